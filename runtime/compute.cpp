// runtime/compute.cpp — the compute backend's mechanics: which backends this
// build has, making and ending a Compute (its streams and cuBLAS handles),
// copies, fills, synchronization and events. Where memory comes from is
// runtime/allocators.cpp; the products are runtime/gemm.cu. Host code: on
// cuda these are calls of the CUDA runtime's host API.
#include "runtime/compute_resources.h"
#include "runtime/simulated_device.h"
#include "runtime/timeline.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <exception>
#include <string>
#if defined(Z2_HAVE_CUDA)
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif

namespace z2 {

const char* to_string(Device device) {
  return device == Device::cuda ? "cuda" : device == Device::sim ? "sim" : "cpu";
}
const char* to_string(Precision precision) {
  return precision == Precision::bf16 ? "bf16" : precision == Precision::fp16 ? "fp16" : "fp32";
}
const char* to_string(Allocator allocator) {
  static const char* names[] = {"direct", "arena", "naive", "caching"};
  return names[(int)allocator];
}

const char* to_string(MemoryKind kind) {
  static const char* names[] = {"params",       "grads",   "optimizer",   "master",
                                "accumulation", "staging", "activations", "bookkeeping"};
  return names[(int)kind];
}

// On cpu, "device memory" is host memory and every operation runs at once, in
// program order; streams and events are no-ops. On sim, memory is the host's
// too, but every operation is queued on its stream and events order them as
// on cuda (runtime/simulated_device.h). On cuda we keep three streams:
// `compute` for the model and the optimizer, `comm` for collectives and the
// reductions that follow them, so a bucket is reduced while backward goes on,
// and `copy` for activation checkpoints on their way to and from the host.
// The ledger counts every byte by kind; the memory formulas are checked
// against these counters, not against what we think we allocated.

bool built_with_cuda() {
#if defined(Z2_HAVE_CUDA)
  return true;
#else
  return false;
#endif
}

bool built_with_nccl() {
#if defined(Z2_HAVE_NCCL)
  return true;
#else
  return false;
#endif
}

bool cuda_available(std::string* why) {
#if defined(Z2_HAVE_CUDA)
  int count = 0;
  cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "insufficient driver" state
    // Without a driver at all the runtime says "driver version is
    // insufficient": on a machine with no GPU, say that instead.
    const bool driver_loaded = access("/proc/driver/nvidia/version", F_OK) == 0;
    if (why && status == cudaErrorInsufficientDriver && !driver_loaded)
      *why = "no GPU here (no NVIDIA driver is loaded)";
    else if (why && status == cudaErrorInsufficientDriver)
      *why = std::string("the NVIDIA driver is older than this build's CUDA runtime needs (") +
             cudaGetErrorString(status) + ")";
    else if (why)
      *why = status == cudaErrorNoDevice ? "no GPU here (no CUDA device found)" : cudaGetErrorString(status);
    return false;
  }
  if (count == 0) {
    if (why) *why = "no CUDA device found";
    return false;
  }
  return true;
#else
  if (why) *why = "built without CUDA (make cpu)";
  return false;
#endif
}
Compute::Compute(Device device, int device_index)
    : device_(device), device_index_(device_index), resources_(new Resources) {
  if (device_ == Device::cpu) return;
  if (device_ == Device::sim) {  // the streams are numbers: the simulated device's queues
    sim_.reset(new SimulatedDevice(*this));
    compute_stream_.handle = (void*)1, comm_stream_.handle = (void*)2, copy_stream_.handle = (void*)3;
    return;
  }
#if defined(Z2_HAVE_CUDA)
  std::string why;
  if (!cuda_available(&why)) usage_error("--device cuda: %s", why.c_str());
  int count = 0;
  Z2_CUDA_CHECK(cudaGetDeviceCount(&count));
  device_index_ = device_index % count;  // ranks beyond the GPU count share GPUs (MPI comm only)
  Z2_CUDA_CHECK(cudaSetDevice(device_index_));
  cudaStream_t compute_stream, comm_stream, copy_stream;
  // Non-blocking streams: none waits for the legacy default stream, so the
  // only orderings are the events we record on purpose.
  Z2_CUDA_CHECK(cudaStreamCreateWithFlags(&compute_stream, cudaStreamNonBlocking));
  Z2_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream, cudaStreamNonBlocking));
  Z2_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream, cudaStreamNonBlocking));
  compute_stream_.handle = compute_stream;
  comm_stream_.handle = comm_stream;
  copy_stream_.handle = copy_stream;
  cublasHandle_t handle;
  Z2_CUBLAS_CHECK(cublasCreate(&handle));
  Z2_CUBLAS_CHECK(cublasSetStream(handle, compute_stream));
  // Plain fp32 math: no TF32 tensor cores, so results do not depend on a mode.
  // cuBLAS is bitwise reproducible for one handle on one stream.
  Z2_CUBLAS_CHECK(cublasSetMathMode(handle, CUBLAS_PEDANTIC_MATH));
  cublas_ = handle;
  // 16-bit inputs (mixed precision): tensor cores, exact products summed in
  // fp32; a split-K reduction must not round partial sums to 16 bits.
  cublasHandle_t handle_16bit;
  Z2_CUBLAS_CHECK(cublasCreate(&handle_16bit));
  Z2_CUBLAS_CHECK(cublasSetStream(handle_16bit, compute_stream));
  Z2_CUBLAS_CHECK(cublasSetMathMode(
      handle_16bit, (cublasMath_t)(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
  cublas_16bit_ = handle_16bit;
#else
  usage_error("--device cuda: built without CUDA (make cpu); use --device cpu");
#endif
}

void Compute::set_host_threads(int threads) {
  if (threads < 1) usage_error("host threads: at least 1 (got %d)", threads);
  host_threads_ = threads;
}

Compute::~Compute() {
#if defined(Z2_HAVE_CUDA)
  if (device_ == Device::cuda) {
    // No checks here: a destructor may run while an error unwinds, and a
    // failing cleanup call must not hide the first error.
    cudaDeviceSynchronize();
    if (resources_->block) {
      cudaFree(resources_->block);
    } else if (allocator_ == Allocator::caching) {
      for (auto& segment : resources_->segments) cudaFree(segment.second.base);
    } else {
      for (auto& entry : resources_->allocations) cudaFree(entry.first);
    }
    for (auto& entry : resources_->pinned) cudaFreeHost(entry.first);
    cublasDestroy((cublasHandle_t)cublas_);
    cublasDestroy((cublasHandle_t)cublas_16bit_);
    cudaStreamDestroy((cudaStream_t)compute_stream_.handle);
    cudaStreamDestroy((cudaStream_t)comm_stream_.handle);
    cudaStreamDestroy((cudaStream_t)copy_stream_.handle);
    return;
  }
#endif
  if (sim_ && timeline_) set_waiting_clock(nullptr);
  // What the simulated device still holds runs before its memory goes (an
  // error unwinding may have left work queued; a second error here is dropped).
  // While an error unwinds, the queued copies may name host vectors whose
  // frames are gone: then the queues are dropped, not run.
  if (sim_ && std::uncaught_exceptions() == 0) try {
      sim_->synchronize_all(Site::here());
    } catch (...) {
    }
  if (resources_->block) {
    if (sim_) sim_->forget_memory(resources_->block);
    munmap(resources_->block, resources_->capacity);
  } else if (allocator_ == Allocator::caching) {
    for (auto& segment : resources_->segments) device_free(segment.second.base);
  } else {
    for (auto& entry : resources_->allocations) device_free(entry.first);
  }
  for (auto& entry : resources_->pinned) std::free(entry.first);
}
// The stream's number on sim (Stream::handle is it + 1).
static int sim_stream(Stream stream) { return (int)(intptr_t)stream.handle - 1; }

void Compute::queue_on_sim(Stream stream, const char* what, Site site, std::function<void()> run,
                           std::initializer_list<std::pair<const void*, size_t>> reads,
                           std::initializer_list<std::pair<const void*, size_t>> writes, bool poison, Work work) {
  SimOperation operation;
  operation.what = what;
  operation.site = site;
  operation.work = work;
  operation.run = std::move(run);
  operation.poison = poison;
  for (const auto& read : reads)
    if (read.second) operation.reads.push_back({(const char*)read.first, (const char*)read.first + read.second});
  for (const auto& write : writes)
    if (write.second) operation.writes.push_back({(const char*)write.first, (const char*)write.first + write.second});
  sim_->enqueue(sim_stream(stream), std::move(operation));
}

void Compute::copy(void* destination, const void* source, size_t bytes, Stream stream, Site site) {
  if (bytes == 0 || destination == source) return;
  // Whether it crosses the host link matters to the timeline's model only.
  const Work work{Work::Kind::copy, (double)bytes, timeline_ && (in_host_memory(destination) || in_host_memory(source))};
  if (queues_on_sim()) {  // the bytes it reads and writes are known; its destination is poisoned
    const std::string what = "copy of " + with_commas(bytes) + " bytes";
    queue_on_sim(stream, what.c_str(), site, [=] { std::memmove(destination, source, bytes); }, {{source, bytes}},
                 {{destination, bytes}}, true, work);
    return;
  }
  const Timed timed(*this, stream, "copy", site, work);
  if (runs_now_on_host()) {
    std::memmove(destination, source, bytes);
    return;
  }
#if defined(Z2_HAVE_CUDA)
  // cudaMemcpyDefault: unified addressing tells host from device pointers.
  Z2_CUDA_CHECK(cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDefault, (cudaStream_t)stream.handle));
#endif
}

void Compute::fill_bytes(void* destination, unsigned char value, size_t bytes, Stream stream, Site site) {
  if (bytes == 0) return;
  const Work work{Work::Kind::fill, (double)bytes};
  if (queues_on_sim()) {
    const std::string what = "fill of " + with_commas(bytes) + " bytes";
    queue_on_sim(stream, what.c_str(), site, [=] { std::memset(destination, value, bytes); }, {},
                 {{destination, bytes}}, true, work);
    return;
  }
  const Timed timed(*this, stream, "fill", site, work);
  if (runs_now_on_host()) {
    std::memset(destination, value, bytes);
    return;
  }
#if defined(Z2_HAVE_CUDA)
  Z2_CUDA_CHECK(cudaMemsetAsync(destination, value, bytes, (cudaStream_t)stream.handle));
#endif
}

// Polled, not cudaStreamSynchronize: a kernel waiting for a stopped peer
// (an NCCL collective) would block the host forever; the watchdog ends it.
void Compute::synchronize(Stream stream, Site site) {
  if (sim_) return sim_->synchronize(sim_stream(stream), site);
#if defined(Z2_HAVE_CUDA)
  if (device_ == Device::cuda) {
    cudaStream_t handle = (cudaStream_t)stream.handle;
    const char* name = stream.handle == comm_stream_.handle   ? "comm"
                       : stream.handle == copy_stream_.handle ? "copy"
                                                              : "compute";
    wait_until(
        [&] {
          const cudaError_t status = cudaStreamQuery(handle);
          if (status == cudaErrorNotReady) return false;
          Z2_CUDA_CHECK(status);
          return true;
        },
        [&] {
          return std::string("the GPU's ") + name +
                 " stream (a kernel, a copy or an NCCL collective that did not finish)";
        });
  }
#endif
  (void)stream;
}

void Compute::synchronize_all(Site site) {
  if (sim_) return sim_->synchronize_all(site);
  synchronize(compute_stream_, site);
  synchronize(comm_stream_, site);
  synchronize(copy_stream_, site);
}

Event Compute::create_event() {
  Event event;
  if (sim_) event.handle = new SimEvent;
#if defined(Z2_HAVE_CUDA)
  if (device_ == Device::cuda) {
    cudaEvent_t handle;
    // No timing: a timing event costs more to record and we only order work.
    Z2_CUDA_CHECK(cudaEventCreateWithFlags(&handle, cudaEventDisableTiming));
    event.handle = handle;
  }
#endif
  return event;
}

void Compute::destroy_event(Event event) {
  if (sim_) return delete (SimEvent*)event.handle;
#if defined(Z2_HAVE_CUDA)
  if (event.handle) cudaEventDestroy((cudaEvent_t)event.handle);
#endif
  (void)event;
}

void Compute::record(Event event, Stream stream, Site site) {
  if (sim_) return sim_->record(*(SimEvent*)event.handle, sim_stream(stream), site);
#if defined(Z2_HAVE_CUDA)
  if (device_ == Device::cuda) Z2_CUDA_CHECK(cudaEventRecord((cudaEvent_t)event.handle, (cudaStream_t)stream.handle));
#endif
  (void)event, (void)stream;
}

bool Compute::query(Event event, Site site) {
  if (sim_) return sim_->query(*(SimEvent*)event.handle, site);
#if defined(Z2_HAVE_CUDA)
  if (device_ == Device::cuda) {
    cudaError_t status = cudaEventQuery((cudaEvent_t)event.handle);
    if (status == cudaErrorNotReady) return false;
    Z2_CUDA_CHECK(status);
  }
#endif
  (void)event;
  return true;
}

void Compute::wait(Stream waiter, Event event, Site site) {
  if (sim_) return sim_->wait(sim_stream(waiter), *(SimEvent*)event.handle, site);
#if defined(Z2_HAVE_CUDA)
  if (device_ == Device::cuda)
    Z2_CUDA_CHECK(cudaStreamWaitEvent((cudaStream_t)waiter.handle, (cudaEvent_t)event.handle, 0));
#endif
  (void)waiter, (void)event;
}

// --- the timeline (--timeline; runtime/timeline.h) ---------------------------

// On sim the operations already queued count as done when it starts. On
// cuda every later operation must come after the origin event: the device
// is idle first, so every elapsed time measured from it is positive.
void Compute::start_timeline() {
  if (timeline_) return;
  long queued[SimulatedDevice::streams] = {};
  if (sim_)
    for (int s = 0; s < SimulatedDevice::streams; ++s) queued[s] = sim_->queued(s);
  timeline_ = std::make_unique<Timeline>(device_, queued);
  if (sim_) set_waiting_clock(timeline_.get());
#if defined(Z2_HAVE_CUDA)
  if (device_ == Device::cuda) {
    Z2_CUDA_CHECK(cudaDeviceSynchronize());
    cudaEvent_t origin;
    Z2_CUDA_CHECK(cudaEventCreate(&origin));
    Z2_CUDA_CHECK(cudaEventRecord(origin, (cudaStream_t)compute_stream_.handle));
    Z2_CUDA_CHECK(cudaEventSynchronize(origin));
    timeline_->gpu_origin = origin;
  }
#endif
}

// A stream's track: its number (cpu: one track, every operation runs at once).
static int track_of(const Compute& compute, Stream stream) {
  if (compute.device() == Device::cpu) return 0;
  if (stream.handle == compute.comm_stream().handle) return 1;
  return stream.handle == compute.copy_stream().handle ? 2 : 0;
}

#if defined(Z2_HAVE_CUDA)
// A timing event recorded on `stream` now (destroyed by finish_timeline).
static void* timing_event(Stream stream) {
  cudaEvent_t event;
  Z2_CUDA_CHECK(cudaEventCreate(&event));
  Z2_CUDA_CHECK(cudaEventRecord(event, (cudaStream_t)stream.handle));
  return event;
}
#endif

void Compute::timed_begin(Timed& timed) {
  timed.begin = timeline_->host_now();
#if defined(Z2_HAVE_CUDA)
  if (device_ == Device::cuda && !timed.on_host) timed.begin_event = timing_event(timed.stream);
#endif
}

void Compute::timed_end(Timed& timed) {
  const int track = timed.on_host ? Timeline::host_track : track_of(*this, timed.stream);
#if defined(Z2_HAVE_CUDA)
  if (timed.begin_event) {
    timeline_->gpu_slices.push_back({track, timed.site, timed.work, timed.begin_event, timing_event(timed.stream)});
    return;
  }
#endif
  timeline_->slice(track, timed.site, timed.work, timed.begin, timeline_->host_now());
}

// A collective's span: from where the comm stream may start it (on sim its
// modelled time, after the wait for what backward wrote; on cuda an event
// on the comm stream) to where the host sees it finished (an event on cuda).
long Compute::timeline_collective_starts(const char* collective, int bucket, int slot) {
  if (!timeline_) return -1;
  const std::string name = std::string(collective) + " bucket " + std::to_string(bucket);
  double begin = timeline_->host_now();
  if (sim_) begin = std::max(begin, timeline_->sim_stream_end(1));
  const long span = timeline_->open(Timeline::first_slot_track + slot, name, begin, "collective");
#if defined(Z2_HAVE_CUDA)
  if (device_ == Device::cuda)
    timeline_->gpu_slices.push_back({0, Site{}, Work{}, timing_event(comm_stream_), nullptr, span});
#endif
  return span;
}

void Compute::timeline_collective_ends(long span) {
  if (!timeline_ || span < 0) return;
#if defined(Z2_HAVE_CUDA)
  if (device_ == Device::cuda) {
    for (auto slice = timeline_->gpu_slices.rbegin(); slice != timeline_->gpu_slices.rend(); ++slice)
      if (slice->span == span) return (void)(slice->end = timing_event(comm_stream_));
  }
#endif
  timeline_->close(span, timeline_->host_now());
}

double Compute::timeline_mpi_posted(size_t bytes) {
  return timeline_ && sim_ ? timeline_->sim_posted(bytes) : 0;
}
void Compute::timeline_mpi_arrived(double arrival) {
  if (timeline_ && sim_) timeline_->sim_arrived(arrival);
}

// cuda: every timed operation's events read, in seconds after the origin,
// and destroyed. (Unmeasured: no GPU has run this.)
void Compute::finish_timeline() {
#if defined(Z2_HAVE_CUDA)
  if (!timeline_ || device_ != Device::cuda) return;
  Z2_CUDA_CHECK(cudaDeviceSynchronize());
  auto seconds = [&](void* event) {
    float ms = 0;
    Z2_CUDA_CHECK(cudaEventElapsedTime(&ms, (cudaEvent_t)timeline_->gpu_origin, (cudaEvent_t)event));
    cudaEventDestroy((cudaEvent_t)event);
    return ms / 1e3;
  };
  for (const Timeline::GpuSlice& slice : timeline_->gpu_slices) {
    if (!slice.end) continue;  // a collective that never ended (cannot happen after finish_all)
    const double begin = seconds(slice.begin), end = seconds(slice.end);
    if (slice.span >= 0) {
      timeline_->move_begin(slice.span, begin);
      timeline_->close(slice.span, end);
    } else {
      timeline_->slice(slice.track, slice.site, slice.work, begin, end);
    }
  }
  timeline_->gpu_slices.clear();
#endif
}

// Host memory, for a copy's side: a pinned buffer, or anything the device's
// allocator did not hand out (a std::vector of the caller's).
bool Compute::in_host_memory(const void* pointer) const {
  const char* p = (const char*)pointer;
  for (const auto& entry : resources_->pinned)
    if (p >= (const char*)entry.first && p < (const char*)entry.first + entry.second.bytes) return true;
  if (resources_->block) return !(p >= resources_->block && p < resources_->block + resources_->capacity);
  for (const auto& segment : resources_->segments)
    if (p >= segment.second.base && p < segment.second.base + segment.second.bytes) return false;
  for (const auto& entry : resources_->allocations)
    if (p >= (const char*)entry.first && p < (const char*)entry.first + entry.second.first) return false;
  return true;
}
}  // namespace z2
