// quant_linear: the fp32 GEMM over GGUF Q4_0 / Q4_1 / Q8_0 weights kept as stored (stages/quant.py),
// summed in packed_linear's order, so that its products are bit-identical to those over the same
// weights as fp32 panels. Many rows: each panel's K slab dequantized into a scratch that all row
// tiles of a block then read (gemm_common.h: blocked_product). A few rows: the codes go to registers
// inside the tile (qtile, 8 lanes), or with AVX-512 in groups of up to 24 rows
// (gemm_few_rows.cpp). The dequantizing steps: gemm_dequant.h; bf16 products: gemm_bf16.cpp.
#include "aten.h"

#include <utility>

#include "gemm_common.h"
#include "gemm_dequant.h"
#include "kernels.h"

namespace {

// Few rows (<= 2 tiles, K whole, as packed_linear then sums): one M x 16 tile over a whole panel
// whose accumulators live across all of K. Up to REG_ROWS rows and no second tile after it, each
// weight row goes from codes to registers straight into the FMAs; otherwise each block is
// dequantized into the panel's scratch (K x 16 floats) just before its 32 FMA steps read it back
// from L1, and a second tile (SECOND) then reads the whole dequantized panel from there. The same
// FMAs in the same order either way. Past 4 rows the 2M accumulators, two weight vectors and the
// block's four scale vectors outgrow the 16 ymm registers: 6 rows spilled and ran 1.16x slower
// than through the scratch, while 1-2 rows run 0.71x of it (30 layers + LM head, 1 thread). And
// dequantizing a whole slab first, read back from L2, was slower than fp32 weights for 1-4 rows.
constexpr int REG_ROWS = 4;

template <int M, bool U4, bool SECOND>
void qtile(const float* x, const uint8_t* panel, int64_t K, float* w, float* c, int64_t ldc, const float* bias) {
  constexpr int64_t QB = U4 ? QB_U4 : QB_S8;
#ifdef PP_AVX2
  constexpr bool REGS = !SECOND && M <= REG_ROWS;
  PP_ACCS
  for (int64_t kb = 0; kb < K / QK; ++kb) {
    const float* a = x + kb * QK * M;  // this block's rows of x, as tile's PP_ROW reads them
    if constexpr (!REGS) {
      float* wb = w + kb * QK * NR;
      dequant<U4>(panel + kb * QB, 0, QK, wb);
#pragma GCC unroll 4
      for (int64_t k = 0; k < QK; ++k) PP_STEP(wb + k * NR)
    } else {
      const uint8_t* blk = panel + kb * QB;
      const __m256 d0 = block_d8(blk, 0), d1 = block_d8(blk, 1), m0 = block_m8(blk, 0), m1 = block_m8(blk, 1);
#pragma GCC unroll 4
      for (int64_t k = 0; k < QK; ++k) {
        __m256 b0, b1;
        dequant_regs<U4>(blk + DM, k, d0, d1, m0, m1, b0, b1);
        PP_ROWS
      }
    }
  }
  PP_WRITE
#else
  dequant<U4>(panel, 0, K, w);
  tile<M, false>(x, w, w, K, c, ldc, false, bias);
#endif
}
#ifdef PP_AVX2
#undef PP_ROW
#undef PP_ROWS
#undef PP_OUT
#undef PP_ACCS
#undef PP_IN
#undef PP_RESUME
#undef PP_STEP
#undef PP_WRITE
#endif

using QTileFn = void (*)(const float*, const uint8_t*, int64_t, float*, float*, int64_t, const float*);
template <bool U4, bool SECOND>
constexpr QTileFn kQTiles[MR + 1] = {nullptr, qtile<1, U4, SECOND>, qtile<2, U4, SECOND>, qtile<3, U4, SECOND>,
                                     qtile<4, U4, SECOND>, qtile<5, U4, SECOND>, qtile<6, U4, SECOND>};

// Ask for bytes [p, p + n) of a panel's codes ahead of their use (into L2, as the fp32 tiles'
// prefetch): without it the quantized products ran 7% slower than fp32 in decode steps of 32
// rows in the model, though not in a loop of GEMMs alone. Not in the few-row path: the next
// whole panel asked for there made 1-4 rows at 1 thread 15-23% slower; qrows_zmm asks for its
// blocks one at a time, PF_BLOCKS ahead, instead.
inline void prefetch_panel(const uint8_t* p, int64_t n) {
  for (int64_t b = 0; b < n; b += 64) _mm_prefetch(reinterpret_cast<const char*>(p + b), PF_HINT);
}

template <bool U4>
void quant_product(const RowTiles& rt, const uint8_t* q, int64_t NP, int64_t K, float* c, const float* bias) {
  constexpr int64_t QB = U4 ? QB_U4 : QB_S8;
  const int64_t N = NP * NR, T = rt.size(), pbytes = K / QK * QB;
  if (T <= WHOLE_K_TILES) {
    for_panel_chunks(NP, K * NR, [&](int64_t j0, int64_t j1, float* w) {
      for (int64_t j = j0; j < j1; ++j) {
        const float* bj = bias ? bias + j * NR : nullptr;
        if (T == 1) {
          kQTiles<U4, false>[rt.mt[0]](rt.ap, q + j * pbytes, K, w, c + j * NR, N, bj);
        } else {
          kQTiles<U4, true>[rt.mt[0]](rt.ap, q + j * pbytes, K, w, c + j * NR, N, bj);
          kTiles[0][rt.mt[1]](rt.ap + rt.r0[1] * K, w, w, K, c + rt.r0[1] * N + j * NR, N, false, bj);
        }
      }
    });
    return;
  }
  // Each (slab, panel) is dequantized into the thread's scratch once per block of rows (one block
  // up to 288 rows) and then read from L1/L2 by every tile of the block, so the conversion costs
  // ~11 instructions per 16 weights against the tiles' 20 per 16 weights per 6 rows.
  blocked_product(rt, NP, K, MCQ / MR, true, 0, c, bias, [&](int64_t j, int64_t j1, int64_t pc, int64_t kc, float* buf) {
    // The codes of the slab two panels on (the next pair's) are on their way while this pair is
    // dequantized and multiplied: the fp32 path prefetches its next slab the same way.
    if (j + 2 < j1) prefetch_panel(q + (j + 2) * pbytes + pc / QK * QB, ((pc + kc + QK - 1) / QK - pc / QK) * QB);
    dequant<U4>(q + j * pbytes, pc, kc, buf);
    return std::pair<const float*, const float*>(buf, nullptr);
  });
}

}  // namespace

