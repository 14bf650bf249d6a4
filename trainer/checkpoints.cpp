// trainer/checkpoints.cpp — checkpoint files (trainer/checkpoints.h).
#include "trainer/checkpoints.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <random>
#include <utility>
#include <vector>

#include "trainer/hf_export.h"
#include "trainer/inputs.h"
#include "trainer/json.h"
#include "trainer/safetensors.h"

namespace bert {

// What a --save directory holds (notes/09):
//   DIR/step_<s>/rank_<q>.safetensors  master, exp_avg, exp_avg_sq: [end - begin] float32 each, the
//                                      canonical range [begin, end) = [q Psi / N, (q + 1) Psi / N)
//                                      of the N ranks that saved it (rank q writes its own file)
//   DIR/step_<s>/index.json            the settings a resumed run must share, the progress (steps,
//                                      AdamW's t, skips, the loss scaler), the parameters, and each
//                                      file's range, size and SHA-256; the run's identity (run_id);
//                                      when it was saved (save_sequence: the order of saves into DIR)
//   DIR/step_<s>/index.sha256          index.json's own SHA-256 (sha256sum's format)
//   DIR/latest                         "step_<s>": the newest complete step, moved last
// The canonical order (registration order, real elements only) does not
// depend on N, the stage or the bucket size, so a checkpoint loads at any of
// them: each rank reads the pieces of the files that overlap the runs it
// owns (Engine::owned_state_runs), and no rank reads the whole state. The
// 16-bit working weights are not stored: they are the master rounded.

// --- the loaded index ---------------------------------------------------------

// --load's index.json, parsed once (adopt_checkpoint) and read by every
// function below. Settings holds it behind a pointer, so that the files
// that include the settings (the model's among them) do without the JSON
// library.
struct CheckpointIndex {
  json index;
};
static const json& index_of(const Settings& s) { return s.checkpoint->index; }

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
static std::string index_digest_line(const std::string& index_text) {
  return sha256_hex(index_text) + "  index.json\n";
}

// A run's identity: 128 random bits, made by a fresh run and carried on by
// every run resumed from its checkpoints (each index records it). Pruning
// deletes only steps that record this run's identity.
static std::string new_run_id() {
  std::random_device random;
  char text[40];
  snprintf(text, sizeof text, "%08x%08x%08x%08x", (unsigned)random(), (unsigned)random(), (unsigned)random(),
           (unsigned)random());
  return text;
}
static bool is_run_id(const json& value) {
  return value.is_string() && value.get<std::string>().size() == 32 &&
         value.get<std::string>().find_first_not_of("0123456789abcdef") == std::string::npos;
}

static std::string step_directory_name(long step) { return "step_" + std::to_string(step); }
// Where the ranks write a step before it is complete (a dot: not a step).
static std::string incomplete_step_directory(const std::string& save_dir, long step) {
  return save_dir + "/." + step_directory_name(step) + ".incomplete";
}

// A step's files that vanish under the save (ENOENT) mean that another
// process works in the directory: the message names that as the likely cause.
static const char* vanished_hint(int error) {
  return error == ENOENT ? " (a file of the checkpoint vanished: another run saving into the same directory at the "
                           "same time is the likely cause; give each run its own --save)"
                         : "";
}
// The same for every failure of a save's body that says ENOENT.
static void naming_a_vanished_file(const std::function<void()>& body) {
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
static void publish_step(const std::string& written, const std::string& directory) {
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
static std::string rank_file_name(int rank) {
  char name[48];
  snprintf(name, sizeof name, "rank_%05d.safetensors", rank);
  return name;
}
// The canonical range the file of rank `rank` of `ranks` covers.
static std::pair<size_t, size_t> file_range(size_t psi, int rank, int ranks) {
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
    // Whose rates (the trainer's, DeepSpeed's scheduler, or none), first of
    // the schedule's settings, so that a contradiction names it before its
    // consequences. A checkpoint written before it was recorded has the
    // trainer's (adopt_checkpoint).
    {"schedule_convention", "schedule_convention",
     "the learning-rate schedule (the trainer's own, DeepSpeed's scheduler, or the optimizer's rate alone)"},
    // Which of DeepSpeed's schedulers, before its params (a checkpoint from
    // before these were recorded had WarmupLR or WarmupDecayLR: "warmup",
    // and the others at their defaults, adopt_checkpoint).
    {"scheduler", "scheduler", "the learning-rate schedule (DeepSpeed's scheduler type)"},
    {"lr", "--lr", "the learning-rate schedule"},
    {"warmup", "--warmup", "the learning-rate schedule"},
    {"schedule_steps", "--schedule-steps", "the learning-rate schedule (its decay ends there; --steps may change)"},
    {"warmup_type", "--warmup-type", "the learning-rate schedule"},
    {"decay", "--decay", "the learning-rate schedule"},
    {"warmup_min_lr", "warmup_min_lr", "the learning-rate schedule"},
    {"warmup_min_ratio", "warmup_min_ratio", "the learning-rate schedule (WarmupCosineLR)"},
    {"cos_min_ratio", "cos_min_ratio", "the learning-rate schedule (WarmupCosineLR)"},
    {"cycle_min_lr", "cycle_min_lr", "the learning-rate schedule (OneCycle)"},
    {"cycle_max_lr", "cycle_max_lr", "the learning-rate schedule (OneCycle)"},
    {"decay_lr_rate", "decay_lr_rate", "the learning-rate schedule (OneCycle)"},
    {"cycle_first_step_size", "cycle_first_step_size", "the learning-rate schedule (OneCycle)"},
    {"cycle_second_step_size", "cycle_second_step_size", "the learning-rate schedule (OneCycle)"},
    {"cycle_first_stair_count", "cycle_first_stair_count", "nothing (OneCycle never reads it), but it is recorded"},
    {"cycle_second_stair_count", "cycle_second_stair_count", "nothing (OneCycle never reads it), but it is recorded"},
    {"decay_step_size", "decay_step_size", "the learning-rate schedule (OneCycle)"},
    {"cycle_momentum", "cycle_momentum", "the optimizer's beta1 (OneCycle cycles it)"},
    {"cycle_min_mom", "cycle_min_mom", "the optimizer's beta1 (OneCycle)"},
    {"cycle_max_mom", "cycle_max_mom", "the optimizer's beta1 (OneCycle)"},
    {"decay_mom_rate", "decay_mom_rate", "the optimizer's beta1 (OneCycle)"},
    {"lr_range_test_min_lr", "lr_range_test_min_lr", "the learning-rate schedule (LRRangeTest)"},
    {"lr_range_test_step_size", "lr_range_test_step_size", "the learning-rate schedule (LRRangeTest)"},
    {"lr_range_test_step_rate", "lr_range_test_step_rate", "the learning-rate schedule (LRRangeTest)"},
    {"lr_range_test_staircase", "lr_range_test_staircase", "the learning-rate schedule (LRRangeTest)"},
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

static json recorded_values(const Settings& s) {
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
          {"schedule_convention", s.schedule_convention},
          {"scheduler", s.scheduler},
          {"warmup_min_ratio", s.warmup_min_ratio},
          {"cos_min_ratio", s.cos_min_ratio},
          {"cycle_min_lr", s.cycle_min_lr},
          {"cycle_max_lr", s.cycle_max_lr},
          {"decay_lr_rate", s.decay_lr_rate},
          {"cycle_first_step_size", s.cycle_first_step_size},
          // -1: None (the first's), recorded as the text the flag parser reads for it
          {"cycle_second_step_size", s.cycle_second_step_size < 0 ? json("none") : json(s.cycle_second_step_size)},
          {"cycle_first_stair_count", s.cycle_first_stair_count},
          {"cycle_second_stair_count",
           s.cycle_second_stair_count < 0 ? json("none") : json(s.cycle_second_stair_count)},
          {"decay_step_size", s.decay_step_size},
          {"cycle_momentum", s.cycle_momentum},
          {"cycle_min_mom", s.cycle_min_mom},
          {"cycle_max_mom", s.cycle_max_mom},
          {"decay_mom_rate", s.decay_mom_rate},
          {"lr_range_test_min_lr", s.lr_range_test_min_lr},
          {"lr_range_test_step_size", s.lr_range_test_step_size},
          {"lr_range_test_step_rate", s.lr_range_test_step_rate},
          {"lr_range_test_staircase", s.lr_range_test_staircase},
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
          {"portable", s.portable},
          {"offload_optimizer", s.offload_optimizer}};
}

// A field of index.json, or one message naming it and the file. `shown`
// is the field's full name in messages when `index` is part of the file
// ("files.2" for the third file entry).
static const json& index_field(const json& index, const std::string& path, const std::string& file,
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
static long index_integer(const json& index, const std::string& path, const std::string& file, long low, long high,
                          const std::string& shown = "") {
  const json& value = index_field(index, path, file, shown);
  if (!value.is_number_integer() || value.get<long>() < low || value.get<long>() > high)
    fail("the checkpoint index '%s': '%s' = %s is not an integer from %ld to %ld", file.c_str(),
         (shown.empty() ? path : shown + "." + path).c_str(), json_text(value).c_str(), low, high);
  return value.get<long>();
}
static std::string index_string(const json& index, const std::string& path, const std::string& file,
                                const std::string& shown = "") {
  const json& value = index_field(index, path, file, shown);
  if (!value.is_string())
    fail("the checkpoint index '%s': '%s' = %s is not a string", file.c_str(),
         (shown.empty() ? path : shown + "." + path).c_str(), json_text(value).c_str());
  return value.get<std::string>();
}

// --- finding and reading one ---------------------------------------------------

// --load DIR: DIR itself when it holds an index.json (DIR/step_<s>), else
// the step DIR/latest names, or the step saved after it when a save was
// stopped before it wrote latest (step_saved_after_latest); `found` then
// says so, for the header.
// Paths are looked at with stat and lstat (stat_hint, path_is_there:
// trainer/inputs.h), so a symlink loop or a dangling link gets a sentence.
// Defined with what a --save directory holds, below.
static std::string step_saved_after_latest(const std::string& directory, const std::string& latest_name,
                                           std::string& found);
static std::string checkpoint_step_directory(const std::string& directory, std::string& found) {
  struct stat info;
  if (stat(directory.c_str(), &info) != 0) {
    const int error = errno;
    if (!path_is_there(directory)) fail("--load '%s' does not exist", directory.c_str());
    fail("--load '%s' cannot be read: %s%s", directory.c_str(), std::strerror(error), stat_hint(error));
  }
  if (!S_ISDIR(info.st_mode)) fail("--load '%s' is not a directory", directory.c_str());
  if (path_is_there(directory + "/index.json")) return directory;  // reading it names what is wrong with it
  const std::string latest = directory + "/latest";
  if (!path_is_there(latest)) {
    const std::string newest = step_saved_after_latest(directory, "", found);
    if (newest.empty())
      fail(
          "--load '%s' has neither index.json (a step's directory) nor latest nor a complete step_<s> (a checkpoint "
          "directory)",
          directory.c_str());
    return newest;
  }
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
  const std::string newer = step_saved_after_latest(directory, name, found);
  return newer.empty() ? step : newer;
}

// An index's text parsed, or null when it is not JSON (the callers say why).
static json parsed_or_null(const std::string& text) {
  try {
    return parse_json(text);
  } catch (const json::exception&) { return json(); }
}
static bool is_zero2_index(const json& index) {
  return index.is_object() && index.contains("format") && index["format"] == "zero2 checkpoint";
}

// A step's index.json, checked against its index.sha256 before anything in
// it is believed: a changed setting, progress field, parameter or file
// entry is damage, whatever it is.
static std::string verified_index_text(const std::string& step_directory) {
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

static json read_checkpoint_index(const std::string& step_directory) {
  const std::string file = step_directory + "/index.json";
  const std::string text = verified_index_text(step_directory);
  json index;
  try {
    index = parse_json(text);
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
    fail("the checkpoint index '%s': 'run_id' = %s is not 32 hex digits", file.c_str(),
         json_text(index["run_id"]).c_str());
  return index;
}

// Whether the interleaved split (N, A) sums a step's N x A micro-batches
// in the canonical tree (notes/06, "The global batch, split two ways"):
// when N is a power of two (each micro-step's N leaves are then an aligned
// subtree) or A = 1 (nothing is accumulated). Two splits give the same
// bits when both do, or when they are the same split.
static bool canonical_split(long world, long accum) { return (world & (world - 1)) == 0 || accum == 1; }
// The splits of N x A micro-batches that keep the bits of a run at (N, A).
static std::string splits_keeping_bits(long world, long accum) {
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
static void check_summation_tree(Settings& s, int world_size, long saved_world, long saved_accum) {
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
static void adopt_checkpoint_batch(Settings& s, int world_size, const std::string& file) {
  const long most = 1l << 20;  // --accum's own bound
  const long saved_world = index_integer(index_of(s), "world_size", file, 1, INT_MAX);
  const long saved_accum = index_integer(index_of(s), "accum", file, 1, most);
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

// A schedule convention (Settings::schedule_convention) in words, for messages.
static std::string schedule_described(const std::string& convention) {
  return convention == "deepspeed" ? "DeepSpeed's scheduler"
         : convention == "none"    ? "the optimizer's rate alone (a config without a scheduler)"
                                   : "the trainer's own schedule (no --config)";
}

// The checkpoint's settings into `s`: each recorded setting not given is
// taken; one given with another value is refused, naming it. Then the batch:
// the same micro-batch and N x A as the saving run (A follows from N when
// not given), and the data it was trained on (adopted when --data is not
// given; its hash is checked once it is read).
void adopt_checkpoint(Settings& s, int world_size) {
  s.checkpoint_directory = checkpoint_step_directory(s.load_dir, s.checkpoint_found);
  s.checkpoint =
      std::make_shared<const CheckpointIndex>(CheckpointIndex{read_checkpoint_index(s.checkpoint_directory)});
  const std::string file = s.checkpoint_directory + "/index.json";
  const json& saved = index_field(index_of(s), "settings", file);
  const bool export_only = s.steps == 0;  // --load DIR --steps 0: export the checkpoint, train nothing
  if (export_only) s.given.erase("--steps");
  const bool precision_given =
      s.given.count("--precision") || s.given.count("fp16.enabled") || s.given.count("bf16.enabled");
  const json current = recorded_values(s);
  // Recorded since the schedule could be DeepSpeed's: before, every
  // checkpoint's rates were the trainer's own.
  const json zero2_schedule = "zero2";
  // Recorded since DeepSpeed's other schedulers: a checkpoint without them
  // had WarmupLR or WarmupDecayLR ("warmup"), the others' params unused at
  // their defaults (a fresh Settings' values).
  const json before_schedulers = recorded_values(Settings{});
  const std::set<std::string> scheduler_keys = {"scheduler",
                                                "warmup_min_ratio",
                                                "cos_min_ratio",
                                                "cycle_min_lr",
                                                "cycle_max_lr",
                                                "decay_lr_rate",
                                                "cycle_first_step_size",
                                                "cycle_second_step_size",
                                                "cycle_first_stair_count",
                                                "cycle_second_stair_count",
                                                "decay_step_size",
                                                "cycle_momentum",
                                                "cycle_min_mom",
                                                "cycle_max_mom",
                                                "decay_mom_rate",
                                                "lr_range_test_min_lr",
                                                "lr_range_test_step_size",
                                                "lr_range_test_step_rate",
                                                "lr_range_test_staircase"};
  for (const RecordedSetting& setting : recorded_settings) {
    const bool unrecorded_schedule = std::string(setting.key) == "schedule_convention" && !saved.contains(setting.key);
    const bool unrecorded_scheduler = scheduler_keys.count(setting.key) && !saved.contains(setting.key);
    const json& value = unrecorded_schedule    ? zero2_schedule
                        : unrecorded_scheduler ? before_schedulers[setting.key]
                                               : index_field(saved, setting.key, file);
    const bool given = std::string(setting.key) == "precision" ? precision_given : s.given.count(setting.flag) > 0;
    if (given) {
      if (std::string(setting.key) == "held_out" && current[setting.key] != value)
        fail("--eval-every %ld %s, and the checkpoint's run (in '%s') did %s: the training data would differ",
             s.eval_every,
             s.eval_every > 0 ? "holds the data's tail out of training" : "keeps the data's tail in training",
             s.checkpoint_directory.c_str(),
             value == true ? "hold it out (--eval-every K > 0 continues it)" : "not (leave --eval-every out)");
      if (std::string(setting.key) == "schedule_convention" && current[setting.key] != value)
        fail(
            "this run's learning rates would follow %s (%s), the checkpoint's (in '%s') %s: the rates would differ "
            "from the run that never stopped. Resume without the config's scheduler and the schedule flags to "
            "continue as saved",
            schedule_described(s.schedule_convention).c_str(), s.origins["schedule_convention"].c_str(),
            s.checkpoint_directory.c_str(), schedule_described(value.is_string() ? value.get<std::string>() : json_text(value)).c_str());
      if (current[setting.key] != value)
        fail(
            "%s %s contradicts the checkpoint's %s (in '%s'): a different value changes %s. Leave it out to "
            "continue as saved",
            setting.flag, json_text(current[setting.key]).c_str(), json_text(value).c_str(),
            s.checkpoint_directory.c_str(), setting.what);
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
                                                   : json_text(value);
      apply(s, setting.flag, text, "the checkpoint's setting '" + std::string(setting.key) + "'");
      s.given.erase(setting.flag);  // taken, not given
    }
    s.origins[std::string(setting.key) == "precision" ? "--precision" : setting.flag] = "checkpoint";
  }
  // Portable mode (notes/11) is not among the settings above: a run may
  // choose it anew, as it may the device, and a checkpoint from before it
  // existed has no record of it. Not given, it continues as saved, so that
  // a resumed portable run keeps the bits of one that never stopped.
  if (!s.given.count("--portable") && saved.contains("portable")) {
    if (!saved["portable"].is_boolean())
      fail("the checkpoint index '%s': settings.portable is %s, not true or false", file.c_str(),
           json_text(saved["portable"]).c_str());
    s.portable = saved["portable"].get<bool>();
  }
  // ZeRO-Offload (notes/13) changes no bit either: a run may choose it anew.
  // Not given, it continues as saved, so that a run which needed the host's
  // memory to fit keeps it on resuming (the stage may change: checked again).
  if (!s.given.count("--offload-optimizer") && saved.contains("offload_optimizer")) {
    s.offload_optimizer = parse_choice("the checkpoint's setting 'offload_optimizer' (in '" + file + "')",
                                       index_string(saved, "offload_optimizer", file, "settings"), {"cpu", "none"});
    s.origins["--offload-optimizer"] = "checkpoint";
    if (!s.plan) check_offload(s);
  }
  if (export_only) s.export_only = true;
  // The run's length is not the schedule's: a resumed run may train longer
  // or shorter; without --steps it ends where the saving run would have.
  if (!s.given.count("--steps")) {  // (an export's --steps 0 is not "given": it trains nothing)
    s.steps = index_integer(saved, "steps", file, 1, 1l << 30, "settings");
    s.given.insert("--steps");
  }
  adopt_checkpoint_batch(s, world_size, file);
  const std::string source = index_string(index_of(s), "data.source", file);
  if (s.data.empty() && source != "embedded") s.data = source;
}

std::string loaded_index_text(const Settings& s) { return s.checkpoint ? json_text(index_of(s)) : ""; }

void check_checkpoint_data(const Settings& s, const std::string& corpus) {
  const std::string file = s.checkpoint_directory + "/index.json";
  const std::string sha = index_string(index_of(s), "data.sha256", file);
  const long bytes = index_integer(index_of(s), "data.bytes", file, 0, LONG_MAX);
  if (sha != sha256_hex(corpus) || bytes != (long)corpus.size())
    fail(
        "this run's data (%s, %s bytes) is not the data the checkpoint '%s' was trained on (%s, %s bytes): "
        "give that --data",
        s.data.empty() ? "the embedded corpus" : s.data.c_str(), z2::with_commas(corpus.size()).c_str(),
        s.checkpoint_directory.c_str(), index_string(index_of(s), "data.source", file).c_str(),
        z2::with_commas((size_t)bytes).c_str());
}

// Every rank's file of the checkpoint, as the index lists it, checked: the
// files cover [0, Psi) in order, one per saving rank.
struct CheckpointFile {
  std::string path, sha256;
  size_t begin = 0, end = 0, bytes = 0;
};
static std::vector<CheckpointFile> checkpoint_files(const Settings& s, size_t psi) {
  const std::string file = s.checkpoint_directory + "/index.json";
  const json& files = index_field(index_of(s), "files", file);
  const long saved_world = index_integer(index_of(s), "world_size", file, 1, INT_MAX);
  if (!files.is_array() || (long)files.size() != saved_world)
    fail("the checkpoint index '%s' lists %zu files for %ld ranks", file.c_str(), files.is_array() ? files.size() : 0,
         saved_world);
  if (index_integer(index_of(s), "psi", file, 0, LONG_MAX) != (long)psi)
    fail("the checkpoint index '%s' holds %ld parameters; this model has %zu", file.c_str(),
         index_integer(index_of(s), "psi", file, 0, LONG_MAX), psi);
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
  // Opened as every input is (a regular file; trainer/inputs.h), which also
  // closes it when a check below refuses it.
  explicit StateFile(const CheckpointFile& entry)
      : entry_(entry), file_("the checkpoint file", entry.path, SIZE_MAX) {  // its size: the index's, below
    if (file_.size() != entry.bytes)
      fail("the checkpoint file '%s' has %s bytes; its index says %s (cut short or replaced)", entry.path.c_str(),
           z2::with_commas(file_.size()).c_str(), z2::with_commas(entry.bytes).c_str());
    // The header through the one safetensors reader (trainer/safetensors.h):
    // its length against the file, its JSON and every tensor's range checked
    // (they tile the data exactly); then what the index says it must hold.
    SafetensorsLayout layout;
    try {  // the file is ours and its size the index's: what the reader refuses is damage, said so
      // A rank file's header is three entries and three strings: 1 MiB is plenty.
      layout = safetensors_layout(entry.path, file_, 1 << 20);
    } catch (const z2::Error& error) {
      fail("the checkpoint file '%s' is damaged: %s", entry.path.c_str(), error.what());
    }
    data_start_ = layout.data_start;
    const size_t count = entry.end - entry.begin;
    if (layout.tensors.size() != 3)
      damaged("its number of tensors (" + std::to_string(layout.tensors.size()) + ", not 3)");
    for (const char* name : {"master", "exp_avg", "exp_avg_sq"}) {
      const auto tensor = layout.tensors.find(name);
      if (tensor == layout.tensors.end()) damaged(std::string("its header (no ") + name + ")");
      if (tensor->second.dtype != "F32" || tensor->second.shape != std::vector<long>{(long)count})
        damaged(std::string("the dtype or shape of ") + name);
      offsets_.push_back(tensor->second.begin);  // its size is F32 x count: checked with the shape
    }
  }
  StateFile(const StateFile&) = delete;
  StateFile& operator=(const StateFile&) = delete;

  // Elements [from, from + count) of the canonical order (inside this
  // file's range) of tensor `which` (0 master, 1 exp_avg, 2 exp_avg_sq).
  void read(int which, size_t from, size_t count, float* into) {
    file_.read_at(into, count * sizeof(float), data_start_ + offsets_[which] + (from - entry_.begin) * sizeof(float));
  }

 private:
  [[noreturn]] void damaged(const std::string& what) {
    fail("the checkpoint file '%s' is damaged: %s does not match its index", entry_.path.c_str(), what.c_str());
  }
  CheckpointFile entry_;
  InputFile file_;
  size_t data_start_ = 0;
  std::vector<size_t> offsets_;
};

// A file's SHA-256, streamed (1 MiB at a time: a file is never held whole).
static std::string file_sha256(const std::string& path) {
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
static z2::OptimizerState read_owned_state(const Settings& s, const z2::Engine& engine, int rank, int world_size) {
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
static std::string impossible_loss_scale(const Settings& s, double scale, long iteration) {
  const z2::LossScaling& l = s.loss_scaling;
  auto power_of_two = [](double x) {
    int exponent = 0;
    return std::isfinite(x) && x > 0 && std::frexp(x, &exponent) == 0.5;
  };
  if (!std::isfinite(scale) || !(scale > 0)) return "not a positive finite number";
  if (s.precision != "fp16") return scale == 1 ? "" : s.precision + " trains at loss scale 1";
  if (l.static_scale > 0)
    return scale == l.static_scale ? "" : "fp16.loss_scale " + json_text(json(l.static_scale)) + " is static";
  const double start = std::ldexp(1.0, l.initial_scale_power);
  const double highest = std::ldexp(std::max(start, l.min_scale), (int)std::min(iteration / l.window, 4096l));
  if (!power_of_two(scale) && !power_of_two(scale / l.min_scale))
    return "the dynamic scale is a power of two, or min_loss_scale times one";
  if (scale < std::min(start, l.min_scale) || scale > highest)
    return "from 2^" + std::to_string(l.initial_scale_power) + ", " + std::to_string(iteration) +
           " steps with a window of " + std::to_string(l.window) + " reach " + json_text(json(highest)) + " at most";
  return "";
}

// The progress the index records.
static z2::TrainingProgress checkpoint_progress(const Settings& s) {
  const std::string file = s.checkpoint_directory + "/index.json";
  z2::TrainingProgress progress;
  progress.steps_taken = index_integer(index_of(s), "progress.steps_taken", file, 0, LONG_MAX);
  progress.applied = index_integer(index_of(s), "progress.applied", file, 0, progress.steps_taken);
  progress.skipped = index_integer(index_of(s), "progress.skipped", file, 0, progress.steps_taken);
  const json& scale = index_field(index_of(s), "progress.loss_scale", file);
  if (!scale.is_number()) fail("the checkpoint index '%s': progress.loss_scale is not a number", file.c_str());
  progress.scaler.scale = scale.get<double>();
  progress.scaler.hysteresis_left = (int)index_integer(index_of(s), "progress.hysteresis_left", file, 1, INT_MAX);
  progress.scaler.iteration = index_integer(index_of(s), "progress.scaler_iteration", file, 0, LONG_MAX);
  progress.scaler.last_overflow = index_integer(index_of(s), "progress.last_overflow", file, -1, LONG_MAX);
  const std::string impossible = impossible_loss_scale(s, progress.scaler.scale, progress.scaler.iteration);
  if (!impossible.empty())
    fail("the checkpoint index '%s' is damaged: progress.loss_scale %s cannot come from training (%s)", file.c_str(),
         json_text(scale).c_str(), impossible.c_str());
  if (progress.applied + progress.skipped != progress.steps_taken)
    fail("the checkpoint index '%s': %ld updates and %ld skipped steps do not make its %ld steps", file.c_str(),
         progress.applied, progress.skipped, progress.steps_taken);
  if (progress.steps_taken > s.steps)
    fail("the checkpoint is at step %ld, past --steps %ld", progress.steps_taken, s.steps);
  return progress;
}

// The model's parameters as the index lists them: the same names, shapes
// and order, or a message naming the first that differs.
static void check_checkpoint_parameters(const Settings& s, const z2::Engine& engine,
                                        const TensorShapes& tensor_shapes) {
  const std::string file = s.checkpoint_directory + "/index.json";
  const json& listed = index_field(index_of(s), "parameters", file);
  const auto& infos = engine.parameters();
  if (!listed.is_array() || listed.size() != infos.size())
    fail("the checkpoint index '%s' lists %zu parameters; this model has %zu", file.c_str(),
         listed.is_array() ? listed.size() : 0, infos.size());
  for (size_t id = 0; id < infos.size(); ++id) {
    const json expected = {{"name", infos[id].name}, {"shape", tensor_shapes[id]}, {"numel", infos[id].numel}};
    if (listed[id] != expected)
      fail("the checkpoint index '%s': parameter %zu is %s; this model's is %s", file.c_str(), id,
           json_text(listed[id]).c_str(), json_text(expected).c_str());
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

// Every entry of `directory` named step_<n> (up to 18 digits: a long), of
// any type, lowest step first. `flag` (--save, --load) names it in a message.
static std::vector<StepEntry> step_entries(const std::string& directory, const char* flag = "--save") {
  std::vector<StepEntry> entries;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(directory, error)) {
    const std::string name = entry.path().filename().string();
    if (name.size() > 5 && name.size() <= 5 + 18 && name.compare(0, 5, "step_") == 0 &&
        name.find_first_not_of("0123456789", 5) == std::string::npos)
      entries.push_back({std::strtol(name.c_str() + 5, nullptr, 10), entry.path().string()});
  }
  if (error) fail("%s: cannot list the directory '%s': %s", flag, directory.c_str(), error.message().c_str());
  std::sort(entries.begin(), entries.end(), [](const StepEntry& a, const StepEntry& b) { return a.step < b.step; });
  return entries;
}

// The index of the step directory at `path`, parsed but not yet believed;
// null, with `why`, when `path` is no directory holding a zero2 index.
static json step_index_or_null(const std::string& path, std::string& why) {
  struct stat info;
  if (lstat(path.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) {
    why = "not a directory";
    return json();
  }
  std::string text;
  try {
    text = read_regular_file("the index", path + "/index.json", 64u << 20);
  } catch (const z2::Error&) {
    why = "no readable index.json";
    return json();
  }
  const json index = parsed_or_null(text);
  if (!is_zero2_index(index)) {
    why = "its index.json is not a zero2 checkpoint index";
    return json();
  }
  return index;
}

// Whether the step directory at `path`, whose index is `index`, is step
// `step` complete: its index verifies against its index.sha256, is this
// version's and step `step`'s, and the directory holds exactly index.json,
// index.sha256 and the files its index lists, at the listed sizes. (The
// rank files' SHA-256 are checked by a load, not here: this reads no state.)
static bool step_is_complete(const std::string& path, const json& index, long step, std::string& why) {
  try {
    verified_index_text(path);
  } catch (const z2::Error&) {
    why = "its index does not match its index.sha256";
    return false;
  }
  if (index.value("version", json()) != checkpoint_version || index.value("step", json()) != step ||
      !index.contains("files") || !index["files"].is_array()) {
    why = "its index is not that of step " + std::to_string(step);
    return false;
  }
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
        (!expected[name].is_null() && expected[name] != (long)file.st_size)) {
      why = "'" + name.substr(0, 64) + "' is not a file its index lists";
      return false;
    }
    ++seen;
  }
  if (error || seen != expected.size()) {
    why = "files its index lists are missing";
    return false;
  }
  return true;
}

// Whose step the entry at `path` is; `why` says what keeps it from being
// this run's when it is not. (Another run's step is not verified: it is
// never replaced or deleted without --save-overwrite, whatever it holds.)
static StepOwner step_owner(const std::string& path, long step, const std::string& run_id, std::string& why) {
  if (!path_is_there(path)) return StepOwner::absent;
  const json index = step_index_or_null(path, why);
  if (index.is_null()) return StepOwner::not_a_step;
  if (!index.contains("run_id") || index["run_id"] != run_id) return StepOwner::other_run;
  return step_is_complete(path, index, step, why) ? StepOwner::this_run : StepOwner::not_a_step;
}

// --- which step was saved last ---------------------------------------------------
//
// A save writes latest last, after its step is in place, so a save killed
// between the two leaves a complete step that latest does not name: latest
// is missing (the first save) or names the step before. Step numbers cannot
// say which step came last: a run resumed from step_6 into the same --save
// saves step_7 after the step_8 of the history it left, and latest rightly
// names step_7. So each index records "save_sequence", the order of saves
// into its directory: Settings::first_save_sequence + the step. An index
// without it (written before it was recorded) counts by its step.

struct CompleteStep {
  long step = 0, sequence = 0;
  bool sequence_recorded = false;  // false: an older index, counted by its step
  std::string path, name;          // DIR/step_<s>, step_<s>
  json run_id;
};
// Every complete step of `directory` (step_is_complete), lowest step first.
static std::vector<CompleteStep> complete_steps(const std::string& directory, const char* flag) {
  std::vector<CompleteStep> steps;
  for (const StepEntry& entry : step_entries(directory, flag)) {
    std::string why;
    const json index = step_index_or_null(entry.path, why);
    if (index.is_null() || !step_is_complete(entry.path, index, entry.step, why)) continue;
    CompleteStep step;
    step.step = step.sequence = entry.step;
    step.path = entry.path;
    step.name = std::filesystem::path(entry.path).filename().string();
    step.run_id = index.value("run_id", json());
    // Bounded, so that first_save_sequence + a step cannot overflow.
    const json sequence = index.value("save_sequence", json());
    if (sequence.is_number_integer() && sequence.get<long>() >= 0 && sequence.get<long>() < (1l << 62))
      step.sequence = sequence.get<long>(), step.sequence_recorded = true;
    steps.push_back(step);
  }
  return steps;
}
// The step of `steps` saved last among those `counts` takes (the highest
// sequence; of two, the higher step), or null when it takes none.
static const CompleteStep* saved_last(const std::vector<CompleteStep>& steps,
                                      const std::function<bool(const CompleteStep&)>& counts) {
  const CompleteStep* newest = nullptr;
  for (const CompleteStep& step : steps)
    if (counts(step) &&
        (!newest || std::make_pair(step.sequence, step.step) > std::make_pair(newest->sequence, newest->step)))
      newest = &step;
  return newest;
}
// A step saved after `named` (the step latest names) by the same run, or
// null. Only steps that record their sequence overrule latest: between two
// older indexes, latest, written last, is the only record of the order.
// Another run's step (kept beside this one's by --save-overwrite, or copied
// in) never overrules it either.
static const CompleteStep* saved_after(const std::vector<CompleteStep>& steps, const CompleteStep& named) {
  return saved_last(steps, [&](const CompleteStep& step) {
    return step.sequence_recorded && step.run_id == named.run_id && step.sequence > named.sequence;
  });
}

// --load DIR, when latest is missing (`latest_name` "") or names a step
// that a later save of its run followed: the step saved last, and in
// `found` one line saying why it is not latest's; "" when latest's step is
// the one (or, latest missing, when DIR holds no complete step). A step
// latest names that is not complete is left for the load to name.
static std::string step_saved_after_latest(const std::string& directory, const std::string& latest_name,
                                           std::string& found) {
  const std::vector<CompleteStep> steps = complete_steps(directory, "--load");
  if (latest_name.empty()) {
    const CompleteStep* newest = saved_last(steps, [](const CompleteStep&) { return true; });
    if (!newest) return "";
    found = "'" + directory + "' has no latest (a save was stopped before it wrote it): took " + newest->name +
            (newest->sequence_recorded ? ", the complete step saved last"
                                       : ", the complete step with the highest number (its index predates save "
                                         "sequences)");
    return newest->path;
  }
  const auto named =
      std::find_if(steps.begin(), steps.end(), [&](const CompleteStep& step) { return step.name == latest_name; });
  if (named == steps.end()) return "";
  const CompleteStep* newer = saved_after(steps, *named);
  if (!newer) return "";
  found = "'" + directory + "/latest' names " + latest_name + ", but " + newer->name +
          " of the same run was saved after it (a save was stopped before it moved latest): took " + newer->name;
  return newer->path;
}

// .step_<n>.incomplete, left by a save that was killed (or the old step a
// re-save swapped out): removed only when it holds nothing but what a save
// writes there (rank files, the index, its digest, the writer's temporaries).
static bool is_incomplete_step_name(const std::string& name) {
  return name.size() > 17 && name.compare(0, 6, ".step_") == 0 &&
         name.compare(name.size() - 11, 11, ".incomplete") == 0 &&
         name.find_first_not_of("0123456789", 6) == name.size() - 11;
}
static bool holds_only_checkpoint_files(const std::string& path) {
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

// A .step_<s>.incomplete holding anything else (a user's file) is never
// removed: refused before step 1 (claim_save_directory) and at the save.
static void refuse_foreign_incomplete(const std::string& incomplete) {
  if (path_is_there(incomplete) && !holds_only_checkpoint_files(incomplete))
    fail("--save: '%s' holds files a save does not write there: move it away", incomplete.c_str());
}

// Where the ranks write a step: .step_<s>.incomplete, made empty (one a
// killed save left is removed, if it holds nothing but a save's files).
static void make_incomplete_step(const std::string& incomplete) {
  if (path_is_there(incomplete)) {
    refuse_foreign_incomplete(incomplete);
    std::error_code ignored;
    std::filesystem::remove_all(incomplete, ignored);
  }
  prepare_directory("--save", incomplete);
}

// Rank 0, before step 1: lock --save, take the run's identity (the loaded
// checkpoint's, or a new one) and its first save sequence, and refuse a
// directory holding another run's steps (unless --save-overwrite), or
// something else under the name of a step this run may save, or a user's
// file in the .step_<s>.incomplete of one (else the save at the end of
// the run, after every step trained, would be refused).
std::unique_ptr<DirectoryLock> claim_save_directory(Settings& s) {
  auto lock = std::make_unique<DirectoryLock>(
      s.save_dir, DirectoryLock::OnBusy::refuse,
      "--save '" + s.save_dir +
          "' is in use: another run is saving into it (it holds the directory's lock). Two runs saving into one "
          "directory would replace each other's steps and latest: give this run another --save");
  const bool resumed = s.checkpoint != nullptr;
  s.run_id = resumed ? index_of(s)["run_id"].get<std::string>() : new_run_id();
  const long first =
      resumed ? index_integer(index_of(s), "progress.steps_taken", s.checkpoint_directory + "/index.json", 0, LONG_MAX)
              : 0;
  const long last = s.export_only ? first : std::max(first, s.steps);
  // A save at the end (last), every --save-every, or at an interrupt.
  auto may_save = [&](long step) { return step == last || (step > first && step <= last); };
  for (const StepEntry& entry : step_entries(s.save_dir)) {
    std::string why;
    const StepOwner owner = step_owner(entry.path, entry.step, s.run_id, why);
    if (owner == StepOwner::other_run && !s.save_overwrite)
      fail(
          "--save '%s' holds checkpoints of another run (%s): a %s run there would replace its steps and latest. "
          "Save into another directory, continue that run with --load %s, or give --save-overwrite to replace them",
          s.save_dir.c_str(), entry.path.c_str(), resumed ? "resumed" : "new", s.save_dir.c_str());
    if (owner == StepOwner::not_a_step && may_save(entry.step))
      fail(
          "--save: '%s' is not a checkpoint of this run (%s), and this run may save step %ld there: move it away or "
          "save into another directory",
          entry.path.c_str(), why.c_str(), entry.step);
  }
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(s.save_dir, error)) {
    const std::string name = entry.path().filename().string();
    if (is_incomplete_step_name(name) && may_save(std::strtol(name.c_str() + 6, nullptr, 10)))
      refuse_foreign_incomplete(entry.path().string());
  }
  // Every complete step's sequence counts, another run's too: a save here
  // is newer than all of them.
  const std::vector<CompleteStep> steps = complete_steps(s.save_dir, "--save");
  const CompleteStep* newest = saved_last(steps, [](const CompleteStep&) { return true; });
  s.first_save_sequence = newest ? newest->sequence + 1 : 0;
  return lock;
}

// --- a load and a save -------------------------------------------------------

// Each rank reads the pieces of the checkpoint's files that overlap the
// runs it owns, then the engine rebuilds every rank's working parameters.
LoadedCheckpoint load_checkpoint(const Settings& s, z2::Engine& engine, const TensorShapes& tensor_shapes,
                                 MPI_Comm world) {
  int rank = 0, world_size = 1;
  MPI_Comm_rank(world, &rank);
  MPI_Comm_size(world, &world_size);
  const auto start = std::chrono::steady_clock::now();
  z2::OptimizerState state;
  z2::TrainingProgress progress;
  agree_on_errors(
      world,
      [&] {
        check_checkpoint_parameters(s, engine, tensor_shapes);
        progress = checkpoint_progress(s);
        state = read_owned_state(s, engine, rank, world_size);
      },
      "every rank read its part of the checkpoint");
  engine.owned_state_from_host(state);
  engine.restore_training_progress(progress);
  const std::string file = s.checkpoint_directory + "/index.json";
  LoadedCheckpoint loaded;
  loaded.directory = s.checkpoint_directory;
  loaded.step = progress.steps_taken;
  loaded.world_size = index_integer(index_of(s), "world_size", file, 1, INT_MAX);
  loaded.accum = index_integer(index_of(s), "accum", file, 1, INT_MAX);
  loaded.stage = index_integer(index_of(s), "stage", file, 0, 2);
  // false only with --allow-different-bits: the bits then differ from the unbroken run's
  loaded.same_summation_tree = !s.summation_tree_changed;
  loaded.precision = s.precision;
  loaded.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return loaded;
}

// Keeps the newest --save-keep steps up to `keep_step` (the one just saved
// among them); steps after it (from a run that was resumed from earlier)
// are left alone. "Newest" is saved last (the save sequence), not the
// highest number: of a step_5 left by an abandoned history and the step_4
// this run saved after it, step_4 is the newer.
// Only this run's steps (step_owner) count and are deleted: a user's
// step_1/ folder, a plain file step_3 or another run's step stays.
static void prune_checkpoints(const Settings& s, long keep_step) {
  std::vector<CompleteStep> ours;
  for (const CompleteStep& step : complete_steps(s.save_dir, "--save"))
    if (step.step <= keep_step && step.run_id == s.run_id) ours.push_back(step);  // step_owner's this_run
  // Oldest first.
  std::sort(ours.begin(), ours.end(), [](const CompleteStep& a, const CompleteStep& b) {
    return std::make_pair(a.sequence, a.step) < std::make_pair(b.sequence, b.step);
  });
  std::error_code error;
  for (size_t k = 0; k + (size_t)s.save_keep < ours.size(); ++k) std::filesystem::remove_all(ours[k].path, error);
  // A save killed before it was complete left .step_<k>.incomplete.
  std::vector<std::string> left;
  for (const auto& entry : std::filesystem::directory_iterator(s.save_dir, error))
    if (is_incomplete_step_name(entry.path().filename().string()) && holds_only_checkpoint_files(entry.path()))
      left.push_back(entry.path());
  for (const std::string& path : left) std::filesystem::remove_all(path, error);
}

// Rank 0's part of a save, once every rank's file is written: the index
// (with every file's SHA-256 and size) and its digest, the step put in
// place, latest moved, old steps pruned. Returns the files' total bytes.
static long write_index_and_publish(const Settings& s, const z2::Engine& engine, const TensorShapes& tensor_shapes,
                                    const std::string& corpus, int world_size, const z2::TrainingProgress& progress,
                                    const std::vector<long>& sizes, const std::vector<char>& shas) {
  const size_t psi = engine.psi();
  const std::string name = step_directory_name(progress.steps_taken);
  const std::string directory = s.save_dir + "/" + name;
  const std::string incomplete = incomplete_step_directory(s.save_dir, progress.steps_taken);
  long total_bytes = 0;
  json files = json::array();
  for (int q = 0; q < world_size; ++q) {
    const auto [low, high] = file_range(psi, q, world_size);
    files.push_back({{"file", rank_file_name(q)},
                     {"begin", low},
                     {"end", high},
                     {"bytes", sizes[q]},
                     {"sha256", std::string(shas.data() + 65 * q)}});
    total_bytes += sizes[q];
  }
  json parameters = json::array();
  for (size_t id = 0; id < engine.parameters().size(); ++id)
    parameters.push_back({{"name", engine.parameters()[id].name},
                          {"shape", tensor_shapes[id]},
                          {"numel", engine.parameters()[id].numel}});
  const json index = {
      {"format", "zero2 checkpoint"},
      {"version", checkpoint_version},
      {"run_id", s.run_id},
      {"step", progress.steps_taken},
      {"save_sequence", s.first_save_sequence + progress.steps_taken},  // when it was saved (--load DIR)
      {"world_size", world_size},
      {"accum", s.accum},
      {"stage", s.stage},
      {"precision", s.precision},
      {"vocab_size", vocab_size},
      {"settings", recorded_values(s)},
      // Absolute: a run resumed from another working directory finds it.
      {"data",
       {{"source", s.data.empty() ? std::string("embedded") : std::filesystem::absolute(s.data).string()},
        {"bytes", corpus.size()},
        {"sha256", sha256_hex(corpus)},
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
  const std::string index_text = json_text(index, 2) + "\n";
  write_output_file(incomplete + "/index.json", index_text);
  write_output_file(incomplete + "/" + index_digest_file, index_digest_line(index_text));
  // The step it replaces (a re-save) must be this run's, or another
  // run's with --save-overwrite: never a user's file or folder.
  std::string why;
  const StepOwner owner = step_owner(directory, progress.steps_taken, s.run_id, why);
  if (owner == StepOwner::not_a_step || (owner == StepOwner::other_run && !s.save_overwrite))
    fail("--save: '%s' is not a checkpoint of this run (%s): move it away or save into another directory",
         directory.c_str(), owner == StepOwner::other_run ? "another run's" : why.c_str());
  publish_step(incomplete, directory);
  write_output_file(s.save_dir + "/latest", name + "\n");  // last: the step is complete
  std::error_code ignored;
  std::filesystem::remove_all(incomplete, ignored);  // the step it replaced, if any
  prune_checkpoints(s, progress.steps_taken);
  return total_bytes;
}

// DIR/step_<s>: each rank writes the canonical range file_range(rank) of the
// state (gathered from its owners) into DIR/.step_<s>.incomplete, the ranks
// agree, then rank 0 writes the index (with every file's SHA-256) and its
// digest there, puts the directory in place (publish_step) and only then
// moves DIR/latest (write_index_and_publish). A crash at any point leaves
// latest naming a complete step, or (killed between the step and latest)
// missing or one save behind: --load DIR then takes the step saved last.
// It reads as the protocol: every collective and every agree_on_errors in
// the order all ranks reach them.
SavedCheckpoint save_checkpoint(const Settings& s, z2::Engine& engine, const TensorShapes& tensor_shapes,
                                const std::string& corpus, MPI_Comm world) {
  int rank = 0, world_size = 1;
  MPI_Comm_rank(world, &rank);
  MPI_Comm_size(world, &world_size);
  const auto start = std::chrono::steady_clock::now();
  const z2::TrainingProgress progress = engine.training_progress();
  const std::string name = step_directory_name(progress.steps_taken);
  const std::string directory = s.save_dir + "/" + name;
  const std::string incomplete = incomplete_step_directory(s.save_dir, progress.steps_taken);
  z2::set_watchdog_context("the checkpoint of step " + std::to_string(progress.steps_taken));
  agree_on_errors(
      world,
      [&] {
        if (rank == 0) naming_a_vanished_file([&] { make_incomplete_step(incomplete); });
      },
      "the checkpoint's directory was made");
  const size_t psi = engine.psi();
  const auto [begin, end] = file_range(psi, rank, world_size);
  const z2::OptimizerState state = engine.state_range_to_host(begin, end);
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
      world,
      [&] { naming_a_vanished_file([&] { write_output_file(incomplete + "/" + rank_file_name(rank), contents); }); },
      "every rank's checkpoint file was written");
  // Every file's SHA-256 and size to rank 0, for the index.
  std::vector<char> shas(rank == 0 ? 65 * (size_t)world_size : 0);
  std::vector<long> sizes(rank == 0 ? world_size : 0);
  long size = (long)contents.size();
  MPI_Request requests[2];
  Z2_MPI_CHECK(MPI_Igather(sha, 65, MPI_CHAR, shas.data(), 65, MPI_CHAR, 0, world, &requests[0]));
  Z2_MPI_CHECK(MPI_Igather(&size, 1, MPI_LONG, sizes.data(), 1, MPI_LONG, 0, world, &requests[1]));
  z2::wait_request(&requests[0], "the gather of the checkpoint files' SHA-256");
  z2::wait_request(&requests[1], "the gather of the checkpoint files' sizes");
  long total_bytes = 0;
  agree_on_errors(
      world,
      [&] {
        if (rank == 0)
          naming_a_vanished_file([&] {
            total_bytes = write_index_and_publish(s, engine, tensor_shapes, corpus, world_size, progress, sizes, shas);
          });
      },
      "the checkpoint's index was written");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  z2::set_watchdog_context("optimizer step " + std::to_string(progress.steps_taken + 1));
  return {directory, progress.steps_taken, total_bytes, seconds};
}

}  // namespace bert
