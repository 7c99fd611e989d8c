// bf16 dot products for fp32 products of many rows (matmul precision "medium").
// torch.set_float32_matmul_precision("medium") lets an fp32 matmul run on bf16 inputs with fp32
// sums; this is that, on cores with AVX512-BF16: x and W rounded to bf16 (nearest even) as they
// are packed, each vdpbf16ps adding two k terms to 16 fp32 sums. A Zen 5 core runs it at ~4x its
// fp32 FMA rate (torch's bf16 matmul: 528 against 118 GFLOP/s, 256 x 576 x 1536, 1 thread), so a
// prefill chunk's products shrink while a few-row product, bound by streaming and dequantizing W,
// would not: products of <= 2 row tiles (<= 12 rows) keep the fp32 path; any larger one, a
// decode-only batch of 13+ sequences too, takes this one (packed_linear and quant_linear choose).
// Here: x and each slab of W (either panel format) turned into bf16 pairs, the 6 x 32 tiles of
// vdpbf16ps over them, and the weight's pairs kept (pack_weight_bf16) for bf16_linear.
#include "aten.h"

#include <algorithm>
#include <string>
#include <type_traits>

#include "gemm_common.h"
#include "gemm_dequant.h"
#include "kernels.h"

#ifdef PP_BF16
namespace {

// deepest K slab of the bf16 path: a pair of panels' 576-deep slab is 36 KB of bf16 pairs and
// stays in L1; 576 against 192 (the fp32 rule) ran 2-10% faster at 32-256 rows
constexpr int64_t BF_KC = 576;

// x's rows in the same register tiles as pack_rows, as bf16 pairs: tile t's word p * m + i holds
// x[r0 + i][2p] (low half) and x[r0 + i][2p + 1]; a tile starts at word r0[t] * K / 2.
RowTiles pack_rows_bf16(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), lda = x.stride(0), KP = K / 2;
  RowTiles rt = row_tiles(M);
  rt.buf = at::empty({M * KP}, x.options());  // M x K/2 words of 4 bytes
  uint32_t* ap = reinterpret_cast<uint32_t*>(rt.buf.data_ptr<float>());
  const float* a = x.data_ptr<float>();
  at::parallel_for(0, rt.size(), 4, [&](int64_t t0, int64_t t1) {
    alignas(64) uint32_t row[MR][16];
    for (int64_t t = t0; t < t1; ++t) {
      const int m = rt.mt[t];
      uint32_t* dst = ap + rt.r0[t] * KP;
      const float* src = a + rt.r0[t] * lda;
      int64_t k = 0;
      for (; k + 32 <= K; k += 32) {  // 16 pairs of each row, converted 32 floats at a time
        for (int i = 0; i < m; ++i) {
          const float* s = src + i * lda + k;
          _mm512_store_si512(row[i], reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + 16),
                                                                                      _mm512_loadu_ps(s))));
        }
        for (int j = 0; j < 16; ++j)
          for (int i = 0; i < m; ++i) dst[(k / 2 + j) * m + i] = row[i][j];
      }
      for (; k < K; k += 2)  // K % 32 pairs left: one at a time (zero padding is a full pair here)
        for (int i = 0; i < m; ++i) {
          const __m128bh v = _mm_cvtneps_pbh(_mm_set_ps(0.f, 0.f, src[i * lda + k + 1], src[i * lda + k]));
          dst[(k / 2) * m + i] = static_cast<uint32_t>(_mm_cvtsi128_si32(reinterpret_cast<__m128i>(v)));
        }
    }
  });
  rt.ap = nullptr;  // the words are rt.buf's: bf16_product reads them
  return rt;
}

// c (M x 32: panels b0, b1; M x 16 without TWO) (+)= a (kp pairs x M words) · b (kp x 16 words each)
template <int M, bool TWO>
void tile_bf16(const uint32_t* a, const uint32_t* b0, const uint32_t* b1, int64_t kp, float* c, int64_t ldc,
               bool acc, const float* bias) {
  __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#define PB_ROW(i)                                                                                  \
  if constexpr (M > i) {                                                                           \
    const __m512bh x = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(a[p * M + i]))); \
    c##i##0 = _mm512_dpbf16_ps(c##i##0, x, w0);                                                    \
    if constexpr (TWO) c##i##1 = _mm512_dpbf16_ps(c##i##1, x, w1);                                 \
  }
