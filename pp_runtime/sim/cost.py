"""Cost models: how long one pipeline stage takes to run one micro-batch.

A micro-batch's cost depends only on its :class:`BatchShape` (prefill tokens, decode tokens and
the KV lengths they attend over). Per layer and TP rank, a cost model gives the time of the six
operations the profiler measures (``OPS``: preproj = QKV, attn, postproj = O, ffn_ln1 =
gate/up, ffn_ln2 = down, others = norms, RoPE, activation, residuals); the first stage adds
the embedding, the last the LM head over the sampled rows. :class:`PipelineCost` turns that into
stage times (layers × per-layer time + two TP all-reduces per layer) and PP send times.

* :class:`RooflineCostModel`: op time = max(FLOPs / (peak · eff), bytes / (bandwidth · eff)) +
  a kernel-launch overhead, from a :class:`~pp_runtime.sim.presets.Hardware` preset. Linear ops
  read their weights once per micro-batch (so decodes alone are memory-bound and ride almost free
  on a prefill chunk); attention reads the K/V of every sequence it attends over.
* :class:`ProfileCostModel`: fitted to the ``profile.csv`` that ``pp-runtime profile`` writes
  (whole model, one device): linear ops as max(floor, a + b·tokens), attention as
  a + b·(prefill tokens × context) + c·(decode tokens × context), others as a + b·tokens +
  c·sampled rows (the LM head, charged to the last stage). TP > 1 divides it ideally.
* :class:`ConstantCost`: fixed times, for tests and hand-checked pipelines.
"""
from __future__ import annotations

import csv
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from pp_runtime.batch import MicroBatch
from pp_runtime.sim.presets import Hardware, SimModel

OPS = ("preproj", "attn", "postproj", "ffn_ln1", "ffn_ln2", "others")
LINEAR_OPS = ("preproj", "postproj", "ffn_ln1", "ffn_ln2")


@dataclass(frozen=True)
class BatchShape:
    """What a micro-batch's cost depends on.

    prefill_pairs: Σ over prefill chunks of n·(start + (n+1)/2), the (query, key) pairs causal
    attention computes; prefill_kv: Σ (start + n), K/V rows the prefill chunks read; decode_kv:
    Σ over decodes of their context (start + 1); sampled: rows the LM head runs on.
    """

    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_pairs: float = 0.0
    prefill_kv: int = 0
    decode_kv: int = 0
    sampled: int = 0
    prefill_chunks: int = 0

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    @classmethod
    def of(cls, mb: MicroBatch) -> "BatchShape":
        p = d = pkv = dkv = s = nchunks = 0
        pairs = 0.0
        for c in mb.chunks:
            n = len(c.token_ids)
            if c.sample is not None:
                s += 1
            if c.is_prefill:
                p += n
                nchunks += 1
                pairs += n * (c.start + (n + 1) / 2)
                pkv += c.start + n
            else:
                d += n
                dkv += c.start + n
        return cls(p, d, pairs, pkv, dkv, s, nchunks)

    @classmethod
    def build(cls, prefill: Sequence[tuple[int, int]] = (), decode_contexts: Sequence[int] = (),
              sampled: int | None = None) -> "BatchShape":
        """From (chunk tokens, cached tokens before it) pairs and the context of each decode
        (cached tokens + its new one); ``sampled`` defaults to one row per chunk and per decode."""
        pairs = sum(n * (c + (n + 1) / 2) for n, c in prefill)
        return cls(sum(n for n, _ in prefill), len(decode_contexts), pairs, sum(n + c for n, c in prefill),
                   sum(decode_contexts), len(prefill) + len(decode_contexts) if sampled is None else sampled,
                   len(prefill))


class CostModel(Protocol):
    """Per-layer, per-TP-rank op times (seconds, in ``OPS`` order) and the first/last-stage extras."""

    def layer_ops(self, shape: BatchShape, tp: int) -> tuple[float, ...]: ...
    def embed_s(self, shape: BatchShape, tp: int) -> float: ...
    def head_s(self, shape: BatchShape, tp: int) -> float: ...
    def describe(self) -> dict: ...


