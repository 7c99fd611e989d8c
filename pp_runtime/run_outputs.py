"""What an ``LLM`` run hands back besides its ``RequestOutput`` list.

    for out in llm.generate_stream(prompts):   # StreamOutput items, partial then final
        ...
    try:
        llm.run(reqs)
    except RunInterrupted as e:                # e.outputs: every request, the rest "cancelled"
        ...
    llm.last_run                               # RunRecord: requests, engine, clock span
"""
from __future__ import annotations

from dataclasses import dataclass

from pp_runtime.engine import Engine
from pp_runtime.outputs import CompletionOutput, RequestOutput, logprobs_of
from pp_runtime.request import Request


class RunInterrupted(KeyboardInterrupt):
    """``LLM.run`` stopped by a KeyboardInterrupt. ``outputs``: every request of the run, in order,
    the finished ones with their tokens and the rest ``cancelled`` (with the tokens they had);
    ``scheduler`` and ``workers`` say what ran. Workers in other processes (Ray, torchrun) are
    already shut down: an interrupt can land between the stages' copies of one plan, so that
    pipeline is not reusable. An in-process pipeline (``launcher="local"``) is reset instead, and
    the LLM takes the next call."""

    def __init__(self, outputs: list[RequestOutput], scheduler: str, workers: list[dict]) -> None:
        cancelled = sum(any(c.finish_reason == "cancelled" for c in o.outputs) for o in outputs)
        super().__init__(f"{cancelled} of {len(outputs)} requests cancelled")
        self.outputs, self.scheduler, self.workers = outputs, scheduler, workers


@dataclass
class StreamOutput(RequestOutput):
    """One item of ``LLM.generate_stream``: one sample's tokens so far (with n > 1 each sample
    streams on its own; ``outputs[0].index`` says which). ``finished`` False: a partial output
    (finish_reason None, more tokens to come); True: the sample's last item, equal to what
    ``generate`` returns for it (with n = 1: for the request)."""

    finish_reason: str | None = None
    finished: bool = False

    @classmethod
    def partial(cls, req: Request) -> "StreamOutput":
        tokens, logprobs = list(req.output_token_ids), logprobs_of(req)
        return cls(req.request_id, list(req.prompt_token_ids), tokens, None, num_cached_tokens=req.num_cached_tokens,
                   logprobs=logprobs, outputs=[CompletionOutput(req.index, tokens, None, logprobs=logprobs)])

    @classmethod
    def final(cls, req: Request) -> "StreamOutput":
        return cls(**vars(RequestOutput.from_request(req)), finished=True)


@dataclass
class RunRecord:
    """One ``LLM.run``: its requests, its engine (plans issued, driver stats) and its clock span
    (wall clock for worker timings, perf_counter for request times)."""

    requests: list[Request]
    engine: Engine
    start_wall: float
    end_wall: float
    start: float
    end: float
