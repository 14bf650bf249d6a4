// trainer/settings.cpp — the settings (trainer/settings.h): each flag's
// parser and range, strict UTF-8, --help, the checks that need several
// settings at once, the ranks' agreement on an error, and what the settings
// make for the engine and the model. The command line, with --config read
// first, is trainer/command_line.cpp; the DeepSpeed config file itself is
// read by trainer/deepspeed_config.cpp.
#include "trainer/settings.h"

#include <algorithm>
#include <cerrno>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <utility>

namespace bert {

// --- one flag's value ----------------------------------------------------------

static long parse_integer(const std::string& flag, const std::string& text, long low, long high) {
  char* end = nullptr;
  errno = 0;
  long value = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end || errno == ERANGE || value < low || value > high)
    fail("%s wants an integer from %ld to %ld (got '%s')", flag.c_str(), low, high, text.c_str());
  return value;
}

// `smallest` is the least non-zero magnitude the setting keeps: DBL_MIN, or
// FLT_MIN for one stored as a float.
static double parse_real(const std::string& flag, const std::string& text, double low, double high,
                         bool high_inclusive = true, double smallest = DBL_MIN) {
  char* end = nullptr;
  errno = 0;
  double value = std::strtod(text.c_str(), &end);
  // strtod says ERANGE for a number too small for a normal double (1e-320)
  // as well as for one too large: only the large one overflows.
  const bool overflow = errno == ERANGE && std::fabs(value) > DBL_MIN;
  bool in_range = value >= low && (high_inclusive ? value <= high : value < high);
  if (text.empty() || *end || overflow || !std::isfinite(value) || !in_range)
    fail("%s wants a number from %g to %g%s (got '%s')", flag.c_str(), low, high, high_inclusive ? "" : " (exclusive)",
         text.c_str());
  // A number written non-zero that reads as 0 or as a subnormal (1e-400,
  // 1e-310) is not what the user meant: 0 would silently switch the
  // setting off (an lr of 0 trains nothing), so it is refused like 1e400.
  const bool written_zero = value == 0 && errno != ERANGE;
  if (!written_zero && std::fabs(value) < smallest)
    fail("%s wants 0 or a number of at least %g in size (got '%s', which %s)", flag.c_str(), smallest, text.c_str(),
         value == 0 ? "reads as 0" : "is too small to keep its precision");
  return value;
}

// The offset of the first byte of `text` that does not begin a well-formed
// UTF-8 sequence (RFC 3629, Unicode's table 3-7), or npos. Strict: no
// overlong forms (C0, C1; E0 80..9F; F0 80..8F), no surrogates (ED A0..BF),
// nothing above U+10FFFF (F4 90.., F5..FF), no stray continuation bytes.
size_t first_bad_utf8(const std::string& text) {
  const size_t n = text.size();
  for (size_t i = 0; i < n;) {
    const unsigned char lead = (unsigned char)text[i];
    if (lead < 0x80) {
      ++i;
      continue;
    }
    size_t length = 0;
    unsigned char low = 0x80, high = 0xbf;  // the range allowed for the second byte
    if (lead >= 0xc2 && lead <= 0xdf) length = 2;
    else if (lead == 0xe0) length = 3, low = 0xa0;
    else if ((lead >= 0xe1 && lead <= 0xec) || lead == 0xee || lead == 0xef) length = 3;
    else if (lead == 0xed) length = 3, high = 0x9f;
    else if (lead == 0xf0) length = 4, low = 0x90;
    else if (lead >= 0xf1 && lead <= 0xf3) length = 4;
    else if (lead == 0xf4) length = 4, high = 0x8f;
    else return i;
    if (i + length > n) return i;
    const unsigned char second = (unsigned char)text[i + 1];
    if (second < low || second > high) return i;
    for (size_t k = 2; k < length; ++k)
      if (((unsigned char)text[i + k] & 0xc0) != 0x80) return i;
    i += length;
  }
  return std::string::npos;
}

// A path's bytes for a message: a byte that is not UTF-8 as \xNN, so the
// message itself stays text a terminal and a JSON reader can take.
static std::string shown_path(const std::string& path) {
  std::string shown;
  for (size_t i = 0; i < path.size();) {
    const size_t bad = first_bad_utf8(path.substr(i));
    const size_t good = bad == std::string::npos ? path.size() - i : bad;
    shown += path.substr(i, good);
    i += good;
    if (i < path.size()) {
      char escaped[8];
      snprintf(escaped, sizeof escaped, "\\x%02x", (unsigned char)path[i++]);
      shown += escaped;
    }
  }
  return shown;
}

// A path: any text but the empty one, which an unset shell variable gives
// ("--json $OUT" with OUT unset would otherwise silently write nothing),
// and UTF-8, as given and made absolute (the working directory's name
// too). The run records paths in JSON (the summary, a checkpoint's index
// holds --data's absolute path), which is UTF-8 only: a name that is not
// would fail when written, after training. Refused here, before anything
// runs, is the one rule for every path flag (notes/14, "What it guards
// against").
std::string parse_path(const std::string& flag, const std::string& text) {
  if (text.empty()) fail("%s wants a path (got an empty one: an unset shell variable?)", flag.c_str());
  if (first_bad_utf8(text) != std::string::npos)
    fail(
        "%s '%s': the path is not UTF-8 (the byte shown as \\x%02x); the run records its paths in JSON, which "
        "holds only UTF-8: rename it",
        flag.c_str(), shown_path(text).c_str(), (unsigned char)text[first_bad_utf8(text)]);
  std::error_code error;
  const std::string absolute = std::filesystem::absolute(text, error).string();
  if (!error && first_bad_utf8(absolute) != std::string::npos)
    fail(
        "%s '%s': the working directory '%s' is not UTF-8; the run records absolute paths in JSON, which holds "
        "only UTF-8: run it from another directory or give an absolute path",
        flag.c_str(), text.c_str(), shown_path(std::filesystem::current_path(error).string()).c_str());
  return text;
}

// "1,2,4,64": positive world sizes, increasing, at most 2^20 (MPI's ranks are int).
static std::vector<int> parse_world_sizes(const std::string& flag, const std::string& text) {
  std::vector<int> sizes;
  size_t begin = 0;
  while (begin <= text.size()) {
    const size_t comma = std::min(text.find(',', begin), text.size());
    const std::string item = text.substr(begin, comma - begin);
    const bool digits = !item.empty() && item.find_first_not_of("0123456789") == std::string::npos;
    const long value = digits && item.size() <= 8 ? std::stol(item) : 0;
    if (value < 1 || value > (1l << 20))
      fail("%s '%s': '%s' is not a world size (a positive integer up to %ld; give them comma-separated, e.g. 1,2,4)",
           flag.c_str(), text.c_str(), item.c_str(), 1l << 20);
    if (!sizes.empty() && value <= sizes.back())
      fail("%s '%s': give the world sizes in increasing order, each once", flag.c_str(), text.c_str());
    sizes.push_back((int)value);
    begin = comma + 1;
  }
  return sizes;
}

