// trainer/deepspeed_config.cpp — the DeepSpeed config reader
// (trainer/deepspeed_config.h): the file checked as text, parsed with its
// keys once each, its numbers' texts kept as written, every key DeepSpeed
// 0.16.9 reads mapped to a flag, accepted with its reason or refused, a key
// it never reads warned about or refused as DeepSpeed would, and DeepSpeed's
// defaults listed for the keys the file leaves out. Each rule cites the
// DeepSpeed file and function it follows.
#include "trainer/deepspeed_config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <set>

#include "trainer/inputs.h"
#include "trainer/json.h"
#include "trainer/settings.h"

namespace bert {

// A message's text with every byte a terminal would act on (control bytes,
// DEL, a byte that is not UTF-8) as \xNN: the JSON library quotes what it
// last read, raw.
static std::string printable(const std::string& text) {
  std::string shown;
  for (size_t i = 0; i < text.size();) {
    const unsigned char byte = (unsigned char)text[i];
    const size_t bad = byte >= 0x80 ? first_bad_utf8(text.substr(i, 4)) : std::string::npos;
    if (byte < 0x20 || byte == 0x7f || bad == 0) {
      char escaped[8];
      snprintf(escaped, sizeof escaped, "\\x%02x", byte);
      shown += escaped;
      ++i;
      continue;
    }
    size_t length = byte < 0x80 ? 1 : byte < 0xe0 ? 2 : byte < 0xf0 ? 3 : 4;  // a whole UTF-8 sequence
    shown += text.substr(i, length);
    i += length;
  }
  return shown;
}

// Hjson's forgiveness of JSON that real configs use, undone: comments (#,
// //, /* */) dropped, a comma before } or ] dropped, and a comma put where a
// line break separates two values. The text that comes out is strict JSON
// exactly when hjson (3.1.0, which DeepSpeed 0.16.9 calls: runtime/
// config.py:715, hjson.load) reads the file for one of those reasons; what
// Hjson also forgives beyond them (quoteless keys and strings, a root
// without braces) is not undone, so the hint below may be left out where
// Hjson would read a file, never given where it would not (measured: a
// trailing "}," after the root, "Extra data" there, is not undone).
static std::string undo_hjson(const std::string& text) {
  std::string out;
  bool line_break = false;  // since the last significant character
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '"') {  // a string, copied whole (its escapes too)
      size_t end = i + 1;
      while (end < text.size() && text[end] != '"') end += text[end] == '\\' ? 2 : 1;
      const char last = out.empty() ? '\0' : out.back();
      if (line_break && (last == '"' || last == '}' || last == ']' || std::isalnum((unsigned char)last))) out += ',';
      out += text.substr(i, end + 1 - i);
      i = end, line_break = false;
    } else if (c == '#' || (c == '/' && i + 1 < text.size() && text[i + 1] == '/')) {
      while (i + 1 < text.size() && text[i + 1] != '\n') ++i;
    } else if (c == '/' && i + 1 < text.size() && text[i + 1] == '*') {
      const size_t end = text.find("*/", i + 2);
      i = end == std::string::npos ? text.size() : end + 1;
    } else if (c == '\n') {
      line_break = true;
    } else if (!std::isspace((unsigned char)c)) {
      const char last = out.empty() ? '\0' : out.back();
      const bool value_ended = last == '"' || last == '}' || last == ']' || std::isalnum((unsigned char)last);
      const bool value_starts = c == '{' || c == '[' || c == '-' || std::isalnum((unsigned char)c);
      if ((c == '}' || c == ']') && last == ',') out.pop_back();
      else if (line_break && value_ended && value_starts) out += ',';
      out += c, line_break = false;
    }
  }
  return out;
}

// The file as JSON, its keys once each: the JSON library keeps the last of
// two equal keys silently, and a setting written twice is a mistake to name.
// DeepSpeed reads it as UTF-8 text (Python's open() in a UTF-8 locale), then
// as Hjson (runtime/config.py:715): a byte that is not UTF-8 fails there too
// (UnicodeDecodeError, measured), and the Hjson hint is given only where
// Hjson would read the file (undo_hjson).
static json parse_config_json(const std::string& path, const std::string& text) {
  auto twice = [&](const std::string& key) {
    fail("the config file '%s' has the key '%s' twice in one object", path.c_str(), key.c_str());
  };
  const size_t bad = first_bad_utf8(text);
  if (bad != std::string::npos)
    fail(
        "the config file '%s' is not UTF-8 text: the byte \\x%02x at offset %zu (line %zu) begins no UTF-8 "
        "character. DeepSpeed fails on it too (Python's UnicodeDecodeError): save the file as UTF-8",
        path.c_str(), (unsigned char)text[bad], bad, (size_t)std::count(text.begin(), text.begin() + bad, '\n') + 1);
  try {
    return parse_json_keys_once(text, twice);  // strict: nothing may follow the value
  } catch (const json::exception& e) {         // a syntax error, or a number beyond double (1e400)
    bool hjson_reads = false;
    try {
      hjson_reads = !json::parse(undo_hjson(text), nullptr, false).is_discarded();
    } catch (const json::exception&) {
    }
    fail("the config file '%s' is not valid JSON: %s%s", path.c_str(), printable(e.what()).c_str(),
         hjson_reads ? " (DeepSpeed reads configs as Hjson, which forgives this file's missing comma, trailing "
                       "comma or comment; this trainer reads strict JSON: write it as JSON)"
                     : "");
  }
}

