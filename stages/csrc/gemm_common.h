// What the CPU GEMM's files share: how a product is cut up (x's rows into register tiles packed per
// call, K into slabs, the weight's panels into chunks that the threads take from a shared counter)
// and the blocked loop over them that fp32 panels (gemm.cpp) and block-quantized ones
// (gemm_quant.cpp) both run; the few-row quantized product (gemm_few_rows.cpp) and the bf16 one
// (gemm_bf16.cpp) take the row tiles and the chunks. All of it inline or templates in an anonymous
// namespace, as when the GEMM was one file: each file compiles its own copy into its own loops, and
// no loop calls into another file (no LTO here). At the end, the two entries that one file's
// product takes from another, one call a product.
#pragma once
#include "aten.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "gemm_tiles.h"

namespace {

constexpr int64_t KC = 256;   // deepest K slab: a panel's slab (<= 16 KB) stays in L1 over a row block
constexpr int64_t WHOLE_K_TILES = 2;  // up to this many row tiles: the 8-lane few-row paths (see quant_product)
// up to this many row tiles K is one slab (slab_depth), and with AVX-512 a quantized product runs
// from codes to registers, <= GROUP_ROWS rows per walk over the codes (few_row_product; at two
// tiles a walk 13-36 rows took 0.61-0.87 of the slab path's time, docs/BENCHMARKS.md)
#ifdef PP_AVX512
constexpr int64_t FEW_ROW_TILES = 6;
// few_row_product's rows at most: exactly the row counts slab_depth keeps K whole for (same bits),
// what FEW_ROW_TILES tiles of MR rows hold (tile_rows)
constexpr int64_t FEW_ROWS = FEW_ROW_TILES * MR;
constexpr int GROUP_ROWS = 24;  // rows at most in one walk over the codes (qrows_zmm: 24 accumulators)
#else
constexpr int64_t FEW_ROW_TILES = WHOLE_K_TILES;
#endif
constexpr int64_t CHUNKS_PER_THREAD = 8;  // panel chunks handed out per thread (see for_panel_chunks)
constexpr int64_t MAX_CHUNK = 16;  // panels per chunk at most: 16 x 36 KB of W stays in L2 over row blocks
constexpr int64_t MCQ = 288;  // rows per block over one dequantized slab (their x slab <= 288 KB: L2; 72 was no faster)

// Rows of the next tile when rem are left: 6, but never leave 1-3 for a last tile (a tile of
// r rows keeps 2r accumulators, too few chains to hide the FMA latency), so 7 -> 3 + 4, 8 -> 4 + 4,
// 9 -> 5 + 4.
inline int tile_rows(int64_t rem) {
  if (rem <= MR) return static_cast<int>(rem);
  if (rem < MR + 4) return static_cast<int>(rem - 4);
  return MR;
}

// x's rows in register tiles, packed k-major: tile t holds rows [r0[t], r0[t] + mt[t]), and its
// K x mt slice of x sits at ap + r0[t] * K, so the kernel's broadcasts walk one contiguous stream
// at fixed offsets (with x's own row stride every k costs address arithmetic next to 12 FMAs).
struct RowTiles {
  std::vector<int64_t> r0;
  std::vector<int> mt;
  at::Tensor buf;
  const float* ap = nullptr;
  int64_t size() const { return static_cast<int64_t>(r0.size()); }
};

inline RowTiles row_tiles(int64_t M) {
  RowTiles rt;
  for (int64_t i = 0; i < M;) { const int m = tile_rows(M - i); rt.r0.push_back(i); rt.mt.push_back(m); i += m; }
  return rt;
}

// dst (K, m) = the m rows at src (row stride lda), k-major: a register tile's (or a row group's) x
inline void pack_kmajor(const float* src, int64_t lda, int64_t m, int64_t K, float* dst) {
  for (int64_t k = 0; k < K; ++k)
    for (int64_t i = 0; i < m; ++i) dst[k * m + i] = src[i * lda + k];
}

inline RowTiles pack_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), lda = x.stride(0);
  RowTiles rt = row_tiles(M);
  rt.buf = at::empty({M * K}, x.options());
  float* ap = rt.buf.data_ptr<float>();
  const float* a = x.data_ptr<float>();
  at::parallel_for(0, rt.size(), 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) pack_kmajor(a + rt.r0[t] * lda, lda, rt.mt[t], K, ap + rt.r0[t] * K);
  });
  rt.ap = ap;
  return rt;
}

// K in slabs of about equal depth (576 -> 3 x 192, not 256 + 256 + 64): a tile reloads and
// stores its 12 accumulators once per slab, which a shallow last slab pays for in full. With a
// few row tiles (FEW_ROW_TILES: decode steps) a slab is read a few times and L1 residency buys
// little, while slabs turn W's stream into 12 KB runs with 24 KB gaps: K whole reads each chunk's
// panels as one sequential stream (isolated, 2 threads, 1-12 rows: 5-9% faster). Both weight
// formats use this rule, so a product sums in the same order whichever holds W.
inline int64_t slab_depth(int64_t K, int64_t tiles) {
  const int64_t nslab = tiles <= FEW_ROW_TILES ? 1 : (K + KC - 1) / KC;
  return ((K + nslab - 1) / nslab + 7) / 8 * 8;
}

