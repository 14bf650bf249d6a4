// expect: the bucket's shard was kept at element 0
// A planted mistake for the gradient-shards lab: every bucket's shard of the
// sum kept at the start of the gradient shard.
#include "zero2.h"
void z2::stage2_gradient_ready(GradientShards& shards, int bucket_index, const BucketInfo& bucket, int parameter) {
  if (shards.handed_over(bucket_index) == bucket.end_parameter - bucket.first_parameter)
    shards.reduce_scatter(bucket_index, 0);
}
