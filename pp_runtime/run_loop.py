"""The step loop of one ``LLM`` run, and what happens when it cannot finish normally.

    for finished in steps(llm, reqs, offsets):   # LLM._steps wraps this with its bookkeeping
        ...

Every request comes out finished: a dead worker finishes the rest with its error
(``worker_died``), a KeyboardInterrupt with "cancelled" and the workers killed, or, in this
process, the pipeline reset (``interrupted``), a run closed early with "cancelled" once the
pipeline is drained (``drain``).
``progress_bar`` is ``LLM.run``'s count of finished requests.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Iterator

from pp_runtime.executor import WorkerError
from pp_runtime.parallel_sampling import group_outputs
from pp_runtime.request import Request
from pp_runtime.run_outputs import RunInterrupted
from pp_runtime.workers import kill_workers

if TYPE_CHECKING:
    from pp_runtime.llm import LLM

INTERRUPTED = "interrupted (Ctrl-C or SIGTERM) before this request finished"
STREAM_CLOSED = "the stream was closed before this request finished"


def steps(llm: LLM, reqs: list[Request], offsets: list[float]) -> Iterator[list[Request]]:
    """One run, one engine step at a time: yields the requests finished by each (first those
    finished with an error already). Every request comes out finished: a dead worker finishes
    the rest with its error, a KeyboardInterrupt with 'cancelled' (and the workers are killed, or
    an in-process pipeline reset), closing the generator early with 'cancelled' (and the pipeline drained)."""
    try:
        llm.executor.drain_timings()  # drop records of earlier runs
        yield [r for r in reqs if r.finished]
        yield from llm.engine.iterate([(offsets[i], r) for i, r in enumerate(reqs) if not r.finished])
    except WorkerError as e:
        yield worker_died(llm, reqs, e)
    except KeyboardInterrupt:
        fault = getattr(llm.executor, "fault", lambda: None)()
        if fault is None:
            raise interrupted(llm, reqs) from None
        yield worker_died(llm, reqs, fault)  # a launcher's signal after a worker died (torchrun's agent)
    except GeneratorExit:
        drain(llm, reqs)
        raise


def worker_died(llm: LLM, reqs: list[Request], e: WorkerError) -> list[Request]:
    # Every request still comes out: the unfinished ones with the error that stopped them.
    llm.broken = str(e)
    finished = finish_rest(reqs, "error", str(e))
    llm.executor.shutdown()
    return finished


def interrupted(llm: LLM, reqs: list[Request]) -> RunInterrupted:
    finish_rest(reqs, "cancelled", INTERRUPTED)
    workers = llm.executor.workers_info()
    if hasattr(llm.executor, "reset_pipeline"):  # stages in this process: the LLM stays usable
        llm.executor.reset_pipeline()
    else:  # a worker elsewhere may hold half a plan, waiting for activations that never come
        llm.broken = "a run was interrupted"
        kill_workers(llm.executor)
    return RunInterrupted(group_outputs(reqs), llm.engine.scheduler.cfg.policy, workers)


def drain(llm: LLM, reqs: list[Request]) -> None:
    """A run left early: cancel what is left and collect the micro-batches still in flight, so
    that the next run starts on an idle pipeline."""
    rest = [r for r in reqs if not r.finished]
    for r in rest:
        llm.engine.abort(r.seq_id)
    try:
        for _ in llm.engine.iterate():
            pass
    except WorkerError as e:
        worker_died(llm, reqs, e)
    finish_rest(reqs, "cancelled", STREAM_CLOSED)  # not arrived yet: the scheduler never saw them
    for r in rest:
        if r.finish_reason == "cancelled":  # say why, rather than the scheduler's "request aborted"
            r.error = STREAM_CLOSED


def finish_rest(reqs: list[Request], reason: str, error: str) -> list[Request]:
    rest = [r for r in reqs if not r.finished]
    for r in rest:
        r.finish(reason, error)
    return rest


def progress_bar(total: int, enabled: bool) -> object:
    from tqdm import tqdm
    return tqdm(total=total, disable=not enabled or total <= 1, file=sys.stderr, unit="req", desc="generate")
