// notes/labs/gradient-shards/skeleton.cpp — lab: stage 2's backward (P_os+g),
// a staging slot per bucket, reduce-scattered as soon as the bucket is
// complete, only the own shard of the sum kept.
// Copy this file, write both functions, and grade them:
//   make lab LAB=gradient-shards SOLUTION=path/to/your_copy.cpp
// What to write and how it is graded: notes/labs/gradient-shards/README.md.
#include "zero2.h"

namespace z2 {

// Backward asks where to write the gradient of a parameter that begins
// `offset_in_bucket` elements into bucket `bucket_index`. Return that place
// (shards.slot_element) in the bucket's slot, taking the slot first
// (shards.take_slot) if the bucket holds none yet.
void* stage2_gradient_output(GradientShards& shards, int bucket_index, const BucketInfo& bucket,
                             size_t offset_in_bucket) {
  // Yours here.
  return nullptr;
}

// Backward has handed over the gradient of parameter `parameter` of bucket
// `bucket_index`. When the bucket is complete, start its reduce-scatter
// (shards.reduce_scatter), keeping this rank's shard of the sum at its place
// in the gradient shard [Psi_padded / N].
void stage2_gradient_ready(GradientShards& shards, int bucket_index, const BucketInfo& bucket, int parameter) {
  // Yours here.
}

}  // namespace z2
