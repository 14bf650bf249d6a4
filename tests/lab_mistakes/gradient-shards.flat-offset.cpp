// expect: looks like an offset in the flat buffer
// A planted mistake for the gradient-shards lab: the parameter's offset in
// the padded flat buffer where its offset within the bucket goes (the slot
// holds one bucket, from its first element).
#include "zero2.h"
void* z2::stage2_gradient_output(GradientShards& shards, int bucket_index, const BucketInfo& bucket,
                                 size_t offset_in_bucket) {
  if (!shards.holds_slot(bucket_index)) shards.take_slot(bucket_index);
  return shards.slot_element(bucket_index, bucket.offset + offset_in_bucket);
}
