// The exact greedy LM head's candidate search over int8 logits it computes and never stores
// (stages/greedy.py; the search over given logits and the column gather are greedy.cpp's).
//
//   int8_candidates(xu (M, K) uint8, xs (M, K/32), eb (M, K/32), bmax (M), q (V/16, K/32, 576) Q8_0
//                   panels, bn (V/16, K/32, 16), floor) -> [ids (U,) int64, member (M, U) bool]
//   quantize_blocks(x (M, K), block_max (K/32)) -> [xu, xs, eb, bmax]: int8_candidates' first four
//
// int8_candidates: greedy_candidates' rule (greedy.cpp) over logits it computes and never stores.
// Each row's block b of 32 k is quantized as x ≈ xs[b] · (xu − 128) (xu: u8 codes), against a Q8_0 weight's own int8
// codes (w = d·q exactly, stages/quant.py), so each block's dot product is an exact int32 sum: 4 k
// per byte lane of an AVX512-VNNI vpdpbusd, 64 multiply-adds an instruction against 32 for a bf16
// dot product and 16 for an fp32 FMA. vpdpbusd takes one operand unsigned: the weight's codes enter
// as q + 128 and x's as signed codes c = xu − 128 (the operand it can broadcast from memory), so
// each sum starts from −128 · Σ c over the block. A logit is Σ_b d·xs[b]·sum_b,
// within Σ_b |w_b|₂ · |e_b|₂ of x's exact one (e: x's quantization error in block b,
// Cauchy-Schwarz per block; bn ≥ |w_b|₂, and eb ≥ |e_b|₂ plus what the fp32 sum over blocks can
// round and what the GEMM's own fp32 logit can be off the exact one, quantize_blocks); bmax[r]
// bounds that over v. Blocks of 32 with a scale each, not
// one scale a row: a hidden state's few large channels (max/rms ~19 on SmolLM2) would otherwise
// set every channel's step, and the bound would keep thousands of candidates. Writing the (M, V)
// logits and bounds would cost more than computing them (12.6 MB at 32 rows, into fresh pages), so
// each thread keeps a row's running max of logit − bound over the panels it has done and keeps
// only the v whose logit + bound reaches it, a superset of the final rule's (the max only grows):
// the first panel's 16, then a few dozen more at most.
#include "aten.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "greedy.h"
#include "panels.h"
#include "vec.h"

using pp_greedy::threshold;
using pp_greedy::union_of;

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define PP_VNNI 1
#endif

namespace {

// float64 -> the float32 at or above it
inline float round_up(double v) {
  float f = static_cast<float>(v);
  return static_cast<double>(f) < v ? std::nextafter(f, INFINITY) : f;
}

#ifdef PP_VNNI
// A thread's view of one row: its running max of logit − bound, the threshold that gives, and the
// (v, logit + bound) it kept.
struct RowScan {
  float mx = -INFINITY, thr = -INFINITY;
  std::vector<std::pair<int64_t, float>> kept;
};

// A block's 4 k-rows i of 16 columns in vpdpbusd lane order (each column's 4 k in one 32-bit lane), as
// unsigned q + 128 (x's codes are the signed operand, so that vpdpbusd takes them from memory)
inline __m512i lanes_u8(const uint8_t* blk, int i) {
  const __m512i q = _mm512_loadu_si512(blk + DM + 64 * i);
  const __m512i lanes = _mm512_permutexvar_epi8(_mm512_load_si512(LANE_ORDER.s8), q);
  return _mm512_xor_si512(lanes, _mm512_set1_epi8(static_cast<char>(0x80)));
}

// vectors a block in int8_candidates' scratch (several tiles): 8 of lanes_u8, then d as fp32
constexpr int64_t LB = 9;

// Rows' x as the tiles read it: c = xu − 128 (signed codes), c0 = −128 · Σ c per block (what the
// + 128 of the weight's codes adds), xs and eb; tiled: in row tiles, else one tile row-major
// (M ≤ ROWS; panels.h: x_code, x_block).
struct XTiles {
  at::Tensor c, c0, s, e;
};

XTiles tile_x(const uint8_t* xu, const float* xs, const float* eb, int64_t M, int64_t K, bool tiled) {
  const int64_t KB = K / QK, T = (M + ROWS - 1) / ROWS;
  XTiles t{at::empty({T * ROWS * K}, at::kChar), at::empty({T * ROWS * KB}, at::kInt),
           at::empty({T * ROWS * KB}, at::kFloat), at::empty({T * ROWS * KB}, at::kFloat)};
  int8_t* c = t.c.data_ptr<int8_t>();
  int32_t* c0 = t.c0.data_ptr<int32_t>();
  float *s = t.s.data_ptr<float>(), *e = t.e.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < KB; ++b) {
      const uint8_t* u = xu + r * K + b * QK;
      const int64_t at = tiled ? x_block<true>(r, b, KB) : x_block<false>(r, b, KB);
      int32_t sum = 0;
      for (int j = 0; j < 8; ++j) {
        int8_t* dst = c + (tiled ? x_code<true>(r, b, j, KB) : x_code<false>(r, b, j, KB));
        for (int k = 0; k < 4; ++k) {
          dst[k] = static_cast<int8_t>(static_cast<int>(u[4 * j + k]) - 128);
          sum += dst[k];
        }
      }
      c0[at] = -128 * sum;
      s[at] = xs[r * KB + b];
      e[at] = eb[r * KB + b];
    }
  return t;
}

