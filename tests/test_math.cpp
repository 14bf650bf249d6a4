// tests/test_math.cpp — zero2's exp, log and erf (zero2.h, "exp, log and erf
// of our own"), which the model calls instead of libm's:
//   1. accuracy on a sample of every 257th float bit pattern (16.7 million
//      inputs, all exponents and both signs): against the double-precision
//      libm function, at most 0.501 ulp and correctly rounded on >= 99.999% of
//      inputs; build/math_accuracy runs the same over every float (notes/07);
//   2. the special inputs (zeros, infinities, NaN, overflow and underflow
//      edges) give exactly IEEE's answers;
//   3. the vectorised loop (as the model's loops run them) and a scalar call
//      through a function pointer give the same bits.
#include <cmath>
#include <limits>

#include "harness.h"
#include "math_accuracy.h"

namespace {

using math_accuracy::Function;

// Called through a pointer: the compiler cannot inline or vectorise it.
float (*volatile scalar_exp)(float) = z2::exp_fp32;
float (*volatile scalar_log)(float) = z2::log_fp32;
float (*volatile scalar_erf)(float) = z2::erf_fp32;

}  // namespace

TEST_CASE("exp, log, erf: within 0.501 ulp of the exact value, and correctly rounded on >= 99.999% of a sample") {
  bool ok = true;
  for (Function function : {Function::exp, Function::log, Function::erf}) {
    const math_accuracy::Result r = math_accuracy::measure(function, 257, 1);
    const double rounded_share = (double)r.correctly_rounded / (double)r.inputs;
    if (harness::rank() == 0)
      MESSAGE(std::string(math_accuracy::name(function))
              << ": " << r.inputs << " inputs, max " << r.max_ulps << " ulp at x = " << r.worst_input
              << ", correctly rounded " << r.correctly_rounded << ", wrong inf/NaN/zero sign " << r.wrong_special);
    // Not 0.5: the double evaluation is within ~4e-13 of the exact value, so
    // a result whose exact value lies that close to a midpoint between two
    // floats can round to the other one (0.5 + 4e-13 / 2^-24 ulp at most).
    ok = ok && r.max_ulps <= 0.501 && rounded_share >= 0.99999 && r.wrong_special == 0 && r.inputs > 8000000;
  }
  CHECK(harness::agree(ok, "exp_fp32 / log_fp32 / erf_fp32 is less accurate than its bound"));
}

