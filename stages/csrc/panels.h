// The weight panels the GEMM (gemm.cpp) and the greedy head (greedy.cpp) read: NR output columns
// a panel; GGUF blocks (stages/quant.py) of QK weights along K, each (panel, block) QB bytes:
// d[16] and m[16] in fp32, then the codes (u4: 16 rows of 16 bytes, two k a byte; s8: 32 rows).
#pragma once
#include <cstdint>

constexpr int NR = 16;  // output columns per panel (two 8-lane vectors)
constexpr int64_t QK = 32;
constexpr int64_t QB_U4 = 128 + QK * NR / 2, QB_S8 = 128 + QK * NR;
