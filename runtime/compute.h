// runtime/compute.h — the compute backend (part of zero2.h: include zero2.h,
// not this): cpu (C++ loops and OpenBLAS) or cuda (kernels and cuBLAS) behind
// one class, and sim, the cuda backend's streams run on the CPU by the
// simulated device (runtime/simulated_device.h) to test the waits. Memory with a ledger by kind, from one of four allocators;
// streams and events (no-ops on cpu); the products; and for_each, which runs
// one loop body, written once as Z2_LOOP(i, { ... }), as a CPU loop or as a
// CUDA kernel. Implemented in runtime/compute.cpp (streams, events, copies),
// runtime/allocators.cpp (where memory comes from) and runtime/gemm.cu.
#pragma once

namespace z2 {

// Z2_LOOP(i, { body }): one loop body, written once. In the nvcc build it
// becomes two lambdas from the same text, a plain host one for the CPU loop
// (inlined and vectorised as g++ would: nvcc's __host__ __device__ lambdas
// are called through a type-erased wrapper on the host, one indirect call
// per element) and a __device__ one for the kernel; in the g++ build, one
// plain lambda. (__VA_ARGS__: commas in the body survive the macro.)
template <class HostBody, class DeviceBody>
struct Loop {
  HostBody host;
  DeviceBody device;
};
template <class HostBody, class DeviceBody>
Loop<HostBody, DeviceBody> make_loop(HostBody host, DeviceBody device) {
  return {host, device};
}
#if defined(__CUDACC__)
#define Z2_LOOP(index, ...) ::z2::make_loop([=](size_t index) __VA_ARGS__, [=] __device__(size_t index) __VA_ARGS__)
#else
#define Z2_LOOP(index, ...) [=](size_t index) __VA_ARGS__
#endif
// Z2_LOOP2(row, column, { body }): the same over a [rows, columns] grid, for
// Compute::for_each(rows, columns, ...) and Compute::column_sums. On the CPU
// the rows are the outer loop and the columns the inner one, so the body sees
// `row` constant across the inner loop: no division per element (i / columns
// and i % columns cost 20-40 cycles each), what depends on the row alone is
// hoisted out, and the inner loop can be vectorised.
#if defined(__CUDACC__)
#define Z2_LOOP2(row, column, ...) \
  ::z2::make_loop([=](size_t row, size_t column) __VA_ARGS__, [=] __device__(size_t row, size_t column) __VA_ARGS__)
#else
#define Z2_LOOP2(row, column, ...) [=](size_t row, size_t column) __VA_ARGS__
#endif

// cpu: C++ loops and OpenBLAS, run at once. cuda: kernels and cuBLAS on
// streams. sim: the cuda backend's execution model run on the CPU
// (runtime/simulated_device.h): the cpu's loops and products, queued on
// streams and run as late as events allow, so a missing wait changes the bits.
enum class Device { cpu, cuda, sim };
enum class MemoryKind {
  params,        // full working parameters, every stage: fp32 (4 Psi) or 16-bit (2 Psi)
  grads,         // full gradients (stages 0, 1) or the own gradient shard (stage 2), same type
  optimizer,     // AdamW m and v, fp32 (full in stage 0, own shard in stages 1, 2)
  master,        // fp32 master weights in mixed precision (as m); none in fp32
  accumulation,  // open blocks of the accumulation tree (A > 1 only)
  staging,       // constant-size gradient staging and receive buffers
  activations,   // the model's activations and temporaries
  bookkeeping,   // small engine tables: norm chunk sums, weight-decay flags
  count
};
const char* to_string(Device device);
const char* to_string(MemoryKind kind);

// Whether a CUDA device can be used here; if not, `why` says what the runtime said.
bool cuda_available(std::string* why = nullptr);
bool built_with_cuda();
bool built_with_nccl();

struct Stream {
  void* handle = nullptr;  // cudaStream_t on cuda; the stream's number + 1 on sim; unused on cpu
};
struct Event {
  void* handle = nullptr;  // cudaEvent_t on cuda; a SimEvent on sim
};

// Where a stream operation was asked for: the caller's file, line and
// function, filled in by the default argument (GCC's and nvcc's builtins).
// The simulated device names both sides of a race with it, the timeline
// names a loop by it, and the mutation test removes one wait by it.
struct Site {
  const char* file = "";
  int line = 0;
  const char* function = "";
  static Site here(const char* file = __builtin_FILE(), int line = __builtin_LINE(),
                   const char* function = __builtin_FUNCTION()) {
    return {file, line, function};
  }
};
class SimulatedDevice;
class Timeline;

// What an operation does, in the units of the timeline's cost model
// (runtime/timeline.h): a loop's elements, a product's flops, a copy's or a
// fill's bytes, and whether a copy crosses to host memory.
struct Work {
  enum class Kind { none, loop, gemm_fp32, gemm_16bit, copy, fill };
  Kind kind = Kind::none;
  double amount = 0;
  bool host_link = false;  // a copy with host memory on one side (or both)
};

// Where device memory comes from (ZeRO-R's M_D, paper section 6.3; notes/05).
//   direct: every buffer is its own cudaMalloc (host allocation on cpu); the
//           engine's tests and the MLP demo use it.
//   arena:  one block of `capacity` bytes reserved at start-up. allocate()
//           carves long-lived buffers from its bottom (model states, staging,
//           checkpoints: a bump pointer); push()/pop() run a stack from its
//           top for per-block temporaries, strictly last in, first out.
//           Neither searches anything, so after start-up no allocation is
//           made at all, and free memory is always one piece.
//   naive:  the same block, but every buffer (pushed or allocated) comes from
//           a best-fit free list and goes back to it when released, in program
//           order: a model of a framework's caching allocator without the
//           arena. Long-lived buffers land between short-lived ones and the
//           free memory breaks into pieces.
//   caching: PyTorch's CUDA caching allocator, modelled (runtime/allocators.cpp):
//           sizes rounded to 512 bytes, small and large pools of blocks split
//           inside segments of 2 MiB, 20 MiB or the request rounded to 2 MiB,
//           merged only inside their segment, segments cached, never returned
//           (except to retry a request the device refused). `capacity` is
//           what the device lets the segments take; nothing is reserved.
enum class Allocator { direct, arena, naive, caching };
const char* to_string(Allocator allocator);

// Where a DeviceArray lives: device memory, or (ZeRO-Offload's optimizer
// state) pinned host memory, counted in the ledger's host column. The
// name says what most of them are; Place::host is the exception, and the
// engine's members say where each one lives.
enum class Place { device, host };

// Thrown when the block cannot serve a request. The message says what was
// asked, how much is free, in how many pieces, and the largest piece. Every
// rank makes the same requests in the same order (the trainer sees to it), so
// every rank throws at the same point and they all stop together.
struct OutOfMemory : Error {
  using Error::Error;
};

// Byte counts per kind; `current` now, `peak` the high-water mark.
struct MemoryCounters {
  size_t current[(int)MemoryKind::count] = {};
  size_t peak[(int)MemoryKind::count] = {};
  size_t total_current = 0, total_peak = 0;        // live bytes (what buffers asked for)
  size_t reserved_current = 0, reserved_peak = 0;  // bytes of the block in use (runtime/allocators.cpp: "reserved =")
  size_t host_pinned_current = 0, host_pinned_peak = 0;    // staging for --comm mpi on cuda
  size_t host_offload_current = 0, host_offload_peak = 0;  // activation checkpoints moved to the host
  // ZeRO-Offload's model states in pinned host memory (allocate_host), by
  // kind: allocated once at build(), so what is held now is the peak too.
  size_t host_current[(int)MemoryKind::count] = {};
  long allocations = 0;     // allocator calls that find memory (cudaMalloc, a free-list search, a bump at start-up)
  long pushes = 0;          // arena stack pushes (pointer arithmetic inside the reserved block)
  long device_mallocs = 0;  // cudaMalloc (or host allocations on cpu) of device memory
};

// One point of a memory trace (Compute::set_tracing): after each allocate,
// release, push or pop, the live bytes, the reserved bytes, the live
// activation bytes, and how many pieces the free memory of the block is in.
struct MemorySample {
  size_t live = 0, reserved = 0, activations = 0, free_pieces = 0;
};

class Compute {
 public:
  // `device_index` chooses the GPU (ranks on one host share GPUs round-robin).
  Compute(Device device, int device_index = 0);
  ~Compute();
  Compute(const Compute&) = delete;
  Compute& operator=(const Compute&) = delete;

