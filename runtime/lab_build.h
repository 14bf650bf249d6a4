// runtime/lab_build.h — what changes in a lab build (-DZ2_LAB_BUILD, `make
// lab`; notes/labs), kept out of the chapter's code but for zero2.h's
// sum_over_ranks (private to zero2.cu).
// A lab build is host-only and replaces a seam with a student's function, so
//   - the exchange's sum over ranks goes through the student's tree_sum
//     (the engine then trains with it: zero2.h's sum_over_ranks), at most
//     64 ranks' slices (check_lab_ranks, where the receiver's sum starts);
//   - a value a student's seam computed may be wrong on some ranks only, so
//     the ranks agree before any stops (one rank stopping alone would leave
//     the others waiting in a collective);
//   - a student's shard_begin and update_region are checked for every rank
//     before anything is allocated (runtime/lab_checks.cpp).
// In every other build these are the engine's own code, unchanged.
#pragma once

#include "zero2.h"

namespace z2 {

// `fails` as every rank sees it: in a lab build, agreed across the ranks.
inline bool fails_on_any_rank(Communicator& comm, bool fails) {
#if defined(Z2_LAB_BUILD)
  return comm.any_rank(fails);
#else
  (void)comm;
  return fails;
#endif
}

// A student's shard_begin (the shards lab) and update_region (the own-shards
// lab), checked on every rank for every rank, so that a wrong one stops all
// ranks with a message instead of one rank tripping over its shard inside a
// collective or AdamW writing past a buffer.
void check_lab_shards(const std::vector<BucketInfo>& buckets, int world_size);
void check_lab_regions(const std::vector<BucketInfo>& buckets, const EngineBuffers& sizes, int stage, int world_size);

// Both, at build(), before anything is allocated (in a lab build; nothing otherwise).
inline void check_lab_layout(const std::vector<BucketInfo>& buckets, const EngineOptions& options, int world_size) {
#if defined(Z2_LAB_BUILD)
  check_lab_shards(buckets, world_size);
  check_lab_regions(buckets, engine_buffers(buckets, options, world_size), options.stage, world_size);
#endif
  (void)buckets, (void)options, (void)world_size;
}

// sum_over_ranks (zero2.h) sums the slices through the student's tree_sum,
// over at most 64 leaves: checked where the receiver's sum starts, for every
// exchange (the engine's, and one a test makes itself).
inline void check_lab_ranks(int ranks) {
#if defined(Z2_LAB_BUILD)
  if (ranks > 64) usage_error("a lab build sums at most 64 ranks' slices (this run has %d)", ranks);
#endif
  (void)ranks;
}

}  // namespace z2
