// zero2.h — the public API of zero2, a reference implementation of ZeRO stage 2
// (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
// Parameter Models", SC20). The engine itself lives in zero2.cu; this header is
// plain C++ (no CUDA types), so test files compiled by mpicxx and model files
// compiled by nvcc include the same declarations.
//
// What you find here, and where zero2.cu implements it (its sections 1-8):
//   1. errors and check macros (MPI, CUDA, cuBLAS, NCCL)     zero2.cu 1
//   2. Z2_HD math shared by CPU loops and CUDA kernels:      here only (inline),
//      counter-based random numbers, bf16 / fp16              used by zero2.cu 2,
//      conversions, exp / log / erf of our own, the           4, 6 and 7
//      portable product's order (notes/11), the canonical
//      summation tree (notes/06, the determinism contract),
//      AdamW
//   3. the compute backend (cpu | cuda): memory with a        zero2.cu 2
//      ledger (and the arena's books), streams, events,
//      for_each (one Z2_LOOP body, run as a CPU loop or a
//      CUDA kernel), gemm
//   4. the communicator (mpi | nccl), its byte ledger, and    zero2.cu 3 and 4
//      the bucket collectives (BucketExchange, and the
//      blocking reference they are tested against)
//   5. the engine: flat buckets, stages 0/1/2, gradient      zero2.cu 5 (layout),
//      accumulation, clipping, AdamW, mixed precision with    6 (stages), 7 (the
//      fp16 loss scaling (notes/08), checkpoint state, and    step), 8 (ledgers)
//      the memory and communication ledgers
// The functions the course labs replace are listed under "the lab seams"
// (section 5; notes/labs).
//
// Usage, in the shape of a training loop (tests/mlp_model.cu is a full example):
//
//   z2::Compute compute(z2::Device::cpu, local_rank);
//   z2::Communicator comm(compute, MPI_COMM_WORLD, z2::CommBackend::mpi,
//                         z2::Collectives::deterministic);
//   z2::Engine engine(compute, comm, options);           // options.stage = 2 ...
//   auto w = engine.add_parameter("layer.weight", out * in, /*decay=*/true);
//   engine.build();                                      // layout + allocation
//   init(engine.parameter(w));                           // same values on every rank
//   for (step) {
//     for (a = 0; a < options.accumulation_steps; ++a) {
//       long m = engine.micro_batch_index(a);            // which global micro-batch
//       forward(...);
//       float* g = engine.gradient_output(w);            // write dL/dw here ...
//       engine.gradient_ready(w);                        // ... then say so
//       engine.end_micro_step(loss_of_this_micro_batch);
//     }
//     z2::StepReport report = engine.step();            // clip, AdamW, all-gather
//   }
#pragma once

#include <mpi.h>

#include <cmath>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

// Z2_HD marks code that runs on both backends: a function (written
// `Z2_HD inline`); a loop body handed to Compute::for_each is written Z2_LOOP(i, { ... }) (below).
#if defined(__CUDACC__)
#define Z2_HD __host__ __device__
#else
#define Z2_HD
#endif

// Z2_LAB_SEAM marks the engine's definition of a function a course lab asks
// students to write (notes/labs). In a lab build (-DZ2_LAB_BUILD, `make lab`)
// the definition is weak, so the student's file, linked beside it, replaces
// it; in every other build it is an ordinary function.
#if defined(Z2_LAB_BUILD)
#define Z2_LAB_SEAM __attribute__((weak))
#else
#define Z2_LAB_SEAM
#endif

