// tests/test_labs.cpp — the graders of the course labs (notes/labs): one test
// case or more per seam declared in zero2.h ("the lab seams"), each with
// expected values worked out independently of the engine (by hand, or from
// the definition written another way), and on failure one line that says what
// differs and what the usual mistake behind it is.
//
// They run in every suite against the engine's own code (which must pass),
// and in `make lab LAB=<name>` against a student's file. A line starting with
// "[lab]" is what tests/lab.sh shows as the first failure.
//
// The reduce-scatter grader watches MPI's reductions through the profiling
// interface: MPI_Allreduce and friends are defined here, count their calls
// while a grader is watching, and call PMPI_*. A deterministic reduce-scatter
// does its own arithmetic, so any call is the mistake "all-reduce, then slice"
// (or "reduce-scatter with MPI_SUM"): twice the bytes, MPI's summation order.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>

#include "harness.h"

using harness::lab_verdict;

using harness::agree;
using harness::recursive_tree_sum;
using harness::same_float_bits;
using harness::wide_value;

// --- watching MPI's reductions (PMPI) --------------------------------------------

namespace {
bool watching_reductions = false;
int reductions_called = 0;
const char* reduction_name = "";
int watched(const char* name) {
  if (watching_reductions && reductions_called++ == 0) reduction_name = name;
  return 0;
}
}  // namespace

extern "C" {
int MPI_Allreduce(const void* send, void* receive, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm) {
  watched("MPI_Allreduce");
  return PMPI_Allreduce(send, receive, count, type, op, comm);
}
int MPI_Reduce(const void* send, void* receive, int count, MPI_Datatype type, MPI_Op op, int root, MPI_Comm comm) {
  watched("MPI_Reduce");
  return PMPI_Reduce(send, receive, count, type, op, root, comm);
}
int MPI_Reduce_scatter_block(const void* send, void* receive, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm) {
  watched("MPI_Reduce_scatter_block");
  return PMPI_Reduce_scatter_block(send, receive, count, type, op, comm);
}
int MPI_Reduce_scatter(const void* send, void* receive, const int counts[], MPI_Datatype type, MPI_Op op,
                       MPI_Comm comm) {
  watched("MPI_Reduce_scatter");
  return PMPI_Reduce_scatter(send, receive, counts, type, op, comm);
}
int MPI_Iallreduce(const void* send, void* receive, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm,
                   MPI_Request* request) {
  watched("MPI_Iallreduce");
  return PMPI_Iallreduce(send, receive, count, type, op, comm, request);
}
int MPI_Ireduce_scatter_block(const void* send, void* receive, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm,
                              MPI_Request* request) {
  watched("MPI_Ireduce_scatter_block");
  return PMPI_Ireduce_scatter_block(send, receive, count, type, op, comm, request);
}
int MPI_Reduce_local(const void* in, void* inout, int count, MPI_Datatype type, MPI_Op op) {
  watched("MPI_Reduce_local");
  return PMPI_Reduce_local(in, inout, count, type, op);
}
}

namespace {

std::string hex_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  char text[16];
  snprintf(text, sizeof text, "%08x", bits);
  return text;
}

// --- tree-sum ------------------------------------------------------------------------

// The canonical tree of leaves [first, first + n) as a formula: "((0+1)+(2+3))+4".
std::string tree_formula(long first, long n) {
  if (n == 1) return std::to_string(first);
  long p = 1;
  while (p * 2 < n) p *= 2;
  const std::string left = tree_formula(first, p), right = tree_formula(first + p, n - p);
  return "(" + left + "+" + right + ")";
}

// The sums students write instead, each named, to say which one was written.
float left_to_right(const float* leaves, long n) {
  float sum = 0;
  for (long k = 0; k < n; ++k) sum += leaves[k];
  return sum;
}
float first_leaf_then_left_to_right(const float* leaves, long n) {
  float sum = leaves[0];
  for (long k = 1; k < n; ++k) sum += leaves[k];
  return sum;
}
float halves(const float* leaves, long n) {  // split at n / 2, not at the power of two below n
  if (n == 1) return leaves[0];
  return halves(leaves, n / 2) + halves(leaves + n / 2, n - n / 2);
}

std::string which_wrong_sum(const float* leaves, long n, float got) {
  if (same_float_bits(got, left_to_right(leaves, n)) || same_float_bits(got, first_leaf_then_left_to_right(leaves, n)))
    return "you added left to right: a sequential sum depends on how the leaves are split across ranks and "
           "micro-steps, the tree does not";
  if (same_float_bits(got, halves(leaves, n)))
    return "you split at n / 2: the canonical tree splits after the largest power of two below n, so that "
           "every left subtree is perfect (and N = 3, A = 2 equals N = 6, A = 1)";
  if (got == 0.0f) return "the sum is 0: is tree_sum written yet?";
  return "the order of the additions differs from the canonical tree";
}

}  // namespace

TEST_CASE("lab tree-sum: tree_sum is the canonical left-complete tree for n = 0 .. 130") {
  bool ok = true;
  std::string message;
  std::vector<float> leaves(130);
  float empty = z2::tree_sum(0, leaves.data());
  if (!same_float_bits(empty, 0.0f)) ok = false, message = "tree_sum of no leaves is +0 (gave " + hex_bits(empty) + ")";
  for (long n = 1; n <= 130 && ok; ++n) {
    // Leaves over 9 binades and both signs: almost every other order rounds differently.
    for (long k = 0; k < n; ++k) leaves[k] = wide_value((uint64_t)(n * 1000 + k), 4);
    const float got = z2::tree_sum(n, leaves.data()), expected = recursive_tree_sum(leaves.data(), n);
    if (same_float_bits(got, expected)) continue;
    ok = false;
    std::ostringstream out;
    out << "tree-sum: n = " << n << ": tree_sum gave " << hex_bits(got) << ", the canonical tree";
    if (n <= 16) out << " " << tree_formula(0, n);
    out << " gives " << hex_bits(expected) << " — " << which_wrong_sum(leaves.data(), n, got);
    message = out.str();
  }
  CHECK_MESSAGE(lab_verdict(ok, message), message);
}

