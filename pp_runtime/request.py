"""Requests, sampling parameters and per-request sequence state.

A request moves waiting → running (prefilling, then decoding) → finished. A preempted
request goes back to waiting with its generated tokens kept: on re-admission the prompt
and those tokens are recomputed as one longer prefill, so nothing is lost.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable

from pp_runtime.batch import SAMPLING_EPS, LogitsEdit
from pp_runtime.field_checks import is_int, is_number


# Seeds torch's generators take (torch.Generator.manual_seed): a seed outside would be reduced,
# two seeds then drawing the same tokens
SEED_RANGE = (-(1 << 63), 1 << 64)
# The most top alternatives ``logprobs`` asks for, per token (vLLM's default max_logprobs)
MAX_LOGPROBS = 20
# The most samples ``n`` asks for of one prompt: each is a sequence of its own, so a typo like
# n=10**9 would fill the driver's memory with requests instead of naming the problem
MAX_N = 1024


@dataclass(frozen=True, kw_only=True)  # by name: SamplingParams(2) read as n=2 in older vLLM
class SamplingParams:
    """How to pick each new token. temperature 0 (or under 1e-5, as vLLM) means greedy; seed makes
    sampling reproducible; n > 1 samples the prompt n times (pp_runtime/parallel_sampling.py)."""

    n: int = 1
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # vLLM's stop strings: generation stops once the output's text holds one; the text ends
    # before it (or after it, with include_stop_str_in_output), the tokens at the one completing it
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    # vLLM's logprobs: None none; N: each new token's log-probability under the model (its raw
    # logits' log-softmax, before temperature and cuts), with the N likeliest tokens' beside it
    logprobs: int | None = None
    # vLLM's: no EOS or stop token id (and no stop string) ends the output before min_tokens
    min_tokens: int = 0
    # vLLM's penalties, on the logits before temperature: presence subtracts itself from every
    # token the output holds, frequency itself times the token's count there; repetition divides a
    # positive logit of a token of the prompt or output by itself and multiplies a negative one
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        """Checks every field by name; numpy scalars become Python numbers, top_k -1 (vLLM's
        other spelling of "off") 0, stop_token_ids None no stops, and a list of them a tuple;
        stop: one string or a list of them."""
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}] (samples of the prompt), got {self.n!r}")
        if not is_int(self.max_tokens) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number ≥ 0, got {self.temperature!r}")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer ≥ 0 (0 or -1: off), got {self.top_k!r}")
        if self.seed is not None and not (is_int(self.seed) and SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):  # "false" would be truthy
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        stops = () if self.stop_token_ids is None else self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not hasattr(stops, "__iter__"):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        stops = tuple(stops)
        if not all(is_int(t) and t >= 0 for t in stops):
            raise ValueError(f"stop_token_ids must be integers ≥ 0 (token ids), got {list(stops)!r}")
        if self.n > 1 and self.temperature < SAMPLING_EPS:  # n copies of one greedy output: as vLLM, an error
            raise ValueError(f"n must be 1 when sampling is greedy (temperature 0), got n={self.n}")
        set_("n", int(self.n))
        set_("max_tokens", int(self.max_tokens))
        set_("temperature", float(self.temperature))
        set_("top_p", float(self.top_p))
        set_("top_k", max(0, int(self.top_k)))
        set_("seed", None if self.seed is None else int(self.seed))
        set_("stop_token_ids", tuple(int(t) for t in stops))  # hashable, plain ints
        strings = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) and s for s in strings):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(f"include_stop_str_in_output must be true or false, got {self.include_stop_str_in_output!r}")
        set_("stop", tuple(strings))
        if self.logprobs is not None and not (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (alternatives per token) or "
                             f"null, got {self.logprobs!r}")
        set_("logprobs", None if self.logprobs is None else int(self.logprobs))
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        set_("min_tokens", int(self.min_tokens))
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_number(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
            set_(name, float(v))
        if not is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 1e4:
            raise ValueError(f"repetition_penalty must be a number > 0 (1: off), got {self.repetition_penalty!r}")
        set_("repetition_penalty", float(self.repetition_penalty))

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability at one position, and its rank there (1: the likeliest)."""

    logprob: float
    rank: int


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
    index: int = 0  # which of its prompt's samples this sequence is (parallel_sampling.py; vLLM's)
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
    # params.logprobs set: per output token, {token id: Logprob}, the sampled token first
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    # stop strings (params.stop): called with the request after each new token, True once its text
    # holds one, and then it sets ``text`` (the output's text, cut there); the scheduler needs no
    # tokenizer for it. search=False (within min_tokens): it reads the new text without searching it
    stop_check: Callable[..., bool] | None = field(default=None, repr=False)
    text: str | None = None
    # for penalties: the outputs counted so far, and the distinct prompt + output tokens (kept
    # as tokens arrive, so a step costs the new tokens, not the whole output)
    _counts: dict[int, int] = field(default_factory=dict, repr=False)
    _counted: int = field(default=0, repr=False)
    _seen: set[int] | None = field(default=None, repr=False)

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

    def logits_edit(self, eos_ids: frozenset[int]) -> LogitsEdit | None:
        """What the next token's logits need changed (LogitsEdit), or None: the penalties, and
        while the output is shorter than min_tokens the ids that would stop it (the model's
        ``eos_ids`` unless ignored, and the request's own stop ids)."""
        p = self.params
        early = len(self.output_token_ids) < p.min_tokens
        if not (early or p.has_penalties):
            return None
        banned = tuple(sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else eos_ids))) if early else ()
        if not p.has_penalties:
            return LogitsEdit(banned) if banned else None
        for t in self.output_token_ids[self._counted:]:
            self._counts[t] = self._counts.get(t, 0) + 1
            if self._seen is not None:
                self._seen.add(t)
        self._counted = len(self.output_token_ids)
        context: tuple[int, ...] = ()
        if p.repetition_penalty != 1:
            if self._seen is None:
                self._seen = set(self.prompt_token_ids) | set(self._counts)
            context = tuple(self._seen)
        return LogitsEdit(banned, p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
                          tuple(self._counts), tuple(self._counts.values()), context)

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
