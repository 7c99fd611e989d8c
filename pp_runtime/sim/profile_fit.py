"""Fitting a ``profile.csv`` (what ``pp-runtime profile`` writes) into per-op cost lines.

Linear ops as max(floor, a + b·tokens), attention as a + b·(prefill tokens × context) +
c·(decode tokens × context), others as a + b·tokens + c·sampled rows (the LM head), or the LM
head on its own line when the profile has ``lm_head_ms``. :mod:`pp_runtime.sim.profile_cost`
turns a fit into a cost model.

    from pp_runtime.sim.profile_fit import fit_profile, read_profile
    fit = fit_profile(read_profile("profile.csv"))
    fit.op_ms(shape), fit.r2, fit.max_rel_err   # per-op ms of a BatchShape; goodness of fit
"""
from __future__ import annotations

import csv
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from pp_runtime.sim.batch_shape import LINEAR_OPS, OPS, BatchShape


def nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a handful of columns: the best fit over every subset of
    columns whose unconstrained solution is non-negative (exact for the few features used here)."""
    k = X.shape[1]
    best, best_err = np.zeros(k), float(np.sum(y ** 2))
    for r in range(1, k + 1):
        for cols in itertools.combinations(range(k), r):
            sub = X[:, cols]
            coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(coef < -1e-15):
                continue
            err = float(np.sum((sub @ coef - y) ** 2))
            if err < best_err - 1e-18 * max(1.0, best_err):
                best = np.zeros(k)
                best[list(cols)] = np.maximum(coef, 0.0)
                best_err = err
    return best


def _line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares a + b·x with b ≥ 0 (any sign of a: a line above a knee may start below 0)."""
    if len(x) == 0:
        return 0.0, 0.0
    if len(set(x.tolist())) >= 2:
        (a, b), *_ = np.linalg.lstsq(np.column_stack([np.ones(len(x)), x]), y, rcond=None)
        if b >= 0:
            return float(a), float(b)
    return float(y.mean()), 0.0


@dataclass(frozen=True)
class FloorLine:
    """t(T) = max(floor, a + b·T): a linear op with a small-batch floor (milliseconds)."""

    floor: float
    a: float
    b: float

    def __call__(self, tokens: float) -> float:
        return max(self.floor, self.a + self.b * tokens)

    @classmethod
    def fit(cls, tokens: Sequence[float], ms: Sequence[float]) -> "FloorLine":
        """Try every split of the rows by token count: rows below it set the floor (their mean),
        rows from it on get a non-negative least-squares line; keep the split with the least error."""
        T, y = np.asarray(tokens, float), np.asarray(ms, float)
        xs = sorted(set(T.tolist()))
        best, best_err = None, math.inf
        for i in range(len(xs)):
            hi = T >= xs[i]
            if len(set(T[hi].tolist())) < 2 and i > 0:
                continue
            a, b = _line(T[hi], y[hi])
            floor = float(y[~hi].mean()) if (~hi).any() else 0.0
            cand = cls(floor, float(a), float(b))
            err = float(sum((cand(t) - v) ** 2 for t, v in zip(T, y)))
            if err < best_err - 1e-15:
                best, best_err = cand, err
        return best or cls(float(y.mean()), 0.0, 0.0)


@dataclass(frozen=True)
class ProfileFit:
    """Fitted per-op cost of the whole profiled model (milliseconds); see ProfileCostModel."""

    linear: dict  # op -> FloorLine
    attn: tuple[float, float, float]  # a + b·prefill_pairs + c·decode_kv
    others: tuple[float, float, float]  # a + b·tokens + c·sampled
    rows: int
    r2: dict  # op -> coefficient of determination on the profile rows
    max_rel_err: float  # of the total over the rows
    # The LM head over the sampled rows, fitted on its own when the profile has lm_head_ms (then
    # others' c is 0): a GEMM of 1-32 rows is far from linear in them on a CPU.
    head: FloorLine | None = None
    # The step time's jitter over the profile's timed rounds (pooled log-sd of the rows'
    # total_log_sd, ≈ its CV); None for profiles written before the column existed.
    jitter: float | None = None

    def head_ms(self, sampled: int) -> float:
        if not sampled:
            return 0.0
        return self.head(sampled) if self.head is not None else self.others[2] * sampled

    def op_ms(self, shape: BatchShape) -> dict[str, float]:
        T = shape.tokens
        out = {op: self.linear[op](T) if T else 0.0 for op in LINEAR_OPS}
        a, b, c = self.attn
        out["attn"] = (a + b * shape.prefill_pairs + c * shape.decode_kv) if T else 0.0
        a, b, _ = self.others
        out["others"] = (a + b * T + self.head_ms(shape.sampled)) if T else 0.0
        return out


