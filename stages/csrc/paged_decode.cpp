// Paged decode attention for fp32 on CPU (see stages/cpu_kernels.py).
// q (B, H, D); k_cache, v_cache (NB, BS, H_kv, D) fp32, fp16 or fp8 e4m3 (T: widened as read); tables (B, NBT)
// int64; lens (B,) int64.
// Each KV head's G = H / H_kv query heads share every K/V row read; two passes (scores and
// softmax over a contiguous buffer, then the V sum), each row read once, block by block.
// With AVX2 and a common head size / group (64 or 128; 1, 2, 3, 4 or 8), heads_tiled (8 lanes
// wide, 16 where the build has AVX-512) does both passes from registers, one task
// per sequence walking its blocks' rows in memory order; otherwise one_head's plain loops, one
// task per (sequence, KV head) (docs/BENCHMARKS.md). bf16: heads_bf16's bf16 products for a call
// of more than bf16_over decodes over fp8 K/V with a group of up to 4, where the build has
// AVX512-BF16 and AVX512-VBMI; every other call keeps fp32 (a build without AVX512-BF16 refuses the flag).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "vec.h"

#if defined(PP_BF16) && defined(__AVX512VBMI__)
#define PP_DECODE_BF16 1  // heads_bf16: vdpbf16ps, and vpermi2b for its fp8 -> bf16 table
#endif

