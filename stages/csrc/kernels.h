// The kernels' entry points, one declaration each: bindings.cpp exposes them to Python,
// stack.cpp calls them in a stage's layer loop.
#pragma once
#include <torch/extension.h>

#include <string>
#include <vector>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                           torch::Tensor lens, double scale, bool bf16, int64_t bf16_over);  // paged_decode.cpp
bool decode_bf16();  // whether paged_decode has its bf16 path (paged_decode.cpp)
// how paged_decode cuts its tasks (costs) into `parts` runs for its threads: the runs' edges
std::vector<int64_t> cost_runs(const std::vector<int64_t>& costs, int64_t parts);
void paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor table,
                   int64_t ctx, double scale, torch::Tensor out, bool bf16);  // paged_prefill.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);  // elementwise.cpp
torch::Tensor add_rms_norm_(torch::Tensor h, torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor silu_mul(torch::Tensor gu);
void rope_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin);
torch::Tensor transpose(torch::Tensor x);
void write_kv_(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots);
torch::Tensor pack_weight(torch::Tensor w);  // gemm.cpp
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor p, c10::optional<torch::Tensor> bias, bool bf16);
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor q, c10::optional<torch::Tensor> bias,
                           bool bf16);  // gemm_quant.cpp
// either of the two above, by the weight's panel format (uint8: block-quantized) (gemm.cpp)
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, bool bf16);
// the bf16 path's weight words kept (pack_weight_bf16) and the product over them (gemm_bf16.cpp)
torch::Tensor pack_weight_bf16(torch::Tensor w);
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor wb);
bool bf16_products();  // gemm_bf16.cpp
// int8 products over block-quantized panels (int8_gemm.cpp): x rounded per block of 32 to int8
std::vector<torch::Tensor> quantize_rows(torch::Tensor x);
// gated: x is [gate | up] (M, 2K), the product takes silu(gate) · up
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor q, c10::optional<torch::Tensor> bias, bool gated);
std::string isa();  // gemm.cpp
std::vector<torch::Tensor> greedy_candidates(torch::Tensor approx, torch::Tensor xn, torch::Tensor wn,
                                             double c, double floor);  // greedy.cpp
std::vector<torch::Tensor> int8_candidates(torch::Tensor xu, torch::Tensor xs, torch::Tensor eb, torch::Tensor bmax,
                                           torch::Tensor q, torch::Tensor bn, double floor);
std::vector<torch::Tensor> quantize_blocks(torch::Tensor x, torch::Tensor block_max);
torch::Tensor gather_columns(torch::Tensor w, torch::Tensor ids);
torch::Tensor panel_rows(torch::Tensor w, torch::Tensor ids);  // embedding.cpp
bool int8_products();
