"""Cost models fitted to a profile (see :mod:`pp_runtime.sim.profile_fit`): one profile.csv of the
whole model on one device (:class:`ProfileCostModel`), or one per stage of an in-deployment
profile (:class:`StageProfiles`). TP > 1 divides the profiled work ideally.

    from pp_runtime.sim.profile_cost import ProfileCostModel, StageProfiles
    cost = ProfileCostModel.from_csv("profile.csv", profiled_layers=model.num_layers)
    stage_costs = StageProfiles.from_csvs(["stage-0/profile.csv", "stage-1/profile.csv"]).per_stage([15, 15])
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from pp_runtime.sim.batch_shape import OPS, BatchShape
from pp_runtime.sim.profile_fit import ProfileFit, fit_profile, read_profile


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
