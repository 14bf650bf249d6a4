// expect: shard_begin is where a shard lies in the full parameter buffer
// A planted mistake for the own-shards lab: AdamW's state indexed like the
// parameters, though m and v hold only the own shards.
#include "zero2.h"
z2::UpdateRegion z2::update_region(const BucketInfo& bucket, int stage, int rank) {
  if (stage == 0) return {bucket.offset, bucket.offset, bucket.offset, bucket.padded_length};
  const size_t slice = shard_begin(bucket, rank);
  return {slice, stage == 2 ? bucket.shard_offset : slice, slice, bucket.shard_length};
}