namespace {

template <typename T>
struct Args {
  const float* q;
  const T* k;
  const T* v;
  const int64_t* tables;
  const int64_t* lens;
  float* out;
  int64_t H, Hkv, G, BS, NBT, Dyn;
  float scale;
  bool bf16;  // bf16 products where heads_bf16 takes this call (fp8 K/V, G <= 4)
};

// One (sequence b, KV head h). DC / GC: the head size / query heads per KV head if known at
// compile time, else 0 (a.Dyn / a.G): with both fixed, each K or V row is loaded once for all
// G heads and the d-loops vectorise with G accumulators.
template <typename T, int DC, int GC>
void one_head(const Args<T>& a, int64_t b, int64_t h, std::vector<float>& p, std::vector<float>& acc,
              std::vector<float>& inv) {
  const int64_t D = DC > 0 ? DC : a.Dyn;
  const int64_t G = GC > 0 ? GC : a.G, len = a.lens[b], row_stride = a.Hkv * D;
  const float* qb = a.q + (b * a.H + h * G) * D;
  const int64_t* table = a.tables + b * a.NBT;
  p.resize(G * len);
  // pass 1: scores of the G query heads against each K row, read once
  for (int64_t start = 0, blk = 0; start < len; start += a.BS, ++blk) {
    const int64_t n = std::min(a.BS, len - start);
    const T* kr = a.k + (table[blk] * a.BS * a.Hkv + h) * D;
    for (int64_t j = 0; j < n; ++j, kr += row_stride) {
      if constexpr (GC > 0) {
        float dot[GC] = {};
        for (int64_t d = 0; d < D; ++d) {
          const float kd = to_f32(kr[d]);
          for (int g = 0; g < GC; ++g) dot[g] += qb[g * D + d] * kd;
        }
        for (int g = 0; g < GC; ++g) p[g * len + start + j] = dot[g] * a.scale;
      } else {
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qb + g * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * to_f32(kr[d]);
          p[g * len + start + j] = dot * a.scale;
        }
      }
    }
  }
  // softmax per head over contiguous scores (already scaled)
  for (int64_t g = 0; g < G; ++g) {
    float* s = p.data() + g * len;
    inv[g] = 1.f / exp_row(s, len, 1.f, row_max(s, len));
  }
  // pass 2: weighted sum of each V row, read once
  std::fill(acc.begin(), acc.begin() + G * D, 0.f);
  for (int64_t start = 0, blk = 0; start < len; start += a.BS, ++blk) {
    const int64_t n = std::min(a.BS, len - start);
    const T* vr = a.v + (table[blk] * a.BS * a.Hkv + h) * D;
    for (int64_t j = 0; j < n; ++j, vr += row_stride) {
      if constexpr (GC > 0) {
        float w[GC];
        for (int g = 0; g < GC; ++g) w[g] = p[g * len + start + j];
        float* ag = acc.data();
        for (int64_t d = 0; d < D; ++d) {
          const float vd = to_f32(vr[d]);
          for (int g = 0; g < GC; ++g) ag[g * D + d] += w[g] * vd;
        }
      } else {
        for (int64_t g = 0; g < G; ++g) {
          const float w = p[g * len + start + j];
          float* ag = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) ag[d] += w * to_f32(vr[d]);
        }
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* o = a.out + (b * a.H + h * G + g) * D;
    const float* ag = acc.data() + g * D;
    for (int64_t d = 0; d < D; ++d) o[d] = ag[d] * inv[g];
  }
}

#ifdef PP_AVX2
// Register-tiled versions of one_head's two passes, for a compile-time head size and group.
// The plain loops above keep one dot product per (row, head) in flight, and each ends in a
// horizontal sum: a chain of dependent FMAs and shuffles per row, which left the kernel at
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
  static constexpr bool kPrefetch = false;  // software prefetch of the next block did not help here
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

// 16 lanes, and software prefetch of the next blocks (what heads_tiled asks for): blocks are
// scattered, and the stream prefetcher starts over at every block (and page) the walk jumps to. Pass 2 goes head by head
// through a whole block, a head's G × W slice in registers across the block's rows (Lanes8's
// order, four rows then the next head, measured the same cold and 10% slower hot here).
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
  static constexpr bool kPrefetch = true;
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
// With L::kPrefetch the walk asks for what it reads next one block ahead, across the seams too:
// the next K block in pass 1 (and V's first during K's last), the next V block in pass 2, and
// during V's last block the next sequence's first K block (next_seq: this task's next sequence,
// its first row, or -1). The V and seam prefetches gave 0.78-0.91 of the K-only walk's time
// (SmolLM2 shapes, 30 layers' caches, scattered blocks, 1-2 threads, fp16 and fp32, B = 4-32,
// 256-1024 keys; docs/BENCHMARKS.md).
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
    const T* next = !L::kPrefetch ? nullptr : (start + a.BS < len ? block(a.k, table[blk + 1]) : block(a.v, table[0]));
    // rows in order, every head of a row before the next rows: the walk through the block stays
    // sequential, which the stream prefetcher follows (a head-by-head walk is strided)
    for (int64_t j = 0; j < n;) {
      const bool full = j + R <= n;
      if (next) prefetch_bytes(next + j * rs, row_bytes(full ? R : 1));
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
    if (L::kPrefetch && start + a.BS < len) {  // the next V block, then the next sequence's first K block
      prefetch_bytes(block(a.v, table[blk + 1]), row_bytes(n));
    } else if (L::kPrefetch && next_seq >= 0) {
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

#ifdef PP_DECODE_BF16
// The decodes' two products in bf16 (matmul precision "medium": steps of more than 12 decodes;
// "int8": every step; fp8 K/V): heads_tiled is bound by its instructions, not by memory (fp8, 512 keys, hot: 21.6 µs a
// decode and layer, ~49 cycles per key and KV head against the 24 FMAs it needs: each 16 fp8 widen in
// ~4 µops). vdpbf16ps does two products a lane, and fp8 → bf16 is exact (4 significant bits, an
// exponent range bf16 covers, subnormals included) through a table: 64 elements in 5 µops. So K
// and V stay exact; q and the softmax weights round to bf16 (relative 2⁻⁹), as the prefill's bf16
// path rounds them.

// bf16 bits of each fp8 magnitude (7 bits; the sign is or-ed back), low and high bytes: two
// 128-byte vpermi2b tables
struct Fp8Bf16 {
  __m512i lo0, lo1, hi0, hi1, sign;
  Fp8Bf16() {
    alignas(64) static const std::array<uint8_t, 256> t = [] {
      std::array<uint8_t, 256> b{};
      for (int i = 0; i < 128; ++i) {
        const Bf16 w = c10::BFloat16(kFp8Values[i]).x;  // exact: no rounding happens
        b[i] = static_cast<uint8_t>(w & 0xFF);
        b[128 + i] = static_cast<uint8_t>(w >> 8);
      }
      return b;
    }();
    lo0 = _mm512_load_si512(t.data());
    lo1 = _mm512_load_si512(t.data() + 64);
    hi0 = _mm512_load_si512(t.data() + 128);
    hi1 = _mm512_load_si512(t.data() + 192);
    sign = _mm512_set1_epi8(static_cast<char>(0x80));
  }
  // 64 fp8 -> 64 bf16: a holds elements 16L + 0..7 of each 128-bit lane L, b 16L + 8..15
  void widen(__m512i x, __m512i& a, __m512i& b) const {
    const __m512i lo = _mm512_permutex2var_epi8(lo0, x, lo1);  // index bit 7 (the sign) ignored
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, x, hi1), x, sign, 0xF8);  // | x & 0x80
    a = _mm512_unpacklo_epi8(lo, hi);
    b = _mm512_unpackhi_epi8(lo, hi);
  }
};

// q (D fp32) -> bf16 in widen's order, per 64 elements: the 32 words a multiplies, then b's
template <int DC>
inline void pack_q(const float* q, Bf16* out) {
  // word 8L + t <- element 16L + t (a) or 16L + 8 + t (b) of the 64, indexing the two natural halves
  alignas(64) static const std::array<int16_t, 64> idx = [] {
    std::array<int16_t, 64> x{};
    for (int w = 0; w < 32; ++w) x[w] = static_cast<int16_t>(16 * (w / 8) + w % 8), x[32 + w] = x[w] + 8;
    return x;
  }();
  for (int c = 0; c < DC; c += 64) {
    const __m512i n0 = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + c + 16), _mm512_loadu_ps(q + c)));
    const __m512i n1 = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + c + 48), _mm512_loadu_ps(q + c + 32)));
    _mm512_storeu_si512(out + c, _mm512_permutex2var_epi16(n0, _mm512_load_si512(idx.data()), n1));
    _mm512_storeu_si512(out + c + 32, _mm512_permutex2var_epi16(n0, _mm512_load_si512(idx.data() + 32), n1));
  }
}