TEST_CASE("lab tree-sum: the engine's global loss is the tree over the N x A micro-batch losses") {
  // Engine::step's loss goes through tree_sum over the micro-batches in
  // global order (m = a N + r). With losses whose order matters, the report
  // must equal the definition's sum on every rank.
  const auto& backend = harness::backends()[0];
  const int N = backend.deterministic->world_size(), A = 3;
  z2::EngineOptions options;
  options.stage = 2, options.accumulation_steps = A, options.bucket_elements = 64;
  z2::Engine engine(*backend.compute, *backend.deterministic, options);
  const z2::ParameterId id = engine.add_parameter("w", 96, true);
  engine.build();
  std::vector<float> losses((size_t)N * A);
  for (size_t m = 0; m < losses.size(); ++m) losses[m] = wide_value(m + 77, 6);
  std::vector<float> zeros(96, 0.0f);
  for (int a = 0; a < A; ++a) {
    backend.compute->copy(engine.gradient_output(id), zeros.data(), zeros.size() * sizeof(float),
                          backend.compute->compute_stream());
    engine.gradient_ready(id);
    engine.end_micro_step(losses[(size_t)engine.micro_batch_index(a)]);
  }
  const float got = engine.step().loss, expected = recursive_tree_sum(losses.data(), (long)losses.size());
  const std::string message = "tree-sum: the engine's loss over " + std::to_string(N * A) + " micro-batches is " +
                              hex_bits(got) + ", the canonical tree gives " + hex_bits(expected) + " — " +
                              which_wrong_sum(losses.data(), (long)losses.size(), got);
  CHECK_MESSAGE(lab_verdict(same_float_bits(got, expected), message), message);
}

// --- reduce-scatter --------------------------------------------------------------------

TEST_CASE("lab reduce-scatter: reduce_scatter_blocking leaves rank r the tree over ranks of slice r") {
  const int N = harness::world_size(), me = harness::rank();
  bool ok = true;
  std::string message;
  for (size_t shard : {1, 7, 64, 1000}) {
    // Rank j's bucket element k, known to every rank: each can work out the sum.
    auto value = [&](int j, size_t k) { return wide_value((uint64_t)j * 1000003 + k + shard * 17, 4); };
    std::vector<float> bucket(N * shard), got(shard, -7.0f), leaves(N);
    for (size_t k = 0; k < bucket.size(); ++k) bucket[k] = value(me, k);
    watching_reductions = true, reductions_called = 0;
    z2::reduce_scatter_blocking(bucket.data(), got.data(), shard, MPI_COMM_WORLD);
    watching_reductions = false;
    if (reductions_called > 0) {
      ok = false;
      message = std::string("reduce-scatter: reduce_scatter_blocking called ") + reduction_name +
                ": all-reduce-then-slice sends 2 (N-1)/N of the bucket where a reduce-scatter sends (N-1)/N, "
                "holds the whole sum on every rank, and sums in MPI's order, not the canonical tree. Send slice j "
                "to rank j and add the N slices yourself";
      break;
    }
    for (size_t i = 0; i < shard && ok; ++i) {
      for (int j = 0; j < N; ++j) leaves[j] = value(j, me * shard + i);
      const float expected = recursive_tree_sum(leaves.data(), N);
      if (same_float_bits(got[i], expected)) continue;
      ok = false;
      std::ostringstream out;
      out << "reduce-scatter: N = " << N << ", shard " << shard << ", rank " << me << ", element " << i << ": bits "
          << hex_bits(got[i]) << ", the tree " << tree_formula(0, N) << " over the ranks' slices gives "
          << hex_bits(expected) << " — ";
      std::vector<float> slice0(N);
      for (int j = 0; j < N; ++j) slice0[j] = value(j, i);
      if (me > 0 && same_float_bits(got[i], recursive_tree_sum(slice0.data(), N)))
        out << "you kept slice 0 of the sum: rank r keeps slice r, at r x shard_elements (the shard offset)";
      else if (same_float_bits(got[i], value(me, me * shard + i)))
        out << "you kept your own slice, unsummed: the other ranks' slices never arrived or were not added";
      else if (same_float_bits(got[i], -7.0f)) out << "the shard was never written";
      else out << which_wrong_sum(leaves.data(), N, got[i]) << " (the ranks' slices in rank order, j = 0 .. N-1)";
      message = out.str();
    }
  }
  CHECK_MESSAGE(lab_verdict(ok, message), message);
}

TEST_CASE("lab reduce-scatter: all_gather_blocking puts rank r's shard at r x shard_elements on every rank") {
  const int N = harness::world_size(), me = harness::rank();
  const size_t shard = 33;
  std::vector<float> mine(shard), got(N * shard, -7.0f);
  for (size_t i = 0; i < shard; ++i) mine[i] = (float)(me * 1000 + (int)i);  // rank and element, exactly
  z2::all_gather_blocking(mine.data(), got.data(), shard, MPI_COMM_WORLD);
  bool ok = true;
  std::string message;
  for (size_t k = 0; k < got.size() && ok; ++k) {
    const float expected = (float)((int)(k / shard) * 1000 + (int)(k % shard));
    if (got[k] == expected) continue;
    ok = false;
    std::ostringstream out;
    out << "reduce-scatter: all_gather_blocking, rank " << me << ", element " << k << " (rank " << k / shard
        << "'s shard, element " << k % shard << ") is " << got[k] << ", expected " << expected;
    if (got[k] == -7.0f) out << " — never written";
    message = out.str();
  }
  CHECK_MESSAGE(lab_verdict(ok, message), message);
}