namespace z2 {

// Z2_LOOP(i, { body }): one loop body, written once. In the nvcc build it
// becomes two lambdas from the same text, a plain host one for the CPU loop
// (inlined and vectorised as g++ would: nvcc's __host__ __device__ lambdas
// are called through a type-erased wrapper on the host, one indirect call
// per element) and a __device__ one for the kernel; in the g++ build, one
// plain lambda. (__VA_ARGS__: commas in the body survive the macro.)
template <class HostBody, class DeviceBody>
struct Loop {
  HostBody host;
  DeviceBody device;
};
template <class HostBody, class DeviceBody>
Loop<HostBody, DeviceBody> make_loop(HostBody host, DeviceBody device) {
  return {host, device};
}
#if defined(__CUDACC__)
#define Z2_LOOP(index, ...) ::z2::make_loop([=](size_t index) __VA_ARGS__, [=] __device__(size_t index) __VA_ARGS__)
#else
#define Z2_LOOP(index, ...) [=](size_t index) __VA_ARGS__
#endif
// Z2_LOOP2(row, column, { body }): the same over a [rows, columns] grid, for
// Compute::for_each(rows, columns, ...) and Compute::column_sums. On the CPU
// the rows are the outer loop and the columns the inner one, so the body sees
// `row` constant across the inner loop: no division per element (i / columns
// and i % columns cost 20-40 cycles each), what depends on the row alone is
// hoisted out, and the inner loop can be vectorised.
#if defined(__CUDACC__)
#define Z2_LOOP2(row, column, ...) \
  ::z2::make_loop([=](size_t row, size_t column) __VA_ARGS__, [=] __device__(size_t row, size_t column) __VA_ARGS__)
#else
#define Z2_LOOP2(row, column, ...) [=](size_t row, size_t column) __VA_ARGS__
#endif

// ----------------------------------------------------------------------------
// 1. Errors
//
// Two kinds. A usage error (bad bucket size, a parameter registered too late)
// throws z2::Error: every rank sees the same arguments, so every rank throws
// at the same place and the caller decides how to exit. A library failure
// (CUDA, cuBLAS, NCCL, MPI) may happen on one rank only; its check prints
// file:line, the library's message and a hint, then MPI_Abort()s every rank,
// because the other ranks may already be waiting in a collective.

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Codes are passed as int so this header needs no CUDA types; zero2.cu turns
// them back into cudaError_t / cublasStatus_t / ncclResult_t for the message.
void check_mpi(int code, const char* call, const char* file, int line);
void check_cuda(int code, const char* call, const char* file, int line);
void check_cublas(int code, const char* call, const char* file, int line);
void check_nccl(int code, const char* call, const char* file, int line);
[[noreturn]] void abort_all_ranks(const char* library, const char* message, const char* call, const char* file,
                                  int line);

#define Z2_MPI_CHECK(call) ::z2::check_mpi((call), #call, __FILE__, __LINE__)
#define Z2_CUDA_CHECK(call) ::z2::check_cuda(static_cast<int>(call), #call, __FILE__, __LINE__)
#define Z2_CUBLAS_CHECK(call) ::z2::check_cublas(static_cast<int>(call), #call, __FILE__, __LINE__)
#define Z2_NCCL_CHECK(call) ::z2::check_nccl(static_cast<int>(call), #call, __FILE__, __LINE__)

// Throw z2::Error with a printf-style message.
[[noreturn]] void usage_error(const char* format, ...);
// A printf-style message whole, however long (a path may take kilobytes: a
// fixed buffer would cut off the reason that follows it).
std::string format_message(const char* format, va_list arguments);
std::string format_text(const char* format, ...);  // the same, from the arguments themselves

// The watchdog (--timeout; README, "When something goes wrong"). Every wait
// of the engine and the trainer — an MPI request, a CUDA stream — polls
// against a deadline of watchdog_timeout() seconds from the moment it began.
// Past it the rank holds a roll call (each waiting rank answers what it
// waits for; a stopped, stuck or dead one does not), prints what it waited
// for (which collective, which bucket, in which step), which ranks did not
// answer and where the others are, and takes the job down: NCCL
// communicators first (ncclCommAbort, as PyTorch's watchdog does), then
// MPI_Abort. A stopped, stuck or dead rank ends the job within the timeout
// (plus the roll call's grace, a tenth of it, 1 to 10 s) instead of leaving
// the others waiting forever.
void set_watchdog_timeout(double seconds);  // default 600; > 0
double watchdog_timeout();
void set_watchdog_context(const std::string& where);  // e.g. "optimizer step 7": named in the message
[[noreturn]] void watchdog_expired(const std::string& waited_for);
// Poll `done` until it returns true, or the watchdog expires; `describe`
// names what is waited for (asked only at expiry or by a roll call).
void wait_until(const std::function<bool()>& done, const std::function<std::string()>& describe);
// MPI_Test polled until `request` completes, or the watchdog expires;
// `what` names it in the message ("the all-gather of the loss").
void wait_request(MPI_Request* request, const std::string& what);
// MPI_Allreduce and MPI_Bcast with the watchdog (non-blocking, waited on).
void watched_allreduce(const void* send, void* receive, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm,
                       const std::string& what);
void watched_bcast(void* buffer, int count, MPI_Datatype type, int root, MPI_Comm comm, const std::string& what);

// ----------------------------------------------------------------------------
// 2. Math written once for both backends (Z2_HD)
//
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
struct bfloat16 {
  uint16_t bits;
};
struct float16 {
  uint16_t bits;
};
enum class Precision { fp32, bf16, fp16 };
const char* to_string(Precision precision);
inline size_t element_bytes(Precision precision) { return precision == Precision::fp32 ? 4 : 2; }

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
template <class T>
Z2_HD inline T from_float(float value);
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
// The Precision a storage type stands for.
template <class T>
constexpr Precision precision_of();
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
  constexpr double cos_terms[10] = {1.0,
                                    -1.0 / 2,
                                    1.0 / 24,
                                    -1.0 / 720,
                                    1.0 / 40320,
                                    -1.0 / 3628800,
                                    1.0 / 479001600,
                                    -1.0 / 87178291200.0,
                                    1.0 / 20922789888000.0,
                                    -1.0 / 6402373705728000.0};  // (-1)^j / (2j)!
  constexpr double sin_terms[10] = {1.0,
                                    -1.0 / 6,
                                    1.0 / 120,
                                    -1.0 / 5040,
                                    1.0 / 362880,
                                    -1.0 / 39916800,
                                    1.0 / 6227020800.0,
                                    -1.0 / 1307674368000.0,
                                    1.0 / 355687428096000.0,
                                    -1.0 / 121645100408832000.0};  // (-1)^j / (2j + 1)!
  return sign * (as_sine ? x * horner<0, 9>(sin_terms, x2) : horner<0, 9>(cos_terms, x2));
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
// 3.6e-13; tests/fit_erf.py prints these). |x| >= 4: erf rounds to +-1.
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
// function of the inputs alone. zero2's CPU kernel (zero2.cu, section 2) and
// its CUDA kernel are two schedules of this loop: they block and vectorise
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

// The canonical summation tree (notes/06). Float addition is not
// associative, so "the sum" of n numbers is only defined once we fix the tree.
// Ours is the left-complete pairwise tree: a range of n > 1 leaves splits after
// its first p leaves, p = the largest power of two below n.
//
// We evaluate it with a binary counter instead of recursion, so it runs in a
// CUDA thread with a fixed-size stack: leaf k is pushed, then merged with the
// stack top once for every trailing one bit of k (each merge closes a perfect
// subtree of equal size), and at the end the stack (block sizes falling) is
// folded from the right. For n = 7 that is ((0+1)+(2+3)) + ((4+5)+6).
//
// `leaf(k)` returns leaf k. The same function sums the N ranks' slices of a
// bucket, the squares inside a norm chunk, the chunk sums, and the loss.
Z2_HD inline int count_bits(unsigned long x) {
  int bits = 0;
  for (; x; x &= x - 1) ++bits;
  return bits;
}
template <class Leaf>
Z2_HD inline float canonical_tree_sum(long n, Leaf leaf) {
  float stack[40];  // one entry per bit of n: enough for any n < 2^40
  int depth = 0;
  for (long k = 0; k < n; ++k) {
    float value = leaf(k);
    for (unsigned long closed = (unsigned long)k; closed & 1ul; closed >>= 1) value = stack[--depth] + value;
    stack[depth++] = value;
  }
  float sum = depth > 0 ? stack[--depth] : 0.0f;
  while (depth > 0) sum = stack[--depth] + sum;
  return sum;
}

// canonical_tree_sum of a power-of-two count of leaves, by levels: the pairs
// of leaves, then the pairs of pairs, ... A perfect tree has one shape, so
// these are the same additions in the same order, written as loops the CPU
// can vectorise (each level reads `from` and writes `to`, then they swap).
// `leaves` [n] is overwritten.
template <int n>
Z2_HD inline float perfect_tree_sum(float* leaves) {
  static_assert(n > 0 && (n & (n - 1)) == 0, "n must be a power of two");
  float scratch[n / 2 > 0 ? n / 2 : 1];
  float *from = leaves, *to = scratch;
  for (int width = n / 2; width >= 1; width /= 2) {
    for (int k = 0; k < width; ++k) to[k] = from[2 * k] + from[2 * k + 1];
    float* swap = from;
    from = to, to = swap;
  }
  return from[0];
}

// The same tree, fed over time: the A micro-step results of one optimizer step
// arrive one by one (notes/06, the interleaved assignment). `stack`
// holds the open blocks of earlier micro-steps (at most floor(log2 A) of them,
// one buffer each); `step` is this micro-step (0-based). Before the last step
// the new value is pushed exactly as in canonical_tree_sum; at the last step
// the stack is folded from the right into `result`.
// In mixed precision `value` is the fp32 sum of the ranks' 16-bit slices, the
// blocks are fp32 (`Accum` = float, grad_accum_dtype "fp32") or 16-bit, and
// `result` is the 16-bit gradient: with fp32 blocks the sums happen in fp32
// and only the finished sum is rounded, once (notes/08).
template <class Accum = float>
struct AccumulationStackOf {
  Accum* entries[32];  // entries[d][i]: element i of open block d (A < 2^32)
};
using AccumulationStack = AccumulationStackOf<float>;
template <class Accum, class Result>
Z2_HD inline void accumulate_micro_step(const AccumulationStackOf<Accum>& stack, long step, long steps, float value,
                                        Result* result, size_t i) {
  int depth = count_bits((unsigned long)step);  // open blocks before this push
  if (step == steps - 1) {
    while (depth > 0) value = to_float(stack.entries[--depth][i]) + value;
    result[i] = from_float<Result>(value);
    return;
  }
  for (unsigned long closed = (unsigned long)step; closed & 1ul; closed >>= 1)
    value = to_float(stack.entries[--depth][i]) + value;
  stack.entries[depth][i] = from_float<Accum>(value);
}

// AdamW exactly as torch.optim.AdamW (single-tensor path, amsgrad off):
//   p <- p * (1 - lr * wd);  m <- m + (g - m)(1 - b1);  v <- v*b2 + (1 - b2) g^2
//   p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// `grad_scale` is the clipping coefficient (1 when not clipping); torch
// multiplies the gradient by it in place before the optimizer reads it, and
// so do we, element by element.
// Scalars are computed in double on the host, as torch does in Python, and
// rounded to float once; the element-wise operations follow the formulas of
// torch's scalar CPU kernels (lerp in its two branches; addcmul:
// v + (c * g) * g; addcdiv: p + (c * m) / d). Bitwise equality with torch is
// not claimed: its vectorized kernels fuse multiply-adds.
struct AdamWConstants {
  float decay_factor;     // 1 - lr * weight_decay
  float one_minus_beta1;  // lerp weight w
  float beta2, one_minus_beta2;
  float eps;
  float negative_step_size;     // -lr / (1 - beta1^t)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t)
  float grad_scale;             // clipping coefficient / fp16 loss scale, 1 when neither applies
};
// `grad` is float (fp32 training) or the 16-bit reduced gradient, widened
// here; `param` is always fp32: the parameters themselves in fp32, the
// master weights in mixed precision.
template <class Grad>
Z2_HD inline void adamw_update(const AdamWConstants& constants, bool decay, float* param, const Grad* grad, float* m,
                               float* v, size_t i) {
  // In AdamW's own notation: g the gradient, p the parameter, m and v the
  // moments (torch's exp_avg and exp_avg_sq).
  float g = to_float(grad[i]);
  if (constants.grad_scale != 1.0f) g = g * constants.grad_scale;
  float p = param[i];
  if (decay) p = p * constants.decay_factor;
  const float w = constants.one_minus_beta1;  // m.lerp_(g, w): exact at both ends
  float m_new = w < 0.5f ? m[i] + w * (g - m[i]) : g - (g - m[i]) * (1.0f - w);
  float v_new = v[i] * constants.beta2 + (constants.one_minus_beta2 * g) * g;
  float denom = sqrtf(v_new) / constants.bias_correction2_sqrt + constants.eps;
  param[i] = p + (constants.negative_step_size * m_new) / denom;
  m[i] = m_new;
  v[i] = v_new;
}

// ----------------------------------------------------------------------------
// 3. Compute backend

enum class Device { cpu, cuda };
enum class MemoryKind {
  params,        // full working parameters, every stage: fp32 (4 Psi) or 16-bit (2 Psi)
  grads,         // full gradients (stages 0, 1) or the own gradient shard (stage 2), same type
  optimizer,     // AdamW m and v, fp32 (full in stage 0, own shard in stages 1, 2)
  master,        // fp32 master weights in mixed precision (as m); none in fp32
  accumulation,  // open blocks of the accumulation tree (A > 1 only)
  staging,       // constant-size gradient staging and receive buffers
  activations,   // the model's activations and temporaries
  bookkeeping,   // small engine tables: norm chunk sums, weight-decay flags
  count
};
const char* to_string(Device device);
const char* to_string(MemoryKind kind);

// Whether a CUDA device can be used here; if not, `why` says what the runtime said.
bool cuda_available(std::string* why = nullptr);
bool built_with_cuda();
bool built_with_nccl();

struct Stream {
  void* handle = nullptr;  // cudaStream_t on cuda; unused on cpu (work runs in program order)
};
struct Event {
  void* handle = nullptr;  // cudaEvent_t on cuda
};

// Where device memory comes from (ZeRO-R's M_D, paper section 6.3; notes/05).
//   direct: every buffer is its own cudaMalloc (host allocation on cpu); the
//           engine's tests and the MLP demo use it.
//   arena:  one block of `capacity` bytes reserved at start-up. allocate()
//           carves long-lived buffers from its bottom (model states, staging,
//           checkpoints: a bump pointer); push()/pop() run a stack from its
//           top for per-block temporaries, strictly last in, first out.
//           Neither searches anything, so after start-up no allocation is
//           made at all, and free memory is always one piece.
//   naive:  the same block, but every buffer (pushed or allocated) comes from
//           a best-fit free list and goes back to it when released, in program
//           order: a model of a framework's caching allocator without the
//           arena. Long-lived buffers land between short-lived ones and the
//           free memory breaks into pieces.
//   caching: PyTorch's CUDA caching allocator, modelled (zero2.cu section 2):
//           sizes rounded to 512 bytes, small and large pools of blocks split
//           inside segments of 2 MiB, 20 MiB or the request rounded to 2 MiB,
//           merged only inside their segment, segments cached, never returned
//           (except to retry a request the device refused). `capacity` is
//           what the device lets the segments take; nothing is reserved.
enum class Allocator { direct, arena, naive, caching };
const char* to_string(Allocator allocator);

// The arena's books, kept apart from the memory they describe (the arena
// lab's seams, notes/labs): offsets into one block of `capacity` bytes.
// [0, bottom) holds the long-lived buffers, [top, capacity) the stack of
// temporaries, and the free memory is the middle, always one piece. Sizes
// come rounded (Compute rounds every request to its block size).
struct ArenaBooks {
  size_t capacity = 0, bottom = 0, top = 0;
  std::vector<size_t> stack;  // the offset of every pushed buffer, oldest first
};
constexpr size_t arena_full = SIZE_MAX;  // what allocate and push return when the middle is too small
// A long-lived buffer from the bottom (a bump pointer), or a temporary
// from the top: its offset, or arena_full.
size_t arena_allocate(ArenaBooks& books, size_t bytes);
size_t arena_push(ArenaBooks& books, size_t bytes);
// A temporary back: it must be the last one pushed (the stack is last in,
// first out), else usage_error.
void arena_pop(ArenaBooks& books, size_t offset, size_t bytes);
// A long-lived buffer back: the bump pointer steps back over it when it is
// the last one; any other keeps its place (the arena never fills a hole).
void arena_release(ArenaBooks& books, size_t offset, size_t bytes);

// ZeRO-R's activation offload (paper section 6.1, "CPU offload"; the offload
// lab's seam): a model of `layers` blocks keeps block l's input, checkpoint
// l, on the host between forward and backward for l = 0 .. layers-2 (the
// last block's input stays). Backward runs block = layers-1 down to 0;
// before each block's backward the model starts copying back the checkpoint
// this returns (-1: none) on the copy stream, and block l waits for
// checkpoint l. One block ahead, the copy of checkpoint l-1 overlaps block
// l's backward, and at most two checkpoints are on the device at once.
int checkpoint_to_prefetch(int block, int layers);

// Thrown when the block cannot serve a request. The message says what was
// asked, how much is free, in how many pieces, and the largest piece. Every
// rank makes the same requests in the same order (the trainer sees to it), so
// every rank throws at the same point and they all stop together.
struct OutOfMemory : Error {
  using Error::Error;
};

// Byte counts per kind; `current` now, `peak` the high-water mark.
struct MemoryCounters {
  size_t current[(int)MemoryKind::count] = {};
  size_t peak[(int)MemoryKind::count] = {};
  size_t total_current = 0, total_peak = 0;              // live bytes (what buffers asked for)
  size_t reserved_current = 0, reserved_peak = 0;        // bytes of the block in use (zero2.cu section 2: "reserved =")
  size_t host_pinned_current = 0, host_pinned_peak = 0;  // staging for --comm mpi on cuda
  size_t host_offload_current = 0, host_offload_peak = 0;  // activation checkpoints moved to the host
  long allocations = 0;     // allocator calls that find memory (cudaMalloc, a free-list search, a bump at start-up)
  long pushes = 0;          // arena stack pushes (pointer arithmetic inside the reserved block)
  long device_mallocs = 0;  // cudaMalloc (or host allocations on cpu) of device memory
};

// One point of a memory trace (Compute::set_tracing): after each allocate,
// release, push or pop, the live bytes, the reserved bytes, the live
// activation bytes, and how many pieces the free memory of the block is in.
struct MemorySample {
  size_t live = 0, reserved = 0, activations = 0, free_pieces = 0;
};

class Compute {
 public:
  // `device_index` chooses the GPU (ranks on one host share GPUs round-robin).
  Compute(Device device, int device_index = 0);
  ~Compute();
  Compute(const Compute&) = delete;
  Compute& operator=(const Compute&) = delete;

