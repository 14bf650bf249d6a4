// trainer/reports.cpp — the header, the progress lines, the summary, the
// --json summary and the memory trace (trainer/reports.h).
#include "trainer/reports.h"

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "trainer/json.h"

namespace bert {

static const char* signal_name(int signal) {
  return signal == SIGINT ? "SIGINT" : signal == SIGTERM ? "SIGTERM" : "a signal";
}

// Seconds as h:mm:ss (or m:ss under an hour), for the progress line.
static std::string clock_text(double seconds) {
  const long total = std::lround(std::max(0.0, seconds));
  char text[32];
  if (total >= 3600) snprintf(text, sizeof text, "%ld:%02ld:%02ld", total / 3600, total / 60 % 60, total % 60);
  else snprintf(text, sizeof text, "%ld:%02ld", total / 60, total % 60);
  return text;
}

static std::string hex32(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  char text[16];
  snprintf(text, sizeof text, "%08x", bits);
  return text;
}

// A loss scale as DeepSpeed prints it: a whole number when it is one.
static std::string scale_text(double scale) {
  char text[40];
  if (scale == std::floor(scale) && scale < 1e18) snprintf(text, sizeof text, "%.0f", scale);
  else snprintf(text, sizeof text, "%g", scale);
  return text;
}

// --- before step 1 -------------------------------------------------------------

// The settings a DeepSpeed config can set, by the name the header and
// --json's settings_origin give them and the flag apply() knows them as
// (trainer/settings.cpp); Settings::origins says where each value came from.
struct ConfigurableSetting {
  const char* name;
  const char* flag;
};
constexpr ConfigurableSetting configurable_settings[] = {
    {"stage", "--stage"},
    {"bucket", "--bucket"},
    {"overlap", "--overlap"},
    {"micro_batch", "--micro-batch"},
    {"accum", "--accum"},
    {"precision", "--precision"},
    {"loss_scale", "loss_scale"},
    {"initial_scale_power", "initial_scale_power"},
    {"loss_scale_window", "loss_scale_window"},
    {"hysteresis", "hysteresis"},
    {"consecutive_hysteresis", "consecutive_hysteresis"},
    {"min_loss_scale", "min_loss_scale"},
    {"grad_accum_dtype", "grad_accum_dtype"},
    {"lr", "--lr"},
    {"beta1", "beta1"},
    {"beta2", "beta2"},
    {"eps", "eps"},
    {"weight_decay", "--weight-decay"},
    {"bias_correction", "bias_correction"},
    {"clip", "--clip"},
    {"schedule", "schedule_convention"},
    {"decay", "--decay"},
    {"warmup", "--warmup"},
    {"warmup_type", "--warmup-type"},
    {"warmup_min_lr", "warmup_min_lr"},
    {"schedule_steps", "--schedule-steps"},
    {"log_every", "--log-every"},
    {"wall_clock_breakdown", "--wall-clock-breakdown"},
    {"activations", "--activations"},
    {"alloc", "--alloc"},
    {"offload_optimizer", "--offload-optimizer"},
    {"portable", "--portable"},
};

static std::string number_text(double value) {
  char text[40];
  snprintf(text, sizeof text, "%g", value);
  return text;
}
// A configurable setting's value as the header shows it.
static std::string setting_text(const Settings& s, const std::string& flag) {
  const z2::LossScaling& l = s.loss_scaling;
  if (flag == "--stage") return std::to_string(s.stage);
  if (flag == "--bucket") return std::to_string(s.bucket);
  if (flag == "--overlap") return s.overlap ? "on" : "off";
  if (flag == "--micro-batch") return std::to_string(s.micro_batch);
  if (flag == "--accum") return std::to_string(s.accum);
  if (flag == "--precision") return s.precision;
  if (flag == "loss_scale") return l.static_scale > 0 ? scale_text(l.static_scale) : "dynamic";
  if (flag == "initial_scale_power") return std::to_string(l.initial_scale_power);
  if (flag == "loss_scale_window") return std::to_string(l.window);
  if (flag == "hysteresis") return std::to_string(l.hysteresis);
  if (flag == "consecutive_hysteresis") return l.consecutive_hysteresis ? "true" : "false";
  if (flag == "min_loss_scale") return scale_text(l.min_scale);
  if (flag == "grad_accum_dtype") return s.grad_accum_dtype;
  if (flag == "--lr") return number_text(s.lr);
  if (flag == "beta1") return number_text(s.beta1);
  if (flag == "beta2") return number_text(s.beta2);
  if (flag == "eps") return number_text(s.eps);
  if (flag == "--weight-decay") return number_text(s.weight_decay);
  if (flag == "bias_correction") return s.bias_correction ? "true" : "false";
  if (flag == "--clip") return number_text(s.clip);
  if (flag == "schedule_convention") return s.schedule_convention;
  if (flag == "--decay") return s.decay;
  if (flag == "--warmup") return std::to_string(s.warmup);
  if (flag == "--warmup-type") return s.warmup_type;
  if (flag == "warmup_min_lr") return number_text(s.warmup_min_lr);
  if (flag == "--schedule-steps") return std::to_string(s.schedule_steps);
  if (flag == "--log-every") return std::to_string(s.log_every);
  if (flag == "--wall-clock-breakdown") return s.wall_clock_breakdown ? "on" : "off";
  if (flag == "--activations") return s.activations;
  if (flag == "--alloc") return s.alloc;
  if (flag == "--offload-optimizer") return s.offload_optimizer;
  return s.portable ? "on" : "off";  // --portable
}
// Where a setting's value came from (Settings::origins), "trainer_default" when unrecorded.
static std::string origin_of(const Settings& s, const std::string& flag) {
  const auto found = s.origins.find(flag);
  return found == s.origins.end() ? "trainer_default" : found->second;
}

static bool scheduler_param(const std::string& flag) {
  return flag == "--decay" || flag == "--warmup" || flag == "--warmup-type" || flag == "warmup_min_lr" ||
         flag == "--schedule-steps";
}

// The config block of the header: the file, then every setting a config
// can set grouped by where its value came from (the config's key, a flag,
// the checkpoint, train_batch_size, DeepSpeed's default and where DeepSpeed
// sets it, the trainer's default), wrapped to about 110 columns; then the
// notes and the keys DeepSpeed ignores.
static void print_config_origins(const Settings& s) {
  printf("  config    %s: read as DeepSpeed 0.16.9 reads it; each setting a config can set, by its source:\n",
         s.config.c_str());
  const std::vector<std::pair<std::string, std::string>> kinds = {{"config", "the config"},
                                                                  {"flag", "flags"},
                                                                  {"checkpoint", "the checkpoint"},
                                                                  {"derived", "train_batch_size (DeepSpeed's rule)"},
                                                                  {"deepspeed_default", "DeepSpeed's defaults"},
                                                                  {"trainer_default", "the trainer's defaults"}};
  for (const auto& [kind, title] : kinds) {
    // Items of one kind, in the table's order; DeepSpeed's defaults grouped by where DeepSpeed sets them.
    std::vector<std::pair<std::string, std::string>> items;  // (detail, "name value")
    for (const ConfigurableSetting& setting : configurable_settings) {
      if (s.schedule_convention == "none" && scheduler_param(setting.flag))
        continue;  // no scheduler: they act on nothing
      const std::string origin = origin_of(s, setting.flag);
      const size_t colon = origin.find(':');
      if (origin.substr(0, colon) != kind) continue;
      const std::string detail = colon == std::string::npos ? "" : origin.substr(colon + 1);
      std::string item = std::string(setting.name) + " " + setting_text(s, setting.flag);
      // The key, a flag other than the setting's own (--warmup choosing the schedule), or "auto".
      if (kind == "config" || (kind == "trainer_default" && !detail.empty()) ||
          (kind == "flag" && detail != setting.flag))
        item += " (" + detail + ")";
      items.push_back({kind == "deepspeed_default" ? detail : "", item});
    }
    if (items.empty()) continue;
    std::stable_sort(items.begin(), items.end(), [](auto& a, auto& b) { return a.first < b.first; });
    std::string text = title + ":";
    for (size_t k = 0; k < items.size(); ++k) {
      const bool group_ends = k + 1 == items.size() || items[k + 1].first != items[k].first;
      text += " " + items[k].second + (group_ends && !items[k].first.empty() ? " [" + items[k].first + "]" : "") +
              (k + 1 == items.size()                   ? ""
               : group_ends && !items[k].first.empty() ? ";"
                                                       : ",");
    }
    // Wrapped at spaces to about 110 columns, each line under the label's column.
    const size_t width = 98;
    while (!text.empty()) {
      size_t cut = text.size() <= width ? text.size() : text.rfind(' ', width);
      if (cut == std::string::npos || cut == 0) cut = std::min(text.size(), width);
      printf("            %s\n", text.substr(0, cut).c_str());
      text = text.substr(std::min(text.size(), cut + 1));
    }
  }
}

// The optimizer line: what the rate does over the schedule, and how much of
// the schedule this run trains when the two differ.
static void print_trainer_schedule(const Settings& s) {
  char from[48] = "";
  if (s.warmup_min_lr > 0) snprintf(from, sizeof from, " from %g", s.warmup_min_lr);
  std::string after =
      s.decay == "none" ? "then constant" : "then linear decay over " + std::to_string(s.schedule_steps) + " steps";
  if (s.decay != "none" && s.warmup_min_lr > 0) after += " back toward " + std::string(from + 6);
  const std::string warmup = s.warmup == 0 ? std::string("no warmup,")
                                           : "warmup " + std::to_string(s.warmup) + " (" + s.warmup_type + ")" + from;
  printf("  optimizer AdamW%s lr %g, %s %s, weight decay %g, clip %g\n",
         s.bias_correction ? "" : " (no bias correction)", s.lr, warmup.c_str(), after.c_str(), s.weight_decay, s.clip);
  if (s.schedule_steps != s.steps)
    printf("  steps     %ld of the schedule's %ld (--steps; total_num_steps / --schedule-steps set the schedule)\n",
           s.steps, s.schedule_steps);
  if (s.steps > s.schedule_steps && s.decay != "none")
    printf("  WARNING   steps %ld to %ld are past the schedule's end: they train at warmup_min_lr = %g%s\n",
           s.schedule_steps + 1, s.steps, s.warmup_min_lr, s.warmup_min_lr == 0 ? " (no update at all)" : "");
}

// DeepSpeed's scheduler (trainer/settings.cpp, deepspeed_learning_rate):
// update t runs at the scheduler's iteration t - 2, so updates 1 and 2 learn
// at warmup_min_lr; WarmupDecayLR reaches warmup_min_lr at iteration S, update S + 2.
static void print_deepspeed_schedule(const Settings& s) {
  const bool decays = s.decay == "linear";
  const long W = std::max(2l, s.warmup), S = s.schedule_steps;
  const std::string after =
      decays ? "then linear decay to " + number_text(s.warmup_min_lr) + " at iteration " + std::to_string(S)
             : "then constant";
  printf(
      "  optimizer AdamW%s lr %g, DeepSpeed's %s: warmup %ld iterations (%s) from %g, %s; update t at iteration "
      "t - 2 (updates 1 and 2 at %g), weight decay %g, clip %g\n",
      s.bias_correction ? "" : " (no bias correction)", s.lr, decays ? "WarmupDecayLR" : "WarmupLR", W,
      s.warmup_type.c_str(), s.warmup_min_lr, after.c_str(), s.warmup_min_lr, s.weight_decay, s.clip);
  if (decays && W > S)
    printf(
        "  WARNING   warmup_num_steps %ld is more than total_num_steps %ld (DeepSpeed only warns): the rate warms "
        "up until iteration %ld, then drops to warmup_min_lr\n",
        W, S, W);
  if (decays && s.steps >= S + 2)
    printf("  WARNING   updates %ld to %ld are past total_num_steps: they train at warmup_min_lr = %g%s\n", S + 2,
           s.steps, s.warmup_min_lr, s.warmup_min_lr == 0 ? " (no update at all)" : "");
}

// DeepSpeed's other three (trainer/settings.cpp, warmup_cosine_learning_rate
// and the next two): the same iterations, update t at t - 2.
static void print_deepspeed_other_schedule(const Settings& s) {
  const char* adamw = s.bias_correction ? "AdamW" : "AdamW (no bias correction)";
  if (s.scheduler == "WarmupCosineLR") {
    const long W = std::max(2l, s.warmup), S = s.schedule_steps;
    printf(
        "  optimizer %s lr %g, DeepSpeed's WarmupCosineLR: warmup %ld iterations (%s) from %g x lr, then a cosine "
        "to %g x lr at iteration %ld; update t at iteration t - 2 (update 1 at 0), weight decay %g, clip %g\n",
        adamw, s.lr, W, s.warmup_type.c_str(), s.warmup_min_ratio, s.cos_min_ratio, S - 1, s.weight_decay, s.clip);
    if (W > S)
      printf(
          "  WARNING   warmup_num_steps %ld is more than total_num_steps %ld (DeepSpeed only warns): the cosine "
          "after the warmup runs over a negative length\n",
          W, S);
    // The cosine's least is at iteration S - 1 (update S + 1); past it the
    // cosine rises again (lr_schedules.py:840-844 clamp nothing).
    if (s.steps >= S + 2)
      printf(
          "  WARNING   updates %ld to %ld are past total_num_steps: DeepSpeed's cosine does not stop there, and the "
          "rate rises again toward lr\n",
          S + 2, s.steps);
    return;
  }
  if (s.scheduler == "OneCycle") {
    const long first = s.cycle_first_step_size,
               second = s.cycle_second_step_size < 0 ? first : s.cycle_second_step_size;
    std::string decay = s.decay_step_size == 0 || s.decay_lr_rate == 0
                            ? "then cycle_min_lr"
                            : "then cycle_min_lr / (1 + " + number_text(s.decay_lr_rate) + " x iterations past / " +
                                  std::to_string(s.decay_step_size) + ")";
    printf(
        "  optimizer %s, DeepSpeed's OneCycle: lr %g up to %g over %ld iterations and back over %ld, %s; update t "
        "at iteration t - 2 (update 1 at %g), weight decay %g, clip %g\n",
        adamw, s.cycle_min_lr, s.cycle_max_lr, first, second, decay.c_str(), s.cycle_min_lr, s.weight_decay, s.clip);
    if (s.cycle_momentum) {
      const std::string after = s.decay_step_size == 0 || s.decay_mom_rate == 0
                                    ? "then " + number_text(s.cycle_max_mom)
                                    : "then " + number_text(s.cycle_max_mom) + " x (1 + " +
                                          number_text(s.decay_mom_rate) + " x iterations past / " +
                                          std::to_string(s.decay_step_size) + ")";
      printf(
          "  betas     (beta1, 0.99): beta1 %g down to %g and back, %s; update 1 at %g (OneCycle sets beta2 0.99: "
          "the optimizer's betas (%g, %g) act in no update)\n",
          s.cycle_max_mom, s.cycle_min_mom, after.c_str(), s.cycle_min_mom, s.beta1, s.beta2);
    }
    return;
  }
  printf(
      "  optimizer %s, DeepSpeed's LRRangeTest: lr %g x (1 + %g x %s(iteration + 1) / %ld)); update t at "
      "iteration t - 2 (update 1 at %g), weight decay %g, clip %g\n",
      adamw, s.lr_range_test_min_lr, s.lr_range_test_step_rate, s.lr_range_test_staircase ? "floor(" : "(",
      s.lr_range_test_step_size, s.lr_range_test_min_lr, s.weight_decay, s.clip);
}

static void print_schedule(const Settings& s) {
  if (s.schedule_convention == "deepspeed" && s.scheduler != "warmup") return print_deepspeed_other_schedule(s);
  if (s.schedule_convention == "deepspeed") return print_deepspeed_schedule(s);
  if (s.schedule_convention == "zero2") return print_trainer_schedule(s);
  printf(
      "  optimizer AdamW%s lr %g at every step (no scheduler: DeepSpeed keeps the optimizer's rate), weight decay "
      "%g, clip %g\n",
      s.bias_correction ? "" : " (no bias correction)", s.lr, s.weight_decay, s.clip);
}

// The model states the ledger measured beside its formula; with ZeRO-Offload
// the device's share and the host's, each beside its own formula (device:
// the working parameters, stage 1 its full gradient too; host: 16 Psi/N).
static void print_model_states(const Settings& settings, const RunRecord& run) {
  const z2::MemoryLedger& ledger = run.start_ledger;
  auto line = [](const char* what, size_t measured, const char* text, size_t formula) {
    printf("  %s per rank: %s bytes; formula %s = %s (%s)\n", what, z2::with_commas(measured).c_str(), text,
           z2::with_commas(formula).c_str(), measured == formula ? "equal" : "DIFFERS");
  };
  line(ledger.offload_optimizer ? "model states on the device" : "model states", ledger.model_states,
       z2::model_states_formula_text(settings.stage, run.precision, ledger.offload_optimizer),
       ledger.model_states_formula);
  if (ledger.offload_optimizer)
    line("offloaded to the host", ledger.host_model_states, z2::offloaded_states_formula_text(true),
         ledger.host_model_states_formula);
}

void print_header(const Settings& settings, const RunRecord& run, const z2::Engine& engine) {
  const int N = run.world_size, T = settings.seq, B = settings.micro_batch;
  const char* names[] = {"data parallel (baseline)", "P_os (optimizer states sharded)",
                         "P_os+g (optimizer states and gradients sharded)"};
  printf("train_bert_mini: BERT-mini masked LM through zero2 (ZeRO stage %d)\n", settings.stage);
  printf("  world     %d rank(s), device %s, comm %s, collectives %s, overlap %s, bucket %s elements\n", N,
         z2::to_string(run.device), z2::to_string(run.comm), settings.collectives.c_str(),
         settings.overlap ? "on" : "off", z2::with_commas((size_t)settings.bucket).c_str());
  printf("  stage     %d: %s\n", settings.stage, names[settings.stage]);
  if (settings.offload_optimizer ==
      "cpu")  // ZeRO-Offload (Ren et al. 2021): what leaves the device, and why the bits stay
    printf(
        "  offload   optimizer to the host (ZeRO-Offload): fp32 master, m, v and the reduced gradient shard in "
        "pinned host memory, AdamW stepped there with the device's arithmetic on %d thread(s) per rank%s: the "
        "same bits\n",
        engine.host_threads(), settings.host_threads > 0 ? " (--host-threads)" : " (its share of the cores)");
  if (settings.portable)
    printf("  portable  zero2's own gemm (%s), own exp / log / erf: the bits depend on the inputs alone (notes/11)\n",
           run.device == z2::Device::cuda ? "a tiled CUDA kernel" : "a blocked CPU kernel");
  if (run.precision == z2::Precision::fp32)
    printf("  precision fp32: parameters, gradients, AdamW state and activations in fp32\n");
  else
    printf(
        "  precision %s: %s parameters, gradients and activations, fp32 master weights and AdamW state "
        "(K = 12); sums in fp32, accumulation in %s\n",
        settings.precision.c_str(), settings.precision.c_str(), settings.grad_accum_dtype.c_str());
  if (run.precision == z2::Precision::fp16) {
    const z2::LossScaling& l = settings.loss_scaling;
    if (l.static_scale > 0) printf("  loss scale static %s (fp16.loss_scale)\n", scale_text(l.static_scale).c_str());
    else
      printf("  loss scale dynamic: 2^%d, doubled after %ld clean steps, halved after %d overflow(s), at least %s\n",
             l.initial_scale_power, l.window, l.hysteresis, scale_text(l.min_scale).c_str());
  }
  printf("  model     layers %d, hidden %d, heads %d, intermediate %d, seq %d, vocab %d, positions %d, dropout %g\n",
         settings.layers, settings.hidden, settings.heads, settings.intermediate, T, vocab_size, settings.max_positions,
         settings.dropout);
  printf("  Psi       %s parameters (%s padded into %zu bucket(s))\n", z2::with_commas((size_t)engine.psi()).c_str(),
         z2::with_commas((size_t)engine.psi_padded()).c_str(), engine.buckets().size());
  printf("  batch     %d sequences x accumulation %d x %d rank(s) = %s tokens per step\n", B, settings.accum, N,
         z2::with_commas((size_t)run.tokens_per_step).c_str());
  printf("  data      %s (%s bytes), seed %llu%s\n",
         settings.data.empty() ? "embedded corpus (data/corpus.txt)" : settings.data.c_str(),
         z2::with_commas((size_t)run.corpus_bytes).c_str(), (unsigned long long)settings.seed,
         run.held_out_bytes == 0
             ? ""
             : ("; the last " + z2::with_commas(run.held_out_bytes) + " held out for --eval-every").c_str());
  print_schedule(settings);
  if (!settings.config.empty()) print_config_origins(settings);
  for (const std::string& line : settings.config_notes) printf("  config    %s\n", line.c_str());
  // Only where the run offloads: a flag (or a checkpoint) decides last, and
  // a note on pinning memory the run does not offload would mislead.
  if (settings.offload_optimizer == "cpu" && !settings.config_pinning_note.empty())
    printf("  config    %s\n", settings.config_pinning_note.c_str());
  for (const std::string& line : settings.config_warnings) printf("  WARNING   %s\n", line.c_str());
  for (const std::string& line : settings.repeated_flags) printf("  flags     %s\n", line.c_str());
  printf("  memory    --activations %s, --alloc %s: %s %s bytes per rank (%s)\n", settings.activations.c_str(),
         settings.alloc.c_str(),
         run.allocator == z2::Allocator::arena || run.allocator == z2::Allocator::naive
             ? "one block of"
             : "segments taken as needed (caching) or cudaMalloc per tensor (cuda) within a limit of",
         z2::with_commas(run.memory_block).c_str(),
         settings.device_memory_limit > 0
             ? "--device-memory-limit"
             : "default: twice the plan's need (--plan) + 64 MiB, at most 90% of what is free");
  const size_t checkpoint_bytes = (size_t)B * T * settings.hidden * z2::element_bytes(run.precision);
  printf("  activations per rank: device peak %s bytes by the formula%s\n",
         z2::with_commas(activation_peak_bytes(run.shape, run.mode, run.allocator == z2::Allocator::arena)).c_str(),
         run.mode == ActivationMode::offload
             ? (" (bound: one block + 2 checkpoints = " + z2::with_commas(offload_activation_bound(run.shape)) +
                "); host " + z2::with_commas((size_t)(settings.layers - 1) * checkpoint_bytes) + " (L - 1 checkpoints)")
                   .c_str()
             : "");
  print_model_states(settings, run);
  if (run.loaded)
    printf("  loaded    %s: step %ld of %ld, saved by %ld rank(s) x accumulation %ld, stage %ld, %s (%.2f s)\n",
           settings.checkpoint_directory.c_str(), run.loaded->step, settings.steps, run.loaded->world_size,
           run.loaded->accum, run.loaded->stage, settings.precision.c_str(), run.loaded->seconds);
  // --load DIR took another step than latest's (a save stopped before it moved latest).
  if (!settings.checkpoint_found.empty()) printf("  loaded    %s\n", settings.checkpoint_found.c_str());
  if (settings.summation_tree_changed)
    printf(
        "  WARNING   this split of the global batch sums in another tree than the checkpoint's "
        "(--allow-different-bits): the bits will differ from the run that never stopped\n");
  if (!settings.save_dir.empty())
    printf("  save      %s/step_<s>: %s, keeping the newest %d\n", settings.save_dir.c_str(),
           settings.save_every > 0 ? ("every " + std::to_string(settings.save_every) + " steps and at the end").c_str()
                                   : "at the end",
           settings.save_keep);
  if (!settings.init_hf.empty()) {
    std::string unused;
    for (const std::string& name : run.initial_weights_unused) unused += (unused.empty() ? "" : ", ") + name;
    printf("  init      every parameter from --init-hf %s/model.safetensors%s\n", settings.init_hf.c_str(),
           unused.empty() ? "" : ("; not used, as from_pretrained leaves them: " + unused).c_str());
  }
  if (!settings.trace_dir.empty()) {
    printf(
        "  trace     %s: the initial weights, every step's batch, loss, grad norm and lr; parameters and gradients "
        "after step 1%s and step %ld (notes/12)\n",
        settings.trace_dir.c_str(),
        settings.trace_params_every > 0 ? (", every " + std::to_string(settings.trace_params_every)).c_str() : "",
        settings.steps);
    if (settings.dropout > 0)
      printf(
          "  WARNING   --dropout %g: no other implementation draws zero2's dropout masks, so only a run with "
          "--dropout 0 can be replayed from this trace\n",
          settings.dropout);
  }
  if (!run.loaded && settings.init_hf.empty())
    printf("  initial loss should be near ln(%d) = %.3f\n", vocab_size, std::log((double)vocab_size));
  printf("\n");
  fflush(stdout);
}

// --- while it trains -------------------------------------------------------------

ProgressLog::ProgressLog(const Settings& settings, MPI_Comm world) : settings_(settings), world_(world) {
  MPI_Comm_rank(world_, &rank_);
  prints_ = rank_ == 0 && !settings_.quiet;
}
ProgressLog::~ProgressLog() = default;

void ProgressLog::start(long resumed_step) {
  // The config's ignored keys: in the header, or, with --quiet and no
  // header, on stderr (rank 0; training goes on).
  if (rank_ == 0 && settings_.quiet)
    for (const std::string& line : settings_.config_warnings)
      fprintf(stderr, "train_bert_mini: warning: %s\n", line.c_str());
  // Which step --load DIR took when it was not latest's: said even with --quiet.
  if (rank_ == 0 && settings_.quiet && !settings_.checkpoint_found.empty())
    fprintf(stderr, "train_bert_mini: note: %s\n", settings_.checkpoint_found.c_str());
  // Rank 0 writes; every rank learns whether it could (or it would wait in
  // the first step's collectives for a rank that left).
  if (!settings_.metrics.empty())
    agree_on_errors(
        world_,
        [&] {
          if (rank_ != 0) return;
          const std::string& resumed_from = settings_.checkpoint_directory;
          metrics_ = std::make_unique<MetricsStream>(
              settings_.metrics,
              resumed_from.empty() ? "" : json_text(json{{"resumed_from", resumed_from}, {"step", resumed_step}}));
        },
        "the --metrics file was made");
  training_start_ = std::chrono::steady_clock::now();
}

void ProgressLog::step(const RunRecord& run, const z2::Engine& engine, const z2::StepReport& report, double ms,
                       const z2::MemoryCounters& memory) {
  if (!report.skipped) loss_since_log_ += report.loss, ++losses_since_log_;
  // An overflow gets its own line, every time (DeepSpeed logs each one too).
  if (report.skipped) {
    if (prints_)
      printf(
          "step %5ld/%ld | fp16 gradients overflowed at loss scale %s: step skipped (%ld so far); scale now %s%s\n",
          report.step, settings_.steps, scale_text(report.loss_scale).c_str(), engine.skipped_steps(),
          scale_text(engine.loss_scaler().scale()).c_str(),
          engine.loss_scaler().scale() == report.loss_scale && engine.loss_scaler().dynamic() ? " (hysteresis)" : "");
    return;
  }
  if (report.step != 1 && report.step % settings_.log_every != 0 && report.step != settings_.steps &&
      run.steps.size() != 1)
    return;
  // Elapsed since this run's first step; the ETA from this run's mean step.
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - training_start_).count();
  const long done = (long)run.steps.size(), left = settings_.steps - report.step;
  const double eta = done > 0 ? elapsed / (double)done * (double)left : 0.0;
  const double mean_loss = loss_since_log_ / (double)std::max(1l, losses_since_log_);
  // Every rank logs the same steps, so all can agree on rank 0's write (a
  // full disk ends every rank, not only the writer).
  if (!settings_.metrics.empty())
    agree_on_errors(
        world_,
        [&] {
          if (metrics_)
            metrics_->append(json_text(json{{"step", report.step},
                                            {"loss", report.loss},
                                            {"loss_mean", mean_loss},
                                            {"losses_in_mean", losses_since_log_},
                                            {"grad_norm", report.grad_norm},
                                            {"lr", report.lr},
                                            {"loss_scale", report.loss_scale},
                                            {"skipped_so_far", engine.skipped_steps()},
                                            {"tokens_per_s", run.steps.back().tokens_per_s},
                                            {"step_ms", ms},
                                            {"elapsed_s", elapsed},
                                            {"eta_s", eta},
                                            {"memory_mib", memory.total_current / 1048576.0}}));
        },
        "the --metrics line was written");
  loss_since_log_ = 0, losses_since_log_ = 0;
  if (!prints_) return;
  char scale[48] = "";
  if (run.precision == z2::Precision::fp16)
    snprintf(scale, sizeof scale, " | scale %s", scale_text(report.loss_scale).c_str());
  printf("step %5ld/%ld | loss %.4f | grad norm %8.4f | lr %.2e%s | %9s tok/s | %8.1f ms | %s %.1f MiB | %s, ETA %s\n",
         report.step, settings_.steps, report.loss, report.grad_norm, report.lr, scale,
         z2::with_commas((size_t)std::llround(run.steps.back().tokens_per_s)).c_str(), ms,
         run.device == z2::Device::cuda ? "device" : "memory", memory.total_current / 1048576.0,
         clock_text(elapsed).c_str(), clock_text(eta).c_str());
  if (settings_.wall_clock_breakdown) {  // DeepSpeed's breakdown: this step's phases, over its A micro-steps
    const StepRecord& r = run.steps.back();
    printf(
        "  time (ms) | forward %.2f | backward %.2f | step %.2f | other %.2f (communication overlaps backward "
        "and the step)\n",
        r.forward_ms, r.backward_ms, r.optimizer_ms,
        std::max(0.0, r.ms - r.forward_ms - r.backward_ms - r.optimizer_ms));
  }
  fflush(stdout);
}

