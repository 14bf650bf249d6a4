// expect: already holds a staging slot
// A planted mistake for the gradient-shards lab: a slot taken for every
// parameter instead of one for the bucket.
#include "zero2.h"
void* z2::stage2_gradient_output(GradientShards& shards, int bucket_index, const BucketInfo& bucket,
                                 size_t offset_in_bucket) {
  shards.take_slot(bucket_index);
  return shards.slot_element(bucket_index, offset_in_bucket);
}
