// measurements/mpi_sum_order.cpp — in which order does this MPI library add the N
// ranks' contributions in MPI_Allreduce and MPI_Reduce_scatter_block? For
// notes/06 ("Why a library's sum changes with N"; make notes runs it at
// N = 2, 3, 4). Each rank contributes random floats of mixed magnitudes, so
// different addition orders give different bits in most elements; rank 0
// compares each result element with three candidate orders over the ranks:
//   canonical   zero2's tree (canonical_tree_sum): ((0+1)+(2+3)), ((0+1)+2), ...
//   halving     recursive halving's pairs at distance N/2 first: ((0+2)+(1+3))
//   in order    left to right: (((0+1)+2)+3)
// and prints one Markdown row per collective and size: the share of
// elements each order explains (an order explains the result when its share
// is 100%). Header-only use of zero2 (the tree); no engine.
#include <mpi.h>

#include <cstdio>
#include <random>
#include <vector>

#include "zero2.h"

namespace {
float in_order(const std::vector<float>& leaves) {
  float sum = leaves[0];
  for (size_t r = 1; r < leaves.size(); ++r) sum = sum + leaves[r];
  return sum;
}
// Pairs at distance N/2 first, then N/4, ... (N a power of two): r + N/2 into r.
float halving(std::vector<float> leaves) {
  for (size_t half = leaves.size() / 2; half >= 1; half /= 2)
    for (size_t r = 0; r < half; ++r) leaves[r] = leaves[r] + leaves[r + half];
  return leaves[0];
}
}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const bool power_of_two = (world & (world - 1)) == 0;
  for (int count : {512, 65536, 1 << 20}) {  // elements: a small bucket, the test MLP's, BERT-mini's size
    const int shard = count / world;
    std::vector<float> all((size_t)world * count);
    std::mt19937 generator(7);
    std::uniform_real_distribution<float> uniform(-1, 1);
    for (float& value : all) value = uniform(generator) * (float)(1 << (generator() % 20));
    const std::vector<float> mine(all.begin() + (size_t)rank * count, all.begin() + (size_t)(rank + 1) * count);
    std::vector<float> reduced(count), scattered(shard);
    MPI_Allreduce(mine.data(), reduced.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Reduce_scatter_block(mine.data(), scattered.data(), shard, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    if (rank != 0) continue;
    for (int collective = 0; collective < 2; ++collective) {
      const std::vector<float>& result = collective == 0 ? reduced : scattered;  // rank 0's shard: elements 0..
      long canonical = 0, halved = 0, ordered = 0;
      std::vector<float> leaves(world);
      for (size_t i = 0; i < result.size(); ++i) {
        for (int r = 0; r < world; ++r) leaves[r] = all[(size_t)r * count + i];
        canonical += result[i] == z2::canonical_tree_sum(world, [&](long r) { return leaves[r]; });
        halved += power_of_two && result[i] == halving(leaves);
        ordered += result[i] == in_order(leaves);
      }
      const double n = (double)result.size();
      char halving_share[16] = "-";
      if (power_of_two) snprintf(halving_share, sizeof halving_share, "%.1f%%", 100.0 * halved / n);
      printf("| %d | %s | %d | %.1f%% | %s | %.1f%% |\n", world,
             collective == 0 ? "MPI_Allreduce" : "MPI_Reduce_scatter_block", count, 100.0 * canonical / n,
             halving_share, 100.0 * ordered / n);
    }
  }
  MPI_Finalize();
  return 0;
}
