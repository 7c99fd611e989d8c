// Paged decode attention for fp32 on CPU (see stages/cpu_kernels.py).
// q (B, H, D); k_cache, v_cache (NB, BS, H_kv, D) fp32, fp16 or fp8 e4m3 (T: widened as read); tables (B, NBT)
// int64; lens (B,) int64.
// Each KV head's G = H / H_kv query heads share every K/V row read; two passes (scores and
// softmax over a contiguous buffer, then the V sum), each row read once, block by block.
// With AVX2 and a common head size / group (64 or 128; 1, 2, 3, 4 or 8), heads_tiled (decode_tiled.h;
// 8 lanes wide, 16 where the build has AVX-512) does both passes from registers, one task
// per sequence walking its blocks' rows in memory order; otherwise one_head's plain loops, one
// task per (sequence, KV head) (docs/BENCHMARKS.md). bf16: heads_bf16's (decode_bf16.h) bf16 products for a call
// of more than bf16_over decodes over fp8 K/V with a group of up to 4, where the build has
// AVX512-BF16 and AVX512-VBMI; every other call keeps fp32 (a build without AVX512-BF16 refuses the flag).
#include "aten.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "decode_bf16.h"
#include "decode_tiled.h"
#include "paged_decode.h"
#include "vec.h"

namespace {

using namespace pp_decode;

// One (sequence b, KV head h). DC / GC: the head size / query heads per KV head if known at
// compile time, else 0 (a.Dyn / a.G): with both fixed, each K or V row is loaded once for all
// G heads and the d-loops vectorise with G accumulators.
template <typename T, int DC, int GC>
void one_head(const Args<T>& a, int64_t b, int64_t h, std::vector<float>& p, std::vector<float>& acc,
              std::vector<float>& inv) {
  const int64_t D = DC > 0 ? DC : a.Dyn;
  const int64_t G = GC > 0 ? GC : a.G, len = a.lens[b], row_stride = a.Hkv * D;
  const float* qb = a.q + (b * a.H + h * G) * D;
  const int64_t* table = a.tables + b * a.NBT;
  p.resize(G * len);
  // pass 1: scores of the G query heads against each K row, read once
  for (int64_t start = 0, blk = 0; start < len; start += a.BS, ++blk) {
    const int64_t n = std::min(a.BS, len - start);
    const T* kr = a.k + (table[blk] * a.BS * a.Hkv + h) * D;
    for (int64_t j = 0; j < n; ++j, kr += row_stride) {
      if constexpr (GC > 0) {
        float dot[GC] = {};
        for (int64_t d = 0; d < D; ++d) {
          const float kd = to_f32(kr[d]);
          for (int g = 0; g < GC; ++g) dot[g] += qb[g * D + d] * kd;
        }
        for (int g = 0; g < GC; ++g) p[g * len + start + j] = dot[g] * a.scale;
      } else {
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qb + g * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * to_f32(kr[d]);
          p[g * len + start + j] = dot * a.scale;
        }
      }
    }
  }
  // softmax per head over contiguous scores (already scaled)
  for (int64_t g = 0; g < G; ++g) {
    float* s = p.data() + g * len;
    inv[g] = 1.f / exp_row(s, len, 1.f, row_max(s, len));
  }
  // pass 2: weighted sum of each V row, read once
  std::fill(acc.begin(), acc.begin() + G * D, 0.f);
  for (int64_t start = 0, blk = 0; start < len; start += a.BS, ++blk) {
    const int64_t n = std::min(a.BS, len - start);
    const T* vr = a.v + (table[blk] * a.BS * a.Hkv + h) * D;
    for (int64_t j = 0; j < n; ++j, vr += row_stride) {
      if constexpr (GC > 0) {
        float w[GC];
        for (int g = 0; g < GC; ++g) w[g] = p[g * len + start + j];
        float* ag = acc.data();
        for (int64_t d = 0; d < D; ++d) {
          const float vd = to_f32(vr[d]);
          for (int g = 0; g < GC; ++g) ag[g * D + d] += w[g] * vd;
        }
      } else {
        for (int64_t g = 0; g < G; ++g) {
          const float w = p[g * len + start + j];
          float* ag = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) ag[d] += w * to_f32(vr[d]);
        }
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* o = a.out + (b * a.H + h * G + g) * D;
    const float* ag = acc.data() + g * D;
    for (int64_t d = 0; d < D; ++d) o[d] = ag[d] * inv[g];
  }
}

// Tasks [0, n) cut into `parts` runs of consecutive tasks of about equal cost (cost(i) ≥ 0):
// edges (parts + 1,), run k = [edge[k], edge[k + 1]). Why: parallel_for cuts by count, and a step's
// decodes differ in context by up to ~8x (vs_hf.py's prompts: 16–128 tokens), so one thread could
// get most of the keys; consecutive, so a run still walks its sequences in order (next_seq).
template <typename F>
std::vector<int64_t> runs_by_cost(int64_t n, int64_t parts, const F& cost) {
  std::vector<double> prefix(n + 1, 0.0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + static_cast<double>(cost(i));
  std::vector<int64_t> edge(parts + 1, n);
  edge[0] = 0;
  for (int64_t k = 1, i = 0; k < parts; ++k) {  // the prefix nearest k / parts of the total
    const double target = prefix[n] * static_cast<double>(k) / static_cast<double>(parts);
    while (i < n && prefix[i + 1] <= target) ++i;
    if (i < n && prefix[i + 1] - target < target - prefix[i]) ++i;
    edge[k] = std::max(i, edge[k - 1]);
  }
  return edge;
}

template <typename T, int DC, int GC>
void run(const Args<T>& a, int64_t B) {
#ifdef PP_AVX2
  if constexpr (DC > 0 && GC > 0) {
    // a task per sequence (all its KV heads) when that still gives every thread work; else per head
    const int64_t threads = at::get_num_threads();
    const bool per_seq = B >= threads;
    const int64_t per = per_seq ? a.Hkv : 1;
    // a task's cost: its keys, plus what a task costs before its first key (q, softmax, out)
    const std::vector<int64_t> edge =
        runs_by_cost(B * a.Hkv / per, threads, [&](int64_t i) { return a.lens[i * per / a.Hkv] + 32; });
    at::parallel_for(0, threads, 1, [&](int64_t r0, int64_t r1) {
      std::vector<float> p, acc, inv;
#ifdef PP_DECODE_BF16
      std::vector<Bf16> pb;
      std::vector<Bf16> qp;
#endif
      // runs r0 .. r1 - 1 are consecutive tasks (several where fewer threads came, or nested)
      for (int64_t i = edge[r0], end = edge[r1]; i < end; ++i) {
        const int64_t b = i * per / a.Hkv, h0 = i * per % a.Hkv, next = per_seq && i + 1 < end ? b + 1 : -1;
#ifdef PP_DECODE_BF16
        if constexpr (std::is_same_v<T, Fp8> && GC <= 4) {
          if (a.bf16) {
            heads_bf16<DC, GC>(a, b, h0, h0 + per, p, pb, acc, inv, qp, next);
            continue;
          }
        }
#endif
        heads_tiled<Lanes, T, DC, GC>(a, b, h0, h0 + per, p, acc, inv, next);
      }
    });
    return;
  }
#endif
  at::parallel_for(0, B * a.Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p, acc(a.G * (DC > 0 ? DC : a.Dyn)), inv(a.G);
    for (int64_t i = begin; i < end; ++i) one_head<T, DC, GC>(a, i / a.Hkv, i % a.Hkv, p, acc, inv);
  });
}

template <typename T, int DC>
void run_g(const Args<T>& a, int64_t B) {
  switch (a.G) {  // the GQA groupings of common checkpoints (SmolLM2: 3; LLaMA-3, Mistral: 4)
    case 1: return run<T, DC, 1>(a, B);
    case 2: return run<T, DC, 2>(a, B);
    case 3: return run<T, DC, 3>(a, B);
    case 4: return run<T, DC, 4>(a, B);
    case 8: return run<T, DC, 8>(a, B);
    default: return run<T, DC, 0>(a, B);
  }
}

template <typename T>
void run_d(const Args<T>& a, int64_t B) {
  if (a.Dyn == 64) {
    run_g<T, 64>(a, B);
  } else if (a.Dyn == 128) {
    run_g<T, 128>(a, B);
  } else {
    run<T, 0, 0>(a, B);
  }
}

}  // namespace

