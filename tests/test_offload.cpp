// tests/test_offload.cpp — ZeRO-Offload (EngineOptions::offload_optimizer):
// the optimizer state and step in host memory compute the same bits as on
// the device. In every stage that offloads (1, 2), precision, overlap,
// bucket size, A and N the run equals the run without offload; the ledger
// splits device and host bytes, each equal to its formula worked out by
// hand; a checkpoint saved with offload loads without it and the reverse;
// offload in stage 0 is refused. The planted fault this file catches (the
// host step reading a shard that was never copied down) is in its note.
#include <cmath>

#include <nlohmann/json.hpp>

#include "harness.h"
#include "mlp_model.h"
#include "synthetic_model.h"

using harness::agree;
using harness::same_bits;
using synthetic::MixedRun;

namespace {

// The MLP of tests/test_engine.cpp (3,050 parameters in 6 tensors), fp32,
// with clipping acting and a warmup, so every branch of the step runs.
struct Run {
  std::vector<float> losses, grad_norms, params;
  z2::MemoryLedger memory;
  std::string json;
};

z2::EngineOptions fp32_options(int stage, bool overlap, long bucket, int A, bool offload) {
  z2::EngineOptions options;
  options.stage = stage, options.overlap = overlap, options.bucket_elements = bucket;
  options.accumulation_steps = A;
  options.lr = 3e-3, options.weight_decay = 0.1, options.clip = 0.05;
  options.lr_schedule = [](long step) { return 3e-3 * std::min(1.0, step / 3.0); };
  options.offload_optimizer = offload;
  return options;
}

Run train_mlp(const harness::Backend& backend, const z2::EngineOptions& options, int steps = 4) {
  mlp::Config config;
  config.micro_batch = 8;
  z2::Engine engine(*backend.compute, *backend.deterministic, options);
  mlp::Model model(*backend.compute, engine, config);
  engine.build();
  model.initialize();  // writes parameter() directly: fp32 offload takes its host master from them
  Run run;
  for (int s = 0; s < steps; ++s) {
    const z2::StepReport report = model.train_step(s);
    run.losses.push_back(report.loss);
    run.grad_norms.push_back(report.grad_norm);
  }
  run.params = engine.parameters_to_host();
  run.memory = engine.memory_ledger();
  run.json = engine.ledgers_json();
  return run;
}

bool same_run(const Run& a, const Run& b) {
  return same_bits(a.params, b.params) && same_bits(a.losses, b.losses) && same_bits(a.grad_norms, b.grad_norms);
}

// The synthetic model (tests/synthetic_model.h) in bf16 or fp16: fp16's
// first steps overflow and are skipped, so skips are compared too.
template <class T>
bool mixed_matrix(const harness::Backend& backend, std::string* note) {
  bool ok = true;
  for (int A : {1, 2}) {
    const MixedRun reference = synthetic::train_synthetic<T>(*backend.compute, *backend.deterministic,
                                                             synthetic::mixed_options(2, true, 500, A), 8);
    for (int stage : {1, 2})
      for (bool overlap : {false, true})
        for (long bucket : {64l, 500l}) {
          z2::EngineOptions options = synthetic::mixed_options(stage, overlap, bucket, A);
          options.offload_optimizer = true;
          const MixedRun run = synthetic::train_synthetic<T>(*backend.compute, *backend.deterministic, options, 8);
          if (!run.reduced_ok || !synthetic::same_mixed_run(run, reference)) {
            ok = false;
            *note += " stage " + std::to_string(stage) + " overlap " + std::to_string(overlap) + " bucket " +
                     std::to_string(bucket) + " A " + std::to_string(A) + " differs;";
          }
        }
    if (z2::precision_of<T>() == z2::Precision::fp16 && !(reference.skipped[0] && !reference.skipped.back())) {
      ok = false;
      *note += " fp16 never skipped a step: the skip comparison proves nothing;";
    }
  }
  return ok;
}

}  // namespace

TEST_CASE("offload, fp32: stages 1 and 2 x overlap x bucket sizes x A give the bits of the run without offload") {
  for (const auto& backend : harness::backends())
    for (int A : {1, 3}) {
      const Run reference = train_mlp(backend, fp32_options(0, false, 256, A, false));
      for (int stage : {1, 2})
        for (bool overlap : {false, true})
          for (long bucket : {256l, 1024l, 1l << 20}) {
            const Run run = train_mlp(backend, fp32_options(stage, overlap, bucket, A, true));
            CHECK_MESSAGE(agree(same_run(run, reference), backend.name + ": fp32 offload run differs"), backend.name,
                          " stage ", stage, " overlap ", overlap, " bucket ", bucket, " A ", A);
          }
    }
}

