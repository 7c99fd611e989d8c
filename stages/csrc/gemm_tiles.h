// The fp32 register tiles of the CPU GEMM: c (M x 16; with AVX-512 also M x 32 over two adjacent
// panels) (+)= a K slab of x's rows, packed k-major, times the same slab of 16-wide weight panels,
// M <= MR rows. Every output sums its k terms one FMA at a time in k order, in every tile here, so
// each path that ends in them (fp32 panels: gemm.cpp, block-quantized ones: gemm_quant.cpp) gives
// the same bits. A slab after the first (acc) starts its accumulators from c, the sums so far,
// instead of adding its own sum to c at the end: one chain of FMAs over the whole K either way, so
// a row's product has the same bits whether its batch's rows cut K into slabs (13+ rows) or not
// (a seeded sample then draws the same token in any batch; before, 13+ rows differed at ~1e-5).
// A header, in an anonymous namespace, because the loops of those files call the tiles and must
// keep inlining them (the module's files are linked without LTO); gemm_common.h includes it.
#pragma once
#include <cstdint>

#include "panels.h"
#include "vec.h"

#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif

namespace {

constexpr int MR = 6;         // rows per register tile

// c[i][0..16) = t[i] (+ bias) for the m rows of one tile
inline void store_tile(const float* t, int m, float* c, int64_t ldc, const float* bias) {
  for (int i = 0; i < m; ++i) {
    float* ci = c + i * ldc;
    const float* ti = t + i * NR;
    for (int j = 0; j < NR; ++j) ci[j] = ti[j] + (bias ? bias[j] : 0.f);
  }
}

#ifdef PP_AVX2
// Named accumulators, not an array: GCC keeps an array of __m256 in memory and stores it on
// every iteration (measured: 27 GFLOP/s against 65).
#define PP_ROW(i)                                                       \
  if constexpr (M > i) {                                                \
    const __m256 x = _mm256_broadcast_ss(a + k * M + i);                \
    c##i##0 = _mm256_fmadd_ps(x, b0, c##i##0);                          \
    c##i##1 = _mm256_fmadd_ps(x, b1, c##i##1);                          \
  }
#define PP_OUT(i)                                                       \
  if constexpr (M > i) {                                                \
    _mm256_store_ps(t[i], c##i##0);                                     \
    _mm256_store_ps(t[i] + 8, c##i##1);                                 \
  }
#define PP_IN(i)                                                        \
  if constexpr (M > i) {                                                \
    c##i##0 = _mm256_loadu_ps(c + i * ldc);                             \
    c##i##1 = _mm256_loadu_ps(c + i * ldc + 8);                         \
  }
// The 6 x 16 register tile as three steps both tiles below share: its 12 accumulators (PP_RESUME:
// from the sums so far in c); one k step (two 8-wide loads of the weight row at bk, then PP_ROWS: a
// broadcast of each x row from a and its FMAs into b0, b1); and its write-out to c.
#define PP_ACCS                                                                                    \
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, \
         c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#define PP_RESUME PP_IN(0) PP_IN(1) PP_IN(2) PP_IN(3) PP_IN(4) PP_IN(5)
#define PP_ROWS PP_ROW(0) PP_ROW(1) PP_ROW(2) PP_ROW(3) PP_ROW(4) PP_ROW(5)
#define PP_STEP(bk)                                                                                \
  {                                                                                                \
    const __m256 b0 = _mm256_loadu_ps(bk), b1 = _mm256_loadu_ps((bk) + 8);                        \
    PP_ROWS                                                                                        \
  }
#define PP_WRITE                                                                                   \
  {                                                                                                \
    alignas(32) float t[MR][NR];                                                                   \
    PP_OUT(0) PP_OUT(1) PP_OUT(2) PP_OUT(3) PP_OUT(4) PP_OUT(5)                                    \
    write_tile(t, M, c, ldc, bias);                                                                \
  }

// c (m x 16) = t (+ bias): a tile's accumulators, stored to its rows of the output
inline void write_tile(const float (*t)[NR], int m, float* c, int64_t ldc, const float* bias) {
  if (bias) {
    store_tile(&t[0][0], m, c, ldc, bias);
    return;
  }
  for (int i = 0; i < m; ++i) {
    float* ci = c + i * ldc;
    _mm256_storeu_ps(ci, _mm256_load_ps(t[i]));
    _mm256_storeu_ps(ci + 8, _mm256_load_ps(t[i] + 8));
  }
}

// c (M x 16, row stride ldc) (+)= a (kc x M, packed k-major) · b (kc x 16 panel slab), acc: the sums
// so far in c go on (the accumulators start from them). bias: added once the sums are whole. PF:
// prefetch the next slab (pf) into L2 — only the first tile of a row block does, the others would ask for
// the same lines again (a prefetch per 12 FMAs in every tile cost 20-30% in a hot-cache loop).
template <int M, bool PF>
void tile(const float* a, const float* b, const float* pf, int64_t kc, float* c, int64_t ldc,
          bool acc, const float* bias) {
  PP_ACCS
  if (acc) {  // the sums so far go on (see the top of this file)
    PP_RESUME
  }
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    // the next slab into L2 while this one is in use: for a few rows the panels stream from
    // memory, and a prefetch a few lines ahead hides too little of its latency
    if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(pf + k * NR), PF_HINT);
    PP_STEP(b + k * NR)
  }
  PP_WRITE
}
// The PP_ macros stay defined for qtile (the block-quantized few-row tile, gemm_quant.cpp),
// which #undefs them after it.
#else
// The plain loops, kept in k order: the module builds with -ffast-math, under which GCC reassociated
// the 1-row tile's sums (vectorized over k), and one row alone came out other bits than in two.
template <int M, bool PF>
__attribute__((optimize("no-associative-math"))) void tile(const float* a, const float* b, const float*, int64_t kc,
                                                           float* c, int64_t ldc, bool acc, const float* bias) {
  float t[MR][NR] = {};
  for (int i = 0; i < M && acc; ++i)
    for (int j = 0; j < NR; ++j) t[i][j] = c[i * ldc + j];
  for (int64_t k = 0; k < kc; ++k)
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < NR; ++j) t[i][j] += a[k * M + i] * b[k * NR + j];
  store_tile(&t[0][0], M, c, ldc, bias);
}
#endif

