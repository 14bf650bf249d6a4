// runtime/transfers.cpp — the machinery that carries buckets (runtime/transfers.h
// says how a transfer advances, and holds the exchange's steps): what a
// waiting transfer tells the watchdog; the exchange's slots; the staging
// through pinned host memory; and the collectives other than the chapter's
// own (zero2.cu, "The reduce-scatter"): the libraries' native ones over MPI,
// and every one over NCCL. Host code: NCCL's calls only enqueue work on the
// comm stream; the sums that follow are zero2.cu's kernels.
#include "runtime/transfers.h"

#include <algorithm>
#include <climits>
#if defined(Z2_HAVE_NCCL)
#include <nccl.h>
#endif

namespace z2 {

// --- what a transfer waits for ------------------------------------------------------

// What a transfer is still waiting for: the ranks whose point-to-point
// slices have not come (or not been taken), or a collective of all ranks.
std::string BucketExchange::Parts::describe_waiting(Transfer& transfer) {
  std::vector<int> missing;
  bool collective = false;
  for (size_t k = 0; k < transfer.requests.size(); ++k) {
    int done = 0;
    Z2_MPI_CHECK(MPI_Test(&transfer.requests[k], &done, MPI_STATUS_IGNORE));
    if (done) continue;
    if (transfer.peers[k] < 0) collective = true;
    else if (std::find(missing.begin(), missing.end(), transfer.peers[k]) == missing.end())
      missing.push_back(transfer.peers[k]);
  }
  std::string text = transfer.what;
  if (!missing.empty()) {
    text += ": rank(s)";
    for (int peer : missing) text += " " + std::to_string(peer);
    text += " have not exchanged their slices with rank " + std::to_string(rank);
  } else if (collective) {
    text += " (an MPI collective of all " + std::to_string(world) + " ranks: one of them has not joined)";
  } else {
    text += " (its GPU copy or kernel has not finished)";
  }
  return text;
}

// --- the exchange's parts ---------------------------------------------------------

BucketExchange::Parts::Parts(Compute& c, Communicator& communicator, Precision w, bool fp32_blocks)
    : compute(c),
      comm(communicator),
      rank(communicator.rank()),
      world(communicator.world_size()),
      wire(w),
      accumulate_fp32(fp32_blocks),
      native(communicator.collectives() == Collectives::native),
      use_nccl(communicator.backend() == CommBackend::nccl),
      through_pinned_host(communicator.backend() == CommBackend::mpi && c.memory_apart_from_host()) {}

// --- --comm mpi on cuda: an MPI collective on pinned host copies ---------------------

namespace {
struct StagedThroughHost : Collective {
  BucketExchange::Parts& exchange;
  Slot& slot;
  const HostCopy down, up;
  std::unique_ptr<MpiCollective> mpi;
  enum class Phase { copy_to_host, wait_for_copy, run, copy_back };
  Phase phase = Phase::copy_to_host;
  StagedThroughHost(BucketExchange::Parts& parts, Slot& s, HostCopy down_, std::unique_ptr<MpiCollective> mpi_,
                    HostCopy up_)
      : exchange(parts), slot(s), down(down_), up(up_), mpi(std::move(mpi_)) {}
  bool advance(Transfer& transfer) override {
    Compute& compute = exchange.compute;
    switch (phase) {
      case Phase::copy_to_host:  // on the comm stream; a slot has one transfer at a time, so its event is this one's
        if (down.count > 0) {
          compute.copy(down.host, down.device, exchange.wire.bytes(down.count), compute.comm_stream());
          compute.record(slot.copied, compute.comm_stream());
        }
        phase = Phase::wait_for_copy;
        [[fallthrough]];
      case Phase::wait_for_copy:
        if (down.count > 0 && !compute.query(slot.copied)) return false;
        phase = Phase::run;
        [[fallthrough]];
      case Phase::run:
        if (!mpi->moved(transfer)) return false;
        phase = Phase::copy_back;
        [[fallthrough]];
      case Phase::copy_back:
        if (up.count > 0) compute.copy(up.device, up.host, exchange.wire.bytes(up.count), compute.comm_stream());
        mpi->arrived();
    }
    return true;
  }
};
}  // namespace

std::unique_ptr<Collective> staged_through_host(BucketExchange::Parts& exchange, Slot& slot, HostCopy down,
                                                std::unique_ptr<MpiCollective> mpi, HostCopy up) {
  return std::make_unique<StagedThroughHost>(exchange, slot, down, std::move(mpi), up);
}

std::unique_ptr<Collective> native_all_reduce_collective(BucketExchange::Parts& exchange, int slot, void* bucket,
                                                         size_t padded, size_t* sent) {
  if (exchange.use_nccl) return nccl_native_all_reduce(exchange, bucket, padded, sent);
  return mpi_native_all_reduce(exchange, slot, bucket, padded, sent);
}

// --- the libraries' own collectives over MPI (--collectives native) ----------------
// Each counts what a ring sends. 16-bit sums go through the Communicator's
// MPI_Op, which rounds every partial sum to 16 bits as a ring's hops do.

namespace {
struct MpiNativeReduceScatter : MpiCollective {
  Slot& slot;
  char *send, *receive;  // the bucket and the slot's receive buffer, or their pinned copies
  const size_t shard;
  const AccumulateInto into;
  size_t* sent;
  MpiNativeReduceScatter(BucketExchange::Parts& parts, Slot& s, void* send_, void* receive_, size_t padded,
                         const AccumulateInto& into_, size_t* sent_)
      : MpiCollective(parts),
        slot(s),
        send((char*)send_),
        receive((char*)receive_),
        shard(padded / parts.world),
        into(into_),
        sent(sent_) {}
  void post(Transfer& transfer) override {
    const Communicator& comm = exchange.comm;
    Z2_MPI_CHECK(MPI_Ireduce_scatter_block(send, receive, (int)shard, exchange.wire.mpi_type,
                                           comm.sum_op(exchange.wire.precision), comm.mpi(), request(transfer)));
    *sent += (size_t)(comm.world_size() - 1) * exchange.wire.bytes(shard);
  }
  void arrived() override { accumulate_reduced(exchange, slot.receive, shard, into); }
};

struct MpiNativeAllReduce : MpiCollective {
  char* host;  // the bucket, or its pinned copy
  const size_t padded;
  size_t* sent;
  MpiNativeAllReduce(BucketExchange::Parts& parts, void* host_, size_t padded_, size_t* sent_)
      : MpiCollective(parts), host((char*)host_), padded(padded_), sent(sent_) {}
  void post(Transfer& transfer) override {
    const Communicator& comm = exchange.comm;
    Z2_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, host, (int)padded, exchange.wire.mpi_type,
                                comm.sum_op(exchange.wire.precision), comm.mpi(), request(transfer)));
    *sent += 2 * (size_t)(comm.world_size() - 1) * exchange.wire.bytes(padded / comm.world_size());
  }
};
}  // namespace

