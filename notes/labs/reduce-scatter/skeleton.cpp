// notes/labs/reduce-scatter/skeleton.cpp — lab: the blocking deterministic
// reduce-scatter and all-gather over MPI.
// Copy this file, write both functions, and grade them:
//   make lab LAB=reduce-scatter SOLUTION=path/to/your_copy.cpp
// What to write and how it is graded: notes/labs/reduce-scatter/README.md.
#include <vector>

#include "zero2.h"

namespace z2 {

// bucket [N x shard_elements] on every rank (N = the ranks of comm). Rank r
// ends with shard [shard_elements]: element i is the sum over ranks j of
// bucket_j[r x shard_elements + i], added with z2::tree_sum in rank order.
void reduce_scatter_blocking(const float* bucket, float* shard, size_t shard_elements, MPI_Comm comm) {
  // Yours here.
}

// shard [shard_elements] of every rank -> bucket [N x shard_elements], rank
// r's shard at r x shard_elements.
void all_gather_blocking(const float* shard, float* bucket, size_t shard_elements, MPI_Comm comm) {
  // Yours here.
}

}  // namespace z2