#pragma GCC unroll 4
  for (int64_t p = 0; p < kp; ++p) {
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b0 + p * NR));
    const __m512bh w1 = TWO ? reinterpret_cast<__m512bh>(_mm512_loadu_si512(b1 + p * NR)) : w0;
    PB_ROW(0) PB_ROW(1) PB_ROW(2) PB_ROW(3) PB_ROW(4) PB_ROW(5)
  }
#undef PB_ROW
  alignas(64) float t[MR][2 * NR];
#define PB_OUT(i)                                                                                  \
  if constexpr (M > i) { _mm512_store_ps(t[i], c##i##0); _mm512_store_ps(t[i] + NR, c##i##1); }
  PB_OUT(0) PB_OUT(1) PB_OUT(2) PB_OUT(3) PB_OUT(4) PB_OUT(5)
#undef PB_OUT
  for (int i = 0; i < M; ++i) {
    float* ci = c + i * ldc;
    for (int h = 0; h < (TWO ? 2 * NR : NR); h += NR) {
      __m512 v = _mm512_load_ps(t[i] + h);
      if (acc) v = _mm512_add_ps(v, _mm512_loadu_ps(ci + h));
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + h));
      _mm512_storeu_ps(ci + h, v);
    }
  }
}

// Two full row tiles (12 rows) x two panels (32 columns) at once: 24 accumulators share each
// pair of W loads, where tile_bf16's 12 accumulators per 2 loads + 6 broadcasts leave the two
// dot-product pipes waiting on their latency. bf16_product takes it for every two consecutive
// full tiles of a panel pair; each output still sums its k pairs in order, so results are the
// same as tile_bf16's. 256 x 576 x 960, 1 thread: 470 -> 500 GFLOP/s (torch's bf16 matmul 511-532).
void tile_bf16_x2(const uint32_t* a0, const uint32_t* a1, const uint32_t* b0, const uint32_t* b1, int64_t kp,
                  float* c, int64_t ldc, bool acc, const float* bias) {
  __m512 s[2 * MR][2];
#pragma GCC unroll 12
  for (int i = 0; i < 2 * MR; ++i) s[i][0] = s[i][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kp; ++p) {
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b0 + p * NR));
    const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b1 + p * NR));
#pragma GCC unroll 12
    for (int i = 0; i < 2 * MR; ++i) {
      const uint32_t* a = i < MR ? a0 + p * MR + i : a1 + p * MR + (i - MR);
      const __m512bh x = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(*a)));
      s[i][0] = _mm512_dpbf16_ps(s[i][0], x, w0);
      s[i][1] = _mm512_dpbf16_ps(s[i][1], x, w1);
    }
  }
#pragma GCC unroll 12
  for (int i = 0; i < 2 * MR; ++i) {
    float* ci = c + i * ldc;
    for (int h = 0; h < 2; ++h) {
      __m512 v = s[i][h];
      if (acc) v = _mm512_add_ps(v, _mm512_loadu_ps(ci + h * NR));
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + h * NR));
      _mm512_storeu_ps(ci + h * NR, v);
    }
  }
}

using BfFn = void (*)(const uint32_t*, const uint32_t*, const uint32_t*, int64_t, float*, int64_t, bool, const float*);
constexpr BfFn kBf[2][MR + 1] = {
  {nullptr, tile_bf16<1, false>, tile_bf16<2, false>, tile_bf16<3, false>, tile_bf16<4, false>, tile_bf16<5, false>, tile_bf16<6, false>},
  {nullptr, tile_bf16<1, true>, tile_bf16<2, true>, tile_bf16<3, true>, tile_bf16<4, true>, tile_bf16<5, true>, tile_bf16<6, true>}};

// kc (even) fp32 weight rows from src (row stride NR) -> pairs at o (word r / 2 * NR)
inline void pair_slab(const float* src, int64_t kc, uint32_t* o) {
  for (int64_t r = 0; r < kc; r += 2)
    _mm512_storeu_si512(o + r / 2 * NR, pair_rows(_mm512_loadu_ps(src + r * NR), _mm512_loadu_ps(src + (r + 1) * NR)));
}