// The keys DeepSpeed 0.16.9 knows, by the block they belong to, for two
// things: the nearest-name suggestion for a typo, and telling a key
// DeepSpeed never reads (ignored there, a warning here) from a near-miss of
// a real one (refused). Built from deepspeed/runtime/constants.py and the
// config classes that runtime/config.py (DeepSpeedConfig._initialize_params)
// reads the top level with, runtime/zero/config.py (DeepSpeedZeroConfig's
// fields), zero/offload_config.py, runtime/lr_schedules.py and the
// optimizers' constructors (ops/adam/fused_adam.py FusedAdam,
// torch.optim.AdamW). A key is compared with its own block's names only.
// clang-format off
static const std::map<std::string, std::vector<const char*>> deepspeed_names = {
    {"", {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
          "steps_per_print", "dump_state", "disable_allgather", "communication_data_type",
          "seq_parallel_communication_data_type", "prescale_gradients", "gradient_predivide_factor",
          "sparse_gradients", "zero_optimization", "activation_checkpointing", "comms_logger", "tensorboard", "wandb",
          "csv_monitor", "comet", "fp16", "bf16", "bfloat16", "amp", "compression_training", "graph_harvesting",
          "optimizer", "scheduler", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "flops_profiler",
          "wall_clock_breakdown", "memory_breakdown", "autotuning", "eigenvalue", "quantize_training",
          "use_data_before_expert_parallelism", "hybrid_engine", "sparse_attention", "pipeline",
          "progressive_layer_drop", "curriculum_learning", "data_efficiency", "checkpoint", "data_types", "aio",
          "dataloader_drop_last", "nebula", "weight_quantization", "compile", "timers", "tensor_parallel",
          "elasticity", "vocabulary_size", "allgather_size", "zero2_portable"}},
    {"fp16", {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale",
              "consecutive_hysteresis", "auto_cast", "fp16_master_weights_and_grads"}},
    {"bf16", {"enabled", "immediate_grad_update"}},
    {"data_types", {"grad_accum_dtype"}},
    {"activation_checkpointing", {"partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                                  "number_checkpoints", "synchronize_checkpoint_boundary", "profile"}},
    {"zero_optimization",
     {"stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
      "allgather_partitions", "allgather_bucket_size", "overlap_comm", "load_from_fp32_weights", "elastic_checkpoint",
      "offload_param", "offload_optimizer", "sub_group_size", "cpu_offload_param", "cpu_offload_use_pin_memory",
      "cpu_offload", "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
      "max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save",
      "module_granularity_threshold", "use_all_reduce_for_fetch_params", "ignore_unused_parameters", "legacy_stage1",
      "round_robin_gradients", "zero_hpz_partition_size", "zero_quantized_weights",
      "zero_quantized_nontrainable_weights", "zero_quantized_gradients", "zeropp_loco_param", "mics_shard_size",
      "mics_hierarchical_params_gather", "memory_efficient_linear", "pipeline_loading_checkpoint",
      "override_module_apply", "log_trace_cache_warnings", "stage3_prefetch_bucket_size",
      "stage3_param_persistence_threshold", "stage3_model_persistence_threshold", "stage3_max_live_parameters",
      "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
      "stage3_gather_fp16_weights_on_model_save"}},
    // zero/offload_config.py DeepSpeedZeroOffloadOptimizerConfig's fields (0.16.9).
    {"zero_optimization.offload_optimizer", {"device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read",
                                             "pipeline_write", "fast_init", "ratio"}},
    // comm/config.py CommsLoggerConfig's and profiling/config.py
    // DeepSpeedFlopsProfilerConfig's fields (0.16.9).
    {"comms_logger", {"enabled", "prof_all", "prof_ops", "verbose", "debug"}},
    {"flops_profiler", {"enabled", "recompute_fwd_factor", "profile_step", "module_depth", "top_modules", "detailed",
                        "output_file"}},
    // compile/config.py CompileConfig's fields (0.16.9).
    {"compile", {"deepcompile", "free_activation", "offload_activation", "offload_opt_states", "double_buffer",
                 "symmetric_memory", "debug_log", "offload_parameters", "sync_before_reduce", "sync_after_reduce",
                 "sync_before_allgather", "sync_after_allgather"}},
    {"optimizer", {"type", "params", "legacy_fusion"}},
    {"optimizer.params", {"lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode", "torch_adam",
                          "amsgrad", "set_grad_none", "fused", "foreach", "capturable", "differentiable", "maximize",
                          "max_grad_norm", "fp32_optimizer_states"}},
    {"scheduler", {"type", "params"}},
    {"scheduler.params", {"warmup_num_steps", "warmup_max_lr", "warmup_min_lr", "total_num_steps", "warmup_type",
                          "last_batch_iteration", "warmup_min_ratio", "cos_min_ratio", "cycle_min_lr",
                          "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size",
                          "cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size",
                          "cycle_momentum", "cycle_min_mom", "cycle_max_mom", "decay_mom_rate",
                          "lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
                          "lr_range_test_staircase"}}};
// clang-format on

// Parameters of DeepSpeed's other optimizers: in an AdamW block, DeepSpeed
// passes them to a constructor that has no such argument (TypeError), so
// they are refused, as belonging to a feature not implemented here
// (deepspeed/ops/lamb/fused_lamb.py FusedLamb,
// runtime/fp16/onebit/{adam,zoadam,lamb}.py; torch.optim's Adagrad and SGD).
static const std::map<std::string, std::string> other_features_params = {
    {"max_coeff", "Lamb's"},
    {"min_coeff", "Lamb's"},
    {"eps_inside_sqrt", "Lamb's"},
    {"freeze_step", "OneBitAdam's / OneBitLamb's"},
    {"cuda_aware", "OneBitAdam's / OneBitLamb's"},
    {"comm_backend_name", "OneBitAdam's / OneBitLamb's"},
    {"coeff_beta", "OneBitLamb's"},
    {"factor_max", "OneBitLamb's"},
    {"factor_min", "OneBitLamb's"},
    {"factor_threshold", "OneBitLamb's"},
    {"var_freeze_step", "ZeroOneAdam's"},
    {"var_update_scaler", "ZeroOneAdam's"},
    {"local_step_scaler", "ZeroOneAdam's"},
    {"local_step_clipper", "ZeroOneAdam's"},
    {"lr_decay", "Adagrad's"},
    {"initial_accumulator_value", "Adagrad's"},
    {"momentum", "SGD's"},
    {"dampening", "SGD's"},
    {"nesterov", "SGD's"}};

// The five schedulers of runtime/lr_schedules.py at v0.16.9 and their
// constructors' arguments (each __init__'s signature: WarmupLR :655-661,
// WarmupDecayLR :746-753, WarmupCosineLR :797-804, OneCycle :440-454,
// LRRangeTest :312-318). A param of another type is refused: DeepSpeed's
// constructor raises TypeError on it.
static const std::map<std::string, std::set<std::string>> scheduler_params = {
    {"WarmupLR", {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"}},
    {"WarmupDecayLR",
     {"total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"}},
    {"WarmupCosineLR",
     {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type",
      "last_batch_iteration"}},
    {"OneCycle",
     {"cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size",
      "cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size", "cycle_momentum", "cycle_min_mom",
      "cycle_max_mom", "decay_mom_rate", "last_batch_iteration"}},
    {"LRRangeTest",
     {"lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate", "lr_range_test_staircase",
      "last_batch_iteration"}}};

// Optimizer types DeepSpeed builds that are not AdamW: its own (runtime/
// config.py DEEPSPEED_OPTIMIZERS, matched in any case) and torch.optim's
// (engine.py _configure_basic_optimizer, getattr(torch.optim, name): the
// exact name).
static const std::set<std::string> deepspeed_other_optimizers = {
    "adagrad", "lamb", "onebitadam", "zerooneadam", "onebitlamb", "muadam", "muadamw", "musgd", "lion"};
static const std::set<std::string> torch_optimizers = {
    "SGD", "RMSprop", "Adadelta", "Adamax", "ASGD", "LBFGS", "NAdam", "RAdam", "Rprop", "SparseAdam", "Adafactor"};
// Scheduler types: DeepSpeed looks the name up exactly, in runtime/
// lr_schedules.py, then in torch.optim.lr_scheduler (engine.py
// _scheduler_from_config).
static const std::set<std::string> torch_schedulers = {
    "LambdaLR",     "MultiplicativeLR",  "StepLR",       "MultiStepLR",       "ConstantLR",
    "LinearLR",     "ExponentialLR",     "PolynomialLR", "CosineAnnealingLR", "ChainedScheduler",
    "SequentialLR", "ReduceLROnPlateau", "CyclicLR",     "OneCycleLR",        "CosineAnnealingWarmRestarts"};

class ConfigReader {
 public:
  explicit ConfigReader(const std::string& path) : path_(path) {}

  ConfigReading read() {
    const std::string text = read_config_text(path_);
    const json config = parse_config_json(path_, text);
    if (!config.is_object()) fail("the config file '%s' must hold a JSON object", path_.c_str());
    numbers_ = number_texts(text);  // valid JSON by now
    offload_key_ = offloading_key(config);  // before the optimizer's params, which it decides the constructor of
    // DeepSpeed needs one of the two (runtime/config.py:979-981; the command line judges it with its flags).
    out_.batch_key_given = config.contains("train_batch_size") || config.contains("train_micro_batch_size_per_gpu");
    for (auto& [key, value] : config.items()) top_level(key, value, config);
    // The client's optimizer under offload is judged with the run's offload (trainer/command_line.cpp).
    out_.optimizer_typed = optimizer_typed_;
    out_.force_ds_cpu_optimizer = config.value("zero_force_ds_cpu_optimizer", json(true)) != false;
    settle_learning_rate_and_clipping();
    add_deepspeed_defaults();
    return out_;
  }

 private:
  // --- values ------------------------------------------------------------
  static bool is_auto(const json& value) { return value.is_string() && value.get<std::string>() == "auto"; }
  void refuse(const std::string& key, const std::string& why) { out_.refused.push_back(key + ": " + why); }
  // The nearest name DeepSpeed knows in the key's block (edit distance 1
  // or 2, or the same words in another order: Megatron's comm_overlap for
  // overlap_comm), with the block in front, or "" when none is that near.
  static std::string near_miss(const std::string& key) {
    const size_t dot = key.rfind('.');
    const std::string name = dot == std::string::npos ? key : key.substr(dot + 1);
    const std::string block = dot == std::string::npos           ? ""
                              : key.substr(0, dot) == "bfloat16" ? "bf16"
                                                                 : key.substr(0, dot);
    const auto names = deepspeed_names.find(block);
    if (names == deepspeed_names.end()) return "";
    std::string best;
    size_t best_distance = 3;
    for (const char* known : names->second) {
      const size_t distance = edit_distance(name, known);
      if (distance < best_distance && distance > 0) best_distance = distance, best = known;
    }
    if (best.empty())
      for (const char* known : names->second)
        if (name != known && words(name) == words(known)) best = known;
    return best.empty() ? "" : (dot == std::string::npos ? "" : key.substr(0, dot + 1)) + best;
  }
  // A key of a block DeepSpeed validates (zero_optimization's pydantic model
  // forbids extra fields: runtime/config_utils.py DeepSpeedConfigModel,
  // extra="forbid"; the optimizer's and scheduler's params are constructor
  // arguments): DeepSpeed refuses it too.
  void unknown(const std::string& key) {
    const std::string suggestion = near_miss(key);
    refuse(key, suggestion.empty() ? std::string("not a DeepSpeed key this trainer knows")
                                   : "not a DeepSpeed key this trainer knows (did you mean '" + suggestion + "'?)");
  }
  // A key of a block DeepSpeed reads with dict.get (the top level, fp16,
  // bf16, data_types, activation_checkpointing, the optimizer's and the
  // scheduler's own keys: runtime/config.py, config_utils.py
  // get_scalar_param): DeepSpeed ignores it, so it only warns here. A
  // near-miss of a real key is a typo whose setting would silently not
  // apply, in DeepSpeed too: refused, naming the key it resembles.
  void ignored(const std::string& key, const std::string& why = "") {
    if (!near_miss(key).empty()) return unknown(key);
    out_.warnings.push_back("config key '" + key + "' is " + (why.empty() ? "not a key DeepSpeed reads" : why) +
                            ": DeepSpeed ignores it, and so does this trainer");
  }
  // A name's words (split at '_'), sorted.
  static std::vector<std::string> words(const std::string& name) {
    std::vector<std::string> out(1);
    for (char c : name) {
      if (c == '_') out.emplace_back();
      else out.back().push_back(c);
    }
    std::sort(out.begin(), out.end());
    return out;
  }
  // A DeepSpeed key this trainer does not act on, at the value that means
  // "off" in DeepSpeed; any other value is refused with `why`.
  void off_only(const std::string& key, const json& value, const json& off, const std::string& why) {
    must_be(key, value, off, "a DeepSpeed feature not implemented here (" + why + ")");
  }

  // A number as the text the flag parser reads, as written: integers (an
  // unsigned 2^64 - 1 stays 18446744073709551615) and floats (1e-5 stays
  // 1e-5), never a boolean. Empty when refused.
  std::string number(const json& value, const std::string& key) {
    if (!value.is_number()) {
      refuse(key, "wants a number (got " + json_text(value) + ")");
      return "";
    }
    const auto written = numbers_.texts.find(key);
    if (value.is_number_unsigned()) return std::to_string(value.get<unsigned long long>());
    // -0 is an integer to JSON and 0 to a long long: quoted as "0", a
    // refusal would name a value the file does not hold.
    if (value.is_number_integer() && value.get<long long>() == 0 && written != numbers_.texts.end())
      return written->second;
    if (value.is_number_integer()) return std::to_string(value.get<long long>());
    // A whole number written as a float (DeepSpeed's configs write
    // "reduce_bucket_size": 5e8) is that integer while a double holds it exactly.
    const double real = value.get<double>();
    // Written non-zero but read as 0 (1e-400): the text, for the flag parser
    // to refuse quoting it; as "0" it would silently pass.
    const bool written_nonzero = written != numbers_.texts.end() &&
                                 written->second.find_first_of("123456789") < written->second.find_first_of("eE");
    if (real == 0 && written_nonzero) return written->second;
    char digits[64];
    snprintf(digits, sizeof digits, "%.0f", real);
    if (real == std::floor(real) && std::fabs(real) <= 9007199254740992.0) return digits;  // 2^53
    if (written != numbers_.texts.end()) return written->second;
    snprintf(digits, sizeof digits, "%.17g", real);
    return digits;
  }
  // The value as a flag's text, by the kind the key wants; "auto" leaves the
  // flag to the command line or the trainer's default.
  void set_number(const std::string& flag, const std::string& key, const json& value) {
    if (is_auto(value)) return (void)out_.auto_flags.insert(flag);
    const std::string text = number(value, key);
    if (!text.empty()) out_.flags.push_back({flag, text, key});
  }
  void set_boolean(const std::string& flag, const std::string& key, const json& value) {
    if (is_auto(value)) return (void)out_.auto_flags.insert(flag);
    if (!value.is_boolean()) return refuse(key, "wants true or false (got " + json_text(value) + ")");
    out_.flags.push_back({flag, value.get<bool>() ? "1" : "0", key});
  }
  // Accepted with one value only (anything else is refused with `why`).
  void must_be(const std::string& key, const json& value, const json& expected, const std::string& why) {
    if (!is_auto(value) && value != expected) refuse(key, json_text(value) + " is not supported: " + why);
  }
  // Accepted whatever its value, when it has the right kind: it changes nothing here.
  void accept_boolean(const std::string& key, const json& value) {
    if (!value.is_boolean() && !is_auto(value)) refuse(key, "wants true or false (got " + json_text(value) + ")");
  }
  void accept_number(const std::string& key, const json& value) {
    if (!value.is_number() && !is_auto(value)) refuse(key, "wants a number (got " + json_text(value) + ")");
  }
  bool object(const std::string& key, const json& value) {
    if (!value.is_object()) refuse(key, "wants an object (got " + json_text(value) + ")");
    return value.is_object();
  }
  static std::string lower(std::string text) {
    for (char& c : text) c = (char)std::tolower((unsigned char)c);
    return text;
  }

  // --- the keys ------------------------------------------------------------
  // The top level (runtime/config.py, DeepSpeedConfig._initialize_params):
  // the keys that set something here, then the blocks, then DeepSpeed's
  // features that this trainer has not or needs not.
  void top_level(const std::string& key, const json& value, const json& config) {
    if (key == "train_batch_size") set_number("train_batch_size", key, value);
    else if (key == "train_micro_batch_size_per_gpu") set_number("--micro-batch", key, value);
    else if (key == "gradient_accumulation_steps") set_number("--accum", key, value);
    else if (key == "gradient_clipping") {
      if (is_auto(value)) out_.auto_flags.insert("--clip");
      else clipping_ = {"", number(value, key), key};
    } else if (key == "steps_per_print") set_number("--log-every", key, value);
    else if (key == "wall_clock_breakdown") set_boolean("--wall-clock-breakdown", key, value);
    else if (key == "zero2_portable") set_boolean("--portable", key, value);  // ours, not DeepSpeed's
    else if (key == "fp16" || key == "bf16") precision_block(key, value);
    // DeepSpeed's older name for bf16, read only when bf16 is absent
    // (runtime/config.py get_bfloat16_enabled tries "bf16" first).
    else if (key == "bfloat16") {
      if (config.contains("bf16")) ignored(key, "DeepSpeed's older name for bf16, which this file also has");
      else precision_block(key, value);
    } else if (key == "data_types") data_types(key, value);
    else if (key == "zero_optimization") zero_optimization(key, value);
    else if (key == "optimizer") optimizer(key, value);
    else if (key == "scheduler") scheduler(key, value);
    else if (key == "activation_checkpointing") activation_checkpointing(key, value);
    else if (!feature(key, value)) ignored(key);
  }

  // DeepSpeed's keys of features that are either absent here (refused when
  // switched on) or change nothing here (accepted, the reason beside each).
  // False: not a key DeepSpeed reads.
  bool feature(const std::string& key, const json& value) {
    // The optimizer is AdamW, which ZeRO is tested with; offloaded, the same AdamW runs on the host (the role
    // of DeepSpeed's DeepSpeedCPUAdam). zero_force_ds_cpu_optimizer is judged with the run's offload
    // (trainer/command_line.cpp, check_client_optimizer_offload).
    if (key == "zero_allow_untested_optimizer" || key == "zero_force_ds_cpu_optimizer") accept_boolean(key, value);
    else if (key == "prescale_gradients" || key == "gradient_predivide_factor") prescaling(key, value);
    else if (key == "amp")
      switched_off(key, value, "apex AMP is not used: --precision bf16|fp16, or the bf16 / fp16 blocks");
    else if (key == "tensorboard" || key == "wandb" || key == "csv_monitor" || key == "comet") monitor(key, value);
    else if (key == "comms_logger") comms_logger(key, value);
    else if (key == "flops_profiler") flops_profiler(key, value);
    else if (key == "compile") compile(key, value);
    else if (key == "elasticity" || key == "autotuning" || key == "data_efficiency" || key == "curriculum_learning" ||
             key == "hybrid_engine" || key == "eigenvalue" || key == "quantize_training" ||
             key == "progressive_layer_drop" || key == "nebula")
      switched_off(key, value, "a DeepSpeed feature not implemented here");
    // Blocks with no switch: their presence asks for the feature.
    else if (key == "sparse_attention" || key == "pipeline" || key == "compression_training" ||
             key == "weight_quantization")
      refuse(key, "a DeepSpeed feature not implemented here");
    else if (key == "tensor_parallel") tensor_parallel(key, value);
    // The ledger is always measured and printed (and in --json).
    else if (key == "memory_breakdown") accept_boolean(key, value);
    // DeepSpeed's own checkpoint options (tags, parallel writes): --save and
    // --load here (notes/09); aio configures ZeRO-Infinity's NVMe swapping and
    // timers DeepSpeed's throughput log, neither of which exists here.
    else if (key == "checkpoint" || key == "aio" || key == "timers") object(key, value);
    else if (key == "sparse_gradients") off_only(key, value, false, "every gradient is dense here");
    // DeepSpeed prints the engine's attributes once at start-up (engine.py
    // DeepSpeedEngine.__init__: if self.dump_state(): print_configuration);
    // nothing a step computes reads it.
    else if (key == "dump_state") {
      accept_boolean(key, value);
      if (value == true)
        out_.notes.push_back(
            "dump_state true: DeepSpeed would print its engine's attributes at start-up (engine.py "
            "print_configuration); zero2 does not (the header is its account; --dump-batch writes step 0's state)");
    } else if (key == "communication_data_type")
      off_only(key, value, nullptr, "the wire carries the working precision, summed in fp32 (notes/08)");
    // Settings of what is not here: DeepSpeed's data loader (the trainer
    // reads its own data), sequence and expert parallelism, CUDA graphs of
    // the bf16 optimizer; disable_allgather is read but used by nothing in
    // DeepSpeed 0.16.9, vocabulary_size only checked for a multiple of 8.
    else if (key == "dataloader_drop_last" || key == "use_data_before_expert_parallelism" ||
             key == "graph_harvesting" || key == "disable_allgather")
      accept_boolean(key, value);
    else if (key == "seq_parallel_communication_data_type") {
      if (!value.is_string()) refuse(key, "wants a string (got " + json_text(value) + ")");
    } else if (key == "vocabulary_size") accept_number(key, value);
    // The boolean zero_optimization's bucket (zero/config.py read_zero_config_deprecated).
    else if (key == "allgather_size") accept_number(key, value);
    else return false;
    return true;
  }
  // DeepSpeed's monitors (monitor/config.py get_monitor_config: each block
  // a pydantic model, TensorBoardConfig, WandbConfig, CSVConfig,
  // CometConfig, that forbids other fields). Enabled, a monitor writes the
  // loss and the timers' milliseconds to its logger on rank 0 (engine.py
  // backward and _write_monitor, through MonitorMaster.write_events): it
  // reads what a step computed and changes none of it, so it is accepted
  // with a note that zero2 does not log there.
  void monitor(const std::string& key, const json& value) {
    static const std::map<std::string, std::set<std::string>> fields = {
        {"tensorboard", {"enabled", "output_path", "job_name"}},
        {"wandb", {"enabled", "group", "team", "project"}},
        {"csv_monitor", {"enabled", "output_path", "job_name"}},
        {"comet",
         {"enabled", "samples_log_interval", "project", "workspace", "api_key", "experiment_name", "experiment_key",
          "online", "mode"}}};
    if (!object(key, value)) return;
    for (auto& [inner, setting] : value.items())
      if (!fields.at(key).count(inner))
        refuse(key + "." + inner, "not a field of DeepSpeed's " + key +
                                      " monitor (monitor/config.py, a pydantic model that forbids other fields)");
    if (!value.contains("enabled")) return;
    accept_boolean(key + ".enabled", value["enabled"]);
    if (value["enabled"] == true)
      out_.notes.push_back(key + ".enabled true: DeepSpeed would log the loss and its timers to " + key +
                           " on rank 0 (engine.py, MonitorMaster); zero2 does not (--json and --metrics record the "
                           "run); the training is the same");
  }
  // DeepSpeed's communication logger (comm/config.py: DeepSpeedCommsConfig
  // builds CommsLoggerConfig(**block), a pydantic model that forbids other
  // fields, whenever the block is present; engine.py DeepSpeedEngine.__init__
  // hands it to dist.configure). Enabled, comm/comm.py timed_op times each
  // collective, synchronizing the device after it, and log_summary prints
  // the times when the client calls it: it changes no value a collective
  // carries, so it is accepted with a note that zero2 does not log them.
  void comms_logger(const std::string& key, const json& value) {
    if (!object(key, value)) return;
    for (auto& [inner, setting] : value.items()) {
      const std::string name = key + "." + inner;
      if (inner == "enabled" || inner == "prof_all" || inner == "verbose" || inner == "debug")
        accept_boolean(name, setting);
      else if (inner == "prof_ops") {
        if (!setting.is_array() && !is_auto(setting)) refuse(name, "wants a list (got " + json_text(setting) + ")");
      } else {
        const std::string suggestion = near_miss(name);
        refuse(name,
               "not a field of DeepSpeed's CommsLoggerConfig (comm/config.py, a pydantic model that forbids "
               "other fields)" +
                   (suggestion.empty() ? "" : " (did you mean '" + suggestion + "'?)"));
      }
    }
    if (value.value("enabled", json(false)) == true)
      out_.notes.push_back(
          "comms_logger.enabled true: DeepSpeed would time each collective (comm/comm.py timed_op, synchronizing "
          "the device after it) for log_summary to print; zero2 does not (--json and --metrics record the run); "
          "the training is the same");
  }
  // DeepSpeed's flops profiler (profiling/config.py
  // DeepSpeedFlopsProfilerConfig: each field read with get_scalar_param, so
  // an unknown one is ignored, not refused). Enabled, engine.py forward
  // profiles the forward of step profile_step on rank 0 (FlopsProfiler
  // counts each module's operations around the same calls) and prints it,
  // and runtime/config.py turns wall_clock_breakdown on with it
  // (wall_clock_breakdown | flops_profiler.enabled, where a non-boolean
  // raises TypeError): no value changes, so it is accepted with a note.
  void flops_profiler(const std::string& key, const json& value) {
    if (!object(key, value)) return;
    for (auto& [inner, setting] : value.items()) {
      const std::string name = key + "." + inner;
      if (inner == "enabled") {
        if (!setting.is_boolean()) refuse(name, "wants true or false (got " + json_text(setting) + ")");
      } else if (inner == "detailed") accept_boolean(name, setting);
      else if (inner == "profile_step" || inner == "module_depth" || inner == "top_modules") {
        if (!setting.is_number_integer()) refuse(name, "wants an integer (got " + json_text(setting) + ")");
      } else if (inner == "recompute_fwd_factor") accept_number(name, setting);
      else if (inner == "output_file") {
        if (!setting.is_string() && !setting.is_null())
          refuse(name, "wants a file name or null (got " + json_text(setting) + ")");
      } else ignored(name);
    }
    if (value.value("enabled", json(false)) == true)
      out_.notes.push_back("flops_profiler.enabled true: DeepSpeed would profile step " +
                           json_text(value.value("profile_step", json(1))) +
                           "'s forward on rank 0 and print its flops (engine.py forward, FlopsProfiler), and turn "
                           "wall_clock_breakdown on (runtime/config.py); zero2 does neither (--wall-clock-breakdown "
                           "times forward, backward and the step); the training is the same");
  }
  // DeepSpeed's AutoTP training (runtime/tensor_parallel/config.py
  // TPTrainingConfig, a pydantic model that forbids other fields): the
  // engine splits the model only when autotp_size > 1 (engine.py
  // DeepSpeedEngine.__init__: if self.autotp_size() > 1:
  // _configure_tensor_parallel); its default 0, and 1, leave the model
  // whole, and the block's other fields are read only by that split.
  void tensor_parallel(const std::string& key, const json& value) {
    static const std::set<std::string> fields = {"dtype",
                                                 "autotp_size",
                                                 "tp_overlap_comm",
                                                 "tensor_parallel",
                                                 "tp",
                                                 "injection_policy_tuple",
                                                 "keep_module_on_host",
                                                 "replace_with_kernel_inject",
                                                 "kernel_inject"};
    if (!object(key, value)) return;
    for (auto& [inner, setting] : value.items())
      if (!fields.count(inner))
        refuse(key + "." + inner,
               "not a field of DeepSpeed's TPTrainingConfig (runtime/tensor_parallel/config.py, a pydantic model "
               "that forbids other fields)");
    const json size = value.value("autotp_size", json(0));
    if (is_auto(size)) return;
    if (!size.is_number_integer())
      return refuse(key + ".autotp_size", "wants an integer (got " + json_text(size) + ")");
    if (size.get<long long>() > 1)
      return refuse(key + ".autotp_size", json_text(size) +
                                              " is not supported: AutoTP tensor parallelism (DeepSpeed splits the "
                                              "model when autotp_size > 1) is a DeepSpeed feature not implemented "
                                              "here; 0 or 1 leaves the model whole");
    out_.notes.push_back(key + ": autotp_size " + json_text(size) +
                         " leaves the model whole, in DeepSpeed (AutoTP splits it only above 1) as here; the "
                         "block's other fields act only on that split");
  }
  // torch.compile and DeepCompile (compile/config.py CompileConfig, which
  // runtime/config.py builds as CompileConfig(**param_dict.get('compile',
  // {})): a pydantic model that forbids other fields, so an unknown one
  // fails DeepSpeed's start-up with a ValidationError; "auto" values are
  // dropped first, as in every DeepSpeedConfigModel). The block compiles
  // nothing by itself: the client calls engine.compile() (engine.py
  // DeepSpeedEngine.compile), and only its deepcompile field changes what
  // that call does (DeepCompile's passes, init_z1 / init_z3); the other
  // fields are DeepCompile's options, read only under it. 0.16.9's model has
  // no "enabled" (later configs' and other tools' spelling): refused, as
  // DeepSpeed refuses it.
  void compile(const std::string& key, const json& value) {
    if (!object(key, value)) return;
    std::string options;
    for (auto& [inner, setting] : value.items()) {
      const std::string name = key + "." + inner;
      if (inner == "deepcompile")
        must_be(name, setting, false,
                "DeepCompile (the engine's own compiler passes, engine.py DeepSpeedEngine.compile) is a DeepSpeed "
                "feature not implemented here");
      else if (std::find_if(deepspeed_names.at("compile").begin(), deepspeed_names.at("compile").end(),
                            [&](const char* field) { return inner == field; }) != deepspeed_names.at("compile").end()) {
        accept_boolean(name, setting);
        if (!is_auto(setting)) options += (options.empty() ? "" : ", ") + inner;
      } else {
        const std::string suggestion = near_miss(name);
        refuse(name,
               "not a field of DeepSpeed 0.16.9's CompileConfig (compile/config.py: a pydantic model that "
               "forbids other fields, so DeepSpeed fails with a ValidationError" +
                   std::string(inner == "enabled" ? "; compiling is the client's call of engine.compile()" : "") + ")" +
                   (suggestion.empty() ? "" : " (did you mean '" + suggestion + "'?)"));
      }
    }
    if (!options.empty())
      out_.notes.push_back("compile: " + options +
                           " set DeepCompile's options, which DeepSpeed reads only with deepcompile true (engine.py "
                           "DeepSpeedEngine.compile); without it they change nothing, there as here");
  }
  // DeepSpeed's scaling of each rank's gradient around the sum over the
  // ranks: what it does depends on the stage, which a flag may change, so
  // the command line judges it (trainer/command_line.cpp, check_prescaling).
  void prescaling(const std::string& key, const json& value) {
    const bool prescale = key == "prescale_gradients";
    if (is_auto(value) || value == json(prescale ? json(false) : json(1))) return;
    if (prescale ? !value.is_boolean() : !value.is_number())
      return refuse(key, std::string(prescale ? "wants true or false" : "wants a number") + " (got " +
                             json_text(value) + ")");
    out_.prescaling.push_back({"", json_text(value), key});
  }

  // A block accepted only when it says "enabled": false (or has no "enabled").
  void switched_off(const std::string& key, const json& value, const std::string& why) {
    if (!object(key, value)) return;
    if (value.contains("enabled") && value["enabled"] != false) refuse(key + ".enabled", why);
  }

  // DeepSpeed's mixed-precision blocks (notes/08), read with get_scalar_param
  // (runtime/config.py get_fp16_enabled ... get_dynamic_loss_scale_args): an
  // unknown key is ignored there. The loss scaler's keys act, and are
  // checked, only in a run that trains in fp16, as DeepSpeed reads them
  // only then (a bf16 run's file may keep an fp16 block with
  // "min_loss_scale": 0 or anything else).
  void precision_block(const std::string& key, const json& value) {
    if (!object(key, value)) return;
    const bool fp16 = key == "fp16";
    const std::string block = fp16 ? "fp16" : "bf16";  // (bfloat16 acts as bf16)
    if (value.contains("enabled")) set_boolean(block + ".enabled", key + ".enabled", value["enabled"]);
    static const std::set<std::string> fp16_numbers = {"loss_scale", "initial_scale_power", "loss_scale_window",
                                                       "hysteresis", "min_loss_scale"};
    // The scaler's keys are read only when fp16 is on (runtime/config.py:195-200 get_loss_scale, :216-242
    // get_dynamic_loss_scale_args: nothing of the block but "enabled" is read otherwise, nor checked): set
    // and checked apart, for the command line to apply once the run's precision is known.
    std::swap(out_.flags, out_.fp16_flags);
    std::swap(out_.refused, out_.fp16_refused);
    for (auto& [inner, setting] : value.items())
      if (fp16 && fp16_numbers.count(inner)) set_number(inner, key + "." + inner, setting);
      else if (fp16 && inner == "consecutive_hysteresis") set_boolean(inner, key + "." + inner, setting);
    std::swap(out_.flags, out_.fp16_flags);
    std::swap(out_.refused, out_.fp16_refused);
    for (auto& [inner, setting] : value.items()) {
      const std::string name = key + "." + inner;
      if (inner == "enabled" || (fp16 && (fp16_numbers.count(inner) || inner == "consecutive_hysteresis"))) continue;
      // DeepSpeed casts a forward's floating-point inputs to fp16; this
      // model's inputs are token ids, which it leaves as they are.
      else if (fp16 && inner == "auto_cast") accept_boolean(name, setting);
      // DeepSpeed allows it only with ZeRO-Offload and DeepSpeedCPUAdam
      // (zero/stage_1_and_2.py asserts so), which then keeps an fp16 master
      // and fp16 gradients on the host: another update, other bits.
      else if (fp16 && inner == "fp16_master_weights_and_grads")
        must_be(name, setting, false,
                "the master weights and the reduced gradients are fp32 here, offloaded or not (notes/08); "
                "DeepSpeed's fp16 master (ZeRO-Offload with DeepSpeedCPUAdam only) would round every update");
      else if (!fp16 && inner == "immediate_grad_update") accept_boolean(name, setting);  // a BF16_Optimizer ordering
      else ignored(name);
    }
    // Which defaults the loss scaler's other keys take (add_deepspeed_defaults).
    for (const char* scaler_key :
         {"initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis", "min_loss_scale"})
      if (fp16 && value.contains(scaler_key)) loss_scaler_keys_ = true;
  }

  void data_types(const std::string& key, const json& value) {
    if (!object(key, value)) return;
    for (auto& [inner, setting] : value.items()) {
      const std::string name = key + "." + inner;
      if (inner != "grad_accum_dtype") {
        ignored(name);  // runtime/config.py reads the block with dict.get
        continue;
      }
      // DeepSpeed's spellings of the three types.
      static const std::map<std::string, std::string> names = {
          {"fp32", "fp32"}, {"float32", "fp32"},  {"float", "fp32"},  {"torch.float32", "fp32"},
          {"bf16", "bf16"}, {"bfloat16", "bf16"}, {"bfloat", "bf16"}, {"torch.bfloat16", "bf16"},
          {"fp16", "fp16"}, {"float16", "fp16"},  {"half", "fp16"},   {"torch.float16", "fp16"}};
      const auto found = setting.is_string() ? names.find(setting.get<std::string>()) : names.end();
      if (found == names.end()) refuse(name, "wants \"fp32\", \"bf16\" or \"fp16\" (got " + json_text(setting) + ")");
      else out_.flags.push_back({"grad_accum_dtype", found->second, name});
    }
  }

  // runtime/zero/config.py, DeepSpeedZeroConfig: a pydantic model that
  // rejects a field it does not have, so an unknown key is refused here too.
  void zero_optimization(const std::string& key, const json& value) {
    // DeepSpeed's older form (its getting-started page still shows it):
    // true is stage 1, false stage 0 (zero/config.py read_zero_config_deprecated).
    if (value.is_boolean()) return out_.flags.push_back({"--stage", value.get<bool>() ? "1" : "0", key});
    if (!object(key, value)) return;
    both_offload_keys_ = value.contains("cpu_offload") && value.contains("offload_optimizer");
    const json offload = value.value("offload_optimizer", json());
    pin_memory_given_ = offload.is_object() && offload.contains("pin_memory");
    nvme_path_missing_ = offload.is_object() && offload.value("nvme_path", json()).is_null();
    for (auto& [inner, setting] : value.items()) {
      const std::string name = key + "." + inner;
      if (zero_key_sets_something(inner, name, setting)) continue;
      // Orderings and checks that change nothing here: every parameter is
      // used, checkpoints hold fp32 and reshard anyway (notes/09).
      if (inner == "round_robin_gradients" || inner == "ignore_unused_parameters" ||
          inner == "load_from_fp32_weights" || inner == "elastic_checkpoint" ||
          inner == "use_multi_rank_bucket_allreduce" || inner == "memory_efficient_linear")
        accept_boolean(name, setting);
      // Stage 3's keys (under either of DeepSpeed's names) act only in stage
      // 3, as in DeepSpeed; cpu_offload_param is offload_param's old name.
      else if (inner.rfind("stage3_", 0) == 0 || inner == "sub_group_size" || inner == "prefetch_bucket_size" ||
               inner == "param_persistence_threshold" || inner == "model_persistence_threshold" ||
               inner == "max_live_parameters" || inner == "max_reuse_distance" ||
               inner == "gather_16bit_weights_on_model_save" || inner == "module_granularity_threshold" ||
               inner == "use_all_reduce_for_fetch_params" || inner == "cpu_offload_param" ||
               inner == "pipeline_loading_checkpoint" || inner == "override_module_apply" ||
               inner == "log_trace_cache_warnings") {
      }
      // ZeRO++ and MiCS, at their "off" values.
      else if (inner == "zero_quantized_weights" || inner == "zero_quantized_gradients" ||
               inner == "zero_quantized_nontrainable_weights" || inner == "mics_hierarchical_params_gather")
        off_only(name, setting, false, "ZeRO++ / MiCS");
      else if (inner == "zeropp_loco_param") off_only(name, setting, nullptr, "ZeRO++'s LoCo");
      else if (inner == "zero_hpz_partition_size") off_only(name, setting, 1, "ZeRO++'s hierarchical partitions");
      else if (inner == "mics_shard_size") off_only(name, setting, -1, "MiCS");
      // DeepSpeed itself refuses the legacy stage 1 (engine.py _configure_zero_optimizer raises).
      else if (inner == "legacy_stage1") off_only(name, setting, false, "DeepSpeed >= 0.5.9 refuses it too");
      else unknown(name);
    }
    if (!allgather_bucket_.empty() && allgather_bucket_ != reduce_bucket_)
      out_.notes.push_back("zero_optimization.allgather_bucket_size " + allgather_bucket_ +
                           ": the parameters are all-gathered in the reduce buckets (" + reduce_bucket_ +
                           " elements); bucket sizes change the speed, not the bits");
  }
  // The zero_optimization keys that set something or must have one value.
  bool zero_key_sets_something(const std::string& inner, const std::string& name, const json& setting) {
    if (inner == "stage") {
      if (setting.is_number_integer() && setting.get<long>() == 3)
        refuse(name, "3 is not supported: stage 3 (P_p, the parameters partitioned) is not implemented; 0, 1 or 2");
      else set_number("--stage", name, setting);
    } else if (inner == "reduce_bucket_size") {
      set_number("--bucket", name, setting);
      if (setting.is_number()) reduce_bucket_ = number(setting, name);
      else if (is_auto(setting)) reduce_bucket_ = "hidden_size^2";  // Hugging Face's fill (trainer/command_line.cpp)
    } else if (inner == "allgather_bucket_size") {
      if (!is_auto(setting)) allgather_bucket_ = number(setting, name);
    } else if (inner == "overlap_comm") set_boolean("--overlap", name, setting);
    // Where DeepSpeed keeps the gradients, and a key its ZeRO-1/2 never
    // reads: false is a buffer layout, no arithmetic. contiguous_gradients
    // false reduces each bucket from the gradients' own tensors by an
    // all-reduce then a division by N (zero/stage_1_and_2.py:1372-1390
    // reduce_ipg_grads, buffered_reduce_fallback) instead of a contiguous
    // buffer's average_tensor: a sum over the ranks divided once either way.
    // allgather_partitions is read into the config (engine.py:988-989) and
    // handed to no ZeRO-1/2 optimizer in 0.16.9 (stage_1_and_2.py never
    // names it). zero2 keeps its one buffer and canonical sums: the same bits.
    else if (inner == "contiguous_gradients" || inner == "allgather_partitions") {
      accept_boolean(name, setting);
      if (setting == false)
        out_.notes.push_back(
            name + " false changes no arithmetic here: " +
            (inner == "contiguous_gradients"
                 ? "DeepSpeed then reduces each bucket from the gradients' own tensors instead of one contiguous "
                   "buffer (zero/stage_1_and_2.py reduce_ipg_grads), a layout, not a sum; zero2 keeps its one "
                   "buffer, the same bits"
                 : "DeepSpeed 0.16.9's ZeRO-1/2 optimizer never reads it (engine.py:988-989 reads it into the "
                   "config; stage_1_and_2.py does not name it); zero2 all-gathers, the same bits"));
    }
    else if (inner == "reduce_scatter")
      must_be(name, setting, true, "gradients are always reduce-scattered here (the deterministic all-to-all)");
    else if (inner == "offload_optimizer") offload_optimizer(name, setting);
    else if (inner == "cpu_offload") cpu_offload(name, setting);
    else if (inner == "cpu_offload_use_pin_memory") {
      // Deprecated with set_new_param False (zero/config.py): DeepSpeed only
      // warns and sets nothing, not even pin_memory; zero2 pins anyway.
      accept_boolean(name, setting);
      out_.warnings.push_back("config key '" + name +
                              "' is deprecated: DeepSpeed 0.16.9 warns and sets nothing from it (not even "
                              "offload_optimizer.pin_memory), and so does this trainer");
    } else if (inner == "offload_param") offload_param(name, setting);  // stage 3 only, as in DeepSpeed
    else return false;
    return true;
  }
  void offload_param(const std::string& key, const json& value) {
    if (value.is_null() || !object(key, value)) return;  // null: DeepSpeed's default, no offload
    if (value.value("device", json("none")) != "none")
      out_.notes.push_back(key + " has no effect below stage 3 (as in DeepSpeed)");
  }
  // ZeRO-Offload (Ren et al., USENIX ATC 2021): DeepSpeed 0.16.9's
  // DeepSpeedZeroOffloadOptimizerConfig (runtime/zero/offload_config.py), a
  // pydantic model that forbids other keys. Its ZeRO-1/2 optimizer reads
  // two of them: any device but "none" offloads, and pin_memory
  // (zero/stage_1_and_2.py DeepSpeedZeroOptimizer.__init__); the rest serve
  // NVMe swapping (ZeRO-Infinity, stage 3's swap_tensor/) or stage 3's
  // partial offload. "auto" leaves the choice to the command line.
  void offload_optimizer(const std::string& key, const json& value) {
    if (value.is_null() || !object(key, value)) return;  // null: DeepSpeed's default, no offload
    const json device = value.value("device", json("none"));
    for (auto& [inner, setting] : value.items()) offload_optimizer_key(key + "." + inner, inner, setting, device);
    if (is_auto(device)) out_.auto_flags.insert("--offload-optimizer");
    else if (device == "cpu" || device == "none")
      out_.flags.push_back({"--offload-optimizer", device.get<std::string>(), key + ".device"});
    if (device == "cpu") pinned_note(key + ".pin_memory", value.value("pin_memory", json(false)));
  }
  void offload_optimizer_key(const std::string& name, const std::string& inner, const json& setting,
                             const json& device) {
    const std::string nvme_only = " serves NVMe offload (ZeRO-Infinity); with device " + json_text(device) +
                                  " DeepSpeed's stage 1 and 2 optimizer never reads it (zero/stage_1_and_2.py "
                                  "reads device and pin_memory), and neither does this trainer";
    if (inner == "device") offload_device(name, setting, device);
    else if (inner == "pin_memory") {
      if (!setting.is_boolean() && !is_auto(setting))  // (DeepSpeed's pydantic would also read "true" and 1)
        refuse(name, "wants true or false, a JSON boolean without quotes (got " + json_text(setting) + ")");
    } else if (inner == "nvme_path") {
      if (!setting.is_string() && !setting.is_null()) refuse(name, "wants a path (got " + json_text(setting) + ")");
    } else if (inner == "buffer_count") {
      if (!is_auto(setting) && !(setting.is_number_integer() && setting.get<long long>() >= 0))
        refuse(name, "wants an integer of at least 0 (got " + json_text(setting) + ")");
      else if (setting != 4 && !is_auto(setting)) out_.warnings.push_back("config key '" + name + "'" + nvme_only);
    } else if (inner == "pipeline_read" || inner == "pipeline_write") {
      accept_boolean(name, setting);
      if (setting == true) out_.warnings.push_back("config key '" + name + "'" + nvme_only);
    } else if (inner == "fast_init")  // (declared, but read by no code of DeepSpeed 0.16.9)
      must_be(name, setting, false,
              "fast optimizer initialization is NVMe offload's (ZeRO-Infinity), which is not implemented here");
    else if (inner == "ratio") offload_ratio(name, setting);
    else unknown(name);
  }
  void offload_device(const std::string& name, const json& setting, const json& device) {
    if (is_auto(setting) || device == "cpu" || device == "none") return;
    if (device == "nvme")
      refuse(name, std::string("\"nvme\" is not supported: NVMe offload (ZeRO-Infinity) is not implemented; ") +
                       "\"cpu\" keeps the optimizer state in host memory, as DeepSpeed's stage 1 and 2 do for "
                       "\"nvme\" too (zero/stage_1_and_2.py offloads to the cpu for any device but \"none\")" +
                       (nvme_path_missing_ ? "; and without nvme_path DeepSpeed's stage 3 fails (stage3.py joins "
                                             "the None path)"
                                           : "") +
                       ". Use \"device\": \"cpu\"");
    else
      refuse(name, json_text(setting) +
                       " is not a device DeepSpeed knows (zero/offload_config.py "
                       "OffloadDeviceEnum: \"none\", \"cpu\", \"nvme\"): \"cpu\" offloads, "
                       "\"none\" keeps the optimizer state on the device");
  }
  // DeepSpeed's Field(1.0, ge=0.0, le=1.0); below 1 its partial offload,
  // which zero/config.py offload_ratio_check allows in stage 3 only.
  void offload_ratio(const std::string& name, const json& setting) {
    if (is_auto(setting)) return;
    if (!setting.is_number() || setting.get<double>() < 0 || setting.get<double>() > 1)
      return refuse(name, "wants a number from 0 to 1 (got " + json_text(setting) + ")");
    if (setting.get<double>() < 1)
      refuse(name, json_text(setting) +
                       " is not supported: partial offload (a ratio of the optimizer state on the host) is stage "
                       "3's; DeepSpeed asserts \"Partial offloading only supported for ZeRO Stage 3.\" "
                       "(zero/config.py offload_ratio_check). 1 offloads all of it");
  }
  // zero2 pins the host state always (on the cpu device host and "device"
  // are one memory): unpinned pages could not be copied while backward
  // runs, and pinning changes the speed, never the bits.
  void pinned_note(const std::string& key, const json& pin) {
    if (pin == false)
      out_.pinning_note = (key + " false" + (pin_memory_given_ ? "" : " (DeepSpeed 0.16.9's default)") +
                           ": zero2 pins the offloaded optimizer state anyway, so that its copies overlap "
                           "backward (DeepSpeed would keep it in pageable memory); the bits are the same");
  }
  // DeepSpeed's older spelling (zero/config.py: deprecated, new_param
  // offload_optimizer, new_param_fn: true is {"device": "cpu"} with the
  // other fields at their defaults, false none). Both spellings together
  // fail DeepSpeed's assertion (config_utils.py _process_deprecated_field).
  void cpu_offload(const std::string& name, const json& setting) {
    if (is_auto(setting)) return (void)out_.auto_flags.insert("--offload-optimizer");
    if (!setting.is_boolean()) return refuse(name, "wants true or false (got " + json_text(setting) + ")");
    if (both_offload_keys_)
      return refuse(name,
                    "given together with zero_optimization.offload_optimizer: DeepSpeed asserts \"Cannot provide "
                    "deprecated parameter 'cpu_offload' and replacing parameter 'offload_optimizer' "
                    "together\" (runtime/config_utils.py): keep offload_optimizer");
    out_.flags.push_back({"--offload-optimizer", setting == true ? "cpu" : "none", name});
    if (setting == true) pinned_note("zero_optimization.offload_optimizer.pin_memory", json(false));
  }

  // The optimizer (engine.py _configure_basic_optimizer): "Adam" and
  // "AdamW" in any case are AdamW (adam_w_mode defaults to true), built as
  // DeepSpeed's FusedAdam, or with "torch_adam": true as torch.optim.AdamW;
  // the params are its constructor's arguments, so an unknown one is
  // refused (TypeError there). A block without "type" is ignored by
  // DeepSpeed (runtime/config.py get_optimizer_name, get_optimizer_params):
  // it trains with the client's optimizer, here the trainer's AdamW.
  void optimizer(const std::string& key, const json& value) {
    if (!object(key, value)) return;
    if (!value.contains("type"))
      return out_.warnings.push_back(
          "config block 'optimizer' has no \"type\": DeepSpeed ignores the block, its params too, and trains with "
          "the client's optimizer (here the trainer's AdamW with its defaults)");
    const json params = value.value("params", json::object());
    optimizer_type(value["type"], params);
    if (params.is_object()) torch_adam_ = params.value("torch_adam", json(false)) == true;
    for (auto& [inner, setting] : value.items()) {
      const std::string name = key + "." + inner;
      if (inner == "type") continue;
      if (inner == "legacy_fusion")
        accept_boolean(name, setting);  // FP16_Optimizer's call of FusedAdam: the same update
      else if (inner != "params") ignored(name);
      else if (object(name, setting))
        for (auto& [param, entry] : setting.items()) optimizer_param(param, entry, name + "." + param);
    }
  }
  void optimizer_type(const json& type, const json& params) {
    if (!type.is_string()) return refuse("optimizer.type", "wants a string (got " + json_text(type) + ")");
    const std::string name = type.get<std::string>(), lowered = lower(name);
    const std::string adamw = "the optimizer is AdamW (\"AdamW\", or \"Adam\" with adam_w_mode true)";
    optimizer_typed_ = true;
    adam_ = lowered == "adam" || lowered == "adamw";
    if (adam_) {
      // DeepSpeed's "Adam" is AdamW unless adam_w_mode is false (its default is true).
      const bool adam_w = lowered == "adamw" || !params.is_object() || params.value("adam_w_mode", json(true)) == true;
      if (!adam_w)
        refuse("optimizer.params.adam_w_mode",
               "false (Adam with L2 regularization in the gradient) is not "
               "implemented: the optimizer is AdamW, DeepSpeed's default for \"Adam\"");
    } else if (deepspeed_other_optimizers.count(lowered))
      refuse("optimizer.type",
             json_text(type) + " is not supported: a DeepSpeed feature not implemented here; " + adamw);
    else if (name == "SGD")  // DeepSpeed runs it (torch.optim.SGD; under ZeRO with zero_allow_untested_optimizer)
      refuse("optimizer.type",
             "\"SGD\" is not supported: DeepSpeed builds torch.optim.SGD for it (engine.py "
             "_configure_basic_optimizer; under ZeRO only with \"zero_allow_untested_optimizer\": true, engine.py:"
             "1332-1335), another update rule (a momentum buffer, no second moment), which this trainer does not "
             "implement: its one optimizer is AdamW, whose state (fp32 master, m, v: 12 bytes per parameter) is "
             "what ZeRO partitions and what the ledgers count; " + adamw);
    else if (torch_optimizers.count(name))
      refuse("optimizer.type", json_text(type) + " is not supported: DeepSpeed builds torch.optim." + name +
                                   " for it, which is not implemented here; " + adamw);
    else
      refuse("optimizer.type", json_text(type) +
                                   " is not an optimizer DeepSpeed knows (engine.py _do_sanity_check asserts "
                                   "_is_supported_optimizer: its own names, any case, or torch.optim's, by exact "
                                   "name); " +
                                   adamw);
  }
  // One of the params: FusedAdam(lr, bias_correction, betas, eps,
  // adam_w_mode, weight_decay, amsgrad, set_grad_none) or, with torch_adam,
  // torch.optim.AdamW(lr, betas, eps, weight_decay, amsgrad, maximize,
  // foreach, capturable, differentiable, fused); DeepSpeed pops torch_adam
  // and adam_w_mode before the call.
  // Under offload (offload_key_) without torch_adam it is DeepSpeedCPUAdam(lr,
  // bias_correction, betas, eps, weight_decay, amsgrad, adamw_mode,
  // fp32_optimizer_states) (ops/adam/cpu_adam.py).
  void optimizer_param(const std::string& param, const json& entry, const std::string& full) {
    const bool cpu_adam = !offload_key_.empty() && !torch_adam_;
    const std::string built = torch_adam_ ? "torch.optim.AdamW (torch_adam true)"
                              : cpu_adam  ? "DeepSpeed's DeepSpeedCPUAdam (built under offload_optimizer)"
                                          : "DeepSpeed's FusedAdam";
    const std::string no_such = built + " has no '" + param + "' (DeepSpeed's call raises TypeError)";
    if (param == "lr") {
      if (is_auto(entry)) optimizer_lr_auto_ = true;
      else optimizer_lr_ = {"", number(entry, full), full};
    } else if (param == "weight_decay") set_number("--weight-decay", full, entry);
    else if (param == "eps") set_number("eps", full, entry);
    else if (param == "betas") {
      if (is_auto(entry)) {
        out_.auto_flags.insert("beta1");
        out_.auto_flags.insert("beta2");
        return;
      }
      if (!entry.is_array() || entry.size() != 2)
        return refuse(full, "wants [beta1, beta2] (got " + json_text(entry) + ")");
      set_number("beta1", full + "[0]", entry[0]);
      set_number("beta2", full + "[1]", entry[1]);
    } else if (param == "bias_correction") {
      if (torch_adam_) refuse(full, no_such + ": torch's AdamW always corrects");
      else set_boolean("bias_correction", full, entry);
    } else if (param == "adam_w_mode" || param == "torch_adam") accept_boolean(full, entry);  // judged with the type
    else if (param == "set_grad_none") {  // FusedAdam's zero_grad frees the gradients: the same update
      if (torch_adam_ || cpu_adam) refuse(full, no_such + "; it is FusedAdam's, built without offload");
      else accept_boolean(full, entry);
    } else if (param == "fp32_optimizer_states") {
      // DeepSpeedCPUAdam keeps the moments in the parameter's type when
      // false (cpu_adam.py step: state_dtype); under ZeRO-Offload its
      // parameters are the fp32 master partitions (zero/stage_1_and_2.py
      // single_partition_of_fp32_groups), so they are fp32 either way.
      if (!cpu_adam) return refuse(full, no_such + "; it is DeepSpeedCPUAdam's, built under offload_optimizer");
      accept_boolean(full, entry);
      if (entry == false)
        out_.notes.push_back(full +
                             " false: DeepSpeedCPUAdam keeps its moments in its parameters' type, which under "
                             "ZeRO-Offload is the fp32 master's: fp32 either way, as here");
    } else if (param == "fused" || param == "foreach" || param == "capturable" || param == "differentiable") {
      if (torch_adam_) accept_boolean(full, entry);  // which of torch's kernels computes it: the same update
      else refuse(full, no_such + "; it is torch.optim.AdamW's, with torch_adam true");
    } else if (param == "maximize") {
      if (torch_adam_) must_be(full, entry, false, "maximizing the loss is not implemented");
      else refuse(full, no_such);
    } else if (param == "amsgrad" && cpu_adam) {
      // DeepSpeedCPUAdam takes amsgrad and never reads it ("NOT SUPPORTED
      // in DeepSpeed CPUAdam", cpu_adam.py): its update is Adam's, as here.
      accept_boolean(full, entry);
      if (entry == true)
        out_.notes.push_back(full +
                             " true: DeepSpeedCPUAdam takes it and ignores it (cpu_adam.py), so DeepSpeed's "
                             "update is plain AdamW, as here");
    } else if (param == "amsgrad") must_be(full, entry, false, "AMSGrad is not implemented");
    else if (param == "max_grad_norm")
      refuse(full,
             "DeepSpeed refuses it (engine.py _configure_basic_optimizer raises ValueError: 'max_grad_norm' is not "
             "supported as an optimizer parameter): write the clip as gradient_clipping");
    else if (other_features_params.count(param))
      refuse(full, "a DeepSpeed feature not implemented here (" + other_features_params.at(param) + " parameter" +
                       (adam_ ? "; " + built + " raises TypeError on it)" : ")"));
    else unknown(full);
  }

  // The scheduler (engine.py _scheduler_from_config, :1101-1114): WarmupLR
  // (warmup, then constant), WarmupDecayLR (warmup, then linear decay to
  // warmup_min_lr at total_num_steps), WarmupCosineLR (warmup, then a cosine
  // to cos_min_ratio), OneCycle (a cycle of the rate and beta1, then a
  // decay), LRRangeTest (a rising rate), looked up by their exact names; the
  // params are the constructor's arguments (runtime/lr_schedules.py; the
  // rates: trainer/settings.cpp). A block without "type" builds no scheduler
  // (runtime/config.py get_scheduler_name).
  void scheduler(const std::string& key, const json& value) {
    if (!object(key, value)) return;
    if (!value.contains("type"))
      return out_.warnings.push_back(
          "config block 'scheduler' has no \"type\": DeepSpeed builds no scheduler from it and ignores its params, "
          "so the optimizer's rate holds at every step");
    scheduler_type(value["type"]);
    for (auto& [inner, setting] : value.items()) {
      const std::string name = key + "." + inner;
      if (inner == "type") continue;
      if (inner != "params") ignored(name);
      else if (object(name, setting)) {
        for (auto& [param, entry] : setting.items()) scheduler_param(param, entry, name + "." + param);
      }
    }
    // Constructor arguments without a default (TypeError in DeepSpeed when
    // left out): WarmupDecayLR's and WarmupCosineLR's total_num_steps
    // (judged with the flags: --schedule-steps gives it), OneCycle's
    // cycle_min_lr and cycle_max_lr (lr_schedules.py:440-443).
    const json params = value.contains("params") && value["params"].is_object() ? value["params"] : json::object();
    out_.total_num_steps_missing = (out_.scheduler == "WarmupDecayLR" || out_.scheduler == "WarmupCosineLR") &&
                                   !params.contains("total_num_steps");
    if (out_.scheduler == "OneCycle")
      for (const char* required : {"cycle_min_lr", "cycle_max_lr"})
        if (!params.contains(required))
          refuse(key + ".params." + required,
                 "missing: DeepSpeed's OneCycle has no default for it (its constructor raises TypeError)");
  }
  void scheduler_type(const json& type) {
    if (!type.is_string()) return refuse("scheduler.type", "wants a string (got " + json_text(type) + ")");
    const std::string name = type.get<std::string>();
    const std::string ours =
        "WarmupLR (warmup, then constant), WarmupDecayLR (warmup, then linear decay), WarmupCosineLR, OneCycle or "
        "LRRangeTest";
    if (scheduler_params.count(name)) {
      out_.scheduler = name;
      const bool warmup = name == "WarmupLR" || name == "WarmupDecayLR";
      out_.flags.push_back({"scheduler", warmup ? "warmup" : name, "scheduler.type"});
      if (warmup) out_.flags.push_back({"--decay", name == "WarmupLR" ? "none" : "linear", "scheduler.type"});
      return;
    }
    std::string same_letters;
    for (const char* known : {"WarmupLR", "WarmupDecayLR", "OneCycle", "LRRangeTest", "WarmupCosineLR"})
      if (lower(known) == lower(name)) same_letters = known;
    if (torch_schedulers.count(name))
      refuse("scheduler.type", json_text(type) + " is not supported: DeepSpeed builds torch.optim.lr_scheduler." +
                                   name + " for it, which is not implemented here; " + ours);
    else if (!same_letters.empty())
      refuse("scheduler.type", json_text(type) +
                                   " is not a scheduler DeepSpeed knows: it looks the type up by its exact name "
                                   "(engine.py _scheduler_from_config). Did you mean \"" +
                                   same_letters + "\"?");
    else refuse("scheduler.type", json_text(type) + " is not a scheduler DeepSpeed knows; " + ours);
  }
  void scheduler_param(const std::string& param, const json& entry, const std::string& full) {
    const std::string type = out_.scheduler;
    if (type.empty()) return;  // another type is refused already: its own params are not judged
    if (!scheduler_params.at(type).count(param)) {
      if (!scheduler_param_known(param)) return unknown(full);
      std::string owners;
      for (auto& [other, params] : scheduler_params)
        if (params.count(param)) owners += (owners.empty() ? "" : ", ") + other;
      if (param == "total_num_steps" && type == "WarmupLR")
        return refuse(full,
                      "WarmupLR holds the rate after its warmup and has no total_num_steps (DeepSpeed's WarmupLR "
                      "rejects it too): WarmupDecayLR decays to warmup_min_lr at total_num_steps");
      return refuse(full, "not a parameter of " + type + " (DeepSpeed's " + type +
                              ".__init__ raises TypeError on it; it is " + owners + "'s)");
    }
    const bool warmup = type == "WarmupLR" || type == "WarmupDecayLR";
    if (param == "warmup_num_steps") set_number("--warmup", full, entry);
    else if (param == "warmup_max_lr") {
      if (is_auto(entry)) scheduler_lr_auto_ = true;
      else scheduler_lr_ = {"", number(entry, full), full};
    } else if (param == "warmup_min_lr") set_number("warmup_min_lr", full, entry);
    else if (param == "total_num_steps") set_number("--schedule-steps", full, entry);
    else if (param == "warmup_type") {
      if (is_auto(entry)) out_.auto_flags.insert("--warmup-type");
      else if (entry == "linear" || entry == "log")
        out_.flags.push_back({"--warmup-type", entry.get<std::string>(), full});
      else if (!warmup)  // WarmupCosineLR keeps it: get_lr_ratio leaves `ratio` unbound (lr_schedules.py:832-837)
        refuse(full, json_text(entry) +
                         " is neither \"linear\" nor \"log\": DeepSpeed's WarmupCosineLR takes it and raises "
                         "UnboundLocalError at its first step (lr_schedules.py:832-837)");
      else {  // lr_schedules.py WarmupLR.__init__ (:670-673): a warning, then the log warmup
        out_.flags.push_back({"--warmup-type", "log", full});
        out_.warnings.push_back("config key '" + full + "' is " + json_text(entry) +
                                ", neither \"linear\" nor \"log\": DeepSpeed warns and warms up logarithmically, "
                                "and so does this trainer");
      }
    } else if (param == "last_batch_iteration")
      must_be(full, entry, -1, "a schedule continues from a checkpoint with --load, not from a step number");
    else if (param == "cycle_momentum" || param == "lr_range_test_staircase") {
      if (is_auto(entry) || !entry.is_boolean())
        return refuse(full, "wants true or false (got " + json_text(entry) + ")");
      out_.flags.push_back({param, entry.get<bool>() ? "1" : "0", full});
    } else {  // a number of WarmupCosineLR, OneCycle or LRRangeTest
      // None (JSON null) is DeepSpeed's default for these two: the first's value.
      if ((param == "cycle_second_step_size" || param == "cycle_second_stair_count") && entry.is_null())
        return out_.flags.push_back({param, "none", full});
      if (is_auto(entry))
        return refuse(full, "\"auto\" is not filled for " + type +
                                "'s own params (DeepSpeed would get the string): give a number");
      const std::string text = number(entry, full);
      if (!text.empty()) out_.flags.push_back({param, text, full});
      if (param == "cycle_first_stair_count" || param == "cycle_second_stair_count")
        out_.notes.push_back(full +
                             " has no effect: DeepSpeed's OneCycle stores it and never reads it "
                             "(lr_schedules.py:483-484), and neither does this trainer");
    }
  }
  static bool scheduler_param_known(const std::string& param) {
    for (auto& [type, params] : scheduler_params)
      if (params.count(param)) return true;
    return false;
  }

  // DeepSpeed's activation checkpointing (paper section 6.1's ZeRO-R, as
  // Megatron uses it). In DeepSpeed the block configures checkpointing that
  // the model's code asks for; here --activations is that choice, so the
  // block alone changes nothing, and cpu_checkpointing true asks for the
  // checkpoints on the host (--activations offload, notes/04). Read with
  // get_scalar_param (runtime/activation_checkpointing/config.py): an unknown
  // key is ignored there.
  void activation_checkpointing(const std::string& key, const json& value) {
    if (!object(key, value)) return;
    std::string mode;
    for (auto& [inner, setting] : value.items()) {
      const std::string name = key + "." + inner;
      // P_a splits each checkpoint across the model-parallel ranks
      // (checkpointing.py partition_activations, get_partition_size: numel /
      // mp_size); without an mpu, mp_size is 1 (the module's default), and
      // the partition is the whole tensor, a copy of the same values. There
      // is no model parallelism here (notes/04).
      if (inner == "partition_activations") {
        accept_boolean(name, setting);
        if (setting == true)
          out_.notes.push_back(name +
                               " true: DeepSpeed splits each checkpoint across the model-parallel ranks; with "
                               "model-parallel size 1, as here (no model parallelism), the part is the whole "
                               "checkpoint: nothing changes");
      } else if (inner == "cpu_checkpointing") {
        accept_boolean(name, setting);
        if (setting == true) mode = "offload";
      } else if (inner == "contiguous_memory_optimization") {
        accept_boolean(name, setting);  // false: the arena stays zero2's default (--alloc naive is the other)
        if (setting == true) out_.flags.push_back({"--alloc", "arena", name});
      }
      // Every block is a checkpoint here, and the copies are ordered by events.
      else if (inner == "number_checkpoints") {
        if (!setting.is_null() && !setting.is_number_integer() && !is_auto(setting))
          refuse(name, "wants an integer or null (got " + json_text(setting) + ")");
      } else if (inner == "synchronize_checkpoint_boundary") accept_boolean(name, setting);
      // Times each checkpointed block's forward and backward with
      // DeepSpeed's timers (checkpointing.py CheckpointFunction, PROFILE_TIME):
      // timing only.
      else if (inner == "profile") {
        accept_boolean(name, setting);
        if (setting == true)
          out_.notes.push_back(name +
                               " true: DeepSpeed would time each checkpointed block's forward and backward; zero2 "
                               "does not (wall_clock_breakdown times forward, backward and the step)");
      } else ignored(name);
    }
    if (!mode.empty()) out_.flags.push_back({"--activations", mode, key + ".cpu_checkpointing"});
    else
      out_.notes.push_back(
          "activation_checkpointing: which activations are checkpointed is --activations here "
          "(keep, recompute, offload); the block alone changes nothing, cpu_checkpointing true is offload");
  }

  // The key by which the file offloads the optimizer state ("" when it does
  // not): offload_optimizer's device "cpu" or "nvme" (engine.py
  // zero_use_cpu_optimizer takes both; "nvme" is refused elsewhere), or the
  // older cpu_offload true. DeepSpeed then builds DeepSpeedCPUAdam for
  // "Adam"/"AdamW" without torch_adam (engine.py _configure_basic_optimizer).
  static std::string offloading_key(const json& config) {
    const json zero = config.value("zero_optimization", json());
    if (!zero.is_object()) return "";
    const json offload = zero.value("offload_optimizer", json());
    if (offload.is_object() && (offload.value("device", json()) == "cpu" || offload.value("device", json()) == "nvme"))
      return "zero_optimization.offload_optimizer.device";
    return zero.value("cpu_offload", json()) == true ? "zero_optimization.cpu_offload" : "";
  }
  // The learning rate: with a scheduler, its warmup_max_lr (lr_schedules.py
  // WarmupLR sets every step's rate, the first one at construction, so the
  // optimizer's lr never acts); without one, the optimizer's lr. The clip:
  // gradient_clipping (an optimizer's max_grad_norm is refused above).
  // WarmupCosineLR's peak is the optimizer's lr (lr_schedules.py:820,
  // org_lrs), as without a scheduler; OneCycle and LRRangeTest set every
  // step's rate from their own params, the first at construction (:497-499,
  // :336-337), so the optimizer's lr never acts: said when the file gives it.
  void settle_learning_rate_and_clipping() {
    const std::string type = out_.scheduler;
    if ((type == "OneCycle" || type == "LRRangeTest") && !optimizer_lr_.value.empty())
      out_.notes.push_back(optimizer_lr_.key + " " + optimizer_lr_.value + " has no effect: " + type +
                           " sets every step's rate, the first when it is built (as in DeepSpeed)");
    if (type == "WarmupLR" || type == "WarmupDecayLR") {
      if (!scheduler_lr_.value.empty()) out_.flags.push_back({"--lr", scheduler_lr_.value, scheduler_lr_.key});
      else if (scheduler_lr_auto_) out_.auto_flags.insert("--lr");
      // Said when it differs from the peak the scheduler sets (its own, or its default 0.001).
      const std::string peak = !scheduler_lr_.value.empty() ? scheduler_lr_.value : scheduler_lr_auto_ ? "" : "0.001";
      if (!optimizer_lr_.value.empty() && !peak.empty() &&
          std::strtod(optimizer_lr_.value.c_str(), nullptr) != std::strtod(peak.c_str(), nullptr))
        out_.notes.push_back(optimizer_lr_.key + " " + optimizer_lr_.value + " has no effect: the scheduler sets " +
                             "every step's rate, up to warmup_max_lr " + peak + " (as in DeepSpeed)");
    } else {
      if (!optimizer_lr_.value.empty()) out_.flags.push_back({"--lr", optimizer_lr_.value, optimizer_lr_.key});
      else if (optimizer_lr_auto_) out_.auto_flags.insert("--lr");
    }
    if (!clipping_.value.empty()) out_.flags.push_back({"--clip", clipping_.value, clipping_.key});
    out_.learning_rate_auto = optimizer_lr_auto_ || scheduler_lr_auto_;
    for (const ConfigSetting& explicit_rate : {optimizer_lr_, scheduler_lr_})
      if (!explicit_rate.value.empty()) out_.learning_rate_keys.push_back(explicit_rate);
  }

  // DeepSpeed's value for every setting the file leaves out; the command
  // line applies each one that neither the file nor a flag gives and that
  // the file does not leave to "auto" (trainer/command_line.cpp). The key names,
  // shortly, where in DeepSpeed 0.16.9 the default is set: runtime/constants.py,
  // zero/config.py DeepSpeedZeroConfig, fp16/loss_scaler.py, the optimizer's
  // or the scheduler's constructor.
  void add_deepspeed_defaults() {
    auto add = [&](const char* flag, const char* value, const std::string& where) {
      out_.defaults.push_back({flag, value, where});
    };
    add("--stage", "0", "DeepSpeedZeroConfig");  // no zero_optimization: ZeRO off
    add("--bucket", "500000000", "DeepSpeedZeroConfig");
    add("--overlap", "0", "DeepSpeedZeroConfig");               // overlap_comm_valid: on in stage 3 only
    add("--offload-optimizer", "none", "DeepSpeedZeroConfig");  // offload_optimizer None: no offload
    add("--clip", "0", "constants.py");
    // (steps_per_print's default is None: DeepSpeed prints no progress; the
    // trainer's line every 10 steps is output only, so it stays.)
    add("--wall-clock-breakdown", "0", "constants.py");
    // fp16's loss scaler. DeepSpeed's ZeRO optimizer (zero/stage_1_and_2.py,
    // CreateLossScaler in fp16/loss_scaler.py) takes dynamic_loss_args from
    // config.py get_dynamic_loss_scale_args: None when the fp16 block names
    // no scaler key, and then DynamicLossScaler's own defaults; else every
    // key, the absent ones at the config section's defaults (constants.py).
    add("loss_scale", "0", "constants.py");
    const std::string scaler = loss_scaler_keys_ ? "fp16 section of constants.py" : "DynamicLossScaler()";
    add("initial_scale_power", loss_scaler_keys_ ? "16" : "32", scaler);
    add("loss_scale_window", "1000", scaler);
    add("hysteresis", loss_scaler_keys_ ? "2" : "1", scaler);
    add("consecutive_hysteresis", "0", scaler);
    add("min_loss_scale", "1", scaler);
    // The optimizer's constructor defaults: FusedAdam's and DeepSpeedCPUAdam's
    // weight decay is 0, torch.optim.AdamW's 1e-2 (engine.py
    // _configure_basic_optimizer builds the last for "torch_adam": true, the
    // second under offload; the command line's --offload-optimizer may
    // change which: trainer/command_line.cpp names the one the run has).
    if (optimizer_typed_) {
      const std::string built = torch_adam_            ? "torch.optim.AdamW"
                                : offload_key_.empty() ? "FusedAdam"
                                                       : "DeepSpeedCPUAdam";
      if (out_.scheduler != "WarmupLR" && out_.scheduler != "WarmupDecayLR") add("--lr", "0.001", built);
      add("--weight-decay", torch_adam_ ? "0.01" : "0", built);
      add("beta1", "0.9", built);
      add("beta2", "0.999", built);
      add("eps", "1e-08", built);
      add("bias_correction", "1", built);
    }
    const std::string& type = out_.scheduler;
    if (type == "WarmupLR" || type == "WarmupDecayLR") {  // lr_schedules.py WarmupLR.__init__'s defaults
      add("--lr", "0.001", type);
      add("--warmup", "1000", type);
      add("--warmup-type", "log", type);
      add("warmup_min_lr", "0", type);
    } else if (type == "WarmupCosineLR") {  // WarmupCosineLR.__init__'s (:797-804)
      add("--warmup", "1000", type);
      add("--warmup-type", "log", type);
      add("warmup_min_ratio", "0", type);
      add("cos_min_ratio", "0.0001", type);
    } else if (type == "OneCycle") {  // OneCycle.__init__'s (:440-454)
      for (auto [flag, value] : {std::pair<const char*, const char*>{"decay_lr_rate", "0"},
                                 {"cycle_first_step_size", "2000"},
                                 {"cycle_second_step_size", "none"},
                                 {"cycle_first_stair_count", "0"},
                                 {"cycle_second_stair_count", "none"},
                                 {"decay_step_size", "0"},
                                 {"cycle_momentum", "1"},
                                 {"cycle_min_mom", "0.8"},
                                 {"cycle_max_mom", "0.9"},
                                 {"decay_mom_rate", "0"}})
        add(flag, value, type);
    } else if (type == "LRRangeTest") {  // LRRangeTest.__init__'s (:312-318)
      add("lr_range_test_min_lr", "0.001", type);
      add("lr_range_test_step_size", "2000", type);
      add("lr_range_test_step_rate", "1", type);
      add("lr_range_test_staircase", "0", type);
    }
  }

  std::string path_;
  NumberTexts numbers_;
  ConfigReading out_;
  ConfigSetting optimizer_lr_, scheduler_lr_, clipping_;  // settled once every key is read
  bool optimizer_lr_auto_ = false, scheduler_lr_auto_ = false;
  bool optimizer_typed_ = false, adam_ = false, torch_adam_ = false;  // which constructor's defaults apply
  bool loss_scaler_keys_ = false;                                     // the fp16 block names a scaler key
  std::string offload_key_;  // the key by which the file offloads the optimizer state, "" when it does not
  // zero_optimization's offload keys, looked at before its keys are read one by one.
  bool both_offload_keys_ = false, pin_memory_given_ = false, nvme_path_missing_ = false;
  // As numbers' texts, for the note; DeepSpeed's reduce bucket is 5e8 unless given.
  std::string reduce_bucket_ = "500000000", allgather_bucket_;
};

ConfigReading read_deepspeed_config(const std::string& path) { return ConfigReader(path).read(); }

}  // namespace bert
