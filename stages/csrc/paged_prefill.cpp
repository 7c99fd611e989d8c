// Paged causal prefill attention for fp32 on CPU (see stages/cpu_kernels.py), one chunk per call.
// q (n, H, D) with any row stride; k_cache, v_cache (NB, BS, H_kv, D), fp32, fp16 or fp8 e4m3
// (widened to fp32 when packed); table (nb,) int64;
// the chunk is the last n of ctx positions, its own K/V already written to the cache.
//
// Why not SDPA: its CPU flash kernel runs a fresh 256-token causal chunk at ~11 GFLOP/s, and a
// chunk with cached context first needs every block gathered into a copy and then an explicit
// mask, so the upper triangle is computed too. Here a task is (KV head, TQ query positions):
// its TQ * G rows (G query heads share the KV head) attend to keys 0 .. its last position only,
// in steps of KC keys with an online softmax. Both products are register-blocked 6 x 16
// micro-tiles of broadcast-FMA over K and V packed once per call into 16-wide panels (Kᵀ: D x 16
// keys, V: keys x 16 columns), so that every micro-tile streams contiguous memory: read in
// place, the cache's rows sit at a stride that maps a 16-key slab onto a few L1 sets.
//
// bf16 (matmul precision "medium" or "int8", where the build has AVX512-BF16; chunks of more than
// 12 tokens): q, K, the softmax weights P and V rounded to bf16 (nearest even), fp32 sums, each
// vdpbf16ps adding two terms into 16 of them (what a GPU's bf16 flash attention does; K and V from
// an fp8 cache are exact in bf16).
// The panels then hold pairs: Kᵀ word (p, j) = K[j][2p], K[j][2p + 1]; V word (jp, c) = V[2jp][c],
// V[2jp + 1][c]. A bf16 panel has as many elements as an fp32 one, so both layouts share offsets.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <type_traits>
#include <vector>
#include "vec.h"

