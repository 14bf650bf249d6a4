// train_bert_mini.cu — BERT-mini masked-language-model training through the
// zero2 engine, on the CPU (loops + OpenBLAS) or CUDA (kernels + cuBLAS), with
// ZeRO stage 0, 1 or 2 over MPI or NCCL.
//
// The model is Hugging Face's BertForMaskedLM (notes/07): byte-level
// tokens, learned positions, one token type, post-LayerNorm blocks with GELU
// (erf form), an MLM head whose decoder is tied to the word embeddings. Every
// per-element or per-row operation is one Z2_HD function that a CPU loop and a
// CUDA kernel both call (through Compute::for_each); the matrix products go to
// Compute::gemm. There are no float atomics: every sum over rows (bias,
// LayerNorm and embedding gradients) has one thread per output walking the
// rows in order, so the same inputs give the same bits on every run.
//
// ZeRO-R (paper section 6): --activations keep|recompute|offload chooses what
// forward leaves for backward (section 4 below), --alloc arena|naive|caching|cuda where
// device memory comes from (zero2.cu section 2), --device-memory-limit how
// much there is. Every combination gives the same bits.
//
// Mixed precision (notes/08): --precision bf16|fp16 (or the config's "bf16"
// / "fp16" blocks) trains the same model with 16-bit activations, working
// parameters and gradients: the model is one template over its storage type,
// Model<float> / Model<z2::bfloat16> / Model<z2::float16>, each operation
// computed in fp32 and rounded once; fp16 scales the loss (the engine's
// DeepSpeed-style scaler) and skips the steps whose gradients overflow.
//
// Checkpoints (notes/09, section 5b): --save DIR writes one safetensors file
// per rank (its contiguous range of the canonical master, exp_avg,
// exp_avg_sq) and an index with its own SHA-256 beside it; --load DIR
// resumes at any N and stage with the same N x A and summation tree, to the
// bits of the run that never stopped. SIGINT / SIGTERM
// finish the step, save and exit 128 + the signal.
//
// DeepSpeed configs (notes/07): --config reads them as DeepSpeed does, and
// refuses what cannot be honoured here, every such key in one message. The
// export carries a byte-level tokenizer for Hugging Face's AutoTokenizer.
//
// What it leaves out: attention masks (every sequence is a full window of
// text, so there is no padding); a learned tokenizer (bytes are tokens).
//
// Build and run (see the Makefile):
//   make                         # nvcc if present, else mpicxx alone
//   make run                     # 2 ranks, stage 2, on the embedded corpus
//   mpirun -n 4 build/train_bert_mini --stage 2 --data my.txt --steps 500 --json out.json
//
// Tests #include this file with BERT_NO_MAIN defined (as llm.c's test_gpt2
// includes train_gpt2), so the model is tested exactly as it trains.
//
// Sections:
//   1. settings, command line and DeepSpeed-style config
//   2. data: corpus, windows, MLM masking (all keyed by (seed, step, sample))
//   3. Z2_HD math: GELU, LayerNorm, softmax, dropout, cross-entropy
//   4. the model: parameters, initialization, forward, backward
//   5. safetensors and the Hugging Face export, the batch dump
//   6. training loop, progress lines, summary, JSON
#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <csignal>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cfloat>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "zero2.h"

namespace bert {

using json = nlohmann::json;

// Byte-level vocabulary: ids 0..255 are bytes, then four special tokens.
constexpr int vocab_size = 260;
constexpr int pad_token = 256, cls_token = 257, sep_token = 258, mask_token = 259;
constexpr float layer_norm_eps = 1e-12f;
constexpr float initializer_range = 0.02f;  // Hugging Face's normal(0, 0.02) init

// ----------------------------------------------------------------------------
// 1. Settings, command line and config file

struct Settings {
  // where and how to run
  std::string device = "auto", comm = "auto", collectives = "deterministic";
  int stage = 2;
  long bucket = 1 << 19;  // elements per gradient bucket (about 2/3 of a block at the default size)
  bool overlap = true;
  // model (BERT-Mini of Turc et al.)
  int layers = 4, hidden = 256, heads = 4, intermediate = 1024, seq = 128, max_positions = 512;
  float dropout = 0.1f;
  // batch and optimizer
  int micro_batch = 8, accum = 1;
  long steps = 100, warmup = -1;  // warmup -1: a tenth of the schedule
  // The schedule (DeepSpeed's WarmupDecayLR / WarmupLR): warmup from
  // warmup_min_lr to lr over `warmup` steps, linear or log, then a linear
  // decay back to warmup_min_lr at schedule_steps, or none. schedule_steps
  // 0: --steps (the run ends where the decay does).
  long schedule_steps = 0;
  std::string warmup_type = "linear", decay = "linear";
  double warmup_min_lr = 0.0;
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01, clip = 1.0;
  bool bias_correction = true;  // Adam's 1 / (1 - beta^t); DeepSpeed's FusedAdam may turn it off
  uint64_t seed = 1;
  long train_batch_size = 0;  // from a config file only: checked against micro x accum x N
  bool accum_given = false;   // else DeepSpeed derives accum from train_batch_size
  // precision (notes/08): fp32, or bf16 / fp16 mixed precision
  std::string precision = "fp32";
  bool precision_given = false;                            // --precision on the command line
  int config_fp16_enabled = -1, config_bf16_enabled = -1;  // a config's "enabled": -1 absent, 0 false, 1 true
  z2::LossScaling loss_scaling;                            // the config's "fp16" block (DeepSpeed's keys)
  // The config's data_types.grad_accum_dtype. zero2 defaults to fp32 (it keeps
  // (N, A) invariance); DeepSpeed, without the key, accumulates in the model's
  // 16-bit type under ZeRO (engine.py, get_data_types): name it to get that.
  std::string grad_accum_dtype = "fp32";
  // memory (ZeRO-R)
  std::string activations = "keep", alloc = "arena";
  long device_memory_limit = 0;  // bytes per rank; 0: enough for the run
  // files and output
  std::string data, config, json_path, export_dir, dump_dir, memory_trace, metrics;
  double timeout = 600;  // seconds the watchdog lets a collective or transfer wait (zero2.h)
  // checkpoints (notes/09)
  std::string save_dir, load_dir;
  long save_every = 0;  // 0: only at the end (and on an interrupt)
  int save_keep = 2;
  bool export_only = false;          // --load DIR --steps 0: export the checkpoint, train nothing
  bool save_overwrite = false;       // --save-overwrite: may replace another run's steps in --save
  bool allow_different_bits = false;  // --allow-different-bits: resume at a split with another summation tree
  bool summation_tree_changed = false;  // this resume took that consent (recorded in --json)
  std::string run_id;  // the history this run continues (rank 0, with --save): pruning deletes only its steps
  json checkpoint;                   // --load's index.json, read before anything else
  std::string checkpoint_directory;  // the step directory it came from
  // The flags given (command line or config): a resumed run takes the
  // checkpoint's value for every recorded setting not among them.
  std::set<std::string> given;
  long log_every = 10;
  // --eval-every K: every K steps (and at the last), the MLM loss on
  // eval_batches micro-batches drawn from the held-out tail of the data.
  long eval_every = 0;
  int eval_batches = 4;
  bool quiet = false;
  // --plan: print the memory plan and train nothing (notes/10)
  bool plan = false;
  std::vector<int> plan_world_sizes;  // empty: 1, 2, 4, ..., 1024
  bool wall_clock_breakdown = false;  // forward / backward / step times on each progress line (DeepSpeed's key)
  // --portable: zero2's own gemm in place of OpenBLAS / cuBLAS, so that the
  // bits depend on the inputs alone, not on the CPU or GPU (notes/11).
  bool portable = false;
  // --poison-activations: fresh activation buffers full of NaN instead of
  // left as they are (a check that the model reads none before writing it)
  bool poison_activations = false;
  std::vector<std::string> config_notes;  // config keys that act differently here, for the header
  std::vector<std::string> repeated_flags;  // "--steps given twice ('3', then '4')...", for the header
};

// Every error a user can cause ends here: one message, the same on every rank
// (each rank parses the same arguments), printed by rank 0 in main().
// Never cut: a long path must not push the reason off the end.
[[noreturn]] inline void fail(const char* format, ...) {
  va_list arguments;
  va_start(arguments, format);
  std::string message = z2::format_message(format, arguments);
  va_end(arguments);
  throw z2::Error(message);
}

// An input file, read whole: `what` names it in messages. It must be a
// regular file (a FIFO, a device or a terminal could block or never end:
// /dev/stdin, /dev/zero) of at most `max_bytes`, checked before reading.
// Opened once (O_NONBLOCK: opening a FIFO does not wait for a writer) and
// checked on that descriptor, so nothing can be swapped in between; read
// to at most max_bytes + 1, so a file that grows (or a /proc file, size 0)
// cannot get past the bound either.
inline std::string read_regular_file(const std::string& what, const std::string& path, size_t max_bytes) {
  if (path.empty()) fail("%s wants a path (got an empty one: an unset shell variable?)", what.c_str());
  const int file = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (file < 0) fail("cannot open %s '%s': %s", what.c_str(), path.c_str(), std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{file};
  struct stat info;
  if (fstat(file, &info) != 0) fail("cannot read %s '%s': %s", what.c_str(), path.c_str(), std::strerror(errno));
  if (S_ISDIR(info.st_mode)) fail("%s '%s' is a directory, not a file", what.c_str(), path.c_str());
  if (!S_ISREG(info.st_mode))
    fail("%s '%s' is not a regular file (a FIFO, a device or a terminal could block or never end): give a file",
         what.c_str(), path.c_str());
  auto too_large = [&](size_t bytes) {
    fail("%s '%s' has %s bytes%s, more than the %s this trainer reads", what.c_str(), path.c_str(),
         z2::with_commas(bytes).c_str(), bytes > max_bytes + 1 ? "" : " or more", z2::with_commas(max_bytes).c_str());
  };
  if ((unsigned long long)info.st_size > max_bytes) too_large((size_t)info.st_size);
  std::string text;
  char buffer[1 << 16];
  for (;;) {
    const ssize_t got = read(file, buffer, std::min(sizeof buffer, max_bytes + 1 - text.size()));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) fail("cannot read %s '%s': %s", what.c_str(), path.c_str(), std::strerror(errno));
    if (got == 0) break;
    text.append(buffer, (size_t)got);
    if (text.size() > max_bytes) too_large(text.size());
  }
  return text;
}

inline long parse_integer(const std::string& flag, const std::string& text, long low, long high) {
  char* end = nullptr;
  errno = 0;
  long value = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end || errno == ERANGE || value < low || value > high)
    fail("%s wants an integer from %ld to %ld (got '%s')", flag.c_str(), low, high, text.c_str());
  return value;
}

