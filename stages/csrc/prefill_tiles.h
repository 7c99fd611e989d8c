// paged_prefill's fp32 micro-tiles (Q Kᵀ and P V, 6 x 16, 16 lanes where the build has AVX-512) and
// the packing of a cache block into their 16-wide panels; included by paged_prefill.cpp.
#pragma once

#include <algorithm>

#include "paged_prefill.h"
#include "vec.h"

namespace pp_prefill {

// s[r][c] = Σ_d q_r[d] kt[d][c] for r < MR, c < NR (kt: one D x NR panel; s row stride lds)
template <int DC>
inline void qk_tile(const float* const* qr, const float* kt, int64_t D, float* s, int64_t lds) {
  const int64_t Dn = DC > 0 ? DC : D;
#if defined(PP_AVX512)
  // a 16-key panel row is one 16-lane register: half the FMA instructions of the 8-lane tile
  __m512 c[MR];
  for (int r = 0; r < MR; ++r) c[r] = _mm512_setzero_ps();
  for (int64_t d = 0; d < Dn; ++d) {
    const __m512 b = _mm512_loadu_ps(kt + d * NR);
    for (int r = 0; r < MR; ++r) c[r] = _mm512_fmadd_ps(_mm512_set1_ps(qr[r][d]), b, c[r]);
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(s + r * lds, c[r]);
#elif defined(PP_AVX2)
  __m256 c[MR][2];
  for (int r = 0; r < MR; ++r) c[r][0] = c[r][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < Dn; ++d) {
    const __m256 b0 = _mm256_loadu_ps(kt + d * NR), b1 = _mm256_loadu_ps(kt + d * NR + 8);
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(qr[r] + d);
      c[r][0] = _mm256_fmadd_ps(a, b0, c[r][0]);
      c[r][1] = _mm256_fmadd_ps(a, b1, c[r][1]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(s + r * lds, c[r][0]);
    _mm256_storeu_ps(s + r * lds + 8, c[r][1]);
  }
#else
  float c[MR][NR] = {};
  for (int64_t d = 0; d < Dn; ++d)
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NR; ++j) c[r][j] += qr[r][d] * kt[d * NR + j];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) s[r * lds + j] = c[r][j];
#endif
}

// o[r][0:NR] += Σ_j p[r][j] vp[j][0:NR] for r < MR, j < kc (vp: a V panel; p, o row strides ldp, ldo)
inline void pv_tile(const float* p, int64_t ldp, const float* vp, int64_t kc, float* o, int64_t ldo) {
#if defined(PP_AVX512)
  __m512 c[MR];
  for (int r = 0; r < MR; ++r) c[r] = _mm512_loadu_ps(o + r * ldo);
  for (int64_t j = 0; j < kc; ++j) {
    const __m512 b = _mm512_loadu_ps(vp + j * NR);
    for (int r = 0; r < MR; ++r) c[r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * ldp + j]), b, c[r]);
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(o + r * ldo, c[r]);
#elif defined(PP_AVX2)
  __m256 c[MR][2];
  for (int r = 0; r < MR; ++r) {
    c[r][0] = _mm256_loadu_ps(o + r * ldo);
    c[r][1] = _mm256_loadu_ps(o + r * ldo + 8);
  }
  for (int64_t j = 0; j < kc; ++j) {
    const __m256 b0 = _mm256_loadu_ps(vp + j * NR), b1 = _mm256_loadu_ps(vp + j * NR + 8);
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(p + r * ldp + j);
      c[r][0] = _mm256_fmadd_ps(a, b0, c[r][0]);
      c[r][1] = _mm256_fmadd_ps(a, b1, c[r][1]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(o + r * ldo, c[r][0]);
    _mm256_storeu_ps(o + r * ldo + 8, c[r][1]);
  }
#else
  for (int64_t j = 0; j < kc; ++j)
    for (int r = 0; r < MR; ++r) {
      const float w = p[r * ldp + j];
      for (int c = 0; c < NR; ++c) o[r * ldo + c] += w * vp[j * NR + c];
    }
#endif
}

// The panels of KV head h for the positions of cache block blk (both read once, in place).
template <typename T>
void pack_block(const Args& a, int64_t h, int64_t blk, float* kt, float* vp) {
  const int64_t j0 = blk * a.BS, j1 = std::min(a.ctx, j0 + a.BS), D = a.D, row = a.Hkv * D;
  const T* kr = static_cast<const T*>(a.k) + (a.table[blk] * a.BS * a.Hkv + h) * D;
  const T* vr = static_cast<const T*>(a.v) + (a.table[blk] * a.BS * a.Hkv + h) * D;
  for (int64_t j = j0; j < j1; ++j, kr += row, vr += row) {
    float* kp = kt + (h * (a.Lp / NR) + j / NR) * D * NR + j % NR;
    for (int64_t d = 0; d < D; ++d) kp[d * NR] = to_f32(kr[d]);
    for (int64_t c = 0; c < D; c += NR) {
      float* vo = vp + ((h * (D / NR) + c / NR) * a.Lp + j) * NR;
      for (int64_t i = 0; i < NR; ++i) vo[i] = to_f32(vr[c + i]);
    }
  }
}

}  // namespace pp_prefill