TEST_CASE("offload, bf16 and fp16: the bits of the run without offload, the same fp16 steps skipped") {
  for (const auto& backend : harness::backends()) {
    std::string note;
    CHECK_MESSAGE(agree(mixed_matrix<z2::bfloat16>(backend, &note), backend.name + ": bf16 offload:" + note),
                  backend.name, note);
    note.clear();
    CHECK_MESSAGE(agree(mixed_matrix<z2::float16>(backend, &note), backend.name + ": fp16 offload:" + note),
                  backend.name, note);
  }
}

// The host's threads: each owns a contiguous run of whole norm chunks, so
// no thread's count can change a bit. K = 3 splits unevenly (the MLP's
// regions are 32, 50 and 16 chunks at N = 1, half that at N = 2), and K = 5
// at N = 4 meets regions of 4 chunks, where a thread gets none. Planted
// (notes/13 says how): a thread that stops one chunk short, or one that runs
// one chunk into its neighbour's, fails here at every K > 1.
TEST_CASE("offload, host threads: K = 1, 2, 3, 5 give the bits of the run without offload, fp32 and bf16, stages 1, 2") {
  for (const auto& backend : harness::backends()) {
    const Run reference = train_mlp(backend, fp32_options(2, true, 1024, 2, false));
    const MixedRun mixed_reference = synthetic::train_synthetic<z2::bfloat16>(
        *backend.compute, *backend.deterministic, synthetic::mixed_options(2, true, 500, 2), 6);
    for (int stage : {1, 2})
      for (int threads : {1, 2, 3, 5}) {
        z2::EngineOptions options = fp32_options(stage, true, 1024, 2, true);
        options.host_threads = threads;
        const Run run = train_mlp(backend, options);
        CHECK_MESSAGE(agree(same_run(run, reference), backend.name + ": fp32 offload differs with host threads"),
                      backend.name, " stage ", stage, " threads ", threads);
        z2::EngineOptions mixed = synthetic::mixed_options(stage, true, 500, 2);
        mixed.offload_optimizer = true, mixed.host_threads = threads;
        const MixedRun mixed_run =
            synthetic::train_synthetic<z2::bfloat16>(*backend.compute, *backend.deterministic, mixed, 6);
        CHECK_MESSAGE(agree(synthetic::same_mixed_run(mixed_run, mixed_reference) && mixed_run.reduced_ok &&
                                backend.compute->host_threads() == threads,
                            backend.name + ": bf16 offload differs with host threads"),
                      backend.name, " stage ", stage, " threads ", threads);
      }
  }
}

TEST_CASE("offload, world-size invariance: (N, A) = (1,4), (2,2), (4,1) with offload equal (1,4) without") {
  // As in test_engine.cpp: each pair on ranks [0, N) of this job (with
  // mpirun -n 2 the first two pairs, with -n 1 the first); rank 0 compares.
  const int pairs[][2] = {{1, 4}, {2, 2}, {4, 1}};
  std::vector<Run> references, runs;  // references[k]: backend k at (1, 4), stage 2, no offload
  std::vector<size_t> backend_of;
  bool finished = true;
  const size_t backend_count = harness::sub_world(1).size();
  for (size_t k = 0; k < backend_count; ++k) {
    if (harness::rank() == 0)
      references.push_back(train_mlp(harness::sub_world(1)[k], fp32_options(2, true, 2048, 4, false)));
    for (int stage : {1, 2})
      for (auto& pair : pairs) {
        const auto& world = harness::sub_world(pair[0]);
        if (!world.empty() && world[k].deterministic) {
          const std::string label = world[k].name + " offload stage " + std::to_string(stage) +
                                    " N=" + std::to_string(pair[0]) + " A=" + std::to_string(pair[1]);
          finished &= harness::completes(
              [&] {
                runs.push_back(train_mlp(world[k], fp32_options(stage, true, 2048, pair[1], true)));
                backend_of.push_back(k);
              },
              label);
        }
        MPI_Barrier(MPI_COMM_WORLD);
      }
  }
  bool equal = agree(finished, "an offload world-size run did not finish");
  if (equal && harness::rank() == 0) {
    equal = runs.size() == backend_count * 2 * (harness::world_size() >= 4 ? 3 : harness::world_size() >= 2 ? 2 : 1);
    for (size_t i = 0; i < runs.size(); ++i)
      if (!same_run(runs[i], references[backend_of[i]])) {
        fprintf(stderr, "[test] offload world-size run %zu differs from its backend's run without offload\n", i);
        equal = false;
      }
  }
  CHECK(harness::from_rank0(equal));
}