at::Tensor quant_linear(at::Tensor x, at::Tensor q, c10::optional<at::Tensor> bias_, bool bf16) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "quant_linear: x (M, K) float32 with contiguous rows");
  TORCH_CHECK(q.dtype() == at::kByte && q.dim() == 3 && q.is_contiguous() && q.size(1) * QK == x.size(1) &&
              (q.size(2) == QB_U4 || q.size(2) == QB_S8),
              "quant_linear: weight (N/16, K/32, ", QB_U4, " or ", QB_S8, ") uint8 panels with K = x.size(1)");
  const int64_t M = x.size(0), K = x.size(1), NP = q.size(0), N = NP * NR;
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  at::Tensor keep;
  const float* bias = bias_of(bias_, N, keep, "quant_linear");
#ifdef PP_BF16
  if (use_bf16(bf16, M, K)) {
    bf16_panel_product(x, q.data_ptr<uint8_t>(), q.size(2), NP, y.data_ptr<float>(), bias);
    return y;
  }
#endif
#ifdef PP_AVX512
  if (M <= FEW_ROWS) {
    few_row_quant_product(x, q.data_ptr<uint8_t>(), q.size(2), NP, y.data_ptr<float>(), bias);
    return y;
  }
#endif
  const RowTiles rt = pack_rows(x);
  if (q.size(2) == QB_U4)
    quant_product<true>(rt, q.data_ptr<uint8_t>(), NP, K, y.data_ptr<float>(), bias);
  else
    quant_product<false>(rt, q.data_ptr<uint8_t>(), NP, K, y.data_ptr<float>(), bias);
  return y;
}
