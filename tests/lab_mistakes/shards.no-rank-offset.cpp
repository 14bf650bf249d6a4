// expect: the rank's offset r x shard_length is missing
// A planted mistake for the shards lab: every rank takes the bucket's first shard.
#include "zero2.h"
size_t z2::shard_begin(const BucketInfo& bucket, int rank) { return bucket.offset; }
