// expect: stage 2 keeps only the gradient shard
// A planted mistake for the own-shards lab: stage 2's reduced gradient
// looked for where stage 1 keeps it, in a full gradient buffer.
#include "zero2.h"
z2::UpdateRegion z2::update_region(const BucketInfo& bucket, int stage, int rank) {
  if (stage == 0) return {bucket.offset, bucket.offset, bucket.offset, bucket.padded_length};
  const size_t slice = shard_begin(bucket, rank);
  return {slice, slice, bucket.shard_offset, bucket.shard_length};
}
