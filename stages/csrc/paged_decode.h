// paged_decode's arguments, shared by its walks (paged_decode.cpp, decode_tiled.h, decode_bf16.h):
// q (B, H, D) fp32; k, v the caches (NB, BS, H_kv, D) of element T; tables (B, NBT) and lens (B,)
// int64; out (B, H, D). Dyn: the head size D.
#pragma once

#include <cstdint>

namespace pp_decode {

template <typename T>
struct Args {
  const float* q;
  const T* k;
  const T* v;
  const int64_t* tables;
  const int64_t* lens;
  float* out;
  int64_t H, Hkv, G, BS, NBT, Dyn;
  float scale;
  bool bf16;  // bf16 products where heads_bf16 takes this call (fp8 K/V, G <= 4)
};

}  // namespace pp_decode
