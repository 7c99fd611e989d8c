"""What a benchmark workload is: ``WorkloadConfig`` (lengths, P:D, arrivals, seed) and its summary.

Synthetic workloads follow the SARATHI paper and sarathi-serve: the TOTAL sequence length
(prompt + decode) is drawn fixed, uniform, or Zipf(θ) between ``min_len`` and ``max_len``
(shorter lengths more likely; θ = 0 is uniform), then split by the P:D ratio (prompt tokens
per decode token). Arrivals are all at once or a Poisson process. Everything is seeded, so a
config always yields the same requests (``pp_runtime.workload.generate_workload`` draws them).

    from pp_runtime.workload_config import WorkloadConfig, workload_summary

    cfg = WorkloadConfig(kind="zipf", num_requests=64, min_len=256, max_len=1024, theta=0.4,
                         pd_ratio=10, arrival="poisson", rate=8.0, seed=0)
    workload_summary(cfg)   # JSON-able, for summary.json

Plain Python + numpy: no torch, no Ray.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

import numpy as np

from pp_runtime.field_checks import check_int, check_positive_number, is_number
from pp_runtime.request import SamplingParams

WORKLOAD_KINDS = ("fixed", "uniform", "zipf", "trace")
ARRIVALS = ("all", "poisson")


@dataclass(frozen=True)
class WorkloadConfig:
    """What requests a benchmark sends, and when.

    kind "fixed":   every request has prompt_len + decode_len tokens, or ``length`` total split
                    by pd_ratio.
    kind "uniform": total length uniform on [min_len, max_len], split by pd_ratio.
    kind "zipf":    total length min_len + i with P(i) ∝ 1/(i+1)^theta, i = 0..max_len−min_len.
    kind "trace":   replay ``trace_path`` (JSONL); num_requests, when given, keeps the first n.
    pd_ratio:       prompt tokens / decode tokens: prompt = round(L·pd/(pd+1)), decode = L − prompt,
                    each at least 1.
    arrival:        "all" (every arrival_s = 0) or "poisson" with ``rate`` requests per second.
    shared_prefix:  synthetic kinds: every prompt's first ``shared_prefix`` tokens (all of a shorter
                    one) are the same ids, as under one system prompt; lengths and the other ids
                    stay what the seed gives without it. For --enable-prefix-caching.
    temperature, top_p, top_k: how every request picks its tokens (SamplingParams); the default
                    is greedy. Each request runs to its decode length (ignore_eos) either way.
    Fields that do not apply to the kind/arrival must stay None: a stray one is usually a typo.
    """

    kind: str = "fixed"
    num_requests: int | None = None
    prompt_len: int | None = None
    decode_len: int | None = None
    length: int | None = None
    min_len: int | None = None
    max_len: int | None = None
    theta: float | None = None
    pd_ratio: float | None = None
    arrival: str = "all"
    rate: float | None = None
    seed: int = 0
    trace_path: str | None = None
    shared_prefix: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.kind not in WORKLOAD_KINDS:
            raise ValueError(f"WorkloadConfig.kind must be one of {', '.join(WORKLOAD_KINDS)}, got {self.kind!r}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"WorkloadConfig.arrival must be one of {', '.join(ARRIVALS)}, got {self.arrival!r}")
        if self.num_requests is not None:
            check_int("WorkloadConfig.num_requests", self.num_requests, 1)
        elif self.kind != "trace":
            raise ValueError(f"WorkloadConfig.num_requests is required for kind {self.kind!r}")
        check_int("WorkloadConfig.seed", self.seed, 0)
        if self.pd_ratio is not None:
            check_positive_number("WorkloadConfig.pd_ratio", self.pd_ratio)
        if self.arrival == "poisson":
            if self.rate is None:
                raise ValueError("WorkloadConfig.rate (requests/s) is required for arrival 'poisson'")
            check_positive_number("WorkloadConfig.rate", self.rate)
        elif self.rate is not None:
            raise ValueError("WorkloadConfig.rate applies only to arrival 'poisson'")
        allowed = {"fixed": {"prompt_len", "decode_len", "length", "pd_ratio", "shared_prefix"},
                   "uniform": {"min_len", "max_len", "pd_ratio", "shared_prefix"},
                   "zipf": {"min_len", "max_len", "theta", "pd_ratio", "shared_prefix"},
                   "trace": {"trace_path"}}[self.kind]
        if self.shared_prefix is not None:
            check_int("WorkloadConfig.shared_prefix", self.shared_prefix, 1)
        for name in ("prompt_len", "decode_len", "length", "min_len", "max_len", "theta", "pd_ratio",
                     "trace_path", "shared_prefix"):
            if getattr(self, name) is not None and name not in allowed:
                raise ValueError(f"WorkloadConfig.{name} does not apply to kind {self.kind!r}")
        getattr(self, f"_check_{self.kind}")()
        try:
            self.sampling_params(1)
        except ValueError as e:
            raise ValueError(f"WorkloadConfig.{e}") from None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """A request's SamplingParams: this workload's sampling, exactly ``max_tokens`` new tokens."""
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k)

    def _check_fixed(self) -> None:
        explicit = self.prompt_len is not None or self.decode_len is not None
        if explicit and (self.length is not None or self.pd_ratio is not None):
            raise ValueError("WorkloadConfig: kind 'fixed' takes prompt_len + decode_len, or length + "
                             "pd_ratio, not both")
        if explicit:
            check_int("WorkloadConfig.prompt_len", self.prompt_len, 1)
            check_int("WorkloadConfig.decode_len", self.decode_len, 1)
            return
        if self.length is None:
            raise ValueError("WorkloadConfig.length (or prompt_len + decode_len) is required for kind 'fixed'")
        check_int("WorkloadConfig.length", self.length, 2)  # one prompt + one decode token at least
        self._require_pd()

    def _check_uniform(self) -> None:
        if self.min_len is None or self.max_len is None:
            raise ValueError(f"WorkloadConfig.min_len and max_len are required for kind {self.kind!r}")
        check_int("WorkloadConfig.min_len", self.min_len, 2)
        check_int("WorkloadConfig.max_len", self.max_len, 2)
        if self.min_len > self.max_len:
            raise ValueError(f"WorkloadConfig.min_len={self.min_len} must be ≤ max_len={self.max_len}")
        self._require_pd()

    def _check_zipf(self) -> None:
        self._check_uniform()
        if self.theta is None:
            raise ValueError("WorkloadConfig.theta is required for kind 'zipf'")
        if not is_number(self.theta) or self.theta < 0:
            raise ValueError(f"WorkloadConfig.theta must be a finite number ≥ 0, got {self.theta!r}")

    def _check_trace(self) -> None:
        if not self.trace_path:
            raise ValueError("WorkloadConfig.trace_path is required for kind 'trace'")
        if not isinstance(self.trace_path, str):
            raise ValueError(f"WorkloadConfig.trace_path must be a file path (a string), got {self.trace_path!r}")

    def _require_pd(self) -> None:
        if self.pd_ratio is None:
            raise ValueError(f"WorkloadConfig.pd_ratio is required for kind {self.kind!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "workload") -> WorkloadConfig:
        """Build from a YAML/JSON mapping; an unknown key raises ValueError naming ``where.key``."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{where} must be a mapping, got {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        for key in data:
            if key not in names:
                raise ValueError(f"unknown key {where}.{key} (known: {', '.join(sorted(names))})")
        return cls(**dict(data))

    @property
    def max_total_len(self) -> int | None:
        """Longest prompt + decode this config can produce; None for a trace (unknown unread)."""
        if self.kind == "fixed":
            return self.length if self.length is not None else self.prompt_len + self.decode_len
        return self.max_len


def workload_summary(cfg: WorkloadConfig) -> dict[str, Any]:
    """JSON-able description of the workload for summary.json (None where a field does not apply)."""
    keys = ("kind", "num_requests", "pd_ratio", "theta", "min_len", "max_len", "arrival", "rate", "seed")
    out = {k: getattr(cfg, k) for k in keys}
    if cfg.shared_prefix is not None:
        out["shared_prefix"] = cfg.shared_prefix
    if cfg.temperature:
        out.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    extra = {"fixed": ("prompt_len", "decode_len", "length"), "trace": ("trace_path",)}.get(cfg.kind, ())
    out.update({k: getattr(cfg, k) for k in extra})
    # numpy scalars (from callers building configs programmatically) are not JSON-able
    return {k: v.item() if isinstance(v, np.generic) else v for k, v in out.items()}
