// expect: called MPI_Allreduce
// A planted mistake for the reduce-scatter lab: all-reduce the whole bucket, keep the own slice.
#include <vector>

#include "zero2.h"
void z2::reduce_scatter_blocking(const float* bucket, float* shard, size_t shard_elements, MPI_Comm comm) {
  int world = 0, rank = 0;
  MPI_Comm_size(comm, &world);
  MPI_Comm_rank(comm, &rank);
  std::vector<float> sum(world * shard_elements);
  MPI_Allreduce(bucket, sum.data(), (int)sum.size(), MPI_FLOAT, MPI_SUM, comm);
  for (size_t i = 0; i < shard_elements; ++i) shard[i] = sum[rank * shard_elements + i];
}
void z2::all_gather_blocking(const float* shard, float* bucket, size_t shard_elements, MPI_Comm comm) {
  MPI_Allgather(shard, (int)shard_elements, MPI_FLOAT, bucket, (int)shard_elements, MPI_FLOAT, comm);
}
