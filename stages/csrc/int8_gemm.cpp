// Linear layers in int8 products (matmul precision "int8"): x's rows cut into blocks of 32 k,
// each rounded to int8 codes with one fp32 scale, against a GGUF weight's own 4- or 8-bit codes.
//
//   xq, xs, xc = quantize_rows(x)            # (M, K) int8, (M, K/32) scales, (M, K/32) xs · Σ codes
//   y = int8_linear(x, panels, bias)         # (M, N) float32; panels: stages/quant.py, Q4_0/Q4_1/Q8_0
//   y = int8_linear(gu, panels, bias, true)  # gu = [gate | up] (M, 2K): of silu(gate) · up (input_row)
//
// Why: an AVX512-VNNI vpdpbusd does 64 multiply-adds of u8 x s8 into int32 lanes, where an fp32
// FMA does 16 (a bf16 dot product 32); on a core without AVX512-BF16 it is the only product
// cheaper than fp32. It is llama.cpp's own scheme for these formats (activations as Q8 blocks).
//
// The math, per output column n and block b of 32 k, with the weight w = d·q + m (stages/quant.py:
// Q4_1 as stored, Q4_0 with m = −8d, Q8_0 with m = 0) and x ≈ xs·c (c: int8 codes, |c| ≤ 127):
//   Σ_k w_k x_k ≈ xs·(d·Σ q_k c_k + m·Σ c_k)
// vpdpbusd takes one operand unsigned: the 4-bit codes are (0..15); the 8-bit ones enter as
// u = q + 128, so Σ u c = Σ q c + 128·Σ c, and m − 128·d stands in for m. Each block's integer
// sum is exact (|Σ| < 2³¹); the fp32 work is one FMA for each of the two terms per block. The
// error against the fp32 product is x's rounding alone: |Σ_b w_b · e_b| with |e_k| ≤ xs/2.
//
// Layout: a (panel, block) holds d[16], m[16] (fp16, panels.h), then the codes row by row of k: u4 two rows
// a 16-byte line (low nibble: row 2i), s8 one row a line. vpdpbusd wants each column's 4 k in one
// 32-bit lane: a byte permute (VBMI, panels.h: LANE_ORDER) puts them there from 4 rows of 16 columns.
// With more than one tile of rows, each panel is unpacked once per call into an L1 scratch that
// every tile loads, and x is quantized into row tiles whose 4-byte groups the tile broadcasts
// straight from memory inside vpdpbusd (docs/BENCHMARKS.md, Changes: 1.2-1.4x at 32-256 rows).
#include "aten.h"

#include <cstring>
#include <memory>
#include <vector>

#include "kernels.h"
#include "panels.h"
#include "vec.h"

namespace {

// One row's block b: codes c = round(x · 127 / amax), scale amax / 127, and xs · Σ c.
void quantize_row(const float* x, int64_t K, int8_t* q, float* xs, float* xc) {
  for (int64_t b = 0; b < K / QK; ++b) {
    const float* xb = x + b * QK;
#ifdef PP_AVX512
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float inv = amax > 0 ? 127.f / amax : 0.f;
    const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));  // round to nearest even
    const __m512i c1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * QK), _mm512_cvtsepi32_epi8(c0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * QK + 16), _mm512_cvtsepi32_epi8(c1));
    const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
#elif defined(PP_AVX2)
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[4], mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i] = _mm256_loadu_ps(xb + 8 * i)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float inv = amax > 0 ? 127.f / amax : 0.f;
    __m256i c[4];  // round to nearest even, as the scalar loop's nearbyint
    for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
    // packs work within 128-bit halves: dwords 0 4 1 5 2 6 3 7 of the result put k back in order
    const __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * QK),
                        _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i c4 = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
    const int sum = static_cast<int>(hsum256(_mm256_cvtepi32_ps(c4)));  // |sum| <= 32 * 127: exact in fp32