def _row_shape(row: dict) -> BatchShape:
    """The BatchShape of one profile.csv row (stages/profile.py's grid points)."""
    kind, p, d, ctx = row["kind"], int(row["prefill_tokens"]), int(row["decode_tokens"]), int(row["context_len"])
    prefill = [(p, ctx if kind == "prefill" else 0)] if p else []
    return BatchShape.build(prefill, [ctx + 1] * d)


def read_profile(path: str | Path) -> list[dict]:
    path = Path(path)
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as exc:
        raise ValueError(f"cannot read profile {str(path)!r}: {exc.strerror}") from None
    need = ("kind", "prefill_tokens", "decode_tokens", "context_len") + tuple(f"{op}_ms" for op in OPS)
    if not rows:
        raise ValueError(f"profile {path}: no rows")
    missing = [c for c in need if c not in rows[0]]
    if missing:
        raise ValueError(f"profile {path}: missing columns {', '.join(missing)}")
    return rows


def fit_profile(rows: list[dict]) -> ProfileFit:
    """Fit every op over the rows of a profile.csv (as read by ``read_profile``)."""
    shapes = [_row_shape(r) for r in rows]
    ms = {op: np.array([float(r[f"{op}_ms"]) for r in rows]) for op in OPS}
    T = np.array([s.tokens for s in shapes], float)
    linear = {op: FloorLine.fit(T, ms[op]) for op in LINEAR_OPS}
    ones = np.ones(len(rows))
    attn = nnls(np.column_stack([ones, [s.prefill_pairs for s in shapes], [s.decode_kv for s in shapes]]), ms["attn"])
    sampled = np.array([s.sampled for s in shapes], float)
    head = None
    if all(r.get("lm_head_ms") not in (None, "") for r in rows):  # profiles since the column exists
        lm = np.array([float(r["lm_head_ms"]) for r in rows])
        head = FloorLine.fit(sampled, lm)
        a, b = nnls(np.column_stack([ones, T]), ms["others"] - lm)
        others = (a, b, 0.0)
    else:  # older profiles: the head is the c·sampled part of others
        others = nnls(np.column_stack([ones, T, sampled]), ms["others"])
    fit = ProfileFit(linear, tuple(float(x) for x in attn), tuple(float(x) for x in others), len(rows), {}, 0.0,
                     head)
    pred = [fit.op_ms(s) for s in shapes]
    r2 = {}
    for op in OPS:
        y = ms[op]
        ss = float(np.sum((y - y.mean()) ** 2))
        res = float(np.sum((np.array([p[op] for p in pred]) - y) ** 2))
        r2[op] = 1.0 - res / ss if ss > 0 else (1.0 if res < 1e-12 else 0.0)
    totals = np.array([sum(ms[op][i] for op in OPS) for i in range(len(rows))])
    ptot = np.array([sum(p.values()) for p in pred])
    rel = float(np.max(np.abs(ptot - totals) / np.maximum(totals, 1e-12)))
    return ProfileFit(linear, fit.attn, fit.others, len(rows), r2, rel, head, pooled_jitter(rows))


def pooled_jitter(rows: list[dict]) -> float | None:
    """√(mean of the rows' total_log_sd²): every row has the same rounds, so the pooled
    within-point variance of log(step time) is the plain mean of theirs."""
    sds = [float(r["total_log_sd"]) for r in rows if r.get("total_log_sd") not in (None, "")]
    return math.sqrt(sum(x * x for x in sds) / len(sds)) if sds else None
