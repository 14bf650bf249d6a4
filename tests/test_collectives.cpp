// tests/test_collectives.cpp — the canonical tree and the bucket collectives.
//
// Expected values are computed analytically on every rank: each rank can
// generate every other rank's data (test_value is keyed by rank and element),
// sum it with the recursive definition of the tree, and compare with memcmp.
#include <cmath>
#include <cstring>

#include "harness.h"

using harness::agree;
using harness::recursive_tree_sum;
using harness::same_bits;
using harness::test_value;

// ----------------------------------------------------------------------------
// The tree itself (host only; the device runs the same Z2_HD function).

TEST_CASE("canonical_tree_sum (binary counter) equals the recursive left-complete tree") {
  bool all_equal = true, order_matters = false;
  for (long n = 0; n <= 130; ++n) {
    std::vector<float> leaves(n);
    for (long k = 0; k < n; ++k) leaves[k] = test_value(n, k);
    float counter = z2::canonical_tree_sum(n, [&](long k) { return leaves[k]; });
    float recursive = recursive_tree_sum(leaves.data(), n);
    all_equal &= std::memcmp(&counter, &recursive, sizeof(float)) == 0;
    float sequential = 0.0f;
    for (float leaf : leaves) sequential += leaf;
    order_matters |= sequential != recursive;
  }
  CHECK(agree(all_equal, "binary-counter tree differs from the recursive tree"));
  // The data are chosen so that the order shows: a left-to-right sum differs
  // somewhere. Without this the test above could not fail.
  CHECK(order_matters);
}

// perfect_tree_sum (by levels, the norm chunks' fast form) must be the same
// tree: compared with the recursive definition for every power of two the
// engine could use, on data where a wrong pairing shows.
template <int n>
static bool perfect_tree_matches(bool* order_matters) {
  bool equal = true;
  for (int trial = 0; trial < 8; ++trial) {
    float leaves[n], copy[n];
    for (int k = 0; k < n; ++k) leaves[k] = copy[k] = test_value(1000 * n + trial, k);
    const float levels = z2::perfect_tree_sum<n>(copy);
    const float recursive = recursive_tree_sum(leaves, n);
    equal &= std::memcmp(&levels, &recursive, sizeof(float)) == 0;
    float sequential = 0.0f;
    for (float leaf : leaves) sequential += leaf;
    *order_matters |= sequential != recursive;
  }
  return equal;
}
TEST_CASE("perfect_tree_sum (by levels) equals the recursive tree for n = 1 ... 256") {
  bool order_matters = false;
  bool equal = perfect_tree_matches<1>(&order_matters) && perfect_tree_matches<2>(&order_matters) &&
               perfect_tree_matches<4>(&order_matters) && perfect_tree_matches<8>(&order_matters) &&
               perfect_tree_matches<16>(&order_matters) && perfect_tree_matches<32>(&order_matters) &&
               perfect_tree_matches<64>(&order_matters) && perfect_tree_matches<128>(&order_matters) &&
               perfect_tree_matches<256>(&order_matters);
  CHECK(agree(equal, "perfect_tree_sum differs from the recursive tree"));
  CHECK(order_matters);  // the data make the order show, so the test can fail
}

TEST_CASE("accumulate_micro_step over A micro-steps equals the canonical tree over A leaves") {
  bool all_equal = true;
  const size_t elements = 5;
  for (long A = 1; A <= 19; ++A) {
    std::vector<std::vector<float>> blocks(32, std::vector<float>(elements, 0.0f));
    z2::AccumulationStack stack{};
    for (int d = 0; d < 32; ++d) stack.entries[d] = blocks[d].data();
    std::vector<float> result(elements, 0.0f);
    for (long a = 0; a < A; ++a)
      for (size_t i = 0; i < elements; ++i)
        z2::accumulate_micro_step(stack, a, A, test_value(A, a, i), result.data(), i);
    for (size_t i = 0; i < elements; ++i) {
      std::vector<float> leaves(A);
      for (long a = 0; a < A; ++a) leaves[a] = test_value(A, a, i);
      float expected = recursive_tree_sum(leaves.data(), A);
      all_equal &= std::memcmp(&expected, &result[i], sizeof(float)) == 0;
    }
    // It never needs more than floor(log2 A) open blocks: the next one is untouched.
    size_t blocks_used = 0;
    while ((2l << blocks_used) <= A) ++blocks_used;
    for (float value : blocks[blocks_used]) all_equal &= value == 0.0f;
  }
  CHECK(agree(all_equal, "accumulation tree differs from the canonical tree"));
}

// ----------------------------------------------------------------------------
// The bucket collectives, on every backend.

