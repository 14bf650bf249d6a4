// runtime/math.h — the bit-level math both backends share (part of zero2.h:
// include zero2.h, not this). Every function here is Z2_HD: a CPU loop and a
// CUDA kernel call the same text, so they compute the same bits.
//   counter-based random numbers (dropout, masking, initialization: notes/06)
//   bf16 and fp16 as bits, and the conversions (mixed precision: notes/08)
//   exp, log and erf of our own (notes/07, "Math functions")
//   the portable product's order (notes/11, "Portable bits")
//   FNV-1a, the hash of a run's final parameters
#pragma once

namespace z2 {

// Counter-based random numbers: a value is a pure function of its keys, never
// of the rank or thread that asks (notes/06). splitmix64's
// finaliser mixes one 64-bit word; we fold the keys in one at a time.

Z2_HD inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
Z2_HD inline uint64_t hash_keys(uint64_t a, uint64_t b, uint64_t c = 0, uint64_t d = 0, uint64_t e = 0) {
  return mix64(mix64(mix64(mix64(mix64(a) ^ b) ^ c) ^ d) ^ e);
}
// Uniform in [0, 1) with 24 random bits: every value is exactly a float.
Z2_HD inline float uniform_from_hash(uint64_t h) { return (float)(h >> 40) * (1.0f / 16777216.0f); }
// For hashes made per element, where 64-bit multiplies would cost more than
// the rest of the loop: murmur3's 32-bit finaliser (a bijection of 32 bits;
// 32-bit multiplies vectorise on every x86-64 vector unit), and a uniform
// from its top 24 bits (converted as a signed int: exact, and vectorisable).
Z2_HD inline uint32_t mix32(uint32_t x) {
  x = (x ^ (x >> 16)) * 0x85ebca6bu;
  x = (x ^ (x >> 13)) * 0xc2b2ae35u;
  return x ^ (x >> 16);
}
Z2_HD inline float uniform_from_hash32(uint32_t h) { return (float)(int32_t)(h >> 8) * (1.0f / 16777216.0f); }

// --- 16-bit floating point (mixed precision, notes/08) ----------------------
//
// Two 16-bit formats, stored as their bits:
//   bf16  1 sign, 8 exponent, 7 mantissa bits: the top half of a float, so the
//         same range (to 3.4e38) with 8 significant bits;
//   fp16  IEEE binary16: 1 sign, 5 exponent, 10 mantissa bits, largest finite
//         65504, subnormals down to 2^-24 (hence loss scaling).
// Narrowing rounds to nearest, ties to even, as the CUDA intrinsics
// __float2bfloat16_rn / __float2half_rn do, bit for bit: overflow goes to
// +-inf, subnormals are kept (no flush to zero), a NaN becomes 0x7fff (CUDA's
// canonical NaN; torch gives 0x7fc0 / 0x7e00, also NaN). Widening is exact.
// Plain bit manipulation, so one function serves the CPU and the kernels.

// A value's bits read as another type of the same size (C++20's bit_cast).
template <class To, class From>
Z2_HD inline To bit_cast_to(From value) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast_to: the sizes differ");
  To result;
  memcpy(&result, &value, sizeof result);
  return result;
}
Z2_HD inline uint32_t bits_of(float value) { return bit_cast_to<uint32_t>(value); }
Z2_HD inline float float_of(uint32_t bits) { return bit_cast_to<float>(bits); }

