// expect: you added left to right
// A planted mistake for the reduce-scatter lab: the slices summed in sequence.
#include <vector>

#include "zero2.h"
void z2::reduce_scatter_blocking(const float* bucket, float* shard, size_t shard_elements, MPI_Comm comm) {
  int world = 0;
  MPI_Comm_size(comm, &world);
  std::vector<float> slices(world * shard_elements);
  MPI_Alltoall(bucket, (int)shard_elements, MPI_FLOAT, slices.data(), (int)shard_elements, MPI_FLOAT, comm);
  for (size_t i = 0; i < shard_elements; ++i) {
    float sum = 0;
    for (int j = 0; j < world; ++j) sum += slices[j * shard_elements + i];
    shard[i] = sum;
  }
}
void z2::all_gather_blocking(const float* shard, float* bucket, size_t shard_elements, MPI_Comm comm) {
  MPI_Allgather(shard, (int)shard_elements, MPI_FLOAT, bucket, (int)shard_elements, MPI_FLOAT, comm);
}
