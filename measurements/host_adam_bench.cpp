// measurements/host_adam_bench.cpp — ZeRO-Offload's host AdamW alone, timed:
// the engine's own body (zero2.h, AdamWByChunk) through the engine's own
// host loop (Compute::for_each_at on Place::host, split over
// Compute::set_host_threads threads), on buffers laid out as the offloaded
// step's are: the fp32 master, m and v, the reduced gradient in the working
// type and, mixed, the rounded working copy going up. Not a test: `make
// bench-host-adam` (measurements/host_adam.sh; also the end of `make bench`)
// runs it beside DeepSpeedCPUAdam.step on the same number of parameters
// (measurements/deepspeed_cpu_adam.py) and prints both as milliseconds, GB/s
// of state touched and their ratio.
//
//   build-cpu/host_adam_bench ELEMENTS THREADS fp32|bf16 [REPEATS]
//
// prints one line: `zero2 PRECISION ELEMENTS THREADS BEST_MS BYTES`, the
// fastest of REPEATS (default 30) steps after 3 untimed ones (the first
// touches every page; on a shared machine a neighbour only ever adds time,
// so the fastest step is the least disturbed), and BYTES the state one step
// reads and writes:
// fp32 28 per element (param 4 + 4, gradient 4, m 4 + 4, v 4 + 4), bf16 28
// too (master 4 + 4, gradient 2, m 4 + 4, v 4 + 4, working copy 2).
// DeepSpeedCPUAdam's fp32 step touches the same 28.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "zero2.h"

namespace {

template <class Working>
double fastest_step_ms(size_t elements, int threads, int repeats) {
  z2::Compute compute(z2::Device::cpu);
  compute.set_host_threads(threads);
  const size_t rows = elements / z2::norm_chunk;
  const size_t n = rows * z2::norm_chunk;
  // Values a real step sees: small gradients, moments already warm, every
  // other chunk decayed (BERT's biases and LayerNorms are not).
  std::vector<float> param(n), m(n), v(n);
  std::vector<Working> gradient(n), working(z2::precision_of<Working>() == z2::Precision::fp32 ? 0 : n);
  std::vector<unsigned char> decay(rows);
  for (size_t i = 0; i < n; ++i) {
    const float x = (float)((i * 2654435761u) % 1000003) / 1000003.0f - 0.5f;  // in [-0.5, 0.5)
    param[i] = x, m[i] = 1e-3f * x, v[i] = 1e-6f * (x * x + 0.01f);
    gradient[i] = z2::from_float<Working>(1e-2f * x);
  }
  for (size_t r = 0; r < rows; ++r) decay[r] = r % 2;
  z2::AdamWConstants constants;  // torch's AdamW defaults at t = 10, lr 1e-4, weight decay 0.01
  constants.decay_factor = (float)(1.0 - 1e-4 * 0.01);
  constants.one_minus_beta1 = 0.1f, constants.beta2 = 0.999f, constants.one_minus_beta2 = (float)(1.0 - 0.999);
  constants.eps = 1e-8f;
  constants.negative_step_size = (float)(-1e-4 / (1.0 - std::pow(0.9, 10)));
  constants.bias_correction2_sqrt = (float)std::sqrt(1.0 - std::pow(0.999, 10));
  constants.grad_scale = 1.0f;
  const z2::AdamWByChunk<Working> update{constants, decay.data(), param.data(), gradient.data(),
                                          m.data(),  v.data(),     working.empty() ? nullptr : working.data()};
  std::vector<double> ms;
  for (int step = 0; step < repeats + 3; ++step) {
    const auto start = std::chrono::steady_clock::now();
    compute.for_each_at(z2::Place::host, rows, (size_t)z2::norm_chunk, update);
    const double elapsed = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (step >= 3) ms.push_back(elapsed);
  }
  return *std::min_element(ms.begin(), ms.end());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s ELEMENTS THREADS fp32|bf16 [REPEATS]\n", argv[0]);
    return 2;
  }
  const double asked = atof(argv[1]);
  const int threads = atoi(argv[2]), repeats = argc > 4 ? atoi(argv[4]) : 30;
  const std::string precision = argv[3];
  if (!(asked >= z2::norm_chunk && asked <= 4e9) || threads < 1 || threads > 1024 || repeats < 1 ||
      (precision != "fp32" && precision != "bf16")) {
    fprintf(stderr, "%s: ELEMENTS in [32, 4e9], THREADS in [1, 1024], fp32 or bf16, REPEATS >= 1\n", argv[0]);
    return 2;
  }
  const size_t elements = (size_t)asked / z2::norm_chunk * z2::norm_chunk;
  try {
    const double ms = precision == "fp32" ? fastest_step_ms<float>(elements, threads, repeats)
                                          : fastest_step_ms<z2::bfloat16>(elements, threads, repeats);
    printf("zero2 %s %zu %d %.4f %zu\n", precision.c_str(), elements, threads, ms, elements * 28);
  } catch (const z2::Error& error) {
    fprintf(stderr, "%s: %s\n", argv[0], error.what());
    return 1;
  }
  return 0;
}
