"""Benchmark workloads: synthetic request streams and trace replay, plus the run-config YAML.

Synthetic workloads follow the SARATHI paper and sarathi-serve: the TOTAL sequence length
(prompt + decode) is drawn fixed, uniform, or Zipf(θ) between ``min_len`` and ``max_len``
(shorter lengths more likely; θ = 0 is uniform), then split by the P:D ratio (prompt tokens
per decode token). Arrivals are all at once or a Poisson process. Everything is seeded, so a
config always yields the same requests.

    from pp_runtime.workload import WorkloadConfig, generate_workload, load_run_config

    cfg = WorkloadConfig(kind="zipf", num_requests=64, min_len=256, max_len=1024, theta=0.4,
                         pd_ratio=10, arrival="poisson", rate=8.0, seed=0)
    items = generate_workload(cfg, vocab_size=49152)
    items[0].request_id, items[0].prompt_token_ids, items[0].max_tokens, items[0].arrival_s

    run = load_run_config("configs/runs/pp2_zipf.yaml").with_overrides(pp=3, chunk_size=None)
    run.engine        # {"model": "smollm2-135m", "pp": 3, ...}: keyword arguments for pp_runtime.LLM
    run.schedulers    # ("sarathi", "orca", "prefill_first", "request_level")
    run.workload      # WorkloadConfig
    workload_summary(run.workload)   # JSON-able, for summary.json

Trace files are JSONL, one request per line: ``prompt_token_ids`` (or ``prompt_len``, ids then
drawn like a synthetic workload), ``max_tokens`` (or ``decode_len``), optional ``id`` and
``arrival_s``; replay keeps the file's order, ids, token ids and arrival times.
``save_trace`` writes items in that format, so a generated workload round-trips.

Plain Python + numpy: no torch, no Ray (the bench command and the simulator both use it).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import yaml

from pp_runtime.config import SCHEDULER_POLICIES, is_layer_count

WORKLOAD_KINDS = ("fixed", "uniform", "zipf", "trace")
ARRIVALS = ("all", "poisson")
# Ids 0..2 are the usual special tokens (unk/bos/eos or pad) of LLaMA-family vocabularies:
# a synthetic prompt full of EOS/BOS would not be a realistic prompt.
MIN_TOKEN_ID = 3

# Keys of the run YAML that become pp_runtime.LLM keyword arguments. The first ten are the
# documented schema; the rest are further LLM settings accepted so a config can pin them.
ENGINE_KEYS = ("model", "pp", "tp", "chunk_size", "max_batch_size", "tile_align", "memory_budget_gb",
               "max_model_len", "threads", "seed", "launcher", "dtype", "device", "attention",
               "block_size", "partition", "gguf_weights", "kv_cache_dtype", "matmul_precision", "chunk_budget")
RUN_KEYS = ENGINE_KEYS + ("schedulers", "workload")


# ---------------------------------------------------------------------------------------------
# validation helpers: every message names the field, as the rest of pp_runtime.config does


def _is_int(value: object) -> bool:
    # bool is an int subclass; `pp: true` in YAML is a mistake, not 1
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, (float, np.floating))) and math.isfinite(float(value))


def _check_int(name: str, value: object, minimum: int) -> None:
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an integer ≥ {minimum}, got {value!r}")


def _check_positive_number(name: str, value: object) -> None:
    if not _is_number(value) or float(value) <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


# ---------------------------------------------------------------------------------------------
# workload


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

    def __post_init__(self) -> None:
        if self.kind not in WORKLOAD_KINDS:
            raise ValueError(f"WorkloadConfig.kind must be one of {', '.join(WORKLOAD_KINDS)}, got {self.kind!r}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"WorkloadConfig.arrival must be one of {', '.join(ARRIVALS)}, got {self.arrival!r}")
        if self.num_requests is not None:
            _check_int("WorkloadConfig.num_requests", self.num_requests, 1)
        elif self.kind != "trace":
            raise ValueError(f"WorkloadConfig.num_requests is required for kind {self.kind!r}")
        _check_int("WorkloadConfig.seed", self.seed, 0)
        if self.pd_ratio is not None:
            _check_positive_number("WorkloadConfig.pd_ratio", self.pd_ratio)
        if self.arrival == "poisson":
            if self.rate is None:
                raise ValueError("WorkloadConfig.rate (requests/s) is required for arrival 'poisson'")
            _check_positive_number("WorkloadConfig.rate", self.rate)
        elif self.rate is not None:
            raise ValueError("WorkloadConfig.rate applies only to arrival 'poisson'")
        allowed = {"fixed": {"prompt_len", "decode_len", "length", "pd_ratio"},
                   "uniform": {"min_len", "max_len", "pd_ratio"},
                   "zipf": {"min_len", "max_len", "theta", "pd_ratio"},
                   "trace": {"trace_path"}}[self.kind]
        for name in ("prompt_len", "decode_len", "length", "min_len", "max_len", "theta", "pd_ratio",
                     "trace_path"):
            if getattr(self, name) is not None and name not in allowed:
                raise ValueError(f"WorkloadConfig.{name} does not apply to kind {self.kind!r}")
        getattr(self, f"_check_{self.kind}")()

    def _check_fixed(self) -> None:
        explicit = self.prompt_len is not None or self.decode_len is not None
        if explicit and (self.length is not None or self.pd_ratio is not None):
            raise ValueError("WorkloadConfig: kind 'fixed' takes prompt_len + decode_len, or length + "
                             "pd_ratio, not both")
        if explicit:
            _check_int("WorkloadConfig.prompt_len", self.prompt_len, 1)
            _check_int("WorkloadConfig.decode_len", self.decode_len, 1)
            return
        if self.length is None:
            raise ValueError("WorkloadConfig.length (or prompt_len + decode_len) is required for kind 'fixed'")
        _check_int("WorkloadConfig.length", self.length, 2)  # one prompt + one decode token at least
        self._require_pd()

    def _check_uniform(self) -> None:
        if self.min_len is None or self.max_len is None:
            raise ValueError(f"WorkloadConfig.min_len and max_len are required for kind {self.kind!r}")
        _check_int("WorkloadConfig.min_len", self.min_len, 2)
        _check_int("WorkloadConfig.max_len", self.max_len, 2)
        if self.min_len > self.max_len:
            raise ValueError(f"WorkloadConfig.min_len={self.min_len} must be ≤ max_len={self.max_len}")
        self._require_pd()

    def _check_zipf(self) -> None:
        self._check_uniform()
        if self.theta is None:
            raise ValueError("WorkloadConfig.theta is required for kind 'zipf'")
        if not _is_number(self.theta) or self.theta < 0:
            raise ValueError(f"WorkloadConfig.theta must be a finite number ≥ 0, got {self.theta!r}")

    def _check_trace(self) -> None:
        if not self.trace_path:
            raise ValueError("WorkloadConfig.trace_path is required for kind 'trace'")

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


@dataclass(frozen=True)
class WorkItem:
    """One request of a workload; arrival_s is the offset from the start of the run."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def total_len(self) -> int:
        return len(self.prompt_token_ids) + self.max_tokens

    def to_json(self) -> dict[str, Any]:
        """The DESIGN.md §3.3 input line plus arrival_s (what save_trace writes)."""
        return {"id": self.request_id, "prompt_token_ids": list(self.prompt_token_ids),
                "max_tokens": self.max_tokens, "arrival_s": self.arrival_s}