  Device device() const { return device_; }
  bool on_cuda() const { return device_ == Device::cuda; }
  // The device's memory is not the host's: on cuda, and on sim, which keeps
  // cuda's rules (MPI's collectives stage through pinned host buffers).
  bool memory_apart_from_host() const { return device_ != Device::cpu; }
  int device_index() const { return device_index_; }
  Stream compute_stream() const { return compute_stream_; }
  Stream comm_stream() const { return comm_stream_; }
  Stream copy_stream() const { return copy_stream_; }  // activation offload and prefetch

  // Choose the allocator before the first allocation. arena and naive
  // reserve their one block of `capacity` bytes here.
  void use_allocator(Allocator allocator, size_t capacity);
  Allocator allocator() const { return allocator_; }
  size_t capacity() const;  // the block's size (0 for direct)

  // Device memory (host memory on cpu), zero-filled, counted by kind.
  // allocate/release: long-lived buffers. push/pop: temporaries, popped in
  // the reverse order of their pushes (the arena's stack; the same as
  // allocate/release for naive and direct). Buffers of kind `activations` are
  // only used on the compute stream (or after an event on it), so releasing
  // one does not wait: work queued later on the compute stream reuses it safely.
  void* allocate(size_t bytes, MemoryKind kind);
  void release(void* pointer);
  void* push(size_t bytes, MemoryKind kind);
  void pop(void* pointer);
  // What push() of an `activations` buffer leaves in it: zeros (as every
  // other buffer gets; the default), nothing in particular (`none`: for a
  // model that writes every element before it reads it, to which the zeroing
  // was one more pass over the memory; BERT-mini's trainer), or all bits set
  // (`poison`: NaN in fp32, bf16 and fp16, so a read of an unwritten element
  // changes the run's bits; the trainer's --poison-activations, which the
  // suite compares with the plain run).
  enum class PushFill { zero, none, poison };
  void set_activation_fill(PushFill fill) { activation_fill_ = fill; }
  // Page-locked host memory (cudaMallocHost on cuda, plain on cpu). `offload`
  // counts it as activation offload space rather than communication staging.
  void* allocate_host_pinned(size_t bytes, bool offload = false);
  // The same memory for ZeRO-Offload's optimizer state, counted by kind in
  // host_current (the ledger's host column). Released by
  // release_host_pinned, like the rest.
  void* allocate_host(size_t bytes, MemoryKind kind);
  void release_host_pinned(void* pointer);
  const MemoryCounters& memory() const { return counters_; }
  void reset_peaks();  // peaks start again from what is allocated now
  // Free memory of the block, for messages and tests: total, pieces, largest.
  void free_space(size_t* total, size_t* pieces, size_t* largest) const;
  // Record a MemorySample at every allocator event while on.
  void set_tracing(bool on);
  const std::vector<MemorySample>& trace() const { return trace_; }

