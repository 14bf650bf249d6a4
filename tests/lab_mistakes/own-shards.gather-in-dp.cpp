// expect: stage 0 (DP) all-gathered parameters that every rank had already updated
// A planted mistake for the own-shards lab: the all-gather in every stage,
// stage 0 included.
#include "zero2.h"
void z2::update_and_gather(OwnShards& shards, const std::vector<BucketInfo>& buckets, int stage) {
  for (int b = 0; b < (int)buckets.size(); ++b) shards.adamw(b);
  for (int b = 0; b < (int)buckets.size(); ++b) shards.all_gather(b);
}