std::string parse_choice(const std::string& flag, const std::string& text, std::vector<std::string> choices) {
  for (auto& choice : choices)
    if (text == choice) return text;
  std::string list;
  for (auto& choice : choices) list += (list.empty() ? "" : "|") + choice;
  fail("%s wants %s (got '%s')", flag.c_str(), list.c_str(), text.c_str());
}

// Every "--" flag apply() takes, the switches among them; the command line
// adds its aliases (--deepspeed, --deepspeed_config, --local-rank).
const std::vector<std::string> command_line_flags = {
    "--device", "--comm", "--collectives", "--stage", "--bucket", "--overlap", "--layers", "--hidden", "--heads",
    "--intermediate", "--seq", "--max-positions", "--dropout", "--micro-batch", "--accum", "--steps", "--warmup",
    "--schedule-steps", "--warmup-type", "--decay", "--wall-clock-breakdown", "--portable", "--lr", "--weight-decay",
    "--clip", "--seed", "--log-every", "--eval-every", "--eval-batches", "--data", "--config", "--json", "--plan",
    "--poison-activations", "--plan-world-sizes", "--metrics", "--export-hf", "--dump-batch", "--trace",
    "--trace-params-every", "--init-hf", "--activations", "--alloc", "--offload-optimizer", "--host-threads",
    "--device-memory-limit", "--memory-trace", "--timeline", "--save", "--load", "--save-every", "--save-keep",
    "--save-overwrite", "--allow-different-bits", "--local_rank", "--timeout", "--precision", "--quiet", "--help"};

