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
#include <atomic>
#include <vector>

#include "vec.h"

#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif

namespace {

constexpr int MR = 6;         // rows per register tile
constexpr int NR = 16;        // output columns per panel (two 8-lane vectors)
constexpr int64_t KC = 256;   // deepest K slab: a panel's slab (<= 16 KB) stays in L1 over a row block
constexpr int64_t MC = 72;    // rows per block: their K slab (72 KB) stays in L2
constexpr int64_t WHOLE_K_TILES = 2;  // up to this many row tiles: K in one slab (see packed_linear)
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

// c (M x 16, row stride ldc) (+)= a (kc x M, packed k-major) · b (kc x 16 panel slab). PF: prefetch
// the next slab (pf) into L2 — only the first tile of a row block does, the others would ask for
// the same lines again (a prefetch per 12 FMAs in every tile cost 20-30% in a hot-cache loop).
template <int M, bool PF>
void tile(const float* a, const float* b, const float* pf, int64_t kc, float* c, int64_t ldc,
          bool acc, const float* bias) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,
         c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    // the next slab into L2 while this one is in use: for a few rows the panels stream from
    // memory, and a prefetch a few lines ahead hides too little of its latency
    if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(pf + k * NR), PF_HINT);
    const __m256 b0 = _mm256_loadu_ps(b + k * NR), b1 = _mm256_loadu_ps(b + k * NR + 8);
    PP_ROW(0) PP_ROW(1) PP_ROW(2) PP_ROW(3) PP_ROW(4) PP_ROW(5)
  }
  alignas(32) float t[MR][NR];
  PP_OUT(0) PP_OUT(1) PP_OUT(2) PP_OUT(3) PP_OUT(4) PP_OUT(5)
  if (!bias) {
    for (int i = 0; i < M; ++i) {
      float* ci = c + i * ldc;
      __m256 v0 = _mm256_load_ps(t[i]), v1 = _mm256_load_ps(t[i] + 8);
      if (acc) {
        v0 = _mm256_add_ps(v0, _mm256_loadu_ps(ci));
        v1 = _mm256_add_ps(v1, _mm256_loadu_ps(ci + 8));
      }
      _mm256_storeu_ps(ci, v0);
      _mm256_storeu_ps(ci + 8, v1);
    }
  } else {
    store_tile(&t[0][0], M, c, ldc, acc, bias);
  }
}
#undef PP_ROW
#undef PP_OUT
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

}  // namespace

torch::Tensor pack_weight(torch::Tensor w) {
  TORCH_CHECK(w.dtype() == torch::kFloat32 && w.dim() == 2, "pack_weight: (N, K) float32");
  TORCH_CHECK(w.size(0) % NR == 0, "pack_weight: N = ", w.size(0), " is not a multiple of ", NR);
  const int64_t N = w.size(0), K = w.size(1);
  // (N/16, 16, K) -> (N/16, K, 16): one copy through torch's strided kernel
  return w.contiguous().view({N / NR, NR, K}).transpose(1, 2).contiguous();
}