inline __m512 dot2(__m512 acc, __m512i x, __m512i y) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(x), reinterpret_cast<__m512bh>(y));
}

// score_rows in bf16: qp (G, DC) packed by pack_q, R fp8 K rows from kr (stride rs)
template <int DC, int GC, int R>
inline void score_rows_bf16(const Bf16* qp, const Fp8* kr, int64_t rs, float scale, float* p, int64_t len,
                            const Fp8Bf16& t) {
  __m512 acc[GC][R];
  for (int g = 0; g < GC; ++g)
    for (int r = 0; r < R; ++r) acc[g][r] = _mm512_setzero_ps();
  for (int c = 0; c < DC; c += 64) {
    for (int r = 0; r < R; ++r) {
      __m512i ka, kb;
      t.widen(_mm512_loadu_si512(kr + r * rs + c), ka, kb);
      for (int g = 0; g < GC; ++g)
        acc[g][r] = dot2(dot2(acc[g][r], _mm512_loadu_si512(qp + g * DC + c), ka), _mm512_loadu_si512(qp + g * DC + c + 32), kb);
    }
  }
  for (int g = 0; g < GC; ++g) {
    if constexpr (R == 4) {
      _mm_storeu_ps(p + g * len, _mm_mul_ps(hsum4x16(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), _mm_set1_ps(scale)));
    } else {
      for (int r = 0; r < R; ++r) p[g * len + r] = _mm512_reduce_add_ps(acc[g][r]) * scale;
    }
  }
}

