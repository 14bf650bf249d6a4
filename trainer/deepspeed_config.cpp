// trainer/deepspeed_config.cpp — the DeepSpeed config reader
// (trainer/deepspeed_config.h): the file checked as text, parsed with its
// keys once each, its numbers' texts kept as written, and every key
// DeepSpeed documents mapped to a flag, accepted with its reason, or refused.
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

// How deep a config's objects and arrays may nest. DeepSpeed's go 3 deep;
// the JSON library recurses when it frees or prints a value, so a file
// nested 100,000 deep would overflow the stack: we count before it parses.
constexpr int max_config_depth = 16;

// A NUL byte would end the text early for some readers; the depth is
// counted before the JSON library sees the text.
std::string read_config_text(const std::string& path) {
  const std::string text = read_regular_file("the config file", path, 1 << 20);
  const size_t nul = text.find('\0');
  if (nul != std::string::npos) fail("the config file '%s' has a NUL byte at offset %zu", path.c_str(), nul);
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;  // the escaped character cannot end the string
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > max_config_depth)
        fail("the config file '%s' nests objects and arrays more than %d deep (at offset %zu)", path.c_str(),
             max_config_depth, i);
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return text;
}

// A JSON object's keys, once each: the JSON library keeps the last of two
// equal keys silently, and a setting written twice is a mistake to name.
static json parse_config_json(const std::string& path, const std::string& text) {
  std::vector<std::set<std::string>> keys;  // one set per open object
  json::parser_callback_t no_duplicates = [&](int, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) keys.emplace_back();
    else if (event == json::parse_event_t::object_end) keys.pop_back();
    else if (event == json::parse_event_t::key && !keys.back().insert(parsed.get<std::string>()).second)
      fail("the config file '%s' has the key '%s' twice in one object", path.c_str(),
           parsed.get<std::string>().c_str());
    return true;
  };
  try {
    return parse_json(text, no_duplicates);  // strict: nothing may follow the value
  } catch (const json::exception& e) {       // a syntax error, or a number beyond double (1e400)
    fail("the config file '%s' is not valid JSON: %s", path.c_str(), e.what());
  }
}

// The text of every floating-point number in a config, by its key path
// ("fp16.loss_scale", "optimizer.params.betas[0]"). The JSON library keeps
// only the double, and a message should quote what the user wrote: 1e39,
// not 9.9999999999999994e+38; 18446744073709551616 (beyond uint64, so
// parsed as a double), not 1.8446744073709552e+19. Its SAX interface hands
// each number's text over; this records it and builds nothing.
struct NumberTexts : nlohmann::json_sax<json> {
  std::map<std::string, std::string> texts;
  std::vector<std::string> keys;  // per open object or array: the current key ("" in an array)
  std::vector<long> indices;      // per open level: the current element's index (-1 in an object)

  std::string here() const {
    std::string where;
    for (size_t level = 0; level < keys.size(); ++level)
      where +=
          indices[level] >= 0 ? "[" + std::to_string(indices[level]) + "]" : (where.empty() ? "" : ".") + keys[level];
    return where;
  }
  bool value() {  // a value ended: the next one in an array has the next index
    if (!indices.empty() && indices.back() >= 0) ++indices.back();
    return true;
  }
  bool open(long index) {
    keys.emplace_back();
    indices.push_back(index);
    return true;
  }
  bool close() {
    keys.pop_back();
    indices.pop_back();
    return value();
  }
  bool null() override { return value(); }
  bool boolean(bool) override { return value(); }
  bool number_integer(number_integer_t) override { return value(); }
  bool number_unsigned(number_unsigned_t) override { return value(); }
  bool number_float(number_float_t, const string_t& text) override {
    texts[here()] = text;
    return value();
  }
  bool string(string_t&) override { return value(); }
  bool binary(binary_t&) override { return value(); }
  bool start_object(std::size_t) override { return open(-1); }
  bool key(string_t& key) override {
    keys.back() = key;
    return true;
  }
  bool end_object() override { return close(); }
  bool start_array(std::size_t) override { return open(0); }
  bool end_array() override { return close(); }
  bool parse_error(std::size_t, const std::string&, const json::exception&) override { return false; }
};

class ConfigReader {
 public:
  explicit ConfigReader(const std::string& path) : path_(path) {}

