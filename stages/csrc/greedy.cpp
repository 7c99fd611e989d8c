// Candidate columns for an exact greedy LM head (stages/greedy.py).
//
//   greedy_candidates(approx (M, V), xn (M), wn (V), c, floor) -> [ids (U,) int64 ascending, member (M, U) bool]
//
// approx holds logits from reduced-precision products whose error is at most b_v = c · xn[r] ·
// wn[v] + floor (xn: the rows' norms, wn: the weight rows' norms, c and floor: the caller's
// bound). Row r's exact argmax must then be among the v with approx[r][v] + b_v >= max_u
// (approx[r][u] - b_u): any other v is below some u even at its bound's best. Two passes over each
// row (the max, then the candidates, a 16-lane compare each where the build has AVX-512), rows in
// parallel; ids is the union over rows, member[r][i] whether ids[i] is row r's.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

#include "vec.h"

namespace {

// max over v of a[v] - b · wn[v] (the caller subtracts the floor)
float lower_max(const float* a, const float* wn, int64_t V, float b) {
  float mx = a[0] - b * wn[0];
  int64_t v = 1;
#ifdef PP_AVX512
  if (V >= 16) {
    const __m512 vb = _mm512_set1_ps(b);
    __m512 m = _mm512_fnmadd_ps(vb, _mm512_loadu_ps(wn), _mm512_loadu_ps(a));
    for (v = 16; v + 16 <= V; v += 16)
      m = _mm512_max_ps(m, _mm512_fnmadd_ps(vb, _mm512_loadu_ps(wn + v), _mm512_loadu_ps(a + v)));
    mx = _mm512_reduce_max_ps(m);
  }
#endif
  for (; v < V; ++v) mx = std::max(mx, a[v] - b * wn[v]);
  return mx;
}

// every v with a[v] + b · wn[v] >= thr, ascending, into out
void upper_at_least(const float* a, const float* wn, int64_t V, float b, float thr, std::vector<int64_t>& out) {
  int64_t v = 0;
#ifdef PP_AVX512
  const __m512 vb = _mm512_set1_ps(b), vt = _mm512_set1_ps(thr);
  for (; v + 16 <= V; v += 16) {
    uint32_t hit = _mm512_cmp_ps_mask(_mm512_fmadd_ps(vb, _mm512_loadu_ps(wn + v), _mm512_loadu_ps(a + v)), vt,
                                      _CMP_GE_OQ);
    for (; hit; hit &= hit - 1) out.push_back(v + __builtin_ctz(hit));
  }
#endif
  for (; v < V; ++v)
    if (a[v] + b * wn[v] >= thr) out.push_back(v);
}

}  // namespace

std::vector<torch::Tensor> greedy_candidates(torch::Tensor approx, torch::Tensor xn, torch::Tensor wn, double c,
                                             double floor) {
  TORCH_CHECK(approx.dtype() == torch::kFloat32 && approx.dim() == 2 && approx.is_contiguous(),
              "greedy_candidates: approx (M, V) contiguous float32");
  const int64_t M = approx.size(0), V = approx.size(1);
  TORCH_CHECK(V > 0 && xn.dtype() == torch::kFloat32 && xn.numel() == M && xn.is_contiguous() &&
              wn.dtype() == torch::kFloat32 && wn.numel() == V && wn.is_contiguous(),
              "greedy_candidates: xn (M) and wn (V) contiguous float32 beside approx (M, V)");
  const float* a = approx.data_ptr<float>();
  const float* w = wn.data_ptr<float>();
  const float* x = xn.data_ptr<float>();
  const float wmax = *std::max_element(w, w + V);
  std::vector<std::vector<int64_t>> rows(M);
  at::parallel_for(0, M, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float b = static_cast<float>(c) * x[r];
      // a[v] + b·wn[v] + floor >= max - floor, both floors on the right; and lower by more than
      // the roundings of either side (half an ulp of terms up to |max| + 4·b·max wn each)
      const float mx = lower_max(a + r * V, w, V, b);
      const float thr = mx - 2 * static_cast<float>(floor) - (std::fabs(mx) + 4 * b * wmax) * 0x1p-20f;
      upper_at_least(a + r * V, w, V, b, thr, rows[r]);
    }
  });
  std::vector<char> mark(V, 0);
  for (const auto& row : rows)
    for (int64_t v : row) mark[v] = 1;
  std::vector<int64_t> ids, slot(V, 0);  // slot: a marked vocab id's place in ids
  for (int64_t v = 0; v < V; ++v)
    if (mark[v]) {
      slot[v] = static_cast<int64_t>(ids.size());
      ids.push_back(v);
    }
  const int64_t U = static_cast<int64_t>(ids.size());
  auto member = torch::zeros({M, U}, torch::kBool);
  bool* mb = member.data_ptr<bool>();
  for (int64_t r = 0; r < M; ++r)
    for (int64_t v : rows[r]) mb[r * U + slot[v]] = true;
  auto out = torch::empty({U}, torch::kInt64);
  std::copy(ids.begin(), ids.end(), out.data_ptr<int64_t>());
  return {out, member};
}