  Device device() const { return device_; }
  bool on_cuda() const { return device_ == Device::cuda; }
  int device_index() const { return device_index_; }
  Stream compute_stream() const { return compute_stream_; }
  Stream comm_stream() const { return comm_stream_; }
  Stream copy_stream() const { return copy_stream_; }  // activation offload and prefetch

  // Choose the allocator before the first allocation. arena and naive
  // reserve their one block of `capacity` bytes here.
  void use_allocator(Allocator allocator, size_t capacity);
  Allocator allocator() const { return allocator_; }
  size_t capacity() const;  // the block's size (0 for direct)

  // Device memory (host memory on cpu), zero-filled, counted by kind.
  // allocate/release: long-lived buffers. push/pop: temporaries, popped in
  // the reverse order of their pushes (the arena's stack; the same as
  // allocate/release for naive and direct). Buffers of kind `activations` are
  // only used on the compute stream (or after an event on it), so releasing
  // one does not wait: work queued later on the compute stream reuses it safely.
  void* allocate(size_t bytes, MemoryKind kind);
  void release(void* pointer);
  void* push(size_t bytes, MemoryKind kind);
  void pop(void* pointer);
  // What push() of an `activations` buffer leaves in it: zeros (as every
  // other buffer gets; the default), nothing in particular (`none`: for a
  // model that writes every element before it reads it, to which the zeroing
  // was one more pass over the memory; BERT-mini's trainer), or all bits set
  // (`poison`: NaN in fp32, bf16 and fp16, so a read of an unwritten element
  // changes the run's bits; the trainer's --poison-activations, which the
  // suite compares with the plain run).
  enum class PushFill { zero, none, poison };
  void set_activation_fill(PushFill fill) { activation_fill_ = fill; }
  // Page-locked host memory (cudaMallocHost on cuda, plain on cpu). `offload`
  // counts it as activation offload space rather than communication staging.
  void* allocate_host_pinned(size_t bytes, bool offload = false);
  void release_host_pinned(void* pointer);
  const MemoryCounters& memory() const { return counters_; }
  void reset_peaks();  // peaks start again from what is allocated now
  // Free memory of the block, for messages and tests: total, pieces, largest.
  void free_space(size_t* total, size_t* pieces, size_t* largest) const;
  // Record a MemorySample at every allocator event while on.
  void set_tracing(bool on);
  const std::vector<MemorySample>& trace() const { return trace_; }

  // Copies are asynchronous on `stream` for cuda (host side must be pinned to
  // really overlap) and immediate on cpu.
  void copy(void* destination, const void* source, size_t bytes, Stream stream);
  void fill_zero(void* destination, size_t bytes, Stream stream) { fill_bytes(destination, 0, bytes, stream); }
  void fill_bytes(void* destination, unsigned char value, size_t bytes, Stream stream);  // memset
  void synchronize(Stream stream);
  void synchronize_all();

