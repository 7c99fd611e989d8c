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
// Here: a task's online softmax and the dispatch; the tiles and packing in prefill_tiles.h (fp32)
// and prefill_bf16.h, the tile sizes and arguments in paged_prefill.h.
#include "aten.h"

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <type_traits>
#include <vector>

#include "paged_prefill.h"
#include "prefill_bf16.h"
#include "prefill_tiles.h"
#include "vec.h"

namespace {

using namespace pp_prefill;

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
    pack = kv == at::kHalf ? pack_block<c10::Half> : kv == at::kFloat8_e4m3fn ? pack_block<Fp8> : pack_block<float>;
#ifdef PP_BF16
  else
    pack = kv == at::kHalf ? pack_block_bf16<c10::Half>
           : kv == at::kFloat8_e4m3fn ? pack_block_bf16<Fp8> : pack_block_bf16<float>;
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

void paged_prefill(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor table,
                   int64_t ctx, double scale, at::Tensor out, bool bf16) {
  const auto kv = k_cache.scalar_type();
  TORCH_CHECK(q.dtype() == at::kFloat &&
              (kv == at::kFloat || kv == at::kHalf || kv == at::kFloat8_e4m3fn) &&
              v_cache.scalar_type() == kv && out.dtype() == at::kFloat,
              "paged_prefill: float32 q and out, float32, float16 or float8_e4m3fn caches");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_prefill: q rows (H, D) contiguous");
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1 && out.stride(1) == out.size(2),
              "paged_prefill: out like q");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && table.is_contiguous() &&
              table.dtype() == at::kLong, "paged_prefill: contiguous caches, int64 table");
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