  // Copies are asynchronous on `stream` for cuda (host side must be pinned to
  // really overlap) and immediate on cpu.
  void copy(void* destination, const void* source, size_t bytes, Stream stream, Site site = Site::here());
  void fill_zero(void* destination, size_t bytes, Stream stream, Site site = Site::here()) {
    fill_bytes(destination, 0, bytes, stream, site);
  }
  void fill_bytes(void* destination, unsigned char value, size_t bytes, Stream stream,
                  Site site = Site::here());  // memset
  void synchronize(Stream stream, Site site = Site::here());
  void synchronize_all(Site site = Site::here());

  Event create_event();
  void destroy_event(Event event);
  void record(Event event, Stream stream, Site site = Site::here());
  bool query(Event event, Site site = Site::here());  // true once the recorded work has finished
  void wait(Stream waiter, Event event, Site site = Site::here());  // GPU-side: `waiter` waits, the host does not
  // The simulated device, or null (device() != sim).
  SimulatedDevice* simulated() const { return sim_.get(); }

  // --timeline (runtime/timeline.h): every stream operation from now on is
  // recorded; timeline() is null until then. A collective that starts (a
  // bucket's transfer in staging slot `slot`, after the comm stream's wait
  // for what backward wrote) opens a span on the slot's track, and its end
  // closes it (-1, and nothing, without a timeline). finish_timeline reads
  // cuda's events (the end of the run; nothing to do on cpu and sim).
  void start_timeline();
  Timeline* timeline() const { return timeline_.get(); }
  long timeline_collective_starts(const char* collective, int bucket, int slot);
  void timeline_collective_ends(long span);
  // On sim, MPI modelled: a collective's `bytes` posted now arrive at the
  // returned time, and the host that sees them arrive has waited for it.
  double timeline_mpi_posted(size_t bytes);
  void timeline_mpi_arrived(double arrival);
  void finish_timeline();

