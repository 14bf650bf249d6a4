// trainer/settings.h — the trainer's settings: every flag with its default,
// each flag's parser and --help, the checks that need several settings at
// once, what the settings make for the engine and the model, and how a bad
// setting ends the run (fail, agree_on_errors). Apart from the model
// (train_bert_mini.cu), which reads the settings and never parses them; the
// command line that fills them is trainer/command_line.h. Defined in
// trainer/settings.cpp.
// Layer: settings, of settings → inputs → formats → training (notes/07, "The trainer's layers").
#pragma once

#include <cstdarg>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "trainer/model_shape.h"
#include "zero2.h"

namespace bert {

struct CheckpointIndex;  // --load's index.json as read (trainer/checkpoints.cpp)

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
  // Whose rates those are (learning_rate): "zero2", the trainer's own
  // schedule counted from step 1 (without --config); "deepspeed", DeepSpeed's
  // scheduler as its engine steps it (a config's scheduler block, or schedule
  // flags next to a config); "none", the optimizer's rate at every step (a
  // config without a scheduler, as DeepSpeed holds it). Checkpoints record it.
  std::string schedule_convention = "zero2";
  // Which of DeepSpeed's schedulers (runtime/lr_schedules.py at v0.16.9),
  // with schedule_convention "deepspeed": "warmup" is WarmupLR or
  // WarmupDecayLR by --decay (the settings above); WarmupCosineLR takes
  // --warmup, --warmup-type and --schedule-steps (total_num_steps) with the
  // two ratios below, its peak the optimizer's lr; OneCycle and LRRangeTest
  // take their own params only. Config only; checkpoints record them all.
  std::string scheduler = "warmup";
  double warmup_min_ratio = 0.0, cos_min_ratio = 1e-4;  // WarmupCosineLR.__init__'s defaults
  // OneCycle.__init__'s defaults (cycle_min_lr and cycle_max_lr have none: a
  // config must give them). cycle_second_step_size -1: None, the first's;
  // the stair counts are read and never used by DeepSpeed (lr_schedules.py
  // _initialize_cycle stores them, nothing reads them), so too here.
  double cycle_min_lr = 0, cycle_max_lr = 0, decay_lr_rate = 0;
  long cycle_first_step_size = 2000, cycle_second_step_size = -1, decay_step_size = 0;
  long cycle_first_stair_count = 0, cycle_second_stair_count = -1;
  bool cycle_momentum = true;
  double cycle_min_mom = 0.8, cycle_max_mom = 0.9, decay_mom_rate = 0;
  // LRRangeTest.__init__'s defaults.
  double lr_range_test_min_lr = 1e-3, lr_range_test_step_rate = 1.0;
  long lr_range_test_step_size = 2000;
  bool lr_range_test_staircase = false;
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
  // ZeRO-Offload (notes/10's plan, zero2.h EngineOptions::offload_optimizer):
  // "cpu" keeps the fp32 master, m, v and the reduced gradient shard in host
  // memory and steps AdamW there; "none" keeps them on the device. Stages 1
  // and 2 only. The bits do not change, so a checkpoint does not record it.
  std::string offload_optimizer = "none";
  int host_threads = 0;  // --host-threads: the offloaded step's threads per rank; 0: this rank's share of the cores
  // files and output
  std::string data, config, json_path, export_dir, dump_dir, memory_trace, metrics;
  std::string timeline;  // --timeline FILE: every stream operation, as Chrome trace-event JSON (notes/15)
  // Checking another implementation against this run (notes/12): --trace DIR
  // records what a peer needs to replay it and what it should match; the
  // parameters and gradients after step 1, every trace_params_every-th step
  // (0: none between) and the last. --init-hf DIR starts from a
  // BertForMaskedLM directory's weights instead of the seed's.
  std::string trace_dir, init_hf;
  long trace_params_every = 0;
  double timeout = 600;  // seconds the watchdog lets a collective or transfer wait (zero2.h)
  // checkpoints (notes/09)
  std::string save_dir, load_dir;
  long save_every = 0;  // 0: only at the end (and on an interrupt)
  int save_keep = 2;
  bool export_only = false;             // --load DIR --steps 0: export the checkpoint, train nothing
  bool save_overwrite = false;          // --save-overwrite: may replace another run's steps in --save
  bool allow_different_bits = false;    // --allow-different-bits: resume at a split with another summation tree
  bool summation_tree_changed = false;  // this resume took that consent (recorded in --json)
  std::string run_id;  // the history this run continues (rank 0, with --save): pruning deletes only its steps
  std::shared_ptr<const CheckpointIndex>
      checkpoint;                    // --load's index.json, read before anything else (null: no --load)
  std::string checkpoint_directory;  // the step directory it came from
  // How --load DIR chose that step when DIR/latest did not name it (missing,
  // or older than a step saved after it): one line for the header; "" else.
  std::string checkpoint_found;
  // Rank 0, with --save: one more than the newest save sequence a step in
  // --save held when this run claimed it (claim_save_directory). The save of
  // step s records it + s, so the sequence grows within a run and across
  // runs: it orders saves by when they happened, not by their step numbers.
  long first_save_sequence = 0;
  // The flags given (command line or config): a resumed run takes the
  // checkpoint's value for every recorded setting not among them.
  std::set<std::string> given;
  long log_every = 10;
  // --eval-every K: every K steps (and at the last), the MLM loss on
  // eval_batches micro-batches drawn from the held-out tail of the data.
  long eval_every = 0;
  int eval_batches = 4;
  bool quiet = false;
  // --local_rank N (DeepSpeed's launcher appends --local_rank=N): checked
  // against MPI's local rank (trainer/launcher.cpp); -1: not given.
  int local_rank = -1;
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
  std::vector<std::string> config_notes;     // config keys that act differently here, for the header
  std::string config_pinning_note;           // the config's pin_memory false: in the header only when offloading
  std::vector<std::string> config_warnings;  // config keys DeepSpeed ignores (the header, or stderr with --quiet)
  // Where each setting's value came from, by the flag apply() knows it as:
  // "config:KEY", "flag:--x", "deepspeed_default:WHERE" (a key the config
  // leaves out), "trainer_default:auto" (a config's "auto"), "checkpoint",
  // "derived:train_batch_size"; a flag not here has the trainer's default.
  std::map<std::string, std::string> origins;
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

// The offset of the first byte of `text` that does not begin a well-formed
// UTF-8 sequence, or npos: the rule for every path a run records (JSON
// holds only UTF-8) and for the corpus (train_bert_mini.cu, read_corpus).
size_t first_bad_utf8(const std::string& text);

// The flags the command line takes (apply() knows each, and the config's
// keys besides): a name outside it is refused before its value is read,
// with the flag it resembles (trainer/command_line.cpp).
extern const std::vector<std::string> command_line_flags;
// Levenshtein distance (a typo's nearest name: flags, DeepSpeed's keys).
size_t edit_distance(const std::string& a, const std::string& b);

// A flag's value as one of `choices`, or one message listing them.
std::string parse_choice(const std::string& flag, const std::string& text, std::vector<std::string> choices);
// A path flag's value: not empty, UTF-8 (the working directory too, for a
// relative one), or one message saying which.
std::string parse_path(const std::string& flag, const std::string& text);
// One flag and its value (as text) into the settings. Config files and the
// command line both end up here, so a value from either is checked the same way.
void apply(Settings& s, const std::string& flag, const std::string& value, std::string name = "");
// The precision, from --precision and a config's fp16 / bf16 blocks.
void resolve_precision(Settings& s);
z2::Precision precision_of(const Settings& s);
// What --help prints: every flag, its values and its default (Settings above).
extern const char* const usage_text;
// Where a setting came from, as a message names it (Settings::origins):
// "--stage 0", "config key 'zero_optimization.stage' 0", "DeepSpeed's
// default stage 0 (...)".
std::string said_by(const Settings& s, const std::string& flag, const std::string& value);
// Checks that need several settings at once (world size known).
void check_consistency(Settings& s, int world_size);
// Offloading the optimizer needs a ZeRO stage (1 or 2): refused at stage 0,
// naming where the stage and the offload came from (a flag or a config key).
void check_offload(const Settings& s);

// Run `checks` on every rank; if any rank failed, every rank throws the
// message of the lowest failing rank (so rank 0 can print it and all ranks
// leave together instead of some waiting in a collective for the others).
// `what` names the agreement for the watchdog ("the export was written").
void agree_on_errors(MPI_Comm world, const std::function<void()>& checks,
                     const std::string& what = "the checks before training");

// --- what the settings make for the engine and the model ---------------------
// The learning rate of the t-th applied optimizer update (1-based; an fp16
// step skipped on overflow does not count, as in DeepSpeed): the trainer's
// schedule, DeepSpeed's WarmupLR or WarmupDecayLR, or constant, by
// schedule_convention.
double learning_rate(const Settings& s, long t);
// Adam's (beta1, beta2) of the t-th applied update: the optimizer's, or
// OneCycle's cycled beta1 with beta2 0.99 when cycle_momentum is on
// (betas_cycle).
std::pair<double, double> adam_betas(const Settings& s, long t);
bool betas_cycle(const Settings& s);
z2::EngineOptions engine_options(const Settings& settings, z2::Precision precision);
ModelShape shape_of(const Settings& settings);
ActivationMode mode_of(const Settings& settings);
z2::Allocator allocator_of(const Settings& settings);

}  // namespace bert
