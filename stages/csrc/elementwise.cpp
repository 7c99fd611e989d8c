// Fused elementwise ops of a decoder layer for fp32 on CPU (see stages/cpu_kernels.py).
// torch runs RMSNorm as five kernels on CPU (pow, mean, add, rsqrt, mul: ~0.3 ms for a
// 256 x 576 chunk), SiLU on the strided gate half of the fused gate/up output at ~1.4 ns an
// element, and rotate-half RoPE as four strided kernels; each of these is one pass over its
// rows here, parallel over rows.
#include "aten.h"

#include <cmath>

#include "vec.h"

namespace {

// out = x · rsqrt(mean(x²) + eps) · w over one row of n
inline void norm_row(const float* x, const float* w, float eps, int64_t n, float* out) {
  int64_t i = 0;
  float ss = 0.f;
#ifdef PP_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  ss = hsum256(acc);
#endif
  for (; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dtype() == at::kFloat && t.dim() == 2 && t.is_contiguous(), what, ": contiguous (T, H) float32");
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  check_rows(x, "rms_norm");
  const int64_t t = x.size(0), n = x.size(1);
  auto out = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, t, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) norm_row(xp + r * n, wp, static_cast<float>(eps), n, op + r * n);
  });
  return out;
}

// h += x (the residual, in place); returns rms_norm(h) — the pre-MLP norm of a decoder layer
at::Tensor add_rms_norm_(at::Tensor h, at::Tensor x, at::Tensor w, double eps) {
  check_rows(h, "add_rms_norm_");
  check_rows(x, "add_rms_norm_");
  TORCH_CHECK(h.sizes() == x.sizes(), "add_rms_norm_: shapes");
  const int64_t t = h.size(0), n = h.size(1);
  auto out = at::empty_like(h);
  float* hp = h.data_ptr<float>();
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, t, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* hr = hp + r * n;
      const float* xr = xp + r * n;
      for (int64_t i = 0; i < n; ++i) hr[i] += xr[i];
      norm_row(hr, wp, static_cast<float>(eps), n, op + r * n);
    }
  });
  return out;
}

// gu (T, 2I) = [gate | up] -> silu(gate) · up (T, I)
at::Tensor silu_mul(at::Tensor gu) {
  check_rows(gu, "silu_mul");
  TORCH_CHECK(gu.size(1) % 2 == 0, "silu_mul: even width");
  const int64_t t = gu.size(0), n = gu.size(1) / 2;
  auto out = at::empty({t, n}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, t, 8, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) silu_mul_row(gp + r * 2 * n, gp + r * 2 * n + n, op + r * n, n);
  });
  return out;
}

// x (T, heads, D), rows of any stride, rotated in place (rotate-half layout):
// x1, x2 = halves of each head; x1 <- x1 cos − x2 sin, x2 <- x2 cos + x1 sin, with the cos/sin
// rows (P, D/2) of each token's position.
void rope_(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rope_: float32 (T, heads, D) with contiguous heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && positions.is_contiguous() &&
              positions.dtype() == at::kLong && cos.size(1) * 2 == x.size(2), "rope_: cos/sin (P, D/2)");
  const int64_t t = x.size(0), heads = x.size(1), half = x.size(2) / 2, stride = x.stride(0);
  float* xp = x.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  TORCH_CHECK(positions.size(0) == t, "rope_: one position per row");
  for (int64_t r = 0; r < t; ++r) TORCH_CHECK(pos[r] >= 0 && pos[r] < cos.size(0), "rope_: position ", pos[r],
                                              " outside the table of ", cos.size(0));
  at::parallel_for(0, t, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float *c = cp + pos[r] * half, *s = sp + pos[r] * half;
      for (int64_t h = 0; h < heads; ++h) {
        float* x1 = xp + r * stride + h * 2 * half;
        float* x2 = x1 + half;
        for (int64_t i = 0; i < half; ++i) {  // vectorised by the compiler (-O3)
          const float a = x1[i], b2 = x2[i];
          x1[i] = a * c[i] - b2 * s[i];
          x2[i] = b2 * c[i] + a * s[i];
        }
      }
    }
  });
}

namespace {

#ifdef PP_AVX2
// dst rows 0..7 (stride ld_d) <- the 8 x 8 block of src rows 0..7 (stride ld_s), transposed
inline void transpose8(const float* src, int64_t ld_s, float* dst, int64_t ld_d) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * ld_s);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ld_d, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ld_d, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}
#endif

}  // namespace

// (R, C) contiguous -> its transpose (C, R), contiguous: the skinny linear's (W Xᵀ) back to
// (T, out); torch's strided copy does it at a third of this speed.
at::Tensor transpose(at::Tensor x) {
  check_rows(x, "transpose");
  const int64_t R = x.size(0), C = x.size(1);
  auto out = at::empty({C, R}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (R + 7) / 8, 64, [&](int64_t b, int64_t e) {  // blocks of 8 source rows
    for (int64_t rb = b; rb < e; ++rb) {
      const int64_t r0 = rb * 8, rn = std::min<int64_t>(8, R - r0);
      int64_t c0 = 0;
#ifdef PP_AVX2
      if (rn == 8)
        for (; c0 + 8 <= C; c0 += 8) transpose8(xp + r0 * C + c0, C, op + c0 * R + r0, R);
#endif
      for (int64_t c = c0; c < C; ++c)
        for (int64_t r = r0; r < r0 + rn; ++r) op[c * R + r] = xp[r * C + c];
    }
  });
  return out;
}

