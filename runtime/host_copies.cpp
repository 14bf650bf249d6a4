// runtime/host_copies.cpp — the engine's buffers to and from the host, in
// the canonical order (registration order, real elements only): the
// parameters for the final hash, the export and the initial values; the
// reduced gradient for the reference checks and the labs' graders. Not on
// the path of a step: these are the copies around it. Host code.
#include "runtime/engine_state.h"

#include <algorithm>

namespace z2 {

// The working type's bits <-> float on the host (uint16_t is either 16-bit format).
static std::vector<float> widen_bits(const std::vector<uint16_t>& bits, Precision precision) {
  std::vector<float> values(bits.size());
  for (size_t i = 0; i < bits.size(); ++i)
    values[i] = precision == Precision::bf16 ? float_from_bf16_bits(bits[i]) : float_from_fp16_bits(bits[i]);
  return values;
}
std::vector<uint16_t> narrow_bits(const std::vector<float>& values, Precision precision) {
  std::vector<uint16_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i)
    bits[i] = precision == Precision::bf16 ? bf16_bits_from_float(values[i]) : fp16_bits_from_float(values[i]);
  return bits;
}

// `count` elements of the working type at `device`, as floats on the host.
static std::vector<float> working_to_host(Compute& compute, const void* device, size_t count, Precision precision) {
  std::vector<float> values(count);
  if (precision == Precision::fp32) {
    compute.copy(values.data(), device, count * sizeof(float), compute.compute_stream());
  } else {
    std::vector<uint16_t> bits(count);
    compute.copy(bits.data(), device, count * sizeof(uint16_t), compute.compute_stream());
    compute.synchronize(compute.compute_stream());
    values = widen_bits(bits, precision);
  }
  compute.synchronize(compute.compute_stream());
  return values;
}

std::vector<float> Engine::canonical_from_padded(const std::vector<float>& padded) const {
  std::vector<float> canonical;
  canonical.reserve(psi());
  for (auto& p : parameters_)
    canonical.insert(canonical.end(), padded.begin() + p.offset, padded.begin() + p.offset + p.numel);
  return canonical;
}

// Every rank's shards (its shard-space vector: its shard of each bucket,
// back to back, Psi_padded / N elements) gathered into the padded layout:
// rank r's shard of bucket b back at b.offset + r * shard_length. Not
// training traffic, so not in the communication ledger. Collective.
std::vector<float> Engine::padded_from_shards(const std::vector<float>& shards, const char* what) const {
  const int N = comm_.world_size();
  std::vector<float> gathered(shards.size() * N), padded(psi_padded(), 0.0f);
  MPI_Request request;
  Z2_MPI_CHECK(MPI_Iallgather(shards.data(), (int)shards.size(), MPI_FLOAT, gathered.data(), (int)shards.size(),
                              MPI_FLOAT, comm_.mpi(), &request));
  wait_request(&request, std::string("the all-gather of ") + what);
  for (int r = 0; r < N; ++r)
    for (auto& b : buckets_)
      std::copy_n(gathered.begin() + (size_t)r * shards.size() + b.shard_offset, b.shard_length,
                  padded.begin() + shard_begin(b, r));
  return padded;
}

std::vector<float> Engine::parameters_to_host() {
  require_built("parameters_to_host");
  compute_.synchronize_all();
  const ModelStates s = model_states();
  if (!s.mixed()) return canonical_from_padded(working_to_host(compute_, s.params, psi_padded(), Precision::fp32));
  std::vector<float> master(s.master_elements);
  compute_.copy(master.data(), s.master, master.size() * sizeof(float), compute_.compute_stream());
  compute_.synchronize(compute_.compute_stream());
  if (options_.stage == 0) return canonical_from_padded(master);
  // Stages 1 and 2 hold the master sharded (in shard space).
  return canonical_from_padded(padded_from_shards(master, "the fp32 master weights"));
}

