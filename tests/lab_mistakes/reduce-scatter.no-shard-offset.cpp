// expect: you kept slice 0 of the sum
// A planted mistake for the reduce-scatter lab: every rank sums slice 0 (the shard offset forgotten).
#include <vector>

#include "zero2.h"
void z2::reduce_scatter_blocking(const float* bucket, float* shard, size_t shard_elements, MPI_Comm comm) {
  int world = 0;
  MPI_Comm_size(comm, &world);
  std::vector<float> everything(world * world * shard_elements), leaves(world);
  MPI_Allgather(bucket, (int)(world * shard_elements), MPI_FLOAT, everything.data(), (int)(world * shard_elements),
                MPI_FLOAT, comm);
  for (size_t i = 0; i < shard_elements; ++i) {
    for (int j = 0; j < world; ++j) leaves[j] = everything[j * world * shard_elements + i];  // slice 0 of rank j
    shard[i] = z2::tree_sum(world, leaves.data());
  }
}
void z2::all_gather_blocking(const float* shard, float* bucket, size_t shard_elements, MPI_Comm comm) {
  MPI_Allgather(shard, (int)shard_elements, MPI_FLOAT, bucket, (int)shard_elements, MPI_FLOAT, comm);
}
