// expect: stage 2 has no full gradient buffer
// A planted mistake for the gradient-shards lab: the shard of the sum kept at
// the bucket's place in a full gradient buffer, which stage 2 does not have.
#include "zero2.h"
void z2::stage2_gradient_ready(GradientShards& shards, int bucket_index, const BucketInfo& bucket, int parameter) {
  if (shards.handed_over(bucket_index) == bucket.end_parameter - bucket.first_parameter)
    shards.reduce_scatter(bucket_index, bucket.offset);
}
