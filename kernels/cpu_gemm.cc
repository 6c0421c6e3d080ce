// Small-batch float32 matrix product for XLA:CPU, as an XLA FFI custom call (kernels/cpu_gemm.py).
//
//   y[m, n] = sum_k x[m, k] * w[n, k]     x [M, K], w [N, K] (a row per output), y [M, N]
//
// x and y are float32; w is float32 (specjax_gemm_nt) or bfloat16 (specjax_gemm_nt_bf16), each
// bfloat16 weight widened exactly to float32 as it is loaded, so the bfloat16 product equals the
// float32 product of the widened weights bit for bit and streams half the bytes.
//
// A verify pass multiplies a few rows (the tree's nodes) by every weight matrix of the target.
// XLA:CPU's matrix product at 2-64 rows streams the weights at about half the speed of its
// one-row product, so a 2-node pass cost ~1.6x a one-node pass. This kernel reads each weight
// row from memory once for all M rows: the N outputs are split into chunks of rows of w, taken
// by XLA's intra-op threads from a shared counter, and each chunk is walked in tiles of MR rows
// of x by NR rows of w whose MR * NR accumulators live in registers (AVX2 + FMA), the NR rows
// of w staying in L1 while every row group of x passes over them (bfloat16 rows widened once
// into an L1-sized float32 buffer of 16 * K bytes when x has several row groups).
//
// Every output element is computed the same way wherever it falls: eight lane sums over k in
// steps of 8 (one FMA chain each, k ascending), a fixed reduction tree across the lanes, then the
// k % 8 trailing terms by scalar FMAs. No tile shape, row count or thread changes the order, so
// a row's result does not depend on the other rows beside it (bitwise).

#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <new>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kRowTile = 3;            // MR: rows of x per register tile
constexpr int kColTile = 4;            // NR: rows of w per register tile
constexpr int64_t kChunk = 48;         // rows of w per unit of work taken by a thread
constexpr int kPrefetchBytes = 512;    // how far ahead in a row of w to prefetch

// Eight weights from p as float32: float32 loads as is, bfloat16 (uint16_t) shifted into the
// high half of a float32, which is exact.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float widen(float v) { return v; }
inline float widen(uint16_t v) {
  const uint32_t bits = uint32_t{v} << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// The MR x NR outputs of rows m0.. of x and rows n0.. of w, which start at wr (row j at
// wr + j * K).
template <int MR, int NR, typename W>
inline void tile(const float* x, const W* wr, float* y, int64_t K, int64_t N, int64_t m0,
                 int64_t n0) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t k8 = K & ~int64_t{7};
  for (int64_t k = 0; k < k8; k += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) {
      const W* row = wr + j * K + k;
      _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
      wv[j] = load8(row);
    }
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + (m0 + i) * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float s = lane_sum(acc[i][j]);
      for (int64_t k = k8; k < K; ++k) {
        s = __builtin_fmaf(x[(m0 + i) * K + k], widen(wr[j * K + k]), s);
      }
      y[(m0 + i) * N + n0 + j] = s;
    }
  }
}

// Outputs of every row of x for rows n0 .. n0 + NR - 1 of w, which start at wr.
template <int NR, typename W>
inline void columns(const float* x, const W* wr, float* y, int64_t M, int64_t K, int64_t N,
                    int64_t n0) {
  int64_t m = 0;
  for (; m + kRowTile <= M; m += kRowTile) tile<kRowTile, NR>(x, wr, y, K, N, m, n0);
  switch (M - m) {
    case 2: tile<2, NR>(x, wr, y, K, N, m, n0); break;
    case 1: tile<1, NR>(x, wr, y, K, N, m, n0); break;
    default: break;
  }
}

// The work shared by the calling thread and its helpers: chunks of rows of w, handed out by
// `next`. It lives on the heap, owned by every task: a helper that starts after the call has
// returned finds no chunk left and touches no buffer.
template <typename W>
struct Job {
  const float* x;
  const W* w;
  float* y;
  int64_t m, k, n, chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};

  // Rows n0 .. n0 + NR - 1 of w for every row of x. Given `wide` (room for kColTile rows),
  // bfloat16 rows are widened into it once, the same float32 values the tiles would load,
  // instead of once per row tile of x.
  template <int NR>
  void group(int64_t n0, float* wide) {
    const W* wr = w + n0 * k;
    if constexpr (std::is_same_v<W, uint16_t>) {
      if (wide != nullptr) {
        for (int64_t i = 0; i < NR * k; ++i) wide[i] = widen(wr[i]);
        columns<NR>(x, static_cast<const float*>(wide), y, m, k, n, n0);
        return;
      }
    }
    columns<NR>(x, wr, y, m, k, n, n0);
  }

  void work() {
    // Widening once pays where x has more than one row tile; without the memory (no
    // exception may cross the FFI boundary) every tile widens its own loads.
    std::unique_ptr<float[]> wide;
    bool wanted = std::is_same_v<W, uint16_t> && m > kRowTile;
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      if (wanted) {
        wide.reset(new (std::nothrow) float[kColTile * k]);
        wanted = false;
      }
      const int64_t begin = c * kChunk, end = begin + kChunk < n ? begin + kChunk : n;
      int64_t col = begin;
      for (; col + kColTile <= end; col += kColTile) group<kColTile>(col, wide.get());
      for (; col < end; ++col) group<1>(col, wide.get());
      finished.fetch_add(1, std::memory_order_release);
    }
  }
};

template <ffi::DataType T>
ffi::Error GemmNT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<T> w,
                  ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("specjax_gemm_nt(_bf16) expects x [M, K] and w [N, K]");
  }
  auto job = std::make_shared<Job<ffi::NativeType<T>>>();
  job->x = x.typed_data();
  job->w = w.typed_data();
  job->y = y->typed_data();
  job->m = xd[0];
  job->k = xd[1];
  job->n = wd[0];
  job->chunks = (job->n + kChunk - 1) / kChunk;
  if (job->m == 0 || job->chunks == 0) return ffi::Error::Success();
  // The caller works too and can finish every chunk alone, so a helper that never gets a
  // thread (all busy) delays nothing but its own share.
  int64_t helpers = pool.num_threads() - 1;
  if (helpers > job->chunks - 1) helpers = job->chunks - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([job] { job->work(); });
  job->work();
  // Only chunks already taken by a running helper remain.
  while (job->finished.load(std::memory_order_acquire) < job->chunks) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxGemmNT, GemmNT<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxGemmNTBF16, GemmNT<ffi::BF16>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
