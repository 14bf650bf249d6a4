// tests/test_conversions_gpu.cu — z2's 16-bit conversions (zero2.h) against
// the CUDA intrinsics the GPU's kernels would otherwise use, bit for bit:
// __float2bfloat16_rn and __float2half_rn over all 2^32 floats, and the two
// widenings over all 2^16 values; and zero2's own exp, log and erf computed
// by a kernel against the same functions on the CPU; and the portable gemm's
// CUDA kernel against its CPU schedule (runtime/gemm.cu), element by
// element, fp32 / bf16 / fp16, every transpose, batched. Compiled by nvcc; skipped with a message
// without a GPU (and in the cpu-only build). tests/gpu_check.sh runs it.
#include <limits>

#include "harness.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace {

// For `count` floats starting at bit pattern `first`, thread t compares the
// 64 inputs first + 64 t .. and writes how many differ into its own slot:
// no atomics, the host adds the slots. A finite or infinite input must give
// the same bits; a NaN must give a NaN on both sides, and a NaN whose bits
// differ (z2 writes 0x7fff, as CUDA's host code does) is counted apart, in
// `nan_slots`, to be reported rather than failed: z2's kernels never call
// the intrinsics, so only NaN-ness matters to them.
Z2_HD inline unsigned nan_bits_differ(uint16_t ours, uint16_t theirs, uint16_t exponent) {
  const bool ours_nan = (ours & exponent) == exponent && (ours & 0x7fffu) != exponent;
  const bool theirs_nan = (theirs & exponent) == exponent && (theirs & 0x7fffu) != exponent;
  return ours_nan && theirs_nan && ours != theirs;
}
void count_mismatches(z2::Compute& compute, uint64_t first, size_t threads, unsigned* bf16_slots, unsigned* fp16_slots,
                      unsigned* nan_slots) {
  compute.for_each(
      threads, Z2_LOOP(t, {
        unsigned bf16_bad = 0, fp16_bad = 0, nan_differ = 0;
        for (uint64_t k = 0; k < 64; ++k) {
          const float x = z2::float_of((uint32_t)(first + t * 64 + k));
#if defined(__CUDA_ARCH__)
          const uint16_t bf16 = z2::bf16_bits_from_float(x), bf16_theirs = __bfloat16_as_ushort(__float2bfloat16_rn(x));
          const uint16_t fp16 = z2::fp16_bits_from_float(x), fp16_theirs = __half_as_ushort(__float2half_rn(x));
          const unsigned bf16_nan = nan_bits_differ(bf16, bf16_theirs, 0x7f80),
                         fp16_nan = nan_bits_differ(fp16, fp16_theirs, 0x7c00);
          bf16_bad += bf16 != bf16_theirs && !bf16_nan;
          fp16_bad += fp16 != fp16_theirs && !fp16_nan;
          nan_differ += bf16_nan + fp16_nan;
#else
      (void)x;  // the host never runs this body: it is launched on the GPU only
#endif
        }
        bf16_slots[t] = bf16_bad;
        fp16_slots[t] = fp16_bad;
        nan_slots[t] = nan_differ;
      }));
}

void count_widening_mismatches(z2::Compute& compute, unsigned* slots) {
  compute.for_each(65536, Z2_LOOP(b, {
                     unsigned bad = 0;
#if defined(__CUDA_ARCH__)
                     const uint16_t bits = (uint16_t)b;
                     const float ours_bf16 = z2::float_from_bf16_bits(bits),
                                 theirs_bf16 = __bfloat162float(__ushort_as_bfloat16(bits));
                     const float ours_fp16 = z2::float_from_fp16_bits(bits),
                                 theirs_fp16 = __half2float(__ushort_as_half(bits));
                     // NaN inputs: NaN out on both sides (payloads may differ, as above).
                     bad += isnan(ours_bf16) ? !isnan(theirs_bf16) : z2::bits_of(ours_bf16) != z2::bits_of(theirs_bf16);
                     bad += isnan(ours_fp16) ? !isnan(theirs_fp16) : z2::bits_of(ours_fp16) != z2::bits_of(theirs_fp16);
#endif
                     slots[b] = bad;
                   }));
}