// R rows (R <= 8) of one row tile against one panel of 16 columns: R int32 block sums, R logit and
// R bound sums in registers (24 of 32 with R = 8). TILED: x in tiles and the panel's codes already
// in lane order in w, and d (KB × LB vectors, once per call for every tile); else x row-major and each
// block's codes permuted here. Then each row's lanes go through its scan. pf: a panel to fetch into
// the caches a block at a time meanwhile (nullptr: none).
template <int R, bool TILED>
void q8_tile(const uint8_t* panel, const __m512i* w, const float* bn, int64_t KB, const int8_t* xc, const int32_t* c0,
             const float* xs, const float* eb, const float* bmax, float floor, int64_t v0, RowScan* scan,
             const uint8_t* pf) {
  __m512 acc[R], bnd[R];
  for (int r = 0; r < R; ++r) acc[r] = bnd[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* blk = panel + b * QB_S8;
    if (pf) prefetch_bytes(pf + b * QB_S8, QB_S8);
    __m512i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm512_set1_epi32(c0[x_block<TILED>(r, b, KB)]);
    for (int i = 0; i < 8; ++i) {  // k = 4i .. 4i + 3 of the block
      const __m512i wv = TILED ? _mm512_load_si512(w + b * LB + i) : lanes_u8(blk, i);
      for (int r = 0; r < R; ++r) s[r] = dpbusd_bcast(s[r], wv, xc + x_code<TILED>(r, b, i, KB));
    }
    const __m512 d = TILED ? _mm512_castsi512_ps(_mm512_load_si512(w + b * LB + 8)) : block_d16(blk);
    const __m512 n = _mm512_loadu_ps(bn + b * NR);
    for (int r = 0; r < R; ++r) {  // exact int32 sums (|sum| < 2^24): exact as floats
      const int64_t at = x_block<TILED>(r, b, KB);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), _mm512_mul_ps(d, _mm512_set1_ps(xs[at])), acc[r]);
      bnd[r] = _mm512_fmadd_ps(n, _mm512_set1_ps(eb[at]), bnd[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    RowScan& sc = scan[r];
    const __m512 lo = _mm512_sub_ps(acc[r], bnd[r]);
    if (_mm512_cmp_ps_mask(lo, _mm512_set1_ps(sc.mx), _CMP_GT_OQ)) {  // a new max: rare after the first panels
      sc.mx = _mm512_reduce_max_ps(lo);
      sc.thr = threshold(sc.mx, bmax[r], floor);
    }
    const __m512 hi = _mm512_add_ps(acc[r], bnd[r]);
    uint32_t hit = _mm512_cmp_ps_mask(hi, _mm512_set1_ps(sc.thr), _CMP_GE_OQ);
    if (hit) {
      alignas(64) float h[NR];
      _mm512_store_ps(h, hi);
      for (; hit; hit &= hit - 1) sc.kept.emplace_back(v0 + __builtin_ctz(hit), h[__builtin_ctz(hit)]);
    }
  }
}

template <bool TILED, int R = ROWS>
void q8_rows(int rows, const uint8_t* panel, const __m512i* w, const float* bn, int64_t KB, const int8_t* xc,
             const int32_t* c0, const float* xs, const float* eb, const float* bmax, float floor, int64_t v0,
             RowScan* scan, const uint8_t* pf) {
  if constexpr (R > 1) {
    if (rows < R) return q8_rows<TILED, R - 1>(rows, panel, w, bn, KB, xc, c0, xs, eb, bmax, floor, v0, scan, pf);
  }
  q8_tile<R, TILED>(panel, w, bn, KB, xc, c0, xs, eb, bmax, floor, v0, scan, pf);
}
#endif


}  // namespace


