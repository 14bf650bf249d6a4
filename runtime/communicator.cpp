// runtime/communicator.cpp — who talks to whom: the Communicator (MPI and
// NCCL start-up, the scalar helpers of a step), --device and --comm resolved
// alike on every rank, and the memory each rank may count on (the GPU's free
// memory, or MemAvailable and the cgroup's room). Host code.
#include "zero2.h"

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#if defined(Z2_HAVE_CUDA)
#include <cuda_runtime.h>
#endif
#if defined(Z2_HAVE_NCCL)
#include <nccl.h>
#endif

namespace z2 {

const char* to_string(CommBackend backend) { return backend == CommBackend::nccl ? "nccl" : "mpi"; }
const char* to_string(Collectives collectives) {
  return collectives == Collectives::native ? "native" : "deterministic";
}

// MPI is always there: it starts the processes, carries the NCCL unique id, and
// moves the few scalars of a step (loss contributions, norm chunk sums). The
// bulk traffic, gradient buckets and parameter shards, goes over the backend:
//   mpi  — host buffers; on cuda we stage through pinned host memory, which is
//          what lets several ranks share one GPU;
//   nccl — device buffers, one GPU per rank. Start-up order as nccl-tests:
//          local rank -> ncclGetUniqueId on rank 0 -> MPI_Bcast -> the device
//          is already set by Compute -> ncclCommInitRank.

int local_rank_of(MPI_Comm comm) {
  MPI_Comm host_comm;
  int rank = 0;
  Z2_MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &host_comm));
  Z2_MPI_CHECK(MPI_Comm_rank(host_comm, &rank));
  Z2_MPI_CHECK(MPI_Comm_free(&host_comm));
  return rank;
}

static int local_size_of(MPI_Comm comm) {
  MPI_Comm host_comm;
  int size = 0;
  Z2_MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &host_comm));
  Z2_MPI_CHECK(MPI_Comm_size(host_comm, &size));
  Z2_MPI_CHECK(MPI_Comm_free(&host_comm));
  return size;
}

// The CPUs a container's quota allows (cgroup v2 cpu.max "QUOTA PERIOD", or
// "max": none; v1 cpu.cfs_quota_us, -1: none, over cpu.cfs_period_us); 0
// when there is no quota or neither can be read.
static double cgroup_cpu_quota() {
  long long quota = 0, period = 0;
  if (std::FILE* v2 = std::fopen("/sys/fs/cgroup/cpu.max", "r")) {
    const bool read = std::fscanf(v2, "%lld %lld", &quota, &period) == 2;
    std::fclose(v2);
    return read && quota > 0 && period > 0 ? (double)quota / (double)period : 0.0;  // "max" reads as no number
  }
  std::FILE* v1_quota = std::fopen("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "r");
  std::FILE* v1_period = std::fopen("/sys/fs/cgroup/cpu/cpu.cfs_period_us", "r");
  const bool read = v1_quota && v1_period && std::fscanf(v1_quota, "%lld", &quota) == 1 &&
                    std::fscanf(v1_period, "%lld", &period) == 1;
  for (std::FILE* file : {v1_quota, v1_period})
    if (file) std::fclose(file);
  return read && quota > 0 && period > 0 ? (double)quota / (double)period : 0.0;
}

// A launcher that binds ranks narrows each one's affinity mask (Open MPI per
// core or per socket, Slurm's --cpus-per-task); one that does not leaves
// every rank the whole machine. Either way the ranks that hold the same mask
// share its CPUs, so the share is the mask's CPUs over the ranks of this
// node with that mask. A container's CPU quota caps it, split over all the
// node's ranks. Collective (every rank calls it in Engine::build).
int host_cores_per_rank(MPI_Comm comm) {
  cpu_set_t mine;
  CPU_ZERO(&mine);
  if (sched_getaffinity(0, sizeof(mine), &mine) != 0) CPU_SET(0, &mine);  // unknown: one CPU
  MPI_Comm host_comm;
  int local = 1;
  Z2_MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &host_comm));
  Z2_MPI_CHECK(MPI_Comm_size(host_comm, &local));
  std::vector<cpu_set_t> masks((size_t)local);
  Z2_MPI_CHECK(MPI_Allgather(&mine, (int)sizeof(cpu_set_t), MPI_BYTE, masks.data(), (int)sizeof(cpu_set_t), MPI_BYTE,
                             host_comm));
  Z2_MPI_CHECK(MPI_Comm_free(&host_comm));
  int sharing = 0;
  for (cpu_set_t& mask : masks) sharing += CPU_EQUAL(&mask, &mine) ? 1 : 0;
  int share = CPU_COUNT(&mine) / std::max(1, sharing);
  const double quota = cgroup_cpu_quota();
  if (quota > 0) share = std::min(share, (int)(quota / local));
  return std::max(1, share);
}