# ---- roofline ---------------------------------------------------------------------------------
class RooflineCostModel:
    """Analytic roofline of ``model`` on ``hw`` (see the module docstring)."""

    def __init__(self, model: SimModel, hw: Hardware, dtype_bytes: int = 2) -> None:
        self.model, self.hw, self.dt = model, hw, dtype_bytes
        self._overhead = hw.op_overhead_us * 1e-6
        self._flops, self._attn_flops, self._bw = hw.flops, hw.attn_flops, hw.mem_bw

    def _matmul(self, tokens: int, k: float, n: float) -> tuple[float, float]:
        """(compute s, memory s) of [tokens, k] @ [k, n]: weights read once, activations in and out."""
        flops = 2.0 * tokens * k * n
        nbytes = (k * n + tokens * (k + n)) * self.dt
        return flops / self._flops, nbytes / self._bw

    def _op(self, tokens: int, k: float, n: float) -> float:
        if tokens <= 0:
            return 0.0
        c, m = self._matmul(tokens, k, n)
        return max(c, m) + self._overhead

    def linear_bounds(self, shape: BatchShape, tp: int = 1) -> dict[str, str]:
        """'compute' or 'memory' for each linear op: which side of the roofline it is on."""
        T = shape.tokens
        dims = self._linear_dims(tp)
        out = {}
        for op in LINEAR_OPS:
            c, mem = self._matmul(T, *dims[op])
            out[op] = "compute" if c >= mem else "memory"
        return out

    def attention_parts(self, shape: BatchShape, tp: int = 1) -> dict[str, tuple[float, float]]:
        """(compute s, memory s) of the prefill and decode attention kernels."""
        m, dt = self.model, self.dt
        q, kv = m.q_size / tp, max(m.num_kv_heads / tp, 1.0) * m.head_size
        out = {}
        if shape.prefill_tokens:
            flops = 4.0 * shape.prefill_pairs * q
            nbytes = (shape.prefill_kv * 2 * kv + shape.prefill_tokens * (2 * q + 2 * kv)) * dt
            out["prefill"] = (flops / self._attn_flops, nbytes / self._bw)
        if shape.decode_tokens:
            flops = 4.0 * shape.decode_kv * q
            nbytes = (shape.decode_kv * 2 * kv + shape.decode_tokens * (2 * q + 2 * kv)) * dt
            out["decode"] = (flops / self._attn_flops, nbytes / self._bw)
        return out

    def _linear_dims(self, tp: int) -> dict[str, tuple[float, float]]:
        m = self.model
        h = m.hidden_size
        return {"preproj": (h, (m.q_size + 2 * m.kv_size) / tp), "postproj": (m.q_size / tp, h),
                "ffn_ln1": (h, m.mlp_up_size / tp), "ffn_ln2": (m.intermediate_size / tp, h)}

    def layer_ops(self, shape: BatchShape, tp: int) -> tuple[float, ...]:
        T = shape.tokens
        if T <= 0:
            return (0.0,) * len(OPS)
        m = self.model
        dims = self._linear_dims(tp)
        lin = [self._op(T, *dims[op]) for op in LINEAR_OPS]
        attn = sum(max(c, mem) + self._overhead for c, mem in self.attention_parts(shape, tp).values())
        # elementwise: 2 RMSNorms (read + write h), 2 residual adds (2 reads + 1 write), RoPE on q and k,
        # the activation (SiLU·mul reads gate and up, writes one)
        elem = (10 * m.hidden_size + 2 * (m.q_size + m.kv_size) / tp
                + (3 if m.gated_mlp else 2) * m.intermediate_size / tp)
        others = T * elem * self.dt / self._bw + 6 * self._overhead
        return (lin[0], attn, lin[1], lin[2], lin[3], others)

    def embed_s(self, shape: BatchShape, tp: int) -> float:
        return shape.tokens * self.model.hidden_size * self.dt / self._bw + self._overhead

    def head_s(self, shape: BatchShape, tp: int) -> float:
        m = self.model
        return self._op(shape.sampled, m.hidden_size, m.vocab_size / tp)

    def describe(self) -> dict:
        return {"kind": "roofline", "hardware": self.hw.name, "model": self.model.name, "dtype_bytes": self.dt,
                "efficiency": dict(self.hw.efficiency), "op_overhead_us": self.hw.op_overhead_us}


