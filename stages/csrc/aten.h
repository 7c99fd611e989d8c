// What the kernels take of torch: tensors and TORCH_CHECK, the factories they allocate with, and
// at::parallel_for. Not <torch/extension.h>: it brings pybind11 and torch's whole C++ API (~63 s
// of compile on the 2-core boxes, against ~10 s for this), and the tests build the kernels once per
// ISA. bindings.cpp adds torch's pybind11 casters to this, and nothing else does.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