std::vector<at::Tensor> int8_candidates(at::Tensor xu, at::Tensor xs, at::Tensor eb, at::Tensor bmax,
                                        at::Tensor q, at::Tensor bn, double floor) {
  TORCH_CHECK(q.dtype() == at::kByte && q.dim() == 3 && q.size(2) == QB_S8 && q.is_contiguous(),
              "int8_candidates: weight (V/16, K/32, ", QB_S8, ") Q8_0 panels");
  const int64_t NP = q.size(0), KB = q.size(1), K = KB * QK, V = NP * NR;
  TORCH_CHECK(xu.dtype() == at::kByte && xu.dim() == 2 && xu.size(1) == K && xu.is_contiguous(),
              "int8_candidates: xu (M, ", K, ") contiguous uint8");
  const int64_t M = xu.size(0);
  for (const auto& [t, name] : {std::pair{xs, "xs"}, std::pair{eb, "eb"}})
    TORCH_CHECK(t.dtype() == at::kFloat && t.dim() == 2 && t.size(0) == M && t.size(1) == KB && t.is_contiguous(),
                "int8_candidates: ", name, " (", M, ", ", KB, ") contiguous float32");
  TORCH_CHECK(bmax.dtype() == at::kFloat && bmax.numel() == M && bmax.is_contiguous(),
              "int8_candidates: bmax (", M, ") contiguous float32");
  TORCH_CHECK(bn.dtype() == at::kFloat && bn.is_contiguous() && bn.dim() == 3 && bn.size(0) == NP &&
              bn.size(1) == KB && bn.size(2) == NR,
              "int8_candidates: bn float32 (", NP, ", ", KB, ", 16) beside the weight");
  std::vector<std::vector<int64_t>> rows(M);
#ifdef PP_VNNI
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const uint8_t* x = xu.data_ptr<uint8_t>();
  const float *s = xs.data_ptr<float>(), *e = eb.data_ptr<float>(), *bm = bmax.data_ptr<float>();
  const float* nb = bn.data_ptr<float>();
  const float fl = static_cast<float>(floor);
  const int T = at::get_num_threads();
  std::vector<RowScan> scans(T * M);  // thread t's scan of row r at t * M + r
  const bool tiled = M > ROWS;
  const XTiles xt = tile_x(x, s, e, M, K, tiled);
  const int8_t* xc = xt.c.data_ptr<int8_t>();
  const int32_t* c0 = xt.c0.data_ptr<int32_t>();
  const float *ts = xt.s.data_ptr<float>(), *te = xt.e.data_ptr<float>();
  // panels split among threads; each panel's codes (10.4 KB at K = 576) read from L1 by every
  // tile of 8 rows (with several tiles, once permuted into a scratch that every tile loads)
  at::parallel_for(0, NP, 16, [&](int64_t p0, int64_t p1) {
    RowScan* sc = scans.data() + at::get_thread_num() * M;
    // with several tiles, each block's 8 code vectors in lane order and its d, once per panel
    std::unique_ptr<__m512i[]> lanes(tiled ? new __m512i[KB * LB] : nullptr);  // new aligns to 64
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* panel = qp + p * KB * QB_S8;
      // the panel after next fetched a block at a time inside the first tile of this one, and with
      // several tiles the next one's norms: the scratch is built at the start of a panel, where no
      // product hides its reads from memory. Against the code before (past 8 rows a burst one panel
      // ahead during the scratch build, whose codes still came late; up to 8 rows no fetch), paired,
      // Zen 4, 1 thread: 4 / 8 / 9 / 16 / 32 rows x0.81 / 0.90 / 0.76 / 0.82 / 0.87 (that burst
      // had itself been x0.85 / 0.89 / 0.92 at 9 / 16 / 32 rows against no fetch)
      const uint8_t* two_ahead = p + 2 < p1 ? panel + 2 * KB * QB_S8 : nullptr;
      if (tiled && p + 1 < p1) prefetch_bytes(nb + (p + 1) * KB * NR, KB * NR * sizeof(float));
      if (tiled)
        for (int64_t b = 0; b < KB; ++b) {
          for (int i = 0; i < 8; ++i) lanes[b * LB + i] = lanes_u8(panel + b * QB_S8, i);
          lanes[b * LB + 8] = _mm512_castps_si512(block_d16(panel + b * QB_S8));
        }
      for (int64_t r = 0; r < M; r += ROWS) {
        const int n = static_cast<int>(std::min<int64_t>(ROWS, M - r));
        const uint8_t* pf = r == 0 ? two_ahead : nullptr;
        if (tiled) {
          const int64_t at = x_block<true>(r, 0, KB);  // the tile's start
          q8_rows<true>(n, panel, lanes.get(), nb + p * KB * NR, KB, xc + x_code<true>(r, 0, 0, KB), c0 + at, ts + at,
                        te + at, bm + r, fl, p * NR, sc + r, pf);
        } else {
          q8_rows<false>(n, panel, nullptr, nb + p * KB * NR, KB, xc, c0, ts, te, bm, fl, p * NR, sc, pf);
        }
      }
    }
  });
  for (int64_t r = 0; r < M; ++r) {  // the final rule: over every thread's max, what each kept
    float mx = -INFINITY;
    for (int t = 0; t < T; ++t) mx = std::max(mx, scans[t * M + r].mx);
    const float thr = threshold(mx, bm[r], fl);
    for (int t = 0; t < T; ++t)
      for (const auto& [v, hi] : scans[t * M + r].kept)
        if (hi >= thr) rows[r].push_back(v);
    std::sort(rows[r].begin(), rows[r].end());
  }
