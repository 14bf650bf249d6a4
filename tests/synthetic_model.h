// tests/synthetic_model.h — a synthetic model for the engine in every
// precision (tests/test_precision.cpp, tests/test_checkpoint.cpp): its
// gradients are computed on the host from the working parameters, so any
// rank can compute any rank's, and a test can plant an overflow.
#pragma once

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "harness.h"

namespace synthetic {

using harness::recursive_tree_sum;
using harness::same_bits;
using harness::same_float_bits;
using harness::test_value;

// Three parameters (weight decay on the first and last). The "backward" of
// global micro-batch m writes, for every element,
//   g = S x (c_m w + d_m(i)),  rounded to 16 bits,
// with w the working parameter (so the gradient depends on every earlier
// update: a stage that updated or gathered a wrong value diverges), c_m and
// d_m(i) fixed by (step, m, i), and S the engine's loss scale (fp16).
constexpr size_t synthetic_sizes[] = {700, 45, 333};
constexpr bool synthetic_decay[] = {true, false, true};

inline float synthetic_gradient(float w, long step, long m, size_t i) {
  return (0.25f + 0.125f * (float)(m % 3)) * w + test_value(600 + step, m, i) / 4.0f;
}

struct MixedRun {
  std::vector<float> master, working, grad_norms, reduced;  // reduced: step 1's gradient where one rank has it all
  std::vector<double> scales, lrs;
  std::vector<long> applied;
  std::vector<char> skipped;
  z2::MemoryLedger memory;
  z2::CommLedger comm;
  bool reduced_ok = true;  // step 1's reduced gradient = the fp32 tree of the leaves, rounded once
};

// `plant(step, m)`: an element index to overwrite with +inf in micro-batch m's
// gradient, or -1. `gradient` replaces synthetic_gradient.
using GradientFunction = std::function<float(float w, long step, long m, size_t k)>;
// An in-process checkpoint: the whole optimizer state in canonical order
// and the progress, as tests/test_checkpoint.cpp passes it between worlds.
struct Checkpoint {
  z2::OptimizerState state;  // [Psi] each
  z2::TrainingProgress progress;
};
// Save after `save_after` steps into `*save` (every rank of `comm` gets it),
// or start from `*load` instead of the initial values.
struct CheckpointHooks {
  int save_after = 0;
  Checkpoint* save = nullptr;
  const Checkpoint* load = nullptr;
};
// The state a file-per-rank checkpoint holds, gathered: each rank asks for
// its contiguous range [r Psi / N, (r + 1) Psi / N) (state_range_to_host),
// then every rank gets every range (what reading all the files gives).
inline Checkpoint gather_checkpoint(z2::Engine& engine, z2::Communicator& comm) {
  const int N = comm.world_size(), rank = comm.rank();
  const size_t psi = engine.psi();
  const size_t begin = psi * rank / N, end = psi * (rank + 1) / N;
  const z2::OptimizerState mine = engine.state_range_to_host(begin, end);
  std::vector<int> counts(N), offsets(N);
  for (int r = 0; r < N; ++r) offsets[r] = (int)(psi * r / N), counts[r] = (int)(psi * (r + 1) / N - psi * r / N);
  Checkpoint checkpoint;
  checkpoint.progress = engine.training_progress();
  auto gather = [&](const std::vector<float>& part, std::vector<float>& whole) {
    whole.assign(psi, 0.0f);
    MPI_Allgatherv(part.data(), (int)part.size(), MPI_FLOAT, whole.data(), counts.data(), offsets.data(), MPI_FLOAT,
                   comm.mpi());
  };
  gather(mine.master, checkpoint.state.master);
  gather(mine.exp_avg, checkpoint.state.exp_avg);
  gather(mine.exp_avg_sq, checkpoint.state.exp_avg_sq);
  return checkpoint;
}
// Loading: this rank takes the pieces of its own runs (owned_state_runs).
inline void load_checkpoint(z2::Engine& engine, const Checkpoint& checkpoint) {
  z2::OptimizerState own;
  for (const z2::StateRun& run : engine.owned_state_runs(engine.rank())) {
    auto take = [&](const std::vector<float>& whole, std::vector<float>& part) {
      part.insert(part.end(), whole.begin() + run.canonical, whole.begin() + run.canonical + run.length);
    };
    take(checkpoint.state.master, own.master);
    take(checkpoint.state.exp_avg, own.exp_avg);
    take(checkpoint.state.exp_avg_sq, own.exp_avg_sq);
  }
  engine.owned_state_from_host(own);
  engine.restore_training_progress(checkpoint.progress);
}

template <class T>
MixedRun train_synthetic(z2::Compute& compute, z2::Communicator& comm, z2::EngineOptions options, int steps,
                         std::function<long(long step, long m)> plant = nullptr,
                         GradientFunction gradient = synthetic_gradient, CheckpointHooks hooks = {}) {
  options.precision = z2::precision_of<T>();
  z2::Engine engine(compute, comm, options);
  std::vector<z2::ParameterId> ids;
  for (int p = 0; p < 3; ++p)
    ids.push_back(engine.add_parameter("p" + std::to_string(p), synthetic_sizes[p], synthetic_decay[p]));
  engine.build();
  std::vector<float> initial;
  for (int p = 0; p < 3; ++p)
    for (size_t i = 0; i < synthetic_sizes[p]; ++i) initial.push_back(test_value(99, p, i) / 4.0f);
  engine.parameters_from_host(initial);
  if (hooks.load) load_checkpoint(engine, *hooks.load);  // every value above replaced
  const int N = comm.world_size(), A = options.accumulation_steps;
  MixedRun run;
  for (int step = (int)engine.training_progress().steps_taken + 1; step <= steps; ++step) {
    const std::vector<float> working = engine.working_parameters_to_host();
    const float scale = engine.loss_scale();
    // Micro-batch m's 16-bit gradient at canonical element k (any rank can
    // compute any rank's: the working parameters are the same everywhere).
    auto leaf = [&](long m, size_t k) {
      float g = gradient(working[k], step, m, k) * scale;
      if (plant && plant(step, m) == (long)k) g = INFINITY;
      return z2::to_float(z2::from_float<T>(g));
    };
    for (int a = 0; a < A; ++a) {
      const long m = engine.micro_batch_index(a);
      for (int p = 2; p >= 0; --p) {  // backward order: the last parameter first
        size_t first = 0;
        for (int q = 0; q < p; ++q) first += synthetic_sizes[q];
        std::vector<T> g(synthetic_sizes[p]);
        for (size_t i = 0; i < g.size(); ++i) g[i] = z2::from_float<T>(leaf(m, first + i));
        compute.copy(engine.gradient_output_as<T>(ids[p]), g.data(), g.size() * sizeof(T), compute.compute_stream());
        compute.synchronize(compute.compute_stream());
        engine.gradient_ready(ids[p]);
      }
      engine.end_micro_step(0.0f);
    }
    if (step == 1) {  // every stage: gradients_to_host gathers the shards of stages 1 and 2
      run.reduced = engine.gradients_to_host();
      std::vector<float> leaves((size_t)N * A);
      for (size_t k = 0; k < run.reduced.size(); ++k) {
        for (long m = 0; m < (long)N * A; ++m) leaves[m] = leaf(m, k);
        const float sum = z2::to_float(z2::from_float<T>(recursive_tree_sum(leaves.data(), (long)N * A))) / scale;
        if (std::isfinite(sum)) run.reduced_ok &= same_float_bits(sum, run.reduced[k]);
        else run.reduced_ok &= !std::isfinite(run.reduced[k]) && std::isnan(sum) == std::isnan(run.reduced[k]);
      }
    }
    z2::StepReport report = engine.step();
    run.grad_norms.push_back(report.grad_norm);
    run.scales.push_back(report.loss_scale);
    run.skipped.push_back(report.skipped);
    run.applied.push_back(report.applied);
    run.lrs.push_back(report.lr);
    if (hooks.save && step == hooks.save_after) *hooks.save = gather_checkpoint(engine, comm);
  }
  run.master = engine.parameters_to_host();
  run.working = engine.working_parameters_to_host();
  run.memory = engine.memory_ledger();
  run.comm = engine.comm_ledger();
  return run;
}

inline z2::EngineOptions mixed_options(int stage, bool overlap, long bucket, int A = 1) {
  z2::EngineOptions options;
  options.stage = stage, options.overlap = overlap, options.bucket_elements = bucket, options.accumulation_steps = A;
  options.lr = 0.02, options.weight_decay = 0.1, options.clip = 4.0;
  options.lr_schedule = [](long t) { return 0.02 * std::min(1.0, t / 3.0); };
  return options;
}

inline bool same_mixed_run(const MixedRun& a, const MixedRun& b) {
  return same_bits(a.master, b.master) && same_bits(a.working, b.working) && same_bits(a.grad_norms, b.grad_norms) &&
         a.scales == b.scales && a.skipped == b.skipped;
}

}  // namespace synthetic
