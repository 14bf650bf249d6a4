// tests/math_accuracy.h — how close zero2's exp_fp32, log_fp32 and erf_fp32
// (zero2.h) are to the exact values, over float inputs: each result against
// the double-precision libm function of the same float (glibc's exp, log and
// erf: within about 1 ulp of double, i.e. 2^-29 of a float ulp, so their
// errors do not show at float resolution). Shared by tests/test_math.cpp (a
// sample, in CI) and measurements/math_accuracy.cpp (every float, for notes/07).
#pragma once

#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

#include "../zero2.h"

namespace math_accuracy {

enum class Function { exp, log, erf };
inline const char* name(Function function) {
  return function == Function::exp ? "exp" : function == Function::log ? "log" : "erf";
}

struct Result {
  uint64_t inputs = 0;             // finite-result inputs measured
  uint64_t correctly_rounded = 0;  // ours == the double reference rounded to float
  uint64_t wrong_special = 0;      // inf / NaN / sign where the reference says otherwise
  double max_ulps = 0.0;           // largest |ours - exact| in ulps of the exact value
  float worst_input = 0.0f;
};

// The ulp of a float at value v: 2^(e - 23) for v in [2^e, 2^(e+1)), and the
// subnormal spacing 2^-149 below 2^-126.
inline double float_ulp(double value) {
  if (value == 0.0) return 0x1p-149;  // frexp(0) says exponent 0
  int exponent;
  std::frexp(std::fabs(value), &exponent);  // |v| in [2^(exponent-1), 2^exponent)
  return std::ldexp(1.0, std::max(exponent - 1, -126) - 23);
}

inline double reference(Function function, float x) {
  const double xd = x;
  return function == Function::exp ? std::exp(xd) : function == Function::log ? std::log(xd) : std::erf(xd);
}

// Inputs: the float bit patterns first, first + stride, ... below 2^32, in
// blocks (ours over a block is one vectorised loop, as in the model).
inline void measure_range(Function function, uint64_t first, uint64_t stride, uint64_t end, Result* result) {
  constexpr int block = 1024;
  float inputs[block], ours[block];
  for (uint64_t start = first; start < end;) {
    int n = 0;
    for (; n < block && start < end; ++n, start += stride) inputs[n] = z2::float_of((uint32_t)start);
    if (function == Function::exp)
      for (int i = 0; i < n; ++i) ours[i] = z2::exp_fp32(inputs[i]);
    else if (function == Function::log)
      for (int i = 0; i < n; ++i) ours[i] = z2::log_fp32(inputs[i]);
    else
      for (int i = 0; i < n; ++i) ours[i] = z2::erf_fp32(inputs[i]);
    for (int i = 0; i < n; ++i) {
      const double exact = reference(function, inputs[i]);
      const float rounded = (float)exact;
      if (!std::isfinite(rounded) || !std::isfinite(ours[i])) {
        // inf or NaN expected or produced: the bits must match the rounded
        // reference (any NaN matches any NaN).
        const bool both_nan = std::isnan(rounded) && std::isnan(ours[i]);
        result->wrong_special += !both_nan && z2::bits_of(rounded) != z2::bits_of(ours[i]);
        continue;
      }
      ++result->inputs;
      result->correctly_rounded += z2::bits_of(rounded) == z2::bits_of(ours[i]);
      // Zero results carry a sign (erf(-0) = -0, exp(-inf) = +0): compare bits.
      if (ours[i] == 0.0f || rounded == 0.0f) result->wrong_special += z2::bits_of(rounded) != z2::bits_of(ours[i]);
      const double ulps = std::fabs((double)ours[i] - exact) / float_ulp(exact);
      if (ulps > result->max_ulps) {
        result->max_ulps = ulps;
        result->worst_input = inputs[i];
      }
    }
  }
}

// All of [0, 2^32) with the given stride, split over `threads` threads
// (thread t takes the t-th of `threads` contiguous runs of the input list).
inline Result measure(Function function, uint64_t stride, unsigned threads) {
  std::vector<Result> parts(threads);
  std::vector<std::thread> workers;
  const uint64_t count = ((1ull << 32) + stride - 1) / stride, per_thread = (count + threads - 1) / threads;
  for (unsigned t = 0; t < threads; ++t)
    workers.emplace_back([&, t] {
      const uint64_t begin = std::min(count, t * per_thread) * stride;
      const uint64_t end = std::min<uint64_t>(std::min(count, (t + 1) * per_thread) * stride, 1ull << 32);
      measure_range(function, begin, stride, end, &parts[t]);
    });
  for (auto& worker : workers) worker.join();
  Result total;
  for (const Result& part : parts) {
    total.inputs += part.inputs;
    total.correctly_rounded += part.correctly_rounded;
    total.wrong_special += part.wrong_special;
    if (part.max_ulps > total.max_ulps) {
      total.max_ulps = part.max_ulps;
      total.worst_input = part.worst_input;
    }
  }
  return total;
}

}  // namespace math_accuracy
