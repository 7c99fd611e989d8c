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
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "panels.h"
#include "vec.h"

#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif

namespace {

constexpr int MR = 6;         // rows per register tile
constexpr int64_t KC = 256;   // deepest K slab: a panel's slab (<= 16 KB) stays in L1 over a row block
constexpr int64_t MC = 72;    // rows per block: their K slab (72 KB) stays in L2
constexpr int64_t WHOLE_K_TILES = 2;  // up to this many row tiles: the 8-lane few-row paths (see packed_linear)
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
constexpr int64_t CHUNKS_PER_THREAD = 8;  // panel chunks handed out per thread (see packed_linear)
constexpr int64_t MAX_CHUNK = 16;  // panels per chunk at most: 16 x 36 KB of W stays in L2 over row blocks

// c[i][0..16) (+)= t[i] (+ bias) for the m rows of one tile
inline void store_tile(const float* t, int m, float* c, int64_t ldc, bool acc, const float* bias) {
  for (int i = 0; i < m; ++i) {
    float* ci = c + i * ldc;
    const float* ti = t + i * NR;
    for (int j = 0; j < NR; ++j) ci[j] = ti[j] + (acc ? ci[j] : 0.f) + (bias ? bias[j] : 0.f);
  }
}

#ifdef PP_AVX2
// Named accumulators, not an array: GCC keeps an array of __m256 in memory and stores it on
// every iteration (measured: 27 GFLOP/s against 65).
#define PP_ROW(i)                                                       \
  if constexpr (M > i) {                                                \
    const __m256 x = _mm256_broadcast_ss(a + k * M + i);                \
    c##i##0 = _mm256_fmadd_ps(x, b0, c##i##0);                          \
    c##i##1 = _mm256_fmadd_ps(x, b1, c##i##1);                          \
  }
#define PP_OUT(i)                                                       \
  if constexpr (M > i) {                                                \
    _mm256_store_ps(t[i], c##i##0);                                     \
    _mm256_store_ps(t[i] + 8, c##i##1);                                 \
  }
// The 6 x 16 register tile as three steps both tiles below share: its 12 accumulators; one k
// step (two 8-wide loads of the weight row at bk, then PP_ROWS: a broadcast of each x row from a
// and its FMAs into b0, b1); and its write-out to c (acc: add to what is there).
#define PP_ACCS                                                                                    \
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, \
         c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#define PP_ROWS PP_ROW(0) PP_ROW(1) PP_ROW(2) PP_ROW(3) PP_ROW(4) PP_ROW(5)
#define PP_STEP(bk)                                                                                \
  {                                                                                                \
    const __m256 b0 = _mm256_loadu_ps(bk), b1 = _mm256_loadu_ps((bk) + 8);                        \
    PP_ROWS                                                                                        \
  }
#define PP_WRITE(acc)                                                                              \
  {                                                                                                \
    alignas(32) float t[MR][NR];                                                                   \
    PP_OUT(0) PP_OUT(1) PP_OUT(2) PP_OUT(3) PP_OUT(4) PP_OUT(5)                                    \
    write_tile(t, M, c, ldc, acc, bias);                                                           \
  }

// c (m x 16) (+)= t (+ bias): a tile's accumulators, stored to its rows of the output
inline void write_tile(const float (*t)[NR], int m, float* c, int64_t ldc, bool acc, const float* bias) {
  if (bias) {
    store_tile(&t[0][0], m, c, ldc, acc, bias);
    return;
  }
  for (int i = 0; i < m; ++i) {
    float* ci = c + i * ldc;
    __m256 v0 = _mm256_load_ps(t[i]), v1 = _mm256_load_ps(t[i] + 8);
    if (acc) {
      v0 = _mm256_add_ps(v0, _mm256_loadu_ps(ci));
      v1 = _mm256_add_ps(v1, _mm256_loadu_ps(ci + 8));
    }
    _mm256_storeu_ps(ci, v0);
    _mm256_storeu_ps(ci + 8, v1);
  }
}

// c (M x 16, row stride ldc) (+)= a (kc x M, packed k-major) · b (kc x 16 panel slab). PF: prefetch
// the next slab (pf) into L2 — only the first tile of a row block does, the others would ask for
// the same lines again (a prefetch per 12 FMAs in every tile cost 20-30% in a hot-cache loop).
template <int M, bool PF>
void tile(const float* a, const float* b, const float* pf, int64_t kc, float* c, int64_t ldc,
          bool acc, const float* bias) {
  PP_ACCS
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    // the next slab into L2 while this one is in use: for a few rows the panels stream from
    // memory, and a prefetch a few lines ahead hides too little of its latency
    if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(pf + k * NR), PF_HINT);
    PP_STEP(b + k * NR)
  }
  PP_WRITE(acc)
}
// The PP_ macros stay defined for qtile (the block-quantized few-row tile) below.
#else
template <int M, bool PF>
void tile(const float* a, const float* b, const float*, int64_t kc, float* c, int64_t ldc,
          bool acc, const float* bias) {
  float t[MR][NR] = {};
  for (int64_t k = 0; k < kc; ++k)
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < NR; ++j) t[i][j] += a[k * M + i] * b[k * NR + j];
  store_tile(&t[0][0], M, c, ldc, acc, bias);
}
#endif

