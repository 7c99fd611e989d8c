"""Decode-maximal batching on this box: the paper's Table 2 with paired rounds (issue 8, target 3).

    .venv/bin/python benchmarks/decode_maximal.py                # embedded model, 1 thread
    .venv/bin/python benchmarks/decode_maximal.py --threads 2
    .venv/bin/python benchmarks/decode_maximal.py --gguf-weights dequantize   # fp32 weights in memory
    .venv/bin/python benchmarks/decode_maximal.py --matmul-precision medium   # bf16 products (AVX512-BF16)
    .venv/bin/python benchmarks/decode_maximal.py --matmul-precision int8     # int8 products (AVX512-VNNI, or AVX2)
    .venv/bin/python benchmarks/decode_maximal.py --smoke --model HF_FOLDER   # CI smoke test
    .venv/bin/python benchmarks/decode_maximal.py --threads 2 --plot table2.png   # and as a figure
    PYTHONPATH=. python3 benchmarks/decode_maximal.py --model llama-7b --device cuda --dtype bfloat16 \
        --chunk 512 --decodes 4,16,32,64 --context 512 --rounds 10   # one 80 GB GPU (docs/BENCHMARKS.md)

One one-stage worker runs, in alternating rounds, the micro-batches whose difference is the
answer: a fresh prefill chunk of P tokens alone (with --chunk-cached, a later chunk of its prompt:
after --context cached tokens of its own, as most chunks are when long prompts are served); the
same chunk plus B decodes (each after --context cached tokens); and the B decodes alone. Per round,

    marginal cost of a piggybacked decode = (t[chunk + B decodes] − t[chunk]) / B
    cost of a decode alone               = t[B decodes] / B

and the figures are medians over rounds (the difference of two ~1 s forwards on a shared box
is noisy; pairing within a round cancels the drift); the same from each batch's fastest round is
printed next to it, and so is the slope of forward time over B fitted within each round over
all the mixed batches and the chunk alone (median over rounds). The slope is the marginal cost
the target names, and the steadiest estimate of it: a pair at B = 4 measures ~10 ms inside the
±50 ms spread of a 1 s forward on a shared box, a fit up to B = 32 measures ~60 ms. Its 90%
interval comes from resampling the rounds (bootstrap). Target: marginal ≤ ¼ of alone at B = 4.
Each forward is what ``stages.profile`` times: the layers plus the LM head on sampled rows.
Beside each B it prints what the target asks of the device: the rate at which a piggybacked
decode's own FLOPs (the mixed batch's over the chunk's, per decode) would have to run for a quarter
of a decode alone, as a multiple of the matmul rate below; above 1 the target asks a decode's whole
work, its memory-bound attention included, to outrun the device's own matmul.

Utilisation: each batch's model FLOPs (``plan_flops``: every token's linear layers, its attention
over the keys it sees, the LM head on sampled rows) over its median time, against the device's
matmul rate measured in the same run (``matmul_rate``: torch's square matmul in the dtype the
products ran in: bf16 where --matmul-precision medium took effect, else the model's; int8 products
are set against the fp32 rate too, torch having no int8 matmul of the same kind). The decode-maximal batch
(the chunk plus the most decodes) at that fraction is the issue's MFU on a GPU; on a CPU our own
GEMM can beat torch's matmul, so the fraction can pass 1 there.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from pp_runtime.batch import SeqChunk
from pp_runtime.chunk_budget import chunk_cost
from pp_runtime.config import DTYPES, KV_DTYPES, MATMUL_PRECISIONS, ModelConfig
from pp_runtime.profile_grid import Grid, Layout, Point, plan_chunks
from stages import triton_elementwise
from stages.attention import build_metadata, triton_decode
from stages.profile import build_worker, device_name, device_sync, fill_cache, forward_step
from stages.worker import StageWorker


TARGET = 0.25  # issue 8's target 3: a piggybacked decode's marginal cost ≤ ¼ of a decode alone at B = 4


def plan_flops(cfg: ModelConfig, chunks: tuple[SeqChunk, ...]) -> float:
    """Model FLOPs of one micro-batch: per token 2 × the layers' linear weights, plus its attention
    (QKᵀ and PV, 4 × q_size per key per layer) over the keys it sees (position p: p + 1, the
    causal half of a chunk only), plus 2 × H × V per sampled row for the LM head."""
    per_token = 2 * cfg.num_layers * cfg.linear_params
    layers = sum(chunk_cost(c.start, c.num_tokens, cfg.key_cost) for c in chunks) * per_token
    return layers + 2 * cfg.hidden_size * cfg.vocab_size * sum(c.sample is not None for c in chunks)


def matmul_rate(device: torch.device, dtype: torch.dtype, size: int, reps: int = 5) -> float:
    """FLOP/s of torch's (size × size) @ (size × size) in ``dtype`` on ``device``, the median of
    ``reps`` after a warm-up (what the device's matmul rate means here)."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    sync = device_sync(device)
    times = []
    for i in range(reps + 1):
        sync()
        t = time.perf_counter()
        a @ b
        sync()
        if i:
            times.append(time.perf_counter() - t)
    return 2 * size ** 3 / statistics.median(times)


def measure(model: str | None, chunks: list[int], decodes: list[int], context: int, threads: int, rounds: int,
            gguf_weights: str = "native", matmul_precision: str = "highest", kv_dtype: str = "auto",
            device: str = "cpu", dtype: str = "float32", attention: str = "auto", matmul_size: int = 0,
            profile: int = 0, cuda_decodes: tuple[str, ...] = (), cuda_elementwise: tuple[str, ...] = (),
            chunk_cached: bool = False) -> list[dict]:
    """One result per chunk size, way of running the decodes' attention (``decode_ways``) and way of
    running the elementwise ops (``elementwise_ways``), all on one worker (building a 7B random
    model takes a minute)."""
    torch.set_num_threads(threads)
    w = build_worker(model, device=device, dtype=dtype, attention=attention, threads=threads,
                     gguf_weights=gguf_weights, kv_dtype=kv_dtype, matmul_precision=matmul_precision)
    # against the rate of the products the chunk actually ran: bf16 where "medium" took effect (a
    # core with AVX512-BF16; batches of <= 12 rows still run fp32), else the model's dtype
    mm_dtype = torch.bfloat16 if w.reduced_linears["bf16"] else getattr(torch, dtype)
    size = matmul_size or (8192 if w.device.type == "cuda" else 2048)
    mm = {"dtype": str(mm_dtype).removeprefix("torch."), "size": size, "flop_s": matmul_rate(w.device, mm_dtype, size)}
    labels = {"context": context, "threads": threads, "rounds": rounds, "gguf_weights": gguf_weights,
              "matmul_precision": matmul_precision, "kv_cache_dtype": kv_dtype, "device": str(w.device),
              "device_name": device_name(w.device), "dtype": dtype, "attention": type(w.model.backend).__name__,
              "matmul": mm}
    out = []
    ways, elementwise = decode_ways(w, cuda_decodes), elementwise_ways(w, cuda_elementwise)
    try:
        for c in chunks:
            for way in ways:
                for ew in elementwise:
                    if hasattr(w.model.backend, "paged_cuda") and w.device.type == "cuda":  # CPU: way "cpu"
                        w.model.backend.paged_cuda = way != "gathered"
                        w.model.backend.decode_tuning = decode_tuning(way)
                    triton_elementwise.enabled = ew != "eager"
                    out.append({"chunk": c, "cuda_decode": way,
                                "elementwise": ew, **labels,
                                **_measure_chunk(w, c, decodes, context, rounds, mm["flop_s"], profile, chunk_cached)})
    finally:
        triton_elementwise.enabled = True
    return out


def elementwise_ways(w: StageWorker, asked: tuple[str, ...]) -> tuple[str, ...]:
    """The labels of how each result runs norms, RoPE, SiLU·mul and the K/V write: on CUDA those asked for of
    ``fused`` (stages/triton_elementwise.py) and ``eager`` (torch ops), by default whichever runs;
    on CPU ``cpu`` (the C++ kernels). Raises ValueError for a way that cannot run here."""
    if w.device.type != "cuda":
        if asked:
            raise ValueError("--cuda-elementwise compares the CUDA path's fused and eager elementwise ops")
        return ("cpu",)
    if w.fused_elementwise:  # the worker's own probe, at its load
        return asked or ("fused",)
    if "fused" in asked:
        raise ValueError("--cuda-elementwise fused: the Triton kernels cannot run here "
                         f"({triton_elementwise.unusable(w.dtype, w.device.index)})")
    return asked or ("eager",)


TUNING_KEYS = ("tokens", "num_warps", "num_stages", "splits", "dot")


def decode_tuning(way: str) -> dict[str, int]:
    """``paged:num_warps=2:splits=4`` -> the Triton decode kernel's knobs {num_warps: 2, splits: 4}
    (stages/attention/triton_decode.py); ``paged`` and ``gathered`` -> {}. Raises ValueError naming
    a knob or value it does not take."""
    name, *knobs = way.split(":")
    if name not in ("paged", "gathered") or (knobs and name != "paged"):
        raise ValueError(f"--cuda-decode takes paged[:KEY=VALUE...] and gathered, not {way!r}")
    tuning = {}
    for knob in knobs:
        key, _, value = knob.partition("=")
        if key not in TUNING_KEYS or not value.isdigit():
            raise ValueError(f"--cuda-decode {way!r}: {knob!r} is not KEY=INTEGER with KEY one of {', '.join(TUNING_KEYS)}")
        tuning[key] = int(value)
    return tuning


def decode_ways(w: StageWorker, asked: tuple[str, ...]) -> tuple[str, ...]:
    """The labels of the decode attention each result runs: on CUDA's torch backend those asked
    for of ``paged`` (K/V read in place by the Triton kernel) and ``gathered`` (copied out, then
    SDPA), by default whichever the backend takes; else the one path there is (``cpu``, or the
    backend's name). Raises ValueError for a way that cannot run here."""
    backend, cfg = w.model.backend, w.spec.source.config
    if w.device.type != "cuda" or not hasattr(backend, "paged_cuda"):
        if asked:
            raise ValueError("--cuda-decode compares the torch backend's two decode paths on CUDA")
        return (backend.name if w.device.type == "cuda" else "cpu",)
    q = torch.empty(1, cfg.num_heads // w.tp.size, cfg.head_size, device=w.device, dtype=w.dtype)
    kc = torch.empty(1, w.block_size, cfg.num_kv_heads // w.tp.size, cfg.head_size, device=w.device, dtype=w.kv_dtype)
    if triton_decode.usable(q, kc, kc):
        return asked or ("paged",)
    if any(way != "gathered" for way in asked):
        raise ValueError("--cuda-decode paged: the Triton decode kernel cannot run here "
                         f"({triton_decode.triton_missing() or 'head size or cache dtype'})")
    return asked or ("gathered",)


def _measure_chunk(w: StageWorker, chunk: int, decodes: list[int], context: int, rounds: int, rate: float,
                   profile: int, chunk_cached: bool = False) -> dict:
    sync = device_sync(w.device)
    # the layout gives the chunk's sequence room for context + chunk where the chunk is cached
    grid = Grid(prefill=(chunk,), prefill_with_context=(chunk,) if chunk_cached else (), decode=tuple(decodes),
                mixed_decode=tuple(decodes), mixed_prefill=chunk, context=context)
    layout = Layout(grid)
    w.kv_caches = []  # the last chunk's cache goes before this one's is allocated (a 7B model's is GBs)
    w.allocate_cache(layout.num_blocks)
    fill_cache(w)
    vocab = w.spec.source.config.vocab_size
    gen = random.Random(0)
    chunk_context = context if chunk_cached else 0  # the chunk's own cached tokens (0: a fresh prompt)
    points = {"chunk": Point("prefill", chunk, 0, chunk_context)}
    for b in decodes:
        points[f"mixed{b}"] = Point("mixed", chunk, b, context, chunk_cached)
        points[f"decode{b}"] = Point("decode", 0, b, context)
    plans = {k: plan_chunks(p, layout, vocab, gen) for k, p in points.items()}

    def run(chunks: tuple) -> tuple[float, float]:
        """(seconds until the step's results exist, seconds until the host had issued it all)."""
        sync()
        t = time.perf_counter()
        meta = build_metadata(chunks, w.block_size, w.device)
        ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long, device=w.device)
        with torch.inference_mode():
            forward_step(w.model, ids, meta, w.kv_caches)
        issued = time.perf_counter() - t
        sync()
        return time.perf_counter() - t, issued

    for chunks in plans.values():  # warm-up
        run(chunks)
    times: dict[str, list[float]] = {k: [] for k in plans}
    # On CUDA the host only queues kernels. A share of the step well under 1 means the host ran
    # ahead and the GPU set the pace. Near 1 it proves nothing alone: the host was the bottleneck
    # (an eager forward is ~40 launches a layer), or it waited on a full launch queue; a profiler
    # tells which (--profile). On a CPU the host does the work: ~1.
    host: dict[str, list[float]] = {k: [] for k in plans}
    for _ in range(rounds):
        for k, chunks in plans.items():
            total, issued = run(chunks)
            times[k].append(total)
            host[k].append(issued)
    slopes = _round_slopes(times, decodes)
    cfg = w.spec.source.config
    flops = {k: plan_flops(cfg, chunks) for k, chunks in plans.items()}
    achieved = {k: flops[k] / statistics.median(times[k]) for k in plans}
    top = f"mixed{max(decodes)}"
    out: dict = {"chunk_context": chunk_context, "flops": flops, "achieved_flop_s": achieved,
                 "host_issue_fraction": {k: statistics.median(host[k]) / statistics.median(times[k]) for k in plans},
                 "decode_maximal": {"batch": top, "flop_s": achieved[top], "fraction_of_matmul": achieved[top] / rate},
                 "chunk_ms": statistics.median(times["chunk"]) * 1e3, "by_batch": {},
                 "slope_ms_per_decode": statistics.median(slopes) * 1e3,
                 "slope_ms_90": [x * 1e3 for x in _bootstrap(lambda ix: statistics.median(slopes[i] for i in ix), rounds)]}
    if profile:
        out["profile"] = profile_ops(lambda: run(plans[top]), profile, w.device.type == "cuda")
    for b in decodes:
        marg = [(m - c) / b for m, c in zip(times[f"mixed{b}"], times["chunk"])]
        alone = [d / b for d in times[f"decode{b}"]]
        marg_med, alone_med = statistics.median(marg), statistics.median(alone)
        # second estimate, steadier against one-sided noise (a busy neighbour only ever adds time)
        marg_min = (min(times[f"mixed{b}"]) - min(times["chunk"])) / b
        alone_min = min(times[f"decode{b}"]) / b
        # The rate a piggybacked decode's own work (its row of every linear, its attention, its LM-head
        # row) must run at for its marginal cost to be TARGET of a decode alone. Above the device's
        # matmul rate the target asks more of that work than the device's own matmul does.
        needs = (flops[f"mixed{b}"] - flops["chunk"]) / b / (TARGET * alone_med)
        out["by_batch"][b] = {"marginal_ms": marg_med * 1e3, "alone_ms": alone_med * 1e3,
                              "target_needs_flop_s": needs, "target_needs_of_matmul": needs / rate,
                              "ratio": marg_med / alone_med,
                              "marginal_ms_of_minima": marg_min * 1e3, "alone_ms_min": alone_min * 1e3,
                              "ratio_of_minima": marg_min / alone_min,
                              "mixed_ms": statistics.median(times[f"mixed{b}"]) * 1e3,
                              "decode_only_ms": statistics.median(times[f"decode{b}"]) * 1e3,
                              "slope_ratio_90": _bootstrap(lambda ix: statistics.median(slopes[i] for i in ix)
                                                           / statistics.median(alone[i] for i in ix), rounds)}
    return out


def profile_ops(step: Callable[[], object], reps: int, cuda: bool, top: int = 12) -> list[dict]:
    """torch.profiler over ``reps`` steps: the ops that took the most self time (the device's on
    CUDA, the host's on a CPU), in ms per step, each with its share of the summed self time."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(reps):
            step()
    if cuda:  # the kernels alone: an op's self device time repeats its kernels' (counted twice)
        rows = [(e.key, e.self_device_time_total, e.count) for e in prof.key_averages()
                if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        rows = [(e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()]
    total = sum(t for _, t, _ in rows) or 1.0
    rows.sort(key=lambda r: -r[1])
    return [{"op": k, "ms_per_step": t / reps / 1e3, "share": t / total, "calls_per_step": n / reps}
            for k, t, n in rows[:top]]


def _bootstrap(stat: Callable[[list[int]], float], rounds: int, draws: int = 2000) -> list[float]:
    """90% interval of ``stat`` over resampled round indices (seeded: reruns print the same)."""
    gen = random.Random(1)
    vals = sorted(stat([gen.randrange(rounds) for _ in range(rounds)]) for _ in range(draws))
    return [vals[int(0.05 * draws)], vals[int(0.95 * draws) - 1]]


def _round_slopes(times: dict[str, list[float]], decodes: list[int]) -> list[float]:
    """Per round, the least-squares slope of forward time over B (the chunk alone is B = 0):
    the marginal cost of a piggybacked decode from every mixed batch of the round at once."""
    bs = [0] + list(decodes)
    mean_b = sum(bs) / len(bs)
    den = sum((b - mean_b) ** 2 for b in bs)
    slopes = []
    for r in range(len(times["chunk"])):
        ts = [times["chunk"][r]] + [times[f"mixed{b}"][r] for b in decodes]
        mean_t = sum(ts) / len(ts)
        slopes.append(sum((b - mean_b) * (t - mean_t) for b, t in zip(bs, ts)) / den)
    return slopes


def report(r: dict, a: argparse.Namespace) -> None:
    """Print one chunk size's figures."""
    print(f"{r['device_name']} ({r['device']}, {r['dtype']}, {r['attention']}, decodes: {r['cuda_decode']}, "
          f"elementwise: {r['elementwise']}): chunk {r['chunk']} "
          f"({f'after {c} cached' if (c := r['chunk_context']) else 'fresh'}) ± decodes "
          f"at context {r['context']}, {r['threads']} thread(s), {r['rounds']} rounds, matmul precision "
          f"{a.matmul_precision}, KV {a.kv_cache_dtype}, GGUF weights {a.gguf_weights}; chunk alone {r['chunk_ms']:.1f} ms")
    print("   B   piggybacked ms/decode   alone ms/decode   ratio    (from minima: piggybacked, alone, ratio)"
          f"   target ratio <= {TARGET} at B = 4")
    for b, row in r["by_batch"].items():
        print(f"{b:4d}   {row['marginal_ms']:21.2f}   {row['alone_ms']:15.2f}   {row['ratio']:.3f}    "
              f"({row['marginal_ms_of_minima']:.2f}, {row['alone_ms_min']:.2f}, {row['ratio_of_minima']:.3f})")
    slope, (lo, hi) = r["slope_ms_per_decode"], r["slope_ms_90"]
    print(f"slope over B = 0, {a.decodes} within each round (median of rounds): {slope:.2f} ms per piggybacked "
          f"decode (90% interval {lo:.2f}–{hi:.2f})")
    for b, row in r["by_batch"].items():
        rlo, rhi = row["slope_ratio_90"]
        print(f"   / alone at B = {b}: {slope / row['alone_ms']:.3f} (90% interval {rlo:.3f}–{rhi:.3f}); "
              f"a ratio of {TARGET} needs a piggybacked decode's work at {row['target_needs_flop_s'] / 1e12:.3f} TFLOP/s "
              f"= {row['target_needs_of_matmul']:.2f}× the matmul rate")
    mm, dm = r["matmul"], r["decode_maximal"]
    print(f"device matmul rate ({mm['dtype']}, {mm['size']}³, torch): {mm['flop_s'] / 1e12:.3f} TFLOP/s; "
          "model FLOPs per batch over its median time:")
    for k, f in r["achieved_flop_s"].items():
        issue = f"   issued by the host in {r['host_issue_fraction'][k]:.2f} of it" if r["device"] != "cpu" else ""
        print(f"   {k:10s} {r['flops'][k] / 1e9:10.2f} GFLOP   {f / 1e12:8.3f} TFLOP/s   {f / mm['flop_s']:6.3f} of matmul"
              + issue)
    print(f"decode-maximal batch ({dm['batch']}): {dm['flop_s'] / 1e12:.3f} TFLOP/s = "
          f"{dm['fraction_of_matmul']:.3f} of the matmul rate")
    for row in r.get("profile", []):
        print(f"   {row['ms_per_step']:8.3f} ms/step {row['share']:6.1%} {row['calls_per_step']:7.1f} calls  {row['op'][:90]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--chunk", default="256", help="prefill chunk size(s), comma-separated: one worker runs each")
    ap.add_argument("--decodes", default="2,4,8,16,32")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--chunk-cached", action="store_true",
                    help="the chunk continues its prompt after --context cached tokens of its own (attention over "
                         "them too), where by default it is the prompt's first")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    ap.add_argument("--json", default=None,
                    help="write the figures here too: one result as a dict, several (chunks × --cuda-decode × "
                         "--cuda-elementwise) as a list")
    ap.add_argument("--plot", default=None, help="draw them to this PNG too (decode_maximal_plot.py; the first result)")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="also run torch.profiler over this many decode-maximal steps and print the top ops")
    ap.add_argument("--gguf-weights", choices=("native", "dequantize"), default="native",
                    help="GGUF matrices as stored blocks (default) or as fp32")
    ap.add_argument("--matmul-precision", choices=MATMUL_PRECISIONS, default="highest",
                    help="medium: products of > 12 rows on bf16 inputs (AVX512-BF16): the chunk's, and a "
                         "decode-only batch's from B = 13; B <= 12 stays fp32")
    ap.add_argument("--kv-cache-dtype", choices=KV_DTYPES, default="auto")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=DTYPES, default="float32", help="the model's weights and activations")
    ap.add_argument("--attention", choices=("torch", "xformers", "auto"), default="auto",
                    help="auto: xformers on CUDA where its operators run, else torch SDPA")
    ap.add_argument("--cuda-decode", default="",
                    help="on CUDA with --attention torch, how decodes read K/V, comma-separated to compare: paged (in "
                         "place, the Triton kernel; paged:num_warps=2:splits=4 and the like set its tokens, num_warps, "
                         "num_stages, splits), gathered (copied out, then SDPA); default: the backend's own")
    ap.add_argument("--cuda-elementwise", default="",
                    help="on CUDA, how norms, RoPE, SiLU·mul and the K/V write run, comma-separated to compare: fused (one Triton "
                         "kernel each) and eager (torch ops); default: fused where it runs")
    ap.add_argument("--matmul-size", type=int, default=0,
                    help="side of the square matmul that measures the device's rate (0: 8192 on CUDA, 2048 on CPU)")
    a = ap.parse_args()
    try:
        for way in filter(None, a.cuda_decode.split(",")):
            decode_tuning(way)
    except ValueError as e:
        raise SystemExit(f"decode_maximal: {e}") from None
    if a.cuda_elementwise and set(a.cuda_elementwise.split(",")) - {"fused", "eager"}:
        raise SystemExit(f"decode_maximal: --cuda-elementwise takes fused and/or eager, not {a.cuda_elementwise!r}")
    if a.smoke:
        a.chunk, a.decodes, a.context, a.rounds, a.matmul_size = "16", "2", 16, 2, a.matmul_size or 256
    try:
        rs = measure(a.model, [int(c) for c in a.chunk.split(",")], [int(b) for b in a.decodes.split(",")], a.context,
                     a.threads, a.rounds, a.gguf_weights, a.matmul_precision, a.kv_cache_dtype, a.device, a.dtype,
                     a.attention, a.matmul_size, a.profile, tuple(filter(None, a.cuda_decode.split(","))),
                     tuple(filter(None, a.cuda_elementwise.split(","))), a.chunk_cached)
    except ValueError as e:  # a bad model, device, dtype or backend: one line, no traceback
        raise SystemExit(f"decode_maximal: {e}") from None
    for r in rs:
        report(r, a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rs[0] if len(rs) == 1 else rs, f, indent=1)
    if a.plot:
        from decode_maximal_plot import plot_table2  # same directory: run as a script
        print(f"figure: {plot_table2(rs[0], Path(a.plot))}")


if __name__ == "__main__":
    main()
