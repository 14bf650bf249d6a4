// runtime/lab_adapters.h — what the lab seams are lent, and what the
// engine refuses on backward's calls (part of zero2.cu: it includes this
// file right after Engine::RankState, whose members these are; private).
//
// The seams (zero2.h, "the lab seams") call an interface, GradientShards or
// OwnShards, so that a student's function can be graded with the engine's
// own calls. The adapters below implement those interfaces over RankState:
// each call is checked first (a seam's call out of order stops every rank
// with a message, not with wrong bits or a hang), then forwarded to the
// chapter's own step (take_slot, reduce_slot, adamw, gather_parameters).
// The chapter reads past them: the checks are the course's, not ZeRO's.
#pragma once

namespace z2 {

// --- stage 2's slots (the gradient-shards lab) ------------------------------------

// What stage 2's two hooks (stage2_gradient_output, stage2_gradient_ready)
// are lent: the exchange's slots and this rank's gradient shard. Each call
// refuses what would break a later one, with a message, then does what the
// chapter's RankState does (take_slot, reduce_slot: zero2.cu, "Backward").
struct Engine::RankState::SlotGradients : GradientShards {
  RankState& rank_state;
  explicit SlotGradients(RankState& state) : rank_state(state) {}
  bool holds_slot(int b) const override {
    return rank_state.exchange->slot_of(rank_state.check_bucket(b, "holds_slot")) >= 0;
  }
  void take_slot(int b) override {
    refuse_second_slot(b);
    rank_state.take_slot(b);
  }
  void* slot_element(int b, size_t index) override {
    refuse_outside_slot(b, index);
    return (char*)rank_state.slot_buffer[b] + index * rank_state.element;
  }
  int handed_over(int b) const override {
    return rank_state.bucket_ready_count[rank_state.check_bucket(b, "handed_over")];
  }
  void reduce_scatter(int b, size_t keep) override {
    refuse_early_reduce_scatter(b, keep);
    rank_state.reduce_slot(b, keep);
  }