  Event create_event();
  void destroy_event(Event event);
  void record(Event event, Stream stream);
  bool query(Event event);                // true once the recorded work has finished
  void wait(Stream waiter, Event event);  // GPU-side: `waiter` waits, the host does not

  // Row-major C[M x N] = alpha * op(A) op(B) + beta * C, with op(X) = X or X^T:
  // OpenBLAS sgemm on cpu, cuBLAS sgemm on the compute stream on cuda; in
  // portable mode (set_portable, below) zero2's own kernels on both.
  void gemm(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const float* A, int lda,
            const float* B, int ldb, float beta, float* C, int ldc);

  // `batch` independent products of the same shape, C_k = alpha op(A_k)
  // op(B_k) + beta C_k with X_k = X + k * stride_x (elements): one cuBLAS
  // strided-batched call on cuda (the heads of an attention layer), a loop of
  // gemm on cpu (so on cpu each product has exactly gemm's bits; cuBLAS may
  // pick another kernel for the batched call, deterministic all the same).
  void gemm_batched(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const float* A, int lda,
                    long stride_a, const float* B, int ldb, long stride_b, float beta, float* C, int ldc, long stride_c,
                    int batch);

  // The same with 16-bit A, B and C (mixed precision, notes/08): exact
  // products summed in fp32, alpha and beta in fp32, C rounded once. On cuda
  // cublasGemmEx / cublasGemmStridedBatchedEx with CUBLAS_COMPUTE_32F (and no
  // reduced-precision split-K reduction); on cpu the operands are widened to
  // fp32 in host scratch (outside the ledger, as cuBLAS's workspace is) and
  // sgemm runs: the same products and the same one rounding of C, so the CPU
  // path is a faithful reference (its summation order is OpenBLAS's).
  void gemm(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const bfloat16* A, int lda,
            const bfloat16* B, int ldb, float beta, bfloat16* C, int ldc);
  void gemm(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const float16* A, int lda,
            const float16* B, int ldb, float beta, float16* C, int ldc);
  void gemm_batched(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const bfloat16* A, int lda,
                    long stride_a, const bfloat16* B, int ldb, long stride_b, float beta, bfloat16* C, int ldc,
                    long stride_c, int batch);
  void gemm_batched(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const float16* A, int lda,
                    long stride_a, const float16* B, int ldb, long stride_b, float beta, float16* C, int ldc,
                    long stride_c, int batch);

  // Portable mode (the trainer's --portable; notes/11): every gemm above is
  // zero2's own, in the order portable_dot defines (a blocked, vectorised CPU
  // kernel; a tiled CUDA kernel), in place of OpenBLAS / cuBLAS, whose
  // summation order depends on the CPU or GPU they run on. With it a run's
  // bits depend on its inputs alone. The 16-bit products widen their
  // operands exactly, as the cpu path always does, and round C once.
  // The CPU kernel's vector width is this build's widest, or the one the
  // environment's Z2_PORTABLE_LANES names (16, 8 or 1; a bad value is refused
  // here): a narrower schedule must train to the same bits, which the suite
  // shows as OPENBLAS_CORETYPE forces OpenBLAS's kernels.
  void set_portable(bool on);
  bool portable() const { return portable_; }

  // Seconds spent inside the gemm (OpenBLAS's sgemm or, in portable mode,
  // zero2's) since this Compute was made (cpu only: on cuda the calls only
  // queue work, so there is nothing to time on the host). `make bench`
  // prints it as the step's gemm share.
  double gemm_seconds() const { return gemm_seconds_; }

  // Run body(i) for i in [0, n) (a Z2_LOOP): a CPU loop, or one CUDA thread
  // per i on `stream`.
  template <class Body>
  void for_each(size_t n, Body body, Stream stream);
  template <class Body>
  void for_each(size_t n, Body body) {
    for_each(n, body, compute_stream_);
  }
  // body(row, column) for every cell of a [rows, columns] grid (Z2_LOOP2): on
  // cpu rows outer and columns inner; on cuda one thread per cell. As for
  // any kernel, no cell may read what another cell writes (the CPU loop tells
  // the compiler so, to vectorise it).
  template <class Body>
  void for_each(size_t rows, size_t columns, Body body);
  // sums[column] = the sum over rows of element(row, column) (Z2_LOOP2
  // returning float), added in row order 0, 1, ..., rows - 1 from 0.0f and
  // stored once as T: the fixed order of the bias and LayerNorm gradients. On
  // cpu the rows are the outer loop (every column's running sum advances one
  // row at a time: the same order, vectorised across columns, in fp32
  // scratch); on cuda one thread per column walks its rows.
  template <class T, class Element>
  void column_sums(size_t rows, size_t columns, Element element, T* sums);

 private:
  void* device_malloc(size_t bytes);  // cudaMalloc / aligned host allocation, zeroed
  void device_free(void* pointer);    // cudaFree / free
  void* caching_take(size_t bytes, MemoryKind kind);
  void caching_give_back(char* start);
  void* take(size_t bytes, MemoryKind kind, bool from_stack);
  void give_back(void* pointer, bool from_stack);
  [[noreturn]] void out_of_memory(size_t bytes, MemoryKind kind, size_t segment = 0) const;  // segment: caching's ask
  void count(void* pointer, size_t bytes, MemoryKind kind);
  size_t reserved_now() const;
  void sample();
  void gemm_16bit(Precision precision, bool transpose_a, bool transpose_b, int M, int N, int K, float alpha,
                  const void* A, int lda, long stride_a, const void* B, int ldb, long stride_b, float beta, void* C,
                  int ldc, long stride_c, int batch);
  Device device_;
  int device_index_;
  Stream compute_stream_, comm_stream_, copy_stream_;
  void* cublas_ = nullptr;        // cublasHandle_t for fp32: pedantic math (no TF32)
  void* cublas_16bit_ = nullptr;  // cublasHandle_t for 16-bit inputs: tensor cores, fp32 accumulation
  Allocator allocator_ = Allocator::direct;
  MemoryCounters counters_;
  bool tracing_ = false;
  PushFill activation_fill_ = PushFill::zero;
  std::vector<MemorySample> trace_;
  double gemm_seconds_ = 0;            // see gemm_seconds()
  bool portable_ = false;              // see set_portable()
  int portable_lanes_ = 1;             // the CPU schedule's vector width in portable mode
  std::vector<float> column_scratch_;  // column_sums' running sums on cpu (kept: no page faults per call)
  struct Resources;
  std::unique_ptr<Resources> resources_;  // pointer -> (bytes, kind), and the block's bookkeeping
};

// The portable product's CPU kernel (zero2.cu, section 2), callable on host
// memory for the tests: row-major C [M x N] = alpha op(A) op(B) + beta C in
// portable_dot's order, by the schedule of `lanes` floats per vector (16:
// AVX-512, 8: AVX2 with FMA, 1: scalar fma, the one every CPU has).
// portable_gemm_lanes() is the widest this build was compiled for; the others
// exist so that the tests compare every schedule with the definition.
int portable_gemm_lanes();
bool portable_gemm_has_lanes(int lanes);
void portable_gemm_cpu(int lanes, bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const float* A,
                       int lda, const float* B, int ldb, float beta, float* C, int ldc);

// A typed, owning device array: frees itself, counts itself in the ledger.
template <class T>
class DeviceArray {
 public:
  DeviceArray() = default;
  DeviceArray(Compute& compute, size_t count, MemoryKind kind)
      : compute_(&compute),
        count_(count),
        data_(count ? static_cast<T*>(compute.allocate(count * sizeof(T), kind)) : nullptr) {}
  ~DeviceArray() { reset(); }
  DeviceArray(DeviceArray&& other) noexcept { *this = std::move(other); }
  DeviceArray& operator=(DeviceArray&& other) noexcept {
    if (this != &other) {
      reset();
      compute_ = other.compute_, count_ = other.count_, data_ = other.data_;
      other.data_ = nullptr, other.count_ = 0;
    }
    return *this;
  }
  void reset() {
    if (data_) compute_->release(data_);
    data_ = nullptr, count_ = 0;
  }
  T* data() const { return data_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }

 private:
  Compute* compute_ = nullptr;
  size_t count_ = 0;
  T* data_ = nullptr;
};

#if defined(__CUDACC__)
// The kernel paired with its launcher: one thread per index, 256 per block.
// The index is computed in 64 bits (blockIdx.x * blockDim.x overflows 32 bits
// past 4G elements).
template <class Body>
__global__ void for_each_kernel(size_t n, Body body) {
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) body(i);
}
void launch_check(const char* file, int line);  // cudaGetLastError after a launch
#endif