#else
    float amax = 0.f;
    for (int k = 0; k < QK; ++k) amax = std::max(amax, std::fabs(xb[k]));
    const float inv = amax > 0 ? 127.f / amax : 0.f;
    int sum = 0;
    for (int k = 0; k < QK; ++k) {
      const int c = static_cast<int>(std::nearbyint(xb[k] * inv));
      q[b * QK + k] = static_cast<int8_t>(std::min(127, std::max(-127, c)));
      sum += q[b * QK + k];
    }
#endif
    xs[b] = amax / 127.f;
    xc[b] = xs[b] * static_cast<float>(sum);
  }
}

// x's row r as the product takes it: the row itself, or (gated: x holds [gate | up], 2K wide)
// silu(gate) · up made into act (K floats). Why gated: the down product's input made row by row
// as it is quantized, from the gate/up product's output, never stored whole: silu_mul's pass wrote
// 1.5 MB a layer of a 256-token chunk that quantizing read back (docs/BENCHMARKS.md).
inline const float* input_row(const float* x, int64_t ld, int64_t r, int64_t K, bool gated, float* act) {
  const float* row = x + r * ld;
  if (!gated) return row;
  silu_mul_row(row, row + K, act, K);
  return act;
}

// x's M rows (or, gated, silu(gate) · up of them: input_row) quantized row-major: codes (M, K),
// values (M, KB); rows split among threads, 16 or more a thread
void quantize_rowwise(const float* x, int64_t ld, int64_t M, int64_t K, bool gated, int8_t* q, float* s, float* c) {
  const int64_t KB = K / QK;
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> act(gated ? K : 0);
    for (int64_t r = r0; r < r1; ++r)
      quantize_row(input_row(x, ld, r, K, gated, act.data()), K, q + r * K, s + r * KB, c + r * KB);
  });
}

#if defined(PP_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define PP_INT8_GEMM 1

// Codes k = 8i .. 8i + 7 of a block in vpdpbusd lane order: out[0] holds each column's k = 8i ..
// 8i + 3, out[1] k = 8i + 4 .. 8i + 7, as unsigned bytes (u4: the codes; s8: q + 128).
template <bool U4>
inline void unpack8(const uint8_t* blk, int i, __m512i* out) {
  if constexpr (U4) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i v = _mm512_loadu_si512(blk + DM + 64 * i);
    const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    out[0] = _mm512_permutex2var_epi8(lo, _mm512_load_si512(LANE_ORDER.u4a), hi);
    out[1] = _mm512_permutex2var_epi8(lo, _mm512_load_si512(LANE_ORDER.u4b), hi);
  } else {
    const __m512i s8 = _mm512_load_si512(LANE_ORDER.s8), flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int h = 0; h < 2; ++h)
      out[h] = _mm512_xor_si512(_mm512_permutexvar_epi8(s8, _mm512_loadu_si512(blk + DM + 64 * (2 * i + h))), flip);
  }
}

// The panels after the one being read, fetched a block at a time meanwhile (nullptr: none): the
// next one into L1, the one after it into L2. Why: at a few rows a step streams every weight once
// from memory (80 MB for SmolLM2's layers); without the L1 fetch the hardware prefetcher left the
// int8 product at 1 row slower than the fp32 one, and the L2 fetch a panel further on gave another
// 6-11% at 1 row (docs/BENCHMARKS.md).
struct Ahead {
  const uint8_t* next = nullptr;
  const uint8_t* after = nullptr;
  void fetch(int64_t b, int64_t QB) const {
    for (int64_t o = 0; o < QB; o += 64) {
      if (next) _mm_prefetch(reinterpret_cast<const char*>(next + b * QB + o), _MM_HINT_T0);
      if (after) _mm_prefetch(reinterpret_cast<const char*>(after + b * QB + o), _MM_HINT_T1);
    }
  }
};

// A block's d and m in fp32, m with the + 128 of s8 codes taken off (u = q + 128)
template <bool U4>
inline void block_dm(const uint8_t* blk, __m512& d, __m512& m) {
  d = block_d16(blk);
  m = block_m16(blk);
  if constexpr (!U4) m = _mm512_fnmadd_ps(d, _mm512_set1_ps(128.f), m);
}

// vectors a block in unpack_panel's scratch: 8 of codes in lane order, then d and m (block_dm)
constexpr int64_t WB = 10;