// Rank r's value at element i of a bucket: test data in the first `length`
// elements, zero in the padding (as the engine's layout pads).
static float bucket_value(int rank, int bucket, size_t i, size_t length) {
  return i < length ? test_value(1000 + rank, bucket, i) : 0.0f;
}

static size_t padded_for(size_t length, int N) { return (length + N - 1) / N * N; }

// Bucket lengths: tiny, not a multiple of anything, one large.
static const size_t lengths[] = {1, 33, 1000, 4099, 70001};

TEST_CASE("deterministic reduce-scatter equals the serial canonical-tree sum and the blocking reference, bit for bit") {
  for (const auto& backend : harness::backends()) {
    z2::Communicator& comm = *backend.deterministic;
    z2::Compute& compute = *backend.compute;
    const int N = comm.world_size(), me = comm.rank();
    size_t max_padded = 0;
    for (size_t length : lengths) max_padded = std::max(max_padded, padded_for(length, N));
    for (int slots : {1, 2}) {
      z2::BucketExchange exchange(compute, comm, max_padded, slots, false);
      const int count = (int)(sizeof lengths / sizeof lengths[0]);
      std::vector<z2::DeviceArray<float>> buckets, results;
      std::vector<std::vector<float>> references;  // z2::reduce_scatter_blocking's shard of each bucket
      for (int b = 0; b < count; ++b) {
        const size_t padded = padded_for(lengths[b], N), shard = padded / N;
        std::vector<float> mine(padded);
        for (size_t i = 0; i < padded; ++i) mine[i] = bucket_value(me, b, i, lengths[b]);
        references.emplace_back(shard);
        z2::reduce_scatter_blocking(mine.data(), references.back().data(), shard, comm.mpi());
        buckets.emplace_back(compute, padded, z2::MemoryKind::activations);
        results.emplace_back(compute, shard, z2::MemoryKind::activations);
        compute.copy(buckets.back().data(), mine.data(), padded * sizeof(float), compute.compute_stream());
        compute.synchronize(compute.compute_stream());
        z2::AccumulateInto into;
        into.result = results.back().data();
        // All buckets in flight at once, through `slots` slots.
        exchange.start_reduce_scatter(exchange.acquire(b), buckets.back().data(), padded, into);
      }
      exchange.finish_all();
      compute.synchronize_all();
      bool equal = true, same_as_reference = true;
      for (int b = 0; b < count; ++b) {
        const size_t padded = padded_for(lengths[b], N), shard = padded / N;
        std::vector<float> got(shard), expected(shard), leaves(N);
        compute.copy(got.data(), results[b].data(), shard * sizeof(float), compute.compute_stream());
        compute.synchronize(compute.compute_stream());
        for (size_t i = 0; i < shard; ++i) {
          for (int j = 0; j < N; ++j) leaves[j] = bucket_value(j, b, me * shard + i, lengths[b]);
          expected[i] = recursive_tree_sum(leaves.data(), N);
        }
        equal &= same_bits(got, expected);
        same_as_reference &= same_bits(got, references[b]);
      }
      CHECK_MESSAGE(agree(equal, backend.name + ": reduce-scatter differs"), backend.name, " slots ", slots);
      // The non-blocking exchange computes what the plain blocking version does.
      CHECK_MESSAGE(
          agree(same_as_reference, backend.name + ": the bucket exchange differs from reduce_scatter_blocking"),
          backend.name, " slots ", slots);
    }
  }
}

