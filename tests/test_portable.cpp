// tests/test_portable.cpp — zero2's own gemm, the product of portable mode
// (zero2.h, "the portable product's order"; notes/11):
//   1. two products worked by hand whose exact answers depend on the order
//      over k and on the fused multiply-add: the definition's answer, and not
//      the one another order or an unfused multiply-add would give;
//   2. every CPU schedule this build has (16, 8 and 1 lanes) against the
//      definition, element by element with memcmp, over shapes that cross
//      every tile and block edge, all four transposes, alpha and beta, and
//      leading dimensions wider than the matrix;
//   3. Compute's portable gemm, gemm_batched and the 16-bit products against
//      the definition on widened operands (one rounding of C).
// tests/test_conversions_gpu.cu compares the CUDA kernel with the CPU.
#include <cmath>
#include <cstdio>
#include <limits>

#include "harness.h"

namespace {

// A value of op(X) [rows x columns] stored in X with leading dimension ld.
template <class T>
const T* element_of(const T* X, bool transposed, int ld, int row, int column) {
  return transposed ? X + (size_t)column * ld + row : X + (size_t)row * ld + column;
}

// C's expected value at (m, n), from zero2.h's definition (portable_dot,
// portable_finish): the sum over k of op(A)[m][k] op(B)[k][n] in the
// definition's order. Only the schedule under test is zero2.cu's code.
template <class T>
float expected_element(bool transpose_a, bool transpose_b, int m, int n, int K, float alpha, const T* A, int lda,
                       const T* B, int ldb, float beta, T c_old) {
  const T* a = element_of(A, transpose_a, lda, m, 0);
  const T* b = element_of(B, transpose_b, ldb, 0, n);
  const size_t a_step = transpose_a ? lda : 1, b_step = transpose_b ? 1 : ldb;
  return z2::portable_finish(z2::portable_dot(K, a, a_step, b, b_step), alpha, beta,
                             beta == 0.0f ? 0.0f : z2::to_float(c_old));
}

using harness::wide_value;

struct Shape {
  int M, N, K;
};

}  // namespace

TEST_CASE("portable gemm: worked by hand, the order over k and the fused multiply-add show") {
  z2::Compute compute(z2::Device::cpu, 0);
  compute.set_portable(true);
  // Row [2^24, 1, -2^24] times ones: in index order 2^24 + 1 rounds to 2^24
  // (the tie goes to even), then - 2^24 gives 0. Summed from the end it is 1.
  const float a1[3] = {16777216.0f, 1.0f, -16777216.0f}, ones[3] = {1.0f, 1.0f, 1.0f};
  float c1 = 42.0f;
  compute.gemm(false, false, 1, 1, 3, 1.0f, a1, 3, ones, 1, 0.0f, &c1, 1);
  // [1, 1 + 2^-12] . [-1, 1 + 2^-12]: -1, then fma((1 + 2^-12)^2, -1) is
  // exactly 2^-11 + 2^-24. An unfused product would round (1 + 2^-12)^2 =
  // 1 + 2^-11 + 2^-24 to 1 + 2^-11 first and give 2^-11.
  const float e = std::ldexp(1.0f, -12);
  const float a2[2] = {1.0f, 1.0f + e}, b2[2] = {-1.0f, 1.0f + e};
  float c2 = 0.0f;
  compute.gemm(false, false, 1, 1, 2, 1.0f, a2, 2, b2, 1, 0.0f, &c2, 1);
  // alpha and beta: 0.5 * 3 + 2 * 1.25 = 4, each product exact.
  const float a3[3] = {1.0f, 1.0f, 1.0f};
  float c3 = 1.25f;
  compute.gemm(false, false, 1, 1, 3, 0.5f, a3, 3, ones, 1, 2.0f, &c3, 1);
  // The finish rounds alpha acc and beta C apart, then their sum: for these
  // two values (found by a search) a fused finish, fma(beta, C, alpha acc)
  // or fma(alpha, acc, beta C), rounds to the float below.
  const float x = 0x1.40414p+0f, c_old = 0x1.6bed46p+1f, one = 1.0f;
  float c4 = c_old;
  compute.gemm(false, false, 1, 1, 1, 0.1f, &one, 1, &x, 1, 0.3f, &c4, 1);
  const float scaled = 0.1f * x, kept = 0.3f * c_old, want4 = scaled + kept;  // -ffp-contract=off: three roundings
  const bool finish_matters = want4 != std::fma(0.3f, c_old, scaled) && want4 != std::fma(0.1f, x, kept);
  // An empty sum (K = 0) by the same definition: alpha (+0) + beta C, so
  // alpha = -1 gives -0, and +0 + (-0) is +0.
  float c5 = 7.0f, c6 = -0.0f;
  compute.gemm(false, false, 1, 1, 0, -1.0f, &one, 1, &one, 1, 0.0f, &c5, 1);
  compute.gemm(false, false, 1, 1, 0, 1.0f, &one, 1, &one, 1, 1.0f, &c6, 1);
  const float want1 = 0.0f, want2 = std::ldexp(1.0f, -11) + std::ldexp(1.0f, -24), want3 = 4.0f, want5 = -0.0f,
              want6 = 0.0f;
  const bool ok = std::memcmp(&c1, &want1, 4) == 0 && std::memcmp(&c2, &want2, 4) == 0 &&
                  std::memcmp(&c3, &want3, 4) == 0 && std::memcmp(&c4, &want4, 4) == 0 && finish_matters &&
                  std::memcmp(&c5, &want5, 4) == 0 && std::memcmp(&c6, &want6, 4) == 0;
  if (!ok && harness::rank() == 0) {
    char text[320];
    snprintf(text, sizeof text,
             "got %a (want 0), %a (want %a), %a (want 4), %a (want %a%s), %a (want -0), %a (want +0)", c1, c2, want2,
             c3, c4, want4, finish_matters ? "" : "; the case no longer tells a fused finish", c5, c6);
    MESSAGE(text);
  }
  CHECK(harness::agree(ok, "the portable gemm does not sum over k in index order with fused multiply-adds"));
}

