// Vector helpers shared by the CPU kernels (AVX2 + FMA where the build has them).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#include <array>

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

// K/V cache elements: fp32, or fp16 / fp8 e4m3 (--kv-cache-dtype float16 / fp8) widened to fp32
// as they are read. fp8 through a table of its 256 values (c10's conversion is a dozen integer
// ops; a prefill chunk widens every cached key and value of its context once per layer)
using Fp8 = c10::Float8_e4m3fn;
inline const std::array<float, 256> kFp8Values = [] {
  std::array<float, 256> t{};
  for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(Fp8(static_cast<uint8_t>(i), Fp8::from_bits()));
  return t;
}();
inline float to_f32(float x) { return x; }
inline float to_f32(c10::Half x) { return static_cast<float>(x); }
inline float to_f32(Fp8 x) { return kFp8Values[x.x]; }

// The prefill attention's bf16 path takes chunks of more than 12 tokens, as the GEMM's bf16 path
// takes products of more than 12 rows: a shorter chunk is bound by reading its context, and a step
// of up to 12 rows stays bit-identical to fp32 ("medium" promises it; paged_decode's bf16_over is
// that 12 under "medium")
constexpr int64_t kBf16MinTokens = 12;
using Bf16 = uint16_t;  // a bf16's bits (the prefill panels' element in its bf16 path)
inline Bf16 to_bf16(float x) { return c10::BFloat16(x).x; }  // nearest even

// What the vector loads below (load8, the decode kernel's 16-lane load) return, in units of the
// element's value: fp8 comes back as value · 2⁻⁸ (its e4m3 bits moved into fp16 bits, whose
// exponent bias is 8 more), and the kernels fold 2⁸ into a scale they multiply by anyway.
template <typename T> constexpr float raw_unit() { return 1.f; }
template <> constexpr float raw_unit<Fp8>() { return 256.f; }

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PP_AVX2 1

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {  // 8 halves -> 8 floats, exactly
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// fp8 e4m3 bits s eeee mmm -> fp16 bits s 0eeee mmm0000000, the same number · 2⁻⁸ (subnormals
// included: both formats' subnormals sit below their smallest exponent): sign-extended to 16
// bits, shifted left 7, the copy of the sign that lands on bit 14 cleared. Exact.
inline __m256 load8(const Fp8* p) {  // 8 fp8 -> 8 floats · 2⁻⁸ (raw_unit)
  const __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(static_cast<short>(0xBF80))));
}
#if defined(__AVX512F__)
#define PP_AVX512 1  // 16-lane FMAs: twice the 8-lane peak where the core has 512-bit FMA units
inline __m512 load16(const c10::Half* p) {  // 16 halves -> 16 floats, exactly
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const Fp8* p) {  // 16 fp8 -> 16 floats · 2⁻⁸, as load8
  const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(static_cast<short>(0xBF80))));
}
#if defined(__AVX512BF16__)
#define PP_BF16 1  // vdpbf16ps: two bf16 products into each of 16 fp32 sums (gemm_bf16.cpp, paged_prefill.cpp, paged_decode.cpp)
// two rows of 16 weights (k, k + 1) -> 16 words, word j holding bf16 w[k][j] (low) and w[k + 1][j]:
// the pair one vdpbf16ps lane multiplies with x's (k, k + 1)
inline __m512i pair_rows(__m512 r0, __m512 r1) {
  // word 2j <- element j (r0's), 2j + 1 <- 16 + j (r1's); _mm512_set_epi16 lists word 31 first
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                       21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(r1, r0)));
}
#endif
#endif

namespace exp_poly {  // shared by exp256 and exp512
constexpr float kLo = -87.f, kLog2e = 1.44269504f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP[5] = {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace exp_poly

// e^x for x <= 88, 8 lanes: 2^k · p(r) with x = k ln2 + r, |r| <= ln2 / 2 and p of degree 6
// (relative error ~1e-7); lanes below -87 flush to 0. libm's expf is scalar here, and a softmax
// or SiLU spends most of its time in it.
inline __m256 exp256(__m256 x) {
  using namespace exp_poly;
  const __m256 lo = _mm256_set1_ps(kLo);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kP[0]);
  for (int i = 1; i < 5; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

#ifdef PP_AVX512
// exp256 in 16 lanes (same polynomial and range handling)
inline __m512 exp512(__m512 x) {
  using namespace exp_poly;
  const __m512 lo = _mm512_set1_ps(kLo);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kP[0]);
  for (int i = 1; i < 5; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~under), p, _mm512_castsi512_ps(e));
}
#endif

inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// bytes [p, p + bytes) into L2, a line at a time (the decode attention's next blocks, the few-row
// GEMM's next quantized blocks). L2, not L1: these lines are used a block or a panel later, and
// pulling them into the 32 KiB L1 early evicts the lines the current block is still reading (on
// Zen 4, 2 threads, medium + fp16, ctx 256: decode B = 1/4/32 0.91/0.92/0.96 of the T0 time)
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T1);
}
#endif

#ifdef PP_AVX512
inline __mmask16 lanes16(int64_t left) {  // the first min(left, 16) lanes of a 16-lane step
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}
#endif

