"""Benchmark workloads: synthetic request streams and trace replay.

``generate_workload`` turns a ``pp_runtime.workload_config.WorkloadConfig`` into its requests:
lengths drawn and split by P:D as the config says, token ids uniform, arrivals at once or
Poisson. Everything is seeded, so a config always yields the same requests.

    from pp_runtime.workload import generate_workload
    from pp_runtime.workload_config import WorkloadConfig

    cfg = WorkloadConfig(kind="zipf", num_requests=64, min_len=256, max_len=1024, theta=0.4,
                         pd_ratio=10, arrival="poisson", rate=8.0, seed=0)
    items = generate_workload(cfg, vocab_size=49152)
    items[0].request_id, items[0].prompt_token_ids, items[0].max_tokens, items[0].arrival_s

Trace files are JSONL, one request per line: ``prompt_token_ids`` (or ``prompt_len``, ids then
drawn like a synthetic workload), ``max_tokens`` (or ``decode_len``), optional ``id`` and
``arrival_s``; replay keeps the file's order, ids, token ids and arrival times.
``save_trace`` writes items in that format, so a generated workload round-trips.

Plain Python + numpy: no torch, no Ray (the bench command and the simulator both use it).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from pp_runtime.field_checks import check_int, is_int, is_number
from pp_runtime.workload_config import WorkloadConfig

# Ids 0..2 are the usual special tokens (unk/bos/eos or pad) of LLaMA-family vocabularies:
# a synthetic prompt full of EOS/BOS would not be a realistic prompt.
MIN_TOKEN_ID = 3


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
    if not is_int(vocab_size) or vocab_size <= MIN_TOKEN_ID:
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
    if cfg.shared_prefix:  # its own stream: the rest of every prompt stays what the seed gave
        prefix = _token_ids(np.random.default_rng([cfg.seed, 1]), [cfg.shared_prefix], vocab_size)[0]
        ids = [prefix[:len(p)] + p[cfg.shared_prefix:] for p in ids]
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
        if not isinstance(prompt, list) or not prompt or not all(is_int(t) for t in prompt):
            raise ValueError(f"{where}: prompt_token_ids must be a non-empty list of integers")
        # Fail the whole benchmark early rather than have requests silently finish with errors.
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise ValueError(f"{where}: prompt_token_ids outside the vocabulary [0, {vocab_size})")
    elif "prompt_len" in obj:
        prompt = obj["prompt_len"]
        check_int(f"{where}: prompt_len", prompt, 1)
    else:
        raise ValueError(f"{where}: needs prompt_token_ids or prompt_len")
    decode = obj.get("max_tokens", obj.get("decode_len"))
    if decode is None:
        raise ValueError(f"{where}: needs max_tokens or decode_len")
    check_int(f"{where}: max_tokens", decode, 1)
    arrival = obj.get("arrival_s")
    if arrival is not None and (not is_number(arrival) or arrival < 0):
        raise ValueError(f"{where}: arrival_s must be a finite number ≥ 0, got {arrival!r}")
    rid = obj.get("id", f"trace-{index}")
    return str(rid), prompt, int(decode), None if arrival is None else float(arrival)


def save_trace(items: Iterable[WorkItem], path: str | Path) -> None:
    """Write items as a trace JSONL that generate_workload(kind="trace") replays exactly."""
    with Path(path).open("w") as fh:
        for item in items:
            fh.write(json.dumps(item.to_json()) + "\n")