// The cgroup's room: its limit less what it holds that cannot be reclaimed.
// Its usage counts page cache, which the kernel reclaims before it kills
// anything, so only what is not file-backed counts. cgroup v2 (memory.max,
// "max": no limit) at the usual mount, else v1 (memory.limit_in_bytes, a huge
// number: no limit). False when neither is readable or neither limits.
static bool cgroup_room(unsigned long long* room, bool* version_one) {
  struct Files {
    const char *limit, *usage, *stat, *file_key;
  };
  const Files hierarchies[2] = {
      {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat", "file %llu"},
      {"/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
       "/sys/fs/cgroup/memory/memory.stat", "total_cache %llu"}};
  for (int k = 0; k < 2; ++k) {
    unsigned long long limit = 0, used = 0, file_backed = 0;
    char line[256];
    std::FILE* limit_file = std::fopen(hierarchies[k].limit, "r");
    std::FILE* used_file = std::fopen(hierarchies[k].usage, "r");
    std::FILE* stat_file = std::fopen(hierarchies[k].stat, "r");
    while (stat_file && std::fgets(line, sizeof line, stat_file))
      if (std::sscanf(line, hierarchies[k].file_key, &file_backed) == 1) break;
    const bool read = limit_file && used_file && std::fscanf(limit_file, "%llu", &limit) == 1 &&
                      std::fscanf(used_file, "%llu", &used) == 1;
    for (std::FILE* file : {limit_file, used_file, stat_file})
      if (file) std::fclose(file);
    // v1 writes "no limit" as the largest page-aligned signed value.
    if (!read || (k == 1 && limit >= (1ull << 62))) continue;
    const unsigned long long unreclaimable = used > file_backed ? used - file_backed : 0;
    *room = limit > unreclaimable ? limit - unreclaimable : 0ull;
    *version_one = k == 1;
    return true;
  }
  return false;
}

// Where a rank's figure came from, smallest code first where two are equal.
enum LimitSource : unsigned long long { kLimitOverride, kLimitCgroup2, kLimitCgroup1, kLimitMeminfo, kLimitDevice };

// What this process holds in memory now (VmRSS: its resident pages, the
// libraries' mapped code and data included), rounded up to a MiB; 0 where
// /proc cannot tell. The nvcc build holds about 170 MB here before its first
// allocation (the CUDA runtime and cuBLAS, even without a GPU), the g++
// build about 20: measured on each run, not assumed.
// One "Name: N kB" line of a /proc file (/proc/meminfo, /proc/self/status), in bytes; 0 when absent.
static unsigned long long proc_kib_line(const char* file, const char* format) {
  std::FILE* proc = std::fopen(file, "r");
  char line[256];
  unsigned long long kib = 0;
  while (proc && std::fgets(line, sizeof line, proc))
    if (std::sscanf(line, format, &kib) == 1) break;
  if (proc) std::fclose(proc);
  return kib * 1024ull;
}
static unsigned long long mib_rounded(unsigned long long bytes) {
  const unsigned long long mib = 1ull << 20;
  return (bytes + mib - 1) / mib * mib;
}
static unsigned long long resident_bytes() { return mib_rounded(proc_kib_line("/proc/self/status", "VmRSS: %llu kB")); }
// The part of it that MemAvailable and the cgroup's room do not count as
// available: anonymous and shared memory. The libraries' file-backed pages
// (RssFile) are page cache, which both figures already count as reclaimable:
// added back as well, they would be counted twice.
static unsigned long long unreclaimable_resident_bytes() {
  return mib_rounded(proc_kib_line("/proc/self/status", "RssAnon: %llu kB") +
                     proc_kib_line("/proc/self/status", "RssShmem: %llu kB"));
}

MemoryLimit memory_per_rank(Device device, MPI_Comm comm) {
  const int sharing = local_size_of(comm);
  // On the host the figures below are room left (MemAvailable, the cgroup's
  // room), which the process's own anonymous pages are already outside of;
  // the override is a budget for the whole process. Both become budgets:
  // room plus those pages, the override as it is. `held`, all the process
  // holds, is what the need counts (trainer/plan.cpp).
  const unsigned long long held = device == Device::cuda ? 0 : resident_bytes();
  const unsigned long long held_outside_room = device == Device::cuda ? 0 : unreclaimable_resident_bytes();
  unsigned long long available = 0, source = kLimitDevice;
  int shared_by = 1;  // ranks dividing the figure
  if (device == Device::cuda) {
#if defined(Z2_HAVE_CUDA)
    // cudaMemGetInfo measures the current device: call this after Compute
    // has selected this rank's GPU (else every rank measures, and creates a
    // context on, GPU 0).
    size_t free_bytes = 0, total_bytes = 0;
    int gpus = 1;
    Z2_CUDA_CHECK(cudaGetDeviceCount(&gpus));
    Z2_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    // Ranks share GPUs round-robin: ceil(local ranks / GPUs) per GPU.
    shared_by = (sharing + gpus - 1) / gpus;
    available = free_bytes / (unsigned long long)shared_by;
#endif
  } else {
    available = proc_kib_line("/proc/meminfo", "MemAvailable: %llu kB"), source = kLimitMeminfo;
    // In a container the cgroup's limit may be far below the host's free
    // memory, and exceeding it gets a rank killed, not an error: take the
    // smaller of the two.
    unsigned long long room = 0;
    bool version_one = false;
    if (cgroup_room(&room, &version_one) && room < available)
      available = room, source = version_one ? kLimitCgroup1 : kLimitCgroup2;
    shared_by = sharing;
    available = available / (unsigned long long)sharing + held_outside_room;
  }
  // The override lowers the figure, per rank; a value that is not a plain
  // number of bytes is refused (by every rank together, below).
  unsigned long long valid = 1;
  if (const char* text = std::getenv("ZERO2_MEMORY_LIMIT")) {
    char* end = nullptr;
    errno = 0;
    const unsigned long long limit = std::strtoull(text, &end, 10);
    valid = text[0] >= '0' && text[0] <= '9' && *end == '\0' && errno == 0 ? 1 : 0;
    if (valid && limit < available) available = limit, source = kLimitOverride;
  }
  unsigned long long mine[2] = {available, valid}, smallest[2] = {0, 0}, most_held = 0;
  watched_allreduce(mine, smallest, 2, MPI_UNSIGNED_LONG_LONG, MPI_MIN, comm, "the memory check's all-reduce");
  // The largest over the ranks, so that every rank computes the same need.
  watched_allreduce(&held, &most_held, 1, MPI_UNSIGNED_LONG_LONG, MPI_MAX, comm, "the memory check's all-reduce");
  if (smallest[1] == 0)
    usage_error(
        "ZERO2_MEMORY_LIMIT='%s' is not a number of bytes: it lowers the memory each rank may count on (e.g. "
        "ZERO2_MEMORY_LIMIT=20000000000); unset it to use what the machine has",
        valid ? "(another rank's value)" : std::getenv("ZERO2_MEMORY_LIMIT"));
  // The source of the smallest figure (the lowest code among the ranks that have it).
  unsigned long long candidate = available == smallest[0] ? source : kLimitDevice + 1, chosen = 0;
  watched_allreduce(&candidate, &chosen, 1, MPI_UNSIGNED_LONG_LONG, MPI_MIN, comm, "the memory check's all-reduce");
  const char* names[] = {"ZERO2_MEMORY_LIMIT", "the cgroup v2 memory.max less its usage",
                         "the cgroup v1 memory.limit_in_bytes less its usage", "MemAvailable in /proc/meminfo",
                         "the GPU's free memory, cudaMemGetInfo"};
  MemoryLimit limit{(size_t)smallest[0], chosen <= kLimitDevice ? names[chosen] : "?", (size_t)most_held};
  if (chosen != kLimitOverride && shared_by > 1)
    limit.source += " / " + std::to_string(shared_by) + " ranks sharing it";
  return limit;
}

static bool all_ranks(bool local, MPI_Comm comm) {
  int value = local ? 1 : 0, all = 0;
  watched_allreduce(&value, &all, 1, MPI_INT, MPI_MIN, comm, "an all-reduce of one flag (the ranks agreeing)");
  return all == 1;
}

// Whether every rank would get a GPU of its own (what NCCL needs): each rank
// names the GPU it would use (host name + PCI bus id, with the same
// local-rank-modulo-count choice Compute makes) and no name may repeat. This
// also accepts launchers that give each rank one GPU by CUDA_VISIBLE_DEVICES.
// `gpus` is this rank's visible device count.
static bool one_gpu_per_rank(MPI_Comm comm, int* gpus) {
  int count = 0;
  char name[2 * MPI_MAX_PROCESSOR_NAME] = {};
#if defined(Z2_HAVE_CUDA)
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    count = 0;
  }
  if (count > 0) {
    int length = 0;
    MPI_Get_processor_name(name, &length);
    name[length] = '/';
    if (cudaDeviceGetPCIBusId(name + length + 1, 64, local_rank_of(comm) % count) != cudaSuccess) count = 0;
  }
#endif
  *gpus = count;
  int size = 0;
  Z2_MPI_CHECK(MPI_Comm_size(comm, &size));
  std::vector<char> names((size_t)size * sizeof name);
  Z2_MPI_CHECK(MPI_Allgather(name, sizeof name, MPI_CHAR, names.data(), sizeof name, MPI_CHAR, comm));
  std::vector<std::string> seen;
  for (int r = 0; r < size; ++r) seen.emplace_back(&names[(size_t)r * sizeof name]);
  std::sort(seen.begin(), seen.end());
  bool distinct = std::adjacent_find(seen.begin(), seen.end()) == seen.end();
  return all_ranks(count > 0 && distinct, comm);
}