// `smallest` is the least non-zero magnitude the setting keeps: DBL_MIN, or
// FLT_MIN for one stored as a float.
inline double parse_real(const std::string& flag, const std::string& text, double low, double high,
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

inline size_t first_bad_utf8(const std::string& text);  // section 2 (the corpus is held to it too)

// A path's bytes for a message: a byte that is not UTF-8 as \xNN, so the
// message itself stays text a terminal and a JSON reader can take.
inline std::string shown_path(const std::string& path) {
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
// runs, is the one rule for every path flag (README, "When something goes
// wrong").
inline std::string parse_path(const std::string& flag, const std::string& text) {
  if (text.empty()) fail("%s wants a path (got an empty one: an unset shell variable?)", flag.c_str());
  if (first_bad_utf8(text) != std::string::npos)
    fail("%s '%s': the path is not UTF-8 (the byte shown as \\x%02x); the run records its paths in JSON, which "
         "holds only UTF-8: rename it",
         flag.c_str(), shown_path(text).c_str(), (unsigned char)text[first_bad_utf8(text)]);
  std::error_code error;
  const std::string absolute = std::filesystem::absolute(text, error).string();
  if (!error && first_bad_utf8(absolute) != std::string::npos)
    fail("%s '%s': the working directory '%s' is not UTF-8; the run records absolute paths in JSON, which holds "
         "only UTF-8: run it from another directory or give an absolute path",
         flag.c_str(), text.c_str(), shown_path(std::filesystem::current_path(error).string()).c_str());
  return text;
}

// "1,2,4,64": positive world sizes, increasing, at most 2^20 (MPI's ranks are int).
inline std::vector<int> parse_world_sizes(const std::string& flag, const std::string& text) {
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

inline std::string parse_choice(const std::string& flag, const std::string& text, std::vector<std::string> choices) {
  for (auto& choice : choices)
    if (text == choice) return text;
  std::string list;
  for (auto& choice : choices) list += (list.empty() ? "" : "|") + choice;
  fail("%s wants %s (got '%s')", flag.c_str(), list.c_str(), text.c_str());
}

// One flag and its value (as text) into the settings. Config files and the
// command line both end up here, so a value from either is checked the same way.
inline void apply(Settings& s, const std::string& flag, const std::string& value, std::string name = "") {
  if (name.empty()) name = flag;  // a config file passes its key, so messages name what the user wrote
  const long big = 1l << 30;
  s.given.insert(flag);
  if (flag == "--device") s.device = parse_choice(name, value, {"auto", "cpu", "cuda"});
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
  else if (flag == "--activations") s.activations = parse_choice(name, value, {"keep", "recompute", "offload"});
  else if (flag == "--alloc") s.alloc = parse_choice(name, value, {"arena", "naive", "caching", "cuda"});
  else if (flag == "--device-memory-limit") s.device_memory_limit = parse_integer(name, value, 4096, LONG_MAX);
  else if (flag == "--memory-trace") s.memory_trace = parse_path(name, value);
  else if (flag == "--save") s.save_dir = parse_path(name, value);
  else if (flag == "--load") s.load_dir = parse_path(name, value);
  else if (flag == "--save-every") s.save_every = parse_integer(name, value, 0, big);
  else if (flag == "--save-keep") s.save_keep = (int)parse_integer(name, value, 1, 1 << 20);
  else if (flag == "--save-overwrite") s.save_overwrite = true;
  else if (flag == "--allow-different-bits") s.allow_different_bits = true;
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
  else if (flag == "min_loss_scale") s.loss_scaling.min_scale = parse_real(name, value, 1e-30, 1e30);
  else if (flag == "grad_accum_dtype") s.grad_accum_dtype = parse_choice(name, value, {"fp32", "bf16", "fp16"});
  else if (flag == "beta1") s.beta1 = parse_real(name, value, 0.0, 1.0, false);
  else if (flag == "beta2") s.beta2 = parse_real(name, value, 0.0, 1.0, false);
  else if (flag == "eps") s.eps = parse_real(name, value, 1e-30, 1.0);
  else if (flag == "warmup_min_lr") s.warmup_min_lr = parse_real(name, value, 0.0, 10.0);
  else if (flag == "bias_correction") s.bias_correction = parse_integer(name, value, 0, 1) != 0;
  else if (flag == "train_batch_size") s.train_batch_size = parse_integer(name, value, 1, big);
  else fail("unknown flag '%s' (train_bert_mini --help lists the flags)", flag.c_str());
}

// A DeepSpeed configuration file, read as DeepSpeed reads it (notes/07,
// "DeepSpeed configs"). Every key DeepSpeed documents that matters here
// either becomes the flag it corresponds to, or is accepted because it
// changes nothing here (the reason is in a comment beside it), or is refused
// with its reason; a key neither side knows is refused too, because silently
// ignoring a setting the user believes is in force is worse. All the refused
// keys of a file are listed in one message, not one per run. "auto" (the
// Hugging Face Trainer's placeholder, which it fills from its own arguments)
// leaves the setting to the command line or the default, as if absent.
struct ConfigSetting {
  std::string flag, value, key;  // the flag it acts as, its value as text, the config key (for messages)
};
struct ConfigReading {
  std::vector<ConfigSetting> flags;  // what the file sets, as flags, in the order to apply them
  std::vector<std::string> refused;  // "key: why", every refused key of the file
  std::vector<std::string> notes;    // accepted keys that act differently from DeepSpeed (printed in the header)
};
// How deep a config's objects and arrays may nest. DeepSpeed's go 3 deep;
// the JSON library recurses when it frees or prints a value, so a file
// nested 100,000 deep would overflow the stack: we count before it parses.
constexpr int max_config_depth = 16;

// The config file as text, refused with its reason: not a regular file (a
// FIFO would block), larger than a config can be, a NUL byte (which would
// end the text early for some readers), nested too deep.
inline std::string read_config_text(const std::string& path) {
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
inline json parse_config_json(const std::string& path, const std::string& text) {
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
    return json::parse(text, no_duplicates);  // strict: nothing may follow the value
  } catch (const json::exception& e) {        // a syntax error, or a number beyond double (1e400)
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
    json::sax_parse(text, &numbers_);  // valid JSON by now: this pass only collects the numbers' texts
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
      refuse(key, "wants a number (got " + value.dump() + ")");
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
    if (!value.is_boolean()) return refuse(key, "wants true or false (got " + value.dump() + ")");
    out_.flags.push_back({flag, value.get<bool>() ? "1" : "0", key});
  }
  // Accepted with one value only (anything else is refused with `why`).
  void must_be(const std::string& key, const json& value, const json& expected, const std::string& why) {
    if (!is_auto(value) && value != expected) refuse(key, value.dump() + " is not supported: " + why);
  }
  // Accepted whatever its value, when it has the right kind: it changes nothing here.
  void accept_boolean(const std::string& key, const json& value) {
    if (!value.is_boolean() && !is_auto(value)) refuse(key, "wants true or false (got " + value.dump() + ")");
  }
  bool object(const std::string& key, const json& value) {
    if (!value.is_object()) refuse(key, "wants an object (got " + value.dump() + ")");
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
      if (found == names.end()) refuse(name, "wants \"fp32\", \"bf16\" or \"fp16\" (got " + setting.dump() + ")");
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
      refuse(key + ".device", device.dump() +
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
        refuse("optimizer.type", type.dump() +
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
          refuse(full, "wants [beta1, beta2] (got " + entry.dump() + ")");
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
        refuse(key + ".type", named.dump() +
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
        else if (!is_auto(entry)) refuse(full, "wants \"linear\" or \"log\" (got " + entry.dump() + ")");
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
          refuse(name, "wants an integer or null (got " + setting.dump() + ")");
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

// The precision, from --precision and a config's fp16 / bf16 blocks. A
// config alone decides as DeepSpeed does; --precision alone decides; when
// both are given they must agree (the Hugging Face Trainer refuses the same
// contradiction between its --fp16 / --bf16 and a DeepSpeed config).
inline void resolve_precision(Settings& s) {
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

inline z2::Precision precision_of(const Settings& s) {
  return s.precision == "bf16"   ? z2::Precision::bf16
         : s.precision == "fp16" ? z2::Precision::fp16
                                 : z2::Precision::fp32;
}

// What --help prints: every flag, its values and its default (Settings above).
constexpr const char* usage_text = R"usage(usage: mpirun -n N train_bert_mini [flags]
BERT-mini masked-language-model training with ZeRO stage 0, 1 or 2 (README.md, notes/07).
Each flag's default is in parentheses, the DeepSpeed config key that sets it in brackets;
a flag on the command line overrides the config file.

where and how
  --stage 0|1|2              ZeRO stage (2) [zero_optimization.stage]
  --device auto|cpu|cuda     compute backend (auto: cuda when a GPU is visible)
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
learning-rate schedule (DeepSpeed's WarmupDecayLR and WarmupLR) [scheduler]
  --warmup W                 warmup steps (a tenth of the schedule) [scheduler.params.warmup_num_steps]
  --warmup-type linear|log   the warmup's shape (linear; a config's scheduler: log, as DeepSpeed)
                             [scheduler.params.warmup_type]
  --decay linear|none        after the warmup: linear decay to the schedule's end, or constant
                             (linear) [scheduler.type WarmupDecayLR | WarmupLR]
  --schedule-steps K         where the decay ends (--steps) [scheduler.params.total_num_steps];
                             warmup_min_lr: config only [scheduler.params.warmup_min_lr]
memory (ZeRO-R; notes/04, notes/05)
  --activations keep|recompute|offload  what forward leaves for backward (keep)
                             [activation_checkpointing.cpu_checkpointing true: offload]
  --alloc arena|naive|caching|cuda  where device memory comes from (arena): the arena; a best-fit
                             block; a model of PyTorch's caching allocator; cudaMalloc per tensor (GPU)
                             [activation_checkpointing.contiguous_memory_optimization true: arena]
  --device-memory-limit BYTES  per rank, rounded down to a multiple of 256 (twice the plan's need + 64 MiB,
                             at most 90% of what is free); with --plan: the limit to find the largest sizes for
  --plan                     train nothing: the bytes per rank by category for stages 0/1/2 at N = 1, 2, 4,
                             ..., 1024, and with --device-memory-limit the largest micro-batch and layer
                             count that fit (notes/10)
  --plan-world-sizes LIST    the N --plan covers, comma-separated (1,2,4,...,1024)
files
  --data FILE                train on this text (UTF-8, at most 1 GiB; the embedded corpus)
  --config FILE              a DeepSpeed config (JSON); notes/07 lists what each key does here
  --json FILE                the run's summary as JSON (written at the end)
  --metrics FILE             one JSON line per progress line, written as training goes (JSON Lines)
  --export-hf DIR            the trained model for BertForMaskedLM.from_pretrained
  --dump-batch DIR           step 0's weights, batch, loss and gradients (for a reference check)
  --memory-trace FILE        the first step's allocator events
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

// The flags --plan cannot honour: it trains nothing and reads no checkpoint.
inline void check_plan_flags(const Settings& s) {
  if (!s.plan) {
    if (!s.plan_world_sizes.empty()) fail("--plan-world-sizes is for --plan (the memory plan): give --plan too");
    return;
  }
  for (auto [flag, value] : {std::pair<const char*, std::string>{"--save", s.save_dir},
                             {"--load", s.load_dir},
                             {"--export-hf", s.export_dir},
                             {"--dump-batch", s.dump_dir},
                             {"--metrics", s.metrics},
                             {"--memory-trace", s.memory_trace}})
    if (!value.empty())
      fail("--plan trains nothing, so %s '%s' would have nothing to %s: drop one of them", flag, value.c_str(),
           std::string(flag) == "--load" ? "read" : "write");
  if (s.alloc != "arena" && s.device_memory_limit > 0)
    fail(
        "--plan's largest sizes for --device-memory-limit are exact for --alloc arena only: %s's memory also "
        "depends on where its holes fall (make fraglab measures it). Drop --alloc %s, or the limit",
        s.alloc.c_str(), s.alloc.c_str());
}

// The command line. --config is read first, whatever its position, so that
// every flag given on the command line overrides the file.
inline Settings parse_command_line(int argc, char** argv) {
  Settings settings;
  std::vector<std::pair<std::string, std::string>> flags;
  const std::set<std::string> switches = {"--quiet",    "--wall-clock-breakdown", "--plan", "--poison-activations",
                                          "--portable", "--save-overwrite",       "--allow-different-bits"};  // no value
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (switches.count(flag)) {
      const bool on_off = flag == "--wall-clock-breakdown" || flag == "--portable";  // a config key sets these too
      flags.push_back({flag, on_off ? "1" : ""});
      continue;
    }
    if (flag.rfind("--", 0) != 0) fail("unexpected argument '%s' (flags start with --)", flag.c_str());
    const size_t equals = flag.find('=');
    if (equals != std::string::npos && switches.count(flag.substr(0, equals)))
      fail("'%s': %s takes no value (write '%s' to switch it on%s)", flag.c_str(), flag.substr(0, equals).c_str(),
           flag.substr(0, equals).c_str(),
           flag.substr(0, equals) == "--portable" ? "; a config file's \"zero2_portable\": false switches it off" : "");
    if (equals != std::string::npos)
      fail("'%s': write '%s %s' (a flag's value comes after a space)", flag.c_str(), flag.substr(0, equals).c_str(),
           flag.substr(equals + 1).c_str());
    // A missing value shows as the next flag taking its place (negative
    // numbers start with a single dash, so they still pass).
    if (i + 1 >= argc || std::string(argv[i + 1]).rfind("--", 0) == 0) fail("%s needs a value", flag.c_str());
    flags.push_back({flag, argv[++i]});
  }
  for (auto& [flag, value] : flags)
    if (flag == "--config") {
      settings.config = parse_path("--config", value);
      ConfigReading config = ConfigReader(value).read();
      // A value out of range counts as refused too: every problem of the file in one message.
      for (auto& setting : config.flags) {
        try {
          apply(settings, setting.flag, setting.value, "config key '" + setting.key + "'");
        } catch (const z2::Error& error) {
          const std::string said = error.what(), prefix = "config key '" + setting.key + "' ";
          config.refused.push_back(setting.key + ": " +
                                   (said.rfind(prefix, 0) == 0 ? said.substr(prefix.size()) : said));
        }
      }
      if (!config.refused.empty()) {
        std::string message = "the config file '" + value + "' has " + std::to_string(config.refused.size()) +
                              (config.refused.size() == 1 ? " setting" : " settings") +
                              " this trainer cannot take (notes/07 lists what each DeepSpeed key does here):";
        for (auto& line : config.refused) message += "\n  " + line;
        throw z2::Error(message);
      }
      settings.config_notes = config.notes;
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
    else apply(settings, flag, value);
  }
  resolve_precision(settings);
  check_plan_flags(settings);
  return settings;
}

// Checks that need several settings at once (world size known).
inline void check_consistency(Settings& s, int world_size) {
  if (s.steps == 0 && !s.export_only)
    fail("--steps wants an integer from 1 to %ld (0 only with --load: export a checkpoint without training)", 1l << 30);
  if (s.export_only && s.export_dir.empty() && s.json_path.empty() && s.save_dir.empty())
    fail(
        "--load with --steps 0 trains nothing: give --export-hf DIR, --save DIR (the checkpoint re-sliced for "
        "this N) or --json FILE for it to write");
  if (!s.load_dir.empty() && !s.dump_dir.empty()) fail("--dump-batch writes step 0 of a fresh run: not with --load");
  if (s.save_every > 0 && s.save_dir.empty()) fail("--save-every %ld needs --save DIR", s.save_every);
  if (s.save_overwrite && s.save_dir.empty()) fail("--save-overwrite needs --save DIR (it is consent to replace there)");
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
  if (s.warmup > s.schedule_steps) {
    if (s.schedule_steps == s.steps) fail("--warmup %ld is longer than --steps %ld", s.warmup, s.steps);
    fail("--warmup %ld is longer than the schedule's %ld steps (--schedule-steps, total_num_steps)", s.warmup,
         s.schedule_steps);
  }
  if (s.warmup < 0) s.warmup = s.schedule_steps / 10;
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
    const bool micro_given = s.given.count("--micro-batch") || !s.checkpoint.is_null();
    if (micro_given && !s.accum_given) s.accum = (int)std::max(1l, global / s.micro_batch / N);
    else if (!micro_given && s.accum_given) s.micro_batch = (int)std::max(1l, global / N / s.accum);
    else if (!micro_given) s.accum = 1, s.micro_batch = (int)std::max(1l, global / N);
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

// Run `checks` on every rank; if any rank failed, every rank throws the
// message of the lowest failing rank (so rank 0 can print it and all ranks
// leave together instead of some waiting in a collective for the others).
// `what` names the agreement for the watchdog ("the export was written").
inline void agree_on_errors(MPI_Comm world, const std::function<void()>& checks,
                            const std::string& what = "the checks before training") {
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

// ----------------------------------------------------------------------------
// 2. Data
//
// A sample is a window of T - 2 bytes of the corpus between [CLS] and [SEP].
// Global sample g = m * B + b of optimizer step s (m the global micro-batch)
// starts at a position drawn from hash(seed, step, g), and its masking from
// hash(seed, step, g, position): a pure function of (seed, s, m), whatever N, A or
// the rank that computes it: what makes 1x4 = 2x2 = 4x1 (notes/06).

enum Site : uint64_t {  // the first key after the seed: which random decision
  site_window = 1,
  site_select,
  site_action,
  site_random_byte,
  site_dropout = 16  // + 8 * layer + one of the dropout sites below
};
enum DropoutSite : uint64_t {
  dropout_embeddings,
  dropout_attention_probs,
  dropout_attention_output,
  dropout_ffn_output
};
constexpr uint64_t embeddings_layer = 1000;  // dropout key of the embeddings: above any block (--layers <= 256)

// The embedded default corpus (data/corpus.txt, made into a string by the Makefile).
inline const std::string& default_corpus() {
  static const std::string text =
#include "corpus.inc"
      ;
  return text;
}

// The offset of the first byte of `text` that does not begin a well-formed
// UTF-8 sequence (RFC 3629, Unicode's table 3-7), or npos. Strict: no
// overlong forms (C0, C1; E0 80..9F; F0 80..8F), no surrogates (ED A0..BF),
// nothing above U+10FFFF (F4 90.., F5..FF), no stray continuation bytes.
inline size_t first_bad_utf8(const std::string& text) {
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

// The corpus: a regular file of UTF-8 text, non-empty, with no NUL byte (a
// binary file is almost certainly a mistake, not a corpus), at most 1 GiB
// (every rank holds all of it in memory).
constexpr size_t max_corpus_bytes = 1ull << 30;
inline std::string read_corpus(const std::string& path) {
  if (path.empty()) return default_corpus();
  const std::string text = read_regular_file("--data", path, max_corpus_bytes);
  if (text.empty()) fail("--data '%s' is empty", path.c_str());
  const size_t nul = text.find('\0');
  if (nul != std::string::npos)
    fail("--data '%s' has a NUL byte at offset %zu: it looks binary, not UTF-8 text", path.c_str(), nul);
  const size_t bad = first_bad_utf8(text);
  if (bad != std::string::npos)
    fail("--data '%s' is not UTF-8 text (an ill-formed sequence at offset %zu, byte 0x%02x)", path.c_str(), bad,
         (unsigned char)text[bad]);
  return text;
}

// One micro-batch on the host: tokens, which positions the loss reads, and
// the word-embedding gradient's gather lists.
struct Batch {
  std::vector<int> tokens;         // [B, T] input ids after masking
  std::vector<long> labels;        // [B, T] original byte where selected, -100 elsewhere (Hugging Face's convention)
  std::vector<int> selected;       // [S] flat positions b * T + t whose label counts, in order
  std::vector<int> targets;        // [S] their labels
  std::vector<int> token_offsets;  // [V + 1] compressed sparse rows (CSR) by token id: positions with token v are
  std::vector<int> token_rows;     //   token_rows[token_offsets[v] .. token_offsets[v + 1]), in order
};

// Sample `sample` of step `step`: fills row b of the batch.
inline void make_sample(const std::string& corpus, uint64_t seed, long step, long sample, int T, int b, Batch& batch) {
  const size_t window = (size_t)T - 2;
  const size_t starts = corpus.size() - window + 1;
  const size_t start = z2::hash_keys(seed, site_window, (uint64_t)step, (uint64_t)sample) % starts;
  int* tokens = batch.tokens.data() + (size_t)b * T;
  long* labels = batch.labels.data() + (size_t)b * T;
  tokens[0] = cls_token;
  tokens[T - 1] = sep_token;
  labels[0] = labels[T - 1] = -100;
  for (int t = 1; t + 1 < T; ++t) {
    const int byte = (unsigned char)corpus[start + t - 1];
    tokens[t] = byte;
    labels[t] = -100;
    // 15% of the positions are selected; of those 80% become [MASK], 10% a
    // random byte and 10% stay (BERT's recipe). [CLS] and [SEP] never are.
    float select =
        z2::uniform_from_hash(z2::hash_keys(seed, site_select, (uint64_t)step, (uint64_t)sample, (uint64_t)t));
    if (select >= 0.15f) continue;
    labels[t] = byte;
    float action =
        z2::uniform_from_hash(z2::hash_keys(seed, site_action, (uint64_t)step, (uint64_t)sample, (uint64_t)t));
    if (action < 0.8f) tokens[t] = mask_token;
    else if (action < 0.9f)
      tokens[t] = (int)(z2::hash_keys(seed, site_random_byte, (uint64_t)step, (uint64_t)sample, (uint64_t)t) % 256);
  }
}

inline Batch make_batch(const std::string& corpus, uint64_t seed, long step, long micro_batch, int B, int T) {
  Batch batch;
  batch.tokens.resize((size_t)B * T);
  batch.labels.resize((size_t)B * T);
  for (int b = 0; b < B; ++b) make_sample(corpus, seed, step, micro_batch * B + b, T, b, batch);
  for (int i = 0; i < B * T; ++i)
    if (batch.labels[i] >= 0) batch.selected.push_back(i), batch.targets.push_back((int)batch.labels[i]);
  // Counting sort of positions by token id, stable: each embedding row sums
  // its positions in increasing order.
  batch.token_offsets.assign(vocab_size + 1, 0);
  for (int token : batch.tokens) ++batch.token_offsets[token + 1];
  for (int v = 0; v < vocab_size; ++v) batch.token_offsets[v + 1] += batch.token_offsets[v];
  batch.token_rows.resize(batch.tokens.size());
  std::vector<int> next(batch.token_offsets.begin(), batch.token_offsets.end() - 1);
  for (int i = 0; i < B * T; ++i) batch.token_rows[next[batch.tokens[i]]++] = i;
  return batch;
}

// The loss is the mean over the selected positions of the whole global batch
// (all N x A micro-batches), so every rank needs that count. Each rank
// recomputes the masks of all M micro-batches (cheap hashes) instead of asking.
inline long global_selected_count(const std::string& corpus, uint64_t seed, long step, long micro_batches, int B,
                                  int T) {
  long count = 0;
  Batch scratch;
  scratch.tokens.resize((size_t)B * T);
  scratch.labels.resize((size_t)B * T);
  for (long m = 0; m < micro_batches; ++m)
    for (int b = 0; b < B; ++b) {
      make_sample(corpus, seed, step, m * B + b, T, b, scratch);
      for (int t = 0; t < T; ++t) count += scratch.labels[(size_t)b * T + t] >= 0;
    }
  return count;
}

// ----------------------------------------------------------------------------
// 3. Math shared by the CPU loops and the CUDA kernels (Z2_HD)
//
// Each row function is written once over the storage type T: float in fp32
// training, z2::bfloat16 or z2::float16 in mixed precision. Whatever T is, the
// arithmetic is fp32: inputs are widened as they are read, and each result is
// rounded to T once, when it is stored (notes/08). With T = float the
// widening and rounding are identities, so fp32 keeps its bits.
using z2::from_float;
using z2::to_float;

// fmaxf(a, b) as glibc defines it (a NaN loses to a number; a tie returns a),
// written out so the compiler inlines it: fmaxf is a libm call at -O3.
Z2_HD inline float max_or_number(float a, float b) { return (a >= b || b != b) ? a : b; }

// GELU, erf form (Hugging Face "gelu"), and its derivative, both from
// 1 + erf(x / sqrt 2): forward can make the derivative with the erf it
// computes anyway (see linear_gelu).
Z2_HD inline float one_plus_erf(float x) { return 1.0f + z2::erf_fp32(x * 0.70710678118654752f); }
Z2_HD inline float gelu_from(float x, float one_plus_erf_x) { return x * 0.5f * one_plus_erf_x; }
Z2_HD inline float gaussian_exp(float x) { return z2::exp_fp32(-0.5f * x * x); }  // exp(-x^2 / 2)
Z2_HD inline float gelu_grad_from(float x, float one_plus_erf_x, float gaussian_exp_x) {
  const float cdf = 0.5f * one_plus_erf_x;
  const float pdf = gaussian_exp_x * 0.39894228040143268f;  // 1 / sqrt(2 pi)
  return cdf + x * pdf;
}
Z2_HD inline float gelu_grad(float x) { return gelu_grad_from(x, one_plus_erf(x), gaussian_exp(x)); }

// Inverted dropout: the scale an element is multiplied by, 0 or 1 / (1 - p),
// from the element's keys alone (notes/06, "Random numbers"). The keys are
// folded in three steps, each as often as it changes:
//   tensor key (seed, layer and site, step): once per dropout call, on the host;
//   row key: mix64(tensor key ^ global sample), once per sample (the CPU loop
//     hoists it out of the row; a CUDA thread computes it itself);
//   per element: two rounds of mix32, the row key's low half xor the element
//     index into the first and its high half into the second.
// The mask is a function of (seed, layer, site, step, sample, element) alone:
// the same at every N, rank and micro-batch split.
inline uint64_t dropout_tensor_key(uint64_t seed, uint64_t layer_site, long step) {
  return z2::hash_keys(seed, site_dropout + layer_site, (uint64_t)step);
}
Z2_HD inline uint64_t dropout_row_key(uint64_t tensor_key, long sample) {
  return z2::mix64(tensor_key ^ (uint64_t)sample);
}
Z2_HD inline float dropout_scale(float p, uint64_t row_key, uint32_t element) {
  const uint32_t bits = z2::mix32(z2::mix32((uint32_t)row_key ^ element) ^ (uint32_t)(row_key >> 32));
  return z2::uniform_from_hash32(bits) < p ? 0.0f : 1.0f / (1.0f - p);
}
// Dropout of one row of n elements that sit at `first_element` onwards in
// their sample (row_key): output[j] = input[j] x dropout_scale (output may be
// input). The attention's row passes call it next to the softmax, while the
// row is in cache.
template <class T>
Z2_HD inline void dropout_row(float p, uint64_t row_key, size_t first_element, const T* input, T* output, int n) {
  for (int j = 0; j < n; ++j)
    output[j] = from_float<T>(to_float(input[j]) * dropout_scale(p, row_key, (uint32_t)(first_element + j)));
}
// The dropout key of (layer, site): blocks 0..255, the embeddings 1000.
Z2_HD inline uint64_t dropout_key(uint64_t layer, uint64_t site) { return layer * 8 + site; }

// LayerNorm of one row of n: y = (x - mean) / sqrt(var + eps) * gamma + beta,
// with the biased variance, two passes (mean, then squared deviations), in
// index order. We keep mean and 1/sqrt(var + eps) for backward, in fp32 (as
// torch does for a 16-bit LayerNorm).
template <class T>
Z2_HD inline void layer_norm_row(const T* x, const T* gamma, const T* beta, int n, T* y, float* mean_out,
                                 float* rstd_out) {
  float sum = 0.0f;
  for (int j = 0; j < n; ++j) sum += to_float(x[j]);
  const float mean = sum / n;
  float squares = 0.0f;
  for (int j = 0; j < n; ++j) {
    const float deviation = to_float(x[j]) - mean;
    squares += deviation * deviation;
  }
  const float rstd = 1.0f / sqrtf(squares / n + layer_norm_eps);
  for (int j = 0; j < n; ++j)
    y[j] = from_float<T>((to_float(x[j]) - mean) * rstd * to_float(gamma[j]) + to_float(beta[j]));
  *mean_out = mean;
  *rstd_out = rstd;
}
// dx of one row: with xhat = (x - mean) rstd and g = dy * gamma,
// dx = rstd (g - mean(g) - xhat mean(g xhat)).
template <class T>
Z2_HD inline void layer_norm_backward_row(const T* x, float mean, float rstd, const T* gamma, const T* dy, int n,
                                          T* dx) {
  float sum_g = 0.0f, sum_g_xhat = 0.0f;
  for (int j = 0; j < n; ++j) {
    const float g = to_float(dy[j]) * to_float(gamma[j]);
    sum_g += g;
    sum_g_xhat += g * ((to_float(x[j]) - mean) * rstd);
  }
  const float mean_g = sum_g / n, mean_g_xhat = sum_g_xhat / n;
  for (int j = 0; j < n; ++j)
    dx[j] = from_float<T>(
        rstd * (to_float(dy[j]) * to_float(gamma[j]) - mean_g - (to_float(x[j]) - mean) * rstd * mean_g_xhat));
}

// Softmax of one row of n scores times `scale` (1/sqrt(D), applied after the
// product as torch does), in place (max subtracted for range). The scaled
// scores are formed in fp32 as each pass reads them, never stored.
// In fp32 the exponentials are stored in the row, summed, and divided in
// place: exp once per element, the bits of computing it twice.
// A 16-bit row cannot hold them unrounded, so there it is computed again.
// The max, in 8 lanes (element j in lane j % 8, then the lanes in order): a
// max is the same whatever the order, up to the sign of a zero, which
// x - max and exp cannot see; and a row of NaNs still gives row[0]'s. The
// lanes make 8 short dependency chains instead of one long one.
template <class T>
Z2_HD inline float scaled_row_max(const T* row, int n, float scale) {
  constexpr int lanes = 8;
  float lane_max[lanes];
  for (int k = 0; k < lanes; ++k) lane_max[k] = to_float(row[0]) * scale;
  int j = 1;
  for (; j + lanes <= n; j += lanes)
    for (int k = 0; k < lanes; ++k) lane_max[k] = max_or_number(lane_max[k], to_float(row[j + k]) * scale);
  float max_value = lane_max[0];
  for (int k = 1; k < lanes; ++k) max_value = max_or_number(max_value, lane_max[k]);
  for (; j < n; ++j) max_value = max_or_number(max_value, to_float(row[j]) * scale);
  return max_value;
}
template <class T>
Z2_HD inline void scaled_softmax_row(T* row, int n, float scale) {
  const float max_value = scaled_row_max(row, n, scale);
  float sum = 0.0f;
  if constexpr (std::is_same<T, float>::value) {
    // The exponentials in a loop of their own (it vectorises), then their
    // sum in order j = 0, 1, ... (a chain, as it always was).
    for (int j = 0; j < n; ++j) row[j] = z2::exp_fp32(row[j] * scale - max_value);
    for (int j = 0; j < n; ++j) sum += row[j];
    for (int j = 0; j < n; ++j) row[j] = row[j] / sum;
  } else {
    for (int j = 0; j < n; ++j) sum += z2::exp_fp32(to_float(row[j]) * scale - max_value);
    for (int j = 0; j < n; ++j) row[j] = from_float<T>(z2::exp_fp32(to_float(row[j]) * scale - max_value) / sum);
  }
}

// Softmax's backward on one row, with the scale after the product (as in
// forward): d_row holds dL/d probabilities in and dL/d scores out,
// dS = P (dP - rowsum(dP P)) / sqrt(D).
template <class T>
Z2_HD inline void softmax_backward_row(const T* p_row, T* d_row, int n, float scale) {
  float dot = 0.0f;
  for (int j = 0; j < n; ++j) dot += to_float(d_row[j]) * to_float(p_row[j]);
  for (int j = 0; j < n; ++j) d_row[j] = from_float<T>(to_float(p_row[j]) * (to_float(d_row[j]) - dot) * scale);
}

// Cross-entropy of one row of logits against `target`; writes the gradient
// (softmax - one_hot) * scale into dlogits (which may be logits itself) and
// returns -log softmax[target], in fp32.
template <class T>
Z2_HD inline float cross_entropy_row(const T* logits, int n, int target, float scale, T* dlogits) {
  float max_value = to_float(logits[0]);
  for (int j = 1; j < n; ++j) max_value = max_or_number(max_value, to_float(logits[j]));
  float sum = 0.0f;
  for (int j = 0; j < n; ++j) sum += z2::exp_fp32(to_float(logits[j]) - max_value);
  const float log_sum = z2::log_fp32(sum);
  const float loss = log_sum + max_value - to_float(logits[target]);  // read before dlogits may overwrite it
  for (int j = 0; j < n; ++j)
    dlogits[j] =
        from_float<T>((z2::exp_fp32(to_float(logits[j]) - max_value - log_sum) - (j == target ? 1.0f : 0.0f)) * scale);
  return loss;
}

// ----------------------------------------------------------------------------
// 4. The model

struct ModelShape {
  int layers, hidden, heads, intermediate, seq, max_positions, micro_batch;
  float dropout;
  uint64_t seed;
  z2::Precision precision = z2::Precision::fp32;  // of the parameters and activations (notes/08)
  int head_dim() const { return hidden / heads; }
};

// Parameter ids, registered in layer order (embeddings first, MLM head last)
// so that stage 2 can reduce a block's bucket while the blocks below are still
// in backward. Names are Hugging Face's, so an export needs no renaming.
struct BlockParameters {
  z2::ParameterId query_weight, query_bias, key_weight, key_bias, value_weight, value_bias;
  z2::ParameterId attention_output_weight, attention_output_bias, attention_norm_weight, attention_norm_bias;
  z2::ParameterId intermediate_weight, intermediate_bias, output_weight, output_bias, output_norm_weight,
      output_norm_bias;
};
struct Parameters {
  z2::ParameterId word_embeddings, position_embeddings, token_type_embeddings, embedding_norm_weight,
      embedding_norm_bias;
  std::vector<BlockParameters> blocks;
  z2::ParameterId head_dense_weight, head_dense_bias, head_norm_weight, head_norm_bias, decoder_bias;
};

// Parameter count of the model (the tensors registered below), from the
// shape alone, so train() can refuse a configuration that cannot fit before
// allocating anything.
inline size_t parameter_count(const ModelShape& s) {
  const size_t H = s.hidden, F = s.intermediate, V = vocab_size;
  const size_t block = 4 * (H * H + H) + 2 * H + (F * H + F) + (H * F + H) + 2 * H;
  return V * H + (size_t)s.max_positions * H + H + 2 * H + s.layers * block + (H * H + H) + 2 * H + V;
}

// --- activation memory (ZeRO-R, P_a and P_a+cpu: paper section 6.1) ----------
//
// What backward needs from forward, three ways (--activations):
//   keep       every intermediate of every block stays on the device until
//              the block's backward: L x W bytes, W = one block's working set.
//   recompute  only each block's input (its checkpoint, R x H floats) stays;
//              backward runs the block's forward again from it just before
//              the block's backward. Saves (L - 1) W bytes at the peak; costs
//              one more forward (about a third more compute).
//   offload    as recompute, but the checkpoints go to pinned host memory
//              while forward goes on (the copy stream) and come back one block
//              ahead of backward. The device holds one working set plus two
//              checkpoints, whatever L is; the host holds L - 1 checkpoints
//              (the last one is the first backward needs, so it stays).
// The bits are the same in all three: the recomputed forward is the same code
// on the same inputs with the same dropout keys.
enum class ActivationMode { keep, recompute, offload };

// Activation bytes the model holds at once, for the fit check and for the
// tests that hold the ledger to it. The model's buffers, in elements (R = B T
// rows, S = B (T - 2) the most rows the head can select, A = B NH T T), of e
// bytes (4 in fp32, 2 in bf16 and fp16: every activation and activation
// gradient is stored in the precision's type) except the fp32 statistics:
//   always:      batch ints (2R + 2S + V + 1), per-row losses S (fp32)
//   per block:   W = 7 R H (q, k, v, context, two residual sums, attention_out)
//                  + A (probabilities) + 2 R F (FFN), + 4 R (LayerNorm stats, fp32)
//   backward:    the tied decoder's gradient V H, the gradient flowing down R H;
//                block scratch 2 R H + R max(2H, F) + A (+ A for dropped
//                probabilities when dropout is on)
//   head:        4 S H + S V forward, + 3 S H backward, + 2 S (stats, fp32)
// Buffers that live across blocks (checkpoints, kept blocks, the two backward
// buffers) are carved once by the arena (live from start-up) and allocated
// when first written by naive; temporaries are pushed and popped by both.
// (With keep, the last block's output is a temporary: see the Model.)
struct ActivationSizes {
  size_t always, working_set, checkpoint, embedding_sum, backward_long, block_scratch, recompute_scratch, head;
  size_t dropped;  // the dropped probabilities' temporary (0 without dropout)
};
// `round` maps one buffer's bytes to what it takes: the identity for the
// live bytes the ledger counts, z2::block_round for the part of a block
// (arena) it occupies. Each term below is one buffer (see the Model).
using BufferRound = size_t (*)(size_t);
inline size_t live_bytes(size_t bytes) { return bytes; }
inline ActivationSizes activation_sizes(const ModelShape& s, BufferRound round = live_bytes) {
  const size_t B = s.micro_batch, T = s.seq, R = B * T, S = B * (T - 2), H = s.hidden, F = s.intermediate,
               V = vocab_size, scores = B * s.heads * T * T, dropped = s.dropout > 0.0f ? scores : 0, f = sizeof(float),
               i = sizeof(int), e = z2::element_bytes(s.precision);
  ActivationSizes sizes;
  // tokens, selected, targets, token offsets, token rows; per-row losses
  sizes.always = round(R * i) + round(S * i) + round(S * i) + round((V + 1) * i) + round(R * i) + round(S * f);
  // query, key, value, context, attention_sum, attention_out, output_sum; probs; ffn_gelu_saved, ffn_act; two stats
  sizes.working_set = 7 * round(R * H * e) + round(scores * e) + 2 * round(R * F * e) + 2 * round(2 * R * f);
  sizes.checkpoint = round(R * H * e);
  sizes.embedding_sum = round(R * H * e) + round(2 * R * f);
  sizes.backward_long = round(V * H * e) + round(R * H * e);  // decoder gradient, gradient flow
  // dsum, dattention, wide_scratch, dprobs, dropped
  sizes.block_scratch =
      2 * round(R * H * e) + round(R * std::max(2 * H, F) * e) + round(scores * e) + round(dropped * e);
  // The recomputed forward pushes dropped probabilities, pops them, then the
  // output it does not need: never both at once.
  sizes.recompute_scratch = std::max(round(dropped * e), round(R * H * e));
  sizes.head = 7 * round(S * H * e) + round(S * V * e) + round(2 * S * f);  // 7 [S, H], logits, stats
  sizes.dropped = round(dropped * e);
  return sizes;
}

// The most temporaries open at once when a block's working set is itself a
// temporary (recompute, offload): a block's backward (recomputed working set
// plus scratch), the head, or the embeddings' recomputation. (A block's
// forward, W + dropped probabilities, is never more: the scratch holds them too.)
inline size_t recomputing_temporaries(const ActivationSizes& z) {
  return std::max(
      {z.working_set + std::max(z.recompute_scratch, z.block_scratch), z.head, z.embedding_sum + z.checkpoint});
}

// The device activation peak (bytes) the ledger must show, by mode and
// allocator. Phase by phase: what is live while that phase's temporaries are.
inline size_t activation_peak_bytes(const ModelShape& s, ActivationMode mode, bool arena,
                                    BufferRound round = live_bytes) {
  const ActivationSizes z = activation_sizes(s, round);
  const size_t L = s.layers, dropped = z.dropped;
  // Buffers that live across blocks, all at once (the arena carves exactly these).
  size_t carved = z.backward_long;
  if (mode == ActivationMode::keep) carved += z.embedding_sum + L * (z.checkpoint + z.working_set);
  if (mode == ActivationMode::recompute) carved += (L + 1) * z.checkpoint;
  if (mode == ActivationMode::offload) carved += 2 * z.checkpoint;
  const size_t largest_temporary = mode == ActivationMode::keep
                                       ? std::max({dropped, z.checkpoint + z.head, z.block_scratch})
                                       : recomputing_temporaries(z);
  if (arena) return z.always + carved + largest_temporary;
  // naive: the long-lived buffers live only from first write to last read.
  const size_t C = z.checkpoint;
  size_t peak = 0;
  if (mode == ActivationMode::keep) {
    const size_t forward = z.embedding_sum + L * (C + z.working_set);  // before the head's input exists
    peak = std::max(
        {forward + dropped, forward + C + z.backward_long + z.head, forward + z.backward_long + z.block_scratch});
  } else {
    // checkpoints on the device: while the head runs, and in block L-1's backward
    const size_t head_checkpoints = mode == ActivationMode::recompute ? (L + 1) * C : std::min<size_t>(2, L + 1) * C;
    const size_t backward_checkpoints = mode == ActivationMode::recompute ? L * C : std::min<size_t>(2, L) * C;
    const size_t forward_checkpoints = mode == ActivationMode::recompute ? L * C : std::min<size_t>(1, L) * C;
    peak = std::max(
        {forward_checkpoints + z.working_set + std::max(dropped, C), head_checkpoints + z.backward_long + z.head,
         backward_checkpoints + z.backward_long + z.working_set + std::max(z.recompute_scratch, z.block_scratch)});
  }
  return z.always + peak;
}

// The bound offload promises (notes/04, "The bound"), from the configuration: one block's
// working set (its activations and backward scratch) plus two checkpoints,
// plus what every mode holds (the batch, the per-row losses, the two
// backward buffers). The head and the embeddings are smaller phases at any
// BERT-like size; the bound takes the largest phase all the same.
inline size_t offload_activation_bound(const ModelShape& s) {
  const ActivationSizes z = activation_sizes(s);
  return z.always + z.backward_long + 2 * z.checkpoint + recomputing_temporaries(z);
}

// How a parameter is initialized (Hugging Face's _init_weights).
enum class Init { normal, zeros, ones };

// Every parameter in registration order (first layer first: stage 2 then
// reduces the last layers' bucket while backward still works on the first),
// through `add(name, dims, decay, init)`, which returns its id. The model
// registers them with the engine; --plan only collects their sizes.
// Weight decay on linear weights and embeddings; none on biases and
// LayerNorm (Hugging Face's and DeepSpeed's default groups; notes/07).
template <class Add>
inline Parameters declare_parameters(const ModelShape& shape, Add add) {
  const long H = shape.hidden, F = shape.intermediate, V = vocab_size;
  Parameters ids;
  ids.word_embeddings = add("bert.embeddings.word_embeddings.weight", {V, H}, true, Init::normal);
  ids.position_embeddings =
      add("bert.embeddings.position_embeddings.weight", {shape.max_positions, H}, true, Init::normal);
  ids.token_type_embeddings = add("bert.embeddings.token_type_embeddings.weight", {1, H}, true, Init::normal);
  ids.embedding_norm_weight = add("bert.embeddings.LayerNorm.weight", {H}, false, Init::ones);
  ids.embedding_norm_bias = add("bert.embeddings.LayerNorm.bias", {H}, false, Init::zeros);
  for (int l = 0; l < shape.layers; ++l) {
    const std::string p = "bert.encoder.layer." + std::to_string(l) + ".";
    BlockParameters b;
    b.query_weight = add(p + "attention.self.query.weight", {H, H}, true, Init::normal);
    b.query_bias = add(p + "attention.self.query.bias", {H}, false, Init::zeros);
    b.key_weight = add(p + "attention.self.key.weight", {H, H}, true, Init::normal);
    b.key_bias = add(p + "attention.self.key.bias", {H}, false, Init::zeros);
    b.value_weight = add(p + "attention.self.value.weight", {H, H}, true, Init::normal);
    b.value_bias = add(p + "attention.self.value.bias", {H}, false, Init::zeros);
    b.attention_output_weight = add(p + "attention.output.dense.weight", {H, H}, true, Init::normal);
    b.attention_output_bias = add(p + "attention.output.dense.bias", {H}, false, Init::zeros);
    b.attention_norm_weight = add(p + "attention.output.LayerNorm.weight", {H}, false, Init::ones);
    b.attention_norm_bias = add(p + "attention.output.LayerNorm.bias", {H}, false, Init::zeros);
    b.intermediate_weight = add(p + "intermediate.dense.weight", {F, H}, true, Init::normal);
    b.intermediate_bias = add(p + "intermediate.dense.bias", {F}, false, Init::zeros);
    b.output_weight = add(p + "output.dense.weight", {H, F}, true, Init::normal);
    b.output_bias = add(p + "output.dense.bias", {H}, false, Init::zeros);
    b.output_norm_weight = add(p + "output.LayerNorm.weight", {H}, false, Init::ones);
    b.output_norm_bias = add(p + "output.LayerNorm.bias", {H}, false, Init::zeros);
    ids.blocks.push_back(b);
  }
  ids.head_dense_weight = add("cls.predictions.transform.dense.weight", {H, H}, true, Init::normal);
  ids.head_dense_bias = add("cls.predictions.transform.dense.bias", {H}, false, Init::zeros);
  ids.head_norm_weight = add("cls.predictions.transform.LayerNorm.weight", {H}, false, Init::ones);
  ids.head_norm_bias = add("cls.predictions.transform.LayerNorm.bias", {H}, false, Init::zeros);
  ids.decoder_bias = add("cls.predictions.bias", {V}, false, Init::zeros);
  return ids;
}

// Their sizes (elements), as the engine sees them: what the planner lays out.
inline std::vector<size_t> parameter_numels(const ModelShape& shape) {
  std::vector<size_t> numels;
  declare_parameters(shape, [&](const std::string&, const std::vector<long>& dims, bool, Init) {
    size_t numel = 1;
    for (long d : dims) numel *= (size_t)d;
    numels.push_back(numel);
    return (z2::ParameterId)(numels.size() - 1);
  });
  return numels;
}

// One model buffer. The model opens it where a framework would allocate the
// tensor (its first write) and closes it after its last read; where the
// memory comes from depends on the allocator and on how long it lives:
//   long-lived (checkpoints, kept blocks, the backward's two long buffers):
//     arena: carved once at start-up (`carved`), open and close do nothing;
//     naive: allocated at open, released at close, from the free list;
//   temporary (one block's or the head's working set, scratch):
//     pushed at open and popped at close, in last-in-first-out order.
// The allocator sees only bytes; BufferOf<T> gives the model typed access.
struct Buffer {
  size_t count = 0;          // elements
  size_t element_bytes = 4;  // 4 (float), 2 (a 16-bit activation)
  bool long_lived = false;
  bool carved = false;      // arena: `storage` is fixed for the whole run
  void* storage = nullptr;  // while open (always, when carved)
  size_t bytes() const { return count * element_bytes; }
};
template <class T>
struct BufferOf : Buffer {
  BufferOf() { element_bytes = sizeof(T); }
  T* data() const { return static_cast<T*>(storage); }
};

// Activations of one block, kept from forward for backward, in the
// activation type `Act` (LayerNorm statistics in fp32). Shapes use R = B * T
// rows (every token of the micro-batch). The block's input x is its
// checkpoint (Model::checkpoints_[l]).
template <class Act>
struct BlockActivations {
  BufferOf<Act> query, key, value;  // [R, H]   heads side by side: head h is columns h*D .. h*D+D-1
  BufferOf<Act> probs;              // [B, NH, T, T] softmax before dropout
  BufferOf<Act> context;            // [R, H]   probs (after dropout) x value
  BufferOf<Act> attention_sum;      // [R, H]   x + dropout(dense(context)), LayerNorm's input
  BufferOf<float> attention_stats;  // [R, 2]   its mean and rstd
  BufferOf<Act> attention_out;      // [R, H]   LayerNorm output: the FFN's input and residual
  BufferOf<Act> ffn_gelu_saved;     // [R, F]   GELU' before the activation (fp32) or the pre-activation (16-bit)
  BufferOf<Act> ffn_act;            // [R, F]   after GELU
  BufferOf<Act> output_sum;         // [R, H]   attention_out + dropout(dense(ffn_act))
  BufferOf<float> output_stats;     // [R, 2]
  // In the order forward opens them (backward closes them in reverse).
  std::array<Buffer*, 12> in_order() {
    return {&query,           &key,           &value,          &probs,   &context,    &attention_sum,
            &attention_stats, &attention_out, &ffn_gelu_saved, &ffn_act, &output_sum, &output_stats};
  }
};

// The model, written once over its activation type: float (fp32), or
// z2::bfloat16 / z2::float16 (mixed precision: the engine's working
// parameters and gradients are that type too). train() picks one.
template <class Act>
class Model {
 public:
  // Construct after compute.use_allocator(): with the arena, the long-lived
  // buffers are carved here, before the engine's model states.
  Model(z2::Compute& compute, z2::Engine& engine, const ModelShape& shape, ActivationMode mode = ActivationMode::keep);
  ~Model();

  // After engine.build(): Hugging Face's initialization (normal(0, 0.02) for
  // weights and embeddings, zeros for biases, ones for LayerNorm weights),
  // drawn on the host in double from hash(seed, parameter, element) and
  // rounded once, so both backends and every N start from the same bits.
  void initialize();
  // Forward (and, when `backward`, backward with the gradients handed to the
  // engine) of one micro-batch. `loss_scale` is 1 / (selected positions in the
  // global batch). Returns this micro-batch's loss contribution: the sum over
  // its selected positions of loss / count, in the canonical tree. In fp16
  // the gradient also carries the engine's loss scale; the loss does not.
  float run(const Batch& batch, long step, long micro_batch, float loss_scale, bool backward);

  // wall_clock_breakdown: milliseconds run() spent in forward (embeddings
  // and blocks) and in backward (the MLM head's forward and backward, which
  // are one pass, then the blocks' and embeddings' backward), summed over
  // micro-steps until reset. Each boundary synchronizes the device, which
  // costs what the breakdown measures (DeepSpeed's timers synchronize too).
  struct Times {
    double forward_ms = 0, backward_ms = 0;
  };
  void time_phases(bool on) { timing_ = on; }
  // Evaluation: no dropout (torch's model.eval()); training's rate back after.
  void set_evaluation(bool on) {
    if (on) training_dropout_ = shape_.dropout, shape_.dropout = 0.0f;
    else shape_.dropout = training_dropout_;
  }
  Times take_times() { return std::exchange(times_, Times{}); }

  const Parameters& ids() const { return ids_; }
  const ModelShape& shape() const { return shape_; }
  // Tensor shape of parameter `id` as Hugging Face stores it.
  const std::vector<long>& tensor_shape(z2::ParameterId id) const { return shapes_[id]; }

  // The steps of run(). Public only because nvcc does not allow extended
  // (__host__ __device__) lambdas inside private member functions.
  z2::ParameterId add(const std::string& name, std::vector<long> shape, bool decay, Init init);
  Act* param(z2::ParameterId id) { return engine_.template parameter_as<Act>(id); }
  Act* gradient(z2::ParameterId id) { return engine_.template gradient_output_as<Act>(id); }
  void upload(const Batch& batch);
  void embeddings_forward(long step, long first_sample, Act* x0);
  void block_forward(int layer, long step, long first_sample, BufferOf<Act>& output);
  void head_forward_backward(long step, float gradient_scale, bool backward);
  float loss_contribution(float loss_scale);
  void block_backward(int layer, long step, long first_sample);
  void embeddings_backward(long step, long first_sample);
  // Where buffers come from (see Buffer), and the checkpoints' trips to the host.
  void* open_storage(Buffer& buffer);
  template <class T>
  T* open(BufferOf<T>& buffer) {
    return static_cast<T*>(open_storage(buffer));
  }
  void close(Buffer& buffer);
  void open_block(BlockActivations<Act>& block);
  void close_block(BlockActivations<Act>& block);
  BlockActivations<Act>& block(int layer) { return blocks_[mode_ == ActivationMode::keep ? layer : 0]; }
  void offload(int checkpoint);   // device -> host, on the copy stream
  void prefetch(int checkpoint);  // host -> device, on the copy stream
  ActivationMode mode() const { return mode_; }
  // Small building blocks (section 4 continued).
  void matmul_bias(const Act* input, const Act* weight, const Act* bias, int rows, int in, int out, Act* output);
  void linear(const Act* input, z2::ParameterId weight, z2::ParameterId bias, int rows, int in, int out, Act* output);
  void linear_gelu(const Act* input, z2::ParameterId weight, z2::ParameterId bias, int rows, int in, int out,
                   Act* gelu_saved, Act* act);
  void gelu_backward(const Act* gelu_saved, size_t count, Act* dact);
  void linear_dropout_residual(const Act* input, z2::ParameterId weight, z2::ParameterId bias, int rows, int in,
                               int out, const Act* residual, Act* output, long step, long first_sample, uint64_t key);
  void linear_backward(const Act* input, const Act* doutput, z2::ParameterId weight, z2::ParameterId bias, int rows,
                       int in, int out, Act* dinput, float dinput_beta);
  void column_sums(const Act* matrix, int rows, int columns, Act* sums);
  void layer_norm(const Act* x, z2::ParameterId weight, z2::ParameterId bias, int rows, Act* y, float* stats);
  void layer_norm_backward(const Act* x, const float* stats, const Act* dy, z2::ParameterId weight,
                           z2::ParameterId bias, int rows, Act* dx);
  void dropout(const Act* input, Act* output, size_t count, size_t per_sample, long step, long first_sample,
               uint64_t key);

 private:
  z2::Compute& compute_;
  bool timing_ = false;
  float training_dropout_ = 0.0f;
  Times times_;
  std::chrono::steady_clock::time_point phase_start_;
  // The phase that ends now, timed from the last boundary (wall_clock_breakdown only).
  void end_phase(double Times::*phase) {
    if (!timing_) return;
    compute_.synchronize_all();
    const auto now = std::chrono::steady_clock::now();
    times_.*phase += std::chrono::duration<double, std::milli>(now - phase_start_).count();
    phase_start_ = now;
  }
  z2::Engine& engine_;
  ModelShape shape_;
  ActivationMode mode_;
  Parameters ids_;
  std::vector<std::vector<long>> shapes_;
  std::vector<Init> inits_;

  // Device copies of the batch, and the per-row losses: allocated once, as
  // they live through every micro-step.
  z2::DeviceArray<int> tokens_, selected_, targets_, token_offsets_, token_rows_;
  z2::DeviceArray<float> sample_loss_;  // [S] fp32 in every precision
  int selected_count_ = 0;
  // Checkpoint l is block l's input ([R, H]); checkpoint L is the last
  // block's output, the head's input. Long-lived in every mode.
  std::vector<BufferOf<Act>> checkpoints_;
  BufferOf<Act> embedding_sum_;                // [R, H] long-lived with keep, a temporary otherwise
  BufferOf<float> embedding_stats_;            // [R, 2] likewise
  std::vector<BlockActivations<Act>> blocks_;  // keep: one per layer, long-lived; else one working set, temporary
  BufferOf<Act> head_input_, head_gelu_saved_, head_act_,
      head_out_;                                          // [S, H] temporaries (S = the most rows the head can select)
  BufferOf<float> head_stats_;                            // [S, 2]
  BufferOf<Act> logits_;                                  // [S, V]
  BufferOf<Act> head_dout_, head_dact_, head_dgathered_;  // [S, H] the head's backward
  // Long-lived through backward: the tied decoder's part of dL/d
  // word_embeddings [V, H], and dL/d the current block's output [R, H].
  BufferOf<Act> decoder_gradient_, gradient_flow_;
  // Backward scratch of one block (temporaries).
  BufferOf<Act> dsum_, dattention_;  // [R, H]
  BufferOf<Act> wide_scratch_;       // [R, max(2H, F)]: d ffn, later dq and dk side by side
  BufferOf<Act> dropped_, dprobs_;   // [B, NH, T, T] dropped probabilities (dropout only), d probabilities
  BufferOf<Act> recomputed_output_;  // [R, H] the output a recomputed forward writes and nobody reads
  // The arena's carved memory (freed when the model goes), and for offload
  // the host copies of checkpoints 0 .. L-2 (pinned) and their events.
  std::vector<z2::DeviceArray<char>> carved_;
  Act* host_checkpoints_ = nullptr;  // [L - 1, R, H]
  std::vector<z2::Event> produced_, offloaded_, prefetched_;
  std::vector<char> fetched_;  // checkpoint c is back on the device in this backward (offload)
  z2::Event slot_free_;
};

template <class Act>
inline z2::ParameterId Model<Act>::add(const std::string& name, std::vector<long> shape, bool decay, Init init) {
  size_t numel = 1;
  for (long d : shape) numel *= (size_t)d;
  z2::ParameterId id = engine_.add_parameter(name, numel, decay);
  shapes_.push_back(shape);
  inits_.push_back(init);
  return id;
}

template <class Act>
inline Model<Act>::Model(z2::Compute& compute, z2::Engine& engine, const ModelShape& shape, ActivationMode mode)
    : compute_(compute), engine_(engine), shape_(shape), mode_(mode) {
  const long H = shape.hidden, F = shape.intermediate, V = vocab_size;
  ids_ = declare_parameters(shape, [&](const std::string& name, std::vector<long> dims, bool decay, Init init) {
    return add(name, std::move(dims), decay, init);
  });

  if (shape.precision != z2::precision_of<Act>() || engine.precision() != shape.precision)
    fail("the model's activations (%s), its shape's precision (%s) and the engine's (%s) must agree",
         z2::to_string(z2::precision_of<Act>()), z2::to_string(shape.precision), z2::to_string(engine.precision()));
  // Activation buffers. R rows of the micro-batch; at most S = B (T - 2)
  // selected rows reach the head. Every rank makes the same requests in the
  // same order (the head's buffers are sized for S whatever the batch
  // selected), so an out-of-memory is met by all ranks at the same request.
  const size_t B = shape.micro_batch, T = shape.seq, R = B * T, S = B * (T - 2);
  const size_t attention = B * shape.heads * T * T;
  auto ints = [&](size_t count) { return z2::DeviceArray<int>(compute, count, z2::MemoryKind::activations); };
  tokens_ = ints(R), selected_ = ints(S), targets_ = ints(S), token_offsets_ = ints(V + 1), token_rows_ = ints(R);
  sample_loss_ = z2::DeviceArray<float>(compute, S, z2::MemoryKind::activations);
  const bool keep = mode == ActivationMode::keep;
  auto sized = [](Buffer& buffer, size_t count, bool long_lived) {
    buffer.count = count, buffer.long_lived = long_lived;
  };
  checkpoints_.resize(shape.layers + 1);
  for (auto& checkpoint : checkpoints_) sized(checkpoint, R * H, true);
  // With keep, the last block's output lives only from its LayerNorm to the
  // end of the head, while no other temporary is open: a stack entry. (In
  // the other modes that block's working set is still pushed when it is made.)
  if (keep) checkpoints_[shape.layers].long_lived = false;
  sized(embedding_sum_, R * H, keep), sized(embedding_stats_, R * 2, keep);
  blocks_.resize(keep ? shape.layers : 1);
  for (auto& a : blocks_) {
    sized(a.query, R * H, keep), sized(a.key, R * H, keep), sized(a.value, R * H, keep);
    sized(a.probs, attention, keep), sized(a.context, R * H, keep);
    sized(a.attention_sum, R * H, keep), sized(a.attention_stats, R * 2, keep), sized(a.attention_out, R * H, keep);
    sized(a.ffn_gelu_saved, R * F, keep), sized(a.ffn_act, R * F, keep);
    sized(a.output_sum, R * H, keep), sized(a.output_stats, R * 2, keep);
  }
  for (Buffer* b :
       {&head_input_, &head_gelu_saved_, &head_act_, &head_out_, &head_dout_, &head_dact_, &head_dgathered_})
    sized(*b, S * H, false);
  sized(head_stats_, S * 2, false), sized(logits_, S * V, false);
  sized(decoder_gradient_, V * H, true), sized(gradient_flow_, R * H, true);
  sized(dsum_, R * H, false), sized(dattention_, R * H, false), sized(wide_scratch_, R * std::max(2 * H, F), false);
  sized(dropped_, attention, false), sized(dprobs_, attention, false), sized(recomputed_output_, R * H, false);

  if (compute.allocator() == z2::Allocator::arena) {
    // The arena's region for long-lived activations: carve each one once.
    // With offload only two checkpoints are ever on the device at once
    // (checkpoint c uses slot c mod 2), so two slots serve all L + 1.
    auto carve = [&](Buffer& buffer) {
      carved_.emplace_back(compute, buffer.bytes(), z2::MemoryKind::activations);
      buffer.storage = carved_.back().data(), buffer.carved = true;
    };
    if (mode == ActivationMode::offload) {
      for (int slot = 0; slot < 2 && slot <= shape.layers; ++slot) carve(checkpoints_[slot]);
      for (int c = 2; c <= shape.layers; ++c)
        checkpoints_[c].storage = checkpoints_[c % 2].storage, checkpoints_[c].carved = true;
    } else {
      for (auto& checkpoint : checkpoints_)
        if (checkpoint.long_lived) carve(checkpoint);
    }
    if (keep) {
      carve(embedding_sum_), carve(embedding_stats_);
      for (auto& a : blocks_)
        for (Buffer* b : a.in_order()) carve(*b);
    }
    carve(decoder_gradient_), carve(gradient_flow_);
  }
  if (mode == ActivationMode::offload) {
    // Host copies of checkpoints 0 .. L-2: the last one (L-1) is still on the
    // device when backward starts, and backward needs it first.
    if (shape.layers >= 2)
      host_checkpoints_ = (Act*)compute.allocate_host_pinned((size_t)(shape.layers - 1) * R * H * sizeof(Act), true);
    for (int c = 0; c <= shape.layers; ++c)
      produced_.push_back(compute.create_event()), offloaded_.push_back(compute.create_event()),
          prefetched_.push_back(compute.create_event());
    slot_free_ = compute.create_event();
    fetched_.assign(shape.layers >= 2 ? shape.layers - 1 : 0, 0);
  }
}

template <class Act>
inline Model<Act>::~Model() {
  compute_.synchronize_all();
  for (auto* events : {&produced_, &offloaded_, &prefetched_})
    for (z2::Event event : *events) compute_.destroy_event(event);
  if (slot_free_.handle) compute_.destroy_event(slot_free_);
  if (host_checkpoints_) compute_.release_host_pinned(host_checkpoints_);
  // Carved buffers go back in reverse order. (The arena reuses none of it:
  // the engine's buffers were carved above them.)
  while (!carved_.empty()) carved_.pop_back();
}

// --- where buffers come from -------------------------------------------------

template <class Act>
inline void* Model<Act>::open_storage(Buffer& buffer) {
  if (buffer.carved) return buffer.storage;
  buffer.storage = buffer.long_lived ? compute_.allocate(buffer.bytes(), z2::MemoryKind::activations)
                                     : compute_.push(buffer.bytes(), z2::MemoryKind::activations);
  return buffer.storage;
}

template <class Act>
inline void Model<Act>::close(Buffer& buffer) {
  if (buffer.carved || !buffer.storage) return;
  if (buffer.long_lived) compute_.release(buffer.storage);
  else compute_.pop(buffer.storage);
  buffer.storage = nullptr;
}

template <class Act>
inline void Model<Act>::open_block(BlockActivations<Act>& block) {
  for (Buffer* b : block.in_order()) open_storage(*b);
}

template <class Act>
inline void Model<Act>::close_block(BlockActivations<Act>& block) {
  auto buffers = block.in_order();
  for (auto b = buffers.rbegin(); b != buffers.rend(); ++b) close(**b);
}

// Checkpoint c (0 <= c <= L-2) to the host, once forward has written it: the
// copy stream waits for the compute stream's event, then copies while the
// next block computes. On cpu the copy happens at once (into host memory
// that plays the role of pinned memory).
template <class Act>
inline void Model<Act>::offload(int c) {
  fetched_[c] = 0;
  const size_t count = checkpoints_[c].count;
  compute_.record(produced_[c], compute_.compute_stream());
  compute_.wait(compute_.copy_stream(), produced_[c]);
  compute_.copy(host_checkpoints_ + (size_t)c * count, checkpoints_[c].data(), checkpoints_[c].bytes(),
                compute_.copy_stream());
  compute_.record(offloaded_[c], compute_.copy_stream());
}

// Checkpoint c back to the device, one block ahead of its backward. Its slot
// (arena) or fresh memory (naive) was last used by work on the compute
// stream: the copy waits for that, and block c's backward waits for the copy.
template <class Act>
inline void Model<Act>::prefetch(int c) {
  if (c > (int)fetched_.size() - 1 || fetched_[c])
    z2::usage_error(
        "offload: checkpoint %d cannot be brought back now: only checkpoints 0 .. %d go to the host, "
        "each once per backward",
        c, (int)fetched_.size() - 1);
  fetched_[c] = 1;
  const size_t count = checkpoints_[c].count;
  open(checkpoints_[c]);
  compute_.record(slot_free_, compute_.compute_stream());
  compute_.wait(compute_.copy_stream(), slot_free_);
  compute_.copy(checkpoints_[c].data(), host_checkpoints_ + (size_t)c * count, checkpoints_[c].bytes(),
                compute_.copy_stream());
  compute_.record(prefetched_[c], compute_.copy_stream());
}

template <class Act>
inline void Model<Act>::initialize() {
  std::vector<float> values;
  values.reserve(engine_.psi());
  const auto& infos = engine_.parameters();
  for (size_t id = 0; id < infos.size(); ++id)
    for (size_t i = 0; i < infos[id].numel; ++i) {
      // Hugging Face zeroes the [PAD] row of the word embeddings (padding_idx).
      const bool pad_row = (int)id == ids_.word_embeddings && i / shape_.hidden == (size_t)pad_token;
      if (inits_[id] != Init::normal || pad_row) {
        values.push_back(inits_[id] == Init::ones ? 1.0f : 0.0f);
        continue;
      }
      // Box-Muller from two 53-bit uniforms in double: host-only, so the same
      // bits on every backend, and with zero2's log and cos (zero2.h), not
      // libm's, so on every machine. u1 in (0, 1] keeps the logarithm finite.
      uint64_t h1 = z2::hash_keys(shape_.seed, 0x1417, id, i, 1), h2 = z2::hash_keys(shape_.seed, 0x1417, id, i, 2);
      double u1 = ((h1 >> 11) + 1) * (1.0 / 9007199254740992.0), u2 = (h2 >> 11) * (1.0 / 9007199254740992.0);
      double normal = std::sqrt(-2.0 * z2::log_double(u1)) * z2::cos_two_pi(u2);
      values.push_back((float)(normal * initializer_range));
    }
  engine_.parameters_from_host(values);
}

// --- building blocks ---------------------------------------------------------
// --- building blocks ---------------------------------------------------------

// output [rows, out] = input [rows, in] x W^T + b, with W [out, in] (torch's
// Linear, and the tied decoder). fp32: the product, then the bias added (the
// bits zero2 has always had). 16-bit: the bias first, then the product with
// beta = 1, so x W^T + b is summed in fp32 and rounded once, as torch's addmm
// (cuBLAS's epilogue) does; a separate bias add would round twice.
template <class Act>
inline void Model<Act>::matmul_bias(const Act* input, const Act* weight, const Act* bias, int rows, int in, int out,
                                    Act* output) {
  if constexpr (std::is_same<Act, float>::value) {
    compute_.gemm(false, true, rows, out, in, 1.0f, input, in, weight, in, 0.0f, output, out);
    compute_.for_each((size_t)rows, (size_t)out, Z2_LOOP2(r, j, { output[r * out + j] += bias[j]; }));
  } else {
    compute_.for_each((size_t)rows, (size_t)out, Z2_LOOP2(r, j, { output[r * out + j] = bias[j]; }));
    compute_.gemm(false, true, rows, out, in, 1.0f, input, in, weight, in, 1.0f, output, out);
  }
}
template <class Act>
inline void Model<Act>::linear(const Act* input, z2::ParameterId weight, z2::ParameterId bias, int rows, int in,
                               int out, Act* output) {
  matmul_bias(input, param(weight), param(bias), rows, in, out, output);
}

// The two fused forms below are linear() and the pass that follows it in a
// block, with the bias added in that pass (fp32; in 16-bit it is in the
// product, as in matmul_bias): one pass over the output instead of two or
// three, each value rounded exactly as the separate passes round it.
// act [rows, out] = GELU(pre), pre = input x W^T + b, and gelu_saved [rows,
// out] = what GELU's backward reads (as PyTorch's autograd saves a tensor
// for it). fp32: GELU'(pre), made here from the same 1 + erf(pre / sqrt 2)
// as GELU(pre), so backward calls no erf (one of the two per element; the
// same bits as computing it there). 16-bit: pre itself, because GELU'
// rounded to 16 bits would change the gradient's bits.
template <class Act>
inline void Model<Act>::linear_gelu(const Act* input, z2::ParameterId weight, z2::ParameterId bias, int rows, int in,
                                    int out, Act* gelu_saved, Act* act) {
  constexpr bool fp32 = std::is_same<Act, float>::value;
  const Act* b = param(bias);
  if (fp32) {
    compute_.gemm(false, true, rows, out, in, 1.0f, input, in, param(weight), in, 0.0f, act, out);  // act = x W^T
    compute_.for_each((size_t)rows, (size_t)out, Z2_LOOP2(r, j, {
                        const size_t i = r * out + j;
                        const float pre = to_float(act[i]) + to_float(b[j]);
                        const float ope = one_plus_erf(pre);
                        act[i] = from_float<Act>(gelu_from(pre, ope));
                        gelu_saved[i] = from_float<Act>(gelu_grad_from(pre, ope, gaussian_exp(pre)));
                      }));
  } else {
    matmul_bias(input, param(weight), b, rows, in, out, gelu_saved);  // pre, bias in the product
    compute_.for_each((size_t)rows * out, Z2_LOOP(i, {
                        const float pre = to_float(gelu_saved[i]);
                        act[i] = from_float<Act>(gelu_from(pre, one_plus_erf(pre)));
                      }));
  }
}
// dact [count] *= GELU'(pre), from linear_gelu's gelu_saved.
template <class Act>
inline void Model<Act>::gelu_backward(const Act* gelu_saved, size_t count, Act* dact) {
  if constexpr (std::is_same<Act, float>::value)
    compute_.for_each(count, Z2_LOOP(i, { dact[i] = dact[i] * gelu_saved[i]; }));
  else
    compute_.for_each(
        count, Z2_LOOP(i, { dact[i] = from_float<Act>(to_float(dact[i]) * gelu_grad(to_float(gelu_saved[i]))); }));
}
// output [rows, out] = residual + dropout(input x W^T + b), the sublayer
// output of a post-LN block (rows are positions, T per sample; `key` the
// dropout site's).
template <class Act>
inline void Model<Act>::linear_dropout_residual(const Act* input, z2::ParameterId weight, z2::ParameterId bias,
                                                int rows, int in, int out, const Act* residual, Act* output, long step,
                                                long first_sample, uint64_t key) {
  constexpr bool bias_in_pass = std::is_same<Act, float>::value;
  const Act* b = param(bias);
  if (bias_in_pass) compute_.gemm(false, true, rows, out, in, 1.0f, input, in, param(weight), in, 0.0f, output, out);
  else matmul_bias(input, param(weight), b, rows, in, out, output);
  const float rate = shape_.dropout;
  const uint64_t tensor_key = dropout_tensor_key(shape_.seed, key, step);
  const size_t T = (size_t)shape_.seq;
  compute_.for_each(
      (size_t)rows, (size_t)out, Z2_LOOP2(r, j, {
        const size_t i = r * out + j;
        // No branch on the rate: at 0 the scale is exactly 1 and the rounding
        // changes nothing, and a branch-free body is one the CPU loop vectorises.
        const uint64_t row_key = dropout_row_key(tensor_key, first_sample + (long)(r / T));
        float value = to_float(output[i]);
        if (bias_in_pass) value = value + to_float(b[j]);
        value = to_float(from_float<Act>(value * dropout_scale(rate, row_key, (uint32_t)((r % T) * out + j))));
        output[i] = from_float<Act>(value + to_float(residual[i]));
      }));
}

// sums [columns] = the sum over rows of matrix [rows, columns], each column's
// rows added in order (the fixed-order reduction that replaces atomics for
// bias and LayerNorm gradients; Compute::column_sums says how each backend
// runs it).
template <class Act>
inline void Model<Act>::column_sums(const Act* matrix, int rows, int columns, Act* sums) {
  compute_.column_sums((size_t)rows, (size_t)columns, Z2_LOOP2(r, j, { return to_float(matrix[r * columns + j]); }),
                       sums);
}

// Given doutput [rows, out]: db = column sums and dW [out, in] = doutput^T x
// input go to the engine (bias first: the reverse of registration order);
// dinput [rows, in] = doutput x W (+ dinput_beta x dinput, so three
// projections can add into one dinput in a fixed order).
template <class Act>
inline void Model<Act>::linear_backward(const Act* input, const Act* doutput, z2::ParameterId weight,
                                        z2::ParameterId bias, int rows, int in, int out, Act* dinput,
                                        float dinput_beta) {
  column_sums(doutput, rows, out, gradient(bias));
  engine_.gradient_ready(bias);
  compute_.gemm(true, false, out, in, rows, 1.0f, doutput, out, input, in, 0.0f, gradient(weight), in);
  engine_.gradient_ready(weight);
  if (dinput)
    compute_.gemm(false, false, rows, in, out, 1.0f, doutput, out, param(weight), in, dinput_beta, dinput, in);
}

template <class Act>
inline void Model<Act>::layer_norm(const Act* x, z2::ParameterId weight, z2::ParameterId bias, int rows, Act* y,
                                   float* stats) {
  const int n = shape_.hidden;
  const Act *gamma = param(weight), *beta = param(bias);
  compute_.for_each((size_t)rows, Z2_LOOP(r, {
                      layer_norm_row(x + r * n, gamma, beta, n, y + r * n, stats + 2 * r, stats + 2 * r + 1);
                    }));
}

// dx [rows, H] from dy; dbeta = sum_rows dy and dgamma = sum_rows dy * xhat go
// to the engine (one thread per column, rows in order; bias first as above).
template <class Act>
inline void Model<Act>::layer_norm_backward(const Act* x, const float* stats, const Act* dy, z2::ParameterId weight,
                                            z2::ParameterId bias, int rows, Act* dx) {
  const int n = shape_.hidden;
  const Act* gamma = param(weight);
  column_sums(dy, rows, n, gradient(bias));
  engine_.gradient_ready(bias);
  compute_.column_sums((size_t)rows, (size_t)n,
                       Z2_LOOP2(r, j,
                                {
                                  return to_float(dy[r * n + j]) *
                                         ((to_float(x[r * n + j]) - stats[2 * r]) * stats[2 * r + 1]);  // dy * xhat
                                }),
                       gradient(weight));
  engine_.gradient_ready(weight);
  compute_.for_each((size_t)rows, Z2_LOOP(r, {
                      layer_norm_backward_row(x + r * n, stats[2 * r], stats[2 * r + 1], gamma, dy + r * n, n,
                                              dx + r * n);
                    }));
}

// output [B, per_sample] = input x dropout scale, keyed by (sample, key,
// element in sample); output may be input. Backward calls the same function
// on the gradient: the mask is recomputed, not stored. Out of place it is one
// pass (a plain copy when p = 0), not a copy and then a scaling pass.
template <class Act>
inline void Model<Act>::dropout(const Act* input, Act* output, size_t count, size_t per_sample, long step,
                                long first_sample, uint64_t key) {
  const float p = shape_.dropout;
  if (p == 0.0f) {
    compute_.copy(output, input, count * sizeof(Act), compute_.compute_stream());  // nothing if in place
    return;
  }
  if (per_sample > UINT32_MAX)
    z2::usage_error("dropout over %zu elements per sample: the mask's element key is 32 bits (at most %u)", per_sample,
                    UINT32_MAX);
  const uint64_t tensor_key = dropout_tensor_key(shape_.seed, key, step);
  compute_.for_each(count / per_sample, per_sample, Z2_LOOP2(sample, element, {
                      const size_t i = sample * per_sample + element;
                      const uint64_t row_key = dropout_row_key(tensor_key, first_sample + (long)sample);
                      output[i] = from_float<Act>(to_float(input[i]) * dropout_scale(p, row_key, (uint32_t)element));
                    }));
}

// --- forward -----------------------------------------------------------------

template <class Act>
inline void Model<Act>::upload(const Batch& batch) {
  z2::Stream stream = compute_.compute_stream();
  selected_count_ = (int)batch.selected.size();
  compute_.copy(tokens_.data(), batch.tokens.data(), batch.tokens.size() * sizeof(int), stream);
  compute_.copy(selected_.data(), batch.selected.data(), batch.selected.size() * sizeof(int), stream);
  compute_.copy(targets_.data(), batch.targets.data(), batch.targets.size() * sizeof(int), stream);
  compute_.copy(token_offsets_.data(), batch.token_offsets.data(), batch.token_offsets.size() * sizeof(int), stream);
  compute_.copy(token_rows_.data(), batch.token_rows.data(), batch.token_rows.size() * sizeof(int), stream);
}

// x0 = dropout(LayerNorm(word[token] + position[t] + token_type[0])) into
// `x0`; the sum and its LayerNorm stats into embedding_sum_ and
// embedding_stats_, which the caller has opened.
template <class Act>
inline void Model<Act>::embeddings_forward(long step, long first_sample, Act* x0) {
  const int H = shape_.hidden, T = shape_.seq, R = shape_.micro_batch * T;
  const int* tokens = tokens_.data();                       // [R] token ids, row r = sample r / T, position r % T
  const Act *word = param(ids_.word_embeddings),            // [V, H]
      *position = param(ids_.position_embeddings),          // [P, H], rows 0..T-1 used
          *token_type = param(ids_.token_type_embeddings);  // [1, H]: every token is type 0
  Act* sum = embedding_sum_.data();                         // [R, H] LayerNorm's input, for backward
  compute_.for_each((size_t)R, (size_t)H, Z2_LOOP2(row, j, {
                      sum[row * H + j] =
                          from_float<Act>(to_float(word[(size_t)tokens[row] * H + j]) +
                                          to_float(position[(row % T) * H + j]) + to_float(token_type[j]));
                    }));
  layer_norm(sum, ids_.embedding_norm_weight, ids_.embedding_norm_bias, R, x0, embedding_stats_.data());
  dropout(x0, x0, (size_t)R * H, (size_t)T * H, step, first_sample, dropout_key(embeddings_layer, dropout_embeddings));
}

// One post-LN block: a = LN(x + drop(attn(x) Wo + bo)), y = LN(a + drop(gelu(a Wi + bi) Wf + bf)).
// x is checkpoint l; the block's buffers are open; `output` [R, H] receives y
// (checkpoint l + 1, or a scratch buffer when backward recomputes the block).
// We open `output` only when its LayerNorm runs, as a framework allocates a
// result when the operation that makes it runs: with the naive allocator the
// long-lived checkpoint then lands above this block's temporaries.
template <class Act>
inline void Model<Act>::block_forward(int l, long step, long first_sample, BufferOf<Act>& output) {
  const int B = shape_.micro_batch, T = shape_.seq, H = shape_.hidden, NH = shape_.heads, D = shape_.head_dim(),
            F = shape_.intermediate, R = B * T;
  const BlockParameters& p = ids_.blocks[l];
  BlockActivations<Act>& a = block(l);    // this block's activations (shapes in BlockActivations)
  const Act* x = checkpoints_[l].data();  // [R, H] the block's input
  linear(x, p.query_weight, p.query_bias, R, H, H, a.query.data());
  linear(x, p.key_weight, p.key_bias, R, H, H, a.key.data());
  linear(x, p.value_weight, p.value_bias, R, H, H, a.value.data());

  // Scores [T, T] per (sample, head) = Q K^T, then / sqrt(D) and softmax, a
  // row per thread. Q of head h is the D columns at h*D of a [T, H] slab.
  // One batched product per sample, the heads being the batch (stride D in
  // Q, K, V; stride T x T in the scores).
  const size_t scores_per_head = (size_t)T * T;
  for (int b = 0; b < B; ++b) {
    const size_t rows = (size_t)b * T * H, square = (size_t)b * NH * scores_per_head;
    compute_.gemm_batched(false, true, T, T, D, 1.0f, a.query.data() + rows, H, D, a.key.data() + rows, H, D, 0.0f,
                          a.probs.data() + square, T, (long)scores_per_head, NH);
  }
  Act* probs = a.probs.data();  // [B, NH, T, T]: scores now, probabilities after the softmax
  // torch divides the scores by sqrt(D) after the product; so do we (a
  // separate rounding, not folded into the gemm's alpha).
  const float inverse_sqrt = 1.0f / sqrtf((float)D);
  // Softmax and, in the same pass over the row, dropout on the probabilities
  // into a temporary (probs stays for backward).
  const float rate = shape_.dropout;
  Act* dropped = rate > 0.0f ? open(dropped_) : nullptr;  // [B, NH, T, T]
  const uint64_t tensor_key = dropout_tensor_key(shape_.seed, dropout_key(l, dropout_attention_probs), step);
  const size_t rows_per_sample = (size_t)NH * T;
  compute_.for_each((size_t)B * NH * T, Z2_LOOP(row, {
                      Act* row_probs = probs + row * T;
                      scaled_softmax_row(row_probs, T, inverse_sqrt);
                      if (dropped)
                        dropout_row(rate, dropout_row_key(tensor_key, first_sample + (long)(row / rows_per_sample)),
                                    (row % rows_per_sample) * T, row_probs, dropped + row * T, T);
                    }));
  const Act* source = dropped ? dropped : probs;  // what multiplies V: probs, or their dropped copy
  // Context [T, D] per (sample, head) = probs x V, into the head's columns.
  for (int b = 0; b < B; ++b) {
    const size_t rows = (size_t)b * T * H, square = (size_t)b * NH * scores_per_head;
    compute_.gemm_batched(false, false, T, D, T, 1.0f, source + square, T, (long)scores_per_head, a.value.data() + rows,
                          H, D, 0.0f, a.context.data() + rows, H, D, NH);
  }
  if (dropped) close(dropped_);
  // Attention output: dense, dropout, residual, LayerNorm.
  Act* sum = a.attention_sum.data();  // [R, H] x + dropout(context Wo^T + bo), kept for LayerNorm's backward
  linear_dropout_residual(a.context.data(), p.attention_output_weight, p.attention_output_bias, R, H, H, x, sum, step,
                          first_sample, dropout_key(l, dropout_attention_output));
  layer_norm(sum, p.attention_norm_weight, p.attention_norm_bias, R, a.attention_out.data(), a.attention_stats.data());
  // Feed-forward: dense to F, GELU, dense to H, dropout, residual, LayerNorm.
  Act* act = a.ffn_act.data();  // [R, F] after GELU (the output dense's input)
  linear_gelu(a.attention_out.data(), p.intermediate_weight, p.intermediate_bias, R, H, F, a.ffn_gelu_saved.data(),
              act);
  Act* out_sum = a.output_sum.data();  // [R, H] attention_out + dropout(act Wf^T + bf)
  linear_dropout_residual(act, p.output_weight, p.output_bias, R, F, H, a.attention_out.data(), out_sum, step,
                          first_sample, dropout_key(l, dropout_ffn_output));
  layer_norm(out_sum, p.output_norm_weight, p.output_norm_bias, R, open(output), a.output_stats.data());
}

// The MLM head on the S selected rows only: the loss reads no other row, so
// computing the head there gives the same loss and gradients as Hugging
// Face's head over all rows with labels -100 elsewhere, at S/R of the cost.
// With `backward`, also the head's backward, ending with dL/d the last
// block's output in gradient_flow_ (zero on rows that were not selected).
// The per-row losses stay on the device in sample_loss_ (loss_contribution
// reads them). The head's buffers are temporaries, pushed here and popped
// before the blocks' backward starts.
template <class Act>
inline void Model<Act>::head_forward_backward(long step, float gradient_scale, bool backward) {
  const int H = shape_.hidden, V = vocab_size, R = shape_.micro_batch * shape_.seq, S = selected_count_;
  const int* selected = selected_.data();                  // [S] which of the R rows carry a label
  const int* targets = targets_.data();                    // [S] their labels (the original bytes)
  const Act* hidden = checkpoints_[shape_.layers].data();  // [R, H] the last block's output
  Act* gathered = open(head_input_);                       // [S, H] its selected rows
  Act* gelu_saved = open(head_gelu_saved_);                // [S, H] for GELU's backward (see linear_gelu)
  Act* act = open(head_act_);                              // [S, H] after GELU: the head LayerNorm's input
  float* stats = open(head_stats_);                        // [S, 2] fp32
  Act* out = open(head_out_);                              // [S, H] LayerNorm's output: the decoder's input
  Act* logits = open(logits_);                             // [S, V]
  compute_.for_each((size_t)S, (size_t)H,
                    Z2_LOOP2(s, j, { gathered[s * H + j] = hidden[(size_t)selected[s] * H + j]; }));
  linear_gelu(gathered, ids_.head_dense_weight, ids_.head_dense_bias, S, H, H, gelu_saved, act);
  layer_norm(act, ids_.head_norm_weight, ids_.head_norm_bias, S, out, stats);
  // logits [S, V] = out x word_embeddings^T + decoder bias (the tied decoder).
  matmul_bias(out, param(ids_.word_embeddings), param(ids_.decoder_bias), S, H, V, logits);
  // Loss per row (fp32); logits are overwritten by their gradient, already
  // divided by the global count (so the reduced sum over ranks is the mean's
  // gradient) and, in fp16, multiplied by the loss scale.
  float* sample_loss = sample_loss_.data();
  compute_.for_each((size_t)S, Z2_LOOP(s, {
                      Act* row = logits + s * V;
                      sample_loss[s] = cross_entropy_row(row, V, targets[s], gradient_scale, row);
                    }));
  if (backward) {
    const Act* dlogits = logits;  // [S, V] dL/dlogits, in the logits' buffer
    column_sums(dlogits, S, V, gradient(ids_.decoder_bias));
    engine_.gradient_ready(ids_.decoder_bias);
    // The tied decoder's gradient [V, H] = dlogits^T x out. It belongs to the
    // word embeddings, whose bucket is the very first (written last), so we
    // keep it here until the embeddings' backward adds its own part: handing it
    // over now would hold a stage-2 staging slot open through all of backward.
    compute_.gemm(true, false, V, H, S, 1.0f, dlogits, V, out, H, 0.0f, open(decoder_gradient_), H);
    Act* dhidden = open(gradient_flow_);  // [R, H] dL/d the last block's output
    Act* dout = open(head_dout_);         // [S, H] dL/d head LayerNorm output = dlogits x word_embeddings
    compute_.gemm(false, false, S, H, V, 1.0f, dlogits, V, param(ids_.word_embeddings), H, 0.0f, dout, H);
    Act* dact = open(head_dact_);  // [S, H] dL/d GELU output, then (in place) dL/d its input
    layer_norm_backward(act, stats, dout, ids_.head_norm_weight, ids_.head_norm_bias, S, dact);
    gelu_backward(gelu_saved, (size_t)S * H, dact);
    Act* dgathered = open(head_dgathered_);  // [S, H] dL/d the selected rows
    linear_backward(gathered, dact, ids_.head_dense_weight, ids_.head_dense_bias, S, H, H, dgathered, 0.0f);
    // Scatter back to the selected rows; the others get zero.
    compute_.fill_zero(dhidden, (size_t)R * H * sizeof(Act), compute_.compute_stream());
    compute_.for_each((size_t)S, (size_t)H,
                      Z2_LOOP2(s, j, { dhidden[(size_t)selected[s] * H + j] = dgathered[s * H + j]; }));
    close(head_dgathered_), close(head_dact_), close(head_dout_);
  }
  close(logits_), close(head_out_), close(head_stats_), close(head_act_), close(head_gelu_saved_), close(head_input_);
}

// The micro-batch's loss contribution: sum over its S selected rows of
// loss / count, in the canonical tree, on the host. run() calls it only after
// backward has been queued, so the GPU does not sit idle in the middle of a
// micro-step while the host waits for the losses.
template <class Act>
inline float Model<Act>::loss_contribution(float loss_scale) {
  const int S = selected_count_;
  std::vector<float> losses(S);
  compute_.copy(losses.data(), sample_loss_.data(), (size_t)S * sizeof(float), compute_.compute_stream());
  compute_.synchronize(compute_.compute_stream());
  return z2::canonical_tree_sum(S, [&](long s) { return losses[s] * loss_scale; });
}

// --- backward ----------------------------------------------------------------

// Backward of block l: dL/d output in gradient_flow_ in, dL/d input in
// gradient_flow_ out. The block's activations are open (kept, or just
// recomputed); its scratch is pushed here and popped in reverse. (Over 80
// lines on purpose: it is block_forward's operations undone in reverse order,
// and the pushes and pops of its scratch must pair up LIFO within one body.)
template <class Act>
inline void Model<Act>::block_backward(int l, long step, long first_sample) {
  const int B = shape_.micro_batch, T = shape_.seq, H = shape_.hidden, NH = shape_.heads, D = shape_.head_dim(),
            F = shape_.intermediate, R = B * T;
  const BlockParameters& p = ids_.blocks[l];
  BlockActivations<Act>& a = block(l);
  const Act* x = checkpoints_[l].data();  // [R, H] the block's input
  // The flow buffer and three scratch buffers, reused as backward goes up the
  // block (the names say what each holds first; later reuses are named where
  // they happen):
  Act* dy = gradient_flow_.data();  // [R, H] dL/d block output in; dL/d block input out
  Act* dsum = open(dsum_);          // [R, H] dL/d output_sum, then dL/d attention_out
  Act* wide_scratch =
      open(wide_scratch_);         // [R, F] dL/d ffn_act, then dL/d the FFN's pre-activation; later dq, dk [R, H] each
  Act* dattn = open(dattention_);  // [R, H] dL/d attention_sum (the residual into x)

  // Output LayerNorm: dsum = dL/d(attention_out + dropout(ffn)).
  layer_norm_backward(a.output_sum.data(), a.output_stats.data(), dy, p.output_norm_weight, p.output_norm_bias, R,
                      dsum);
  // The FFN branch sees dsum through the dropout; the residual gets dsum itself.
  Act* dffn = dy;  // dy is no longer needed: reuse it
  dropout(dsum, dffn, (size_t)R * H, (size_t)T * H, step, first_sample, dropout_key(l, dropout_ffn_output));
  linear_backward(a.ffn_act.data(), dffn, p.output_weight, p.output_bias, R, F, H, wide_scratch, 0.0f);
  gelu_backward(a.ffn_gelu_saved.data(), (size_t)R * F, wide_scratch);
  // d attention_out = dsum (residual) + wide_scratch x Wi: gemm with beta = 1 adds onto dsum.
  linear_backward(a.attention_out.data(), wide_scratch, p.intermediate_weight, p.intermediate_bias, R, H, F, dsum,
                  1.0f);
  // Attention LayerNorm: dattn = dL/d(x + dropout(dense(context))).
  layer_norm_backward(a.attention_sum.data(), a.attention_stats.data(), dsum, p.attention_norm_weight,
                      p.attention_norm_bias, R, dattn);
  Act* ddense = dsum;  // [R, H] dL/d the attention output dense's result: dattn through the dropout
  dropout(dattn, ddense, (size_t)R * H, (size_t)T * H, step, first_sample, dropout_key(l, dropout_attention_output));
  Act* dcontext = dy;  // [R, H] dL/d context, heads side by side
  linear_backward(a.context.data(), ddense, p.attention_output_weight, p.attention_output_bias, R, H, H, dcontext,
                  0.0f);

  // Attention, per (sample, head): with P the probabilities and Pd = dropout(P),
  // dV = Pd^T dC, dPd = dC V^T, dP = dropout(dPd), dS = P (dP - rowsum(dP P)) / sqrt(D),
  // dQ = dS K, dK = dS^T Q. dq and dk go to wide_scratch (R x max(2H, F)), dv to
  // dsum (free once the attention output's backward is done).
  const size_t scores_per_head = (size_t)T * T;
  const Act* probs = a.probs.data();  // [B, NH, T, T] saved softmax output
  const float rate = shape_.dropout;
  Act* dropped = rate > 0.0f ? open(dropped_) : nullptr;  // [B, NH, T, T] probs after dropout, recomputed from its keys
  Act *dq = wide_scratch, *dk = wide_scratch + (size_t)R * H, *dv = dsum;  // dsum is free again
  Act* dprobs = open(dprobs_);  // [B, NH, T, T] dL/d dropped probs, then d scores
  for (int b = 0; b < B; ++b) {
    const size_t rows = (size_t)b * T * H, square = (size_t)b * NH * scores_per_head;
    compute_.gemm_batched(false, true, T, T, D, 1.0f, dcontext + rows, H, D, a.value.data() + rows, H, D, 0.0f,
                          dprobs + square, T, (long)scores_per_head, NH);
  }
  // One pass over each row: the dropped probabilities (for dV), dP =
  // dropout(dPd) with the same mask, and softmax's backward.
  const uint64_t tensor_key = dropout_tensor_key(shape_.seed, dropout_key(l, dropout_attention_probs), step);
  const size_t rows_per_sample = (size_t)NH * T;
  const float inverse_sqrt = 1.0f / sqrtf((float)D);
  compute_.for_each((size_t)B * NH * T, Z2_LOOP(row, {
                      const Act* p_row = probs + row * T;
                      Act* d_row = dprobs + row * T;
                      if (dropped) {
                        const uint64_t row_key =
                            dropout_row_key(tensor_key, first_sample + (long)(row / rows_per_sample));
                        const size_t first_element = (row % rows_per_sample) * T;
                        dropout_row(rate, row_key, first_element, p_row, dropped + row * T, T);
                        dropout_row(rate, row_key, first_element, d_row, d_row, T);
                      }
                      softmax_backward_row(p_row, d_row, T, inverse_sqrt);
                    }));
  const Act* source = dropped ? dropped : probs;  // what multiplied V in forward
  for (int b = 0; b < B; ++b) {
    const size_t rows = (size_t)b * T * H, square = (size_t)b * NH * scores_per_head;
    compute_.gemm_batched(true, false, T, D, T, 1.0f, source + square, T, (long)scores_per_head, dcontext + rows, H, D,
                          0.0f, dv + rows, H, D, NH);
  }
  for (int b = 0; b < B; ++b) {
    const size_t rows = (size_t)b * T * H, square = (size_t)b * NH * scores_per_head;
    compute_.gemm_batched(false, false, T, D, T, 1.0f, dprobs + square, T, (long)scores_per_head, a.key.data() + rows,
                          H, D, 0.0f, dq + rows, H, D, NH);
    compute_.gemm_batched(true, false, T, D, T, 1.0f, dprobs + square, T, (long)scores_per_head, a.query.data() + rows,
                          H, D, 0.0f, dk + rows, H, D, NH);
  }
  close(dprobs_);
  if (dropped) close(dropped_);
  // dx = dattn (residual) + dv Wv + dk Wk + dq Wq, added in that order into
  // dy: value first, so gradients reach the engine in exactly the reverse of
  // registration order and stage 2 never needs more than its two slots.
  Act* dx = dy;
  compute_.copy(dx, dattn, (size_t)R * H * sizeof(Act), compute_.compute_stream());
  close(dattention_);
  linear_backward(x, dv, p.value_weight, p.value_bias, R, H, H, dx, 1.0f);
  linear_backward(x, dk, p.key_weight, p.key_bias, R, H, H, dx, 1.0f);
  linear_backward(x, dq, p.query_weight, p.query_bias, R, H, H, dx, 1.0f);
  close(wide_scratch_), close(dsum_);
}

// Embeddings' backward, last: dL/d x0 in gradient_flow_, the embedding sum
// and stats open (kept, or just recomputed).
template <class Act>
inline void Model<Act>::embeddings_backward(long step, long first_sample) {
  const int H = shape_.hidden, T = shape_.seq, B = shape_.micro_batch, R = B * T, P = shape_.max_positions;
  Act* dx0 = gradient_flow_.data();  // [R, H] dL/d x0 (from block 0's backward)
  dropout(dx0, dx0, (size_t)R * H, (size_t)T * H, step, first_sample,
          dropout_key(embeddings_layer, dropout_embeddings));
  Act* dsum = open(dsum_);  // [R, H] dL/d (word + position + type)
  layer_norm_backward(embedding_sum_.data(), embedding_stats_.data(), dx0, ids_.embedding_norm_weight,
                      ids_.embedding_norm_bias, R, dsum);
  // Token type 0 is at every position: the column sums.
  column_sums(dsum, R, H, gradient(ids_.token_type_embeddings));
  engine_.gradient_ready(ids_.token_type_embeddings);
  // Position t collects row t of every sample, samples in order; unused positions get 0.
  Act* dposition = gradient(ids_.position_embeddings);  // [P, H]
  compute_.for_each((size_t)P, (size_t)H, Z2_LOOP2(t, j, {
                      float sum = 0.0f;
                      if (t < (size_t)T)
                        for (int b = 0; b < B; ++b) sum += to_float(dsum[((size_t)b * T + t) * H + j]);
                      dposition[t * H + j] = from_float<Act>(sum);
                    }));
  engine_.gradient_ready(ids_.position_embeddings);
  // Word row v: the tied decoder's part plus the rows where token v occurs,
  // in position order (the counting sort made on the host).
  Act* dword = gradient(ids_.word_embeddings);    // [V, H]
  const Act* decoder = decoder_gradient_.data();  // [V, H] the tied decoder's part
  const int* offsets = token_offsets_.data();     // [V + 1] CSR offsets by token id
  const int* rows = token_rows_.data();           // [R] positions sorted by token id, in order within an id
  compute_.for_each((size_t)vocab_size, (size_t)H, Z2_LOOP2(v, j, {
                      float sum = 0.0f;
                      for (int k = offsets[v]; k < offsets[v + 1]; ++k) sum += to_float(dsum[(size_t)rows[k] * H + j]);
                      dword[v * H + j] = from_float<Act>(to_float(decoder[v * H + j]) + sum);
                    }));
  engine_.gradient_ready(ids_.word_embeddings);
  close(dsum_);
}

// One micro-step. The order of open and close below is the order a framework
// would allocate and free these tensors in; the arena and naive allocators
// serve the same requests (notes/05).
template <class Act>
inline float Model<Act>::run(const Batch& batch, long step, long micro_batch, float loss_scale, bool backward) {
  const long first_sample = micro_batch * shape_.micro_batch;
  const int L = shape_.layers;
  const bool keep = mode_ == ActivationMode::keep, offloading = mode_ == ActivationMode::offload;
  if (timing_) compute_.synchronize_all(), phase_start_ = std::chrono::steady_clock::now();
  upload(batch);
  // Forward. With keep, every block's buffers stay open until its backward;
  // otherwise one working set is pushed and popped per block and only the
  // checkpoints stay.
  open(embedding_sum_), open(embedding_stats_);
  embeddings_forward(step, first_sample, open(checkpoints_[0]));
  if (!keep) close(embedding_stats_), close(embedding_sum_);
  if (offloading && 0 <= L - 2) offload(0);
  for (int l = 0; l < L; ++l) {
    open_block(block(l));
    block_forward(l, step, first_sample, checkpoints_[l + 1]);
    if (!keep) close_block(block(l));
    if (offloading && l + 1 <= L - 2) offload(l + 1);
    if (offloading && l <= L - 2) {
      // Checkpoint l has been read and copied out: its slot may be reused
      // once the copy is done (the compute stream waits for it, not the host).
      compute_.wait(compute_.compute_stream(), offloaded_[l]);
      close(checkpoints_[l]);
    }
  }
  end_phase(&Times::forward_ms);
  // fp16: the gradient carries the engine's loss scale (a power of two, so
  // the product with 1/count is exact); 1 in fp32 and bf16.
  head_forward_backward(step, loss_scale * engine_.loss_scale(), backward);
  close(checkpoints_[L]);
  if (!backward) {
    // Loss only (the tests' finite differences): give back what forward kept.
    for (int l = L - 1; l >= 0; --l) {
      if (keep) close_block(block(l));
      close(checkpoints_[l]);
    }
    close(embedding_stats_), close(embedding_sum_);
    return loss_contribution(loss_scale);
  }

  // Backward, last block first. Checkpoint l - 1 comes back from the host
  // while block l works (offload), so it is there when block l - 1 starts.
  for (int l = L - 1; l >= 0; --l) {
    const int fetch = offloading ? z2::checkpoint_to_prefetch(l, L) : -1;
    if (fetch >= 0) prefetch(fetch);
    if (offloading && l <= L - 2) {
      // Reading a checkpoint still on the host would read whatever its slot holds now.
      if (!fetched_[l])
        z2::usage_error(
            "offload: block %d's backward needs checkpoint %d, which was never brought back from the host "
            "(checkpoint_to_prefetch returned it for no block before this one)",
            l, l);
      compute_.wait(compute_.compute_stream(), prefetched_[l]);
    }
    if (!keep) {
      // Recompute the block's forward from its checkpoint: the same code,
      // inputs and dropout keys, so the same bits as the first time.
      open_block(block(l));
      block_forward(l, step, first_sample, recomputed_output_);
      close(recomputed_output_);
    }
    block_backward(l, step, first_sample);
    close_block(block(l));
    close(checkpoints_[l]);
    engine_.progress();  // let MPI move the buckets already handed over
  }
  if (!keep) {
    // The embeddings' sum and stats, recomputed (their output is not needed).
    open(embedding_sum_), open(embedding_stats_);
    embeddings_forward(step, first_sample, open(recomputed_output_));
    close(recomputed_output_);
  }
  embeddings_backward(step, first_sample);
  close(embedding_stats_), close(embedding_sum_);
  close(gradient_flow_), close(decoder_gradient_);
  const float contribution = loss_contribution(loss_scale);
  engine_.end_micro_step(contribution);
  end_phase(&Times::backward_ms);
  return contribution;
}

// ----------------------------------------------------------------------------
// ----------------------------------------------------------------------------
// 5. safetensors, the Hugging Face export and the batch dump

// A tensor's bytes are either its own (`owned`: the batch dump's token ids)
// or a view of the caller's values, which outlive the file's writing: a
// checkpoint or an export holds its values once, not a second copy per
// tensor (notes/10, "What a run holds on the host besides the plan").
struct Tensor {
  std::string name, dtype;  // "F32" or "I64"
  std::vector<long> shape;
  std::string owned;
  const char* view = nullptr;
  size_t view_bytes = 0;
  std::string_view bytes() const { return view ? std::string_view(view, view_bytes) : std::string_view(owned); }
};
inline Tensor tensor_f32(const std::string& name, std::vector<long> shape, const float* values, size_t count) {
  return {name, "F32", std::move(shape), std::string(), (const char*)values, count * sizeof(float)};
}

// --- output files (README, "When something goes wrong") ----------------------
//
// Every file the trainer writes goes through write_output_file:
//   0. the path must name nothing yet or a regular file; a symlink is
//      followed to the file it names (output_destination);
//   1. the contents go to a file with no name yet (O_TMPFILE in the target
//      directory), then fsync: on the disk, not only in the cache. A run
//      killed here (a signal, the watchdog, a crash) leaves nothing behind:
//      the kernel frees a file that has no name;
//   2. the file gets a temporary name no other writer can pick (the pid,
//      the rank, a random number), then is renamed over the final name
//      (atomic within a directory), then the directory is synced so the
//      rename itself survives a crash.
// Where the file system has no O_TMPFILE the file is written under the
// temporary name from the start. A failure at any point removes the
// temporary and throws with the path and the system's reason (strerror):
// nothing under a final name is ever partial. The caller runs it inside
// agree_on_errors, so a write that fails on one rank ends every rank, with
// exit 2 and rank 0's message.
inline std::string directory_of(const std::string& path) {
  const std::string parent = std::filesystem::path(path).parent_path().string();
  return parent.empty() ? "." : parent;
}

// A name in `directory` for a temporary file of `name` that no other
// process or rank picks; at most 255 bytes whatever the name's length
// (the name is cut to 160: it is only there to tell a person what it was).
inline std::string unique_temporary(const std::string& directory, const std::string& name) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::random_device random;
  char suffix[80];
  snprintf(suffix, sizeof suffix, ".zero2-tmp.%ld.%d.%08x", (long)getpid(), rank, (unsigned)random());
  return directory + "/." + name.substr(0, 160) + suffix;
}

// For tests only: ZERO2_TEST_FAULT="stop K" or "kill K" stops (SIGSTOP) or
// kills (SIGKILL) this process halfway through writing its K-th output
// file (1-based, counted per process), to show what a failure mid-write
// leaves (tests/test_trainer.sh); "kill K R" does it on rank R only.
// Unset, it costs one getenv per file.
inline void fault_for_tests(int file_number) {
  const char* fault = std::getenv("ZERO2_TEST_FAULT");
  if (fault == nullptr) return;
  char action[8] = {};
  int target = 0, only_rank = -1, rank = 0;
  if (std::sscanf(fault, "%7s %d %d", action, &target, &only_rank) < 2 || target != file_number) return;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (only_rank >= 0 && only_rank != rank) return;
  if (std::strcmp(action, "stop") == 0) raise(SIGSTOP);
  if (std::strcmp(action, "kill") == 0) raise(SIGKILL);
}

// A directory's entries made durable (a rename in it is on the disk once
// this returns); `done` says what was done, for the message.
inline void sync_directory(const std::string& directory, const std::string& done) {
  const int folder = open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (folder < 0 || fsync(folder) != 0) {
    const int error = errno;
    if (folder >= 0) close(folder);
    fail("%s, but the directory '%s' could not be synced: %s", done.c_str(), directory.c_str(), std::strerror(error));
  }
  close(folder);
}

// What an output path may name, since the writer renames a new file over
// it and a rename replaces whatever is there: nothing yet, or a regular
// file. A device, a FIFO, a socket or a directory is refused (as root,
// `--json /dev/null` would otherwise turn /dev/null into a file for the
// whole machine). A symlink is followed: the file written is its target,
// made beside the target and renamed over it, so the link stays a link;
// one that leads nowhere is refused. Returns the path to write, and is
// asked twice: before step 1 (check_output_file) and again at the write,
// since the run may have lasted hours.
inline const char* file_kind(mode_t mode) {
  return S_ISDIR(mode) ? "a directory" : S_ISCHR(mode) ? "a character device" : S_ISBLK(mode) ? "a block device"
         : S_ISFIFO(mode) ? "a FIFO" : S_ISSOCK(mode) ? "a socket" : "not a regular file";
}
inline std::string output_destination(const std::string& what, const std::string& path) {
  struct stat info;
  if (lstat(path.c_str(), &info) != 0) return path;  // nothing there yet (other errors show when writing)
  std::string destination = path;
  if (S_ISLNK(info.st_mode)) {
    char* resolved = realpath(path.c_str(), nullptr);
    if (resolved == nullptr)
      fail("%s '%s' is a symlink that leads to no file (%s): zero2 writes through a symlink only to an existing "
           "regular file; remove the link or point it at one",
           what.c_str(), path.c_str(), std::strerror(errno));
    destination = resolved;
    free(resolved);
    if (stat(destination.c_str(), &info) != 0)
      fail("%s '%s': cannot look at its target '%s': %s", what.c_str(), path.c_str(), destination.c_str(),
           std::strerror(errno));
  }
  if (!S_ISREG(info.st_mode))
    fail("%s '%s'%s is %s: zero2 writes only regular files and never replaces anything else; give another path",
         what.c_str(), path.c_str(), destination == path ? "" : (" (a symlink to '" + destination + "')").c_str(),
         file_kind(info.st_mode));
  return destination;
}

inline void write_output_file(const std::string& written_path, const std::string& contents) {
  static int files_written = 0;
  const int file_number = ++files_written;
  const std::string path = output_destination("the output", written_path);
  const std::string directory = directory_of(path);
  const std::string temporary = unique_temporary(directory, std::filesystem::path(path).filename().string());
  // A file that is replaced keeps its permissions; a new one gets 0666
  // less the umask, as any program's new file does.
  struct stat old;
  const bool replacing = stat(path.c_str(), &old) == 0 && S_ISREG(old.st_mode);
  const mode_t mode = replacing ? (old.st_mode & 07777) : 0666;
  int file = open(directory.c_str(), O_TMPFILE | O_WRONLY | O_CLOEXEC, mode);
  const bool nameless = file >= 0;
  if (!nameless) file = open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  if (file < 0) fail("cannot write '%s': %s", path.c_str(), std::strerror(errno));
  if (replacing) fchmod(file, mode);  // exactly the old mode, whatever the umask
  bool named = !nameless;
  auto give_up = [&](const char* doing) {
    const int error = errno;
    close(file);
    if (named) unlink(temporary.c_str());
    fail("cannot write '%s': %s (%s)", path.c_str(), std::strerror(error), doing);
  };
  auto write_range = [&](size_t begin, size_t end) {
    for (size_t done = begin; done < end;) {
      const ssize_t wrote = write(file, contents.data() + done, end - done);
      if (wrote < 0 && errno == EINTR) continue;
      if (wrote <= 0) give_up("writing");
      done += (size_t)wrote;
    }
  };
  write_range(0, contents.size() / 2);
  fault_for_tests(file_number);
  write_range(contents.size() / 2, contents.size());
  if (fsync(file) != 0) give_up("fsync");
  if (nameless) {  // the file gets its temporary name only now, complete and on the disk
    char self[64];
    snprintf(self, sizeof self, "/proc/self/fd/%d", file);
    if (linkat(AT_FDCWD, self, AT_FDCWD, temporary.c_str(), AT_SYMLINK_FOLLOW) != 0) give_up("naming the temporary");
    named = true;
  }
  if (close(file) != 0) {
    const int error = errno;
    unlink(temporary.c_str());
    fail("cannot write '%s': %s (closing)", path.c_str(), std::strerror(error));
  }
  if (rename(temporary.c_str(), path.c_str()) != 0) {
    const int error = errno;
    unlink(temporary.c_str());
    fail("cannot write '%s': %s (renaming the temporary over it)", path.c_str(), std::strerror(error));
  }
  sync_directory(directory, "wrote '" + path + "'");
}

// An exclusive lock on a directory (flock on the directory itself: no lock
// file is left), for two writers:
//   - an export (model.safetensors, then config.json): two runs exporting
//     into one directory take turns (OnBusy::wait), so the directory never
//     holds one run's weights under the other's config. The lock is polled
//     against the watchdog's deadline: a run that holds it for too long ends
//     this one with a message that says so;
//   - --save, for the whole run (OnBusy::refuse): two runs saving into one
//     directory would replace each other's steps and latest, so the second
//     is refused before its first step with `busy`. A file system without
//     flock gives no lock there; the run goes on without one.
class DirectoryLock {
 public:
  enum class OnBusy { wait, refuse };
  DirectoryLock(const std::string& directory, OnBusy on_busy, const std::string& busy = "")
      : fd_(open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)) {
    if (fd_ < 0) fail("cannot lock the directory '%s' for writing: %s", directory.c_str(), std::strerror(errno));
    if (on_busy == OnBusy::refuse) {
      if (flock(fd_, LOCK_EX | LOCK_NB) == 0 || errno != EWOULDBLOCK) return;
      close(fd_);
      fd_ = -1;
      throw z2::Error(busy);
    }
    z2::wait_until(
        [&] {
          if (flock(fd_, LOCK_EX | LOCK_NB) == 0) return true;
          if (errno != EWOULDBLOCK && errno != EINTR)
            fail("cannot lock the directory '%s' for writing: %s", directory.c_str(), std::strerror(errno));
          return false;
        },
        [&] { return "the lock on the directory '" + directory + "' (another process is writing into it)"; });
  }
  ~DirectoryLock() {
    if (fd_ >= 0) close(fd_);  // closing releases the lock
  }
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

 private:
  int fd_;
};

// safetensors: an 8-byte little-endian header length, a JSON header naming
// each tensor's dtype, shape and byte range, padded with spaces to a multiple
// of 8, then the raw little-endian data.
inline std::string safetensors_bytes(const std::vector<Tensor>& tensors,
                                     const std::map<std::string, std::string>& metadata = {}) {
  json header = json::object();
  size_t offset = 0;
  for (auto& t : tensors) {
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes().size()}}};
    offset += t.bytes().size();
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string contents(8, '\0');
  // Its final size up front: growing by doubling would hold the old and the
  // new buffer at once, up to twice the file's bytes on the host.
  contents.reserve(8 + text.size() + offset);
  uint64_t length = text.size();
  for (int k = 0; k < 8; ++k) contents[k] = (char)((length >> (8 * k)) & 0xff);
  contents += text;
  for (auto& t : tensors) contents += t.bytes();
  return contents;
}
inline void write_safetensors(const std::string& path, const std::vector<Tensor>& tensors,
                              const std::map<std::string, std::string>& metadata = {}) {
  write_output_file(path, safetensors_bytes(tensors, metadata));
}

// That a file can be created in `directory`, and the directory opened for
// the sync after a rename (and the export's lock): a temporary made and
// removed now, before training, so a read-only or foreign directory fails
// in the first second and not after the run. (A full disk shows only when
// writing.)
inline void probe_writable(const std::string& flag, const std::string& directory) {
  const int folder = open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (folder < 0) fail("%s: cannot open the directory '%s': %s", flag.c_str(), directory.c_str(), std::strerror(errno));
  close(folder);
  const std::string probe = unique_temporary(directory, "probe");
  const int file = open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (file < 0)
    fail("%s: cannot create files in the directory '%s': %s", flag.c_str(), directory.c_str(), std::strerror(errno));
  close(file);
  unlink(probe.c_str());
}
inline bool is_directory(const std::string& path) {
  std::error_code ignored;  // a path we cannot look at is not a directory we can use
  return std::filesystem::is_directory(path, ignored);
}
// A directory we will write into: create it (and its parents) now, and probe it.
inline void prepare_directory(const std::string& flag, const std::string& directory) {
  struct stat info;
  if (stat(directory.c_str(), &info) == 0 && !S_ISDIR(info.st_mode))
    fail("%s '%s' is %s, not a directory: give a directory (it is made if it does not exist)", flag.c_str(),
         directory.c_str(), S_ISREG(info.st_mode) ? "a file" : file_kind(info.st_mode));
  std::error_code error;
  std::filesystem::create_directories(directory, error);
  if (!is_directory(directory))
    fail("%s '%s' cannot be created as a directory%s%s", flag.c_str(), directory.c_str(), error ? ": " : "",
         error ? error.message().c_str() : "");
  probe_writable(flag, directory);
}
// A file we will write: its directory exists and takes files, its name
// fits the file system, and it is not a directory.
inline void check_output_file(const std::string& flag, const std::string& path) {
  const std::string name = std::filesystem::path(path).filename().string();
  if (name.empty() || name == "." || name == "..")
    fail("%s '%s' names a directory, not a file", flag.c_str(), path.c_str());
  if (!is_directory(directory_of(path)))
    fail("%s '%s': the directory '%s' does not exist", flag.c_str(), path.c_str(), directory_of(path).c_str());
  probe_writable(flag, directory_of(output_destination(flag, path)));  // a symlink's target's directory
}

// Each name in an output's path fits a file system (255 bytes, NAME_MAX on
// Linux's): checked first, since every later check would fail on it with
// the system's less helpful "File name too long".
inline void check_name_lengths(const std::string& what, const std::string& path) {
  for (const auto& part : std::filesystem::path(path))
    if (part.string().size() > NAME_MAX)
      fail("%s '%s': the name '%s...' has %zu bytes, more than the %d a file name may have", what.c_str(), path.c_str(),
           part.string().substr(0, 24).c_str(), part.string().size(), NAME_MAX);
}

// Compared as absolute paths, normalised, symlinks resolved as far as the
// path exists, without a trailing slash ("d", "./d/" and "/abs/d" are one
// directory, whether or not it exists yet). A path that cannot be resolved
// (a directory we may not read) is compared as written, made absolute: the
// checks that follow say what is wrong with it.
inline std::string normal_path(const std::string& path) {
  std::error_code error;
  const std::filesystem::path absolute = std::filesystem::absolute(path, error);
  std::filesystem::path full = std::filesystem::weakly_canonical(absolute, error);
  if (error) full = absolute;
  std::string text = full.lexically_normal().string();
  while (text.size() > 1 && text.back() == '/') text.pop_back();
  return text;
}

// Every output, up front (rank 0 writes them all): no output may be an
// input (the run would overwrite its own --data or --config, and exit 0)
// or another output (one would overwrite the other), whether a file or a
// directory; an export or a dump directory counts with the files it will
// hold. The checkpoint --load reads is an input whole: nothing may be
// written in its step directory (its index, its rank files), nor over the
// `latest` that named it, except by --save, whose `latest` moves only
// after the load and only to a newer complete step. Then each file's own
// checks (check_output_file).
inline void check_outputs(const Settings& s) {
  struct Place {
    std::string what, path;
    bool directory;
  };
  std::vector<Place> inputs, outputs;
  if (!s.data.empty()) inputs.push_back({"--data", s.data, false});
  if (!s.config.empty()) inputs.push_back({"--config", s.config, false});
  if (!s.checkpoint_directory.empty()) {
    inputs.push_back({"--load checkpoint's", s.checkpoint_directory, true});
    if (normal_path(s.checkpoint_directory) != normal_path(s.load_dir))
      inputs.push_back({"--load checkpoint's latest", s.load_dir + "/latest", false});
  }
  if (!s.json_path.empty()) outputs.push_back({"--json", s.json_path, false});
  if (!s.memory_trace.empty()) outputs.push_back({"--memory-trace", s.memory_trace, false});
  if (!s.metrics.empty()) outputs.push_back({"--metrics", s.metrics, false});
  for (auto [flag, directory] : {std::pair<std::string, std::string>{"--export-hf", s.export_dir},
                                 {"--dump-batch", s.dump_dir},
                                 {"--save", s.save_dir}}) {
    if (directory.empty()) continue;
    outputs.push_back({flag, directory, true});
    std::vector<std::string> names = {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
                                      "special_tokens_map.json"};
    if (flag == "--dump-batch") names.push_back("batch.safetensors");
    if (flag == "--save") names = {"latest"};
    for (auto& name : names) outputs.push_back({flag + "'s " + name, directory + "/" + name, false});
  }
  std::vector<std::string> normal;
  for (auto& output : outputs) {
    check_name_lengths(output.what, output.path);
    normal.push_back(normal_path(output.path));
  }
  for (size_t o = 0; o < outputs.size(); ++o) {
    for (auto& input : inputs) {
      const std::string read = normal_path(input.path);
      if (input.directory && (normal[o] == read || normal[o].rfind(read + "/", 0) == 0))
        fail("%s '%s' is inside the checkpoint it loads, '%s': the run would write over what it reads; give a "
             "path outside it",
             outputs[o].what.c_str(), outputs[o].path.c_str(), input.path.c_str());
      const bool saves_over_latest = outputs[o].what == "--save's latest" && input.what == "--load checkpoint's latest";
      if (!input.directory && normal[o] == read && !saves_over_latest)
        fail("%s '%s' is the %s file: the run would overwrite its own input", outputs[o].what.c_str(),
             outputs[o].path.c_str(), input.what.c_str());
    }
    for (size_t other = 0; other < o; ++other)
      if (normal[o] == normal[other])
        fail("%s and %s name the same %s '%s': one would overwrite the other", outputs[other].what.c_str(),
             outputs[o].what.c_str(),
             outputs[o].directory && outputs[other].directory   ? "directory"
             : outputs[o].directory || outputs[other].directory ? "path"
                                                                : "file",
             outputs[o].path.c_str());
  }
  for (auto& output : outputs)
    if (output.directory) prepare_directory(output.what, output.path);
    else check_output_file(output.what, output.path);
}

// --metrics FILE: JSON Lines, one object per progress line, appended while
// training runs (a plotting script or a dashboard can follow it). It is the
// one output that grows in place, so it cannot be renamed into place whole:
// the writer creates it empty (nameless until complete, as every output),
// then each line is one write() of the whole line followed by fdatasync, so
// a killed run leaves every line it logged, whole. Rank 0 only.
// A resumed run (--load) continues the file it is given instead of
// emptying it, after a line {"resumed_from": step directory, "step": s}:
// lines above it past step s are from a run that went on after that
// checkpoint was saved, and a reader drops them (notes/plot_loss.py does).
class MetricsStream {
 public:
  MetricsStream(const std::string& path, const std::string& resumed_from, long resumed_step) : path_(path) {
    struct stat info;
    const bool continuing = !resumed_from.empty() && stat(output_destination("--metrics", path).c_str(), &info) == 0;
    if (!continuing) write_output_file(path, "");
    fd_ = open(path.c_str(), O_RDWR | O_APPEND | O_CLOEXEC);
    if (fd_ < 0) fail("cannot append to --metrics '%s': %s", path.c_str(), std::strerror(errno));
    if (!continuing) return;
    char last = '\n';  // a line cut short (a full disk) is ended, so the marker starts a line of its own
    if (info.st_size > 0 && pread(fd_, &last, 1, info.st_size - 1) == 1 && last != '\n') write_line("\n");
    write_line(json{{"resumed_from", resumed_from}, {"step", resumed_step}}.dump() + "\n");
  }
  ~MetricsStream() {
    if (fd_ >= 0) close(fd_);
  }
  MetricsStream(const MetricsStream&) = delete;
  MetricsStream& operator=(const MetricsStream&) = delete;
  void append(const json& record) { write_line(record.dump() + "\n"); }

 private:
  void write_line(const std::string& line) {
    const ssize_t wrote = write(fd_, line.data(), line.size());
    if (wrote != (ssize_t)line.size() || fdatasync(fd_) != 0)
      fail("cannot append to --metrics '%s': %s", path_.c_str(), wrote < 0 ? std::strerror(errno) : "a short write");
  }
  std::string path_;
  int fd_ = -1;
};

// A float setting as the decimal the user typed (0.1, not 0.100000001).
inline double decimal(float value) {
  char text[32];
  snprintf(text, sizeof text, "%.7g", value);
  return std::strtod(text, nullptr);
}

// config.json in Hugging Face's BertConfig keys, so BertForMaskedLM.from_pretrained loads the export.
inline json hf_config(const ModelShape& s) {
  return {{"architectures", {"BertForMaskedLM"}},
          {"model_type", "bert"},
          {"vocab_size", vocab_size},
          {"hidden_size", s.hidden},
          {"num_hidden_layers", s.layers},
          {"num_attention_heads", s.heads},
          {"intermediate_size", s.intermediate},
          {"hidden_act", "gelu"},
          {"hidden_dropout_prob", decimal(s.dropout)},
          {"attention_probs_dropout_prob", decimal(s.dropout)},
          {"max_position_embeddings", s.max_positions},
          {"type_vocab_size", 1},
          {"initializer_range", 0.02},
          {"layer_norm_eps", 1e-12},
          {"pad_token_id", pad_token},
          {"position_embedding_type", "absolute"},
          {"tie_word_embeddings", true},
          {"torch_dtype", "float32"}};
}

// The byte-level tokenizer the trainer's ids come from, in the files Hugging
// Face's AutoTokenizer reads: token b is byte b (0..255), then [PAD] [CLS]
// [SEP] [MASK] = 256..259, and a text becomes [CLS] its bytes [SEP]. In the
// tokenizers library's terms: the ByteLevel pre-tokenizer without its regex
// (one piece per text) maps each byte to GPT-2's printable stand-in for it,
// a BPE model with no merges maps each stand-in to its byte's id, and a
// template adds [CLS] and [SEP]; the ByteLevel decoder maps back.
inline std::string byte_stand_in(int byte) {  // GPT-2's bytes_to_unicode, as UTF-8
  int code = byte;
  const bool printable =
      (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) || (byte >= 0xAE && byte <= 0xFF);
  if (!printable) {  // the others, in byte order, from U+0100 on
    int before = 0;
    for (int b = 0; b < byte; ++b)
      before += !((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF));
    code = 256 + before;
  }
  std::string utf8;
  if (code < 0x80) utf8 += (char)code;
  else utf8 += (char)(0xC0 | (code >> 6)), utf8 += (char)(0x80 | (code & 0x3F));  // code < 0x800
  return utf8;
}
inline json hf_tokenizer() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_stand_in(b)] = b;
  // The specials in the vocabulary too (not only as added tokens), so the
  // tokenizer says nothing about "special tokens added to the vocabulary".
  for (const auto& [name, id] : {std::pair<const char*, int>{"[PAD]", pad_token},
                                 {"[CLS]", cls_token},
                                 {"[SEP]", sep_token},
                                 {"[MASK]", mask_token}})
    vocab[name] = id;
  json added = json::array();
  const char* specials[] = {"[PAD]", "[CLS]", "[SEP]", "[MASK]"};
  for (int k = 0; k < 4; ++k)
    added.push_back({{"id", pad_token + k},
                     {"content", specials[k]},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  auto special = [](const char* name) { return json{{"SpecialToken", {{"id", name}, {"type_id", 0}}}}; };
  auto sequence = [](const char* name) {
    return json{{"Sequence", {{"id", name}, {"type_id", 0}}}};
  };  // one token type
  const json byte_level = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}};
  json tokenizer = {{"version", "1.0"},
                    {"truncation", nullptr},
                    {"padding", nullptr},
                    {"added_tokens", added},
                    {"normalizer", nullptr},
                    {"pre_tokenizer", byte_level},
                    {"post_processor",
                     {{"type", "TemplateProcessing"},
                      {"single", {special("[CLS]"), sequence("A"), special("[SEP]")}},
                      {"pair", {special("[CLS]"), sequence("A"), special("[SEP]"), sequence("B"), special("[SEP]")}},
                      {"special_tokens",
                       {{"[CLS]", {{"id", "[CLS]"}, {"ids", {cls_token}}, {"tokens", {"[CLS]"}}}},
                        {"[SEP]", {{"id", "[SEP]"}, {"ids", {sep_token}}, {"tokens", {"[SEP]"}}}}}}}},
                    {"decoder", byte_level},
                    {"model",
                     {{"type", "BPE"},
                      {"dropout", nullptr},
                      {"unk_token", nullptr},
                      {"continuing_subword_prefix", nullptr},
                      {"end_of_word_suffix", nullptr},
                      {"fuse_unk", false},
                      {"byte_fallback", false},
                      {"vocab", vocab},
                      {"merges", json::array()}}}};
  return tokenizer;
}
inline json hf_special_tokens() {
  return {{"pad_token", "[PAD]"}, {"cls_token", "[CLS]"}, {"sep_token", "[SEP]"}, {"mask_token", "[MASK]"}};
}
inline json hf_tokenizer_config(int max_positions) {
  json config = hf_special_tokens();
  config["tokenizer_class"] = "PreTrainedTokenizerFast";
  config["model_max_length"] = max_positions;
  config["clean_up_tokenization_spaces"] = false;
  return config;
}

// Parameters (canonical order, as Engine::parameters_to_host gives them) as
// named tensors. The decoder weight is not stored: it is the word embedding
// (Hugging Face ties it again on load).
template <class Act>
inline std::vector<Tensor> named_tensors(const Model<Act>& model, const z2::Engine& engine,
                                         const std::vector<float>& values, const std::string& prefix = "") {
  std::vector<Tensor> tensors;
  size_t position = 0;
  const auto& infos = engine.parameters();
  for (size_t id = 0; id < infos.size(); ++id) {
    tensors.push_back(
        tensor_f32(prefix + infos[id].name, model.tensor_shape((int)id), values.data() + position, infos[id].numel));
    position += infos[id].numel;
  }
  return tensors;
}

// A dump in mixed precision says in config.json what its float32 values are
// ("zero2_weights") and their precision ("zero2_precision"): the 16-bit
// working weights that step used. (Hugging Face ignores keys it does not know.)
template <class Act>
inline void export_hf(const std::string& directory, const Model<Act>& model, const z2::Engine& engine,
                      const std::vector<float>& values, z2::Precision dumped = z2::Precision::fp32) {
  // The weights first, the config last: a directory with a config.json is
  // complete (each file itself is written atomically). An old config.json
  // from an earlier export goes first, so it cannot vouch for new weights;
  // the lock keeps another export into this directory from interleaving.
  DirectoryLock lock(directory, DirectoryLock::OnBusy::wait);
  // (A config.json that is a symlink: its target is what goes and comes back.)
  const std::string config_path = output_destination("--export-hf's config.json", directory + "/config.json");
  if (unlink(config_path.c_str()) != 0 && errno != ENOENT)
    fail("cannot replace '%s': %s", config_path.c_str(), std::strerror(errno));
  write_safetensors(directory + "/model.safetensors", named_tensors(model, engine, values), {{"format", "pt"}});
  const int positions = model.shape().max_positions;
  write_output_file(directory + "/tokenizer.json", hf_tokenizer().dump(2) + "\n");
  write_output_file(directory + "/tokenizer_config.json", hf_tokenizer_config(positions).dump(2) + "\n");
  write_output_file(directory + "/special_tokens_map.json", hf_special_tokens().dump(2) + "\n");
  json config = hf_config(model.shape());
  if (dumped != z2::Precision::fp32) {
    config["zero2_precision"] = z2::to_string(dumped);
    config["zero2_weights"] =
        std::string("the ") + z2::to_string(dumped) + " working weights of the dumped step, as float32";
  }
  write_output_file(config_path, config.dump(2) + "\n");
}

// ----------------------------------------------------------------------------
// 5b. Checkpoints (--save, --load; notes/09)
//
//   DIR/step_<s>/rank_<q>.safetensors  master, exp_avg, exp_avg_sq: [end - begin] float32 each, the
//                                      canonical range [begin, end) = [q Psi / N, (q + 1) Psi / N)
//                                      of the N ranks that saved it (rank q writes its own file)
//   DIR/step_<s>/index.json            the settings a resumed run must share, the progress (steps,
//                                      AdamW's t, skips, the loss scaler), the parameters, and each
//                                      file's range, size and SHA-256; the run's identity (run_id)
//   DIR/step_<s>/index.sha256          index.json's own SHA-256 (sha256sum's format)
//   DIR/latest                         "step_<s>": the newest complete step, moved last
// The canonical order (registration order, real elements only) does not
// depend on N, the stage or the bucket size, so a checkpoint loads at any of
// them: each rank reads the pieces of the files that overlap the runs it
// owns (Engine::owned_state_runs), and no rank reads the whole state. The
// 16-bit working weights are not stored: they are the master rounded.

// --- SHA-256 (FIPS 180-4), streamed -------------------------------------------

class Sha256 {
 public:
  void update(const void* data, size_t bytes) {
    const unsigned char* p = static_cast<const unsigned char*>(data);
    total_ += bytes;
    while (bytes > 0) {
      const size_t take = std::min(bytes, sizeof buffer_ - buffered_);
      std::memcpy(buffer_ + buffered_, p, take);
      buffered_ += take, p += take, bytes -= take;
      if (buffered_ == sizeof buffer_) block(buffer_), buffered_ = 0;
    }
  }
  // The digest as 64 hex digits; the object is spent afterwards.
  std::string hex() {
    const uint64_t bits = total_ * 8;
    const unsigned char one = 0x80, zero = 0;
    update(&one, 1);
    while (buffered_ != 56) update(&zero, 1);
    unsigned char length[8];
    for (int k = 0; k < 8; ++k) length[k] = (unsigned char)(bits >> (56 - 8 * k));
    update(length, 8);
    char text[65];
    for (int k = 0; k < 8; ++k) snprintf(text + 8 * k, 9, "%08x", state_[k]);
    return text;
  }

 private:
  static uint32_t rotate(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }
  void block(const unsigned char* p) {
    static const uint32_t k[64] = {
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
        0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
        0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
        0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
        0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
        0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
        0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
    uint32_t w[64];
    for (int t = 0; t < 16; ++t)
      w[t] = (uint32_t)p[4 * t] << 24 | (uint32_t)p[4 * t + 1] << 16 | (uint32_t)p[4 * t + 2] << 8 | p[4 * t + 3];
    for (int t = 16; t < 64; ++t) {
      const uint32_t s0 = rotate(w[t - 15], 7) ^ rotate(w[t - 15], 18) ^ (w[t - 15] >> 3);
      const uint32_t s1 = rotate(w[t - 2], 17) ^ rotate(w[t - 2], 19) ^ (w[t - 2] >> 10);
      w[t] = w[t - 16] + s0 + w[t - 7] + s1;
    }
    uint32_t a = state_[0], b = state_[1], c = state_[2], d = state_[3], e = state_[4], f = state_[5], g = state_[6],
             h = state_[7];
    for (int t = 0; t < 64; ++t) {
      const uint32_t t1 = h + (rotate(e, 6) ^ rotate(e, 11) ^ rotate(e, 25)) + ((e & f) ^ (~e & g)) + k[t] + w[t];
      const uint32_t t2 = (rotate(a, 2) ^ rotate(a, 13) ^ rotate(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      h = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
    }
    const uint32_t add[8] = {a, b, c, d, e, f, g, h};
    for (int k2 = 0; k2 < 8; ++k2) state_[k2] += add[k2];
  }
  uint32_t state_[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  unsigned char buffer_[64] = {};
  size_t buffered_ = 0;
  uint64_t total_ = 0;
};

inline std::string sha256_hex(const std::string& bytes) {
  Sha256 sha;
  sha.update(bytes.data(), bytes.size());
  return sha.hex();
}

// --- what a checkpoint records ----------------------------------------------

// Version 2 added index.sha256 (the index's own SHA-256) and run_id; a
// version 1 index has neither, so nothing would catch a changed setting in it.
constexpr int checkpoint_version = 2;

// index.sha256 beside index.json: the index's SHA-256 in sha256sum's format
// (`sha256sum -c index.sha256` checks it). The rank files are protected by
// the SHA-256 the index records; the index by this. A flipped bit in
// index.json changes its digest (no two texts are known with one SHA-256,
// let alone two a bit apart), and a flipped bit in index.sha256 gives
// another digest or a line that is no digest at all: either way the two
// disagree. A file beside the index, not a field in it, so that it covers
// every byte (whitespace and number spellings included, nothing to
// canonicalise) and holds for a step directory loaded directly
// (--load DIR/step_<s>), which `latest` would not.
constexpr const char* index_digest_file = "index.sha256";
inline std::string index_digest_line(const std::string& index_text) { return sha256_hex(index_text) + "  index.json\n"; }

// A run's identity: 128 random bits, made by a fresh run and carried on by
// every run resumed from its checkpoints (each index records it). Pruning
// deletes only steps that record this run's identity.
inline std::string new_run_id() {
  std::random_device random;
  char text[40];
  snprintf(text, sizeof text, "%08x%08x%08x%08x", (unsigned)random(), (unsigned)random(), (unsigned)random(),
           (unsigned)random());
  return text;
}
inline bool is_run_id(const json& value) {
  return value.is_string() && value.get<std::string>().size() == 32 &&
         value.get<std::string>().find_first_not_of("0123456789abcdef") == std::string::npos;
}

inline std::string step_directory_name(long step) { return "step_" + std::to_string(step); }
// Where the ranks write a step before it is complete (a dot: not a step).
inline std::string incomplete_step_directory(const std::string& save_dir, long step) {
  return save_dir + "/." + step_directory_name(step) + ".incomplete";
}

// A step's files that vanish under the save (ENOENT) mean that another
// process works in the directory: the message names that as the likely cause.
inline const char* vanished_hint(int error) {
  return error == ENOENT ? " (a file of the checkpoint vanished: another run saving into the same directory at the "
                           "same time is the likely cause; give each run its own --save)"
                         : "";
}
// The same for every failure of a save's body that says ENOENT.
inline void naming_a_vanished_file(const std::function<void()>& body) {
  try {
    body();
  } catch (const z2::Error& error) {
    const std::string said = error.what();
    if (said.find(std::strerror(ENOENT)) == std::string::npos || said.find(vanished_hint(ENOENT)) != std::string::npos)
      throw;
    throw z2::Error(said + vanished_hint(ENOENT));
  }
}

// The complete step `written` becomes `directory`. Over an existing step (a
// run resumed from an earlier step into the same --save) the two are swapped
// in one rename (RENAME_EXCHANGE), so `directory` is a complete step at every
// moment and latest, which may name it, never dangles; the old one is left at
// `written` for the caller to delete. A file system without the exchange
// (some network ones) gets two renames, with a moment between them.
inline void publish_step(const std::string& written, const std::string& directory) {
  struct stat info;
  if (lstat(directory.c_str(), &info) != 0) {
    if (rename(written.c_str(), directory.c_str()) != 0)
      fail("cannot name the checkpoint '%s': %s%s", directory.c_str(), std::strerror(errno), vanished_hint(errno));
  } else if (renameat2(AT_FDCWD, written.c_str(), AT_FDCWD, directory.c_str(), RENAME_EXCHANGE) != 0) {
    if (errno != EINVAL && errno != ENOSYS)
      fail("cannot replace the checkpoint '%s': %s%s", directory.c_str(), std::strerror(errno), vanished_hint(errno));
    const std::string aside = written + ".old";
    if (rename(directory.c_str(), aside.c_str()) != 0 || rename(written.c_str(), directory.c_str()) != 0 ||
        rename(aside.c_str(), written.c_str()) != 0)
      fail("cannot replace the checkpoint '%s': %s%s", directory.c_str(), std::strerror(errno), vanished_hint(errno));
  }
  sync_directory(directory_of(directory), "named the checkpoint '" + directory + "'");
}
inline std::string rank_file_name(int rank) {
  char name[48];
  snprintf(name, sizeof name, "rank_%05d.safetensors", rank);
  return name;
}
// The canonical range the file of rank `rank` of `ranks` covers.
inline std::pair<size_t, size_t> file_range(size_t psi, int rank, int ranks) {
  return {psi * (size_t)rank / (size_t)ranks, psi * (size_t)(rank + 1) / (size_t)ranks};
}

// The settings that decide the bits of every step: a resumed run takes the
// checkpoint's value for each one it is not given, and refuses one given
// with another value. (Stage, N and A with the same N x A, the bucket,
// overlap, activations, allocator, device, backends and outputs may change:
// they do not change the bits.)
struct RecordedSetting {
  const char* key;   // in index.json's "settings"
  const char* flag;  // as apply() knows it
  const char* what;  // what a different value would change
};
constexpr RecordedSetting recorded_settings[] = {
    {"layers", "--layers", "the model"},
    {"hidden", "--hidden", "the model"},
    {"heads", "--heads", "the model"},
    {"intermediate", "--intermediate", "the model"},
    {"seq", "--seq", "the model's windows"},
    {"max_positions", "--max-positions", "the model"},
    {"dropout", "--dropout", "the model's dropout"},
    {"seed", "--seed", "the data, the masking and dropout (all keyed by the seed)"},
    {"micro_batch", "--micro-batch", "the batch"},
    {"lr", "--lr", "the learning-rate schedule"},
    {"warmup", "--warmup", "the learning-rate schedule"},
    {"schedule_steps", "--schedule-steps", "the learning-rate schedule (its decay ends there; --steps may change)"},
    {"warmup_type", "--warmup-type", "the learning-rate schedule"},
    {"decay", "--decay", "the learning-rate schedule"},
    {"warmup_min_lr", "warmup_min_lr", "the learning-rate schedule"},
    {"bias_correction", "bias_correction", "the optimizer"},
    // Whether the data's tail is held out (--eval-every > 0), not how often
    // evaluation runs: that may change (without --eval-every, the saved one).
    {"held_out", "--eval-every", "the training data (evaluation holds the data's tail out of training)"},
    {"weight_decay", "--weight-decay", "the optimizer"},
    {"clip", "--clip", "the optimizer"},
    {"beta1", "beta1", "the optimizer"},
    {"beta2", "beta2", "the optimizer"},
    {"eps", "eps", "the optimizer"},
    {"precision", "--precision", "the precision (the master is fp32 in each, the rest is not)"},
    {"grad_accum_dtype", "grad_accum_dtype", "the accumulation"},
    {"loss_scale", "loss_scale", "fp16's loss scaling"},
    {"initial_scale_power", "initial_scale_power", "fp16's loss scaling"},
    {"loss_scale_window", "loss_scale_window", "fp16's loss scaling"},
    {"hysteresis", "hysteresis", "fp16's loss scaling"},
    {"consecutive_hysteresis", "consecutive_hysteresis", "fp16's loss scaling"},
    {"min_loss_scale", "min_loss_scale", "fp16's loss scaling"},
};

inline json recorded_values(const Settings& s) {
  const z2::LossScaling& l = s.loss_scaling;
  return {{"layers", s.layers},
          {"hidden", s.hidden},
          {"heads", s.heads},
          {"intermediate", s.intermediate},
          {"seq", s.seq},
          {"max_positions", s.max_positions},
          {"dropout", (double)s.dropout},
          {"seed", s.seed},
          {"micro_batch", s.micro_batch},
          {"lr", s.lr},
          {"warmup", s.warmup},
          {"steps", s.steps},
          {"schedule_steps", s.schedule_steps},
          {"warmup_type", s.warmup_type},
          {"decay", s.decay},
          {"warmup_min_lr", s.warmup_min_lr},
          {"bias_correction", s.bias_correction},
          {"held_out", s.eval_every > 0},
          {"eval_every", s.eval_every},
          {"weight_decay", s.weight_decay},
          {"clip", s.clip},
          {"beta1", s.beta1},
          {"beta2", s.beta2},
          {"eps", s.eps},
          {"precision", s.precision},
          {"grad_accum_dtype", s.grad_accum_dtype},
          {"loss_scale", l.static_scale},
          {"initial_scale_power", l.initial_scale_power},
          {"loss_scale_window", l.window},
          {"hysteresis", l.hysteresis},
          {"consecutive_hysteresis", l.consecutive_hysteresis},
          {"min_loss_scale", l.min_scale},
          {"portable", s.portable}};
}

// A field of index.json, or one message naming it and the file. `shown`
// is the field's full name in messages when `index` is part of the file
// ("files.2" for the third file entry).
inline const json& index_field(const json& index, const std::string& path, const std::string& file,
                               const std::string& shown = "") {
  const std::string name = shown.empty() ? path : shown + "." + path;
  const json* here = &index;
  size_t start = 0;
  while (start <= path.size()) {
    const size_t dot = std::min(path.find('.', start), path.size());
    const std::string key = path.substr(start, dot - start);
    if (!here->is_object() || !here->contains(key))
      fail("the checkpoint index '%s' lacks '%s'", file.c_str(), name.c_str());
    here = &(*here)[key];
    start = dot + 1;
  }
  return *here;
}
inline long index_integer(const json& index, const std::string& path, const std::string& file, long low, long high,
                          const std::string& shown = "") {
  const json& value = index_field(index, path, file, shown);
  if (!value.is_number_integer() || value.get<long>() < low || value.get<long>() > high)
    fail("the checkpoint index '%s': '%s' = %s is not an integer from %ld to %ld", file.c_str(),
         (shown.empty() ? path : shown + "." + path).c_str(), value.dump().c_str(), low, high);
  return value.get<long>();
}
inline std::string index_string(const json& index, const std::string& path, const std::string& file,
                                const std::string& shown = "") {
  const json& value = index_field(index, path, file, shown);
  if (!value.is_string())
    fail("the checkpoint index '%s': '%s' = %s is not a string", file.c_str(),
         (shown.empty() ? path : shown + "." + path).c_str(), value.dump().c_str());
  return value.get<std::string>();
}

// --- finding and reading one ---------------------------------------------------

// --load DIR: DIR itself when it holds an index.json (DIR/step_<s>), else
// the step DIR/latest names.
// Paths are looked at with stat and lstat (errno, not std::filesystem's
// exceptions), so a symlink loop or a dangling link gets a sentence.
inline const char* stat_hint(int error) {
  return error == ELOOP    ? " (a symlink loop: a link that leads back to itself)"
         : error == ENOENT ? " (a symlink to nothing)"
                           : "";
}
inline bool path_is_there(const std::string& path) {  // anything under that name, a dangling link included
  struct stat info;
  return lstat(path.c_str(), &info) == 0;
}
inline std::string checkpoint_step_directory(const std::string& directory) {
  struct stat info;
  if (stat(directory.c_str(), &info) != 0) {
    const int error = errno;
    if (!path_is_there(directory)) fail("--load '%s' does not exist", directory.c_str());
    fail("--load '%s' cannot be read: %s%s", directory.c_str(), std::strerror(error), stat_hint(error));
  }
  if (!S_ISDIR(info.st_mode)) fail("--load '%s' is not a directory", directory.c_str());
  if (path_is_there(directory + "/index.json")) return directory;  // reading it names what is wrong with it
  const std::string latest = directory + "/latest";
  if (!path_is_there(latest))
    fail("--load '%s' has neither index.json (a step's directory) nor latest (a checkpoint directory)",
         directory.c_str());
  if (stat(latest.c_str(), &info) != 0) {
    const int error = errno;
    fail("the checkpoint's latest file '%s' cannot be read: %s%s", latest.c_str(), std::strerror(error),
         stat_hint(error));
  }
  std::string name = read_regular_file("the checkpoint's latest file", latest, 256);
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r')) name.pop_back();
  // A NUL would end the name early in every message below: said as such.
  if (name.find('\0') != std::string::npos)
    fail("'%s' holds a NUL byte (at byte %zu): it should hold a step's name (step_<number>) and nothing else",
         latest.c_str(), name.find('\0'));
  const bool well_formed = name.size() > 5 && name.compare(0, 5, "step_") == 0 &&
                           name.find_first_not_of("0123456789", 5) == std::string::npos;
  if (!well_formed)
    fail("'%s' should name a step (step_<number>), not '%s'", latest.c_str(), name.substr(0, 64).c_str());
  const std::string step = directory + "/" + name;
  if (!path_is_there(step + "/index.json"))
    fail("'%s' names '%s', which is not a complete checkpoint in '%s' (no %s/index.json)", latest.c_str(), name.c_str(),
         directory.c_str(), name.c_str());
  return step;
}

// An index's text parsed, or null when it is not JSON (the callers say why).
inline json parsed_or_null(const std::string& text) {
  try {
    return json::parse(text);
  } catch (const json::exception&) { return json(); }
}
inline bool is_zero2_index(const json& index) {
  return index.is_object() && index.contains("format") && index["format"] == "zero2 checkpoint";
}

// A step's index.json, checked against its index.sha256 before anything in
// it is believed: a changed setting, progress field, parameter or file
// entry is damage, whatever it is.
inline std::string verified_index_text(const std::string& step_directory) {
  const std::string file = step_directory + "/index.json", digest = step_directory + "/" + index_digest_file;
  const std::string text = read_regular_file("the checkpoint index", file, 64u << 20);
  if (!path_is_there(digest)) {
    const json index = parsed_or_null(text);
    if (is_zero2_index(index) && index.contains("version") && index["version"] == 1)
      fail(
          "the checkpoint '%s' was written by an earlier zero2 (checkpoint version 1, whose index.json has no "
          "SHA-256 of its own, so a changed setting in it would go unnoticed); this trainer reads version %d. "
          "Resume or export it with the zero2 that wrote it",
          step_directory.c_str(), checkpoint_version);
    fail("the checkpoint index '%s' is damaged: '%s', which records its SHA-256, is missing", file.c_str(),
         digest.c_str());
  }
  if (read_regular_file("the checkpoint index's SHA-256 file", digest, 4096) != index_digest_line(text))
    fail("the checkpoint index '%s' is damaged: its SHA-256 is not the one '%s' records (a changed bit, or an edit)",
         file.c_str(), digest.c_str());
  return text;
}

inline json read_checkpoint_index(const std::string& step_directory) {
  const std::string file = step_directory + "/index.json";
  const std::string text = verified_index_text(step_directory);
  json index;
  try {
    index = json::parse(text);
  } catch (const json::exception& e) {
    fail("the checkpoint index '%s' is not valid JSON: %s", file.c_str(), e.what());
  }
  if (!is_zero2_index(index))
    fail("'%s' is not a zero2 checkpoint index (no \"format\": \"zero2 checkpoint\")", file.c_str());
  const long version = index_integer(index, "version", file, 0, LONG_MAX);
  if (version != checkpoint_version)
    fail("the checkpoint index '%s' has version %ld; this trainer reads version %d", file.c_str(), version,
         checkpoint_version);
  if (!is_run_id(index_field(index, "run_id", file)))
    fail("the checkpoint index '%s': 'run_id' = %s is not 32 hex digits", file.c_str(), index["run_id"].dump().c_str());
  return index;
}

// Whether the interleaved split (N, A) sums a step's N x A micro-batches
// in the canonical tree (notes/06, "The global batch, split two ways"):
// when N is a power of two (each micro-step's N leaves are then an aligned
// subtree) or A = 1 (nothing is accumulated). Two splits give the same
// bits when both do, or when they are the same split.
inline bool canonical_split(long world, long accum) { return (world & (world - 1)) == 0 || accum == 1; }
// The splits of N x A micro-batches that keep the bits of a run at (N, A).
inline std::string splits_keeping_bits(long world, long accum) {
  const long micro_batches = world * accum;
  auto split = [](long n, long a) { return "N = " + std::to_string(n) + " (A = " + std::to_string(a) + ")"; };
  if (!canonical_split(world, accum)) return split(world, accum) + " only, the checkpoint's own";
  std::string text;
  for (long n = 1; micro_batches % n == 0; n *= 2) text += (text.empty() ? "" : ", ") + split(n, micro_batches / n);
  if ((micro_batches & (micro_batches - 1)) != 0) text += ", " + split(micro_batches, 1);
  return text;
}
// A resume that changes the summation tree is refused, or with
// --allow-different-bits taken and recorded.
inline void check_summation_tree(Settings& s, int world_size, long saved_world, long saved_accum) {
  const bool same_split = world_size == saved_world && s.accum == saved_accum;
  if (same_split || (canonical_split(saved_world, saved_accum) && canonical_split(world_size, s.accum))) return;
  if (s.allow_different_bits) {
    s.summation_tree_changed = true;
    return;
  }
  fail(
      "resuming at N = %d (A = %d) sums each step's %ld micro-batches in another tree than the checkpoint's run at "
      "N = %ld (A = %ld): a split sums in the canonical tree only when N is a power of two or A = 1 (notes/06, "
      "\"The global batch, split two ways\"), so the bits would not be those of the run that never stopped. Splits "
      "that keep them: %s; or give --allow-different-bits to resume at this split anyway",
      world_size, s.accum, saved_world * saved_accum, saved_world, saved_accum,
      splits_keeping_bits(saved_world, saved_accum).c_str());
}

// The global batch of a resumed run: N x A micro-batches per step, as the
// checkpoint's. A is --accum, or DeepSpeed's train_batch_size / (micro-batch
// x N), or else the checkpoint's N x A / N. An export that records nothing
// (--steps 0 without --save) may run at any N.
inline void adopt_checkpoint_batch(Settings& s, int world_size, const std::string& file) {
  const long most = 1l << 20;  // --accum's own bound
  const long saved_world = index_integer(s.checkpoint, "world_size", file, 1, INT_MAX);
  const long saved_accum = index_integer(s.checkpoint, "accum", file, 1, most);
  const long micro_batches = saved_world * saved_accum;  // N x A: the global batch, in micro-batches
  const bool records_nothing = s.export_only && s.save_dir.empty();
  bool known = s.accum_given;
  if (!known && s.train_batch_size && s.train_batch_size % ((long)s.micro_batch * world_size) == 0) {
    s.accum = (int)std::min(most, s.train_batch_size / ((long)s.micro_batch * world_size));
    known = true;  // check_consistency compares it with train_batch_size again
  }
  if (!known) {
    if (micro_batches % world_size == 0) s.accum = (int)std::min(most, micro_batches / world_size);
    else if (records_nothing) s.accum = 1;  // nothing is trained or saved: the split does not matter
    else
      fail(
          "the checkpoint was saved with N x A = %ld x %ld = %ld micro-batches per step; %d ranks cannot split "
          "that evenly (use a divisor of %ld ranks)",
          saved_world, saved_accum, micro_batches, world_size, micro_batches);
  }
  if ((long)s.accum * world_size != micro_batches && !records_nothing)
    fail(
        "--accum %d x %d ranks = %ld micro-batches per step, but the checkpoint's steps had %ld (N %ld x A %ld): "
        "the global batch must stay the same",
        s.accum, world_size, (long)s.accum * world_size, micro_batches, saved_world, saved_accum);
  // 16-bit accumulation rounds after every micro-step (notes/08): its bits
  // depend on A itself, so only fp32 accumulation may change the split.
  if (s.grad_accum_dtype != "fp32" && s.accum != saved_accum && !records_nothing)
    fail(
        "the checkpoint accumulates gradients in %s (data_types.grad_accum_dtype), which rounds after every "
        "micro-step: a different split gives different bits. Resume with %ld ranks (A = %ld)",
        s.grad_accum_dtype.c_str(), saved_world, saved_accum);
  if (!records_nothing) check_summation_tree(s, world_size, saved_world, saved_accum);
}

// The checkpoint's settings into `s`: each recorded setting not given is
// taken; one given with another value is refused, naming it. Then the batch:
// the same micro-batch and N x A as the saving run (A follows from N when
// not given), and the data it was trained on (adopted when --data is not
// given; its hash is checked once it is read).
inline void adopt_checkpoint(Settings& s, int world_size) {
  s.checkpoint_directory = checkpoint_step_directory(s.load_dir);
  s.checkpoint = read_checkpoint_index(s.checkpoint_directory);
  const std::string file = s.checkpoint_directory + "/index.json";
  const json& saved = index_field(s.checkpoint, "settings", file);
  const bool export_only = s.steps == 0;  // --load DIR --steps 0: export the checkpoint, train nothing
  if (export_only) s.given.erase("--steps");
  const bool precision_given =
      s.given.count("--precision") || s.given.count("fp16.enabled") || s.given.count("bf16.enabled");
  const json current = recorded_values(s);
  for (const RecordedSetting& setting : recorded_settings) {
    const json& value = index_field(saved, setting.key, file);
    const bool given = std::string(setting.key) == "precision" ? precision_given : s.given.count(setting.flag) > 0;
    if (given) {
      if (std::string(setting.key) == "held_out" && current[setting.key] != value)
        fail("--eval-every %ld %s, and the checkpoint's run (in '%s') did %s: the training data would differ",
             s.eval_every,
             s.eval_every > 0 ? "holds the data's tail out of training" : "keeps the data's tail in training",
             s.checkpoint_directory.c_str(),
             value == true ? "hold it out (--eval-every K > 0 continues it)" : "not (leave --eval-every out)");
      if (current[setting.key] != value)
        fail(
            "%s %s contradicts the checkpoint's %s (in '%s'): a different value changes %s. Leave it out to "
            "continue as saved",
            setting.flag, current[setting.key].dump().c_str(), value.dump().c_str(), s.checkpoint_directory.c_str(),
            setting.what);
      continue;
    }
    if (std::string(setting.key) == "held_out") {
      s.eval_every = index_integer(saved, "eval_every", file, 0, 1l << 30, "settings");
      if ((s.eval_every > 0) != (value == true))
        fail("the checkpoint index '%s': settings.eval_every and settings.held_out disagree", file.c_str());
    } else if (std::string(setting.key) == "precision") {
      s.precision = parse_choice("the checkpoint's setting 'precision' (in '" + file + "')",
                                 index_string(saved, "precision", file, "settings"), {"fp32", "bf16", "fp16"});
    } else {
      const std::string text = value.is_boolean()  ? (value.get<bool>() ? "1" : "0")
                               : value.is_string() ? value.get<std::string>()
                                                   : value.dump();
      apply(s, setting.flag, text, "the checkpoint's setting '" + std::string(setting.key) + "'");
      s.given.erase(setting.flag);  // taken, not given
    }
  }
  // Portable mode (notes/11) is not among the settings above: a run may
  // choose it anew, as it may the device, and a checkpoint from before it
  // existed has no record of it. Not given, it continues as saved, so that
  // a resumed portable run keeps the bits of one that never stopped.
  if (!s.given.count("--portable") && saved.contains("portable")) {
    if (!saved["portable"].is_boolean())
      fail("the checkpoint index '%s': settings.portable is %s, not true or false", file.c_str(),
           saved["portable"].dump().c_str());
    s.portable = saved["portable"].get<bool>();
  }
  if (export_only) s.export_only = true;
  // The run's length is not the schedule's: a resumed run may train longer
  // or shorter; without --steps it ends where the saving run would have.
  if (!s.given.count("--steps")) {  // (an export's --steps 0 is not "given": it trains nothing)
    s.steps = index_integer(saved, "steps", file, 1, 1l << 30, "settings");
    s.given.insert("--steps");
  }
  adopt_checkpoint_batch(s, world_size, file);
  const std::string source = index_string(s.checkpoint, "data.source", file);
  if (s.data.empty() && source != "embedded") s.data = source;
}

// Every rank's file of the checkpoint, as the index lists it, checked: the
// files cover [0, Psi) in order, one per saving rank.
struct CheckpointFile {
  std::string path, sha256;
  size_t begin = 0, end = 0, bytes = 0;
};
inline std::vector<CheckpointFile> checkpoint_files(const Settings& s, size_t psi) {
  const std::string file = s.checkpoint_directory + "/index.json";
  const json& files = index_field(s.checkpoint, "files", file);
  const long saved_world = index_integer(s.checkpoint, "world_size", file, 1, INT_MAX);
  if (!files.is_array() || (long)files.size() != saved_world)
    fail("the checkpoint index '%s' lists %zu files for %ld ranks", file.c_str(), files.is_array() ? files.size() : 0,
         saved_world);
  if (index_integer(s.checkpoint, "psi", file, 0, LONG_MAX) != (long)psi)
    fail("the checkpoint index '%s' holds %ld parameters; this model has %zu", file.c_str(),
         index_integer(s.checkpoint, "psi", file, 0, LONG_MAX), psi);
  std::vector<CheckpointFile> list;
  size_t covered = 0;
  for (size_t q = 0; q < files.size(); ++q) {
    const std::string where = "files." + std::to_string(q);
    CheckpointFile entry;
    const std::string name = index_string(files[q], "file", file, where);
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..")
      fail("the checkpoint index '%s': '%s.file' = \"%s\" is not a file name", file.c_str(), where.c_str(),
           name.c_str());
    entry.path = s.checkpoint_directory + "/" + name;
    entry.sha256 = index_string(files[q], "sha256", file, where);
    entry.begin = (size_t)index_integer(files[q], "begin", file, 0, (long)psi, where);
    entry.end = (size_t)index_integer(files[q], "end", file, 0, (long)psi, where);
    entry.bytes = (size_t)index_integer(files[q], "bytes", file, 0, LONG_MAX, where);
    if (entry.begin != covered || entry.end < entry.begin)
      fail("the checkpoint index '%s': %s covers [%zu, %zu), but the files before end at %zu", file.c_str(),
           where.c_str(), entry.begin, entry.end, covered);
    covered = entry.end;
    list.push_back(entry);
  }
  if (covered != psi)
    fail("the checkpoint index '%s': its files cover %zu of %zu parameters", file.c_str(), covered, psi);
  return list;
}

// One rank file opened for reading pieces: its header checked against the
// index (three float32 tensors of end - begin elements, and nothing else).
class StateFile {
 public:
  explicit StateFile(const CheckpointFile& entry) : entry_(entry) {
    fd_ = open(entry.path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) fail("cannot open the checkpoint file '%s': %s", entry.path.c_str(), std::strerror(errno));
    struct stat info;
    if (fstat(fd_, &info) != 0 || !S_ISREG(info.st_mode))
      fail("the checkpoint file '%s' is not a regular file", entry.path.c_str());
    if ((size_t)info.st_size != entry.bytes)
      fail("the checkpoint file '%s' has %s bytes; its index says %s (cut short or replaced)", entry.path.c_str(),
           z2::with_commas((size_t)info.st_size).c_str(), z2::with_commas(entry.bytes).c_str());
    unsigned char length_bytes[8];
    read_at(length_bytes, 8, 0);
    uint64_t length = 0;
    for (int k = 0; k < 8; ++k) length |= (uint64_t)length_bytes[k] << (8 * k);
    if (length > (1u << 20) || 8 + length > entry.bytes) damaged("its header length");
    std::string text(length, '\0');
    read_at(text.data(), length, 8);
    json header;
    try {
      header = json::parse(text);
    } catch (const json::exception&) { damaged("its header (not JSON)"); }
    const size_t count = entry.end - entry.begin;
    data_start_ = 8 + length;
    if (!header.is_object()) damaged("its header (not a JSON object)");
    for (const char* name : {"master", "exp_avg", "exp_avg_sq"}) {
      if (!header.contains(name) || !header[name].is_object()) damaged(std::string("its header (no ") + name + ")");
      const json& tensor = header[name];
      if (tensor.value("dtype", json()) != "F32" || tensor.value("shape", json()) != json::array({count}))
        damaged(std::string("the dtype or shape of ") + name);
      const json offsets = tensor.value("data_offsets", json::array());
      if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
          !offsets[1].is_number_unsigned() || offsets[1].get<size_t>() < offsets[0].get<size_t>() ||
          offsets[1].get<size_t>() - offsets[0].get<size_t>() != 4 * count ||
          data_start_ + offsets[1].get<size_t>() > entry.bytes)
        damaged(std::string("the offsets of ") + name);
      offsets_.push_back(offsets[0].get<size_t>());
    }
  }
  ~StateFile() { close(fd_); }
  StateFile(const StateFile&) = delete;
  StateFile& operator=(const StateFile&) = delete;

  // Elements [from, from + count) of the canonical order (inside this
  // file's range) of tensor `which` (0 master, 1 exp_avg, 2 exp_avg_sq).
  void read(int which, size_t from, size_t count, float* into) {
    read_at(into, count * sizeof(float), data_start_ + offsets_[which] + (from - entry_.begin) * sizeof(float));
  }

 private:
  [[noreturn]] void damaged(const std::string& what) {
    fail("the checkpoint file '%s' is damaged: %s does not match its index", entry_.path.c_str(), what.c_str());
  }
  void read_at(void* into, size_t bytes, size_t offset) {
    for (size_t done = 0; done < bytes;) {
      const ssize_t got = pread(fd_, (char*)into + done, bytes - done, (off_t)(offset + done));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0)
        fail("cannot read the checkpoint file '%s': %s", entry_.path.c_str(),
             got < 0 ? std::strerror(errno) : "it ends early");
      done += (size_t)got;
    }
  }
  CheckpointFile entry_;
  int fd_ = -1;
  size_t data_start_ = 0;
  std::vector<size_t> offsets_;
};

// A file's SHA-256, streamed (1 MiB at a time: a file is never held whole).
inline std::string file_sha256(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot open the checkpoint file '%s': %s", path.c_str(), std::strerror(errno));
  Sha256 sha;
  std::vector<char> buffer(1 << 20);
  for (;;) {
    const ssize_t got = read(fd, buffer.data(), buffer.size());
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      close(fd);
      fail("cannot read the checkpoint file '%s': %s", path.c_str(), std::strerror(errno));
    }
    if (got == 0) break;
    sha.update(buffer.data(), (size_t)got);
  }
  close(fd);
  return sha.hex();
}

// This rank's optimizer state for the runs it owns, read from the files
// that overlap them. Rank r also checks the SHA-256 of files r, r + N, ...
// (each file once over the ranks: verification does not multiply the reads).
inline z2::OptimizerState read_owned_state(const Settings& s, const z2::Engine& engine, int rank, int world_size) {
  const std::vector<CheckpointFile> files = checkpoint_files(s, engine.psi());
  for (size_t q = (size_t)rank; q < files.size(); q += (size_t)world_size) {
    StateFile header_check(files[q]);  // its size and header first: a truncated file is named as such
    if (file_sha256(files[q].path) != files[q].sha256)
      fail("the checkpoint file '%s' is damaged: its SHA-256 is not the one its index records", files[q].path.c_str());
  }
  const std::vector<z2::StateRun> owned = engine.owned_state_runs(rank);
  std::vector<z2::StateRun> ranges;
  for (const CheckpointFile& file : files) ranges.push_back({file.begin, file.end - file.begin});
  size_t owned_elements = 0;
  for (const z2::StateRun& run : owned) owned_elements += run.length;
  z2::OptimizerState state;
  state.master.resize(owned_elements), state.exp_avg.resize(owned_elements), state.exp_avg_sq.resize(owned_elements);
  std::vector<std::unique_ptr<StateFile>> opened(files.size());  // each file opened (and its header read) once
  size_t filled = 0;
  for (const z2::ReshardRead& read : z2::reshard_reads(owned, ranges)) {
    if (read.file >= files.size() || read.canonical < files[read.file].begin ||
        read.canonical + read.length > files[read.file].end || read.into + read.length > owned_elements)
      fail(
          "resharding: a read of %zu elements at %zu from file %zu (into %zu) lies outside the file or the owned "
          "state",
          read.length, read.canonical, read.file, read.into);
    if (!opened[read.file]) opened[read.file] = std::make_unique<StateFile>(files[read.file]);
    opened[read.file]->read(0, read.canonical, read.length, state.master.data() + read.into);
    opened[read.file]->read(1, read.canonical, read.length, state.exp_avg.data() + read.into);
    opened[read.file]->read(2, read.canonical, read.length, state.exp_avg_sq.data() + read.into);
    filled += read.length;
  }
  if (filled != owned_elements)
    fail("resharding: the reads fill %zu of the %zu elements this rank owns", filled, owned_elements);
  return state;
}

// Why a loss scale cannot have come from training with these settings, or
// "" when it can. fp32 and bf16 train at 1; fp16's static scale never
// changes; DeepSpeed's dynamic scaler starts at 2^initial_scale_power,
// halves (clamped at min_loss_scale) and doubles at most once per
// loss_scale_window clean steps: a power of two, or min_loss_scale times one.
inline std::string impossible_loss_scale(const Settings& s, double scale, long iteration) {
  const z2::LossScaling& l = s.loss_scaling;
  auto power_of_two = [](double x) {
    int exponent = 0;
    return std::isfinite(x) && x > 0 && std::frexp(x, &exponent) == 0.5;
  };
  if (!std::isfinite(scale) || !(scale > 0)) return "not a positive finite number";
  if (s.precision != "fp16") return scale == 1 ? "" : s.precision + " trains at loss scale 1";
  if (l.static_scale > 0)
    return scale == l.static_scale ? "" : "fp16.loss_scale " + json(l.static_scale).dump() + " is static";
  const double start = std::ldexp(1.0, l.initial_scale_power);
  const double highest = std::ldexp(std::max(start, l.min_scale), (int)std::min(iteration / l.window, 4096l));
  if (!power_of_two(scale) && !power_of_two(scale / l.min_scale))
    return "the dynamic scale is a power of two, or min_loss_scale times one";
  if (scale < std::min(start, l.min_scale) || scale > highest)
    return "from 2^" + std::to_string(l.initial_scale_power) + ", " + std::to_string(iteration) +
           " steps with a window of " + std::to_string(l.window) + " reach " + json(highest).dump() + " at most";
  return "";
}

// The progress the index records.
inline z2::TrainingProgress checkpoint_progress(const Settings& s) {
  const std::string file = s.checkpoint_directory + "/index.json";
  z2::TrainingProgress progress;
  progress.steps_taken = index_integer(s.checkpoint, "progress.steps_taken", file, 0, LONG_MAX);
  progress.applied = index_integer(s.checkpoint, "progress.applied", file, 0, progress.steps_taken);
  progress.skipped = index_integer(s.checkpoint, "progress.skipped", file, 0, progress.steps_taken);
  const json& scale = index_field(s.checkpoint, "progress.loss_scale", file);
  if (!scale.is_number()) fail("the checkpoint index '%s': progress.loss_scale is not a number", file.c_str());
  progress.scaler.scale = scale.get<double>();
  progress.scaler.hysteresis_left = (int)index_integer(s.checkpoint, "progress.hysteresis_left", file, 1, INT_MAX);
  progress.scaler.iteration = index_integer(s.checkpoint, "progress.scaler_iteration", file, 0, LONG_MAX);
  progress.scaler.last_overflow = index_integer(s.checkpoint, "progress.last_overflow", file, -1, LONG_MAX);
  const std::string impossible = impossible_loss_scale(s, progress.scaler.scale, progress.scaler.iteration);
  if (!impossible.empty())
    fail("the checkpoint index '%s' is damaged: progress.loss_scale %s cannot come from training (%s)", file.c_str(),
         scale.dump().c_str(), impossible.c_str());
  if (progress.applied + progress.skipped != progress.steps_taken)
    fail("the checkpoint index '%s': %ld updates and %ld skipped steps do not make its %ld steps", file.c_str(),
         progress.applied, progress.skipped, progress.steps_taken);
  if (progress.steps_taken > s.steps)
    fail("the checkpoint is at step %ld, past --steps %ld", progress.steps_taken, s.steps);
  return progress;
}

// The model's parameters as the index lists them: the same names, shapes
// and order, or a message naming the first that differs.
template <class Act>
inline void check_checkpoint_parameters(const Settings& s, const Model<Act>& model, const z2::Engine& engine) {
  const std::string file = s.checkpoint_directory + "/index.json";
  const json& listed = index_field(s.checkpoint, "parameters", file);
  const auto& infos = engine.parameters();
  if (!listed.is_array() || listed.size() != infos.size())
    fail("the checkpoint index '%s' lists %zu parameters; this model has %zu", file.c_str(),
         listed.is_array() ? listed.size() : 0, infos.size());
  for (size_t id = 0; id < infos.size(); ++id) {
    const json expected = {
        {"name", infos[id].name}, {"shape", model.tensor_shape((int)id)}, {"numel", infos[id].numel}};
    if (listed[id] != expected)
      fail("the checkpoint index '%s': parameter %zu is %s; this model's is %s", file.c_str(), id,
           listed[id].dump().c_str(), expected.dump().c_str());
  }
}

// --- what a --save directory holds, and whose ----------------------------------
//
// A --save directory may hold the user's own files beside the steps, and
// steps of runs other than this one. Only what is provably this run's is
// ever deleted or replaced: a step_<n> directory (not a link) whose index
// verifies against its index.sha256, records this run's run_id and step n,
// and which holds exactly index.json, index.sha256 and the files its index
// lists, at the listed sizes.

enum class StepOwner { absent, this_run, other_run, not_a_step };
struct StepEntry {
  long step = 0;
  std::string path;
};

// Every entry of `save_dir` named step_<n> (up to 18 digits: a long), of any type.
inline std::vector<StepEntry> step_entries(const std::string& save_dir) {
  std::vector<StepEntry> entries;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(save_dir, error)) {
    const std::string name = entry.path().filename().string();
    if (name.size() > 5 && name.size() <= 5 + 18 && name.compare(0, 5, "step_") == 0 &&
        name.find_first_not_of("0123456789", 5) == std::string::npos)
      entries.push_back({std::strtol(name.c_str() + 5, nullptr, 10), entry.path().string()});
  }
  if (error) fail("--save: cannot list the directory '%s': %s", save_dir.c_str(), error.message().c_str());
  std::sort(entries.begin(), entries.end(), [](const StepEntry& a, const StepEntry& b) { return a.step < b.step; });
  return entries;
}

// Whose step the entry at `path` is; `why` says what keeps it from being
// this run's when it is not.
inline StepOwner step_owner(const std::string& path, long step, const std::string& run_id, std::string& why) {
  auto not_this_run = [&](const std::string& reason) {
    why = reason;
    return StepOwner::not_a_step;
  };
  struct stat info;
  if (lstat(path.c_str(), &info) != 0) return StepOwner::absent;
  if (!S_ISDIR(info.st_mode)) return not_this_run("not a directory");
  std::string text;
  try {
    text = read_regular_file("the index", path + "/index.json", 64u << 20);
  } catch (const z2::Error&) { return not_this_run("no readable index.json"); }
  const json index = parsed_or_null(text);
  if (!is_zero2_index(index)) return not_this_run("its index.json is not a zero2 checkpoint index");
  if (!index.contains("run_id") || index["run_id"] != run_id) return StepOwner::other_run;
  try {
    verified_index_text(path);
  } catch (const z2::Error&) { return not_this_run("its index does not match its index.sha256"); }
  if (index.value("version", json()) != checkpoint_version || index.value("step", json()) != step ||
      !index.contains("files") || !index["files"].is_array())
    return not_this_run("its index is not that of step " + std::to_string(step));
  std::map<std::string, json> expected = {{"index.json", json()}, {index_digest_file, json()}};
  for (const json& entry : index["files"])
    if (entry.is_object() && entry.value("file", json()).is_string())
      expected[entry["file"].get<std::string>()] = entry.value("bytes", json());
  std::error_code error;
  size_t seen = 0;
  for (const auto& entry : std::filesystem::directory_iterator(path, error)) {
    const std::string name = entry.path().filename().string();
    struct stat file;
    if (!expected.count(name) || lstat(entry.path().c_str(), &file) != 0 || !S_ISREG(file.st_mode) ||
        (!expected[name].is_null() && expected[name] != (long)file.st_size))
      return not_this_run("'" + name.substr(0, 64) + "' is not a file its index lists");
    ++seen;
  }
  if (error || seen != expected.size()) return not_this_run("files its index lists are missing");
  return StepOwner::this_run;
}

// .step_<n>.incomplete, left by a save that was killed (or the old step a
// re-save swapped out): removed only when it holds nothing but what a save
// writes there (rank files, the index, its digest, the writer's temporaries).
inline bool is_incomplete_step_name(const std::string& name) {
  return name.size() > 17 && name.compare(0, 6, ".step_") == 0 &&
         name.compare(name.size() - 11, 11, ".incomplete") == 0 &&
         name.find_first_not_of("0123456789", 6) == name.size() - 11;
}
inline bool holds_only_checkpoint_files(const std::string& path) {
  struct stat info;
  if (lstat(path.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) return false;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(path, error)) {
    const std::string name = entry.path().filename().string();
    const bool rank_file = name.size() == 22 && name.compare(0, 5, "rank_") == 0 &&
                           name.find_first_not_of("0123456789", 5) == 10 && name.compare(10, 12, ".safetensors") == 0;
    if (!rank_file && name != "index.json" && name != index_digest_file &&
        name.find(".zero2-tmp.") == std::string::npos)
      return false;
  }
  return !error;
}

// Where the ranks write a step: .step_<s>.incomplete, made empty (one a
// killed save left is removed, if it holds nothing but a save's files).
inline void make_incomplete_step(const std::string& incomplete) {
  if (path_is_there(incomplete)) {
    if (!holds_only_checkpoint_files(incomplete))
      fail("--save: '%s' holds files a save does not write there: move it away", incomplete.c_str());
    std::error_code ignored;
    std::filesystem::remove_all(incomplete, ignored);
  }
  prepare_directory("--save", incomplete);
}

// Rank 0, before step 1: lock --save, take the run's identity (the loaded
// checkpoint's, or a new one), and refuse a directory holding another
// run's steps (unless --save-overwrite) or something else under the name
// of a step this run may save.
inline std::unique_ptr<DirectoryLock> claim_save_directory(Settings& s) {
  auto lock = std::make_unique<DirectoryLock>(
      s.save_dir, DirectoryLock::OnBusy::refuse,
      "--save '" + s.save_dir +
          "' is in use: another run is saving into it (it holds the directory's lock). Two runs saving into one "
          "directory would replace each other's steps and latest: give this run another --save");
  const bool resumed = !s.checkpoint.is_null();
  s.run_id = resumed ? s.checkpoint["run_id"].get<std::string>() : new_run_id();
  const long first =
      resumed ? index_integer(s.checkpoint, "progress.steps_taken", s.checkpoint_directory + "/index.json", 0, LONG_MAX)
              : 0;
  const long last = s.export_only ? first : std::max(first, s.steps);
  for (const StepEntry& entry : step_entries(s.save_dir)) {
    std::string why;
    const StepOwner owner = step_owner(entry.path, entry.step, s.run_id, why);
    if (owner == StepOwner::other_run && !s.save_overwrite)
      fail(
          "--save '%s' holds checkpoints of another run (%s): a %s run there would replace its steps and latest. "
          "Save into another directory, continue that run with --load %s, or give --save-overwrite to replace them",
          s.save_dir.c_str(), entry.path.c_str(), resumed ? "resumed" : "new", s.save_dir.c_str());
    const bool may_save_it = entry.step == last || (entry.step > first && entry.step <= last);
    if (owner == StepOwner::not_a_step && may_save_it)
      fail(
          "--save: '%s' is not a checkpoint of this run (%s), and this run may save step %ld there: move it away or "
          "save into another directory",
          entry.path.c_str(), why.c_str(), entry.step);
  }
  return lock;
}

// --- interrupts ---------------------------------------------------------------
//
// The first SIGINT or SIGTERM asks the run to stop after the current step:
// every rank agrees at the end of each step, saves a checkpoint (--save),
// writes --json marked interrupted and exits 128 + the signal (130, 143). A
// second one at least 2 s later ends the process at once (mpirun and a
// terminal may each deliver the first Ctrl-C, a moment apart).

inline volatile std::sig_atomic_t interrupt_signal = 0;
inline volatile std::sig_atomic_t interrupt_second = 0;  // CLOCK_MONOTONIC seconds of the first, + 2

inline void on_interrupt(int signal) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  if (interrupt_signal != 0 && now.tv_sec >= interrupt_second) {
    std::signal(signal, SIG_DFL);  // async-signal-safe, as is raise
    raise(signal);
    return;
  }
  if (interrupt_signal == 0) {
    interrupt_signal = signal;
    interrupt_second = (std::sig_atomic_t)(now.tv_sec + 2);
  }
}

inline void catch_interrupts() {
  interrupt_signal = 0;
  std::signal(SIGINT, on_interrupt);
  std::signal(SIGTERM, on_interrupt);
}

inline const char* signal_name(int signal) {
  return signal == SIGINT ? "SIGINT" : signal == SIGTERM ? "SIGTERM" : "a signal";
}

// ----------------------------------------------------------------------------
// 6. Training

// The learning rate of optimizer step t (1-based): a warmup from
// warmup_min_lr to lr over W steps, linear (t / W) or DeepSpeed's log
// (ln(t + 1) / ln(W + 1): zero2 counts from 1, so step 1 learns and step W
// reaches lr), then constant (--decay none: DeepSpeed's WarmupLR) or linear
// back toward warmup_min_lr at the schedule's end S (WarmupDecayLR): step S
// still learns at min + (lr - min) / (S - W). With warmup_min_lr 0 (the
// default) these are the products and quotients of the first schedule.
inline double learning_rate(const Settings& s, long t) {
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

// Seconds as h:mm:ss (or m:ss under an hour), for the progress line.
inline std::string clock_text(double seconds) {
  const long total = std::lround(std::max(0.0, seconds));
  char text[32];
  if (total >= 3600) snprintf(text, sizeof text, "%ld:%02ld:%02ld", total / 3600, total / 60 % 60, total % 60);
  else snprintf(text, sizeof text, "%ld:%02ld", total / 60, total % 60);
  return text;
}

inline std::string hex32(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  char text[16];
  snprintf(text, sizeof text, "%08x", bits);
  return text;
}

// A loss scale as DeepSpeed prints it: a whole number when it is one.
inline std::string scale_text(double scale) {
  char text[40];
  if (scale == std::floor(scale) && scale < 1e18) snprintf(text, sizeof text, "%.0f", scale);
  else snprintf(text, sizeof text, "%g", scale);
  return text;
}

struct StepRecord {
  long step;
  float loss, grad_norm;  // grad_norm NaN (null in the JSON) on a skipped step
  double lr, ms, tokens_per_s;
  double loss_scale;  // the scale this step's gradients carried (fp16; 1 otherwise)
  bool skipped;       // fp16 overflow: no update
  double forward_ms = 0, backward_ms = 0, optimizer_ms = 0;  // wall_clock_breakdown only
  double gemm_ms = 0;  // of ms, the time inside sgemm (cpu; 0 on cuda, where gemm only queues work)
};

// --- before step 1 -------------------------------------------------------------

// On several hosts every rank reads its own copy of --data, --config and
// --load's index: they must be the same bytes, or the ranks would train on
// different data (nothing else would notice: the shapes agree). Each rank's
// sizes and SHA-256 go to every rank (one all-gather), so every rank finds
// the same difference and stops with the same message, naming the ranks and
// hosts that differ from rank 0.
inline void check_same_inputs(const Settings& settings, const std::string& corpus, MPI_Comm world) {
  struct Fingerprint {
    char host[MPI_MAX_PROCESSOR_NAME + 1];
    char sha256[3][65];  // --data (the corpus as read), --config, --load's index.json; "" when not given
    long bytes[3];
  };
  Fingerprint mine = {};
  agree_on_errors(
      world,
      [&] {  // reading the config again may fail on one host: agreed before the all-gather
        int length = 0;
        MPI_Get_processor_name(mine.host, &length);
        const std::string index = settings.checkpoint.is_null() ? "" : settings.checkpoint.dump();
        const std::string config = settings.config.empty() ? "" : read_config_text(settings.config);
        const std::string* texts[3] = {&corpus, &config, &index};
        for (int k = 0; k < 3; ++k) {
          snprintf(mine.sha256[k], 65, "%s", sha256_hex(*texts[k]).c_str());
          mine.bytes[k] = (long)texts[k]->size();
        }
      },
      "every rank fingerprinted its inputs");
  int rank = 0, size = 1;
  MPI_Comm_rank(world, &rank);
  MPI_Comm_size(world, &size);
  std::vector<Fingerprint> all((size_t)size);
  MPI_Request request;
  Z2_MPI_CHECK(
      MPI_Iallgather(&mine, (int)sizeof mine, MPI_BYTE, all.data(), (int)sizeof mine, MPI_BYTE, world, &request));
  z2::wait_request(&request, "the all-gather of every rank's input fingerprints");
  const char* names[3] = {"--data", "--config", "--load's index.json"};
  for (int k = 0; k < 3; ++k) {
    std::string differing;
    for (int q = 1; q < size; ++q)
      if (std::strcmp(all[q].sha256[k], all[0].sha256[k]) != 0 || all[q].bytes[k] != all[0].bytes[k])
        differing += (differing.empty() ? "" : ", ") + std::string("rank ") + std::to_string(q) + " on " + all[q].host +
                     " has " + z2::with_commas((size_t)all[q].bytes[k]) + " bytes, SHA-256 " +
                     std::string(all[q].sha256[k]).substr(0, 12) + "...";
    if (!differing.empty())
      fail(
          "%s is not the same file on every rank: rank 0 on %s has %s bytes, SHA-256 %.12s...; %s. Every host "
          "needs the same copy (notes/07, \"Several machines\")",
          names[k], all[0].host, z2::with_commas((size_t)all[0].bytes[k]).c_str(), all[0].sha256[k], differing.c_str());
  }
}

// Checks that touch this host's files: every rank reads its own copy of the
// data, rank 0 alone writes. On several hosts one of them may lack a file,
// so the ranks agree on the outcome before anyone enters a collective.
inline std::string read_inputs(const Settings& settings, int rank, MPI_Comm world) {
  std::string corpus;
  agree_on_errors(world, [&] {
    if (rank == 0) check_outputs(settings);
    corpus = read_corpus(settings.data);
    if (corpus.size() < (size_t)settings.seq - 2)
      fail("the corpus has %zu bytes; --seq %d needs at least %d (a window is seq - 2 bytes)", corpus.size(),
           settings.seq, settings.seq - 2);
    if (!settings.checkpoint.is_null()) {  // the data the checkpoint was trained on, byte for byte
      const std::string file = settings.checkpoint_directory + "/index.json";
      const std::string sha = index_string(settings.checkpoint, "data.sha256", file);
      const long bytes = index_integer(settings.checkpoint, "data.bytes", file, 0, LONG_MAX);
      if (sha != sha256_hex(corpus) || bytes != (long)corpus.size())
        fail(
            "this run's data (%s, %s bytes) is not the data the checkpoint '%s' was trained on (%s, %s bytes): "
            "give that --data",
            settings.data.empty() ? "the embedded corpus" : settings.data.c_str(),
            z2::with_commas(corpus.size()).c_str(), settings.checkpoint_directory.c_str(),
            index_string(settings.checkpoint, "data.source", file).c_str(), z2::with_commas((size_t)bytes).c_str());
    }
  });
  return corpus;
}

inline z2::EngineOptions engine_options(const Settings& settings, z2::Precision precision) {
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
  options.precision = precision;
  options.accumulate_fp32 = settings.grad_accum_dtype == "fp32";
  options.loss_scaling = settings.loss_scaling;
  return options;
}

// --- the memory plan (--plan; notes/10) ------------------------------------------
//
// Bytes per rank, by category, from the flags alone: no engine, no model, no
// allocation. Each category is the code the run allocates with: the engine's
// buffers are z2::engine_buffers() over z2::lay_out_buckets() of the model's
// parameter_numels() (what Engine::build() allocates), the activations are
// activation_peak_bytes() (what the model opens and closes, phase by phase).
// tests/test_trainer.sh holds every category to the measured ledger, to the
// byte. The arena's block is the same sum with each buffer rounded up to 256
// bytes, as the arena serves it: the smallest --device-memory-limit that
// trains. naive's block also depends on where its holes fall (make fraglab
// measures it); the plan gives its live peak, a lower bound.
struct RankPlan {
  int stage = 2, world_size = 1;
  z2::EngineBuffers engine;
  size_t psi = 0;               // real parameters
  size_t activation_peak = 0;   // live bytes at the activation peak, for the allocator
  size_t activation_block = 0;  // the arena's share for them (each buffer rounded to 256)
  size_t live() const { return engine.live() + activation_peak; }              // the ledger's device peak
  size_t arena_block() const { return engine.reserved() + activation_block; }  // the ledger's reserved (arena)
};

inline ModelShape shape_of(const Settings& settings) {
  return ModelShape{settings.layers, settings.hidden,        settings.heads,       settings.intermediate,
                    settings.seq,    settings.max_positions, settings.micro_batch, settings.dropout,
                    settings.seed,   precision_of(settings)};
}
inline ActivationMode mode_of(const Settings& settings) {
  return settings.activations == "recompute" ? ActivationMode::recompute
         : settings.activations == "offload" ? ActivationMode::offload
                                             : ActivationMode::keep;
}

inline z2::Allocator allocator_of(const Settings& settings) {
  if (settings.alloc == "naive") return z2::Allocator::naive;
  if (settings.alloc == "caching") return z2::Allocator::caching;
  if (settings.alloc == "cuda") return z2::Allocator::direct;
  return z2::Allocator::arena;
}

inline RankPlan plan_rank(const Settings& settings, int stage, int world_size) {
  Settings at_stage = settings;
  at_stage.stage = stage;
  const ModelShape shape = shape_of(settings);
  const std::vector<size_t> numels = parameter_numels(shape);
  RankPlan plan;
  plan.stage = stage, plan.world_size = world_size;
  for (size_t numel : numels) plan.psi += numel;
  plan.engine = z2::engine_buffers(z2::lay_out_buckets(numels, world_size, settings.bucket),
                                   engine_options(at_stage, shape.precision), world_size);
  const bool arena = settings.alloc == "arena";
  plan.activation_peak = activation_peak_bytes(shape, mode_of(settings), arena);
  plan.activation_block = activation_peak_bytes(shape, mode_of(settings), true, z2::block_round);
  return plan;
}

// --- what a run holds on the host besides the plan (notes/10) --------------------
//
// The plan counts the engine's buffers and the activations: what the block
// holds. A run also makes host copies the block does not hold: the initial
// parameters built on the host, the final parameters gathered for the hash
// and the export, the optimizer state gathered for a checkpoint or read from
// one; and, for the whole run, offload's host checkpoints and the cpu gemm's
// widened (16-bit) or packed (--portable) operands. On the cpu device these
// share the machine with the block, whose pages stay resident once touched,
// so the check adds them to the plan. Each copy is read off the code that
// makes it (the functions named below) in units of 4 Psi (Psi_padded floats);
// notes/10 has the measured peaks they bound.
struct HostUse {
  size_t fixed = 0;       // what the libraries and the process take after the check (OpenBLAS's buffers)
  size_t persistent = 0;  // held from the first step to the end
  size_t copies = 0;      // the largest transient copy
  std::string largest;    // which one, for the message
  size_t total() const { return fixed + persistent + copies; }
};

inline HostUse host_use(const Settings& settings, const RankPlan& plan, z2::Device device) {
  const double p = 4.0 * (double)plan.engine.psi_padded, N = plan.world_size;
  const bool mixed = precision_of(settings) != z2::Precision::fp32;
  const bool whole_state = plan.stage == 0 || plan.world_size == 1;  // each rank holds all of AdamW's state
  HostUse use;
  use.fixed = 64ull << 20;  // measured: under 2 MiB on 2 cores (notes/10); OpenBLAS's buffer grows with its threads
  double largest = 0;
  auto consider = [&](double bytes, const char* what) {
    if (bytes > largest) largest = bytes, use.largest = what;
  };
  // Model::initialize's values and Engine::parameters_from_host's padded copy (16-bit: and its rounding).
  consider(mixed ? 2.5 * p : 2 * p, "building the initial parameters on the host");
  // Engine::parameters_to_host (16-bit, stages 1-2: the shards, their all-gather, the padded and canonical copies);
  // --export-hf's file is one more copy beside the result.
  consider(mixed && plan.stage > 0 ? 3 * p + p / N : 2 * p,
           "gathering the final parameters for the hash and the export");
  // --dump-batch: the weights and the gradients of step 0, one in its file at a time.
  if (!settings.dump_dir.empty()) consider(4 * p, "--dump-batch's weights and gradients");
  // Engine::state_range_to_host (owned_state_to_host's copies, then the range) and the file's bytes.
  if (!settings.save_dir.empty())
    consider(whole_state ? 6 * p : (mixed ? 0 : p) + 8 * p / N, "--save's copy of the optimizer state and its file");
  // read_owned_state, then Engine::owned_state_from_host's copies of the buffers.
  if (!settings.checkpoint.is_null())
    consider(whole_state ? 6 * p : (mixed ? 0 : p) + 6 * p / N, "--load's copy of the optimizer state");
  use.copies = (size_t)largest;
  const ModelShape shape = shape_of(settings);
  const size_t act = precision_of(settings) == z2::Precision::fp32 ? 4 : 2;
  const size_t B = shape.micro_batch, T = shape.seq, H = shape.hidden, S = B * T;
  if (mode_of(settings) == ActivationMode::offload)  // Model's host_checkpoints_ (pinned on cuda)
    use.persistent += (size_t)(shape.layers - 1) * S * H * act;
  if (device == z2::Device::cpu && (mixed || settings.portable)) {
    // The largest gemm operand (weights, activations, attention scores), in floats: 16-bit widens A, B
    // and C into fp32 scratch; --portable packs A and a block of B.
    const size_t I = shape.intermediate, V = vocab_size;
    const size_t operand =
        std::max({H * std::max({I, V, 3 * H}), S * std::max({I, V, 3 * H}), B * shape.heads * T * T});
    use.persistent += operand * sizeof(float) * ((mixed ? 3 : 0) + (settings.portable ? 2 : 0));
  }
  return use;
}

// Refuse a configuration a rank cannot hold before allocating it (a run
// over the machine's memory is killed by the kernel's OOM killer, not
// stopped with a message): the plan's block for the arena, its live peak for
// naive (which needs more: its holes); on the cpu device the host's own use
// besides (host_use), on cuda that against the host's memory. Returns the one
// block each rank reserves.
inline size_t memory_block(const Settings& settings, z2::Allocator allocator, z2::Device device, int world_size,
                           MPI_Comm world) {
  const RankPlan plan = plan_rank(settings, settings.stage, world_size);
  const double needed = (double)(allocator == z2::Allocator::arena ? plan.arena_block() : plan.live());
  const HostUse host = host_use(settings, plan, device);
  const z2::MemoryLimit limit = z2::memory_per_rank(device, world);
  const z2::MemoryLimit host_limit = device == z2::Device::cpu ? limit : z2::memory_per_rank(z2::Device::cpu, world);
  const double available = (double)limit.bytes, GiB = 1073741824.0;
  const double on_device = needed + (device == z2::Device::cpu ? (double)host.total() : 0.0);
  if (on_device > available || (double)host.total() > (double)host_limit.bytes) {
    // One message: the figure that does not fit, the limit and its source, then the figure's parts.
    const bool host_short = device != z2::Device::cpu && on_device <= available;
    const z2::MemoryLimit& short_of = host_short ? host_limit : limit;
    const double need = host_short ? (double)host.total() : on_device;
    char plan_text[320], host_text[320];
    snprintf(plan_text, sizeof plan_text,
             "%s bytes of the plan (%s parameters, stage %d, N = %d, activations %.2f GiB with --activations %s; "
             "--plan shows every category)",
             z2::with_commas((size_t)needed).c_str(), z2::with_commas(plan.psi).c_str(), settings.stage, world_size,
             plan.activation_peak / GiB, settings.activations.c_str());
    snprintf(host_text, sizeof host_text,
             "%s bytes the process holds on the host besides the plan (%.2f GiB for %s, %.2f held all run, %.2f "
             "for the libraries; notes/10)",
             z2::with_commas(host.total()).c_str(), host.copies / GiB, host.largest.c_str(), host.persistent / GiB,
             host.fixed / GiB);
    std::string parts = plan_text, where;  // cuda, short of the GPU's memory: the plan alone
    if (device == z2::Device::cpu) parts += std::string(" plus ") + host_text;
    else if (host_short) parts = std::string(host_text) + " (the plan itself is on the GPU)", where = " on the host";
    else where = " on the GPU";
    const bool overridden = short_of.source == "ZERO2_MEMORY_LIMIT";
    fail(
        "this configuration needs %s bytes (%.2f GiB) per rank%s but %.2f GiB are available per rank (%s): %s. "
        "Use a smaller model or micro-batch, --activations recompute or offload, a higher stage or more ranks%s",
        z2::with_commas((size_t)need).c_str(), need / GiB, where.c_str(), (double)short_of.bytes / GiB,
        short_of.source.c_str(), parts.c_str(),
        overridden ? ", or raise or unset ZERO2_MEMORY_LIMIT, which set this limit" : "");
  }
  if ((double)settings.device_memory_limit > available)
    fail("--device-memory-limit %ld is more than the %.0f bytes available per rank on this %s (%s)",
         settings.device_memory_limit, available, z2::to_string(device), limit.source.c_str());
  // By default: twice the plan (the naive allocator needs room for its
  // fragmentation; make fraglab shows how much it took) plus 64 MiB, within
  // 90% of what is available (cuBLAS's workspace, NCCL's buffers and the
  // CUDA context live outside the block). On cpu the block is address space
  // until it is touched, so it is never less than the plan, even where the
  // check above passed by less than 10%.
  if (settings.device_memory_limit > 0) return (size_t)settings.device_memory_limit;
  const double block = std::min(0.9 * available, 2 * needed + 64.0 * 1048576.0);
  return (size_t)(device == z2::Device::cpu ? std::max(block, needed) : block);
}

// --- the run --------------------------------------------------------------------

// The whole run on this rank, with activations (and the engine's working
// parameters and gradients) of type Act: construction does everything up
// to step 1 (inputs, the fit check, the engine, the model, a checkpoint
// loaded), run() the steps and the outputs.
template <class Act>
class Training {
 public:
  Training(Settings settings, MPI_Comm world);
  int run();  // the process exit code

 private:
  void print_header() const;
  void train_step(long step);
  void write_memory_trace();
  void write_dump(const z2::StepReport& report, const std::vector<float>& gradients);
  void log_progress(const z2::StepReport& report, double ms);
  float evaluate() const;
  void log_evaluation(long step);
  void load_checkpoint();
  void save_checkpoint();
  long write_index_and_publish(const z2::TrainingProgress& progress, const std::vector<long>& sizes,
                               const std::vector<char>& shas);
  void prune_checkpoints(long keep_step) const;
  void print_schedule() const;
  void print_summary(const std::vector<float>& final_parameters, const std::string& hash) const;
  void write_json(const std::string& hash) const;

  Settings settings_;
  MPI_Comm world_;
  int rank_ = 0, world_size_ = 1;
  bool prints_progress_ = false;
  std::string corpus_;
  z2::Device device_;
  z2::CommBackend comm_backend_;
  z2::Precision precision_ = z2::precision_of<Act>();
  ModelShape shape_;
  ActivationMode mode_ = ActivationMode::keep;
  z2::Allocator allocator_ = z2::Allocator::arena;
  std::unique_ptr<z2::Compute> compute_;
  std::unique_ptr<z2::Communicator> comm_;
  std::unique_ptr<z2::Engine> engine_;
  std::unique_ptr<Model<Act>> model_;
  long tokens_per_step_ = 0;
  z2::MemoryLedger start_ledger_;
  std::vector<StepRecord> records_;
  // Step 0's dump (--dump-batch): what forward read, the batch, the losses.
  std::vector<float> dump_weights_;
  std::vector<Batch> dump_batches_;
  json loaded_, saved_ = json::array();  // what --load read, what --save wrote (for the summary and the JSON)
  // Progress: when this run's training began, the losses since the last
  // progress line (their mean goes in the metrics), and the stream itself.
  std::chrono::steady_clock::time_point training_start_;
  double loss_since_log_ = 0;
  long losses_since_log_ = 0;
  std::unique_ptr<MetricsStream> metrics_;
  std::unique_ptr<DirectoryLock> save_lock_;  // rank 0 with --save: held until the run ends
  // --eval-every: the held-out tail of the data, and each evaluation's loss.
  std::string training_text_, held_out_;
  json evaluations_ = json::array();
  int interrupted_by_ = 0;  // the signal that stopped the run early, or 0
};

template <class Act>
Training<Act>::Training(Settings settings, MPI_Comm world) : settings_(std::move(settings)), world_(world) {
  MPI_Comm_rank(world_, &rank_);
  MPI_Comm_size(world_, &world_size_);
  prints_progress_ = rank_ == 0 && !settings_.quiet;
  z2::set_watchdog_timeout(settings_.timeout);  // from here every wait has a deadline
  check_consistency(settings_, world_size_);
  corpus_ = read_inputs(settings_, rank_, world_);
  // With --eval-every, the last 5% of the data (at least one window) is held
  // out: training draws its windows from the rest (the same bytes on every
  // rank, so every rank splits at the same place, or refuses the same way).
  training_text_ = corpus_;
  if (settings_.eval_every > 0) {
    const size_t window = (size_t)settings_.seq - 2, held = std::max(window, corpus_.size() / 20);
    if (corpus_.size() < held + window)
      fail(
          "--eval-every holds out the data's last %s bytes (5%%, at least one window of --seq - 2), leaving %s "
          "bytes to train on; a window needs %zu: give more data or a shorter --seq",
          z2::with_commas(held).c_str(), z2::with_commas(corpus_.size() - std::min(held, corpus_.size())).c_str(),
          window);
    held_out_ = corpus_.substr(corpus_.size() - held);
    training_text_.resize(corpus_.size() - held);
  }
  // Every rank finds the same difference: the same message and exit everywhere.
  if (world_size_ > 1) check_same_inputs(settings_, corpus_, world_);
  // Rank 0 saves: it locks --save and looks at what it holds, before step 1.
  if (!settings_.save_dir.empty())
    agree_on_errors(
        world_,
        [&] {
          if (rank_ == 0) save_lock_ = claim_save_directory(settings_);
        },
        "the --save directory was claimed");
  device_ = z2::choose_device(settings_.device, world_);
  comm_backend_ = z2::choose_comm(settings_.comm, device_, world_);
  shape_ = shape_of(settings_);
  compute_ = std::make_unique<z2::Compute>(device_, z2::local_rank_of(world_));  // selects this rank's GPU
  // The model writes every element of a pushed activation before reading it
  // (the suite checks with --poison-activations), so zeroing them was one
  // more pass over every activation buffer, every step.
  compute_->set_activation_fill(settings_.poison_activations ? z2::Compute::PushFill::poison
                                                             : z2::Compute::PushFill::none);
  compute_->set_portable(settings_.portable);
  mode_ = mode_of(settings_);
  allocator_ = allocator_of(settings_);
  if (allocator_ == z2::Allocator::direct && device_ != z2::Device::cuda)
    fail(
        "--alloc cuda is cudaMalloc and cudaFree for every tensor: it needs a GPU (--device cuda); on the cpu "
        "use --alloc caching, the model of PyTorch's caching allocator");
  const size_t capacity = memory_block(settings_, allocator_, device_, world_size_, world_);
  // Reserving can fail on one rank only (ranks sharing a GPU measured its
  // free memory at slightly different times), so the ranks agree.
  agree_on_errors(
      world_, [&] { compute_->use_allocator(allocator_, capacity); }, "every rank has its memory");
  comm_ = std::make_unique<z2::Communicator>(
      *compute_, world_, comm_backend_,
      settings_.collectives == "native" ? z2::Collectives::native : z2::Collectives::deterministic);
  engine_ = std::make_unique<z2::Engine>(*compute_, *comm_, engine_options(settings_, precision_));
  model_ = std::make_unique<Model<Act>>(*compute_, *engine_, shape_, mode_);
  model_->time_phases(settings_.wall_clock_breakdown);
  engine_->build();
  model_->initialize();
  if (!settings_.checkpoint.is_null()) load_checkpoint();
  tokens_per_step_ = (long)world_size_ * settings_.accum * settings_.micro_batch * settings_.seq;
  start_ledger_ = engine_->memory_ledger();
}

// Each rank reads the pieces of the checkpoint's files that overlap the
// runs it owns, then the engine rebuilds every rank's working parameters.
template <class Act>
void Training<Act>::load_checkpoint() {
  const auto start = std::chrono::steady_clock::now();
  z2::OptimizerState state;
  z2::TrainingProgress progress;
  agree_on_errors(
      world_,
      [&] {
        check_checkpoint_parameters(settings_, *model_, *engine_);
        progress = checkpoint_progress(settings_);
        state = read_owned_state(settings_, *engine_, rank_, world_size_);
      },
      "every rank read its part of the checkpoint");
  engine_->owned_state_from_host(state);
  engine_->restore_training_progress(progress);
  const std::string file = settings_.checkpoint_directory + "/index.json";
  loaded_ = {{"directory", settings_.checkpoint_directory},
             {"step", progress.steps_taken},
             {"world_size", index_integer(settings_.checkpoint, "world_size", file, 1, INT_MAX)},
             {"accum", index_integer(settings_.checkpoint, "accum", file, 1, INT_MAX)},
             {"stage", index_integer(settings_.checkpoint, "stage", file, 0, 2)},
             // false only with --allow-different-bits: the bits then differ from the unbroken run's
             {"same_summation_tree", !settings_.summation_tree_changed},
             {"precision", settings_.precision},
             {"seconds", std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()}};
}

// DIR/step_<s>: each rank writes the canonical range file_range(rank) of the
// state (gathered from its owners) into DIR/.step_<s>.incomplete, the ranks
// agree, then rank 0 writes the index (with every file's SHA-256) and its
// digest there, puts the directory in place (publish_step) and only then
// moves DIR/latest (write_index_and_publish). A crash at any point leaves
// latest naming a complete step. It reads as the protocol: every collective
// and every agree_on_errors in the order all ranks reach them.
template <class Act>
void Training<Act>::save_checkpoint() {
  const auto start = std::chrono::steady_clock::now();
  const z2::TrainingProgress progress = engine_->training_progress();
  const std::string name = step_directory_name(progress.steps_taken);
  const std::string directory = settings_.save_dir + "/" + name;
  const std::string incomplete = incomplete_step_directory(settings_.save_dir, progress.steps_taken);
  z2::set_watchdog_context("the checkpoint of step " + std::to_string(progress.steps_taken));
  agree_on_errors(
      world_,
      [&] {
        if (rank_ == 0) naming_a_vanished_file([&] { make_incomplete_step(incomplete); });
      },
      "the checkpoint's directory was made");
  const size_t psi = engine_->psi();
  const auto [begin, end] = file_range(psi, rank_, world_size_);
  const z2::OptimizerState state = engine_->state_range_to_host(begin, end);
  char range[2][24];
  snprintf(range[0], sizeof range[0], "%zu", begin);
  snprintf(range[1], sizeof range[1], "%zu", end);
  const long count = (long)(end - begin);
  const std::string contents =
      safetensors_bytes({tensor_f32("master", {count}, state.master.data(), state.master.size()),
                         tensor_f32("exp_avg", {count}, state.exp_avg.data(), state.exp_avg.size()),
                         tensor_f32("exp_avg_sq", {count}, state.exp_avg_sq.data(), state.exp_avg_sq.size())},
                        {{"format", "zero2"}, {"begin", range[0]}, {"end", range[1]}});
  char sha[65] = {};
  snprintf(sha, sizeof sha, "%s", sha256_hex(contents).c_str());
  agree_on_errors(
      world_,
      [&] { naming_a_vanished_file([&] { write_output_file(incomplete + "/" + rank_file_name(rank_), contents); }); },
      "every rank's checkpoint file was written");
  // Every file's SHA-256 and size to rank 0, for the index.
  std::vector<char> shas(rank_ == 0 ? 65 * (size_t)world_size_ : 0);
  std::vector<long> sizes(rank_ == 0 ? world_size_ : 0);
  long size = (long)contents.size();
  MPI_Request requests[2];
  Z2_MPI_CHECK(MPI_Igather(sha, 65, MPI_CHAR, shas.data(), 65, MPI_CHAR, 0, world_, &requests[0]));
  Z2_MPI_CHECK(MPI_Igather(&size, 1, MPI_LONG, sizes.data(), 1, MPI_LONG, 0, world_, &requests[1]));
  z2::wait_request(&requests[0], "the gather of the checkpoint files' SHA-256");
  z2::wait_request(&requests[1], "the gather of the checkpoint files' sizes");
  long total_bytes = 0;
  agree_on_errors(
      world_,
      [&] {
        if (rank_ == 0) naming_a_vanished_file([&] { total_bytes = write_index_and_publish(progress, sizes, shas); });
      },
      "the checkpoint's index was written");
  saved_.push_back({{"directory", directory},
                    {"step", progress.steps_taken},
                    {"bytes", total_bytes},
                    {"seconds", std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()}});
  z2::set_watchdog_context("optimizer step " + std::to_string(progress.steps_taken + 1));
}

// Rank 0's part of a save, once every rank's file is written: the index
// (with every file's SHA-256 and size) and its digest, the step put in
// place, latest moved, old steps pruned. Returns the files' total bytes.
template <class Act>
long Training<Act>::write_index_and_publish(const z2::TrainingProgress& progress, const std::vector<long>& sizes,
                                            const std::vector<char>& shas) {
  const size_t psi = engine_->psi();
  const std::string name = step_directory_name(progress.steps_taken);
  const std::string directory = settings_.save_dir + "/" + name;
  const std::string incomplete = incomplete_step_directory(settings_.save_dir, progress.steps_taken);
  long total_bytes = 0;
  json files = json::array();
  for (int q = 0; q < world_size_; ++q) {
    const auto [low, high] = file_range(psi, q, world_size_);
    files.push_back({{"file", rank_file_name(q)},
                     {"begin", low},
                     {"end", high},
                     {"bytes", sizes[q]},
                     {"sha256", std::string(shas.data() + 65 * q)}});
    total_bytes += sizes[q];
  }
  json parameters = json::array();
  for (size_t id = 0; id < engine_->parameters().size(); ++id)
    parameters.push_back({{"name", engine_->parameters()[id].name},
                          {"shape", model_->tensor_shape((int)id)},
                          {"numel", engine_->parameters()[id].numel}});
  const json index = {
      {"format", "zero2 checkpoint"},
      {"version", checkpoint_version},
      {"run_id", settings_.run_id},
      {"step", progress.steps_taken},
      {"world_size", world_size_},
      {"accum", settings_.accum},
      {"stage", settings_.stage},
      {"precision", settings_.precision},
      {"vocab_size", vocab_size},
      {"settings", recorded_values(settings_)},
      // Absolute: a run resumed from another working directory finds it.
      {"data",
       {{"source",
         settings_.data.empty() ? std::string("embedded") : std::filesystem::absolute(settings_.data).string()},
        {"bytes", corpus_.size()},
        {"sha256", sha256_hex(corpus_)},
        {"cursor", "the data of step s is drawn from (seed, s, micro-batch): resuming at step s needs s only"}}},
      {"progress",
       {{"steps_taken", progress.steps_taken},
        {"applied", progress.applied},
        {"skipped", progress.skipped},
        {"loss_scale", progress.scaler.scale},
        {"hysteresis_left", progress.scaler.hysteresis_left},
        {"scaler_iteration", progress.scaler.iteration},
        {"last_overflow", progress.scaler.last_overflow}}},
      {"psi", psi},
      {"parameters", parameters},
      {"files", files}};
  const std::string index_text = index.dump(2) + "\n";
  write_output_file(incomplete + "/index.json", index_text);
  write_output_file(incomplete + "/" + index_digest_file, index_digest_line(index_text));
  // The step it replaces (a re-save) must be this run's, or another
  // run's with --save-overwrite: never a user's file or folder.
  std::string why;
  const StepOwner owner = step_owner(directory, progress.steps_taken, settings_.run_id, why);
  if (owner == StepOwner::not_a_step || (owner == StepOwner::other_run && !settings_.save_overwrite))
    fail("--save: '%s' is not a checkpoint of this run (%s): move it away or save into another directory",
         directory.c_str(), owner == StepOwner::other_run ? "another run's" : why.c_str());
  publish_step(incomplete, directory);
  write_output_file(settings_.save_dir + "/latest", name + "\n");  // last: the step is complete
  std::error_code ignored;
  std::filesystem::remove_all(incomplete, ignored);  // the step it replaced, if any
  prune_checkpoints(progress.steps_taken);
  return total_bytes;
}

// Keeps the newest --save-keep steps up to `keep_step` (the one just saved
// among them); steps after it (from a run that was resumed from earlier)
// are left alone.
// Only this run's steps (step_owner) count and are deleted: a user's
// step_1/ folder, a plain file step_3 or another run's step stays.
template <class Act>
void Training<Act>::prune_checkpoints(long keep_step) const {
  std::vector<std::string> ours;  // oldest first
  for (const StepEntry& entry : step_entries(settings_.save_dir)) {
    std::string why;
    if (entry.step <= keep_step && step_owner(entry.path, entry.step, settings_.run_id, why) == StepOwner::this_run)
      ours.push_back(entry.path);
  }
  std::error_code error;
  for (size_t k = 0; k + (size_t)settings_.save_keep < ours.size(); ++k) std::filesystem::remove_all(ours[k], error);
  // A save killed before it was complete left .step_<k>.incomplete.
  std::vector<std::string> left;
  for (const auto& entry : std::filesystem::directory_iterator(settings_.save_dir, error))
    if (is_incomplete_step_name(entry.path().filename().string()) && holds_only_checkpoint_files(entry.path()))
      left.push_back(entry.path());
  for (const std::string& path : left) std::filesystem::remove_all(path, error);
}

// The optimizer line: what the rate does over the schedule, and how much of
// the schedule this run trains when the two differ.
template <class Act>
void Training<Act>::print_schedule() const {
  const Settings& s = settings_;
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

template <class Act>
void Training<Act>::print_header() const {
  const int N = world_size_, T = settings_.seq, B = settings_.micro_batch;
  const char* names[] = {"data parallel (baseline)", "P_os (optimizer states sharded)",
                         "P_os+g (optimizer states and gradients sharded)"};
  printf("train_bert_mini: BERT-mini masked LM through zero2 (ZeRO stage %d)\n", settings_.stage);
  printf("  world     %d rank(s), device %s, comm %s, collectives %s, overlap %s, bucket %s elements\n", N,
         z2::to_string(device_), z2::to_string(comm_backend_), settings_.collectives.c_str(),
         settings_.overlap ? "on" : "off", z2::with_commas((size_t)settings_.bucket).c_str());
  printf("  stage     %d: %s\n", settings_.stage, names[settings_.stage]);
  if (settings_.portable)
    printf("  portable  zero2's own gemm (%s), own exp / log / erf: the bits depend on the inputs alone (notes/11)\n",
           device_ == z2::Device::cuda ? "a tiled CUDA kernel" : "a blocked CPU kernel");
  if (precision_ == z2::Precision::fp32)
    printf("  precision fp32: parameters, gradients, AdamW state and activations in fp32\n");
  else
    printf(
        "  precision %s: %s parameters, gradients and activations, fp32 master weights and AdamW state "
        "(K = 12); sums in fp32, accumulation in %s\n",
        settings_.precision.c_str(), settings_.precision.c_str(), settings_.grad_accum_dtype.c_str());
  if (precision_ == z2::Precision::fp16) {
    const z2::LossScaling& l = settings_.loss_scaling;
    if (l.static_scale > 0) printf("  loss scale static %s (fp16.loss_scale)\n", scale_text(l.static_scale).c_str());
    else
      printf("  loss scale dynamic: 2^%d, doubled after %ld clean steps, halved after %d overflow(s), at least %s\n",
             l.initial_scale_power, l.window, l.hysteresis, scale_text(l.min_scale).c_str());
  }
  printf("  model     layers %d, hidden %d, heads %d, intermediate %d, seq %d, vocab %d, positions %d, dropout %g\n",
         settings_.layers, settings_.hidden, settings_.heads, settings_.intermediate, T, vocab_size,
         settings_.max_positions, settings_.dropout);
  printf("  Psi       %s parameters (%s padded into %zu bucket(s))\n", z2::with_commas((size_t)engine_->psi()).c_str(),
         z2::with_commas((size_t)engine_->psi_padded()).c_str(), engine_->buckets().size());
  printf("  batch     %d sequences x accumulation %d x %d rank(s) = %s tokens per step\n", B, settings_.accum, N,
         z2::with_commas((size_t)tokens_per_step_).c_str());
  printf("  data      %s (%s bytes), seed %llu%s\n",
         settings_.data.empty() ? "embedded corpus (data/corpus.txt)" : settings_.data.c_str(),
         z2::with_commas((size_t)corpus_.size()).c_str(), (unsigned long long)settings_.seed,
         held_out_.empty()
             ? ""
             : ("; the last " + z2::with_commas(held_out_.size()) + " held out for --eval-every").c_str());
  print_schedule();
  for (const std::string& line : settings_.config_notes) printf("  config    %s\n", line.c_str());
  for (const std::string& line : settings_.repeated_flags) printf("  flags     %s\n", line.c_str());
  printf("  memory    --activations %s, --alloc %s: %s %s bytes per rank (%s)\n", settings_.activations.c_str(),
         settings_.alloc.c_str(),
         allocator_ == z2::Allocator::arena || allocator_ == z2::Allocator::naive
             ? "one block of"
             : "segments taken as needed (caching) or cudaMalloc per tensor (cuda) within a limit of",
         z2::with_commas(compute_->capacity()).c_str(),
         settings_.device_memory_limit > 0
             ? "--device-memory-limit"
             : "default: twice the plan's need (--plan) + 64 MiB, at most 90% of what is free");
  const size_t checkpoint_bytes = (size_t)B * T * settings_.hidden * sizeof(Act);
  printf(
      "  activations per rank: device peak %s bytes by the formula%s\n",
      z2::with_commas(activation_peak_bytes(shape_, mode_, allocator_ == z2::Allocator::arena)).c_str(),
      mode_ == ActivationMode::offload
          ? (" (bound: one block + 2 checkpoints = " + z2::with_commas(offload_activation_bound(shape_)) + "); host " +
             z2::with_commas((size_t)(settings_.layers - 1) * checkpoint_bytes) + " (L - 1 checkpoints)")
                .c_str()
          : "");
  printf("  model states per rank: %s bytes; formula %s = %s (%s)\n",
         z2::with_commas((size_t)start_ledger_.model_states).c_str(),
         z2::model_states_formula_text(settings_.stage, precision_),
         z2::with_commas((size_t)start_ledger_.model_states_formula).c_str(),
         start_ledger_.model_states == start_ledger_.model_states_formula ? "equal" : "DIFFERS");
  if (!loaded_.is_null())
    printf("  loaded    %s: step %ld of %ld, saved by %ld rank(s) x accumulation %ld, stage %ld, %s (%.2f s)\n",
           settings_.checkpoint_directory.c_str(), loaded_["step"].get<long>(), settings_.steps,
           loaded_["world_size"].get<long>(), loaded_["accum"].get<long>(), loaded_["stage"].get<long>(),
           settings_.precision.c_str(), loaded_["seconds"].get<double>());
  if (settings_.summation_tree_changed)
    printf(
        "  WARNING   this split of the global batch sums in another tree than the checkpoint's "
        "(--allow-different-bits): the bits will differ from the run that never stopped\n");
  if (!settings_.save_dir.empty())
    printf("  save      %s/step_<s>: %s, keeping the newest %d\n", settings_.save_dir.c_str(),
           settings_.save_every > 0
               ? ("every " + std::to_string(settings_.save_every) + " steps and at the end").c_str()
               : "at the end",
           settings_.save_keep);
  if (loaded_.is_null())
    printf("  initial loss should be near ln(%d) = %.3f\n", vocab_size, std::log((double)vocab_size));
  printf("\n");
  fflush(stdout);
}

// One optimizer step: A micro-steps of forward and backward, the engine's
// step, and what this step writes (trace, dump, progress line).
template <class Act>
void Training<Act>::train_step(long step) {
  const int A = settings_.accum, B = settings_.micro_batch, T = settings_.seq;
  const auto start = std::chrono::steady_clock::now();
  const double gemm_seconds_before = compute_->gemm_seconds();
  const long selected = global_selected_count(training_text_, settings_.seed, step, (long)world_size_ * A, B, T);
  // A global batch with no selected position has no loss; the scale 1/1 then
  // multiplies nothing (every gradient is zero).
  const float loss_scale = 1.0f / (float)std::max(1l, selected);
  const bool first = records_.empty();  // this run's first step (a resumed run's too)
  const bool dumping = step == 0 && !settings_.dump_dir.empty();
  if (first && !settings_.memory_trace.empty()) compute_->set_tracing(true);
  if (dumping) dump_weights_ = engine_->working_parameters_to_host();  // what forward reads (16-bit: as floats)
  for (int a = 0; a < A; ++a) {
    const long m = engine_->micro_batch_index(a);
    Batch batch = make_batch(training_text_, settings_.seed, step, m, B, T);
    model_->run(batch, step, m, loss_scale, true);
    if (dumping) dump_batches_.push_back(std::move(batch));
  }
  std::vector<float> dump_gradients;
  if (dumping) dump_gradients = engine_->gradients_to_host();
  const auto optimizer_start = std::chrono::steady_clock::now();
  const z2::StepReport report = engine_->step();
  compute_->synchronize_all();
  const auto end = std::chrono::steady_clock::now();
  if (first && !settings_.memory_trace.empty()) write_memory_trace();
  const double ms = std::chrono::duration<double, std::milli>(end - start).count();
  records_.push_back({report.step, report.loss, report.grad_norm, report.lr, ms, tokens_per_step_ / (ms / 1000.0),
                      report.loss_scale, report.skipped});
  records_.back().gemm_ms = (compute_->gemm_seconds() - gemm_seconds_before) * 1000.0;
  if (settings_.wall_clock_breakdown) {
    const typename Model<Act>::Times times = model_->take_times();
    records_.back().forward_ms = times.forward_ms;
    records_.back().backward_ms = times.backward_ms;
    records_.back().optimizer_ms = std::chrono::duration<double, std::milli>(end - optimizer_start).count();
  }
  // (An fp16 overflow skips the step instead: its loss may be inf.)
  if (!report.skipped && !std::isfinite(report.loss))
    fail("the loss is %g at step %ld: training diverged (lower --lr?)", report.loss, report.step);
  if (dumping) write_dump(report, dump_gradients);
  log_progress(report, ms);
}

// Rank 0 writes; every rank learns whether it could (a full disk ends them all).
template <class Act>
void Training<Act>::write_memory_trace() {
  compute_->set_tracing(false);
  agree_on_errors(
      world_,
      [&] {
        if (rank_ != 0) return;
        std::ostringstream csv;
        csv << "event,live_bytes,reserved_bytes,activation_bytes,free_pieces\n";
        for (size_t k = 0; k < compute_->trace().size(); ++k) {
          const z2::MemorySample& sample = compute_->trace()[k];
          csv << k << ',' << sample.live << ',' << sample.reserved << ',' << sample.activations << ','
              << sample.free_pieces << '\n';
        }
        write_output_file(settings_.memory_trace, csv.str());
      },
      "the memory trace was written");
}

// Step 0, one rank: the weights, batch, loss and gradients of this step.
template <class Act>
void Training<Act>::write_dump(const z2::StepReport& report, const std::vector<float>& gradients) {
  agree_on_errors(
      world_,
      [&] {
        const int T = settings_.seq;
        std::vector<Tensor> tensors = named_tensors(*model_, *engine_, gradients, "grad.");
        std::vector<int64_t> ids, labels;
        for (auto& batch : dump_batches_) {
          ids.insert(ids.end(), batch.tokens.begin(), batch.tokens.end());
          labels.insert(labels.end(), batch.labels.begin(), batch.labels.end());
        }
        const long rows = (long)dump_batches_.size() * settings_.micro_batch;
        tensors.push_back({"input_ids", "I64", {rows, T}, std::string((const char*)ids.data(), ids.size() * 8)});
        tensors.push_back({"labels", "I64", {rows, T}, std::string((const char*)labels.data(), labels.size() * 8)});
        tensors.push_back(tensor_f32("loss", {}, &report.loss, 1));
        char text[7][40];
        const double values[] = {report.lr,        settings_.beta1,        settings_.beta2,
                                 settings_.eps,    settings_.weight_decay, settings_.clip,
                                 settings_.dropout};
        for (int k = 0; k < 7; ++k) snprintf(text[k], sizeof text[k], "%.17g", values[k]);
        write_safetensors(settings_.dump_dir + "/batch.safetensors", tensors,
                          {{"format", "pt"},
                           {"lr", text[0]},
                           {"beta1", text[1]},
                           {"beta2", text[2]},
                           {"eps", text[3]},
                           {"weight_decay", text[4]},
                           {"clip", text[5]},
                           {"dropout", text[6]}});
        export_hf(settings_.dump_dir, *model_, *engine_, dump_weights_, precision_);
      },
      "the batch dump was written");
}

// The MLM loss on --eval-batches micro-batches of held-out windows, without
// dropout: the mean over all their selected positions, summed micro-batch by
// micro-batch in order. The windows and masks are keyed by a step number no
// training step has (-1), so every evaluation reads the same batch. Every
// rank computes it whole from the full working weights (every stage holds
// them), so the value does not depend on N or the stage.
template <class Act>
float Training<Act>::evaluate() const {
  const int B = settings_.micro_batch, T = settings_.seq, E = settings_.eval_batches;
  const long key = -1;
  const long selected = global_selected_count(held_out_, settings_.seed, key, E, B, T);
  const float loss_scale = 1.0f / (float)std::max(1l, selected);
  model_->set_evaluation(true);
  float loss = 0.0f;
  for (int m = 0; m < E; ++m)
    loss += model_->run(make_batch(held_out_, settings_.seed, key, m, B, T), key, m, loss_scale, false);
  model_->set_evaluation(false);
  return loss;
}

template <class Act>
void Training<Act>::log_evaluation(long step) {
  const float loss = evaluate();
  evaluations_.push_back({{"step", step}, {"loss", loss}, {"loss_bits", hex32(loss)}});
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - training_start_).count();
  if (!settings_.metrics.empty())
    agree_on_errors(
        world_,
        [&] {
          if (metrics_) metrics_->append({{"step", step}, {"eval_loss", loss}, {"elapsed_s", elapsed}});
        },
        "the --metrics line was written");
  if (prints_progress_) {
    printf("  eval      step %ld: loss %.4f on %d held-out micro-batch(es) of %d\n", step, loss, settings_.eval_batches,
           settings_.micro_batch);
    fflush(stdout);
  }
}

template <class Act>
void Training<Act>::log_progress(const z2::StepReport& report, double ms) {
  if (!report.skipped) loss_since_log_ += report.loss, ++losses_since_log_;
  // An overflow gets its own line, every time (DeepSpeed logs each one too).
  if (report.skipped) {
    if (prints_progress_)
      printf("step %5ld/%ld | fp16 gradients overflowed at loss scale %s: step skipped (%ld so far); scale now %s%s\n",
             report.step, settings_.steps, scale_text(report.loss_scale).c_str(), engine_->skipped_steps(),
             scale_text(engine_->loss_scaler().scale()).c_str(),
             engine_->loss_scaler().scale() == report.loss_scale && engine_->loss_scaler().dynamic() ? " (hysteresis)"
                                                                                                     : "");
    return;
  }
  if (report.step != 1 && report.step % settings_.log_every != 0 && report.step != settings_.steps &&
      records_.size() != 1)
    return;
  // Elapsed since this run's first step; the ETA from this run's mean step.
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - training_start_).count();
  const long done = (long)records_.size(), left = settings_.steps - report.step;
  const double eta = done > 0 ? elapsed / (double)done * (double)left : 0.0;
  const double mean_loss = loss_since_log_ / (double)std::max(1l, losses_since_log_);
  const z2::MemoryCounters& memory = compute_->memory();
  // Every rank logs the same steps, so all can agree on rank 0's write (a
  // full disk ends every rank, not only the writer).
  if (!settings_.metrics.empty())
    agree_on_errors(
        world_,
        [&] {
          if (metrics_)
            metrics_->append({{"step", report.step},
                              {"loss", report.loss},
                              {"loss_mean", mean_loss},
                              {"losses_in_mean", losses_since_log_},
                              {"grad_norm", report.grad_norm},
                              {"lr", report.lr},
                              {"loss_scale", report.loss_scale},
                              {"skipped_so_far", engine_->skipped_steps()},
                              {"tokens_per_s", records_.back().tokens_per_s},
                              {"step_ms", ms},
                              {"elapsed_s", elapsed},
                              {"eta_s", eta},
                              {"memory_mib", memory.total_current / 1048576.0}});
        },
        "the --metrics line was written");
  loss_since_log_ = 0, losses_since_log_ = 0;
  if (!prints_progress_) return;
  char scale[48] = "";
  if (precision_ == z2::Precision::fp16)
    snprintf(scale, sizeof scale, " | scale %s", scale_text(report.loss_scale).c_str());
  printf("step %5ld/%ld | loss %.4f | grad norm %8.4f | lr %.2e%s | %9s tok/s | %8.1f ms | %s %.1f MiB | %s, ETA %s\n",
         report.step, settings_.steps, report.loss, report.grad_norm, report.lr, scale,
         z2::with_commas((size_t)std::llround(records_.back().tokens_per_s)).c_str(), ms,
         device_ == z2::Device::cuda ? "device" : "memory", memory.total_current / 1048576.0,
         clock_text(elapsed).c_str(), clock_text(eta).c_str());
  if (settings_.wall_clock_breakdown) {  // DeepSpeed's breakdown: this step's phases, over its A micro-steps
    const StepRecord& r = records_.back();
    printf(
        "  time (ms) | forward %.2f | backward %.2f | step %.2f | other %.2f (communication overlaps backward "
        "and the step)\n",
        r.forward_ms, r.backward_ms, r.optimizer_ms,
        std::max(0.0, r.ms - r.forward_ms - r.backward_ms - r.optimizer_ms));
  }
  fflush(stdout);
}

template <class Act>
int Training<Act>::run() {
  if (prints_progress_) print_header();
  // Rank 0 writes; every rank learns whether it could (or it would wait in
  // the first step's collectives for a rank that left).
  if (!settings_.metrics.empty())
    agree_on_errors(
        world_,
        [&] {
          if (rank_ == 0)
            metrics_ = std::make_unique<MetricsStream>(settings_.metrics, settings_.checkpoint_directory,
                                                       engine_->training_progress().steps_taken);
        },
        "the --metrics file was made");
  training_start_ = std::chrono::steady_clock::now();
  catch_interrupts();
  const long first_step = engine_->training_progress().steps_taken;
  const long last_step = settings_.export_only ? first_step : settings_.steps;
  for (long step = first_step; step < last_step; ++step) {
    train_step(step);
    // A signal on any rank stops every rank after the same step.
    int mine = (int)interrupt_signal, signal = 0;
    z2::watched_allreduce(&mine, &signal, 1, MPI_INT, MPI_MAX, world_, "the ranks agreeing whether to stop (a signal)");
    const long done = step + 1;
    if (settings_.eval_every > 0 && (done % settings_.eval_every == 0 || done == last_step)) log_evaluation(done);
    if (!settings_.save_dir.empty() && settings_.save_every > 0 && done % settings_.save_every == 0) save_checkpoint();
    if (signal != 0) {
      interrupted_by_ = signal;
      break;
    }
  }
  // At the end (or the interrupt), unless that step was just saved. A run
  // that trained nothing saves too: --load at one N, --save at another
  // re-slices a checkpoint without a step.
  const long now = engine_->training_progress().steps_taken;
  if (!settings_.save_dir.empty() && (saved_.empty() || saved_.back()["step"].get<long>() != now)) save_checkpoint();
  z2::set_watchdog_context("the end of the run, after step " +
                           std::to_string(engine_->training_progress().steps_taken));
  // The fp32 master weights (collective: sharded in mixed precision stages 1, 2).
  const std::vector<float> final_parameters = engine_->parameters_to_host();
  char hash[24];
  snprintf(hash, sizeof hash, "%016llx",
           (unsigned long long)z2::fnv1a64(final_parameters.data(), final_parameters.size()));
  // The export is the trained model: an interrupted run has a checkpoint instead (--save).
  agree_on_errors(
      world_,
      [&] {
        if (rank_ == 0 && !settings_.export_dir.empty() && interrupted_by_ == 0)
          export_hf(settings_.export_dir, *model_, *engine_, final_parameters);
      },
      "the export was written");
  if (prints_progress_) print_summary(final_parameters, hash);
  agree_on_errors(
      world_, [&] { write_json(hash); }, "the JSON summary was written");
  // Every rank reaches here before any finalizes: a rank stopped now would
  // otherwise leave the others in MPI_Finalize, where no watchdog runs.
  MPI_Request finished;
  Z2_MPI_CHECK(MPI_Ibarrier(world_, &finished));
  z2::wait_request(&finished, "the end of the run (every rank finishing)");
  return interrupted_by_ != 0 ? 128 + interrupted_by_ : 0;
}

template <class Act>
void Training<Act>::print_summary(const std::vector<float>& final_parameters, const std::string& hash) const {
  printf("\nsummary\n");
  if (interrupted_by_ != 0)
    printf("  %-24s by %s after step %ld (of %ld)\n", "interrupted", signal_name(interrupted_by_),
           engine_->training_progress().steps_taken, settings_.steps);
  if (!records_.empty()) {
    std::vector<double> times;
    for (auto& r : records_) times.push_back(r.ms);
    std::sort(times.begin(), times.end());
    const double median_ms = times[times.size() / 2];
    printf("  %-24s %s -> %s (%s)\n", "loss", std::to_string(records_.front().loss).c_str(),
           std::to_string(records_.back().loss).c_str(),
           records_.back().loss < records_.front().loss ? "falling" : "NOT falling");
    printf("  %-24s %s\n", "last loss bits", hex32(records_.back().loss).c_str());
    printf("  %-24s %.1f ms\n", "median step", median_ms);
    printf("  %-24s %s\n", "tokens/s (median step)",
           z2::with_commas((size_t)std::llround(tokens_per_step_ / (median_ms / 1000.0))).c_str());
  } else {
    printf("  %-24s none (the run starts at step %ld of %ld)\n", "steps trained",
           engine_->training_progress().steps_taken, settings_.steps);
  }
  printf("  %-24s %s%s\n", "final params hash", hash.c_str(),
         precision_ == z2::Precision::fp32 ? "" : " (of the fp32 master weights)");
  if (precision_ == z2::Precision::fp16)
    printf("  %-24s %s, %ld step(s) skipped on overflow\n", "loss scale (final)",
           scale_text(engine_->loss_scaler().scale()).c_str(), engine_->skipped_steps());
  for (const json& save : saved_)
    printf("  %-24s %s/ (%s bytes in %zu files, %.2f s)\n", "saved", save["directory"].get<std::string>().c_str(),
           z2::with_commas(save["bytes"].get<size_t>()).c_str(), (size_t)world_size_, save["seconds"].get<double>());
  if (!settings_.export_dir.empty() && interrupted_by_ == 0)
    printf("  %-24s %s/\n", "exported (HF layout)", settings_.export_dir.c_str());
  if (!settings_.dump_dir.empty()) printf("  %-24s %s/\n", "step-0 dump", settings_.dump_dir.c_str());
  (void)final_parameters;
  engine_->print_ledgers(stdout);
  fflush(stdout);
}

template <class Act>
void Training<Act>::write_json(const std::string& hash) const {
  if (rank_ != 0 || settings_.json_path.empty()) return;
  json summary = json::parse(engine_->ledgers_json());
  json out = {
      {"world_size", world_size_},
      {"device", z2::to_string(device_)},
      {"comm", z2::to_string(comm_backend_)},
      {"collectives", settings_.collectives},
      {"stage", settings_.stage},
      {"precision", settings_.precision},
      {"portable", settings_.portable},
      {"grad_accum_dtype", settings_.grad_accum_dtype},
      {"loss_scale", engine_->loss_scaler().scale()},
      {"skipped_steps", engine_->skipped_steps()},
      {"activations", settings_.activations},
      {"alloc", settings_.alloc},
      {"device_memory_limit", settings_.device_memory_limit},
      {"activation_peak_formula_bytes", activation_peak_bytes(shape_, mode_, allocator_ == z2::Allocator::arena)},
      {"offload_activation_bound_bytes", offload_activation_bound(shape_)},
      {"accum", settings_.accum},
      {"micro_batch", settings_.micro_batch},
      {"seq", settings_.seq},
      {"overlap", settings_.overlap},
      {"bucket", settings_.bucket},
      {"params", engine_->psi()},
      {"params_padded", engine_->psi_padded()},
      {"tokens_per_step", tokens_per_step_},
      {"steps_total", settings_.steps},
      {"schedule",
       {{"lr", settings_.lr},
        {"warmup", settings_.warmup},
        {"warmup_type", settings_.warmup_type},
        {"warmup_min_lr", settings_.warmup_min_lr},
        {"decay", settings_.decay},
        {"schedule_steps", settings_.schedule_steps}}},
      {"optimizer",
       {{"betas", {settings_.beta1, settings_.beta2}},
        {"eps", settings_.eps},
        {"weight_decay", settings_.weight_decay},
        {"clip", settings_.clip},
        {"bias_correction", settings_.bias_correction}}},
      {"interrupted", interrupted_by_ != 0 ? json(signal_name(interrupted_by_)) : json(nullptr)}};
  json steps = json::array();
  for (auto& r : records_) {
    steps.push_back({{"step", r.step},
                     {"loss", r.loss},
                     {"loss_bits", hex32(r.loss)},
                     {"grad_norm", r.grad_norm},
                     {"lr", r.lr},
                     {"ms", r.ms},
                     {"tokens_per_s", r.tokens_per_s},
                     {"loss_scale", r.loss_scale},
                     {"skipped", r.skipped}});
    if (settings_.wall_clock_breakdown) {
      steps.back()["forward_ms"] = r.forward_ms;
      steps.back()["backward_ms"] = r.backward_ms;
      steps.back()["optimizer_ms"] = r.optimizer_ms;
    }
  }
  out["steps"] = steps;
  out["final_params_hash"] = hash;
  out["memory"] = summary["memory"];
  out["comm"] = summary["comm"];
  out["checkpoint"] = {
      {"loaded", loaded_}, {"saved", saved_}, {"allow_different_bits", settings_.allow_different_bits}};
  out["eval"] = evaluations_;
  out["held_out_bytes"] = held_out_.size();
  if (!records_.empty()) {
    std::vector<double> times;
    for (auto& r : records_) times.push_back(r.ms);
    std::sort(times.begin(), times.end());
    const double median_ms = times[times.size() / 2];
    // The sgemm share: the median over steps of (time in sgemm) / (step time).
    std::vector<double> gemm_shares;
    for (auto& r : records_) gemm_shares.push_back(r.gemm_ms / r.ms);
    std::sort(gemm_shares.begin(), gemm_shares.end());
    out["time"] = {{"step_ms_median", median_ms},
                   {"tokens_per_s_median", tokens_per_step_ / (median_ms / 1000.0)},
                   {"gemm_share_median", gemm_shares[gemm_shares.size() / 2]}};
  }
  write_output_file(settings_.json_path, out.dump(2) + "\n");
}

// The run in the precision the settings name: the model, its activations and
// the engine's working copy in float, bfloat16 or float16.
// --- --plan: the table, the largest sizes, the JSON ---------------------------------

// The largest value in [1, cap] for which fits() holds, fits() being monotone
// (every category grows with the micro-batch and the layers); 0 if none.
inline long largest_fitting(long cap, const std::function<bool(long)>& fits) {
  if (!fits(1)) return 0;
  long good = 1, bad = cap + 1;
  for (long probe = 2; probe <= cap && bad == cap + 1; probe *= 2) (fits(probe) ? good : bad) = probe;
  if (bad == cap + 1 && fits(cap)) return cap;
  while (bad - good > 1) {
    const long middle = good + (bad - good) / 2;
    (fits(middle) ? good : bad) = middle;
  }
  return good;
}

// Model states by the formula, from Psi_padded as the run's ledger computes it
// (exact in double: Psi_padded is a multiple of N).
inline size_t formula_bytes(const RankPlan& p, z2::Precision precision) {
  return (size_t)z2::model_states_formula(p.stage, precision, (double)p.engine.psi_padded, p.world_size);
}

inline json plan_row_json(const RankPlan& p, z2::Precision precision) {
  return {{"stage", p.stage},
          {"world_size", p.world_size},
          {"psi_padded", p.engine.psi_padded},
          {"params_bytes", p.engine.params},
          {"grads_bytes", p.engine.grads},
          {"master_bytes", p.engine.master},
          {"optimizer_bytes", 2 * p.engine.moment},
          {"accumulation_bytes", p.engine.accumulation_blocks * p.engine.accumulation_block},
          {"staging_bytes", p.engine.staging},
          {"activation_peak_bytes", p.activation_peak},
          {"bookkeeping_bytes", p.engine.chunk_sums + p.engine.decay_flags},
          {"model_states_bytes", p.engine.model_states()},
          {"device_peak_bytes", p.live()},
          {"arena_block_bytes", p.arena_block()},
          {"model_states_formula_bytes", formula_bytes(p, precision)}};
}

// The settings at world size N: DeepSpeed's batch rule (train_batch_size ->
// accumulation) and the masked-positions check depend on N, so each N of
// the plan is checked as a run at that N would be. Empty `why`: valid.
struct PlannedWorld {
  int world_size;
  Settings settings;
  std::string why;
};
inline std::vector<PlannedWorld> planned_worlds(const Settings& settings, const std::vector<int>& sizes) {
  std::vector<PlannedWorld> worlds;
  for (int n : sizes) {
    PlannedWorld world{n, settings, ""};
    try {
      check_consistency(world.settings, n);
    } catch (const z2::Error& error) { world.why = error.what(); }
    worlds.push_back(world);
  }
  return worlds;
}

// The table of one stage, rows by N, into `text` and `rows`.
inline void plan_stage_table(int stage, const std::vector<PlannedWorld>& worlds, z2::Precision precision,
                             std::string& text, json& rows) {
  char line[1024];
  snprintf(line, sizeof line, "\nstage %d (%s; model states by the formula %s%s)\n\n", stage,
           stage == 0   ? "DP"
           : stage == 1 ? "P_os"
                        : "P_os+g",
           z2::model_states_formula_text(stage, precision),
           precision == z2::Precision::fp32 ? " in fp32" : ", the paper's K = 12");
  text += line;
  text +=
      "| N | params | grads | master | m, v | accumulation | staging | activations | bookkeeping | device peak | "
      "arena block | model states by the formula |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  auto c = [](size_t v) { return z2::with_commas(v); };
  for (const PlannedWorld& world : worlds) {
    if (!world.why.empty()) {
      text += "| " + std::to_string(world.world_size) + " | not a valid run at this N: " + world.why + " |||||||||||\n";
      rows.push_back({{"stage", stage}, {"world_size", world.world_size}, {"refused", world.why}});
      continue;
    }
    const RankPlan p = plan_rank(world.settings, stage, world.world_size);
    rows.push_back(plan_row_json(p, precision));
    snprintf(line, sizeof line, "| %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", world.world_size,
             c(p.engine.params).c_str(), c(p.engine.grads).c_str(), c(p.engine.master).c_str(),
             c(2 * p.engine.moment).c_str(), c(p.engine.accumulation_blocks * p.engine.accumulation_block).c_str(),
             c(p.engine.staging).c_str(), c(p.activation_peak).c_str(),
             c(p.engine.chunk_sums + p.engine.decay_flags).c_str(), c(p.live()).c_str(), c(p.arena_block()).c_str(),
             c(formula_bytes(p, precision)).c_str());
    text += line;
  }
}

// The largest micro-batch (with --layers as given) and the largest layer
// count (with --micro-batch as given) whose arena block fits `limit`.
inline void plan_largest(const std::vector<PlannedWorld>& worlds, long limit, std::string& text, json& largest) {
  const Settings& base = worlds.front().settings;
  const long batch_cap =
      std::min<long>(1 << 20, (long)(1.5e9 / ((double)base.seq * std::max(base.hidden, base.intermediate))));
  const long layer_cap = 256;  // the flags' own limits
  char line[512];
  snprintf(line, sizeof line,
           "\nthe largest that fits in --device-memory-limit %s (its arena block; 0: not even 1 fits)\n"
           "micro-batch: with --layers %d as given; layers: with --micro-batch %d as given\n\n"
           "| stage | N | micro-batch | layers |\n|---|---|---|---|\n",
           z2::with_commas((size_t)limit).c_str(), base.layers, base.micro_batch);
  text += line;
  size_t smallest = SIZE_MAX;
  int smallest_stage = 0, smallest_n = 1;
  for (int stage = 0; stage <= 2; ++stage)
    for (const PlannedWorld& world : worlds) {
      if (!world.why.empty()) continue;
      auto fits = [&](int micro_batch, int layers) {
        Settings trial = world.settings;
        trial.micro_batch = micro_batch, trial.layers = layers;
        return plan_rank(trial, stage, world.world_size).arena_block() <= (size_t)limit;
      };
      const long batch = largest_fitting(batch_cap, [&](long b) { return fits((int)b, world.settings.layers); });
      const long layers = largest_fitting(layer_cap, [&](long l) { return fits(world.settings.micro_batch, (int)l); });
      Settings one = world.settings;
      one.micro_batch = 1, one.layers = 1;
      const size_t floor = plan_rank(one, stage, world.world_size).arena_block();
      if (floor < smallest) smallest = floor, smallest_stage = stage, smallest_n = world.world_size;
      largest.push_back({{"stage", stage},
                         {"world_size", world.world_size},
                         {"micro_batch", batch},
                         {"layers", layers},
                         {"micro_batch_cap", batch_cap},
                         {"layers_cap", layer_cap}});
      snprintf(line, sizeof line, "| %d | %d | %ld%s | %ld%s |\n", stage, world.world_size, batch,
               batch == batch_cap ? " (the flag's limit)" : "", layers,
               layers == layer_cap ? " (the flag's limit)" : "");
      text += line;
    }
  if (smallest > (size_t)limit)
    fail(
        "--device-memory-limit %s holds nothing: the smallest of the plan (stage %d, N = %d, micro-batch 1, 1 layer, "
        "the other flags as given) needs a %s-byte arena block",
        z2::with_commas((size_t)limit).c_str(), smallest_stage, smallest_n, z2::with_commas(smallest).c_str());
}

inline int run_plan(Settings settings, MPI_Comm world) {
  int rank = 0;
  MPI_Comm_rank(world, &rank);
  if (settings.quiet && settings.json_path.empty())
    fail("--plan --quiet would print nothing: give --json FILE for the plan, or drop --quiet");
  agree_on_errors(world, [&] {
    if (rank == 0) check_outputs(settings);
  });
  std::vector<int> sizes = settings.plan_world_sizes;
  if (sizes.empty())
    for (int n = 1; n <= 1024; n *= 2) sizes.push_back(n);
  std::vector<PlannedWorld> worlds = planned_worlds(settings, sizes);
  std::vector<PlannedWorld> valid;
  for (auto& w : worlds)
    if (w.why.empty()) valid.push_back(w);
  if (valid.empty()) throw z2::Error(worlds.front().why + (sizes.size() > 1 ? " (at every N of the plan)" : ""));
  const z2::Precision precision = precision_of(settings);
  const Settings& shown = valid.front().settings;
  const RankPlan first = plan_rank(shown, 0, 1);
  std::string text;
  char line[1024];
  snprintf(line, sizeof line,
           "memory plan per rank in bytes (--plan: nothing trained, nothing allocated)\n"
           "BERT-mini L %d, H %d, %d heads, F %d, micro-batch %d x %d tokens, %s, --activations %s, --alloc %s, "
           "A = %d, bucket %ld, overlap %s.\n"
           "Psi = %s parameters. Every column is what the run allocates (notes/10); device peak = their sum (live "
           "bytes);\narena block = the smallest --device-memory-limit that trains with --alloc arena (each buffer "
           "rounded to 256).\n",
           shown.layers, shown.hidden, shown.heads, shown.intermediate, shown.micro_batch, shown.seq,
           z2::to_string(precision), shown.activations.c_str(), shown.alloc.c_str(), shown.accum, shown.bucket,
           shown.overlap ? "on" : "off", z2::with_commas(first.psi).c_str());
  text += line;
  if (settings.alloc != "arena")
    text += "With --alloc " + settings.alloc +
            " the device peak is a lower bound: where its holes fall adds to it "
            "(make fraglab measures how much).\n";
  if (settings.given.count("--stage")) text += "(--stage is not used: the plan covers stages 0, 1 and 2.)\n";
  json rows = json::array(), largest = json::array();
  for (int stage = 0; stage <= 2; ++stage) plan_stage_table(stage, worlds, precision, text, rows);
  if (settings.device_memory_limit > 0) plan_largest(valid, settings.device_memory_limit / 256 * 256, text, largest);
  if (rank == 0 && !settings.quiet) fputs(text.c_str(), stdout);
  if (!settings.json_path.empty()) {
    json out = {{"plan", rows},
                {"largest", largest},
                {"params", first.psi},
                {"precision", z2::to_string(precision)},
                {"activations", shown.activations},
                {"alloc", shown.alloc},
                {"micro_batch", shown.micro_batch},
                {"layers", shown.layers},
                {"hidden", shown.hidden},
                {"heads", shown.heads},
                {"intermediate", shown.intermediate},
                {"seq", shown.seq},
                {"bucket", shown.bucket},
                {"overlap", shown.overlap},
                {"accum_given", settings.accum},
                {"device_memory_limit", settings.device_memory_limit}};
    agree_on_errors(
        world,
        [&] {
          if (rank == 0) write_output_file(settings.json_path, out.dump(1) + "\n");
        },
        "the plan was written");
  }
  fflush(stdout);
  return 0;
}

inline int train(Settings settings, MPI_Comm world) {
  if (settings.plan) return run_plan(settings, world);
  switch (precision_of(settings)) {
    case z2::Precision::bf16: return Training<z2::bfloat16>(settings, world).run();
    case z2::Precision::fp16: return Training<z2::float16>(settings, world).run();
    default: return Training<float>(settings, world).run();
  }
}

}  // namespace bert

#ifndef BERT_NO_MAIN
// Every rank runs the same code on the same arguments, so a bad setting
// throws on every rank at the same point; rank 0 prints the one message, all
// ranks finalize MPI and exit 2. Failures inside a library call (CUDA, NCCL,
// MPI) abort every rank from the check macros instead.
int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int status = 0;
  try {
    bool help = false;
    for (int i = 1; i < argc; ++i) help = help || std::string(argv[i]) == "--help" || std::string(argv[i]) == "-h";
    if (help) {
      if (rank == 0) fputs(bert::usage_text, stdout);
    } else {
      // Every rank reads its own --config (on several hosts, its own copy):
      // a failure on any rank is agreed on, so no rank waits for one that left.
      bert::Settings settings;
      bert::agree_on_errors(
          MPI_COMM_WORLD,
          [&] {
            settings = bert::parse_command_line(argc, argv);
            int world_size = 1;
            MPI_Comm_size(MPI_COMM_WORLD, &world_size);
            if (!settings.load_dir.empty())
              bert::adopt_checkpoint(settings, world_size);  // before the precision is chosen
          },
          "the command line was read");
      status = bert::train(settings, MPI_COMM_WORLD);
    }
  } catch (const z2::Error& error) {
    if (rank == 0) fprintf(stderr, "train_bert_mini: error: %s\n", error.what());
    status = 2;
  } catch (const std::exception& error) {
    if (rank == 0) fprintf(stderr, "train_bert_mini: error: %s\n", error.what());
    status = 2;
  }
  MPI_Finalize();
  return status;
}
#endif
