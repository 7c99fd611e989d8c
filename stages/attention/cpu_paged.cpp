// Paged decode attention for fp32 on CPU (see cpu_paged.py).
// q (B, H, D); k_cache, v_cache (NB, BS, H_kv, D); tables (B, NBT) int64; lens (B,) int64.
// One task per (sequence, KV head): its G = H / H_kv query heads share every K/V row read;
// two passes (scores and softmax over a contiguous buffer, then the V sum), each row read once.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor tables, torch::Tensor lens, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
              v_cache.dtype() == torch::kFloat32, "paged_decode: float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              tables.is_contiguous() && lens.is_contiguous(), "paged_decode: contiguous inputs");
  TORCH_CHECK(tables.dtype() == torch::kInt64 && lens.dtype() == torch::kInt64, "paged_decode: int64 tables/lens");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2), NBT = tables.size(1);
  TORCH_CHECK(H % Hkv == 0 && k_cache.size(3) == D, "paged_decode: head shapes");
  const int64_t G = H / Hkv;
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p, acc(G * D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / Hkv, h = i % Hkv, len = lp[b];
      const float* qb = qp + (b * H + h * G) * D;
      p.resize(G * len);
      // pass 1: scores of the G query heads against each K row, read once
      for (int64_t pos = 0; pos < len; ++pos) {
        const int64_t slot = tp[b * NBT + pos / BS] * BS + pos % BS;
        const float* kr = kp + (slot * Hkv + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qb + g * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * kr[d];
          p[g * len + pos] = dot * sc;
        }
      }
      // softmax per head over contiguous scores (vectorised exp)
      std::vector<float> inv(G);
      for (int64_t g = 0; g < G; ++g) {
        float* s = p.data() + g * len;
        float mx = s[0];
        for (int64_t j = 1; j < len; ++j) mx = std::max(mx, s[j]);
        float sum = 0.f;
        for (int64_t j = 0; j < len; ++j) { s[j] = std::exp(s[j] - mx); sum += s[j]; }
        inv[g] = 1.f / sum;
      }
      // pass 2: weighted sum of each V row, read once
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t pos = 0; pos < len; ++pos) {
        const int64_t slot = tp[b * NBT + pos / BS] * BS + pos % BS;
        const float* vr = vp + (slot * Hkv + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float w = p[g * len + pos];
          float* a = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) a[d] += w * vr[d];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* o = op + (b * H + h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[g * D + d] * inv[g];
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (fp32, CPU)");
}