namespace {

constexpr int MR = 6;    // rows per micro-tile
constexpr int NR = 16;   // keys (Q Kᵀ) or output columns (P V) per micro-tile
constexpr int TQ = 16;   // query positions per task
constexpr int KC = 256;  // keys per online-softmax step
// a running max below any score: finite, since -ffast-math assumes no infinities
constexpr float kNoMax = -1e30f;

struct Args {
  const float* q;
  const void* k;  // T: float, c10::Half or Fp8, as the cache is
  const void* v;
  const int64_t* table;
  float* out;
  int64_t q_row, out_row, n, ctx, H, Hkv, G, D, BS;
  float scale;
  const void* kt;  // E: (Hkv, Lp / NR, D, NR): Kᵀ panels, zero past ctx
  const void* vp;  // E: (Hkv, D / NR, Lp, NR): V panels, zero past ctx (a bf16 pair reads one row past)
  int64_t Lp;
};

// s[r][c] = Σ_d q_r[d] kt[d][c] for r < MR, c < NR (kt: one D x NR panel; s row stride lds)
template <int DC>
inline void qk_tile(const float* const* qr, const float* kt, int64_t D, float* s, int64_t lds) {
  const int64_t Dn = DC > 0 ? DC : D;
#if defined(PP_AVX512)
  // a 16-key panel row is one 16-lane register: half the FMA instructions of the 8-lane tile
  __m512 c[MR];
  for (int r = 0; r < MR; ++r) c[r] = _mm512_setzero_ps();
  for (int64_t d = 0; d < Dn; ++d) {
    const __m512 b = _mm512_loadu_ps(kt + d * NR);
    for (int r = 0; r < MR; ++r) c[r] = _mm512_fmadd_ps(_mm512_set1_ps(qr[r][d]), b, c[r]);
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(s + r * lds, c[r]);
#elif defined(PP_AVX2)
  __m256 c[MR][2];
  for (int r = 0; r < MR; ++r) c[r][0] = c[r][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < Dn; ++d) {
    const __m256 b0 = _mm256_loadu_ps(kt + d * NR), b1 = _mm256_loadu_ps(kt + d * NR + 8);
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(qr[r] + d);
      c[r][0] = _mm256_fmadd_ps(a, b0, c[r][0]);
      c[r][1] = _mm256_fmadd_ps(a, b1, c[r][1]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(s + r * lds, c[r][0]);
    _mm256_storeu_ps(s + r * lds + 8, c[r][1]);
  }
#else
  float c[MR][NR] = {};
  for (int64_t d = 0; d < Dn; ++d)
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NR; ++j) c[r][j] += qr[r][d] * kt[d * NR + j];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) s[r * lds + j] = c[r][j];
#endif
}

// o[r][0:NR] += Σ_j p[r][j] vp[j][0:NR] for r < MR, j < kc (vp: a V panel; p, o row strides ldp, ldo)
inline void pv_tile(const float* p, int64_t ldp, const float* vp, int64_t kc, float* o, int64_t ldo) {
#if defined(PP_AVX512)
  __m512 c[MR];
  for (int r = 0; r < MR; ++r) c[r] = _mm512_loadu_ps(o + r * ldo);
  for (int64_t j = 0; j < kc; ++j) {
    const __m512 b = _mm512_loadu_ps(vp + j * NR);
    for (int r = 0; r < MR; ++r) c[r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * ldp + j]), b, c[r]);
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(o + r * ldo, c[r]);
#elif defined(PP_AVX2)
  __m256 c[MR][2];
  for (int r = 0; r < MR; ++r) {
    c[r][0] = _mm256_loadu_ps(o + r * ldo);
    c[r][1] = _mm256_loadu_ps(o + r * ldo + 8);
  }
  for (int64_t j = 0; j < kc; ++j) {
    const __m256 b0 = _mm256_loadu_ps(vp + j * NR), b1 = _mm256_loadu_ps(vp + j * NR + 8);
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(p + r * ldp + j);
      c[r][0] = _mm256_fmadd_ps(a, b0, c[r][0]);
      c[r][1] = _mm256_fmadd_ps(a, b1, c[r][1]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(o + r * ldo, c[r][0]);
    _mm256_storeu_ps(o + r * ldo + 8, c[r][1]);
  }
#else
  for (int64_t j = 0; j < kc; ++j)
    for (int r = 0; r < MR; ++r) {
      const float w = p[r * ldp + j];
      for (int c = 0; c < NR; ++c) o[r * ldo + c] += w * vp[j * NR + c];
    }
#endif
}

// The panels of KV head h for the positions of cache block blk (both read once, in place).
template <typename T>
void pack_block(const Args& a, int64_t h, int64_t blk, float* kt, float* vp) {
  const int64_t j0 = blk * a.BS, j1 = std::min(a.ctx, j0 + a.BS), D = a.D, row = a.Hkv * D;
  const T* kr = static_cast<const T*>(a.k) + (a.table[blk] * a.BS * a.Hkv + h) * D;
  const T* vr = static_cast<const T*>(a.v) + (a.table[blk] * a.BS * a.Hkv + h) * D;
  for (int64_t j = j0; j < j1; ++j, kr += row, vr += row) {
    float* kp = kt + (h * (a.Lp / NR) + j / NR) * D * NR + j % NR;
    for (int64_t d = 0; d < D; ++d) kp[d * NR] = to_f32(kr[d]);
    for (int64_t c = 0; c < D; c += NR) {
      float* vo = vp + ((h * (D / NR) + c / NR) * a.Lp + j) * NR;
      for (int64_t i = 0; i < NR; ++i) vo[i] = to_f32(vr[c + i]);
    }
  }
}

#ifdef PP_BF16
template <typename T>
inline __m512 widen16(const T* p) {  // 16 cache elements -> their 16 values, exactly
  if constexpr (std::is_same_v<T, float>) return _mm512_loadu_ps(p);
  else if constexpr (std::is_same_v<T, Fp8>) return _mm512_mul_ps(load16(p), _mm512_set1_ps(raw_unit<Fp8>()));
  else return load16(p);
}

// pack_block's panels as bf16 pairs: K's (d, d + 1) in word (d / 2, j), V's rows (j, j + 1) in word
// (j / 2, c); 16 elements at a time (converted one by one, packing took ~9% of a 256-token chunk's
// attention): a K row's 16 bf16 go out as 8 words a panel row apart, two V rows' 16 columns as 16
// adjacent words (pair_rows). A V row without its pair in this block (an odd block size) goes in
// one element at a time.
template <typename T>
void pack_block_bf16(const Args& a, int64_t h, int64_t blk, Bf16* kt, Bf16* vp) {
  const int64_t j0 = blk * a.BS, j1 = std::min(a.ctx, j0 + a.BS), D = a.D, row = a.Hkv * D;
  const T* k0 = static_cast<const T*>(a.k) + (a.table[blk] * a.BS * a.Hkv + h) * D;
  const T* v0 = static_cast<const T*>(a.v) + (a.table[blk] * a.BS * a.Hkv + h) * D;
  const T* kr = k0;
  for (int64_t j = j0; j < j1; ++j, kr += row) {
    uint32_t* kp = reinterpret_cast<uint32_t*>(kt + (h * (a.Lp / NR) + j / NR) * D * NR) + j % NR;
    for (int64_t d = 0; d < D; d += 16) {
      alignas(32) uint32_t w[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(w), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(widen16(kr + d))));
      for (int i = 0; i < 8; ++i) kp[(d / 2 + i) * NR] = w[i];
    }
  }
  Bf16* vo = vp + h * D * a.Lp;
  for (int64_t j = j0; j < j1;) {
    const T* vr = v0 + (j - j0) * row;
    const bool last = j + 1 == a.ctx;  // its pair is padding: zero
    if (j % 2 == 0 && (j + 1 < j1 || last)) {
      for (int64_t c = 0; c < D; c += NR) {
        const __m512 r1 = last ? _mm512_setzero_ps() : widen16(vr + row + c);
        _mm512_storeu_si512(vo + c * a.Lp + j * NR, pair_rows(widen16(vr + c), r1));
      }
      j += 2;
    } else {
      for (int64_t c = 0; c < D; c += NR)
        for (int64_t i = 0; i < NR; ++i) vo[c * a.Lp + (j / 2 * NR + i) * 2 + j % 2] = to_bf16(to_f32(vr[c + i]));
      j += 1;
    }
  }
}
#endif

