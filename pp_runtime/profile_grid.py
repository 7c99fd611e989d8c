"""The profile's plan and its tables, in plain Python (no tensors): which batches a profile
runs (``Grid`` → ``Point``s → ``SeqChunk``s over a ``Layout`` of KV blocks), and how timed
samples become ``profile.csv`` rows and the paper's Table 2.

Shared by the in-process profile (stages/profile.py, one worker of the whole model) and the
in-deployment one (pp_runtime/profile_deploy.py, every stage worker of a running deployment).

    grid = parse_grid("decode=1,4;context=512")
    for pt in grid_points(grid): print(pt.label)
"""
from __future__ import annotations

import csv
import json
import math
import random
import statistics
from dataclasses import dataclass, fields, replace

from pp_runtime.batch import SampleSpec, SeqChunk
from pp_runtime.kv_cache import blocks_for

OPS = ("preproj", "attn", "postproj", "ffn_ln1", "ffn_ln2")
BUCKETS = OPS + ("others",)
CSV_COLUMNS = ("kind", "prefill_tokens", "decode_tokens", "context_len", "preproj_ms", "attn_ms",
               "postproj_ms", "ffn_ln1_ms", "ffn_ln2_ms", "others_ms", "total_ms", "per_token_ms",
               "per_decode_token_ms", "lm_head_ms", "total_log_sd")
KINDS = ("prefill", "decode", "mixed")
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


# ---- KV layout and plans ------------------------------------------------------------------
class Layout:
    """Block regions of the cache: sequence 0 (every prefill chunk) first, then one region per
    decode sequence, each large enough for its context plus the new token."""

    def __init__(self, grid: Grid) -> None:
        bs = grid.block_size
        self.bs = bs
        self.prefill_blocks = blocks_for(max([c + p for p, c in grid.prefill_points()] + [1]), bs)
        self.decode_blocks = blocks_for(grid.context + 1, bs)
        self.max_decodes = max(list(grid.decode) + list(grid.mixed_decode) + [0])
        self.num_blocks = self.prefill_blocks + self.max_decodes * self.decode_blocks

    def prefill_table(self) -> tuple[int, ...]:
        return tuple(range(self.prefill_blocks))

    def decode_table(self, j: int) -> tuple[int, ...]:
        first = self.prefill_blocks + j * self.decode_blocks
        return tuple(range(first, first + self.decode_blocks))


def plan_chunks(point: Point, layout: Layout, vocab: int, rng: random.Random) -> tuple[SeqChunk, ...]:
    """The SeqChunks of one grid point: prefill chunk first, then the decodes (the scheduler's
    order). Token ids are random: no op's cost depends on their values."""
    chunks = []
    if point.prefill_tokens:
        ids = tuple(rng.randrange(vocab) for _ in range(point.prefill_tokens))
        start = point.context_len if point.kind == "prefill" else 0
        chunks.append(SeqChunk(0, start, ids, layout.prefill_table(), True, _GREEDY))
    for j in range(point.decode_tokens):
        chunks.append(SeqChunk(1 + j, point.context_len, (rng.randrange(vocab),), layout.decode_table(j), False,
                               _GREEDY))
    return tuple(chunks)


# ---- rows and tables ----------------------------------------------------------------------
def timed_sample(ops: dict[str, float], total: float) -> dict[str, float]:
    """One timed forward as ``rows_from_samples`` takes it (seconds): the hooked ops (``lm_head``
    included), the measured ``total``, and ``others`` = the total less the five ops."""
    rec = dict(ops)
    rec["total"] = total
    rec["others"] = max(0.0, total - sum(ops[op] for op in OPS))
    return rec


def rows_from_samples(points: list[Point], samples: dict[Point, list[dict[str, float]]],
                      stat: str = "median") -> list[dict]:
    """One CSV row per point from its timed samples (seconds per bucket, ``lm_head`` and
    ``total`` included): the ``stat`` of each bucket over the samples, in milliseconds."""
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
        row["total_log_sd"] = log_sd([r["total"] for r in recs])
        row["reps"] = len(recs)
        row["stat"] = stat
        rows.append(row)
    base = {r["prefill_tokens"]: r["total_ms"] for r in rows if r["kind"] == "prefill" and r["context_len"] == 0}
    for r in rows:
        if r["kind"] == "mixed":
            r["per_decode_token_ms"] = (r["total_ms"] - base[r["prefill_tokens"]]) / r["decode_tokens"]
    return rows


