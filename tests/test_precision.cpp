// tests/test_precision.cpp — mixed precision (notes/08), from the bits up:
//   1. bf16 and fp16 rounding against a reference computed another way
//      (arithmetic in double) and, for fp16, against the CPU's own F16C
//      instruction over all 2^32 floats;
//   2. the 16-bit gemm against exact integer products;
//   3. the 16-bit bucket collectives against sums computed here: the N
//      16-bit slices summed in fp32 in the canonical tree, rounded once;
//   4. the engine in bf16 and fp16 on a synthetic model (gradients computed on
//      the host from the working parameters): stages 0/1/2 x overlap x bucket
//      sizes, and (N, A) = (1,4), (2,2), (4,1), give the same bits; the
//      reduced gradient is the tree of the leaves rounded once; the ledgers
//      are 16 Psi, 4 Psi + 12 Psi/N, 2 Psi + 14 Psi/N and 2 bytes an element;
//   5. fp16 loss scaling: DeepSpeed's rule on hand-worked sequences, and an
//      overflow planted on one rank skipping the same step on every rank in
//      every stage.
// The GPU's intrinsics are compared with the conversions in
// tests/test_conversions_gpu.cu.
#include <cmath>
#include <cstring>
#include <functional>
#include <random>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "harness.h"
#include "synthetic_model.h"

using harness::agree;
using harness::recursive_tree_sum;
using harness::same_bits;
using harness::same_float_bits;
using harness::test_value;
using synthetic::mixed_options;
using synthetic::MixedRun;
using synthetic::same_mixed_run;
using synthetic::synthetic_gradient;
using synthetic::synthetic_sizes;
using synthetic::train_synthetic;

namespace {

// --- 1. conversions ---------------------------------------------------------

// Round-to-nearest-even to a binary format with `mantissa_bits` stored bits
// and smallest normal exponent `min_exponent`, by arithmetic in double: the
// format's spacing q at x's magnitude (subnormals share the lowest binade's),
// then nearbyint(x / q) q (the default rounding mode: to nearest, ties to
// even; x / q is exact), then overflow to infinity at `overflow`. Nothing
// here shares code with z2's bit manipulation.
float reference_round(float x, int mantissa_bits, int min_exponent, double overflow) {
  int exponent = 0;
  std::frexp((double)x, &exponent);  // |x| in [2^(exponent-1), 2^exponent)
  const int binade = std::max(exponent - 1, min_exponent);
  const double spacing = std::ldexp(1.0, binade - mantissa_bits);
  const double rounded = std::nearbyint((double)x / spacing) * spacing;
  if (std::fabs(rounded) >= overflow) return std::copysign(INFINITY, x);
  return (float)rounded;  // exact: it has at most mantissa_bits + 1 significant bits
}
float reference_bf16(float x) { return reference_round(x, 7, -126, std::ldexp(1.0, 128)); }
float reference_fp16(float x) { return reference_round(x, 10, -14, 65536.0); }

// Inputs that reach every rounding case of both formats: every sign and
// exponent, with mantissas at and around every bit position (ties with an
// even and an odd kept bit, just below and above them, carries out of the
// mantissa), plus random ones.
std::vector<uint32_t> boundary_inputs() {
  std::vector<uint32_t> mantissas = {0, 1, 2, 3, 0x7fffff, 0x7ffffe, 0x400000, 0x3fffff};
  for (int b = 0; b < 23; ++b) {
    const uint32_t bit = 1u << b, next = b < 22 ? 2u << b : 0;
    for (uint32_t m : {bit, bit - 1, bit + 1, bit | next, (bit | next) - 1, (bit | next) + 1, 0x7fffffu & ~(bit - 1),
                       0x7fffffu & ~bit})
      mantissas.push_back(m & 0x7fffffu);
  }
  std::mt19937 random(42);
  for (int k = 0; k < 32; ++k) mantissas.push_back(random() & 0x7fffffu);
  std::vector<uint32_t> inputs;
  for (uint32_t sign : {0u, 1u})
    for (uint32_t exponent = 0; exponent < 255; ++exponent)
      for (uint32_t m : mantissas) inputs.push_back(sign << 31 | exponent << 23 | m);
  for (int k = 0; k < (1 << 20); ++k) {
    const uint32_t bits = random();
    if ((bits & 0x7f800000u) != 0x7f800000u) inputs.push_back(bits);  // finite only: specials are below
  }
  return inputs;
}

#if defined(__x86_64__)
// fp16 rounding by the processor (F16C's vcvtps2ph, immediate 0: to nearest
// even), for every float in [begin, end): the number of results that differ
// from z2's (NaNs: both must be NaN; the payloads differ by design).
__attribute__((target("f16c"))) size_t f16c_mismatches(uint64_t begin, uint64_t end) {
  size_t mismatches = 0;
  for (uint64_t bits = begin; bits < end; ++bits) {
    const float x = z2::float_of((uint32_t)bits);
    const uint16_t ours = z2::fp16_bits_from_float(x), theirs = _cvtss_sh(x, 0);
    const bool nan = std::isnan(x);
    if (nan ? (ours & 0x7fff) <= 0x7c00 || (theirs & 0x7fff) <= 0x7c00 : ours != theirs) ++mismatches;
  }
  return mismatches;
}
__attribute__((target("f16c"))) float f16c_widen(uint16_t bits) { return _cvtsh_ss(bits); }
#endif

}  // namespace

