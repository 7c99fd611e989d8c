"""The interface the engine drives, and its in-process implementation.

An executor owns the workers: ``submit(mb)`` hands a plan to every worker of every stage,
``collect()`` returns the sampled token ids of the oldest micro-batch still in flight.
Ray and torchrun implementations live in launch/; this one runs every stage (tp=1) in the
calling process, handing hidden states from stage to stage through in-process queues.
"""
from __future__ import annotations

from collections import deque
from typing import Protocol

from pp_runtime.batch import MicroBatch, Sampled
from pp_runtime.config import EngineConfig


class WorkerError(RuntimeError):
    """A worker died or stopped answering; the message names its stage, TP rank and node."""


class Executor(Protocol):
    def memory_profiles(self) -> list: ...
    def allocate_cache(self, num_blocks: int) -> int: ...
    def workers_info(self) -> list[dict]: ...
    def submit(self, mb: MicroBatch) -> None: ...
    def collect(self) -> Sampled: ...
    def drain_timings(self) -> list[list]: ...
    def drain_op_times(self) -> list[list]: ...
    def ranks(self) -> list[tuple[int, int]]: ...
    def clock_offsets(self) -> list[float]: ...
    def shutdown(self) -> None: ...


class LocalExecutor:
    """pp stages (tp=1) in this process; a submitted plan runs when its tokens are collected."""

    def __init__(self, cfg: EngineConfig, source: object) -> None:
        from pp_runtime.comm import LocalLink  # torch: only when stages really run in this process
        from stages.layers import TPContext
        from stages.worker import StageWorker
        from stages.worker_spec import WorkerSpec
        if cfg.parallel.tp != 1:
            raise ValueError("the local launcher runs tp=1 only; use --launcher ray or torchrun for tp > 1")
        links = LocalLink.chain(cfg.parallel.pp)
        self.workers = [StageWorker(WorkerSpec(source, s, 0, cfg.parallel, cfg.cache, cfg.device),
                                    TPContext(), links[s]) for s in range(cfg.parallel.pp)]
        self._queue: deque[tuple] = deque()

    def memory_profiles(self) -> list:
        return [w.memory_profile() for w in self.workers]

    def allocate_cache(self, num_blocks: int) -> int:
        return sum(w.allocate_cache(num_blocks) for w in self.workers)

    def workers_info(self) -> list[dict]:
        return [w.info() for w in self.workers]

    def submit(self, mb: MicroBatch) -> None:
        self._queue.append(mb.to_wire())

    def collect(self) -> Sampled:
        wire = self._queue.popleft()
        tokens = None
        for s, w in enumerate(self.workers):  # stages in order: each one's output is the next one's input
            try:
                tokens = w.execute(wire)
            except Exception as e:
                # As a Ray worker's failure would: the run ends with this error and the LLM is marked
                # broken. Plans still queued and activations handed halfway would otherwise pair up
                # with the next run's micro-batches and give wrong tokens without an error.
                self._queue.clear()
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise WorkerError(f"worker stage {s} tp_rank 0 (in this process) failed: {first}") from e
        return tokens

    def reset_pipeline(self) -> None:
        """After a run interrupted mid-step (Ctrl-C): drop the plans still queued and the
        activations handed halfway. The stages live in this process, so that is all an interrupt
        leaves behind (a KeyboardInterrupt lands between Python bytecodes, never inside an op),
        and the next run starts on an idle pipeline with the weights still loaded."""
        self._queue.clear()
        for w in self.workers:
            if w.link.outbox is not None:
                w.link.outbox.clear()

    def drain_timings(self) -> list[list]:
        """Per worker (rank order): [(mb_id, t_ready, t_start, t_end)] since the last drain."""
        return [w.drain_timings() for w in self.workers]

    def drain_op_times(self) -> list[list]:
        """Per worker: [(mb_id, {op: seconds})] of the ``time_ops`` micro-batches since the last drain."""
        return [w.drain_op_times() for w in self.workers]

    def ranks(self) -> list[tuple[int, int]]:
        return [(s, 0) for s in range(len(self.workers))]

    def clock_offsets(self) -> list[float]:
        return [0.0] * len(self.workers)  # one process, one clock

    def shutdown(self) -> None:
        self.workers = []