def split_pd(total: np.ndarray, pd_ratio: float) -> tuple[np.ndarray, np.ndarray]:
    """Split total lengths L into (prompt, decode) = (round(L·pd/(pd+1)), L − prompt), each ≥ 1.

    Rounds half up (floor(x + 0.5)) rather than numpy's half-to-even so that the split of a
    length does not depend on whether its exact quotient happens to be even."""
    total = np.asarray(total, dtype=np.int64)
    prompt = np.floor(total * (pd_ratio / (pd_ratio + 1.0)) + 0.5).astype(np.int64)
    prompt = np.clip(prompt, 1, total - 1)
    return prompt, total - prompt


def zipf_pmf(min_len: int, max_len: int, theta: float) -> np.ndarray:
    """P(L = min_len + i) ∝ 1/(i+1)^theta for i = 0..max_len−min_len (index i of the result)."""
    weights = np.arange(1, max_len - min_len + 2, dtype=np.float64) ** -float(theta)
    return weights / weights.sum()


def _rngs(seed: int) -> tuple[np.random.Generator, np.random.Generator, np.random.Generator]:
    # Independent streams for lengths, token ids and arrivals: switching arrival "all" → "poisson"
    # (or changing the vocabulary) must not change the lengths a seed gives.
    lengths, tokens, arrivals = np.random.SeedSequence(seed).spawn(3)
    return np.random.default_rng(lengths), np.random.default_rng(tokens), np.random.default_rng(arrivals)