TEST_CASE("bf16 and fp16 rounding: nearest even, as arithmetic in double computes it, on every exponent and boundary") {
  const std::vector<uint32_t> inputs = boundary_inputs();
  size_t bf16_bad = 0, fp16_bad = 0;
  for (uint32_t bits : inputs) {
    const float x = z2::float_of(bits);
    bf16_bad += !same_float_bits(z2::float_from_bf16_bits(z2::bf16_bits_from_float(x)), reference_bf16(x));
    fp16_bad += !same_float_bits(z2::float_from_fp16_bits(z2::fp16_bits_from_float(x)), reference_fp16(x));
  }
  // The specials, by hand.
  const float inf = INFINITY, nan = NAN;
  bool specials = z2::bf16_bits_from_float(inf) == 0x7f80 && z2::bf16_bits_from_float(-inf) == 0xff80 &&
                  z2::fp16_bits_from_float(inf) == 0x7c00 && z2::fp16_bits_from_float(-inf) == 0xfc00 &&
                  z2::bf16_bits_from_float(nan) == 0x7fff && z2::fp16_bits_from_float(-nan) == 0x7fff &&
                  z2::bf16_bits_from_float(z2::float_of(0x7f800001u)) == 0x7fff &&  // a signalling NaN stays NaN
                  z2::fp16_bits_from_float(65504.0f) == 0x7bff &&                   // the largest finite fp16
                  z2::fp16_bits_from_float(65519.996f) == 0x7bff &&                 // just below the tie
                  z2::fp16_bits_from_float(65520.0f) == 0x7c00 &&                   // the tie goes to inf (even)
                  z2::fp16_bits_from_float(std::ldexp(1.0f, -24)) == 0x0001 &&      // the smallest subnormal
                  z2::fp16_bits_from_float(std::ldexp(1.0f, -25)) == 0x0000 &&      // its half: ties to even 0
                  z2::fp16_bits_from_float(std::nextafter(std::ldexp(1.0f, -25), 1.0f)) == 0x0001 &&
                  z2::fp16_bits_from_float(3 * std::ldexp(1.0f, -25)) == 0x0002 &&  // 1.5 ulp: to even 2
                  z2::fp16_bits_from_float(-0.0f) == 0x8000 && z2::bf16_bits_from_float(-0.0f) == 0x8000 &&
                  z2::bf16_bits_from_float(z2::float_of(0x7f7fffffu)) == 0x7f80 &&  // FLT_MAX rounds to inf
                  z2::bf16_bits_from_float(z2::float_of(0x7f7f7fffu)) == 0x7f7f &&  // below the tie
                  z2::bf16_bits_from_float(z2::float_of(0x00008000u)) == 0x0000 &&  // a subnormal tie, even
                  z2::bf16_bits_from_float(z2::float_of(0x00018000u)) == 0x0002;    // a subnormal tie, odd: up
  // Widening is exact: every finite 16-bit value comes back unchanged.
  bool round_trips = true;
  for (uint32_t b = 0; b < 65536; ++b) {
    const uint16_t bits = (uint16_t)b;
    if ((bits & 0x7f80) != 0x7f80) round_trips &= z2::bf16_bits_from_float(z2::float_from_bf16_bits(bits)) == bits;
    if ((bits & 0x7c00) != 0x7c00) round_trips &= z2::fp16_bits_from_float(z2::float_from_fp16_bits(bits)) == bits;
  }
  MESSAGE(inputs.size() << " inputs: " << bf16_bad << " bf16 and " << fp16_bad
                        << " fp16 results differ from the reference");
  CHECK(agree(bf16_bad == 0 && fp16_bad == 0, "a 16-bit rounding differs from the double reference"));
  CHECK(agree(specials, "a special value converts wrongly"));
  CHECK(agree(round_trips, "widening then narrowing does not give the 16-bit value back"));
}

TEST_CASE("fp16 rounding equals the CPU's F16C instruction on all 2^32 floats (split across ranks)") {
#if defined(__x86_64__)
  if (!__builtin_cpu_supports("f16c")) {
    MESSAGE("SKIP: this CPU has no F16C");
    return;
  }
  const uint64_t total = 1ull << 32, N = harness::world_size(), me = harness::rank();
  const size_t mismatches = f16c_mismatches(total * me / N, total * (me + 1) / N);
  bool widening = true;
  for (uint32_t b = 0; b < 65536; ++b) {
    const float ours = z2::float_from_fp16_bits((uint16_t)b), theirs = f16c_widen((uint16_t)b);
    widening &= std::isnan(ours) ? std::isnan(theirs) : same_float_bits(ours, theirs);
  }
  CHECK_MESSAGE(agree(mismatches == 0 && widening, "fp16 conversion differs from F16C"), mismatches, " mismatches");
#else
  MESSAGE("SKIP: not an x86-64 CPU (no F16C)");
#endif
}

// --- 2. the 16-bit gemm ---------------------------------------------------------

