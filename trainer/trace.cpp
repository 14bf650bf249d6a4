// trainer/trace.cpp — --trace DIR (trainer/trace.h; the format is notes/12's
// "The trace", version 1).
//
//   DIR/initial/              the weights step 1 starts from: the export's layout (config.json,
//                             model.safetensors, the tokenizer), loadable by BertForMaskedLM.from_pretrained
//   DIR/step_<s>/             after optimizer step s: the same layout (the fp32 parameters: the master
//                             weights in mixed precision) and gradients.safetensors, the gradient step s
//                             applied (before clipping; fp16's loss scale divided out), by the same names
//   DIR/batches.safetensors   input_ids, labels: int64 [steps, N x A x B, T]; row m B + b of a step is
//                             sample b of global micro-batch m; labels -100 where the loss does not read
//   DIR/trace.json            the settings, the conventions, the layout, every step's record; written
//                             last, so a directory holding it holds a whole trace
#include "trainer/trace.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "trainer/hf_export.h"
#include "trainer/inputs.h"
#include "trainer/json.h"

namespace bert {

std::unique_ptr<DirectoryLock> claim_trace_directory(const Settings& settings) {
  auto lock = std::make_unique<DirectoryLock>(
      settings.trace_dir, DirectoryLock::OnBusy::refuse,
      "--trace '" + settings.trace_dir + "' is being written by another run: give each run its own directory");
  check_empty_directory("--trace", settings.trace_dir, "a trace");  // the first run may have finished already
  return lock;
}

RunTrace::RunTrace(const Settings& settings, std::unique_ptr<DirectoryLock> lock)
    : settings_(settings), lock_(std::move(lock)) {
  // The config as it was read before step 1 (the file may change or go before the run ends).
  if (!settings.config.empty()) config_text_ = read_config_text(settings.config);
}
RunTrace::~RunTrace() = default;

bool trace_keeps_parameters_after(const Settings& settings, long step) {
  const long every = settings.trace_params_every;
  return !settings.trace_dir.empty() && (step == 1 || (every > 0 && step % every == 0) || step == settings.steps);
}

void RunTrace::write_initial(const ModelShape& shape, const TensorShapes& tensor_shapes, const z2::Engine& engine,
                             const std::vector<float>& values) {
  const std::string directory = settings_.trace_dir + "/initial";
  prepare_directory("--trace", directory);
  export_hf(directory, shape, tensor_shapes, engine, values);
}

void RunTrace::add_micro_batch(const std::vector<int>& tokens, const std::vector<long>& labels) {
  input_ids_.insert(input_ids_.end(), tokens.begin(), tokens.end());
  labels_.insert(labels_.end(), labels.begin(), labels.end());
  rows_ += (long)(tokens.size() / (size_t)settings_.seq);
}

void RunTrace::add_step(TracedStep step) { steps_.push_back(std::move(step)); }

void RunTrace::write_parameters(long step, const ModelShape& shape, const TensorShapes& tensor_shapes,
                                const z2::Engine& engine, const std::vector<float>& parameters,
                                const std::vector<float>& gradients) {
  const std::string directory = settings_.trace_dir + "/step_" + std::to_string(step);
  prepare_directory("--trace", directory);
  // The gradient first: a step directory whose config.json is there is whole
  // (export_hf writes config.json last).
  if (!gradients.empty())
    write_output_file(directory + "/gradients.safetensors",
                      safetensors_bytes(named_tensors(engine, tensor_shapes, gradients), {{"format", "pt"}}));
  export_hf(directory, shape, tensor_shapes, engine, parameters);
  parameter_steps_.push_back(step);
  has_gradients_.push_back(!gradients.empty());
}

// --- trace.json ---------------------------------------------------------------------

// A float the run computed, exactly (JSON's numbers are doubles: a float
// widens to one without rounding), or null when it is not finite (an fp16
// step that overflowed).
static json exact(double value) { return std::isfinite(value) ? json(value) : json(nullptr); }

// A float setting as the decimal it was given as (0.1, not 0.100000001).
static double as_written(float value) {
  char text[32];
  snprintf(text, sizeof text, "%.7g", value);
  return std::strtod(text, nullptr);
}

static std::string float_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  char text[9];
  snprintf(text, sizeof text, "%08x", bits);
  return text;
}

