"""Per-operation stage profile: the paper's Table 2 and Figure 3 on this model and device.

One stage worker (pp = tp = 1) runs forward passes of three batch kinds over a grid of sizes:

- ``prefill``: one prompt chunk of P tokens after ``context_len`` cached tokens (0: a fresh
  prompt); its last row is sampled, as for a whole prompt of P tokens;
- ``decode``: B decodes, each after ``context_len`` cached tokens (one new token each);
- ``mixed`` (decode-maximal): one fresh chunk of P tokens plus B decodes, as SARATHI builds them.

Each forward is ``worker.model(ids, meta, kv)`` plus ``model.logits`` on the sampled rows only,
as ``StageWorker.execute`` does (sampling itself is left out). Time goes to six buckets:

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

import contextlib
import csv
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, fields, replace
from typing import Callable, Iterator

import torch

from pp_runtime.batch import SampleSpec, SeqChunk
from pp_runtime.config import CacheConfig, DeviceConfig, ParallelConfig
from stages.attention import build_metadata
from stages.layers import TPContext
from stages.weights import DEFAULT_MODEL, resolve_model
from stages.worker import StageWorker, WorkerSpec

OPS = ("preproj", "attn", "postproj", "ffn_ln1", "ffn_ln2")
BUCKETS = OPS + ("others",)
CSV_COLUMNS = ("kind", "prefill_tokens", "decode_tokens", "context_len", "preproj_ms", "attn_ms",
               "postproj_ms", "ffn_ln1_ms", "ffn_ln2_ms", "others_ms", "total_ms", "per_token_ms",
               "per_decode_token_ms", "lm_head_ms")
KINDS = ("prefill", "decode", "mixed")
_LINEARS = {"preproj": "self_attn.qkv_proj", "postproj": "self_attn.o_proj",
            "ffn_ln1": "mlp.gate_up_proj", "ffn_ln2": "mlp.down_proj"}
_GREEDY = SampleSpec(0.0, 1.0, 0, 0)
STATS = {"median": statistics.median, "min": min}


# ---- grid ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Grid:
    """What to run. ``context`` is the cached length of every decode and of the
    ``prefill_with_context`` rows; ``mixed_prefill`` is the chunk P of every mixed row."""

    prefill: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
    prefill_with_context: tuple[int, ...] = (256,)
    decode: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    mixed_decode: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    mixed_prefill: int = 256
    context: int = 256
    warmup: int = 1
    reps: int = 3
    block_size: int = 16
    stat: str = "median"  # per bucket over the timed rounds; "min" resists a busy shared CPU

    def __post_init__(self) -> None:
        if self.stat not in STATS:
            raise ValueError(f"grid stat must be one of {', '.join(STATS)}, got {self.stat!r}")
        for f in ("prefill", "prefill_with_context", "decode", "mixed_decode"):
            v = getattr(self, f)
            if any(not isinstance(n, int) or n <= 0 for n in v):
                raise ValueError(f"grid {f} sizes must be positive integers, got {list(v)}")
        if not (self.prefill or self.decode or self.mixed_decode):
            raise ValueError("grid has no prefill, decode or mixed sizes")
        for f in ("mixed_prefill", "reps", "block_size"):
            if getattr(self, f) <= 0:
                raise ValueError(f"grid {f} must be > 0, got {getattr(self, f)}")
        if self.context < 0 or self.warmup < 0:
            raise ValueError("grid context and warmup must be ≥ 0")
        if (self.decode or self.mixed_decode) and self.context <= 0:
            raise ValueError("grid context must be > 0 when there are decodes (they need cached tokens)")

    def prefill_points(self) -> list[tuple[int, int]]:
        """(P, cached) of every prefill-only row; P = mixed_prefill at 0 is always there (the
        baseline of the mixed rows' marginal decode cost)."""
        pts = [(p, 0) for p in self.prefill] + [(p, self.context) for p in self.prefill_with_context]
        if self.mixed_decode and (self.mixed_prefill, 0) not in pts:
            pts.append((self.mixed_prefill, 0))
        return sorted(set(pts), key=lambda x: (x[1], x[0]))

    def max_len(self) -> int:
        lens = [c + p for p, c in self.prefill_points()] + [self.context + 1]
        return max(lens)


GRIDS = {
    "default": Grid(),
    "quick": Grid(prefill=(4, 8), prefill_with_context=(4,), decode=(1, 2, 4), mixed_decode=(1, 2, 4),
                  mixed_prefill=8, context=8, warmup=1, reps=3, block_size=4),
}


def parse_grid(spec: str | Grid) -> Grid:
    """``default``, ``quick``, or overrides of the default grid:
    ``"prefill=64,256;decode=1,4;mixed_decode=4;mixed_prefill=256;context=512;reps=3;stat=min"``
    (a base may lead: ``"quick;reps=5"``). Raises ValueError naming a bad key or value."""
    if isinstance(spec, Grid):
        return spec
    spec = (spec or "default").strip()
    if spec in GRIDS:
        return GRIDS[spec]
    parts = [p.strip() for p in spec.split(";") if p.strip()]
    base = GRIDS["default"]
    if parts and parts[0] in GRIDS:
        base = GRIDS[parts.pop(0)]
    known = {f.name: f for f in fields(Grid)}
    changes: dict = {}
    for part in parts:
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in known:
            raise ValueError(f"bad grid item {part!r}: expected NAME=VALUE with NAME one of "
                             f"{', '.join(known)} (or a grid name: {', '.join(GRIDS)})")
        if key == "stat":
            changes[key] = value.strip()
            continue
        try:
            vals = tuple(int(v) for v in value.split(",") if v.strip())
        except ValueError:
            raise ValueError(f"bad grid value {part!r}: integers expected") from None
        if isinstance(getattr(base, key), tuple):
            changes[key] = vals
        elif len(vals) != 1:
            raise ValueError(f"grid {key} takes one integer, got {value!r}")
        else:
            changes[key] = vals[0]
    return replace(base, **changes)


@dataclass(frozen=True)
class Point:
    kind: str
    prefill_tokens: int
    decode_tokens: int
    context_len: int  # cached tokens before the prefill chunk (prefill) or before each decode

    @property
    def label(self) -> str:
        return f"{self.kind} P={self.prefill_tokens} B={self.decode_tokens} ctx={self.context_len}"


def grid_points(grid: Grid) -> list[Point]:
    pts = [Point("prefill", p, 0, c) for p, c in grid.prefill_points()]
    pts += [Point("decode", 0, b, grid.context) for b in grid.decode]
    pts += [Point("mixed", grid.mixed_prefill, b, grid.context) for b in grid.mixed_decode]
    return pts


# ---- worker and plans -----------------------------------------------------------------------
def build_worker(model: str | None, device: str = "cpu", dtype: str = "float32", attention: str = "auto",
                 threads: int = 0, block_size: int = 16) -> StageWorker:
    """A one-stage, one-rank worker of the whole model (no KV cache yet)."""
    spec = WorkerSpec(resolve_model(model), 0, 0, ParallelConfig(1, 1), CacheConfig(block_size, None),
                      DeviceConfig(device, dtype, attention, threads))
    return StageWorker(spec, TPContext(), None)


class _Layout:
    """Block regions of the cache: sequence 0 (every prefill chunk) first, then one region per
    decode sequence, each large enough for its context plus the new token."""

    def __init__(self, grid: Grid) -> None:
        bs = grid.block_size
        self.bs = bs
        self.prefill_blocks = -(-max([c + p for p, c in grid.prefill_points()] + [1]) // bs)
        self.decode_blocks = -(-(grid.context + 1) // bs)
        self.max_decodes = max(list(grid.decode) + list(grid.mixed_decode) + [0])
        self.num_blocks = self.prefill_blocks + self.max_decodes * self.decode_blocks

    def prefill_table(self) -> tuple[int, ...]:
        return tuple(range(self.prefill_blocks))

    def decode_table(self, j: int) -> tuple[int, ...]:
        first = self.prefill_blocks + j * self.decode_blocks
        return tuple(range(first, first + self.decode_blocks))


def plan_chunks(point: Point, layout: _Layout, vocab: int, gen: torch.Generator) -> tuple[SeqChunk, ...]:
    """The SeqChunks of one grid point: prefill chunk first, then the decodes (the scheduler's order)."""
    chunks = []
    if point.prefill_tokens:
        ids = torch.randint(0, vocab, (point.prefill_tokens,), generator=gen).tolist()
        start = point.context_len if point.kind == "prefill" else 0
        chunks.append(SeqChunk(0, start, tuple(ids), layout.prefill_table(), True, _GREEDY))
    for j in range(point.decode_tokens):
        tok = int(torch.randint(0, vocab, (1,), generator=gen))
        chunks.append(SeqChunk(1 + j, point.context_len, (tok,), layout.decode_table(j), False, _GREEDY))
    return tuple(chunks)


# ---- timing -------------------------------------------------------------------------------
class OpTimer:
    """Accumulates seconds per bucket; ``sync`` runs at every boundary (CUDA synchronize)."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.acc: dict[str, float] = {}
        self._t0: dict[str, float] = {}

    def reset(self) -> None:
        self.acc = {op: 0.0 for op in OPS + ("lm_head",)}

    def start(self, op: str) -> None:
        self.sync()
        self._t0[op] = time.perf_counter()

    def stop(self, op: str) -> None:
        self.sync()
        self.acc[op] = self.acc.get(op, 0.0) + time.perf_counter() - self._t0.pop(op)


@contextlib.contextmanager
def instrument(model: torch.nn.Module, timer: OpTimer) -> Iterator[None]:
    """Hooks on every layer's four linears and the LM head, a timing wrapper on the attention
    backend's ``forward``; all removed on exit (also on error)."""
    handles = []
    backend = model.backend
    had_own = "forward" in vars(backend)
    saved = vars(backend).get("forward")
    try:
        for layer in model.layers:
            for op, path in _LINEARS.items():
                mod = layer.get_submodule(path)
                handles.append(mod.register_forward_pre_hook(lambda m, a, op=op: timer.start(op)))
                handles.append(mod.register_forward_hook(lambda m, a, o, op=op: timer.stop(op)))
        if model.lm_head is not None:
            handles.append(model.lm_head.register_forward_pre_hook(lambda m, a: timer.start("lm_head")))
            handles.append(model.lm_head.register_forward_hook(lambda m, a, o: timer.stop("lm_head")))
        inner = backend.forward

        def timed_forward(*args, **kwargs):
            timer.start("attn")
            try:
                return inner(*args, **kwargs)
            finally:
                timer.stop("attn")

        backend.forward = timed_forward
        yield
    finally:
        for h in handles:
            h.remove()
        if had_own:
            backend.forward = saved
        else:
            vars(backend).pop("forward", None)


def forward_step(model: torch.nn.Module, ids: torch.Tensor, meta: object,
                 kv_caches: list) -> torch.Tensor | None:
    """What the last (= only) stage computes for one micro-batch: layers, then logits of the
    sampled rows only."""
    h = model(ids, meta, kv_caches)
    if model.is_last and meta.sample_idx.numel():
        return model.logits(h[meta.sample_idx])
    return h


def fill_cache(worker: StageWorker, seed: int = 0) -> None:
    """Random K/V everywhere: the decodes' contexts count as cached (attention cost does not
    depend on the values), and no slot holds uninitialised memory."""
    g = torch.Generator(device=worker.device).manual_seed(seed)
    for k, v in worker.kv_caches:
        k.normal_(generator=g)
        v.normal_(generator=g)


def measure(worker: StageWorker, grid: Grid, progress: bool = False, seed: int = 0,
            ready: Callable[[], None] | None = None) -> list[dict]:
    """Allocate and fill the worker's cache for ``grid``, run it, return one row per point
    (CSV_COLUMNS plus ``measured_total_ms``, ``reps``). Hooks are gone after. ``ready`` is called
    just before the first timed forward (co-located profiles meet there, so they overlap)."""
    cfg = worker.spec.source.config
    if grid.max_len() > cfg.max_position_embeddings:
        raise ValueError(f"grid needs {grid.max_len()} positions, the model has "
                         f"max_position_embeddings={cfg.max_position_embeddings}")
    if grid.block_size != worker.block_size:
        raise ValueError(f"grid block_size={grid.block_size} differs from the worker's {worker.block_size}")
    layout = _Layout(grid)
    worker.allocate_cache(layout.num_blocks)
    fill_cache(worker, seed)
    model, device = worker.model, worker.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    timer = OpTimer(sync)
    gen = torch.Generator().manual_seed(seed)
    points = grid_points(grid)
    plans = []
    for pt in points:
        chunks = plan_chunks(pt, layout, cfg.vocab_size, gen)
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
                        rec = dict(timer.acc)
                        rec["total"] = total
                        rec["others"] = max(0.0, total - sum(rec[op] for op in OPS))
                        samples[pt].append(rec)
                    bar.update(1)
    finally:
        bar.close()
        if gc_was:
            gc.enable()
    return _rows(points, samples, grid.stat)


def _rows(points: list[Point], samples: dict[Point, list[dict[str, float]]], stat: str = "median") -> list[dict]:
    rows = []
    for pt in points:
        recs = samples[pt]
        med = {b: STATS[stat]([r[b] for r in recs]) * 1e3 for b in BUCKETS + ("lm_head", "total")}
        total = sum(med[b] for b in BUCKETS)
        row = {"kind": pt.kind, "prefill_tokens": pt.prefill_tokens, "decode_tokens": pt.decode_tokens,
               "context_len": pt.context_len}
        row.update({f"{b}_ms": med[b] for b in BUCKETS})
        row["total_ms"] = total
        row["per_token_ms"] = total / (pt.prefill_tokens + pt.decode_tokens)
        row["per_decode_token_ms"] = total / pt.decode_tokens if pt.kind == "decode" else None
        row["lm_head_ms"] = med["lm_head"]
        row["measured_total_ms"] = med["total"]
        row["reps"] = len(recs)
        row["stat"] = stat
        rows.append(row)
    base = {r["prefill_tokens"]: r["total_ms"] for r in rows if r["kind"] == "prefill" and r["context_len"] == 0}
    for r in rows:
        if r["kind"] == "mixed":
            r["per_decode_token_ms"] = (r["total_ms"] - base[r["prefill_tokens"]]) / r["decode_tokens"]
    return rows


# ---- summary and files --------------------------------------------------------------------
def _closest(values: list[int], target: int) -> int | None:
    return min(values, key=lambda v: (abs(v - target), v)) if values else None


def table2(rows: list[dict], target_decodes: int = 4, target_prefill: int = 256) -> dict:
    """The paper's Table 2 on this run: decode cost per token alone (decode-only batch of B)
    vs piggybacked (marginal cost per decode in the mixed batch with the same B)."""
    dec = {r["decode_tokens"]: r for r in rows if r["kind"] == "decode"}
    mix = {r["decode_tokens"]: r for r in rows if r["kind"] == "mixed"}
    pre = {r["prefill_tokens"]: r for r in rows if r["kind"] == "prefill" and r["context_len"] == 0}
    b = _closest(sorted(set(dec) & set(mix)), target_decodes)
    alone = dec[b]["per_decode_token_ms"] if b is not None else None
    piggy = mix[b]["per_decode_token_ms"] if b is not None else None
    p = _closest(sorted(pre), target_prefill)
    b1 = min(dec) if dec else None
    out = {
        "decode_alone_ms_per_token": alone,
        "decode_piggybacked_ms_per_token": piggy,
        "ratio": alone / piggy if alone is not None and piggy is not None and piggy > 0 else None,
        "prefill_ms_per_token_at_256": pre[p]["per_token_ms"] if p is not None else None,
        "decodes": b,
        "mixed_prefill_tokens": mix[b]["prefill_tokens"] if b is not None else None,
        "decode_context_len": dec[b]["context_len"] if b is not None else None,
        "prefill_tokens_for_per_token": p,
        "decode_b1_ms_per_token": dec[b1]["per_decode_token_ms"] if b1 is not None else None,
    }
    if out["decode_b1_ms_per_token"] is not None and out["prefill_ms_per_token_at_256"]:
        out["decode_b1_over_prefill_per_token"] = out["decode_b1_ms_per_token"] / out["prefill_ms_per_token_at_256"]
    return out


def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for r in rows:
            w.writerow(["" if r[c] is None else (f"{r[c]:.6f}" if isinstance(r[c], float) else r[c])
                        for c in CSV_COLUMNS])


def format_table(rows: list[dict]) -> str:
    """Per-operation milliseconds of every row (others includes the LM head)."""
    head = ("kind", "P", "B", "ctx", "preproj", "attn", "postproj", "ffn_ln1", "ffn_ln2", "others",
            "total", "ms/tok", "ms/dec")
    lines = ["{:<8}{:>5}{:>4}{:>6}".format(*head[:4]) + "".join(f"{h:>10}" for h in head[4:])]
    for r in rows:
        cells = [r[f"{b}_ms"] for b in BUCKETS] + [r["total_ms"], r["per_token_ms"], r["per_decode_token_ms"]]
        lines.append(f"{r['kind']:<8}{r['prefill_tokens']:>5}{r['decode_tokens']:>4}{r['context_len']:>6}"
                     + "".join(f"{'-':>10}" if v is None else f"{v:>10.3f}" for v in cells))
    stat = rows[0].get("stat", "median") if rows else "median"
    lines.append(f"(ms; {stat} over reps; others = embedding, norms, RoPE, activation, residuals, LM head "
                 "on sampled rows; ms/dec for mixed = (total - prefill-only total at the same P) / B)")
    return "\n".join(lines)


def format_summary(t2: dict) -> str:
    def f(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.3f}"
    ratio = "n/a" if t2.get("ratio") is None else f"{t2['ratio']:.2f}x"
    return (f"Table 2 ({t2.get('model')}, {t2.get('device')}, {t2.get('dtype')}, {t2.get('torch_threads')} threads): "
            f"decode alone {f(t2['decode_alone_ms_per_token'])} ms/token (B={t2['decodes']}, "
            f"ctx={t2['decode_context_len']}), piggybacked {f(t2['decode_piggybacked_ms_per_token'])} ms/token "
            f"(P={t2['mixed_prefill_tokens']}): {ratio}; prefill {f(t2['prefill_ms_per_token_at_256'])} "
            f"ms/token at P={t2['prefill_tokens_for_per_token']}")


def run_profile(model: str | None, device: str, dtype: str, out_dir: str, grid: str | Grid = "default",
                threads: int = 0, attention: str = "auto", progress: bool = True,
                ready: Callable[[], None] | None = None) -> dict:
    """Profile ``model`` (None: the embedded default) on ``device``; write ``out_dir/profile.csv``
    and ``out_dir/table2.json``; print the per-op table and the Table-2 line to stdout.

    ``grid``: ``default``, ``quick`` or overrides (see ``parse_grid``). ``threads`` > 0 sets
    torch's intra-op threads for the run (restored afterwards); ``attention``: torch|xformers|auto.
    Returns the table2.json fields plus ``rows`` (every row: CSV_COLUMNS +
    ``measured_total_ms``, ``reps``, ``stat``) and ``files`` (the two paths). ``elapsed_s``
    includes loading the model. Raises ValueError (ModelError included) on a bad grid, model,
    device, dtype or attention backend."""
    g = parse_grid(grid)
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but CUDA is not available")
    prev_threads = torch.get_num_threads()
    t_start = time.perf_counter()
    try:
        worker = build_worker(model, device, dtype, attention, threads, g.block_size)
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
        "model": model or DEFAULT_MODEL, "device": device, "dtype": dtype, "torch_threads": used_threads,
        "attention": backend, "device_name": (torch.cuda.get_device_name() if device == "cuda"
                                              else _cpu_name()),
        "torch_version": torch.__version__, "lm_head_in": "others_ms",
        "grid": grid if isinstance(grid, str) else "custom", "warmup": g.warmup, "reps": g.reps, "stat": g.stat,
        "elapsed_s": round(elapsed, 3),
    })
    os.makedirs(out_dir, exist_ok=True)
    csv_path, json_path = os.path.join(out_dir, "profile.csv"), os.path.join(out_dir, "table2.json")
    write_csv(rows, csv_path)
    with open(json_path, "w") as f:
        json.dump(t2, f, indent=2)
        f.write("\n")
    print(format_table(rows))
    print(format_summary(t2))
    return {**t2, "rows": rows, "files": [csv_path, json_path]}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or "cpu"
