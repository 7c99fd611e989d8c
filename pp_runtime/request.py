"""Requests, sampling parameters and per-request sequence state.

A request moves waiting → running (prefilling, then decoding) → finished. A preempted
request goes back to waiting with its generated tokens kept: on re-admission the prompt
and those tokens are recomputed as one longer prefill, so nothing is lost.
"""
from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token. temperature 0 means greedy; seed makes sampling reproducible."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number ≥ 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer ≥ 0, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        stops = tuple(self.stop_token_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in stops):
            raise ValueError(f"stop_token_ids must be integers, got {list(stops)!r}")
        object.__setattr__(self, "stop_token_ids", stops)  # normalise lists to a hashable tuple


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class Phase(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """One generation request and its progress through the pipeline.

    num_scheduled: tokens of ``all_token_ids`` already handed to the pipeline (their K/V is
    in the cache, or will be once the micro-batches in flight land).
    prefill_len: tokens to prefill since the last (re)admission: the prompt, plus the
    generated tokens when the request is recomputed after a preemption.
    """

    request_id: str
    seq_id: int  # compact integer id used on the wire and in the block manager
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    phase: Phase = Phase.WAITING
    num_scheduled: int = 0
    prefill_len: int = 0
    in_flight: int = 0  # micro-batches in flight that contain this request
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held at the first admission (vLLM's)
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + outputs, without concatenating both lists."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def is_prefilling(self) -> bool:
        return self.phase is Phase.RUNNING and self.num_scheduled < self.prefill_len

    @property
    def is_decoding(self) -> bool:
        return self.phase is Phase.RUNNING and self.num_scheduled >= self.prefill_len

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED

    def admit(self, cached: int = 0) -> None:
        """Start running; ``cached``: leading tokens whose K/V the prefix cache holds already."""
        self.phase = Phase.RUNNING
        self.prefill_len = self.num_tokens
        self.num_scheduled = cached
        if not self.num_preemptions:  # a recomputation's hit is mostly its own blocks: not the prompt's
            self.num_cached_tokens = cached

    def preempt(self) -> None:
        """Drop all cached state; the request will be recomputed from its tokens."""
        self.phase = Phase.WAITING
        self.num_scheduled = 0
        self.num_preemptions += 1

    def finish(self, reason: str, error: str | None = None) -> None:
        self.phase = Phase.FINISHED
        self.finish_reason = reason
        self.error = error
        self.finish_time = time.perf_counter()


@dataclass
class RequestOutput:
    """What a caller gets back for one request (DESIGN.md §3.3 output line)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    error: str | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    text: str | None = None
    num_cached_tokens: int = 0  # of its prompt, found in the prefix cache (vLLM's field)

    @classmethod
    def from_request(cls, req: Request) -> "RequestOutput":
        ttft = None if req.first_token_time is None else req.first_token_time - req.arrival_time
        lat = None if req.finish_time is None else req.finish_time - req.arrival_time
        return cls(req.request_id, list(req.prompt_token_ids), list(req.output_token_ids),
                   req.finish_reason or "error", req.error, ttft, lat, num_cached_tokens=req.num_cached_tokens)

    def to_json(self) -> dict:
        out = {"id": self.request_id, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
               "error": self.error, "ttft_s": self.ttft_s, "latency_s": self.latency_s}
        if self.text is not None:
            out["text"] = self.text
        return out
