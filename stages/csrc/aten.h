// What the kernels take of torch: tensors and TORCH_CHECK, the factories they allocate with, and
// at::parallel_for. Not <torch/extension.h>: it brings pybind11 and torch's whole C++ API, ~25 s
// of each ~27 s compile of a source here, and the tests build the kernels four times (one per
// ISA). Only bindings.cpp, which binds the kernels and stack.h's LayerStack to Python,
// includes it.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