std::unique_ptr<Collective> mpi_native_reduce_scatter(BucketExchange::Parts& exchange, int slot, void* bucket,
                                                      size_t padded, const AccumulateInto& into, size_t* sent) {
  Slot& s = exchange.slots[slot];
  if (!exchange.through_pinned_host)
    return std::make_unique<MpiNativeReduceScatter>(exchange, s, bucket, s.receive, padded, into, sent);
  const size_t shard = padded / exchange.world;
  return staged_through_host(
      exchange, s, {bucket, s.host_send, padded},
      std::make_unique<MpiNativeReduceScatter>(exchange, s, s.host_send, s.host_receive, padded, into, sent),
      {s.receive, s.host_receive, shard});
}

std::unique_ptr<Collective> mpi_native_all_reduce(BucketExchange::Parts& exchange, int slot, void* bucket,
                                                  size_t padded, size_t* sent) {
  if (!exchange.through_pinned_host) return std::make_unique<MpiNativeAllReduce>(exchange, bucket, padded, sent);
  Slot& s = exchange.slots[slot];
  return staged_through_host(exchange, s, {bucket, s.host_send, padded},
                             std::make_unique<MpiNativeAllReduce>(exchange, s.host_send, padded, sent),
                             {bucket, s.host_send, padded});
}

