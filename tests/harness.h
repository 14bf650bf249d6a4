// tests/harness.h — what every test file shares: the backends to test, made
// once in main() (communicators belong outside test bodies: doctest re-runs a
// TEST_CASE body per SUBCASE), and agreement across ranks.
//
// The rule that keeps MPI tests from hanging: a rank never leaves a test case
// early. Each check computes its local verdict, all ranks agree on it with one
// MPI_Allreduce (harness::agree), and every rank CHECKs the agreed value, so
// every rank reaches the same collectives and doctest counts the same failure
// on each. Only rank 0 prints doctest's report; a rank whose own comparison
// failed says so on stderr.
#pragma once

#include <doctest/doctest.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "../zero2.h"

namespace harness {

struct Backend {
  std::string name;  // e.g. "cpu/mpi", "cuda/nccl"
  z2::Compute* compute = nullptr;
  z2::Communicator* deterministic = nullptr;  // --collectives deterministic
  z2::Communicator* native = nullptr;         // --collectives native
};

// Backends over all ranks: cpu/mpi and sim/mpi always; cuda/mpi and cuda/nccl when a GPU
// is present (cuda/nccl only with one GPU per rank).
const std::vector<Backend>& backends();
// Backends over ranks [0, n) only (n = 1, 2, 4 up to the world size), for the
// world-size tests; `deterministic` is null on ranks outside. Empty if n is
// larger than the world.
const std::vector<Backend>& sub_world(int n);

// A lab grader's one line (tests/test_labs.cpp, test_lab_streams.cpp): every
// rank agrees on the verdict; the message of the lowest rank that found the
// fault is printed by rank 0 as "[lab] ...", what tests/lab.sh shows.
bool lab_verdict(bool local_ok, const std::string& local_message);

int rank();
int world_size();
// Logical AND of `local` over all ranks of MPI_COMM_WORLD; a rank whose
// `local` is false prints `what` to stderr.
bool agree(bool local, const std::string& what = "");
// Rank 0's value, on every rank.
bool from_rank0(bool value);

// BERT-mini trained by bert::train with the trainer's command-line `flags`
// (--quiet and --json added) on every rank of MPI_COMM_WORLD: on rank 0 its
// final parameters' hash and every step's loss bits, "" on the other ranks
// and on every rank when the run failed. In tests/test_bert.cu, which
// compiles the model (the streams lab's grader, tests/test_labs.cpp, trains it).
std::string bert_run_bits(const std::vector<std::string>& flags);

// Runs `body` and says whether it finished: an exception becomes `false`
// (and a line on stderr). For code that only some ranks run (a sub-world):
// an exception must not take those ranks out of the test case while the
// others wait at its next collective. (A lab's wrong answer makes the engine
// refuse a call on every rank that runs it.)
template <class Body>
bool completes(Body&& body, const std::string& what) {
  try {
    body();
    return true;
  } catch (const std::exception& error) {
    fprintf(stderr, "[test] rank %d: %s: %s\n", rank(), what.c_str(), error.what());
    return false;
  }
}

// Bitwise equality of two float arrays (memcmp, not "close").
inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// Bitwise equality of two floats.
inline bool same_float_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// The canonical tree written as its definition (notes/06),
// recursively, independent of z2::canonical_tree_sum's binary counter.
inline float recursive_tree_sum(const float* leaves, long n) {
  if (n == 0) return 0.0f;
  if (n == 1) return leaves[0];
  long p = 1;
  while (p * 2 < n) p *= 2;  // the largest power of two below n
  return recursive_tree_sum(leaves, p) + recursive_tree_sum(leaves + p, n - p);
}

// A deterministic pseudo-random float in [-1, 1) with a varied exponent, so
// that summation order changes the rounded result.
inline float test_value(uint64_t a, uint64_t b, uint64_t c = 0) {
  uint64_t h = z2::hash_keys(0x7e57, a, b, c);
  float magnitude = (float)(1u << (h & 7)) / 16.0f;  // 1/16 .. 8
  return (2.0f * z2::uniform_from_hash(h) - 1.0f) * magnitude;
}

// A pseudo-random float over 2 spread + 1 binades and both signs (40 by
// default), so that another order over k of a product rounds differently
// almost everywhere (the portable gemm's tests; fp16 wants spread 5, as it
// tops out at 65504).
inline float wide_value(uint64_t key, int spread = 20) {
  const uint64_t h = z2::hash_keys(0x9e11, key);
  const float unit = (float)((h >> 40) & 0xffffff) / 16777216.0f - 0.5f;
  return std::ldexp(unit, (int)(h % (2 * spread + 1)) - spread);
}

}  // namespace harness
