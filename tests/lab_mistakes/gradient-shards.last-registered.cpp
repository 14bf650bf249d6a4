// expect: count them
// A planted mistake for the gradient-shards lab: the bucket is taken as
// complete when its last registered parameter arrives, but backward hands
// that one over first.
#include "zero2.h"
void z2::stage2_gradient_ready(GradientShards& shards, int bucket_index, const BucketInfo& bucket, int parameter) {
  if (parameter == bucket.end_parameter - 1) shards.reduce_scatter(bucket_index, bucket.shard_offset);
}