  // Row-major C[M x N] = alpha * op(A) op(B) + beta * C, with op(X) = X or X^T:
  // OpenBLAS sgemm on cpu, cuBLAS sgemm on the compute stream on cuda; in
  // portable mode (set_portable, below) zero2's own kernels on both.
  void gemm(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const float* A, int lda,
            const float* B, int ldb, float beta, float* C, int ldc, Site site = Site::here());

  // `batch` independent products of the same shape, C_k = alpha op(A_k)
  // op(B_k) + beta C_k with X_k = X + k * stride_x (elements): one cuBLAS
  // strided-batched call on cuda (the heads of an attention layer), a loop of
  // gemm on cpu (so on cpu each product has exactly gemm's bits; cuBLAS may
  // pick another kernel for the batched call, deterministic all the same).
  void gemm_batched(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const float* A, int lda,
                    long stride_a, const float* B, int ldb, long stride_b, float beta, float* C, int ldc, long stride_c,
                    int batch, Site site = Site::here());

  // The same with 16-bit A, B and C (mixed precision, notes/08): exact
  // products summed in fp32, alpha and beta in fp32, C rounded once. On cuda
  // cublasGemmEx / cublasGemmStridedBatchedEx with CUBLAS_COMPUTE_32F (and no
  // reduced-precision split-K reduction); on cpu the operands are widened to
  // fp32 in host scratch (outside the ledger, as cuBLAS's workspace is) and
  // sgemm runs: the same products and the same one rounding of C, so the CPU
  // path is a faithful reference (its summation order is OpenBLAS's).
  void gemm(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const bfloat16* A, int lda,
            const bfloat16* B, int ldb, float beta, bfloat16* C, int ldc, Site site = Site::here());
  void gemm(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const float16* A, int lda,
            const float16* B, int ldb, float beta, float16* C, int ldc, Site site = Site::here());
  void gemm_batched(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const bfloat16* A, int lda,
                    long stride_a, const bfloat16* B, int ldb, long stride_b, float beta, bfloat16* C, int ldc,
                    long stride_c, int batch, Site site = Site::here());
  void gemm_batched(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const float16* A, int lda,
                    long stride_a, const float16* B, int ldb, long stride_b, float beta, float16* C, int ldc,
                    long stride_c, int batch, Site site = Site::here());

  // Portable mode (the trainer's --portable; notes/11): every gemm above is
  // zero2's own, in the order portable_dot defines (a blocked, vectorised CPU
  // kernel; a tiled CUDA kernel), in place of OpenBLAS / cuBLAS, whose
  // summation order depends on the CPU or GPU they run on. With it a run's
  // bits depend on its inputs alone. The 16-bit products widen their
  // operands exactly, as the cpu path always does, and round C once.
  // The CPU kernel's vector width is this build's widest, or the one the
  // environment's Z2_PORTABLE_LANES names (16, 8 or 1; a bad value is refused
  // here): a narrower schedule must train to the same bits, which the suite
  // shows as OPENBLAS_CORETYPE forces OpenBLAS's kernels.
  void set_portable(bool on);
  bool portable() const { return portable_; }

  // Seconds spent inside the gemm (OpenBLAS's sgemm or, in portable mode,
  // zero2's) since this Compute was made (cpu only: on cuda the calls only
  // queue work, so there is nothing to time on the host). `make bench`
  // prints it as the step's gemm share.
  double gemm_seconds() const { return gemm_seconds_; }