#else
  TORCH_CHECK(false, "int8_candidates: this build has no AVX512-VNNI (int8_head() is false)");
#endif
  return union_of(rows, V);
}

std::vector<at::Tensor> quantize_blocks(at::Tensor x, at::Tensor block_max) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.size(1) % QK == 0 && x.is_contiguous(),
              "quantize_blocks: x (M, K) contiguous float32 with K a multiple of ", QK);
  const int64_t M = x.size(0), K = x.size(1), KB = K / QK;
  TORCH_CHECK(block_max.dtype() == at::kDouble && block_max.numel() == KB && block_max.is_contiguous(),
              "quantize_blocks: block_max (", KB, ") contiguous float64");
  auto xu = at::empty({M, K}, at::kByte);
  auto xs = at::empty({M, KB}, at::kFloat), eb = at::empty({M, KB}, at::kFloat);
  auto bmax = at::empty({M}, at::kFloat);
  const float* xp = x.data_ptr<float>();
  const double* bm = block_max.data_ptr<double>();
  uint8_t* up = xu.data_ptr<uint8_t>();
  float *sp = xs.data_ptr<float>(), *ep = eb.data_ptr<float>(), *mp = bmax.data_ptr<float>();
  // what int8_candidates' fp32 sum over KB blocks can add to a logit's error: one rounding of
  // d·xs and one of each FMA, γ = (KB + 2)·2⁻²⁴ of Σ_b |w_b|·|xq_b|; the logit to match is the
  // GEMM's, a K-term fp32 sum within (K + 2)·2⁻²⁴ · Σ_b |w_b|·|x_b| of the exact one; and the
  // bound's own sum of KB positive terms, (KB + 2)·2⁻²³ of itself
  const double gamma = (KB + 2) * 0x1p-24, gemm = (K + 2) * 0x1p-24 * (1 + 0x1p-10);
  const double up_sum = (1 + (KB + 2) * 0x1p-23) * (1 + 0x1p-40);
  for (int64_t r = 0; r < M; ++r) {
    double row = 0;
    for (int64_t b = 0; b < KB; ++b) {
      const float* xb = xp + r * K + b * QK;
      float amax = 0.f;
      for (int k = 0; k < QK; ++k) amax = std::max(amax, std::fabs(xb[k]));
      const float s = amax / 127.f;
      double e2 = 0, q2 = 0, x2 = 0;
      for (int k = 0; k < QK; ++k) {
        const float u = s > 0 ? std::min(127.f, std::max(-127.f, std::nearbyint(xb[k] / s))) : 0.f;
        const double xq = static_cast<double>(u) * s;  // exact: an 8-bit code times a float32
        e2 += (xb[k] - xq) * (xb[k] - xq);
        q2 += xq * xq;
        x2 += static_cast<double>(xb[k]) * xb[k];
        up[r * K + b * QK + k] = static_cast<uint8_t>(static_cast<int>(u) + 128);
      }
      sp[r * KB + b] = s;
      ep[r * KB + b] = round_up((std::sqrt(e2) + gamma * std::sqrt(q2) + gemm * std::sqrt(x2)) * up_sum);
      row += bm[b] * ep[r * KB + b];
    }
    mp[r] = round_up(row * up_sum);  // ≥ the kernel's fp32 sum of the same KB terms
  }
  return {xu, xs, eb, bmax};
}

bool int8_head() {
#ifdef PP_VNNI
  return true;
#else
  return false;
#endif
}