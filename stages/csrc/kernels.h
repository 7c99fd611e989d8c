// The kernels' entry points, one declaration each: bindings.cpp exposes them to Python,
// stack.h calls them in a stage's layer loop.
#pragma once
#include "aten.h"

#include <string>
#include <vector>

at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor tables,
                        at::Tensor lens, double scale, bool bf16, int64_t bf16_over);  // paged_decode.cpp
bool decode_bf16();  // whether paged_decode has its bf16 path (paged_decode.cpp)
// how paged_decode cuts its tasks (costs) into `parts` runs for its threads: the runs' edges
std::vector<int64_t> cost_runs(const std::vector<int64_t>& costs, int64_t parts);
void paged_prefill(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor table,
                   int64_t ctx, double scale, at::Tensor out, bool bf16);  // paged_prefill.cpp
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps);  // elementwise.cpp
at::Tensor add_rms_norm_(at::Tensor h, at::Tensor x, at::Tensor w, double eps);
at::Tensor silu_mul(at::Tensor gu);
void rope_(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin);
at::Tensor transpose(at::Tensor x);
void write_kv_(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots);
at::Tensor pack_weight(at::Tensor w);  // gemm.cpp
at::Tensor packed_linear(at::Tensor x, at::Tensor p, c10::optional<at::Tensor> bias, bool bf16);
at::Tensor quant_linear(at::Tensor x, at::Tensor q, c10::optional<at::Tensor> bias,
                        bool bf16);  // gemm_quant.cpp
// either of the two above, by the weight's panel format (uint8: block-quantized) (gemm.cpp)
at::Tensor panel_linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias, bool bf16);
// the bf16 path's weight words kept (pack_weight_bf16) and the product over them (gemm_bf16.cpp)
at::Tensor pack_weight_bf16(at::Tensor w);
at::Tensor bf16_linear(at::Tensor x, at::Tensor wb);
bool bf16_products();  // gemm_bf16.cpp
// int8 products over block-quantized panels (int8_gemm.cpp): x rounded per block of 32 to int8
std::vector<at::Tensor> quantize_rows(at::Tensor x);
// gated: x is [gate | up] (M, 2K), the product takes silu(gate) · up
at::Tensor int8_linear(at::Tensor x, at::Tensor q, c10::optional<at::Tensor> bias, bool gated);
std::string isa();  // gemm.cpp
std::vector<at::Tensor> greedy_candidates(at::Tensor approx, at::Tensor xn, at::Tensor wn,
                                          double c, double floor);  // greedy.cpp
std::vector<at::Tensor> int8_candidates(at::Tensor xu, at::Tensor xs, at::Tensor eb, at::Tensor bmax,
                                        at::Tensor q, at::Tensor bn, double floor);
std::vector<at::Tensor> quantize_blocks(at::Tensor x, at::Tensor block_max);
at::Tensor gather_columns(at::Tensor w, at::Tensor ids);
at::Tensor panel_rows(at::Tensor w, at::Tensor ids);  // embedding.cpp
bool int8_products();  // int8_gemm.cpp: int8_linear runs here
// whether matmul precision "int8" takes int8_linear for weight w: block-quantized panels whose
// int8 product is the faster one on this build
bool int8_takes(const at::Tensor& w);
bool int8_head();  // greedy_int8.cpp: int8_candidates runs here
