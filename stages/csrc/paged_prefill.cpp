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
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <memory>
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
  const float* kt;  // (Hkv, Lp / NR, D, NR): Kᵀ panels, zero past ctx
  const float* vp;  // (Hkv, D / NR, Lp, NR): V panels, rows past ctx unset (never read)
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

struct Scratch {
  std::vector<const float*> qr;
  std::vector<float> s, o, m, l;
  std::vector<int64_t> pos;
};

// Rows of task (h, t): position i0 + i / G, query head h * G + i % G; padded to MR with a zero row.
template <int DC>
void one_task(const Args& a, int64_t h, int64_t t, Scratch& w, const float* zero) {
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
  const float* kt = a.kt + h * a.Lp * D;  // this head's panels
  const float* vp = a.vp + h * D * a.Lp;
  for (int64_t j0 = 0; j0 < Lt; j0 += KC) {
    const int64_t kc = std::min<int64_t>(KC, Lt - j0), kcp = (kc + NR - 1) / NR * NR;
    for (int64_t c = 0; c < kcp; c += NR)  // Kᵀ slab stays in L1 across the row tiles
      for (int64_t r = 0; r < Rp; r += MR) qk_tile<DC>(&w.qr[r], kt + (j0 + c) * D, D, &w.s[r * KC + c], KC);
    for (int64_t r = 0; r < Rp; ++r) {  // online softmax: scores -> weights, rescale what is summed
      float* s = &w.s[r * KC];
      const int64_t valid = std::clamp<int64_t>(w.pos[r] - j0 + 1, 0, kc);
      if (valid == 0) {
        std::fill(s, s + kc, 0.f);
        continue;
      }
      const float m_new = std::max(w.m[r], row_max(s, valid) * a.scale);
      const float alpha = w.m[r] == kNoMax ? 0.f : std::exp(w.m[r] - m_new);
      const float sum = exp_row(s, valid, a.scale, m_new);
      std::fill(s + valid, s + kc, 0.f);
      w.l[r] = w.l[r] * alpha + sum;
      w.m[r] = m_new;
      if (alpha != 1.f)
        for (int64_t d = 0; d < D; ++d) w.o[r * D + d] *= alpha;
    }
    for (int64_t c = 0; c < D; c += NR)  // one V panel slab across the row tiles
      for (int64_t r = 0; r < Rp; r += MR) pv_tile(&w.s[r * KC], KC, vp + (c * a.Lp + j0 * NR), kc, &w.o[r * D + c], D);
  }
  for (int64_t r = 0; r < R; ++r) {
    float* o = a.out + (i0 + r / a.G) * a.out_row + (h * a.G + r % a.G) * D;
    const float inv = 1.f / w.l[r];
    for (int64_t d = 0; d < D; ++d) o[d] = w.o[r * D + d] * inv;
  }
}

template <int DC>
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
      one_task<DC>(a, h, t, w, zero.data());
    }
  });
}

}  // namespace

void paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor table,
                   int64_t ctx, double scale, torch::Tensor out) {
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
  const int64_t Lp = (ctx + NR - 1) / NR * NR;
  // Uninitialised (a long context's panels are MBs): packing writes every real key; the K
  // columns past ctx in the last panel are zeroed (the tiles read them; the softmax masks
  // them), the V rows past ctx are never read.
  std::unique_ptr<float[]> kt(new float[Hkv * D * Lp]), vp(new float[Hkv * D * Lp]);
  for (int64_t h = 0; h < Hkv && Lp > ctx; ++h)
    for (int64_t d = 0; d < D; ++d)
      std::fill_n(kt.get() + ((h * (Lp / NR) + Lp / NR - 1) * D + d) * NR + ctx % NR, Lp - ctx, 0.f);
  Args a{q.data_ptr<float>(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr<int64_t>(),
         out.data_ptr<float>(), q.stride(0), out.stride(0), n, ctx, H, Hkv, H / Hkv, D, BS,
         static_cast<float>(scale), kt.get(), vp.get(), Lp};
  const int64_t blocks = (ctx + BS - 1) / BS;
  const auto pack = kv == torch::kFloat16 ? pack_block<c10::Half>  // the cache's element
                    : kv == torch::kFloat8_e4m3fn ? pack_block<Fp8> : pack_block<float>;
  at::parallel_for(0, Hkv * blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) pack(a, i / blocks, i % blocks, kt.get(), vp.get());
  });
  if (D == 64) {
    run<64>(a);
  } else if (D == 128) {
    run<128>(a);
  } else {
    run<0>(a);
  }
}
