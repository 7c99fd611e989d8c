"""How a profile's timed samples become rows (one per grid point, milliseconds per op bucket)
and how noisy the steps are, in plain Python (no tensors).

    rec = timed_sample(timer.acc, total_s)                       # one timed forward
    rows = rows_from_samples(points, {pt: [rec, ...]}, "median")
    stage_jitter(runs)["independent"]                            # σ per stage, for the simulator
"""
from __future__ import annotations

import math
import statistics

from pp_runtime.profile_grid import STATS, Point

OPS = ("preproj", "attn", "postproj", "ffn_ln1", "ffn_ln2")
BUCKETS = OPS + ("others",)


# ---- rows ---------------------------------------------------------------------------------
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


# ---- jitter -------------------------------------------------------------------------------
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