TEST_CASE("all-gather puts every rank's shard everywhere, and all-reduce = reduce-scatter + all-gather") {
  for (const auto& backend : harness::backends()) {
    for (z2::Communicator* comm : {backend.deterministic, backend.native}) {
      z2::Compute& compute = *backend.compute;
      const int N = comm->world_size(), me = comm->rank();
      const size_t length = 4099, padded = padded_for(length, N), shard = padded / N;
      z2::BucketExchange exchange(compute, *comm, padded, 2, false);

      // All-gather: own shard filled, the rest garbage that must be overwritten.
      std::vector<float> host(padded, -7.0f), expected(padded);
      for (size_t i = 0; i < padded; ++i) expected[i] = bucket_value((int)(i / shard), 9, i, length);
      for (size_t i = me * shard; i < (me + 1) * shard; ++i) host[i] = expected[i];
      z2::DeviceArray<float> gathered(compute, padded, z2::MemoryKind::activations);
      compute.copy(gathered.data(), host.data(), padded * sizeof(float), compute.compute_stream());
      const size_t before = comm->counters().all_gather;
      exchange.start_all_gather(exchange.acquire(0), gathered.data(), padded);
      exchange.finish_all();
      compute.synchronize_all();
      compute.copy(host.data(), gathered.data(), padded * sizeof(float), compute.compute_stream());
      compute.synchronize(compute.compute_stream());
      CHECK_MESSAGE(agree(same_bits(host, expected), backend.name + ": all-gather differs"), backend.name);
      CHECK(agree(comm->counters().all_gather - before == (size_t)(N - 1) * shard * sizeof(float)));

      if (comm->collectives() == z2::Collectives::native) continue;  // tolerance test below
      // All-reduce: every rank ends with the whole reduced bucket.
      std::vector<float> mine(padded), reduced(padded), leaves(N);
      for (size_t i = 0; i < padded; ++i) {
        mine[i] = bucket_value(me, 11, i, length);
        for (int j = 0; j < N; ++j) leaves[j] = bucket_value(j, 11, i, length);
        expected[i] = recursive_tree_sum(leaves.data(), N);
      }
      z2::DeviceArray<float> bucket(compute, padded, z2::MemoryKind::activations);
      compute.copy(bucket.data(), mine.data(), padded * sizeof(float), compute.compute_stream());
      exchange.start_all_reduce(exchange.acquire(1), bucket.data(), padded, z2::AccumulateInto{});
      exchange.finish_all();
      compute.synchronize_all();
      compute.copy(reduced.data(), bucket.data(), padded * sizeof(float), compute.compute_stream());
      compute.synchronize(compute.compute_stream());
      CHECK_MESSAGE(agree(same_bits(reduced, expected), backend.name + ": all-reduce differs"), backend.name);
    }
  }
}

TEST_CASE("many all-reduces in flight: MPI collectives start in the same order on every rank") {
  // Each deterministic all-reduce is point-to-point slices, then an
  // MPI_Iallgather. With large buckets (beyond MPI's eager limit) the slices of
  // an older bucket can arrive after a younger one's, and the all-gathers must
  // still be started in bucket order on every rank, or ranks mismatch them.
  // Native collectives are all ordered collectives: the same hazard.
  const size_t sizes[] = {70001, 150011, 33, 90007, 120001, 5};
  for (const auto& backend : harness::backends())
    for (z2::Communicator* comm : {backend.deterministic, backend.native}) {
      z2::Compute& compute = *backend.compute;
      const int N = comm->world_size(), me = comm->rank(), count = (int)(sizeof sizes / sizeof sizes[0]);
      size_t max_padded = 0;
      for (size_t length : sizes) max_padded = std::max(max_padded, padded_for(length, N));
      z2::BucketExchange exchange(compute, *comm, max_padded, 3, false);
      std::vector<z2::DeviceArray<float>> buckets;
      for (int b = 0; b < count; ++b) {
        const size_t padded = padded_for(sizes[b], N);
        std::vector<float> mine(padded);
        // Small integers: every summation order gives the same exact result,
        // so native and deterministic can be compared exactly here.
        for (size_t i = 0; i < padded; ++i) mine[i] = i < sizes[b] ? (float)((me + 1) * (b + 1) + i % 7) : 0.0f;
        buckets.emplace_back(compute, padded, z2::MemoryKind::activations);
        compute.copy(buckets.back().data(), mine.data(), padded * sizeof(float), compute.compute_stream());
        compute.synchronize(compute.compute_stream());
        exchange.start_all_reduce(exchange.acquire(b), buckets.back().data(), padded, z2::AccumulateInto{});
      }
      exchange.finish_all();
      compute.synchronize_all();
      bool equal = true;
      for (int b = 0; b < count; ++b) {
        const size_t padded = padded_for(sizes[b], N);
        std::vector<float> got(padded);
        compute.copy(got.data(), buckets[b].data(), padded * sizeof(float), compute.compute_stream());
        compute.synchronize(compute.compute_stream());
        for (size_t i = 0; i < padded; ++i) {
          float expected = 0.0f;
          for (int r = 0; r < N; ++r) expected += i < sizes[b] ? (float)((r + 1) * (b + 1) + i % 7) : 0.0f;
          equal &= got[i] == expected;
        }
      }
      CHECK_MESSAGE(agree(equal, backend.name + ": in-flight all-reduces mixed up"), backend.name, " ",
                    z2::to_string(comm->collectives()));
    }
}