TEST_CASE("portable gemm: every CPU schedule equals the definition, element by element (memcmp)") {
  // Shapes across every schedule's tile edges (4 x 4, 6 x 16, 12 x 32: one
  // less, equal, one more), the 256-column block, K = 0 and 1, then random ones.
  std::vector<Shape> shapes = {{1, 1, 1},    {3, 3, 2},    {4, 4, 1},    {5, 5, 3},     {6, 16, 7},
                               {7, 17, 2},   {11, 31, 17}, {12, 32, 1},  {13, 33, 64},  {25, 65, 9},
                               {17, 257, 3}, {33, 300, 5}, {3, 520, 40}, {64, 64, 300}, {5, 2, 0}};
  for (uint64_t r = 0; r < 12; ++r) {
    const uint64_t h = z2::hash_keys(0x5a9e, r);
    shapes.push_back({1 + (int)(h % 40), 1 + (int)((h >> 8) % 300), (int)((h >> 20) % 70)});
  }
  const float alphas[] = {1.0f, 0.75f, -1.5f}, betas[] = {0.0f, 1.0f, 0.5f};
  int checked_schedules = 0;
  bool ok = true;
  std::string first_failure;
  for (int lanes : {16, 8, 1}) {
    if (!z2::portable_gemm_has_lanes(lanes)) continue;
    ++checked_schedules;
    uint64_t key = 0;
    for (const Shape& shape : shapes)
      for (int transposes = 0; transposes < 4; ++transposes)
        for (int variant = 0; variant < 3; ++variant) {
          const bool transpose_a = transposes & 1, transpose_b = transposes & 2;
          const int M = shape.M, N = shape.N, K = shape.K;
          // Leading dimensions wider than the stored matrix by `variant`.
          const int lda = (transpose_a ? M : K) + variant, ldb = (transpose_b ? K : N) + variant, ldc = N + 2 * variant;
          std::vector<float> A((size_t)(transpose_a ? K : M) * lda + 1), B((size_t)(transpose_b ? N : K) * ldb + 1);
          std::vector<float> C((size_t)M * ldc);
          for (float& x : A) x = wide_value(++key);
          for (float& x : B) x = wide_value(++key);
          const float alpha = alphas[variant], beta = betas[variant];
          // beta = 0 must not read C: a NaN there stays out of the result.
          for (float& x : C) x = beta == 0.0f ? std::numeric_limits<float>::quiet_NaN() : wide_value(++key);
          const std::vector<float> before = C;
          z2::portable_gemm_cpu(lanes, transpose_a, transpose_b, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta,
                                C.data(), ldc);
          for (int m = 0; m < M && ok; ++m)
            for (int n = 0; n < ldc && ok; ++n) {
              const size_t at = (size_t)m * ldc + n;
              // Columns past N belong to no one: they must be left as they were.
              const float want = n >= N ? before[at]
                                        : expected_element(transpose_a, transpose_b, m, n, K, alpha, A.data(), lda,
                                                           B.data(), ldb, beta, before[at]);
              if (std::memcmp(&want, &C[at], 4) != 0) {
                ok = false;
                char text[256];
                snprintf(text, sizeof text,
                         "%d lanes, M %d N %d K %d, transpose a %d b %d, alpha %g beta %g: C[%d][%d] = %08x, the "
                         "definition gives %08x",
                         lanes, M, N, K, transpose_a, transpose_b, alpha, beta, m, n, z2::bits_of(C[at]),
                         z2::bits_of(want));
                first_failure = text;
              }
            }
        }
  }
  if (harness::rank() == 0) MESSAGE("schedules checked (lanes 16, 8, 1 as this build has them): " << checked_schedules);
  if (!ok && harness::rank() == 0) MESSAGE(first_failure);
  CHECK(harness::agree(ok && checked_schedules >= 1, "a portable gemm schedule differs from portable_dot's order"));
}