def _sample_totals(cfg: WorkloadConfig, rng: np.random.Generator) -> np.ndarray:
    n = cfg.num_requests
    if cfg.kind == "uniform":
        return rng.integers(cfg.min_len, cfg.max_len + 1, size=n, dtype=np.int64)
    if cfg.kind == "zipf":
        pmf = zipf_pmf(cfg.min_len, cfg.max_len, cfg.theta)
        return cfg.min_len + rng.choice(len(pmf), size=n, p=pmf).astype(np.int64)
    return np.full(n, cfg.length, dtype=np.int64)


def _arrivals(cfg: WorkloadConfig, n: int, rng: np.random.Generator) -> list[float]:
    if cfg.arrival == "all":
        return [0.0] * n
    # Poisson process: exponential gaps with mean 1/rate, so arrivals are sorted by construction.
    return np.cumsum(rng.exponential(1.0 / float(cfg.rate), size=n)).tolist()


def _token_ids(rng: np.random.Generator, lengths: Iterable[int], vocab_size: int) -> list[list[int]]:
    lengths = [int(n) for n in lengths]
    # One draw for the whole workload, then split: much faster than one call per request.
    flat = rng.integers(MIN_TOKEN_ID, vocab_size, size=sum(lengths), dtype=np.int64).tolist()
    out, start = [], 0
    for n in lengths:
        out.append(flat[start:start + n])
        start += n
    return out


def generate_workload(cfg: WorkloadConfig, vocab_size: int) -> list[WorkItem]:
    """The requests of ``cfg``, identical for identical (cfg, vocab_size). Synthetic token ids are
    uniform on [3, vocab_size). Raises ValueError for a bad vocab_size or trace file."""
    if not _is_int(vocab_size) or vocab_size <= MIN_TOKEN_ID:
        raise ValueError(f"vocab_size must be an integer > {MIN_TOKEN_ID}, got {vocab_size!r}")
    len_rng, tok_rng, arr_rng = _rngs(cfg.seed)
    if cfg.kind == "trace":
        return _replay_trace(cfg, vocab_size, tok_rng, arr_rng)
    n = cfg.num_requests
    if cfg.kind == "fixed" and cfg.prompt_len is not None:
        prompts, decodes = np.full(n, cfg.prompt_len), np.full(n, cfg.decode_len)
    else:
        prompts, decodes = split_pd(_sample_totals(cfg, len_rng), float(cfg.pd_ratio))
    ids = _token_ids(tok_rng, prompts, vocab_size)
    width = len(str(n - 1))  # zero-padded ids sort in request order
    return [WorkItem(f"req-{i:0{width}d}", ids[i], int(decodes[i]), arrival)
            for i, arrival in enumerate(_arrivals(cfg, n, arr_rng))]


def _replay_trace(cfg: WorkloadConfig, vocab_size: int, tok_rng: np.random.Generator,
                  arr_rng: np.random.Generator) -> list[WorkItem]:
    path = Path(cfg.trace_path)
    if not path.is_file():
        raise ValueError(f"WorkloadConfig.trace_path {str(path)!r} is not a file")
    rows: list[tuple[str, list[int] | int, int, float | None]] = []
    with path.open() as fh:
        for lineno, text in enumerate(fh, 1):
            if not text.strip():
                continue
            if cfg.num_requests is not None and len(rows) == cfg.num_requests:
                break
            rows.append(_parse_trace_line(text, lineno, path, vocab_size, len(rows)))
    if not rows:
        raise ValueError(f"trace {path}: no requests")
    timed = [r[3] is not None for r in rows]
    if any(timed) and not all(timed):
        raise ValueError(f"trace {path}: arrival_s must be on every line or on none")
    if all(timed) and cfg.arrival == "poisson":
        raise ValueError(f"trace {path} has arrival_s; WorkloadConfig.arrival 'poisson' would override it "
                         f"(use arrival 'all' to replay the trace's times)")
    # Lines that give only prompt_len get token ids the same way a synthetic workload does.
    drawn = iter(_token_ids(tok_rng, [r[1] for r in rows if isinstance(r[1], int)], vocab_size))
    arrivals = [r[3] for r in rows] if all(timed) else _arrivals(cfg, len(rows), arr_rng)
    return [WorkItem(rid, prompt if isinstance(prompt, list) else next(drawn), decode, float(arrival))
            for (rid, prompt, decode, _), arrival in zip(rows, arrivals)]