// exp_fp32 / log_fp32 / erf_fp32 (zero2.h) of the inputs first + k stride,
// k < count, on whichever backend `compute` is: one element per thread.
void math_functions(z2::Compute& compute, uint64_t first, uint64_t stride, size_t count, float* exp_out, float* log_out,
                    float* erf_out) {
  compute.for_each(count, Z2_LOOP(k, {
                     const float x = z2::float_of((uint32_t)(first + k * stride));
                     exp_out[k] = z2::exp_fp32(x);
                     log_out[k] = z2::log_fp32(x);
                     erf_out[k] = z2::erf_fp32(x);
                   }));
}

// Runs check(gpu), which returns whether it passed, once on rank 0's GPU,
// then agrees on the result across ranks (every rank reaches the agreement,
// so a failure hangs no one); without a GPU, says SKIP.
template <class Check>
void on_rank0_gpu(const char* failure, Check check) {
  bool ran = false, ok = true;
  for (const auto& backend : harness::sub_world(1)) {
    if (!backend.compute->on_cuda() || !backend.deterministic || ran) continue;  // rank 0's GPU, once
    ran = true;
    ok = check(*backend.compute);
  }
  if (!harness::from_rank0(ran))
    MESSAGE("SKIP: no GPU (" << (z2::cuda_available() ? "" : "cudaGetDeviceCount failed") << ")");
  CHECK(harness::agree(ok, failure));
}

}  // namespace
#endif

TEST_CASE("GPU: bf16 and fp16 conversions equal __float2bfloat16_rn / __float2half_rn on all 2^32 floats") {
#if defined(__CUDACC__)
  on_rank0_gpu("a 16-bit conversion differs from the CUDA intrinsic", [&](z2::Compute& compute) {
    const size_t chunk = 1ull << 28, threads = chunk / 64;
    z2::DeviceArray<unsigned> bf16_slots(compute, threads, z2::MemoryKind::activations),
        fp16_slots(compute, threads, z2::MemoryKind::activations),
        nan_slots(compute, threads, z2::MemoryKind::activations), widening(compute, 65536, z2::MemoryKind::activations);
    std::vector<unsigned> host(threads);
    uint64_t bf16_total = 0, fp16_total = 0, nan_total = 0, widening_total = 0;
    auto add_up = [&](const unsigned* slots, uint64_t* total) {
      compute.copy(host.data(), slots, threads * sizeof(unsigned), compute.compute_stream());
      compute.synchronize(compute.compute_stream());
      for (unsigned c : host) *total += c;
    };
    for (uint64_t first = 0; first < (1ull << 32); first += chunk) {
      count_mismatches(compute, first, threads, bf16_slots.data(), fp16_slots.data(), nan_slots.data());
      add_up(bf16_slots.data(), &bf16_total);
      add_up(fp16_slots.data(), &fp16_total);
      add_up(nan_slots.data(), &nan_total);
    }
    count_widening_mismatches(compute, widening.data());
    compute.copy(host.data(), widening.data(), 65536 * sizeof(unsigned), compute.compute_stream());
    compute.synchronize(compute.compute_stream());
    for (size_t b = 0; b < 65536; ++b) widening_total += host[b];
    MESSAGE("all 2^32 floats on the GPU: "
            << bf16_total << " bf16 and " << fp16_total
            << " fp16 results differ from the intrinsics (NaN inputs whose NaN bits differ: " << nan_total
            << "); widening: " << widening_total);
    return bf16_total == 0 && fp16_total == 0 && widening_total == 0;
  });
#else
  MESSAGE("SKIP: the cpu-only build has no CUDA intrinsics");
#endif
}