#ifdef PP_BF16
// The bf16 tiles are MR rows x NP panels (up to 4: 64 keys or output columns), 24 accumulators
// as the GEMM's bf16 tiles, against vdpbf16ps's latency. Measured against 6 (one panel): no
// faster here (256-token chunk, 1 thread: 0.645 / 0.644 ms a layer), the kernel's products were
// not waiting on it; kept at no cost for other cores and head sizes.
constexpr int NPB = 4;

// s[r][c] = Σ_d q_r[d] kt_c[d] for r < MR, c < NP · NR as qk_tile over NP consecutive panels
// (kt: the first, D / 2 x NR words each), from bf16: q rows at q + r * D
template <int DC, int NP>
inline void qk_tile_bf16(const Bf16* q, const Bf16* kt, int64_t D, float* s, int64_t lds) {
  const int64_t Dn = DC > 0 ? DC : D;
  __m512 c[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int i = 0; i < NP; ++i) c[r][i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < Dn / 2; ++p) {
    __m512bh b[NP];
    for (int i = 0; i < NP; ++i) b[i] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kt + i * Dn * NR + p * 2 * NR));
    for (int r = 0; r < MR; ++r) {
      const __m512bh x = bcast_pair(q + r * Dn + 2 * p);
      for (int i = 0; i < NP; ++i) c[r][i] = _mm512_dpbf16_ps(c[r][i], x, b[i]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int i = 0; i < NP; ++i) _mm512_storeu_ps(s + r * lds + i * NR, c[r][i]);
}