// R rows of one row tile against one panel: R int32 block sums and R fp32 outputs in registers.
// TILED: x in row tiles (quantize_tiles) and the panel's codes, d and m already unpacked in w
// (unpack_panel); else one tile of x row-major (quantize_row) and each block unpacked here. pf:
// the panels ahead to fetch meanwhile.
template <int R, bool U4, bool TILED>
void tile(const uint8_t* panel, const __m512i* w, int64_t KB, const int8_t* xt, const float* st, const float* ct,
          float* y, int64_t N, const float* bias, Ahead pf) {
  constexpr int64_t QB = U4 ? QB_U4 : QB_S8;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* blk = panel + b * QB;
    pf.fetch(b, QB);
    __m512i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_si512();
    for (int i = 0; i < 4; ++i) {  // k = 8i .. 8i + 7: two code vectors, unpacked here or loaded
      __m512i wv[2];
      if constexpr (TILED) {
        wv[0] = _mm512_load_si512(w + b * WB + 2 * i);
        wv[1] = _mm512_load_si512(w + b * WB + 2 * i + 1);
      } else {
        unpack8<U4>(blk, i, wv);
      }
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < R; ++r) s[r] = dpbusd_bcast(s[r], wv[h], xt + x_code<TILED>(r, b, 2 * i + h, KB));
    }
    __m512 d, m;
    if constexpr (TILED) {
      d = _mm512_castsi512_ps(_mm512_load_si512(w + b * WB + 8));
      m = _mm512_castsi512_ps(_mm512_load_si512(w + b * WB + 9));
    } else {
      block_dm<U4>(blk, d, m);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = x_block<TILED>(r, b, KB);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), _mm512_mul_ps(d, _mm512_set1_ps(st[at])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(ct[at]), acc[r]);
    }
  }
  const __m512 bv = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * N, _mm512_add_ps(acc[r], bv));
}

template <bool U4, bool TILED, int R = ROWS>
void rows(int n, const uint8_t* panel, const __m512i* w, int64_t KB, const int8_t* xt, const float* st,
          const float* ct, float* y, int64_t N, const float* bias, Ahead pf) {
  if constexpr (R > 1) {
    if (n < R) return rows<U4, TILED, R - 1>(n, panel, w, KB, xt, st, ct, y, N, bias, pf);
  }
  tile<R, U4, TILED>(panel, w, KB, xt, st, ct, y, N, bias, pf);
}

// Row tiles up to which a call fetches the panels ahead inside its first tile, not in the unpack
constexpr int64_t FETCH_IN_TILE = 8;

// The whole panel unpacked (KB × WB vectors), for calls with several row tiles: each tile then
// loads its codes instead of unpacking them again (a quarter fewer vector uops a tile), and its
// d and m instead of widening them from fp16 (four uops a block on vpdpbusd's ports: chunks ran
// 2-5% slower when each tile did).
template <bool U4>
void unpack_panel(const uint8_t* panel, int64_t KB, Ahead pf, __m512i* w) {
  constexpr int64_t QB = U4 ? QB_U4 : QB_S8;
  for (int64_t b = 0; b < KB; ++b) {
    pf.fetch(b, QB);
    for (int i = 0; i < 4; ++i) unpack8<U4>(panel + b * QB, i, w + b * WB + 2 * i);
    __m512 d, m;
    block_dm<U4>(panel + b * QB, d, m);
    _mm512_store_si512(w + b * WB + 8, _mm512_castps_si512(d));
    _mm512_store_si512(w + b * WB + 9, _mm512_castps_si512(m));
  }
}

// The 8 x 8 dwords rows[i][j] (row i's codes 4j .. 4j + 3 of a block) -> out[j][i]: x_code's
// order within a (tile, block), 8 stores of 32 bytes
inline void transpose8x8(const __m256i* r, int8_t* out) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);      // rows i, i+1: j 0 1 | 4 5
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);  // j 2 3 | 6 7
  }
  for (int i = 0; i < 8; i += 4)
    for (int h = 0; h < 2; ++h) {
      u[i + 2 * h] = _mm256_unpacklo_epi64(t[i + h], t[i + h + 2]);      // rows i .. i+3: j 2h | 2h + 4
      u[i + 2 * h + 1] = _mm256_unpackhi_epi64(t[i + h], t[i + h + 2]);  // j 2h + 1 | 2h + 5
    }
  for (int j = 0; j < 4; ++j) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * j), _mm256_permute2x128_si256(u[j], u[j + 4], 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * (j + 4)), _mm256_permute2x128_si256(u[j], u[j + 4], 0x31));
  }
}

