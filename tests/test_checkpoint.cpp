// tests/test_checkpoint.cpp — the engine's side of checkpoints (notes/09),
// in process, on the synthetic model of tests/synthetic_model.h:
//   1. the runs of optimizer state a rank owns partition the canonical order
//      (each element once over the ranks in stages 1 and 2; all of it on
//      every rank in stage 0), counted element by element;
//   2. state_range_to_host gives, for any range, the bits a stage-0 run
//      holds locally (the all-to-all that sends each piece where it goes);
//   3. resume and reshard: the state saved after K steps at (N, A, stage),
//      loaded at (N', A', stage') with N'A' = NA, continues to the same bits
//      as the run that never stopped, in fp32, bf16 and fp16 (with skipped
//      steps and scale changes after K).
// The trainer's files, index and damaged checkpoints are tested through the
// command line (tests/cli/checkpoints.sh).
#include <algorithm>
#include <cstring>

#include "harness.h"
#include "synthetic_model.h"

using harness::agree;
using harness::same_bits;
using synthetic::Checkpoint;
using synthetic::CheckpointHooks;
using synthetic::mixed_options;
using synthetic::MixedRun;
using synthetic::synthetic_sizes;
using synthetic::train_synthetic;

namespace {

// fp16 with a scale that doubles after 2 clean steps from 2^14 and halves on
// the first overflow: it overflows (and skips) every few steps throughout.
z2::EngineOptions resume_options(int stage, int A, long bucket = 500) {
  z2::EngineOptions options = mixed_options(stage, true, bucket, A);
  options.loss_scaling.initial_scale_power = 14;
  options.loss_scaling.window = 2;
  options.loss_scaling.hysteresis = 1;
  return options;
}

size_t synthetic_psi() {
  size_t psi = 0;
  for (size_t size : synthetic_sizes) psi += size;
  return psi;
}

// An engine with the synthetic model's parameters, built, nothing trained.
std::unique_ptr<z2::Engine> built_engine(const harness::Backend& backend, int stage, long bucket) {
  auto engine =
      std::make_unique<z2::Engine>(*backend.compute, *backend.deterministic, mixed_options(stage, true, bucket));
  for (int p = 0; p < 3; ++p) engine->add_parameter("p" + std::to_string(p), synthetic_sizes[p], true);
  engine->build();
  return engine;
}

// Element k's owners over ranks [0, N): `counts[k]` ranks list it; runs are
// in canonical order and do not overlap.
bool runs_partition(const z2::Engine& engine, int N, int stage, std::string* note) {
  std::vector<int> counts(engine.psi(), 0);
  for (int rank = 0; rank < N; ++rank) {
    size_t previous_end = 0;
    for (const z2::StateRun& run : engine.owned_state_runs(rank)) {
      if (run.canonical < previous_end || run.canonical + run.length > engine.psi() || run.length == 0) {
        *note = "rank " + std::to_string(rank) + ": a run out of order, empty or beyond Psi";
        return false;
      }
      previous_end = run.canonical + run.length;
      for (size_t k = run.canonical; k < previous_end; ++k) ++counts[k];
    }
  }
  const int expected = stage == 0 ? N : 1;  // stage 0 replicates the state (section 5.1 saves exactly this)
  for (size_t k = 0; k < counts.size(); ++k)
    if (counts[k] != expected) {
      *note = "element " + std::to_string(k) + " has " + std::to_string(counts[k]) + " owners, want " +
              std::to_string(expected);
      return false;
    }
  return true;
}

}  // namespace

TEST_CASE("checkpoint runs: each element's optimizer state has one owner in stages 1 and 2, every rank in stage 0") {
  for (int N : {1, 2, 4}) {
    const auto& world = harness::sub_world(N);
    if (world.empty()) continue;
    for (const harness::Backend& backend : world) {
      bool ok = true;
      std::string note;
      if (backend.deterministic)
        for (int stage : {0, 1, 2})
          for (long bucket : {64l, 500l, 1l << 20}) {
            const std::string where = "stage " + std::to_string(stage) + " bucket " + std::to_string(bucket);
            const bool finished = harness::completes(
                [&] {
                  auto engine = built_engine(backend, stage, bucket);
                  if (!runs_partition(*engine, N, stage, &note)) ok = false, note = where + ": " + note;
                },
                where);
            ok = ok && finished;
          }
      CHECK_MESSAGE(agree(ok, backend.name + " N=" + std::to_string(N) + ": " + note), backend.name, " N=", N);
    }
  }
}

