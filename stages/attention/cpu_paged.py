"""Paged decode attention on CPU: a small C++ kernel that reads K/V blocks where they lie.

The torch path gathers every decode's blocks into a contiguous (B, L, H_kv, D) copy per layer
and then runs SDPA over it: the copy is written once and read twice. This kernel walks each
sequence's block table: scores of the G query heads of a KV head against each K row, a softmax
over them, then the weighted V rows, so K/V are read once and nothing is written but the output.
Built on first use with torch's JIT extension loader (g++, ninja) for the host CPU
(-march=native; it is built where it runs); ``scripts/setup.sh`` builds it ahead so that no
run pays the ~30-60 s compile. Where it cannot be built, ``available()``
is False and the torch path runs.

    out = paged_decode(q, k_cache, v_cache, tables, lens, scale)
    # q (B, H, D) fp32; caches (NB, BS, H_kv, D); tables (B, nb) int64 block ids; lens (B,) int64
"""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch

_SOURCE = Path(__file__).with_name("cpu_paged.cpp")
_lock = threading.Lock()
_module: object | None = None
_failed: str | None = None


def _load() -> object | None:
    global _module, _failed
    if _module is not None or _failed is not None:  # every decode layer asks: no lock once settled
        return _module
    with _lock:
        if _module is None and _failed is None:
            try:
                from torch.utils.cpp_extension import load
                # -fopenmp: at::parallel_for is header code that splits work only under OpenMP
                _module = load("pp_runtime_cpu_paged", sources=[str(_SOURCE)],
                               extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                               extra_ldflags=["-fopenmp"], verbose=False)
            except Exception as exc:  # no compiler, no ninja, an odd CPU: the torch path still works
                _failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                print(f"pp_runtime: CPU paged-attention kernel unavailable ({_failed}); using the torch path",
                      file=sys.stderr)
    return _module


def available() -> bool:
    return _load() is not None


def status() -> str:
    """'ready' or why not (scripts/setup.sh prints it after building)."""
    return "ready" if available() else f"not built ({_failed})"


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, scale: float) -> torch.Tensor:
    """(B, H, D) attention of each decode over the first lens[b] slots of its block table."""
    return _load().paged_decode(q.contiguous(), k_cache, v_cache, tables, lens, scale)

