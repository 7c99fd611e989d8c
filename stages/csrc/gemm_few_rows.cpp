// The quantized product of a few rows (<= FEW_ROWS: decode steps) on AVX-512 builds: each weight
// row goes from codes to a 16-lane register and straight into the FMAs of up to 24 rows of x at
// once, P adjacent panels a walk, the codes a few blocks ahead prefetched. Each output still sums
// its k terms in k order, one FMA at a time: the same bits as every other path (quant_linear,
// gemm_quant.cpp, takes it; the 8-lane build runs qtile there instead).
#include "aten.h"

#include <algorithm>
#include <array>
#include <memory>
#include <utility>

#include "gemm_common.h"
#include "gemm_dequant.h"

#ifdef PP_AVX512
namespace {

// qrows_zmm asks for the codes PF_BLOCKS blocks ahead of its walk; panels_at_once: how many panels
// one walk of that many rows takes (enough FMA chains in flight at 1-8 rows). The prefetch took 30
// layers' four shapes + a Q8_0 LM head, from memory, 1 thread, M = 1 from 7.9 to 4.2 ms
// (docs/BENCHMARKS.md).
constexpr int64_t PF_BLOCKS = 6;

constexpr int panels_at_once(int rows) { return rows <= 4 ? 4 : (rows <= 8 ? 2 : 1); }

// R rows of x, packed k-major as one (K, R) block (pack_groups), against P adjacent quantized
// panels over the whole K, into rows c, c + ldc, ...: each weight row from codes to a 16-lane register and
// straight into the FMAs of every row. Each output sums its k terms in one chain of dependent FMAs,
// k after k, as every other path does (bit-identical), so a panel at a time with 1-4 rows waited
// on the FMA's latency, ~4 cycles per k step: ~14 GB/s of codes. P panels keep P · R chains in
// flight (up to 24 accumulators at P = 1, beside the block's scale and offset, the levels and two
// weight rows: 29 of the 32 registers). The codes stream, a panel after the next, and the blocks
// PF_BLOCKS ahead are asked for in the same walk, across into the next P panels: the hardware
// prefetcher alone left 1-4-row products at 17-20 GB/s of codes. One base pointer for all R rows,
// x's offsets constants: when the rows sat in up to four register tiles (a pointer each and one
// shared index), GCC gave every FMA an indexed memory operand, which Intel cores split into two
// uops (un-lamination); on the Xeon box a 16-row walk ran 1.19x faster this way (docs/BENCHMARKS.md).
template <int P, bool U4, int R>
void qrows_zmm(const float* x, const uint8_t* panel, int64_t pbytes, int64_t K, float* c, int64_t ldc,
               const float* bias) {
  constexpr int64_t QB = U4 ? QB_U4 : QB_S8;
  const int64_t nb = K / QK;
  const __m512 levels = u4_levels();
  __m512 acc[P][R];
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 24
    for (int i = 0; i < R; ++i) acc[p][i] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < nb; ++kb) {
    __m512 d[P], m[P];
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
      const uint8_t* blk = panel + p * pbytes + kb * QB;
      d[p] = block_d16(blk);
      m[p] = block_m16(blk);
      // a prefetch never faults: past the last panel it asks for lines nobody reads, no harm
      prefetch_bytes(kb + PF_BLOCKS < nb ? blk + PF_BLOCKS * QB : panel + (P + p) * pbytes + (kb + PF_BLOCKS - nb) * QB, QB);
    }
    const float* xb = x + kb * QK * R;  // (QK, R): this block's k of every row
    // w's row k into every row's sum, k after k as everywhere else
    auto step = [&](int p, int64_t k, __m512 w) {
#pragma GCC unroll 24
      for (int i = 0; i < R; ++i) acc[p][i] = _mm512_fmadd_ps(_mm512_set1_ps(xb[k * R + i]), w, acc[p][i]);
    };
#pragma GCC unroll 2
    for (int64_t k = 0; k < QK; k += 2) {
#pragma GCC unroll 16
      for (int p = 0; p < P; ++p) {
        __m512 w0, w1;
        dequant_pair_zmm<U4>(panel + p * pbytes + kb * QB + DM, k / 2, d[p], m[p], levels, w0, w1);
        step(p, k, w0);
        step(p, k + 1, w1);
      }
    }
  }
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p) {
    const __m512 bv = bias ? _mm512_loadu_ps(bias + p * NR) : _mm512_setzero_ps();
#pragma GCC unroll 24
    for (int i = 0; i < R; ++i) _mm512_storeu_ps(c + i * ldc + p * NR, _mm512_add_ps(acc[p][i], bv));
  }
}

