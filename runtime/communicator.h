// runtime/communicator.h — who talks to whom (part of zero2.h: include
// zero2.h, not this): the Communicator (MPI always, NCCL for device buffers),
// --device and --comm resolved alike on every rank, and the memory each rank
// may count on. Implemented in runtime/communicator.cpp.
#pragma once

namespace z2 {

enum class CommBackend { mpi, nccl };
enum class Collectives { deterministic, native };
const char* to_string(CommBackend backend);
const char* to_string(Collectives collectives);

class Communicator {
 public:
  // Collective over `mpi_comm` (duplicated inside). With nccl it needs one GPU
  // per rank on each host and creates an NCCL communicator over the same ranks.
  Communicator(Compute& compute, MPI_Comm mpi_comm, CommBackend backend, Collectives collectives);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  CommBackend backend() const { return backend_; }
  Collectives collectives() const { return collectives_; }
  MPI_Comm mpi() const { return mpi_comm_; }
  void* nccl() const { return nccl_; }  // ncclComm_t
  Compute& compute() const { return compute_; }
  CommCounters& counters() { return counters_; }

  // Small host-side helpers for scalars (loss, norm chunk sums): always MPI.
  // Counted under "other".
  // `what` names it for the watchdog's message ("the micro-batch losses").
  void all_gather_host(const float* send, size_t count, float* receive, const std::string& what = "floats");
  bool all_agree(bool local_ok);  // logical AND over ranks
  bool any_rank(bool local);      // logical OR over ranks (one flag, max-reduced), counted under "other"
  void barrier();
  // MPI_SUM for fp32; for bf16 / fp16 an MPI_Op that adds in fp32 and rounds
  // each partial sum back to 16 bits, as NCCL's 16-bit sum does (native
  // collectives only: the deterministic ones do no arithmetic in MPI).
  MPI_Op sum_op(Precision precision) const;

 private:
  Compute& compute_;
  MPI_Comm mpi_comm_ = MPI_COMM_NULL;
  int rank_ = 0, world_size_ = 1;
  CommBackend backend_;
  Collectives collectives_;
  void* nccl_ = nullptr;
  CommCounters counters_;
  MPI_Op sum_bf16_ = MPI_OP_NULL, sum_fp16_ = MPI_OP_NULL;
};

// The local rank (rank among the processes of this host) of `comm`.
int local_rank_of(MPI_Comm comm);
// This rank's share of its node's cores: the CPUs it may run on
// (sched_getaffinity, which a launcher's binding narrows) over the ranks of
// `comm` on this host that may run on the same CPUs, capped by a container's
// CPU quota; at least 1. The default of EngineOptions::host_threads.
// Collective over `comm`.
int host_cores_per_rank(MPI_Comm comm);
// Bytes one rank of `comm` can plan to use on `device`, and where that figure
// came from: the smallest over all ranks of what its host (or GPU) can give,
// divided by the ranks sharing it: on cpu the smaller of MemAvailable and the
// cgroup's limit less its usage (v2 or v1), plus the anonymous and shared
// memory the process already holds (which those figures no longer count;
// its libraries' file pages they count as reclaimable already): the two
// together are the process's budget; on cuda the current device's free memory.
// ZERO2_MEMORY_LIMIT=BYTES (for tests, and for users who want a lower
// ceiling) lowers it to BYTES per rank, the whole process's budget; it never
// raises it. Call it after constructing the Compute (which selects the
// rank's GPU). Collective; the same value and source on every rank, so a
// "does not fit" decision is taken by all ranks together.
struct MemoryLimit {
  size_t bytes = 0;
  std::string source;  // e.g. "MemAvailable (/proc/meminfo) / 2 ranks on this host"
  size_t held = 0;     // on the host: the process's resident bytes at the call (the ranks' largest, MiB-rounded)
};
MemoryLimit memory_per_rank(Device device, MPI_Comm comm);

// Resolve --device auto / --comm auto the same way on every rank.
Device choose_device(const std::string& requested, MPI_Comm comm);
CommBackend choose_comm(const std::string& requested, Device device, MPI_Comm comm);

}  // namespace z2
