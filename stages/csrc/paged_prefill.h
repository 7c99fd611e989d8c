// paged_prefill's tile sizes and arguments, shared by its tiles (paged_prefill.cpp, prefill_tiles.h,
// prefill_bf16.h).
#pragma once

#include <cstdint>

namespace pp_prefill {

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

}  // namespace pp_prefill