void ProgressLog::evaluation(long step, float loss) {
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - training_start_).count();
  if (!settings_.metrics.empty())
    agree_on_errors(
        world_,
        [&] {
          if (metrics_) metrics_->append(json_text(json{{"step", step}, {"eval_loss", loss}, {"elapsed_s", elapsed}}));
        },
        "the --metrics line was written");
  if (prints_) {
    printf("  eval      step %ld: loss %.4f on %d held-out micro-batch(es) of %d\n", step, loss, settings_.eval_batches,
           settings_.micro_batch);
    fflush(stdout);
  }
}

void write_memory_trace(const std::string& path, const std::vector<z2::MemorySample>& trace) {
  std::ostringstream csv;
  csv << "event,live_bytes,reserved_bytes,activation_bytes,free_pieces\n";
  for (size_t k = 0; k < trace.size(); ++k) {
    const z2::MemorySample& sample = trace[k];
    csv << k << ',' << sample.live << ',' << sample.reserved << ',' << sample.activations << ',' << sample.free_pieces
        << '\n';
  }
  write_output_file(path, csv.str());
}

// --- at the end -------------------------------------------------------------------

// The median step's time (at least one step).
static double median_step_ms(const std::vector<StepRecord>& steps) {
  std::vector<double> times;
  for (auto& r : steps) times.push_back(r.ms);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

void print_summary(const Settings& settings, const RunRecord& run, const z2::Engine& engine, const std::string& hash) {
  printf("\nsummary\n");
  if (run.interrupted_by != 0)
    printf("  %-24s by %s after step %ld (of %ld)\n", "interrupted", signal_name(run.interrupted_by),
           engine.training_progress().steps_taken, settings.steps);
  if (!run.steps.empty()) {
    const double median_ms = median_step_ms(run.steps);
    printf("  %-24s %s -> %s (%s)\n", "loss", std::to_string(run.steps.front().loss).c_str(),
           std::to_string(run.steps.back().loss).c_str(),
           run.steps.back().loss < run.steps.front().loss ? "falling" : "NOT falling");
    printf("  %-24s %s\n", "last loss bits", hex32(run.steps.back().loss).c_str());
    printf("  %-24s %.1f ms\n", "median step", median_ms);
    printf("  %-24s %s\n", "tokens/s (median step)",
           z2::with_commas((size_t)std::llround(run.tokens_per_step / (median_ms / 1000.0))).c_str());
  } else {
    printf("  %-24s none (the run starts at step %ld of %ld)\n", "steps trained",
           engine.training_progress().steps_taken, settings.steps);
  }
  printf("  %-24s %s%s\n", "final params hash", hash.c_str(),
         run.precision == z2::Precision::fp32 ? "" : " (of the fp32 master weights)");
  if (run.precision == z2::Precision::fp16)
    printf("  %-24s %s, %ld step(s) skipped on overflow\n", "loss scale (final)",
           scale_text(engine.loss_scaler().scale()).c_str(), engine.skipped_steps());
  for (const SavedCheckpoint& save : run.saved)
    printf("  %-24s %s/ (%s bytes in %zu files, %.2f s)\n", "saved", save.directory.c_str(),
           z2::with_commas((size_t)save.bytes).c_str(), (size_t)run.world_size, save.seconds);
  if (!settings.export_dir.empty() && run.interrupted_by == 0)
    printf("  %-24s %s/\n", "exported (HF layout)", settings.export_dir.c_str());
  if (!settings.dump_dir.empty()) printf("  %-24s %s/\n", "step-0 dump", settings.dump_dir.c_str());
  engine.print_ledgers(stdout);
  fflush(stdout);
}

// What the run loaded (null without --load) and saved, for --json.
static json checkpoints_json(const Settings& settings, const RunRecord& run) {
  json loaded = nullptr, saved = json::array();
  if (run.loaded) {
    const LoadedCheckpoint& l = *run.loaded;
    loaded = {{"directory", l.directory}, {"step", l.step},      {"world_size", l.world_size},
              {"accum", l.accum},         {"stage", l.stage},    {"same_summation_tree", l.same_summation_tree},
              {"precision", l.precision}, {"seconds", l.seconds}};
  }
  for (const SavedCheckpoint& save : run.saved)
    saved.push_back(
        {{"directory", save.directory}, {"step", save.step}, {"bytes", save.bytes}, {"seconds", save.seconds}});
  return {{"loaded", loaded}, {"saved", saved}, {"allow_different_bits", settings.allow_different_bits}};
}

void write_json(const Settings& settings, const RunRecord& run, const z2::Engine& engine, const std::string& hash) {
  json summary = parse_json(engine.ledgers_json());
  json out = {{"world_size", run.world_size},
              {"device", z2::to_string(run.device)},
              {"comm", z2::to_string(run.comm)},
              {"collectives", settings.collectives},
              {"stage", settings.stage},
              {"precision", settings.precision},
              {"portable", settings.portable},
              {"grad_accum_dtype", settings.grad_accum_dtype},
              {"loss_scale", engine.loss_scaler().scale()},
              // The scaler's settings (fp16; DeepSpeed's "fp16" keys), whatever the precision.
              {"loss_scaling",
               {{"static_scale", settings.loss_scaling.static_scale},
                {"initial_scale_power", settings.loss_scaling.initial_scale_power},
                {"window", settings.loss_scaling.window},
                {"hysteresis", settings.loss_scaling.hysteresis},
                {"consecutive_hysteresis", settings.loss_scaling.consecutive_hysteresis},
                {"min_scale", settings.loss_scaling.min_scale}}},
              {"skipped_steps", engine.skipped_steps()},
              {"activations", settings.activations},
              {"alloc", settings.alloc},
              {"offload_optimizer", settings.offload_optimizer},
              // ZeRO-Offload's host threads (null without offload: no loop runs on the host).
              {"host_threads", settings.offload_optimizer == "cpu" ? json(engine.host_threads()) : json()},
              {"device_memory_limit", settings.device_memory_limit},
              {"activation_peak_formula_bytes",
               activation_peak_bytes(run.shape, run.mode, run.allocator == z2::Allocator::arena)},
              {"offload_activation_bound_bytes", offload_activation_bound(run.shape)},
              {"accum", settings.accum},
              {"micro_batch", settings.micro_batch},
              {"seq", settings.seq},
              {"overlap", settings.overlap},
              {"bucket", settings.bucket},
              {"params", engine.psi()},
              {"params_padded", engine.psi_padded()},
              {"tokens_per_step", run.tokens_per_step},
              {"steps_total", settings.steps},
              {"schedule",
               {{"lr", settings.lr},
                {"warmup", settings.warmup},
                {"warmup_type", settings.warmup_type},
                {"warmup_min_lr", settings.warmup_min_lr},
                {"decay", settings.decay},
                {"schedule_steps", settings.schedule_steps},
                {"convention", settings.schedule_convention},
                {"scheduler", settings.scheduler},
                {"warmup_min_ratio", settings.warmup_min_ratio},
                {"cos_min_ratio", settings.cos_min_ratio},
                {"cycle_min_lr", settings.cycle_min_lr},
                {"cycle_max_lr", settings.cycle_max_lr},
                {"decay_lr_rate", settings.decay_lr_rate},
                {"cycle_first_step_size", settings.cycle_first_step_size},
                {"cycle_second_step_size",  // null: None, the first's
                 settings.cycle_second_step_size < 0 ? json(nullptr) : json(settings.cycle_second_step_size)},
                {"decay_step_size", settings.decay_step_size},
                {"cycle_momentum", settings.cycle_momentum},
                {"cycle_min_mom", settings.cycle_min_mom},
                {"cycle_max_mom", settings.cycle_max_mom},
                {"decay_mom_rate", settings.decay_mom_rate},
                {"lr_range_test_min_lr", settings.lr_range_test_min_lr},
                {"lr_range_test_step_size", settings.lr_range_test_step_size},
                {"lr_range_test_step_rate", settings.lr_range_test_step_rate},
                {"lr_range_test_staircase", settings.lr_range_test_staircase},
                {"betas_cycle", betas_cycle(settings)}}},
              {"optimizer",
               {{"betas", {settings.beta1, settings.beta2}},
                {"eps", settings.eps},
                {"weight_decay", settings.weight_decay},
                {"clip", settings.clip},
                {"bias_correction", settings.bias_correction}}},
              {"interrupted", run.interrupted_by != 0 ? json(signal_name(run.interrupted_by)) : json(nullptr)}};
  json steps = json::array();
  for (auto& r : run.steps) {
    steps.push_back({{"step", r.step},
                     {"loss", r.loss},
                     {"loss_bits", hex32(r.loss)},
                     {"grad_norm", r.grad_norm},
                     {"lr", r.lr},
                     {"ms", r.ms},
                     {"tokens_per_s", r.tokens_per_s},
                     {"loss_scale", r.loss_scale},
                     {"skipped", r.skipped}});
    // The update's betas, when a scheduler sets them per step (OneCycle's momentum)
    if (betas_cycle(settings)) steps.back()["betas"] = {r.beta1, r.beta2};
    if (settings.wall_clock_breakdown) {
      steps.back()["forward_ms"] = r.forward_ms;
      steps.back()["backward_ms"] = r.backward_ms;
      steps.back()["optimizer_ms"] = r.optimizer_ms;
    }
  }
  out["steps"] = steps;
  // Where each setting a config can set came from (print_config_origins).
  json origins = json::object();
  for (const ConfigurableSetting& setting : configurable_settings)
    origins[setting.name] = origin_of(settings, setting.flag);
  out["config"] = settings.config.empty() ? json(nullptr) : json(settings.config);
  out["settings_origin"] = origins;
  out["config_warnings"] = settings.config_warnings;
  out["final_params_hash"] = hash;
  out["memory"] = summary["memory"];  // with ZeRO-Offload, the host's column too (ledgers_json)
  out["comm"] = summary["comm"];
  out["checkpoint"] = checkpoints_json(settings, run);
  json evaluations = json::array();
  for (const Evaluation& e : run.evaluations)
    evaluations.push_back({{"step", e.step}, {"loss", e.loss}, {"loss_bits", hex32(e.loss)}});
  out["eval"] = evaluations;
  out["held_out_bytes"] = run.held_out_bytes;
  if (!run.steps.empty()) {
    const double median_ms = median_step_ms(run.steps);
    // The sgemm share: the median over steps of (time in sgemm) / (step time).
    std::vector<double> gemm_shares;
    for (auto& r : run.steps) gemm_shares.push_back(r.gemm_ms / r.ms);
    std::sort(gemm_shares.begin(), gemm_shares.end());
    out["time"] = {{"step_ms_median", median_ms},
                   {"tokens_per_s_median", run.tokens_per_step / (median_ms / 1000.0)},
                   {"gemm_share_median", gemm_shares[gemm_shares.size() / 2]}};
  }
  write_output_file(settings.json_path, json_text(out, 2) + "\n");
}

}  // namespace bert
