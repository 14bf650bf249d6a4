// expect: the bucket's offset is missing
// A planted mistake for the shards lab: the shard's place inside its bucket, not in the flat buffer.
#include "zero2.h"
size_t z2::shard_begin(const BucketInfo& bucket, int rank) { return (size_t)rank * bucket.shard_length; }