TEST_CASE("offload ledger: the device keeps the working parameters (stage 1 also its gradient), the host 16 Psi/N") {
  for (const auto& backend : harness::backends()) {
    const size_t N = backend.deterministic->world_size();
    // Psi_padded of the MLP with 2,048-element buckets, worked out by hand in
    // tests/test_engine.cpp (psi_padded_by_hand): 3,136 at N = 1, 2; 3,200 at 4.
    const size_t psi = N == 4 ? 3200 : 3136, shard = psi / N;
    for (int stage : {1, 2}) {
      const Run run = train_mlp(backend, fp32_options(stage, true, 2048, 1, true), 2);
      const z2::MemoryLedger& m = run.memory;
      // fp32: device 4 Psi of parameters (+ 4 Psi of gradient in stage 1);
      // host: master copy 4 Psi/N, m and v 8 Psi/N, the reduced shard 4 Psi/N.
      const size_t device = stage == 1 ? 8 * psi : 4 * psi;
      const bool ok = m.offload_optimizer && m.model_states == device && m.model_states_formula == device &&
                      m.master == 0 && m.optimizer == 0 && m.grads == (stage == 1 ? 4 * psi : 0) &&
                      m.params == 4 * psi && m.host_master == 4 * shard && m.host_optimizer == 8 * shard &&
                      m.host_grads == 4 * shard && m.host_params == 0 && m.host_model_states == 16 * shard &&
                      m.host_model_states_formula == 16 * shard && m.host_bookkeeping > 0 &&
                      m.device_allocations_after_step1 == 0;
      CHECK_MESSAGE(agree(ok, backend.name + ": fp32 offload ledger differs"), backend.name, " stage ", stage,
                    " device ", m.model_states, " host ", m.host_model_states);
      const nlohmann::json json = nlohmann::json::parse(run.json)["memory"];
      CHECK(agree(json["offload_optimizer"] == true && json["host_model_states_bytes"] == 16 * shard &&
                      json["host_model_states_formula_bytes"] == 16 * shard && json["model_states_bytes"] == device,
                  "offload ledger JSON differs"));
      // bf16: device 2 Psi (+ 2 Psi); host master 4, m and v 8, the 16-bit
      // reduced shard 2 and the 16-bit updated shard going up 2: 16 Psi/N.
      z2::EngineOptions options = synthetic::mixed_options(stage, true, 1 << 20);
      options.offload_optimizer = true;
      const z2::MemoryLedger b =
          synthetic::train_synthetic<z2::bfloat16>(*backend.compute, *backend.deterministic, options, 2).memory;
      // The synthetic model: 700 + 45 + 333 elements, each rounded up to 32
      // (704, 64, 352 = 1,120), one bucket padded to a multiple of 32 N.
      const size_t psi16 = (1120 + 32 * N - 1) / (32 * N) * (32 * N), shard16 = psi16 / N;
      const bool ok16 = b.model_states == (stage == 1 ? 4 : 2) * psi16 && b.model_states_formula == b.model_states &&
                        b.host_master == 4 * shard16 && b.host_optimizer == 8 * shard16 &&
                        b.host_grads == 2 * shard16 && b.host_params == 2 * shard16 &&
                        b.host_model_states == 16 * shard16 && b.host_model_states_formula == 16 * shard16;
      CHECK_MESSAGE(agree(ok16, backend.name + ": bf16 offload ledger differs"), backend.name, " stage ", stage,
                    " device ", b.model_states, " host ", b.host_model_states);
    }
    // Without offload the host column is empty.
    const Run plain = train_mlp(backend, fp32_options(2, true, 2048, 1, false), 1);
    CHECK(agree(!plain.memory.offload_optimizer && plain.memory.host_model_states == 0 &&
                plain.memory.host_model_states_formula == 0 && plain.memory.host_bookkeeping == 0));
  }
}

