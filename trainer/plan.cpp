// trainer/plan.cpp — the memory plan and the fit check (trainer/plan.h).
#include "trainer/plan.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "trainer/json.h"
#include "trainer/model_shape.h"
#include "trainer/output_files.h"

namespace bert {

// --- the memory plan (--plan; notes/10) ------------------------------------------
//
// Bytes per rank, by category, from the flags alone: no engine, no model, no
// allocation. Each category is the code the run allocates with: the engine's
// buffers are z2::engine_buffers() over z2::lay_out_buckets() of the model's
// parameter_numels() (what Engine::build() allocates), the activations are
// activation_peak_bytes() (what the model opens and closes, phase by phase).
// tests/cli/plan.sh holds every category to the measured ledger, to the
// byte. The arena's block is the same sum with each buffer rounded up to 256
// bytes, as the arena serves it: the smallest --device-memory-limit that
// trains. naive's block also depends on where its holes fall (make fraglab
// measures it); the plan gives its live peak, a lower bound.
struct RankPlan {
  int stage = 2, world_size = 1;
  bool offload = false;  // ZeRO-Offload at this stage (1, 2): the optimizer's partition in host memory
  z2::EngineBuffers engine;
  size_t psi = 0;               // real parameters
  size_t activation_peak = 0;   // live bytes at the activation peak, for the allocator
  size_t activation_block = 0;  // the arena's share for them (each buffer rounded to 256)
  size_t live() const { return engine.live() + activation_peak; }              // the ledger's device peak
  size_t arena_block() const { return engine.reserved() + activation_block; }  // the ledger's reserved (arena)
};

static RankPlan plan_rank(const Settings& settings, int stage, int world_size) {
  Settings at_stage = settings;
  at_stage.stage = stage;
  const ModelShape shape = shape_of(settings);
  const std::vector<size_t> numels = parameter_numels(shape);
  RankPlan plan;
  plan.stage = stage, plan.world_size = world_size;
  plan.offload = settings.offload_optimizer == "cpu" && stage > 0;  // (engine_buffers ignores it at stage 0)
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
  size_t held = 0;        // what the process holds at the check, measured (the libraries, the corpus, --init-hf)
  size_t growth = 0;      // what the libraries and the heap add after the check (OpenBLAS's buffers, glibc's arenas)
  size_t persistent = 0;  // held from the first step to the end
  size_t offloaded = 0;   // ZeRO-Offload's optimizer state and its tables (16 Psi/N and a little; 0 without it)
  size_t copies = 0;      // the largest transient copy
  std::string largest;    // which one, for the message
  size_t total() const { return held + growth + persistent + offloaded + copies; }
};

static HostUse host_use(const Settings& settings, const RankPlan& plan, z2::Device device, size_t held) {
  const double p = 4.0 * (double)plan.engine.psi_padded, N = plan.world_size;
  const bool mixed = precision_of(settings) != z2::Precision::fp32;
  const bool whole_state = plan.stage == 0 || plan.world_size == 1;  // each rank holds all of AdamW's state
  const ModelShape shape = shape_of(settings);
  HostUse use;
  use.held = held;
  // Measured (notes/10): OpenBLAS's buffer, under 2 MiB with one thread, and
  // glibc's heap, which keeps freed copies under 32 MB for reuse.
  use.growth = 64ull << 20;
  double largest = 0;
  auto consider = [&](double bytes, const char* what) {
    if (bytes > largest) largest = bytes, use.largest = what;
  };
  // Model::initialize's values and Engine::parameters_from_host's padded copy (16-bit: and its rounding).
  consider(mixed ? 2.5 * p : 2 * p, "building the initial parameters on the host");
  // Engine::parameters_to_host (16-bit, stages 1-2: the shards, their all-gather, the padded and canonical copies);
  // --export-hf's file is one more copy beside the result.
  const double final_parameters = mixed && plan.stage > 0 ? 3 * p + p / N : 2 * p;
  consider(final_parameters, "gathering the final parameters for the hash and the export");
  // --trace, after each kept step (rank 0 writes, every rank gathers): the
  // gradient (Engine::gradients_to_host, held through the step) beside
  // parameters_to_host's copies, then beside the parameters and one file's bytes.
  if (!settings.trace_dir.empty()) consider(p + std::max(final_parameters, 2 * p), "--trace's parameters and gradient");
  // --dump-batch: the weights and the gradients of step 0, one in its file at a time.
  if (!settings.dump_dir.empty()) consider(4 * p, "--dump-batch's weights and gradients");
  // Engine::state_range_to_host (owned_state_to_host's copies, then the range) and the file's bytes.
  if (!settings.save_dir.empty())
    consider(whole_state ? 6 * p : (mixed ? 0 : p) + 8 * p / N, "--save's copy of the optimizer state and its file");
  // read_owned_state, then Engine::owned_state_from_host's copies of the buffers.
  if (settings.checkpoint != nullptr)
    consider(whole_state ? 6 * p : (mixed ? 0 : p) + 6 * p / N, "--load's copy of the optimizer state");
  // --trace's batches (input_ids and labels, int64, every token of every
  // step), kept until the end and then written whole: once more as the file.
  const double traced_batches = settings.trace_dir.empty() ? 0.0
                                                           : 16.0 * (double)settings.steps * plan.world_size *
                                                                 settings.accum * shape.micro_batch * shape.seq;
  consider(traced_batches, "--trace's batches file");
  use.copies = (size_t)largest;
  use.persistent += (size_t)traced_batches;
  const size_t act = precision_of(settings) == z2::Precision::fp32 ? 4 : 2;
  const size_t B = shape.micro_batch, T = shape.seq, H = shape.hidden, S = B * T;
  if (mode_of(settings) == ActivationMode::offload)  // Model's host_checkpoints_ (pinned on cuda)
    use.persistent += (size_t)(shape.layers - 1) * S * H * act;
  use.offloaded = plan.engine.host_live();  // allocated by build(), pinned on cuda
  if (device != z2::Device::cuda && (mixed || settings.portable)) {
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
size_t memory_block(const Settings& settings, z2::Allocator allocator, z2::Device device, int world_size,
                    MPI_Comm world) {
  const RankPlan plan = plan_rank(settings, settings.stage, world_size);
  const double needed = (double)(allocator == z2::Allocator::arena ? plan.arena_block() : plan.live());
  const z2::MemoryLimit limit = z2::memory_per_rank(device, world);
  const z2::MemoryLimit host_limit = device != z2::Device::cuda ? limit : z2::memory_per_rank(z2::Device::cpu, world);
  const HostUse host = host_use(settings, plan, device, host_limit.held);
  const double available = (double)limit.bytes, GiB = 1073741824.0;
  const double on_device = needed + (device != z2::Device::cuda ? (double)host.total() : 0.0);
  if (on_device > available || (double)host.total() > (double)host_limit.bytes) {
    // One message: the figure that does not fit, the limit and its source, then the figure's parts.
    const bool host_short = device == z2::Device::cuda && on_device <= available;
    const z2::MemoryLimit& short_of = host_short ? host_limit : limit;
    const double need = host_short ? (double)host.total() : on_device;
    char plan_text[320], host_text[640];
    snprintf(plan_text, sizeof plan_text,
             "%s bytes of the plan (%s parameters, stage %d, N = %d, activations %.2f GiB with --activations %s; "
             "--plan shows every category)",
             z2::with_commas((size_t)needed).c_str(), z2::with_commas(plan.psi).c_str(), settings.stage, world_size,
             plan.activation_peak / GiB, settings.activations.c_str());
    snprintf(
        host_text, sizeof host_text,
        "%s bytes the process holds on the host besides the plan (%.2f GiB held already, measured: the "
        "libraries, the inputs; %.2f for %s, %.2f held all run, %s%.2f for what the libraries and the heap "
        "add; notes/10)",
        z2::with_commas(host.total()).c_str(), host.held / GiB, host.copies / GiB, host.largest.c_str(),
        host.persistent / GiB,
        host.offloaded
            ? z2::format_text("%.2f the optimizer offloaded (ZeRO-Offload, 16 Psi/N), ", host.offloaded / GiB).c_str()
            : "",
        host.growth / GiB);
    std::string parts = plan_text, where;  // cuda, short of the GPU's memory: the plan alone
    if (device != z2::Device::cuda) parts += std::string(" plus ") + host_text;
    else if (host_short) parts = std::string(host_text) + " (the plan itself is on the GPU)", where = " on the host";
    else where = " on the GPU";
    const bool overridden = short_of.source == "ZERO2_MEMORY_LIMIT";
    // A machine's figure is room left, to which what the process holds is added back (memory_per_rank).
    const std::string source =
        short_of.source + (overridden || short_of.held == 0 ? "" : ", with what the process holds already");
    fail(
        "this configuration needs %s bytes (%.2f GiB) per rank%s but %.2f GiB are available per rank (%s): %s. "
        "Use a smaller model or micro-batch, --activations recompute or offload, a higher stage or more ranks%s",
        z2::with_commas((size_t)need).c_str(), need / GiB, where.c_str(), (double)short_of.bytes / GiB, source.c_str(),
        parts.c_str(), overridden ? ", or raise or unset ZERO2_MEMORY_LIMIT, which set this limit" : "");
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
  return (size_t)(device != z2::Device::cuda ? std::max(block, needed) : block);
}

// --- --plan: the table, the largest sizes, the JSON ---------------------------------

// The largest value in [1, cap] for which fits() holds, fits() being monotone
// (every category grows with the micro-batch and the layers); 0 if none.
static long largest_fitting(long cap, const std::function<bool(long)>& fits) {
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
static size_t formula_bytes(const RankPlan& p, z2::Precision precision) {
  return (size_t)z2::model_states_formula(p.stage, precision, (double)p.engine.psi_padded, p.world_size, p.offload);
}
// ZeRO-Offload's host bytes by the formula, 16 Psi/N (0 without offload).
static size_t host_formula_bytes(const RankPlan& p, z2::Precision precision) {
  return (size_t)z2::offloaded_states_formula(p.stage, precision, (double)p.engine.psi_padded, p.world_size, p.offload);
}

static json plan_row_json(const RankPlan& p, z2::Precision precision) {
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
          {"model_states_formula_bytes", formula_bytes(p, precision)},
          // ZeRO-Offload (0 without it): the host's share, by category as the ledger has it.
          {"offload", p.offload},
          {"host_master_bytes", p.engine.host_master},
          {"host_optimizer_bytes", 2 * p.engine.host_moment},
          {"host_params_bytes", p.engine.host_working},  // the updated shard rounded on its way up (mixed)
          {"host_grads_bytes", p.engine.host_grads},
          {"host_bookkeeping_bytes", p.engine.host_chunk_sums + p.engine.host_decay_flags},
          {"host_model_states_bytes", p.engine.host_model_states()},
          {"host_model_states_formula_bytes", host_formula_bytes(p, precision)}};
}

// The settings at world size N: DeepSpeed's batch rule (train_batch_size ->
// accumulation) and the masked-positions check depend on N, so each N of
// the plan is checked as a run at that N would be. Empty `why`: valid.
struct PlannedWorld {
  int world_size;
  Settings settings;
  std::string why;
};
static std::vector<PlannedWorld> planned_worlds(const Settings& settings, const std::vector<int>& sizes) {
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

// The table of one stage, rows by N, into `text` and `rows`. With
// --offload-optimizer cpu (stages 1, 2) the device columns shrink to what
// stays there and two columns give the host's share: measured from the
// sizes, and by the formula (16 Psi/N).
static void plan_stage_table(int stage, const std::vector<PlannedWorld>& worlds, z2::Precision precision,
                             std::string& text, json& rows) {
  const bool offload = stage > 0 && !worlds.empty() && worlds.front().settings.offload_optimizer == "cpu";
  char line[1024];
  snprintf(line, sizeof line, "\nstage %d (%s; model states by the formula %s%s%s)\n\n", stage,
           stage == 0   ? "DP"
           : stage == 1 ? "P_os"
                        : "P_os+g",
           z2::model_states_formula_text(stage, precision, offload),
           precision == z2::Precision::fp32 ? " in fp32" : ", the paper's K = 12",
           offload ? " on the device; ZeRO-Offload: 16 Psi/N on the host" : "");
  text += line;
  text +=
      "| N | params | grads | master | m, v | accumulation | staging | activations | bookkeeping | device peak | "
      "arena block | model states by the formula |";
  text += offload
              ? " host: offloaded | host by the formula |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
              : "\n|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  auto c = [](size_t v) { return z2::with_commas(v); };
  for (const PlannedWorld& world : worlds) {
    if (!world.why.empty()) {
      text += "| " + std::to_string(world.world_size) + " | not a valid run at this N: " + world.why + " |||||||||||" +
              (offload ? "||\n" : "\n");
      rows.push_back({{"stage", stage}, {"world_size", world.world_size}, {"refused", world.why}});
      continue;
    }
    const RankPlan p = plan_rank(world.settings, stage, world.world_size);
    rows.push_back(plan_row_json(p, precision));
    snprintf(line, sizeof line, "| %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |", world.world_size,
             c(p.engine.params).c_str(), c(p.engine.grads).c_str(), c(p.engine.master).c_str(),
             c(2 * p.engine.moment).c_str(), c(p.engine.accumulation_blocks * p.engine.accumulation_block).c_str(),
             c(p.engine.staging).c_str(), c(p.activation_peak).c_str(),
             c(p.engine.chunk_sums + p.engine.decay_flags).c_str(), c(p.live()).c_str(), c(p.arena_block()).c_str(),
             c(formula_bytes(p, precision)).c_str());
    text += line;
    if (offload) text += " " + c(p.engine.host_model_states()) + " | " + c(host_formula_bytes(p, precision)) + " |";
    text += "\n";
  }
}

// The largest micro-batch (with --layers as given) and the largest layer
// count (with --micro-batch as given) whose arena block fits `limit`, at one
// (stage, N), offloaded or not; psi: the parameters of that many layers.
struct Largest {
  long micro_batch = 0, layers = 0;
  size_t psi = 0;
};
static Largest largest_at(const PlannedWorld& world, int stage, bool offload, long limit, long batch_cap,
                          long layer_cap) {
  Settings base = world.settings;
  base.offload_optimizer = offload ? "cpu" : "none";
  auto fits = [&](int micro_batch, int layers) {
    Settings trial = base;
    trial.micro_batch = micro_batch, trial.layers = layers;
    return plan_rank(trial, stage, world.world_size).arena_block() <= (size_t)limit;
  };
  Largest most;
  most.micro_batch = largest_fitting(batch_cap, [&](long b) { return fits((int)b, base.layers); });
  most.layers = largest_fitting(layer_cap, [&](long l) { return fits(base.micro_batch, (int)l); });
  Settings deepest = base;
  deepest.layers = (int)std::max(1l, most.layers);
  most.psi = most.layers > 0 ? plan_rank(deepest, stage, world.world_size).psi : 0;
  return most;
}

// The table of the largest sizes for each (stage, N): micro-batch and layers
// with the flags as given, and the largest model (layers, Psi) without and
// with ZeRO-Offload: offloading the optimizer's 12 or 14 Psi/N (stage 2)
// leaves the device the working parameters, so more layers fit.
static void plan_largest(const std::vector<PlannedWorld>& worlds, long limit, std::string& text, json& largest) {
  const Settings& base = worlds.front().settings;
  const long batch_cap =
      std::min<long>(1 << 20, (long)(1.5e9 / ((double)base.seq * std::max(base.hidden, base.intermediate))));
  const long layer_cap = 256;  // the flags' own limits
  const bool offload = base.offload_optimizer == "cpu";
  char line[640];
  snprintf(line, sizeof line,
           "\nthe largest that fits in --device-memory-limit %s (its arena block; 0: not even 1 fits)\n"
           "micro-batch: with --layers %d as given; layers: with --micro-batch %d as given (--offload-optimizer %s);\n"
           "the largest model (layers, Psi) without and with --offload-optimizer cpu (stages 1 and 2)\n\n"
           "| stage | N | micro-batch | layers | largest model, no offload | largest model, offload cpu |\n"
           "|---|---|---|---|---|---|\n",
           z2::with_commas((size_t)limit).c_str(), base.layers, base.micro_batch, base.offload_optimizer.c_str());
  text += line;
  auto model = [&](const Largest& l) {
    return std::to_string(l.layers) + (l.layers == layer_cap ? " (the flag's limit)" : "") + " layers, " +
           z2::with_commas(l.psi);
  };
  auto as_json = [](const Largest& l) {
    return json{{"micro_batch", l.micro_batch}, {"layers", l.layers}, {"params", l.psi}};
  };
  size_t smallest = SIZE_MAX;
  int smallest_stage = 0, smallest_n = 1;
  for (int stage = 0; stage <= 2; ++stage)
    for (const PlannedWorld& world : worlds) {
      if (!world.why.empty()) continue;
      const Largest none = largest_at(world, stage, false, limit, batch_cap, layer_cap);
      const Largest cpu = stage > 0 ? largest_at(world, stage, true, limit, batch_cap, layer_cap) : none;
      const Largest& given = offload ? cpu : none;
      Settings one = world.settings;
      one.micro_batch = 1, one.layers = 1;
      const size_t floor = plan_rank(one, stage, world.world_size).arena_block();
      if (floor < smallest) smallest = floor, smallest_stage = stage, smallest_n = world.world_size;
      largest.push_back({{"stage", stage},
                         {"world_size", world.world_size},
                         {"micro_batch", given.micro_batch},
                         {"layers", given.layers},
                         {"micro_batch_cap", batch_cap},
                         {"layers_cap", layer_cap},
                         {"offload_none", as_json(none)},
                         {"offload_cpu", stage > 0 ? as_json(cpu) : json(nullptr)}});
      snprintf(line, sizeof line, "| %d | %d | %ld%s | %ld%s | %s | %s |\n", stage, world.world_size, given.micro_batch,
               given.micro_batch == batch_cap ? " (the flag's limit)" : "", given.layers,
               given.layers == layer_cap ? " (the flag's limit)" : "", model(none).c_str(),
               stage > 0 ? model(cpu).c_str() : "- (stage 0: no partition to offload)");
      text += line;
    }
  if (smallest > (size_t)limit)
    fail(
        "--device-memory-limit %s holds nothing: the smallest of the plan (stage %d, N = %d, micro-batch 1, 1 layer, "
        "the other flags as given) needs a %s-byte arena block",
        z2::with_commas((size_t)limit).c_str(), smallest_stage, smallest_n, z2::with_commas(smallest).c_str());
}

int run_plan(Settings settings, MPI_Comm world) {
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
           "A = %d, bucket %ld, overlap %s, --offload-optimizer %s.\n"
           "Psi = %s parameters. Every column is what the run allocates (notes/10); device peak = their sum (live "
           "bytes);\narena block = the smallest --device-memory-limit that trains with --alloc arena (each buffer "
           "rounded to 256).\n",
           shown.layers, shown.hidden, shown.heads, shown.intermediate, shown.micro_batch, shown.seq,
           z2::to_string(precision), shown.activations.c_str(), shown.alloc.c_str(), shown.accum, shown.bucket,
           shown.overlap ? "on" : "off", shown.offload_optimizer.c_str(), z2::with_commas(first.psi).c_str());
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
                {"offload_optimizer", shown.offload_optimizer},
                {"accum_given", settings.accum},
                {"device_memory_limit", settings.device_memory_limit}};
    agree_on_errors(
        world,
        [&] {
          if (rank == 0) write_output_file(settings.json_path, json_text(out, 1) + "\n");
        },
        "the plan was written");
  }
  fflush(stdout);
  return 0;
}

}  // namespace bert
