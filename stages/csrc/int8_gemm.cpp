// Linear layers in int8 products (matmul precision "int8"): x's rows cut into blocks of 32 k,
// each rounded to int8 codes with one fp32 scale, against a GGUF weight's own 4- or 8-bit codes.
//
//   xq, xs, xc = quantize_rows(x)            # (M, K) int8, (M, K/32) scales, (M, K/32) xs · Σ codes
//   y = int8_linear(x, panels, bias)         # (M, N) float32; panels: stages/quant.py, Q4_0/Q4_1/Q8_0
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
// Layout: a (panel, block) holds d[16], m[16] (fp32), then the codes row by row of k: u4 two rows
// a 16-byte line (low nibble: row 2i), s8 one row a line. vpdpbusd wants each column's 4 k in one
// 32-bit lane: a byte permute (VBMI, panels.h: LANE_ORDER) puts them there from 4 rows of 16 columns.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>
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

#if defined(PP_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define PP_INT8_GEMM 1

// rows a tile: 8 int32 sums + 8 outputs + codes and constants in 32 zmm registers (6, 10 and 12
// rows, and each row's sum split in two chains, measured no faster on the model's shapes)
constexpr int ROWS = 8;

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// R rows against one panel: R int32 block sums and R fp32 outputs in registers. pf: the next
// panel, fetched block by block meanwhile (nullptr: none). Why: at a few rows a step streams
// every weight once from L3 (80 MB for SmolLM2's layers), and without it the hardware prefetcher
// left the int8 product at 1 row slower than the fp32 one, which prefetches.
template <int R, bool U4>
void tile(const uint8_t* panel, int64_t KB, const int8_t* xq, int64_t K, const float* xs, const float* xc,
          float* y, int64_t N, const float* bias, const uint8_t* pf) {
  constexpr int64_t QB = U4 ? QB_U4 : QB_S8;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* blk = panel + b * QB;
    const int8_t* xb = xq + b * QK;
    if (pf)
      for (int64_t o = 0; o < QB; o += 64) _mm_prefetch(reinterpret_cast<const char*>(pf + b * QB + o), _MM_HINT_T0);
    __m512i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_si512();
    if constexpr (U4) {
      const __m512i u4a = _mm512_load_si512(LANE_ORDER.u4a), u4b = _mm512_load_si512(LANE_ORDER.u4b);
      for (int i = 0; i < 4; ++i) {  // k = 8i .. 8i + 7
        const __m512i v = _mm512_loadu_si512(blk + 128 + 64 * i);
        const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        const __m512i w0 = _mm512_permutex2var_epi8(lo, u4a, hi), w1 = _mm512_permutex2var_epi8(lo, u4b, hi);
        for (int r = 0; r < R; ++r) {
          s[r] = _mm512_dpbusd_epi32(s[r], w0, bcast4(xb + r * K + 8 * i));
          s[r] = _mm512_dpbusd_epi32(s[r], w1, bcast4(xb + r * K + 8 * i + 4));
        }
      }
    } else {
      const __m512i s8 = _mm512_load_si512(LANE_ORDER.s8);
      for (int i = 0; i < 8; ++i) {  // k = 4i .. 4i + 3, codes + 128 as unsigned bytes
        const __m512i w = _mm512_xor_si512(_mm512_permutexvar_epi8(s8, _mm512_loadu_si512(blk + 128 + 64 * i)), flip);
        for (int r = 0; r < R; ++r) s[r] = _mm512_dpbusd_epi32(s[r], w, bcast4(xb + r * K + 4 * i));
      }
    }
    const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(blk));
    __m512 m = _mm512_loadu_ps(reinterpret_cast<const float*>(blk + 64));
    if constexpr (!U4) m = _mm512_fnmadd_ps(d, _mm512_set1_ps(128.f), m);  // the + 128 of u, taken off
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), _mm512_mul_ps(d, _mm512_set1_ps(xs[r * KB + b])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xc[r * KB + b]), acc[r]);
    }
  }
  const __m512 bv = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * N, _mm512_add_ps(acc[r], bv));
}

template <bool U4, int R = ROWS>
void rows(int n, const uint8_t* panel, int64_t KB, const int8_t* xq, int64_t K, const float* xs, const float* xc,
          float* y, int64_t N, const float* bias, const uint8_t* pf) {
  if constexpr (R > 1) {
    if (n < R) return rows<U4, R - 1>(n, panel, KB, xq, K, xs, xc, y, N, bias, pf);
  }
  tile<R, U4>(panel, KB, xq, K, xs, xc, y, N, bias, pf);
}
#endif

}  // namespace

std::vector<torch::Tensor> quantize_rows(torch::Tensor x) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1 && x.size(1) % QK == 0,
              "quantize_rows: x (M, K) float32 with contiguous rows and K a multiple of ", QK);
  const int64_t M = x.size(0), K = x.size(1), KB = K / QK;
  auto xq = torch::empty({M, K}, torch::kInt8);
  auto xs = torch::empty({M, KB}, torch::kFloat32), xc = torch::empty({M, KB}, torch::kFloat32);
  const float* xp = x.data_ptr<float>();
  const int64_t ld = x.stride(0);
  int8_t* qp = xq.data_ptr<int8_t>();
  float *sp = xs.data_ptr<float>(), *cp = xc.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) quantize_row(xp + r * ld, K, qp + r * K, sp + r * KB, cp + r * KB);
  });
  return {xq, xs, xc};
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor q, c10::optional<torch::Tensor> bias_) {
  TORCH_CHECK(q.dtype() == torch::kUInt8 && q.dim() == 3 && q.is_contiguous() && (q.size(2) == QB_U4 || q.size(2) == QB_S8),
              "int8_linear: weight (N/16, K/32, ", QB_U4, " or ", QB_S8, ") uint8 panels");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == q.size(1) * QK, "int8_linear: x (M, ", q.size(1) * QK, ")");
  const int64_t M = x.size(0), K = x.size(1), KB = K / QK, NP = q.size(0), N = NP * NR;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
#ifdef PP_INT8_GEMM
  torch::Tensor keep;
  const float* bp = bias_of(bias_, N, keep, "int8_linear");
  const auto parts = quantize_rows(x);
  const int8_t* xq = parts[0].data_ptr<int8_t>();
  const float *xs = parts[1].data_ptr<float>(), *xc = parts[2].data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const bool u4 = q.size(2) == QB_U4;
  const int64_t qb = q.size(2);
  float* yp = y.data_ptr<float>();
  // panels split among threads; each panel's codes (6.9 KB at K = 576, u4) stay in L1 while every
  // tile of rows reads them
  at::parallel_for(0, NP, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t r = 0; r < M; r += ROWS) {
        const int n = static_cast<int>(std::min<int64_t>(ROWS, M - r));
        const float* bb = bp ? bp + p * NR : nullptr;
        const uint8_t* pf = r == 0 && p + 1 < NP ? qp + (p + 1) * KB * qb : nullptr;  // later tiles: in L1
        if (u4)
          rows<true>(n, qp + p * KB * qb, KB, xq + r * K, K, xs + r * KB, xc + r * KB, yp + r * N + p * NR, N, bb, pf);
        else
          rows<false>(n, qp + p * KB * qb, KB, xq + r * K, K, xs + r * KB, xc + r * KB, yp + r * N + p * NR, N, bb, pf);
      }
  });
#else
  TORCH_CHECK(false, "int8_linear: this build has no AVX512-VNNI and VBMI (int8_products() is false)");
#endif
  return y;
}