// heads_tiled's walk (the same order and prefetches) with bf16 products. Pass 2 takes a block's V
// rows in pairs (j, j + 1): their bytes interleaved, widened, are (v_j[d], v_j+1[d]) word pairs,
// which one vdpbf16ps lane multiplies with the bf16 pair (p_j, p_j+1). Its accumulators hold a
// 64-wide slice in widen's order: lane 4L + t of the q-th holds d = 16L + 4q + t, put back at the end.
template <int DC, int GC>
void heads_bf16(const Args<Fp8>& a, int64_t b, int64_t h0, int64_t h1, std::vector<float>& p, std::vector<Bf16>& pb,
                std::vector<float>& acc, std::vector<float>& inv, std::vector<Bf16>& qp, int64_t next_seq) {
  constexpr int R = GC <= 4 ? 4 : 2;
  const Fp8Bf16 t;
  const int64_t len = a.lens[b], rs = a.Hkv * DC, nh = h1 - h0, lp = (len + 16) / 16 * 16;  // pairs read p[len]
  const int64_t* table = a.tables + b * a.NBT;
  auto block = [&a, rs](const Fp8* cache, int64_t id) { return cache + id * a.BS * rs; };
  p.resize(nh * GC * len);
  pb.resize(nh * GC * lp);
  acc.assign(nh * GC * DC, 0.f);
  inv.resize(nh * GC);
  qp.resize(nh * GC * DC);
  for (int64_t i = 0; i < nh * GC; ++i) pack_q<DC>(a.q + (b * a.H + h0 * GC) * DC + i * DC, &qp[i * DC]);
  // pass 1: scores, R rows of a block at a time, every head of a row before the next rows
  for (int64_t start = 0, blk = 0; start < len; start += a.BS, ++blk) {
    const int64_t n = std::min(a.BS, len - start);
    const Fp8* next = start + a.BS < len ? block(a.k, table[blk + 1]) : block(a.v, table[0]);
    for (int64_t j = 0; j < n;) {
      const bool full = j + R <= n;
      prefetch_bytes(next + j * rs, (full ? R : 1) * rs);
      for (int64_t h = h0; h < h1; ++h) {
        const Fp8* kr = a.k + (table[blk] * a.BS * a.Hkv + h) * DC + j * rs;
        float* ph = p.data() + (h - h0) * GC * len + start + j;
        const Bf16* qh = &qp[(h - h0) * GC * DC];
        if (full) score_rows_bf16<DC, GC, R>(qh, kr, rs, a.scale, ph, len, t);
        else score_rows_bf16<DC, GC, 1>(qh, kr, rs, a.scale, ph, len, t);
      }
      j += full ? R : 1;
    }
  }
  for (int64_t g = 0; g < nh * GC; ++g) {  // softmax weights in bf16, zeros from len to lp
    const float* s = p.data() + g * len;
    inv[g] = 1.f / exp_row_bf16(s, len, lp, 1.f, row_max(s, len), &pb[g * lp]);
  }
  // pass 2: out_g = Σ_j p[g, j] · v_j, a 64-wide slice of a head's G rows in registers for a block
  for (int64_t start = 0, blk = 0; start < len; start += a.BS, ++blk) {
    const int64_t n = std::min(a.BS, len - start);
    if (start + a.BS < len) prefetch_bytes(block(a.v, table[blk + 1]), n * rs);
    else if (next_seq >= 0) prefetch_bytes(block(a.k, a.tables[next_seq * a.NBT]), a.BS * rs);
    for (int64_t h = h0; h < h1; ++h) {
      const Fp8* vb = a.v + (table[blk] * a.BS * a.Hkv + h) * DC;
      const Bf16* ph = &pb[(h - h0) * GC * lp + start];
      float* ah = acc.data() + (h - h0) * GC * DC;
      for (int c = 0; c < DC; c += 64) {
        __m512 o[GC][4];
        for (int g = 0; g < GC; ++g)
          for (int q = 0; q < 4; ++q) o[g][q] = _mm512_loadu_ps(ah + g * DC + c + 16 * q);
        for (int64_t j = 0; j < n; j += 2) {
          const bool pair = j + 1 < n;  // else the row pairs with zeros, its weight with 0
          const __m512i x0 = _mm512_loadu_si512(vb + j * rs + c);
          const __m512i x1 = pair ? _mm512_loadu_si512(vb + (j + 1) * rs + c) : _mm512_setzero_si512();
          __m512i v[4];
          t.widen(_mm512_unpacklo_epi8(x0, x1), v[0], v[1]);
          t.widen(_mm512_unpackhi_epi8(x0, x1), v[2], v[3]);
          for (int g = 0; g < GC; ++g) {
            int32_t w2;
            std::memcpy(&w2, ph + g * lp + j, sizeof(w2));
            const __m512i w = _mm512_set1_epi32(pair ? w2 : w2 & 0xFFFF);
            for (int q = 0; q < 4; ++q) o[g][q] = dot2(o[g][q], w, v[q]);
          }
        }
        for (int g = 0; g < GC; ++g)
          for (int q = 0; q < 4; ++q) _mm512_storeu_ps(ah + g * DC + c + 16 * q, o[g][q]);
      }
    }
  }
  for (int64_t g = 0; g < nh * GC; ++g) {  // widen's order back to d's, times 1 / Σ p
    float* out = a.out + (b * a.H + h0 * GC + g) * DC;
    const float* ag = acc.data() + g * DC;
    for (int d = 0; d < DC; ++d) out[d] = ag[d / 64 * 64 + (d % 16) / 4 * 16 + (d % 64) / 16 * 4 + d % 4] * inv[g];
  }
}
#endif

