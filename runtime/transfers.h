// runtime/transfers.h — what carries a bucket between ranks (private to
// zero2.cu and runtime/transfers.cpp): the staging slots, the element type on
// the wire, a transfer, and the parts a BucketExchange is made of (its slots,
// the transfers in flight, the receiver's sum), then an MPI collective's steps.
//
// A transfer moves one bucket through one collective (an all-reduce: two, a
// reduce-scatter and then an all-gather) in one slot. Each collective is
// written as the steps it takes, in the order it takes them; advance() goes
// as far as it can without waiting (for an MPI request, a CUDA event, a
// ticket) and the next call resumes there. BucketExchange::progress advances
// every transfer in flight each time the engine calls progress(): that is how
// MPI transfers move while backward computes (MPICH progresses only inside
// MPI calls).
//
// The chapter's own collectives are in zero2.cu ("The reduce-scatter", "The
// step"): the deterministic reduce-scatter over MPI and the all-gather over
// MPI, with the receiver's sum. This header holds the types and the steps a
// bucket goes through (after the types, in the order a bucket meets them:
// the chapter's path reads them here); transfers.cpp the rest: the
// watchdog's description of a wait, the slots' buffers, the staging through
// pinned host memory (--comm mpi on cuda), the libraries' native collectives
// (--collectives native: faster, their summation order is the library's)
// and every collective over NCCL.
#pragma once

#include <climits>
#include <deque>

#include "runtime/timeline.h"
#include "zero2.h"

namespace z2 {

// One set of constant-size buffers for one bucket in flight (the "staging"
// of the memory ledger). With --comm mpi on cuda the bucket is copied to
// pinned host memory, sent by MPI, and the received slices are copied back
// before the device sums them.
struct Slot {
  char* bucket_gradients = nullptr;  // [max padded bucket]   stage 2: backward writes here
  char* receive = nullptr;           // [(N-1) x max shard]  slices from the other ranks
  char* host_send = nullptr;         // [max padded bucket]   pinned, --comm mpi on cuda (staged_through_host)
  char* host_receive = nullptr;      // [(N-1) x max shard]  pinned, --comm mpi on cuda
  Event done;                        // recorded on the comm stream when its transfer ends
  Event copied;                      // its transfer's device-to-host copy has finished
  int bucket = -1;                   // the bucket holding the slot, -1 when free
  bool running = false;              // a transfer is using it
};

// The element type on the wire (of buckets, gradients and parameters alike):
// 4 bytes for fp32, 2 for bf16 and fp16. Every buffer of the exchange counts
// in these elements; at() and bytes() do the byte arithmetic.
struct WireType {
  Precision precision;
  size_t element;         // bytes
  MPI_Datatype mpi_type;  // MPI moves 16-bit elements as MPI_UINT16_T (it only copies them)
  explicit WireType(Precision p)
      : precision(p), element(element_bytes(p)), mpi_type(p == Precision::fp32 ? MPI_FLOAT : MPI_UINT16_T) {}
  char* at(const void* base, size_t index) const { return (char*)base + index * element; }
  size_t bytes(size_t count) const { return count * element; }
};

// The slices from the other ranks: rank j's slice of this rank's shard is
// the (j - (j > rank))-th of the N - 1 received (this rank's own is never sent).
Z2_HD inline size_t received_index(int j, int rank) { return (size_t)(j - (j > rank ? 1 : 0)); }

struct Transfer;
// One collective's part of a transfer. advance() takes the collective's
// steps in order from where the last call stopped, and returns true once
// the last is taken, false at a step that must wait.
struct Collective {
  virtual ~Collective() = default;
  virtual bool advance(Transfer& transfer) = 0;
};

struct Transfer {
  int slot = -1;
  std::string what;                                      // for the watchdog: "the reduce-scatter of bucket 3"
  std::vector<std::unique_ptr<Collective>> collectives;  // run one after the other
  size_t next = 0;
  std::vector<MPI_Request> requests;  // what the current collective waits for
  std::vector<int> peers;             // the rank each request exchanges with; -1 for a collective over all ranks
  long timeline_span = -1;            // its span on --timeline's slot track (runtime/timeline.h)
  bool finished() const { return next == collectives.size(); }
  bool advance() {
    while (!finished() && collectives[next]->advance(*this)) ++next;
    return finished();
  }
};

// The exchange: its slots, the transfers in flight (oldest first, each in
// its slot), the receiver's sums, and how a collective is chosen for the
// backend (zero2.cu: the chapter's own over MPI; the others from transfers.cpp).
struct BucketExchange::Parts {
  Compute& compute;
  Communicator& comm;
  const int rank, world;
  const WireType wire;
  const bool accumulate_fp32;      // the accumulation tree's blocks in fp32 (else the wire type)
  const bool native;               // --collectives native
  const bool use_nccl;             // --comm nccl
  const bool through_pinned_host;  // --comm mpi with --device cuda
  size_t max_padded = 0;
  DeviceArray<char> staging;  // slots x (bucket gradients + receive)
  std::vector<Slot> slots;
  std::deque<std::unique_ptr<Transfer>> transfers;
  Event ready;  // "the compute stream got this far"
  // MPI tags, in the order transfers start (the same everywhere): they need
  // only tell apart transfers in flight (at most a few), and the standard
  // promises tags up to 32767 on every implementation.
  int sequence = 0;
  // MPI requires every rank to start its collectives on a communicator in the
  // same order. Transfers advance independently (one may wait on its
  // point-to-point slices or a host copy while a younger one is ready), so
  // each collective start takes a ticket when its transfer is built, in the
  // same order on every rank, and may only run when its ticket is next.
  long next_ticket = 0, next_to_post = 0;

