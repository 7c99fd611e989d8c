// What the exact greedy LM head's two candidate searches share (greedy.cpp, greedy_int8.cpp).
#pragma once

#include "aten.h"

#include <cmath>
#include <vector>

namespace pp_greedy {

// The candidates' threshold for a row whose max of logit − bound is mx: logit + bound + floor >=
// mx − floor, both floors on the right; and lower by more than the roundings of either side (half
// an ulp of terms up to |mx| + 4·bmax each, bmax >= every bound of the row). It grows with mx.
inline float threshold(float mx, float bmax, float floor) {
  return mx - 2 * floor - (std::fabs(mx) + 4 * bmax) * 0x1p-20f;
}


// the union of rows' candidates -> [ids ascending, member (M, U)]
std::vector<at::Tensor> union_of(const std::vector<std::vector<int64_t>>& rows, int64_t V);

}  // namespace pp_greedy