namespace {

// Rank r asks for a range that straddles buckets and shards (and one rank
// an empty one); every range must hold the bits a stage-0 run keeps locally.
template <class T>
bool ranges_match_stage0(const harness::Backend& backend, std::string* note) {
  const size_t psi = synthetic_psi();
  const int N = backend.deterministic->world_size(), rank = backend.deterministic->rank();
  Checkpoint reference, saved;
  train_synthetic<T>(*backend.compute, *backend.deterministic, resume_options(0, 1), 4, nullptr,
                     synthetic::synthetic_gradient, CheckpointHooks{4, &reference, nullptr});
  bool ok = true;
  for (int stage : {1, 2}) {
    // The gathered state (every rank's contiguous range, then all of them).
    train_synthetic<T>(*backend.compute, *backend.deterministic, resume_options(stage, 1, 64), 4, nullptr,
                       synthetic::synthetic_gradient, CheckpointHooks{4, &saved, nullptr});
    ok &= same_bits(saved.state.master, reference.state.master) &&
          same_bits(saved.state.exp_avg, reference.state.exp_avg) &&
          same_bits(saved.state.exp_avg_sq, reference.state.exp_avg_sq);
    if (!ok) *note = "stage " + std::to_string(stage) + ": the gathered state differs from stage 0's";
  }
  // Odd ranges, asked directly of a stage-2 engine trained the same way.
  z2::Engine engine(*backend.compute, *backend.deterministic, [] {
    z2::EngineOptions options = resume_options(2, 1, 64);
    options.precision = z2::precision_of<T>();
    return options;
  }());
  for (int p = 0; p < 3; ++p) engine.add_parameter("p" + std::to_string(p), synthetic_sizes[p], true);
  engine.build();
  synthetic::load_checkpoint(engine, reference);
  const size_t begin = rank == N - 1 && N > 1 ? 300 : (size_t)(37 + 211 * rank) % psi;
  const size_t end = rank == N - 1 && N > 1 ? 300 : std::min(psi, begin + 517);
  const z2::OptimizerState range = engine.state_range_to_host(begin, end);
  auto slice = [&](const std::vector<float>& whole) {
    return std::vector<float>(whole.begin() + begin, whole.begin() + end);
  };
  if (!same_bits(range.master, slice(reference.state.master)) ||
      !same_bits(range.exp_avg, slice(reference.state.exp_avg)) ||
      !same_bits(range.exp_avg_sq, slice(reference.state.exp_avg_sq))) {
    ok = false;
    *note = "the range [" + std::to_string(begin) + ", " + std::to_string(end) + ") differs";
  }
  // And the state moved: a test of zeros would pass anything.
  if (!std::any_of(reference.state.exp_avg_sq.begin(), reference.state.exp_avg_sq.end(), [](float v) { return v > 0; }))
    ok = false, *note = "no update was applied: every exp_avg_sq is 0";
  return ok;
}

}  // namespace

TEST_CASE("checkpoint ranges: any range of the canonical order, gathered from the owners, has stage 0's bits") {
  for (const harness::Backend& backend : harness::backends()) {
    for (int precision = 0; precision < 3; ++precision) {
      std::string note;
      const bool ok = precision == 0   ? ranges_match_stage0<float>(backend, &note)
                      : precision == 1 ? ranges_match_stage0<z2::bfloat16>(backend, &note)
                                       : ranges_match_stage0<z2::float16>(backend, &note);
      CHECK_MESSAGE(agree(ok, backend.name + ": " + note), backend.name, " precision ", precision);
    }
  }
}