namespace {

// Compute's portable 16-bit (or fp32) gemm_batched against the definition on
// the widened operands, C rounded once. Returns "" or the first difference.
template <class T>
std::string check_compute_batched(z2::Compute& compute, bool transpose_a, bool transpose_b, float beta) {
  const int M = 13, N = 37, K = 29, batch = 3;
  const int lda = transpose_a ? M : K, ldb = transpose_b ? K : N, ldc = N + 1;
  const long stride_a = (long)(transpose_a ? K : M) * lda + 5, stride_b = (long)(transpose_b ? N : K) * ldb + 3,
             stride_c = (long)M * ldc + 7;
  std::vector<T> A((size_t)stride_a * batch), B((size_t)stride_b * batch), C((size_t)stride_c * batch);
  uint64_t key = 1000 + transpose_a + 2 * transpose_b;
  const int spread = z2::precision_of<T>() == z2::Precision::fp16 ? 5 : 20;  // fp16 tops out at 65504
  for (T& x : A) x = z2::from_float<T>(wide_value(++key, spread));
  for (T& x : B) x = z2::from_float<T>(wide_value(++key, spread));
  for (T& x : C) x = z2::from_float<T>(wide_value(++key, spread));
  const std::vector<T> before = C;
  const float alpha = 0.625f;
  compute.gemm_batched(transpose_a, transpose_b, M, N, K, alpha, A.data(), lda, stride_a, B.data(), ldb, stride_b, beta,
                       C.data(), ldc, stride_c, batch);
  for (int k = 0; k < batch; ++k)
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < N; ++n) {
        const size_t at = (size_t)k * stride_c + (size_t)m * ldc + n;
        const T want =
            z2::from_float<T>(expected_element(transpose_a, transpose_b, m, n, K, alpha, A.data() + k * stride_a, lda,
                                               B.data() + k * stride_b, ldb, beta, before[at]));
        if (std::memcmp(&want, &C[at], sizeof(T)) != 0)
          return std::string(z2::to_string(z2::precision_of<T>())) + " batch " + std::to_string(k) + " C[" +
                 std::to_string(m) + "][" + std::to_string(n) + "] differs from the definition (transpose a " +
                 std::to_string(transpose_a) + ", b " + std::to_string(transpose_b) + ", beta " + std::to_string(beta) +
                 ")";
      }
  return "";
}

}  // namespace

TEST_CASE("portable gemm: Compute's fp32, bf16 and fp16 products (batched) are the definition on widened operands") {
  z2::Compute compute(z2::Device::cpu, 0);
  compute.set_portable(true);
  std::string failure;
  for (int transposes = 0; transposes < 4 && failure.empty(); ++transposes)
    for (float beta : {0.0f, 1.0f}) {
      const bool transpose_a = transposes & 1, transpose_b = transposes & 2;
      if (failure.empty()) failure = check_compute_batched<float>(compute, transpose_a, transpose_b, beta);
      if (failure.empty()) failure = check_compute_batched<z2::bfloat16>(compute, transpose_a, transpose_b, beta);
      if (failure.empty()) failure = check_compute_batched<z2::float16>(compute, transpose_a, transpose_b, beta);
    }
  if (!failure.empty() && harness::rank() == 0) MESSAGE(failure);
  CHECK(harness::agree(failure.empty(), "Compute's portable gemm differs from the definition"));
}