bool decode_bf16() {
#ifdef PP_DECODE_BF16
  return true;
#else
  return false;
#endif
}

std::vector<int64_t> cost_runs(const std::vector<int64_t>& costs, int64_t parts) {
  TORCH_CHECK(parts >= 1, "cost_runs: parts must be >= 1, got ", parts);
  for (const int64_t c : costs) TORCH_CHECK(c >= 0, "cost_runs: costs must be >= 0, got ", c);
  return runs_by_cost(static_cast<int64_t>(costs.size()), parts, [&](int64_t i) { return costs[i]; });
}

at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                        at::Tensor tables, at::Tensor lens, double scale, bool bf16, int64_t bf16_over) {
  const auto kv = k_cache.scalar_type();
  TORCH_CHECK(q.dtype() == at::kFloat &&
              (kv == at::kFloat || kv == at::kHalf || kv == at::kFloat8_e4m3fn) &&
              v_cache.scalar_type() == kv, "paged_decode: float32 q, float32, float16 or float8_e4m3fn caches");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              tables.is_contiguous() && lens.is_contiguous(), "paged_decode: contiguous inputs");
  TORCH_CHECK(tables.dtype() == at::kLong && lens.dtype() == at::kLong, "paged_decode: int64 tables/lens");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(2);
  TORCH_CHECK(H % Hkv == 0 && k_cache.size(3) == D, "paged_decode: head shapes");
#ifndef PP_BF16
  TORCH_CHECK(!bf16, "paged_decode: bf16 products need AVX512-BF16, which this build has not");
#endif
  auto out = at::empty_like(q);
  auto run_as = [&](auto element) {  // the caches' element type T, by the value's type
    using T = decltype(element);
    run_d(Args<T>{q.data_ptr<float>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), tables.data_ptr<int64_t>(),
                  lens.data_ptr<int64_t>(), out.data_ptr<float>(), H, Hkv, H / Hkv, k_cache.size(1), tables.size(1), D,
                  static_cast<float>(scale), bf16 && B > bf16_over}, B);
  };
  if (kv == at::kHalf) run_as(c10::Half{});
  else if (kv == at::kFloat8_e4m3fn) run_as(Fp8{});
  else run_as(0.f);
  return out;
}