// --- NCCL: each collective one step on the comm stream ------------------------------
// The deterministic reduce-scatter is a group of the N-1 slice sends and
// receives, then the chapter's sum (ncclReduceScatter, native). Counts are
// elements, not bytes.

#if defined(Z2_HAVE_NCCL)
namespace {
ncclDataType_t nccl_type(const WireType& wire) {
  return wire.precision == Precision::bf16 ? ncclBfloat16 : wire.precision == Precision::fp16 ? ncclHalf : ncclFloat;
}

// What every NCCL collective here works on: a bucket of `padded` elements,
// and the ledger's counter its bytes go to.
struct NcclCollective : Collective {
  BucketExchange::Parts& exchange;
  void* bucket;
  const size_t padded;
  size_t* sent;
  NcclCollective(BucketExchange::Parts& parts, void* bucket_, size_t padded_, size_t* sent_)
      : exchange(parts), bucket(bucket_), padded(padded_), sent(sent_) {}
  size_t shard() const { return padded / exchange.world; }
  ncclComm_t nccl() const { return (ncclComm_t)exchange.comm.nccl(); }
  cudaStream_t stream() const { return (cudaStream_t)exchange.compute.comm_stream().handle; }
};

struct NcclReduceScatter : NcclCollective {
  void* received;
  const AccumulateInto into;
  NcclReduceScatter(BucketExchange::Parts& parts, void* bucket_, void* received_, size_t padded_,
                    const AccumulateInto& into_, size_t* sent_)
      : NcclCollective(parts, bucket_, padded_, sent_), received(received_), into(into_) {}
  bool advance(Transfer&) override {
    const WireType& wire = exchange.wire;
    const int world = exchange.world, rank = exchange.rank;
    if (exchange.native) {
      Z2_NCCL_CHECK(ncclReduceScatter(bucket, received, shard(), nccl_type(wire), ncclSum, nccl(), stream()));
      *sent += (size_t)(world - 1) * wire.bytes(shard());  // what a ring sends
      accumulate_reduced(exchange, received, shard(), into);
      return true;
    }
    Z2_NCCL_CHECK(ncclGroupStart());
    for (int j = 0; j < world; ++j) {
      if (j == rank) continue;
      Z2_NCCL_CHECK(ncclSend(wire.at(bucket, (size_t)j * shard()), shard(), nccl_type(wire), j, nccl(), stream()));
      Z2_NCCL_CHECK(ncclRecv(wire.at(received, received_index(j, rank) * shard()), shard(), nccl_type(wire), j, nccl(),
                             stream()));
      *sent += wire.bytes(shard());
    }
    Z2_NCCL_CHECK(ncclGroupEnd());
    exchange.sum_and_accumulate(shard(), wire.at(bucket, (size_t)rank * shard()), received, into);
    return true;
  }
};

struct NcclAllGather : NcclCollective {
  using NcclCollective::NcclCollective;
  bool advance(Transfer&) override {
    Z2_NCCL_CHECK(ncclAllGather(exchange.wire.at(bucket, (size_t)exchange.rank * shard()), bucket, shard(),
                                nccl_type(exchange.wire), nccl(), stream()));
    *sent += (size_t)(exchange.world - 1) * exchange.wire.bytes(shard());
    return true;
  }
};

struct NcclAllReduce : NcclCollective {
  using NcclCollective::NcclCollective;
  bool advance(Transfer&) override {
    Z2_NCCL_CHECK(ncclAllReduce(bucket, bucket, padded, nccl_type(exchange.wire), ncclSum, nccl(), stream()));
    *sent += 2 * (size_t)(exchange.world - 1) * exchange.wire.bytes(shard());
    return true;
  }
};
}  // namespace

