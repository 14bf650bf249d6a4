// expect: Update a bucket, then all-gather it
// A planted mistake for the own-shards lab: each bucket all-gathered before
// its update, so the other ranks would receive the shard as it was.
#include "zero2.h"
void z2::update_and_gather(OwnShards& shards, const std::vector<BucketInfo>& buckets, int stage) {
  for (int b = 0; b < (int)buckets.size(); ++b) {
    if (stage > 0) shards.all_gather(b);
    shards.adamw(b);
  }
}