TEST_CASE("offload checkpoints: saved with offload, loaded without, and the reverse: the bits of never stopping") {
  for (const auto& backend : harness::backends())
    for (int stage : {1, 2}) {
      z2::EngineOptions plain = synthetic::mixed_options(stage, true, 500), offloaded = plain;
      offloaded.offload_optimizer = true;
      const MixedRun straight =
          synthetic::train_synthetic<z2::bfloat16>(*backend.compute, *backend.deterministic, plain, 6);
      for (bool save_offloaded : {true, false}) {
        synthetic::Checkpoint checkpoint;
        synthetic::CheckpointHooks save{3, &checkpoint, nullptr}, load{0, nullptr, &checkpoint};
        synthetic::train_synthetic<z2::bfloat16>(*backend.compute, *backend.deterministic,
                                                 save_offloaded ? offloaded : plain, 3, nullptr,
                                                 synthetic::synthetic_gradient, save);
        const MixedRun resumed = synthetic::train_synthetic<z2::bfloat16>(*backend.compute, *backend.deterministic,
                                                                          save_offloaded ? plain : offloaded, 6,
                                                                          nullptr, synthetic::synthetic_gradient, load);
        CHECK_MESSAGE(agree(same_bits(resumed.master, straight.master) && same_bits(resumed.working, straight.working),
                            backend.name + ": offload checkpoint round trip differs"),
                      backend.name, " stage ", stage, " saved with offload ", save_offloaded);
      }
      // fp32, both ways: the host's master copy must follow a checkpoint loaded into the parameters.
      z2::EngineOptions fp32 = fp32_options(stage, true, 1024, 1, false), fp32_offloaded = fp32;
      fp32_offloaded.offload_optimizer = true;
      const MixedRun fp32_straight =
          synthetic::train_synthetic<float>(*backend.compute, *backend.deterministic, fp32, 6);
      for (bool save_offloaded : {true, false}) {
        synthetic::Checkpoint checkpoint;
        synthetic::train_synthetic<float>(*backend.compute, *backend.deterministic,
                                          save_offloaded ? fp32_offloaded : fp32, 3, nullptr,
                                          synthetic::synthetic_gradient, {3, &checkpoint, nullptr});
        const MixedRun fp32_resumed = synthetic::train_synthetic<float>(
            *backend.compute, *backend.deterministic, save_offloaded ? fp32 : fp32_offloaded, 6, nullptr,
            synthetic::synthetic_gradient, {0, nullptr, &checkpoint});
        CHECK_MESSAGE(agree(same_bits(fp32_resumed.master, fp32_straight.master),
                            backend.name + ": fp32 offload checkpoint round trip differs"),
                      backend.name, " stage ", stage, " saved with offload ", save_offloaded);
      }
    }
}

TEST_CASE("offload, fp32: parameters and optimizer state set between steps reach the host's master copy") {
  for (const auto& backend : harness::backends())
    for (int stage : {1, 2}) {
      std::vector<std::vector<float>> finals;
      for (bool offload : {false, true}) {
        mlp::Config config;
        config.micro_batch = 8;
        z2::Engine engine(*backend.compute, *backend.deterministic, fp32_options(stage, true, 1024, 1, offload));
        mlp::Model model(*backend.compute, engine, config);
        engine.build();
        model.initialize();
        for (int s = 0; s < 2; ++s) model.train_step(s);
        std::vector<float> halved = engine.parameters_to_host();
        for (float& value : halved) value *= 0.5f;  // exact
        engine.parameters_from_host(halved);        // after step 2: the host master must follow
        for (int s = 2; s < 4; ++s) model.train_step(s);
        // A checkpoint's state loaded after step 4 (its master doubled back): the same must hold.
        z2::OptimizerState state = engine.owned_state_to_host();
        for (float& value : state.master) value *= 2.0f;
        engine.owned_state_from_host(state);
        for (int s = 4; s < 6; ++s) model.train_step(s);
        finals.push_back(engine.parameters_to_host());
      }
      CHECK_MESSAGE(agree(same_bits(finals[0], finals[1]),
                          backend.name + ": parameters or state set between steps lost with offload"),
                    backend.name, " stage ", stage);
    }
}

TEST_CASE("offload bad input: stage 0 is refused on every rank, with the reason") {
  for (const auto& backend : harness::backends()) {
    z2::EngineOptions options;
    options.stage = 0;
    options.offload_optimizer = true;
    CHECK_THROWS_WITH_AS(z2::Engine(*backend.compute, *backend.deterministic, options),
                         doctest::Contains("offloading the optimizer needs ZeRO stage 1 or 2"), z2::Error);
    options.stage = 2, options.host_threads = -1;
    CHECK_THROWS_WITH_AS(z2::Engine(*backend.compute, *backend.deterministic, options),
                         doctest::Contains("host threads must be 0 (this rank's share of the node's cores) or 1 to "
                                           "1024 (got -1)"),
                         z2::Error);
  }
}