std::unique_ptr<Collective> nccl_reduce_scatter(BucketExchange::Parts& exchange, int slot, void* bucket, size_t padded,
                                                const AccumulateInto& into, size_t* sent) {
  return std::make_unique<NcclReduceScatter>(exchange, bucket, exchange.slots[slot].receive, padded, into, sent);
}
std::unique_ptr<Collective> nccl_all_gather(BucketExchange::Parts& exchange, void* bucket, size_t padded,
                                            size_t* sent) {
  return std::make_unique<NcclAllGather>(exchange, bucket, padded, sent);
}
std::unique_ptr<Collective> nccl_native_all_reduce(BucketExchange::Parts& exchange, void* bucket, size_t padded,
                                                   size_t* sent) {
  return std::make_unique<NcclAllReduce>(exchange, bucket, padded, sent);
}
#else  // no NCCL in this build: Communicator refuses --comm nccl before any bucket moves
std::unique_ptr<Collective> nccl_reduce_scatter(BucketExchange::Parts&, int, void*, size_t, const AccumulateInto&,
                                                size_t*) {
  usage_error("--comm nccl: this binary was built without NCCL");
}
std::unique_ptr<Collective> nccl_all_gather(BucketExchange::Parts&, void*, size_t, size_t*) {
  usage_error("--comm nccl: this binary was built without NCCL");
}
std::unique_ptr<Collective> nccl_native_all_reduce(BucketExchange::Parts&, void*, size_t, size_t*) {
  usage_error("--comm nccl: this binary was built without NCCL");
}
#endif

// --- the exchange: its slots and buffers ---------------------------------------------

BucketExchange::BucketExchange(Compute& compute, Communicator& comm, size_t max_padded, int slot_count,
                               bool bucket_buffers, Precision wire, bool accumulate_fp32)
    : parts_(new Parts(compute, comm, wire, accumulate_fp32)) {
  Parts& p = *parts_;
  const size_t N = (size_t)comm.world_size();
  if (slot_count < 1) usage_error("bucket exchange: at least one slot (got %d)", slot_count);
  p.max_padded = max_padded;
  // In elements of the wire type: 16-bit buckets take half the bytes.
  const size_t bucket_part = bucket_buffers ? max_padded : 0, receive_part = (N - 1) * (max_padded / N);
  p.staging = DeviceArray<char>(compute, p.wire.bytes(staging_elements(max_padded, (int)N, slot_count, bucket_buffers)),
                                MemoryKind::staging);
  for (int k = 0; k < slot_count; ++k) {
    Slot slot;
    char* base = p.wire.at(p.staging.data(), k * (bucket_part + receive_part));
    slot.bucket_gradients = bucket_part ? base : nullptr;
    slot.receive = receive_part ? p.wire.at(base, bucket_part) : nullptr;
    if (p.through_pinned_host && N > 1) {
      slot.host_send = (char*)compute.allocate_host_pinned(p.wire.bytes(max_padded));
      slot.host_receive = (char*)compute.allocate_host_pinned(p.wire.bytes(receive_part));
    }
    // Not recorded yet: the slot's first user waits for no transfer, and a
    // wait for an event never recorded is no wait (CUDA's rule, and sim's).
    slot.done = compute.create_event();
    slot.copied = compute.create_event();
    p.slots.push_back(slot);
  }
  p.ready = compute.create_event();
}

BucketExchange::~BucketExchange() {
  Parts& p = *parts_;
  // MPI may still write into the pinned buffers: let every transfer end. Usage
  // errors stop every rank at the same place, so the others finish too.
  finish_all();
  p.compute.synchronize_all();
  for (auto& slot : p.slots) {
    p.compute.destroy_event(slot.done);
    p.compute.destroy_event(slot.copied);
    p.compute.release_host_pinned(slot.host_send);
    p.compute.release_host_pinned(slot.host_receive);
  }
  p.compute.destroy_event(p.ready);
}


}  // namespace z2