// --- shards --------------------------------------------------------------------------------

TEST_CASE("lab shards: shard_begin tiles each bucket with N shards in rank order") {
  // Buckets as Engine::build lays them out: padded to N x norm_chunk, one
  // after another. The shards must start at the bucket's offset, follow each
  // other, and end where the bucket ends, for any N.
  bool ok = true;
  std::string message;
  for (int N : {1, 2, 3, 4, 8}) {
    size_t offset = 0;
    for (size_t length : {32ul, 96ul, 4096ul}) {
      z2::BucketInfo bucket;
      bucket.offset = offset;
      bucket.length = length;
      bucket.padded_length = (length + N * z2::norm_chunk - 1) / (N * z2::norm_chunk) * (N * z2::norm_chunk);
      bucket.shard_length = bucket.padded_length / N;
      bucket.shard_offset = offset / N;  // (a plausible shard-space start; not what shard_begin returns)
      offset += bucket.padded_length;
      std::ostringstream out;
      out << "shards: N = " << N << ", a bucket at offset " << bucket.offset << " of " << bucket.padded_length
          << " elements (shards of " << bucket.shard_length << "): ";
      const size_t first = z2::shard_begin(bucket, 0);
      if (first != bucket.offset) {
        out << "rank 0's shard begins at " << first << ", not at the bucket's offset " << bucket.offset;
        if (first == 0) out << " — the bucket's offset is missing";
        if (first == bucket.shard_offset)
          out << " — shard_offset is where the shard is stored in shard space, not "
                 "where it lies in the flat buffer";
        ok = false, message = out.str();
        break;
      }
      for (int r = 1; r < N && ok; ++r) {
        const size_t begin = z2::shard_begin(bucket, r), previous = z2::shard_begin(bucket, r - 1);
        if (begin == previous + bucket.shard_length) continue;
        out << "rank " << r << "'s shard begins at " << begin << ", rank " << r - 1 << "'s at " << previous
            << ": consecutive shards are shard_length = " << bucket.shard_length << " apart";
        if (begin == previous) out << " — every rank got the same shard: the rank's offset r x shard_length is missing";
        ok = false, message = out.str();
      }
      if (ok && z2::shard_begin(bucket, N - 1) + bucket.shard_length != bucket.offset + bucket.padded_length) {
        out << "the last shard does not end where the bucket ends";
        ok = false, message = out.str();
      }
      if (!ok) break;
    }
    if (!ok) break;
  }
  CHECK_MESSAGE(lab_verdict(ok, message), message);
}

// --- loss-scale ------------------------------------------------------------------------

namespace {
// One hand-worked sequence: the updates ('O' overflow, 'c' clean) and the
// scale after each, from DeepSpeed's update_scale worked through by hand.
struct ScalerCase {
  const char* what;
  int initial_power;
  long window;
  int hysteresis;
  bool consecutive;
  const char* updates;
  std::vector<double> scales;
  const char* mistake;  // what a student who fails it most likely wrote
};
}  // namespace

TEST_CASE("lab loss-scale: LossScaler::update follows DeepSpeed's DynamicLossScaler step by step") {
  const std::vector<ScalerCase> cases = {
      {"window 4, four clean steps",
       8,
       4,
       1,
       false,
       "cccccccc",
       {256, 256, 256, 512, 512, 512, 512, 1024},
       "a scale that never grows (or grows at the wrong step): after every `window` clean steps since the last "
       "overflow (counting from iteration 0 when there was none) the scale doubles"},
      {"hysteresis 1: an overflow halves at once",
       8,
       100,
       1,
       false,
       "OOc",
       {128, 64, 64},
       "an overflow with no hysteresis left halves the scale"},
      {"hysteresis 2: the first overflow only spends hysteresis",
       8,
       100,
       2,
       false,
       "OO",
       {256, 128},
       "with hysteresis h the scale halves at the h-th overflow; the ones before only count down"},
      {"the window restarts at an overflow",
       4,
       3,
       1,
       false,
       "ccOccc",
       {16, 16, 8, 8, 8, 16},
       "the clean steps are counted from the last overflow ((iteration - last_overflow) % window == 0), not "
       "from the start"},
      {"without consecutive_hysteresis a clean step does not restore it",
       4,
       100,
       2,
       false,
       "OcOcO",
       {16, 16, 8, 8, 4},
       "hysteresis comes back only when the scale doubles (unless consecutive_hysteresis)"},
      {"consecutive_hysteresis restores it on every clean step",
       4,
       100,
       2,
       true,
       "OcOcO",
       {16, 16, 16, 16, 16},
       "with consecutive_hysteresis every clean step resets the hysteresis"},
  };
  bool ok = true;
  std::string message;
  for (const ScalerCase& c : cases) {
    z2::LossScaling settings;
    settings.initial_scale_power = c.initial_power, settings.window = c.window, settings.hysteresis = c.hysteresis;
    settings.consecutive_hysteresis = c.consecutive, settings.min_scale = 1;
    z2::LossScaler scaler(settings, true);
    for (size_t k = 0; c.updates[k] && ok; ++k) {
      scaler.update(c.updates[k] == 'O');
      if (scaler.scale() == c.scales[k]) continue;
      std::ostringstream out;
      out << "loss-scale: " << c.what << " (initial 2^" << c.initial_power << ", window " << c.window << ", hysteresis "
          << c.hysteresis << "), updates \"" << std::string(c.updates, k + 1) << "\": scale " << scaler.scale()
          << ", expected " << c.scales[k] << " — " << c.mistake;
      ok = false, message = out.str();
    }
    if (!ok) break;
  }
  // An overflow at the minimum with no hysteresis left ends the run (DeepSpeed raises).
  if (ok) {
    z2::LossScaling settings;
    settings.initial_scale_power = 1, settings.hysteresis = 1, settings.min_scale = 1;
    z2::LossScaler scaler(settings, true);
    bool threw = false;
    try {
      scaler.update(true);  // 2 -> 1
      scaler.update(true);  // at the minimum: an error
    } catch (const z2::Error&) { threw = true; }
    if (!threw || scaler.scale() != 1) {
      ok = false;
      message =
          "loss-scale: an overflow at min_loss_scale with no hysteresis left must throw z2::Error (the run "
          "cannot go on: DeepSpeed raises \"Current loss scale already at minimum\"); the scale never goes "
          "below the minimum";
    }
  }
  CHECK_MESSAGE(lab_verdict(ok, message), message);
}

