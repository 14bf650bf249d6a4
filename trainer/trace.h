// trainer/trace.h — --trace DIR: the run written down for another
// implementation to replay and be checked against (notes/12, "The trace").
// A trace holds what a replay needs (the initial weights in Hugging Face's
// layout, every step's global batch, the settings and conventions that fix
// the arithmetic, every step's learning rate) and what it should match
// (every step's loss and gradient norm, the parameters and the gradient
// after step 1, every --trace-params-every steps and the last). Rank 0
// writes it, through the one writer; the training loop hands it what it
// gathered. Defined in trainer/trace.cpp; tests/check_trace.py reads it.
// Layer: formats, of settings → inputs → formats → training (notes/07, "The trainer's layers").
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "trainer/model_shape.h"
#include "trainer/output_files.h"
#include "trainer/settings.h"
#include "zero2.h"

namespace bert {

// The format's name and version, in trace.json: a reader refuses others.
constexpr const char* trace_format = "zero2-trace";
constexpr int trace_version = 1;

// One optimizer step as the trace records it.
struct TracedStep {
  z2::StepReport report;
  // Per global micro-batch m (0 .. N x A - 1): its contribution to the
  // step's loss (its selected positions' cross-entropy summed, divided by
  // the whole global batch's count) and its count of selected positions.
  std::vector<float> micro_batch_losses;
  std::vector<long> micro_batch_selected;
};

// Whether a trace keeps the parameters and gradients after optimizer step
// `step` (1-based): step 1 (the first update, from weights a replay shares
// exactly), every --trace-params-every K-th, the run's last. False without
// --trace. Every rank asks: what it keeps takes collectives to gather.
bool trace_keeps_parameters_after(const Settings& settings, long step);

// Rank 0, before step 1 (before the engine is built): DIR locked for this
// run, THEN found empty. check_outputs found it empty earlier, but two runs
// started together both pass that look; of the two, the one that takes the
// lock second finds it held (refused, naming the holder) or, if the first
// has already finished, finds its files (refused). Exactly one proceeds.
std::unique_ptr<DirectoryLock> claim_trace_directory(const Settings& settings);

class RunTrace {
 public:
  // Rank 0: DIR, claimed by claim_trace_directory, whose lock the trace
  // holds until the run ends.
  RunTrace(const Settings& settings, std::unique_ptr<DirectoryLock> lock);
  ~RunTrace();
  RunTrace(const RunTrace&) = delete;
  RunTrace& operator=(const RunTrace&) = delete;

  // Rank 0 only, each through the one writer:
  // DIR/initial/: the weights step 1 starts from (fp32, canonical order).
  void write_initial(const ModelShape& shape, const TensorShapes& tensor_shapes, const z2::Engine& engine,
                     const std::vector<float>& values);
  // One global micro-batch's rows [B, T], in global micro-batch order.
  void add_micro_batch(const std::vector<int>& tokens, const std::vector<long>& labels);
  void add_step(TracedStep step);
  // DIR/step_<s>/: the parameters after step s and, when given, the gradient it applied.
  void write_parameters(long step, const ModelShape& shape, const TensorShapes& tensor_shapes, const z2::Engine& engine,
                        const std::vector<float>& parameters, const std::vector<float>& gradients);
  // DIR/batches.safetensors, then DIR/trace.json, which says the trace is whole.
  void finish(const ModelShape& shape, const TensorShapes& tensor_shapes, const z2::Engine& engine, int interrupted_by);

 private:
  Settings settings_;
  std::string config_text_;  // --config's JSON as the run read it ("" without one)
  std::unique_ptr<DirectoryLock> lock_;
  std::vector<int64_t> input_ids_, labels_;  // [steps, N x A x B, T], flat
  long rows_ = 0;
  std::vector<TracedStep> steps_;
  std::vector<long> parameter_steps_;
  std::vector<bool> has_gradients_;
};

}  // namespace bert
