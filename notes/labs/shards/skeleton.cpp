// notes/labs/shards/skeleton.cpp — lab: which part of a bucket a rank owns
// (the partition of P_os and P_os+g).
// Copy this file, write shard_begin, and grade it:
//   make lab LAB=shards SOLUTION=path/to/your_copy.cpp
// What to write and how it is graded: notes/labs/shards/README.md.
#include "zero2.h"

namespace z2 {

// The first element of rank `rank`'s shard of `bucket` in the padded flat
// buffer that holds every bucket one after another (zero2.h, BucketInfo).
size_t shard_begin(const BucketInfo& bucket, int rank) {
  // Yours here.
  return 0;
}

}  // namespace z2
