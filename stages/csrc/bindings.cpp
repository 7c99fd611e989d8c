// The Python module of the CPU kernels (stages/cpu_kernels.py loads it).
#include <torch/extension.h>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                           torch::Tensor lens, double scale);  // paged_decode.cpp
void paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor table,
                   int64_t ctx, double scale, torch::Tensor out);  // paged_prefill.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);  // elementwise.cpp
torch::Tensor add_rms_norm_(torch::Tensor h, torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor silu_mul(torch::Tensor gu);
void rope_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin);
torch::Tensor transpose(torch::Tensor x);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (fp32, CPU)");
  m.def("paged_prefill", &paged_prefill, "paged causal prefill attention of one chunk, into out (fp32, CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm over rows (fp32, CPU)");
  m.def("add_rms_norm_", &add_rms_norm_, "h += x in place, then RMSNorm of h (fp32, CPU)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused (T, 2I) gate/up output (fp32, CPU)");
  m.def("rope_", &rope_, "rotate-half RoPE in place over (T, heads, D) rows (fp32, CPU)");
  m.def("transpose", &transpose, "contiguous transpose of a contiguous (R, C) matrix (fp32, CPU)");
}
