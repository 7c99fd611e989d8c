// paged_decode's walk with bf16 products over fp8 K/V (heads_bf16), where the build has AVX512-BF16
// and AVX512-VBMI (PP_DECODE_BF16); included by paged_decode.cpp, which dispatches to it.
#pragma once

#include <array>
#include <cstring>
#include <vector>

#include "decode_tiled.h"  // hsum4x16
#include "paged_decode.h"
#include "vec.h"

#if defined(PP_BF16) && defined(__AVX512VBMI__)
#define PP_DECODE_BF16 1  // heads_bf16: vdpbf16ps, and vpermi2b for its fp8 -> bf16 table
#endif

namespace pp_decode {

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

// heads_tiled's walk (decode_tiled.h: the same order and prefetches) with bf16 products. Pass 2 takes a block's V
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

}  // namespace pp_decode
