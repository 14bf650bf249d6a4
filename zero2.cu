// zero2.cu — ZeRO stage 2, the chapter: the data-parallel baseline (stage 0),
// P_os (stage 1: optimizer-state partitioning) and P_os+g (stage 2: + gradient
// partitioning), over MPI or NCCL, on CPU or CUDA, giving the same bits in
// every stage.
//
// Paper: Rajbhandari, Rasley, Ruwase, He, "ZeRO: Memory Optimizations Toward
// Training Trillion Parameter Models", SC20. Section numbers in the comments
// are the paper's (2.1 data parallelism, 5.1 P_os, 5.2 P_g, 6 ZeRO-R, 7.2
// communication).
//
// Read it top to bottom: the sections follow one gradient on its way.
//   1. Layout              parameters, norm chunks, buckets, and the shard a rank owns
//   2. The stage buffers   what each stage keeps, full or sharded (DP, P_os, P_os+g)
//   3. Backward            where a gradient is written, and stage 2's slots, each
//                          bucket reduce-scattered as soon as it is complete
//   4. The reduce-scatter  the blocking reference, the transfer that carries a
//                          bucket, the receiver's canonical-tree sum, the micro-step's end
//   5. The step            loss, global norm, fp16's overflow skip, clipping, AdamW
//                          on the own shard, the all-gather of the updated shards
// The path one gradient takes through them is in this order too, with two
// seams beside it: runtime/offload.h (ZeRO-Offload's step on the host) and
// runtime/lab_adapters.h (what the course labs' seams are lent, the refusals);
// runtime/transfers.h holds the exchange's steps and MPI's (notes/gradient_path.py).
//   6. ZeRO-R's seams      the arena's books (M_D), the offload schedule (P_a+cpu)
//   7. Resharding          which pieces of a checkpoint a rank reads, at any N
//   8. The ledger          the formulas the measured bytes are held to
//
// What it leaves out: parameter partitioning (P_p, "stage 3"), and the
// machinery it runs on, which is in runtime/ (README's reading map lists each file): errors
// and the watchdog, the compute backend and its allocators, the gemms, the
// communicator, the bucket exchange's transfers with the libraries' native collectives,
// host copies, checkpoint state, the ledgers' printing. Mixed precision (bf16,
// fp16 with loss scaling; notes/08) is the same code: the working type is a
// template parameter of the kernels below. ZeRO-R's activation checkpointing
// itself lives in the model (train_bert_mini.cu).
//
// Functions marked Z2_LAB_SEAM are the ones the course labs (notes/labs) ask
// a student to write; zero2.h lists them under "the lab seams".
//
// Build and run (see the Makefile for every flag):
//   make            nvcc build: cpu + cuda compute, mpi + nccl communication
//   make cpu        mpicxx build: cpu + mpi only (this file compiled as C++)
//   make test       the doctest suite under mpirun -n 1, 2, 4 and one check per claim
//   make demo       the three stages on the test model, 2 ranks
//   make lab LAB=x  a course lab: your function in place of the engine's, graded (notes/labs)

#include "zero2.h"                 // the API, the arithmetic of the stages, BucketExchange
#include "runtime/engine_state.h"  // ModelStates: this rank's buffers as the runtime's host copies see them
#include "runtime/lab_build.h"     // what a lab build checks: a student's layout, agreed refusals
#include "runtime/transfers.h"     // Slot, Transfer, Parts (slots, transfers in flight, sums) and its steps

#include <algorithm>
#include <climits>

