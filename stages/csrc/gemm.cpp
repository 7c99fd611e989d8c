// fp32 linear layers on CPU over weights packed once at load (see stages/cpu_kernels.py).
//
//   pack_weight(w (N, K)) -> (N / 16, K, 16): panel p holds output columns 16p .. 16p + 15,
//                            one contiguous 16-wide row per k
//   packed_linear(x (M, K), packed, bias?) -> (M, N) = x wᵀ (+ bias)
//
// Why not torch.mm / MKL: every call packs W again (it is read once per micro-batch, so the pack
// is a second full pass over the weights), and its blocking for a few rows — a decode batch —
// is poor: on the 2-core box the model's four shapes ran at 45–85 GFLOP/s for 8–32 rows against
// ~120 at 256. Here W is packed once; threads take chunks of panels, so W streams from
// memory exactly once per call whatever M is, and the product is 6 x 16 register tiles of
// broadcast-FMA (12 accumulators) over a K slab of the panel kept in L1 for all the tiles of a
// block of rows. x is packed per call too (k-major 6-row tiles: cheap, it is M x K against the
// N x K weight). M needs no multiple of anything: 256 + a few decode rows costs its FLOPs, not
// another 256-row tile.
//
// The GEMM's other files: gemm_tiles.h (the register tiles), gemm_common.h (row tiles, K slabs,
// panel chunks, the blocked loop), gemm_quant.cpp, gemm_few_rows.cpp and gemm_dequant.h (GGUF
// block-quantized panels: quant_linear), gemm_bf16.cpp (bf16 products, matmul precision "medium").
#include "aten.h"

#include <string>
#include <utility>

#include "gemm_common.h"
#include "kernels.h"

namespace {

constexpr int64_t MC = 72;  // rows per block: their K slab (72 KB) stays in L2

}  // namespace

at::Tensor pack_weight(at::Tensor w) {
  TORCH_CHECK(w.dtype() == at::kFloat && w.dim() == 2, "pack_weight: (N, K) float32");
  TORCH_CHECK(w.size(0) % NR == 0, "pack_weight: N = ", w.size(0), " is not a multiple of ", NR);
  const int64_t N = w.size(0), K = w.size(1);
  // (N/16, 16, K) -> (N/16, K, 16): one copy through torch's strided kernel
  return w.contiguous().view({N / NR, NR, K}).transpose(1, 2).contiguous();
}

at::Tensor packed_linear(at::Tensor x, at::Tensor p, c10::optional<at::Tensor> bias_, bool bf16) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "packed_linear: x (M, K) float32 with contiguous rows");
  TORCH_CHECK(p.dtype() == at::kFloat && p.dim() == 3 && p.size(2) == NR && p.is_contiguous() &&
              p.size(1) == x.size(1), "packed_linear: weight (N/16, K, 16) from pack_weight with K = x.size(1)");
  const int64_t M = x.size(0), K = x.size(1), NP = p.size(0), N = NP * NR;
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* b = p.data_ptr<float>();
  float* c = y.data_ptr<float>();
  at::Tensor keep;
  const float* bias = bias_of(bias_, N, keep, "packed_linear");
#ifdef PP_BF16
  if (use_bf16(bf16, M, K)) {
    bf16_panel_product(x, b, 0, NP, c, bias);
    return y;
  }
#endif
  const RowTiles rt = pack_rows(x);
  // W's slice of a chunk comes from memory for the first block of MC rows (a 16-panel chunk's
  // 576 KB then stays in L2 for the others); each panel step prefetches the next one's slab.
  blocked_product(rt, NP, K, MC / MR, false, K * NR, c, bias, [&](int64_t j, int64_t j1, int64_t pc, int64_t, float*) {
    const float* bj = b + j * K * NR + pc * NR;
    return std::pair<const float*, const float*>(bj, j + 1 < j1 ? bj + K * NR : bj);
  });
  return y;
}

at::Tensor panel_linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias, bool bf16) {
  return w.scalar_type() == at::kByte ? quant_linear(x, w, bias, bf16) : packed_linear(x, w, bias, bf16);
}

std::string isa() {  // which instance of the kernels this build runs (vec.h picks it from the target)
#if defined(PP_AVX512)
  return bf16_products() ? "avx512+bf16" : "avx512";
#elif defined(PP_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}
