"""Per-operation stage profile: the paper's Table 2 and Figure 3 on this model and device.

One stage worker (pp = tp = 1) runs forward passes of three batch kinds over a grid of sizes:

- ``prefill``: one prompt chunk of P tokens after ``context_len`` cached tokens (0: a fresh
  prompt); its last row is sampled, as for a whole prompt of P tokens;
- ``decode``: B decodes, each after ``context_len`` cached tokens (one new token each);
- ``mixed`` (decode-maximal): one fresh chunk of P tokens plus B decodes, as SARATHI builds them.

Each forward is ``worker.model(ids, meta, kv)`` plus the LM head on the sampled rows only, as
``StageWorker.execute`` runs it for greedy rows (``model.argmax_tokens``). Time goes to six buckets:

    preproj   self_attn.qkv_proj          postproj  self_attn.o_proj
    attn      the attention backend call  ffn_ln1   mlp.gate_up_proj
              (KV write included)         ffn_ln2   mlp.down_proj
    others    everything else: embedding, RMSNorms, RoPE, SiLU·mul, residual adds, final norm
              and the LM head (the LM head alone is also reported as ``lm_head_ms``, a part
              of ``others_ms``: the simulator charges it to the last stage only)

Linears are timed with forward pre/post hooks, the backend by wrapping its ``forward``; on
CUDA every boundary synchronizes. The grid is run in interleaved rounds (every grid point once
per round: warm-up rounds, then ``reps`` timed rounds) so that drift on a shared machine hits
every point alike; each bucket is the median over the timed rounds (``stat=min`` in the grid:
the minimum, steadier on a busy shared CPU), and ``total_ms`` = the sum of the six medians (so
the parts always add up; the median of the measured totals is kept as ``measured_total_ms`` in
the returned rows).

    result = run_profile(None, "cpu", "float32", "runs/profile", threads=2)
    result["ratio"]   # decode ms/token alone ÷ piggybacked in a decode-maximal batch

Writes ``profile.csv`` (``CSV_COLUMNS``) and ``table2.json`` into ``out_dir``.
"""
from __future__ import annotations

import gc
import os
import random
import sys
import time
from typing import Callable

import torch

from pp_runtime.config import CacheConfig, DeviceConfig, ParallelConfig, check_kv_dtype
from pp_runtime.profile_grid import Grid, Layout, Point, grid_points, parse_grid, plan_chunks
from pp_runtime.profile_stats import rows_from_samples, timed_sample
from pp_runtime.profile_tables import format_summary, format_table, table2, write_csv, write_json
from stages.attention import build_metadata
from stages.cpu_info import cpu_name
from stages.layers import TPContext
from stages.op_timing import OpTimer, instrument
from stages.model_source import DEFAULT_MODEL, resolve_model
from stages.worker import StageWorker
from stages.worker_spec import WorkerSpec


# ---- worker ---------------------------------------------------------------------------------
def build_worker(model: str | None, device: str = "cpu", dtype: str = "float32", attention: str = "auto",
                 threads: int = 0, block_size: int = 16, gguf_weights: str = "native",
                 kv_dtype: str = "auto", matmul_precision: str = "highest") -> StageWorker:
    """A one-stage, one-rank worker of the whole model (no KV cache yet). Raises ValueError on a
    device this machine lacks, or a bad KV dtype."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but CUDA is not available")
    check_kv_dtype(kv_dtype, device, dtype)
    spec = WorkerSpec(resolve_model(model), 0, 0, ParallelConfig(1, 1), CacheConfig(block_size, None, kv_dtype),
                      DeviceConfig(device, dtype, attention, threads, gguf_weights, matmul_precision,
                                   cuda_graphs=False))  # profiles time eager forwards
    return StageWorker(spec, TPContext(), None)


def device_sync(device: torch.device) -> Callable[[], None]:
    """What makes a timer's stop mean the device's work is done: CUDA queues kernels, a CPU has
    none left by the time a call returns."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def device_name(device: torch.device) -> str:
    """The GPU's or the CPU's name, for reports."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def forward_step(model: torch.nn.Module, ids: torch.Tensor, meta: object,
                 kv_caches: list) -> torch.Tensor | None:
    """What the last (= only) stage computes for one micro-batch of greedy rows (the profile's
    plans are): layers, then the sampled rows' tokens as the worker gets them (sample_hidden:
    the LM head's argmax only)."""
    # Every layer whole (no keep, unlike the worker's last stage): the profile's op costs are per
    # layer (pp_runtime/sim/profile_cost.py divides them by the layer count), and a last layer
    # that skips its unsampled rows would make every layer look cheaper by its share.
    h = model(ids, meta, kv_caches)
    if model.is_last and meta.sample_idx.numel():
        return model.argmax_tokens(h[meta.sample_idx])
    return h


def fill_cache(worker: StageWorker, seed: int = 0) -> None:
    """Random K/V everywhere: the decodes' contexts count as cached (attention cost does not
    depend on the values), and no slot holds uninitialised memory."""
    g = torch.Generator(device=worker.device).manual_seed(seed)
    for cache in (t for kv in worker.kv_caches for t in kv):
        if cache.dtype != torch.float8_e4m3fn:
            cache.normal_(generator=g)
            continue
        for part in cache.split(256):  # torch draws no fp8: fp32 draws, rounded, 256 blocks at a time
            part.copy_(torch.randn(part.shape, generator=g, device=worker.device))