// --- arena ---------------------------------------------------------------------------------

TEST_CASE("lab arena: the bump region and the LIFO stack on a hand-worked sequence") {
  // A block of 1,000 bytes (sizes come rounded; here any size is a size).
  // Worked by hand: long-lived 100 and 200 at 0 and 100; pushes of 300 and
  // 100 at 700 and 600; the middle [300, 600) is the free memory.
  z2::ArenaBooks books{1000, 0, 1000, {}};
  std::string message;
  auto expect = [&](bool holds, const std::string& what) {
    if (!holds && message.empty()) message = "arena: " + what;
  };
  auto text = [](size_t offset) {
    return offset == z2::arena_full ? std::string("arena_full") : std::to_string(offset);
  };
  auto books_are = [&](size_t bottom, size_t top, size_t depth) {
    return books.bottom == bottom && books.top == top && books.stack.size() == depth;
  };
  const size_t first = z2::arena_allocate(books, 100), second = z2::arena_allocate(books, 200);
  expect(first == 0 && second == 100, "long-lived buffers of 100 and 200 bytes begin at " + text(first) + " and " +
                                          text(second) +
                                          "; the bump pointer gives 0 and 100 (from the bottom, one after another)");
  const size_t pushed = z2::arena_push(books, 300), pushed_again = z2::arena_push(books, 100);
  expect(pushed == 700 && pushed_again == 600, "pushes of 300 and 100 bytes begin at " + text(pushed) + " and " +
                                                   text(pushed_again) +
                                                   "; the stack grows down from the top: 700 and 600");
  expect(books_are(300, 600, 2),
         "after two allocations and two pushes the books should read bottom 300, top 600, "
         "2 on the stack; they read bottom " +
             std::to_string(books.bottom) + ", top " + std::to_string(books.top) + ", " +
             std::to_string(books.stack.size()));
  // 300 bytes are free: 301 does not fit either way, 300 does, and nothing moves when it does not.
  expect(z2::arena_allocate(books, 301) == z2::arena_full && z2::arena_push(books, 301) == z2::arena_full &&
             books_are(300, 600, 2),
         "a request of 301 bytes with 300 free must return arena_full and change nothing (Compute then reports "
         "out of memory with the free bytes)");
  const size_t exact = z2::arena_push(books, 300);
  expect(exact == 300, "a push of exactly the 300 free bytes fits, at 300; it gave " + text(exact));
  if (exact == 300) z2::arena_pop(books, 300, 300);
  // A pop out of order must be refused: the buffer at 700 is not the last pushed (600 is).
  bool refused = false;
  try {
    z2::arena_pop(books, 700, 300);
  } catch (const z2::Error&) { refused = true; }
  expect(refused,
         "a pop out of order was accepted: the buffer at 700 is not the last one pushed (the one at 600 "
         "is); the top would step over a live buffer and the next push would overwrite it. Refuse it "
         "with usage_error");
  if (!refused) books = z2::ArenaBooks{1000, 300, 600, {700, 600}};  // go on from where the books should be
  expect(books_are(300, 600, 2), "a refused pop must leave the books as they were");
  z2::arena_pop(books, 600, 100);
  z2::arena_pop(books, 700, 300);
  expect(books_are(300, 1000, 0),
         "after popping both pushes the top is back at 1000 and the stack is empty; "
         "the books read top " +
             std::to_string(books.top) + ", " + std::to_string(books.stack.size()) + " on the stack");
  // Releasing the first long-lived buffer leaves a hole the arena never fills; the last one steps back.
  z2::arena_release(books, 0, 100);
  expect(books.bottom == 300,
         "releasing the long-lived buffer at 0 (not the last one) must leave the bump pointer "
         "at 300: the arena never searches for holes; it moved to " +
             std::to_string(books.bottom));
  z2::arena_release(books, 100, 200);
  expect(books.bottom == 100,
         "releasing the last long-lived buffer (200 bytes at 100) steps the bump pointer back "
         "to 100; it is at " +
             std::to_string(books.bottom));
  CHECK_MESSAGE(lab_verdict(message.empty(), message), message);
}

// --- offload -----------------------------------------------------------------------------

