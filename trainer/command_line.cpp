// trainer/command_line.cpp — the command line (trainer/command_line.h):
// the flags read, a config file's keys applied as flags (trainer/
// deepspeed_config.cpp reads the file), what the file means to DeepSpeed
// beyond its keys, and the flags that cannot go together. Each flag's value
// is checked by apply() (trainer/settings.cpp), so a value from the file and
// one from the command line are checked the same way.
#include "trainer/command_line.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "trainer/deepspeed_config.h"

namespace bert {

// --trace and --init-hf against the flags they cannot go with (before --load reads anything).
static void check_trace_flags(const Settings& s) {
  // A peer replays a trace from step 1: its own AdamW state starts at zero,
  // and a checkpoint's (m, v) are zero2's, in no form another framework reads.
  if (!s.load_dir.empty() && !s.trace_dir.empty())
    fail(
        "--trace records a run from step 1, which another implementation replays from the initial weights; a "
        "resumed run starts from a checkpoint's optimizer state instead: trace a fresh run (--init-hf DIR starts "
        "it from given weights)");
  if (!s.load_dir.empty() && !s.init_hf.empty())
    fail("--init-hf '%s' and --load '%s' both give the weights to start from: give one", s.init_hf.c_str(),
         s.load_dir.c_str());
  if (s.trace_params_every > 0 && s.trace_dir.empty())
    fail("--trace-params-every %ld is for --trace DIR (what the trace records): give --trace too",
         s.trace_params_every);
}

// The flags --plan cannot honour: it trains nothing and reads no checkpoint.
static void check_plan_flags(const Settings& s) {
  if (!s.plan) {
    if (!s.plan_world_sizes.empty()) fail("--plan-world-sizes is for --plan (the memory plan): give --plan too");
    return;
  }
  for (auto [flag, value] : {std::pair<const char*, std::string>{"--save", s.save_dir},
                             {"--load", s.load_dir},
                             {"--init-hf", s.init_hf},
                             {"--trace", s.trace_dir},
                             {"--export-hf", s.export_dir},
                             {"--dump-batch", s.dump_dir},
                             {"--metrics", s.metrics},
                             {"--memory-trace", s.memory_trace},
                             {"--timeline", s.timeline}})
    if (!value.empty())
      fail("--plan trains nothing, so %s '%s' would have nothing to %s: drop one of them", flag, value.c_str(),
           std::string(flag) == "--load" || std::string(flag) == "--init-hf" ? "read" : "write");
  if (s.alloc != "arena" && s.device_memory_limit > 0)
    fail(
        "--plan's largest sizes for --device-memory-limit are exact for --alloc arena only: %s's memory also "
        "depends on where its holes fall (make fraglab measures it). Drop --alloc %s, or the limit",
        s.alloc.c_str(), s.alloc.c_str());
}

// A config file's keys, as flags (their origin the key). A value out of
// range counts as refused too: every problem of the file in one message.
static void apply_file_settings(Settings& settings, const std::vector<ConfigSetting>& flags,
                                std::vector<std::string> refused, const std::string& path) {
  for (auto& setting : flags) {
    try {
      apply(settings, setting.flag, setting.value, "config key '" + setting.key + "'");
      settings.origins[setting.flag] = "config:" + setting.key;
    } catch (const z2::Error& error) {
      const std::string said = error.what(), prefix = "config key '" + setting.key + "' ";
      refused.push_back(setting.key + ": " + (said.rfind(prefix, 0) == 0 ? said.substr(prefix.size()) : said));
    }
  }
  if (!refused.empty()) {
    std::string message = "the config file '" + path + "' has " + std::to_string(refused.size()) +
                          (refused.size() == 1 ? " setting" : " settings") +
                          " this trainer cannot take (notes/07 lists what each DeepSpeed key does here):";
    for (auto& line : refused) message += "\n  " + line;
    throw z2::Error(message);
  }
}
static void apply_config_keys(Settings& settings, ConfigReading& config, const std::string& path) {
  apply_file_settings(settings, config.flags, config.refused, path);
  settings.config_notes = config.notes;
  settings.config_pinning_note = config.pinning_note;
  settings.config_warnings = config.warnings;
}

// fp16's loss-scaler keys, once the precision is known: DeepSpeed reads them
// only when fp16 is enabled (runtime/config.py:195-200 get_loss_scale,
// :216-242 get_dynamic_loss_scale_args), so a run in another precision
// neither applies nor checks them ("min_loss_scale": 0 in a bf16 run's
// file is no error), and one in fp16 applies them as the file's other keys.
static void apply_fp16_scaler_keys(Settings& s, const ConfigReading& config) {
  if (s.precision == "fp16") return apply_file_settings(s, config.fp16_flags, config.fp16_refused, s.config);
  std::string keys;
  for (const ConfigSetting& key : config.fp16_flags) keys += (keys.empty() ? "" : ", ") + key.key;
  for (const std::string& refused : config.fp16_refused)
    keys += (keys.empty() ? "" : ", ") + refused.substr(0, refused.find(':'));
  if (!keys.empty())
    s.config_notes.push_back(keys + " not read: the run trains in " + s.precision +
                             ", and DeepSpeed reads fp16's loss-scaler keys only when fp16 is enabled "
                             "(runtime/config.py:195-242), as does this trainer");
}

// A file with neither train_batch_size nor train_micro_batch_size_per_gpu
// ("auto" counts as given: Hugging Face's Trainer fills it) fails DeepSpeed's
// start-up (runtime/config.py:979-981, gradient_accumulation_steps alone
// too). --micro-batch gives what the file lacks; a resumed run takes the
// checkpoint's.
static void check_batch_keys(const Settings& s, const ConfigReading& config,
                             const std::map<std::string, std::string>& flags) {
  if (config.batch_key_given || flags.count("--micro-batch") || !s.load_dir.empty()) return;
  fail(
      "the config file '%s' gives neither train_batch_size nor train_micro_batch_size_per_gpu: DeepSpeed refuses it "
      "(\"Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided\", runtime/config.py:"
      "979-981; gradient_accumulation_steps alone is not enough). Add one of them to the file, or give --micro-batch B",
      s.config.c_str());
}

// "reduce_bucket_size": "auto" as Hugging Face's Trainer fills it: the
// model's hidden_size squared (integrations/deepspeed.py,
// trainer_config_finalize: fill_only("zero_optimization.reduce_bucket_size",
// hidden_size * hidden_size)), here the run's --hidden. --bucket overrides it.
static void fill_bucket_auto(Settings& s, const ConfigReading& config) {
  if (!config.auto_flags.count("--bucket") || s.given.count("--bucket")) return;
  const long bucket = (long)s.hidden * s.hidden;
  apply(s, "--bucket", std::to_string(bucket), "zero_optimization.reduce_bucket_size \"auto\" (hidden_size^2)");
  s.origins["--bucket"] = "hugging_face_auto:hidden_size^2";
  s.config_notes.push_back("zero_optimization.reduce_bucket_size \"auto\": hidden_size^2 = " +
                           std::to_string(s.hidden) + "^2 = " + std::to_string(bucket) +
                           " elements, as Hugging Face's Trainer fills it (integrations/deepspeed.py)");
}

// prescale_gradients true or gradient_predivide_factor f other than 1, by
// the run's stage (N the ranks). Stage 0: DeepSpeed's engine multiplies
// each rank's gradient by 1 / N before the all-reduce (engine.py:2565-2567,
// allreduce_bucket), or by 1 / f before and f / N after (:2557-2564): an
// arithmetic zero2 does not implement (its loss is the global batch's mean,
// its gradients summed over the ranks in fp32 in canonical order, notes/06:
// no division by N exists to move; the same value in exact arithmetic). Stage 1: DeepSpeed's
// ZeRO optimizer reduces with reduce_scatter (its default, the only value
// taken here), whose average_tensor divides by N before the sum whatever
// the keys say (zero/stage_1_and_2.py:1128); they act only without
// reduce_scatter (:1068-1069, gradient_reduction_w_predivide). Stage 2:
// DeepSpeed asserts both away (stage_1_and_2.py:244-246). (With prescale
// true the engine never reads the factor: a stage-0 file with both, as
// DeepSpeedExamples' BERT configs have, is refused for prescale alone.)
static void check_prescaling(Settings& s, const ConfigReading& config) {
  std::string refused;  // both keys' reasons in one message
  bool prescale_on = false;
  for (const ConfigSetting& key : config.prescaling) prescale_on = prescale_on || key.key == "prescale_gradients";
  for (const ConfigSetting& key : config.prescaling) {
    const bool prescale = key.key == "prescale_gradients";
    // At stage 0 with prescale_gradients true the engine takes the prescale
    // branch (engine.py:2565-2567), which never reads the factor.
    if (!prescale && prescale_on && s.stage == 0) continue;
    const std::string said = "config key '" + key.key + "' " + key.value;
    if (s.stage == 1) {
      s.config_notes.push_back(said + " changes nothing, here as in DeepSpeed at stage 1: its ZeRO optimizer "
                                      "reduces with reduce_scatter (its default), which divides each rank's gradient "
                                      "by N before the sum whatever the key says (zero/stage_1_and_2.py:1128)");
      continue;
    }
    const std::string stage = said_by(s, "--stage", std::to_string(s.stage)), write = prescale ? "false" : "1.0";
    std::string reason;
    if (s.stage == 2)
      reason = said + " with " + stage + ": DeepSpeed refuses it too at stage 2 with reduce_scatter (its default): " +
               "stage_1_and_2.py:" + (prescale ? "246" : "245") + " asserts \"" +
               (prescale ? "pre-scale gradients" : "gradient_predivide_factor != 1.0") +
               " is not yet supported with ZeRO-2 with reduce scatter enabled\". Write " + write +
               " (at stage 1 DeepSpeed ignores it)";
    else
      reason = said + " with " + stage + ": DeepSpeed's engine then multiplies each rank's gradient by " +
               (prescale ? std::string("1 / N before the sum over the ranks (engine.py:2565-2567, allreduce_bucket") +
                               (config.prescaling.size() > 1 ? "; gradient_predivide_factor is then not read)" : ")")
                         : "1 / " + key.value + " before the sum over the ranks and the sum by " + key.value +
                               " / N after (engine.py:2557-2564, allreduce_bucket)") +
               "; zero2's loss is the mean over the whole global batch and its gradients are summed over the "
               "ranks in fp32 in one canonical order (notes/06): no division by N exists to move before the sum, "
               "and that arithmetic (the same mean in exact arithmetic, rounded otherwise) is not implemented. "
               "Write " + write + ", or train at stage 1, where DeepSpeed's ZeRO optimizer ignores it";
    refused += (refused.empty() ? "" : "\n  ") + reason;
  }
  if (!refused.empty()) throw z2::Error(refused);
}

// The schedule a config means, with the flags next to it: its scheduler
// block (a schedule flag overrides that block's key), or, when it has none,
// the scheduler the schedule flags describe (--decay's type, WarmupDecayLR
// unless --decay none, over --schedule-steps or --steps; its other params
// DeepSpeed's defaults), or else none at all: DeepSpeed then keeps the
// optimizer's rate at every step (engine.py _configure_lr_scheduler builds
// nothing). A convention that a config key or a flag chose is given (a
// resumed run must agree with the checkpoint's); "none" is a default.
static void choose_schedule(Settings& s, const ConfigReading& config, const std::map<std::string, std::string>& flags) {
  std::string flag_added;
  for (const char* flag : {"--warmup", "--warmup-type", "--decay", "--schedule-steps"})
    if (flags.count(flag) && flag_added.empty()) flag_added = flag;
  if (config.scheduler.empty() && flag_added.empty()) {
    apply(s, "schedule_convention", "none");
    s.given.erase("schedule_convention");
    s.origins["schedule_convention"] = "deepspeed_default:no scheduler block";
    return;
  }
  apply(s, "schedule_convention", "deepspeed");
  s.origins["schedule_convention"] = config.scheduler.empty() ? "flag:" + flag_added : "config:scheduler.type";
  // The schedule flags act on WarmupLR's and WarmupDecayLR's params, and
  // (but --decay) on WarmupCosineLR's; OneCycle and LRRangeTest have none of
  // them (their constructors would raise TypeError on each).
  const bool other =
      config.scheduler == "WarmupCosineLR" || config.scheduler == "OneCycle" || config.scheduler == "LRRangeTest";
  for (const char* flag : {"--warmup", "--warmup-type", "--decay", "--schedule-steps"})
    if (other && flags.count(flag) && (std::string(flag) == "--decay" || config.scheduler != "WarmupCosineLR"))
      fail(
          "%s acts on DeepSpeed's WarmupLR / WarmupDecayLR%s, and the config's scheduler.type is \"%s\": give "
          "its own params in the config",
          flag, std::string(flag) == "--decay" ? "" : " / WarmupCosineLR", config.scheduler.c_str());
  // WarmupDecayLR's and WarmupCosineLR's total_num_steps is a required
  // argument (lr_schedules.py:746-748, :797-799: no default): DeepSpeed
  // raises TypeError without it.
  const std::string needs_total = config.scheduler == "WarmupCosineLR" ? "WarmupCosineLR" : "WarmupDecayLR";
  if (config.total_num_steps_missing && (s.decay == "linear" || config.scheduler == "WarmupCosineLR") &&
      !flags.count("--schedule-steps"))
    fail(
        "config key 'scheduler.params.total_num_steps' is missing: DeepSpeed's %s has no default for it "
        "(its constructor raises TypeError). Give it, or \"auto\" (the run's --steps), or --schedule-steps",
        needs_total.c_str());
  if (!config.scheduler.empty()) return;  // the block's own defaults are among config.defaults
  const std::string type = s.decay == "none" ? "WarmupLR" : "WarmupDecayLR";
  const std::string added = " (the scheduler the flags add)";
  for (auto [flag, value] :
       {std::pair<const char*, const char*>{"--warmup", "1000"}, {"--warmup-type", "log"}, {"warmup_min_lr", "0"}})
    if (!s.given.count(flag)) {
      apply(s, flag, value);
      s.given.erase(flag);
      s.origins[flag] = "deepspeed_default:" + type + added;
    }
}

// ZeRO-Offload with the client's optimizer: a config without an optimizer
// "type" trains the client's (here the trainer's AdamW), and under offload
// DeepSpeed 0.16.9 raises ZeRORuntimeException for any client optimizer
// but DeepSpeedCPUAdam unless zero_force_ds_cpu_optimizer is false
// (engine.py _configure_optimizer; the key is read with get_scalar_param,
// true by default). Judged with the run's offload: the file's, or a flag's
// over it (--offload-optimizer none lifts it; cpu over a file without
// offload asks for the same run DeepSpeed would refuse).
static void check_client_optimizer_offload(Settings& s, const ConfigReading& config) {
  if (s.offload_optimizer != "cpu" || config.optimizer_typed) return;
  if (!config.force_ds_cpu_optimizer)
    return s.config_notes.push_back(
        "zero_force_ds_cpu_optimizer false: ZeRO-Offload steps the client's optimizer (the trainer's AdamW) on the "
        "host, as DeepSpeed allows with that key");
  const std::string origin = s.origins.count("--offload-optimizer") ? s.origins.at("--offload-optimizer") : "";
  const std::string by = origin.rfind("config:", 0) == 0 ? "config key '" + origin.substr(7) + "'"
                                                         : std::string("--offload-optimizer cpu");
  fail(
      "%s offloads the optimizer, and the config file names no optimizer \"type\", so the optimizer is the "
      "client's (the trainer's AdamW, as DeepSpeed's would be the script's): DeepSpeed raises ZeRORuntimeException "
      "for any client optimizer but DeepSpeedCPUAdam under ZeRO-Offload (engine.py _configure_optimizer; "
      "zero_force_ds_cpu_optimizer is true by default). Give \"optimizer\": {\"type\": \"AdamW\"} (DeepSpeed then "
      "builds DeepSpeedCPUAdam), or \"zero_force_ds_cpu_optimizer\": false",
      by.c_str());
}

// "auto" beside an explicit rate, as Hugging Face's Trainer judges it: it
// fills optimizer.params.lr and scheduler.params.warmup_max_lr from one
// learning_rate, and where the file gives one of them explicitly, that
// value must equal learning_rate (integrations/deepspeed.py fill_match,
// which collects every mismatch and raises ValueError). Here --lr is
// learning_rate, so "auto" takes the run's rate, and an explicit value
// that differs is refused with both named (trlx's reward-model config: an
// explicit lr 1e-5 under a warmup_max_lr "auto" would otherwise train at
// the trainer's 1e-3 without a word). Refused rather than resolved to the
// explicit value: the same file under Hugging Face's Trainer fails, so a
// run here that passed would train at a rate the file's users never had.
static void check_learning_rate_auto(const Settings& s, const ConfigReading& config) {
  if (!config.learning_rate_auto) return;
  std::string differ;
  for (const ConfigSetting& rate : config.learning_rate_keys)
    if (std::strtod(rate.value.c_str(), nullptr) != s.lr)
      differ += (differ.empty() ? "" : ", ") + rate.key + " is " + rate.value;
  if (differ.empty()) return;
  char rate[32];
  std::snprintf(rate, sizeof rate, "%g", s.lr);
  fail(
      "a learning rate in the config is \"auto\", which takes the run's rate (%s), but %s: Hugging Face's Trainer "
      "fills both keys from its one learning_rate and refuses a file whose explicit value differs from it "
      "(fill_match). Give --lr %s, or write \"auto\" in its place",
      said_by(s, "--lr", rate).c_str(), differ.c_str(), config.learning_rate_keys.front().value.c_str());
}

// What a config file means to DeepSpeed beyond its keys: the schedule, and
// DeepSpeed's default for every setting it leaves out that no flag gives
// (one it leaves to "auto" keeps the trainer's default). Defaults are not
// "given": a resumed run takes the checkpoint's value over them.
static void apply_deepspeed_meaning(Settings& s, const ConfigReading& config,
                                    const std::map<std::string, std::string>& flags) {
  choose_schedule(s, config, flags);
  for (const ConfigSetting& deepspeed : config.defaults) {
    if (s.given.count(deepspeed.flag)) continue;
    if (config.auto_flags.count(deepspeed.flag)) {
      s.origins[deepspeed.flag] = "trainer_default:auto";
      continue;
    }
    apply(s, deepspeed.flag, deepspeed.value, "DeepSpeed's default for '" + deepspeed.flag + "'");
    s.given.erase(deepspeed.flag);
    // The optimizer DeepSpeed builds follows the run's offload, a flag's too
    // (engine.py _configure_basic_optimizer: DeepSpeedCPUAdam under offload,
    // FusedAdam without; their defaults are the same). --offload-optimizer's
    // own default comes earlier in the list, so the setting is final here.
    std::string where = deepspeed.key;
    if (where == "FusedAdam" || where == "DeepSpeedCPUAdam")
      where = s.offload_optimizer == "cpu" ? "DeepSpeedCPUAdam" : "FusedAdam";
    s.origins[deepspeed.flag] = "deepspeed_default:" + where;
  }
  for (const std::string& flag : config.auto_flags)
    if (!s.given.count(flag)) s.origins[flag] = "trainer_default:auto";
  // The precision: a block's "enabled", a flag, or DeepSpeed's fp32.
  if (!s.precision_given) {
    // The block that is on decides (wenet's fp16 false beside bf16 true is bf16's); with none on, the first given.
    const char* key = s.config_fp16_enabled == 1   ? "fp16.enabled"
                      : s.config_bf16_enabled == 1 ? "bf16.enabled"
                      : s.config_fp16_enabled >= 0 ? "fp16.enabled"
                      : s.config_bf16_enabled >= 0 ? "bf16.enabled"
                                                   : "";
    const bool left_to_auto = config.auto_flags.count("fp16.enabled") || config.auto_flags.count("bf16.enabled");
    s.origins["--precision"] = *key           ? std::string("config:") + key
                               : left_to_auto ? "trainer_default:auto"
                                              : "deepspeed_default:constants.py";
  }
  // Two of DeepSpeed's behaviours this trainer keeps its own rule for, said
  // where they apply. At stage 0 DeepSpeed's fp16 is FP16_Optimizer (engine.py
  // _configure_fp16_optimizer: from 2^initial_scale_power, 16 by default, no
  // hysteresis); zero2 uses its ZeRO optimizer's scaler at every stage, so
  // that every stage gives the same bits.
  if (s.precision == "fp16" && s.stage == 0)
    s.config_notes.push_back(
        "fp16 at stage 0: DeepSpeed's FP16_Optimizer would start at 2^initial_scale_power (2^16 by default) and "
        "halve on every overflow; this trainer keeps its ZeRO optimizer's loss scaler (shown above) at every stage");
  // Without the key, DeepSpeed accumulates 16-bit gradients in their own
  // type (engine.py get_data_types); zero2 keeps fp32, which keeps (N, A)
  // invariance (notes/08). It matters where micro-steps accumulate.
  const std::string deepspeed_accumulation = s.precision == "bf16" && s.stage == 0 ? "fp32" : s.precision;
  const bool accumulates = s.accum > 1 || s.train_batch_size > 0;
  if (!s.given.count("grad_accum_dtype") && deepspeed_accumulation != s.grad_accum_dtype && accumulates)
    s.config_notes.push_back(
        "data_types.grad_accum_dtype left out: gradients accumulate in fp32 (the trainer's "
        "default); DeepSpeed would accumulate them in " +
        deepspeed_accumulation + " (\"grad_accum_dtype\": \"" + deepspeed_accumulation + "\" asks for that)");
}

// Hugging Face's TrainingArguments flags a user pastes from a run script,
// with the zero2 flag that does that job (run_mlm.py's and the Trainer's
// most common ones; --seed is the same flag here).
static const std::map<std::string, std::string> hugging_face_flags = {
    {"per_device_train_batch_size", "--micro-batch B (sequences per rank per micro-step)"},
    {"train_batch_size", "--micro-batch B (per rank), or a config's train_batch_size (the global batch)"},
    {"gradient_accumulation_steps", "--accum A"},
    {"learning_rate", "--lr LR"},
    {"num_train_epochs", "--steps S (zero2 counts optimizer steps, not epochs)"},
    {"max_steps", "--steps S"},
    {"warmup_steps", "--warmup W"},
    {"warmup_ratio", "--warmup W (in steps: the ratio times --steps)"},
    {"weight_decay", "--weight-decay WD"},
    {"max_grad_norm", "--clip C"},
    {"output_dir", "--save DIR (checkpoints), --export-hf DIR (the model) or --json FILE (the summary)"},
    {"overwrite_output_dir", "--save-overwrite"},
    {"bf16", "--precision bf16"},
    {"fp16", "--precision fp16"},
    {"logging_steps", "--log-every K"},
    {"save_steps", "--save-every K"},
    {"save_total_limit", "--save-keep K"},
    {"eval_steps", "--eval-every K"},
    {"lr_scheduler_type", "--decay linear|none (with --warmup-type), or a config's scheduler block"},
    {"resume_from_checkpoint", "--load DIR"},
    {"gradient_checkpointing", "--activations recompute"},
    {"model_name_or_path", "--init-hf DIR (a BertForMaskedLM directory of the run's sizes)"},
    {"train_file", "--data FILE (UTF-8 text)"},
    {"dataset_name", "--data FILE (UTF-8 text)"},
    {"max_seq_length", "--seq T"},
    {"do_train", "nothing: the trainer always trains (--steps S)"},
    {"adam_beta1", "a config's optimizer.params.betas"},
    {"adam_beta2", "a config's optimizer.params.betas"},
    {"adam_epsilon", "a config's optimizer.params.eps"},
    {"logging_dir", "--metrics FILE"},
    {"report_to", "--metrics FILE (JSON Lines) and --json FILE"}};

// A flag this trainer does not take, refused before its value is read (a
// pasted "--bf16 --learning_rate 1e-4" would otherwise read as "--bf16
// needs a value"), with what to write instead: Hugging Face's spelling, the
// same name with hyphens, or the nearest flag.
[[noreturn]] static void unknown_flag(const std::string& flag) {
  std::string name = flag.substr(2), hyphens = flag;
  for (char& c : name) c = c == '-' ? '_' : c;
  for (char& c : hyphens) c = c == '_' ? '-' : c;
  const auto hugging_face = hugging_face_flags.find(name);
  if (hugging_face != hugging_face_flags.end())
    fail("unknown flag '%s' (Hugging Face's TrainingArguments spelling?): zero2's is %s (train_bert_mini --help "
         "lists the flags)",
         flag.c_str(), hugging_face->second.c_str());
  std::string nearest;
  size_t best = 3;  // at most 2 edits away
  for (const std::string& known : command_line_flags) {
    const size_t distance = known == hyphens ? 0 : edit_distance(flag, known);
    if (distance < best) best = distance, nearest = known;
  }
  if (!nearest.empty())
    fail("unknown flag '%s' (did you mean '%s'?) (train_bert_mini --help lists the flags)", flag.c_str(),
         nearest.c_str());
  fail("unknown flag '%s' (train_bert_mini --help lists the flags)", flag.c_str());
}

// DeepSpeed's and torch's launch flags, in argparse's forms too ("--x=V" as
// well as "--x V"): --deepspeed FILE (Hugging Face's) and --deepspeed_config
// FILE (DeepSpeed's add_config_arguments) are --config FILE; DeepSpeed's own
// --deepspeed is a switch without a value (on: zero2 is always ZeRO);
// --local_rank=N, which the deepspeed launcher appends (and --local-rank,
// torch's newer spelling), is checked against MPI's (trainer/launcher.cpp).
// True when argv[i] was one of them (i then past its value).
static bool launcher_flag(int& i, int argc, char** argv, std::vector<std::pair<std::string, std::string>>& flags) {
  const std::string word = argv[i];
  const size_t equals = word.find('=');
  const std::string name = word.substr(0, equals);
  const bool config = name == "--deepspeed" || name == "--deepspeed_config";
  if (!config && name != "--local_rank" && name != "--local-rank") return false;
  const bool next_is_value = i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0;
  if (name == "--deepspeed" && equals == std::string::npos && !next_is_value) return true;  // the switch
  if (equals == std::string::npos && !next_is_value) fail("%s needs a value", name.c_str());
  const std::string value = equals != std::string::npos ? word.substr(equals + 1) : argv[++i];
  flags.push_back({config ? "--config" : "--local_rank", value});
  return true;
}

// argv as (flag, value) pairs, in order: a switch's value "" (or "1" for
// the two a config key also sets), every other flag's the word after it.
static std::vector<std::pair<std::string, std::string>> read_argv(int argc, char** argv,
                                                                  const std::set<std::string>& switches) {
  std::vector<std::pair<std::string, std::string>> flags;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (switches.count(flag)) {
      const bool on_off = flag == "--wall-clock-breakdown" || flag == "--portable";  // a config key sets these too
      flags.push_back({flag, on_off ? "1" : ""});
      continue;
    }
    if (flag.rfind("--", 0) != 0) fail("unexpected argument '%s' (flags start with --)", flag.c_str());
    if (launcher_flag(i, argc, argv, flags)) continue;
    const size_t equals = flag.find('=');
    const std::string name = flag.substr(0, equals);
    if (std::find(command_line_flags.begin(), command_line_flags.end(), name) == command_line_flags.end())
      unknown_flag(name);
    if (equals != std::string::npos && switches.count(name))
      fail("'%s': %s takes no value (write '%s' to switch it on%s)", flag.c_str(), name.c_str(), name.c_str(),
           name == "--portable" ? "; a config file's \"zero2_portable\": false switches it off" : "");
    if (equals != std::string::npos)
      fail("'%s': write '%s %s' (a flag's value comes after a space)", flag.c_str(), name.c_str(),
           flag.substr(equals + 1).c_str());
    // A missing value shows as the next flag taking its place (negative
    // numbers start with a single dash, so they still pass).
    if (i + 1 >= argc || std::string(argv[i + 1]).rfind("--", 0) == 0) fail("%s needs a value", flag.c_str());
    flags.push_back({flag, argv[++i]});
  }
  return flags;
}