def _parse_trace_line(text: str, lineno: int, path: Path, vocab_size: int,
                      index: int) -> tuple[str, list[int] | int, int, float | None]:
    """(id, prompt ids or prompt length, decode length, arrival_s or None) of one trace line."""
    where = f"trace {path} line {lineno}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object")
    if "prompt_token_ids" in obj:
        prompt = obj["prompt_token_ids"]
        if not isinstance(prompt, list) or not prompt or not all(_is_int(t) for t in prompt):
            raise ValueError(f"{where}: prompt_token_ids must be a non-empty list of integers")
        # Fail the whole benchmark early rather than have requests silently finish with errors.
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise ValueError(f"{where}: prompt_token_ids outside the vocabulary [0, {vocab_size})")
    elif "prompt_len" in obj:
        prompt = obj["prompt_len"]
        _check_int(f"{where}: prompt_len", prompt, 1)
    else:
        raise ValueError(f"{where}: needs prompt_token_ids or prompt_len")
    decode = obj.get("max_tokens", obj.get("decode_len"))
    if decode is None:
        raise ValueError(f"{where}: needs max_tokens or decode_len")
    _check_int(f"{where}: max_tokens", decode, 1)
    arrival = obj.get("arrival_s")
    if arrival is not None and (not _is_number(arrival) or arrival < 0):
        raise ValueError(f"{where}: arrival_s must be a finite number ≥ 0, got {arrival!r}")
    rid = obj.get("id", f"trace-{index}")
    return str(rid), prompt, int(decode), None if arrival is None else float(arrival)


def save_trace(items: Iterable[WorkItem], path: str | Path) -> None:
    """Write items as a trace JSONL that generate_workload(kind="trace") replays exactly."""
    with Path(path).open("w") as fh:
        for item in items:
            fh.write(json.dumps(item.to_json()) + "\n")


def workload_summary(cfg: WorkloadConfig) -> dict[str, Any]:
    """JSON-able description of the workload for summary.json (None where a field does not apply)."""
    keys = ("kind", "num_requests", "pd_ratio", "theta", "min_len", "max_len", "arrival", "rate", "seed")
    out = {k: getattr(cfg, k) for k in keys}
    extra = {"fixed": ("prompt_len", "decode_len", "length"), "trace": ("trace_path",)}.get(cfg.kind, ())
    out.update({k: getattr(cfg, k) for k in extra})
    # numpy scalars (from callers building configs programmatically) are not JSON-able
    return {k: v.item() if isinstance(v, np.generic) else v for k, v in out.items()}


# ---------------------------------------------------------------------------------------------
# run config


def _check_engine(engine: Mapping[str, Any]) -> None:
    """Type/range checks of the engine keys, naming the key; deeper checks (model exists, pp fits
    the layers, memory budget) happen when pp_runtime.LLM is built."""
    for key, value in engine.items():
        if key not in ENGINE_KEYS:
            raise ValueError(f"unknown engine key {key!r} (known: {', '.join(ENGINE_KEYS)})")
        if key in ("model", "launcher", "dtype", "device", "attention", "gguf_weights", "kv_cache_dtype",
                   "matmul_precision", "chunk_budget"):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{key} must be a string, got {value!r}")
        elif key in ("pp", "tp", "chunk_size", "max_batch_size", "max_model_len", "block_size"):
            _check_int(key, value, 1)
        elif key in ("threads", "seed"):
            _check_int(key, value, 0)
        elif key == "tile_align":
            if not isinstance(value, bool):
                raise ValueError(f"tile_align must be true or false, got {value!r}")
        elif key == "memory_budget_gb":
            _check_positive_number(key, value)
        elif key == "partition":
            if not isinstance(value, (list, tuple)) or not value or not all(is_layer_count(v) for v in value):
                raise ValueError(f"partition must be a list of positive layer counts (multiples of 0.5), got {value!r}")