namespace {

constexpr int resume_steps = 10, save_after = 5;

// The checkpoint from world rank 0 (in every sub-world) to every rank of
// the job: the saving and the loading world need not be the same ranks.
void broadcast_checkpoint(Checkpoint& checkpoint) {
  const size_t psi = synthetic_psi();
  for (std::vector<float>* tensor :
       {&checkpoint.state.master, &checkpoint.state.exp_avg, &checkpoint.state.exp_avg_sq}) {
    tensor->resize(psi);
    MPI_Bcast(tensor->data(), (int)psi, MPI_FLOAT, 0, MPI_COMM_WORLD);
  }
  long numbers[5] = {checkpoint.progress.steps_taken, checkpoint.progress.applied, checkpoint.progress.skipped,
                     checkpoint.progress.scaler.iteration, checkpoint.progress.scaler.last_overflow};
  MPI_Bcast(numbers, 5, MPI_LONG, 0, MPI_COMM_WORLD);
  MPI_Bcast(&checkpoint.progress.scaler.scale, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  MPI_Bcast(&checkpoint.progress.scaler.hysteresis_left, 1, MPI_INT, 0, MPI_COMM_WORLD);
  checkpoint.progress.steps_taken = numbers[0], checkpoint.progress.applied = numbers[1];
  checkpoint.progress.skipped = numbers[2], checkpoint.progress.scaler.iteration = numbers[3];
  checkpoint.progress.scaler.last_overflow = numbers[4];
}

struct Layout {
  int N, A, stage;
  std::string text() const {
    return "(N, A, stage) = (" + std::to_string(N) + ", " + std::to_string(A) + ", " + std::to_string(stage) + ")";
  }
};

template <class T>
bool resumes_match(size_t backend_index, std::string* note) {
  // The run that never stopped, at (1, 4, 0) on rank 0.
  MixedRun straight;
  const auto& one = harness::sub_world(1);
  if (one[backend_index].deterministic)
    straight = train_synthetic<T>(*one[backend_index].compute, *one[backend_index].deterministic, resume_options(0, 4),
                                  resume_steps);
  const std::pair<Layout, Layout> pairs[] = {{{4, 1, 2}, {2, 2, 1}}, {{4, 1, 2}, {1, 4, 0}}, {{1, 4, 0}, {4, 1, 2}},
                                             {{2, 2, 2}, {2, 2, 2}}, {{2, 2, 0}, {4, 1, 1}}, {{1, 4, 1}, {1, 4, 2}},
                                             {{1, 4, 2}, {1, 4, 0}}};
  bool ok = true;
  int compared = 0;
  for (const auto& [save, load] : pairs) {
    const auto& save_world = harness::sub_world(save.N);
    const auto& load_world = harness::sub_world(load.N);
    if (save_world.empty() || load_world.empty()) continue;  // the job is smaller than the pair
    Checkpoint checkpoint;
    if (save_world[backend_index].deterministic)
      train_synthetic<T>(*save_world[backend_index].compute, *save_world[backend_index].deterministic,
                         resume_options(save.stage, save.A), save_after, nullptr, synthetic::synthetic_gradient,
                         CheckpointHooks{save_after, &checkpoint, nullptr});
    broadcast_checkpoint(checkpoint);
    MixedRun resumed;
    if (load_world[backend_index].deterministic)
      resumed = train_synthetic<T>(*load_world[backend_index].compute, *load_world[backend_index].deterministic,
                                   resume_options(load.stage, load.A), resume_steps, nullptr,
                                   synthetic::synthetic_gradient, CheckpointHooks{0, nullptr, &checkpoint});
    MPI_Barrier(MPI_COMM_WORLD);
    if (harness::rank() != 0) continue;
    ++compared;
    // The resumed run's steps are the straight run's last ones.
    auto tail = [](const auto& values) {
      return std::decay_t<decltype(values)>(values.end() - (resume_steps - save_after), values.end());
    };
    const bool same = same_bits(resumed.master, straight.master) && same_bits(resumed.working, straight.working) &&
                      same_bits(resumed.grad_norms, tail(straight.grad_norms)) &&
                      resumed.scales == tail(straight.scales) && resumed.skipped == tail(straight.skipped) &&
                      resumed.applied == tail(straight.applied);
    if (!same) {
      ok = false;
      *note += " saved at " + save.text() + ", loaded at " + load.text() + ": differs;";
    }
  }
  if (harness::rank() == 0) {
    // Something to compare at every world size, and in fp16 the resumed
    // part holds skipped steps and scale changes (else the scaler's state
    // would not be tested).
    if (compared == 0) ok = false, *note += " no pair ran;";
    if (z2::precision_of<T>() == z2::Precision::fp16) {
      const auto first = straight.skipped.begin() + save_after;
      const bool skips = std::count(first, straight.skipped.end(), 1) > 0;
      const bool changes = std::adjacent_find(straight.scales.begin() + save_after - 1, straight.scales.end(),
                                              std::not_equal_to<double>()) != straight.scales.end();
      if (!skips || !changes) ok = false, *note += " the fp16 run has no skip or no scale change after step K;";
    }
  }
  return harness::from_rank0(ok);
}

}  // namespace

TEST_CASE("resume and reshard: saved at (N, A, stage), loaded at (N', A', stage'), the same bits as never stopping") {
  for (size_t k = 0; k < harness::sub_world(1).size(); ++k) {
    std::string note;
    const std::string name = harness::sub_world(1)[k].name;
    CHECK_MESSAGE(resumes_match<float>(k, &note), name, " fp32:", note);
    note.clear();
    CHECK_MESSAGE(resumes_match<z2::bfloat16>(k, &note), name, " bf16:", note);
    note.clear();
    CHECK_MESSAGE(resumes_match<z2::float16>(k, &note), name, " fp16:", note);
  }
}