// x quantized straight into row tiles (panels.h: x_code), a tile at a time: its rows quantized
// row-major into a scratch, then each block's 8 x 8 dwords transposed into place (placed 4 bytes
// at a time, that step took ~4% of an int8 chunk's forward). Rows past M in the last tile come
// from zeroed scratch rows and are never read. gated: as input_row.
void quantize_tiles(const float* x, int64_t ld, int64_t M, int64_t K, bool gated, int8_t* q, float* s, float* c) {
  static_assert(ROWS == 8, "quantize_tiles transposes 8 rows");
  const int64_t KB = K / QK, tiles = (M + ROWS - 1) / ROWS;
  at::parallel_for(0, tiles, 2, [&](int64_t t0, int64_t t1) {
    std::vector<int8_t> rows(ROWS * K);
    std::vector<float> rs(ROWS * KB), rc(ROWS * KB), act(gated ? K : 0);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m = std::min<int64_t>(ROWS, M - t * ROWS);
      for (int64_t i = 0; i < ROWS; ++i) {
        if (i < m) {
          quantize_row(input_row(x, ld, t * ROWS + i, K, gated, act.data()), K, &rows[i * K], &rs[i * KB], &rc[i * KB]);
        } else {
          std::fill_n(&rows[i * K], K, int8_t(0));
          std::fill_n(&rs[i * KB], KB, 0.f);
          std::fill_n(&rc[i * KB], KB, 0.f);
        }
      }
      for (int64_t b = 0; b < KB; ++b) {
        __m256i r[ROWS];
        for (int i = 0; i < ROWS; ++i) r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&rows[i * K + b * QK]));
        transpose8x8(r, q + x_code<true>(t * ROWS, b, 0, KB));
        for (int i = 0; i < ROWS; ++i) {
          s[x_block<true>(t * ROWS + i, b, KB)] = rs[i * KB + b];
          c[x_block<true>(t * ROWS + i, b, KB)] = rc[i * KB + b];
        }
      }
    }
  });
}
#elif defined(PP_AVX2)
#define PP_INT8_AVX2 1

// Without VNNI (AVX2 cores: Zen 1-3, Intel before Ice Lake): vpmaddubsw multiplies u8 x s8 byte
// pairs and adds each pair into an s16 lane, and vpmaddwd against ones adds a 32-bit lane's two
// s16 into int32: with each column's 4 k in one 32-bit lane (vpdpbusd's order) and x's 4 codes
// broadcast, the two make vpdpbusd's sum, 8 columns a vector (an fp32 FMA does 8 products, a
// vpmaddubsw 32). u4 codes (0..15) against x's (|c| <= 127): a pair is at most 3810, so a block's
// 8 steps add up in s16 (<= 30480) and one vpmaddwd a block widens them. s8 codes: q + 128, as
// vpdpbusd takes them, would overflow s16 (a pair up to 2 · 255 · 127), so the unsigned operand is
// |q| (<= 128) and x takes q's sign (vpsignb: |c| <= 127, no wrap); a pair reaches 32512, so each
// step widens. Both sums are exact, as on VNNI.
//
// A panel is unpacked once per call into a scratch of, per block, two halves (columns 0-7, 8-15)
// of HV vectors each: the code vectors in lane order (s8: 8 of |q|, then 8 of q), then d and m.
template <bool U4>
constexpr int64_t HV = U4 ? 8 + 2 : 16 + 2;
constexpr int TR = 4;  // rows a tile: 4 int32 sums and 4 fp32 outputs a half in registers (3 no faster, 6 spilled: 0.6-1.0x)