  Parts(Compute& c, Communicator& communicator, Precision w, bool fp32_blocks);
  // The transfer of one collective on a bucket of `padded` elements, in `slot`.
  Transfer* start(int slot, size_t padded, const char* collective);
  // Blocking: poll until done, against the watchdog's deadline.
  void finish(Transfer& transfer);
  std::string describe_waiting(Transfer& transfer);
  void retire_finished();
  int free_slot() const;
  // Each collective adds the bytes it sends to `sent` at the moment it calls
  // MPI or NCCL, so the ledger counts traffic that happened, by the
  // collective that sent it (a reduce-scatter that quietly became an
  // all-reduce would show), in bytes of the wire type.
  std::unique_ptr<Collective> reduce_scatter_collective(int slot, void* bucket, size_t padded,
                                                        const AccumulateInto& into, size_t* sent);
  std::unique_ptr<Collective> all_gather_collective(int slot, void* bucket, size_t padded, size_t* sent);
  // The receiver's sum (a kernel on the comm stream; zero2.cu): the N slices
  // of this rank's shard (`own` its own slice, never sent; `received` the
  // N-1 others) summed in canonical order, in fp32, handed to the
  // accumulation tree (which rounds the finished sum to the wire type once).
  void sum_and_accumulate(size_t shard, const void* own, const void* received, const AccumulateInto& into);
};

// --- the exchange's steps, in the order a bucket meets them ------------------------
// A slot for a bucket (BucketExchange::acquire): a free one, or the oldest
// transfer finished to free its slot.

inline int BucketExchange::Parts::free_slot() const {
  for (size_t s = 0; s < slots.size(); ++s)
    if (slots[s].bucket < 0 && !slots[s].running) return (int)s;
  return -1;
}

// wait_until yields between polls: ranks often share cores, 4 ranks on 2 here.
inline void BucketExchange::Parts::finish(Transfer& transfer) {
  wait_until([&] { return transfer.advance(); }, [&] { return describe_waiting(transfer); });
}

// Transfers leave the queue oldest first. A finished younger one waits for
// the older: slots come back in the order they were taken, and the oldest
// transfer is always the one to finish when a slot is needed.
inline void BucketExchange::Parts::retire_finished() {
  while (!transfers.empty() && transfers.front()->finished()) {
    Slot& slot = slots[transfers.front()->slot];
    // Everything the transfer queued is on the comm stream before this
    // event: whoever reuses the slot's buffers on the compute stream waits
    // for it on the GPU, not on the host.
    compute.record(slot.done, compute.comm_stream());
    compute.timeline_collective_ends(transfers.front()->timeline_span);
    slot.running = false;
    slot.bucket = -1;
    transfers.pop_front();
  }
}

// A collective started (BucketExchange::start_reduce_scatter and the others):
// a transfer in the slot, after what the compute stream wrote so far.

inline Transfer* BucketExchange::Parts::start(int slot, size_t padded, const char* collective) {
  if (padded > max_padded || padded % world != 0)
    usage_error("bucket collective: %zu elements (at most %zu, a multiple of N = %d)", padded, max_padded, world);
  if (padded > (size_t)INT_MAX)  // MPI counts are int
    usage_error("a bucket of %zu elements is more than MPI can count (2^31 - 1): split the parameter", padded);
  if (slot < 0 || slot >= (int)slots.size()) usage_error("bucket collective: slot %d out of range", slot);
  if (slots[slot].running) usage_error("bucket collective: slot %d already has a transfer in flight", slot);
  transfers.push_back(std::unique_ptr<Transfer>(new Transfer));
  Transfer* transfer = transfers.back().get();
  transfer->slot = slot;
  transfer->what = std::string("the ") + collective + " of bucket " + std::to_string(slots[slot].bucket);
  slots[slot].running = true;
  compute.record(ready, compute.compute_stream());
  compute.wait(compute.comm_stream(), ready);
  transfer->timeline_span = compute.timeline_collective_starts(collective, slots[slot].bucket, slot);
  return transfer;
}

// --- an MPI collective's steps (the reduce-scatter's slices, the all-gather) ----------

// A collective over MPI on one bucket (the chapter's reduce-scatter and
// all-gather, the native ones), in the order it runs: its requests are
// posted (post; a collective of all ranks only when its ticket is next),
// waited for, and arrived() does what follows. (With --comm mpi on cuda it
// runs on pinned host copies, between the copies there and back:
// staged_through_host, runtime/transfers.cpp.)
struct MpiCollective : Collective {
  BucketExchange::Parts& exchange;
  const long ticket;     // -1: point-to-point, matched by (source, tag), in no order
  bool waiting = false;  // posted: its requests are in flight
  double arrival = 0;    // --timeline on sim: when the network delivers them (runtime/timeline.h)