TEST_CASE("exp, log, erf: IEEE's answers at zeros, infinities, NaN and the overflow and underflow edges") {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const float smallest = std::numeric_limits<float>::denorm_min(), largest = std::numeric_limits<float>::max();
  struct Case {
    float (*function)(float);
    const char* name;
    float x, expected;
  };
  const Case cases[] = {
      {z2::exp_fp32, "exp", 0.0f, 1.0f},
      {z2::exp_fp32, "exp", -0.0f, 1.0f},
      {z2::exp_fp32, "exp", inf, inf},
      {z2::exp_fp32, "exp", -inf, 0.0f},
      {z2::exp_fp32, "exp", 88.72283f, 3.40279851e38f},  // the largest x with a finite e^x
      {z2::exp_fp32, "exp", 88.7228394f, inf},           // the next float up overflows
      {z2::exp_fp32, "exp", -103.278931f, smallest},     // e^x rounds to the smallest subnormal
      {z2::exp_fp32, "exp", -103.972084f, 0.0f},         // below half of it: 0
      {z2::exp_fp32, "exp", 1.0f, 2.71828175f},
      {z2::log_fp32, "log", 1.0f, 0.0f},
      {z2::log_fp32, "log", 0.0f, -inf},
      {z2::log_fp32, "log", -0.0f, -inf},
      {z2::log_fp32, "log", inf, inf},
      {z2::log_fp32, "log", smallest, -103.278931f},
      {z2::log_fp32, "log", largest, 88.7228394f},
      {z2::log_fp32, "log", 2.0f, 0.693147182f},
      {z2::erf_fp32, "erf", 0.0f, 0.0f},
      {z2::erf_fp32, "erf", -0.0f, -0.0f},
      {z2::erf_fp32, "erf", inf, 1.0f},
      {z2::erf_fp32, "erf", -inf, -1.0f},
      {z2::erf_fp32, "erf", 4.0f, 1.0f},
      {z2::erf_fp32, "erf", 3.95f, 1.0f},         // 1 - erf(3.95) = 2.3e-8: less than half an ulp below 1
      {z2::erf_fp32, "erf", 3.9f, 0.99999994f},   // 1 - erf(3.9) = 3.5e-8: more, so the float below 1
      {z2::erf_fp32, "erf", smallest, smallest},  // 2/sqrt(pi) x rounds back to the smallest subnormal
      {z2::erf_fp32, "erf", 1.0f, 0.842700793f},
  };
  bool ok = true;
  for (const Case& c : cases) {
    const float got = c.function(c.x);
    const bool match = harness::same_float_bits(got, c.expected);
    if (!match) MESSAGE(std::string(c.name) << "(" << c.x << ") = " << got << ", IEEE says " << c.expected);
    ok = ok && match;
  }
  for (auto function : {z2::exp_fp32, z2::log_fp32, z2::erf_fp32}) ok = ok && std::isnan(function(nan));
  ok = ok && std::isnan(z2::log_fp32(-1.0f)) && std::isnan(z2::log_fp32(-smallest)) && std::isnan(z2::log_fp32(-inf));
  CHECK(harness::agree(ok, "a special input of exp_fp32 / log_fp32 / erf_fp32 gives the wrong answer"));
}

TEST_CASE("exp, log, erf: the vectorised loop and a scalar call give the same bits") {
  constexpr int count = 1 << 16;
  std::vector<float> inputs(count), vector_exp(count), vector_log(count), vector_erf(count);
  std::vector<float> scalar_exp_out(count), scalar_log_out(count), scalar_erf_out(count);
  for (int i = 0; i < count; ++i) inputs[i] = z2::float_of((uint32_t)(i * 65521u));  // every exponent, both signs
  for (int i = 0; i < count; ++i) vector_exp[i] = z2::exp_fp32(inputs[i]);
  for (int i = 0; i < count; ++i) vector_log[i] = z2::log_fp32(inputs[i]);
  for (int i = 0; i < count; ++i) vector_erf[i] = z2::erf_fp32(inputs[i]);
  for (int i = 0; i < count; ++i) {
    scalar_exp_out[i] = scalar_exp(inputs[i]);
    scalar_log_out[i] = scalar_log(inputs[i]);
    scalar_erf_out[i] = scalar_erf(inputs[i]);
  }
  // NaN results have one payload on both paths (the same operations), so
  // memcmp holds for them too.
  const bool ok = harness::same_bits(vector_exp, scalar_exp_out) && harness::same_bits(vector_log, scalar_log_out) &&
                  harness::same_bits(vector_erf, scalar_erf_out);
  CHECK(harness::agree(ok, "exp_fp32 / log_fp32 / erf_fp32 differs between its vectorised and scalar forms"));
}