// Rows of the next tile when rem are left: 6, but never leave 1-3 for a last tile (a tile of
// r rows keeps 2r accumulators, too few chains to hide the FMA latency), so 7 -> 3 + 4, 8 -> 4 + 4,
// 9 -> 5 + 4.
inline int tile_rows(int64_t rem) {
  if (rem <= MR) return static_cast<int>(rem);
  if (rem < MR + 4) return static_cast<int>(rem - 4);
  return MR;
}

using TileFn = void (*)(const float*, const float*, const float*, int64_t, float*, int64_t, bool, const float*);
constexpr TileFn kTiles[2][MR + 1] = {{nullptr, tile<1, false>, tile<2, false>, tile<3, false>, tile<4, false>, tile<5, false>, tile<6, false>},
  {nullptr, tile<1, true>, tile<2, true>, tile<3, true>, tile<4, true>, tile<5, true>, tile<6, true>}};

#ifdef PP_AVX512
// Two adjacent panels at once in 16-lane registers: a 6 x 32 tile, 12 accumulators again (one
// per row and panel). An 8-lane tile cannot use the second half of a 512-bit FMA unit; the 16-lane
// one doubles the FLOPs per instruction (measured on a Zen 5 core: 127 against 255 GFLOP/s of
// plain FMAs). Every output element still sums its k terms one FMA at a time in k order, so a
// product is bit-identical to the 8-lane tile's. b0, b1: the two panels' slabs; pf, pf_stride: the
// next pair's first slab and the step to its second (prefetches never fault, so a pair past the
// end may be asked for).
#define PZ_ROW(i)                                                       \
  if constexpr (M > i) {                                                \
    const __m512 x = _mm512_set1_ps(a[k * M + i]);                      \
    c##i##0 = _mm512_fmadd_ps(x, w0, c##i##0);                          \
    c##i##1 = _mm512_fmadd_ps(x, w1, c##i##1);                          \
  }
#define PZ_OUT(i)                                                       \
  if constexpr (M > i) {                                                \
    _mm512_store_ps(t[i], c##i##0);                                     \
    _mm512_store_ps(t[i] + NR, c##i##1);                                \
  }
template <int M, bool PF>
void tile_pair(const float* a, const float* b0, const float* b1, const float* pf, int64_t pf_stride, int64_t kc,
               float* c, int64_t ldc, bool acc, const float* bias) {
  __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    if constexpr (PF) {
      _mm_prefetch(reinterpret_cast<const char*>(pf + k * NR), PF_HINT);
      _mm_prefetch(reinterpret_cast<const char*>(pf + pf_stride + k * NR), PF_HINT);
    }
    const __m512 w0 = _mm512_loadu_ps(b0 + k * NR), w1 = _mm512_loadu_ps(b1 + k * NR);
    PZ_ROW(0) PZ_ROW(1) PZ_ROW(2) PZ_ROW(3) PZ_ROW(4) PZ_ROW(5)
  }
  alignas(64) float t[MR][2 * NR];
  PZ_OUT(0) PZ_OUT(1) PZ_OUT(2) PZ_OUT(3) PZ_OUT(4) PZ_OUT(5)
  for (int i = 0; i < M; ++i) {
    float* ci = c + i * ldc;
    for (int h = 0; h < 2 * NR; h += NR) {
      __m512 v = _mm512_load_ps(t[i] + h);
      if (acc) v = _mm512_add_ps(v, _mm512_loadu_ps(ci + h));
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + h));
      _mm512_storeu_ps(ci + h, v);
    }
  }
}
#undef PZ_ROW
#undef PZ_OUT

