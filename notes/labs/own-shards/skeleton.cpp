// notes/labs/own-shards/skeleton.cpp — lab: stage 1's optimizer step (P_os),
// AdamW on the own shard of every bucket, then the all-gather.
// Copy this file, write both functions, and grade them:
//   make lab LAB=own-shards SOLUTION=path/to/your_copy.cpp
// What to write and how it is graded: notes/labs/own-shards/README.md.
#include "zero2.h"

namespace z2 {

// The elements of `bucket` whose AdamW update rank `rank` makes at `stage`,
// as a run in each of three index spaces (zero2.h, UpdateRegion):
//   parameter  in the padded flat buffer of parameters [Psi_padded];
//   gradient   in the gradient buffer: [Psi_padded] in stages 0 and 1,
//              [Psi_padded / N] in stage 2;
//   state      in AdamW's m and v (and the fp32 master): [Psi_padded] in
//              stage 0, [Psi_padded / N] in stages 1 and 2;
//   length     the run's length, the same in each.
UpdateRegion update_region(const BucketInfo& bucket, int stage, int rank) {
  UpdateRegion region;
  // Yours here.
  return region;
}

// One optimizer step of `stage` over the engine's buckets: shards.adamw(b)
// updates update_region(bucket b, stage, this rank); shards.all_gather(b)
// starts the all-gather of bucket b's parameters (the engine waits for it
// after this returns).
void update_and_gather(OwnShards& shards, const std::vector<BucketInfo>& buckets, int stage) {
  // Yours here.
}

}  // namespace z2
