// paged_decode's register-tiled walk (heads_tiled), 8 lanes (AVX2) or 16 (AVX-512) wide; included by
// paged_decode.cpp, which dispatches to it.
#pragma once

#include <algorithm>
#include <limits>
#include <vector>

#include "paged_decode.h"
#include "vec.h"

namespace pp_decode {

#ifdef PP_AVX2
// Register-tiled versions of one_head's two passes, for a compile-time head size and group.
// one_head's plain loops (paged_decode.cpp) keep one dot product per (row, head) in flight, and
// each ends in a horizontal sum: a chain of dependent FMAs and shuffles per row, which left the kernel at
// ~8 GB/s of K/V against ~38 GB/s the core streams. Here pass 1 takes R rows at once (G·R
// independent accumulators, reduced four rows per shuffle tree) and pass 2 keeps a CV-vector
// slice of the G output rows in registers across RV rows of a block. Same math; pass 2 adds the
// rows in the same order as before, pass 1's dot products reassociate (like -ffast-math did).
//
// One walk, two vector widths (a struct of the vector ops and the tile sizes each width wants):
// Lanes8 (AVX2) and, where the build has AVX-512, Lanes16. At 8 lanes half of a 512-bit FMA
// unit idles and a G = 3 tile (12 accumulators + q + k) does not fit the 16 ymm registers.

// (a, b, c, d) -> their four horizontal sums, in order
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

struct Lanes8 {
  using V = __m256;
  static constexpr int N = 8;
  static constexpr int rows_at_once(int g) { return g <= 3 ? 4 : (g <= 6 ? 2 : 1); }
  static constexpr int slice_vectors(int g, int) { return g <= 3 ? 4 : (g <= 6 ? 2 : 1); }
  static constexpr int64_t RV = 4;        // pass 2: rows per slice load / store, in order as in pass 1
  static V zero() { return _mm256_setzero_ps(); }
  static V loadf(const float* p) { return _mm256_loadu_ps(p); }
  template <typename T> static V load(const T* p) { return load8(p); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static __m128 sum4(V a, V b, V c, V d) { return hsum4(a, b, c, d); }
  static float sum(V v) { return hsum256(v); }
};

#ifdef PP_AVX512
// (a, b, c, d) -> their four horizontal sums, in order
inline __m128 hsum4x16(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  // the upper 256 bits through the f64 view: extractf32x8 would need AVX512DQ, this is AVX512F
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1));
  const __m256 v = _mm256_add_ps(_mm512_castps512_ps256(u), hi);
  return _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
}

// 16 lanes. Pass 2 goes head by head through a whole block, a head's G × W slice in registers
// across the block's rows (Lanes8's order, four rows then the next head, measured the same cold and
// 10% slower hot here).
// SmolLM2 shapes, 30 layers' caches, scattered 16-token blocks, 1 thread, B = 4 × 256 keys:
// 0.63-0.71 of the 8-lane walk's time read cold, 0.67-0.70 hot (docs/BENCHMARKS.md).
struct Lanes16 {
  using V = __m512;
  static constexpr int N = 16;
  static constexpr int rows_at_once(int g) { return g <= 4 ? 4 : 2; }  // G·R ≤ 16 accumulators
  static constexpr int slice_vectors(int g, int dc) {  // G·CV ≤ 16 accumulators, CV | D / 16
    const int most = g <= 2 ? 8 : (g <= 4 ? 4 : 2);
    return most < dc / 16 ? most : dc / 16;
  }
  static constexpr int64_t RV = std::numeric_limits<int64_t>::max();  // a whole block
  static V zero() { return _mm512_setzero_ps(); }
  static V loadf(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const c10::Half* p) { return load16(p); }
  static V load(const Fp8* p) { return load16(p); }  // 16 fp8 -> 16 floats · 2⁻⁸
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static __m128 sum4(V a, V b, V c, V d) { return hsum4x16(a, b, c, d); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
};
using Lanes = Lanes16;
#else
using Lanes = Lanes8;
#endif

// scores of the G query heads (qb: (G, D)) against R rows from kr (stride rs): p[g·len + j] = q_g·k_j·scale
template <typename L, typename T, int DC, int GC, int R>
inline void score_rows(const float* qb, const T* kr, int64_t rs, float scale, float* p, int64_t len) {
  typename L::V acc[GC][R];
  for (int g = 0; g < GC; ++g)
    for (int r = 0; r < R; ++r) acc[g][r] = L::zero();
  for (int d = 0; d < DC; d += L::N) {
    typename L::V qv[GC];
    for (int g = 0; g < GC; ++g) qv[g] = L::loadf(qb + g * DC + d);
    for (int r = 0; r < R; ++r) {
      const typename L::V kv = L::load(kr + r * rs + d);
      for (int g = 0; g < GC; ++g) acc[g][r] = L::fma(qv[g], kv, acc[g][r]);
    }
  }
  for (int g = 0; g < GC; ++g) {
    if constexpr (R == 4) {
      _mm_storeu_ps(p + g * len, _mm_mul_ps(L::sum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), _mm_set1_ps(scale)));
    } else {
      for (int r = 0; r < R; ++r) p[g * len + r] = L::sum(acc[g][r]) * scale;
    }
  }
}