namespace {

// Small integers (exact in both formats) make every product and partial sum
// exact in fp32, whatever the summation order, so C = round16(exact) on every
// backend and the comparison can be bitwise. Values up to 8 and K <= 64 keep
// sums below 2^12 while beta C and alpha stay exact too (alpha 0.5, beta 2).
template <class T>
bool gemm_16bit_exact(z2::Compute& compute, std::string* where) {
  bool ok = true;
  const int M = 5, N = 7, K = 33, batch = 3;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (float beta : {0.0f, 2.0f}) {
        // Batched, with the products side by side in C's rows (stride N,
        // ldc = batch N + 2, as the attention heads are): each product must
        // write its own columns only, and the last two columns stay.
        const int lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 1, ldc = batch * N + 2;
        const long stride_a = (long)lda * (ta ? K : M), stride_b = (long)ldb * (tb ? N : K), stride_c = N;
        const size_t a_count = (size_t)stride_a * batch, b_count = (size_t)stride_b * batch, c_count = (size_t)M * ldc;
        std::vector<float> a(a_count), b(b_count), c(c_count);
        for (size_t i = 0; i < a_count; ++i) a[i] = (float)((int)(i * 7 % 17) - 8);
        for (size_t i = 0; i < b_count; ++i) b[i] = (float)((int)(i * 5 % 13) - 6);
        for (size_t i = 0; i < c_count; ++i) c[i] = (float)((int)(i % 9) - 4);
        auto narrow = [](const std::vector<float>& values) {
          std::vector<T> out(values.size());
          for (size_t i = 0; i < values.size(); ++i) out[i] = z2::from_float<T>(values[i]);
          return out;
        };
        std::vector<T> a16 = narrow(a), b16 = narrow(b), c16 = narrow(c);
        z2::DeviceArray<T> da(compute, a_count, z2::MemoryKind::activations),
            db(compute, b_count, z2::MemoryKind::activations), dc(compute, c_count, z2::MemoryKind::activations);
        z2::Stream stream = compute.compute_stream();
        compute.copy(da.data(), a16.data(), a_count * sizeof(T), stream);
        compute.copy(db.data(), b16.data(), b_count * sizeof(T), stream);
        compute.copy(dc.data(), c16.data(), c_count * sizeof(T), stream);
        compute.gemm_batched(ta, tb, M, N, K, 0.5f, da.data(), lda, stride_a, db.data(), ldb, stride_b, beta, dc.data(),
                             ldc, stride_c, batch);
        std::vector<T> got(c_count);
        compute.copy(got.data(), dc.data(), c_count * sizeof(T), stream);
        compute.synchronize(stream);
        for (int k = 0; k < batch; ++k)
          for (int i = 0; i < M; ++i)
            for (int j = 0; j < N; ++j) {
              double sum = 0;
              for (int l = 0; l < K; ++l) {
                const double x = a[k * stride_a + (ta ? (size_t)l * lda + i : (size_t)i * lda + l)];
                const double y = b[k * stride_b + (tb ? (size_t)j * ldb + l : (size_t)l * ldb + j)];
                sum += x * y;
              }
              const size_t at = k * stride_c + (size_t)i * ldc + j;
              const float expected = (float)(0.5 * sum + beta * (double)c[at]);
              ok &= same_float_bits(z2::to_float(got[at]), z2::to_float(z2::from_float<T>(expected)));
            }
        // Elements of C no product covers are untouched.
        for (int i = 0; i < M; ++i)
          for (int j = batch * N; j < ldc; ++j)
            ok &= same_float_bits(z2::to_float(got[(size_t)i * ldc + j]), z2::to_float(c16[(size_t)i * ldc + j]));
        if (!ok && where->empty()) *where = std::string("ta ") + (ta ? "1" : "0") + " tb " + (tb ? "1" : "0");
      }
  return ok;
}

}  // namespace

TEST_CASE("16-bit gemm (GemmEx on cuda, widened sgemm on cpu): exact products summed in fp32, C rounded once") {
  for (const auto& backend : harness::backends()) {
    if (backend.name.find("nccl") != std::string::npos) continue;  // the same Compute as cuda/mpi
    std::string where;
    bool ok = gemm_16bit_exact<z2::bfloat16>(*backend.compute, &where) &&
              gemm_16bit_exact<z2::float16>(*backend.compute, &where);
    CHECK_MESSAGE(agree(ok, backend.name + ": 16-bit gemm differs from the exact result"), backend.name, " ", where);
  }
}

// --- 3. the 16-bit bucket collectives ---------------------------------------------

