// The Python module of the CPU kernels (stages/cpu_kernels.py loads it).
// Not <torch/extension.h>: it also brings torch's whole C++ frontend (torch/all.h), ~40 of its
// ~63 s compile here, and the tests build this file once per ISA. aten.h and torch's pybind11
// casters (at::Tensor, optionals, vectors) are all the bindings use.
#include <torch/csrc/utils/pybind.h>

#include "aten.h"

#include "kernels.h"
#include "stack.h"
#include "vec.h"  // kBf16MinTokens

static void bind_layer_stack(pybind11::module& m) {
  namespace py = pybind11;
  using layer_stack::LayerStack, layer_stack::StepMeta;
  py::class_<StepMeta>(m, "StepMeta", py::module_local())  // local: one build per ISA in a process
      .def(py::init([](at::Tensor positions, at::Tensor slots, std::vector<int64_t> q_lens,
                       std::vector<int64_t> ctx_lens, std::vector<at::Tensor> tables,
                       c10::optional<at::Tensor> decode_tables, c10::optional<at::Tensor> decode_lens) {
        return StepMeta{positions, slots, q_lens, ctx_lens, tables, decode_tables, decode_lens};
      }));
  py::class_<LayerStack>(m, "LayerStack", py::module_local())
      .def(py::init<std::vector<at::Tensor>, int64_t, int64_t, int64_t, double, double, std::string, bool,
                    int64_t, at::Tensor, at::Tensor>())
      .def("forward", &LayerStack::forward, py::arg("h"), py::arg("caches"), py::arg("meta"),
           py::arg("times") = py::none(), py::arg("keep") = py::none(), py::call_guard<py::gil_scoped_release>(),
           "the stage's decoder layers over h (T, H), as stages/model.py runs them on CPU");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (fp32 q, fp32, fp16 or fp8 K/V caches, CPU; bf16: bf16 products where taken)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("tables"), py::arg("lens"), py::arg("scale"),
        py::arg("bf16") = false, py::arg("bf16_over") = kBf16MinTokens);
  m.def("decode_bf16", &decode_bf16, "whether paged_decode has its bf16 path (AVX512-BF16 and AVX512-VBMI)");
  m.def("cost_runs", &cost_runs, "paged_decode's cut of tasks of these costs into runs of consecutive tasks of about equal cost, one a thread: the runs' edges (parts + 1)");
  m.def("paged_prefill", &paged_prefill, "paged causal prefill attention of one chunk, into out (fp32 q, fp32, fp16 or fp8 K/V caches, CPU; bf16: bf16 products)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("table"), py::arg("ctx"), py::arg("scale"),
        py::arg("out"), py::arg("bf16") = false);
  m.def("rms_norm", &rms_norm, "RMSNorm over rows (fp32, CPU)");
  m.def("add_rms_norm_", &add_rms_norm_, "h += x in place, then RMSNorm of h (fp32, CPU)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused (T, 2I) gate/up output (fp32, CPU)");
  m.def("rope_", &rope_, "rotate-half RoPE in place over (T, heads, D) rows (fp32, CPU)");
  m.def("pack_weight", &pack_weight, "(N, K) -> (N/16, K, 16) panels for packed_linear (fp32)");
  m.def("packed_linear", &packed_linear, "x wᵀ (+ bias) over a packed weight (fp32; bf16: bf16 products for > 12 rows, CPU)",
        py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(), py::arg("bf16") = false);
  m.def("quant_linear", &quant_linear, "x wᵀ (+ bias) over block-quantized (GGUF Q4/Q8) panels (bf16 as packed_linear, CPU)",
        py::arg("x"), py::arg("q"), py::arg("bias") = py::none(), py::arg("bf16") = false);
  m.def("panel_linear", &panel_linear, "quant_linear for uint8 (block-quantized) panels, packed_linear for fp32 ones",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none(), py::arg("bf16") = false);
  m.def("pack_weight_bf16", &pack_weight_bf16, "panels (fp32 or block-quantized) -> (N/16, K/2, 16) int32 words of bf16 pairs for bf16_linear");
  m.def("bf16_linear", &bf16_linear, "x wᵀ in bf16 products over pack_weight_bf16's words (AVX512-BF16 builds, CPU)");
  m.def("bf16_products", &bf16_products, "whether packed_linear / quant_linear can take bf16 dot products (AVX512-BF16)");
  m.def("quantize_rows", &quantize_rows, "rows (M, K) -> int8 codes (M, K), per-block-of-32 scales and scale · Σ codes (M, K/32)");
  m.def("int8_linear", &int8_linear, "x wᵀ (+ bias) in int8 products: x quantized per block of 32, the weight's own Q4/Q8 codes (AVX512-VNNI + VBMI); gated: x = [gate | up], the product takes silu(gate) · up",
        py::arg("x"), py::arg("q"), py::arg("bias") = py::none(), py::arg("gated") = false);
  m.def("isa", &isa, "the vector instructions this build's kernels use: avx512+bf16, avx512, avx2 or scalar");
  m.def("greedy_candidates", &greedy_candidates,
        "vocab ids whose logit can still be a row's maximum given approximate logits and their error bound c·|x|·|w_v|");
  m.def("int8_candidates", &int8_candidates,
        "greedy_candidates over logits of block-quantized int8 rows against Q8_0 panels, computed and bounded in place (AVX512-VNNI)");
  m.def("quantize_blocks", &quantize_blocks,
        "rows -> int8_candidates' u8 codes + 128, block scales, error bounds and each row's largest bound");
  m.def("gather_columns", &gather_columns, "the panels (fp32 or block-quantized) of a weight's output columns ids");
  m.def("panel_rows", &panel_rows, "rows ids of the (V, K) table held by weight panels (fp32 or block-quantized), as float32 (T, K)");
  m.def("int8_products", &int8_products, "whether int8_linear runs here (AVX512-VNNI and VBMI, or AVX2)");
  m.def("int8_takes", &int8_takes, "whether matmul precision int8 takes int8_linear for these panels here (AVX2: Q4 ones)");
  m.def("int8_head", &int8_head, "whether int8_candidates runs here (AVX512-VNNI and VBMI)");
  m.def("write_kv_", &write_kv_, "new tokens' K/V rows into the paged caches at their slots (fp32 or fp16 caches, CPU)");
  m.def("transpose", &transpose, "contiguous transpose of a contiguous (R, C) matrix (fp32, CPU)");
  bind_layer_stack(m);
}