// o[r][c] += Σ_j p[r][j] v_c[j] for r < MR, c < NP · NR as pv_tile over kc2 keys (even) and NP
// column panels (vp: the first's slab, kc2 / 2 x NR words; the next at + pstride), from bf16 P rows
// at stride ldp
template <int NP>
inline void pv_tile_bf16(const Bf16* p, int64_t ldp, const Bf16* vp, int64_t pstride, int64_t kc2, float* o,
                         int64_t ldo) {
  __m512 c[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int i = 0; i < NP; ++i) c[r][i] = _mm512_loadu_ps(o + r * ldo + i * NR);
  for (int64_t j = 0; j < kc2; j += 2) {
    __m512bh b[NP];
    for (int i = 0; i < NP; ++i) b[i] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(vp + i * pstride + j * NR));
    for (int r = 0; r < MR; ++r) {
      const __m512bh x = bcast_pair(p + r * ldp + j);
      for (int i = 0; i < NP; ++i) c[r][i] = _mm512_dpbf16_ps(c[r][i], x, b[i]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int i = 0; i < NP; ++i) _mm512_storeu_ps(o + r * ldo + i * NR, c[r][i]);
}

// f<NP>() for NP = n (1 .. NPB): the tiles' panel count as a compile-time constant
template <typename F>
inline void with_panels(int64_t n, const F& f) {
  switch (n) {
    case 1: return f(std::integral_constant<int, 1>());
    case 2: return f(std::integral_constant<int, 2>());
    case 3: return f(std::integral_constant<int, 3>());
    default: return f(std::integral_constant<int, NPB>());
  }
}

// n floats -> n bf16 (n a multiple of 16)
inline void round_row(const float* x, int64_t n, Bf16* y) {
  for (int64_t i = 0; i < n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i))));
}
#endif

struct Scratch {
  std::vector<const float*> qr;
  std::vector<float> s, o, m, l;
  std::vector<int64_t> pos;
  std::vector<Bf16> qb, pb;  // the bf16 path's q rows and softmax weights
};