namespace {

size_t padded_for(size_t length, int N) { return (length + N - 1) / N * N; }

// Rank r's 16-bit value at element i of a bucket (zero in the padding), as
// the float it stands for. Magnitudes from 1/16 to 8 make 16-bit partial sums
// round differently from one fp32 sum.
template <class T>
float leaf(int rank, int bucket, size_t i, size_t length) {
  return i < length ? z2::to_float(z2::from_float<T>(test_value(3000 + rank, bucket, i))) : 0.0f;
}

template <class T>
std::vector<T> narrow_all(const std::vector<float>& values) {
  std::vector<T> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = z2::from_float<T>(values[i]);
  return out;
}
template <class T>
std::vector<float> widen_all(const std::vector<T>& values) {
  std::vector<float> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = z2::to_float(values[i]);
  return out;
}

// The exchange's reduce-scatter of A micro-steps into `result` (16-bit),
// micro-step a on this rank being global micro-batch a N + rank. With
// `fp32_blocks` the accumulation tree's open blocks are fp32.
template <class T>
std::vector<float> reduce_micro_steps(z2::Compute& compute, z2::Communicator& comm, size_t length, int A,
                                      bool fp32_blocks, size_t* sent) {
  const int N = comm.world_size(), me = comm.rank();
  const size_t padded = padded_for(length, N), shard = padded / N;
  z2::BucketExchange exchange(compute, comm, padded, 2, false, z2::precision_of<T>(), fp32_blocks);
  z2::DeviceArray<T> bucket(compute, padded, z2::MemoryKind::activations),
      result(compute, shard, z2::MemoryKind::activations);
  std::vector<z2::DeviceArray<char>> blocks;
  z2::AccumulateInto into;
  into.result = result.data();
  into.micro_steps = A;
  for (int d = 0; (2 << d) <= A; ++d) {
    blocks.emplace_back(compute, shard * (fp32_blocks ? 4 : sizeof(T)), z2::MemoryKind::activations);
    into.stack.entries[d] = blocks.back().data();
  }
  const size_t before = comm.counters().reduce_scatter;
  std::vector<float> mine(padded);
  for (int a = 0; a < A; ++a) {
    for (size_t i = 0; i < padded; ++i) mine[i] = leaf<T>(a * N + me, 7, i, length);
    std::vector<T> bits = narrow_all<T>(mine);
    compute.copy(bucket.data(), bits.data(), padded * sizeof(T), compute.compute_stream());
    into.micro_step = a;
    exchange.start_reduce_scatter(exchange.acquire(0), bucket.data(), padded, into);
    exchange.finish_all();
    compute.synchronize_all();
  }
  *sent = comm.counters().reduce_scatter - before;
  std::vector<T> got(shard);
  compute.copy(got.data(), result.data(), shard * sizeof(T), compute.compute_stream());
  compute.synchronize(compute.compute_stream());
  return widen_all(got);
}

template <class T>
bool check_16bit_reduce_scatter(const harness::Backend& backend, std::string* note) {
  z2::Compute& compute = *backend.compute;
  z2::Communicator& comm = *backend.deterministic;
  const int N = comm.world_size(), me = comm.rank();
  const size_t length = 3001, padded = padded_for(length, N), shard = padded / N;
  bool ok = true, rounding_shows = false;
  for (int A : {1, 2, 3, 4}) {
    size_t sent = 0;
    // fp32 blocks: the canonical tree over all N A leaves in fp32, rounded once.
    const std::vector<float> got = reduce_micro_steps<T>(compute, comm, length, A, true, &sent);
    std::vector<float> leaves((size_t)N * A);
    for (size_t i = 0; i < shard; ++i) {
      for (int m = 0; m < N * A; ++m) leaves[m] = leaf<T>(m, 7, me * shard + i, length);
      const float exact = recursive_tree_sum(leaves.data(), (long)N * A);
      ok &= same_float_bits(got[i], z2::to_float(z2::from_float<T>(exact)));
      // The test could tell a 16-bit running sum from the fp32 one.
      float running = 0.0f;
      for (float value : leaves) running = z2::to_float(z2::from_float<T>(running + value));
      rounding_shows |= !same_float_bits(running, z2::to_float(z2::from_float<T>(exact)));
    }
    ok &= sent == (size_t)A * (N - 1) * shard * sizeof(T);  // 16-bit slices: 2 bytes an element
    // 16-bit blocks (grad_accum_dtype = the precision): each closed block is
    // rounded, so the result is the tree with every block sum rounded.
    const std::vector<float> rounded_blocks = reduce_micro_steps<T>(compute, comm, length, A, false, &sent);
    for (size_t i = 0; i < shard; ++i) {
      // Per micro-step a, the fp32 sum over ranks; then the binary counter
      // over micro-steps with each stored block rounded to 16 bits.
      std::vector<float> steps(A), open;
      for (int a = 0; a < A; ++a) {
        std::vector<float> ranks(N);
        for (int j = 0; j < N; ++j) ranks[j] = leaf<T>(a * N + j, 7, me * shard + i, length);
        steps[a] = recursive_tree_sum(ranks.data(), N);
      }
      std::vector<float> stack;
      float result = 0.0f;
      for (int a = 0; a < A; ++a) {
        float value = steps[a];
        size_t depth = (size_t)__builtin_popcount(a);
        if (a == A - 1) {
          while (depth > 0) value = stack[--depth] + value;
          result = z2::to_float(z2::from_float<T>(value));
          break;
        }
        for (int closed = a; closed & 1; closed >>= 1) value = stack[--depth] + value;
        stack.resize(depth + 1);
        stack[depth] = z2::to_float(z2::from_float<T>(value));
      }
      ok &= same_float_bits(rounded_blocks[i], result);
    }
  }
  if (!rounding_shows) *note = "the data never made a 16-bit running sum differ: the test could not fail";
  return ok && rounding_shows;
}

}  // namespace

TEST_CASE("16-bit reduce-scatter: 2-byte slices, summed in fp32 in the canonical tree and rounded once") {
  for (const auto& backend : harness::backends()) {
    std::string note;
    const bool ok = check_16bit_reduce_scatter<z2::bfloat16>(backend, &note) &&
                    check_16bit_reduce_scatter<z2::float16>(backend, &note);
    CHECK_MESSAGE(agree(ok, backend.name + ": 16-bit reduce-scatter differs " + note), backend.name, " ", note);
  }
}