Z2_HD inline uint16_t bf16_bits_from_float(float value) {
  uint32_t bits = bits_of(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;  // NaN
  // Round the 16 dropped bits to nearest even: add just under half, plus the
  // kept lowest bit. A carry ripples into the exponent, which is right (it
  // also takes the values above the largest finite bf16 to infinity).
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return (uint16_t)(bits >> 16);
}
Z2_HD inline float float_from_bf16_bits(uint16_t bits) { return float_of((uint32_t)bits << 16); }

// Both fp16 conversions are branch-free: every case is computed and the
// right one selected, so a loop that converts (every fp16 kernel) vectorises.
Z2_HD inline uint16_t fp16_bits_from_float(float value) {
  const uint32_t bits = bits_of(value), magnitude = bits & 0x7fffffffu, sign = (bits >> 16) & 0x8000u;
  // A normal fp16 (2^-14 and up): rebias 127 -> 15, round the 13 dropped bits
  // to nearest even (add just under half, plus the kept lowest bit; a carry
  // into the exponent is right).
  uint32_t rebased = magnitude - 0x38000000u;
  rebased += 0xfffu + ((rebased >> 13) & 1u);
  const uint32_t normal = rebased >> 13;
  // Below 2^-14, fp16 counts in units of 2^-24, and |x| + 0.5 in float rounds
  // |x| to a multiple of 2^-24 (0.5's ulp), to nearest even, in one IEEE
  // addition: the units are the sum's bits above 0.5's. This covers zero, the
  // ties to 0 at 2^-25 and below, and the carry into the smallest normal.
  const uint32_t subnormal = bits_of(float_of(magnitude) + 0.5f) - 0x3f000000u;
  uint32_t result = magnitude >= 0x38800000u ? normal : subnormal;
  // 65520 (0x477ff000) is halfway between 65504, the largest finite, and
  // 65536; its tie goes to the even neighbour, which is infinity.
  result = magnitude >= 0x477ff000u ? 0x7c00u : result;
  return magnitude > 0x7f800000u ? (uint16_t)0x7fffu : (uint16_t)(sign | result);  // NaN: 0x7fff
}
Z2_HD inline float float_from_fp16_bits(uint16_t bits) {
  const uint32_t sign = (uint32_t)(bits & 0x8000u) << 16, exponent = (bits >> 10) & 0x1fu, mantissa = bits & 0x3ffu;
  const uint32_t special = mantissa ? 0x7fffffffu : sign | 0x7f800000u;  // NaN (as CUDA), +-inf
  const uint32_t normal = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  // Zero or subnormal: mantissa x 2^-24, exact in float; the sign ORed in.
  const uint32_t small = sign | bits_of((float)mantissa * 5.9604644775390625e-8f);
  return float_of(exponent == 0x1fu ? special : (exponent != 0 ? normal : small));
}

// Reading and writing an element of any storage type: the model's and the
// engine's kernels are written once over `T` and run as float (fp32: these
// are identities, the fp32 bits do not change), bfloat16 or float16.
Z2_HD inline float to_float(float value) { return value; }
Z2_HD inline float to_float(bfloat16 value) { return float_from_bf16_bits(value.bits); }
Z2_HD inline float to_float(float16 value) { return float_from_fp16_bits(value.bits); }
template <>
Z2_HD inline float from_float<float>(float value) {
  return value;
}
template <>
Z2_HD inline bfloat16 from_float<bfloat16>(float value) {
  return bfloat16{bf16_bits_from_float(value)};
}
template <>
Z2_HD inline float16 from_float<float16>(float value) {
  return float16{fp16_bits_from_float(value)};
}
// The Precision a storage type stands for (declared in zero2.h).
template <>
constexpr Precision precision_of<float>() {
  return Precision::fp32;
}
template <>
constexpr Precision precision_of<bfloat16>() {
  return Precision::bf16;
}
template <>
constexpr Precision precision_of<float16>() {
  return Precision::fp16;
}

// --- exp, log and erf of our own (notes/07, "Math functions") ---------------
//
// The model's transcendental functions: softmax's and cross-entropy's exp and
// log, GELU's erf. libm's expf / erff are calls the compiler cannot vectorise
// (a call per element was ~10% of a CPU step), and their bits are the
// library's: glibc picks an FMA variant of expf on CPUs that have FMA, CUDA's
// libdevice is another again. Ours are written once, for the CPU loops (where
// they vectorise) and the kernels. Each works in double on a float argument,
// with + - * / only (no fma, no table, no libm): the double result is within
// ~4e-13 of the exact value, rounded to float once, so the float is the
// correctly rounded one except where the exact value lies that close to a
// midpoint between two floats. build/math_accuracy measures the error in
// ulps over every float input (tests/test_math.cpp checks a sample in CI).
Z2_HD inline uint64_t bits_of_double(double value) { return bit_cast_to<uint64_t>(value); }
Z2_HD inline double double_of(uint64_t bits) { return bit_cast_to<double>(bits); }

// c[first] + t (c[first + 1] + t (... + t c[last])), unrolled at compile time
// (a loop over the coefficients would keep the caller's loop from vectorising).
template <int first, int last>
Z2_HD inline double horner(const double* c, double t) {
  if constexpr (first == last) return c[last];
  else return horner<first + 1, last>(c, t) * t + c[first];
}

// e^x: x = k ln 2 + r with k an integer and |r| <= ln 2 / 2, e^r by Taylor's
// series to r^10 (the rest is < 3.1e-13 of e^r), and 2^k made from its bits.
Z2_HD inline float exp_fp32(float x) {
  // Clamped where the float is already decided: e^89 > FLT_MAX (inf) and
  // e^-104 < half the smallest subnormal (0). A NaN fails both tests. Two
  // selects, no branch: with -fno-trapping-math (Makefile) the compiler
  // computes both sides of each, and the caller's loop vectorises.
  const float below_max = x > 89.0f ? 89.0f : x;
  const float clamped = below_max < -104.0f ? -104.0f : below_max;
  const double xd = clamped;
  // Adding 1.5 * 2^52 rounds to an integer and leaves it in the low bits.
  const double shift = 6755399441055744.0;
  const double shifted = xd * 1.4426950408889634 + shift;  // x log2(e) + shift
  const double k = shifted - shift;
  // k ln 2 rounds by < 2^-46 (|k| <= 151): that much relative error in e^x.
  const double r = xd - k * 0.6931471805599453;
  constexpr double inverse_factorials[11] = {
      1.0,       1.0,        1.0 / 2,     1.0 / 6,      1.0 / 24,     1.0 / 120,
      1.0 / 720, 1.0 / 5040, 1.0 / 40320, 1.0 / 362880, 1.0 / 3628800};  // 1 / j!
  const double series = horner<0, 10>(inverse_factorials, r);
  // 2^k from its bits: k in [-151, 129] is a normal double's exponent, and
  // the product is exact (a power of two), so the one rounding is to float
  // (to inf above FLT_MAX, to a subnormal or 0 below FLT_MIN, as IEEE says).
  const uint64_t k_bits = bits_of_double(shifted) - bits_of_double(shift);  // k, two's complement
  const double two_to_k = double_of((k_bits + 1023u) << 52);
  return (float)(series * two_to_k);
}

// log x for a positive, finite x (a normal double): x = 2^e m with m in
// [sqrt(1/2), sqrt 2), log m = 2 atanh(s) with s = (m - 1) / (m + 1),
// |s| <= 0.1716, by its series to s^(2 terms - 1). log_fp32 sums 10 terms
// (the rest is < 1e-15 of the sum); the host's double log (the initial
// weights' Box-Muller, the "log" warmup) sums 13 (< 2e-20: what is left is
// the double roundings, a few ulps of the double).
template <int terms>
Z2_HD inline double log_series(double x) {
  const uint64_t bits = bits_of_double(x);
  int exponent = (int)(bits >> 52) - 1023;
  double mantissa = double_of((bits & 0x000fffffffffffffull) | 0x3ff0000000000000ull);  // [1, 2)
  if (mantissa > 1.4142135623730951) {
    mantissa *= 0.5;
    exponent += 1;
  }
  const double s = (mantissa - 1.0) / (mantissa + 1.0);  // m - 1 is exact (Sterbenz)
  const double s2 = s * s;
  constexpr double inverse_odds[13] = {1.0,      1.0 / 3,  1.0 / 5,  1.0 / 7,  1.0 / 9,  1.0 / 11, 1.0 / 13,
                                       1.0 / 15, 1.0 / 17, 1.0 / 19, 1.0 / 21, 1.0 / 23, 1.0 / 25};  // 1 / (2j + 1)
  static_assert(terms <= 13, "inverse_odds has 13 terms");
  const double series = horner<0, terms - 1>(inverse_odds, s2);  // sum of s2^j / (2j + 1)
  // For x in [sqrt(1/2), sqrt 2) the exponent is 0: no cancellation near 1.
  return exponent * 0.6931471805599453 + 2.0 * s * series;
}

// log x of a float (cross-entropy). Called a few hundred times a step, so the
// special inputs are plain branches; a subnormal float is a normal double.
Z2_HD inline float log_fp32(float x) {
  if (x != x || x == INFINITY) return x;       // NaN, +inf
  if (x == 0.0f) return -INFINITY;             // either sign of zero
  if (x < 0.0f) return float_of(0x7fc00000u);  // a quiet NaN
  return (float)log_series<10>((double)x);
}

// The host's double log of a positive finite x (no special values: its two
// callers pass (0, 1] and [1, 2^31]).
inline double log_double(double x) { return log_series<13>(x); }

// Taylor's series of cos x and of sin x / x in x2 = x^2, to x^18 and x^19:
// < 3e-18 left for |x| <= pi / 4, where both callers below use them.
inline double cos_taylor(double x2) {
  constexpr double terms[10] = {1.0,
                                -1.0 / 2,
                                1.0 / 24,
                                -1.0 / 720,
                                1.0 / 40320,
                                -1.0 / 3628800,
                                1.0 / 479001600,
                                -1.0 / 87178291200.0,
                                1.0 / 20922789888000.0,
                                -1.0 / 6402373705728000.0};  // (-1)^j / (2j)!
  return horner<0, 9>(terms, x2);
}
inline double sin_over_x_taylor(double x2) {
  constexpr double terms[10] = {1.0,
                                -1.0 / 6,
                                1.0 / 120,
                                -1.0 / 5040,
                                1.0 / 362880,
                                -1.0 / 39916800,
                                1.0 / 6227020800.0,
                                -1.0 / 1307674368000.0,
                                1.0 / 355687428096000.0,
                                -1.0 / 121645100408832000.0};  // (-1)^j / (2j + 1)!
  return horner<0, 9>(terms, x2);
}

// cos(2 pi u) for u in [0, 1) (the angle of Box-Muller), in turns so that
// the reduction is exact: cos(2 pi u) = cos(2 pi (1 - u)) = -cos(2 pi (1/2 - u))
// = sin(2 pi (1/4 - u)), each subtraction exact for these u (multiples of
// 2^-53), down to x = 2 pi u' <= pi / 4, where Taylor's series to x^18 (cos)
// or x^19 (sin) leaves < 3e-18.
inline double cos_two_pi(double u) {
  if (u > 0.5) u = 1.0 - u;
  double sign = 1.0;
  if (u > 0.25) {
    u = 0.5 - u;
    sign = -1.0;
  }
  const bool as_sine = u > 0.125;
  if (as_sine) u = 0.25 - u;
  const double x = 6.283185307179586 * u, x2 = x * x;
  return sign * (as_sine ? x * sin_over_x_taylor(x2) : cos_taylor(x2));
}

// cos x of a double |x| <= 2^20 (DeepSpeed's WarmupCosineLR, whose argument
// pi r / T the caller keeps in [0, 2 pi]: trainer/settings.cpp). Cody and
// Waite's reduction x = k pi/2 + r, k the nearest integer, with pi/2 in three
// parts of 33 bits (fdlibm's pio2_1, pio2_2, pio2_3), so that k times each is
// exact for k < 2^20 and the first subtraction is exact (Sterbenz); the other
// two round by < 2^-54 of |r| <= pi/4 each, and the third part's tail
// (pio2_3t, 8.5e-32) times k is < 1e-25. Then cos r or sin r by Taylor's
// series to r^18 / r^19 as in cos_two_pi (< 3e-18 left), signed by the
// quadrant k mod 4: within ~2.5e-16 of cos x absolutely (tests/test_math.cpp).
inline double cos_double(double x) {
  if (x < 0) x = -x;
  const double k = std::floor(x * 0.6366197723675814 + 0.5);  // x / (pi/2), nearest; an integer < 2^20
  const double r =
      ((x - k * 1.57079632673412561417e+00) - k * 6.07710050630396597660e-11) - k * 2.02226624871116645580e-21;
  const double r2 = r * r;
  // cos(k pi/2 + r): cos r, -sin r, -cos r, sin r for k = 0, 1, 2, 3 mod 4.
  const long quadrant = (long)k & 3;
  const double value = (quadrant & 1) ? r * sin_over_x_taylor(r2) : cos_taylor(r2);
  return quadrant == 1 || quadrant == 2 ? -value : value;
}

// base^exponent for an integer exponent >= 0 by repeated squaring (Adam's
// bias corrections beta^t): multiplications only, the same on every machine,
// where libm's pow is a different function per library (and per CPU: glibc
// has an FMA variant).
inline double power_double(double base, long exponent) {
  double result = 1.0;
  for (; exponent > 0; exponent >>= 1) {
    if (exponent & 1) result *= base;
    base *= base;
  }
  return result;
}

// erf x = x P(t) for |x| < 4, t = x^2 / 8 - 1 in [-1, 1] (x^2 of a float is
// exact in double), P the Chebyshev interpolant of degree 22 of
// erf(sqrt u) / sqrt u on u in [0, 16], in powers of t (relative error
// 3.6e-13; measurements/fit_erf.py prints these). |x| >= 4: erf rounds to +-1.
Z2_HD inline float erf_fp32(float x) {
  constexpr double coefficients[23] = {
      0x1.6a040781a4982p-2,  -0x1.69a0ccda54952p-3,  0x1.0dabaf061ddfcp-3,  -0x1.b92e95b20b5e1p-4,
      0x1.717efc728e255p-4,  -0x1.3215da49e043ap-4,  0x1.ea97f26001881p-5,  -0x1.76e83f098334ap-5,
      0x1.0ed51f90471d4p-5,  -0x1.7036eb6c5269dp-6,  0x1.d6366b9d70c84p-7,  -0x1.19f28bf3e4857p-7,
      0x1.3e0b127cfde9fp-8,  -0x1.52908d0777a74p-9,  0x1.533fbf51c858fp-10, -0x1.3d1cc2c1e9bd2p-11,
      0x1.1e453c5321644p-12, -0x1.094fac537a6f5p-13, 0x1.a84593e9bd379p-15, -0x1.a7b88f4de9bd6p-17,
      0x1.526ee6f4de9c0p-18, -0x1.33e39bd37a6f5p-18, 0x1.90dc2c8590b21p-20};
  const double xd = x;
  const double t = xd * xd * 0.125 - 1.0;
  const float inside = (float)(xd * horner<0, 22>(coefficients, t));
  // Selected, not branched (as in exp_fp32), so the loops vectorise; inf
  // gives +-1 and NaN gives NaN (tests/test_math.cpp).
  const float at_most_one = x >= 4.0f ? 1.0f : inside;
  return x <= -4.0f ? -1.0f : at_most_one;
}

// --- the portable product's order (notes/11, "Portable bits") ---------------
//
// What one element of C = alpha op(A) op(B) + beta C is in portable mode
// (Compute::set_portable): the sum over k in index order, each step one fused
// multiply-add (a * b + acc rounded once, IEEE's fma), from +0:
//
//   acc = 0;  for k = 0 .. K-1:  acc = fma(a_k, b_k, acc)
//   C   = alpha * acc                      (beta == 0: C's old value unread)
//   C   = alpha * acc + beta * C           (otherwise: two products, one sum)
//
// Every multiply-add and product is correctly rounded, so the result is a
// function of the inputs alone. zero2's CPU kernel and its CUDA kernel
// (runtime/gemm.cu) are two schedules of this loop: they block and vectorise
// over rows and columns of C, never over k.
Z2_HD inline float fma_fp32(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);  // an instruction with FMA hardware; glibc's exact fmaf without
#endif
}

// The sum over k of one element: a_k = a[k * a_step], b_k = b[k * b_step],
// widened to fp32 (exactly) if T is a 16-bit type.
template <class T>
Z2_HD inline float portable_dot(int K, const T* a, size_t a_step, const T* b, size_t b_step) {
  float acc = 0.0f;
  for (int k = 0; k < K; ++k) acc = fma_fp32(to_float(a[k * a_step]), to_float(b[k * b_step]), acc);
  return acc;
}

// alpha and beta applied to the sum (c_old is ignored when beta == 0, so NaN
// in a fresh output does not leak into it, as BLAS defines beta = 0).
Z2_HD inline float portable_finish(float acc, float alpha, float beta, float c_old) {
  const float scaled = alpha * acc;
  return beta == 0.0f ? scaled : scaled + beta * c_old;
}

// FNV-1a 64 over the bytes of `count` floats: the run's "final_params_hash".
uint64_t fnv1a64(const float* values, size_t count);

}  // namespace z2