using PairFn = void (*)(const float*, const float*, const float*, const float*, int64_t, int64_t, float*, int64_t,
                        bool, const float*);
constexpr PairFn kPairs[2][MR + 1] = {
  {nullptr, tile_pair<1, false>, tile_pair<2, false>, tile_pair<3, false>, tile_pair<4, false>, tile_pair<5, false>, tile_pair<6, false>},
  {nullptr, tile_pair<1, true>, tile_pair<2, true>, tile_pair<3, true>, tile_pair<4, true>, tile_pair<5, true>, tile_pair<6, true>}};
constexpr int64_t PANELS_AT_ONCE = 2;
#else
constexpr int64_t PANELS_AT_ONCE = 1;
#endif

}  // namespace

torch::Tensor pack_weight(torch::Tensor w) {
  TORCH_CHECK(w.dtype() == torch::kFloat32 && w.dim() == 2, "pack_weight: (N, K) float32");
  TORCH_CHECK(w.size(0) % NR == 0, "pack_weight: N = ", w.size(0), " is not a multiple of ", NR);
  const int64_t N = w.size(0), K = w.size(1);
  // (N/16, 16, K) -> (N/16, K, 16): one copy through torch's strided kernel
  return w.contiguous().view({N / NR, NR, K}).transpose(1, 2).contiguous();
}

namespace {

// x's rows in register tiles, packed k-major: tile t holds rows [r0[t], r0[t] + mt[t]), and its
// K x mt slice of x sits at ap + r0[t] * K, so the kernel's broadcasts walk one contiguous stream
// at fixed offsets (with x's own row stride every k costs address arithmetic next to 12 FMAs).
struct RowTiles {
  std::vector<int64_t> r0;
  std::vector<int> mt;
  torch::Tensor buf;
  const float* ap = nullptr;
  int64_t size() const { return static_cast<int64_t>(r0.size()); }
};

RowTiles row_tiles(int64_t M) {
  RowTiles rt;
  for (int64_t i = 0; i < M;) { const int m = tile_rows(M - i); rt.r0.push_back(i); rt.mt.push_back(m); i += m; }
  return rt;
}

// dst (K, m) = the m rows at src (row stride lda), k-major: a register tile's (or a row group's) x
inline void pack_kmajor(const float* src, int64_t lda, int64_t m, int64_t K, float* dst) {
  for (int64_t k = 0; k < K; ++k)
    for (int64_t i = 0; i < m; ++i) dst[k * m + i] = src[i * lda + k];
}

RowTiles pack_rows(const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), lda = x.stride(0);
  RowTiles rt = row_tiles(M);
  rt.buf = torch::empty({M * K}, x.options());
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
int64_t slab_depth(int64_t K, int64_t tiles) {
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

// ---- block-quantized panels (GGUF Q4_0 / Q4_1 / Q8_0 weights kept as stored) ----------------
// A panel's K is cut into blocks of QK = 32; block b of panel p is QB bytes: scale d[16] and
// offset m[16] (fp32, one per output column), then the 32 x 16 codes: u4 — rows 2i and 2i + 1 in
// 16 bytes, byte j holding column j of row 2i (low nibble) and of row 2i + 1 (high), so one byte
// load widened to 16 lanes gives two rows' columns in order — or s8, row k in 16 bytes. The weight
// is w = d·q + m, computed as one FMA: d·q is exact in fp32 (an fp16 scale times a 4- or 8-bit
// code), so it rounds once, as the gguf package's (d * q) + m does: the same fp32 weights.

#ifdef PP_AVX2
// row r of one u4 block -> its 16 codes, one byte per column in order
inline __m128i u4_row(const uint8_t* codes, int64_t r) {
  const __m128i pair = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + r / 2 * 16));
  return _mm_and_si128(_mm_srl_epi16(pair, _mm_cvtsi32_si128(4 * static_cast<int>(r & 1))), _mm_set1_epi8(0x0F));
}

// row r of one block -> its 16 fp32 weights in w0 (columns 0-7), w1 (8-15); d, m: the block's
// scales, loaded by the caller
template <bool U4>
inline void dequant_regs(const uint8_t* codes, int64_t r, __m256 d0, __m256 d1, __m256 m0, __m256 m1, __m256& w0,
                         __m256& w1) {
  __m256 f0, f1;
  if constexpr (U4) {
    const __m128i q = u4_row(codes, r);
    f0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
    f1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)));
  } else {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + r * 16));
    f0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    f1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
  }
  w0 = _mm256_fmadd_ps(f0, d0, m0);
  w1 = _mm256_fmadd_ps(f1, d1, m1);
}