  // Run body(i) for i in [0, n) (a Z2_LOOP): a CPU loop, or one CUDA thread
  // per i on `stream`.
  template <class Body>
  void for_each(size_t n, Body body, Stream stream, Site site = Site::here());
  template <class Body>
  void for_each(size_t n, Body body, Site site = Site::here()) {
    for_each(n, body, compute_stream_, site);
  }
  // The same loops run as CPU loops on either backend: ZeRO-Offload's step
  // works on host memory with the bodies the device runs without it. One
  // thread (the cpu backend's own loops), or `threads` splitting the rows
  // (below).
  template <class Body>
  void for_each_on_host(size_t n, Body body, int threads = 1);
  template <class Body>
  void for_each_on_host(size_t rows, size_t columns, Body body, int threads = 1);
  // Either, by where the data is: kernels on the device's buffers, CPU loops
  // on host memory (the optimizer step's loops, with or without ZeRO-Offload).
  // The host's loops run on host_threads() threads: ZeRO-Offload's step is
  // the host's work, as DeepSpeedCPUAdam's OpenMP loop is.
  template <class Body>
  void for_each_at(Place place, size_t n, Body body, Site site = Site::here()) {
    if (place == Place::device) return for_each(n, body, site);
    const Timed timed(*this, compute_stream_, "host loop", site, {Work::Kind::loop, (double)n}, true);
    for_each_on_host(n, body, host_threads_);
  }
  template <class Body>
  void for_each_at(Place place, size_t rows, size_t columns, Body body, Site site = Site::here()) {
    if (place == Place::device) return for_each(rows, columns, body, site);
    const Timed timed(*this, compute_stream_, "host loop", site, {Work::Kind::loop, (double)rows * columns}, true);
    for_each_on_host(rows, columns, body, host_threads_);
  }
  // How many threads the host's loops (for_each_at on Place::host) split
  // their rows over: ZeRO-Offload's host step (the Engine sets it at build
  // from EngineOptions::host_threads). Every row is computed whole by one
  // thread and no row reads what another writes, so the bits do not depend
  // on it: each norm chunk's tree and each element's AdamW are the same
  // operations in the same order, whichever thread runs them.
  void set_host_threads(int threads);
  int host_threads() const { return host_threads_; }
  // body(row, column) for every cell of a [rows, columns] grid (Z2_LOOP2): on
  // cpu rows outer and columns inner; on cuda one thread per cell. As for
  // any kernel, no cell may read what another cell writes (the CPU loop tells
  // the compiler so, to vectorise it).
  template <class Body>
  void for_each(size_t rows, size_t columns, Body body, Site site = Site::here());
  // sums[column] = the sum over rows of element(row, column) (Z2_LOOP2
  // returning float), added in row order 0, 1, ..., rows - 1 from 0.0f and
  // stored once as T: the fixed order of the bias and LayerNorm gradients. On
  // cpu the rows are the outer loop (every column's running sum advances one
  // row at a time: the same order, vectorised across columns, in fp32
  // scratch); on cuda one thread per column walks its rows.
  template <class T, class Element>
  void column_sums(size_t rows, size_t columns, Element element, T* sums, Site site = Site::here());