# ---- fitted to a profile ------------------------------------------------------------------------
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


class ProfileCostModel:
    """Costs fitted to a profile.csv of the whole model on one device (pp = tp = 1).

    Per layer: each fitted op / ``profiled_layers``; ``others`` is split into a per-layer part
    (a + b·tokens, embedding included) and the LM head part (c·sampled), charged to the last
    stage. TP ranks divide the work ideally (the profile has no TP); all-reduces and sends come
    from ``hw`` in :class:`PipelineCost`.
    """

    def __init__(self, fit: ProfileFit, profiled_layers: int, source: str = "") -> None:
        if profiled_layers <= 0:
            raise ValueError(f"profiled_layers must be > 0, got {profiled_layers}")
        self.fit, self.layers, self.source = fit, profiled_layers, source

    @classmethod
    def from_csv(cls, path: str | Path | Sequence[str | Path], profiled_layers: int) -> "ProfileCostModel":
        """One profile.csv, or several (e.g. taken at different contexts) fitted as one set of rows."""
        paths = [path] if isinstance(path, (str, Path)) else list(path)
        rows = [row for p in paths for row in read_profile(p)]
        return cls(fit_profile(rows), profiled_layers, ", ".join(str(p) for p in paths))

    def layer_ops(self, shape: BatchShape, tp: int) -> tuple[float, ...]:
        if shape.tokens <= 0:
            return (0.0,) * len(OPS)
        ms = self.fit.op_ms(shape)
        a, b, _ = self.fit.others
        ms["others"] = a + b * shape.tokens
        scale = 1e-3 / (self.layers * tp)
        return tuple(ms[op] * scale for op in OPS)

    def embed_s(self, shape: BatchShape, tp: int) -> float:
        return 0.0  # inside the fitted per-layer "others"

    def head_s(self, shape: BatchShape, tp: int) -> float:
        return self.fit.head_ms(shape.sampled) * 1e-3 / tp

    def describe(self) -> dict:
        f = self.fit
        return {"kind": "profile", "csv": self.source, "profiled_layers": self.layers, "rows": f.rows,
                "linear_ms": {op: {"floor": l.floor, "a": l.a, "b_per_token": l.b} for op, l in f.linear.items()},
                "attn_ms": {"a": f.attn[0], "b_per_prefill_pair": f.attn[1], "c_per_decode_kv": f.attn[2]},
                "others_ms": {"a": f.others[0], "b_per_token": f.others[1], "c_per_sampled": f.others[2]},
                "lm_head_ms": None if f.head is None else {"floor": f.head.floor, "a": f.head.a,
                                                           "b_per_sampled": f.head.b},
                "r2": f.r2, "max_rel_err_total": f.max_rel_err, "jitter": f.jitter}


@dataclass(frozen=True)
class StageProfiles:
    """Per-stage fits of an in-deployment profile (``pp-runtime profile --pp N``, one CSV set per
    stage): stage s's rows time its own layers, in the deployment, with its neighbours busy, so
    its model divides them by its own layer count. The simulated deployment must cut the layers
    as the profiled one did."""

    fits: tuple[ProfileFit, ...]
    sources: tuple[str, ...]

    @classmethod
    def from_csvs(cls, stages: Sequence[str | Path | Sequence[str | Path]]) -> "StageProfiles":
        fits, sources = [], []
        for paths in stages:
            paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
            fits.append(fit_profile([row for p in paths for row in read_profile(p)]))
            sources.append(", ".join(str(p) for p in paths))
        return cls(tuple(fits), tuple(sources))

    def per_stage(self, layers: Sequence[int]) -> list[ProfileCostModel]:
        if len(layers) != len(self.fits):
            raise ValueError(f"cost_model.stages has {len(self.fits)} stage profiles, the scenario has "
                             f"pp={len(layers)}")
        return [ProfileCostModel(f, n, src) for f, n, src in zip(self.fits, layers, self.sources)]


# ---- from ops to pipeline stages ---------------------------------------------------------------
class StageCost(Protocol):
    """What the SimExecutor needs: per-stage compute seconds and per-boundary send seconds."""

    def stage_times(self, mb: MicroBatch) -> tuple[Sequence[float], Sequence[float]]: ...