Device choose_device(const std::string& requested, MPI_Comm comm) {
  std::string why;
  bool available = all_ranks(cuda_available(&why), comm);
  if (requested == "cpu") return Device::cpu;
  if (requested == "sim") return Device::sim;  // any build: the simulated device is host code
  if (requested == "cuda") {
    if (!available) usage_error("--device cuda: no usable GPU on every rank (%s); use --device cpu", why.c_str());
    return Device::cuda;
  }
  if (requested == "auto") return available ? Device::cuda : Device::cpu;
  usage_error("--device must be auto, cpu, cuda or sim (got '%s')", requested.c_str());
}

CommBackend choose_comm(const std::string& requested, Device device, MPI_Comm comm) {
  int gpus = 0;
  bool nccl_possible = device == Device::cuda && built_with_nccl() && one_gpu_per_rank(comm, &gpus);
  if (requested == "mpi") return CommBackend::mpi;
  if (requested == "nccl") {
    if (device == Device::sim)
      usage_error(
          "--comm nccl with --device sim: the simulated device runs MPI's collectives only (an NCCL stand-in "
          "would need the device to progress while the host waits in MPI, which a scheduler the host runs "
          "cannot do); use --comm mpi");
    if (device != Device::cuda) usage_error("--comm nccl needs --device cuda");
    if (!built_with_nccl()) usage_error("--comm nccl: this binary was built without NCCL");
    if (!nccl_possible)
      usage_error(
          "--comm nccl: NCCL needs one GPU per rank, but a host has %d ranks and %d GPU(s); "
          "use --comm mpi to share a GPU",
          local_size_of(comm), gpus);
    return CommBackend::nccl;
  }
  if (requested == "auto") return nccl_possible ? CommBackend::nccl : CommBackend::mpi;
  usage_error("--comm must be auto, mpi or nccl (got '%s')", requested.c_str());
}