namespace z2 {

// ----------------------------------------------------------------------------
// 1. Layout: parameters, norm chunks, buckets, shards
//
// Three index spaces, from the user's view down to the rank's:
//   canonical — parameters in registration order, each starting on a multiple
//               of norm_chunk. It does not depend on N or on the bucket size,
//               so the global norm, computed over its chunks, does not either.
//   padded    — the flat buffer every rank holds for parameters (and, in
//               stages 0/1, gradients). Parameters are grouped into buckets of
//               whole parameters, at most bucket_elements each (a larger
//               parameter gets a bucket of its own, as in DeepSpeed), and each
//               bucket is padded to a multiple of N * norm_chunk, so it splits
//               into N equal shards made of whole chunks (as FSDP pads a flat
//               parameter). Psi_padded = its length.
//   shard     — this rank's shard of every bucket, back to back: Psi_padded / N
//               elements. Stages 1 and 2 keep AdamW state here, stage 2 also
//               the gradient.
// Padding is zero in parameters, gradients and AdamW state, and stays zero:
// AdamW maps (p, g, m, v) = 0 to 0.

// Rank r owns the r-th of the bucket's N equal slices (the shards lab's seam).
Z2_LAB_SEAM size_t shard_begin(const BucketInfo& bucket, int rank) {
  return bucket.offset + (size_t)rank * bucket.shard_length;
}

// The elements of a bucket whose update this rank makes, in each buffer's
// index space (the own-shards lab's first seam; zero2.h, UpdateRegion). The
// norm's chunk sums, AdamW and the checkpoints all take it from here.
Z2_LAB_SEAM UpdateRegion update_region(const BucketInfo& bucket, int stage, int rank) {
  UpdateRegion region;
  if (stage == 0) {  // DP (paper 2.1): every rank updates the whole bucket, and every buffer is full-size
    region.parameter = region.gradient = region.state = bucket.offset;
    region.length = bucket.padded_length;
    return region;
  }
  // P_os (5.1): the own slice only. Its optimizer state lies in shard space, each
  // bucket's shard after the last one's: Psi_padded / N elements of m, v (and master) in all.
  region.parameter = shard_begin(bucket, rank);
  region.state = bucket.shard_offset;
  // P_os+g (5.2): the reduced gradient is kept in shard space too (stage 1 keeps it in the full buffer).
  region.gradient = stage == 2 ? bucket.shard_offset : region.parameter;
  region.length = bucket.shard_length;
  return region;
}

static size_t round_up(size_t value, size_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// Buckets of whole parameters, in registration order: a bucket takes
// parameters while their chunk-rounded sizes fit bucket_elements (at least
// one), and is padded to a multiple of N norm chunks so it splits into N
// equal shards. Canonical offsets: each parameter rounded up to a norm chunk.
std::vector<BucketInfo> lay_out_buckets(const std::vector<size_t>& numels, int world_size, long bucket_elements) {
  const size_t N = (size_t)world_size, bucket_limit = round_up((size_t)bucket_elements, norm_chunk);
  std::vector<BucketInfo> buckets;
  size_t offset = 0, shard_offset = 0, canonical = 0;
  for (size_t first = 0; first < numels.size();) {
    BucketInfo b;
    b.first_parameter = (int)first;
    b.canonical_chunk = canonical / norm_chunk;
    size_t end = first, span = 0;
    while (end < numels.size() && (end == first || span + round_up(numels[end], norm_chunk) <= bucket_limit))
      span += round_up(numels[end++], norm_chunk);
    b.end_parameter = (int)end;
    b.length = span;
    b.padded_length = round_up(span, N * norm_chunk);
    b.shard_length = b.padded_length / N;
    b.offset = offset;
    b.shard_offset = shard_offset;
    offset += b.padded_length;
    shard_offset += b.shard_length;
    canonical += span;
    buckets.push_back(b);
    first = end;
  }
  return buckets;
}

// Each parameter's bucket and its offset in the padded flat buffer.
static void place_parameters(std::vector<ParameterInfo>& parameters, const std::vector<BucketInfo>& buckets) {
  for (size_t b = 0; b < buckets.size(); ++b)
    for (int p = buckets[b].first_parameter; p < buckets[b].end_parameter; ++p) {
      parameters[p].bucket = (int)b;
      parameters[p].offset = buckets[b].offset +
                             (parameters[p].canonical_offset - parameters[buckets[b].first_parameter].canonical_offset);
    }
}

ParameterId Engine::add_parameter(const std::string& name, size_t numel, bool decay) {
  if (built_) usage_error("parameter '%s' registered after build(): register every parameter first", name.c_str());
  if (numel == 0) usage_error("parameter '%s' has no elements", name.c_str());
  ParameterInfo info;
  info.name = name;
  info.numel = numel;
  info.decay = decay;
  info.canonical_offset = canonical_elements_;
  canonical_elements_ += round_up(numel, norm_chunk);
  parameters_.push_back(info);
  return (ParameterId)parameters_.size() - 1;
}

size_t Engine::psi() const {
  size_t total = 0;
  for (auto& parameter : parameters_) total += parameter.numel;
  return total;
}

size_t Engine::psi_padded() const {
  return buckets_.empty() ? 0 : buckets_.back().offset + buckets_.back().padded_length;
}

std::pair<size_t, size_t> Engine::shard_range(int bucket, int rank) const {
  require_built("shard_range");
  if (bucket < 0 || bucket >= (int)buckets_.size())
    usage_error("shard_range: bucket %d out of range (the layout has %zu buckets)", bucket, buckets_.size());
  if (rank < 0 || rank >= comm_.world_size())
    usage_error("shard_range: rank %d out of range (world size %d)", rank, comm_.world_size());
  const size_t begin = shard_begin(buckets_[bucket], rank);
  return {begin, begin + buckets_[bucket].shard_length};
}

long Engine::micro_batch_index(int a) const {
  if (a < 0 || a >= options_.accumulation_steps)
    usage_error("micro_batch_index: micro-step %d out of range (accumulation_steps %d)", a,
                options_.accumulation_steps);
  return (long)a * comm_.world_size() + comm_.rank();
}

int Engine::world_size() const { return comm_.world_size(); }
int Engine::rank() const { return comm_.rank(); }

void Engine::require_built(const char* what) const {
  if (!built_) usage_error("%s called before build()", what);
}

// ----------------------------------------------------------------------------
// 2. The stage buffers: what each stage keeps, full or sharded
//
// Bytes per rank below are fp32's, then mixed precision's (16-bit working
// parameters and gradients, fp32 master, m and v: the paper's K = 12).
//
// Stage 0, data parallel (the baseline, paper section 2.1): every rank keeps
// the full gradient [Psi_padded] and all-reduces it. With A = 1 that is one
// all-reduce per bucket per step, as PyTorch DDP. With A > 1 we split the
// all-reduce in time: each micro-step reduce-scatters (every micro-step must
// be reduced across ranks, see below), the last one also all-gathers. The
// bits are those of an all-reduce of the accumulated gradient (an all-gather
// does no arithmetic) and every stage sends the same bytes for any A.
// Model states: fp32 4 Psi params + 4 Psi grads + 8 Psi AdamW (m, v) = 16 Psi;
// mixed 2 Psi + 2 Psi + 12 Psi (master, m, v) = 16 Psi.
//
// Stage 1, P_os (paper section 5.1): AdamW state (and the master) is split N
// ways; each rank updates only its own shard of each bucket and all-gathers
// the parameters. The full gradient is still written by backward, then
// reduce-scattered in place (the own slice of each bucket receives the sum).
// Saves 8 Psi (N - 1) / N bytes in fp32 (4 Psi + 4 Psi + 8 Psi / N), 12 Psi
// (N - 1) / N in mixed precision (2 Psi + 2 Psi + 12 Psi / N).
//
// Stage 2, P_os+g (paper section 5.2): the gradient is split too. Backward
// writes each bucket into a constant-size staging buffer; as soon as the
// bucket is complete it is reduce-scattered and only this rank's shard of the
// sum is kept. Saves another 4 Psi (N - 1) / N bytes in fp32 (4 Psi + 12
// Psi / N), 2 Psi (N - 1) / N in mixed (2 Psi + 14 Psi / N), plus slots x
// (bucket + (N-1)/N bucket) staging elements that do not grow with the model.
//
// All three send the same bytes per step when A = 1: an all-reduce is a
// reduce-scatter plus an all-gather, 2 (N-1)/N Psi elements (section 7.2.1),
// of 4 bytes or of 2. In mixed precision the slices travel as 16 bits and the
// receiver sums them in fp32, rounding once (notes/08): the paper's volume
// with better numerics than a 16-bit ring.
//
// ZeRO-Offload (Ren et al., USENIX ATC 2021; notes/13), stages 1 and 2: the
// optimizer's 12 Psi/N and the reduced shard move to pinned host memory, the
// step runs there; the device keeps the working parameters (stage 2: 4 Psi
// fp32, 2 Psi mixed). 2 Psi/N bytes cross each way per step (4 in fp32).
//
// Gradient accumulation (notes/06): rank r computes global micro-batch
// m = a N + r at micro-step a, every micro-step is reduced across ranks (the
// tree over the N ranks, a perfect subtree when N is a power of two), and the
// A results go through accumulate_micro_step(). The whole is the canonical
// tree over the M = N A micro-batches: 1 x 4 = 2 x 2 = 4 x 1.

// Two slots with overlap (one reduces while backward fills the other), one
// without. Stage 2 needs two even without overlap: a bucket that starts with
// a layer's bias and ends with the next layer's weight is still open when
// backward reaches the previous bucket.
static int staging_slots(const EngineOptions& options) { return options.overlap || options.stage == 2 ? 2 : 1; }

// ZeRO-Offload applies to stages 1 and 2 (the Engine refuses it in stage 0).
static bool offload_optimizer(const EngineOptions& options) { return options.offload_optimizer && options.stage > 0; }
static void move_optimizer_sizes_to_host(EngineBuffers& sizes, const EngineOptions& options,
                                         size_t shard);  // offload.h

// Staging elements (of the wire type): each slot holds a bucket's gradient
// (stage 2) and the N - 1 shards the reduce-scatter receives.
size_t staging_elements(size_t max_padded_bucket, int world_size, int slot_count, bool bucket_buffers) {
  const size_t bucket_part = bucket_buffers ? max_padded_bucket : 0;
  return (size_t)slot_count * (bucket_part + (size_t)(world_size - 1) * (max_padded_bucket / world_size));
}

size_t accumulation_blocks(int accumulation_steps) {  // floor(log2 A)
  size_t blocks = 0;
  while ((2l << blocks) <= accumulation_steps) ++blocks;
  return blocks;
}

// The bytes of every buffer build() allocates, from the layout alone: build()
// allocates these sizes, and --plan adds them up without allocating (the
// planner's model states, staging and bookkeeping are this function).
EngineBuffers engine_buffers(const std::vector<BucketInfo>& buckets, const EngineOptions& options, int world_size) {
  EngineBuffers sizes;
  const size_t N = (size_t)world_size, e = element_bytes(options.precision);
  const size_t padded = buckets.empty() ? 0 : buckets.back().offset + buckets.back().padded_length, shard = padded / N;
  const int stage = options.stage;
  for (auto& b : buckets) sizes.max_padded_bucket = std::max(sizes.max_padded_bucket, b.padded_length);
  sizes.psi_padded = padded;
  // Where the stages' savings happen. Bytes per rank, fp32 | mixed precision:
  //               stage 0, DP (2.1)   stage 1, P_os (5.1)   stage 2, P_os+g (5.2)
  //   params      4 Psi | 2 Psi       4 Psi | 2 Psi         4 Psi | 2 Psi
  //   grads       4 Psi | 2 Psi       4 Psi | 2 Psi         4 Psi/N | 2 Psi/N    saves 4 | 2 Psi (N-1)/N
  //   master      -     | 4 Psi       -     | 4 Psi/N       -     | 4 Psi/N    saves 4 Psi (N-1)/N in mixed
  //   m and v     8 Psi | 8 Psi       8 Psi/N | 8 Psi/N     8 Psi/N | 8 Psi/N    saves 8 Psi (N-1)/N
  // (fp32's parameters are their own master.)
  sizes.params = padded * e;
  sizes.grads = (stage == 2 ? shard : padded) * e;  // P_g (5.2): only the own shard of the reduced gradient
  sizes.master = options.precision == Precision::fp32 ? 0 : (stage == 0 ? padded : shard) * sizeof(float);  // P_os
  sizes.moment = (stage == 0 ? padded : shard) * sizeof(float);  // P_os (5.1): AdamW's m and v of the own shard
  sizes.accumulation_blocks = accumulation_blocks(options.accumulation_steps);
  sizes.accumulation_block = shard * (options.accumulate_fp32 ? sizeof(float) : e);
  sizes.staging = staging_elements(sizes.max_padded_bucket, world_size, staging_slots(options), stage == 2) * e;
  sizes.chunk_sums = (stage == 0 ? padded : shard) / norm_chunk * sizeof(float);  // P_os (5.1): the own chunks, 1/N
  sizes.decay_flags = padded / norm_chunk;
  if (offload_optimizer(options)) move_optimizer_sizes_to_host(sizes, options, shard);
  return sizes;
}

size_t EngineBuffers::model_states() const { return params + grads + master + 2 * moment; }
size_t EngineBuffers::host_model_states() const { return host_master + 2 * host_moment + host_grads + host_working; }
size_t EngineBuffers::live() const {
  return model_states() + accumulation_blocks * accumulation_block + staging + chunk_sums + decay_flags;
}
size_t EngineBuffers::host_live() const { return host_model_states() + host_chunk_sums + host_decay_flags; }
size_t EngineBuffers::reserved() const {  // in a block: each buffer rounded up as Compute::take rounds it
  return block_round(params) + block_round(grads) + block_round(master) + 2 * block_round(moment) +
         accumulation_blocks * block_round(accumulation_block) + block_round(staging) + block_round(chunk_sums) +
         block_round(decay_flags);
}

// A kernel for a precision's type: call(T{}) with T float, bfloat16 or float16.
template <class Call>
void for_precision(Precision precision, Call call) {
  switch (precision) {
    case Precision::fp32: return call(float{});
    case Precision::bf16: return call(bfloat16{});
    case Precision::fp16: return call(float16{});
  }
}

// What this rank holds for the engine: the model-state buffers above, full
// or sharded by stage, the bucket exchange, the micro-step's bookkeeping, and
// the steps over them (defined in the sections that use them). It reads the
// Engine's layout and counters and writes only its own state; the Engine
// writes its counters and the loss scale itself (Engine::step).
struct Engine::RankState {
  Engine& engine;
  Compute& compute;
  Communicator& comm;
  const EngineOptions& options;
  const std::vector<BucketInfo>& buckets;
  int stage, rank;
  Precision precision;          // of the working parameters and gradients
  size_t element;               // their bytes: 4 or 2
  bool mixed;                   // bf16 or fp16: a separate fp32 master
  size_t accumulation_element;  // bytes of an accumulation block element
  bool offload;                 // ZeRO-Offload (stages 1, 2): the step's home is the host (runtime/offload.h)

  DeviceArray<char> params;                     // [Psi_padded] working parameters, every stage (fp32: also the master)
  DeviceArray<char> grads;                      // [Psi_padded] stages 0/1, [Psi_padded / N] stage 2, working type
  DeviceArray<float> master;                    // mixed only: [Psi_padded] stage 0, [Psi_padded / N] stages 1/2
  DeviceArray<float> adam_m, adam_v;            // [Psi_padded] stage 0,    [Psi_padded / N] stages 1/2
  std::vector<DeviceArray<char>> accumulation;  // floor(log2 A) x [Psi_padded / N]
  DeviceArray<float> chunk_sums;                // [update region / norm_chunk]
  DeviceArray<unsigned char> decay;             // [Psi_padded / norm_chunk] 1 = weight decay applies
  DeviceArray<char> host_grads;    // offload: [Psi_padded / N] the reduced shard, copied down (working type)
  DeviceArray<char> host_working;  // offload, mixed: [Psi_padded / N] the updated shard rounded, going up
  // Where the step finds its buffers and runs its loops (below: the device's; ZeRO-Offload's seam).
  struct StepHome;
  struct HostHome;  // runtime/offload.h
  std::unique_ptr<StepHome> home;
  std::unique_ptr<BucketExchange> exchange;
  Event comm_done;

  // Per micro-step state.
  std::vector<void*> slot_buffer;  // stage 2: the slot buffer bucket b is written into this micro-step
  std::vector<char> parameter_ready, bucket_reduced;
  std::vector<int> bucket_ready_count;
  std::vector<float> micro_losses;  // this rank's A loss contributions
  int reduced_during_backward = 0;
  long allocations_at_step1 = -1;  // the allocator's count when step 1 ended
  // Allocator calls and stack pushes: when the last step began (the end of
  // build() or of the step before), and how many that step made.
  long allocations_at_step_start = 0, pushes_at_step_start = 0;
  long allocations_last_step = 0, pushes_last_step = 0;
  CommCounters step_start_counters, last_step_counters;

  RankState(Engine& e, Compute& c)
      : engine(e),
        compute(c),
        comm(e.comm_),
        options(e.options_),
        buckets(e.buckets_),
        stage(e.options_.stage),
        rank(e.comm_.rank()),
        precision(e.options_.precision),
        element(element_bytes(precision)),
        mixed(precision != Precision::fp32),
        accumulation_element(e.options_.accumulate_fp32 ? sizeof(float) : element),
        offload(offload_optimizer(e.options_)) {}
  ~RankState() { compute.destroy_event(comm_done); }
  void allocate(const EngineBuffers& sizes);  // build()'s buffers

  // Element `index` of a buffer of the working type, as a byte address.
  char* at(DeviceArray<char>& buffer, size_t index) { return buffer.data() + index * element; }
  // The update region of bucket b (update_region, "Layout"): the whole
  // bucket in stage 0, the own shard in stages 1 and 2, in the index space of
  // each buffer. The chunk sums are indexed like the optimizer state.
  UpdateRegion region(int b) const { return update_region(buckets[b], stage, rank); }
  void* region_param(int b) { return at(params, region(b).parameter); }
  int check_bucket(int b, const char* what) const {  // b, once it is a bucket of the layout
    if (b < 0 || b >= (int)buckets.size())
      usage_error("%s: bucket %d out of range (the layout has %zu buckets)", what, b, buckets.size());
    return b;
  }

  // --- backward and its buckets' reduction ("Backward", "The reduce-scatter"), in this order ---
  void take_slot(int b);  // stage 2: bucket b's slot, zeroed for backward
  void gradient_ready(ParameterId id);
  void reduce_slot(int b, size_t keep);  // stage 2: bucket b's reduce-scatter from its slot
  AccumulateInto accumulate_into(size_t result, size_t shard);
  void reduce_bucket(int b);  // stages 0/1: from the full gradient buffer
  void end_micro_step(int a, float loss);
  void reduce_buckets_left();  // end_micro_step: what backward did not reduce (stages 0/1)
  // What the lab seams are lent, and what backward's calls refuse (runtime/lab_adapters.h).
  struct SlotGradients;
  struct StepOverShards;
  void refuse_gradient_output(ParameterId id, Precision expected) const;
  void refuse_gradient_ready(ParameterId id) const;

  // --- the optimizer step, step by step ("The step", defined in this order; Engine::step
  // calls open_step, home->wait_for_shards, local_chunk_sums, in fp16 the Engine's
  // overflow_skips_step, global_norm, clip_coefficient, apply_update, close_step) ---
  StepReport open_step();
  float global_loss();
  std::vector<float> local_chunk_sums(float scale = 1.0f);
  template <class Working>
  void chunk_squares_as(int b, float scale);
  float global_norm(const std::vector<float>& local, const StepReport& report);
  float rescaled_squared_norm(const StepReport& report, float* scale_back);
  float global_squared_norm(const std::vector<float>& local);
  float global_largest_magnitude(bool* finite);
  template <class Working>
  void chunk_largest_as(int b);
  float clip_coefficient(float grad_norm) const;
  void apply_update(StepReport& report);
  AdamWConstants adamw_constants(const StepReport& report, long t, float grad_scale) const;
  void adamw(int b, const AdamWConstants& constants);
  template <class Working>
  void adamw_as(int b, const AdamWConstants& constants);
  void gather_parameters(int b);
  void wait_for_all_gathers();
  void all_gather_untracked();
  StepReport close_step(const StepReport& report);
  void account_step();
};

// Where the optimizer step reads the reduced gradient and keeps the state it
// updates, and where its loops run: on the device, in RankState's buffers
// (here), or with ZeRO-Offload on pinned host copies (HostHome overrides
// every hook: runtime/offload.h). The chapter calls each hook; none asks
// which home it has. Indices are the update region's (region(b)).
struct Engine::RankState::StepHome {
  RankState& s;
  explicit StepHome(RankState& state) : s(state) {}
  virtual ~StepHome() = default;
  virtual Place place() const { return Place::device; }  // where the step's loops run
  // Bucket b's reduced gradient (stage 0: all-reduced, every rank the whole bucket).
  virtual void* gradient(int b) { return s.at(s.grads, s.region(b).gradient); }
  // The fp32 values AdamW updates: the parameters themselves in fp32, the master in mixed precision.
  virtual float* master(int b) {
    return s.mixed ? s.master.data() + s.region(b).state : (float*)s.params.data() + s.region(b).parameter;
  }
  // Where AdamW writes the rounded working copy (mixed only): the parameters.
  virtual void* working(int b) { return s.mixed ? s.region_param(b) : nullptr; }
  // build(): AdamW's state (m, v, mixed: the master), then the step's tables (chunk sums, decay flags).
  virtual void allocate_state(const EngineBuffers& sizes);
  virtual void allocate_tables(const EngineBuffers& sizes);
  virtual void route(AccumulateInto& into, int b, size_t keep) {}  // where bucket b's final sum goes besides
  virtual void wait_for_shards() {}                                // before the step reads the reduced shards
  virtual void shard_updated(int b) {}  // bucket b updated: before its all-gather reads the parameters
  virtual void parameters_written() {}  // the parameters were set from outside the step
};
}  // namespace z2
#include "runtime/offload.h"       // HostHome: ZeRO-Offload's step on the host
#include "runtime/lab_adapters.h"  // SlotGradients, StepOverShards: the seams' adapters, and the refusals
namespace z2 {

Engine::Engine(Compute& compute, Communicator& comm, const EngineOptions& options)
    : compute_(compute),
      comm_(comm),
      options_(options),
      scaler_(options.loss_scaling, options.precision == Precision::fp16) {
  check_engine_options(options_);  // runtime/option_checks.cpp
}

Engine::~Engine() = default;

// Build: agree on the model, lay it out in buckets ("Layout"), allocate
// every buffer once (after this no allocation is made: the ledger counts them).
void Engine::build() {
  if (built_) usage_error("build() called twice");
  if (parameters_.empty()) usage_error("build(): no parameters registered");
  check_same_parameters(parameters_, comm_);
  std::vector<size_t> numels;
  for (auto& p : parameters_) numels.push_back(p.numel);
  buckets_ = lay_out_buckets(numels, comm_.world_size(), options_.bucket_elements);
  check_lab_layout(buckets_, options_, comm_.world_size());  // a lab build's shard_begin, update_region (lab_build.h)
  place_parameters(parameters_, buckets_);
  // ZeRO-Offload's host loops: the threads asked for, or this rank's share of the node's cores.
  // The share is collective: every rank of an offloaded run asks, whatever it was given (the
  // ranks agree on offload; a build without it runs nothing on the host and asks nothing).
  if (offload_optimizer(options_)) {
    const int cores = host_cores_per_rank(comm_.mpi());
    compute_.set_host_threads(options_.host_threads > 0 ? options_.host_threads : cores);
  }
  rank_state_.reset(new RankState(*this, compute_));
  // The ledger's peaks are this engine's: start them from what exists now.
  compute_.reset_peaks();
  // Every size comes from engine_buffers(), the function --plan calls: what
  // the planner promises is what is allocated here ("The ledger" holds it to the formula).
  rank_state_->allocate(engine_buffers(buckets_, options_, comm_.world_size()));
  built_ = true;
  set_watchdog_context("optimizer step 1");  // what the watchdog's message names, from here on
}

// The buffers of build(), in the order the memory ledger lists them.
void Engine::RankState::allocate(const EngineBuffers& sizes) {
  home = step_home(*this);  // ZeRO-Offload enters here: the step's home, the host (runtime/offload.h)
  // Model states, the memory the paper's formulas count; their bytes in each
  // stage, and what each stage saves, are engine_buffers()' table.
  params = DeviceArray<char>(compute, sizes.params, MemoryKind::params);
  grads = DeviceArray<char>(compute, sizes.grads, MemoryKind::grads);
  home->allocate_state(sizes);  // m, v and (mixed) the master: on the device, or ZeRO-Offload's host
  // The accumulation tree's open blocks, each the size of this rank's shard
  // (fp32, or 16-bit with accumulate_fp32 off).
  for (size_t d = 0; d < sizes.accumulation_blocks; ++d)
    accumulation.emplace_back(compute, sizes.accumulation_block, MemoryKind::accumulation);

  // Staging (staging_slots): stage 2's slots also hold a bucket's gradient.
  exchange.reset(new BucketExchange(compute, comm, sizes.max_padded_bucket, staging_slots(options), stage == 2,
                                    options.precision, options.accumulate_fp32));
  comm_done = compute.create_event();

  // Bookkeeping: a norm chunk sum per chunk of the update region, and a
  // weight-decay flag per chunk of the padded buffer (a chunk never straddles
  // two parameters, so one flag per chunk is exact).
  home->allocate_tables(sizes);
  std::vector<unsigned char> decay_flags(decay.size(), 0);
  for (auto& p : engine.parameters_)
    for (size_t c = p.offset / norm_chunk; c < (p.offset + p.numel + norm_chunk - 1) / norm_chunk; ++c)
      decay_flags[c] = p.decay ? 1 : 0;
  compute.copy(decay.data(), decay_flags.data(), decay_flags.size(), compute.compute_stream());
  compute.synchronize(compute.compute_stream());

  parameter_ready.assign(engine.parameters_.size(), 0);
  bucket_ready_count.assign(buckets.size(), 0);
  bucket_reduced.assign(buckets.size(), 0);
  slot_buffer.assign(buckets.size(), nullptr);
  micro_losses.assign(options.accumulation_steps, 0.0f);
  step_start_counters = comm.counters();
  allocations_at_step_start = compute.memory().allocations;
  pushes_at_step_start = compute.memory().pushes;
}

// The device's optimizer state: its bytes in each stage are engine_buffers()' table.
void Engine::RankState::StepHome::allocate_state(const EngineBuffers& sizes) {
  if (s.mixed) s.master = DeviceArray<float>(s.compute, sizes.master / sizeof(float), MemoryKind::master);
  s.adam_m = DeviceArray<float>(s.compute, sizes.moment / sizeof(float), MemoryKind::optimizer);
  s.adam_v = DeviceArray<float>(s.compute, sizes.moment / sizeof(float), MemoryKind::optimizer);
}
void Engine::RankState::StepHome::allocate_tables(const EngineBuffers& sizes) {
  s.chunk_sums = DeviceArray<float>(s.compute, sizes.chunk_sums / sizeof(float), MemoryKind::bookkeeping);
  s.decay = DeviceArray<unsigned char>(s.compute, sizes.decay_flags, MemoryKind::bookkeeping);
}

// The buffers as the runtime's host copies and checkpoints see them.
ModelStates Engine::model_states() const {
  RankState& s = *rank_state_;
  return {compute_, comm_, options_, parameters_, buckets_, s.params.data(),
          // Stage 2 with offload keeps its reduced shard only on the host.
          s.offload && s.stage == 2 ? s.host_grads.data() : s.grads.data(),
          (s.offload && s.stage == 2 ? s.host_grads.size() : s.grads.size()) / s.element, s.master.data(),
          s.master.size(), s.adam_m.data(), s.adam_v.data(), s.adam_m.size(), s.element, s.accumulation_element};
}

// ----------------------------------------------------------------------------
// 3. Backward: where a gradient is written, and how its bucket is reduced
//
// The model asks where to write a parameter's gradient (gradient_output),
// writes it, and hands it over (gradient_ready). DP and P_os write the full
// gradient buffer and reduce each bucket from there; P_os+g has no full
// buffer: a bucket's gradients go into one of the staging slots, taken at
// the bucket's first gradient, and the bucket is reduce-scattered as soon as
// its last one is in, while backward goes on with the next bucket. The
// model hands parameters over last layer first, so the last bucket completes
// first.

// --- stage 2's slots (the gradient-shards lab's seams) -------------------------

void* Engine::parameter_storage(ParameterId id, Precision expected) {
  require_built("parameter");
  if (id < 0 || id >= (int)parameters_.size()) usage_error("parameter: id %d out of range", id);
  if (expected != options_.precision)
    usage_error("parameter '%s' asked for as %s, but the engine trains in %s", parameters_[id].name.c_str(),
                to_string(expected), to_string(options_.precision));
  return rank_state_->at(rank_state_->params, parameters_[id].offset);
}

void* Engine::gradient_storage(ParameterId id, Precision expected) {
  require_built("gradient_output");
  RankState& rank_state = *rank_state_;
  rank_state.refuse_gradient_output(id, expected);
  const ParameterInfo& p = parameters_[id];
  // DP and P_os: backward writes the full gradient buffer [Psi_padded].
  if (rank_state.stage < 2) return rank_state.at(rank_state.grads, p.offset);
  // P_os+g (paper 5.2): no full gradient exists; backward writes the bucket's slot (the hook below).
  const BucketInfo& b = buckets_[p.bucket];
  RankState::SlotGradients slots(rank_state);
  void* storage = stage2_gradient_output(slots, p.bucket, b, p.offset - b.offset);
  slots.refuse_storage_outside_slot(p, storage);
  return storage;
}

// P_os+g (5.2): backward writes a slot of the bucket's size, taken when the
// bucket's first gradient arrives; no full gradient buffer exists, which saves
// 4 Psi (N-1)/N bytes (2 Psi (N-1)/N in mixed precision).
Z2_LAB_SEAM void* stage2_gradient_output(GradientShards& shards, int bucket_index, const BucketInfo& bucket,
                                         size_t offset_in_bucket) {
  if (!shards.holds_slot(bucket_index)) shards.take_slot(bucket_index);
  return shards.slot_element(bucket_index, offset_in_bucket);
}

// A slot for bucket b (the exchange's, below), zeroed: backward writes it.
void Engine::RankState::take_slot(int b) {
  slot_buffer[b] = exchange->open_bucket_buffer(exchange->acquire(b), buckets[b].padded_length);
}

// Constant memory is the point of stage 2: at most slot_count buckets are in
// flight, and a bucket that needs a slot waits for the oldest transfer.
int BucketExchange::acquire(int bucket) {
  Parts& p = *parts_;
  int slot = p.free_slot();
  while (slot < 0 && !p.transfers.empty()) {
    p.finish(*p.transfers.front());
    p.retire_finished();
    slot = p.free_slot();
  }
  if (slot < 0)
    usage_error(
        "all %zu staging slot(s) are held by buckets not yet handed over (bucket %d is open) when bucket %d "
        "needs one: hand over every gradient of a bucket before starting the next",
        p.slots.size(), p.slots[0].bucket, bucket);
  p.slots[slot].bucket = bucket;
  return slot;
}

void* BucketExchange::open_bucket_buffer(int slot, size_t padded) {
  Parts& p = *parts_;
  char* buffer = p.slots.at(slot).bucket_gradients;
  if (!buffer) usage_error("open_bucket_buffer: this exchange was made without bucket buffers");
  // The slot's previous transfer may still read the buffer on the comm stream.
  p.compute.wait(p.compute.compute_stream(), p.slots[slot].done);
  p.compute.fill_zero(buffer, p.wire.bytes(padded), p.compute.compute_stream());
  return buffer;
}

void Engine::gradient_ready(ParameterId id) {
  require_built("gradient_ready");
  rank_state_->gradient_ready(id);
}

// The gradient handed over: counted in its bucket, and the bucket reduced when complete.
void Engine::RankState::gradient_ready(ParameterId id) {
  refuse_gradient_ready(id);
  const ParameterInfo& p = engine.parameters_[id];
  const BucketInfo& b = buckets[p.bucket];
  parameter_ready[id] = 1;
  ++bucket_ready_count[p.bucket];
  if (stage == 2) {
    // P_os+g cannot wait for the end of backward: its slots must come back for
    // the next buckets, so a complete bucket is reduce-scattered at once.
    SlotGradients slots(*this);
    stage2_gradient_ready(slots, p.bucket, b, id);
  } else if (options.overlap && bucket_ready_count[p.bucket] == b.end_parameter - b.first_parameter) {
    // Stages 0/1 with overlap reduce a complete bucket now; without it, at
    // end_micro_step, as a framework without gradient hooks would.
    reduce_bucket(p.bucket);
  }
  exchange->progress();
}

// Complete once every parameter is in (backward hands them over in reverse
// order of registration, so count): reduce-scatter now, while backward goes
// on with the next bucket, and keep only this rank's shard of the sum, each
// bucket's after the last one's in the Psi_padded / N gradient shard.
Z2_LAB_SEAM void stage2_gradient_ready(GradientShards& shards, int bucket_index, const BucketInfo& bucket,
                                       int parameter) {
  if (shards.handed_over(bucket_index) < bucket.end_parameter - bucket.first_parameter) return;
  shards.reduce_scatter(bucket_index, bucket.shard_offset);
}

// P_os+g (5.2): the bucket's reduce-scatter from its slot; this rank's shard
// of the sum is kept from element `keep` of the gradient shard [Psi_padded / N].
void Engine::RankState::reduce_slot(int b, size_t keep) {
  AccumulateInto into = accumulate_into(keep, keep);
  home->route(into, b, keep);  // ZeRO-Offload: the sum goes down to the host (runtime/offload.h)
  exchange->start_reduce_scatter(exchange->slot_of(b), slot_buffer[b], buckets[b].padded_length, into);
  bucket_reduced[b] = 1;
  if (!options.overlap) exchange->finish_all();
}

// The slot bucket b took (take_slot): its reduce-scatter runs in it.
int BucketExchange::slot_of(int bucket) const {
  const std::vector<Slot>& slots = parts_->slots;
  for (size_t k = 0; k < slots.size(); ++k)
    if (slots[k].bucket == bucket) return (int)k;
  return -1;
}

// Where a reduce-scatter leaves this rank's shard of the sum: element
// `result` of the gradient buffer, by way of the accumulation tree's open
// blocks, which are shard-sized in every stage (element `shard` of them).
AccumulateInto Engine::RankState::accumulate_into(size_t result, size_t shard) {
  AccumulateInto into;
  into.result = at(grads, result);
  for (size_t d = 0; d < accumulation.size(); ++d)
    into.stack.entries[d] = accumulation[d].data() + shard * accumulation_element;
  into.micro_step = engine.micro_steps_done_;
  into.micro_steps = options.accumulation_steps;
  return into;
}

// Stages 0 and 1 reduce from the full gradient buffer. (Stage 2 has none:
// its buckets are reduced from their slots, above.)
void Engine::RankState::reduce_bucket(int b) {
  const BucketInfo& info = buckets[b];
  const bool last_micro_step = engine.micro_steps_done_ == options.accumulation_steps - 1;
  // The own slice of the full buffer receives this rank's shard of the sum
  // (with ZeRO-Offload it then goes down to the host's copy, in the same transfer).
  AccumulateInto into = accumulate_into(shard_begin(info, rank), info.shard_offset);
  home->route(into, b, info.shard_offset);
  if (stage == 0 && last_micro_step) {
    // DP (paper 2.1): an all-reduce; every rank keeps the whole sum, 4 Psi (2 Psi mixed) of gradients.
    exchange->start_all_reduce(exchange->acquire(b), at(grads, info.offset), info.padded_length, into);
  } else {
    // P_os (5.1), and DP's earlier micro-steps: reduce-scatter in place; the full gradient buffer stays.
    exchange->start_reduce_scatter(exchange->acquire(b), at(grads, info.offset), info.padded_length, into);
  }
  bucket_reduced[b] = 1;
  if (!options.overlap) exchange->finish_all();
}

int Engine::buckets_reduced_during_backward() const {
  require_built("buckets_reduced_during_backward");
  return rank_state_->reduced_during_backward;
}

// ----------------------------------------------------------------------------
// 4. The reduce-scatter: the blocking reference, the transfer that carries a
//    bucket, the receiver's sum, the micro-step's end
//
// --- first, the plain blocking version -----------------------------------------
// What the deterministic reduce-scatter computes, in the fewest lines (MPI,
// fp32, host memory): an all-to-all of slices, then the canonical tree over
// the ranks for each element of the own shard. Every rank sends (N-1)/N of
// the bucket, what a ring reduce-scatter sends, and the sum's order is ours,
// not the library's, so the bits do not depend on N or on MPI's algorithm.
// The engine does not train with it (it blocks, so backward could not go on
// while a bucket is reduced); it is the reference the non-blocking exchange
// below is tested against (tests/test_collectives.cpp) and the answer to the
// reduce-scatter lab (notes/labs).

static int mpi_count(size_t elements, const char* what) {
  if (elements > (size_t)INT_MAX) usage_error("%s: %zu elements, more than MPI's int count holds", what, elements);
  return (int)elements;
}

Z2_LAB_SEAM void reduce_scatter_blocking(const float* bucket, float* shard, size_t shard_elements, MPI_Comm comm) {
  int world = 0;
  Z2_MPI_CHECK(MPI_Comm_size(comm, &world));
  const int count = mpi_count(shard_elements, "reduce_scatter_blocking");
  // Slice j of this rank's bucket goes to rank j; rank j's slice of this
  // rank's shard arrives at j x shard_elements.
  std::vector<float> slices((size_t)world * shard_elements), leaves(world);
  Z2_MPI_CHECK(MPI_Alltoall(bucket, count, MPI_FLOAT, slices.data(), count, MPI_FLOAT, comm));
  for (size_t i = 0; i < shard_elements; ++i) {
    for (int j = 0; j < world; ++j) leaves[j] = slices[(size_t)j * shard_elements + i];
    shard[i] = tree_sum(world, leaves.data());  // in rank order: never MPI_SUM, whose order is MPI's
  }
}

// An all-gather only copies, so the library's is exact.
Z2_LAB_SEAM void all_gather_blocking(const float* shard, float* bucket, size_t shard_elements, MPI_Comm comm) {
  const int count = mpi_count(shard_elements, "all_gather_blocking");
  Z2_MPI_CHECK(MPI_Allgather(shard, count, MPI_FLOAT, bucket, count, MPI_FLOAT, comm));
}

// --- the transfer that carries it: one bucket over MPI, as it runs ---------------

// The collectives the engine calls start a transfer in the slot at once
// (the exchange's steps: runtime/transfers.h); progress() moves it on.
void BucketExchange::start_reduce_scatter(int slot, void* bucket, size_t padded, const AccumulateInto& into) {
  Parts& p = *parts_;
  Transfer* transfer = p.start(slot, padded, "reduce-scatter");
  transfer->collectives.push_back(
      p.reduce_scatter_collective(slot, bucket, padded, into, &p.comm.counters().reduce_scatter));
  if (into.copy_to_host && into.micro_step == into.micro_steps - 1)  // the final sum, also to the host (offload.h)
    transfer->collectives.push_back(
        std::make_unique<ShardToHost>(p, into.result, into.copy_to_host, padded / p.world));
  progress();
}

// The chapter's own reduce-scatter over MPI, a non-blocking form of the
// reference above, in an MPI collective's steps (runtime/transfers.h): each
// progress() call (between layers) takes them as far as they go without
// waiting. MPI sends from `send` and receives into `receive`: the bucket and
// the slot's receive buffer, or (--comm mpi on cuda) their pinned copies.
struct MpiReduceScatter : MpiCollective {
  Slot& slot;
  char *bucket, *send, *receive;
  const size_t shard;
  const AccumulateInto into;
  size_t* sent;
  const int tag = exchange.sequence++ % 32768;  // point-to-point slices match by (source, tag): no ticket needed
  MpiReduceScatter(BucketExchange::Parts& parts, Slot& s, void* bucket_, void* send_, void* receive_, size_t padded,
                   const AccumulateInto& into_, size_t* sent_)
      : MpiCollective(parts, /*of_all_ranks=*/false),
        slot(s),
        bucket((char*)bucket_),
        send((char*)send_),
        receive((char*)receive_),
        shard(padded / parts.world),
        into(into_),
        sent(sent_) {}
  // Slice j of the bucket to rank j; rank j's slice of this rank's shard from rank j.
  void post(Transfer& transfer) override {
    const WireType& wire = exchange.wire;
    const int world = exchange.world, rank = exchange.rank, count = (int)shard;
    for (int j = 0; j < world; ++j) {
      if (j == rank) continue;  // the own slice stays: it is read in place by the sum
      Z2_MPI_CHECK(MPI_Irecv(wire.at(receive, received_index(j, rank) * shard), count, wire.mpi_type, j, tag,
                             exchange.comm.mpi(), request(transfer, j)));
      Z2_MPI_CHECK(MPI_Isend(wire.at(send, (size_t)j * shard), count, wire.mpi_type, j, tag, exchange.comm.mpi(),
                             request(transfer, j)));
      *sent += wire.bytes(shard);  // N - 1 slices of Psi_b / N: what a ring reduce-scatter sends
    }
  }
  // The canonical tree over the N slices (after the copy back: one comm stream).
  void arrived() override {
    exchange.sum_and_accumulate(shard, exchange.wire.at(bucket, (size_t)exchange.rank * shard), slot.receive, into);
  }
};

// One rank: the tree over one leaf is the leaf.
struct OneRankSum : Collective {
  BucketExchange::Parts& exchange;
  void* bucket;
  const size_t padded;
  const AccumulateInto into;
  OneRankSum(BucketExchange::Parts& parts, void* bucket_, size_t padded_, const AccumulateInto& into_)
      : exchange(parts), bucket(bucket_), padded(padded_), into(into_) {}
  bool advance(Transfer&) override {
    accumulate_reduced(exchange, bucket, padded, into);
    return true;
  }
};

// --comm mpi on cuda: the same reduce-scatter on the slot's pinned copies,
// the bucket down to them, the slices back up before the sum (runtime/transfers.cpp).
static std::unique_ptr<Collective> staged_reduce_scatter(BucketExchange::Parts& p, Slot& s, void* bucket,
                                                         size_t padded, const AccumulateInto& into, size_t* sent) {
  return staged_through_host(
      p, s, {bucket, s.host_send, padded},
      std::make_unique<MpiReduceScatter>(p, s, bucket, s.host_send, s.host_receive, padded, into, sent),
      {s.receive, s.host_receive, (size_t)(p.world - 1) * (padded / p.world)});
}

// Which collective carries a bucket's reduce-scatter: the chapter's own over
// MPI (above), or the libraries' (NCCL, --collectives native: runtime/transfers.cpp).
std::unique_ptr<Collective> BucketExchange::Parts::reduce_scatter_collective(int slot, void* bucket, size_t padded,
                                                                             const AccumulateInto& into, size_t* sent) {
  if (world == 1) return std::make_unique<OneRankSum>(*this, bucket, padded, into);
  if (use_nccl) return nccl_reduce_scatter(*this, slot, bucket, padded, into, sent);
  if (native) return mpi_native_reduce_scatter(*this, slot, bucket, padded, into, sent);
  Slot& s = slots[slot];
  if (through_pinned_host) return staged_reduce_scatter(*this, s, bucket, padded, into, sent);  // --comm mpi on cuda
  return std::make_unique<MpiReduceScatter>(*this, s, bucket, bucket, s.receive, padded, into, sent);
}

// --- the receiver's sum (a kernel on the comm stream) -----------------------------

// The kernel for the exchange's types: call(Wire{}, Accum{}), Accum fp32
// or (accumulate_fp32 off) the wire type.
template <class Call>
static void for_exchange_types(const BucketExchange::Parts& parts, Call call) {
  for_precision(parts.wire.precision, [&](auto wire_zero) {
    if (parts.accumulate_fp32) return call(wire_zero, float{});
    return call(wire_zero, wire_zero);
  });
}

// The same sum on the device, in any precision: element i of the own shard
// is the canonical tree over the N ranks' slices, in fp32, handed to the
// accumulation tree, which rounds the finished sum once (notes/08). Rank r
// computed micro-batch a N + r, so this tree continued over the micro-steps
// is the canonical tree over all N A micro-batches: the same bits at any
// power-of-two N (notes/06). (sum_over_ranks, zero2.h: canonical_tree_sum, or
// in a lab build the student's tree_sum.)
template <class Wire, class Accum>
static void sum_and_accumulate_as(BucketExchange::Parts& p, size_t shard, const void* own_slice,
                                  const void* received_slices, const AccumulateInto& into) {
  const int ranks = p.world, me = p.rank;
  const Wire *own = (const Wire*)own_slice, *received = (const Wire*)received_slices;
  Wire* result = (Wire*)into.result;
  const AccumulationStackOf<Accum> stack = into.stack_as<Accum>();
  const long micro_step = into.micro_step, micro_steps = into.micro_steps;
  p.compute.for_each(shard,
                     Z2_LOOP(i,
                             {
                               float value = sum_over_ranks(ranks, [&](long j) {
                                 return to_float(j == me ? own[i] : received[received_index(j, me) * shard + i]);
                               });
                               accumulate_micro_step(stack, micro_step, micro_steps, value, result, i);
                             }),
                     p.compute.comm_stream());
}
void BucketExchange::Parts::sum_and_accumulate(size_t shard, const void* own, const void* received,
                                               const AccumulateInto& into) {
  check_lab_ranks(world);  // a lab build's tree_sum takes at most 64 leaves (runtime/lab_build.h)
  for_exchange_types(*this, [&](auto wire_zero, auto accum_zero) {
    sum_and_accumulate_as<decltype(wire_zero), decltype(accum_zero)>(*this, shard, own, received, into);
  });
}

// One value per element already reduced (one rank, or a native reduce-scatter).
template <class Wire, class Accum>
static void accumulate_as(Compute& compute, const void* reduced, size_t n, const AccumulateInto& into) {
  const Wire* values = (const Wire*)reduced;
  Wire* result = (Wire*)into.result;
  const AccumulationStackOf<Accum> stack = into.stack_as<Accum>();
  const long micro_step = into.micro_step, micro_steps = into.micro_steps;
  compute.for_each(
      n, Z2_LOOP(i, { accumulate_micro_step(stack, micro_step, micro_steps, to_float(values[i]), result, i); }),
      compute.comm_stream());
}
void accumulate_reduced(BucketExchange::Parts& exchange, const void* values, size_t n, const AccumulateInto& into) {
  for_exchange_types(exchange, [&](auto wire_zero, auto accum_zero) {
    accumulate_as<decltype(wire_zero), decltype(accum_zero)>(exchange.compute, values, n, into);
  });
}

// DP's all-reduce: the reduce-scatter into the bucket's own slice (through
// `into`, so an accumulation's last micro-step folds into it), then the
// all-gather of the slices; with native collectives and nothing to
// accumulate, the library's all-reduce.
void BucketExchange::start_all_reduce(int slot, void* bucket, size_t padded, const AccumulateInto& into) {
  Parts& p = *parts_;
  void* own = p.wire.at(bucket, (size_t)p.rank * (padded / p.world));
  AccumulateInto target = into;
  if (!target.result) target.result = own;
  if (target.result != own)
    usage_error("all_reduce: the reduced shard must land in the bucket's own slice, to be all-gathered from there");
  Transfer* transfer = p.start(slot, padded, "all-reduce");
  size_t* sent = &p.comm.counters().all_reduce;
  if (p.native && p.world > 1 && target.micro_steps == 1) {
    transfer->collectives.push_back(native_all_reduce_collective(p, slot, bucket, padded, sent));
  } else {
    transfer->collectives.push_back(p.reduce_scatter_collective(slot, bucket, padded, target, sent));
    if (p.world > 1) transfer->collectives.push_back(p.all_gather_collective(slot, bucket, padded, sent));
  }
  progress();
}

// --- every bucket reduced: the transfers move between layers, and finish --------

// Between layers: every transfer in flight as far as it goes without waiting.
void Engine::progress() {
  if (built_) rank_state_->exchange->progress();
}

// Every transfer in flight as far as it goes without waiting, the finished ones retired.
void BucketExchange::progress() {
  for (auto& transfer : parts_->transfers) transfer->advance();
  parts_->retire_finished();
}

void Engine::end_micro_step(float loss) {
  require_built("end_micro_step");
  if (micro_steps_done_ >= options_.accumulation_steps)
    usage_error("end_micro_step: already %d micro-steps; call step()", options_.accumulation_steps);
  rank_state_->end_micro_step(micro_steps_done_, loss);
  ++micro_steps_done_;
}

// Micro-step a's end: every bucket reduced, its transfers finished.
void Engine::RankState::end_micro_step(int a, float loss) {
  for (size_t id = 0; id < parameter_ready.size(); ++id)
    if (!parameter_ready[id])
      usage_error("end_micro_step: no gradient was handed over for '%s'", engine.parameters_[id].name.c_str());
  reduce_buckets_left();
  exchange->finish_all();
  // The next micro-step's backward overwrites the gradients: it must come
  // after everything the comm stream still does with them.
  compute.record(comm_done, compute.comm_stream());
  compute.wait(compute.compute_stream(), comm_done);
  micro_losses[a] = loss;
  std::fill(parameter_ready.begin(), parameter_ready.end(), 0);
  std::fill(bucket_ready_count.begin(), bucket_ready_count.end(), 0);
  std::fill(bucket_reduced.begin(), bucket_reduced.end(), 0);
}

// Every transfer in flight finished, oldest first, and retired.
void BucketExchange::finish_all() {
  for (auto& transfer : parts_->transfers) parts_->finish(*transfer);
  parts_->retire_finished();
}

// Buckets not reduced yet (stages 0/1 without overlap): last bucket first,
// the order backward completes them. Stage 2 reduces every bucket during
// backward, from its slot: one left means the hook never started it.
void Engine::RankState::reduce_buckets_left() {
  reduced_during_backward = 0;
  for (char reduced : bucket_reduced) reduced_during_backward += reduced;
  for (int b = (int)buckets.size() - 1; b >= 0; --b) {
    if (bucket_reduced[b]) continue;
    if (stage == 2)
      usage_error(
          "end_micro_step: bucket %d ('%s' ...) was never reduce-scattered: in stage 2 each bucket is "
          "reduce-scattered from its slot as soon as its last gradient is handed over (stage2_gradient_ready)",
          b, engine.parameters_[buckets[b].first_parameter].name.c_str());
    reduce_bucket(b);
  }
}

// ----------------------------------------------------------------------------
// 5. The step: loss, global norm, overflow, clipping, AdamW, all-gather
//
// Everything here is element-wise on the update region (the whole buffer in
// stage 0, the own shards in stages 1 and 2) with the same Z2_HD functions, so
// an element is updated with the same operations whichever rank owns it. The
// two reductions that feed the update use the canonical tree over pieces that
// do not depend on N: the loss over the M = N A micro-batches, the squared
// norm over norm chunks of the canonical layout.
//
// fp16 (notes/08): the gradients carry the loss scale S. A rank that finds
// inf or NaN in its own reduced shard raises one flag, the flags are
// max-reduced, and on an overflow every rank skips the step: no update, no
// all-gather, AdamW's t and the lr schedule stay (DeepSpeed's rule; its
// global step still counts). Every stage reduces the same bits, so every
// stage skips the same steps. Otherwise the unscaling by 1/S (a power of two:
// exact) is folded into the clipping coefficient, one multiply per element.

// ZeRO-Offload runs this section on the host: the shards came down in their
// reduce-scatters (ShardToHost), the loops below run as CPU loops on the
// host's buffers (the step's home, StepHome) and each updated shard goes up
// once computed (runtime/offload.h). Same loops, same values: same bits.

// The step as the paper's optimizer sees it; each call below is one idea.
// The rank's steps are defined after it in the same order; the home's hook
// (wait_for_shards) is with StepHome, after RankState (and in offload.h).
StepReport Engine::step() {
  require_built("step");
  RankState& rank_state = *rank_state_;
  StepReport report = rank_state.open_step();  // the global loss, the step's number and learning rate
  step_calls_ = report.step;
  rank_state.home->wait_for_shards();  // ZeRO-Offload: the host's copies of them have come down
  const std::vector<float> local = rank_state.local_chunk_sums();  // the squares of this rank's reduced gradients
  const bool skipped = options_.precision == Precision::fp16 && overflow_skips_step(local, report);  // fp16 only
  micro_steps_done_ = 0;  // the next step's micro-steps start again
  if (skipped) return rank_state.close_step(report);
  report.grad_norm = rank_state.global_norm(local, report);
  report.clip_coefficient = rank_state.clip_coefficient(report.grad_norm);
  // AdamW on this rank's update regions (every bucket in DP, its shards in P_os and P_os+g),
  // then, in P_os and P_os+g, everyone's updated shards to everyone.
  rank_state.apply_update(report);
  updates_applied_ = report.applied;
  return rank_state.close_step(report);
}

StepReport Engine::RankState::open_step() {
  const int A = options.accumulation_steps;
  if (engine.micro_steps_done_ != A)
    usage_error("step() after %d micro-step(s); accumulation_steps is %d", engine.micro_steps_done_, A);
  StepReport report;
  report.loss = global_loss();
  report.step = engine.step_calls_ + 1;
  set_watchdog_context("optimizer step " + std::to_string(report.step) + " (its update)");
  report.loss_scale = engine.scaler_.scale();
  // The rate and betas of the update this step makes, unless it is skipped.
  scheduled_settings(options, engine.updates_applied_ + 1, report);  // runtime/option_checks.cpp
  return report;
}

// Loss: rank r's micro-step a is global micro-batch m = a N + r.
float Engine::RankState::global_loss() {
  const int A = options.accumulation_steps, N = comm.world_size();
  std::vector<float> gathered((size_t)N * A), by_micro_batch((size_t)N * A);
  comm.all_gather_host(micro_losses.data(), A, gathered.data(), "the micro-batch losses");
  for (int r = 0; r < N; ++r)
    for (int a = 0; a < A; ++a) by_micro_batch[(size_t)a * N + r] = gathered[(size_t)r * A + a];
  return tree_sum((long)by_micro_batch.size(), by_micro_batch.data());
}

// The sum of squares of every norm chunk of this rank's update region, on the host.
std::vector<float> Engine::RankState::local_chunk_sums(float scale) {
  for (int b = 0; b < (int)buckets.size(); ++b)
    for_precision(precision, [&](auto zero) { chunk_squares_as<decltype(zero)>(b, scale); });
  std::vector<float> local(chunk_sums.size());
  compute.copy(local.data(), chunk_sums.data(), local.size() * sizeof(float), compute.compute_stream());
  compute.synchronize(compute.compute_stream());
  return local;
}

// Sum of squares of each norm chunk of bucket b's update region (a perfect
// tree of norm_chunk leaves, in fp32), of the gradient times `scale` (1,
// or a power of two that keeps the squares from overflowing: see step()).
template <class Working>
void Engine::RankState::chunk_squares_as(int b, float scale) {
  const Working* gradient = (const Working*)home->gradient(b);
  float* sums = chunk_sums.data() + region(b).state / norm_chunk;
  compute.for_each_at(home->place(), region(b).length / norm_chunk, Z2_LOOP(chunk, {
                        const Working* values = gradient + chunk * norm_chunk;
                        float squares[norm_chunk];  // the tree's leaves
                        for (long k = 0; k < norm_chunk; ++k) {
                          const float value =
                              to_float(values[k]) * scale;  // exact: scale is a power of two (1 as a rule)
                          squares[k] = value * value;
                        }
                        sums[chunk] = perfect_tree_sum<norm_chunk>(squares);  // = canonical_tree_sum over the squares
                      }));
}

// fp16: overflow anywhere? (A chunk sum of finite fp16 values is finite:
// 32 x 65504^2 < 2^37, so a non-finite chunk is a non-finite element.) Every
// rank takes the same verdict and the scaler moves on it; a skipped step
// updates nothing.
bool Engine::overflow_skips_step(const std::vector<float>& local, StepReport& report) {
  bool overflow = false;
  for (float sum : local) overflow |= !std::isfinite(sum);
  report.skipped = comm_.any_rank(overflow);
  // At the minimum scale update throws, on every rank; the run ends there,
  // so the message says where, counting steps as the progress lines do.
  try {
    scaler_.update(report.skipped);
  } catch (const Error& error) { throw Error("optimizer step " + std::to_string(report.step) + ": " + error.what()); }
  if (!report.skipped) return false;
  ++skipped_steps_;
  report.applied = updates_applied_;
  report.grad_norm = NAN;
  return true;
}

// --- fp16's loss scale (DeepSpeed's DynamicLossScaler; the loss-scale lab's seam) ----

// update_scale of deepspeed/runtime/fp16/loss_scaler.py, line by line: after
// every step's overflow check, on every rank with the same verdict.
Z2_LAB_SEAM void LossScaler::update(bool overflow) {
  if (!dynamic_) return;  // a static scale never changes (an overflow still skips the step)
  if (overflow) {
    if (settings_.hysteresis == 1 || hysteresis_left_ == 1) {
      if (scale_ == settings_.min_scale)
        usage_error(
            "fp16 gradients overflowed at the minimum loss scale %.17g (min_loss_scale) with no hysteresis "
            "left: the scale cannot go lower (DeepSpeed stops here too). Lower --lr, use bf16, or clip",
            scale_);
      scale_ = std::max(scale_ / 2, settings_.min_scale);
    } else {
      hysteresis_left_ -= 1;
    }
    last_overflow_ = iteration_;
  } else {
    if (settings_.consecutive_hysteresis) hysteresis_left_ = settings_.hysteresis;
    if ((iteration_ - last_overflow_) % settings_.window == 0) {
      if (!settings_.consecutive_hysteresis) hysteresis_left_ = settings_.hysteresis;
      scale_ *= 2;
    }
  }
  iteration_ += 1;
}

LossScaler::LossScaler(const LossScaling& settings, bool fp16) : settings_(settings) {
  if (!fp16) return;             // bf16 and fp32 need no scaling: scale 1, never updated
  check_loss_scaling(settings);  // runtime/option_checks.cpp
  dynamic_ = settings.static_scale == 0;
  scale_ = dynamic_ ? std::ldexp(1.0, settings.initial_scale_power) : settings.static_scale;
  hysteresis_left_ = settings.hysteresis;
}

void LossScaler::restore(const LossScalerState& state) {
  check_loss_scaler_state(state);  // runtime/option_checks.cpp
  scale_ = state.scale;
  hysteresis_left_ = state.hysteresis_left;
  iteration_ = state.iteration;
  last_overflow_ = state.last_overflow;
}

// The global norm over every rank's reduced gradient (its norm chunks and
// the canonical tree), unscaled by fp16's loss scale. A gradient that is
// itself inf or NaN ends the run (fp16 skipped the step before this).
float Engine::RankState::global_norm(const std::vector<float>& local, const StepReport& report) {
  float squared = global_squared_norm(local), scale_back = 1.0f;
  // Stage 0 sums its own copy of the reduced gradient: with native collectives
  // (the library's all-reduce) nothing promises every rank the same bits, so
  // there the ranks agree before a branch whose collectives all must join.
  const bool own_copy = stage == 0 && comm.collectives() == Collectives::native;
  auto on_any_rank = [&](bool condition) { return own_copy ? comm.any_rank(condition) : condition; };
  if (on_any_rank(!std::isfinite(squared))) squared = rescaled_squared_norm(report, &scale_back);
  const float norm = std::sqrt(squared) * scale_back / (float)report.loss_scale;
  if (on_any_rank(!std::isfinite(norm)))
    usage_error(
        "the gradient norm is beyond float's range in optimizer step %ld (every element finite, their "
        "norm not): training diverged. Lower --lr or lengthen --warmup",
        report.step);
  return norm;
}

// The fp32 sum of squares overflows where gradients are finite but above
// ~1.8e19 (bf16 reaches 3.4e38; so does fp32 under very high dropout): then
// the squares are taken again of g / 2^e, with 2^e the power of two just
// above the largest |g| (an all-reduce of the maxima, exact and
// N-independent), in the same chunks and tree, and the norm is scaled back
// by 2^e. Runs that do not overflow keep their bits.
float Engine::RankState::rescaled_squared_norm(const StepReport& report, float* scale_back) {
  bool finite = true;
  const float largest = global_largest_magnitude(&finite);
  if (!finite)
    usage_error(engine.updates_applied_ == 0
                    ? "a gradient is not finite (inf or NaN) in optimizer step %ld, before any update: the model "
                      "as initialized overflows on this data (the learning rate has not acted yet): look at "
                      "--dropout and the model sizes"
                    : "a gradient is not finite (inf or NaN) in optimizer step %ld: training diverged (the "
                      "updates grew until the gradients overflowed). Lower --lr or lengthen --warmup",
                report.step);
  int exponent = 0;
  std::frexp(largest, &exponent);  // largest < 2^exponent
  *scale_back = std::ldexp(1.0f, exponent);
  return global_squared_norm(local_chunk_sums(std::ldexp(1.0f, -exponent)));
}

// The global squared norm: the chunk sums of all ranks in canonical order,
// then the canonical tree over them. Padding chunks take no part.
float Engine::RankState::global_squared_norm(const std::vector<float>& local) {
  const int N = comm.world_size();
  std::vector<float> all_chunks;  // indexed by chunk of the padded buffer
  if (stage == 0) {
    all_chunks = local;  // DP: this rank holds every reduced gradient
  } else {
    // P_os, P_os+g: each rank summed its own shards' chunks; gather Psi/32 floats, not Psi.
    std::vector<float> gathered_chunks(local.size() * N);
    comm.all_gather_host(local.data(), local.size(), gathered_chunks.data(), "the norm chunk sums");
    all_chunks.assign(engine.psi_padded() / norm_chunk, 0.0f);
    for (int r = 0; r < N; ++r)
      for (auto& b : buckets)
        for (size_t k = 0; k < b.shard_length / norm_chunk; ++k)
          all_chunks[shard_begin(b, r) / norm_chunk + k] =
              gathered_chunks[r * local.size() + b.shard_offset / norm_chunk + k];
  }
  std::vector<float> canonical(engine.canonical_elements_ / norm_chunk);
  for (auto& b : buckets)
    for (size_t k = 0; k < b.length / norm_chunk; ++k)
      canonical[b.canonical_chunk + k] = all_chunks[b.offset / norm_chunk + k];
  return tree_sum((long)canonical.size(), canonical.data());
}

// The canonical tree over leaves in memory (the tree-sum lab's seam): the
// norm's chunk sums, the loss, the blocking reference's slices.
Z2_LAB_SEAM float tree_sum(long n, const float* leaves) {
  return canonical_tree_sum(n, [&](long k) { return leaves[k]; });
}

// The largest |g| over every rank's update region (collective); `finite`
// says whether every element of the gradient is finite.
float Engine::RankState::global_largest_magnitude(bool* finite) {
  for (int b = 0; b < (int)buckets.size(); ++b)
    for_precision(precision, [&](auto zero) { chunk_largest_as<decltype(zero)>(b); });
  std::vector<float> local(chunk_sums.size());
  compute.copy(local.data(), chunk_sums.data(), local.size() * sizeof(float), compute.compute_stream());
  compute.synchronize(compute.compute_stream());
  float largest = 0.0f;
  bool mine_finite = true;
  for (float value : local) {
    if (!std::isfinite(value)) mine_finite = false;
    else largest = std::max(largest, value);
  }
  *finite = !comm.any_rank(!mine_finite);
  float global = 0.0f;
  watched_allreduce(&largest, &global, 1, MPI_FLOAT, MPI_MAX, comm.mpi(), "the all-reduce of the largest |gradient|");
  return global;
}

// The largest |g| of each norm chunk (NaN if the chunk holds one), into
// the same buffer: max is exact and order-free, so no tree is needed.
template <class Working>
void Engine::RankState::chunk_largest_as(int b) {
  const Working* gradient = (const Working*)home->gradient(b);
  float* largest = chunk_sums.data() + region(b).state / norm_chunk;
  compute.for_each_at(home->place(), region(b).length / norm_chunk, Z2_LOOP(chunk, {
                        float value = 0.0f;
                        for (long k = 0; k < norm_chunk; ++k) {
                          const float magnitude = fabsf(to_float(gradient[chunk * norm_chunk + k]));
                          if (magnitude > value || magnitude != magnitude) value = magnitude;  // a NaN stays
                          if (value != value) break;
                        }
                        largest[chunk] = value;
                      }));
}

// Clipping as torch.nn.utils.clip_grad_norm_: coefficient = clip / (norm +
// 1e-6), capped at 1, in float; 1 when not clipping.
float Engine::RankState::clip_coefficient(float grad_norm) const {
  if (options.clip <= 0) return 1.0f;
  const float coefficient = (float)options.clip / (grad_norm + 1e-6f);
  return std::min(coefficient, 1.0f);
}

// AdamW's constants for update t, the stage's step through the seam below,
// and the wait for its all-gathers. One multiply per element folds the
// clipping coefficient and fp16's 1/S into the gradient.
[[maybe_unused]] static void gather_each_when_updated(OwnShards& shards, const std::vector<BucketInfo>& buckets,
                                                      int stage);  // below, beside the seam's plain order
void Engine::RankState::apply_update(StepReport& report) {
  const long t = engine.updates_applied_ + 1;
  const float grad_scale = report.clip_coefficient / (float)report.loss_scale;
  StepOverShards shards(*this, adamw_constants(report, t, grad_scale));
#if defined(Z2_LAB_BUILD)
  z2::update_and_gather(shards, buckets, stage);  // the lab's seam: a student's order, or the plain one below
#else
  gather_each_when_updated(shards, buckets, stage);
#endif
  wait_for_all_gathers();
  report.applied = t;  // the update step() counts
}

// torch.optim.AdamW's scalars, computed in double, for update t (1-based),
// with the step's rate and betas (open_step: a scheduler may set both).
AdamWConstants Engine::RankState::adamw_constants(const StepReport& report, long t, float grad_scale) const {
  const EngineOptions& o = options;
  const double lr = report.lr, beta1 = report.beta1, beta2 = report.beta2;
  AdamWConstants constants;
  constants.decay_factor = (float)(1.0 - lr * o.weight_decay);
  constants.one_minus_beta1 = (float)(1.0 - beta1);
  constants.beta2 = (float)beta2;
  constants.one_minus_beta2 = (float)(1.0 - beta2);
  constants.eps = (float)o.eps;
  // Without bias correction the step is -lr and the divisor 1 (exact: v / 1 = v).
  // beta^t by repeated squaring (runtime/math.h's power_double), not libm's pow:
  // the same double on every machine.
  constants.negative_step_size = (float)(o.bias_correction ? -lr / (1.0 - power_double(beta1, t)) : -lr);
  constants.bias_correction2_sqrt = o.bias_correction ? (float)std::sqrt(1.0 - power_double(beta2, t)) : 1.0f;
  constants.grad_scale = grad_scale;
  return constants;
}

// The optimizer step of each stage (the own-shards lab's second seam), in
// its plain order: every update, then every all-gather.
Z2_LAB_SEAM void update_and_gather(OwnShards& shards, const std::vector<BucketInfo>& buckets, int stage) {
  for (int b = 0; b < (int)buckets.size(); ++b) shards.adamw(b);  // this rank's update region of each bucket
  if (stage == 0) return;                                         // DP (2.1): every rank updated every parameter
  // P_os (5.1), P_os+g (5.2): each rank updated only its shards. The all-gather sends (N-1)/N Psi
  // elements, the second half of the all-reduce DP sends, so the volume is DP's (7.2.1).
  for (int b = 0; b < (int)buckets.size(); ++b) shards.all_gather(b);
}

// The same step as the engine runs it (a lab build runs the seam above):
// each bucket's all-gather starts as soon as its own update is done, so it
// crosses while the next bucket updates. The same calls, the same volume,
// the same bits (an all-gather only copies); what moves is when. With
// ZeRO-Offload the host's AdamW of bucket b + 1 overlaps bucket b's copy up
// and its all-gather, which follow each other on the comm stream.
static void gather_each_when_updated(OwnShards& shards, const std::vector<BucketInfo>& buckets, int stage) {
  for (int b = 0; b < (int)buckets.size(); ++b) {
    shards.adamw(b);
    if (stage > 0) shards.all_gather(b);  // P_os, P_os+g (5.1, 5.2): DP (2.1) updated every parameter itself
  }
}

// AdamW on bucket b's update region, in the working type.
void Engine::RankState::adamw(int b, const AdamWConstants& constants) {
  for_precision(precision, [&](auto zero) { adamw_as<decltype(zero)>(b, constants); });
  home->shard_updated(b);  // ZeRO-Offload: up to the device's parameters
}

// AdamW on bucket b's update region. fp32: the parameters are the master.
// Mixed: the fp32 master is updated, then rounded once into the working
// copy that forward reads and the all-gather sends.
template <class Working>
void Engine::RankState::adamw_as(int b, const AdamWConstants& constants) {
  const UpdateRegion own = region(b);
  const AdamWByChunk<Working> update{constants,
                                     decay.data() + own.parameter / norm_chunk,  // the region's first chunk's flag
                                     home->master(b),
                                     (const Working*)home->gradient(b),
                                     adam_m.data() + own.state,  // torch's names for m and v: exp_avg, exp_avg_sq
                                     adam_v.data() + own.state,
                                     (Working*)home->working(b)};
  // A row per norm chunk (zero2.h, AdamWByChunk): the CPU loop reads the
  // flag once a chunk and vectorises the 32 updates of each; ZeRO-Offload's
  // host splits the rows over its threads (Compute::set_host_threads).
  compute.for_each_at(home->place(), own.length / norm_chunk, (size_t)norm_chunk, update);
}

// Bucket b's parameters, in place, rank r's shard to every rank: the
// all-gather over MPI below, in the exchange's transfer queue.
void Engine::RankState::gather_parameters(int b) {
  exchange->start_all_gather(exchange->acquire(b), at(params, buckets[b].offset), buckets[b].padded_length);
}
// The all-gather of a bucket over MPI: MPI's own, in place (rank r's shard
// at r x shard, as NCCL lays it out); it only copies, so it is exact in
// every mode (runtime/transfers.h: MpiCollective's steps).
struct MpiAllGather : MpiCollective {
  char* host;  // where MPI gathers: the bucket itself, or (--comm mpi on cuda) the slot's pinned copy
  const size_t shard;
  size_t* sent;
  MpiAllGather(BucketExchange::Parts& parts, void* host_, size_t padded, size_t* sent_)
      : MpiCollective(parts), host((char*)host_), shard(padded / parts.world), sent(sent_) {}
  void post(Transfer& transfer) override {
    const MPI_Datatype type = exchange.wire.mpi_type;
    Z2_MPI_CHECK(MPI_Iallgather(MPI_IN_PLACE, 0, type, host, (int)shard, type, exchange.comm.mpi(), request(transfer)));
    *sent += (size_t)(exchange.world - 1) * exchange.wire.bytes(shard);
  }
};

// --comm mpi on cuda: the same all-gather in the slot's pinned copy, the own
// shard down to it, the whole bucket back up (runtime/transfers.cpp).
static std::unique_ptr<Collective> staged_all_gather(BucketExchange::Parts& p, Slot& s, void* bucket, size_t padded,
                                                     size_t* sent) {
  const size_t own = (size_t)p.rank * (padded / p.world);
  return staged_through_host(p, s, {p.wire.at(bucket, own), p.wire.at(s.host_send, own), padded / p.world},
                             std::make_unique<MpiAllGather>(p, s.host_send, padded, sent),
                             {bucket, s.host_send, padded});
}

// Which collective carries it: NCCL's, or the one above.
std::unique_ptr<Collective> BucketExchange::Parts::all_gather_collective(int slot, void* bucket, size_t padded,
                                                                         size_t* sent) {
  if (use_nccl) return nccl_all_gather(*this, bucket, padded, sent);
  if (through_pinned_host) return staged_all_gather(*this, slots[slot], bucket, padded, sent);  // --comm mpi on cuda
  return std::make_unique<MpiAllGather>(*this, bucket, padded, sent);
}

void BucketExchange::start_all_gather(int slot, void* bucket, size_t padded) {
  Parts& p = *parts_;
  Transfer* transfer = p.start(slot, padded, "all-gather");
  if (p.world > 1)  // one rank: nothing to send
    transfer->collectives.push_back(p.all_gather_collective(slot, bucket, padded, &p.comm.counters().all_gather));
  progress();
}

// The wait for every all-gather started, after which forward (on the
// compute stream) may read the parameters.
void Engine::RankState::wait_for_all_gathers() {
  exchange->finish_all();
  compute.record(comm_done, compute.comm_stream());
  compute.wait(compute.compute_stream(), comm_done);
}

// Every rank's update regions to every rank, as at the end of a step; not
// training traffic, so the next step's ledger does not count it (after a
// checkpoint is loaded: runtime/checkpoint_state.cpp).
void Engine::all_gather_untracked() { rank_state_->all_gather_untracked(); }
void Engine::RankState::all_gather_untracked() {
  if (stage > 0)  // P_os, P_os+g (5.1, 5.2): each rank holds only its shards updated; DP (2.1) holds them all
    for (int b = 0; b < (int)buckets.size(); ++b) gather_parameters(b);
  wait_for_all_gathers();
  compute.synchronize_all();
  step_start_counters = comm.counters();
}

void Engine::parameters_written() { rank_state_->home->parameters_written(); }
int Engine::host_threads() const { return compute_.host_threads(); }

// Account the step in the ledgers and name the next one for the watchdog.
StepReport Engine::RankState::close_step(const StepReport& report) {
  account_step();
  set_watchdog_context("optimizer step " + std::to_string(report.step + 1));
  return report;
}

// This step's communication and allocations, for the ledger.
void Engine::RankState::account_step() {
  const CommCounters& now = comm.counters();
  last_step_counters.reduce_scatter = now.reduce_scatter - step_start_counters.reduce_scatter;
  last_step_counters.all_gather = now.all_gather - step_start_counters.all_gather;
  last_step_counters.all_reduce = now.all_reduce - step_start_counters.all_reduce;
  last_step_counters.other = now.other - step_start_counters.other;
  step_start_counters = now;
  const MemoryCounters& memory = compute.memory();
  if (allocations_at_step1 < 0)
    allocations_at_step1 = memory.allocations;  // this run's first step (a resumed run's too)
  allocations_last_step = memory.allocations - allocations_at_step_start;
  pushes_last_step = memory.pushes - pushes_at_step_start;
  allocations_at_step_start = memory.allocations;
  pushes_at_step_start = memory.pushes;
}

// ----------------------------------------------------------------------------
// 6. ZeRO-R's seams: the arena's books (M_D) and the offload schedule (P_a+cpu)
//
// The paper (section 3.2) observed out-of-memory errors with over 30% of the
// memory still free: long-lived tensors are allocated between short-lived
// ones, and the free memory is left in pieces. M_D (section 6.3) pre-allocates
// contiguous buffers for the long-lived ones. zero2's arena keeps one block:
// long-lived buffers from the bottom, temporaries on a stack from the top, so
// the free memory is the one gap between them, never in pieces. These are
// its books, kept apart from the memory they describe (runtime/allocators.cpp
// turns their offsets into pointers, and models the allocators it is
// compared with; notes/05).

// Neither end searches: a request is one comparison and one addition, and
// the free middle stays one piece, however buffers come and go.
Z2_LAB_SEAM size_t arena_allocate(ArenaBooks& books, size_t bytes) {
  if (bytes > books.top - books.bottom) return arena_full;
  books.bottom += bytes;
  return books.bottom - bytes;
}
Z2_LAB_SEAM size_t arena_push(ArenaBooks& books, size_t bytes) {
  if (bytes > books.top - books.bottom) return arena_full;
  books.top -= bytes;
  books.stack.push_back(books.top);
  return books.top;
}
Z2_LAB_SEAM void arena_pop(ArenaBooks& books, size_t offset, size_t bytes) {
  // Out of order, the top would step over a live buffer, and the next push would overwrite it.
  if (books.stack.empty() || books.stack.back() != offset)
    usage_error(
        "arena stack: pop of a buffer that is not the last one pushed (temporaries must be popped in "
        "the reverse order of their pushes)");
  books.stack.pop_back();
  books.top += bytes;
}
Z2_LAB_SEAM void arena_release(ArenaBooks& books, size_t offset, size_t bytes) {
  if (offset + bytes == books.bottom) books.bottom = offset;  // the last long-lived buffer: the bump pointer steps back
  // (Any other keeps its place until the block goes: the arena never searches, so it never reuses a hole.)
}

// --- ZeRO-R's offload schedule (the offload lab's seam) -------------------------
// Block l's backward needs checkpoint l; fetching it while block l + 1 runs
// hides the copy behind compute, and fetching no earlier keeps two
// checkpoints on the device, not L - 1.
Z2_LAB_SEAM int checkpoint_to_prefetch(int block, int layers) {
  const int needed_next = block - 1;  // the input of the block that runs after this one
  return needed_next >= 0 && needed_next <= layers - 2 ? needed_next : -1;
}

// --- a checkpoint's copy, between the compute stream's work (the streams lab's seam)
// Three streams run at once; only events order work across them. The copy
// stream waits for an event recorded on the compute stream after the work
// the copy depends on (the checkpoint written, or its slot's last reader
// queued), and `copied`, recorded after the copy, is what the compute stream
// waits for before it reads the checkpoint or lets its slot go.
Z2_LAB_SEAM void checkpoint_copy(Compute& compute, void* destination, const void* source, size_t bytes, Event ready,
                                 Event copied) {
  compute.record(ready, compute.compute_stream());
  compute.wait(compute.copy_stream(), ready);
  compute.copy(destination, source, bytes, compute.copy_stream());
  compute.record(copied, compute.copy_stream());
}

// ----------------------------------------------------------------------------
// 7. Resharding: a checkpoint read at any N (notes/09; the reshard lab's seam)
//
// A checkpoint holds the optimizer state in the canonical order, which does
// not depend on N, the stage or the bucket size; each rank owns runs of it
// (Engine::owned_state_runs: its update regions, cut at parameter
// boundaries; runtime/checkpoint_state.cpp gathers and places them). Loading
// at another N is then a re-slice, not a conversion.

// Each owned run meets the files whose range overlaps it, in file order; a
// run saved across a file boundary becomes two reads.
Z2_LAB_SEAM std::vector<ReshardRead> reshard_reads(const std::vector<StateRun>& owned,
                                                   const std::vector<StateRun>& files) {
  std::vector<ReshardRead> reads;
  size_t into = 0;
  for (const StateRun& run : owned) {
    for (size_t q = 0; q < files.size(); ++q) {
      const size_t low = std::max(run.canonical, files[q].canonical);
      const size_t high = std::min(run.canonical + run.length, files[q].canonical + files[q].length);
      if (low < high) reads.push_back({q, low, high - low, into + (low - run.canonical)});
    }
    into += run.length;
  }
  return reads;
}

// ----------------------------------------------------------------------------
// 8. The ledger: the formulas the measured bytes are held to
//
// Memory (paper section 3.1 and Figure 1, Psi = Psi_padded):
//                 fp32                                  bf16 / fp16 (K = 12: master, m, v)
//   stage 0: 4 + 4 + 8 Psi        = 16 Psi             2 + 2 + 12 Psi           = 16 Psi
//   stage 1: 4 + 4 + 8 Psi / N    = 8 Psi + 8 Psi/N    2 + 2 + 12 Psi / N       = 4 Psi + 12 Psi/N
//   stage 2: 4 + (4 + 8) Psi / N  = 4 Psi + 12 Psi/N   2 + (2 + 12) Psi / N     = 2 Psi + 14 Psi/N
// In fp32 the parameters are their own master copy, so "master" is 0.
// Two things the formulas do not count, printed on their own lines:
//   staging      — slots x (stage 2 bucket + (N-1) x shard) elements of 4 or
//                  2 bytes, constant in the model size;
//   accumulation — with A > 1 micro-steps, floor(log2 A) open blocks of the
//                  canonical tree, each Psi / N elements (fp32 by default in
//                  mixed precision too, where the paper counts none).
//
// Communication per rank per step (section 7.2), counted as a ring sends, the
// same in every stage: A reduce-scatters of (N-1)/N Psi elements and one
// all-gather of (N-1)/N Psi (of gradients in stage 0, where the last
// reduce-scatter and the all-gather form an all-reduce; of parameters in
// stages 1, 2). With A = 1: 2 (N-1)/N Psi x 4 bytes in fp32, x 2 in mixed
// precision, one all-reduce's worth.

// With ZeRO-Offload (stages 1 and 2) the device keeps the working parameters
// and stage 1's full gradient; the host holds 16 Psi/N (move_optimizer_sizes_to_host).
//                 fp32: device | host          mixed: device | host
//   stage 1:     8 Psi        | 16 Psi/N      4 Psi         | 16 Psi/N
//   stage 2:     4 Psi        | 16 Psi/N      2 Psi         | 16 Psi/N
double model_states_formula(int stage, Precision precision, double psi, double ranks, bool offload) {
  const double working = precision == Precision::fp32 ? 4 * psi : 2 * psi;  // the parameters, or a gradient
  if (offload && stage > 0) return stage == 1 ? 2 * working : working;
  if (precision == Precision::fp32) {
    const double fp32[] = {16 * psi, 8 * psi + 8 * psi / ranks, 4 * psi + 12 * psi / ranks};
    return fp32[stage];
  }
  const double mixed[] = {16 * psi, 4 * psi + 12 * psi / ranks, 2 * psi + 14 * psi / ranks};
  return mixed[stage];
}

double offloaded_states_formula(int stage, Precision, double psi, double ranks, bool offload) {
  return offload && stage > 0 ? 16 * psi / ranks : 0;
}

MemoryLedger Engine::memory_ledger() const {
  require_built("memory_ledger");
  const MemoryCounters& c = compute_.memory();
  const size_t psi = psi_padded(), N = comm_.world_size(), e = rank_state_->element;
  MemoryLedger ledger;
  ledger.precision = options_.precision;
  ledger.params = c.current[(int)MemoryKind::params];
  ledger.grads = c.current[(int)MemoryKind::grads];
  ledger.optimizer = c.current[(int)MemoryKind::optimizer];
  ledger.master = c.current[(int)MemoryKind::master];
  ledger.accumulation = c.current[(int)MemoryKind::accumulation];
  ledger.staging = c.current[(int)MemoryKind::staging];
  ledger.activations = c.peak[(int)MemoryKind::activations];
  ledger.bookkeeping = c.current[(int)MemoryKind::bookkeeping];
  ledger.model_states = ledger.params + ledger.grads + ledger.optimizer + ledger.master;
  // Exact in double: Psi_padded is a multiple of N, and far below 2^53.
  const bool offload = rank_state_->offload;
  ledger.model_states_formula =
      (size_t)model_states_formula(options_.stage, options_.precision, (double)psi, (double)N, offload);
  // ZeRO-Offload's column: what the host holds, by category, against 16 Psi/N.
  ledger.offload_optimizer = offload;
  ledger.host_params = c.host_current[(int)MemoryKind::params];
  ledger.host_grads = c.host_current[(int)MemoryKind::grads];
  ledger.host_optimizer = c.host_current[(int)MemoryKind::optimizer];
  ledger.host_master = c.host_current[(int)MemoryKind::master];
  ledger.host_bookkeeping = c.host_current[(int)MemoryKind::bookkeeping];
  ledger.host_model_states = ledger.host_params + ledger.host_grads + ledger.host_optimizer + ledger.host_master;
  ledger.host_model_states_formula =
      (size_t)offloaded_states_formula(options_.stage, options_.precision, (double)psi, (double)N, offload);
  ledger.accumulation_formula =
      accumulation_blocks(options_.accumulation_steps) * (psi / N) * rank_state_->accumulation_element;
  size_t max_padded_bucket = 0;
  for (auto& b : buckets_) max_padded_bucket = std::max(max_padded_bucket, b.padded_length);
  ledger.staging_formula =
      staging_slots(options_) * ((options_.stage == 2 ? max_padded_bucket : 0) + (N - 1) * (max_padded_bucket / N)) * e;
  ledger.device_current = c.total_current;
  ledger.device_peak = c.total_peak;
  ledger.host_pinned = c.host_pinned_current;
  ledger.reserved = c.reserved_peak;
  ledger.capacity = compute_.capacity();
  ledger.fragmentation = c.reserved_peak > 0 ? 1.0 - (double)c.total_peak / (double)c.reserved_peak : 0.0;
  ledger.host_offload_peak = c.host_offload_peak;
  if (rank_state_->allocations_at_step1 >= 0)
    ledger.device_allocations_after_step1 = c.allocations - rank_state_->allocations_at_step1;
  ledger.device_allocations_per_step = rank_state_->allocations_last_step;
  ledger.stack_pushes_per_step = rank_state_->pushes_last_step;
  ledger.device_mallocs = c.device_mallocs;
  return ledger;
}

CommLedger Engine::comm_ledger() const {
  require_built("comm_ledger");
  const size_t psi = psi_padded(), N = comm_.world_size(), A = options_.accumulation_steps;
  const size_t one_way = (N - 1) * (psi / N) * rank_state_->element;  // (N-1)/N Psi elements of 4 or 2 bytes
  CommLedger ledger;
  ledger.per_step = rank_state_->last_step_counters;
  ledger.formula_per_step = A * one_way + one_way;  // A reduce-scatters + 1 all-gather, in every stage
  return ledger;
}

}  // namespace z2
