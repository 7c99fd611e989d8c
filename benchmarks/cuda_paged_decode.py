"""Decode attention on CUDA alone: the Triton paged kernel's variants against the gather + SDPA path.

    PYTHONPATH=. python3 benchmarks/cuda_paged_decode.py                 # LLaMA-7B's heads, 64 decodes × 512
    PYTHONPATH=. python3 benchmarks/cuda_paged_decode.py --json out.json --context 2048

One layer's paged K/V cache (blocks shuffled, as a long-running cache leaves them), the decodes'
attention timed with CUDA events: the torch backend's decode path gathered and paged (K/V write
and output copy included), then the Triton kernel alone in each tuning (median of --reps after a warm-up). Each way reads the decodes'
K/V at least once, so the figure of merit is bytes of K/V over time against the card's HBM rate
(H200: ~4.3 TB/s measured by a device copy). A layer's K/V for 64 × 512 keys is 537 MB, well
past the 60 MB L2, so each call streams from HBM.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from pp_runtime.batch import SeqChunk
from stages.attention import TorchAttention, build_metadata, triton_decode

VARIANTS = {  # name: paged_decode's tuning knobs ("paged": its defaults; spans by choose_splits where unset)
    "paged": {},
    "paged-dot": {"dot": 1},  # the products by tl.dot (the default over a cache of q's dtype)
    "paged-sums": {"dot": 0},  # the products in fp32 by tl.sum (the default over an fp8 cache)
    "paged-unaligned": {"aligned": False},
    "paged-tokens16": {"tokens": 16},
    "paged-tokens64": {"tokens": 64},
    "paged-warps1": {"num_warps": 1},
    "paged-warps2": {"num_warps": 2},
    "paged-warps4": {"num_warps": 4},
    "paged-warps8": {"num_warps": 8},
    "paged-warps2-tokens16": {"num_warps": 2, "tokens": 16},
    "paged-warps2-tokens64": {"num_warps": 2, "tokens": 64},
    "paged-stages1": {"num_stages": 1},
    "paged-stages2": {"num_stages": 2},
    "paged-stages4": {"num_stages": 4},
    **{f"paged-splits{n}": {"splits": n} for n in (1, 2, 4, 8, 16)},
}


def timed(fn: callable, reps: int) -> float:
    """Median ms of ``fn`` over ``reps`` calls, each between CUDA events."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decodes", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-dtype", default="", help="the cache's dtype if not --dtype's: float8_e4m3fn (--kv-cache-dtype fp8)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_paged_decode: needs a CUDA device")
    dev, dtype, bs = torch.device("cuda"), getattr(torch, a.dtype), a.block_size
    nb = -(-a.context // bs)
    order = torch.randperm(a.decodes * nb).tolist()
    chunks = tuple(SeqChunk(i, a.context - 1, (0,), tuple(order[i * nb:(i + 1) * nb]), False, None)
                   for i in range(a.decodes))
    meta = build_metadata(chunks, bs, dev)
    kv_dtype = getattr(torch, a.kv_dtype) if a.kv_dtype else dtype
    kc, vc = (torch.randn(a.decodes * nb, bs, a.kv_heads, a.head_size, device=dev).to(kv_dtype) for _ in range(2))
    q = torch.randn(a.decodes, a.heads, a.head_size, device=dev, dtype=dtype)
    k, v = (torch.randn(a.decodes, a.kv_heads, a.head_size, device=dev, dtype=dtype) for _ in range(2))
    lens, scale = torch.tensor(meta.ctx_lens, device=dev), a.head_size ** -0.5
    # the backend's whole decode path either way (its K/V write and output copy included), then
    # the kernel alone in each tuning
    gathered, paged = TorchAttention(scale), TorchAttention(scale)
    gathered.paged_cuda = False
    ways = {"gathered": lambda: gathered.forward(q, k, v, kc, vc, meta),
            "paged-backend": lambda: paged.forward(q, k, v, kc, vc, meta)}
    ways |= {name: (lambda kw=kw: triton_decode.paged_decode(q, kc, vc, meta.decode_tables, lens, scale, **kw))
             for name, kw in VARIANTS.items()}
    ref = ways["gathered"]().float()
    kv_bytes = 2 * a.decodes * a.context * a.kv_heads * a.head_size * kc.element_size()
    out = {"device": torch.cuda.get_device_name(), **vars(a), "kv_bytes": kv_bytes, "ms": {}, "tb_s": {}, "max_err": {}}
    for name, fn in ways.items():
        out["max_err"][name] = (fn().float() - ref).abs().max().item()
        out["ms"][name] = timed(fn, a.reps)
        out["tb_s"][name] = kv_bytes / out["ms"][name] / 1e9
        print(f"{name:16s} {out['ms'][name]:8.3f} ms  {out['tb_s'][name]:6.2f} TB/s of K/V  "
              f"max |diff| vs gathered {out['max_err'][name]:.2e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