torch::Tensor packed_linear(torch::Tensor x, torch::Tensor p, c10::optional<torch::Tensor> bias_) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              "packed_linear: x (M, K) float32 with contiguous rows");
  TORCH_CHECK(p.dtype() == torch::kFloat32 && p.dim() == 3 && p.size(2) == NR && p.is_contiguous() &&
              p.size(1) == x.size(1), "packed_linear: weight (N/16, K, 16) from pack_weight with K = x.size(1)");
  const int64_t M = x.size(0), K = x.size(1), NP = p.size(0), N = NP * NR;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* a = x.data_ptr<float>();
  const int64_t lda = x.stride(0);
  const float* b = p.data_ptr<float>();
  float* c = y.data_ptr<float>();
  torch::Tensor bias_c;
  const float* bias = nullptr;
  if (bias_.has_value() && bias_->defined()) {
    bias_c = bias_->contiguous();
    TORCH_CHECK(bias_c.numel() == N, "packed_linear: bias of ", N);
    bias = bias_c.data_ptr<float>();
  }
  // Row tiles over all of M: tile t holds rows [r0[t], r0[t] + mt[t]), and its K x mt slice of x
  // is packed k-major at offset r0[t] * K, so the kernel's broadcasts walk one contiguous stream
  // at fixed offsets (with x's own row stride every k costs address arithmetic next to 12 FMAs).
  std::vector<int64_t> r0;
  std::vector<int> mt;
  for (int64_t i = 0; i < M;) { const int m = tile_rows(M - i); r0.push_back(i); mt.push_back(m); i += m; }
  const int64_t T = r0.size();
  auto ap_t = torch::empty({M * K}, x.options());
  float* ap = ap_t.data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int m = mt[t];
      float* dst = ap + r0[t] * K;
      const float* src = a + r0[t] * lda;
      for (int64_t k = 0; k < K; ++k)
        for (int i = 0; i < m; ++i) dst[k * m + i] = src[i * lda + k];
    }
  });
  // K in slabs of about equal depth (576 -> 3 x 192, not 256 + 256 + 64): a tile reloads and
  // stores its 12 accumulators once per slab, which a shallow last slab pays for in full. With one
  // or two row tiles (<= 12 rows: decode steps) a slab is read once or twice and L1 residency buys
  // little, while slabs turn W's stream into 12 KB runs with 24 KB gaps: K whole reads each chunk's
  // panels as one sequential stream (isolated, 2 threads, 1-12 rows: 5-9% faster).
  const int64_t nslab = T <= WHOLE_K_TILES ? 1 : (K + KC - 1) / KC;
  const int64_t kcb = ((K + nslab - 1) / nslab + 7) / 8 * 8;
  constexpr int64_t TPB = MC / MR;  // tiles per row block: MC rows of 6-row tiles (a few 4-5-row ones)
  // Panels [j0, j1) of the product, row block by row block: W's slice comes from memory for the
  // first block (a 16-panel chunk's 576 KB then stays in L2 for the others).
  auto panels = [&](int64_t j0, int64_t j1) {
    for (int64_t tb = 0; tb < T; tb += TPB) {
      const int64_t te = std::min(T, tb + TPB);
      for (int64_t pc = 0; pc < K; pc += kcb) {
        const int64_t kc = std::min(kcb, K - pc);
        const bool last = pc + kc == K;
        for (int64_t j = j0; j < j1; ++j) {
          const float* bj = b + j * K * NR + pc * NR;
          const float* next = j + 1 < j1 ? bj + K * NR : bj;  // the slab the next panel step reads
          for (int64_t t = tb; t < te; ++t) {
            const int m = mt[t];
            kTiles[t == tb][m](ap + r0[t] * K + pc * m, bj, next, kc, c + r0[t] * N + j * NR, N, pc > 0,
                      last && bias ? bias + j * NR : nullptr);
          }
        }
      }
    }
  };
  // Threads take chunks of panels from a shared counter instead of equal halves: the box's two
  // cores run ~7% apart and the pool's thread joins each call a little late, and with halves the
  // faster one waited at the barrier (a 32-row decode step: ~4% faster in-model).
  // Without OpenMP the pragma is ignored and one thread takes every chunk.
  const int nt = at::in_parallel_region() ? 1 : at::get_num_threads();
  if (nt <= 1) {
    panels(0, NP);
  } else {
    const int64_t C = std::max<int64_t>(1, std::min<int64_t>(MAX_CHUNK, NP / (nt * CHUNKS_PER_THREAD)));
    const int64_t nchunks = (NP + C - 1) / C;
    std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(nt)
    for (int64_t c = next++; c < nchunks; c = next++) panels(c * C, std::min(NP, (c + 1) * C));
  }
  return y;
}
