// runtime/option_checks.cpp — what the engine refuses before it starts, each
// with one message on every rank (usage_error): EngineOptions out of range
// (and a schedule's rate or betas at each update),
// ranks that registered different parameters, fp16 loss-scaling settings and
// a restored loss-scaler state that no run reaches. The chapter (zero2.cu)
// calls these where the options arrive; what they guard is taught there.
// Host code.
#include "runtime/engine_state.h"

#include <cmath>
#include <utility>

namespace z2 {

// Adam's betas: in [0, 1) (a NaN fails it too).
static bool beta_in_range(double beta) { return beta >= 0 && beta < 1; }

void check_engine_options(const EngineOptions& o) {
  if (o.stage < 0 || o.stage > 2) usage_error("stage must be 0, 1 or 2 (got %d)", o.stage);
  if (o.offload_optimizer && o.stage == 0)
    usage_error(
        "offloading the optimizer needs ZeRO stage 1 or 2: in stage 0 every rank updates every parameter, so the "
        "host would hold all 16 Psi bytes (DeepSpeed refuses it too: ZeRO-Offload is built on the partitioned "
        "optimizer). Use stage 1 or 2, or no offload");
  if (o.host_threads < 0 || o.host_threads > 1024)
    usage_error("host threads must be 0 (this rank's share of the node's cores) or 1 to 1024 (got %d)",
                o.host_threads);
  if (o.bucket_elements <= 0)
    usage_error("bucket size must be a positive number of elements (got %ld)", o.bucket_elements);
  if (o.accumulation_steps < 1)
    usage_error("gradient accumulation steps must be at least 1 (got %d)", o.accumulation_steps);
  if (!(o.lr >= 0) || !beta_in_range(o.beta1) || !beta_in_range(o.beta2) || !(o.eps > 0) ||
      !(o.weight_decay >= 0) || !(o.clip >= 0))
    usage_error(
        "AdamW settings out of range: lr %g >= 0, 0 <= beta1 %g < 1, 0 <= beta2 %g < 1, eps %g > 0, "
        "weight decay %g >= 0, clip %g >= 0",
        o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.clip);
}

// Update t's rate and betas, from the schedules where the options give them
// (a scheduler may set both: DeepSpeed's OneCycle cycles beta1), held to the
// ranges check_engine_options holds the fixed ones to.
void scheduled_settings(const EngineOptions& o, long t, StepReport& report) {
  report.lr = o.lr_schedule ? o.lr_schedule(t) : o.lr;
  if (!std::isfinite(report.lr) || report.lr < 0)
    usage_error("the learning-rate schedule gave %g for step %ld: it must be finite and >= 0", report.lr, t);
  const std::pair<double, double> betas = o.betas_schedule ? o.betas_schedule(t) : std::make_pair(o.beta1, o.beta2);
  report.beta1 = betas.first, report.beta2 = betas.second;
  if (!beta_in_range(report.beta1) || !beta_in_range(report.beta2))
    usage_error("the betas schedule gave (%g, %g) for step %ld: each must be in [0, 1)", report.beta1, report.beta2, t);
}

// Every rank must register the same parameters, or the buckets would not
// match and the first collective would fail with an opaque MPI error. Agree
// on a hash of the names, sizes and decay flags.
void check_same_parameters(const std::vector<ParameterInfo>& parameters, Communicator& comm) {
  uint64_t layout = 0xcbf29ce484222325ull;
  for (auto& p : parameters) layout = hash_keys(layout, std::hash<std::string>()(p.name), p.numel, p.decay);
  unsigned long long mine = layout, lowest = 0, highest = 0;
  watched_allreduce(&mine, &lowest, 1, MPI_UNSIGNED_LONG_LONG, MPI_MIN, comm.mpi(), "the layout check's all-reduce");
  watched_allreduce(&mine, &highest, 1, MPI_UNSIGNED_LONG_LONG, MPI_MAX, comm.mpi(), "the layout check's all-reduce");
  if (lowest != highest)
    usage_error(
        "build(): the ranks registered different parameters (names, sizes or decay flags differ); every "
        "rank must register the same model");
}

void check_loss_scaling(const LossScaling& settings) {
  if (!(settings.static_scale >= 0) || !std::isfinite(settings.static_scale))
    usage_error("fp16 loss_scale %g: 0 (dynamic) or a positive static scale", settings.static_scale);
  if (settings.initial_scale_power < 0 || settings.initial_scale_power > 100)
    usage_error("fp16 initial_scale_power %d: from 0 to 100", settings.initial_scale_power);
  if (settings.window < 1) usage_error("fp16 loss_scale_window %ld: at least 1", settings.window);
  if (settings.hysteresis < 1) usage_error("fp16 hysteresis %d: at least 1", settings.hysteresis);
  // 0 is DeepSpeed's "no floor" (loss_scaler.py update_scale: max(scale / 2, 0));
  // its raise at the minimum then comes only once the scale has reached 0.
  if (!(settings.min_scale >= 0) || !std::isfinite(settings.min_scale))
    usage_error("fp16 min_loss_scale %g: must be >= 0", settings.min_scale);
}

void check_loss_scaler_state(const LossScalerState& state) {
  if (!(state.scale > 0) || !std::isfinite(state.scale) || state.hysteresis_left < 1 || state.iteration < 0 ||
      state.last_overflow < -1 || state.last_overflow >= state.iteration)
    usage_error(
        "a loss scaler state that no run reaches: scale %g, hysteresis left %d, iteration %ld, last overflow %ld",
        state.scale, state.hysteresis_left, state.iteration, state.last_overflow);
}

}  // namespace z2