Settings parse_command_line(int argc, char** argv) {
  Settings settings;
  const std::set<std::string> switches = {
      "--quiet",          "--wall-clock-breakdown", "--plan", "--poison-activations", "--portable",
      "--save-overwrite", "--allow-different-bits"};  // no value
  const std::vector<std::pair<std::string, std::string>> flags = read_argv(argc, argv, switches);
  // One config file, the last given (--config, --deepspeed and
  // --deepspeed_config are one flag; the header names a repeat): two files'
  // keys must not mix.
  ConfigReading config;
  std::string config_path;
  for (auto& [flag, value] : flags)
    if (flag == "--config") config_path = value;
  if (!config_path.empty()) {
    settings.config = parse_path("--config", config_path);
    config = read_deepspeed_config(config_path);
    apply_config_keys(settings, config, config_path);
  }
  // A flag given twice: the last counts, as argparse (DeepSpeed's and
  // Hugging Face's launchers) and most Unix tools do, so a script can keep
  // its defaults in one array and append what a run changes. Not silently:
  // the header names it. (A config file's key twice is refused instead: in
  // a file it is a copy-paste mistake, not an override.)
  std::map<std::string, std::string> seen;
  for (auto& [flag, value] : flags) {
    if (seen.count(flag) && !switches.count(flag))  // a switch twice is still on
      settings.repeated_flags.push_back(flag + " given twice ('" + seen[flag] + "', then '" + value +
                                        "'): the last counts");
    seen[flag] = value;
    if (flag == "--quiet") settings.quiet = true;
    else apply(settings, flag, value), settings.origins[flag] = "flag:" + flag;
  }
  resolve_precision(settings);
  if (!settings.config.empty()) {
    apply_fp16_scaler_keys(settings, config);
    check_batch_keys(settings, config, seen);
    apply_deepspeed_meaning(settings, config, seen);
    fill_bucket_auto(settings, config);
    check_prescaling(settings, config);
  }
  check_plan_flags(settings);
  if (!settings.plan) check_offload(settings);  // --plan shows every stage, offloaded where it can be
  if (!settings.plan && !settings.config.empty()) check_client_optimizer_offload(settings, config);
  if (!settings.config.empty()) check_learning_rate_auto(settings, config);
  check_trace_flags(settings);
  return settings;
}

}  // namespace bert