// The host half of a Z2_LOOP / Z2_LOOP2 (or the plain lambda of the g++
// build), and the device half (which only the nvcc build has).
template <class Body>
const Body& host_body(const Body& body) {
  return body;
}
template <class HostBody, class DeviceBody>
const HostBody& host_body(const Loop<HostBody, DeviceBody>& loop) {
  return loop.host;
}
template <class Body>
const Body& device_body(const Body& body) {
  return body;
}
template <class HostBody, class DeviceBody>
const DeviceBody& device_body(const Loop<HostBody, DeviceBody>& loop) {
  return loop.device;
}

template <class Body>
void Compute::for_each(size_t n, Body body, Stream stream) {
  if (n == 0) return;
  if (device_ == Device::cpu) {
    const auto& host = host_body(body);
    for (size_t i = 0; i < n; ++i) host(i);
    return;
  }
#if defined(__CUDACC__)
  const unsigned threads = 256;
  const size_t blocks = (n + threads - 1) / threads;
  for_each_kernel<<<(unsigned)blocks, threads, 0, (cudaStream_t)stream.handle>>>(n, device_body(body));
  launch_check(__FILE__, __LINE__);
#else
  (void)stream;
  usage_error("for_each on cuda called from a file not compiled by nvcc");
#endif
}

#if defined(__CUDACC__)
template <class Body>
__global__ void for_each_2d_kernel(size_t rows, size_t columns, Body body) {
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < rows * columns) body(i / columns, i % columns);
}
template <class T, class Element>
__global__ void column_sums_kernel(size_t rows, size_t columns, Element element, T* sums) {
  size_t column = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (column >= columns) return;
  float sum = 0.0f;
  for (size_t row = 0; row < rows; ++row) sum += element(row, column);
  sums[column] = from_float<T>(sum);
}
#endif

template <class Body>
void Compute::for_each(size_t rows, size_t columns, Body body) {
  if (rows == 0 || columns == 0) return;
  if (device_ == Device::cpu) {
    const auto& host = host_body(body);
    for (size_t row = 0; row < rows; ++row)
    // Cells are independent (on cuda each is its own thread), which is what
    // ivdep tells the compiler: no alias check stands between it and vectors.
#pragma GCC ivdep
      for (size_t column = 0; column < columns; ++column) host(row, column);
    return;
  }
#if defined(__CUDACC__)
  const unsigned threads = 256;
  const size_t blocks = (rows * columns + threads - 1) / threads;
  for_each_2d_kernel<<<(unsigned)blocks, threads, 0, (cudaStream_t)compute_stream_.handle>>>(rows, columns,
                                                                                             device_body(body));
  launch_check(__FILE__, __LINE__);
#else
  usage_error("for_each on cuda called from a file not compiled by nvcc");
#endif
}

template <class T, class Element>
void Compute::column_sums(size_t rows, size_t columns, Element element, T* sums) {
  if (columns == 0) return;
  if (device_ == Device::cpu) {
    const auto& host = host_body(element);
    column_scratch_.assign(columns, 0.0f);
    float* running = column_scratch_.data();  // [columns] the sums over the rows so far
    for (size_t row = 0; row < rows; ++row)
#pragma GCC ivdep
      for (size_t column = 0; column < columns; ++column) running[column] += host(row, column);
    for (size_t column = 0; column < columns; ++column) sums[column] = from_float<T>(running[column]);
    return;
  }
#if defined(__CUDACC__)
  const unsigned threads = 256;
  const size_t blocks = (columns + threads - 1) / threads;
  column_sums_kernel<<<(unsigned)blocks, threads, 0, (cudaStream_t)compute_stream_.handle>>>(
      rows, columns, device_body(element), sums);
  launch_check(__FILE__, __LINE__);
#else
  usage_error("column_sums on cuda called from a file not compiled by nvcc");
#endif
}

// ----------------------------------------------------------------------------
// 4. Communicator

enum class CommBackend { mpi, nccl };
enum class Collectives { deterministic, native };
const char* to_string(CommBackend backend);
const char* to_string(Collectives collectives);

// Bytes this rank sent, by collective. Counted as a ring algorithm sends them,
// (N-1)/N of the buffer per reduce-scatter or all-gather, so the deterministic
// all-to-all and the libraries' own collectives are counted alike.
struct CommCounters {
  size_t reduce_scatter = 0, all_gather = 0, all_reduce = 0, other = 0;
  size_t total() const { return reduce_scatter + all_gather + all_reduce + other; }
};

class Communicator {
 public:
  // Collective over `mpi_comm` (duplicated inside). With nccl it needs one GPU
  // per rank on each host and creates an NCCL communicator over the same ranks.
  Communicator(Compute& compute, MPI_Comm mpi_comm, CommBackend backend, Collectives collectives);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  CommBackend backend() const { return backend_; }
  Collectives collectives() const { return collectives_; }
  MPI_Comm mpi() const { return mpi_comm_; }
  void* nccl() const { return nccl_; }  // ncclComm_t
  Compute& compute() const { return compute_; }
  CommCounters& counters() { return counters_; }

  // Small host-side helpers for scalars (loss, norm chunk sums): always MPI.
  // Counted under "other".
  // `what` names it for the watchdog's message ("the micro-batch losses").
  void all_gather_host(const float* send, size_t count, float* receive, const std::string& what = "floats");
  bool all_agree(bool local_ok);  // logical AND over ranks
  bool any_rank(bool local);      // logical OR over ranks (one flag, max-reduced), counted under "other"
  void barrier();
  // MPI_SUM for fp32; for bf16 / fp16 an MPI_Op that adds in fp32 and rounds
  // each partial sum back to 16 bits, as NCCL's 16-bit sum does (native
  // collectives only: the deterministic ones do no arithmetic in MPI).
  MPI_Op sum_op(Precision precision) const;

 private:
  Compute& compute_;
  MPI_Comm mpi_comm_ = MPI_COMM_NULL;
  int rank_ = 0, world_size_ = 1;
  CommBackend backend_;
  Collectives collectives_;
  void* nccl_ = nullptr;
  CommCounters counters_;
  MPI_Op sum_bf16_ = MPI_OP_NULL, sum_fp16_ = MPI_OP_NULL;
};

// Where the reduced shard of a bucket goes: straight into `result` (steps = 1),
// or into the accumulation tree as micro-step `step` of `steps`
// (accumulate_micro_step). `result` and the stack entries point at the
// bucket's own region; `result` has the exchange's wire type (the gradient's
// type), the entries its accumulation type.
struct AccumulateInto {
  void* result = nullptr;
  AccumulationStackOf<void> stack{};
  long step = 0, steps = 1;
};

// The bucket collectives, non-blocking, in a fixed number of constant-size
// slots (notes/06; the deterministic forms are described in
// zero2.cu section 4). A bucket of `padded` elements splits into N shards of
// padded / N; rank r owns elements [r * shard, (r + 1) * shard).
class BucketExchange {
 public:
  // `max_padded` bounds every bucket; with `bucket_buffers` each slot also has
  // a buffer backward can write a bucket's gradient into (stage 2). `wire` is
  // the element type of buckets, gradients and parameters alike (what goes on
  // the wire: 4 or 2 bytes an element); the N slices are always summed in
  // fp32, and the accumulation tree's blocks are fp32 (`accumulate_fp32`) or
  // of the wire type.
  BucketExchange(Compute& compute, Communicator& comm, size_t max_padded, int slots, bool bucket_buffers,
                 Precision wire = Precision::fp32, bool accumulate_fp32 = true);
  ~BucketExchange();
  BucketExchange(const BucketExchange&) = delete;
  BucketExchange& operator=(const BucketExchange&) = delete;

  // Take a free slot for bucket `bucket`, finishing the oldest transfer if all
  // are busy. Throws if every slot is held by a bucket not yet handed over.
  int acquire(int bucket);
  int slot_of(int bucket) const;  // the slot `bucket` holds, or -1
  // The slot's bucket buffer (wire type), zeroed, once the compute stream may write it.
  void* open_bucket_buffer(int slot, size_t padded);

  // Each collective runs in `slot` (from acquire) and frees it when finished.
  // `bucket` holds `padded` elements of the wire type.
  // reduce_scatter: the sum over ranks of `bucket`'s own slice, into `into`.
  void reduce_scatter(int slot, void* bucket, size_t padded, const AccumulateInto& into);
  // all_gather: in place, rank r's shard at r * shard (NCCL's layout).
  void all_gather(int slot, void* bucket, size_t padded);
  // all_reduce: in place. The reduce-scatter half goes through `into`, whose
  // result must be the bucket's own slice (so the final micro-step of an
  // accumulation can fold into it), then the slices are all-gathered.
  void all_reduce(int slot, void* bucket, size_t padded, const AccumulateInto& into);