// Rows of task (h, t): position i0 + i / G, query head h * G + i % G; padded to MR with a zero row.
// E: the panels' element (float, or Bf16 for bf16 products)
template <int DC, typename E>
void one_task(const Args& a, int64_t h, int64_t t, Scratch& w, const float* zero) {
  constexpr bool BF = std::is_same_v<E, Bf16>;
  const int64_t D = DC > 0 ? DC : a.D, i0 = t * TQ, ni = std::min<int64_t>(TQ, a.n - i0);
  const int64_t R = ni * a.G, Rp = (R + MR - 1) / MR * MR, first = a.ctx - a.n;
  w.qr.resize(Rp);
  w.pos.resize(Rp);
  for (int64_t r = 0; r < Rp; ++r) {
    const bool real = r < R;
    w.qr[r] = real ? a.q + (i0 + r / a.G) * a.q_row + (h * a.G + r % a.G) * D : zero;
    w.pos[r] = real ? first + i0 + r / a.G : -1;
  }
  const int64_t Lt = first + i0 + ni;  // keys this task can see
  w.s.resize(Rp * KC);
  w.o.assign(Rp * D, 0.f);
  w.m.assign(Rp, kNoMax);
  w.l.assign(Rp, 0.f);
#ifdef PP_BF16
  if constexpr (BF) {
    w.qb.resize(Rp * D);
    w.pb.resize(Rp * KC);
    for (int64_t r = 0; r < Rp; ++r) round_row(w.qr[r], D, &w.qb[r * D]);
  }
#endif
  const E* kt = static_cast<const E*>(a.kt) + h * a.Lp * D;  // this head's panels
  const E* vp = static_cast<const E*>(a.vp) + h * D * a.Lp;
  for (int64_t j0 = 0; j0 < Lt; j0 += KC) {
    const int64_t kc = std::min<int64_t>(KC, Lt - j0), kcp = (kc + NR - 1) / NR * NR;
#ifdef PP_BF16
    if constexpr (BF) {
      for (int64_t c = 0; c < kcp; c += NPB * NR)  // up to NPB panels of Kᵀ across the row tiles
        with_panels((kcp - c) / NR, [&](auto np) {
          for (int64_t r = 0; r < Rp; r += MR)
            qk_tile_bf16<DC, np()>(&w.qb[r * D], kt + (j0 + c) * D, D, &w.s[r * KC + c], KC);
        });
    }
#endif
    if constexpr (!BF)
      for (int64_t c = 0; c < kcp; c += NR)  // Kᵀ slab stays in L1 across the row tiles
        for (int64_t r = 0; r < Rp; r += MR) qk_tile<DC>(&w.qr[r], kt + (j0 + c) * D, D, &w.s[r * KC + c], KC);
    for (int64_t r = 0; r < Rp; ++r) {  // online softmax: scores -> weights, rescale what is summed
      float* s = &w.s[r * KC];
      const int64_t valid = std::clamp<int64_t>(w.pos[r] - j0 + 1, 0, kc);
      if (valid == 0) {
        std::fill(s, s + kcp, 0.f);
#ifdef PP_BF16
        if constexpr (BF) std::fill_n(&w.pb[r * KC], kcp, Bf16(0));
#endif
        continue;
      }
      const float m_new = std::max(w.m[r], row_max(s, valid) * a.scale);
      const float alpha = w.m[r] == kNoMax ? 0.f : std::exp(w.m[r] - m_new);
      float sum = 0.f;
#ifdef PP_BF16
      if constexpr (BF) sum = exp_row_bf16(s, valid, kcp, a.scale, m_new, &w.pb[r * KC]);  // zeros to kcp: pairs read up to kc + 1
#endif
      if constexpr (!BF) {
        sum = exp_row(s, valid, a.scale, m_new);
        std::fill(s + valid, s + kcp, 0.f);
      }
      w.l[r] = w.l[r] * alpha + sum;
      w.m[r] = m_new;
      if (alpha != 1.f)
        for (int64_t d = 0; d < D; ++d) w.o[r * D + d] *= alpha;
    }
#ifdef PP_BF16
    if constexpr (BF) {
      for (int64_t c = 0; c < D; c += NPB * NR)  // up to NPB V panels' slabs across the row tiles
        with_panels((D - c) / NR, [&](auto np) {
          for (int64_t r = 0; r < Rp; r += MR)
            pv_tile_bf16<np()>(&w.pb[r * KC], KC, vp + (c * a.Lp + j0 * NR), NR * a.Lp, (kc + 1) / 2 * 2,
                               &w.o[r * D + c], D);
        });
    }
#endif
    if constexpr (!BF)
      for (int64_t c = 0; c < D; c += NR)  // one V panel slab across the row tiles
        for (int64_t r = 0; r < Rp; r += MR) pv_tile(&w.s[r * KC], KC, vp + (c * a.Lp + j0 * NR), kc, &w.o[r * D + c], D);
  }
  for (int64_t r = 0; r < R; ++r) {
    float* o = a.out + (i0 + r / a.G) * a.out_row + (h * a.G + r % a.G) * D;
    const float inv = 1.f / w.l[r];
    for (int64_t d = 0; d < D; ++d) o[d] = w.o[r * D + d] * inv;
  }
}

template <int DC, typename E>
void run(const Args& a) {
  const int64_t tiles = (a.n + TQ - 1) / TQ, tasks = tiles * a.Hkv;
  // Later tiles see more keys: pair tile t with tiles-1-t so that equal contiguous ranges
  // of tasks (how parallel_for splits them) cost about the same.
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    std::vector<float> zero(a.D, 0.f);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = i / a.Hkv, h = i % a.Hkv;
      const int64_t t = slot % 2 == 0 ? slot / 2 : tiles - 1 - slot / 2;
      one_task<DC, E>(a, h, t, w, zero.data());
    }
  });
}