// the same, stored to o[0..16)
template <bool U4>
inline void dequant_row(const uint8_t* codes, int64_t r, __m256 d0, __m256 d1, __m256 m0, __m256 m1, float* o) {
  __m256 w0, w1;
  dequant_regs<U4>(codes, r, d0, d1, m0, m1, w0, w1);
  _mm256_storeu_ps(o, w0);
  _mm256_storeu_ps(o + 8, w1);
}

#ifdef PP_AVX512
// row r of one block -> its 16 fp32 weights in one 16-lane register (the same FMA per weight as
// dequant_regs)
template <bool U4>
inline __m512 dequant_zmm(const uint8_t* codes, int64_t r, __m512 d, __m512 m) {
  if constexpr (U4) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(u4_row(codes, r))), d, m);
  } else {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + r * 16));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d, m);
  }
}
#endif
#endif

// fn(block, r0, r1, at) for panel rows [k0, k0 + kc), block by block: rows [r0, r1) of the block
// whose QB bytes start at block, row r of it being slab row at + r (a slab need not start or end on
// a block: K = 288 cuts into 2 x 144)
template <bool U4, typename Fn>
void for_blocks(const uint8_t* panel, int64_t k0, int64_t kc, const Fn& fn) {
  constexpr int64_t QB = U4 ? QB_U4 : QB_S8;
  for (int64_t k = k0, ke = k0 + kc; k < ke;) {
    const int64_t r0 = k % QK, r1 = std::min<int64_t>(QK, r0 + ke - k);
    fn(panel + (k / QK) * QB, r0, r1, k - k0 - r0);
    k += r1 - r0;
  }
}

// buf (kc x 16) = panel rows [k0, k0 + kc) as fp32
template <bool U4>
void dequant(const uint8_t* panel, int64_t k0, int64_t kc, float* buf) {
  for_blocks<U4>(panel, k0, kc, [buf](const uint8_t* blk, int64_t r0, int64_t r1, int64_t at) {
    float* o = buf + at * NR;
#if defined(PP_AVX512)
    const __m512 d = block_d16(blk), m = block_m16(blk);
    for (int64_t r = r0; r < r1; ++r) _mm512_storeu_ps(o + r * NR, dequant_zmm<U4>(blk + DM, r, d, m));
#elif defined(PP_AVX2)
    const __m256 d0 = block_d8(blk, 0), d1 = block_d8(blk, 1), m0 = block_m8(blk, 0), m1 = block_m8(blk, 1);
    for (int64_t r = r0; r < r1; ++r) dequant_row<U4>(blk + DM, r, d0, d1, m0, m1, o + r * NR);
#else
    for (int64_t r = r0; r < r1; ++r)
      for (int j = 0; j < NR; ++j) {
        float q;
        if constexpr (U4) {
          const uint8_t byte = blk[DM + r / 2 * 16 + j];
          q = static_cast<float>(r % 2 ? byte >> 4 : byte & 0x0F);
        } else {
          q = static_cast<float>(static_cast<int8_t>(blk[DM + r * 16 + j]));
        }
        o[r * NR + j] = std::fma(q, block_d(blk, j), block_m(blk, j));
      }
#endif
  });
}

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
  PP_WRITE(false)
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
#undef PP_STEP
#undef PP_WRITE
#endif

#ifdef PP_AVX512

// qrows_zmm asks for the codes PF_BLOCKS blocks ahead of its walk; panels_at_once: how many panels
// one walk of that many rows takes (enough FMA chains in flight at 1-8 rows). The prefetch took 30
// layers' four shapes + a Q8_0 LM head, from memory, 1 thread, M = 1 from 7.9 to 4.2 ms
// (docs/BENCHMARKS.md).
constexpr int64_t PF_BLOCKS = 6;

constexpr int panels_at_once(int rows) { return rows <= 4 ? 4 : (rows <= 8 ? 2 : 1); }