  void progress();    // advance every transfer as far as it goes without blocking
  void finish_all();  // block until every transfer has finished

  // Its parts (zero2.cu section 4): the slots, the queue of transfers in
  // flight, the receiver's sums, and one builder of transfers per backend.
  struct Parts;

 private:
  std::unique_ptr<Parts> parts_;
};

// The local rank (rank among the processes of this host) of `comm`.
int local_rank_of(MPI_Comm comm);
// Bytes one rank of `comm` can plan to use on `device`, and where that figure
// came from: the smallest over all ranks of what its host (or GPU) can give,
// divided by the ranks sharing it: on cpu the smaller of MemAvailable and the
// cgroup's limit less its usage (v2 or v1); on cuda the current device's free
// memory. ZERO2_MEMORY_LIMIT=BYTES (for tests, and for users who want a lower
// ceiling) lowers it to BYTES per rank; it never raises it. Call it after
// constructing the Compute (which selects the rank's GPU). Collective; the
// same value and source on every rank, so a "does not fit" decision is taken
// by all ranks together.
struct MemoryLimit {
  size_t bytes = 0;
  std::string source;  // e.g. "MemAvailable (/proc/meminfo) / 2 ranks on this host"
};
MemoryLimit memory_per_rank(Device device, MPI_Comm comm);

// Resolve --device auto / --comm auto the same way on every rank.
Device choose_device(const std::string& requested, MPI_Comm comm);
CommBackend choose_comm(const std::string& requested, Device device, MPI_Comm comm);

// ----------------------------------------------------------------------------
// 5. The engine

// fp16's loss scaling, with DeepSpeed's "fp16" config keys and defaults
// (deepspeed/runtime/fp16/loss_scaler.py, DynamicLossScaler): the loss, and so
// every gradient, is multiplied by a power of two large enough that small
// gradients do not vanish below fp16's 2^-24, and small enough that none
// overflows 65504. An overflow anywhere skips the step and, after
// `hysteresis` of them, halves the scale; `window` clean steps double it.
struct LossScaling {
  double static_scale = 0;              // "loss_scale": > 0 a fixed scale (no halving or doubling), 0 dynamic
  int initial_scale_power = 16;         // "initial_scale_power": the dynamic scale starts at 2^this
  long window = 1000;                   // "loss_scale_window": clean steps before the scale doubles
  int hysteresis = 2;                   // "hysteresis": overflows before the scale halves (DeepSpeed's delayed_shift)
  bool consecutive_hysteresis = false;  // "consecutive_hysteresis": a clean step restores the hysteresis
  double min_scale = 1;                 // "min_loss_scale": an overflow at this scale stops the run
};

// What a loss scaler carries from step to step: a checkpoint holds it, and
// a resumed run goes on with the same scale, hysteresis and window.
struct LossScalerState {
  double scale = 1;
  int hysteresis_left = 1;
  long iteration = 0, last_overflow = -1;
};

// DeepSpeed's DynamicLossScaler.update_scale, step by step (its LossScaler
// when the scale is static; scale 1 and no updates outside fp16).
class LossScaler {
 public:
  LossScaler(const LossScaling& settings, bool fp16);
  LossScalerState state() const { return {scale_, hysteresis_left_, iteration_, last_overflow_}; }
  void restore(const LossScalerState& state);
  double scale() const { return scale_; }
  bool dynamic() const { return dynamic_; }
  int hysteresis_left() const { return hysteresis_left_; }
  long iteration() const { return iteration_; }          // update() calls so far (DeepSpeed's cur_iter)
  long last_overflow() const { return last_overflow_; }  // the iteration of the last overflow, -1 if none
  // After every step's overflow check, on every rank with the same verdict.
  // Throws z2::Error when an overflow comes at the minimum scale with no
  // hysteresis left (DeepSpeed raises "Current loss scale already at minimum").
  void update(bool overflow);

 private:
  LossScaling settings_;
  bool dynamic_ = false;
  double scale_ = 1;
  int hysteresis_left_ = 1;
  long iteration_ = 0, last_overflow_ = -1;
};

struct EngineOptions {
  int stage = 2;                   // 0: data parallel, 1: P_os, 2: P_os+g
  long bucket_elements = 1 << 20;  // rounded up to a multiple of norm_chunk
  bool overlap = true;             // reduce buckets while backward goes on
  int accumulation_steps = 1;      // A micro-steps per optimizer step
  double clip = 0.0;               // global-norm clipping threshold; <= 0: off
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
  // Adam's bias corrections 1 / (1 - beta1^t) and sqrt(1 - beta2^t), as
  // torch applies them; false drops both (DeepSpeed's FusedAdam
  // bias_correction false, as bing_bert trains).
  bool bias_correction = true;
  // Learning rate of optimizer step `step` (1-based, as torch counts); when
  // empty, `lr` is used throughout. This is the hook for warmup and decay.
  std::function<double(long step)> lr_schedule;
  // Mixed precision (notes/08): bf16 or fp16 working parameters and
  // gradients (2 bytes each), fp32 master weights and AdamW state. fp32: the
  // parameters are their own master copy.
  Precision precision = Precision::fp32;
  // A > 1 in mixed precision: the accumulation tree's blocks in fp32
  // (data_types.grad_accum_dtype "fp32", zero2's default), or 16-bit (what
  // DeepSpeed does under ZeRO when the key is absent). Only fp32 blocks keep
  // (N, A) invariance: a 16-bit block rounds a partial sum.
  bool accumulate_fp32 = true;
  LossScaling loss_scaling;  // fp16 only
};

// The global gradient norm is computed over fixed chunks of this many elements
// of the canonical layout (every parameter starts on a chunk boundary), so it
// is independent of N and of the bucket size (notes/06).
constexpr long norm_chunk = 32;

using ParameterId = int;

struct ParameterInfo {
  std::string name;
  size_t numel = 0;
  bool decay = true;
  size_t canonical_offset = 0;  // in the canonical layout (chunk-aligned, N-independent)
  size_t offset = 0;            // in the padded flat buffer (depends on N and bucket)
  int bucket = -1;
};

struct BucketInfo {
  int first_parameter = 0, end_parameter = 0;  // [first, end) in registration order
  size_t offset = 0;                           // start in the padded flat buffer
  size_t length = 0;                           // elements the parameters span (a multiple of norm_chunk)
  size_t padded_length = 0;                    // length rounded up to a multiple of N * norm_chunk
  size_t shard_length = 0;                     // padded_length / N
  size_t shard_offset = 0;                     // start of this bucket's shard in shard space
  size_t canonical_chunk = 0;                  // index of its first norm chunk in the canonical layout
};

// A piece of the canonical order (real elements only, registration order:
// what parameters_to_host() lists) whose optimizer state one rank updates.
struct StateRun {
  size_t canonical = 0;  // first element, in the canonical order
  size_t length = 0;
};

// --- the lab seams (notes/labs) ------------------------------------------------
// Functions of the engine a student can write in its place and have the
// suite grade bit for bit (`make lab LAB=<name> SOLUTION=<file>`). Each is
// called by the engine wherever it needs that idea, so a wrong one breaks the
// stages' equality, not only its own test.
//
//   tree-sum        tree_sum: the canonical summation tree (notes/06). The
//                   engine sums the N ranks' slices, the loss and the norm's
//                   chunk sums with it.
//   reduce-scatter  reduce_scatter_blocking, all_gather_blocking: the plain
//                   blocking collectives over MPI, the reference the engine's
//                   non-blocking bucket exchange is tested against.
//   shards          shard_begin: where rank r's shard of a bucket starts, the
//                   partition of P_os and P_os+g (paper sections 5.1, 5.2).
//   loss-scale      LossScaler::update (above): fp16's dynamic loss scale.
//   arena           arena_allocate, arena_push, arena_pop, arena_release
//                   (ArenaBooks, section 3 of this header): ZeRO-R's contiguous memory
//                   (paper section 6.3), a bump region and a LIFO stack.
//   reshard         reshard_reads: which pieces of a checkpoint saved at any N
//                   fill the optimizer state a rank owns.
//   offload         checkpoint_to_prefetch (section 3 of this header): which activation
//                   checkpoint comes back from the host, one block ahead.
//   own-shards      update_region, update_and_gather: stage 1's optimizer step
//                   (P_os, paper 5.1), AdamW on the own shard of every bucket,
//                   then the all-gather of the updated shards.
//   gradient-shards stage2_gradient_output, stage2_gradient_ready: stage 2's
//                   backward (P_os+g, paper 5.2), a staging slot per bucket,
//                   reduce-scattered as soon as the bucket is complete, only
//                   the own shard of the sum kept.

