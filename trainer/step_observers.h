// trainer/step_observers.h — what watches a training step without changing
// it: the step's time (and, with --wall-clock-breakdown, its phases'), the
// first step's allocator events (--memory-trace), step 0's weights, batch,
// loss and gradients (--dump-batch), the step in the trace (--trace), the
// step's record for the reports, and its progress line. The model's step
// (train_bert_mini.cu, Training::train_step) calls it at the three points
// where something must be read while it is there: before forward (the clock
// starts, the memory trace begins, the weights forward reads), before the
// update (the reduced gradient, which the update consumes), and after it.
// Apart from the model, which hands it the little it reads of it
// (ObservedModel), so that it is compiled once, not once per precision;
// defined in trainer/step_observers.cpp.
// Layer: training, of settings → inputs → formats → training (notes/07, "The trainer's layers").
#pragma once

#include <chrono>
#include <cmath>
#include <functional>
#include <utility>
#include <vector>

#include "trainer/hf_export.h"
#include "trainer/model_shape.h"
#include "trainer/reports.h"
#include "trainer/settings.h"
#include "trainer/trace.h"
#include "zero2.h"

namespace bert {

// One micro-batch as the data drew it, for the dump and the trace.
struct DrawnBatch {
  std::vector<int> tokens;   // [B, T] input ids after masking
  std::vector<long> labels;  // [B, T] the original byte where selected, -100 elsewhere
  long selected = 0;         // the positions whose label the loss reads
};
// What the observers read of the model, whatever its precision.
struct ObservedModel {
  const TensorShapes& tensor_shapes;
  // Forward's and backward's milliseconds since the last call (--wall-clock-breakdown).
  std::function<std::pair<double, double>()> take_phase_times;
  // Global micro-batch m of optimizer step `step` (0-based), drawn again from the seed.
  std::function<DrawnBatch(long step, long m)> batch;
};

// An fp16 overflow skips a step (its loss may be inf); any other step whose
// loss is not finite diverged.
inline bool diverged(const z2::StepReport& report) { return !report.skipped && !std::isfinite(report.loss); }

class StepObservers {
 public:
  // `trace`: rank 0's with --trace, else null.
  StepObservers(const Settings& settings, MPI_Comm world, z2::Compute& compute, z2::Engine& engine, ObservedModel model,
                RunRecord& run, ProgressLog& progress, RunTrace* trace);
  void before_forward(long step);
  void before_update(long step);
  // `losses`: this rank's micro-batches' shares of the step's loss, in order.
  // A diverged step is timed and recorded and its memory trace written, but
  // no dump, trace or progress line claims it: the step fails right after.
  void after_update(long step, const z2::StepReport& report, const std::vector<float>& losses);
  // --timeline FILE at the end of the run (collective): every rank's events, written by rank 0.
  void write_timeline();

 private:
  void trace_step(long step, const z2::StepReport& report, const std::vector<float>& losses);

  const Settings& settings_;
  MPI_Comm world_;
  int rank_ = 0, world_size_ = 1;
  z2::Compute& compute_;
  z2::Engine& engine_;
  ObservedModel model_;
  RunRecord& run_;
  ProgressLog& progress_;
  RunTrace* trace_;
  // The step being watched: when it and its update started, the gemm time
  // before it, which outputs it makes, and the reduced gradient they keep.
  std::chrono::steady_clock::time_point start_, optimizer_start_;
  double gemm_seconds_before_ = 0;
  bool dumping_ = false, tracing_memory_ = false;
  long timeline_step_ = -1;  // the step's span on --timeline's host track
  std::vector<float> gradients_;
  BatchDump dump_;  // step 0's (--dump-batch): what forward read
};

}  // namespace bert