def measure(worker: StageWorker, grid: Grid, progress: bool = False, seed: int = 0,
            ready: Callable[[], None] | None = None) -> list[dict]:
    """Allocate and fill the worker's cache for ``grid``, run it, return one row per point
    (CSV_COLUMNS plus ``measured_total_ms``, ``reps``). Hooks are gone after. ``ready`` is called
    just before the first timed forward (co-located profiles meet there, so they overlap)."""
    cfg = worker.spec.source.config
    if grid.max_len() > cfg.max_position_embeddings:
        raise ValueError(f"grid needs {grid.max_len()} positions, the model has "
                         f"max_position_embeddings={cfg.max_position_embeddings}")
    if grid.max_len() > cfg.max_len:  # past a sliding window attention here is not the model's
        raise ValueError(f"grid needs {grid.max_len()} positions, the model's sliding window is "
                         f"{cfg.sliding_window} (sliding_window)")
    if grid.block_size != worker.block_size:
        raise ValueError(f"grid block_size={grid.block_size} differs from the worker's {worker.block_size}")
    layout = Layout(grid)
    worker.allocate_cache(layout.num_blocks)
    fill_cache(worker, seed)
    model, device = worker.model, worker.device
    sync = device_sync(device)
    timer = OpTimer(sync)
    rng = random.Random(seed)
    points = grid_points(grid)
    plans = []
    for pt in points:
        chunks = plan_chunks(pt, layout, cfg.vocab_size, rng)
        ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long, device=device)
        plans.append((pt, chunks, ids))
    samples: dict[Point, list[dict[str, float]]] = {pt: [] for pt in points}
    from tqdm import tqdm
    bar = tqdm(total=(grid.warmup + grid.reps) * len(points), file=sys.stderr, disable=not progress,
               desc="profile", unit="fwd", leave=False)
    if ready is not None:
        ready()
    gc.collect()
    gc_was = gc.isenabled()
    gc.disable()
    try:
        with torch.inference_mode(), instrument(model, timer):
            for rnd in range(grid.warmup + grid.reps):
                for pt, chunks, x in plans:
                    bar.set_postfix_str(pt.label, refresh=False)
                    meta = build_metadata(chunks, worker.block_size, device)
                    timer.reset()
                    sync()
                    t0 = time.perf_counter()
                    forward_step(model, x, meta, worker.kv_caches)
                    sync()
                    total = time.perf_counter() - t0
                    if rnd >= grid.warmup:
                        samples[pt].append(timed_sample(timer.acc, total))
                    bar.update(1)
    finally:
        bar.close()
        if gc_was:
            gc.enable()
    return rows_from_samples(points, samples, grid.stat)


# ---- run and files --------------------------------------------------------------------------
def run_profile(model: str | None, device: str, dtype: str, out_dir: str, grid: str | Grid = "default",
                threads: int = 0, attention: str = "auto", progress: bool = True,
                ready: Callable[[], None] | None = None, kv_dtype: str = "auto",
                matmul_precision: str = "highest") -> dict:
    """Profile ``model`` (None: the embedded default) on ``device``; write ``out_dir/profile.csv``
    and ``out_dir/table2.json``; print the per-op table and the Table-2 line to stdout.

    ``grid``: ``default``, ``quick`` or overrides (see ``parse_grid``). ``threads`` > 0 sets
    torch's intra-op threads for the run (restored afterwards); ``attention``: torch|xformers|auto.
    Returns the table2.json fields plus ``rows`` (every row: CSV_COLUMNS +
    ``measured_total_ms``, ``reps``, ``stat``) and ``files`` (the two paths). ``elapsed_s``
    includes loading the model. Raises ValueError (ModelError included) on a bad grid, model,
    device, dtype or attention backend."""
    g = parse_grid(grid)
    prev_threads = torch.get_num_threads()
    t_start = time.perf_counter()
    try:
        worker = build_worker(model, device, dtype, attention, threads, g.block_size, kv_dtype=kv_dtype,
                              matmul_precision=matmul_precision)
        used_threads = torch.get_num_threads()
        rows = measure(worker, g, progress=progress, ready=ready)
        backend = worker.model.backend.name
        del worker
    finally:
        if threads:
            torch.set_num_threads(prev_threads)
    elapsed = time.perf_counter() - t_start
    t2 = table2(rows)
    t2.update({
        "model": model or DEFAULT_MODEL, "device": device, "dtype": dtype, "kv_cache_dtype": kv_dtype,
        "matmul_precision": matmul_precision, "torch_threads": used_threads,
        "attention": backend, "device_name": device_name(torch.device(device)),
        "torch_version": torch.__version__, "lm_head_in": "others_ms",
        "grid": grid if isinstance(grid, str) else "custom", "warmup": g.warmup, "reps": g.reps, "stat": g.stat,
        "elapsed_s": round(elapsed, 3),
    })
    os.makedirs(out_dir, exist_ok=True)
    csv_path, json_path = os.path.join(out_dir, "profile.csv"), os.path.join(out_dir, "table2.json")
    write_csv(rows, csv_path)
    write_json(t2, json_path)
    print(format_table(rows))
    print(format_summary(t2))
    return {**t2, "rows": rows, "files": [csv_path, json_path]}