  ConfigReading read() {
    const std::string text = read_config_text(path_);
    const json config = parse_config_json(path_, text);
    if (!config.is_object()) fail("the config file '%s' must hold a JSON object", path_.c_str());
    parse_json_events(text, numbers_);  // valid JSON by now: this pass only collects the numbers' texts
    for (auto& [key, value] : config.items()) top_level(key, value);
    settle_learning_rate_and_clipping();
    return out_;
  }

 private:
  // --- values ------------------------------------------------------------
  static bool is_auto(const json& value) { return value.is_string() && value.get<std::string>() == "auto"; }
  void refuse(const std::string& key, const std::string& why) { out_.refused.push_back(key + ": " + why); }
  // A key neither side knows: most often a typo, so the nearest name this
  // reader knows (edit distance at most 2) is suggested.
  void unknown(const std::string& key) {
    const size_t dot = key.rfind('.');
    const std::string name = dot == std::string::npos ? key : key.substr(dot + 1);
    std::string best;
    size_t best_distance = 3;
    for (const char* known : known_names) {
      const size_t distance = edit_distance(name, known);
      if (distance < best_distance && distance > 0) best_distance = distance, best = known;
    }
    refuse(key, best.empty() ? std::string("not a DeepSpeed key this trainer knows")
                             : "not a DeepSpeed key this trainer knows (did you mean '" +
                                   (dot == std::string::npos ? "" : key.substr(0, dot + 1)) + best + "'?)");
  }
  static size_t edit_distance(const std::string& a, const std::string& b) {
    std::vector<size_t> row(b.size() + 1);
    for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
    for (size_t i = 1; i <= a.size(); ++i) {
      size_t diagonal = row[0];
      row[0] = i;
      for (size_t j = 1; j <= b.size(); ++j) {
        const size_t above = row[j];
        row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])});
        diagonal = above;
      }
    }
    return row[b.size()];
  }
  // Every key name the reader takes, at any level (for the suggestion only).
  // clang-format off
  static constexpr const char* known_names[] = {
      "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
      "steps_per_print", "wall_clock_breakdown", "fp16", "bf16", "data_types", "zero_optimization", "optimizer",
      "scheduler", "activation_checkpointing", "zero_allow_untested_optimizer", "prescale_gradients",
      "gradient_predivide_factor", "enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
      "min_loss_scale", "consecutive_hysteresis", "auto_cast", "grad_accum_dtype", "stage", "reduce_bucket_size",
      "allgather_bucket_size", "overlap_comm", "contiguous_gradients", "reduce_scatter", "allgather_partitions",
      "offload_optimizer", "offload_param", "type", "params", "lr", "betas", "eps", "weight_decay", "bias_correction",
      "adam_w_mode", "warmup_num_steps", "warmup_max_lr", "warmup_min_lr", "total_num_steps", "warmup_type",
      "partition_activations", "cpu_checkpointing", "contiguous_memory_optimization", "number_checkpoints",
      "synchronize_checkpoint_boundary", "memory_breakdown", "communication_data_type", "zero2_portable"};
  // clang-format on
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
    if (value.is_number_unsigned()) return std::to_string(value.get<unsigned long long>());
    if (value.is_number_integer()) return std::to_string(value.get<long long>());
    // A whole number written as a float (DeepSpeed's configs write
    // "reduce_bucket_size": 5e8) is that integer while a double holds it exactly.
    const double real = value.get<double>();
    const auto written = numbers_.texts.find(key);
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
  // The value as a flag's text, by the kind the key wants; "auto" sets nothing.
  void set_number(const std::string& flag, const std::string& key, const json& value) {
    if (is_auto(value)) return;
    const std::string text = number(value, key);
    if (!text.empty()) out_.flags.push_back({flag, text, key});
  }
  void set_boolean(const std::string& flag, const std::string& key, const json& value) {
    if (is_auto(value)) return;
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
  bool object(const std::string& key, const json& value) {
    if (!value.is_object()) refuse(key, "wants an object (got " + json_text(value) + ")");
    return value.is_object();
  }
  static std::string lower(std::string text) {
    for (char& c : text) c = (char)std::tolower((unsigned char)c);
    return text;
  }

  // --- the keys ------------------------------------------------------------
  void top_level(const std::string& key, const json& value) {
    if (key == "train_batch_size") set_number("train_batch_size", key, value);
    else if (key == "train_micro_batch_size_per_gpu") set_number("--micro-batch", key, value);
    else if (key == "gradient_accumulation_steps") set_number("--accum", key, value);
    else if (key == "gradient_clipping") {
      if (!is_auto(value)) clipping_ = {"", number(value, key), key};
    } else if (key == "steps_per_print") set_number("--log-every", key, value);
    else if (key == "wall_clock_breakdown") set_boolean("--wall-clock-breakdown", key, value);
    else if (key == "zero2_portable") set_boolean("--portable", key, value);  // ours, not DeepSpeed's
    else if (key == "fp16" || key == "bf16") precision_block(key, value);
    else if (key == "data_types") data_types(key, value);
    else if (key == "zero_optimization") zero_optimization(key, value);
    else if (key == "optimizer") optimizer(key, value);
    else if (key == "scheduler") scheduler(key, value);
    else if (key == "activation_checkpointing") activation_checkpointing(key, value);
    // The optimizer is AdamW, which ZeRO is tested with; there is no CPU optimizer without offload.
    else if (key == "zero_allow_untested_optimizer" || key == "zero_force_ds_cpu_optimizer") accept_boolean(key, value);
    // The canonical tree sums gradients in fp32 and divides once (notes/06):
    // dividing before the reduction would round differently.
    else if (key == "prescale_gradients")
      must_be(key, value, false, "gradients are summed, then divided once (notes/06)");
    else if (key == "gradient_predivide_factor")
      must_be(key, value, 1, "gradients are summed, then divided once by the global batch (notes/06)");
    else if (key == "amp")
      switched_off(key, value, "apex AMP is not used: --precision bf16|fp16, or the bf16 / fp16 blocks");
    else if (key == "tensorboard" || key == "wandb" || key == "csv_monitor" || key == "comms_logger" ||
             key == "flops_profiler")
      switched_off(key, value, "not implemented here: --json and --metrics record the run");
    else if (key == "elasticity" || key == "compile" || key == "autotuning" || key == "data_efficiency" ||
             key == "curriculum_learning")
      switched_off(key, value, "a DeepSpeed feature not implemented here");
    // The ledger is always measured and printed (and in --json).
    else if (key == "memory_breakdown") accept_boolean(key, value);
    // DeepSpeed's own checkpoint options (tags, parallel writes): --save and --load here (notes/09).
    else if (key == "checkpoint") object(key, value);
    else if (key == "sparse_gradients") off_only(key, value, false, "every gradient is dense here");
    else if (key == "dump_state") off_only(key, value, false, "--dump-batch writes step 0's state");
    else if (key == "communication_data_type")
      off_only(key, value, nullptr, "the wire carries the working precision, summed in fp32 (notes/08)");
    else unknown(key);
  }
  // A block accepted only when it says "enabled": false (or has no "enabled").
  void switched_off(const std::string& key, const json& value, const std::string& why) {
    if (!object(key, value)) return;
    if (value.contains("enabled") && value["enabled"] != false) refuse(key + ".enabled", why);
  }

  // DeepSpeed's mixed-precision blocks (notes/08). In a disabled block the
  // keys have no effect, as in DeepSpeed, but are still checked: a negative
  // loss scale is wrong whether or not fp16 is on today.
  void precision_block(const std::string& key, const json& value) {
    if (!object(key, value)) return;
    const bool fp16 = key == "fp16";
    const json enabled = value.value("enabled", json(false));
    if (value.contains("enabled")) set_boolean(key + ".enabled", key + ".enabled", enabled);
    static const std::set<std::string> fp16_numbers = {"loss_scale", "initial_scale_power", "loss_scale_window",
                                                       "hysteresis", "min_loss_scale"};
    for (auto& [inner, setting] : value.items()) {
      const std::string name = key + "." + inner;
      if (inner == "enabled") continue;
      if (fp16 && fp16_numbers.count(inner)) set_number(inner, name, setting);
      else if (fp16 && inner == "consecutive_hysteresis") set_boolean(inner, name, setting);
      else if (fp16 && inner == "auto_cast")
        must_be(name, setting, false, "the model casts nothing: its inputs are token ids");
      else if (fp16 && inner == "fp16_master_weights_and_grads")
        must_be(name, setting, false, "the master weights and the reduced gradients are fp32 here (notes/08)");
      else if (!fp16 && inner == "immediate_grad_update") accept_boolean(name, setting);  // a BF16_Optimizer ordering
      else unknown(name);
    }
  }

  void data_types(const std::string& key, const json& value) {
    if (!object(key, value)) return;
    for (auto& [inner, setting] : value.items()) {
      const std::string name = key + "." + inner;
      if (inner != "grad_accum_dtype") {
        unknown(name);
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

  void zero_optimization(const std::string& key, const json& value) {
    // DeepSpeed's older form (its getting-started page still shows it):
    // true is stage 1, false stage 0.
    if (value.is_boolean()) return out_.flags.push_back({"--stage", value.get<bool>() ? "1" : "0", key});
    if (!object(key, value)) return;
    for (auto& [inner, setting] : value.items()) {
      const std::string name = key + "." + inner;
      if (inner == "stage") {
        if (setting.is_number_integer() && setting.get<long>() == 3)
          refuse(name, "3 is not supported: stage 3 (P_p, the parameters partitioned) is not implemented; 0, 1 or 2");
        else set_number("--stage", name, setting);
      } else if (inner == "reduce_bucket_size") {
        set_number("--bucket", name, setting);
        if (setting.is_number()) reduce_bucket_ = number(setting, name);
      } else if (inner == "allgather_bucket_size") {
        if (!is_auto(setting)) allgather_bucket_ = number(setting, name);
      } else if (inner == "overlap_comm") set_boolean("--overlap", name, setting);
      else if (inner == "contiguous_gradients")
        must_be(name, setting, true, "gradients always live in one contiguous buffer here");
      else if (inner == "reduce_scatter")
        must_be(name, setting, true, "gradients are always reduce-scattered here (the deterministic all-to-all)");
      else if (inner == "allgather_partitions")
        must_be(name, setting, true, "parameters are always all-gathered bucket by bucket here");
      else if (inner == "offload_optimizer") offload(name, setting, true);
      else if (inner == "cpu_offload")  // DeepSpeed's older spelling of offload_optimizer
        must_be(name, setting, false, "ZeRO-Offload (the optimizer state in host memory) is not implemented");
      // Stage 3's keys and offload_param act only in stage 3, as in DeepSpeed.
      else if (inner == "offload_param") offload(name, setting, false);
      else if (inner.rfind("stage3_", 0) == 0 || inner == "sub_group_size") {
      }
      // Orderings and checks that change nothing here: every parameter is
      // used, checkpoints hold fp32 and reshard anyway (notes/09).
      else if (inner == "round_robin_gradients" || inner == "ignore_unused_parameters" ||
               inner == "load_from_fp32_weights" || inner == "elastic_checkpoint" ||
               inner == "use_multi_rank_bucket_allreduce" || inner == "memory_efficient_linear")
        accept_boolean(name, setting);
      // ZeRO++ and MiCS, at their "off" values.
      else if (inner == "zero_quantized_weights" || inner == "zero_quantized_gradients" ||
               inner == "zero_quantized_nontrainable_weights" || inner == "mics_hierarchical_params_gather")
        off_only(name, setting, false, "ZeRO++ / MiCS");
      else if (inner == "zero_hpz_partition_size") off_only(name, setting, 1, "ZeRO++'s hierarchical partitions");
      else if (inner == "mics_shard_size") off_only(name, setting, -1, "MiCS");
      else unknown(name);
    }
    if (!allgather_bucket_.empty() && allgather_bucket_ != reduce_bucket_)
      out_.notes.push_back("zero_optimization.allgather_bucket_size " + allgather_bucket_ +
                           ": the parameters are all-gathered in the reduce buckets (" +
                           (reduce_bucket_.empty() ? std::string("--bucket") : reduce_bucket_) +
                           " elements); bucket sizes change the speed, not the bits");
  }
  void offload(const std::string& key, const json& value, bool optimizer_state) {
    if (!object(key, value)) return;
    const json device = value.value("device", json("none"));
    if (device == "none") return;
    if (optimizer_state)
      refuse(key + ".device", json_text(device) +
                                  " is not supported: ZeRO-Offload (the optimizer state in host "
                                  "memory) is not implemented; \"none\" keeps it on the device");
    else out_.notes.push_back(key + " has no effect below stage 3 (as in DeepSpeed)");
  }

  // The "params" of a {"type", "params"} block (optimizer, scheduler), each
  // handed to `take` with its full key; any other key of the block is refused.
  void each_param(const std::string& key, const json& value,
                  const std::function<void(const std::string&, const json&, const std::string&)>& take) {
    for (auto& [inner, setting] : value.items()) {
      const std::string name = key + "." + inner;
      if (inner == "type") continue;
      if (inner != "params") unknown(name);
      else if (object(name, setting))
        for (auto& [param, entry] : setting.items()) take(param, entry, name + "." + param);
    }
  }

  void optimizer(const std::string& key, const json& value) {
    if (!object(key, value)) return;
    const json params = value.value("params", json::object());
    if (value.contains("type")) {
      const json& type = value["type"];
      const std::string name = type.is_string() ? lower(type.get<std::string>()) : "";
      // DeepSpeed's "Adam" is AdamW unless adam_w_mode is false (its default is true).
      const bool adam_w = params.is_object() ? params.value("adam_w_mode", json(true)) == true : true;
      if (name == "adam" && !adam_w)
        refuse("optimizer.params.adam_w_mode",
               "false (Adam with L2 regularization in the gradient) is not "
               "implemented: the optimizer is AdamW, DeepSpeed's default for \"Adam\"");
      else if (name != "adamw" && name != "adam")
        refuse("optimizer.type", json_text(type) +
                                     " is not supported: the optimizer is AdamW (\"AdamW\", or \"Adam\" "
                                     "with adam_w_mode true)");
    }
    each_param(key, value, [&](const std::string& param, const json& entry, const std::string& full) {
      if (param == "lr") {
        if (!is_auto(entry)) optimizer_lr_ = {"", number(entry, full), full};
      } else if (param == "weight_decay") set_number("--weight-decay", full, entry);
      else if (param == "eps") set_number("eps", full, entry);
      else if (param == "betas") {
        if (is_auto(entry)) return;
        if (!entry.is_array() || entry.size() != 2) {
          refuse(full, "wants [beta1, beta2] (got " + json_text(entry) + ")");
          return;
        }
        set_number("beta1", full + "[0]", entry[0]);
        set_number("beta2", full + "[1]", entry[1]);
      } else if (param == "bias_correction") set_boolean("bias_correction", full, entry);
      else if (param == "adam_w_mode") accept_boolean(full, entry);  // checked with the type above
      // Which implementation computes it (torch's, fused): the same update.
      else if (param == "torch_adam" || param == "fused" || param == "foreach") accept_boolean(full, entry);
      else if (param == "amsgrad") must_be(full, entry, false, "AMSGrad is not implemented");
      // apex's FusedAdam clipped inside the optimizer; it is the global-norm clip.
      else if (param == "max_grad_norm") {
        if (!is_auto(entry)) max_grad_norm_ = {"", number(entry, full), full};
      } else unknown(full);
    });
  }

  // WarmupLR (warmup, then constant) and WarmupDecayLR (warmup, then linear
  // decay to warmup_min_lr at total_num_steps), with DeepSpeed's default
  // "log" warmup; names in any case, as DeepSpeed takes them.
  void scheduler(const std::string& key, const json& value) {
    if (!object(key, value)) return;
    std::string type = "warmupdecaylr";
    if (value.contains("type")) {
      const json& named = value["type"];
      type = named.is_string() ? lower(named.get<std::string>()) : "";
      if (type == "warmuplr") out_.flags.push_back({"--decay", "none", key + ".type"});
      else if (type == "warmupdecaylr") out_.flags.push_back({"--decay", "linear", key + ".type"});
      else
        refuse(key + ".type", json_text(named) +
                                  " is not supported: WarmupLR (warmup, then constant) or WarmupDecayLR "
                                  "(warmup, then linear decay)");
    }
    bool warmup_type_given = false;
    each_param(key, value, [&](const std::string& param, const json& entry, const std::string& full) {
      if (param == "warmup_num_steps") set_number("--warmup", full, entry);
      else if (param == "warmup_max_lr") {
        if (!is_auto(entry)) scheduler_lr_ = {"", number(entry, full), full};
      } else if (param == "warmup_min_lr") set_number("warmup_min_lr", full, entry);
      else if (param == "total_num_steps" && type == "warmupdecaylr") set_number("--schedule-steps", full, entry);
      else if (param == "total_num_steps" && type == "warmuplr")
        refuse(full,
               "WarmupLR holds the rate after its warmup and has no total_num_steps (DeepSpeed's WarmupLR "
               "rejects it too): WarmupDecayLR decays to warmup_min_lr at total_num_steps");
      else if (param == "warmup_type") {
        warmup_type_given = true;
        if (entry == "linear" || entry == "log")
          out_.flags.push_back({"--warmup-type", entry.get<std::string>(), full});
        else if (!is_auto(entry)) refuse(full, "wants \"linear\" or \"log\" (got " + json_text(entry) + ")");
      } else if (param == "last_batch_iteration")
        must_be(full, entry, -1, "a schedule continues from a checkpoint with --load, not from a step number");
      else if (type == "warmupdecaylr" || type == "warmuplr") unknown(full);
      // (another type is refused already: its own params are not judged)
    });
    // DeepSpeed's warmup is logarithmic unless told otherwise.
    if (!warmup_type_given)
      out_.flags.push_back({"--warmup-type", "log", key + ".params.warmup_type (DeepSpeed's default)"});
  }

  // DeepSpeed's activation checkpointing (paper section 6.1's ZeRO-R, as
  // Megatron uses it). In DeepSpeed the block configures checkpointing that
  // the model's code asks for; here --activations is that choice, so the
  // block alone changes nothing, and cpu_checkpointing true asks for the
  // checkpoints on the host (--activations offload, notes/04).
  void activation_checkpointing(const std::string& key, const json& value) {
    if (!object(key, value)) return;
    std::string mode;
    for (auto& [inner, setting] : value.items()) {
      const std::string name = key + "." + inner;
      if (inner == "partition_activations")
        must_be(name, setting, false,
                "P_a splits activation checkpoints across model-parallel ranks, and there is "
                "no model parallelism here (notes/04)");
      else if (inner == "cpu_checkpointing") {
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
      else if (inner == "profile")
        must_be(name, setting, false,
                "per-checkpoint timing is not implemented (wall_clock_breakdown times forward, "
                "backward and the step)");
      else unknown(name);
    }
    if (!mode.empty()) out_.flags.push_back({"--activations", mode, key + ".cpu_checkpointing"});
    else
      out_.notes.push_back(
          "activation_checkpointing: which activations are checkpointed is --activations here "
          "(keep, recompute, offload); the block alone changes nothing, cpu_checkpointing true is offload");
  }

  // The learning rate: the scheduler's warmup_max_lr when given (DeepSpeed's
  // scheduler sets the rate every step), else the optimizer's lr. Clipping:
  // gradient_clipping, or an apex-era optimizer's max_grad_norm; both given
  // must agree.
  void settle_learning_rate_and_clipping() {
    const ConfigSetting& lr = !scheduler_lr_.value.empty() ? scheduler_lr_ : optimizer_lr_;
    if (!lr.value.empty()) out_.flags.push_back({"--lr", lr.value, lr.key});
    if (!clipping_.value.empty() && !max_grad_norm_.value.empty() &&
        std::strtod(clipping_.value.c_str(), nullptr) != std::strtod(max_grad_norm_.value.c_str(), nullptr))
      refuse(max_grad_norm_.key, max_grad_norm_.value + " contradicts gradient_clipping " + clipping_.value +
                                     ": one global-norm clip applies");
    const ConfigSetting& clip = !clipping_.value.empty() ? clipping_ : max_grad_norm_;
    if (!clip.value.empty()) out_.flags.push_back({"--clip", clip.value, clip.key});
  }

  std::string path_;
  NumberTexts numbers_;
  ConfigReading out_;
  ConfigSetting optimizer_lr_, scheduler_lr_, clipping_, max_grad_norm_;  // settled once every key is read
  std::string reduce_bucket_, allgather_bucket_;                          // as numbers' texts, for the note
};

ConfigReading read_deepspeed_config(const std::string& path) { return ConfigReader(path).read(); }

}  // namespace bert
