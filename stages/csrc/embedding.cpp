// Embedding lookups from weight panels: the rows of a tied LM head's table as the GEMM holds it.
//
//   rows = panel_rows(w, ids)   # w: (V/16, K/32, QB) uint8 GGUF panels (panels.h) or (V/16, K, 16)
//                               # fp32 panels (gemm.cpp: pack_weight); ids (T,) int64 -> (T, K) fp32
//
// Why: row v is column v % 16 of panel v / 16. torch's indexing (stages/quant.py: panel_rows, the
// reference) gathers each id's whole panel first, 16x the bytes, then dequantizes it in several
// passes: 1.85 ms for a 256-token chunk at 1 thread on SmolLM2's Q8_0 table (Zen 4), ~1% of the
// chunk's forward, more than its RoPE. Here each row is read once where it lies: per block, its d
// and m and one code a 16-byte line. Values as the gguf package dequantizes them, bit for bit:
// d·q is exact in fp32, the + m its one rounding (a fused multiply-add rounds it the same).
#include "aten.h"

#include "kernels.h"
#include "panels.h"

namespace {

// row c of panel blocks blk (KB blocks of QB bytes) -> out (KB · 32 floats)
template <bool U4>
void quant_row(const uint8_t* blk, int64_t KB, int64_t QB, int c, float* out) {
  for (int64_t b = 0; b < KB; ++b, blk += QB, out += QK) {
    const float d = block_d(blk, c), m = block_m(blk, c);
    const uint8_t* codes = blk + DM + c;  // this column's byte in each 16-byte line
    for (int k = 0; k < QK; ++k) {
      // u4: line k / 2 holds rows 2i (low nibble) and 2i + 1 (high); s8: one row a line, signed
      const int q = U4 ? (codes[(k >> 1) * NR] >> ((k & 1) * 4)) & 0x0F
                       : static_cast<int8_t>(codes[k * NR]);
      out[k] = static_cast<float>(q) * d + m;
    }
  }
}

}  // namespace

at::Tensor panel_rows(at::Tensor w, at::Tensor ids) {
  const bool quant = check_panels(w, "panel_rows");
  TORCH_CHECK(ids.dtype() == at::kLong && ids.dim() == 1, "panel_rows: ids (T,) int64");
  TORCH_CHECK(w.device().is_cpu() && ids.device().is_cpu(), "panel_rows: CPU tensors");
  ids = ids.contiguous();
  const int64_t T = ids.numel(), V = w.size(0) * NR, K = quant ? w.size(1) * QK : w.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(id[t] >= 0 && id[t] < V, "panel_rows: id ", id[t], " out of range [0, ", V, ")");
  auto out = at::empty({T, K}, at::kFloat);
  float* op = out.data_ptr<float>();
  const int64_t pstride = w.stride(0);  // elements (bytes for uint8) a panel
  at::parallel_for(0, T, 32, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t p = id[t] / NR;
      const int c = static_cast<int>(id[t] % NR);
      float* o = op + t * K;
      if (!quant) {  // (K, 16) floats a panel: column c, one float a row of 16
        const float* src = w.data_ptr<float>() + p * pstride + c;
        for (int64_t k = 0; k < K; ++k) o[k] = src[k * NR];
      } else if (w.size(2) == QB_U4) {
        quant_row<true>(w.data_ptr<uint8_t>() + p * pstride, w.size(1), QB_U4, c, o);
      } else {
        quant_row<false>(w.data_ptr<uint8_t>() + p * pstride, w.size(1), QB_S8, c, o);
      }
    }
  });
  return out;
}