// Packs the panels (elements E) and runs the tasks over them.
template <typename E>
void launch(Args a, c10::ScalarType kv) {
  const int64_t Hkv = a.Hkv, D = a.D, Lp = a.Lp, ctx = a.ctx;
  // Uninitialised (a long context's panels are MBs): packing writes every real key. What the
  // tiles read past ctx is zeroed first: the last Kᵀ panel (the softmax masks its scores) and the
  // V rows from the pair that holds ctx on (only P's zeros multiply them; NaN · 0 would not be 0).
  std::unique_ptr<E[]> kt(new E[Hkv * D * Lp]), vp(new E[Hkv * D * Lp]);
  for (int64_t h = 0; h < Hkv && Lp > ctx; ++h) {
    std::fill_n(kt.get() + (h * (Lp / NR) + Lp / NR - 1) * D * NR, D * NR, E(0));
    for (int64_t c = 0; c < D; c += NR)
      std::fill_n(vp.get() + h * D * Lp + c * Lp + ctx / 2 * 2 * NR, (Lp - ctx / 2 * 2) * NR, E(0));
  }
  a.kt = kt.get();
  a.vp = vp.get();
  const int64_t blocks = (ctx + a.BS - 1) / a.BS;
  void (*pack)(const Args&, int64_t, int64_t, E*, E*);  // by the cache's element
  if constexpr (std::is_same_v<E, float>)
    pack = kv == torch::kFloat16 ? pack_block<c10::Half> : kv == torch::kFloat8_e4m3fn ? pack_block<Fp8> : pack_block<float>;
#ifdef PP_BF16
  else
    pack = kv == torch::kFloat16 ? pack_block_bf16<c10::Half>
           : kv == torch::kFloat8_e4m3fn ? pack_block_bf16<Fp8> : pack_block_bf16<float>;
#endif
  at::parallel_for(0, Hkv * blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) pack(a, i / blocks, i % blocks, kt.get(), vp.get());
  });
  if (D == 64) {
    run<64, E>(a);
  } else if (D == 128) {
    run<128, E>(a);
  } else {
    run<0, E>(a);
  }
}

}  // namespace

void paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor table,
                   int64_t ctx, double scale, torch::Tensor out, bool bf16) {
  const auto kv = k_cache.scalar_type();
  TORCH_CHECK(q.dtype() == torch::kFloat32 &&
              (kv == torch::kFloat32 || kv == torch::kFloat16 || kv == torch::kFloat8_e4m3fn) &&
              v_cache.scalar_type() == kv && out.dtype() == torch::kFloat32,
              "paged_prefill: float32 q and out, float32, float16 or float8_e4m3fn caches");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_prefill: q rows (H, D) contiguous");
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1 && out.stride(1) == out.size(2),
              "paged_prefill: out like q");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && table.is_contiguous() &&
              table.dtype() == torch::kInt64, "paged_prefill: contiguous caches, int64 table");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(2), BS = k_cache.size(1);
  TORCH_CHECK(H % Hkv == 0 && k_cache.size(3) == D && D % NR == 0, "paged_prefill: head shapes");
  TORCH_CHECK(n <= ctx && table.size(0) * BS >= ctx, "paged_prefill: table shorter than the context");
  const int64_t* tp = table.data_ptr<int64_t>();
  for (int64_t i = 0, nb = (ctx + BS - 1) / BS; i < nb; ++i)
    TORCH_CHECK(tp[i] >= 0 && tp[i] < k_cache.size(0), "paged_prefill: block ", tp[i], " outside the cache");
  if (n == 0) return;
  Args a{q.data_ptr<float>(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr<int64_t>(),
         out.data_ptr<float>(), q.stride(0), out.stride(0), n, ctx, H, Hkv, H / Hkv, D, BS,
         static_cast<float>(scale), nullptr, nullptr, (ctx + NR - 1) / NR * NR};
#ifdef PP_BF16
  if (bf16 && n > kBf16MinTokens) return launch<Bf16>(a, kv);
#else
  TORCH_CHECK(!bf16, "paged_prefill: bf16 products need a build with AVX512-BF16 (bf16_products())");
#endif
  launch<float>(a, kv);
}