// What a replay must do the same way, in words (notes/12 says why each).
static json conventions(const Settings& s) {
  return {
      {"loss",
       "the mean cross-entropy over the selected positions (labels != -100) of the whole global batch: each "
       "selected position's cross-entropy summed over all N x A micro-batches, divided once by their count "
       "(steps[].selected). Not a mean of per-rank or per-micro-batch means"},
      {"micro_batches",
       "a step's global batch is N x A micro-batches of B rows; global micro-batch m is computed by rank m mod N at "
       "its micro-step m div N (m = a N + r)"},
      {"gradient",
       "the derivative of that loss (summed over the micro-batches and the ranks, not averaged again), before "
       "clipping, in fp32; fp16's loss scale divided out"},
      {"grad_norm", "the L2 norm of the whole gradient (every parameter, every rank's shard) before clipping"},
      {"clipping",
       "with clip > 0, as torch.nn.utils.clip_grad_norm_: the gradient times clip / (grad_norm + 1e-6) when "
       "that is below 1"},
      {"optimizer",
       "AdamW as torch.optim.AdamW: m = beta1 m + (1 - beta1) g, v = beta2 v + (1 - beta2) g^2, p -= lr wd p "
       "(decoupled, not for the parameters in no_weight_decay), p -= lr m_hat / (sqrt(v_hat) + eps) with "
       "m_hat = m / (1 - beta1^t), v_hat = v / (1 - beta2^t) (bias_correction; without it m and v), t the "
       "updates applied so far, lr = steps[].lr"},
      {"learning_rate", "steps[].lr is the rate of that step's update, whatever schedule gave it"},
      {"betas", betas_cycle(s)
                    ? "steps[].betas are that update's (beta1, beta2), which DeepSpeed's OneCycle sets per step; "
                      "optimizer.betas are the optimizer's own, which act in no update"
                    : "optimizer.betas in every update"},
      {"dropout", s.dropout == 0
                      ? "0: a replay computes the same functions"
                      : "> 0: zero2 draws its masks from a hash of (seed, step, sample, layer, site, element), which "
                        "no other implementation draws; only a run with dropout 0 can be replayed"},
      {"parameters",
       "initial/ and step_<s>/ hold float32 values (the fp32 master weights in mixed precision), in the "
       "export's Hugging Face layout; step_<s>/gradients.safetensors the gradient step s applied"},
  };
}

static json optimizer_record(const z2::EngineOptions& options, const z2::Engine& engine) {
  json no_decay = json::array();
  for (const z2::ParameterInfo& p : engine.parameters())
    if (!p.decay) no_decay.push_back(p.name);
  return {{"type", "AdamW"},
          {"betas", {options.beta1, options.beta2}},
          {"eps", options.eps},
          {"weight_decay", options.weight_decay},
          {"bias_correction", options.bias_correction},
          {"clip", options.clip > 0 ? options.clip : 0.0},
          {"no_weight_decay", no_decay}};
}

// fp16's dynamic loss scale (DeepSpeed's rule) as the run starts it; null in fp32 and bf16.
static json loss_scaling_record(const z2::Engine& engine) {
  if (engine.precision() != z2::Precision::fp16) return nullptr;
  const z2::LossScaling& l = engine.options().loss_scaling;
  return {{"rule", l.static_scale > 0 ? "static" : "DeepSpeed DynamicLossScaler"},
          {"initial_scale", l.static_scale > 0 ? l.static_scale : std::ldexp(1.0, l.initial_scale_power)},
          {"window", l.window},
          {"hysteresis", l.hysteresis},
          {"consecutive_hysteresis", l.consecutive_hysteresis},
          {"min_scale", l.min_scale}};
}

// Where each parameter and bucket lies at this run's N (zero2.cu, "Layout"):
// what lets the checker name a difference in ZeRO's terms.
static json layout_record(const z2::Engine& engine, const TensorShapes& tensor_shapes) {
  json buckets = json::array(), parameters = json::array();
  for (const z2::BucketInfo& b : engine.buckets())
    buckets.push_back({{"offset", b.offset},
                       {"length", b.length},
                       {"padded_length", b.padded_length},
                       {"shard_length", b.shard_length}});
  const auto& infos = engine.parameters();
  for (size_t id = 0; id < infos.size(); ++id)
    parameters.push_back({{"name", infos[id].name},
                          {"shape", tensor_shapes[id]},
                          {"numel", infos[id].numel},
                          {"decay", infos[id].decay},
                          {"bucket", infos[id].bucket},
                          {"offset", infos[id].offset}});
  return {{"world_size", engine.world_size()},
          {"norm_chunk", z2::norm_chunk},
          {"psi", engine.psi()},
          {"psi_padded", engine.psi_padded()},
          {"buckets", buckets},
          {"parameters", parameters},
          {"shard_rule",
           "rank r owns [offset + r shard_length, offset + (r + 1) shard_length) of each bucket of the padded flat "
           "buffer; a parameter's element i lies at its offset + i"}};
}