// Tasks [0, n) cut into `parts` runs of consecutive tasks of about equal cost (cost(i) ≥ 0):
// edges (parts + 1,), run k = [edge[k], edge[k + 1]). Why: parallel_for cuts by count, and a step's
// decodes differ in context by up to ~8x (vs_hf.py's prompts: 16–128 tokens), so one thread could
// get most of the keys; consecutive, so a run still walks its sequences in order (next_seq).
template <typename F>
std::vector<int64_t> runs_by_cost(int64_t n, int64_t parts, const F& cost) {
  std::vector<double> prefix(n + 1, 0.0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + static_cast<double>(cost(i));
  std::vector<int64_t> edge(parts + 1, n);
  edge[0] = 0;
  for (int64_t k = 1, i = 0; k < parts; ++k) {  // the prefix nearest k / parts of the total
    const double target = prefix[n] * static_cast<double>(k) / static_cast<double>(parts);
    while (i < n && prefix[i + 1] <= target) ++i;
    if (i < n && prefix[i + 1] - target < target - prefix[i]) ++i;
    edge[k] = std::max(i, edge[k - 1]);
  }
  return edge;
}

template <typename T, int DC, int GC>
void run(const Args<T>& a, int64_t B) {
#ifdef PP_AVX2
  if constexpr (DC > 0 && GC > 0) {
    // a task per sequence (all its KV heads) when that still gives every thread work; else per head
    const int64_t threads = at::get_num_threads();
    const bool per_seq = B >= threads;
    const int64_t per = per_seq ? a.Hkv : 1;
    // a task's cost: its keys, plus what a task costs before its first key (q, softmax, out)
    const std::vector<int64_t> edge =
        runs_by_cost(B * a.Hkv / per, threads, [&](int64_t i) { return a.lens[i * per / a.Hkv] + 32; });
    at::parallel_for(0, threads, 1, [&](int64_t r0, int64_t r1) {
      std::vector<float> p, acc, inv;
#ifdef PP_DECODE_BF16
      std::vector<Bf16> pb;
      std::vector<Bf16> qp;
#endif
      // runs r0 .. r1 - 1 are consecutive tasks (several where fewer threads came, or nested)
      for (int64_t i = edge[r0], end = edge[r1]; i < end; ++i) {
        const int64_t b = i * per / a.Hkv, h0 = i * per % a.Hkv, next = per_seq && i + 1 < end ? b + 1 : -1;
#ifdef PP_DECODE_BF16
        if constexpr (std::is_same_v<T, Fp8> && GC <= 4) {
          if (a.bf16) {
            heads_bf16<DC, GC>(a, b, h0, h0 + per, p, pb, acc, inv, qp, next);
            continue;
          }
        }
#endif
        heads_tiled<Lanes, T, DC, GC>(a, b, h0, h0 + per, p, acc, inv, next);
      }
    });
    return;
  }
#endif
  at::parallel_for(0, B * a.Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p, acc(a.G * (DC > 0 ? DC : a.Dyn)), inv(a.G);
    for (int64_t i = begin; i < end; ++i) one_head<T, DC, GC>(a, i / a.Hkv, i % a.Hkv, p, acc, inv);
  });
}

