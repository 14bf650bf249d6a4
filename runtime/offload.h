// runtime/offload.h — ZeRO-Offload (Ren et al., "ZeRO-Offload: Democratizing
// Billion-Scale Model Training", USENIX ATC 2021; notes/13): the optimizer
// step's home on the host. Part of zero2.cu, which includes it right after
// Engine::RankState and its StepHome (the device's home); private.
//
// ZeRO-Offload enters the chapter where the sizes are set: engine_buffers(),
// whose sizes move to the host (move_optimizer_sizes_to_host, below), and
// RankState::allocate(), which gives the step this home (step_home, below).
// Besides, the reduce-scatter's transfer carries a shard down when its
// AccumulateInto asks (copy_to_host), and the runtime's view of the buffers
// and the ledger read where the state lives (model_states, the ledger). From
// there the chapter calls the home's hooks, the same calls with or without
// offload: each bucket's reduced shard goes down inside its reduce-scatter
// (route, ShardToHost), the step's loops run as CPU loops over the host's
// buffers (place, gradient, master, working), and each updated shard goes
// up before its all-gather (shard_updated). Same loops, same values: the
// same bits as without offload, in every stage and precision.
#pragma once

namespace z2 {

// ZeRO-Offload (Ren et al. 2021, section 4): the own shard's optimizer state
// leaves the device for pinned host memory, 16 Psi/N bytes there in every
// precision: the fp32 master (fp32 too: the device's parameters are a copy
// of it, as in DeepSpeed) 4 Psi/N, m and v 8 Psi/N, and what crosses the
// bus, 4 Psi/N: the reduced gradient shard as it comes off the wire (fp32 4,
// mixed 2) plus, mixed only, the updated shard rounded on its way up (2). The
// device saves 12 Psi/N (fp32) or 14 Psi/N (mixed) in stage 2: its gradient
// shard too, for the reduce-scatter leaves the sum in the slot it was taken
// from and the copy down reads it there. Stage 1 keeps its full gradient.
static void move_optimizer_sizes_to_host(EngineBuffers& sizes, const EngineOptions& options, size_t shard) {
  const size_t e = element_bytes(options.precision);
  sizes.host_master = shard * sizeof(float);
  sizes.host_moment = shard * sizeof(float);
  sizes.host_grads = shard * e;
  sizes.host_working = options.precision == Precision::fp32 ? 0 : shard * e;             // fp32 sends the master itself
  sizes.host_chunk_sums = sizes.chunk_sums, sizes.host_decay_flags = sizes.decay_flags;  // the step's tables go along
  sizes.master = sizes.moment = sizes.chunk_sums = sizes.decay_flags = 0;
  if (options.stage == 2) sizes.grads = 0;
}

// ZeRO-Offload: the reduced shard down to the host, as the last step of its
// reduce-scatter's transfer (after the sum, on the comm stream), so it
// overlaps the rest of backward and the slot waits for it. In mixed
// precision 2 Psi/N bytes cross per step, 4 Psi/N in fp32.
struct ShardToHost : Collective {
  BucketExchange::Parts& exchange;
  const void* shard;
  void* host;
  const size_t count;  // elements of the wire type
  ShardToHost(BucketExchange::Parts& parts, const void* shard_, void* host_, size_t count_)
      : exchange(parts), shard(shard_), host(host_), count(count_) {}
  bool advance(Transfer&) override {
    exchange.compute.copy(host, shard, exchange.wire.bytes(count), exchange.compute.comm_stream());
    return true;
  }
};

// The host's copies, all in shard space (region(b).state): the reduced
// gradient shard as it came down (working type), the fp32 master (fp32 too:
// the device's parameters are a copy of it), and (mixed) the rounded
// shard that goes up to the parameters.
struct Engine::RankState::HostHome : StepHome {
  bool master_stale = true;  // fp32: the host master must be taken from the parameters
  using StepHome::StepHome;
  Place place() const override { return Place::host; }
  void* gradient(int b) override { return s.at(s.host_grads, s.region(b).state); }
  float* master(int b) override { return s.master.data() + s.region(b).state; }
  void* working(int b) override { return s.mixed ? s.at(s.host_working, s.region(b).state) : nullptr; }
  // engine_buffers' host sizes, in pinned host memory.
  void allocate_state(const EngineBuffers& sizes) override {
    s.master = DeviceArray<float>(s.compute, sizes.host_master / sizeof(float), MemoryKind::master, Place::host);
    s.adam_m = DeviceArray<float>(s.compute, sizes.host_moment / sizeof(float), MemoryKind::optimizer, Place::host);
    s.adam_v = DeviceArray<float>(s.compute, sizes.host_moment / sizeof(float), MemoryKind::optimizer, Place::host);
    s.host_grads = DeviceArray<char>(s.compute, sizes.host_grads, MemoryKind::grads, Place::host);
    s.host_working = DeviceArray<char>(s.compute, sizes.host_working, MemoryKind::params, Place::host);
  }
  void allocate_tables(const EngineBuffers& sizes) override {
    s.chunk_sums =
        DeviceArray<float>(s.compute, sizes.host_chunk_sums / sizeof(float), MemoryKind::bookkeeping, Place::host);
    s.decay = DeviceArray<unsigned char>(s.compute, sizes.host_decay_flags, MemoryKind::bookkeeping, Place::host);
  }
  // The final sum of bucket b goes down to the host's shard, in its
  // reduce-scatter's transfer. Stage 2 keeps no gradient shard on the
  // device (2 Psi/N bytes fewer, 4 in fp32): the sum lands in the slot's own
  // slice (each element read, then written: in place is safe) and goes down
  // from there. Stage 1 keeps its full gradient buffer.
  void route(AccumulateInto& into, int b, size_t keep) override {
    if (s.stage == 2) into.result = (char*)s.slot_buffer[b] + (size_t)s.rank * s.buckets[b].shard_length * s.element;
    into.copy_to_host = s.at(s.host_grads, keep);
  }
  void wait_for_shards() override;
  void shard_updated(int b) override;
  void parameters_written() override { master_stale = true; }
  void take_master_from_parameters();
};

// ZeRO-Offload's entry (RankState::allocate): the host for stages 1 and 2 with
// offload_optimizer (the Engine refuses it in stage 0), else the device.
static std::unique_ptr<Engine::RankState::StepHome> step_home(Engine::RankState& s) {
  if (s.offload) return std::make_unique<Engine::RankState::HostHome>(s);
  return std::make_unique<Engine::RankState::StepHome>(s);
}

// ZeRO-Offload. The reduced shards came down inside their reduce-scatters
// (ShardToHost): wait for those copies, and with them for backward, before
// the host reads the shards and before anything is copied up over the
// parameters backward read.
void Engine::RankState::HostHome::wait_for_shards() {
  s.compute.synchronize_all();
  if (!s.mixed && master_stale) take_master_from_parameters();
}

// fp32 keeps a host copy of its own shards as the master (without offload
// the device's parameters are the master): taken from the parameters at the
// first step after they were set from outside the step (a model's writes
// between build() and step 1, parameters_from_host, a checkpoint loaded).
// Writes through parameter() after step 1 are not seen, as in mixed
// precision, offloaded or not (zero2.h, Engine::parameter_as).
void Engine::RankState::HostHome::take_master_from_parameters() {
  for (int b = 0; b < (int)s.buckets.size(); ++b)
    s.compute.copy(master(b), s.region_param(b), s.region(b).length * sizeof(float), s.compute.compute_stream());
  s.compute.synchronize(s.compute.compute_stream());
  master_stale = false;
}

// The updated shard of bucket b up to the device's parameters (mixed: its
// rounded copy, 2 Psi/N bytes a step in all; fp32: the master itself, 4),
// on the comm stream, where the bucket's all-gather follows it. The host
// goes on to the next bucket's AdamW while this one crosses.
void Engine::RankState::HostHome::shard_updated(int b) {
  const void* updated = s.mixed ? working(b) : (const void*)master(b);
  s.compute.copy(s.region_param(b), updated, s.region(b).length * s.element, s.compute.comm_stream());
}

}  // namespace z2