TEST_CASE("host math: log_double, cos_two_pi and power_double against long double libm") {
  // The initial weights' Box-Muller (log, cos), the "log" warmup and Adam's
  // beta^t use these instead of libm's double functions (zero2.h). Their
  // results are rounded to float afterwards, so what matters is a small
  // relative error in double: bounded here against x87's 64-bit-mantissa
  // logl / cosl / powl, which are ~2^11 times more precise.
  double worst_log = 0, worst_cos = 0, worst_power = 0;
  const long double two_pi = 6.283185307179586476925286766559L;
  for (uint64_t i = 0; i < 200000; ++i) {
    const uint64_t h = z2::hash_keys(0x1095, i);
    // Box-Muller's u1 in (0, 1], and the warmup's 1 .. 2^31
    const double u1 = ((h >> 11) + 1) * (1.0 / 9007199254740992.0), step = (double)(1 + (h >> 33));
    for (double x : {u1, step}) {
      const long double exact = logl((long double)x);
      if (exact != 0) worst_log = std::max(worst_log, (double)fabsl((z2::log_double(x) - exact) / exact));
    }
    // cos(2 pi u): an absolute error (the result crosses zero)
    const double u2 = (h >> 11) * (1.0 / 9007199254740992.0);
    worst_cos = std::max(worst_cos, (double)fabsl(z2::cos_two_pi(u2) - cosl(two_pi * (long double)u2)));
    // beta^t for Adam's betas and steps up to 2^20
    const double beta = (i & 1) ? 0.999 : 0.9;
    const long t = (long)(h % 1048576);
    const long double exact_power = powl((long double)beta, (long double)t);
    if (exact_power > 1e-300L)
      worst_power = std::max(worst_power, (double)fabsl((z2::power_double(beta, t) - exact_power) / exact_power));
  }
  if (harness::rank() == 0)
    MESSAGE("log_double relative " << worst_log << ", cos_two_pi absolute " << worst_cos << ", power_double relative "
                                   << worst_power << " (t up to 2^20)");
  // A few ulps of a double (2^-52 = 2.2e-16) for log and cos; repeated
  // squaring multiplies a rounding by up to t, so t = 2^20 allows ~1e-10.
  const bool ok = worst_log < 1e-15 && worst_cos < 1e-15 && worst_power < 1e-9 && std::isfinite(worst_power);
  CHECK(harness::agree(ok, "a host math function of zero2.h is less accurate than its bound"));
}

TEST_CASE("host math: cos_double against long double cosl") {
  // DeepSpeed's WarmupCosineLR takes cos(pi r / T) (trainer/settings.cpp keeps
  // the argument in [0, 2 pi]); cos_double is bounded on all of [0, 2^20],
  // where its reduction is exact, with an absolute error (cos crosses zero)
  // against x87's cosl of the same double, which is ~2^11 times more precise.
  double worst = 0, worst_small = 0;
  for (uint64_t i = 0; i < 200000; ++i) {
    const uint64_t h = z2::hash_keys(0xc05, i);
    const double u = (h >> 11) * (1.0 / 9007199254740992.0);  // [0, 1)
    // half the samples in [0, 2 pi] (the scheduler's), half in [0, 2^20], either sign
    const double x = ((i & 1) ? 6.283185307179586 * u : 1048576.0 * u) * ((i & 2) ? -1.0 : 1.0);
    const double error = (double)fabsl(z2::cos_double(x) - cosl((long double)x));
    worst = std::max(worst, error);
    if (i & 1) worst_small = std::max(worst_small, error);
  }
  // The quadrant boundaries and zeros, where the reduction and the sign switch:
  // multiples of pi/4 as doubles, and their neighbours one ulp away.
  for (int k = -64; k <= 64; ++k) {
    const double x = k * 0.7853981633974483;
    for (double y : {std::nextafter(x, -1e9), x, std::nextafter(x, 1e9)})
      worst_small = std::max(worst_small, (double)fabsl(z2::cos_double(y) - cosl((long double)y)));
  }
  // Values known exactly: cos 0 = 1, and cos(pi) is -1 to a double (the double
  // nearest pi is 1.2e-16 off, and cos is flat there: -1 + 7e-33).
  const bool exact = z2::cos_double(0.0) == 1.0 && z2::cos_double(3.141592653589793) == -1.0;
  if (harness::rank() == 0)
    MESSAGE("cos_double absolute " << worst << " on [-2^20, 2^20], " << worst_small << " on [-2 pi, 2 pi]");
  // A few ulps of 1 (2^-52 = 2.2e-16): the same bound as cos_two_pi's.
  const bool ok = exact && worst < 1e-15 && worst_small < 1e-15 && std::isfinite(worst);
  CHECK(harness::agree(ok, "cos_double is less accurate than its bound"));
}