 private:
  void* device_malloc(size_t bytes);  // cudaMalloc / aligned host allocation, zeroed
  void device_free(void* pointer);    // cudaFree / free
  void* caching_take(size_t bytes, MemoryKind kind);
  void caching_give_back(char* start);
  void* take(size_t bytes, MemoryKind kind, bool from_stack);
  void give_back(void* pointer, bool from_stack);
  [[noreturn]] void out_of_memory(size_t bytes, MemoryKind kind, size_t segment = 0) const;  // segment: caching's ask
  void count(void* pointer, size_t bytes, MemoryKind kind);
  size_t reserved_now() const;
  void sample();
  void gemm_16bit(Precision precision, bool transpose_a, bool transpose_b, int M, int N, int K, float alpha,
                  const void* A, int lda, long stride_a, const void* B, int ldb, long stride_b, float beta, void* C,
                  int ldc, long stride_c, int batch, Site site);
  // On sim, outside the simulated device's own operations, work is queued
  // (queue_on_sim: `run` on `stream`; reads and writes: the bytes it touches
  // where known; poison: its writes read as NaN until it ran). Elsewhere the
  // caller does the work itself, now.
  bool queues_on_sim() const { return device_ == Device::sim && !sim_running_; }
  void queue_on_sim(Stream stream, const char* what, Site site, std::function<void()> run,
                    std::initializer_list<std::pair<const void*, size_t>> reads = {},
                    std::initializer_list<std::pair<const void*, size_t>> writes = {}, bool poison = false,
                    Work work = {});  // work: what the timeline's cost model charges for it
  void queue_gemm_on_sim(Site site, size_t element, bool transpose_a, bool transpose_b, int M, int N, int K,
                         const void* A, int lda, long stride_a, const void* B, int ldb, long stride_b, float beta,
                         const void* C, int ldc, long stride_c, int batch, std::function<void()> run);
  // --timeline on cpu and cuda: an operation's slice on its stream's track,
  // from this object's making to its end (the host's clock on cpu, events
  // around the launch on cuda). Nothing without a timeline, nor on sim,
  // whose model records each operation when it is queued.
  // `on_host`: the host's own work (ZeRO-Offload's step), on the host's
  // track by the host's clock, on every backend.
  struct Timed {
    Compute* compute = nullptr;  // null: nothing recorded
    Stream stream;
    const char* what;
    Site site;
    Work work;
    bool on_host;
    double begin = 0;
    void* begin_event = nullptr;  // cuda
    Timed(Compute& c, Stream stream_, const char* what_, Site site_, Work work_, bool on_host_ = false)
        : compute(c.timeline_ && (on_host_ || !c.sim_) ? &c : nullptr),
          stream(stream_),
          what(what_),
          site(site_),
          work(work_),
          on_host(on_host_) {
      if (compute) compute->timed_begin(*this);
    }
    ~Timed() {
      if (compute) compute->timed_end(*this);
    }
    Timed(const Timed&) = delete;
    Timed& operator=(const Timed&) = delete;
  };
  void timed_begin(Timed& timed);
  void timed_end(Timed& timed);
  bool in_host_memory(const void* pointer) const;  // pinned, or not the device's (a copy's side, for the model)
  // Work runs on the host now: always on cpu, on sim inside an operation.
  bool runs_now_on_host() const { return device_ == Device::cpu || (device_ == Device::sim && sim_running_); }
  Device device_;
  int device_index_;
  Stream compute_stream_, comm_stream_, copy_stream_;
  void* cublas_ = nullptr;        // cublasHandle_t for fp32: pedantic math (no TF32)
  void* cublas_16bit_ = nullptr;  // cublasHandle_t for 16-bit inputs: tensor cores, fp32 accumulation
  Allocator allocator_ = Allocator::direct;
  MemoryCounters counters_;
  bool tracing_ = false;
  PushFill activation_fill_ = PushFill::zero;
  std::vector<MemorySample> trace_;
  double gemm_seconds_ = 0;            // see gemm_seconds()
  bool portable_ = false;              // see set_portable()
  int host_threads_ = 1;               // see set_host_threads()
  int portable_lanes_ = 1;             // the CPU schedule's vector width in portable mode
  std::vector<float> column_scratch_;  // column_sums' running sums on cpu (kept: no page faults per call)
  struct Resources;
  std::unique_ptr<Resources> resources_;  // pointer -> (bytes, kind), and the block's bookkeeping
  std::unique_ptr<SimulatedDevice> sim_;  // device() == sim: the streams' queues and the scheduler
  std::unique_ptr<Timeline> timeline_;    // --timeline: what ran where and when
  bool sim_running_ = false;              // the simulated device is running one of its operations
  friend class SimulatedDevice;
};

// The portable product's CPU kernel (runtime/gemm.cu), callable on host
// memory for the tests: row-major C [M x N] = alpha op(A) op(B) + beta C in
// portable_dot's order, by the schedule of `lanes` floats per vector (16:
// AVX-512, 8: AVX2 with FMA, 1: scalar fma, the one every CPU has).
// portable_gemm_lanes() is the widest this build was compiled for; the others
// exist so that the tests compare every schedule with the definition.
int portable_gemm_lanes();
bool portable_gemm_has_lanes(int lanes);
void portable_gemm_cpu(int lanes, bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const float* A,
                       int lda, const float* B, int ldb, float beta, float* C, int ldc);

// A typed, owning array: frees itself, counts itself in the ledger.
template <class T>
class DeviceArray {
 public:
  DeviceArray() = default;
  DeviceArray(Compute& compute, size_t count, MemoryKind kind, Place place = Place::device)
      : compute_(&compute), count_(count), place_(place), data_(count ? static_cast<T*>(take(kind)) : nullptr) {}
  ~DeviceArray() { reset(); }
  DeviceArray(DeviceArray&& other) noexcept { *this = std::move(other); }
  DeviceArray& operator=(DeviceArray&& other) noexcept {
    if (this != &other) {
      reset();
      compute_ = other.compute_, count_ = other.count_, place_ = other.place_, data_ = other.data_;
      other.data_ = nullptr, other.count_ = 0;
    }
    return *this;
  }
  void reset() {
    if (data_ && place_ == Place::host) compute_->release_host_pinned(data_);
    else if (data_) compute_->release(data_);
    data_ = nullptr, count_ = 0;
  }
  T* data() const { return data_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }
  Place place() const { return place_; }