TEST_CASE("lab offload: checkpoint_to_prefetch brings every checkpoint back one block ahead of its use") {
  // Backward runs block L-1 .. 0; block l needs checkpoint l (l <= L-2 live
  // on the host). Walk the schedule as the model does and name the first
  // block where it goes wrong.
  std::string message;
  for (int layers = 8; layers >= 1 && message.empty(); --layers) {
    std::vector<int> fetched_at(layers, -1);  // the block before whose backward checkpoint c was fetched
    const std::string where = "offload: " + std::to_string(layers) + " layers (checkpoints 0 .. " +
                              std::to_string(layers - 2) + " on the host): ";
    for (int block = layers - 1; block >= 0 && message.empty(); --block) {
      const int c = z2::checkpoint_to_prefetch(block, layers);
      const std::string at = "before block " + std::to_string(block) + "'s backward ";
      if (c < -1 || c > layers - 2) {
        message = where + at + "it fetches checkpoint " + std::to_string(c) + ", which never went to the host";
      } else if (c >= 0 && fetched_at[c] >= 0) {
        message = where + at + "it fetches checkpoint " + std::to_string(c) + " again (first before block " +
                  std::to_string(fetched_at[c]) + ")";
      } else if (c > block) {
        message = where + at + "it fetches checkpoint " + std::to_string(c) +
                  ", whose block already ran: a prefetch "
                  "after use (the block it feeds has already read its slot)";
      } else if (c == block) {
        message = where + at + "it fetches checkpoint " + std::to_string(c) +
                  ", the one this block reads now: the "
                  "copy waits in front of the compute instead of overlapping the block before it; fetch one block "
                  "ahead";
      } else if (c >= 0 && c < block - 1) {
        message = where + at + "it fetches checkpoint " + std::to_string(c) + ", " + std::to_string(block - c) +
                  " blocks ahead: more checkpoints are on the device at once than the bound (one block plus two "
                  "checkpoints) allows";
      } else {
        if (c >= 0) fetched_at[c] = block;
        if (block <= layers - 2 && fetched_at[block] < 0) {
          message = where + "block " + std::to_string(block) + "'s backward needs checkpoint " + std::to_string(block) +
                    ", which nothing fetched before it: it is still on the host";
          for (int later = block - 1; later >= 0; --later)
            if (z2::checkpoint_to_prefetch(later, layers) == block)
              message += "; it is fetched before block " + std::to_string(later) + "'s backward, after block " +
                         std::to_string(block) + " read it: a prefetch after use";
        }
      }
    }
  }
  CHECK_MESSAGE(lab_verdict(message.empty(), message), message);
}

// --- reshard -----------------------------------------------------------------------------

namespace {
// Apply `reads` to an owned state that records, at each position, the
// canonical index it was filled from; compare with what the owned runs ask
// for. "" when right, else what is wrong first.
std::string check_reads(const std::vector<z2::StateRun>& owned, const std::vector<z2::StateRun>& files,
                        const std::string& where) {
  size_t total = 0;
  for (const z2::StateRun& run : owned) total += run.length;
  const size_t unfilled = SIZE_MAX;
  std::vector<size_t> filled_from(total, unfilled);
  const std::vector<z2::ReshardRead> reads = z2::reshard_reads(owned, files);
  if (reads.empty() && total > 0)
    return where + "reshard_reads returned no reads for " + std::to_string(total) +
           " owned elements: is it written yet?";
  for (const z2::ReshardRead& read : reads) {
    const std::string text = "a read of [" + std::to_string(read.canonical) + ", " +
                             std::to_string(read.canonical + read.length) + ") from file " + std::to_string(read.file);
    if (read.file >= files.size()) return where + text + ": there are only " + std::to_string(files.size()) + " files";
    const z2::StateRun& file = files[read.file];
    if (read.canonical < file.canonical || read.canonical + read.length > file.canonical + file.length)
      return where + text + ", which holds [" + std::to_string(file.canonical) + ", " +
             std::to_string(file.canonical + file.length) + "): a file holds only its own range";
    if (read.into + read.length > total)
      return where + text + " into position " + std::to_string(read.into) + " goes past the " + std::to_string(total) +
             " elements this rank owns";
    for (size_t i = 0; i < read.length; ++i) filled_from[read.into + i] = read.canonical + i;
  }
  size_t position = 0;
  for (const z2::StateRun& run : owned)
    for (size_t i = 0; i < run.length; ++i, ++position) {
      const size_t wanted = run.canonical + i;
      if (filled_from[position] == wanted) continue;
      std::string text = where + "owned position " + std::to_string(position) + " (canonical element " +
                         std::to_string(wanted) + ", in the run [" + std::to_string(run.canonical) + ", " +
                         std::to_string(run.canonical + run.length) + ")) ";
      if (filled_from[position] != unfilled)
        return text + "was filled from canonical element " + std::to_string(filled_from[position]) +
               ": `into` is the run's place in the owned runs laid end to end, plus the read's offset in the run";
      for (size_t q = 0; q + 1 < files.size(); ++q) {
        const size_t boundary = files[q + 1].canonical;
        if (run.canonical < boundary && boundary < run.canonical + run.length)
          return text + "is never read: the run crosses the boundary between files " + std::to_string(q) + " and " +
                 std::to_string(q + 1) + " at " + std::to_string(boundary) + ", so it takes a read from each";
      }
      return text + "is never read";
    }
  return "";
}

// Files as a run of N_saved ranks writes them: rank q the range [q Psi / N, (q + 1) Psi / N).
std::vector<z2::StateRun> saved_files(size_t psi, int saved_world) {
  std::vector<z2::StateRun> files;
  for (int q = 0; q < saved_world; ++q) {
    const size_t begin = psi * q / saved_world, end = psi * (q + 1) / saved_world;
    files.push_back({begin, end - begin});
  }
  return files;
}
}  // namespace

