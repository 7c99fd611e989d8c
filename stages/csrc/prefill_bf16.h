// paged_prefill's bf16 path (PP_BF16 builds): cache blocks packed into bf16 pair panels, and the
// vdpbf16ps micro-tiles over them; included by paged_prefill.cpp.
#pragma once

#include <algorithm>
#include <type_traits>

#include "paged_prefill.h"
#include "vec.h"

namespace pp_prefill {

#ifdef PP_BF16
template <typename T>
inline __m512 widen16(const T* p) {  // 16 cache elements -> their 16 values, exactly
  if constexpr (std::is_same_v<T, float>) return _mm512_loadu_ps(p);
  else if constexpr (std::is_same_v<T, Fp8>) return _mm512_mul_ps(load16(p), _mm512_set1_ps(raw_unit<Fp8>()));
  else return load16(p);
}

// pack_block's panels as bf16 pairs: K's (d, d + 1) in word (d / 2, j), V's rows (j, j + 1) in word
// (j / 2, c); 16 elements at a time (converted one by one, packing took ~9% of a 256-token chunk's
// attention): a K row's 16 bf16 go out as 8 words a panel row apart, two V rows' 16 columns as 16
// adjacent words (pair_rows). A V row without its pair in this block (an odd block size) goes in
// one element at a time.
template <typename T>
void pack_block_bf16(const Args& a, int64_t h, int64_t blk, Bf16* kt, Bf16* vp) {
  const int64_t j0 = blk * a.BS, j1 = std::min(a.ctx, j0 + a.BS), D = a.D, row = a.Hkv * D;
  const T* k0 = static_cast<const T*>(a.k) + (a.table[blk] * a.BS * a.Hkv + h) * D;
  const T* v0 = static_cast<const T*>(a.v) + (a.table[blk] * a.BS * a.Hkv + h) * D;
  const T* kr = k0;
  for (int64_t j = j0; j < j1; ++j, kr += row) {
    uint32_t* kp = reinterpret_cast<uint32_t*>(kt + (h * (a.Lp / NR) + j / NR) * D * NR) + j % NR;
    for (int64_t d = 0; d < D; d += 16) {
      alignas(32) uint32_t w[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(w), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(widen16(kr + d))));
      for (int i = 0; i < 8; ++i) kp[(d / 2 + i) * NR] = w[i];
    }
  }
  Bf16* vo = vp + h * D * a.Lp;
  for (int64_t j = j0; j < j1;) {
    const T* vr = v0 + (j - j0) * row;
    const bool last = j + 1 == a.ctx;  // its pair is padding: zero
    if (j % 2 == 0 && (j + 1 < j1 || last)) {
      for (int64_t c = 0; c < D; c += NR) {
        const __m512 r1 = last ? _mm512_setzero_ps() : widen16(vr + row + c);
        _mm512_storeu_si512(vo + c * a.Lp + j * NR, pair_rows(widen16(vr + c), r1));
      }
      j += 2;
    } else {
      for (int64_t c = 0; c < D; c += NR)
        for (int64_t i = 0; i < NR; ++i) vo[c * a.Lp + (j / 2 * NR + i) * 2 + j % 2] = to_bf16(to_f32(vr[c + i]));
      j += 1;
    }
  }
}
#endif

#ifdef PP_BF16
// The bf16 tiles are MR rows x NP panels (up to 4: 64 keys or output columns), 24 accumulators
// as the GEMM's bf16 tiles, against vdpbf16ps's latency. Measured against 6 (one panel): no
// faster here (256-token chunk, 1 thread: 0.645 / 0.644 ms a layer), the kernel's products were
// not waiting on it; kept at no cost for other cores and head sizes.
constexpr int NPB = 4;

// s[r][c] = Σ_d q_r[d] kt_c[d] for r < MR, c < NP · NR as qk_tile over NP consecutive panels
// (kt: the first, D / 2 x NR words each), from bf16: q rows at q + r * D
template <int DC, int NP>
inline void qk_tile_bf16(const Bf16* q, const Bf16* kt, int64_t D, float* s, int64_t lds) {
  const int64_t Dn = DC > 0 ? DC : D;
  __m512 c[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int i = 0; i < NP; ++i) c[r][i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < Dn / 2; ++p) {
    __m512bh b[NP];
    for (int i = 0; i < NP; ++i) b[i] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kt + i * Dn * NR + p * 2 * NR));
    for (int r = 0; r < MR; ++r) {
      const __m512bh x = bcast_pair(q + r * Dn + 2 * p);
      for (int i = 0; i < NP; ++i) c[r][i] = _mm512_dpbf16_ps(c[r][i], x, b[i]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int i = 0; i < NP; ++i) _mm512_storeu_ps(s + r * lds + i * NR, c[r][i]);
}

// o[r][c] += Σ_j p[r][j] v_c[j] for r < MR, c < NP · NR as pv_tile over kc2 keys (even) and NP
// column panels (vp: the first's slab, kc2 / 2 x NR words; the next at + pstride), from bf16 P rows
// at stride ldp
template <int NP>
inline void pv_tile_bf16(const Bf16* p, int64_t ldp, const Bf16* vp, int64_t pstride, int64_t kc2, float* o,
                         int64_t ldo) {
  __m512 c[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int i = 0; i < NP; ++i) c[r][i] = _mm512_loadu_ps(o + r * ldo + i * NR);
  for (int64_t j = 0; j < kc2; j += 2) {
    __m512bh b[NP];
    for (int i = 0; i < NP; ++i) b[i] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(vp + i * pstride + j * NR));
    for (int r = 0; r < MR; ++r) {
      const __m512bh x = bcast_pair(p + r * ldp + j);
      for (int i = 0; i < NP; ++i) c[r][i] = _mm512_dpbf16_ps(c[r][i], x, b[i]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int i = 0; i < NP; ++i) _mm512_storeu_ps(o + r * ldo + i * NR, c[r][i]);
}

// f<NP>() for NP = n (1 .. NPB): the tiles' panel count as a compile-time constant
template <typename F>
inline void with_panels(int64_t n, const F& f) {
  switch (n) {
    case 1: return f(std::integral_constant<int, 1>());
    case 2: return f(std::integral_constant<int, 2>());
    case 3: return f(std::integral_constant<int, 3>());
    default: return f(std::integral_constant<int, NPB>());
  }
}

// n floats -> n bf16 (n a multiple of 16)
inline void round_row(const float* x, int64_t n, Bf16* y) {
  for (int64_t i = 0; i < n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i))));
}
#endif

}  // namespace pp_prefill
