// zero2.h — the public API of zero2, a reference implementation of ZeRO stage 2
// (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
// Parameter Models", SC20). Plain C++ (no CUDA types): test files compiled by
// mpicxx and model files compiled by nvcc include the same declarations.
//
// The API comes first, in the order a user meets it (one part each below):
//   what you choose          EngineOptions, LossScaling
//   what the engine lays out ParameterInfo, BucketInfo (buckets, shards), StateRun
//   what it reports          StepReport, the ledgers, what a checkpoint holds
//   the engine               Engine (and LossScaler, fp16's loss scale)
//   the lab seams            the functions a course lab asks a student to write
//   the memory plan          what build() allocates, from the sizes alone (--plan)
//   the arithmetic of the stages (Z2_HD): the canonical summation tree,
//                            gradient accumulation, AdamW
//   the bucket exchange      BucketExchange, the collectives stage 2 trains with
// and then, one header each, what it runs on (runtime/, included at the end).
//
// zero2.cu is the chapter that implements them; which runtime/ file holds
// what is README's one reading map ("How to read it").
//
// Usage, in the shape of a training loop (tests/mlp_model.cu is a full example):
//
//   z2::Compute compute(z2::Device::cpu, local_rank);
//   z2::Communicator comm(compute, MPI_COMM_WORLD, z2::CommBackend::mpi,
//                         z2::Collectives::deterministic);
//   z2::Engine engine(compute, comm, options);           // options.stage = 2 ...
//   auto w = engine.add_parameter("layer.weight", out * in, /*decay=*/true);
//   engine.build();                                      // layout + allocation
//   init(engine.parameter(w));                           // same values on every rank
//   for (step) {
//     for (a = 0; a < options.accumulation_steps; ++a) {
//       long m = engine.micro_batch_index(a);            // which global micro-batch
//       forward(...);
//       float* g = engine.gradient_output(w);            // write dL/dw here ...
//       engine.gradient_ready(w);                        // ... then say so
//       engine.end_micro_step(loss_of_this_micro_batch);
//     }
//     z2::StepReport report = engine.step();            // clip, AdamW, all-gather
//   }
#pragma once

#include <mpi.h>
#if defined(_OPENMP)  // every build but the fuzz target's (Makefile: -fopenmp)
#include <omp.h>      // omp_get_thread_num: ZeRO-Offload's host threads (runtime/compute.h)
#endif

#include <cmath>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

// Z2_HD marks code that runs on both backends: a function (written
// `Z2_HD inline`); a loop body handed to Compute::for_each is written
// Z2_LOOP(i, { ... }) (runtime/compute.h).
#if defined(__CUDACC__)
#define Z2_HD __host__ __device__
#else
#define Z2_HD
#endif

// Z2_LAB_SEAM marks the engine's definition of a function a course lab asks
// students to write (notes/labs). In a lab build (-DZ2_LAB_BUILD, `make lab`)
// the definition is weak, so the student's file, linked beside it, replaces
// it; in every other build it is an ordinary function.
#if defined(Z2_LAB_BUILD)
#define Z2_LAB_SEAM __attribute__((weak))
#else
#define Z2_LAB_SEAM
#endif