// KV heads [h0, h1) of sequence b. The kernel is bound by reading K/V from memory, and how fast
// that goes depends on the order: a task per KV head reads a third of every 768-byte row of a
// block and jumps, 8.4 GB/s on scattered 16-token blocks (SmolLM2 shapes, 12 sequences × 900
// keys, 15 layers' caches, 1 thread, 8 lanes); all heads of a row before the next row keeps the
// walk sequential within a block: 10.5 GB/s scattered, 20 GB/s when the blocks are in order,
// 35 GB/s hot in cache.
//
// The walk asks for what it reads next one block ahead, across the seams too (blocks are scattered,
// and the stream prefetcher starts over at every block and page the walk jumps to):
// the next K block in pass 1 (and V's first during K's last), the next V block in pass 2, and
// during V's last block the next sequence's first K block (next_seq: this task's next sequence,
// its first row, or -1). The V and seam prefetches gave 0.78-0.91 of the K-only walk's time
// (SmolLM2 shapes, 30 layers' caches, scattered blocks, 1-2 threads, fp16 and fp32, B = 4-32,
// 256-1024 keys; docs/BENCHMARKS.md). At 8 lanes the prefetch once measured no gain (the first AVX2
// box); on the 2-core Zen 3 box, paired runs, it took 0.62-0.63x the time without on fp16 and fp8 K/V
// (B = 32, 16-200 keys), 0.86x at B = 16 × 900 keys fp32, about even at B = 4 × 256 (docs/BENCHMARKS.md).
template <typename L, typename T, int DC, int GC>
void heads_tiled(const Args<T>& a, int64_t b, int64_t h0, int64_t h1, std::vector<float>& p, std::vector<float>& acc,
                 std::vector<float>& inv, int64_t next_seq) {
  constexpr int R = L::rows_at_once(GC), CV = L::slice_vectors(GC, DC), W = L::N * CV;
  static_assert(DC % W == 0, "head size must be a whole number of slices");
  const int64_t len = a.lens[b], rs = a.Hkv * DC, nh = h1 - h0;
  const int64_t* table = a.tables + b * a.NBT;
  const float kscale = a.scale * raw_unit<T>();  // L::load's K rows are in raw units (vec.h)
  // block id's first row (all KV heads) in a cache; bytes of n rows
  auto block = [&a, rs](const T* cache, int64_t id) { return cache + id * a.BS * rs; };
  auto row_bytes = [rs](int64_t n) { return n * rs * static_cast<int64_t>(sizeof(T)); };
  p.resize(nh * GC * len);
  acc.resize(nh * GC * DC);
  inv.resize(nh * GC);
  // pass 1: scores, R rows of a block at a time (a block's rows are rs apart); p is (nh·G, len)
  for (int64_t start = 0, blk = 0; start < len; start += a.BS, ++blk) {
    const int64_t n = std::min(a.BS, len - start);
    // the next block's K rows (V's first block's after the last), the same rows as scored now
    const T* next = start + a.BS < len ? block(a.k, table[blk + 1]) : block(a.v, table[0]);
    // rows in order, every head of a row before the next rows: the walk through the block stays
    // sequential, which the stream prefetcher follows (a head-by-head walk is strided)
    for (int64_t j = 0; j < n;) {
      const bool full = j + R <= n;
      prefetch_bytes(next + j * rs, row_bytes(full ? R : 1));
      for (int64_t h = h0; h < h1; ++h) {
        const float* qb = a.q + (b * a.H + h * GC) * DC;
        const T* kr = a.k + (table[blk] * a.BS * a.Hkv + h) * DC + j * rs;
        float* ph = p.data() + (h - h0) * GC * len + start + j;
        if (full) score_rows<L, T, DC, GC, R>(qb, kr, rs, kscale, ph, len);
        else score_rows<L, T, DC, GC, 1>(qb, kr, rs, kscale, ph, len);
      }
      j += full ? R : 1;
    }
  }
  for (int64_t g = 0; g < nh * GC; ++g) {
    float* s = p.data() + g * len;
    inv[g] = 1.f / exp_row(s, len, 1.f, row_max(s, len));
  }
  // pass 2: out_g = Σ_j p[g, j] · v_j, a W-wide slice of a head's G rows in registers for RV rows
  std::fill(acc.begin(), acc.end(), 0.f);
  for (int64_t start = 0, blk = 0; start < len; start += a.BS, ++blk) {
    const int64_t n = std::min(a.BS, len - start);
    if (start + a.BS < len) {  // the next V block, then the next sequence's first K block
      prefetch_bytes(block(a.v, table[blk + 1]), row_bytes(n));
    } else if (next_seq >= 0) {
      prefetch_bytes(block(a.k, a.tables[next_seq * a.NBT]), row_bytes(a.BS));
    }
    for (int64_t j0 = 0, nr; j0 < n; j0 += nr) {
      nr = std::min<int64_t>(L::RV, n - j0);
      for (int64_t h = h0; h < h1; ++h) {
        const T* vb = a.v + (table[blk] * a.BS * a.Hkv + h) * DC + j0 * rs;
        const float* ph = p.data() + (h - h0) * GC * len + start + j0;
        float* ah = acc.data() + (h - h0) * GC * DC;
        for (int c0 = 0; c0 < DC; c0 += W) {
          typename L::V o[GC][CV];
          for (int g = 0; g < GC; ++g)
            for (int c = 0; c < CV; ++c) o[g][c] = L::loadf(ah + g * DC + c0 + L::N * c);
          const T* vr = vb + c0;
          for (int64_t j = 0; j < nr; ++j, vr += rs) {
            typename L::V w[GC];
            for (int g = 0; g < GC; ++g) w[g] = L::set1(ph[g * len + j]);
            for (int c = 0; c < CV; ++c) {
              const typename L::V vv = L::load(vr + L::N * c);
              for (int g = 0; g < GC; ++g) o[g][c] = L::fma(w[g], vv, o[g][c]);
            }
          }
          for (int g = 0; g < GC; ++g)
            for (int c = 0; c < CV; ++c) L::store(ah + g * DC + c0 + L::N * c, o[g][c]);
        }
      }
    }
  }
  for (int64_t g = 0; g < nh * GC; ++g) {
    float* out = a.out + (b * a.H + h0 * GC + g) * DC;
    const typename L::V s = L::set1(inv[g] * raw_unit<T>());  // and V's rows
    for (int d = 0; d < DC; d += L::N) L::store(out + d, L::mul(L::loadf(acc.data() + g * DC + d), s));
  }
}
#endif

}  // namespace pp_decode