TEST_CASE("lab reshard: reshard_reads fills the owned state from files saved at any world size") {
  // By hand: Psi = 100 saved by 3 ranks ([0, 33), [33, 66), [66, 100)); the
  // owned runs [10, 40), [60, 70), [95, 100) need five reads, two runs
  // crossing a file boundary.
  std::string message = check_reads({{10, 30}, {60, 10}, {95, 5}}, saved_files(100, 3), "reshard: by hand: ");
  // The engine's own runs at this world size, in stages 1 and 2 (every owner
  // has a piece), against checkpoints saved by 1 .. 5 ranks.
  const auto& backend = harness::backends()[0];
  for (int stage : {1, 2}) {
    z2::EngineOptions options;
    options.stage = stage, options.bucket_elements = 200;
    z2::Engine engine(*backend.compute, *backend.deterministic, options);
    for (size_t numel : {70, 33, 300, 5, 128}) engine.add_parameter("p" + std::to_string(numel), numel, true);
    engine.build();
    for (int saved = 1; saved <= 5 && message.empty(); ++saved)
      message =
          check_reads(engine.owned_state_runs(engine.rank()), saved_files(engine.psi(), saved),
                      "reshard: stage " + std::to_string(stage) + ", rank " + std::to_string(engine.rank()) + " of " +
                          std::to_string(engine.world_size()) + ", saved by " + std::to_string(saved) + " rank(s): ");
  }
  CHECK_MESSAGE(lab_verdict(message.empty(), message), message);
}

// --- own-shards -------------------------------------------------------------------------

namespace {
// The update region worked out from the paper's description, field by
// field, for a bucket laid out by hand: DP updates every bucket whole; P_os
// and P_os+g update the own slice, whose state (and, in P_os+g, gradient) is
// stored in shard space, each bucket's shard after the last one's.
z2::UpdateRegion expected_region(const z2::BucketInfo& bucket, int stage, int rank) {
  if (stage == 0) return {bucket.offset, bucket.offset, bucket.offset, bucket.padded_length};
  const size_t slice = bucket.offset + (size_t)rank * bucket.shard_length;
  return {slice, stage == 2 ? bucket.shard_offset : slice, bucket.shard_offset, bucket.shard_length};
}

std::string region_text(const z2::UpdateRegion& region) {
  return "{parameter " + std::to_string(region.parameter) + ", gradient " + std::to_string(region.gradient) +
         ", state " + std::to_string(region.state) + ", length " + std::to_string(region.length) + "}";
}

// What a student who returned `got` most likely wrote.
std::string region_mistake(const z2::BucketInfo& bucket, int stage, int rank, const z2::UpdateRegion& got) {
  const z2::UpdateRegion want = expected_region(bucket, stage, rank);
  const size_t slice = bucket.offset + (size_t)rank * bucket.shard_length;
  if (stage == 0 && got.length != want.length)
    return "stage 0 (DP) keeps every buffer full-size and every rank updates every bucket whole";
  if (stage > 0 && got.length == bucket.padded_length && bucket.padded_length != bucket.shard_length)
    return "in this stage a rank updates its own shard only (shard_length elements), not the whole bucket";
  if (stage > 0 && got.state == slice && got.state != want.state)
    return "the state buffer holds the own shards one after another, each bucket's at its shard_offset; "
           "shard_begin is where a shard lies in the full parameter buffer";
  if (stage == 2 && got.gradient == slice && got.gradient != want.gradient)
    return "stage 2 keeps only the gradient shard [Psi_padded / N] (P_os+g): the reduced gradient is at the "
           "bucket's shard_offset there";
  if (stage == 1 && got.gradient == bucket.shard_offset && got.gradient != want.gradient)
    return "stage 1 still has the full gradient buffer (P_os shards the optimizer state only): the reduced shard "
           "lies where the parameters' shard lies";
  if (got.parameter != want.parameter) return "the parameter run is not this rank's slice of the bucket (lab shards)";
  return "compare each field with the index space of its buffer (zero2.h, UpdateRegion)";
}
}  // namespace

TEST_CASE("lab own-shards: update_region places the own shard in each buffer's index space") {
  bool ok = true;
  std::string message;
  for (int stage : {0, 1, 2})
    for (int N : {1, 2, 3, 4, 8}) {
      size_t offset = 0, shard_offset = 0;
      for (size_t length : {32ul, 96ul, 4096ul}) {
        z2::BucketInfo bucket;
        bucket.offset = offset, bucket.length = length;
        bucket.padded_length = (length + N * z2::norm_chunk - 1) / (N * z2::norm_chunk) * (N * z2::norm_chunk);
        bucket.shard_length = bucket.padded_length / N;
        bucket.shard_offset = shard_offset;
        offset += bucket.padded_length, shard_offset += bucket.shard_length;
        for (int r = 0; r < N && ok; ++r) {
          const z2::UpdateRegion got = z2::update_region(bucket, stage, r), want = expected_region(bucket, stage, r);
          if (std::memcmp(&got, &want, sizeof got) == 0) continue;
          ok = false;
          message = "own-shards: stage " + std::to_string(stage) + ", N = " + std::to_string(N) + ", rank " +
                    std::to_string(r) + ", a bucket at offset " + std::to_string(bucket.offset) + " (shard_offset " +
                    std::to_string(bucket.shard_offset) + ", shards of " + std::to_string(bucket.shard_length) +
                    "): update_region gave " + region_text(got) + ", expected " + region_text(want) + " — " +
                    region_mistake(bucket, stage, r, got);
        }
      }
    }
  CHECK_MESSAGE(lab_verdict(ok, message), message);
}