TEST_CASE("16-bit all-gather moves the bits unchanged; native 16-bit reduce-scatter is within its rounding bound") {
  for (const auto& backend : harness::backends()) {
    z2::Compute& compute = *backend.compute;
    const int N = backend.deterministic->world_size(), me = backend.deterministic->rank();
    const size_t length = 5000, padded = padded_for(length, N), shard = padded / N;
    bool gathered_ok = true, native_ok = true;
    for (z2::Precision precision : {z2::Precision::bf16, z2::Precision::fp16}) {
      std::vector<uint16_t> mine(padded), expected(padded);
      for (size_t i = 0; i < padded; ++i) {
        const size_t owner = i / shard;  // rank owner's shard holds its own values
        const float value = test_value(4000 + (int)owner, 1, i);
        expected[i] =
            precision == z2::Precision::bf16 ? z2::bf16_bits_from_float(value) : z2::fp16_bits_from_float(value);
        mine[i] = owner == (size_t)me ? expected[i] : 0x7fc1;  // the others' slices start as NaN (in both formats)
      }
      z2::BucketExchange exchange(compute, *backend.deterministic, padded, 1, false, precision);
      z2::DeviceArray<uint16_t> bucket(compute, padded, z2::MemoryKind::activations);
      compute.copy(bucket.data(), mine.data(), padded * 2, compute.compute_stream());
      const size_t before = backend.deterministic->counters().all_gather;
      exchange.start_all_gather(exchange.acquire(0), bucket.data(), padded);
      exchange.finish_all();
      compute.synchronize_all();
      std::vector<uint16_t> got(padded);
      compute.copy(got.data(), bucket.data(), padded * 2, compute.compute_stream());
      compute.synchronize(compute.compute_stream());
      gathered_ok &= got == expected && backend.deterministic->counters().all_gather - before == (N - 1) * shard * 2;

      // Native: the library (or our MPI_Op) rounds every partial sum to 16
      // bits. Each order's error is at most (N - 1) u sum |x_j| + u |sum|
      // with u = 2^-8 (bf16) or 2^-11 (fp16); two orders differ by at most
      // twice that. (fp16's subnormals add at most N 2^-24; the data here
      // are at least 1/16.)
      const double u = std::ldexp(1.0, precision == z2::Precision::bf16 ? -8 : -11);
      std::vector<std::vector<float>> outputs;
      for (z2::Communicator* comm : {backend.deterministic, backend.native}) {
        z2::BucketExchange reducer(compute, *comm, padded, 1, false, precision);
        std::vector<uint16_t> values(padded);
        for (size_t i = 0; i < padded; ++i) {
          const float value = i < length ? test_value(5000 + me, 2, i) : 0.0f;
          values[i] =
              precision == z2::Precision::bf16 ? z2::bf16_bits_from_float(value) : z2::fp16_bits_from_float(value);
        }
        z2::DeviceArray<uint16_t> input(compute, padded, z2::MemoryKind::activations),
            result(compute, shard, z2::MemoryKind::activations);
        compute.copy(input.data(), values.data(), padded * 2, compute.compute_stream());
        z2::AccumulateInto into;
        into.result = result.data();
        reducer.start_reduce_scatter(reducer.acquire(0), input.data(), padded, into);
        reducer.finish_all();
        compute.synchronize_all();
        std::vector<uint16_t> bits(shard);
        compute.copy(bits.data(), result.data(), shard * 2, compute.compute_stream());
        compute.synchronize(compute.compute_stream());
        outputs.emplace_back(shard);
        for (size_t i = 0; i < shard; ++i)
          outputs.back()[i] =
              precision == z2::Precision::bf16 ? z2::float_from_bf16_bits(bits[i]) : z2::float_from_fp16_bits(bits[i]);
      }
      for (size_t i = 0; i < shard; ++i) {
        double absolute = 0;
        for (int j = 0; j < N; ++j) {
          const size_t element = me * shard + i;
          absolute += element < length ? std::fabs(test_value(5000 + j, 2, element)) : 0.0;
        }
        const double bound = 2 * (N * u * absolute) + 2.0 * N * std::ldexp(1.0, -24);
        native_ok &= std::fabs((double)outputs[0][i] - outputs[1][i]) <= bound;
      }
    }
    CHECK_MESSAGE(agree(gathered_ok, backend.name + ": 16-bit all-gather changed bits or bytes"), backend.name);
    CHECK_MESSAGE(agree(native_ok, backend.name + ": native 16-bit sum beyond its bound"), backend.name);
  }
}

// --- 4. the engine in bf16 and fp16, on a synthetic model --------------------