// The canonical tree (canonical_tree_sum, section 2) over leaves [n].
float tree_sum(long n, const float* leaves);
// Blocking, deterministic, fp32, over every rank of `comm` (N ranks):
// bucket [N x shard_elements] on every rank; rank r receives in shard
// [shard_elements] element i of the sum over ranks j = 0..N-1 of bucket_j[r
// shard_elements + i], summed with tree_sum in rank order.
void reduce_scatter_blocking(const float* bucket, float* shard, size_t shard_elements, MPI_Comm comm);
// shard [shard_elements] of every rank into bucket [N x shard_elements], rank
// r's at r x shard_elements.
void all_gather_blocking(const float* shard, float* bucket, size_t shard_elements, MPI_Comm comm);
// The first element of rank `rank`'s shard of `bucket` in the padded flat
// buffer (parameters, full gradients): the bucket's offset plus `rank` shards.
size_t shard_begin(const BucketInfo& bucket, int rank);

// The own-shards lab. A rank's update region of a bucket: the elements whose
// AdamW update it makes, in the three index spaces the engine's buffers use
// (all in elements):
//   parameter  in the padded flat buffer of parameters [Psi_padded];
//   gradient   in the gradient buffer: [Psi_padded] in stages 0 and 1 (the
//              full gradient), [Psi_padded / N] in stage 2 (the own shards,
//              one bucket's after another);
//   state      in the optimizer-state buffers (AdamW's m and v, and the fp32
//              master in mixed precision): [Psi_padded] in stage 0, [Psi_padded
//              / N] in stages 1 and 2;
//   length     how many elements, the same run in each.
struct UpdateRegion {
  size_t parameter = 0, gradient = 0, state = 0, length = 0;
};
UpdateRegion update_region(const BucketInfo& bucket, int stage, int rank);
// What the engine lends update_and_gather (the calls are the engine's own):
class OwnShards {
 public:
  virtual ~OwnShards() = default;
  // AdamW, with this step's constants, on update_region(bucket, stage, rank).
  virtual void adamw(int bucket) = 0;
  // Start the all-gather of bucket `bucket`'s parameters, in place: rank r's
  // shard, from shard_begin(bucket, r), to every rank. The engine waits for
  // every all-gather after update_and_gather returns.
  virtual void all_gather(int bucket) = 0;
};
// The stage's optimizer step over `buckets` (the engine's layout): the AdamW
// updates this rank makes and the all-gathers that follow them.
void update_and_gather(OwnShards& shards, const std::vector<BucketInfo>& buckets, int stage);

// The gradient-shards lab. Stage 2's backward has no full gradient buffer:
// a bucket's gradients are written into one of a few staging slots (two),
// and the slot comes back once the bucket's reduce-scatter has finished.
// What the engine lends the two hooks below (the calls are the engine's own;
// each refuses a call out of order with a message):
class GradientShards {
 public:
  virtual ~GradientShards() = default;
  // Does bucket `bucket` hold a slot now (from its take_slot to the end of its reduce-scatter)?
  virtual bool holds_slot(int bucket) const = 0;
  // Take a free slot for the bucket and zero its buffer [padded_length],
  // waiting for the oldest reduce-scatter when no slot is free.
  virtual void take_slot(int bucket) = 0;
  // Element `index` of the bucket's slot buffer, where backward writes.
  virtual void* slot_element(int bucket, size_t index) = 0;
  // How many of the bucket's parameters have been handed over in this
  // micro-step, the one being handed over included.
  virtual int handed_over(int bucket) const = 0;
  // Start the reduce-scatter of the bucket's slot (non-blocking): this rank's
  // shard of the sum over ranks is kept from element `keep` of the gradient
  // shard [Psi_padded / N] (through the accumulation tree when A > 1).
  virtual void reduce_scatter(int bucket, size_t keep) = 0;
};
// Where backward writes the gradient of a parameter of bucket `bucket` that
// begins `offset_in_bucket` elements into it (the engine's gradient_output in stage 2).
void* stage2_gradient_output(GradientShards& shards, int bucket_index, const BucketInfo& bucket,
                             size_t offset_in_bucket);
// Parameter `parameter` of bucket `bucket` has been handed over (the
// engine's gradient_ready in stage 2).
void stage2_gradient_ready(GradientShards& shards, int bucket_index, const BucketInfo& bucket, int parameter);

// Resharding a checkpoint (notes/09; the reshard lab's seam). A checkpoint
// is files that each hold one range of the canonical order, together
// [0, Psi) in order (`files`, as runs); a rank of the loading run owns
// `owned` (Engine::owned_state_runs, at its own N and stage). The reads that
// fill the owned state, in order: read k copies elements [canonical,
// canonical + length) of the canonical order from file `file` to position
// `into` of the owned state (the owned runs one after another).
struct ReshardRead {
  size_t file = 0, canonical = 0, length = 0, into = 0;
};
std::vector<ReshardRead> reshard_reads(const std::vector<StateRun>& owned, const std::vector<StateRun>& files);

// The fp32 optimizer state of some runs of the canonical order, run after
// run: the master weights (the parameters themselves in fp32), AdamW's
// first and second moments (torch's exp_avg, exp_avg_sq).
struct OptimizerState {
  std::vector<float> master, exp_avg, exp_avg_sq;
};

// Where training stands, beyond the tensors: what a checkpoint must hold
// besides the optimizer state for a resumed run to continue bit for bit.
struct TrainingProgress {
  long steps_taken = 0;  // step() calls (skipped included): the data's position
  long applied = 0;      // updates made (AdamW's t): the learning-rate schedule's position
  long skipped = 0;      // fp16 steps skipped on overflow
  LossScalerState scaler;
};

struct StepReport {
  long step = 0;        // 1-based: step() calls so far, skipped ones included (DeepSpeed's global_steps)
  long applied = 0;     // optimizer updates made so far (AdamW's t; the lr schedule's position)
  float loss = 0;       // canonical-tree sum of the micro-batch loss contributions
  float grad_norm = 0;  // global L2 norm before clipping (unscaled; inf or NaN on an fp16 overflow)
  float clip_coefficient = 1;
  double lr = 0;          // the learning rate of the update (of the update it would have been, when skipped)
  double loss_scale = 1;  // the scale this step's gradients carry (fp16; 1 otherwise)
  bool skipped = false;   // fp16: a gradient overflowed on some rank, so no rank updated
};

struct MemoryLedger {
  Precision precision = Precision::fp32;
  size_t params = 0, grads = 0, optimizer = 0, master = 0;  // model states (measured)
  size_t accumulation = 0, staging = 0, activations = 0, bookkeeping = 0;
  size_t model_states = 0;          // params + grads + optimizer + master
  size_t model_states_formula = 0;  // the paper's formula for this stage, from Psi_padded
  size_t accumulation_formula = 0;  // floor(log2 A) blocks of Psi_padded / N (fp32 or 16-bit elements)
  size_t staging_formula = 0;
  size_t device_current = 0, device_peak = 0, host_pinned = 0;
  // reserved: the peak of the device memory held for the buffers. With
  // Allocator::direct every buffer is its own allocation, so reserved = peak
  // live; with arena and naive it is the peak of the block's used part (see
  // Compute). fragmentation = 1 - peak live / peak reserved.
  size_t reserved = 0, capacity = 0, host_offload_peak = 0;
  double fragmentation = 0;
  // Allocator calls made after the end of optimizer step 1 (-1 before it),
  // and in the last step; arena stack pushes in the last step.
  long device_allocations_after_step1 = -1, device_allocations_per_step = 0, stack_pushes_per_step = 0;
  long device_mallocs = 0;  // cudaMalloc calls (host allocations on cpu) in all
};

struct CommLedger {
  CommCounters per_step;        // measured in the last step
  size_t formula_per_step = 0;  // reduce_scatter + all_gather + all_reduce, from the formula
};