class ConstantCost:
    """Every micro-batch takes ``stage_s`` on each stage (one value, or one per stage) and
    ``send_s`` between stages; optionally plus ``per_token_s`` × its tokens on every stage."""

    def __init__(self, stage_s: float | Sequence[float], send_s: float = 0.0, pp: int | None = None,
                 per_token_s: float = 0.0) -> None:
        if isinstance(stage_s, (int, float)):
            if pp is None:
                raise ValueError("ConstantCost needs pp when stage_s is one number")
            stage_s = [float(stage_s)] * pp
        self.stage = list(stage_s)
        self.send = [float(send_s)] * (len(self.stage) - 1)
        self.per_token = per_token_s

    def stage_times(self, mb: MicroBatch) -> tuple[list[float], list[float]]:
        if self.per_token:
            extra = self.per_token * mb.num_tokens
            return [s + extra for s in self.stage], self.send
        return self.stage, self.send


class PipelineCost:
    """Stage and send times of one replica (pp stages × tp ranks) from a per-layer cost model.

    Stage s runs ``layers[s]`` layers: each = the six ops + two all-reduces of the layer's
    [tokens, hidden] output over the stage's TP ranks (NVLink ring); the first stage adds the
    embedding, the last the LM head. ``cost`` is one model for every stage, or one per stage
    (an in-deployment profile: StageProfiles.per_stage). A send carries [tokens, hidden] from each TP rank to its
    peer on the next stage, over InfiniBand when the two stages sit on different nodes.
    """

    def __init__(self, cost: CostModel | Sequence[CostModel], model: SimModel, hw: Hardware, pp: int, tp: int,
                 layers: Sequence[int] | None = None, inter_node: Sequence[bool] | None = None,
                 dtype_bytes: int = 2) -> None:
        self.costs = list(cost) if isinstance(cost, (list, tuple)) else [cost] * pp
        if len(self.costs) != pp:
            raise ValueError(f"{len(self.costs)} stage cost models for pp={pp}")
        self.cost, self.model, self.hw, self.pp, self.tp, self.dt = self.costs[0], model, hw, pp, tp, dtype_bytes
        if layers is None:
            base, extra = divmod(model.num_layers, pp)
            layers = [base + (1 if s < extra else 0) for s in range(pp)]
        if len(layers) != pp or sum(layers) != model.num_layers:
            raise ValueError(f"layers per stage {list(layers)} must be {pp} counts summing to {model.num_layers}")
        self.layers = list(layers)
        self.inter_node = list(inter_node) if inter_node is not None else [True] * (pp - 1)
        self._uniform = len(set(self.layers)) == 1 and all(c is self.cost for c in self.costs)

    def describe(self) -> dict:
        if all(c is self.cost for c in self.costs):
            return self.cost.describe()
        return {"kind": "profile", "per_stage": [c.describe() for c in self.costs]}

    def breakdown(self, shape: BatchShape) -> dict[str, float]:
        """Seconds per op of one layer on one TP rank, plus its all-reduces."""
        ops = self.cost.layer_ops(shape, self.tp)
        out = dict(zip(OPS, ops))
        out["allreduce"] = self._allreduce(shape)
        return out

    def _allreduce(self, shape: BatchShape) -> float:
        if self.tp == 1 or shape.tokens == 0:
            return 0.0
        return 2 * self.hw.allreduce_s(shape.tokens * self.model.hidden_size * self.dt, self.tp)

    def shape_times(self, shape: BatchShape) -> tuple[list[float], list[float]]:
        ar = self._allreduce(shape)
        if self._uniform:
            compute = [self.layers[0] * (sum(self.cost.layer_ops(shape, self.tp)) + ar)] * self.pp
        else:
            compute = [n * (sum(c.layer_ops(shape, self.tp)) + ar) for n, c in zip(self.layers, self.costs)]
        compute[0] += self.costs[0].embed_s(shape, self.tp)
        compute[-1] += self.costs[-1].head_s(shape, self.tp)
        nbytes = shape.tokens * self.model.hidden_size * self.dt
        send = [self.hw.p2p_s(nbytes, x) for x in self.inter_node]
        return compute, send

    def stage_times(self, mb: MicroBatch) -> tuple[list[float], list[float]]:
        return self.shape_times(BatchShape.of(mb))
