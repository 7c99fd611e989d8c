// Paged decode attention for fp32 on CPU (see stages/cpu_kernels.py).
// q (B, H, D); k_cache, v_cache (NB, BS, H_kv, D); tables (B, NBT) int64; lens (B,) int64.
// One task per (sequence, KV head): its G = H / H_kv query heads share every K/V row read;
// two passes (scores and softmax over a contiguous buffer, then the V sum), each row read once.
// Rows are walked block by block (no division per position), and the head size is a
// compile-time constant where it is a common one, so the compiler unrolls and vectorises
// the 64-wide dot products and row updates (measured: docs/BENCHMARKS.md).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "vec.h"

namespace {

struct Args {
  const float* q;
  const float* k;
  const float* v;
  const int64_t* tables;
  const int64_t* lens;
  float* out;
  int64_t H, Hkv, G, BS, NBT, Dyn;
  float scale;
};

// One (sequence b, KV head h). DC / GC: the head size / query heads per KV head if known at
// compile time, else 0 (a.Dyn / a.G): with both fixed, each K or V row is loaded once for all
// G heads and the d-loops vectorise with G accumulators.
template <int DC, int GC>
void one_head(const Args& a, int64_t b, int64_t h, std::vector<float>& p, std::vector<float>& acc,
              std::vector<float>& inv) {
  const int64_t D = DC > 0 ? DC : a.Dyn;
  const int64_t G = GC > 0 ? GC : a.G, len = a.lens[b], row_stride = a.Hkv * D;
  const float* qb = a.q + (b * a.H + h * G) * D;
  const int64_t* table = a.tables + b * a.NBT;
  p.resize(G * len);
  // pass 1: scores of the G query heads against each K row, read once
  for (int64_t start = 0, blk = 0; start < len; start += a.BS, ++blk) {
    const int64_t n = std::min(a.BS, len - start);
    const float* kr = a.k + (table[blk] * a.BS * a.Hkv + h) * D;
    for (int64_t j = 0; j < n; ++j, kr += row_stride) {
      if constexpr (GC > 0) {
        float dot[GC] = {};
        for (int64_t d = 0; d < D; ++d) {
          const float kd = kr[d];
          for (int g = 0; g < GC; ++g) dot[g] += qb[g * D + d] * kd;
        }
        for (int g = 0; g < GC; ++g) p[g * len + start + j] = dot[g] * a.scale;
      } else {
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qb + g * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * kr[d];
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
    const float* vr = a.v + (table[blk] * a.BS * a.Hkv + h) * D;
    for (int64_t j = 0; j < n; ++j, vr += row_stride) {
      if constexpr (GC > 0) {
        float w[GC];
        for (int g = 0; g < GC; ++g) w[g] = p[g * len + start + j];
        float* ag = acc.data();
        for (int64_t d = 0; d < D; ++d) {
          const float vd = vr[d];
          for (int g = 0; g < GC; ++g) ag[g * D + d] += w[g] * vd;
        }
      } else {
        for (int64_t g = 0; g < G; ++g) {
          const float w = p[g * len + start + j];
          float* ag = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) ag[d] += w * vr[d];
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

template <int DC, int GC>
void run(const Args& a, int64_t B) {
  at::parallel_for(0, B * a.Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p, acc(a.G * (DC > 0 ? DC : a.Dyn)), inv(a.G);
    for (int64_t i = begin; i < end; ++i) one_head<DC, GC>(a, i / a.Hkv, i % a.Hkv, p, acc, inv);
  });
}

template <int DC>
void run_g(const Args& a, int64_t B) {
  switch (a.G) {  // the GQA groupings of common checkpoints (SmolLM2: 3; LLaMA-3, Mistral: 4)
    case 1: return run<DC, 1>(a, B);
    case 2: return run<DC, 2>(a, B);
    case 3: return run<DC, 3>(a, B);
    case 4: return run<DC, 4>(a, B);
    case 8: return run<DC, 8>(a, B);
    default: return run<DC, 0>(a, B);
  }
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor tables, torch::Tensor lens, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
              v_cache.dtype() == torch::kFloat32, "paged_decode: float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              tables.is_contiguous() && lens.is_contiguous(), "paged_decode: contiguous inputs");
  TORCH_CHECK(tables.dtype() == torch::kInt64 && lens.dtype() == torch::kInt64, "paged_decode: int64 tables/lens");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(2);
  TORCH_CHECK(H % Hkv == 0 && k_cache.size(3) == D, "paged_decode: head shapes");
  auto out = torch::empty_like(q);
  Args a{q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tables.data_ptr<int64_t>(),
         lens.data_ptr<int64_t>(), out.data_ptr<float>(), H, Hkv, H / Hkv, k_cache.size(1), tables.size(1), D,
         static_cast<float>(scale)};
  if (D == 64) {
    run_g<64>(a, B);
  } else if (D == 128) {
    run_g<128>(a, B);
  } else {
    run<0, 0>(a, B);
  }
  return out;
}