// fn(j0, j1, scratch) over chunks of [0, NP) panels. Threads take chunks from a shared counter
// instead of equal halves: the box's two cores run ~7% apart and the pool's thread joins each call
// a little late, and with halves the faster one waited at the barrier (a 32-row decode step: ~4%
// faster in-model). Each thread gets its own scratch of `scratch` floats. Chunks are whole
// multiples of `align` panels (a one-row product's 4 panels at once: a chunk of 2, the size a
// 36-panel product got, ran its panels one at a time, ~1.5x slower each, waiting on FMA latency).
// Without OpenMP the pragma is ignored and one thread takes every chunk.
template <typename Fn>
void for_panel_chunks(int64_t NP, int64_t scratch, const Fn& fn, int64_t align = 1) {
  const int nt = at::in_parallel_region() ? 1 : at::get_num_threads();
  // uninitialized: every user writes its scratch before reading it (a zeroed vector cost a
  // memset of up to K x 16 floats per thread per call)
  auto scratch_of = [scratch] { return std::unique_ptr<float[]>(scratch ? new float[scratch] : nullptr); };
  if (nt <= 1) {
    fn(0, NP, scratch_of().get());
    return;
  }
  const int64_t C = (std::max<int64_t>(1, std::min<int64_t>(MAX_CHUNK, NP / (nt * CHUNKS_PER_THREAD))) + align - 1) /
                    align * align;
  const int64_t nchunks = (NP + C - 1) / C;
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(nt)
  {
    const auto s = scratch_of();
    for (int64_t c = next++; c < nchunks; c = next++) fn(c * C, std::min(NP, (c + 1) * C), s.get());
  }
}

// The product over panel chunks, row block by row block (tpb tiles each), K slab by K slab, panel
// by panel (two at a time with 16-lane FMAs): slab(j, j1, pc, kc, scratch) gives the kc x 16 slab
// of panel j that every tile of the block reads (in scratch if it makes one there), and the slab to
// prefetch meanwhile (nullptr: none; only a block's first tile asks). pf_stride: from one panel's
// slab to the next one's, for the pair tile's second prefetch.
template <typename SlabFn>
void blocked_product(const RowTiles& rt, int64_t NP, int64_t K, int64_t tpb, bool scratch, int64_t pf_stride,
                     float* c, const float* bias, const SlabFn& slab) {
  const int64_t N = NP * NR, T = rt.size(), kcb = slab_depth(K, T);
  for_panel_chunks(NP, scratch ? PANELS_AT_ONCE * kcb * NR : 0, [&](int64_t j0, int64_t j1, float* buf) {
    for (int64_t tb = 0; tb < T; tb += tpb) {
      const int64_t te = std::min(T, tb + tpb);
      for (int64_t pc = 0; pc < K; pc += kcb) {
        const int64_t kc = std::min(kcb, K - pc);
        const bool last = pc + kc == K;
        for (int64_t j = j0; j < j1;) {
          const auto [bj, next] = slab(j, j1, pc, kc, buf);
#ifdef PP_AVX512
          if (j + 1 < j1) {
            const auto [bj1, next1] = slab(j + 1, j1, pc, kc, buf + (scratch ? kcb * NR : 0));
            for (int64_t t = tb; t < te; ++t) {
              const int m = rt.mt[t];
              kPairs[next1 != nullptr && t == tb][m](rt.ap + rt.r0[t] * K + pc * m, bj, bj1, next1 ? next1 : bj1,
                                                     pf_stride, kc, c + rt.r0[t] * N + j * NR, N, pc > 0,
                                                     last && bias ? bias + j * NR : nullptr);
            }
            j += 2;
            continue;
          }
#endif
          for (int64_t t = tb; t < te; ++t) {
            const int m = rt.mt[t];
            kTiles[next != nullptr && t == tb][m](rt.ap + rt.r0[t] * K + pc * m, bj, next ? next : bj, kc,
                                                  c + rt.r0[t] * N + j * NR, N, pc > 0,
                                                  last && bias ? bias + j * NR : nullptr);
          }
          ++j;
        }
      }
    }
  });
}

// Whether a product of M x K rows takes the bf16 path: asked for, built, more than the few-row
// tiles (tile_rows cuts <= 12 rows into <= 2 tiles, 13 into 3), and K in whole pairs.
inline bool use_bf16(bool bf16, int64_t M, int64_t K) {
#ifdef PP_BF16
  return bf16 && K % 2 == 0 && M > WHOLE_K_TILES * MR;
#else
  return false;
#endif
}

}  // namespace

#ifdef PP_BF16
// c (M x N) = x (M x K) times the transpose of a weight held as fp32 panels (qb = 0) or as
// block-quantized ones of qb bytes a block, in bf16 products, each slab of W converted to bf16
// pairs once per row block (gemm_bf16.cpp; packed_linear and quant_linear call it where use_bf16)
void bf16_panel_product(const at::Tensor& x, const void* w, int64_t qb, int64_t NP, float* c, const float* bias);
#endif
#ifdef PP_AVX512
// c (M x N) = x (M <= FEW_ROWS rows) times block-quantized panels of qb bytes a block, from codes to
// registers (gemm_few_rows.cpp; quant_linear calls it)
void few_row_quant_product(const at::Tensor& x, const uint8_t* q, int64_t qb, int64_t NP, float* c,
                           const float* bias);
#endif