class Engine {
 public:
  Engine(Compute& compute, Communicator& comm, const EngineOptions& options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Register parameters in layer order (first layer first): stage 2 then
  // reduces the last layers' bucket while backward still works on the first.
  ParameterId add_parameter(const std::string& name, size_t numel, bool decay);
  void build();  // fix the layout and allocate; after this, no more parameters

  // The full (working) parameter: every stage keeps all parameters on every
  // rank, in the precision's type (fp32, or the 16-bit copy of the master).
  // `T` must be that type (float, bfloat16 or float16); parameter() is the fp32 form.
  template <class T>
  T* parameter_as(ParameterId id) {
    return static_cast<T*>(parameter_storage(id, precision_of<T>()));
  }
  float* parameter(ParameterId id) { return parameter_as<float>(id); }
  // Where backward writes the gradient of `id` for this micro-step (overwrite,
  // do not accumulate), in the same type, and the call that hands it over.
  // In fp16 the model multiplies its loss gradient by loss_scale() first.
  template <class T>
  T* gradient_output_as(ParameterId id) {
    return static_cast<T*>(gradient_storage(id, precision_of<T>()));
  }
  float* gradient_output(ParameterId id) { return gradient_output_as<float>(id); }
  void gradient_ready(ParameterId id);
  Precision precision() const { return options_.precision; }
  float loss_scale() const { return (float)scaler_.scale(); }  // for this step's backward
  const LossScaler& loss_scaler() const { return scaler_; }
  long skipped_steps() const { return skipped_steps_; }
  // Between layers: lets MPI make progress on buckets in flight.
  void progress();
  // End of a micro-step's backward. `loss` is this micro-batch's contribution
  // to the step's loss (its sum of per-sample losses over the global count).
  void end_micro_step(float loss);
  // After accumulation_steps micro-steps: norm, clipping, AdamW, all-gather.
  StepReport step();

  // The global micro-batch this rank computes at micro-step `a`: a*N + rank
  // (the interleaved assignment of notes/06).
  long micro_batch_index(int a) const;
  int world_size() const;
  int rank() const;
  int micro_steps_done() const { return micro_step_; }
  // Buckets whose reduction started before end_micro_step() in the last
  // micro-step: all of them with overlap (or in stage 2), none without.
  int buckets_reduced_during_backward() const;

  // Layout and shards (for tests, ledgers, notes).
  const std::vector<ParameterInfo>& parameters() const { return parameters_; }
  const std::vector<BucketInfo>& buckets() const { return buckets_; }
  size_t psi() const;         // real parameter elements
  size_t psi_padded() const;  // elements of the padded flat buffer
  size_t canonical_elements() const { return canonical_elements_; }
  // [begin, end) of bucket `bucket`'s shard owned by `rank` in the padded buffer.
  std::pair<size_t, size_t> shard_range(int bucket, int rank) const;

  // The fp32 parameters in canonical order, real elements only, on the
  // host: the master weights in mixed precision. Collective (every rank
  // calls it): in mixed precision stages 1 and 2 hold the master sharded.
  std::vector<float> parameters_to_host();
  // Sets the master weights and the working copy (rounded) from fp32 values.
  void parameters_from_host(const std::vector<float>& canonical);
  uint64_t parameters_hash();  // FNV-1a 64 over parameters_to_host(); collective
  // The working parameters forward and backward use, widened to float
  // (equal to parameters_to_host() in fp32). Every rank holds them all.
  std::vector<float> working_parameters_to_host();
  // The step's reduced gradient (sum over all micro-batches, before clipping;
  // fp16's loss scale divided out) in canonical order, real elements only.
  // Valid after the last end_micro_step() and before step(), where one rank
  // holds all of it: stage 0, or N = 1 (for --dump-batch and the reference checks).
  std::vector<float> gradients_to_host();
  // The gradient buffer as it is, widened to float: [Psi_padded] in stages 0
  // and 1, this rank's shards [Psi_padded / N] in stage 2 (fp16's loss scale
  // still in). After the last end_micro_step() and before step(); the labs'
  // graders read it.
  std::vector<float> gradient_buffer_to_host();

  // --- checkpoints (notes/09) ---
  // The runs of the canonical order whose optimizer state `rank` updates:
  // every element in stage 0, its shard of every bucket in stages 1 and 2.
  std::vector<StateRun> owned_state_runs(int rank) const;
  // This rank's optimizer state for owned_state_runs(rank()), run after run.
  OptimizerState owned_state_to_host();
  // Sets this rank's optimizer state (the same layout), then rebuilds the
  // working parameters from the master on every rank. Collective.
  void owned_state_from_host(const OptimizerState& state);
  // The optimizer state of [begin, end) of the canonical order, whatever
  // rank holds it (each rank asks for its own range; stages 1 and 2
  // exchange the pieces with one all-to-all). Collective.
  OptimizerState state_range_to_host(size_t begin, size_t end);
  TrainingProgress training_progress() const;
  void restore_training_progress(const TrainingProgress& progress);

  MemoryLedger memory_ledger() const;
  CommLedger comm_ledger() const;
  void print_ledgers(FILE* out) const;  // rank 0 should call it
  std::string ledgers_json() const;

  const EngineOptions& options() const { return options_; }
  long optimizer_steps() const { return optimizer_step_; }

  // What this rank holds for the engine (zero2.cu section 6): its model-state
  // buffers, full or sharded by stage, its bucket exchange and the micro-step's
  // bookkeeping, with the kernels and steps that work on them.
  struct RankState;

 private:
  void require_built(const char* what) const;
  void* parameter_storage(ParameterId id, Precision expected);
  void* gradient_storage(ParameterId id, Precision expected);
  std::vector<float> canonical_from_padded(const std::vector<float>& padded) const;
  Compute& compute_;
  Communicator& comm_;
  EngineOptions options_;
  std::vector<ParameterInfo> parameters_;
  std::vector<BucketInfo> buckets_;
  size_t canonical_elements_ = 0;
  bool built_ = false;
  int micro_step_ = 0;
  long optimizer_step_ = 0;  // updates applied (AdamW's t)
  long steps_taken_ = 0;     // step() calls, skipped ones included
  long skipped_steps_ = 0;
  LossScaler scaler_;
  std::unique_ptr<RankState> rank_state_;
};

// --- the memory plan (train_bert_mini --plan; notes/10) ---
// What build() lays out and allocates, from the parameter sizes alone, with
// no engine and no allocation: the planner and build() call these, so the
// plan and the measured ledger cannot drift apart.
std::vector<BucketInfo> lay_out_buckets(const std::vector<size_t>& numels, int world_size, long bucket_elements);
struct EngineBuffers {                           // bytes of each buffer build() allocates
  size_t psi_padded = 0, max_padded_bucket = 0;  // elements
  size_t params = 0, grads = 0, master = 0;
  size_t moment = 0;  // each of AdamW's m and v
  size_t accumulation_blocks = 0, accumulation_block = 0;
  size_t staging = 0, chunk_sums = 0, decay_flags = 0;
  size_t model_states() const;  // params + grads + master + m + v
  size_t live() const;          // every buffer
  size_t reserved() const;      // every buffer rounded up to 256 bytes, as a block serves it
};
EngineBuffers engine_buffers(const std::vector<BucketInfo>& buckets, const EngineOptions& options, int world_size);
// Staging elements of the bucket exchange (of the wire type).
size_t staging_elements(size_t max_padded_bucket, int world_size, int slot_count, bool bucket_buffers);
// Bytes rounded up to 256, as every buffer in a block (arena, naive) starts
// on a 256-byte boundary.
size_t block_round(size_t bytes);
// The caching allocator's rules (Allocator::caching): a request's rounded
// size, and the segment a rounded size asks the device for when no cached
// block holds it.
size_t caching_round_size(size_t bytes);
size_t caching_segment_size(size_t rounded);

// FNV-1a 64 over the bytes of `count` floats.
uint64_t fnv1a64(const float* values, size_t count);

// floor(log2 A): how many open blocks the accumulation tree of A micro-steps
// keeps (each Psi_padded / N elements).
size_t accumulation_blocks(int accumulation_steps);

// The paper's model-state bytes per rank (section 3.1 and Table 1), for Psi
// parameters over N ranks: the one formula the ledger, the fit check and
// the paper's table in notes/08 all use.
//   fp32:            stage 0: 16 Psi   stage 1: 8 Psi + 8 Psi/N    stage 2: 4 Psi + 12 Psi/N
//   bf16, fp16 (K = 12): 16 Psi             4 Psi + 12 Psi/N            2 Psi + 14 Psi/N
double model_states_formula(int stage, Precision precision, double psi, double ranks);
const char* model_states_formula_text(int stage, Precision precision);  // e.g. "2 Psi + 14 Psi/N"
// 1234567 -> "1,234,567", for the ledgers and the trainer's output.
std::string with_commas(size_t value);

}  // namespace z2