def log_sd(values: list[float]) -> float | None:
    """Sample standard deviation of log(value) over the timed rounds of one point: the step
    time's jitter as a fraction (≈ its coefficient of variation), which a deterministic cost
    model leaves out; None under two rounds. The simulator draws per-step noise of this size."""
    logs = [math.log(v) for v in values if v > 0]
    return statistics.stdev(logs) if len(logs) >= 2 else None


def stage_jitter(runs: list[list[tuple[Point, float]]]) -> dict:
    """How noisy each stage's steps are, from an in-deployment profile: per stage, (point, step
    seconds) of its timed micro-batches in the order it ran them (the same order on every stage).

    A step's deviation is log(its time) less its point's mean log time. ``sigma``: per stage,
    their pooled sd (as the CSVs' total_log_sd) — slow drift of the box over the minutes between
    rounds included. What makes stages wait on each other is the step-to-step part, so
    ``short``: √(mean of squared successive differences / 2) (von Neumann's estimator: drift
    slower than a step cancels in the differences). ``shared_corr``: the correlation of those
    differences between adjacent stages for the same micro-batch (a busy box slows every stage
    alike, which makes no stage wait). ``independent``: short·√(1 − ρ) — the σ the simulator
    draws per stage and step (cost_model.jitter)."""
    devs = [_deviations(run) for run in runs]
    by_point = [{} for _ in runs]
    for per, run, dev in zip(by_point, runs, devs):
        for (pt, _), x in zip(run, dev):
            per.setdefault(pt, []).append(x)
    sigma = [_pooled_sd([g for g in per.values() if len(g) >= 2]) for per in by_point]
    diffs = [[b - a for a, b in zip(dev, dev[1:])] for dev in devs]
    short = [math.sqrt(sum(d * d for d in ds) / (2 * len(ds))) if ds else None for ds in diffs]
    num = den0 = den1 = 0.0
    for xs, ys in zip(diffs, diffs[1:]):
        for x, y in zip(xs, ys):
            num, den0, den1 = num + x * y, den0 + x * x, den1 + y * y
    rho = num / math.sqrt(den0 * den1) if den0 > 0 and den1 > 0 else None
    keep = math.sqrt(1.0 - max(0.0, rho)) if rho is not None else 1.0
    return {"sigma": sigma, "short": short, "shared_corr": rho,
            "independent": [None if x is None else x * keep for x in short]}


def _deviations(run: list[tuple[Point, float]]) -> list[float]:
    logs = [math.log(max(t, 1e-12)) for _, t in run]
    groups: dict[Point, list[float]] = {}
    for (pt, _), x in zip(run, logs):
        groups.setdefault(pt, []).append(x)
    mean = {pt: sum(g) / len(g) for pt, g in groups.items()}
    return [x - mean[pt] for (pt, _), x in zip(run, logs)]


def _pooled_sd(groups: list[list[float]]) -> float | None:
    """√(Σ squared deviations / Σ (n − 1)) over groups already centred on their own means."""
    ss, dof = sum(x * x for g in groups for x in g), sum(len(g) - 1 for g in groups)
    return math.sqrt(ss / dof) if dof > 0 else None


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


def write_json(obj: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


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
    piggy = t2["decode_piggybacked_ms_per_token"]
    if piggy is not None and piggy <= 0:  # the mixed batch ran faster than its chunk alone: noise won
        ratio = "n/a (piggybacked cost ≤ 0: the mixed and prefill-only timings are noise-dominated; rerun with more reps)"
    return (f"Table 2 ({t2.get('model')}, {t2.get('device')}, {t2.get('dtype')}, {t2.get('torch_threads')} threads): "
            f"decode alone {f(t2['decode_alone_ms_per_token'])} ms/token (B={t2['decodes']}, "
            f"ctx={t2['decode_context_len']}), piggybacked {f(t2['decode_piggybacked_ms_per_token'])} ms/token "
            f"(P={t2['mixed_prefill_tokens']}): {ratio}; prefill {f(t2['prefill_ms_per_token_at_256'])} "
            f"ms/token at P={t2['prefill_tokens_for_per_token']}")
