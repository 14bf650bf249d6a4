// runtime/gemm.cu — the products: C = alpha op(A) op(B) + beta C on the host
// (OpenBLAS's sgemm) or the GPU (cuBLAS), the 16-bit products of mixed
// precision, and zero2's own portable gemm (--portable, notes/11: the order
// portable_dot defines, a blocked CPU kernel with AVX schedules and a tiled
// CUDA kernel). nvcc compiles it: the portable kernel and the empty sum's
// loop (K = 0) are kernels.
#include "runtime/compute_resources.h"

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>

// The portable gemm's vector schedules, where the host compiler targets them
// (-march=native; never in nvcc's device pass).
#if !defined(__CUDA_ARCH__) && defined(__AVX512F__)
#define Z2_AVX512_LANES 1
#endif
#if !defined(__CUDA_ARCH__) && defined(__AVX2__) && defined(__FMA__)
#define Z2_AVX2_LANES 1
#endif
#if defined(Z2_AVX512_LANES) || defined(Z2_AVX2_LANES)
#include <immintrin.h>
#endif

#if defined(__CUDACC__)
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif

namespace z2 {

using Clock = std::chrono::steady_clock;

// --- the portable products (notes/11, "Portable bits") -----------------------
//
// zero2's own gemm, for --portable: every element in portable_dot's order
// (runtime/math.h): acc = fma(a_k, b_k, acc) for k = 0, 1, ..., K-1, then alpha and
// beta. The two kernels below are schedules of that loop. Neither splits k
// (no partial sums over ranges of k, no tree over k), so any blocking over
// rows and columns of C, any vector width and any thread layout give the
// same bits.
//
// Legend: M, N, K the product's sizes, C [M x N] row-major with leading
// dimension ldc; op(A) [M x K], op(B) [K x N]. The CPU kernel works on tiles
// of C of R x W (tile_rows x tile_columns of the vector width's traits).
//
// The CPU schedule (a GotoBLAS-style plan, one thread):
//   pack op(A) into strips of R rows, k-major:            [strips][K][R]
//   for each block of kColumnBlock columns of C:
//     pack op(B)'s block into panels of W columns, k-major: [panels][K][W]
//     for each strip x panel: the tile kernel sums over all of k in registers
//     (R x W accumulators), then alpha / beta into C.
// Rows and columns past M and N are packed as zeros; their results are
// discarded. k is never padded: a product 0 * 0 added to an accumulator of
// -0 would make it +0.

namespace {
constexpr int kColumnBlock = 256;  // a multiple of every tile width

// Vector traits for the tile kernel: `lanes` floats in one register, the
// explicit fused multiply-add of that width (one rounding per lane, the same
// as fma_fp32 on each lane: IEEE defines fma exactly), and the tile that
// fills the register file without spilling: R x W / lanes accumulators, plus
// W / lanes registers for B's row and one for A's broadcast. The tile shape
// changes the speed, never the bits.
struct ScalarLanes {
  static constexpr int lanes = 1, tile_rows = 4, tile_columns = 4;  // 16 accumulators
  using Vector = float;
  static Vector zero() { return 0.0f; }
  static Vector load(const float* p) { return *p; }
  static Vector broadcast(float x) { return x; }
  static Vector fma(Vector a, Vector b, Vector c) { return fma_fp32(a, b, c); }
  static void store(float* p, Vector v) { *p = v; }
};
#if defined(Z2_AVX2_LANES)
struct Avx2Lanes {
  static constexpr int lanes = 8, tile_rows = 6, tile_columns = 16;  // 12 of the 16 ymm registers
  using Vector = __m256;
  static Vector zero() { return _mm256_setzero_ps(); }
  static Vector load(const float* p) { return _mm256_loadu_ps(p); }
  static Vector broadcast(float x) { return _mm256_set1_ps(x); }
  static Vector fma(Vector a, Vector b, Vector c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, Vector v) { _mm256_storeu_ps(p, v); }
};
#endif
#if defined(Z2_AVX512_LANES)
struct Avx512Lanes {
  // 24 of the 32 zmm registers; 12 rows were faster than 8 or 14 in a
  // micro-benchmark of BERT-mini's shapes on a Skylake-X core.
  static constexpr int lanes = 16, tile_rows = 12, tile_columns = 32;
  using Vector = __m512;
  static Vector zero() { return _mm512_setzero_ps(); }
  static Vector load(const float* p) { return _mm512_loadu_ps(p); }
  static Vector broadcast(float x) { return _mm512_set1_ps(x); }
  static Vector fma(Vector a, Vector b, Vector c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, Vector v) { _mm512_storeu_ps(p, v); }
};
#endif

// tile [R x W] = the sums over k of one strip of op(A) (rows [K][R]) times
// one panel of op(B) (columns [K][W]), each accumulator in a register for
// all of k: portable_dot's loop for R x W elements at once.
template <class Lanes>
void portable_tile(int K, const float* __restrict rows, const float* __restrict columns, float* __restrict tile) {
  constexpr int R = Lanes::tile_rows, W = Lanes::tile_columns, vectors = W / Lanes::lanes;  // vectors per tile row
  typename Lanes::Vector acc[R][vectors];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < vectors; ++v) acc[r][v] = Lanes::zero();
  for (int k = 0; k < K; ++k) {
    typename Lanes::Vector b[vectors];
    for (int v = 0; v < vectors; ++v) b[v] = Lanes::load(columns + (size_t)k * W + v * Lanes::lanes);
    for (int r = 0; r < R; ++r) {
      const auto a = Lanes::broadcast(rows[(size_t)k * R + r]);
      for (int v = 0; v < vectors; ++v) acc[r][v] = Lanes::fma(a, b[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < vectors; ++v) Lanes::store(tile + r * W + v * Lanes::lanes, acc[r][v]);
}

// packed [strips][K][R] = op(A) [M x K] by strips of R rows (zeros past M).
void pack_row_strips(int R, bool transpose_a, int M, int K, const float* A, int lda, std::vector<float>& packed) {
  const int strips = (M + R - 1) / R;
  packed.resize((size_t)strips * K * R);
  for (int strip = 0; strip < strips; ++strip)
    for (int k = 0; k < K; ++k)
      for (int r = 0; r < R; ++r) {
        const int m = strip * R + r;
        const float value = m >= M ? 0.0f : transpose_a ? A[(size_t)k * lda + m] : A[(size_t)m * lda + k];
        packed[((size_t)strip * K + k) * R + r] = value;
      }
}

// packed [panels][K][W] = columns [first, first + count) of op(B) [K x N]
// by panels of W columns (zeros past the block).
void pack_column_panels(int W, bool transpose_b, int K, int first, int count, const float* B, int ldb,
                        std::vector<float>& packed) {
  const int panels = (count + W - 1) / W;
  packed.resize((size_t)panels * K * W);
  for (int panel = 0; panel < panels; ++panel)
    for (int k = 0; k < K; ++k)
      for (int c = 0; c < W; ++c) {
        const int within = panel * W + c, n = first + within;
        const float value = within >= count ? 0.0f : transpose_b ? B[(size_t)n * ldb + k] : B[(size_t)k * ldb + n];
        packed[((size_t)panel * K + k) * W + c] = value;
      }
}

template <class Lanes>
void portable_gemm_schedule(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const float* A,
                            int lda, const float* B, int ldb, float beta, float* C, int ldc) {
  constexpr int R = Lanes::tile_rows, W = Lanes::tile_columns;
  static_assert(kColumnBlock % W == 0, "a column block holds whole panels");
  // Kept between calls (one set per thread): no page faults per product.
  thread_local std::vector<float> strips, panels;
  pack_row_strips(R, transpose_a, M, K, A, lda, strips);
  alignas(64) float tile[R * W];
  for (int first = 0; first < N; first += kColumnBlock) {
    const int count = std::min(kColumnBlock, N - first);
    pack_column_panels(W, transpose_b, K, first, count, B, ldb, panels);
    for (int strip = 0; strip * R < M; ++strip)
      for (int panel = 0; panel * W < count; ++panel) {
        portable_tile<Lanes>(K, strips.data() + (size_t)strip * K * R, panels.data() + (size_t)panel * K * W, tile);
        const int rows = std::min(R, M - strip * R), columns = std::min(W, count - panel * W);
        for (int r = 0; r < rows; ++r) {
          float* c_row = C + (size_t)(strip * R + r) * ldc + first + panel * W;
          for (int c = 0; c < columns; ++c)
            c_row[c] = portable_finish(tile[r * W + c], alpha, beta, beta == 0.0f ? 0.0f : c_row[c]);
        }
      }
  }
}
}  // namespace

int portable_gemm_lanes() {
#if defined(Z2_AVX512_LANES)
  return 16;
#elif defined(Z2_AVX2_LANES)
  return 8;
#else
  return 1;
#endif
}

bool portable_gemm_has_lanes(int lanes) {
#if defined(Z2_AVX512_LANES)
  if (lanes == 16) return true;
#endif
#if defined(Z2_AVX2_LANES)
  if (lanes == 8) return true;
#endif
  return lanes == 1;
}

void portable_gemm_cpu(int lanes, bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const float* A,
                       int lda, const float* B, int ldb, float beta, float* C, int ldc) {
  if (!portable_gemm_has_lanes(lanes)) usage_error("portable gemm: this build has no %d-lane schedule", lanes);
  if (M == 0 || N == 0) return;
#if defined(Z2_AVX512_LANES)
  if (lanes == 16)
    return portable_gemm_schedule<Avx512Lanes>(transpose_a, transpose_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
#endif
#if defined(Z2_AVX2_LANES)
  if (lanes == 8)
    return portable_gemm_schedule<Avx2Lanes>(transpose_a, transpose_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
#endif
  portable_gemm_schedule<ScalarLanes>(transpose_a, transpose_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

#if defined(__CUDACC__)
// The CUDA schedule: a block of 16 x 16 threads computes a 64 x 64 tile of C,
// each thread 4 x 4 elements (rows ty + 16 i, columns tx + 16 j), with
// op(A) and op(B) staged through shared memory 16 values of k at a time,
// widened to fp32 as they are loaded. Each thread's accumulators walk k in
// order, one __fmaf_rn per step: portable_dot's loop. blockIdx.z is the
// product of a strided batch.
constexpr int kCudaTile = 64, kCudaDepth = 16, kCudaThreads = 16, kCudaPerThread = kCudaTile / kCudaThreads;

template <class T>
__global__ void portable_gemm_kernel(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const T* A,
                                     int lda, long stride_a, const T* B, int ldb, long stride_b, float beta, T* C,
                                     int ldc, long stride_c) {
  // [k][row of C] and [k][column of C]. The +1 spreads a k-contiguous
  // operand's stores (16 threads on one row, 65 floats apart) over banks.
  __shared__ float a_tile[kCudaDepth][kCudaTile + 1];
  __shared__ float b_tile[kCudaDepth][kCudaTile + 1];
  A += blockIdx.z * stride_a;
  B += blockIdx.z * stride_b;
  C += blockIdx.z * stride_c;
  const int first_row = blockIdx.y * kCudaTile, first_column = blockIdx.x * kCudaTile;
  const int tx = threadIdx.x, ty = threadIdx.y, thread = ty * kCudaThreads + tx;
  float acc[kCudaPerThread][kCudaPerThread];
  for (int i = 0; i < kCudaPerThread; ++i)
    for (int j = 0; j < kCudaPerThread; ++j) acc[i][j] = 0.0f;
  for (int k0 = 0; k0 < K; k0 += kCudaDepth) {
    // Element e of each tile: consecutive threads read consecutive addresses
    // (k for an operand stored k-contiguous, rows or columns otherwise), so a
    // warp's loads coalesce. Which thread loads which element changes no value.
    for (int e = thread; e < kCudaDepth * kCudaTile; e += kCudaThreads * kCudaThreads) {
      const bool a_k_contiguous = !transpose_a, b_k_contiguous = transpose_b;
      const int a_kk = a_k_contiguous ? e % kCudaDepth : e / kCudaTile;
      const int a_within = a_k_contiguous ? e / kCudaDepth : e % kCudaTile;
      const int b_kk = b_k_contiguous ? e % kCudaDepth : e / kCudaTile;
      const int b_within = b_k_contiguous ? e / kCudaDepth : e % kCudaTile;
      const int m = first_row + a_within, a_k = k0 + a_kk, n = first_column + b_within, b_k = k0 + b_kk;
      a_tile[a_kk][a_within] =
          m < M && a_k < K ? to_float(transpose_a ? A[(size_t)a_k * lda + m] : A[(size_t)m * lda + a_k]) : 0.0f;
      b_tile[b_kk][b_within] =
          n < N && b_k < K ? to_float(transpose_b ? B[(size_t)n * ldb + b_k] : B[(size_t)b_k * ldb + n]) : 0.0f;
    }
    __syncthreads();
    const int depth = min(kCudaDepth, K - k0);  // never past K: see the CPU schedule's note on -0
    for (int kk = 0; kk < depth; ++kk)
      for (int i = 0; i < kCudaPerThread; ++i)
        for (int j = 0; j < kCudaPerThread; ++j)
          acc[i][j] = fma_fp32(a_tile[kk][ty + kCudaThreads * i], b_tile[kk][tx + kCudaThreads * j], acc[i][j]);
    __syncthreads();
  }
  for (int i = 0; i < kCudaPerThread; ++i)
    for (int j = 0; j < kCudaPerThread; ++j) {
      const int m = first_row + ty + kCudaThreads * i, n = first_column + tx + kCudaThreads * j;
      if (m >= M || n >= N) continue;
      T* c = C + (size_t)m * ldc + n;
      *c = from_float<T>(portable_finish(acc[i][j], alpha, beta, beta == 0.0f ? 0.0f : to_float(*c)));
    }
}

template <class T>
void launch_portable_gemm(Stream stream, bool transpose_a, bool transpose_b, int M, int N, int K, float alpha,
                          const T* A, int lda, long stride_a, const T* B, int ldb, long stride_b, float beta, T* C,
                          int ldc, long stride_c, int batch) {
  // gridDim.y and .z stop at 65535: rows and products beyond go in further
  // launches, each on its part of A and C (a tile's values do not depend on
  // which launch computes it).
  const int rows_per_launch = 65535 * kCudaTile, batch_per_launch = 65535;
  for (int first_product = 0; first_product < batch; first_product += batch_per_launch)
    for (int first_row = 0; first_row < M; first_row += rows_per_launch) {
      const int rows = std::min(rows_per_launch, M - first_row);
      const int products = std::min(batch_per_launch, batch - first_product);
      const T* A_part = A + first_product * stride_a + (transpose_a ? (size_t)first_row : (size_t)first_row * lda);
      const T* B_part = B + first_product * stride_b;
      T* C_part = C + first_product * stride_c + (size_t)first_row * ldc;
      const dim3 grid((N + kCudaTile - 1) / kCudaTile, (rows + kCudaTile - 1) / kCudaTile, products);
      const dim3 threads(kCudaThreads, kCudaThreads);
      portable_gemm_kernel<T><<<grid, threads, 0, (cudaStream_t)stream.handle>>>(
          transpose_a, transpose_b, rows, N, K, alpha, A_part, lda, stride_a, B_part, ldb, stride_b, beta, C_part, ldc,
          stride_c);
      launch_check(__FILE__, __LINE__);
    }
}
#endif

void Compute::set_portable(bool on) {
  portable_ = on;
  portable_lanes_ = portable_gemm_lanes();
  const char* forced = getenv("Z2_PORTABLE_LANES");
  if (!on || forced == nullptr || *forced == '\0') return;
  const std::string text = forced;
  if (!(text == "16" || text == "8" || text == "1") || !portable_gemm_has_lanes(std::stoi(text)))
    usage_error(
        "Z2_PORTABLE_LANES=%s: this build's portable CPU schedules have %s lanes (16: AVX-512, 8: AVX2 "
        "with FMA, 1: scalar; the CPU target decides which exist)",
        forced,
        portable_gemm_lanes() == 16  ? "16, 8 or 1"
        : portable_gemm_lanes() == 8 ? "8 or 1"
                                     : "1");
  portable_lanes_ = std::stoi(text);
}

// One fp32 product on the host, OpenBLAS's sgemm or (portable: lanes > 0)
// zero2's schedule of that width, with the time it took added to `seconds`
// (a clock read costs ~20 ns; the smallest product of a BERT-mini step takes ~100 us).
static void timed_cpu_gemm(double& seconds, int portable_lanes, bool transpose_a, bool transpose_b, int M, int N, int K,
                           float alpha, const float* A, int lda, const float* B, int ldb, float beta, float* C,
                           int ldc) {
  const auto start = Clock::now();
  if (portable_lanes > 0)
    portable_gemm_cpu(portable_lanes, transpose_a, transpose_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  else
    cblas_sgemm(CblasRowMajor, transpose_a ? CblasTrans : CblasNoTrans, transpose_b ? CblasTrans : CblasNoTrans, M, N,
                K, alpha, A, lda, B, ldb, beta, C, ldc);
  seconds += std::chrono::duration<double>(Clock::now() - start).count();
}

// Elements a stored matrix of `rows` x `columns` (leading dimension `ld`)
// spans, and the span of `batch` of them `stride` apart.
static size_t matrix_span(int rows, int columns, int ld) { return rows == 0 ? 0 : (size_t)(rows - 1) * ld + columns; }
static size_t batch_span(size_t span, long stride, int batch) { return span + (size_t)(batch - 1) * (size_t)stride; }

// What the timeline's cost model charges a product: 2 M N K flops a matrix,
// on tensor cores for 16-bit operands (runtime/timeline.h).
static Work gemm_work(size_t element, int M, int N, int K, int batch) {
  return {element == sizeof(float) ? Work::Kind::gemm_fp32 : Work::Kind::gemm_16bit, 2.0 * M * N * K * batch};
}

// On sim a product is one operation on the compute stream, as a cuBLAS call
// is; what it reads (A, B, and C unless beta = 0) and writes (C) are its
// operands' spans, `element` bytes an element, for the race report.
void Compute::queue_gemm_on_sim(Site site, size_t element, bool transpose_a, bool transpose_b, int M, int N, int K,
                                const void* A, int lda, long stride_a, const void* B, int ldb, long stride_b,
                                float beta, const void* C, int ldc, long stride_c, int batch,
                                std::function<void()> run) {
  // (A span from its first element to its last: with ldc > N it covers the
  // gaps between C's rows too, so a race found there may be a near miss.)
  const size_t a = K == 0 ? 0 : element * batch_span(matrix_span(transpose_a ? K : M, transpose_a ? M : K, lda), stride_a, batch),
               b = K == 0 ? 0 : element * batch_span(matrix_span(transpose_b ? N : K, transpose_b ? K : N, ldb), stride_b, batch),
               c = element * batch_span(matrix_span(M, N, ldc), stride_c, batch);
  queue_on_sim(compute_stream_, "gemm", site, std::move(run), {{A, a}, {B, b}, {C, beta == 0.0f ? 0 : c}}, {{C, c}},
               false, gemm_work(element, M, N, K, batch));
}

void Compute::gemm(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const float* A, int lda,
                   const float* B, int ldb, float beta, float* C, int ldc, Site site) {
  if (M == 0 || N == 0) return;
  if (queues_on_sim())
    return queue_gemm_on_sim(site, sizeof(float), transpose_a, transpose_b, M, N, K, A, lda, 0, B, ldb, 0, beta, C, ldc,
                             0, 1, [=] { gemm(transpose_a, transpose_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc); });
  const Timed timed(*this, compute_stream_, "gemm", site, gemm_work(sizeof(float), M, N, K, 1));
  if (K == 0) {
    // An empty sum (a micro-batch that selected no position): C = alpha 0 +
    // beta C, as BLAS defines it, in portable_finish's roundings (so portable
    // mode's definition holds for K = 0 too, signed zeros included). We do it
    // ourselves because cuBLAS has, in some releases, returned without
    // touching C when k = 0 (pytorch#31421), which would leave stale values
    // where a zero gradient belongs.
    for_each((size_t)M * N, Z2_LOOP(i, {
               float* c = C + (i / N) * (size_t)ldc + i % N;
               *c = portable_finish(0.0f, alpha, beta, beta == 0.0f ? 0.0f : *c);
             }));
    return;
  }
  if (runs_now_on_host()) {
    timed_cpu_gemm(gemm_seconds_, portable_ ? portable_lanes_ : 0, transpose_a, transpose_b, M, N, K, alpha, A, lda, B,
                   ldb, beta, C, ldc);
    return;
  }
#if defined(__CUDACC__)
  if (portable_)
    return launch_portable_gemm(compute_stream_, transpose_a, transpose_b, M, N, K, alpha, A, lda, 0, B, ldb, 0, beta,
                                C, ldc, 0, 1);
  // cuBLAS is column-major. A row-major C is a column-major C^T, and
  // C^T = op(B)^T op(A)^T: swap the operands and the sizes, keep the flags.
  Z2_CUBLAS_CHECK(cublasSgemm((cublasHandle_t)cublas_, transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                              transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha, B, ldb, A, lda, &beta, C, ldc));
#endif
}

void Compute::gemm_batched(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const float* A,
                           int lda, long stride_a, const float* B, int ldb, long stride_b, float beta, float* C,
                           int ldc, long stride_c, int batch, Site site) {
  if (M == 0 || N == 0 || batch == 0) return;
  if (queues_on_sim())
    return queue_gemm_on_sim(site, sizeof(float), transpose_a, transpose_b, M, N, K, A, lda, stride_a, B, ldb, stride_b,
                             beta, C, ldc, stride_c, batch, [=] {
                               gemm_batched(transpose_a, transpose_b, M, N, K, alpha, A, lda, stride_a, B, ldb,
                                            stride_b, beta, C, ldc, stride_c, batch);
                             });
  const Timed timed(*this, compute_stream_, "gemm", site, gemm_work(sizeof(float), M, N, K, batch));
  if (runs_now_on_host() || K == 0) {
    for (int k = 0; k < batch; ++k)
      gemm(transpose_a, transpose_b, M, N, K, alpha, A + k * stride_a, lda, B + k * stride_b, ldb, beta,
           C + k * stride_c, ldc);
    return;
  }
#if defined(__CUDACC__)
  if (portable_)
    return launch_portable_gemm(compute_stream_, transpose_a, transpose_b, M, N, K, alpha, A, lda, stride_a, B, ldb,
                                stride_b, beta, C, ldc, stride_c, batch);
  // The same operand swap as gemm, batch by batch.
  Z2_CUBLAS_CHECK(cublasSgemmStridedBatched((cublasHandle_t)cublas_, transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                            transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha, B, ldb, stride_b,
                                            A, lda, stride_a, &beta, C, ldc, stride_c, batch));
#endif
}

// --- the 16-bit products (mixed precision) ----------------------------------


template <class T>
static void widen_to(const T* source, size_t count, std::vector<float>& target) {
  target.resize(count);
  for (size_t i = 0; i < count; ++i) target[i] = to_float(source[i]);
}

// C = alpha 0 + beta C (an empty sum, K = 0): as the fp32 gemm does it, in the storage type.
template <class T>
static void scale_matrix(Compute& compute, int M, int N, float alpha, float beta, T* C, int ldc, long stride_c,
                         int batch) {
  compute.for_each((size_t)batch * M * N, Z2_LOOP(i, {
                     const size_t k = i / ((size_t)M * N), within = i % ((size_t)M * N);
                     T* c = C + k * stride_c + (within / N) * (size_t)ldc + within % N;
                     *c = from_float<T>(portable_finish(0.0f, alpha, beta, beta == 0.0f ? 0.0f : to_float(*c)));
                   }));
}

// The cpu reference: widen each operand's span once, sgemm each product, and
// round back only C's M x N elements (the columns between them may belong to
// another head's product).
template <class T>
static void cpu_gemm_16bit(double& seconds, int portable_lanes, std::vector<float>& a, std::vector<float>& b,
                           std::vector<float>& c, bool transpose_a, bool transpose_b, int M, int N, int K, float alpha,
                           const T* A, int lda, long stride_a, const T* B, int ldb, long stride_b, float beta, T* C,
                           int ldc, long stride_c, int batch) {
  widen_to(A, batch_span(matrix_span(transpose_a ? K : M, transpose_a ? M : K, lda), stride_a, batch), a);
  widen_to(B, batch_span(matrix_span(transpose_b ? N : K, transpose_b ? K : N, ldb), stride_b, batch), b);
  const size_t c_span = batch_span(matrix_span(M, N, ldc), stride_c, batch);
  if (beta == 0.0f) c.assign(c_span, 0.0f);  // C's old values (even NaN bits) must not matter
  else widen_to(C, c_span, c);
  for (int k = 0; k < batch; ++k) {
    float* c_k = c.data() + k * stride_c;
    timed_cpu_gemm(seconds, portable_lanes, transpose_a, transpose_b, M, N, K, alpha, a.data() + k * stride_a, lda,
                   b.data() + k * stride_b, ldb, beta, c_k, ldc);
    T* C_k = C + k * stride_c;
    for (int row = 0; row < M; ++row)
      for (int column = 0; column < N; ++column)
        C_k[(size_t)row * ldc + column] = from_float<T>(c_k[(size_t)row * ldc + column]);
  }
}

void Compute::gemm_16bit(Precision precision, bool transpose_a, bool transpose_b, int M, int N, int K, float alpha,
                         const void* A, int lda, long stride_a, const void* B, int ldb, long stride_b, float beta,
                         void* C, int ldc, long stride_c, int batch, Site site) {
  if (M == 0 || N == 0 || batch == 0) return;
  if (queues_on_sim())
    return queue_gemm_on_sim(site, sizeof(uint16_t), transpose_a, transpose_b, M, N, K, A, lda, stride_a, B, ldb,
                             stride_b, beta, C, ldc, stride_c, batch, [=] {
                               gemm_16bit(precision, transpose_a, transpose_b, M, N, K, alpha, A, lda, stride_a, B, ldb,
                                          stride_b, beta, C, ldc, stride_c, batch, site);
                             });
  const Timed timed(*this, compute_stream_, "gemm", site, gemm_work(sizeof(uint16_t), M, N, K, batch));
  const bool bf16 = precision == Precision::bf16;
  if (K == 0) {  // see gemm(): C = beta C ourselves
    if (bf16) scale_matrix(*this, M, N, alpha, beta, (bfloat16*)C, ldc, stride_c, batch);
    else scale_matrix(*this, M, N, alpha, beta, (float16*)C, ldc, stride_c, batch);
    return;
  }
  if (runs_now_on_host()) {
    Resources& scratch = *resources_;
    const int lanes = portable_ ? portable_lanes_ : 0;  // 0: OpenBLAS
    if (bf16)
      cpu_gemm_16bit(gemm_seconds_, lanes, scratch.gemm_a, scratch.gemm_b, scratch.gemm_c, transpose_a, transpose_b, M,
                     N, K, alpha, (const bfloat16*)A, lda, stride_a, (const bfloat16*)B, ldb, stride_b, beta,
                     (bfloat16*)C, ldc, stride_c, batch);
    else
      cpu_gemm_16bit(gemm_seconds_, lanes, scratch.gemm_a, scratch.gemm_b, scratch.gemm_c, transpose_a, transpose_b, M,
                     N, K, alpha, (const float16*)A, lda, stride_a, (const float16*)B, ldb, stride_b, beta, (float16*)C,
                     ldc, stride_c, batch);
    return;
  }
#if defined(__CUDACC__)
  // The operand swap of gemm() (row-major C is column-major C^T), with the
  // 16-bit types and fp32 compute; alpha and beta are fp32 (the scale type of
  // CUBLAS_COMPUTE_32F).
  if (portable_ && bf16)
    return launch_portable_gemm(compute_stream_, transpose_a, transpose_b, M, N, K, alpha, (const bfloat16*)A, lda,
                                stride_a, (const bfloat16*)B, ldb, stride_b, beta, (bfloat16*)C, ldc, stride_c, batch);
  if (portable_)
    return launch_portable_gemm(compute_stream_, transpose_a, transpose_b, M, N, K, alpha, (const float16*)A, lda,
                                stride_a, (const float16*)B, ldb, stride_b, beta, (float16*)C, ldc, stride_c, batch);
  const cudaDataType type = bf16 ? CUDA_R_16BF : CUDA_R_16F;
  cublasHandle_t handle = (cublasHandle_t)cublas_16bit_;
  const cublasOperation_t op_b = transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                          op_a = transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (batch == 1)
    Z2_CUBLAS_CHECK(cublasGemmEx(handle, op_b, op_a, N, M, K, &alpha, B, type, ldb, A, type, lda, &beta, C, type, ldc,
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  else
    Z2_CUBLAS_CHECK(cublasGemmStridedBatchedEx(handle, op_b, op_a, N, M, K, &alpha, B, type, ldb, stride_b, A, type,
                                               lda, stride_a, &beta, C, type, ldc, stride_c, batch, CUBLAS_COMPUTE_32F,
                                               CUBLAS_GEMM_DEFAULT));
#endif
}

void Compute::gemm(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const bfloat16* A, int lda,
                   const bfloat16* B, int ldb, float beta, bfloat16* C, int ldc, Site site) {
  gemm_16bit(Precision::bf16, transpose_a, transpose_b, M, N, K, alpha, A, lda, 0, B, ldb, 0, beta, C, ldc, 0, 1, site);
}
void Compute::gemm(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const float16* A, int lda,
                   const float16* B, int ldb, float beta, float16* C, int ldc, Site site) {
  gemm_16bit(Precision::fp16, transpose_a, transpose_b, M, N, K, alpha, A, lda, 0, B, ldb, 0, beta, C, ldc, 0, 1, site);
}
void Compute::gemm_batched(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const bfloat16* A,
                           int lda, long stride_a, const bfloat16* B, int ldb, long stride_b, float beta, bfloat16* C,
                           int ldc, long stride_c, int batch, Site site) {
  gemm_16bit(Precision::bf16, transpose_a, transpose_b, M, N, K, alpha, A, lda, stride_a, B, ldb, stride_b, beta, C,
             ldc, stride_c, batch, site);
}
void Compute::gemm_batched(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const float16* A,
                           int lda, long stride_a, const float16* B, int ldb, long stride_b, float beta, float16* C,
                           int ldc, long stride_c, int batch, Site site) {
  gemm_16bit(Precision::fp16, transpose_a, transpose_b, M, N, K, alpha, A, lda, stride_a, B, ldb, stride_b, beta, C,
             ldc, stride_c, batch, site);
}

}  // namespace z2