// code rows k = 0..3 of 16 columns (a byte a column) -> h0 columns 0-7, h1 columns 8-15, each
// column's 4 k in one 32-bit lane
inline void lanes4(const __m128i* l, __m256i& h0, __m256i& h1) {
  const __m128i a0 = _mm_unpacklo_epi8(l[0], l[1]), a1 = _mm_unpackhi_epi8(l[0], l[1]);  // k 0, 1
  const __m128i b0 = _mm_unpacklo_epi8(l[2], l[3]), b1 = _mm_unpackhi_epi8(l[2], l[3]);  // k 2, 3
  h0 = _mm256_set_m128i(_mm_unpackhi_epi16(a0, b0), _mm_unpacklo_epi16(a0, b0));
  h1 = _mm256_set_m128i(_mm_unpackhi_epi16(a1, b1), _mm_unpacklo_epi16(a1, b1));
}

template <bool U4>
void unpack_panel2(const uint8_t* panel, int64_t KB, __m256i* w) {
  constexpr int64_t QB = U4 ? QB_U4 : QB_S8, H = HV<U4>;
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* blk = panel + b * QB;
    __m256i* o = w + b * 2 * H;
    for (int j = 0; j < 8; ++j) {  // k = 4j .. 4j + 3
      __m128i l[4];
      for (int t = 0; t < 4; ++t) {
        if constexpr (U4) {  // line p: k = 2p in the low nibbles, 2p + 1 in the high ones
          const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + DM + 16 * (2 * j + t / 2)));
          l[t] = _mm_and_si128(t % 2 ? _mm_srli_epi16(v, 4) : v, low);
        } else {
          l[t] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + DM + 16 * (4 * j + t)));
        }
      }
      __m256i h[2];
      lanes4(l, h[0], h[1]);
      for (int i = 0; i < 2; ++i) {
        if constexpr (U4) {
          o[i * H + j] = h[i];
        } else {
          o[i * H + j] = _mm256_abs_epi8(h[i]);  // -128 -> 0x80: 128 as unsigned
          o[i * H + 8 + j] = h[i];
        }
      }
    }
    for (int i = 0; i < 2; ++i) {
      o[i * H + H - 2] = _mm256_castps_si256(block_d8(blk, i));
      o[i * H + H - 1] = _mm256_castps_si256(block_m8(blk, i));
    }
  }
}

// R rows of x (row-major codes, K = KB · QK a row; values KB a row) against one unpacked panel:
// y's R x 16 outputs (+ bias)
template <int R, bool U4>
void tile2(const __m256i* w, int64_t KB, const int8_t* x, const float* xs, const float* xc, float* y, int64_t N,
           const float* bias) {
  constexpr int64_t H = HV<U4>;
  const int64_t K = KB * QK;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int i = 0; i < 2; ++i) {  // columns 8i .. 8i + 7
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < KB; ++b) {
      const __m256i* wb = w + (2 * b + i) * H;
      __m256i s[R];
      for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const __m256i wv = _mm256_load_si256(wb + j);
        for (int r = 0; r < R; ++r) {
          // the 4 codes broadcast straight from memory: vbroadcastss is one load uop, where
          // _mm256_set1_epi32 of an int became a move and a shuffle
          const __m256i xv = _mm256_castps_si256(
              _mm256_broadcast_ss(reinterpret_cast<const float*>(x + r * K + b * QK + 4 * j)));
          if constexpr (U4) {
            s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(wv, xv));
          } else {
            const __m256i p = _mm256_maddubs_epi16(wv, _mm256_sign_epi8(xv, _mm256_load_si256(wb + 8 + j)));
            s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(p, ones));
          }
        }
      }
      const __m256 d = _mm256_castsi256_ps(_mm256_load_si256(wb + H - 2));
      const __m256 m = _mm256_castsi256_ps(_mm256_load_si256(wb + H - 1));
      for (int r = 0; r < R; ++r) {
        const __m256i s32 = U4 ? _mm256_madd_epi16(s[r], ones) : s[r];
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_mul_ps(d, _mm256_set1_ps(xs[r * KB + b])), acc[r]);
        acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xc[r * KB + b]), acc[r]);
      }
    }
    const __m256 bv = bias ? _mm256_loadu_ps(bias + 8 * i) : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * N + 8 * i, _mm256_add_ps(acc[r], bv));
  }
}