namespace z2 {

class Compute;       // runtime/compute.h: the cpu | cuda backend, and sim (cuda's streams on the CPU)
struct Event;        // runtime/compute.h: a point in a stream's work
class Communicator;  // runtime/communicator.h: MPI, and NCCL for device buffers

// The precision of the working parameters and gradients (notes/08): fp32, or
// one of two 16-bit formats, stored as their bits (runtime/math.h converts).
enum class Precision { fp32, bf16, fp16 };
struct bfloat16 {
  uint16_t bits;
};
struct float16 {
  uint16_t bits;
};
const char* to_string(Precision precision);
inline size_t element_bytes(Precision precision) { return precision == Precision::fp32 ? 4 : 2; }
// Reading and writing an element of any of the three types (defined in runtime/math.h).
Z2_HD inline float to_float(float value);
Z2_HD inline float to_float(bfloat16 value);
Z2_HD inline float to_float(float16 value);
template <class T>
Z2_HD inline T from_float(float value);
template <class T>
constexpr Precision precision_of();  // the Precision a storage type stands for

// ----------------------------------------------------------------------------
// What you choose

// fp16's loss scaling, with DeepSpeed's "fp16" config keys and defaults
// (deepspeed/runtime/fp16/loss_scaler.py, DynamicLossScaler): the loss, and so
// every gradient, is multiplied by a power of two large enough that small
// gradients do not vanish below fp16's 2^-24, and small enough that none
// overflows 65504. An overflow anywhere skips the step and, after
// `hysteresis` of them, halves the scale; `window` clean steps double it.
struct LossScaling {
  double static_scale = 0;              // "loss_scale": > 0 a fixed scale (no halving or doubling), 0 dynamic
  int initial_scale_power = 16;         // "initial_scale_power": the dynamic scale starts at 2^this
  long window = 1000;                   // "loss_scale_window": clean steps before the scale doubles
  int hysteresis = 2;                   // "hysteresis": overflows before the scale halves (DeepSpeed's delayed_shift)
  bool consecutive_hysteresis = false;  // "consecutive_hysteresis": a clean step restores the hysteresis
  double min_scale = 1;                 // "min_loss_scale": an overflow at this scale stops the run
};

struct EngineOptions {
  int stage = 2;                   // 0: data parallel, 1: P_os, 2: P_os+g
  long bucket_elements = 1 << 20;  // rounded up to a multiple of norm_chunk
  bool overlap = true;             // reduce buckets while backward goes on
  int accumulation_steps = 1;      // A micro-steps per optimizer step
  double clip = 0.0;               // global-norm clipping threshold; <= 0: off
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
  // Adam's bias corrections 1 / (1 - beta1^t) and sqrt(1 - beta2^t), as
  // torch applies them; false drops both (DeepSpeed's FusedAdam
  // bias_correction false, as bing_bert trains).
  bool bias_correction = true;
  // Learning rate of optimizer step `step` (1-based, as torch counts); when
  // empty, `lr` is used throughout. This is the hook for warmup and decay.
  std::function<double(long step)> lr_schedule;
  // Adam's (beta1, beta2) of optimizer step `step` (1-based), when a
  // scheduler sets them per step (DeepSpeed's OneCycle with cycle_momentum:
  // beta1 cycles, beta2 is 0.99; trainer/settings.cpp); when empty, beta1 and
  // beta2 throughout. The bias corrections take the step's own betas, as
  // torch's AdamW and DeepSpeed's FusedAdam do (1 - beta1^t with this beta1).
  std::function<std::pair<double, double>(long step)> betas_schedule;
  // Mixed precision (notes/08): bf16 or fp16 working parameters and
  // gradients (2 bytes each), fp32 master weights and AdamW state. fp32: the
  // parameters are their own master copy.
  Precision precision = Precision::fp32;
  // A > 1 in mixed precision: the accumulation tree's blocks in fp32
  // (data_types.grad_accum_dtype "fp32", zero2's default), or 16-bit (what
  // DeepSpeed does under ZeRO when the key is absent). Only fp32 blocks keep
  // (N, A) invariance: a 16-bit block rounds a partial sum.
  bool accumulate_fp32 = true;
  LossScaling loss_scaling;  // fp16 only
  // ZeRO-Offload (Ren et al., "ZeRO-Offload", USENIX ATC 2021; DeepSpeed's
  // zero_optimization.offload_optimizer {"device": "cpu"}): stages 1 and 2
  // only. The optimizer state (fp32 master, m, v), the reduced gradient
  // shard and the step itself live in pinned host memory: each bucket's
  // reduced shard is copied down as its reduce-scatter ends, the norm,
  // overflow check and AdamW run on the host (the same Z2_LOOP bodies, as
  // CPU loops), and the updated shard goes back up before its all-gather.
  // The device keeps the working parameters (and stage 1 its full gradient
  // buffer). Same bits as without it (zero2.cu, "The step").
  bool offload_optimizer = false;
  // ZeRO-Offload's host step on this many threads per rank (the norm's
  // chunk sums, the largest |g|, AdamW), each owning whole norm chunks, so
  // the bits are the same at any count. 0: this rank's share of the node's
  // cores (runtime/communicator.h, host_cores_per_rank; at least 1).
  // DeepSpeedCPUAdam takes torch's thread count (OMP_NUM_THREADS).
  int host_threads = 0;
};

// ----------------------------------------------------------------------------
// What the engine lays out (zero2.cu, "Layout")

// The global gradient norm is computed over fixed chunks of this many elements
// of the canonical layout (every parameter starts on a chunk boundary), so it
// is independent of N and of the bucket size (notes/06).
constexpr long norm_chunk = 32;

using ParameterId = int;

struct ParameterInfo {
  std::string name;
  size_t numel = 0;
  bool decay = true;
  size_t canonical_offset = 0;  // in the canonical layout (chunk-aligned, N-independent)
  size_t offset = 0;            // in the padded flat buffer (depends on N and bucket)
  int bucket = -1;
};

struct BucketInfo {
  int first_parameter = 0, end_parameter = 0;  // [first, end) in registration order
  size_t offset = 0;                           // start in the padded flat buffer
  size_t length = 0;                           // elements the parameters span (a multiple of norm_chunk)
  size_t padded_length = 0;                    // length rounded up to a multiple of N * norm_chunk
  size_t shard_length = 0;                     // padded_length / N
  size_t shard_offset = 0;                     // start of this bucket's shard in shard space
  size_t canonical_chunk = 0;                  // index of its first norm chunk in the canonical layout
};

// A piece of the canonical order (real elements only, registration order:
// what parameters_to_host() lists) whose optimizer state one rank updates.
struct StateRun {
  size_t canonical = 0;  // first element, in the canonical order
  size_t length = 0;
};

// ----------------------------------------------------------------------------
// What it reports, and what a checkpoint holds

struct StepReport {
  long step = 0;        // 1-based: step() calls so far, skipped ones included (DeepSpeed's global_steps)
  long applied = 0;     // optimizer updates made so far (AdamW's t; the lr schedule's position)
  float loss = 0;       // canonical-tree sum of the micro-batch loss contributions
  float grad_norm = 0;  // global L2 norm before clipping (unscaled; inf or NaN on an fp16 overflow)
  float clip_coefficient = 1;
  double lr = 0;                // the learning rate of the update (of the update it would have been, when skipped)
  double beta1 = 0, beta2 = 0;  // Adam's betas of the update (EngineOptions::betas_schedule, or beta1 and beta2)
  double loss_scale = 1;        // the scale this step's gradients carry (fp16; 1 otherwise)
  bool skipped = false;         // fp16: a gradient overflowed on some rank, so no rank updated
};

// What a loss scaler carries from step to step: a checkpoint holds it, and
// a resumed run goes on with the same scale, hysteresis and window.
struct LossScalerState {
  double scale = 1;
  int hysteresis_left = 1;
  long iteration = 0, last_overflow = -1;
};

// The fp32 optimizer state of some runs of the canonical order, run after
// run: the master weights (the parameters themselves in fp32), AdamW's
// first and second moments (torch's exp_avg, exp_avg_sq).
struct OptimizerState {
  std::vector<float> master, exp_avg, exp_avg_sq;
};

// Where training stands, beyond the tensors: what a checkpoint must hold
// besides the optimizer state for a resumed run to continue bit for bit.
struct TrainingProgress {
  long steps_taken = 0;  // step() calls (skipped included): the data's position
  long applied = 0;      // updates made (AdamW's t): the learning-rate schedule's position
  long skipped = 0;      // fp16 steps skipped on overflow
  LossScalerState scaler;
};

// Bytes this rank sent, by collective. Counted as a ring algorithm sends them,
// (N-1)/N of the buffer per reduce-scatter or all-gather, so the deterministic
// all-to-all and the libraries' own collectives are counted alike.
struct CommCounters {
  size_t reduce_scatter = 0, all_gather = 0, all_reduce = 0, other = 0;
  size_t total() const { return reduce_scatter + all_gather + all_reduce + other; }
};

struct MemoryLedger {
  Precision precision = Precision::fp32;
  size_t params = 0, grads = 0, optimizer = 0, master = 0;  // model states (measured)
  size_t accumulation = 0, staging = 0, activations = 0, bookkeeping = 0;
  size_t model_states = 0;          // params + grads + optimizer + master
  size_t model_states_formula = 0;  // the paper's formula for this stage, from Psi_padded (device bytes)
  // ZeRO-Offload: the model states held in pinned host memory, by category
  // (0 without offload), and their formula, 16 Psi/N in every precision.
  // host_params is the updated shard rounded on its way up (mixed only: the
  // engine's host_working buffer, counted with the parameters it becomes).
  bool offload_optimizer = false;
  size_t host_params = 0, host_grads = 0, host_optimizer = 0, host_master = 0, host_bookkeeping = 0;
  size_t host_model_states = 0;  // host_params + host_grads + host_optimizer + host_master
  size_t host_model_states_formula = 0;
  size_t accumulation_formula = 0;  // floor(log2 A) blocks of Psi_padded / N (fp32 or 16-bit elements)
  size_t staging_formula = 0;
  size_t device_current = 0, device_peak = 0, host_pinned = 0;
  // reserved: the peak of the device memory held for the buffers. With
  // Allocator::direct every buffer is its own allocation, so reserved = peak
  // live; with arena and naive it is the peak of the block's used part (see
  // Compute). fragmentation = 1 - peak live / peak reserved.
  size_t reserved = 0, capacity = 0, host_offload_peak = 0;
  double fragmentation = 0;
  // Allocator calls made after the end of optimizer step 1 (-1 before it),
  // and in the last step; arena stack pushes in the last step.
  long device_allocations_after_step1 = -1, device_allocations_per_step = 0, stack_pushes_per_step = 0;
  long device_mallocs = 0;  // cudaMalloc calls (host allocations on cpu) in all
};

struct CommLedger {
  CommCounters per_step;        // measured in the last step
  size_t formula_per_step = 0;  // reduce_scatter + all_gather + all_reduce, from the formula
};

// ----------------------------------------------------------------------------
// The engine (zero2.cu)

// DeepSpeed's DynamicLossScaler.update_scale, step by step (its LossScaler
// when the scale is static; scale 1 and no updates outside fp16).
class LossScaler {
 public:
  LossScaler(const LossScaling& settings, bool fp16);
  LossScalerState state() const { return {scale_, hysteresis_left_, iteration_, last_overflow_}; }
  void restore(const LossScalerState& state);
  double scale() const { return scale_; }
  bool dynamic() const { return dynamic_; }
  int hysteresis_left() const { return hysteresis_left_; }
  long iteration() const { return iteration_; }          // update() calls so far (DeepSpeed's cur_iter)
  long last_overflow() const { return last_overflow_; }  // the iteration of the last overflow, -1 if none
  // After every step's overflow check, on every rank with the same verdict.
  // Throws z2::Error when an overflow comes at the minimum scale with no
  // hysteresis left (DeepSpeed raises "Current loss scale already at minimum").
  void update(bool overflow);