static json step_record(const TracedStep& traced, bool betas_cycle) {
  const z2::StepReport& r = traced.report;
  long selected = 0;
  for (long count : traced.micro_batch_selected) selected += count;
  json losses = json::array();
  for (float loss : traced.micro_batch_losses) losses.push_back(exact(loss));
  json record = {{"step", r.step},
                 {"lr", r.lr},
                 {"loss", exact(r.loss)},
                 {"loss_bits", float_bits(r.loss)},
                 {"grad_norm", exact(r.grad_norm)},
                 {"clip_coefficient", exact(r.clip_coefficient)},
                 {"loss_scale", r.loss_scale},
                 {"skipped", r.skipped},
                 {"selected", selected},
                 {"micro_batch_losses", losses},
                 {"micro_batch_selected", traced.micro_batch_selected}};
  // (DeepSpeed's OneCycle sets Adam's betas every step: that step's pair.)
  if (betas_cycle) record["betas"] = {r.beta1, r.beta2};
  return record;
}

void RunTrace::finish(const ModelShape& shape, const TensorShapes& tensor_shapes, const z2::Engine& engine,
                      int interrupted_by) {
  const long steps = (long)steps_.size(), rows_per_step = steps > 0 ? rows_ / steps : 0;
  write_output_file(
      settings_.trace_dir + "/batches.safetensors",
      safetensors_bytes({{"input_ids",
                          "I64",
                          {steps, rows_per_step, shape.seq},
                          std::string((const char*)input_ids_.data(), input_ids_.size() * sizeof(int64_t))},
                         {"labels",
                          "I64",
                          {steps, rows_per_step, shape.seq},
                          std::string((const char*)labels_.data(), labels_.size() * sizeof(int64_t))}},
                        {{"format", "pt"}}));
  const z2::EngineOptions& options = engine.options();
  json parameter_steps = json::array();
  for (size_t k = 0; k < parameter_steps_.size(); ++k)
    parameter_steps.push_back({{"step", parameter_steps_[k]}, {"gradients", (bool)has_gradients_[k]}});
  json records = json::array();
  for (const TracedStep& traced : steps_) records.push_back(step_record(traced, betas_cycle(settings_)));
  const json config = config_text_.empty() ? json(nullptr) : parse_json(config_text_);
  const json trace = {
      {"format", trace_format},
      {"version", trace_version},
      {"producer", "zero2 train_bert_mini"},
      {"model",
       {{"architecture", "BertForMaskedLM"},
        {"vocab_size", vocab_size},
        {"hidden_size", shape.hidden},
        {"num_hidden_layers", shape.layers},
        {"num_attention_heads", shape.heads},
        {"intermediate_size", shape.intermediate},
        {"max_position_embeddings", shape.max_positions},
        {"type_vocab_size", 1},
        {"hidden_act", "gelu"},
        {"layer_norm_eps", 1e-12},
        {"tie_word_embeddings", true}}},
      {"run",
       {{"world_size", engine.world_size()},
        {"accumulation_steps", options.accumulation_steps},
        {"micro_batch", shape.micro_batch},
        {"seq", shape.seq},
        {"steps", steps},
        {"stage", options.stage},
        {"bucket", options.bucket_elements},
        {"overlap", options.overlap},
        // ZeRO-Offload (notes/13): where the optimizer ran changes no bit; a peer may offload too.
        {"offload_optimizer", options.offload_optimizer},
        {"precision", z2::to_string(options.precision)},
        // Where the micro-steps' gradients are summed (A > 1): zero2's fp32 blocks, or the working
        // precision (data_types.grad_accum_dtype); DeepSpeed under ZeRO sums in the 16-bit type by default.
        {"grad_accum_dtype", options.accumulate_fp32 ? "fp32" : z2::to_string(options.precision)},
        {"dropout", as_written(shape.dropout)},
        {"seed", shape.seed},
        {"interrupted_by", interrupted_by},
        {"deepspeed_config", config}}},
      {"optimizer", optimizer_record(options, engine)},
      {"loss_scaling", loss_scaling_record(engine)},
      {"conventions", conventions(settings_)},
      {"layout", layout_record(engine, tensor_shapes)},
      {"parameter_steps", parameter_steps},
      {"steps", records}};
  write_output_file(settings_.trace_dir + "/trace.json", json_text(trace, 1) + "\n");
}

}  // namespace bert