// o[i] = silu(g[i]) · u[i] = g / (1 + e^-g) · u for i < n (elementwise.cpp: silu_mul, row by row;
// int8_gemm.cpp: the down product's input, made as it is quantized). e^-g capped at e^88: silu is
// ~0 there anyway, and -ffast-math assumes no infinities (g / (1 + inf) came out NaN).
inline void silu_mul_row(const float* g, const float* u, float* o, int64_t n) {
  int64_t i = 0;
#ifdef PP_AVX512
  for (; i + 16 <= n; i += 16) {  // the 8-lane loop below, 16 lanes at a time
    const __m512 gv = _mm512_loadu_ps(g + i), one = _mm512_set1_ps(1.f);
    const __m512 den = _mm512_add_ps(one, exp512(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv),
                                                                _mm512_set1_ps(88.f))));
    __m512 inv = _mm512_rcp14_ps(den);
    inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.f)));
    _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_mul_ps(gv, inv), _mm512_loadu_ps(u + i)));
  }
#endif
#ifdef PP_AVX2
  const __m256 one = _mm256_set1_ps(1.f), cap = _mm256_set1_ps(88.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 ex = exp256(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv), cap));
    const __m256 den = _mm256_add_ps(one, ex);
    __m256 inv = _mm256_rcp_ps(den);  // 12 bits, one Newton step to ~23: a divide is 3x slower
    inv = _mm256_mul_ps(inv, _mm256_fnmadd_ps(den, inv, _mm256_set1_ps(2.f)));
    _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(gv, inv), _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) o[i] = g[i] / (1.f + std::exp(std::min(-g[i], 88.f))) * u[i];
}

// max of s[0..n), n >= 1
inline float row_max(const float* s, int64_t n) {
  float mx = s[0];
  int64_t j = 1;
#ifdef PP_AVX512  // 16 lanes, the tail masked (its lanes keep the running max), as exp_row
  __m512 m = _mm512_set1_ps(mx);
  for (j = 0; j < n; j += 16) {
    const __mmask16 k = lanes16(n - j);
    m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, k, s + j));
  }
  return _mm512_reduce_max_ps(m);
#elif defined(PP_AVX2)
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(s);
    for (j = 8; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + j));
    float t[8];
    _mm256_storeu_ps(t, m);
    mx = *std::max_element(t, t + 8);
  }
#endif
  for (; j < n; ++j) mx = std::max(mx, s[j]);
  return mx;
}

// s[j] <- e^(s[j] · scale − m) for j < n; returns their sum
inline float exp_row(float* s, int64_t n, float scale, float m) {
#ifdef PP_AVX512  // 16 lanes, the tail masked: a prefill chunk's softmax spent ~13% of its attention here at 8
  const __m512 vs = _mm512_set1_ps(scale), vm = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = lanes16(n - j);
    const __m512 e = _mm512_maskz_mov_ps(k, exp512(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, s + j), vs, vm)));
    _mm512_mask_storeu_ps(s + j, k, e);
    acc = _mm512_add_ps(acc, e);
  }
  return _mm512_reduce_add_ps(acc);
#else
  int64_t j = 0;
  float sum = 0.f;
#ifdef PP_AVX2
  const __m256 vs = _mm256_set1_ps(scale), vm = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp256(_mm256_fmsub_ps(_mm256_loadu_ps(s + j), vs, vm));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum256(acc);
#endif
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] * scale - m);
    sum += s[j];
  }
  return sum;
#endif
}

#ifdef PP_BF16
inline __m512bh bcast_pair(const Bf16* p) {  // the bf16 pair at p in all 16 words
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p)));
}

// 2^t, 16 lanes, for softmax weights that are rounded to bf16 next: t = k + f with |f| ≤ ½, 2^f by
// its degree-5 Taylor polynomial (relative error < 4e-6, against bf16's 2^-9), 2^k by vscalefps
// (no exponent arithmetic, no clamp: it goes to 0 far below): ~half of exp512's instructions.
inline __m512 exp2_softmax(__m512 t) {
  const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, k);
  constexpr float c[5] = {1.3333558e-3f, 9.6181291e-3f, 5.5504109e-2f, 2.4022651e-1f, 6.9314718e-1f};  // ln2ⁱ / i!
  __m512 p = _mm512_set1_ps(c[0]);
  for (int i = 1; i < 5; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
  return _mm512_scalef_ps(_mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f)), k);
}

// One softmax row for the bf16 products, in one pass over its scores (exp_row, then zeros, then
// round_row took three; the softmax was ~20% of a 256-token chunk's attention): e^(s·scale − m) of
// the first n scores and 0 up to np (a multiple of 16) as bf16 into p; returns their fp32 sum.
inline float exp_row_bf16(const float* s, int64_t n, int64_t np, float scale, float m, Bf16* p) {
  constexpr float kLog2e = 1.44269504f;
  const __m512 vs = _mm512_set1_ps(scale * kLog2e), vm = _mm512_set1_ps(m * kLog2e);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < np; j += 16) {
    const __mmask16 k = n > j ? lanes16(n - j) : __mmask16(0);
    const __m512 e = _mm512_maskz_mov_ps(k, exp2_softmax(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, s + j), vs, vm)));
    acc = _mm512_add_ps(acc, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
  }
  return _mm512_reduce_add_ps(acc);
}
#endif