 private:
  LossScaling settings_;
  bool dynamic_ = false;
  double scale_ = 1;
  int hysteresis_left_ = 1;
  long iteration_ = 0, last_overflow_ = -1;
};

// This rank's model-state buffers as the runtime's host copies, checkpoint
// state and ledger report see them (runtime/engine_state.h).
struct ModelStates;

class Engine {
 public:
  Engine(Compute& compute, Communicator& comm, const EngineOptions& options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Register parameters in layer order (first layer first): stage 2 then
  // reduces the last layers' bucket while backward still works on the first.
  ParameterId add_parameter(const std::string& name, size_t numel, bool decay);
  void build();  // fix the layout and allocate; after this, no more parameters

  // The full (working) parameter: every stage keeps all parameters on every
  // rank, in the precision's type (fp32, or the 16-bit copy of the master).
  // Writes here after build() and before the first step() set the run's
  // values in fp32; later ones, and any in mixed precision, go through
  // parameters_from_host() (the master is elsewhere: the own shard's, or with
  // ZeRO-Offload the host's, which the next step would write back).
  // `T` must be that type (float, bfloat16 or float16); parameter() is the fp32 form.
  template <class T>
  T* parameter_as(ParameterId id) {
    return static_cast<T*>(parameter_storage(id, precision_of<T>()));
  }
  float* parameter(ParameterId id) { return parameter_as<float>(id); }
  // Where backward writes the gradient of `id` for this micro-step (overwrite,
  // do not accumulate), in the same type, and the call that hands it over.
  // In fp16 the model multiplies its loss gradient by loss_scale() first.
  template <class T>
  T* gradient_output_as(ParameterId id) {
    return static_cast<T*>(gradient_storage(id, precision_of<T>()));
  }
  float* gradient_output(ParameterId id) { return gradient_output_as<float>(id); }
  void gradient_ready(ParameterId id);
  Precision precision() const { return options_.precision; }
  float loss_scale() const { return (float)scaler_.scale(); }  // for this step's backward
  const LossScaler& loss_scaler() const { return scaler_; }
  long skipped_steps() const { return skipped_steps_; }
  // The threads ZeRO-Offload's host step runs on (EngineOptions::host_threads, resolved at build).
  int host_threads() const;
  // Between layers: lets MPI make progress on buckets in flight.
  void progress();
  // End of a micro-step's backward. `loss` is this micro-batch's contribution
  // to the step's loss (its sum of per-sample losses over the global count).
  void end_micro_step(float loss);
  // After accumulation_steps micro-steps: norm, clipping, AdamW, all-gather.
  StepReport step();

  // The global micro-batch this rank computes at micro-step `a`: a*N + rank
  // (the interleaved assignment of notes/06).
  long micro_batch_index(int a) const;
  int world_size() const;
  int rank() const;
  int micro_steps_done() const { return micro_steps_done_; }
  // Buckets whose reduction started before end_micro_step() in the last
  // micro-step: all of them with overlap (or in stage 2), none without.
  int buckets_reduced_during_backward() const;

  // Layout and shards (for tests, ledgers, notes).
  const std::vector<ParameterInfo>& parameters() const { return parameters_; }
  const std::vector<BucketInfo>& buckets() const { return buckets_; }
  size_t psi() const;         // real parameter elements
  size_t psi_padded() const;  // elements of the padded flat buffer
  size_t canonical_elements() const { return canonical_elements_; }
  // [begin, end) of bucket `bucket`'s shard owned by `rank` in the padded buffer.
  std::pair<size_t, size_t> shard_range(int bucket, int rank) const;

  // --- host copies (runtime/host_copies.cpp) ---
  // The fp32 parameters in canonical order, real elements only, on the
  // host: the master weights in mixed precision. Collective (every rank
  // calls it): in mixed precision stages 1 and 2 hold the master sharded.
  std::vector<float> parameters_to_host();
  // Sets the master weights and the working copy (rounded) from fp32 values.
  void parameters_from_host(const std::vector<float>& canonical);
  uint64_t parameters_hash();  // FNV-1a 64 over parameters_to_host(); collective
  // The working parameters forward and backward use, widened to float
  // (equal to parameters_to_host() in fp32). Every rank holds them all.
  std::vector<float> working_parameters_to_host();
  // The step's reduced gradient (sum over all micro-batches, before clipping;
  // fp16's loss scale divided out) in canonical order, real elements only.
  // Valid after the last end_micro_step() and before step(). Collective in
  // stages 1 and 2, where each rank holds its shards of it (for --dump-batch,
  // --trace and the reference checks).
  std::vector<float> gradients_to_host();
  // The gradient buffer as it is, widened to float: [Psi_padded] in stages 0
  // and 1, this rank's shards [Psi_padded / N] in stage 2 (fp16's loss scale
  // still in). After the last end_micro_step() and before step(); the labs'
  // graders read it.
  std::vector<float> gradient_buffer_to_host();

  // --- checkpoints (notes/09; runtime/checkpoint_state.cpp) ---
  // The runs of the canonical order whose optimizer state `rank` updates:
  // every element in stage 0, its shard of every bucket in stages 1 and 2.
  std::vector<StateRun> owned_state_runs(int rank) const;
  // This rank's optimizer state for owned_state_runs(rank()), run after run.
  OptimizerState owned_state_to_host();
  // Sets this rank's optimizer state (the same layout), then rebuilds the
  // working parameters from the master on every rank. Collective.
  void owned_state_from_host(const OptimizerState& state);
  // The optimizer state of [begin, end) of the canonical order, whatever
  // rank holds it (each rank asks for its own range; stages 1 and 2
  // exchange the pieces with one all-to-all). Collective.
  OptimizerState state_range_to_host(size_t begin, size_t end);
  TrainingProgress training_progress() const;
  void restore_training_progress(const TrainingProgress& progress);

  // --- the ledgers: measured beside the formulas (zero2.cu), printed
  // (runtime/ledger_report.cpp) ---
  MemoryLedger memory_ledger() const;
  CommLedger comm_ledger() const;
  void print_ledgers(FILE* out) const;  // rank 0 should call it
  std::string ledgers_json() const;

  const EngineOptions& options() const { return options_; }
  long optimizer_steps() const { return updates_applied_; }

  // What this rank holds for the engine (zero2.cu, "The stage buffers"): its model-state
  // buffers, full or sharded by stage, its bucket exchange and the micro-step's
  // bookkeeping, with the kernels and steps that work on them.
  struct RankState;

 private:
  void require_built(const char* what) const;
  void* parameter_storage(ParameterId id, Precision expected);
  void* gradient_storage(ParameterId id, Precision expected);
  std::vector<float> canonical_from_padded(const std::vector<float>& padded) const;  // runtime/host_copies.cpp
  std::vector<float> padded_from_shards(const std::vector<float>& shards, const char* what) const;  // collective
  // This rank's buffers for the runtime's host copies, checkpoint state and
  // ledger report, and every rank's update regions to every rank outside the
  // ledger (after a checkpoint is loaded): zero2.cu.
  ModelStates model_states() const;
  void all_gather_untracked();
  // fp16's overflow check and the loss scale's move, at every fp16 step (zero2.cu, "The step").
  bool overflow_skips_step(const std::vector<float>& local, StepReport& report);
  // The parameters were set from outside the step: with ZeRO-Offload in
  // fp32 the host's master copy is taken from them again at the next step.
  void parameters_written();
  Compute& compute_;
  Communicator& comm_;
  EngineOptions options_;
  std::vector<ParameterInfo> parameters_;
  std::vector<BucketInfo> buckets_;
  size_t canonical_elements_ = 0;
  bool built_ = false;
  // Three counters, three names: micro-steps of the step under way, AdamW
  // updates made (its t), step() calls (skipped ones included). The Engine
  // writes them and its layout; RankState (zero2.cu) reads them and writes
  // only its own state, the buffers and the micro-step's bookkeeping.
  int micro_steps_done_ = 0;
  long updates_applied_ = 0;
  long step_calls_ = 0;
  long skipped_steps_ = 0;
  LossScaler scaler_;
  std::unique_ptr<RankState> rank_state_;
};

// ----------------------------------------------------------------------------
// The lab seams (notes/labs)
// Functions of the engine a student can write in its place and have the
// suite grade bit for bit (`make lab LAB=<name> SOLUTION=<file>`). Each is
// called by the engine wherever it needs that idea, so a wrong one breaks the
// stages' equality, not only its own test.
//
//   tree-sum        tree_sum: the canonical summation tree (notes/06). The
//                   engine sums the N ranks' slices, the loss and the norm's
//                   chunk sums with it.
//   reduce-scatter  reduce_scatter_blocking, all_gather_blocking: the plain
//                   blocking collectives over MPI, the reference the engine's
//                   non-blocking bucket exchange is tested against.
//   shards          shard_begin: where rank r's shard of a bucket starts, the
//                   partition of P_os and P_os+g (paper sections 5.1, 5.2).
//   loss-scale      LossScaler::update (above): fp16's dynamic loss scale.
//   arena           arena_allocate, arena_push, arena_pop, arena_release
//                   (ArenaBooks, below): ZeRO-R's contiguous memory
//                   (paper section 6.3), a bump region and a LIFO stack.
//   reshard         reshard_reads: which pieces of a checkpoint saved at any N
//                   fill the optimizer state a rank owns.
//   offload         checkpoint_to_prefetch (below): which activation
//                   checkpoint comes back from the host, one block ahead.
//   streams         checkpoint_copy (below): a checkpoint's copy on the copy
//                   stream, ordered between the compute stream's work by
//                   events (graded on the simulated device, --device sim).
//   own-shards      update_region, update_and_gather: stage 1's optimizer step
//                   (P_os, paper 5.1), AdamW on the own shard of every bucket,
//                   then the all-gather of the updated shards.
//   gradient-shards stage2_gradient_output, stage2_gradient_ready: stage 2's
//                   backward (P_os+g, paper 5.2), a staging slot per bucket,
//                   reduce-scattered as soon as the bucket is complete, only
//                   the own shard of the sum kept.

// The canonical tree (canonical_tree_sum, "The arithmetic of the stages") over leaves [n].
float tree_sum(long n, const float* leaves);
// Blocking, deterministic, fp32, over every rank of `comm` (N ranks):
// bucket [N x shard_elements] on every rank; rank r receives in shard
// [shard_elements] element i of the sum over ranks j = 0..N-1 of bucket_j[r
// shard_elements + i], summed with tree_sum in rank order.
void reduce_scatter_blocking(const float* bucket, float* shard, size_t shard_elements, MPI_Comm comm);
// shard [shard_elements] of every rank into bucket [N x shard_elements], rank
// r's at r x shard_elements.
void all_gather_blocking(const float* shard, float* bucket, size_t shard_elements, MPI_Comm comm);
// The first element of rank `rank`'s shard of `bucket` in the padded flat
// buffer (parameters, full gradients): the bucket's offset plus `rank` shards.
size_t shard_begin(const BucketInfo& bucket, int rank);

// The own-shards lab. A rank's update region of a bucket: the elements whose
// AdamW update it makes, in the three index spaces the engine's buffers use
// (all in elements):
//   parameter  in the padded flat buffer of parameters [Psi_padded];
//   gradient   in the gradient buffer: [Psi_padded] in stages 0 and 1 (the
//              full gradient), [Psi_padded / N] in stage 2 (the own shards,
//              one bucket's after another);
//   state      in the optimizer-state buffers (AdamW's m and v, and the fp32
//              master in mixed precision): [Psi_padded] in stage 0, [Psi_padded
//              / N] in stages 1 and 2;
//   length     how many elements, the same run in each.
struct UpdateRegion {
  size_t parameter = 0, gradient = 0, state = 0, length = 0;
};
UpdateRegion update_region(const BucketInfo& bucket, int stage, int rank);
// What the engine lends update_and_gather (the calls are the engine's own):
class OwnShards {
 public:
  virtual ~OwnShards() = default;
  // AdamW, with this step's constants, on update_region(bucket, stage, rank).
  virtual void adamw(int bucket) = 0;
  // Start the all-gather of bucket `bucket`'s parameters, in place: rank r's
  // shard, from shard_begin(bucket, r), to every rank. The engine waits for
  // every all-gather after update_and_gather returns.
  virtual void all_gather(int bucket) = 0;
};
// The stage's optimizer step over `buckets` (the engine's layout): the AdamW
// updates this rank makes and the all-gathers that follow them.
void update_and_gather(OwnShards& shards, const std::vector<BucketInfo>& buckets, int stage);

// The gradient-shards lab. Stage 2's backward has no full gradient buffer:
// a bucket's gradients are written into one of a few staging slots (two),
// and the slot comes back once the bucket's reduce-scatter has finished.
// What the engine lends the two hooks below (the calls are the engine's own;
// each refuses a call out of order with a message):
class GradientShards {
 public:
  virtual ~GradientShards() = default;
  // Does bucket `bucket` hold a slot now (from its take_slot to the end of its reduce-scatter)?
  virtual bool holds_slot(int bucket) const = 0;
  // Take a free slot for the bucket and zero its buffer [padded_length],
  // waiting for the oldest reduce-scatter when no slot is free.
  virtual void take_slot(int bucket) = 0;
  // Element `index` of the bucket's slot buffer, where backward writes.
  virtual void* slot_element(int bucket, size_t index) = 0;
  // How many of the bucket's parameters have been handed over in this
  // micro-step, the one being handed over included.
  virtual int handed_over(int bucket) const = 0;
  // Start the reduce-scatter of the bucket's slot (non-blocking): this rank's
  // shard of the sum over ranks is kept from element `keep` of the gradient
  // shard [Psi_padded / N] (through the accumulation tree when A > 1).
  virtual void reduce_scatter(int bucket, size_t keep) = 0;
};
// Where backward writes the gradient of a parameter of bucket `bucket` that
// begins `offset_in_bucket` elements into it (the engine's gradient_output in stage 2).
void* stage2_gradient_output(GradientShards& shards, int bucket_index, const BucketInfo& bucket,
                             size_t offset_in_bucket);
// Parameter `parameter` of bucket `bucket` has been handed over (the
// engine's gradient_ready in stage 2).
void stage2_gradient_ready(GradientShards& shards, int bucket_index, const BucketInfo& bucket, int parameter);

// Resharding a checkpoint (notes/09; the reshard lab's seam). A checkpoint
// is files that each hold one range of the canonical order, together
// [0, Psi) in order (`files`, as runs); a rank of the loading run owns
// `owned` (Engine::owned_state_runs, at its own N and stage). The reads that
// fill the owned state, in order: read k copies elements [canonical,
// canonical + length) of the canonical order from file `file` to position
// `into` of the owned state (the owned runs one after another).
struct ReshardRead {
  size_t file = 0, canonical = 0, length = 0, into = 0;
};
std::vector<ReshardRead> reshard_reads(const std::vector<StateRun>& owned, const std::vector<StateRun>& files);

// The arena's books, kept apart from the memory they describe (the arena
// lab's seams, notes/labs): offsets into one block of `capacity` bytes.
// [0, bottom) holds the long-lived buffers, [top, capacity) the stack of
// temporaries, and the free memory is the middle, always one piece. Sizes
// come rounded (Compute rounds every request to its block size).
struct ArenaBooks {
  size_t capacity = 0, bottom = 0, top = 0;
  std::vector<size_t> stack;  // the offset of every pushed buffer, oldest first
};
constexpr size_t arena_full = SIZE_MAX;  // what allocate and push return when the middle is too small
// A long-lived buffer from the bottom (a bump pointer), or a temporary
// from the top: its offset, or arena_full.
size_t arena_allocate(ArenaBooks& books, size_t bytes);
size_t arena_push(ArenaBooks& books, size_t bytes);
// A temporary back: it must be the last one pushed (the stack is last in,
// first out), else usage_error.
void arena_pop(ArenaBooks& books, size_t offset, size_t bytes);
// A long-lived buffer back: the bump pointer steps back over it when it is
// the last one; any other keeps its place (the arena never fills a hole).
void arena_release(ArenaBooks& books, size_t offset, size_t bytes);

// ZeRO-R's activation offload (paper section 6.1, "CPU offload"; the offload
// lab's seam): a model of `layers` blocks keeps block l's input, checkpoint
// l, on the host between forward and backward for l = 0 .. layers-2 (the
// last block's input stays). Backward runs block = layers-1 down to 0;
// before each block's backward the model starts copying back the checkpoint
// this returns (-1: none) on the copy stream, and block l waits for
// checkpoint l. One block ahead, the copy of checkpoint l-1 overlaps block
// l's backward, and at most two checkpoints are on the device at once.
int checkpoint_to_prefetch(int block, int layers);
// The streams lab: one checkpoint's trip, to the host after forward wrote it
// or back into its slot before backward (the model's offload and prefetch).
// Copy `bytes` from `source` to `destination` on the copy stream once the
// work the compute stream has queued so far is done (`ready`: the caller's
// event, free to record), and record `copied` where the copy is done; the
// compute stream waits for `copied` before it reads the checkpoint or reuses
// its buffer. The host waits for nothing: the copy overlaps the next block.
void checkpoint_copy(Compute& compute, void* destination, const void* source, size_t bytes, Event ready, Event copied);

// ----------------------------------------------------------------------------
// The memory plan (train_bert_mini --plan; notes/10)
// What build() lays out and allocates, from the parameter sizes alone, with
// no engine and no allocation: the planner and build() call these, so the
// plan and the measured ledger cannot drift apart.
std::vector<BucketInfo> lay_out_buckets(const std::vector<size_t>& numels, int world_size, long bucket_elements);
struct EngineBuffers {                           // bytes of each buffer build() allocates
  size_t psi_padded = 0, max_padded_bucket = 0;  // elements
  size_t params = 0, grads = 0, master = 0;
  size_t moment = 0;  // each of AdamW's m and v
  size_t accumulation_blocks = 0, accumulation_block = 0;
  size_t staging = 0, chunk_sums = 0, decay_flags = 0;
  // ZeRO-Offload (options.offload_optimizer): what moves to pinned host
  // memory, in bytes; 0 without it. Mixed precision: the reduced gradient
  // shard as it comes off the wire (16-bit) and the updated shard rounded on
  // its way up (16-bit); fp32: the gradient shard and the master's fp32 copy.
  size_t host_master = 0, host_moment = 0, host_grads = 0, host_working = 0;  // host_moment: each of m and v
  size_t host_chunk_sums = 0, host_decay_flags = 0;
  size_t model_states() const;       // params + grads + master + m + v (device)
  size_t host_model_states() const;  // host_master + 2 host_moment + host_grads + host_working
  size_t live() const;               // every device buffer
  size_t host_live() const;          // every host buffer of the offloaded optimizer
  size_t reserved() const;           // every device buffer rounded up to 256 bytes, as a block serves it
};
EngineBuffers engine_buffers(const std::vector<BucketInfo>& buckets, const EngineOptions& options, int world_size);
// Staging elements of the bucket exchange (of the wire type).
size_t staging_elements(size_t max_padded_bucket, int world_size, int slot_count, bool bucket_buffers);
// floor(log2 A): how many open blocks the accumulation tree of A micro-steps
// keeps (each Psi_padded / N elements).
size_t accumulation_blocks(int accumulation_steps);

// The paper's model-state bytes per rank (section 3.1 and Table 1), for Psi
// parameters over N ranks: the one formula the ledger, the fit check and
// the paper's table in notes/08 all use.
//   fp32:            stage 0: 16 Psi   stage 1: 8 Psi + 8 Psi/N    stage 2: 4 Psi + 12 Psi/N
//   bf16, fp16 (K = 12): 16 Psi             4 Psi + 12 Psi/N            2 Psi + 14 Psi/N
// With ZeRO-Offload (stages 1 and 2) the device keeps the working parameters
// (stage 1 also its full gradient buffer): fp32 4 Psi (stage 1: 8 Psi), mixed
// 2 Psi (4 Psi), and the host holds offloaded_states_formula(): 16 Psi/N.
double model_states_formula(int stage, Precision precision, double psi, double ranks, bool offload = false);
const char* model_states_formula_text(int stage, Precision precision, bool offload = false);  // e.g. "2 Psi + 14 Psi/N"
double offloaded_states_formula(int stage, Precision precision, double psi, double ranks, bool offload);  // host bytes
const char* offloaded_states_formula_text(bool offload);  // "16 Psi/N", or "0"
// ----------------------------------------------------------------------------
// The arithmetic of the stages (Z2_HD: the CPU loops and the kernels share it)

// The canonical summation tree (notes/06). Float addition is not
// associative, so "the sum" of n numbers is only defined once we fix the tree.
// Ours is the left-complete pairwise tree: a range of n > 1 leaves splits after
// its first p leaves, p = the largest power of two below n.
//
// We evaluate it with a binary counter instead of recursion, so it runs in a
// CUDA thread with a fixed-size stack: leaf k is pushed, then merged with the
// stack top once for every trailing one bit of k (each merge closes a perfect
// subtree of equal size), and at the end the stack (block sizes falling) is
// folded from the right. For n = 7 that is ((0+1)+(2+3)) + ((4+5)+6).
//
// `leaf(k)` returns leaf k. The same function sums the N ranks' slices of a
// bucket, the squares inside a norm chunk, the chunk sums, and the loss.
Z2_HD inline int count_bits(unsigned long x) {
  int bits = 0;
  for (; x; x &= x - 1) ++bits;
  return bits;
}
template <class Leaf>
Z2_HD inline float canonical_tree_sum(long n, Leaf leaf) {
  float stack[40];  // one entry per bit of n: enough for any n < 2^40
  int depth = 0;
  for (long k = 0; k < n; ++k) {
    float value = leaf(k);
    for (unsigned long closed = (unsigned long)k; closed & 1ul; closed >>= 1) value = stack[--depth] + value;
    stack[depth++] = value;
  }
  float sum = depth > 0 ? stack[--depth] : 0.0f;
  while (depth > 0) sum = stack[--depth] + sum;
  return sum;
}

// The canonical tree over the N ranks' slices of one element (zero2.cu's
// receiver's sum): canonical_tree_sum, or in a lab build (notes/labs) the
// student's tree_sum over the leaves, at most 64 (runtime/lab_build.h).
template <class Leaf>
Z2_HD inline float sum_over_ranks(long ranks, Leaf leaf) {
#if defined(Z2_LAB_BUILD)
  float leaves[64];  // a lab build refuses more ranks (check_lab_ranks)
  for (long j = 0; j < ranks; ++j) leaves[j] = leaf(j);
  return tree_sum(ranks, leaves);
#else
  return canonical_tree_sum(ranks, leaf);
#endif
}

// The same tree, fed over time: the A micro-step results of one optimizer step
// arrive one by one (notes/06, the interleaved assignment). `stack`
// holds the open blocks of earlier micro-steps (at most floor(log2 A) of them,
// one buffer each); `micro_step` is this one (0-based) of `micro_steps`.
// Before the last the new value is pushed exactly as in canonical_tree_sum;
// at the last the stack is folded from the right into `result`.
// In mixed precision `value` is the fp32 sum of the ranks' 16-bit slices, the
// blocks are fp32 (`Accum` = float, grad_accum_dtype "fp32") or 16-bit, and
// `result` is the 16-bit gradient: with fp32 blocks the sums happen in fp32
// and only the finished sum is rounded, once (notes/08).
template <class Accum = float>
struct AccumulationStackOf {
  Accum* entries[32];  // entries[d][i]: element i of open block d (A < 2^32)
};
using AccumulationStack = AccumulationStackOf<float>;
template <class Accum, class Result>
Z2_HD inline void accumulate_micro_step(const AccumulationStackOf<Accum>& stack, long micro_step, long micro_steps,
                                        float value, Result* result, size_t i) {
  int depth = count_bits((unsigned long)micro_step);  // open blocks before this push
  if (micro_step == micro_steps - 1) {
    while (depth > 0) value = to_float(stack.entries[--depth][i]) + value;
    result[i] = from_float<Result>(value);
    return;
  }
  for (unsigned long closed = (unsigned long)micro_step; closed & 1ul; closed >>= 1)
    value = to_float(stack.entries[--depth][i]) + value;
  stack.entries[depth][i] = from_float<Accum>(value);
}

// canonical_tree_sum of a power-of-two count of leaves, by levels: the pairs
// of leaves, then the pairs of pairs, ... A perfect tree has one shape, so
// these are the same additions in the same order, written as loops the CPU
// can vectorise (each level reads `from` and writes `to`, then they swap).
// `leaves` [n] is overwritten.
template <int n>
Z2_HD inline float perfect_tree_sum(float* leaves) {
  static_assert(n > 0 && (n & (n - 1)) == 0, "n must be a power of two");
  float scratch[n / 2 > 0 ? n / 2 : 1];
  float *from = leaves, *to = scratch;
  for (int width = n / 2; width >= 1; width /= 2) {
    for (int k = 0; k < width; ++k) to[k] = from[2 * k] + from[2 * k + 1];
    float* swap = from;
    from = to, to = swap;
  }
  return from[0];
}

// AdamW exactly as torch.optim.AdamW (single-tensor path, amsgrad off):
//   p <- p * (1 - lr * wd);  m <- m + (g - m)(1 - b1);  v <- v*b2 + (1 - b2) g^2
//   p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// `grad_scale` is the clipping coefficient (1 when not clipping); torch
// multiplies the gradient by it in place before the optimizer reads it, and
// so do we, element by element.
// Scalars are computed in double on the host, as torch does in Python, and
// rounded to float once; the element-wise operations follow the formulas of
// torch's scalar CPU kernels (lerp in its two branches; addcmul:
// v + (c * g) * g; addcdiv: p + (c * m) / d). Bitwise equality with torch is
// not claimed: its vectorized kernels fuse multiply-adds.
struct AdamWConstants {
  float decay_factor;     // 1 - lr * weight_decay
  float one_minus_beta1;  // lerp weight w
  float beta2, one_minus_beta2;
  float eps;
  float negative_step_size;     // -lr / (1 - beta1^t)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t)
  float grad_scale;             // clipping coefficient / fp16 loss scale, 1 when neither applies
};
// `grad` is float (fp32 training) or the 16-bit reduced gradient, widened
// here; `param` is always fp32: the parameters themselves in fp32, the
// master weights in mixed precision.
template <class Grad>
Z2_HD inline float adamw_update(const AdamWConstants& constants, bool decay, float* param, const Grad* grad,
                                float* m, float* v, size_t i) {
  // In AdamW's own notation: g the gradient, p the parameter, m and v the
  // moments (torch's exp_avg and exp_avg_sq).
  float g = to_float(grad[i]);
  if (constants.grad_scale != 1.0f) g = g * constants.grad_scale;
  float p = param[i];
  if (decay) p = p * constants.decay_factor;
  const float w = constants.one_minus_beta1;  // m.lerp_(g, w): exact at both ends
  float m_new = w < 0.5f ? m[i] + w * (g - m[i]) : g - (g - m[i]) * (1.0f - w);
  float v_new = v[i] * constants.beta2 + (constants.one_minus_beta2 * g) * g;
  float denom = sqrtf(v_new) / constants.bias_correction2_sqrt + constants.eps;
  const float p_new = p + (constants.negative_step_size * m_new) / denom;
  param[i] = p_new;
  m[i] = m_new;
  v[i] = v_new;
  return p_new;  // the updated parameter (mixed precision rounds it into the working copy)
}

// AdamW over an update region, one row per norm chunk (the decay flag is
// per chunk), a Z2_LOOP2 body: zero2.cu's step runs it as a kernel or, with
// ZeRO-Offload, as the host's threaded loop; `make bench-host-adam` times
// the same body beside DeepSpeedCPUAdam (measurements/host_adam_bench.cpp). Mixed
// precision also rounds each updated master into the working copy.
template <class Working>
struct AdamWByChunk {
  AdamWConstants constants;
  const unsigned char* decay;  // [rows] the chunk's weight-decay flag
  float* param;                // [rows x norm_chunk] fp32: the parameters; mixed: the master
  const Working* gradient;     // [rows x norm_chunk] the reduced gradient, in the working type
  float* exp_avg;              // [rows x norm_chunk] m
  float* exp_avg_sq;           // [rows x norm_chunk] v
  Working* working;            // [rows x norm_chunk] mixed: the rounded copy; fp32: nullptr
  Z2_HD void operator()(size_t chunk, size_t k) const {
    const size_t i = chunk * norm_chunk + k;
    const float updated = adamw_update(constants, decay[chunk] != 0, param, gradient, exp_avg, exp_avg_sq, i);
    if (working) working[i] = from_float<Working>(updated);
  }
};

// ----------------------------------------------------------------------------
// The bucket exchange (zero2.cu, "The reduce-scatter"; runtime/transfers.h, .cpp)

// Where the reduced shard of a bucket goes: straight into `result` (micro_steps = 1),
// or into the accumulation tree as micro-step `micro_step` of `micro_steps`
// (accumulate_micro_step). `result` and the stack entries point at the
// bucket's own region; `result` has the exchange's wire type (the gradient's
// type), the entries its accumulation type.
struct AccumulateInto {
  void* result = nullptr;
  AccumulationStackOf<void> stack{};
  long micro_step = 0, micro_steps = 1;
  // ZeRO-Offload: once the last micro-step's `result` is written, the same
  // transfer copies it ([padded / N] wire elements) to this host address, so
  // the slot it may lie in is not handed on before the copy has read it.
  void* copy_to_host = nullptr;
  template <class Accum>
  AccumulationStackOf<Accum> stack_as() const {  // the open blocks as `Accum` elements
    AccumulationStackOf<Accum> typed;
    for (int d = 0; d < 32; ++d) typed.entries[d] = (Accum*)stack.entries[d];
    return typed;
  }
};

// The bucket collectives, non-blocking, in a fixed number of constant-size
// slots (notes/06; the deterministic forms are described in
// zero2.cu, "The reduce-scatter"). A bucket of `padded` elements splits into N shards of
// padded / N; rank r owns elements [r * shard, (r + 1) * shard).
class BucketExchange {
 public:
  // `max_padded` bounds every bucket; with `bucket_buffers` each slot also has
  // a buffer backward can write a bucket's gradient into (stage 2). `wire` is
  // the element type of buckets, gradients and parameters alike (what goes on
  // the wire: 4 or 2 bytes an element); the N slices are always summed in
  // fp32, and the accumulation tree's blocks are fp32 (`accumulate_fp32`) or
  // of the wire type.
  BucketExchange(Compute& compute, Communicator& comm, size_t max_padded, int slots, bool bucket_buffers,
                 Precision wire = Precision::fp32, bool accumulate_fp32 = true);
  ~BucketExchange();
  BucketExchange(const BucketExchange&) = delete;
  BucketExchange& operator=(const BucketExchange&) = delete;