// panel rows [k0, k0 + kc) of a block-quantized panel -> kc / 2 x 16 words of bf16 pairs (k0, kc even)
template <bool U4>
void dequant_bf16(const uint8_t* panel, int64_t k0, int64_t kc, uint32_t* buf) {
  for_blocks<U4>(panel, k0, kc, [buf](const uint8_t* blk, int64_t r0, int64_t r1, int64_t at) {
    const __m512 d = block_d16(blk), m = block_m16(blk), levels = u4_levels();
    uint32_t* o = buf + at / 2 * NR;
    for (int64_t r = r0; r < r1; r += 2) {  // r0 even: k0 is
      __m512 w0, w1;
      dequant_pair_zmm<U4>(blk + DM, r / 2, d, m, levels, w0, w1);
      _mm512_storeu_si512(o + r / 2 * NR, pair_rows(w0, w1));
    }
  });
}

// rows [k0, k0 + kc) (k0, kc even) of panel j of a weight held as fp32 panels (qb = 0) or as
// block-quantized ones of qb bytes a block -> kc / 2 x 16 words of bf16 pairs at o: the words the
// bf16 path multiplies, whether converted per call (packed_linear, quant_linear) or kept
// (pack_weight_bf16)
inline void panel_pairs(const void* w, int64_t qb, int64_t K, int64_t j, int64_t k0, int64_t kc, uint32_t* o) {
  if (qb == 0) pair_slab(static_cast<const float*>(w) + (j * K + k0) * NR, kc, o);
  else if (qb == QB_U4) dequant_bf16<true>(static_cast<const uint8_t*>(w) + j * (K / QK) * qb, k0, kc, o);
  else dequant_bf16<false>(static_cast<const uint8_t*>(w) + j * (K / QK) * qb, k0, kc, o);
}

// c (M x N) = x (M x K) times the weight's transpose as blocked_product runs it (panel chunks,
// blocks of MCQ rows, K slabs), x packed by pack_rows_bf16 and each slab of a panel pair
// converted to bf16 pairs once per row block: slab(j, pc, kc, words) returns kc / 2 x 16 words of
// panel j's slab at pc, filled into words (or already held as pairs: bf16_linear).
template <typename SlabFn>
void bf16_product(const at::Tensor& x, int64_t NP, float* c, const float* bias, const SlabFn& slab) {
  const RowTiles rt = pack_rows_bf16(x);
  const uint32_t* ap = reinterpret_cast<const uint32_t*>(rt.buf.data_ptr<float>());
  const int64_t K = x.size(1), N = NP * NR, T = rt.size(), nslab = (K + BF_KC - 1) / BF_KC;
  const int64_t kcb = ((K + nslab - 1) / nslab + 7) / 8 * 8, tpb = MCQ / MR;  // slabs of equal, even depth
  // scratch in floats: two panels' slabs of kcb / 2 x 16 four-byte words
  for_panel_chunks(NP, kcb * NR, [&](int64_t j0, int64_t j1, float* scratch) {
    uint32_t* buf = reinterpret_cast<uint32_t*>(scratch);
    uint32_t* b1 = buf + kcb / 2 * NR;  // the second panel's slab
    for (int64_t tb = 0; tb < T; tb += tpb) {
      const int64_t te = std::min(T, tb + tpb);
      for (int64_t pc = 0; pc < K; pc += kcb) {
        const int64_t kc = std::min(kcb, K - pc);
        const bool last = pc + kc == K;
        for (int64_t j = j0; j < j1; j += 2) {
          const bool two = j + 1 < j1;
          const uint32_t* s0 = slab(j, pc, kc, buf);
          const uint32_t* s1 = two ? slab(j + 1, pc, kc, b1) : s0;
          for (int64_t t = tb; t < te; ++t) {
            const int m = rt.mt[t];
            if (two && m == MR && t + 1 < te && rt.mt[t + 1] == MR) {  // rows r0[t] .. r0[t] + 11
              tile_bf16_x2(ap + rt.r0[t] * K / 2 + pc / 2 * MR, ap + rt.r0[t + 1] * K / 2 + pc / 2 * MR, s0, s1,
                           kc / 2, c + rt.r0[t] * N + j * NR, N, pc > 0, last && bias ? bias + j * NR : nullptr);
              ++t;
              continue;
            }
            kBf[two][m](ap + rt.r0[t] * K / 2 + pc / 2 * m, s0, s1, kc / 2, c + rt.r0[t] * N + j * NR, N, pc > 0,
                        last && bias ? bias + j * NR : nullptr);
          }
        }
      }
    }
  });
}

}  // namespace

