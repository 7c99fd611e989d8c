"""How close a prefill chunk's forward runs to its pure matrix products (issue 8, target 2).

    .venv/bin/python benchmarks/chunk_overhead.py                 # embedded model, chunk 256, 1 thread
    .venv/bin/python benchmarks/chunk_overhead.py --threads 2
    .venv/bin/python benchmarks/chunk_overhead.py --threads 2 --matmul-precision int8 --kv-cache-dtype fp8
    .venv/bin/python benchmarks/chunk_overhead.py --smoke --model HF_FOLDER   # CI smoke test

"Forward" is everything a one-stage worker does for one micro-batch holding a fresh prompt
chunk of --chunk tokens whose last row is sampled: ``StageWorker.execute`` on the wire plan
(metadata, embedding, every layer with its attention, norms, RoPE and KV writes, the LM head
on the sampled row, sampling, Python). "Matmuls" are the same products with the same weights
and shapes and nothing else, through the same GEMM (``stages.layers.linear``: on CPU fp32 the
packed kernel over the worker's packed weights; each linear's own products, so with
--matmul-precision int8 the int8 ones over the GGUF blocks): per layer qkv, o, gate_up, down at
--chunk rows (the last layer's o, gate_up and down at the one sampled row, as the forward runs
them), plus the LM head on one row. The two run in alternating rounds and the ratio is taken per round (forward ÷ the
matmuls of the same round), so that a shared box's drift hits both alike; the median of the
per-round ratios is the figure. A bucketed pass (stages.profile's timers) then says where the
non-matmul time goes.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pp_runtime.batch import MicroBatch, SampleSpec, SeqChunk
from pp_runtime.config import KV_DTYPES, MATMUL_PRECISIONS
from stages.layers import linear
from stages.op_timing import OpTimer, instrument
from stages.profile import build_worker


def chunk_plan(chunk: int, vocab: int, block_size: int) -> tuple:
    ids = torch.randint(3, vocab, (chunk,), generator=torch.Generator().manual_seed(0)).tolist()
    table = tuple(range(-(-chunk // block_size)))
    return MicroBatch(0, (SeqChunk(0, 0, tuple(ids), table, True, SampleSpec(0.0, 1.0, 0, 0)),)).to_wire()


def matmuls(model: torch.nn.Module, chunk: int) -> callable:
    """The forward's matrix products alone, on random inputs of the same shapes."""
    cfg = model.cfg
    x, xq, xi = torch.randn(chunk, cfg.hidden_size), torch.randn(chunk, cfg.q_size), \
        torch.randn(chunk, cfg.intermediate_size)

    last = len(model.layers) - 1

    @torch.inference_mode()
    def run() -> None:
        for i, layer in enumerate(model.layers):
            # past the last attention the forward carries the sampled row only (StageModel.forward: keep)
            r = chunk if i < last else 1
            for inp, mod in ((x, layer.self_attn.qkv_proj), (xq[:r], layer.self_attn.o_proj),
                             (x[:r], layer.mlp.gate_up_proj), (xi[:r], layer.mlp.down_proj)):
                linear(inp, mod.weight, products=mod.products)
        linear(x[:1], model.lm_head.weight, products=model.lm_head.products)
    return run


def timed(f: callable) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def measure(model: str | None, chunk: int, threads: int, rounds: int, matmul_precision: str = "highest",
            kv_dtype: str = "auto") -> dict:
    torch.set_num_threads(threads)
    w = build_worker(model, threads=threads, matmul_precision=matmul_precision, kv_dtype=kv_dtype)
    w.allocate_cache(-(-chunk // w.block_size))
    wire = chunk_plan(chunk, w.spec.source.config.vocab_size, w.block_size)
    fwd, mm = (lambda: w.execute(wire)), matmuls(w.model, chunk)
    for f in (fwd, mm, fwd, mm):  # warm-up
        f()
    t_fwd, t_mm = [], []
    for _ in range(rounds):
        t_fwd.append(timed(fwd))
        t_mm.append(timed(mm))
    ratios = [a / b for a, b in zip(t_fwd, t_mm)]
    timer = OpTimer(lambda: None)
    with instrument(w.model, timer):  # one bucketed pass: where the rest goes
        best = None
        for _ in range(max(3, rounds // 4)):
            timer.reset()
            total = timed(fwd)
            if best is None or total < best[0]:
                best = (total, dict(timer.acc))
    total, acc = best
    linears = sum(v for k, v in acc.items() if k != "attn")
    return {"chunk": chunk, "threads": threads, "rounds": rounds, "matmul_precision": matmul_precision,
            "kv_cache_dtype": kv_dtype, "reduced_linears": dict(w.reduced_linears),  # which took bf16 / int8
            "forward_ms_min": min(t_fwd) * 1e3, "forward_ms_median": statistics.median(t_fwd) * 1e3,
            "matmul_ms_min": min(t_mm) * 1e3, "matmul_ms_median": statistics.median(t_mm) * 1e3,
            "ratio_median": statistics.median(ratios), "ratio_of_mins": min(t_fwd) / min(t_mm),
            "bucketed_total_ms": total * 1e3, "bucketed_linears_ms": linears * 1e3,
            "bucketed_attention_ms": acc["attn"] * 1e3, "bucketed_rest_ms": (total - linears - acc["attn"]) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--matmul-precision", choices=MATMUL_PRECISIONS, default="highest",
                    help="the linears' products, in the forward and in its matmuls alike")
    ap.add_argument("--kv-cache-dtype", choices=KV_DTYPES, default="auto")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    ap.add_argument("--json", default=None, help="write the figures here too")
    a = ap.parse_args()
    if a.smoke:
        a.chunk, a.rounds = 16, 3
    r = measure(a.model, a.chunk, a.threads, a.rounds, a.matmul_precision, a.kv_cache_dtype)
    print(f"chunk {r['chunk']}, {r['threads']} thread(s), {r['rounds']} alternating rounds, "
          f"matmul precision {a.matmul_precision}, K/V {a.kv_cache_dtype}")
    print(f"  forward (StageWorker.execute): min {r['forward_ms_min']:7.1f} ms  median {r['forward_ms_median']:7.1f} ms")
    print(f"  its matmuls alone:             min {r['matmul_ms_min']:7.1f} ms  median {r['matmul_ms_median']:7.1f} ms")
    print(f"  forward / matmuls: {r['ratio_median']:.3f} (median of per-round ratios; ratio of minima "
          f"{r['ratio_of_mins']:.3f}; target <= 1.15)")
    print(f"  bucketed pass: linears {r['bucketed_linears_ms']:.1f} ms, attention (incl. KV write) "
          f"{r['bucketed_attention_ms']:.1f} ms, everything else {r['bucketed_rest_ms']:.1f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