 private:
  void* take(MemoryKind kind) {
    const size_t bytes = count_ * sizeof(T);
    return place_ == Place::host ? compute_->allocate_host(bytes, kind) : compute_->allocate(bytes, kind);
  }
  Compute* compute_ = nullptr;
  size_t count_ = 0;
  Place place_ = Place::device;
  T* data_ = nullptr;
};

#if defined(__CUDACC__)
// The kernel paired with its launcher: one thread per index, 256 per block.
// The index is computed in 64 bits (blockIdx.x * blockDim.x overflows 32 bits
// past 4G elements).
template <class Body>
__global__ void for_each_kernel(size_t n, Body body) {
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) body(i);
}
void launch_check(const char* file, int line);  // cudaGetLastError after a launch
#endif

// The host half of a Z2_LOOP / Z2_LOOP2 (or the plain lambda of the g++
// build), and the device half (which only the nvcc build has).
template <class Body>
const Body& host_body(const Body& body) {
  return body;
}
template <class HostBody, class DeviceBody>
const HostBody& host_body(const Loop<HostBody, DeviceBody>& loop) {
  return loop.host;
}
template <class Body>
const Body& device_body(const Body& body) {
  return body;
}
template <class HostBody, class DeviceBody>
const DeviceBody& device_body(const Loop<HostBody, DeviceBody>& loop) {
  return loop.device;
}

// A host loop over [0, n) on `threads` threads: each thread takes one
// contiguous run of indices (rows, for the 2-D loops below: whole norm
// chunks in the optimizer's loops), as DeepSpeedCPUAdam's OpenMP loop
// splits its tiles. Which thread runs an index never changes what it
// computes. One thread runs the loop itself, without OpenMP.
template <class Run>
void on_host_threads(size_t n, int threads, Run run) {
  if (threads <= 1 || n < 2) return run((size_t)0, n);
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads)
  {
    const size_t t = (size_t)omp_get_thread_num(), count = (size_t)omp_get_num_threads();
    run(n * t / count, n * (t + 1) / count);
  }
#else
  run((size_t)0, n);  // built without OpenMP (the fuzz target): one thread
#endif
}

template <class Body>
void Compute::for_each_on_host(size_t n, Body body, int threads) {
  on_host_threads(n, threads, [&](size_t first, size_t last) {
    // The thread's own copy of the body: its pointers and constants are then
    // locals no store can change, so the compiler keeps them in registers and
    // takes an invariant test (AdamW's lerp branch) out of the loop.
    const auto host = host_body(body);
    for (size_t i = first; i < last; ++i) host(i);
  });
}
template <class Body>
void Compute::for_each(size_t n, Body body, Stream stream, Site site) {
  if (n == 0) return;
  // On sim the loop is queued on its stream and runs when the scheduler says.
  const Work work{Work::Kind::loop, (double)n};
  if (queues_on_sim()) return queue_on_sim(stream, "loop", site, [this, n, body] { for_each_on_host(n, body); }, {}, {}, false, work);
  const Timed timed(*this, stream, "loop", site, work);
  if (runs_now_on_host()) return for_each_on_host(n, body);
#if defined(__CUDACC__)
  const unsigned threads = 256;
  const size_t blocks = (n + threads - 1) / threads;
  for_each_kernel<<<(unsigned)blocks, threads, 0, (cudaStream_t)stream.handle>>>(n, device_body(body));
  launch_check(__FILE__, __LINE__);
#else
  (void)stream;
  usage_error("for_each on cuda called from a file not compiled by nvcc");
#endif
}

