// Block-quantized panels (GGUF Q4_0 / Q4_1 / Q8_0 weights kept as stored) to fp32: the
// dequantizing steps that the quantized products (gemm_quant.cpp, gemm_few_rows.cpp) and the bf16
// one (gemm_bf16.cpp) run inside their loops, whence a header of inline functions and templates
// (in an anonymous namespace, as gemm_common.h).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "panels.h"
#include "vec.h"

namespace {

// A panel's K is cut into blocks of QK = 32; block b of panel p is QB bytes: scale d[16] and
// offset m[16] (fp16, one per output column, widened exactly: panels.h), then the 32 x 16 codes: u4 — rows 2i and 2i + 1 in
// 16 bytes, byte j holding column j of row 2i (low nibble) and of row 2i + 1 (high), so one byte
// load widened to 16 lanes gives two rows' columns in order — or s8, row k in 16 bytes. The weight
// is w = d·q + m, computed as one FMA: d·q is exact in fp32 (an fp16 scale times a 4- or 8-bit
// code), so it rounds once, as the gguf package's (d * q) + m does: the same fp32 weights.

#ifdef PP_AVX2
// row r of one u4 block -> its 16 codes, one byte per column in order
inline __m128i u4_row(const uint8_t* codes, int64_t r) {
  const __m128i pair = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + r / 2 * 16));
  return _mm_and_si128(_mm_srl_epi16(pair, _mm_cvtsi32_si128(4 * static_cast<int>(r & 1))), _mm_set1_epi8(0x0F));
}

// row r of one block -> its 16 fp32 weights in w0 (columns 0-7), w1 (8-15); d, m: the block's
// scales, loaded by the caller
template <bool U4>
inline void dequant_regs(const uint8_t* codes, int64_t r, __m256 d0, __m256 d1, __m256 m0, __m256 m1, __m256& w0,
                         __m256& w1) {
  __m256 f0, f1;
  if constexpr (U4) {
    const __m128i q = u4_row(codes, r);
    f0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
    f1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)));
  } else {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + r * 16));
    f0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    f1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
  }
  w0 = _mm256_fmadd_ps(f0, d0, m0);
  w1 = _mm256_fmadd_ps(f1, d1, m1);
}

// the same, stored to o[0..16)
template <bool U4>
inline void dequant_row(const uint8_t* codes, int64_t r, __m256 d0, __m256 d1, __m256 m0, __m256 m1, float* o) {
  __m256 w0, w1;
  dequant_regs<U4>(codes, r, d0, d1, m0, m1, w0, w1);
  _mm256_storeu_ps(o, w0);
  _mm256_storeu_ps(o + 8, w1);
}

#ifdef PP_AVX512
// row r of one block -> its 16 fp32 weights in one 16-lane register (the same FMA per weight as
// dequant_regs)
template <bool U4>
inline __m512 dequant_zmm(const uint8_t* codes, int64_t r, __m512 d, __m512 m) {
  if constexpr (U4) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(u4_row(codes, r))), d, m);
  } else {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + r * 16));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d, m);
  }
}

// rows 2i and 2i + 1 of one u4 block -> their 16 codes each as fp32 (lo, hi): the pair's 16 bytes
// widened to 16 lanes once; vpermps from {0, 1, ..., 15} reads only the low 4 bits of each lane,
// so it masks and converts row 2i in one instruction, and row 2i + 1 after a shift by 4. Two rows
// in four instructions: the row-at-a-time layout took four per row (broadcast, widen, shift,
// permute), and at 1-4 rows those, not the FMAs, bound the product on a core with one 512-bit
// FMA per cycle (Zen 4: decode steps of 1 / 4 rows 0.90 / 0.94 of the time, docs/BENCHMARKS.md)
inline void codes_u4_pair(const uint8_t* codes, int64_t i, __m512 levels, __m512& lo, __m512& hi) {
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i * 16)));
  lo = _mm512_permutexvar_ps(q, levels);
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), levels);
}

// rows 2i and 2i + 1 of one block -> their 16 fp32 weights each (the same FMA per weight as
// dequant_zmm); levels: {0, 1, ..., 15}, for codes_u4_pair
template <bool U4>
inline void dequant_pair_zmm(const uint8_t* codes, int64_t i, __m512 d, __m512 m, __m512 levels, __m512& w0,
                             __m512& w1) {
  if constexpr (U4) {
    __m512 lo, hi;
    codes_u4_pair(codes, i, levels, lo, hi);
    w0 = _mm512_fmadd_ps(lo, d, m);
    w1 = _mm512_fmadd_ps(hi, d, m);
  } else {
    w0 = dequant_zmm<false>(codes, 2 * i, d, m);
    w1 = dequant_zmm<false>(codes, 2 * i + 1, d, m);
  }
}

inline __m512 u4_levels() { return _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0); }
#endif
#endif

// fn(block, r0, r1, at) for panel rows [k0, k0 + kc), block by block: rows [r0, r1) of the block
// whose QB bytes start at block, row r of it being slab row at + r (a slab need not start or end on
// a block: K = 288 cuts into 2 x 144)
template <bool U4, typename Fn>
void for_blocks(const uint8_t* panel, int64_t k0, int64_t kc, const Fn& fn) {
  constexpr int64_t QB = U4 ? QB_U4 : QB_S8;
  for (int64_t k = k0, ke = k0 + kc; k < ke;) {
    const int64_t r0 = k % QK, r1 = std::min<int64_t>(QK, r0 + ke - k);
    fn(panel + (k / QK) * QB, r0, r1, k - k0 - r0);
    k += r1 - r0;
  }
}

// buf (kc x 16) = panel rows [k0, k0 + kc) as fp32
template <bool U4>
void dequant(const uint8_t* panel, int64_t k0, int64_t kc, float* buf) {
  for_blocks<U4>(panel, k0, kc, [buf](const uint8_t* blk, int64_t r0, int64_t r1, int64_t at) {
    float* o = buf + at * NR;
#if defined(PP_AVX512)
    const __m512 d = block_d16(blk), m = block_m16(blk);
    for (int64_t r = r0; r < r1; ++r) _mm512_storeu_ps(o + r * NR, dequant_zmm<U4>(blk + DM, r, d, m));
#elif defined(PP_AVX2)
    const __m256 d0 = block_d8(blk, 0), d1 = block_d8(blk, 1), m0 = block_m8(blk, 0), m1 = block_m8(blk, 1);
    for (int64_t r = r0; r < r1; ++r) dequant_row<U4>(blk + DM, r, d0, d1, m0, m1, o + r * NR);
#else
    for (int64_t r = r0; r < r1; ++r)
      for (int j = 0; j < NR; ++j) {
        float q;
        if constexpr (U4) {
          const uint8_t byte = blk[DM + r / 2 * 16 + j];
          q = static_cast<float>(r % 2 ? byte >> 4 : byte & 0x0F);
        } else {
          q = static_cast<float>(static_cast<int8_t>(blk[DM + r * 16 + j]));
        }
        o[r * NR + j] = std::fma(q, block_d(blk, j), block_m(blk, j));
      }
#endif
  });
}

}  // namespace