template <typename T, int DC>
void run_g(const Args<T>& a, int64_t B) {
  switch (a.G) {  // the GQA groupings of common checkpoints (SmolLM2: 3; LLaMA-3, Mistral: 4)
    case 1: return run<T, DC, 1>(a, B);
    case 2: return run<T, DC, 2>(a, B);
    case 3: return run<T, DC, 3>(a, B);
    case 4: return run<T, DC, 4>(a, B);
    case 8: return run<T, DC, 8>(a, B);
    default: return run<T, DC, 0>(a, B);
  }
}

template <typename T>
void run_d(const Args<T>& a, int64_t B) {
  if (a.Dyn == 64) {
    run_g<T, 64>(a, B);
  } else if (a.Dyn == 128) {
    run_g<T, 128>(a, B);
  } else {
    run<T, 0, 0>(a, B);
  }
}

}  // namespace

bool decode_bf16() {
#ifdef PP_DECODE_BF16
  return true;
#else
  return false;
#endif
}

std::vector<int64_t> cost_runs(const std::vector<int64_t>& costs, int64_t parts) {
  TORCH_CHECK(parts >= 1, "cost_runs: parts must be >= 1, got ", parts);
  for (const int64_t c : costs) TORCH_CHECK(c >= 0, "cost_runs: costs must be >= 0, got ", c);
  return runs_by_cost(static_cast<int64_t>(costs.size()), parts, [&](int64_t i) { return costs[i]; });
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor tables, torch::Tensor lens, double scale, bool bf16, int64_t bf16_over) {
  const auto kv = k_cache.scalar_type();
  TORCH_CHECK(q.dtype() == torch::kFloat32 &&
              (kv == torch::kFloat32 || kv == torch::kFloat16 || kv == torch::kFloat8_e4m3fn) &&
              v_cache.scalar_type() == kv, "paged_decode: float32 q, float32, float16 or float8_e4m3fn caches");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              tables.is_contiguous() && lens.is_contiguous(), "paged_decode: contiguous inputs");
  TORCH_CHECK(tables.dtype() == torch::kInt64 && lens.dtype() == torch::kInt64, "paged_decode: int64 tables/lens");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(2);
  TORCH_CHECK(H % Hkv == 0 && k_cache.size(3) == D, "paged_decode: head shapes");
#ifndef PP_BF16
  TORCH_CHECK(!bf16, "paged_decode: bf16 products need AVX512-BF16, which this build has not");
#endif
  auto out = torch::empty_like(q);
  auto run_as = [&](auto element) {  // the caches' element type T, by the value's type
    using T = decltype(element);
    run_d(Args<T>{q.data_ptr<float>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), tables.data_ptr<int64_t>(),
                  lens.data_ptr<int64_t>(), out.data_ptr<float>(), H, Hkv, H / Hkv, k_cache.size(1), tables.size(1), D,
                  static_cast<float>(scale), bf16 && B > bf16_over}, B);
  };
  if (kv == torch::kFloat16) run_as(c10::Half{});
  else if (kv == torch::kFloat8_e4m3fn) run_as(Fp8{});
  else run_as(0.f);
  return out;
}
