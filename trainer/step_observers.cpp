// trainer/step_observers.cpp — what watches a training step
// (trainer/step_observers.h), in the order the step meets it.
#include "trainer/step_observers.h"

#include <tuple>

#include "runtime/timeline.h"
#include "trainer/output_files.h"
#include <utility>

namespace bert {

StepObservers::StepObservers(const Settings& settings, MPI_Comm world, z2::Compute& compute, z2::Engine& engine,
                             ObservedModel model, RunRecord& run, ProgressLog& progress, RunTrace* trace)
    : settings_(settings),
      world_(world),
      compute_(compute),
      engine_(engine),
      model_(std::move(model)),
      run_(run),
      progress_(progress),
      trace_(trace) {
  MPI_Comm_rank(world_, &rank_);
  MPI_Comm_size(world_, &world_size_);
  if (!settings_.timeline.empty()) compute_.start_timeline();  // from step 1 on: start-up is not in it
}

void StepObservers::before_forward(long step) {
  start_ = std::chrono::steady_clock::now();
  if (z2::Timeline* timeline = compute_.timeline())  // the step on the host's track, in the timeline's time
    timeline_step_ = timeline->open(z2::Timeline::host_track, "step " + std::to_string(step + 1), timeline->host_now(),
                                    "step");
  gemm_seconds_before_ = compute_.gemm_seconds();
  // This run's first step (a resumed run's too) and step 0 of a fresh run.
  tracing_memory_ = run_.steps.empty() && !settings_.memory_trace.empty();
  dumping_ = step == 0 && !settings_.dump_dir.empty();
  if (tracing_memory_) compute_.set_tracing(true);
  if (dumping_) dump_.weights = engine_.working_parameters_to_host();  // what forward reads (16-bit: as floats)
}

// The step's reduced gradient, before step() clips and applies it
// (collective in stages 1 and 2, where each rank holds its shards of it).
void StepObservers::before_update(long step) {
  if (dumping_ || trace_keeps_parameters_after(settings_, step + 1)) gradients_ = engine_.gradients_to_host();
  optimizer_start_ = std::chrono::steady_clock::now();
}

void StepObservers::after_update(long step, const z2::StepReport& report, const std::vector<float>& losses) {
  const auto end = std::chrono::steady_clock::now();
  if (z2::Timeline* timeline = compute_.timeline()) timeline->close(timeline_step_, timeline->host_now());
  if (tracing_memory_) {
    compute_.set_tracing(false);
    // Rank 0 writes; every rank learns whether it could (a full disk ends them all).
    agree_on_errors(
        world_,
        [&] {
          if (rank_ == 0) write_memory_trace(settings_.memory_trace, compute_.trace());
        },
        "the memory trace was written");
  }
  const double ms = std::chrono::duration<double, std::milli>(end - start_).count();
  run_.steps.push_back({report.step, report.loss, report.grad_norm, report.lr, ms, run_.tokens_per_step / (ms / 1000.0),
                        report.loss_scale, report.skipped});
  StepRecord& record = run_.steps.back();
  record.beta1 = report.beta1, record.beta2 = report.beta2;
  record.gemm_ms = (compute_.gemm_seconds() - gemm_seconds_before_) * 1000.0;
  if (settings_.wall_clock_breakdown) {
    std::tie(record.forward_ms, record.backward_ms) = model_.take_phase_times();
    record.optimizer_ms = std::chrono::duration<double, std::milli>(end - optimizer_start_).count();
  }
  if (diverged(report)) return;
  if (dumping_) {
    // This rank's micro-batches as forward read them (the same hashes drew them).
    for (int a = 0; a < settings_.accum; ++a) {
      const DrawnBatch batch = model_.batch(step, engine_.micro_batch_index(a));
      dump_.input_ids.insert(dump_.input_ids.end(), batch.tokens.begin(), batch.tokens.end());
      dump_.labels.insert(dump_.labels.end(), batch.labels.begin(), batch.labels.end());
      dump_.rows += settings_.micro_batch;
    }
    agree_on_errors(
        world_,
        [&] { write_batch_dump(settings_, run_.shape, model_.tensor_shapes, engine_, dump_, report, gradients_); },
        "the batch dump was written");
  }
  if (!settings_.trace_dir.empty()) trace_step(step, report, losses);
  progress_.step(run_, engine_, report, ms, compute_.memory());
  gradients_ = std::vector<float>();  // 4 Psi bytes, not held past the step
}

// --timeline: every rank's events gathered (collective), rank 0 writes the file.
void StepObservers::write_timeline() {
  if (settings_.timeline.empty()) return;
  const std::string text = z2::timeline_json(compute_, world_);
  agree_on_errors(
      world_,
      [&] {
        if (rank_ == 0) write_output_file(settings_.timeline, text);
      },
      "the timeline was written");
}

// --trace: what step `step` (0-based; the trace counts from 1) adds. Rank 0
// gathers every rank's micro-batch losses and rebuilds the global batch
// from the seed (the same hashes every rank drew its own micro-batches
// from: nothing else crosses the wire); after the kept steps, the
// parameters (a collective) and the gradient the step applied.
void StepObservers::trace_step(long step, const z2::StepReport& report, const std::vector<float>& losses) {
  const int N = world_size_, A = settings_.accum;
  std::vector<float> gathered((size_t)N * A);  // [rank][micro-step]
  MPI_Request request;
  Z2_MPI_CHECK(MPI_Igather(losses.data(), A, MPI_FLOAT, gathered.data(), A, MPI_FLOAT, 0, world_, &request));
  z2::wait_request(&request, "the gather of the micro-batch losses for --trace");
  std::vector<float> parameters;
  if (trace_keeps_parameters_after(settings_, step + 1)) parameters = engine_.parameters_to_host();
  agree_on_errors(
      world_,
      [&] {
        if (rank_ != 0) return;
        TracedStep traced{report, {}, {}};
        for (long m = 0; m < (long)N * A; ++m) {  // rank m mod N computed it at micro-step m div N
          const DrawnBatch batch = model_.batch(step, m);
          trace_->add_micro_batch(batch.tokens, batch.labels);
          traced.micro_batch_losses.push_back(gathered[(size_t)(m % N) * A + m / N]);
          traced.micro_batch_selected.push_back(batch.selected);
        }
        trace_->add_step(std::move(traced));
        if (!parameters.empty())
          trace_->write_parameters(step + 1, run_.shape, model_.tensor_shapes, engine_, parameters, gradients_);
      },
      "the trace's step was written");
}

}  // namespace bert