namespace {

template <class T>
bool check_stage_matrix(const harness::Backend& backend, std::string* note) {
  bool ok = true;
  MixedRun reference;
  bool first = true;
  for (int stage : {0, 1, 2})
    for (bool overlap : {false, true})
      for (long bucket : {64l, 500l, 1l << 20}) {
        MixedRun run =
            train_synthetic<T>(*backend.compute, *backend.deterministic, mixed_options(stage, overlap, bucket), 8);
        ok &= run.reduced_ok;
        if (first) reference = run, first = false;
        if (!same_mixed_run(run, reference)) {
          ok = false;
          *note = "stage " + std::to_string(stage) + " overlap " + std::to_string(overlap) + " bucket " +
                  std::to_string(bucket) + " differs";
        }
      }
  // The run trained (the master moved from its start, and its 16-bit copy
  // is the master rounded), and in fp16 the first steps overflowed (S x
  // gradients above 65504) and were skipped: the matrix compares skips too.
  bool rounded = true;
  for (size_t k = 0; k < reference.master.size(); ++k)
    rounded &= same_float_bits(reference.working[k], z2::to_float(z2::from_float<T>(reference.master[k])));
  ok &= rounded && reference.master[0] != test_value(99, 0, 0) / 4.0f;
  if (z2::precision_of<T>() == z2::Precision::fp16) {
    const bool skipped_some = reference.skipped[0] && !reference.skipped.back();
    if (!skipped_some) *note += " (fp16 never overflowed: the skip comparison proves nothing)";
    ok &= skipped_some;
  }
  return ok;
}

}  // namespace

TEST_CASE("mixed precision stage matrix: bf16 and fp16 x stages 0/1/2 x overlap x bucket sizes give identical bits") {
  for (const auto& backend : harness::backends()) {
    std::string note;
    bool ok = check_stage_matrix<z2::bfloat16>(backend, &note);
    CHECK_MESSAGE(agree(ok, backend.name + ": bf16 stage matrix: " + note), backend.name, " bf16 ", note);
    note.clear();
    ok = check_stage_matrix<z2::float16>(backend, &note);
    CHECK_MESSAGE(agree(ok, backend.name + ": fp16 stage matrix: " + note), backend.name, " fp16 ", note);
  }
}

TEST_CASE("mixed precision world-size invariance: (N, A) = (1,4), (2,2), (4,1) give identical bits") {
  const int pairs[][2] = {{1, 4}, {2, 2}, {4, 1}};
  bool equal = true;
  const size_t backend_count = harness::sub_world(1).size();
  for (size_t b = 0; b < backend_count; ++b)
    for (int stage : {0, 2})
      for (z2::Precision precision : {z2::Precision::bf16, z2::Precision::fp16}) {
        std::vector<MixedRun> runs;
        for (auto& pair : pairs) {
          const auto& world = harness::sub_world(pair[0]);
          if (world.empty()) continue;
          const harness::Backend& backend = world[b];
          if (backend.deterministic) {
            z2::EngineOptions options = mixed_options(stage, true, 500, pair[1]);
            bool reduced_ok = false;
            const bool finished = harness::completes(
                [&] {
                  runs.push_back(
                      precision == z2::Precision::bf16
                          ? train_synthetic<z2::bfloat16>(*backend.compute, *backend.deterministic, options, 6)
                          : train_synthetic<z2::float16>(*backend.compute, *backend.deterministic, options, 6));
                  reduced_ok = runs.back().reduced_ok;
                },
                "mixed precision world-size run");
            equal = equal && finished && reduced_ok;
          }
          MPI_Barrier(MPI_COMM_WORLD);
        }
        equal = harness::agree(equal);
        if (equal && harness::rank() == 0)
          for (const MixedRun& run : runs) equal &= same_mixed_run(run, runs[0]);
        if (b == 0 && stage == 0 && precision == z2::Precision::bf16)
          MESSAGE(runs.size() << " of the 3 (N, A) splits fit in this world (-n 4 runs all; at -n 1 only (1, 4),"
                                 " compared with itself)");
      }
  CHECK(harness::from_rank0(equal));
}

TEST_CASE(
    "mixed precision ledgers: model states 16 Psi, 4 Psi + 12 Psi/N, 2 Psi + 14 Psi/N; 2 bytes an element on the "
    "wire") {
  for (const auto& backend : harness::backends()) {
    const size_t N = backend.deterministic->world_size();
    for (int stage : {0, 1, 2})
      for (int A : {1, 4})
        for (bool fp32_blocks : {true, false}) {
          z2::EngineOptions options = mixed_options(stage, true, 500, A);
          options.accumulate_fp32 = fp32_blocks;
          const MixedRun run = train_synthetic<z2::bfloat16>(*backend.compute, *backend.deterministic, options, 2);
          // Psi_padded from the rule (each tensor to a chunk, each bucket of
          // whole tensors up to 500 elements to N chunks), not from the engine.
          const size_t C = z2::norm_chunk;
          std::vector<size_t> spans;
          size_t open = 0;
          for (size_t size : synthetic_sizes) {
            const size_t aligned = (size + C - 1) / C * C;
            if (open > 0 && open + aligned > (500 + C - 1) / C * C) spans.push_back(open), open = 0;
            open += aligned;
          }
          spans.push_back(open);
          size_t psi = 0;
          for (size_t span : spans) psi += (span + N * C - 1) / (N * C) * (N * C);
          const size_t formula = stage == 0 ? 16 * psi : stage == 1 ? 4 * psi + 12 * psi / N : 2 * psi + 14 * psi / N;
          const z2::MemoryLedger& m = run.memory;
          const size_t blocks = A == 4 ? 2 : 0;  // floor(log2 A)
          bool ok = m.model_states == formula && m.model_states_formula == formula && m.params == 2 * psi &&
                    m.grads == (stage == 2 ? 2 * psi / N : 2 * psi) &&
                    m.master == (stage == 0 ? 4 * psi : 4 * psi / N) &&
                    m.optimizer == (stage == 0 ? 8 * psi : 8 * psi / N) &&
                    m.accumulation == blocks * (psi / N) * (fp32_blocks ? 4 : 2) &&
                    m.accumulation == m.accumulation_formula && m.staging == m.staging_formula;
          // The wire: A reduce-scatters and one all-gather of (N - 1)/N Psi
          // elements, 2 bytes each: half of fp32's.
          const z2::CommCounters& c = run.comm.per_step;
          const size_t one_way = (N - 1) * (psi / N) * 2;
          ok &= c.reduce_scatter + c.all_gather + c.all_reduce == (A + 1) * one_way &&
                run.comm.formula_per_step == (A + 1) * one_way;
          CHECK_MESSAGE(agree(ok, backend.name + ": mixed-precision ledger differs"), backend.name, " stage ", stage,
                        " A ", A, " measured ", m.model_states, " formula ", formula, " grads ", m.grads, " master ",
                        m.master);
        }
  }
}