TEST_CASE("accumulating A reduce-scatters equals the canonical tree over the N*A micro-batches") {
  // Micro-step a on rank r is global micro-batch m = a N + r (interleaved).
  // For N a power of two this is exactly the tree over m = 0 .. NA-1.
  for (const auto& backend : harness::backends()) {
    z2::Communicator& comm = *backend.deterministic;
    z2::Compute& compute = *backend.compute;
    const int N = comm.world_size(), me = comm.rank();
    const size_t length = 1000, padded = padded_for(length, N), shard = padded / N;
    for (int A : {2, 3, 4, 7}) {
      z2::BucketExchange exchange(compute, comm, padded, 2, false);
      z2::DeviceArray<float> bucket(compute, padded, z2::MemoryKind::activations);
      z2::DeviceArray<float> result(compute, shard, z2::MemoryKind::activations);
      std::vector<z2::DeviceArray<float>> blocks;
      z2::AccumulateInto into;
      into.result = result.data();
      into.micro_steps = A;
      for (int d = 0; (2 << d) <= A; ++d) {
        blocks.emplace_back(compute, shard, z2::MemoryKind::activations);
        into.stack.entries[d] = blocks.back().data();
      }
      std::vector<float> mine(padded);
      for (int a = 0; a < A; ++a) {
        for (size_t i = 0; i < padded; ++i) mine[i] = bucket_value(a * N + me, 5, i, length);
        compute.copy(bucket.data(), mine.data(), padded * sizeof(float), compute.compute_stream());
        into.micro_step = a;
        exchange.start_reduce_scatter(exchange.acquire(0), bucket.data(), padded, into);
        exchange.finish_all();
        compute.synchronize_all();
      }
      std::vector<float> got(shard), expected(shard), leaves((size_t)N * A);
      compute.copy(got.data(), result.data(), shard * sizeof(float), compute.compute_stream());
      compute.synchronize(compute.compute_stream());
      for (size_t i = 0; i < shard; ++i) {
        for (int m = 0; m < N * A; ++m) leaves[m] = bucket_value(m, 5, me * shard + i, length);
        expected[i] = recursive_tree_sum(leaves.data(), (long)N * A);
      }
      CHECK_MESSAGE(agree(same_bits(got, expected), backend.name + ": accumulated reduce-scatter differs"),
                    backend.name, " A=", A);
    }
  }
}

TEST_CASE("native collectives agree with the deterministic ones within rounding") {
  // The library sums the N contributions in its own order. Each order's error
  // is at most (N-1) u sum_j |x_j| (u = 2^-24, standard recursive-summation
  // bound), so two orders differ by at most 2 (N-1) u sum_j |x_j|.
  for (const auto& backend : harness::backends()) {
    z2::Compute& compute = *backend.compute;
    const int N = backend.native->world_size(), me = backend.native->rank();
    const size_t length = 70001, padded = padded_for(length, N), shard = padded / N;
    std::vector<float> mine(padded);
    for (size_t i = 0; i < padded; ++i) mine[i] = bucket_value(me, 3, i, length);
    std::vector<std::vector<float>> outputs;
    for (z2::Communicator* comm : {backend.deterministic, backend.native}) {
      z2::BucketExchange exchange(compute, *comm, padded, 1, false);
      z2::DeviceArray<float> bucket(compute, padded, z2::MemoryKind::activations);
      z2::DeviceArray<float> result(compute, shard, z2::MemoryKind::activations);
      compute.copy(bucket.data(), mine.data(), padded * sizeof(float), compute.compute_stream());
      z2::AccumulateInto into;
      into.result = result.data();
      exchange.start_reduce_scatter(exchange.acquire(0), bucket.data(), padded, into);
      exchange.finish_all();
      compute.synchronize_all();
      outputs.emplace_back(shard);
      compute.copy(outputs.back().data(), result.data(), shard * sizeof(float), compute.compute_stream());
      compute.synchronize(compute.compute_stream());
      // And the native all-reduce, against the same bound.
      compute.copy(bucket.data(), mine.data(), padded * sizeof(float), compute.compute_stream());
      exchange.start_all_reduce(exchange.acquire(1), bucket.data(), padded, z2::AccumulateInto{});
      exchange.finish_all();
      compute.synchronize_all();
      outputs.emplace_back(padded);
      compute.copy(outputs.back().data(), bucket.data(), padded * sizeof(float), compute.compute_stream());
      compute.synchronize(compute.compute_stream());
    }
    bool within = true;
    const double u = std::ldexp(1.0, -24);
    for (size_t i = 0; i < padded; ++i) {
      double absolute_sum = 0;
      for (int j = 0; j < N; ++j) absolute_sum += std::fabs(bucket_value(j, 3, i, length));
      const double bound = 2.0 * (N - 1) * u * absolute_sum;
      if (i >= me * shard && i < (me + 1) * shard)
        within &= std::fabs((double)outputs[0][i - me * shard] - outputs[2][i - me * shard]) <= bound;
      within &= std::fabs((double)outputs[1][i] - outputs[3][i]) <= bound;
    }
    CHECK_MESSAGE(agree(within, backend.name + ": native differs beyond the rounding bound"), backend.name);
  }
}