#if defined(__CUDACC__)
template <class Body>
__global__ void for_each_2d_kernel(size_t rows, size_t columns, Body body) {
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < rows * columns) body(i / columns, i % columns);
}
template <class T, class Element>
__global__ void column_sums_kernel(size_t rows, size_t columns, Element element, T* sums) {
  size_t column = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (column >= columns) return;
  float sum = 0.0f;
  for (size_t row = 0; row < rows; ++row) sum += element(row, column);
  sums[column] = from_float<T>(sum);
}
#endif

template <class Body>
void Compute::for_each_on_host(size_t rows, size_t columns, Body body, int threads) {
  on_host_threads(rows, threads, [&](size_t first, size_t last) {
    const auto host = host_body(body);  // the thread's own copy (the 1-D loop above says why)
    for (size_t row = first; row < last; ++row)
    // Cells are independent (on cuda each is its own thread), which is what
    // ivdep tells the compiler: no alias check stands between it and vectors.
#pragma GCC ivdep
      for (size_t column = 0; column < columns; ++column) host(row, column);
  });
}
template <class Body>
void Compute::for_each(size_t rows, size_t columns, Body body, Site site) {
  if (rows == 0 || columns == 0) return;
  const Work work{Work::Kind::loop, (double)rows * columns};
  if (queues_on_sim())
    return queue_on_sim(
        compute_stream_, "loop", site, [this, rows, columns, body] { for_each_on_host(rows, columns, body); }, {}, {},
        false, work);
  const Timed timed(*this, compute_stream_, "loop", site, work);
  if (runs_now_on_host()) return for_each_on_host(rows, columns, body);
#if defined(__CUDACC__)
  const unsigned threads = 256;
  const size_t blocks = (rows * columns + threads - 1) / threads;
  for_each_2d_kernel<<<(unsigned)blocks, threads, 0, (cudaStream_t)compute_stream_.handle>>>(rows, columns,
                                                                                             device_body(body));
  launch_check(__FILE__, __LINE__);
#else
  usage_error("for_each on cuda called from a file not compiled by nvcc");
#endif
}

template <class T, class Element>
void Compute::column_sums(size_t rows, size_t columns, Element element, T* sums, Site site) {
  if (columns == 0) return;
  const Work work{Work::Kind::loop, (double)rows * columns};
  if (queues_on_sim())
    return queue_on_sim(
        compute_stream_, "column sums", site,
        [this, rows, columns, element, sums] { column_sums(rows, columns, element, sums); }, {},
        {{sums, columns * sizeof(T)}}, false, work);
  const Timed timed(*this, compute_stream_, "column sums", site, work);
  if (runs_now_on_host()) {
    const auto& host = host_body(element);
    column_scratch_.assign(columns, 0.0f);
    float* running = column_scratch_.data();  // [columns] the sums over the rows so far
    for (size_t row = 0; row < rows; ++row)
#pragma GCC ivdep
      for (size_t column = 0; column < columns; ++column) running[column] += host(row, column);
    for (size_t column = 0; column < columns; ++column) sums[column] = from_float<T>(running[column]);
    return;
  }
#if defined(__CUDACC__)
  const unsigned threads = 256;
  const size_t blocks = (columns + threads - 1) / threads;
  column_sums_kernel<<<(unsigned)blocks, threads, 0, (cudaStream_t)compute_stream_.handle>>>(
      rows, columns, device_body(element), sums);
  launch_check(__FILE__, __LINE__);
#else
  usage_error("column_sums on cuda called from a file not compiled by nvcc");
#endif
}

// Bytes rounded up to 256, as every buffer in a block (arena, naive) starts
// on a 256-byte boundary.
size_t block_round(size_t bytes);
// The caching allocator's rules (Allocator::caching): a request's rounded
// size, and the segment a rounded size asks the device for when no cached
// block holds it.
size_t caching_round_size(size_t bytes);
size_t caching_segment_size(size_t rounded);

}  // namespace z2