TEST_CASE("GPU: exp_fp32, log_fp32 and erf_fp32 in a kernel give the CPU's bits (every 13th float)") {
#if defined(__CUDACC__)
  on_rank0_gpu("exp_fp32 / log_fp32 / erf_fp32 differs between a CUDA kernel and the CPU", [&](z2::Compute& gpu) {
    z2::Compute cpu(z2::Device::cpu, 0);
    const uint64_t stride = 13;
    const size_t chunk = 1ull << 26;
    z2::DeviceArray<float> gpu_exp(gpu, chunk, z2::MemoryKind::activations),
        gpu_log(gpu, chunk, z2::MemoryKind::activations), gpu_erf(gpu, chunk, z2::MemoryKind::activations);
    std::vector<float> got_exp(chunk), got_log(chunk), got_erf(chunk), want_exp(chunk), want_log(chunk),
        want_erf(chunk);
    uint64_t differ = 0, nan_payloads = 0;
    for (uint64_t first = 0; first < (1ull << 32); first += chunk * stride) {
      const size_t count = (size_t)std::min<uint64_t>(chunk, ((1ull << 32) - first + stride - 1) / stride);
      math_functions(gpu, first, stride, count, gpu_exp.data(), gpu_log.data(), gpu_erf.data());
      gpu.copy(got_exp.data(), gpu_exp.data(), count * sizeof(float), gpu.compute_stream());
      gpu.copy(got_log.data(), gpu_log.data(), count * sizeof(float), gpu.compute_stream());
      gpu.copy(got_erf.data(), gpu_erf.data(), count * sizeof(float), gpu.compute_stream());
      gpu.synchronize(gpu.compute_stream());
      math_functions(cpu, first, stride, count, want_exp.data(), want_log.data(), want_erf.data());
      // Bits; but a NaN only needs to be a NaN: x86 carries a NaN input's
      // sign and payload through the arithmetic, the GPU makes its canonical
      // 0x7fffffff (as in the conversions above). Those are counted apart.
      auto compare = [&](float gpu_value, float cpu_value) {
        if (cpu_value != cpu_value) {
          differ += gpu_value == gpu_value;
          nan_payloads += gpu_value != gpu_value && z2::bits_of(gpu_value) != z2::bits_of(cpu_value);
        } else {
          differ += z2::bits_of(gpu_value) != z2::bits_of(cpu_value);
        }
      };
      for (size_t k = 0; k < count; ++k) {
        compare(got_exp[k], want_exp[k]);
        compare(got_log[k], want_log[k]);
        compare(got_erf[k], want_erf[k]);
      }
    }
    MESSAGE("exp / log / erf on the GPU vs the CPU, every 13th float: "
            << differ << " results differ (NaNs whose bits differ: " << nan_payloads << ")");
    return differ == 0;
  });
#else
  MESSAGE("SKIP: the cpu-only build has no GPU");
#endif
}