// The 16-bit sums for native MPI collectives: each partial sum is widened,
// added in fp32 and rounded back to 16 bits, as a ring's every hop does.
template <class T>
static void sum_16bit(void* in, void* inout, int* length, MPI_Datatype*) {
  const T* a = (const T*)in;
  T* b = (T*)inout;
  for (int i = 0; i < *length; ++i) b[i] = from_float<T>(to_float(a[i]) + to_float(b[i]));
}

Communicator::Communicator(Compute& compute, MPI_Comm mpi_comm, CommBackend backend, Collectives collectives)
    : compute_(compute), backend_(backend), collectives_(collectives) {
  Z2_MPI_CHECK(MPI_Op_create(&sum_16bit<bfloat16>, 1, &sum_bf16_));
  Z2_MPI_CHECK(MPI_Op_create(&sum_16bit<float16>, 1, &sum_fp16_));
  Z2_MPI_CHECK(MPI_Comm_dup(mpi_comm, &mpi_comm_));
  // Errors come back to our check macro, which prints a message and a hint,
  // instead of MPI's default abort without one.
  Z2_MPI_CHECK(MPI_Comm_set_errhandler(mpi_comm_, MPI_ERRORS_RETURN));
  Z2_MPI_CHECK(MPI_Comm_rank(mpi_comm_, &rank_));
  Z2_MPI_CHECK(MPI_Comm_size(mpi_comm_, &world_size_));
  if (backend_ == CommBackend::mpi) return;
  if (!compute.on_cuda()) usage_error("--comm nccl needs --device cuda");
#if defined(Z2_HAVE_NCCL)
  int gpus = 0;
  if (!one_gpu_per_rank(mpi_comm_, &gpus))
    usage_error(
        "--comm nccl: NCCL needs one GPU per rank, but a host has more ranks than its %d GPU(s); "
        "use --comm mpi to share a GPU",
        gpus);
  ncclUniqueId id;
  if (rank_ == 0) Z2_NCCL_CHECK(ncclGetUniqueId(&id));
  watched_bcast(&id, sizeof id, MPI_BYTE, 0, mpi_comm_, "the broadcast of the NCCL unique id");
  Z2_CUDA_CHECK(cudaSetDevice(compute.device_index()));
  ncclComm_t nccl;
  Z2_NCCL_CHECK(ncclCommInitRank(&nccl, world_size_, id, rank_));
  nccl_ = nccl;
  watch_nccl_communicator(nccl_);  // the watchdog aborts it before it takes the job down
#else
  usage_error("--comm nccl: this binary was built without NCCL");
#endif
}