// --- 5. fp16 loss scaling ------------------------------------------------------------

TEST_CASE("fp16 loss scaler: DeepSpeed's DynamicLossScaler on hand-worked sequences") {
  // init 2^4, window 3, hysteresis 2. O = overflow, c = clean; the scale and
  // the hysteresis left after each update, worked out from loss_scaler.py's
  // update_scale by hand:
  //   O: hysteresis 2 -> 1            c: (2 - 1) % 3 != 0         c: ... (4 - 1) % 3 == 0: x2, hysteresis back to 2
  z2::LossScaling settings;
  settings.initial_scale_power = 4, settings.window = 3, settings.hysteresis = 2, settings.min_scale = 1;
  z2::LossScaler scaler(settings, true);
  const bool overflow[] = {true, true, false, false, false, true, false, true, false, false, false};
  const double scales[] = {16, 8, 8, 8, 16, 16, 16, 8, 8, 8, 16};
  const int hysteresis[] = {1, 1, 1, 1, 2, 1, 1, 1, 1, 1, 2};
  bool ok = scaler.scale() == 16;
  for (int k = 0; k < 11; ++k) {
    scaler.update(overflow[k]);
    ok &= scaler.scale() == scales[k] && scaler.hysteresis_left() == hysteresis[k];
  }
  CHECK(ok);
  // With no overflow yet, the first doubling comes after `window` clean steps.
  z2::LossScaler fresh(settings, true);
  fresh.update(false), fresh.update(false);
  CHECK(fresh.scale() == 16);
  fresh.update(false);
  CHECK(fresh.scale() == 32);
  // consecutive_hysteresis: a clean step restores the hysteresis, so
  // alternating overflows never halve; without it they do.
  for (bool consecutive : {true, false}) {
    settings.window = 100, settings.consecutive_hysteresis = consecutive;
    z2::LossScaler alternating(settings, true);
    for (bool o : {true, false, true, false, true}) alternating.update(o);
    CHECK(alternating.scale() == (consecutive ? 16 : 4));
  }
  // At the minimum with no hysteresis left an overflow stops the run, as
  // DeepSpeed raises; above it the scale halves down to the minimum.
  settings.initial_scale_power = 1, settings.hysteresis = 1, settings.min_scale = 0.5,
  settings.consecutive_hysteresis = false;
  z2::LossScaler low(settings, true);
  low.update(true);
  low.update(true);
  CHECK(low.scale() == 0.5);
  CHECK_THROWS_WITH_AS(low.update(true), doctest::Contains("minimum loss scale"), z2::Error);
  // A static scale never moves; bf16 and fp32 have scale 1 and no updates.
  settings.static_scale = 128;
  z2::LossScaler fixed(settings, true);
  for (bool o : {true, true, false, false, false, false}) fixed.update(o);
  CHECK(fixed.scale() == 128);
  CHECK(!fixed.dynamic());
  z2::LossScaler none(settings, false);
  none.update(true);
  CHECK(none.scale() == 1);
  // Out-of-range settings are refused with the key's name.
  z2::LossScaling bad;
  bad.hysteresis = 0;
  CHECK_THROWS_WITH_AS(z2::LossScaler(bad, true), doctest::Contains("hysteresis"), z2::Error);
  bad = z2::LossScaling();
  bad.min_scale = -1;  // (0 is DeepSpeed's "no floor", taken)
  CHECK_THROWS_WITH_AS(z2::LossScaler(bad, true), doctest::Contains("min_loss_scale"), z2::Error);
}

namespace {

// fp32 or bf16: gradients finite but far beyond sqrt(FLT_MAX) ~ 1.8e19 at two
// elements in different buckets (and shards) in step 1.
template <class T>
bool check_huge_gradient_norm(const harness::Backend& backend) {
  auto gradient = [](float w, long step, long m, size_t k) {
    if (step == 1 && k == 17) return 1e30f;
    if (step == 1 && k == 900) return -3e29f;
    return synthetic_gradient(w, step, m, k);
  };
  const MixedRun run =
      train_synthetic<T>(*backend.compute, *backend.deterministic, mixed_options(0, true, 500), 3, nullptr, gradient);
  // The norm of the reduced gradient (which run.reduced holds: stage 0), in double.
  double squared = 0;
  for (float g : run.reduced) squared += (double)g * g;
  const double expected = std::sqrt(squared);
  return run.reduced_ok && std::isfinite(run.grad_norms[0]) &&
         std::fabs(run.grad_norms[0] - expected) <= 1e-6 * expected && std::isfinite(run.grad_norms[2]);
}

}  // namespace