#if defined(__CUDACC__)
namespace {

// One portable product of T on `gpu` and on a cpu Compute, the same inputs;
// the number of elements of C whose bits differ.
template <class T>
size_t portable_gemm_differences(z2::Compute& gpu, z2::Compute& cpu, bool transpose_a, bool transpose_b, int M, int N,
                                 int K, int batch, float beta) {
  const int lda = (transpose_a ? M : K) + 1, ldb = (transpose_b ? K : N) + 2, ldc = N + 3;
  const long stride_a = (long)(transpose_a ? K : M) * lda, stride_b = (long)(transpose_b ? N : K) * ldb,
             stride_c = (long)M * ldc;
  std::vector<T> A((size_t)stride_a * batch), B((size_t)stride_b * batch), C((size_t)stride_c * batch);
  const int spread = z2::precision_of<T>() == z2::Precision::fp16 ? 5 : 20;  // fp16 tops out at 65504
  uint64_t key = 1u << 20;  // keys of its own: not test_portable.cpp's values
  auto value = [&] { return z2::from_float<T>(harness::wide_value(++key, spread)); };
  for (T& x : A) x = value();
  for (T& x : B) x = value();
  // beta = 0 must not read C: NaN there stays out of the result.
  for (T& x : C) x = beta == 0.0f ? z2::from_float<T>(std::numeric_limits<float>::quiet_NaN()) : value();
  std::vector<T> want = C, got(C.size());
  z2::DeviceArray<T> a(gpu, A.size(), z2::MemoryKind::activations), b(gpu, B.size(), z2::MemoryKind::activations),
      c(gpu, C.size(), z2::MemoryKind::activations);
  gpu.copy(a.data(), A.data(), A.size() * sizeof(T), gpu.compute_stream());
  gpu.copy(b.data(), B.data(), B.size() * sizeof(T), gpu.compute_stream());
  gpu.copy(c.data(), C.data(), C.size() * sizeof(T), gpu.compute_stream());
  gpu.gemm_batched(transpose_a, transpose_b, M, N, K, 0.75f, a.data(), lda, stride_a, b.data(), ldb, stride_b, beta,
                   c.data(), ldc, stride_c, batch);
  gpu.copy(got.data(), c.data(), got.size() * sizeof(T), gpu.compute_stream());
  gpu.synchronize(gpu.compute_stream());
  cpu.gemm_batched(transpose_a, transpose_b, M, N, K, 0.75f, A.data(), lda, stride_a, B.data(), ldb, stride_b, beta,
                   want.data(), ldc, stride_c, batch);
  size_t differ = 0;
  for (int k = 0; k < batch; ++k)
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < N; ++n) {
        const size_t at = (size_t)k * stride_c + (size_t)m * ldc + n;
        differ += std::memcmp(&got[at], &want[at], sizeof(T)) != 0;
      }
  return differ;
}

}  // namespace
#endif

TEST_CASE("GPU: the portable gemm kernel gives the CPU schedule's bits (fp32, bf16, fp16, every transpose, batched)") {
#if defined(__CUDACC__)
  on_rank0_gpu("the portable gemm's CUDA kernel differs from its CPU schedule", [&](z2::Compute& gpu) {
    z2::Compute cpu(z2::Device::cpu, 0);
    const bool was_portable = gpu.portable();
    gpu.set_portable(true);
    cpu.set_portable(true);
    size_t differ = 0, elements = 0;
    // Sizes across the kernel's 64 x 64 tile and 16-deep k steps, and BERT-mini's.
    const int shapes[][4] = {{1, 1, 1, 1}, {65, 63, 17, 2}, {128, 128, 64, 3}, {300, 70, 257, 1}, {1024, 256, 64, 1}};
    for (const auto& shape : shapes)
      for (int transposes = 0; transposes < 4; ++transposes)
        for (float beta : {0.0f, 1.0f, 0.3f}) {
          const bool ta = transposes & 1, tb = transposes & 2;
          differ += portable_gemm_differences<float>(gpu, cpu, ta, tb, shape[0], shape[1], shape[2], shape[3], beta);
          differ +=
              portable_gemm_differences<z2::bfloat16>(gpu, cpu, ta, tb, shape[0], shape[1], shape[2], shape[3], beta);
          differ +=
              portable_gemm_differences<z2::float16>(gpu, cpu, ta, tb, shape[0], shape[1], shape[2], shape[3], beta);
          elements += 3 * (size_t)shape[0] * shape[1] * shape[3];
        }
    gpu.set_portable(was_portable);
    MESSAGE("the portable gemm kernel on the GPU vs the CPU schedule: " << differ << " of " << elements
                                                                        << " elements differ");
    return differ == 0;
  });
#else
  MESSAGE("SKIP: the cpu-only build has no GPU");
#endif
}