  // Take a free slot for bucket `bucket`, finishing the oldest transfer if all
  // are busy. Throws if every slot is held by a bucket not yet handed over.
  int acquire(int bucket);
  int slot_of(int bucket) const;  // the slot `bucket` holds, or -1
  // The slot's bucket buffer (wire type), zeroed, once the compute stream may write it.
  void* open_bucket_buffer(int slot, size_t padded);

  // Each collective runs in `slot` (from acquire) and frees it when finished.
  // `bucket` holds `padded` elements of the wire type.
  // reduce_scatter: the sum over ranks of `bucket`'s own slice, into `into`.
  void start_reduce_scatter(int slot, void* bucket, size_t padded, const AccumulateInto& into);
  // all_gather: in place, rank r's shard at r * shard (NCCL's layout).
  void start_all_gather(int slot, void* bucket, size_t padded);
  // all_reduce: in place. The reduce-scatter half goes through `into`, whose
  // result must be the bucket's own slice (so the final micro-step of an
  // accumulation can fold into it), then the slices are all-gathered.
  void start_all_reduce(int slot, void* bucket, size_t padded, const AccumulateInto& into);

  void progress();    // advance every transfer as far as it goes without blocking
  void finish_all();  // block until every transfer has finished

  // Its parts (runtime/transfers.h): the slots, the queue of transfers in
  // flight, the receiver's sums, and one builder of transfers per backend.
  struct Parts;

 private:
  std::unique_ptr<Parts> parts_;
};

}  // namespace z2

// What the API runs on, one header each (parts of this header: include zero2.h, not them).
#include "runtime/math.h"          // Z2_HD bits: random numbers, bf16 / fp16, exp / log / erf, the portable dot
#include "runtime/errors.h"        // z2::Error, usage_error, the check macros, the watchdog, with_commas
#include "runtime/compute.h"       // Compute (memory with a ledger, streams, events, gemm), Z2_LOOP, DeviceArray
#include "runtime/communicator.h"  // Communicator, the memory per rank, --device and --comm resolved