  void refuse_second_slot(int b) const;
  void refuse_outside_slot(int b, size_t index) const;
  void refuse_storage_outside_slot(const ParameterInfo& p, const void* storage) const;
  void refuse_early_reduce_scatter(int b, size_t keep) const;
};

// --- what backward's calls refuse (a model's call out of order) -----------------

void Engine::RankState::refuse_gradient_output(ParameterId id, Precision expected) const {
  const std::vector<ParameterInfo>& parameters = engine.parameters_;
  if (id < 0 || id >= (int)parameters.size()) usage_error("gradient_output: id %d out of range", id);
  if (expected != options.precision)
    usage_error("gradient_output: '%s' asked for as %s, but the engine trains in %s", parameters[id].name.c_str(),
                to_string(expected), to_string(options.precision));
  if (engine.micro_steps_done_ >= options.accumulation_steps)
    usage_error("gradient_output: all %d micro-steps of this optimizer step are done; call step() first",
                options.accumulation_steps);
  if (parameter_ready[id])
    usage_error("gradient_output: '%s' was already handed over this micro-step", parameters[id].name.c_str());
}

void Engine::RankState::refuse_gradient_ready(ParameterId id) const {
  const std::vector<ParameterInfo>& parameters = engine.parameters_;
  if (id < 0 || id >= (int)parameters.size()) usage_error("gradient_ready: id %d out of range", id);
  if (parameter_ready[id])
    usage_error("gradient_ready: '%s' handed over twice in one micro-step", parameters[id].name.c_str());
  if (stage == 2 && exchange->slot_of(parameters[id].bucket) < 0)
    usage_error("gradient_ready: '%s' handed over without gradient_output()", parameters[id].name.c_str());
}

// --- what stage 2's hooks refuse (a seam's call out of order) -----------------

void Engine::RankState::SlotGradients::refuse_second_slot(int b) const {
  if (holds_slot(b))
    usage_error(
        "take_slot: bucket %d already holds a staging slot: a bucket takes one slot, at its first gradient, and "
        "keeps it until its reduce-scatter has finished",
        b);
}

void Engine::RankState::SlotGradients::refuse_outside_slot(int b, size_t index) const {
  if (!holds_slot(b)) usage_error("slot_element: bucket %d holds no slot (take_slot first)", b);
  const BucketInfo& bucket = rank_state.buckets[b];
  if (index < bucket.padded_length) return;
  // The likely mistake: the parameter's offset in the flat buffer where its offset in the bucket goes.
  const bool flat = index >= bucket.offset && index - bucket.offset < bucket.padded_length;
  usage_error("slot_element: element %zu of bucket %d, which has %zu%s", index, b, bucket.padded_length,
              flat ? format_text(" (%zu looks like an offset in the flat buffer, where bucket %d begins at %zu: the "
                                 "slot holds the bucket alone, so pass the offset within it, %zu)",
                                 index, b, bucket.offset, index - bucket.offset)
                         .c_str()
                   : "");
}

void Engine::RankState::SlotGradients::refuse_storage_outside_slot(const ParameterInfo& p, const void* storage) const {
  const BucketInfo& b = rank_state.buckets[p.bucket];
  const char* slot = (const char*)rank_state.slot_buffer[p.bucket];
  if (!holds_slot(p.bucket) || (const char*)storage < slot ||
      (const char*)storage + p.numel * rank_state.element > slot + b.padded_length * rank_state.element)
    usage_error("stage2_gradient_output: the gradient of '%s' (%zu elements) must lie in bucket %d's slot",
                p.name.c_str(), p.numel, p.bucket);
}

void Engine::RankState::SlotGradients::refuse_early_reduce_scatter(int b, size_t keep) const {
  const BucketInfo& info = rank_state.buckets[b];
  const int parameters = info.end_parameter - info.first_parameter;
  if (rank_state.bucket_reduced[b])
    usage_error("reduce_scatter: bucket %d was reduce-scattered already in this micro-step", b);
  if (!holds_slot(b)) usage_error("reduce_scatter: bucket %d holds no slot: nothing was written for it", b);
  if (rank_state.bucket_ready_count[b] < parameters)
    usage_error(
        "reduce_scatter: bucket %d with %d of its %d gradients handed over: the others would be written after the "
        "sum was taken. Backward hands a bucket's parameters over last first (in any order, in general): count them",
        b, rank_state.bucket_ready_count[b], parameters);
  // A student's `keep` may differ between ranks: agreed, so that no rank stops alone.
  const size_t shard_elements = rank_state.engine.psi_padded() / rank_state.comm.world_size();
  if (fails_on_any_rank(rank_state.comm, keep > shard_elements || info.shard_length > shard_elements - keep))
    usage_error(
        "reduce_scatter: bucket %d's shard of %zu elements kept from element %zu of a gradient shard of %zu on some "
        "rank: stage 2 has no full gradient buffer (shard_begin places a shard in the full buffer)",
        b, info.shard_length, keep, shard_elements);
}

// --- the step over the own shards (the own-shards lab) ------------------------------

// What the own-shards seam (update_and_gather) is lent: AdamW with this
// step's constants on a bucket's update region, and the all-gather of a
// bucket's parameters, each bucket once, its update first (the refusals
// below), done by the chapter's RankState::adamw and gather_parameters.
struct Engine::RankState::StepOverShards : OwnShards {
  RankState& rank_state;
  const AdamWConstants constants;
  std::vector<char> updated = std::vector<char>(rank_state.buckets.size()), gathered = updated;  // this step
  StepOverShards(RankState& state, const AdamWConstants& step_constants)
      : rank_state(state), constants(step_constants) {}
  void adamw(int b) override {
    refuse_update(b);
    updated[b] = 1;
    rank_state.adamw(b, constants);
  }
  void all_gather(int b) override {
    refuse_gather(b);
    gathered[b] = 1;
    rank_state.gather_parameters(b);
  }
  void refuse_update(int b) const;
  void refuse_gather(int b) const;
};

// --- what the own-shards seam refuses (a call out of order) ------------------
// The all-gather reads the shard while it runs, so an update after it would
// race with it, and the other ranks could receive the old shard. (The order
// of the calls is the same on every rank, so every rank refuses together.)

void Engine::RankState::StepOverShards::refuse_update(int b) const {
  rank_state.check_bucket(b, "adamw");
  if (gathered[b])
    usage_error(
        "adamw: bucket %d's all-gather has already started: it would send the shard as it was before the "
        "update (or half updated). Update a bucket, then all-gather it",
        b);
  if (updated[b]) usage_error("adamw: bucket %d was updated already in this step", b);
}

void Engine::RankState::StepOverShards::refuse_gather(int b) const {
  rank_state.check_bucket(b, "all_gather");
  if (gathered[b]) usage_error("all_gather: bucket %d was all-gathered already in this step", b);
}

}  // namespace z2
