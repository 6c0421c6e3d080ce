// Small-batch float32 matrix product for XLA:CPU, as an XLA FFI custom call (kernels/cpu_gemm.py).
//
//   y[m, n] = sum_k x[m, k] * w[n, k]     x [M, K], w [N, K] (a row per output), y [M, N]
//
// A verify pass multiplies a few rows (the tree's nodes) by every weight matrix of the target.
// XLA:CPU's matrix product at 2-64 rows streams the weights at about half the speed of its
// one-row product, so a 2-node pass cost ~1.6x a one-node pass. This kernel reads each weight
// row from memory once for all M rows: the N outputs are split into chunks of rows of w, taken
// by XLA's intra-op threads from a shared counter, and each chunk is walked in tiles of MR rows
// of x by NR rows of w whose MR * NR accumulators live in registers (AVX2 + FMA), the NR rows
// of w staying in L1 while every row group of x passes over them.
//
// Every output element is computed the same way wherever it falls: eight lane sums over k in
// steps of 8 (one FMA chain each, k ascending), a fixed reduction tree across the lanes, then the
// k % 8 trailing terms by scalar FMAs. No tile shape, row count or thread changes the order, so
// a row's result does not depend on the other rows beside it (bitwise).

#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kRowTile = 3;            // MR: rows of x per register tile
constexpr int kColTile = 4;            // NR: rows of w per register tile
constexpr int64_t kChunk = 48;         // rows of w per unit of work taken by a thread
constexpr int kPrefetchBytes = 512;    // how far ahead in a row of w to prefetch

inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// The MR x NR outputs of rows m0.. of x and rows n0.. of w.
template <int MR, int NR>
inline void tile(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t m0,
                 int64_t n0) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t k8 = K & ~int64_t{7};
  for (int64_t k = 0; k < k8; k += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) {
      const float* row = w + (n0 + j) * K + k;
      _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
      wv[j] = _mm256_loadu_ps(row);
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
        s = __builtin_fmaf(x[(m0 + i) * K + k], w[(n0 + j) * K + k], s);
      }
      y[(m0 + i) * N + n0 + j] = s;
    }
  }
}

// Outputs of every row of x for rows n0 .. n0 + NR - 1 of w.
template <int NR>
inline void columns(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N,
                    int64_t n0) {
  int64_t m = 0;
  for (; m + kRowTile <= M; m += kRowTile) tile<kRowTile, NR>(x, w, y, K, N, m, n0);
  switch (M - m) {
    case 2: tile<2, NR>(x, w, y, K, N, m, n0); break;
    case 1: tile<1, NR>(x, w, y, K, N, m, n0); break;
    default: break;
  }
}

// The work shared by the calling thread and its helpers: chunks of rows of w, handed out by
// `next`. It lives on the heap, owned by every task: a helper that starts after the call has
// returned finds no chunk left and touches no buffer.
struct Job {
  const float* x;
  const float* w;
  float* y;
  int64_t m, k, n, chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};

  void work() {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      const int64_t begin = c * kChunk, end = begin + kChunk < n ? begin + kChunk : n;
      int64_t col = begin;
      for (; col + kColTile <= end; col += kColTile) columns<kColTile>(x, w, y, m, k, n, col);
      for (; col < end; ++col) columns<1>(x, w, y, m, k, n, col);
      finished.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error GemmNT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("specjax_gemm_nt expects x [M, K] and w [N, K]");
  }
  auto job = std::make_shared<Job>();
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxGemmNT, GemmNT,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