std::vector<float> Engine::working_parameters_to_host() {
  require_built("working_parameters_to_host");
  compute_.synchronize_all();
  return canonical_from_padded(working_to_host(compute_, model_states().params, psi_padded(), options_.precision));
}

void Engine::parameters_from_host(const std::vector<float>& canonical) {
  require_built("parameters_from_host");
  if (canonical.size() != psi())
    usage_error("parameters_from_host: %zu values for %zu parameters", canonical.size(), psi());
  const ModelStates s = model_states();
  std::vector<float> padded(psi_padded(), 0.0f);  // padding stays zero
  size_t position = 0;
  for (auto& p : parameters_) {
    std::copy_n(canonical.begin() + position, p.numel, padded.begin() + p.offset);
    position += p.numel;
  }
  Stream stream = compute_.compute_stream();
  // The copies read these host vectors when they run, not when they are
  // asked for: both live until the synchronize below (the simulated device
  // found `working` freed before its copy ran when it lived in the branch).
  std::vector<uint16_t> working;
  if (!s.mixed()) {
    compute_.copy(s.params, padded.data(), padded.size() * sizeof(float), stream);
    parameters_written();  // ZeRO-Offload: the host's fp32 master follows
  } else {
    // The working copy is the master rounded; the master holds this rank's region.
    working = narrow_bits(padded, options_.precision);
    compute_.copy(s.params, working.data(), working.size() * sizeof(uint16_t), stream);
    for (int b = 0; b < (int)buckets_.size(); ++b) {
      const UpdateRegion own = s.region(b);
      compute_.copy(s.master + own.state, padded.data() + own.parameter, own.length * sizeof(float), stream);
    }
  }
  compute_.synchronize(stream);
}

std::vector<float> Engine::gradients_to_host() {
  require_built("gradients_to_host");
  if (micro_steps_done_ != options_.accumulation_steps)
    usage_error("gradients_to_host: only after all %d micro-steps and before step()", options_.accumulation_steps);
  compute_.synchronize_all();
  // Each bucket's update region holds its reduced gradient: the whole bucket
  // in stage 0 (all-gathered), this rank's shard in stages 1 and 2.
  const ModelStates s = model_states();
  const bool whole = options_.stage == 0 || comm_.world_size() == 1;
  std::vector<float> values(whole ? psi_padded() : psi_padded() / comm_.world_size());
  for (int b = 0; b < (int)buckets_.size(); ++b) {
    const UpdateRegion own = s.region(b);
    const std::vector<float> region =
        working_to_host(compute_, s.grads + own.gradient * s.element, own.length, options_.precision);
    std::copy(region.begin(), region.end(), values.begin() + (whole ? buckets_[b].offset : buckets_[b].shard_offset));
  }
  std::vector<float> padded = whole ? std::move(values) : padded_from_shards(values, "the reduced gradient");
  // fp16: divide the loss scale out (a power of two: exact).
  const float unscale = 1.0f / loss_scale();
  if (unscale != 1.0f)
    for (float& value : padded) value *= unscale;
  return canonical_from_padded(padded);
}

std::vector<float> Engine::gradient_buffer_to_host() {
  require_built("gradient_buffer_to_host");
  if (micro_steps_done_ != options_.accumulation_steps)
    usage_error("gradient_buffer_to_host: only after all %d micro-steps and before step()",
                options_.accumulation_steps);
  compute_.synchronize_all();
  const ModelStates s = model_states();
  return working_to_host(compute_, s.grads, s.grad_elements, options_.precision);
}

uint64_t Engine::parameters_hash() {
  std::vector<float> values = parameters_to_host();
  return fnv1a64(values.data(), values.size());
}

uint64_t fnv1a64(const float* values, size_t count) {
  const unsigned char* bytes = reinterpret_cast<const unsigned char*>(values);
  uint64_t hash = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < count * sizeof(float); ++i) hash = (hash ^ bytes[i]) * 0x100000001b3ull;
  return hash;
}

}  // namespace z2
