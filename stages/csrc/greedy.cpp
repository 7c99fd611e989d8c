// The kernels of an exact greedy LM head (stages/greedy.py): cheap logits with an error bound,
// then the columns whose exact logit can still be a row's maximum. This file: the search over
// logits the caller computed, and the gather of the candidates' weight columns; greedy_int8.cpp:
// the search that computes int8 logits itself (AVX512-VNNI).
//
//   greedy_candidates(approx (M, V), xn (M), wn (V), c, floor) -> [ids (U,) int64, member (M, U) bool]
//   gather_columns(w panels, ids (U,)) -> the panels of w's output columns ids (padded to 16)
//
// greedy_candidates: approx holds logits from reduced-precision products whose error is at most
// b_v = c · xn[r] · wn[v] + floor (xn: the rows' norms, wn: the weight rows' norms, c and floor:
// the caller's bound). Row r's exact argmax must then be among the v with approx[r][v] + b_v >=
// max_u (approx[r][u] - b_u): any other v is below some u even at its bound's best. Two passes
// over each row (the max, then the candidates, a 16-lane compare each where the build has
// AVX-512), rows in parallel; ids is the union over rows, member[r][i] whether ids[i] is row r's.
#include "aten.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "greedy.h"
#include "panels.h"
#include "vec.h"

using pp_greedy::threshold;
using pp_greedy::union_of;

namespace {

// b_v = b · wn[v]: a bound proportional to the weight rows' norms (greedy_candidates)
struct ScaledNorms {
  const float* wn;
  float b;
  float at(int64_t v) const { return b * wn[v]; }
#ifdef PP_AVX512
  __m512 at16(int64_t v) const { return _mm512_mul_ps(_mm512_set1_ps(b), _mm512_loadu_ps(wn + v)); }
#endif
};

// max over v of a[v] - b_v (the caller subtracts the floor)
template <typename B>
float lower_max(const float* a, const B& b, int64_t V) {
  float mx = a[0] - b.at(0);
  int64_t v = 1;
#ifdef PP_AVX512
  if (V >= 16) {
    __m512 m = _mm512_sub_ps(_mm512_loadu_ps(a), b.at16(0));
    for (v = 16; v + 16 <= V; v += 16) m = _mm512_max_ps(m, _mm512_sub_ps(_mm512_loadu_ps(a + v), b.at16(v)));
    mx = _mm512_reduce_max_ps(m);
  }
#endif
  for (; v < V; ++v) mx = std::max(mx, a[v] - b.at(v));
  return mx;
}

// every v with a[v] + b_v >= thr, ascending, into out
template <typename B>
void upper_at_least(const float* a, const B& b, int64_t V, float thr, std::vector<int64_t>& out) {
  int64_t v = 0;
#ifdef PP_AVX512
  const __m512 vt = _mm512_set1_ps(thr);
  for (; v + 16 <= V; v += 16) {
    uint32_t hit = _mm512_cmp_ps_mask(_mm512_add_ps(_mm512_loadu_ps(a + v), b.at16(v)), vt, _CMP_GE_OQ);
    for (; hit; hit &= hit - 1) out.push_back(v + __builtin_ctz(hit));
  }
#endif
  for (; v < V; ++v)
    if (a[v] + b.at(v) >= thr) out.push_back(v);
}

}  // namespace

namespace pp_greedy {

// the union of rows' candidates -> [ids ascending, member (M, U)]
std::vector<at::Tensor> union_of(const std::vector<std::vector<int64_t>>& rows, int64_t V) {
  const int64_t M = static_cast<int64_t>(rows.size());
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
  auto member = at::zeros({M, U}, at::kBool);
  bool* mb = member.data_ptr<bool>();
  for (int64_t r = 0; r < M; ++r)
    for (int64_t v : rows[r]) mb[r * U + slot[v]] = true;
  auto out = at::empty({U}, at::kLong);
  std::copy(ids.begin(), ids.end(), out.data_ptr<int64_t>());
  return {out, member};
}

}  // namespace pp_greedy


std::vector<at::Tensor> greedy_candidates(at::Tensor approx, at::Tensor xn, at::Tensor wn, double c,
                                          double floor) {
  TORCH_CHECK(approx.dtype() == at::kFloat && approx.dim() == 2 && approx.is_contiguous(),
              "greedy_candidates: approx (M, V) contiguous float32");
  const int64_t M = approx.size(0), V = approx.size(1);
  TORCH_CHECK(V > 0 && xn.dtype() == at::kFloat && xn.numel() == M && xn.is_contiguous() &&
              wn.dtype() == at::kFloat && wn.numel() == V && wn.is_contiguous(),
              "greedy_candidates: xn (M) and wn (V) contiguous float32 beside approx (M, V)");
  const float* a = approx.data_ptr<float>();
  const float* w = wn.data_ptr<float>();
  const float* x = xn.data_ptr<float>();
  const float wmax = *std::max_element(w, w + V);
  std::vector<std::vector<int64_t>> rows(M);
  at::parallel_for(0, M, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const ScaledNorms b{w, static_cast<float>(c) * x[r]};
      upper_at_least(a + r * V, b, V, threshold(lower_max(a + r * V, b, V), b.b * wmax, floor), rows[r]);
    }
  });
  return union_of(rows, V);
}

at::Tensor gather_columns(at::Tensor w, at::Tensor ids) {
  const bool quant = check_panels(w, "gather_columns");
  TORCH_CHECK(ids.dtype() == at::kLong && ids.dim() == 1 && ids.numel() > 0 && ids.is_contiguous(),
              "gather_columns: ids (U,) int64, not empty");
  const int64_t NP = w.size(0), U = ids.numel(), n = (U + NR - 1) / NR;
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < U; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < NP * NR, "gather_columns: id ", id[i], " out of range");
  auto out = at::empty({n, w.size(1), w.size(2)}, w.options());
  // a panel's rows (fp32: K rows of 16 floats; quantized: one a block, its 16 d and 16 m of 2
  // bytes, then rows of 16 code bytes): column i of the output takes column c of panel p in each
  const int64_t rows = w.size(1), row_elems = quant ? w.size(2) : NR;  // quantized: a row is a block
  const uint8_t* src = static_cast<const uint8_t*>(w.data_ptr());
  uint8_t* dst = static_cast<uint8_t*>(out.data_ptr());
  const int64_t pbytes = rows * row_elems * (quant ? 1 : 4);
  at::parallel_for(0, n, 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t i = 0; i < NR; ++i) {
        const int64_t v = id[std::min(j * NR + i, U - 1)];  // past U: the last id again
        const uint8_t* sp = src + (v / NR) * pbytes;
        const int64_t c = v % NR;
        uint8_t* dp = dst + j * pbytes;
        if (!quant) {
          for (int64_t k = 0; k < rows; ++k) std::memcpy(dp + (k * NR + i) * 4, sp + (k * NR + c) * 4, 4);
          continue;
        }
        for (int64_t b = 0; b < rows; ++b, sp += row_elems, dp += row_elems) {
          std::memcpy(dp + i * 2, sp + c * 2, 2);  // d
          std::memcpy(dp + 2 * NR + i * 2, sp + 2 * NR + c * 2, 2);  // m
          for (int64_t o = DM; o < row_elems; o += NR) dp[o + i] = sp[o + c];  // one byte per code row
        }
      }
  });
  return out;
}
