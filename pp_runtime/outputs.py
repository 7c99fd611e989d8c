"""What a caller gets back: one RequestOutput per request (DESIGN.md §3.3 output line), each
sample of it (SamplingParams.n) a CompletionOutput, as vLLM's.

    out = RequestOutput.from_samples(seqs)   # a request's sequences, sample 0 first
    out.token_ids, out.outputs[1].text       # sample 0's fields; every sample's
    out.to_json()                            # the JSONL line ("outputs" too where n > 1)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from pp_runtime.request import Logprob, Request


@dataclass
class CompletionOutput:
    """One sample of a request (vLLM's CompletionOutput): ``index`` says which of its n."""

    index: int
    token_ids: list[int]
    finish_reason: str | None
    text: str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    error: str | None = None

    @classmethod
    def of(cls, req: Request) -> "CompletionOutput":
        return cls(req.index, list(req.output_token_ids), req.finish_reason or "error", req.text,
                   logprobs_of(req), req.error)

    def to_json(self) -> dict:
        out = {"index": self.index, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
               "error": self.error}
        if self.text is not None:
            out["text"] = self.text
        if self.logprobs is not None:
            out["logprobs"] = logprobs_json(self.logprobs)
        return out


@dataclass
class RequestOutput:
    """What a caller gets back for one request (DESIGN.md §3.3 output line). Its fields are its
    first sample's but ttft_s and latency_s, which span every sample; ``outputs`` holds every
    sample (SamplingParams.n of them), as vLLM's does."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    error: str | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    text: str | None = None
    num_cached_tokens: int = 0  # of its prompt, found in the prefix cache (vLLM's field)
    # with SamplingParams.logprobs: one {token id: Logprob} per token of token_ids, the sampled first
    logprobs: list[dict[int, Logprob]] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)  # empty: the one sample above

    def __post_init__(self) -> None:
        if not self.outputs:
            self.outputs = [CompletionOutput(0, self.token_ids, self.finish_reason, self.text, self.logprobs,
                                             self.error)]

    @classmethod
    def from_request(cls, req: Request) -> "RequestOutput":
        return cls.from_samples([req])

    @classmethod
    def from_samples(cls, reqs: list[Request]) -> "RequestOutput":
        """The output of one request from its samples' sequences, the first sample first: its first
        token came when any sample's did, and it ended when the last sample did."""
        first = reqs[0]
        starts = [r.first_token_time for r in reqs if r.first_token_time is not None]
        ends = [r.finish_time for r in reqs]
        ttft = min(starts) - first.arrival_time if starts else None
        lat = None if None in ends else max(ends) - first.arrival_time
        outs = [CompletionOutput.of(r) for r in reqs]
        one = outs[0]
        return cls(first.request_id, list(first.prompt_token_ids), one.token_ids, one.finish_reason, one.error,
                   ttft, lat, one.text, first.num_cached_tokens, one.logprobs, outs)

    def fill_texts(self, decode: Callable[[list[int]], str]) -> None:
        """Each sample's text from its tokens, but where it has one (cut at a stop string) or failed."""
        for c in self.outputs:
            if c.finish_reason != "error" and c.text is None:
                c.text = decode(c.token_ids)
        self.text = self.outputs[0].text

    def clear_texts(self) -> None:
        for c in self.outputs:
            c.text = None
        self.text = None

    def to_json(self) -> dict:
        """The §3.3 line; with n > 1 samples, every sample in "outputs" too (the line's own fields: the first's)."""
        out = {"id": self.request_id, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
               "error": self.error, "ttft_s": self.ttft_s, "latency_s": self.latency_s}
        if self.text is not None:
            out["text"] = self.text
        if self.logprobs is not None:
            out["logprobs"] = logprobs_json(self.logprobs)
        if len(self.outputs) > 1:
            out["outputs"] = [c.to_json() for c in self.outputs]
        return out


def logprobs_json(logprobs: list[dict[int, Logprob]]) -> list[list[dict]]:
    """Per token: [{"token_id", "logprob", "rank"}, ...], the sampled first."""
    return [[{"token_id": t, "logprob": lp.logprob, "rank": lp.rank} for t, lp in d.items()] for d in logprobs]


def logprobs_of(req: Request) -> list[dict[int, Logprob]] | None:
    """A copy of the request's per-token logprobs, or None when it asked for none."""
    return None if req.params.logprobs is None else list(req.output_logprobs)