template <bool U4, int R = TR>
void rows2(int n, const __m256i* w, int64_t KB, const int8_t* x, const float* xs, const float* xc, float* y,
           int64_t N, const float* bias) {
  if constexpr (R > 1) {
    if (n < R) return rows2<U4, R - 1>(n, w, KB, x, xs, xc, y, N, bias);
  }
  tile2<R, U4>(w, KB, x, xs, xc, y, N, bias);
}
#endif

}  // namespace

std::vector<at::Tensor> quantize_rows(at::Tensor x) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 && x.size(1) % QK == 0,
              "quantize_rows: x (M, K) float32 with contiguous rows and K a multiple of ", QK);
  const int64_t M = x.size(0), K = x.size(1), KB = K / QK;
  auto xq = at::empty({M, K}, at::kChar);
  auto xs = at::empty({M, KB}, at::kFloat), xc = at::empty({M, KB}, at::kFloat);
  quantize_rowwise(x.data_ptr<float>(), x.stride(0), M, K, false, xq.data_ptr<int8_t>(), xs.data_ptr<float>(),
                   xc.data_ptr<float>());
  return {xq, xs, xc};
}

at::Tensor int8_linear(at::Tensor x, at::Tensor q, c10::optional<at::Tensor> bias_, bool gated) {
  TORCH_CHECK(q.dtype() == at::kByte && q.dim() == 3 && q.is_contiguous() && (q.size(2) == QB_U4 || q.size(2) == QB_S8),
              "int8_linear: weight (N/16, K/32, ", QB_U4, " or ", QB_S8, ") uint8 panels");
  const int64_t K = q.size(1) * QK;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == (gated ? 2 : 1) * K, "int8_linear: x (M, ", (gated ? 2 : 1) * K, ")",
              gated ? ": [gate | up]" : "");
  const int64_t M = x.size(0), KB = K / QK, NP = q.size(0), N = NP * NR;
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
#if !defined(PP_INT8_GEMM) && !defined(PP_INT8_AVX2)
  TORCH_CHECK(false, "int8_linear: this build has neither AVX512-VNNI and VBMI nor AVX2 (int8_products() is false)");
#else
  at::Tensor keep;
  const float* bp = bias_of(bias_, N, keep, "int8_linear");
  TORCH_CHECK(x.dtype() == at::kFloat && x.stride(1) == 1, "int8_linear: x float32 with contiguous rows");
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const bool u4 = q.size(2) == QB_U4;
  const int64_t qb = q.size(2);
  float* yp = y.data_ptr<float>();
