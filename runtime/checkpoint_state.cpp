// runtime/checkpoint_state.cpp — the optimizer state for checkpoints
// (notes/09), in the canonical order, which does not depend on N, the stage
// or the bucket size: the runs a rank owns (its update regions, cut at
// parameter boundaries), copied to and from the host, and any range of them
// gathered from their owners with one all-to-all. zero2.cu's reshard_reads
// says which file pieces fill a rank's runs; the files are the trainer's.
// Host code.
#include "runtime/engine_state.h"

#include <algorithm>
#include <climits>

namespace z2 {

// A checkpoint holds the optimizer state in the canonical order, which does
// not depend on N, the stage or the bucket size: loading it at another N or
// stage is a re-slice, not a conversion. A rank's own state lies in its
// region of each bucket (the whole bucket in stage 0, its shard in stages 1
// and 2); each region, cut at parameter boundaries (the padding between
// parameters holds no state), gives the runs below, in canonical order.
namespace {
struct LocatedRun {
  StateRun run;
  size_t padded = 0;  // where the run starts in the padded flat buffer (fp32: the master is the parameters)
  size_t stored = 0;  // where it starts in the region-sized buffers: master (mixed), m, v
};

std::vector<LocatedRun> located_runs(const Engine& engine, int rank) {
  const int stage = engine.options().stage;
  const auto& parameters = engine.parameters();
  std::vector<size_t> canonical(parameters.size() + 1, 0);  // real elements before each parameter
  for (size_t p = 0; p < parameters.size(); ++p) canonical[p + 1] = canonical[p] + parameters[p].numel;
  std::vector<LocatedRun> runs;
  for (const BucketInfo& bucket : engine.buckets()) {
    const UpdateRegion region = update_region(bucket, stage, rank);
    const size_t start = region.parameter, length = region.length, stored = region.state;
    for (int p = bucket.first_parameter; p < bucket.end_parameter; ++p) {
      const size_t low = std::max(start, parameters[p].offset);
      const size_t high = std::min(start + length, parameters[p].offset + parameters[p].numel);
      if (low >= high) continue;
      runs.push_back({{canonical[p] + (low - parameters[p].offset), high - low}, low, stored + (low - start)});
    }
  }
  return runs;
}

// The pieces of `runs` that fall in [begin, end): (offset in the runs'
// concatenation, canonical position, length), in order.
struct Piece {
  size_t source = 0, canonical = 0, length = 0;
};
std::vector<Piece> pieces_within(const std::vector<LocatedRun>& runs, size_t begin, size_t end) {
  std::vector<Piece> pieces;
  size_t source = 0;
  for (const LocatedRun& located : runs) {
    const size_t low = std::max(begin, located.run.canonical);
    const size_t high = std::min(end, located.run.canonical + located.run.length);
    if (low < high) pieces.push_back({source + (low - located.run.canonical), low, high - low});
    source += located.run.length;
  }
  return pieces;
}
}  // namespace
std::vector<StateRun> Engine::owned_state_runs(int rank) const {
  require_built("owned_state_runs");
  std::vector<StateRun> runs;
  for (const LocatedRun& located : located_runs(*this, rank)) runs.push_back(located.run);
  return runs;
}

OptimizerState Engine::owned_state_to_host() {
  require_built("owned_state_to_host");
  compute_.synchronize_all();
  const ModelStates s = model_states();
  const std::vector<LocatedRun> runs = located_runs(*this, rank());
  auto to_host = [&](const float* device, size_t count) {
    std::vector<float> values(count);
    compute_.copy(values.data(), device, count * sizeof(float), compute_.compute_stream());
    return values;
  };
  const std::vector<float> exp_avg = to_host(s.exp_avg, s.moment_elements);
  const std::vector<float> exp_avg_sq = to_host(s.exp_avg_sq, s.moment_elements);
  const std::vector<float> master =
      s.mixed() ? to_host(s.master, s.master_elements) : to_host((const float*)s.params, psi_padded());
  compute_.synchronize(compute_.compute_stream());
  OptimizerState state;
  // Sized once: growing run by run would hold the old and the new buffer at
  // once (notes/10, "What a run holds on the host besides the plan").
  size_t total = 0;
  for (const LocatedRun& located : runs) total += located.run.length;
  state.master.reserve(total), state.exp_avg.reserve(total), state.exp_avg_sq.reserve(total);
  for (const LocatedRun& located : runs) {
    const size_t at = s.mixed() ? located.stored : located.padded;
    state.master.insert(state.master.end(), master.begin() + at, master.begin() + at + located.run.length);
    state.exp_avg.insert(state.exp_avg.end(), exp_avg.begin() + located.stored,
                         exp_avg.begin() + located.stored + located.run.length);
    state.exp_avg_sq.insert(state.exp_avg_sq.end(), exp_avg_sq.begin() + located.stored,
                            exp_avg_sq.begin() + located.stored + located.run.length);
  }
  return state;
}

void Engine::owned_state_from_host(const OptimizerState& state) {
  require_built("owned_state_from_host");
  const ModelStates s = model_states();
  const std::vector<LocatedRun> runs = located_runs(*this, rank());
  size_t total = 0;
  for (const LocatedRun& located : runs) total += located.run.length;
  // Agreed: in stages 1 and 2 the other ranks would go on to the all-gather below.
  const bool wrong_size =
      state.master.size() != total || state.exp_avg.size() != total || state.exp_avg_sq.size() != total;
  if (comm_.any_rank(wrong_size))
    usage_error("owned_state_from_host: %zu, %zu, %zu values for the %zu this rank holds (or another rank's differ)",
                state.master.size(), state.exp_avg.size(), state.exp_avg_sq.size(), total);
  compute_.synchronize_all();
  const Stream stream = compute_.compute_stream();
  // Into host copies of the whole buffers (padding keeps its zeros), then back.
  std::vector<float> exp_avg(s.moment_elements), exp_avg_sq(s.moment_elements);
  std::vector<float> master(s.mixed() ? s.master_elements : psi_padded());
  compute_.copy(exp_avg.data(), s.exp_avg, exp_avg.size() * sizeof(float), stream);
  compute_.copy(exp_avg_sq.data(), s.exp_avg_sq, exp_avg_sq.size() * sizeof(float), stream);
  compute_.copy(master.data(), s.mixed() ? (const void*)s.master : (const void*)s.params, master.size() * sizeof(float),
                stream);
  compute_.synchronize(stream);
  size_t from = 0;
  for (const LocatedRun& located : runs) {
    const size_t length = located.run.length;
    std::copy_n(state.master.begin() + from, length, master.begin() + (s.mixed() ? located.stored : located.padded));
    std::copy_n(state.exp_avg.begin() + from, length, exp_avg.begin() + located.stored);
    std::copy_n(state.exp_avg_sq.begin() + from, length, exp_avg_sq.begin() + located.stored);
    from += length;
  }
  compute_.copy(s.exp_avg, exp_avg.data(), exp_avg.size() * sizeof(float), stream);
  compute_.copy(s.exp_avg_sq, exp_avg_sq.data(), exp_avg_sq.size() * sizeof(float), stream);
  if (!s.mixed()) {
    compute_.copy(s.params, master.data(), master.size() * sizeof(float), stream);
    parameters_written();  // ZeRO-Offload: the host's fp32 master follows
  } else {
    compute_.copy(s.master, master.data(), master.size() * sizeof(float), stream);
    // The working copy of the own region is the master rounded, as an update leaves it.
    for (int b = 0; b < (int)buckets_.size(); ++b) {
      const UpdateRegion own = s.region(b);
      const std::vector<float> region(master.begin() + own.state, master.begin() + own.state + own.length);
      const std::vector<uint16_t> working = narrow_bits(region, options_.precision);
      compute_.copy(s.params + own.parameter * s.element, working.data(), working.size() * sizeof(uint16_t), stream);
      compute_.synchronize(stream);  // `working` leaves scope
    }
  }
  compute_.synchronize(stream);
  // Every rank's regions to every rank, as at the end of a step (zero2.cu).
  all_gather_untracked();
}

// Who sends whom which pieces when every rank asks for its own range
// (ranges: [begin, end) of rank q at 2q, 2q + 1): rank s sends rank q the
// pieces of its runs inside q's range, in canonical order; q knows s's runs
// (the layout is the same everywhere) and places them.
namespace {
struct RangeExchange {
  std::vector<int> send_counts, send_offsets, receive_counts, receive_offsets;
  std::vector<std::vector<Piece>> outgoing, incoming;
  size_t sending = 0, receiving = 0;
};

RangeExchange plan_range_exchange(const Engine& engine, const std::vector<long>& ranges, size_t begin, size_t end) {
  const int N = engine.world_size();
  RangeExchange plan;
  plan.send_counts.assign(N, 0), plan.send_offsets.assign(N, 0);
  plan.receive_counts.assign(N, 0), plan.receive_offsets.assign(N, 0);
  plan.outgoing.resize(N), plan.incoming.resize(N);
  const std::vector<LocatedRun> my_runs = located_runs(engine, engine.rank());
  for (int q = 0; q < N; ++q) {
    plan.outgoing[q] = pieces_within(my_runs, (size_t)ranges[2 * q], (size_t)ranges[2 * q + 1]);
    plan.incoming[q] = pieces_within(located_runs(engine, q), begin, end);
    for (const Piece& piece : plan.outgoing[q]) plan.send_counts[q] += (int)piece.length;
    for (const Piece& piece : plan.incoming[q]) plan.receive_counts[q] += (int)piece.length;
    if (q > 0) {
      plan.send_offsets[q] = plan.send_offsets[q - 1] + plan.send_counts[q - 1];
      plan.receive_offsets[q] = plan.receive_offsets[q - 1] + plan.receive_counts[q - 1];
    }
  }
  plan.sending = (size_t)plan.send_offsets[N - 1] + plan.send_counts[N - 1];
  plan.receiving = (size_t)plan.receive_offsets[N - 1] + plan.receive_counts[N - 1];
  return plan;
}

// One tensor of the state through the exchange: this rank's `owned` values
// out, the pieces of its range into `placed` (which starts at `begin`).
void exchange_range(const RangeExchange& plan, MPI_Comm comm, const std::vector<float>& owned,
                    std::vector<float>& placed, size_t begin, const char* name) {
  std::vector<float> packed, arrived(plan.receiving);
  packed.reserve(plan.sending);
  for (const std::vector<Piece>& pieces : plan.outgoing)
    for (const Piece& piece : pieces)
      packed.insert(packed.end(), owned.begin() + piece.source, owned.begin() + piece.source + piece.length);
  MPI_Request request;
  Z2_MPI_CHECK(MPI_Ialltoallv(packed.data(), plan.send_counts.data(), plan.send_offsets.data(), MPI_FLOAT,
                              arrived.data(), plan.receive_counts.data(), plan.receive_offsets.data(), MPI_FLOAT, comm,
                              &request));
  wait_request(&request, std::string("the all-to-all of the checkpoint's ") + name);
  size_t at = 0;
  for (const std::vector<Piece>& pieces : plan.incoming)
    for (const Piece& piece : pieces) {
      std::copy_n(arrived.begin() + at, piece.length, placed.begin() + (piece.canonical - begin));
      at += piece.length;
    }
}

}  // namespace

OptimizerState Engine::state_range_to_host(size_t begin, size_t end) {
  require_built("state_range_to_host");
  const int N = comm_.world_size(), me = rank();
  const bool sharded = options_.stage != 0 && N > 1;
  // Each rank asks for its own range. Where the ranks then exchange pieces,
  // every rank checks every rank's range (below), so that all refuse
  // together; one refusing alone would leave the others in the all-to-all.
  std::vector<long> ranges(2 * (size_t)N);
  if (sharded) {
    long mine[2] = {(long)begin, (long)end};
    MPI_Request gathered;
    Z2_MPI_CHECK(MPI_Iallgather(mine, 2, MPI_LONG, ranges.data(), 2, MPI_LONG, comm_.mpi(), &gathered));
    wait_request(&gathered, "the all-gather of the ranges each rank asks for");
    for (int q = 0; q < N; ++q)
      if (ranges[2 * q] > ranges[2 * q + 1] || ranges[2 * q + 1] > (long)psi())
        usage_error("state_range_to_host: rank %d asks for [%ld, %ld) of %zu", q, ranges[2 * q], ranges[2 * q + 1],
                    psi());
  } else if (begin > end || end > psi()) {
    usage_error("state_range_to_host: [%zu, %zu) of %zu", begin, end, psi());
  }
  const OptimizerState own = owned_state_to_host();
  OptimizerState range;
  range.master.assign(end - begin, 0.0f);
  range.exp_avg.assign(end - begin, 0.0f);
  range.exp_avg_sq.assign(end - begin, 0.0f);
  if (!sharded) {  // this rank holds every run
    for (const Piece& piece : pieces_within(located_runs(*this, me), begin, end)) {
      std::copy_n(own.master.begin() + piece.source, piece.length, range.master.begin() + (piece.canonical - begin));
      std::copy_n(own.exp_avg.begin() + piece.source, piece.length, range.exp_avg.begin() + (piece.canonical - begin));
      std::copy_n(own.exp_avg_sq.begin() + piece.source, piece.length,
                  range.exp_avg_sq.begin() + (piece.canonical - begin));
    }
    return range;
  }
  // MPI counts are int. Every rank sees the same ranges and layout, so every
  // rank refuses together, before the all-to-all.
  for (int q = 0; q < N; ++q)
    if (ranges[2 * q + 1] - ranges[2 * q] > INT_MAX || psi_padded() / (size_t)N > (size_t)INT_MAX)
      usage_error(
          "state_range_to_host: more than 2^31 - 1 elements to or from one rank (MPI counts are int): "
          "save with more ranks");
  // Every rank's range (gathered above), then one all-to-all per tensor.
  const RangeExchange plan = plan_range_exchange(*this, ranges, begin, end);
  exchange_range(plan, comm_.mpi(), own.master, range.master, begin, "master weights");
  exchange_range(plan, comm_.mpi(), own.exp_avg, range.exp_avg, begin, "exp_avg");
  exchange_range(plan, comm_.mpi(), own.exp_avg_sq, range.exp_avg_sq, begin, "exp_avg_sq");
  return range;
}

TrainingProgress Engine::training_progress() const {
  return {step_calls_, updates_applied_, skipped_steps_, scaler_.state()};
}

void Engine::restore_training_progress(const TrainingProgress& progress) {
  if (micro_steps_done_ != 0)
    usage_error("restore_training_progress: in the middle of a step (%d micro-steps done)", micro_steps_done_);
  step_calls_ = progress.steps_taken;
  updates_applied_ = progress.applied;
  skipped_steps_ = progress.skipped;
  scaler_.restore(progress.scaler);
  set_watchdog_context("optimizer step " + std::to_string(step_calls_ + 1));
}

}  // namespace z2