// rows 2i and 2i + 1 of one u4 block -> their 16 codes each as fp32 (lo, hi): the pair's 16 bytes
// widened to 16 lanes once; vpermps from {0, 1, ..., 15} reads only the low 4 bits of each lane,
// so it masks and converts row 2i in one instruction, and row 2i + 1 after a shift by 4. Two rows
// in four instructions: the row-at-a-time layout took four per row (broadcast, widen, shift,
// permute), and at 1-4 rows those, not the FMAs, bound the product on a core with one 512-bit
// FMA per cycle (Zen 4: decode steps of 1 / 4 rows 0.90 / 0.94 of the time, docs/BENCHMARKS.md)
inline void codes_u4_pair(const uint8_t* codes, int64_t i, __m512 levels, __m512& lo, __m512& hi) {
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i * 16)));
  lo = _mm512_permutexvar_ps(q, levels);
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), levels);
}

// rows 2i and 2i + 1 of one block -> their 16 fp32 weights each (the same FMA per weight as
// dequant_zmm); levels: {0, 1, ..., 15}, for codes_u4_pair
template <bool U4>
inline void dequant_pair_zmm(const uint8_t* codes, int64_t i, __m512 d, __m512 m, __m512 levels, __m512& w0,
                             __m512& w1) {
  if constexpr (U4) {
    __m512 lo, hi;
    codes_u4_pair(codes, i, levels, lo, hi);
    w0 = _mm512_fmadd_ps(lo, d, m);
    w1 = _mm512_fmadd_ps(hi, d, m);
  } else {
    w0 = dequant_zmm<false>(codes, 2 * i, d, m);
    w1 = dequant_zmm<false>(codes, 2 * i + 1, d, m);
  }
}