TEST_CASE("global norm: squares beyond fp32's range are taken again scaled; a non-finite gradient stops every rank") {
  for (const auto& backend : harness::backends()) {
    const bool ok = check_huge_gradient_norm<float>(backend) && check_huge_gradient_norm<z2::bfloat16>(backend);
    CHECK_MESSAGE(agree(ok, backend.name + ": the norm of a huge finite gradient is wrong"), backend.name);
    // An inf in one rank's micro-batch: every rank throws the same error at
    // the same step (the verdict is agreed), so none is left waiting.
    const int N = backend.deterministic->world_size();
    auto plant = [N](long step, long m) { return step == 2 && m == N - 1 ? 5l : -1l; };
    for (int stage : {0, 2}) {
      CHECK_THROWS_WITH_AS(
          train_synthetic<float>(*backend.compute, *backend.deterministic, mixed_options(stage, true, 500), 4, plant),
          doctest::Contains("a gradient is not finite (inf or NaN) in optimizer step 2"), z2::Error);
      CHECK_THROWS_WITH_AS(train_synthetic<z2::bfloat16>(*backend.compute, *backend.deterministic,
                                                         mixed_options(stage, true, 500), 4, plant),
                           doctest::Contains("not finite"), z2::Error);
    }
  }
}

TEST_CASE("fp16 loss scale is divided out exactly: static scales 1 and 2^8 train to the same bits") {
  // With gradients in fp16's normal range (here between 0.17 and 1) and a
  // power-of-two scale, every scaled value, sum, square and norm is the
  // unscaled one times a power of two, and the optimizer's 1/S (folded into
  // the clipping coefficient) brings it back exactly. AdamW alone would not
  // show a missing 1/S (m / sqrt(v) cancels a scale); bitwise equality does.
  auto gradient = [](float w, long step, long m, size_t k) {
    return 0.5f + 0.1f * w + test_value(700 + step, m, k) / 64.0f;
  };
  for (const auto& backend : harness::backends()) {
    std::vector<MixedRun> runs;
    for (double scale : {1.0, 256.0})
      for (int stage : {0, 2}) {
        z2::EngineOptions options = mixed_options(stage, true, 500);
        options.loss_scaling.static_scale = scale;
        runs.push_back(
            train_synthetic<z2::float16>(*backend.compute, *backend.deterministic, options, 6, nullptr, gradient));
      }
    bool ok = runs[1].scales == std::vector<double>(6, 1.0) && runs[3].scales == std::vector<double>(6, 256.0);
    for (const MixedRun& run : runs)
      ok &= same_bits(run.master, runs[0].master) && same_bits(run.grad_norms, runs[0].grad_norms) && run.reduced_ok;
    CHECK_MESSAGE(agree(ok, backend.name + ": the loss scale changed the result"), backend.name);
  }
}

TEST_CASE("fp16 overflow on one rank: every rank and every stage skips the same step; AdamW's t and the lr wait") {
  for (const auto& backend : harness::backends()) {
    const int N = backend.deterministic->world_size();
    // An inf in micro-batch m = N - 1 (the last rank's) at step 5 only.
    auto plant = [N](long step, long m) { return step == 5 && m == N - 1 ? 17l : -1l; };
    std::vector<MixedRun> runs;
    for (int stage : {0, 1, 2}) {
      z2::EngineOptions options = mixed_options(stage, true, 500);
      options.loss_scaling.initial_scale_power = 8;  // low enough that only the planted inf overflows
      options.loss_scaling.hysteresis = 1;
      runs.push_back(train_synthetic<z2::float16>(*backend.compute, *backend.deterministic, options, 8, plant));
    }
    const std::vector<char> expected_skips = {0, 0, 0, 0, 1, 0, 0, 0};
    // After the skip the scale halved (hysteresis 1); nothing else moved it.
    const std::vector<double> expected_scales = {256, 256, 256, 256, 256, 128, 128, 128};
    // The skipped step made no update, so step 6 is AdamW's t = 5, with the
    // schedule's lr for 5 (DeepSpeed steps neither on an overflow).
    const std::vector<long> expected_applied = {1, 2, 3, 4, 4, 5, 6, 7};
    auto schedule = [](long t) { return 0.02 * std::min(1.0, t / 3.0); };
    bool ok = true;
    for (const MixedRun& run : runs) {
      ok &= run.skipped == expected_skips && run.scales == expected_scales && run.applied == expected_applied &&
            same_mixed_run(run, runs[0]) && std::isnan(run.grad_norms[4]) && std::isfinite(run.grad_norms[5]);
      for (int k = 0; k < 8; ++k) ok &= run.lrs[k] == schedule(expected_applied[k] + (expected_skips[k] ? 1 : 0));
    }
    CHECK_MESSAGE(agree(ok, backend.name + ": an fp16 overflow was not skipped alike everywhere"), backend.name);
  }
}