namespace {

// n floats -> the cache's element type: fp32 as they are, fp16 clamped to its finite range
// (+-65504: an inf key would make every score of its row NaN) and rounded to nearest even, as
// torch's clamp + .to(float16) does
inline void store_row(const float* x, int64_t n, float* out) { std::copy(x, x + n, out); }
inline void store_row(const float* x, int64_t n, c10::Half* out) {
  int64_t i = 0;
#ifdef PP_AVX2
  const __m256 lo = _mm256_set1_ps(-65504.f), hi = _mm256_set1_ps(65504.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_loadu_ps(x + i), lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
#endif
  for (; i < n; ++i) out[i] = c10::Half(std::min(std::max(x[i], -65504.f), 65504.f));
}
// fp8 e4m3 the same way: clamped to ±448, its largest finite value, and rounded to nearest even
// as torch's .to(float8_e4m3fn) does. 16 lanes: the magnitude's fp32 bits rounded at bit 20 and
// rebiased (exponent 127 -> 7) where it is normal in e4m3 (≥ 2⁻⁶); below, |x| · 2⁹ rounded to an
// integer, which is the subnormal code (and gives 8, 2⁻⁶'s code, where rounding reaches it)
inline void store_row(const float* x, int64_t n, Fp8* out) {
  int64_t i = 0;
#ifdef PP_AVX512
  const __m512 lo = _mm512_set1_ps(-448.f), hi = _mm512_set1_ps(448.f);
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF), one = _mm512_set1_epi32(1);
  const __m512i half_ulp = _mm512_set1_epi32(0x7FFFF), rebias = _mm512_set1_epi32((127 - 7) << 3);
  const __m512i smallest_normal = _mm512_set1_epi32(0x3C800000);  // 2⁻⁶
  for (; i + 16 <= n; i += 16) {
    const __m512i bits = _mm512_castps_si512(_mm512_min_ps(_mm512_max_ps(_mm512_loadu_ps(x + i), lo), hi));
    const __m512i a = _mm512_and_si512(bits, magnitude);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), one);  // ties to even
    const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_add_epi32(a, _mm512_add_epi32(half_ulp, odd)), 20),
                                            rebias);
    const __m512i sub = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(512.f)),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i code = _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(a, smallest_normal), normal, sub);
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(_mm512_or_si512(code, sign)));
  }
#endif
  for (; i < n; ++i) out[i] = Fp8(std::min(std::max(x[i], -448.f), 448.f));
}

template <typename T>
void write_rows(const at::Tensor& src, at::Tensor& cache, const int64_t* slots) {
  const int64_t t = src.size(0), n = src.size(1) * src.size(2), ld = src.stride(0);
  const float* s = src.data_ptr<float>();
  T* c = cache.data_ptr<T>();
  at::parallel_for(0, t, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) store_row(s + r * ld, n, c + slots[r] * n);
  });
}

}  // namespace

// The new tokens' K and V (T, H_kv, D; each (H_kv, D) row contiguous, any row stride: views of
// the fused QKV output) into the paged caches (NB, BS, H_kv, D) at flat slots (T,) int64, in one
// call: torch's index_copy_ twice per layer cost ~22 us each on a 32-row decode step, ~1.3 ms a
// step over 30 layers, while the other core waited.
void write_kv_(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots) {
  TORCH_CHECK(k.dtype() == at::kFloat && v.dtype() == at::kFloat && k.dim() == 3 && k.sizes() == v.sizes() &&
              k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "write_kv_: k, v (T, H, D) float32 with contiguous (H, D) rows");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dtype() == v_cache.dtype() &&
              (k_cache.dtype() == at::kFloat || k_cache.dtype() == at::kHalf ||
               k_cache.dtype() == at::kFloat8_e4m3fn) && k_cache.dim() == 4 &&
              k_cache.size(2) * k_cache.size(3) == k.size(1) * k.size(2) && k_cache.sizes() == v_cache.sizes(),
              "write_kv_: caches (NB, BS, H, D) float32, float16 or float8_e4m3fn, contiguous, of k's heads");
  TORCH_CHECK(slots.dtype() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0),
              "write_kv_: slots (T,) int64");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t nslots = k_cache.size(0) * k_cache.size(1);
  for (int64_t r = 0; r < slots.numel(); ++r)
    TORCH_CHECK(sl[r] >= 0 && sl[r] < nslots, "write_kv_: slot ", sl[r], " outside the cache's ", nslots);
  if (k_cache.dtype() == at::kHalf) {
    write_rows<c10::Half>(k, k_cache, sl);
    write_rows<c10::Half>(v, v_cache, sl);
  } else if (k_cache.dtype() == at::kFloat8_e4m3fn) {
    write_rows<Fp8>(k, k_cache, sl);
    write_rows<Fp8>(v, v_cache, sl);
  } else {
    write_rows<float>(k, k_cache, sl);
    write_rows<float>(v, v_cache, sl);
  }
}
