"""The driver loop: keep up to ``max_in_flight`` micro-batches in the pipeline.

One engine step is three named calls — schedule (fill the pipeline with plans), run
(collect the oldest micro-batch's sampled tokens from the executor), postprocess (append
tokens, finish requests, free their blocks). The engine never touches a tensor.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator

from pp_runtime.batch import MicroBatch, Sampled
from pp_runtime.executor import Executor
from pp_runtime.request import Request
from pp_runtime.scheduler import Scheduler


@dataclass
class DriverStats:
    """Where the driver's time goes: its own work (schedule + plan packing/delivery + postprocess)
    versus waiting for the pipeline. The control-plane cost is the first part."""

    steps: int = 0
    schedule_s: float = 0.0
    wait_s: float = 0.0
    postprocess_s: float = 0.0

    @property
    def driver_s(self) -> float:
        return self.schedule_s + self.postprocess_s


class Engine:
    def __init__(self, scheduler: Scheduler, executor: Executor, max_in_flight: int) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.max_in_flight = max_in_flight
        self.in_flight: deque[MicroBatch] = deque()
        self.history: list[MicroBatch] = []  # every plan issued, in issue order
        self.in_flight_log: list[tuple[int, ...]] = []  # mb ids in flight after each schedule call
        self.submit_times: dict[int, float] = {}  # mb id -> wall clock when handed to the executor
        # mb id -> wall clock (when the driver asked for its tokens, when it had them): with the last
        # stage's end time this gives the token-return leg of the control plane
        self.collect_times: dict[int, tuple[float, float]] = {}
        self.mb_iter: dict[int, int] = {}  # mb id -> engine step at which it was scheduled
        self.stats = DriverStats()
        # seq ids to cancel, appended from any thread (or a stream consumer), applied between steps:
        # deque append/popleft are atomic, and the scheduler is only ever touched by the loop.
        self._aborts: deque[int] = deque()

    def abort(self, seq_id: int) -> None:
        """Cancel a request (waiting, running, in flight or not yet arrived) at the next step boundary."""
        self._aborts.append(seq_id)

    def schedule(self) -> None:
        while len(self.in_flight) < self.max_in_flight:
            mb = self.scheduler.schedule()
            if mb is None:
                break
            self.submit_times[mb.mb_id] = time.time()
            self.mb_iter[mb.mb_id] = self.stats.steps
            self.executor.submit(mb)
            self.in_flight.append(mb)
            self.history.append(mb)
        self.in_flight_log.append(tuple(mb.mb_id for mb in self.in_flight))

    def run(self) -> tuple[MicroBatch, Sampled]:
        mb = self.in_flight.popleft()
        t_ask = time.time()
        tokens = self.executor.collect()
        self.collect_times[mb.mb_id] = (t_ask, time.time())
        return mb, tokens

    def postprocess(self, mb: MicroBatch, tokens: Sampled) -> list[Request]:
        return self.scheduler.postprocess(mb, tokens)

    def step(self) -> list[Request]:
        t0 = time.perf_counter()
        self.schedule()
        t1 = time.perf_counter()
        if not self.in_flight:
            if self.scheduler.has_unfinished():
                stuck = [r.request_id for r in list(self.scheduler.running) + list(self.scheduler.waiting)]
                raise RuntimeError(f"scheduler made no progress with requests {stuck[:8]} unfinished")
            return []
        mb, tokens = self.run()
        t2 = time.perf_counter()
        finished = self.postprocess(mb, tokens)
        st = self.stats
        st.steps += 1
        st.schedule_s += t1 - t0
        st.wait_s += t2 - t1
        st.postprocess_s += time.perf_counter() - t2
        return finished

    def iterate(self, arrivals: list[tuple[float, Request]] | None = None) -> Iterator[list[Request]]:
        """Run until every request is finished, one step at a time. ``arrivals``: (seconds after
        start, request) pairs that join the scheduler when their time comes (an empty pipeline
        sleeps until then). Yields after every pipeline step (and whenever an idle pipeline
        finished something) the requests finished since the last yield, rejected on arrival and
        aborted ones included. Streams read the new tokens between yields."""
        pending = deque(sorted(arrivals or [], key=lambda x: x[0]))
        start = time.perf_counter()
        while pending or self.scheduler.has_unfinished() or self.in_flight:
            finished = self._arrive(pending, start) + self._apply_aborts(pending)
            if not self.in_flight and not self.scheduler.has_unfinished():
                if finished:
                    yield finished
                if pending:  # short naps: an abort or a signal is not held up by a late arrival
                    time.sleep(min(0.05, max(0.0, start + pending[0][0] - time.perf_counter())))
                continue
            yield finished + self.step()

    def _arrive(self, pending: deque, start: float) -> list[Request]:
        """Hand the requests whose time has come to the scheduler; returns those it rejected."""
        rejected = []
        now = time.perf_counter()
        while pending and start + pending[0][0] <= now:
            offset, req = pending.popleft()
            req.arrival_time = start + offset
            if not self.scheduler.add(req):
                rejected.append(req)  # finished with an error already
        return rejected

    def _apply_aborts(self, pending: deque) -> list[Request]:
        """Cancel the requests asked for; one in flight finishes when its micro-batch returns."""
        finished = []
        while self._aborts:
            seq_id = self._aborts.popleft()
            for item in [x for x in pending if x[1].seq_id == seq_id]:  # not arrived yet: never ran
                pending.remove(item)
                item[1].finish("cancelled", "request aborted")
                finished.append(item[1])
            req = self.scheduler.abort(seq_id)
            if req is not None:
                finished.append(req)
        return finished