void bf16_panel_product(const at::Tensor& x, const void* w, int64_t qb, int64_t NP, float* c, const float* bias) {
  const int64_t K = x.size(1);
  // one instance for each format, as when packed_linear and quant_linear each passed their own
  // slab: for fp32 panels qb is the constant 0, and panel_pairs' choice folds away (one instance
  // for both took 17-32-row products over fp32 panels 1-3% longer)
  const auto product = [&](auto qbc) {
    bf16_product(x, NP, c, bias, [&](int64_t j, int64_t pc, int64_t kc, uint32_t* o) {
      panel_pairs(w, qbc, K, j, pc, kc, o);
      return static_cast<const uint32_t*>(o);
    });
  };
  if (qb == 0)
    product(std::integral_constant<int64_t, 0>{});
  else
    product(qb);
}
#endif

// A weight in either panel format -> (N/16, K/2, 16) int32 words of bf16 pairs, word (p, k, j) holding
// bf16 w[16p + j][2k] (low half) and w[16p + j][2k + 1]: each slab of it is the words panel_linear's
// bf16 path converts that slab to on every call (the same rounding), kept. 2 bytes a weight.
at::Tensor pack_weight_bf16(at::Tensor w) {
  const bool quant = check_panels(w, "pack_weight_bf16");
  const int64_t NP = w.size(0), K = quant ? w.size(1) * QK : w.size(1);
  TORCH_CHECK(K % 2 == 0, "pack_weight_bf16: K = ", K, " is odd");
  auto out = at::empty({NP, K / 2, NR}, w.options().dtype(at::kInt));
#ifdef PP_BF16
  uint32_t* o = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  const void* src = w.data_ptr();
  const int64_t qb = quant ? w.size(2) : 0;
  at::parallel_for(0, NP, 16, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) panel_pairs(src, qb, K, j, 0, K, o + j * (K / 2) * NR);
  });
#else
  TORCH_CHECK(false, "pack_weight_bf16: this build has no bf16 dot products (bf16_products() is false)");
#endif
  return out;
}

// x (M, K) times a weight packed by pack_weight_bf16, in bf16 products for every M: for M > 12 the
// same bits as panel_linear(x, w, bf16=True) over the panels it was packed from, without the
// per-call conversion of W (2.4 ms of a 32-row product over SmolLM2's 49152 x 576 LM head).
at::Tensor bf16_linear(at::Tensor x, at::Tensor wb) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "bf16_linear: x (M, K) float32 with contiguous rows");
  TORCH_CHECK(wb.dtype() == at::kInt && wb.dim() == 3 && wb.size(2) == NR && wb.is_contiguous() &&
              wb.size(1) * 2 == x.size(1), "bf16_linear: weight (N/16, K/2, 16) from pack_weight_bf16 with K = x.size(1)");
  const int64_t M = x.size(0), K = x.size(1), NP = wb.size(0);
  auto y = at::empty({M, NP * NR}, x.options());
  if (M == 0) return y;
#ifdef PP_BF16
  const uint32_t* b = reinterpret_cast<const uint32_t*>(wb.data_ptr<int32_t>());
  bf16_product(x, NP, y.data_ptr<float>(), nullptr, [&](int64_t j, int64_t pc, int64_t, uint32_t*) {
    return b + j * (K / 2) * NR + pc / 2 * NR;
  });
#else
  TORCH_CHECK(false, "bf16_linear: this build has no bf16 dot products (bf16_products() is false)");
#endif
  return y;
}

bool bf16_products() {
#ifdef PP_BF16
  return true;
#else
  return false;
#endif
}