namespace {
// AdamW's scalars as torch.optim.AdamW defines them, for update t = 1 or 2
// (beta^t by one multiply, correctly rounded like any power for t <= 2).
z2::AdamWConstants torch_adamw(const z2::EngineOptions& o, long t) {
  const double beta1_t = t == 1 ? o.beta1 : o.beta1 * o.beta1, beta2_t = t == 1 ? o.beta2 : o.beta2 * o.beta2;
  z2::AdamWConstants c;
  c.decay_factor = (float)(1.0 - o.lr * o.weight_decay);
  c.one_minus_beta1 = (float)(1.0 - o.beta1);
  c.beta2 = (float)o.beta2;
  c.one_minus_beta2 = (float)(1.0 - o.beta2);
  c.eps = (float)o.eps;
  c.negative_step_size = (float)(-o.lr / (1.0 - beta1_t));
  c.bias_correction2_sqrt = (float)std::sqrt(1.0 - beta2_t);
  c.grad_scale = 1.0f;
  return c;
}

// A small model of five parameters (mixed decay) in buckets of at most 200
// elements, so that shards cut through parameters.
struct SmallModel {
  std::vector<size_t> numels{70, 33, 300, 5, 128};
  std::vector<bool> decays{true, false, true, false, true};
  std::vector<z2::ParameterId> ids;
  size_t psi() const {
    size_t total = 0;
    for (size_t n : numels) total += n;
    return total;
  }
  void add_to(z2::Engine& engine) {
    for (size_t p = 0; p < numels.size(); ++p)
      ids.push_back(engine.add_parameter("p" + std::to_string(p), numels[p], decays[p]));
  }
  // The parameter and its element for canonical element k (real elements only).
  std::pair<size_t, size_t> locate(size_t k) const {
    size_t p = 0;
    while (k >= numels[p]) k -= numels[p++];
    return {p, k};
  }
};
}  // namespace

TEST_CASE("lab own-shards: after each step every rank holds every parameter as AdamW over the summed gradient") {
  // Two steps of each stage with gradients known on every rank; the expected
  // parameters are AdamW (zero2.h's element update, not what this lab
  // grades) over the tree-summed gradient, element by element on the host.
  const auto& backend = harness::backends()[0];
  const int N = harness::world_size(), me = harness::rank();
  bool ok = true;
  std::string message;
  for (int stage : {0, 1, 2}) {
    z2::EngineOptions options;
    options.stage = stage, options.bucket_elements = 200, options.lr = 0.01, options.weight_decay = 0.1;
    SmallModel model;
    z2::Engine engine(*backend.compute, *backend.deterministic, options);
    model.add_to(engine);
    engine.build();
    const size_t psi = model.psi();
    std::vector<float> param(psi), m(psi, 0.0f), v(psi, 0.0f);
    for (size_t k = 0; k < psi; ++k) param[k] = wide_value(k + 5000, 3);
    engine.parameters_from_host(param);
    for (long t = 1; t <= 2; ++t) {
      auto gradient = [&](int rank, size_t k) {
        return wide_value((uint64_t)t * 7919 + (uint64_t)rank * 104729 + k, 3);
      };
      try {
        size_t first = psi;
        for (int p = (int)model.numels.size() - 1; p >= 0; --p) {  // backward's order
          first -= model.numels[p];
          float* out = engine.gradient_output(model.ids[p]);
          std::vector<float> values(model.numels[p]);
          for (size_t i = 0; i < values.size(); ++i) values[i] = gradient(me, first + i);
          backend.compute->copy(out, values.data(), values.size() * sizeof(float), backend.compute->compute_stream());
          engine.gradient_ready(model.ids[p]);
        }
        engine.end_micro_step(0.0f);
        engine.step();
      } catch (const z2::Error& error) {  // the engine refused a call of update_and_gather, on every rank alike
        ok = false,
        message = "own-shards: stage " + std::to_string(stage) + ", step " + std::to_string(t) + ": " + error.what();
        break;
      }
      const std::vector<float> before = param;
      const z2::AdamWConstants constants = torch_adamw(options, t);
      std::vector<float> leaves(N);
      for (size_t k = 0; k < psi; ++k) {
        for (int r = 0; r < N; ++r) leaves[r] = gradient(r, k);
        const float summed = recursive_tree_sum(leaves.data(), N);
        z2::adamw_update(constants, model.decays[model.locate(k).first], &param[k], &summed, &m[k], &v[k], 0);
      }
      const std::vector<float> got = engine.working_parameters_to_host();
      for (size_t k = 0; k < psi && ok; ++k) {
        if (same_float_bits(got[k], param[k])) continue;
        ok = false;
        const auto where = model.locate(k);
        const z2::ParameterInfo& info = engine.parameters()[where.first];
        const size_t padded = info.offset + where.second;
        int owner = 0;
        for (int r = 0; r < N; ++r) {
          const auto range = engine.shard_range(info.bucket, r);
          if (range.first <= padded && padded < range.second) owner = r;
        }
        std::ostringstream out;
        out << "own-shards: stage " << stage << ", N = " << N << ", step " << t << ", rank " << me << ": element "
            << where.second << " of " << info.name << " (in rank " << owner << "'s shard) is " << hex_bits(got[k])
            << ", AdamW over the summed gradient gives " << hex_bits(param[k]) << " — ";
        if (stage > 0 && owner != me && same_float_bits(got[k], before[k]))
          out << "this rank's copy was not updated: the all-gather of the updated shards is missing (P_os: each "
                 "rank updates its own shard, then every bucket is all-gathered)";
        else if (owner == me || stage == 0)
          out << "this rank's own update went wrong: is AdamW applied once to every bucket, and is update_region "
                 "right (the first own-shards test)?";
        else out << "the gathered value is not the owner's update";
        message = out.str();
      }
      // Only P_os and P_os+g gather the parameters; each bucket once.
      const size_t gathered = engine.comm_ledger().per_step.all_gather;
      const size_t expected_gather = stage == 0 ? 0 : (size_t)(N - 1) * (engine.psi_padded() / N) * sizeof(float);
      if (ok && gathered != expected_gather) {
        ok = false;
        message = "own-shards: stage " + std::to_string(stage) + ", N = " + std::to_string(N) + ": the step " +
                  "all-gathered " + std::to_string(gathered) + " bytes, expected " + std::to_string(expected_gather) +
                  (stage == 0 ? " — stage 0 (DP) all-gathered parameters that every rank had already updated: the "
                                "all-gather belongs to P_os and P_os+g only"
                              : " — each bucket is all-gathered once per step: (N-1)/N of Psi_padded elements");
      }
      if (!harness::agree(ok)) break;  // every rank leaves together, before the next collective
    }
    if (!harness::agree(ok)) break;
  }
  CHECK_MESSAGE(lab_verdict(ok, message), message);
}