using QZFn = void (*)(const float*, const uint8_t*, int64_t, int64_t, float*, int64_t, const float*);
struct QZ {
  QZFn wide;  // P panels at once
  int P;
  QZFn one;   // one panel: what is left of a thread's panels past a multiple of P
};
template <bool U4, int R>
constexpr QZ qz_entry() {
  constexpr int P = panels_at_once(R);
  return {qrows_zmm<P, U4, R>, P, qrows_zmm<1, U4, R>};
}
template <bool U4, int... Rm1>
constexpr std::array<QZ, sizeof...(Rm1)> qz_table(std::integer_sequence<int, Rm1...>) {
  return {qz_entry<U4, Rm1 + 1>()...};
}
// by the rows of a group, 1..GROUP_ROWS
template <bool U4>
constexpr auto kQZ = qz_table<U4>(std::make_integer_sequence<int, GROUP_ROWS>{});

// x's M rows (any row stride) in groups of R_g rows, each group k-major as one (K, R_g) block at
// out + r0 * K (r0 its first row); sizes[g] gets R_g. As few groups of up to GROUP_ROWS rows as hold
// M, as even as can be (32 rows: 16 + 16).
int pack_groups(const at::Tensor& x, float* out, int* sizes) {
  const int64_t M = x.size(0), K = x.size(1), lda = x.stride(0);
  const float* a = x.data_ptr<float>();
  int ng = 0;
  for (int64_t r0 = 0, left = (M + GROUP_ROWS - 1) / GROUP_ROWS; r0 < M; --left) {
    const int64_t R = (M - r0 + left - 1) / left;
    pack_kmajor(a + r0 * lda, lda, R, K, out + r0 * K);
    sizes[ng++] = static_cast<int>(R);
    r0 += R;
  }
  return ng;
}

// The product of a few rows (<= FEW_ROWS) over quantized panels: every weight row dequantized
// once per group of up to GROUP_ROWS rows, from codes to registers (qrows_zmm). With groups of a
// dozen rows, 13-36 rows walked the codes and paid the two dequantizing FMAs per k pair up to three
// times (docs/BENCHMARKS.md). Every group runs over the same 4 panels before the next 4, whose codes
// (28-74 KB) are then still in L1/L2 for the groups after the first.
template <bool U4>
void few_row_product(const at::Tensor& x, const uint8_t* q, int64_t NP, float* c, const float* bias) {
  constexpr int64_t QB = U4 ? QB_U4 : QB_S8;
  const int64_t M = x.size(0), K = x.size(1), N = NP * NR, pbytes = K / QK * QB;
  std::unique_ptr<float[]> xg(new float[M * K]);
  std::array<int, (FEW_ROWS + GROUP_ROWS - 1) / GROUP_ROWS> sizes{};
  const int ng = pack_groups(x, xg.get(), sizes.data());
  // one row: chunks of whole P = 4 walks (x0.946 of a 1-row decode step at 2 threads, Zen 4);
  // at 2-4 rows the one-panel walk has enough chains and smaller chunks balance better (0.98-1.02)
  const int align = M == 1 ? kQZ<U4>[0].P : 1;
  for_panel_chunks(NP, 0, [&](int64_t j0, int64_t j1, float*) {
    for (int64_t j = j0; j < j1; j += 4) {  // 4: a multiple of every group's P
      const int64_t je = std::min(j + 4, j1);
      for (int g = 0, r0 = 0; g < ng; r0 += sizes[g++]) {
        const QZ& qz = kQZ<U4>[sizes[g] - 1];
        for (int64_t i = j; i < je;) {
          const int64_t n = i + qz.P <= je ? qz.P : 1;
          (n > 1 ? qz.wide : qz.one)(xg.get() + r0 * K, q + i * pbytes, pbytes, K, c + r0 * N + i * NR, N,
                                     bias ? bias + i * NR : nullptr);
          i += n;
        }
      }
    }
  }, align);
}

}  // namespace

void few_row_quant_product(const at::Tensor& x, const uint8_t* q, int64_t qb, int64_t NP, float* c,
                           const float* bias) {
  if (qb == QB_U4)
    few_row_product<true>(x, q, NP, c, bias);
  else
    few_row_product<false>(x, q, NP, c, bias);
}
#endif