Communicator::~Communicator() {
#if defined(Z2_HAVE_NCCL)
  if (nccl_) {
    compute_.synchronize_all();
    unwatch_nccl_communicator(nccl_);
    ncclCommDestroy((ncclComm_t)nccl_);
  }
#endif
  if (mpi_comm_ != MPI_COMM_NULL) MPI_Comm_free(&mpi_comm_);
  for (MPI_Op* op : {&sum_bf16_, &sum_fp16_})
    if (*op != MPI_OP_NULL) MPI_Op_free(op);
}

MPI_Op Communicator::sum_op(Precision precision) const {
  return precision == Precision::bf16 ? sum_bf16_ : precision == Precision::fp16 ? sum_fp16_ : MPI_SUM;
}

void Communicator::all_gather_host(const float* send, size_t count, float* receive, const std::string& what) {
  MPI_Request request;
  Z2_MPI_CHECK(MPI_Iallgather(send, (int)count, MPI_FLOAT, receive, (int)count, MPI_FLOAT, mpi_comm_, &request));
  wait_request(&request, "the all-gather of " + what + " (an MPI collective of all " + std::to_string(world_size_) +
                             " ranks: one of them has not joined)");
  counters_.other += (size_t)(world_size_ - 1) * count * sizeof(float);
}

bool Communicator::all_agree(bool local_ok) { return all_ranks(local_ok, mpi_comm_); }

bool Communicator::any_rank(bool local) {
  int value = local ? 1 : 0, any = 0;
  watched_allreduce(&value, &any, 1, MPI_INT, MPI_MAX, mpi_comm_,
                    "the all-reduce of a flag (an overflow, a non-finite gradient)");
  counters_.other += (size_t)(world_size_ - 1) * sizeof(int);  // as a ring would send one int
  return any == 1;
}

void Communicator::barrier() {
  MPI_Request request;
  Z2_MPI_CHECK(MPI_Ibarrier(mpi_comm_, &request));
  wait_request(&request, "a barrier");
}

}  // namespace z2
