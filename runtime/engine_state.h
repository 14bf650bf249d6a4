// runtime/engine_state.h — this rank's model-state buffers as the runtime sees
// them (private to zero2.cu and the runtime's host copies, checkpoint state
// and ledger report). The engine's own view, with the kernels that work on
// the buffers, is zero2.cu's Engine::RankState; these files only copy bytes
// to and from the host, so they get the pointers and sizes, not the kernels.
#pragma once

#include "zero2.h"

namespace z2 {

struct ModelStates {
  Compute& compute;
  Communicator& comm;
  const EngineOptions& options;
  const std::vector<ParameterInfo>& parameters;
  const std::vector<BucketInfo>& buckets;
  char* params;  // [Psi_padded] working parameters (fp32: also the master)
  char* grads;   // [Psi_padded] stages 0/1, [Psi_padded / N] stage 2 (offload: the host's copy), working type
  size_t grad_elements;
  float* master;  // mixed precision: [Psi_padded] stage 0, [Psi_padded / N] stages 1/2 (fp32 with offload: a copy)
  size_t master_elements;
  float *exp_avg, *exp_avg_sq;  // AdamW's m and v, as many elements as the master
  size_t moment_elements;
  size_t element;               // bytes of a working element: 4 or 2
  size_t accumulation_element;  // bytes of an accumulation block's element
  bool mixed() const { return options.precision != Precision::fp32; }
  // This rank's update region of bucket b (zero2.h, UpdateRegion).
  UpdateRegion region(int b) const { return update_region(buckets[b], options.stage, comm.rank()); }
};

// What the engine refuses before it starts (runtime/option_checks.cpp), and
// each update's scheduled lr and betas, held to the same ranges (every step).
void check_engine_options(const EngineOptions& options);
void scheduled_settings(const EngineOptions& options, long t, StepReport& report);  // update t's lr and betas
void check_same_parameters(const std::vector<ParameterInfo>& parameters, Communicator& comm);  // collective
void check_loss_scaling(const LossScaling& settings);
void check_loss_scaler_state(const LossScalerState& state);

// fp32 values rounded to a 16-bit precision's bits (runtime/host_copies.cpp):
// a working copy is its master rounded, as an update leaves it.
std::vector<uint16_t> narrow_bits(const std::vector<float>& values, Precision precision);

}  // namespace z2
