"""Host time to issue one CUDA kernel: torch ops against each Triton kernel a layer launches.

    PYTHONPATH=. python3 benchmarks/cuda_launch_overhead.py                 # LLaMA-7B's shapes, 4 decodes
    PYTHONPATH=. python3 benchmarks/cuda_launch_overhead.py --json out.json --calls 500

A decode-only step of LLaMA-7B on an H200 is host-bound: 12.6 ms for ~3 ms of weights, ~375 µs of
host a layer for ~13 launches (docs/BENCHMARKS.md, "The second GPU run"). This splits that: each
way is called ``--calls`` times back to back on a decode step's tensors, whose kernels the GPU
finishes in a few µs, so the host's wall time per call until the last returns is its issue cost
(``issue_us``); ``done_us`` also waits for the GPU, and is close to ``issue_us`` only where the host
is the bound (else the queue filled and the figure is the GPU's).
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import torch
import torch.nn.functional as F

from stages import triton_elementwise as te
from stages.attention import triton_decode


def per_call_us(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    """(µs of host per call until the last is issued, µs per call until the GPU has run them all)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (issued - start) / calls * 1e6, (done - start) / calls * 1e6


def ways(b: int, heads: int, head_size: int, hidden: int, inter: int, context: int, dtype: torch.dtype,
         dev: torch.device) -> dict[str, Callable[[], object]]:
    """One decode step's worth of each launch the CUDA layers make, at LLaMA-like sizes (on CPU
    tensors only in Triton's interpreter: the tests call each way once)."""
    bs = 16
    x, y, out = (torch.randn(b, hidden, device=dev, dtype=dtype) for _ in range(3))
    w = torch.randn(hidden, device=dev, dtype=dtype)
    w16 = torch.randn(16, hidden, device=dev, dtype=dtype)
    gu = torch.randn(b, 2 * inter, device=dev, dtype=dtype)
    q, k, v = (torch.randn(b, heads, head_size, device=dev, dtype=dtype) for _ in range(3))
    nb = -(-context // bs)
    kc, vc = (torch.randn(b * nb, bs, heads, head_size, device=dev, dtype=dtype) for _ in range(2))
    tables = torch.arange(b * nb, device=dev).view(b, nb)
    lens = torch.full((b,), context, device=dev)
    slots = tables[:, -1] * bs + (context - 1) % bs
    positions = torch.full((b,), context - 1, device=dev)
    cos, sin = (torch.randn(context, head_size // 2, device=dev) for _ in range(2))
    scale = head_size ** -0.5
    return {
        "torch add (out=)": lambda: torch.add(x, y, out=out),
        "torch slice copy": lambda: x[:, :hidden // 2].contiguous(),
        "torch silu·mul, eager": lambda: te.eager_silu_mul(gu),
        "torch rms_norm, eager": lambda: te.eager_rms_norm(x, w, 1e-5),
        "torch linear, 16 outputs": lambda: F.linear(x, w16),
        "triton rms_norm": lambda: te.rms_norm(x, w, 1e-5),
        "triton add + rms_norm": lambda: te.add_rms_norm_(out, x, w, 1e-5),
        "triton rope": lambda: te.rope_(q, positions, cos, sin),
        "triton silu·mul": lambda: te.silu_mul(gu),
        "triton write_kv": lambda: te.write_kv_(k, v, kc, vc, slots),
        "triton paged_decode": lambda: triton_decode.paged_decode(q, kc, vc, tables, lens, scale, splits=1),
        "triton paged_decode, 2 spans + merge": lambda: triton_decode.paged_decode(q, kc, vc, tables, lens, scale,
                                                                                   splits=2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decodes", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_launch_overhead: needs a CUDA device")
    out = {"device": torch.cuda.get_device_name(), **vars(a), "issue_us": {}, "done_us": {}}
    for name, fn in ways(a.decodes, 32, 128, 4096, 11008, a.context, torch.bfloat16, torch.device("cuda")).items():
        out["issue_us"][name], out["done_us"][name] = per_call_us(fn, a.calls)
        print(f"{name:38s} {out['issue_us'][name]:7.1f} µs to issue  {out['done_us'][name]:7.1f} µs to run")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