inline __m512 u4_levels() { return _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0); }

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
int pack_groups(const torch::Tensor& x, float* out, int* sizes) {
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
void few_row_product(const torch::Tensor& x, const uint8_t* q, int64_t NP, float* c, const float* bias) {
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
#endif

using QTileFn = void (*)(const float*, const uint8_t*, int64_t, float*, float*, int64_t, const float*);
template <bool U4, bool SECOND>
constexpr QTileFn kQTiles[MR + 1] = {nullptr, qtile<1, U4, SECOND>, qtile<2, U4, SECOND>, qtile<3, U4, SECOND>,
                                     qtile<4, U4, SECOND>, qtile<5, U4, SECOND>, qtile<6, U4, SECOND>};

constexpr int64_t MCQ = 288;  // rows per block over one dequantized slab (their x slab <= 288 KB: L2; 72 was no faster)

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


// ---- bf16 dot products for fp32 products of many rows (matmul precision "medium") -----------
// torch.set_float32_matmul_precision("medium") lets an fp32 matmul run on bf16 inputs with fp32
// sums; this is that, on cores with AVX512-BF16: x and W rounded to bf16 (nearest even) as they
// are packed, each vdpbf16ps adding two k terms to 16 fp32 sums. A Zen 5 core runs it at ~4x its
// fp32 FMA rate (torch's bf16 matmul: 528 against 118 GFLOP/s, 256 x 576 x 1536, 1 thread), so a
// prefill chunk's products shrink while a few-row product, bound by streaming and dequantizing W,
// would not: products of <= 2 row tiles (<= 12 rows) keep the fp32 path; any larger one, a
// decode-only batch of 13+ sequences too, takes this one (packed_linear and quant_linear choose).
#ifdef PP_BF16
// deepest K slab of the bf16 path: a pair of panels' 576-deep slab is 36 KB of bf16 pairs and
// stays in L1; 576 against 192 (the fp32 rule) ran 2-10% faster at 32-256 rows
constexpr int64_t BF_KC = 576;

// x's rows in the same register tiles as pack_rows, as bf16 pairs: tile t's word p * m + i holds
// x[r0 + i][2p] (low half) and x[r0 + i][2p + 1]; a tile starts at word r0[t] * K / 2.
RowTiles pack_rows_bf16(const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), lda = x.stride(0), KP = K / 2;
  RowTiles rt = row_tiles(M);
  rt.buf = torch::empty({M * KP}, x.options());  // M x K/2 words of 4 bytes
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
void bf16_product(const torch::Tensor& x, int64_t NP, float* c, const float* bias, const SlabFn& slab) {
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
#endif

// Whether a product of M x K rows takes the bf16 path: asked for, built, more than the few-row
// tiles (tile_rows cuts <= 12 rows into <= 2 tiles, 13 into 3), and K in whole pairs.
bool use_bf16(bool bf16, int64_t M, int64_t K) {
#ifdef PP_BF16
  return bf16 && K % 2 == 0 && M > WHOLE_K_TILES * MR;
#else
  return false;
#endif
}

}  // namespace

torch::Tensor packed_linear(torch::Tensor x, torch::Tensor p, c10::optional<torch::Tensor> bias_, bool bf16) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              "packed_linear: x (M, K) float32 with contiguous rows");
  TORCH_CHECK(p.dtype() == torch::kFloat32 && p.dim() == 3 && p.size(2) == NR && p.is_contiguous() &&
              p.size(1) == x.size(1), "packed_linear: weight (N/16, K, 16) from pack_weight with K = x.size(1)");
  const int64_t M = x.size(0), K = x.size(1), NP = p.size(0), N = NP * NR;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* b = p.data_ptr<float>();
  float* c = y.data_ptr<float>();
  torch::Tensor keep;
  const float* bias = bias_of(bias_, N, keep, "packed_linear");
#ifdef PP_BF16
  if (use_bf16(bf16, M, K)) {
    bf16_product(x, NP, c, bias,
                 [&](int64_t j, int64_t pc, int64_t kc, uint32_t* o) {
                   panel_pairs(b, 0, K, j, pc, kc, o);
                   return static_cast<const uint32_t*>(o);
                 });
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

torch::Tensor quant_linear(torch::Tensor x, torch::Tensor q, c10::optional<torch::Tensor> bias_, bool bf16) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              "quant_linear: x (M, K) float32 with contiguous rows");
  TORCH_CHECK(q.dtype() == torch::kUInt8 && q.dim() == 3 && q.is_contiguous() && q.size(1) * QK == x.size(1) &&
              (q.size(2) == QB_U4 || q.size(2) == QB_S8),
              "quant_linear: weight (N/16, K/32, ", QB_U4, " or ", QB_S8, ") uint8 panels with K = x.size(1)");
  const int64_t M = x.size(0), K = x.size(1), NP = q.size(0), N = NP * NR;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  torch::Tensor keep;
  const float* bias = bias_of(bias_, N, keep, "quant_linear");
#ifdef PP_BF16
  if (use_bf16(bf16, M, K)) {
    const uint8_t* qp = q.data_ptr<uint8_t>();
    const int64_t qb = q.size(2);
    bf16_product(x, NP, y.data_ptr<float>(), bias, [&](int64_t j, int64_t pc, int64_t kc, uint32_t* o) {
      panel_pairs(qp, qb, K, j, pc, kc, o);
      return static_cast<const uint32_t*>(o);
    });
    return y;
  }
#endif
#ifdef PP_AVX512
  if (M <= FEW_ROWS) {
    if (q.size(2) == QB_U4)
      few_row_product<true>(x, q.data_ptr<uint8_t>(), NP, y.data_ptr<float>(), bias);
    else
      few_row_product<false>(x, q.data_ptr<uint8_t>(), NP, y.data_ptr<float>(), bias);
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

// A weight in either panel format -> (N/16, K/2, 16) int32 words of bf16 pairs, word (p, k, j) holding
// bf16 w[16p + j][2k] (low half) and w[16p + j][2k + 1]: each slab of it is the words panel_linear's
// bf16 path converts that slab to on every call (the same rounding), kept. 2 bytes a weight.
torch::Tensor pack_weight_bf16(torch::Tensor w) {
  const bool quant = check_panels(w, "pack_weight_bf16");
  const int64_t NP = w.size(0), K = quant ? w.size(1) * QK : w.size(1);
  TORCH_CHECK(K % 2 == 0, "pack_weight_bf16: K = ", K, " is odd");
  auto out = torch::empty({NP, K / 2, NR}, w.options().dtype(torch::kInt32));
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
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor wb) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              "bf16_linear: x (M, K) float32 with contiguous rows");
  TORCH_CHECK(wb.dtype() == torch::kInt32 && wb.dim() == 3 && wb.size(2) == NR && wb.is_contiguous() &&
              wb.size(1) * 2 == x.size(1), "bf16_linear: weight (N/16, K/2, 16) from pack_weight_bf16 with K = x.size(1)");
  const int64_t M = x.size(0), K = x.size(1), NP = wb.size(0);
  auto y = torch::empty({M, NP * NR}, x.options());
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

torch::Tensor panel_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, bool bf16) {
  return w.scalar_type() == torch::kUInt8 ? quant_linear(x, w, bias, bf16) : packed_linear(x, w, bias, bf16);
}

bool bf16_products() {
#ifdef PP_BF16
  return true;
#else
  return false;
#endif
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