using TileFn = void (*)(const float*, const float*, const float*, int64_t, float*, int64_t, bool, const float*);
constexpr TileFn kTiles[2][MR + 1] = {{nullptr, tile<1, false>, tile<2, false>, tile<3, false>, tile<4, false>, tile<5, false>, tile<6, false>},
  {nullptr, tile<1, true>, tile<2, true>, tile<3, true>, tile<4, true>, tile<5, true>, tile<6, true>}};

#ifdef PP_AVX512
// Two adjacent panels at once in 16-lane registers: a 6 x 32 tile, 12 accumulators again (one
// per row and panel). An 8-lane tile cannot use the second half of a 512-bit FMA unit; the 16-lane
// one doubles the FLOPs per instruction (measured on a Zen 5 core: 127 against 255 GFLOP/s of
// plain FMAs). Every output element still sums its k terms one FMA at a time in k order, so a
// product is bit-identical to the 8-lane tile's. b0, b1: the two panels' slabs; pf, pf_stride: the
// next pair's first slab and the step to its second (prefetches never fault, so a pair past the
// end may be asked for).
#define PZ_ROW(i)                                                       \
  if constexpr (M > i) {                                                \
    const __m512 x = _mm512_set1_ps(a[k * M + i]);                      \
    c##i##0 = _mm512_fmadd_ps(x, w0, c##i##0);                          \
    c##i##1 = _mm512_fmadd_ps(x, w1, c##i##1);                          \
  }
#define PZ_IN(i)                                                        \
  if constexpr (M > i) {                                                \
    c##i##0 = _mm512_loadu_ps(c + i * ldc);                             \
    c##i##1 = _mm512_loadu_ps(c + i * ldc + NR);                        \
  }
#define PZ_OUT(i)                                                       \
  if constexpr (M > i) {                                                \
    _mm512_store_ps(t[i], c##i##0);                                     \
    _mm512_store_ps(t[i] + NR, c##i##1);                                \
  }
template <int M, bool PF>
void tile_pair(const float* a, const float* b0, const float* b1, const float* pf, int64_t pf_stride, int64_t kc,
               float* c, int64_t ldc, bool acc, const float* bias) {
  __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  if (acc) {  // the sums so far go on (see the top of this file)
    PZ_IN(0) PZ_IN(1) PZ_IN(2) PZ_IN(3) PZ_IN(4) PZ_IN(5)
  }
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    if constexpr (PF) {
      _mm_prefetch(reinterpret_cast<const char*>(pf + k * NR), PF_HINT);
      _mm_prefetch(reinterpret_cast<const char*>(pf + pf_stride + k * NR), PF_HINT);
    }
    const __m512 w0 = _mm512_loadu_ps(b0 + k * NR), w1 = _mm512_loadu_ps(b1 + k * NR);
    PZ_ROW(0) PZ_ROW(1) PZ_ROW(2) PZ_ROW(3) PZ_ROW(4) PZ_ROW(5)
  }
  alignas(64) float t[MR][2 * NR];
  PZ_OUT(0) PZ_OUT(1) PZ_OUT(2) PZ_OUT(3) PZ_OUT(4) PZ_OUT(5)
  for (int i = 0; i < M; ++i) {
    float* ci = c + i * ldc;
    for (int h = 0; h < 2 * NR; h += NR) {
      __m512 v = _mm512_load_ps(t[i] + h);
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + h));
      _mm512_storeu_ps(ci + h, v);
    }
  }
}
#undef PZ_ROW
#undef PZ_IN
#undef PZ_OUT

using PairFn = void (*)(const float*, const float*, const float*, const float*, int64_t, int64_t, float*, int64_t,
                        bool, const float*);
constexpr PairFn kPairs[2][MR + 1] = {
  {nullptr, tile_pair<1, false>, tile_pair<2, false>, tile_pair<3, false>, tile_pair<4, false>, tile_pair<5, false>, tile_pair<6, false>},
  {nullptr, tile_pair<1, true>, tile_pair<2, true>, tile_pair<3, true>, tile_pair<4, true>, tile_pair<5, true>, tile_pair<6, true>}};
constexpr int64_t PANELS_AT_ONCE = 2;
#else
constexpr int64_t PANELS_AT_ONCE = 1;
#endif

}  // namespace
