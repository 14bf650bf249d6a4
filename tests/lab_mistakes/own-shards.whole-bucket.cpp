// expect: not the whole bucket
// A planted mistake for the own-shards lab: every stage updates the whole
// bucket, as data parallelism does.
#include "zero2.h"
z2::UpdateRegion z2::update_region(const BucketInfo& bucket, int stage, int rank) {
  return {bucket.offset, bucket.offset, bucket.offset, bucket.padded_length};
}