// --- gradient-shards ---------------------------------------------------------------------

TEST_CASE("lab gradient-shards: stage 2 keeps each bucket's shard of the sum at its shard_offset") {
  // Seven parameters in four buckets (three of them with two parameters),
  // more buckets than the two slots, handed over last first as backward does;
  // A = 1 and A = 2. Rank r's gradient at micro-step a is micro-batch
  // m = a N + r's; the kept shard must be the canonical tree over the N A
  // micro-batches (N a power of two), padding zero.
  const auto& backend = harness::backends()[0];
  const int N = harness::world_size(), me = harness::rank();
  const std::vector<size_t> numels{70, 33, 300, 5, 128, 64, 40};
  size_t psi = 0;
  for (size_t n : numels) psi += n;
  bool ok = true;
  std::string message;
  for (int A : {1, 2}) {
    z2::EngineOptions options;
    options.stage = 2, options.bucket_elements = 200, options.accumulation_steps = A;
    z2::Engine engine(*backend.compute, *backend.deterministic, options);
    for (size_t p = 0; p < numels.size(); ++p) engine.add_parameter("p" + std::to_string(p), numels[p], true);
    engine.build();
    auto gradient = [](long micro_batch, size_t k) { return wide_value((uint64_t)micro_batch * 100003 + k + 11, 4); };
    std::vector<float> shard;
    try {
      for (int a = 0; a < A; ++a) {
        const long micro_batch = engine.micro_batch_index(a);
        size_t first = psi;
        for (int p = (int)numels.size() - 1; p >= 0; --p) {
          first -= numels[p];
          float* out = engine.gradient_output(p);
          std::vector<float> values(numels[p]);
          for (size_t i = 0; i < values.size(); ++i) values[i] = gradient(micro_batch, first + i);
          backend.compute->copy(out, values.data(), values.size() * sizeof(float), backend.compute->compute_stream());
          engine.gradient_ready(p);
        }
        engine.end_micro_step(0.0f);
      }
      shard = engine.gradient_buffer_to_host();
    } catch (const z2::Error& error) {  // the engine refused a call of the hooks, on every rank alike
      ok = false, message = std::string("gradient-shards: A = ") + std::to_string(A) + ": " + error.what();
    }
    // The expected shard, worked out from the layout: padded element -> canonical element -> the tree.
    std::vector<float> expected(engine.psi_padded() / N, 0.0f), leaves((size_t)N * A);
    size_t canonical = 0;
    for (const z2::ParameterInfo& p : engine.parameters()) {
      for (size_t i = 0; i < p.numel; ++i) {
        const z2::BucketInfo& bucket = engine.buckets()[p.bucket];
        const size_t padded = p.offset + i, own_begin = bucket.offset + (size_t)me * bucket.shard_length;
        if (padded >= own_begin && padded < own_begin + bucket.shard_length) {
          for (long m = 0; m < (long)leaves.size(); ++m) leaves[m] = gradient(m, canonical + i);
          expected[bucket.shard_offset + (padded - own_begin)] = recursive_tree_sum(leaves.data(), (long)leaves.size());
        }
      }
      canonical += p.numel;
    }
    for (size_t b = 0; b < engine.buckets().size() && ok; ++b) {
      const z2::BucketInfo& bucket = engine.buckets()[b];
      for (size_t i = 0; i < bucket.shard_length && ok; ++i) {
        const size_t at = bucket.shard_offset + i;
        if (same_float_bits(shard[at], expected[at])) continue;
        ok = false;
        std::ostringstream out;
        out << "gradient-shards: A = " << A << ", N = " << N << ", rank " << me << ": bucket " << b << " (shard_offset "
            << bucket.shard_offset << "), shard element " << i << " is " << hex_bits(shard[at])
            << ", the tree over the " << N * A << " micro-batches gives " << hex_bits(expected[at]) << " — ";
        // Kept at element 0 (and partly overwritten there by the buckets reduced after it)?
        bool at_zero = false;
        for (size_t j = 0; j < bucket.shard_length && bucket.shard_offset > 0 && !at_zero; ++j)
          at_zero =
              expected[bucket.shard_offset + j] != 0.0f && same_float_bits(shard[j], expected[bucket.shard_offset + j]);
        bool empty = true;
        for (size_t j = 0; j < bucket.shard_length && empty; ++j) empty = shard[at - i + j] == 0.0f;
        if (at_zero)
          out << "the bucket's shard was kept at element 0: each bucket's shard goes after the last one's, at its "
                 "shard_offset, in the Psi_padded / N gradient shard";
        else if (empty)
          out << "nothing was kept there: was the bucket reduce-scattered, with its shard kept at shard_offset?";
        else
          out << "a wrong sum: were all the bucket's gradients in its slot when it was reduce-scattered, each written "
                 "at "
                 "its offset_in_bucket (shards.slot_element)?";
        message = out.str();
      }
    }
    if (!harness::agree(ok)) break;
  }
  CHECK_MESSAGE(lab_verdict(ok, message), message);
}