size_t edit_distance(const std::string& a, const std::string& b) {
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

void apply(Settings& s, const std::string& flag, const std::string& value, std::string name) {
  if (name.empty()) name = flag;  // a config file passes its key, so messages name what the user wrote
  const long big = 1l << 30;
  s.given.insert(flag);
  if (flag == "--device") s.device = parse_choice(name, value, {"auto", "cpu", "cuda", "sim"});
  else if (flag == "--comm") s.comm = parse_choice(name, value, {"auto", "mpi", "nccl"});
  else if (flag == "--collectives") s.collectives = parse_choice(name, value, {"deterministic", "native"});
  else if (flag == "--stage") s.stage = (int)parse_integer(name, value, 0, 2);
  else if (flag == "--bucket") s.bucket = parse_integer(name, value, 1, 1 << 30);  // MPI counts are int
  else if (flag == "--overlap") s.overlap = parse_integer(name, value, 0, 1) != 0;
  else if (flag == "--layers") s.layers = (int)parse_integer(name, value, 1, 256);
  else if (flag == "--hidden") s.hidden = (int)parse_integer(name, value, 1, 16384);
  else if (flag == "--heads") s.heads = (int)parse_integer(name, value, 1, 1024);
  else if (flag == "--intermediate") s.intermediate = (int)parse_integer(name, value, 1, 65536);
  else if (flag == "--seq") s.seq = (int)parse_integer(name, value, 3, 65536);
  else if (flag == "--max-positions") s.max_positions = (int)parse_integer(name, value, 3, 65536);
  else if (flag == "--dropout") s.dropout = (float)parse_real(name, value, 0.0, 1.0, false, FLT_MIN);
  else if (flag == "--micro-batch") s.micro_batch = (int)parse_integer(name, value, 1, 1 << 20);
  else if (flag == "--accum") s.accum = (int)parse_integer(name, value, 1, 1 << 20), s.accum_given = true;
  else if (flag == "--steps") s.steps = parse_integer(name, value, 0, big);  // 0: only with --load (check_consistency)
  else if (flag == "--warmup") s.warmup = parse_integer(name, value, 0, big);
  else if (flag == "--schedule-steps") s.schedule_steps = parse_integer(name, value, 1, big);
  else if (flag == "--warmup-type") s.warmup_type = parse_choice(name, value, {"linear", "log"});
  else if (flag == "--decay") s.decay = parse_choice(name, value, {"linear", "none"});
  else if (flag == "--wall-clock-breakdown") s.wall_clock_breakdown = parse_integer(name, value, 0, 1) != 0;
  else if (flag == "--portable") s.portable = parse_integer(name, value, 0, 1) != 0;
  else if (flag == "--lr") s.lr = parse_real(name, value, 0.0, 10.0);
  else if (flag == "--weight-decay") s.weight_decay = parse_real(name, value, 0.0, 10.0);
  else if (flag == "--clip") s.clip = parse_real(name, value, 0.0, 1e30);
  else if (flag == "--seed") s.seed = (uint64_t)parse_integer(name, value, 0, LONG_MAX);
  else if (flag == "--log-every") s.log_every = parse_integer(name, value, 1, big);
  else if (flag == "--eval-every") s.eval_every = parse_integer(name, value, 0, big);
  else if (flag == "--eval-batches") s.eval_batches = (int)parse_integer(name, value, 1, 1 << 16);
  else if (flag == "--data") s.data = parse_path(name, value);
  else if (flag == "--config") s.config = parse_path(name, value);
  else if (flag == "--json") s.json_path = parse_path(name, value);
  else if (flag == "--plan") s.plan = true;
  else if (flag == "--poison-activations") s.poison_activations = true;
  else if (flag == "--plan-world-sizes") s.plan_world_sizes = parse_world_sizes(name, value);
  else if (flag == "--metrics") s.metrics = parse_path(name, value);
  else if (flag == "--export-hf") s.export_dir = parse_path(name, value);
  else if (flag == "--dump-batch") s.dump_dir = parse_path(name, value);
  else if (flag == "--trace") s.trace_dir = parse_path(name, value);
  else if (flag == "--trace-params-every") s.trace_params_every = parse_integer(name, value, 0, big);
  else if (flag == "--init-hf") s.init_hf = parse_path(name, value);
  else if (flag == "--activations") s.activations = parse_choice(name, value, {"keep", "recompute", "offload"});
  else if (flag == "--alloc") s.alloc = parse_choice(name, value, {"arena", "naive", "caching", "cuda"});
  else if (flag == "--offload-optimizer") s.offload_optimizer = parse_choice(name, value, {"cpu", "none"});
  else if (flag == "--host-threads") s.host_threads = (int)parse_integer(name, value, 0, 1024);
  else if (flag == "--device-memory-limit") s.device_memory_limit = parse_integer(name, value, 4096, LONG_MAX);
  else if (flag == "--memory-trace") s.memory_trace = parse_path(name, value);
  else if (flag == "--timeline") s.timeline = parse_path(name, value);
  else if (flag == "--save") s.save_dir = parse_path(name, value);
  else if (flag == "--load") s.load_dir = parse_path(name, value);
  else if (flag == "--save-every") s.save_every = parse_integer(name, value, 0, big);
  else if (flag == "--save-keep") s.save_keep = (int)parse_integer(name, value, 1, 1 << 20);
  else if (flag == "--save-overwrite") s.save_overwrite = true;
  else if (flag == "--allow-different-bits") s.allow_different_bits = true;
  else if (flag == "--local_rank") s.local_rank = (int)parse_integer(name, value, 0, 1 << 20);
  else if (flag == "--timeout")
    s.timeout = parse_real(name, value, 1, 1e9);  // below a second a healthy wait can expire
  else if (flag == "--precision")
    s.precision = parse_choice(name, value, {"fp32", "bf16", "fp16"}), s.precision_given = true;
  // Not command-line flags: only a config file sets these.
  else if (flag == "fp16.enabled") s.config_fp16_enabled = (int)parse_integer(name, value, 0, 1);
  else if (flag == "bf16.enabled") s.config_bf16_enabled = (int)parse_integer(name, value, 0, 1);
  else if (flag == "loss_scale") s.loss_scaling.static_scale = parse_real(name, value, 0.0, 1e30);
  else if (flag == "initial_scale_power") s.loss_scaling.initial_scale_power = (int)parse_integer(name, value, 0, 100);
  else if (flag == "loss_scale_window") s.loss_scaling.window = parse_integer(name, value, 1, big);
  else if (flag == "hysteresis") s.loss_scaling.hysteresis = (int)parse_integer(name, value, 1, big);
  else if (flag == "consecutive_hysteresis")
    s.loss_scaling.consecutive_hysteresis = parse_integer(name, value, 0, 1) != 0;
  // 0: no floor, as DeepSpeed's DynamicLossScaler takes it (the scale halves until it reaches 0)
  else if (flag == "min_loss_scale") s.loss_scaling.min_scale = parse_real(name, value, 0.0, 1e30);
  else if (flag == "grad_accum_dtype") s.grad_accum_dtype = parse_choice(name, value, {"fp32", "bf16", "fp16"});
  else if (flag == "beta1") s.beta1 = parse_real(name, value, 0.0, 1.0, false);
  else if (flag == "beta2") s.beta2 = parse_real(name, value, 0.0, 1.0, false);
  else if (flag == "eps") s.eps = parse_real(name, value, 1e-30, 1.0);
  else if (flag == "warmup_min_lr") s.warmup_min_lr = parse_real(name, value, 0.0, 10.0);
  // DeepSpeed's scheduler and its params (trainer/deepspeed_config.cpp reads
  // them): ranges where DeepSpeed would divide by zero or step at a negative
  // rate; the checks across params are check_scheduler's.
  else if (flag == "scheduler")
    s.scheduler = parse_choice(name, value, {"warmup", "WarmupCosineLR", "OneCycle", "LRRangeTest"});
  else if (flag == "warmup_min_ratio") s.warmup_min_ratio = parse_real(name, value, 0.0, 1.0);
  else if (flag == "cos_min_ratio") s.cos_min_ratio = parse_real(name, value, 0.0, 1.0);
  else if (flag == "cycle_min_lr") s.cycle_min_lr = parse_real(name, value, 0.0, 10.0);
  else if (flag == "cycle_max_lr") s.cycle_max_lr = parse_real(name, value, 0.0, 10.0);
  else if (flag == "decay_lr_rate") s.decay_lr_rate = parse_real(name, value, 0.0, 1e6);
  else if (flag == "cycle_first_step_size") s.cycle_first_step_size = parse_integer(name, value, 1, big);
  else if (flag == "cycle_second_step_size")  // "none": DeepSpeed's None, the first's
    s.cycle_second_step_size = value == "none" ? -1 : parse_integer(name, value, 0, big);
  else if (flag == "cycle_first_stair_count") s.cycle_first_stair_count = parse_integer(name, value, 0, big);
  else if (flag == "cycle_second_stair_count")
    s.cycle_second_stair_count = value == "none" ? -1 : parse_integer(name, value, 0, big);
  else if (flag == "decay_step_size") s.decay_step_size = parse_integer(name, value, 0, big);
  else if (flag == "cycle_momentum") s.cycle_momentum = parse_integer(name, value, 0, 1) != 0;
  else if (flag == "cycle_min_mom") s.cycle_min_mom = parse_real(name, value, 0.0, 1.0, false);
  else if (flag == "cycle_max_mom") s.cycle_max_mom = parse_real(name, value, 0.0, 1.0, false);
  else if (flag == "decay_mom_rate") s.decay_mom_rate = parse_real(name, value, 0.0, 1e6);
  else if (flag == "lr_range_test_min_lr") s.lr_range_test_min_lr = parse_real(name, value, 0.0, 10.0);
  else if (flag == "lr_range_test_step_size") s.lr_range_test_step_size = parse_integer(name, value, 1, big);
  else if (flag == "lr_range_test_step_rate") s.lr_range_test_step_rate = parse_real(name, value, 0.0, 1e6);
  else if (flag == "lr_range_test_staircase") s.lr_range_test_staircase = parse_integer(name, value, 0, 1) != 0;
  else if (flag == "schedule_convention")
    s.schedule_convention = parse_choice(name, value, {"zero2", "deepspeed", "none"});
  else if (flag == "bias_correction") s.bias_correction = parse_integer(name, value, 0, 1) != 0;
  else if (flag == "train_batch_size") s.train_batch_size = parse_integer(name, value, 1, big);
  else fail("unknown flag '%s' (train_bert_mini --help lists the flags)", flag.c_str());
}

// --- the precision, --help, and the checks across flags ----------------------

// The precision, from --precision and a config's fp16 / bf16 blocks. A
// config alone decides as DeepSpeed does; --precision alone decides; when
// both are given they must agree (the Hugging Face Trainer refuses the same
// contradiction between its --fp16 / --bf16 and a DeepSpeed config).
void resolve_precision(Settings& s) {
  if (s.config_fp16_enabled == 1 && s.config_bf16_enabled == 1)
    fail("config keys 'fp16.enabled' and 'bf16.enabled' are both true: enable one of them");
  const std::string from_config = s.config_fp16_enabled == 1 ? "fp16" : s.config_bf16_enabled == 1 ? "bf16" : "";
  if (s.precision_given) {
    if (!from_config.empty() && from_config != s.precision)
      fail("--precision %s contradicts config key '%s.enabled' = true: give one or make them agree",
           s.precision.c_str(), from_config.c_str());
    if ((s.precision == "fp16" && s.config_fp16_enabled == 0) || (s.precision == "bf16" && s.config_bf16_enabled == 0))
      fail("--precision %s contradicts config key '%s.enabled' = false: give one or make them agree",
           s.precision.c_str(), s.precision.c_str());
  } else if (!from_config.empty()) {
    s.precision = from_config;
  }
  if (s.grad_accum_dtype != "fp32" && s.grad_accum_dtype != s.precision)
    fail(
        "config key 'data_types.grad_accum_dtype' = \"%s\" with precision %s: accumulate in fp32 or in the "
        "training precision",
        s.grad_accum_dtype.c_str(), s.precision.c_str());
}

z2::Precision precision_of(const Settings& s) {
  return s.precision == "bf16"   ? z2::Precision::bf16
         : s.precision == "fp16" ? z2::Precision::fp16
                                 : z2::Precision::fp32;
}

const char* const usage_text = R"usage(usage: mpirun -n N train_bert_mini [flags]
BERT-mini masked-language-model training with ZeRO stage 0, 1 or 2 (README.md, notes/07).
Each flag's default is in parentheses, the DeepSpeed config key that sets it in brackets.
With --config FILE the file means what it means to DeepSpeed 0.16.9: a key it leaves out takes
DeepSpeed's default, not the one in parentheses ("auto" keeps that one; the header names each
setting's source). A flag on the command line overrides the file's key, but not its
train_batch_size: micro-batch x accumulation x ranks must equal it (DeepSpeed's rule), so of
--micro-batch and --accum (flag or key) the one not given follows from it (accumulation 1 when
neither is), and a value that contradicts it, or does not divide it, is refused.

where and how
  --stage 0|1|2              ZeRO stage (2) [zero_optimization.stage]
  --device auto|cpu|cuda|sim compute backend (auto: cuda when a GPU is visible; sim: cuda's streams on the CPU)
  --comm auto|mpi|nccl       communication backend (auto: nccl with cuda, else mpi)
  --collectives deterministic|native   the canonical-order sums, or the library's own (deterministic)
  --bucket ELEMENTS          gradient bucket size (524288) [zero_optimization.reduce_bucket_size]
  --overlap 0|1              reduce buckets during backward (1) [zero_optimization.overlap_comm]
  --precision fp32|bf16|fp16 working precision; fp32 master weights either way (fp32; notes/08)
                             [fp16.enabled, bf16.enabled; fp16's loss-scaler keys]
  --portable                 zero2's own gemm instead of OpenBLAS / cuBLAS: bits that depend on the inputs
                             alone, the same on any CPU, in both builds and on the GPU (notes/11)
                             [zero2_portable: zero2's own key]
  --timeout SECONDS          the watchdog's limit on any wait (600)
  --local_rank N             DeepSpeed's launcher appends it (--local_rank=N, --local-rank N too): it must be
                             MPI's local rank. The ranks are MPI's: start them with mpirun -n N; torchrun's,
                             srun's or Open MPI's variables naming more processes than MPI has are refused
                             (notes/07, "Launching")
model
  --layers L --hidden H --heads NH --intermediate F   (4, 256, 4, 1024: BERT-Mini)
  --seq T --max-positions P  window length and position table (128, 512)
  --dropout P                (0.1)
batch
  --micro-batch B            sequences per rank per micro-step (8) [train_micro_batch_size_per_gpu]
  --accum A                  micro-steps per optimizer step (1) [gradient_accumulation_steps];
                             the global batch B x A x N is [train_batch_size]
  --steps S                  optimizer steps this run trains (100; a config's total_num_steps alone
                             sets it too)
  --seed SEED                every random decision is keyed by it (1)
optimizer: AdamW [optimizer.type "AdamW", or "Adam" with adam_w_mode true]
  --lr LR                    peak learning rate (1e-3) [optimizer.params.lr, scheduler.params.warmup_max_lr]
  --weight-decay WD          decoupled weight decay (0.01) [optimizer.params.weight_decay]
  --clip C                   global gradient-norm clip, 0: none (1.0) [gradient_clipping]
                             betas, eps, bias_correction: config only [optimizer.params.*]
learning-rate schedule (DeepSpeed's WarmupDecayLR and WarmupLR, and more) [scheduler]: without --config the
trainer's own, counted from step 1; with --config DeepSpeed's, as its engine steps it (update t runs
at the scheduler's iteration t - 2), or without a scheduler block the optimizer's lr at every step
unless one of these flags adds one (notes/07)
  --warmup W                 warmup steps (a tenth of the schedule; DeepSpeed's 1000 in a config's
                             scheduler) [scheduler.params.warmup_num_steps]
  --warmup-type linear|log   the warmup's shape (linear; a config's scheduler: log, as DeepSpeed)
                             [scheduler.params.warmup_type]
  --decay linear|none        after the warmup: linear decay to the schedule's end, or constant
                             (linear) [scheduler.type WarmupDecayLR | WarmupLR]
  --schedule-steps K         where the decay ends (--steps) [scheduler.params.total_num_steps];
                             warmup_min_lr: config only [scheduler.params.warmup_min_lr]
  config only: DeepSpeed's WarmupCosineLR (peak: the optimizer's lr; --warmup, --warmup-type and
  --schedule-steps act on it; warmup_min_ratio, cos_min_ratio), OneCycle (cycle_* and decay_* params;
  cycle_momentum, true by default, cycles Adam's beta1 and sets beta2 0.99) and LRRangeTest
  (lr_range_test_*), at the same iterations [scheduler.type, scheduler.params]
memory (ZeRO-R; notes/04, notes/05)
  --activations keep|recompute|offload  what forward leaves for backward (keep)
                             [activation_checkpointing.cpu_checkpointing true: offload]
  --alloc arena|naive|caching|cuda  where device memory comes from (arena): the arena; a best-fit
                             block; a model of PyTorch's caching allocator; cudaMalloc per tensor (GPU)
                             [activation_checkpointing.contiguous_memory_optimization true: arena]
  --offload-optimizer cpu|none  ZeRO-Offload, stages 1 and 2: the fp32 master, AdamW's m and v, the
                             reduced gradient shard and the step in pinned host memory, the same bits (none)
                             [zero_optimization.offload_optimizer.device, zero_optimization.cpu_offload]
  --host-threads K           the offloaded step's threads per rank, the same bits at any K (0: the cores
                             this rank may run on over the ranks sharing them; without --offload-optimizer
                             cpu nothing runs on the host; DeepSpeed: OMP_NUM_THREADS)
  --device-memory-limit BYTES  per rank, rounded down to a multiple of 256 (twice the plan's need + 64 MiB,
                             at most 90% of what is free); with --plan: the limit to find the largest sizes for
  --plan                     train nothing: the bytes per rank by category for stages 0/1/2 at N = 1, 2, 4,
                             ..., 1024, and with --device-memory-limit the largest micro-batch and layer
                             count that fit (notes/10)
  --plan-world-sizes LIST    the N --plan covers, comma-separated (1,2,4,...,1024)
files
  --data FILE                train on this text (UTF-8, at most 1 GiB; the embedded corpus)
  --config FILE              a DeepSpeed config (JSON); notes/07 lists what each key does here
  --deepspeed FILE, --deepspeed_config FILE  the same as --config FILE (Hugging Face's and DeepSpeed's
                             spellings, =FILE too); DeepSpeed's --deepspeed switch alone changes nothing
  --json FILE                the run's summary as JSON (written at the end)
  --metrics FILE             one JSON line per progress line, written as training goes (JSON Lines)
  --export-hf DIR            the trained model for BertForMaskedLM.from_pretrained
  --dump-batch DIR           step 0's weights, batch, loss and gradients (for a reference check)
  --memory-trace FILE        the first step's allocator events
  --timeline FILE            every stream operation, collective and wait as Chrome trace-event JSON
                             (ui.perfetto.dev); on --device sim in a modelled device time (notes/15)
checking another implementation against this run (notes/12)
  --trace DIR                a new or empty DIR: the initial weights, every step's global batch, the settings
                             that fix the arithmetic, every step's loss, grad norm and lr, and the parameters
                             and gradients after step 1, every K-th step and the last (make check-trace)
  --trace-params-every K     with --trace: also the parameters and gradients after every K-th step (0)
  --init-hf DIR              start from a BertForMaskedLM directory's weights (config.json, model.safetensors;
                             the run's sizes) instead of the seed's initialization
checkpoints (notes/09)
  --save DIR                 save DIR/step_<s> at the end (and on SIGINT/SIGTERM); DIR/latest names the newest
  --save-every K             also every K steps (0: only at the end)
  --save-keep K              keep the newest K steps (2) of this run's; nothing else in DIR is deleted
  --save-overwrite           save into a DIR holding another run's checkpoints (refused without it), replacing
                             its steps of the same number and latest (its other steps stay)
  --load DIR                 resume from DIR/latest or DIR/step_<s>, at any N and stage with the same N x A;
                             settings not given are the checkpoint's. --steps 0: only export it (--export-hf)
                             or re-slice it (--save)
  --allow-different-bits     resume at an (N, A) whose summation tree is not the checkpoint's (refused
                             without it): the run goes on, but not to the bits of the run that never stopped
output
  --log-every K              a progress line every K steps (10) [steps_per_print]
  --eval-every K             the MLM loss on held-out data every K steps and at the end (0: never); the
                             last 5% of the data (at least one window) is then held out of training
  --eval-batches E           micro-batches of held-out windows per evaluation (4)
  --wall-clock-breakdown     forward, backward and step times on each progress line [wall_clock_breakdown]
  --quiet                    print nothing but errors (no header, progress or summary)
  --poison-activations       fill each fresh activation buffer with NaN (a test: the model must write
                             every element before reading it, so the bits stay those of a plain run)
  --help                     this text
)usage";

// Where a setting came from, as a message names it: "--stage 0", "config key
// 'zero_optimization.stage' 0", "DeepSpeed's default stage 0 (...)".
std::string said_by(const Settings& s, const std::string& flag, const std::string& value) {
  const auto found = s.origins.find(flag);
  const std::string origin = found == s.origins.end() ? "" : found->second;
  if (origin.rfind("config:", 0) == 0) return "config key '" + origin.substr(7) + "' " + value;
  if (origin.rfind("deepspeed_default:", 0) == 0)
    return flag.substr(2) + " " + value + " (DeepSpeed's default: the config names no " + flag.substr(2) + ")";
  if (origin == "checkpoint") return flag + " " + value + " (the checkpoint's, not given here)";
  if (origin.rfind("trainer_default", 0) == 0) return flag + " " + value + " (the trainer's default, not given here)";
  return flag + " " + value;
}

// ZeRO-Offload moves the optimizer's partition (Ren et al. 2021, section 4):
// stage 0 has none, every rank updating every parameter. DeepSpeed 0.16.9
// fails too: with offload_optimizer it builds DeepSpeedCPUAdam (engine.py
// _configure_basic_optimizer, zero_use_cpu_optimizer), which at stage 0 no
// ZeRO optimizer moves to the host, and its step asserts "CPUAdam param is on
// cuda and must be 'cpu'" (ops/adam/cpu_adam.py DeepSpeedCPUAdam.step).
void check_offload(const Settings& s) {
  if (s.offload_optimizer == "none" || s.stage != 0) return;
  const auto origin = s.origins.find("--offload-optimizer");  // the old spelling's value is true
  const bool old_key = origin != s.origins.end() && origin->second == "config:zero_optimization.cpu_offload";
  const bool from_config = origin != s.origins.end() && origin->second.rfind("config:", 0) == 0;
  const std::string offload_value = old_key ? "true" : from_config ? "\"cpu\"" : "cpu";
  fail(
      "%s with %s: offloading the optimizer needs ZeRO stage 1 or 2, whose optimizer state is partitioned; in "
      "stage 0 every rank updates every parameter (DeepSpeed fails too: its DeepSpeedCPUAdam asserts at the first "
      "step that the parameters are on the cpu, ops/adam/cpu_adam.py). Give --stage 1 or 2, or "
      "--offload-optimizer none",
      said_by(s, "--offload-optimizer", offload_value).c_str(), said_by(s, "--stage", "0").c_str());
}

static void check_scheduler(const Settings& s);  // below, with the schedules

void check_consistency(Settings& s, int world_size) {
  if (s.steps == 0 && !s.export_only)
    fail("--steps wants an integer from 1 to %ld (0 only with --load: export a checkpoint without training)", 1l << 30);
  if (s.export_only && s.export_dir.empty() && s.json_path.empty() && s.save_dir.empty())
    fail(
        "--load with --steps 0 trains nothing: give --export-hf DIR, --save DIR (the checkpoint re-sliced for "
        "this N) or --json FILE for it to write");
  if (!s.load_dir.empty() && !s.dump_dir.empty()) fail("--dump-batch writes step 0 of a fresh run: not with --load");
  if (s.save_every > 0 && s.save_dir.empty()) fail("--save-every %ld needs --save DIR", s.save_every);
  if (s.save_overwrite && s.save_dir.empty())
    fail("--save-overwrite needs --save DIR (it is consent to replace there)");
  if (s.allow_different_bits && s.load_dir.empty())
    fail("--allow-different-bits is for --load (a resume at another split of the global batch): give --load DIR");
  if (s.hidden % s.heads != 0)
    fail("--hidden %d is not divisible by --heads %d (each head gets hidden / heads features)", s.hidden, s.heads);
  // Portable bits need every sum in zero2's order (notes/11); the libraries'
  // own reductions sum over ranks in theirs.
  if (s.portable && s.collectives == "native")
    fail(
        "--portable needs --collectives deterministic: native collectives sum over ranks in MPI's or NCCL's own "
        "order, which depends on the library and the machine");
  if (s.seq > s.max_positions)
    fail("--seq %d is longer than the %d learned positions (--max-positions)", s.seq, s.max_positions);
  // The schedule's length: --schedule-steps (total_num_steps), else the
  // run's. A config's total_num_steps without --steps trains the whole schedule.
  const bool steps_given = s.given.count("--steps") > 0;
  if (s.schedule_steps == 0) s.schedule_steps = s.steps;
  else if (!steps_given && !s.export_only) s.steps = s.schedule_steps;
  // (DeepSpeed's schedulers take a warmup longer than the run: WarmupDecayLR
  // only warns, lr_schedules.py; the header says so.)
  if (s.warmup > s.schedule_steps && s.schedule_convention == "zero2") {
    if (s.schedule_steps == s.steps) fail("--warmup %ld is longer than --steps %ld", s.warmup, s.steps);
    fail("--warmup %ld is longer than the schedule's %ld steps (--schedule-steps, total_num_steps)", s.warmup,
         s.schedule_steps);
  }
  if (s.warmup < 0) s.warmup = s.schedule_steps / 10;
  check_scheduler(s);
  if (s.eval_every > s.steps && !s.export_only)
    fail(
        "--eval-every %ld is more than --steps %ld: it would evaluate only at the end (give --eval-every %ld for that)",
        s.eval_every, s.steps, s.steps);
  if (s.warmup_min_lr > s.lr)
    fail("warmup_min_lr %g is above the learning rate %g (warmup_max_lr, --lr)", s.warmup_min_lr, s.lr);
  // DeepSpeed's rule (runtime/config.py, _set_batch_related_parameters):
  // train_batch_size = micro-batch x accumulation x ranks; of the three, the
  // ones not given follow from the others (accumulation 1 when only the
  // global batch is given), and three given must agree. A resumed run's
  // micro-batch is the checkpoint's, as if given.
  if (s.train_batch_size) {
    const long N = world_size, global = s.train_batch_size;
    const bool micro_given = s.given.count("--micro-batch") || s.checkpoint != nullptr;
    if (micro_given && !s.accum_given) s.accum = (int)std::max(1l, global / s.micro_batch / N);
    else if (!micro_given && s.accum_given) s.micro_batch = (int)std::max(1l, global / N / s.accum);
    else if (!micro_given) s.accum = 1, s.micro_batch = (int)std::max(1l, global / N);
    if (!micro_given) s.origins["--micro-batch"] = "derived:train_batch_size";
    if (!s.accum_given) s.origins["--accum"] = "derived:train_batch_size";
    if (global != (long)s.micro_batch * s.accum * N && micro_given && !s.accum_given)
      fail(
          "config train_batch_size %ld is not a multiple of micro batch %d x %d ranks = %ld (DeepSpeed's rule: the "
          "accumulation is train_batch_size / (micro batch x ranks))",
          global, s.micro_batch, world_size, (long)s.micro_batch * N);
    if (global != (long)s.micro_batch * s.accum * N)
      fail(
          "config train_batch_size %ld != micro batch %d x accumulation %d x %d ranks (DeepSpeed's rule: give two of "
          "the three, or three that agree)",
          global, s.micro_batch, s.accum, world_size);
  }
  if (!s.dump_dir.empty() && world_size != 1)
    fail("--dump-batch writes step 0 of a single-rank run: run it with 1 rank (got %d)", world_size);
  const double tokens = (double)s.micro_batch * s.seq;
  if (tokens * std::max(s.hidden, s.intermediate) > 1.5e9)
    fail("--micro-batch %d x --seq %d is too large for one micro-batch's activations", s.micro_batch, s.seq);
  // MLM learns only from the selected positions: 15% of the seq - 2 bytes of
  // each sequence. A global batch that selects less than one on average has
  // no loss on most steps; training on it would say "NOT falling" and mean nothing.
  const long sequences = (long)s.micro_batch * s.accum * world_size;
  const double selected = 0.15 * (s.seq - 2) * (double)sequences;
  if (selected < 1.0)
    fail(
        "--seq %d leaves %d byte(s) per sequence to mask, and 15%% of them are selected: a global batch of %ld "
        "sequence(s) (micro-batch x accumulation x ranks) selects %.2f positions on average, so most steps would "
        "have no loss to learn from. Use a longer --seq or a larger batch",
        s.seq, s.seq - 2, sequences, selected);
}

void agree_on_errors(MPI_Comm world, const std::function<void()>& checks, const std::string& what) {
  std::string message;
  try {
    checks();
  } catch (const std::exception& error) {  // z2::Error, and std::filesystem's errors (EACCES, a name too long)
    message = error.what();
  }
  int rank = 0, size = 1;
  MPI_Comm_rank(world, &rank);
  MPI_Comm_size(world, &size);
  int mine = message.empty() ? size : rank, first = size;
  z2::watched_allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, world, "the ranks agreeing that " + what);
  if (first == size) return;
  int length = (int)message.size();  // the message's length first: a long path is not cut short
  z2::watched_bcast(&length, 1, MPI_INT, first, world, "the broadcast of a failed check's message");
  std::string text(message);
  text.resize((size_t)length);
  z2::watched_bcast(text.data(), length, MPI_CHAR, first, world, "the broadcast of a failed check's message");
  throw z2::Error(first == 0 ? text : text + " (on rank " + std::to_string(first) + ")");
}

// --- what the settings make for the engine and the model ---------------------

// The trainer's own schedule (without --config), for update t counted from
// 1: a warmup from warmup_min_lr to lr over W steps, linear (t / W) or log
// (ln(t + 1) / ln(W + 1): step 1 learns and step W reaches lr), then
// constant (--decay none) or linear back toward warmup_min_lr at the
// schedule's end S: step S still learns at min + (lr - min) / (S - W). With
// warmup_min_lr 0 (the default) these are the products and quotients of the
// first schedule.
static double trainer_learning_rate(const Settings& s, long t) {
  const double low = s.warmup_min_lr, range = s.lr - s.warmup_min_lr;
  const long S = s.schedule_steps > 0 ? s.schedule_steps : s.steps, W = s.warmup;  // (0 before check_consistency)
  if (t <= W) {
    if (s.warmup_type == "log") return low + range * z2::log_double((double)t + 1) / z2::log_double((double)W + 1);
    return low + range * (double)t / (double)W;
  }
  if (s.decay == "none") return s.lr;
  if (t > S) return low;  // a run longer than its schedule (--steps past --schedule-steps)
  return low + range * (double)(S - t + 1) / (double)(S - W);
}

// DeepSpeed's WarmupLR and WarmupDecayLR as its engine steps them. The
// scheduler sets warmup_min_lr when it is built (lr_schedules.py
// WarmupLR.__init__, last_batch_iteration -1: get_lr returns min_lrs), and
// the engine calls step() after each applied update only (engine.py
// _take_model_step: not after an fp16 overflow), so update t runs at
// iteration i = t - 2. WarmupLR.__init__ raises W to at least 2; _get_gamma:
// ln(i + 1) / ln(W) (as (1 / ln W) * ln(i + 1), the order DeepSpeed
// multiplies in) or i / W while i < W; then 1 (WarmupLR), or
// max(0, (S - i) / max(1, S - W)) (WarmupDecayLR._get_gamma); the rate is
// min + (max - min) * gamma.
static double deepspeed_learning_rate(const Settings& s, long t) {
  const long i = t - 2;
  if (i < 0) return s.warmup_min_lr;
  const double W = (double)std::max(2l, s.warmup), S = (double)s.schedule_steps, iteration = (double)i;
  double gamma = 1.0;
  if (iteration < W)
    gamma = s.warmup_type == "log" ? (1.0 / z2::log_double(W)) * z2::log_double(iteration + 1) : iteration / W;
  else if (s.decay == "linear") gamma = std::max(0.0, (S - iteration) / std::max(1.0, S - W));
  return s.warmup_min_lr + (s.lr - s.warmup_min_lr) * gamma;
}

// DeepSpeed's other three schedulers (lr_schedules.py at v0.16.9), at the
// same iteration i = t - 2 as above (i = -1: the rate __init__ sets), each
// expression in DeepSpeed's order of operations, in double as Python's float.
//
// WarmupCosineLR (lr_schedules.py:774-870): the peak is the optimizer's lr
// (org_lrs, :820); __init__ sets get_lr() at i = -1, which is 0 (:853-857);
// W = max(2, warmup_num_steps) (:814); get_lr_ratio (:826-845): while i < W,
// wmin + ((1 / ln W) ln(i + 1) or i / W) (1 - wmin); then, with r = i - W + 1
// and T = S - W, max(0, cmin + (1 - cmin) (1 + cos(pi r / T)) / 2), with no
// clamp past S (the cosine rises again). check_scheduler refuses S == W
// (ZeroDivisionError at :843 in DeepSpeed). cos(pi r / T) has period 2|T| in
// the integer r, so r is first reduced mod 2|T| (exact): the argument stays
// in [0, 2 pi], where cos_double holds its bound, and within the schedule
// (r < 2T) it is DeepSpeed's own double, pi * r / T.
static double warmup_cosine_learning_rate(const Settings& s, long t) {
  const long i = t - 2;
  if (i < 0) return 0.0;  // get_lr, last_batch_iteration < 0: [0.0]
  const long W = std::max(2l, s.warmup);
  double ratio;
  if (i < W) {
    ratio = s.warmup_type == "log" ? (1.0 / z2::log_double((double)W)) * z2::log_double((double)(i + 1))
                                   : (double)i / (double)W;
    ratio = s.warmup_min_ratio + ratio * (1.0 - s.warmup_min_ratio);
  } else {
    const long T = s.schedule_steps - W, period = 2 * std::labs(T);
    const long r = (i - W + 1) % period;
    const double cosine = z2::cos_double(3.141592653589793 * (double)r / (double)T);
    ratio = std::max(0.0, s.cos_min_ratio + (1.0 - s.cos_min_ratio) * ((1.0 + cosine) / 2.0));
  }
  return s.lr * ratio;
}

// OneCycle (lr_schedules.py:371-630). __init__ sets cycle_min_lr at i = -1
// (_initialize_lr, :495-499). total = first + second step sizes (second None:
// the first's, :478-479), step_ratio = first / total (:482). While
// i < total (get_lr, :584-590), _get_scale_factor (:528-537): b = i + 1,
// cycle = floor(1 + b / total), x = 1 + b / total - cycle, scale x / ratio
// when x <= ratio, else (x - 1) / (ratio - 1); the rate min + (max - min)
// scale (_get_cycle_lr, :550-558). After, with d = i - total + 1
// (_get_decay_lr, :570-582): min / (1 + decay_lr_rate (d / decay_step_size)),
// or min itself when decay_step_size or decay_lr_rate is 0 (skip_lr_decay:
// math.isclose(x, 0) is x == 0 at its default tolerances, :487-492, :504-505).
// The stair counts are never read (:483-484 store them, nothing uses them).
struct OneCycleShape {
  double total, step_ratio;
};
static OneCycleShape one_cycle_shape(const Settings& s) {
  const double first = (double)s.cycle_first_step_size,
               second = s.cycle_second_step_size < 0 ? first : (double)s.cycle_second_step_size;
  const double total = first + second;
  return {total, first / total};
}
static double one_cycle_scale(const OneCycleShape& shape, long i) {
  const double b = (double)(i + 1);
  const double cycle = std::floor(1 + b / shape.total);
  const double x = 1. + b / shape.total - cycle;
  return x <= shape.step_ratio ? x / shape.step_ratio : (x - 1) / (shape.step_ratio - 1);
}
static double one_cycle_learning_rate(const Settings& s, long t) {
  const long i = t - 2;
  if (i < 0) return s.cycle_min_lr;
  const OneCycleShape shape = one_cycle_shape(s);
  if ((double)i < shape.total) return s.cycle_min_lr + (s.cycle_max_lr - s.cycle_min_lr) * one_cycle_scale(shape, i);
  if (s.decay_step_size == 0 || s.decay_lr_rate == 0) return s.cycle_min_lr;
  const double interval = (double)(i - (long)shape.total + 1) / (double)s.decay_step_size;
  return s.cycle_min_lr / (1 + s.decay_lr_rate * interval);
}

// LRRangeTest (lr_schedules.py:273-368): __init__ sets lr_range_test_min_lr
// at i = -1 (:336-337); then min_lr (1 + step_rate interval) (get_lr,
// :345-350), interval = (i + 1) / step_size, or its floor with staircase
// (:339-343). (At i = -1 the formula gives min_lr too.)
static double lr_range_test_learning_rate(const Settings& s, long t) {
  const long i = t - 2;
  if (i < 0) return s.lr_range_test_min_lr;
  double interval = (double)(i + 1) / (double)s.lr_range_test_step_size;
  if (s.lr_range_test_staircase) interval = std::floor(interval);
  return s.lr_range_test_min_lr * (1 + s.lr_range_test_step_rate * interval);
}

double learning_rate(const Settings& s, long t) {
  if (s.schedule_convention == "none") return s.lr;  // no scheduler: the optimizer's rate
  if (s.schedule_convention == "deepspeed") {
    if (s.scheduler == "WarmupCosineLR") return warmup_cosine_learning_rate(s, t);
    if (s.scheduler == "OneCycle") return one_cycle_learning_rate(s, t);
    if (s.scheduler == "LRRangeTest") return lr_range_test_learning_rate(s, t);
    return deepspeed_learning_rate(s, t);
  }
  return trainer_learning_rate(s, t);
}

// OneCycle's momentum (cycle_momentum true, its default): the optimizer's
// betas become (beta1, 0.99) (_initialize_momentum, :508-526, builds
// (cycle_min_mom, 0.99) and (cycle_max_mom, 0.99), whatever the optimizer's
// beta2 was), set in every step() after the rate (:618-624). __init__ sets
// (cycle_min_mom, 0.99) at i = -1 (:521-523), although the cycle's formula
// there would give cycle_max_mom. Then, while i < total, beta1 = max_mom -
// (max_mom - min_mom) scale (_get_cycle_mom, :539-548), the inverse of the
// rate's cycle; after, max_mom (1 + decay_mom_rate (d / decay_step_size)),
// or max_mom when decay_step_size or decay_mom_rate is 0 (_get_decay_mom,
// :560-568; skip_mom_decay, :487-492, :525-526). FusedAdam and
// DeepSpeedCPUAdam read group['betas'] at each step, and their bias
// correction is 1 - beta1^t with the step's beta1 (zero2.cu adamw_constants).
bool betas_cycle(const Settings& s) {
  return s.schedule_convention == "deepspeed" && s.scheduler == "OneCycle" && s.cycle_momentum;
}
std::pair<double, double> adam_betas(const Settings& s, long t) {
  if (!betas_cycle(s)) return {s.beta1, s.beta2};
  const long i = t - 2;
  if (i < 0) return {s.cycle_min_mom, 0.99};
  const OneCycleShape shape = one_cycle_shape(s);
  if ((double)i < shape.total)
    return {s.cycle_max_mom - (s.cycle_max_mom - s.cycle_min_mom) * one_cycle_scale(shape, i), 0.99};
  if (s.decay_step_size == 0 || s.decay_mom_rate == 0) return {s.cycle_max_mom, 0.99};
  const double interval = (double)(i - (long)shape.total + 1) / (double)s.decay_step_size;
  return {s.cycle_max_mom * (1 + s.decay_mom_rate * interval), 0.99};
}

// The checks across one DeepSpeed scheduler's params (each param's own range
// is apply's), where DeepSpeed would raise or step with a beta1 Adam cannot
// take. Said by where each value came from (said_by).
static std::string real_text(double value) {
  char text[32];
  snprintf(text, sizeof text, "%g", value);
  return text;
}
static void check_scheduler(const Settings& s) {
  if (s.schedule_convention != "deepspeed") return;
  // WarmupCosineLR divides by T = S - W once i reaches W (lr_schedules.py:843:
  // ZeroDivisionError); refused before the run, since a longer or resumed run
  // would get there. (S < W only warns in DeepSpeed, :817-819: the header says so.)
  const long W = std::max(2l, s.warmup);
  if (s.scheduler == "WarmupCosineLR" && s.schedule_steps == W)
    fail(
        "%s equals the warmup's %ld iterations (%s; DeepSpeed's WarmupCosineLR raises it to at least 2): its "
        "cosine divides by total_num_steps - warmup_num_steps, so DeepSpeed raises ZeroDivisionError once the "
        "warmup ends (lr_schedules.py:843). Give a total_num_steps other than %ld",
        said_by(s, "--schedule-steps", std::to_string(s.schedule_steps)).c_str(), W,
        said_by(s, "--warmup", std::to_string(s.warmup)).c_str(), W);
  if (s.scheduler != "OneCycle" || !s.cycle_momentum || s.decay_step_size == 0 || s.decay_mom_rate == 0) return;
  // OneCycle's momentum after the cycle grows as max_mom (1 + decay_mom_rate d
  // / decay_step_size) (:560-568); DeepSpeed lets it pass 1, where Adam's m
  // diverges. Refused at the first update of this run where it would.
  const OneCycleShape shape = one_cycle_shape(s);
  const long first_decay = (long)shape.total + 2;  // update t at iteration t - 2 >= total
  if (s.steps < first_decay || adam_betas(s, s.steps).first < 1) return;
  long low = first_decay, high = s.steps;  // beta1 grows with t: the first t where it reaches 1
  while (low < high) {
    const long middle = low + (high - low) / 2;
    if (adam_betas(s, middle).first >= 1) high = middle;
    else low = middle + 1;
  }
  fail(
      "%s takes OneCycle's beta1 to %.17g at update %ld of this run's %ld (cycle_max_mom %g x (1 + decay_mom_rate x "
      "iterations past the cycle / decay_step_size %ld), lr_schedules.py:560-568): Adam's beta1 must stay below 1. "
      "Give a smaller decay_mom_rate, or fewer --steps",
      said_by(s, "decay_mom_rate", real_text(s.decay_mom_rate)).c_str(), adam_betas(s, low).first, low, s.steps,
      s.cycle_max_mom, s.decay_step_size);
}

z2::EngineOptions engine_options(const Settings& settings, z2::Precision precision) {
  z2::EngineOptions options;
  options.stage = settings.stage;
  options.bucket_elements = settings.bucket;
  options.overlap = settings.overlap;
  options.accumulation_steps = settings.accum;
  options.clip = settings.clip;
  options.bias_correction = settings.bias_correction;
  options.lr = settings.lr;
  options.beta1 = settings.beta1, options.beta2 = settings.beta2, options.eps = settings.eps;
  options.weight_decay = settings.weight_decay;
  options.lr_schedule = [settings](long t) { return learning_rate(settings, t); };
  if (betas_cycle(settings)) options.betas_schedule = [settings](long t) { return adam_betas(settings, t); };
  options.precision = precision;
  options.accumulate_fp32 = settings.grad_accum_dtype == "fp32";
  options.loss_scaling = settings.loss_scaling;
  options.offload_optimizer = settings.offload_optimizer == "cpu";
  options.host_threads = settings.host_threads;
  return options;
}

ModelShape shape_of(const Settings& settings) {
  return ModelShape{settings.layers, settings.hidden,        settings.heads,       settings.intermediate,
                    settings.seq,    settings.max_positions, settings.micro_batch, settings.dropout,
                    settings.seed,   precision_of(settings)};
}
ActivationMode mode_of(const Settings& settings) {
  return settings.activations == "recompute" ? ActivationMode::recompute
         : settings.activations == "offload" ? ActivationMode::offload
                                             : ActivationMode::keep;
}

z2::Allocator allocator_of(const Settings& settings) {
  if (settings.alloc == "naive") return z2::Allocator::naive;
  if (settings.alloc == "caching") return z2::Allocator::caching;
  if (settings.alloc == "cuda") return z2::Allocator::direct;
  return z2::Allocator::arena;
}

}  // namespace bert