@dataclass(frozen=True)
class RunConfig:
    """A bench setup: engine = keyword arguments of pp_runtime.LLM (only those the YAML set; the
    scheduler policy is not among them, it comes from ``schedulers``), the policies to compare
    and the workload."""

    engine: dict[str, Any]
    workload: WorkloadConfig
    schedulers: tuple[str, ...] = SCHEDULER_POLICIES

    def __post_init__(self) -> None:
        if not isinstance(self.engine, dict):
            raise ValueError(f"RunConfig.engine must be a dict, got {type(self.engine).__name__}")
        _check_engine(self.engine)
        if not isinstance(self.workload, WorkloadConfig):
            raise ValueError("RunConfig.workload must be a WorkloadConfig")
        if isinstance(self.schedulers, str) or not isinstance(self.schedulers, (list, tuple)) \
                or not self.schedulers:
            raise ValueError(f"schedulers must be a non-empty list, got {self.schedulers!r}")
        for name in self.schedulers:
            if name not in SCHEDULER_POLICIES:
                raise ValueError(f"schedulers: unknown scheduler {name!r} (known: {', '.join(SCHEDULER_POLICIES)})")
        if len(set(self.schedulers)) != len(self.schedulers):
            raise ValueError(f"schedulers lists a scheduler twice: {list(self.schedulers)}")
        # Every request longer than the model length would come back as an error, not a result.
        longest, max_len = self.workload.max_total_len, self.engine.get("max_model_len")
        if longest is not None and max_len is not None and longest > max_len:
            raise ValueError(f"workload: requests up to {longest} tokens exceed max_model_len={max_len}")
        object.__setattr__(self, "schedulers", tuple(self.schedulers))  # a YAML list → the tuple form

    def with_overrides(self, **engine_kwargs: Any) -> RunConfig:
        """A copy with these engine values replaced (command-line overrides); None means "not
        given" and keeps the config's value. Unknown keys raise ValueError."""
        given = {k: v for k, v in engine_kwargs.items() if v is not None}
        if "partition" in given:
            given["partition"] = list(given["partition"])
        return replace(self, engine={**self.engine, **given})


def read_yaml_mapping(path: Path, what: str) -> dict:
    """A YAML file whose top level is a mapping; ValueError names ``what`` and the path when it
    cannot be read, is not YAML or is not a mapping (run and simulation configs alike)."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {what} {str(path)!r}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{what} {path}: invalid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path}: expected a mapping at the top level")
    return data


def load_run_config(path: str | Path) -> RunConfig:
    """Read a run YAML (configs/runs/*.yaml). Every key is optional except ``workload``; an
    unknown key raises ValueError naming it. A relative workload.trace_path is taken relative to
    the YAML's folder when the file is there, else as given (relative to the working directory).
    A workload without its own seed uses the run's seed."""
    path = Path(path)
    data = read_yaml_mapping(path, "run config")
    for key in data:
        if key not in RUN_KEYS:
            raise ValueError(f"run config {path}: unknown key {key!r} (known: {', '.join(RUN_KEYS)})")
    if "workload" not in data:
        raise ValueError(f"run config {path}: workload is required")
    wl = data["workload"]
    if isinstance(wl, dict):
        wl = dict(wl)
        wl.setdefault("seed", data.get("seed", 0))
        trace = wl.get("trace_path")
        if isinstance(trace, str) and not Path(trace).is_absolute() and (path.parent / trace).is_file():
            wl["trace_path"] = str(path.parent / trace)
    try:
        engine = {k: data[k] for k in ENGINE_KEYS if k in data}
        return RunConfig(engine=engine, workload=WorkloadConfig.from_dict(wl),
                         schedulers=data.get("schedulers", SCHEDULER_POLICIES))
    except ValueError as exc:
        raise ValueError(f"run config {path}: {exc}") from None