#ifdef PP_INT8_GEMM
  const int64_t T = (M + ROWS - 1) / ROWS;
  // one tile: x's codes row-major (quantize_row's own layout); more: in tiles (quantize_tiles)
  auto xq = at::empty({T * ROWS * K}, at::kChar);
  auto xs = at::empty({T * ROWS * KB}, at::kFloat), xc = at::empty({T * ROWS * KB}, at::kFloat);
  int8_t* qx = xq.data_ptr<int8_t>();
  float *sx = xs.data_ptr<float>(), *cx = xc.data_ptr<float>();
  if (T > 1) quantize_tiles(xp, x.stride(0), M, K, gated, qx, sx, cx);
  else quantize_rowwise(xp, x.stride(0), M, K, gated, qx, sx, cx);  // M <= 8: one thread
  // panels split among threads; each panel's codes (5.8 KB at K = 576, u4; 11.5 KB unpacked)
  // stay in L1 while every tile of rows reads them
  at::parallel_for(0, NP, 4, [&](int64_t p0, int64_t p1) {
    std::unique_ptr<__m512i[]> unpacked(T > 1 ? new __m512i[KB * WB] : nullptr);  // new aligns to 64
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* panel = qp + p * KB * qb;
      Ahead pf{p + 1 < NP ? qp + (p + 1) * KB * qb : nullptr, p + 2 < NP ? qp + (p + 2) * KB * qb : nullptr};
      const float* bb = bp ? bp + p * NR : nullptr;
      if (T == 1) {  // one tile: the panel unpacked inside it, fetching the panels ahead meanwhile
        if (u4) rows<true, false>(M, panel, nullptr, KB, qx, sx, cx, yp + p * NR, N, bb, pf);
        else rows<false, false>(M, panel, nullptr, KB, qx, sx, cx, yp + p * NR, N, bb, pf);
        continue;
      }
      // unpacked once, then every tile. The panels ahead are fetched meanwhile: with a few tiles,
      // spread over the first tile's blocks (fetched in one burst during the unpack, they reached
      // the next unpack late: 9 / 17 / 32 rows x1.08 / 1.05 / 1.03 of the time, paired, 1 thread);
      // with many, during the unpack (the first tile then ends a long way before the next unpack:
      // 256 rows 1-2% slower)
      const __m512i* w = unpacked.get();
      const bool in_tile = T <= FETCH_IN_TILE;
      if (u4) unpack_panel<true>(panel, KB, in_tile ? Ahead{} : pf, unpacked.get());
      else unpack_panel<false>(panel, KB, in_tile ? Ahead{} : pf, unpacked.get());
      for (int64_t t = 0; t < T; ++t) {
        const int n = static_cast<int>(std::min<int64_t>(ROWS, M - t * ROWS));
        const int64_t r = t * ROWS;
        const int8_t* xt = qx + x_code<true>(r, 0, 0, KB);
        const float *st = sx + x_block<true>(r, 0, KB), *ct = cx + x_block<true>(r, 0, KB);
        float* yt = yp + r * N + p * NR;
        const Ahead tp = in_tile && t == 0 ? pf : Ahead{};
        if (u4) rows<true, true>(n, panel, w, KB, xt, st, ct, yt, N, bb, tp);
        else rows<false, true>(n, panel, w, KB, xt, st, ct, yt, N, bb, tp);
      }
    }
  });
#else  // PP_INT8_AVX2
  auto xq = at::empty({M * K}, at::kChar);  // x's codes row-major, (M, K)
  auto xs = at::empty({M * KB}, at::kFloat), xc = at::empty({M * KB}, at::kFloat);
  int8_t* qx = xq.data_ptr<int8_t>();
  float *sx = xs.data_ptr<float>(), *cx = xc.data_ptr<float>();
  quantize_rowwise(xp, x.stride(0), M, K, gated, qx, sx, cx);
  // panels split among threads; each unpacked once (11.5 KB at K = 576, u4), then every tile of rows
  at::parallel_for(0, NP, 4, [&](int64_t p0, int64_t p1) {
    std::unique_ptr<__m256i[]> w(new __m256i[KB * 2 * (u4 ? HV<true> : HV<false>)]);  // new aligns to 32
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* panel = qp + p * KB * qb;
      const float* bb = bp ? bp + p * NR : nullptr;
      if (u4) unpack_panel2<true>(panel, KB, w.get());
      else unpack_panel2<false>(panel, KB, w.get());
      for (int64_t r = 0; r < M; r += TR) {
        const int n = static_cast<int>(std::min<int64_t>(TR, M - r));
        if (u4) rows2<true>(n, w.get(), KB, qx + r * K, sx + r * KB, cx + r * KB, yp + r * N + p * NR, N, bb);
        else rows2<false>(n, w.get(), KB, qx + r * K, sx + r * KB, cx + r * KB, yp + r * N + p * NR, N, bb);
      }
    }
  });
#endif
#endif
  return y;
}

bool int8_products() {
#if defined(PP_INT8_GEMM) || defined(PP_INT8_AVX2)
  return true;
#else
  return false;
#endif
}

bool int8_takes(const at::Tensor& w) {
  if (!int8_products() || w.scalar_type() != at::kByte || w.dim() != 3) return false;
#ifdef PP_INT8_GEMM
  return true;
#else
  // AVX2: s8 (Q8_0) panels measured no faster than their fp32 product (0.82-1.24x: the sign and
  // the widening each step cost what the byte products save), u4 ones 1.6-2.4x
  return w.size(2) == QB_U4;
#endif
}
