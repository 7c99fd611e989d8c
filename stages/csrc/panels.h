// The weight panels the GEMM (gemm*.cpp) and the greedy head (greedy.cpp) read: NR output columns
// a panel; GGUF blocks (stages/quant.py) of QK weights along K, each (panel, block) QB bytes:
// d[16] and m[16] in fp16 (GGUF's own scales, so widening them is exact), then the codes at DM
// (u4: 16 rows of 16 bytes, two k a byte; s8: 32 rows). Why fp16: a few-row step streams every
// block from memory, and fp32 scales made a Q4_1 block 384 bytes instead of 320.
#pragma once
#include <cstdint>

#include "aten.h"

#include "vec.h"

constexpr int NR = 16;  // output columns per panel (two 8-lane vectors)
constexpr int64_t QK = 32;
constexpr int64_t DM = 2 * NR * 2;  // bytes of a block's d[16] and m[16]: where its codes start
constexpr int64_t QB_U4 = DM + QK * NR / 2, QB_S8 = DM + QK * NR;

// a block's d[16] then m[16]
inline const c10::Half* block_halves(const uint8_t* blk) { return reinterpret_cast<const c10::Half*>(blk); }
// column j's d and m, as fp32
inline float block_d(const uint8_t* blk, int j) { return to_f32(block_halves(blk)[j]); }
inline float block_m(const uint8_t* blk, int j) { return to_f32(block_halves(blk)[NR + j]); }

#ifdef PP_AVX2
// columns 8h .. 8h + 7's d or m
inline __m256 block_d8(const uint8_t* blk, int h) { return load8(block_halves(blk) + 8 * h); }
inline __m256 block_m8(const uint8_t* blk, int h) { return load8(block_halves(blk) + NR + 8 * h); }
#endif
#ifdef PP_AVX512
// the 16 columns' d or m
inline __m512 block_d16(const uint8_t* blk) { return load16(block_halves(blk)); }
inline __m512 block_m16(const uint8_t* blk) { return load16(block_halves(blk) + NR); }
#endif

// Byte permutes that put each column's 4 k in one 32-bit lane, as vpdpbusd sums them (the int8
// products of greedy.cpp and int8_gemm.cpp): out byte 4j + t <- column j's k = t of 4 code rows.
// s8: 4 lines of 16 bytes, k = t in byte 16t + j. u4 (two operands, the low nibbles then the high
// ones, 64+: from the second): line p holds rows 2p (low) and 2p + 1 (high), so u4a takes k 0-3
// from lines 0-1 and u4b k 4-7 from lines 2-3.
// A product's optional bias (N,) float32 as a pointer (nullptr: none); keep holds its contiguous copy
// while the product runs; who names the product in the error
inline const float* bias_of(const c10::optional<at::Tensor>& bias, int64_t N, at::Tensor& keep, const char* who) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  keep = bias->contiguous();
  TORCH_CHECK(keep.dtype() == at::kFloat && keep.numel() == N, who, ": bias of ", N, " float32");
  return keep.data_ptr<float>();
}

// Whether w is block-quantized panels (uint8, stages.quant) rather than fp32 ones (pack_weight);
// anything else is an error that names `who` (gather_columns, pack_weight_bf16, panel_rows)
inline bool check_panels(const at::Tensor& w, const char* who) {
  const bool quant = w.scalar_type() == at::kByte;
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && (quant ? (w.size(2) == QB_U4 || w.size(2) == QB_S8)
                                                          : (w.scalar_type() == at::kFloat && w.size(2) == NR)),
              who, ": weight panels from pack_weight (fp32) or stages.quant (uint8)");
  return quant;
}

struct LaneOrder {
  alignas(64) uint8_t s8[64] = {};
  alignas(64) uint8_t u4a[64] = {};
  alignas(64) uint8_t u4b[64] = {};
};

constexpr LaneOrder lane_order() {
  LaneOrder o;
  for (int j = 0; j < NR; ++j)
    for (int t = 0; t < 4; ++t) {
      o.s8[4 * j + t] = static_cast<uint8_t>(16 * t + j);
      o.u4a[4 * j + t] = static_cast<uint8_t>((t & 1 ? 64 : 0) + 16 * (t >> 1) + j);
      o.u4b[4 * j + t] = static_cast<uint8_t>(o.u4a[4 * j + t] + 32);
    }
  return o;
}

inline constexpr LaneOrder LANE_ORDER = lane_order();

// x's rows as the int8 products read them (int8_gemm.cpp, greedy.cpp): codes in 4-byte groups and
// per-block values (scales, sums), either one tile row-major (codes (M, K), values (M, KB)) or in
// row tiles: codes (T, KB, 8, ROWS, 4), values (T, KB, ROWS), so that a tile's broadcasts read one
// stream at fixed offsets (eight row pointers spilled general registers). ROWS: rows a tile, 8
// int32 sums and 8 fp32 outputs in registers (6, 10 and 12 rows measured no faster, 12 spilled).
constexpr int ROWS = 8;

// Where row r's codes k = 4j .. 4j + 3 of block b are (K = KB · QK); for r < ROWS, from its tile's start
template <bool TILED>
constexpr int64_t x_code(int64_t r, int64_t b, int j, int64_t KB) {
  return TILED ? (((r / ROWS * KB + b) * 8 + j) * ROWS + r % ROWS) * 4 : (r * KB + b) * QK + 4 * j;
}

// Where row r's values of block b are; for r < ROWS, from its tile's start
template <bool TILED>
constexpr int64_t x_block(int64_t r, int64_t b, int64_t KB) {
  return TILED ? (r / ROWS * KB + b) * ROWS + r % ROWS : r * KB + b;
}

#ifdef __AVX512VNNI__
#include <immintrin.h>

// s += w (u8) · the 4 signed bytes at p, broadcast to every lane from memory inside vpdpbusd ({1to16}):
// GCC keeps _mm512_set1_epi32's broadcast a separate vpbroadcastd, one more front-end uop each
// (int8_gemm.cpp, greedy.cpp)
inline __m512i dpbusd_bcast(__m512i s, __m512i w, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(s) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return s;
}
#endif