  MpiCollective(BucketExchange::Parts& parts, bool of_all_ranks = true)
      : exchange(parts), ticket(of_all_ranks ? parts.next_ticket++ : -1) {}
  bool advance(Transfer& transfer) final {
    if (!moved(transfer)) return false;
    arrived();
    return true;
  }
  // Posted once it may be (every rank starts its collectives in one order:
  // this one's ticket must be next), then done once its requests are
  // (MPICH moves them only inside MPI calls: each progress() tests), which
  // then leave the transfer.
  bool moved(Transfer& transfer) {
    const HostClockPaused modelled(exchange.compute.timeline());  // --timeline on sim: the network's time is modelled
    if (!waiting) {
      if (ticket >= 0 && ticket != exchange.next_to_post) return false;
      const size_t sent = exchange.comm.counters().total();
      post(transfer);
      arrival = exchange.compute.timeline_mpi_posted(exchange.comm.counters().total() - sent);
      if (ticket >= 0) ++exchange.next_to_post;
      waiting = true;
    }
    if (transfer.requests.empty()) return true;
    int done = 0;
    Z2_MPI_CHECK(MPI_Testall((int)transfer.requests.size(), transfer.requests.data(), &done, MPI_STATUSES_IGNORE));
    if (done) transfer.requests.clear(), transfer.peers.clear(), exchange.compute.timeline_mpi_arrived(arrival);
    return done != 0;
  }
  virtual void post(Transfer& transfer) = 0;  // the MPI calls, nonblocking, each through request()
  virtual void arrived() {}
  // A new request of the transfer, exchanged with `peer` (-1: all ranks).
  MPI_Request* request(Transfer& transfer, int peer = -1) {
    transfer.peers.push_back(peer);
    transfer.requests.emplace_back();
    return &transfer.requests.back();
  }
};

// --comm mpi on cuda: MPI reads and writes pinned host memory. `down` (the
// part of the bucket MPI reads) crosses to the slot's pinned copies first,
// `mpi` runs on those copies, and `up` (what MPI wrote) comes back before
// its arrived(). Each is `count` elements of the wire type; 0: no copy.
struct HostCopy {
  void* device = nullptr;
  void* host = nullptr;
  size_t count = 0;
};
std::unique_ptr<Collective> staged_through_host(BucketExchange::Parts& exchange, Slot& slot, HostCopy down,
                                                std::unique_ptr<MpiCollective> mpi, HostCopy up);

// One value per element already reduced (one rank, a native reduce-scatter)
// into the accumulation tree, on the comm stream (zero2.cu).
void accumulate_reduced(BucketExchange::Parts& exchange, const void* values, size_t n, const AccumulateInto& into);
// DP's all-reduce with --collectives native and nothing to accumulate: NCCL's or MPI's (transfers.cpp).
std::unique_ptr<Collective> native_all_reduce_collective(BucketExchange::Parts& exchange, int slot, void* bucket,
                                                         size_t padded, size_t* sent);

// The collectives transfers.cpp builds: the libraries' native ones over MPI,
// and every one over NCCL (one step each: NCCL orders its work on the comm
// stream, so there is nothing to poll but the slot's event).
std::unique_ptr<Collective> mpi_native_reduce_scatter(BucketExchange::Parts& exchange, int slot, void* bucket,
                                                      size_t padded, const AccumulateInto& into, size_t* sent);
std::unique_ptr<Collective> mpi_native_all_reduce(BucketExchange::Parts& exchange, int slot, void* bucket,
                                                  size_t padded, size_t* sent);
std::unique_ptr<Collective> nccl_reduce_scatter(BucketExchange::Parts& exchange, int slot, void* bucket, size_t padded,
                                                const AccumulateInto& into, size_t* sent);
std::unique_ptr<Collective> nccl_all_gather(BucketExchange::Parts& exchange, void* bucket, size_t padded, size_t* sent);
std::unique_ptr<Collective> nccl_native_all_reduce(BucketExchange::Parts& exchange, void* bucket, size_t padded,
                                                   size_t* sent);

}  // namespace z2
