"""The discrete-event simulation: R replicas, each a real Engine + Scheduler + BlockManager driving a
SimExecutor on its own virtual clock.

Per replica the driver does exactly what ``Engine.iterate`` does, in the same order —
add the requests that have arrived, ``engine.schedule()`` (fill the pipeline up to pp
micro-batches), ``engine.run()`` (collect the oldest; the virtual clock jumps to when it leaves
the last stage), ``engine.postprocess()`` — only the waits are virtual: time comes from the
SimExecutor instead of the wall clock, and an idle replica jumps to the next arrival instead of
sleeping. Request arrival, first-token, token and finish times are virtual seconds, so
pp_runtime.timing.summarize works on them unchanged.

Replicas are interleaved by a global event queue (the earliest pending postprocess first, arrivals
before events at the same time), so a router sees every replica as it is at the arrival time:

    round_robin   request i → replica i mod R
    least_loaded  the replica with the fewest outstanding tokens (prompt + max_tokens of its
                  unfinished requests); ties → lowest index

Scale: the scheduler scans its whole waiting queue on every schedule call, so requests that have
arrived wait in a per-replica FIFO and are handed to the scheduler as its waiting queue runs low
(``window`` ≥ max_batch_size + 1 of them at a time). Every policy admits waiting requests strictly
in order and at most max_batch_size per schedule call, so the plans are identical to handing all
of them over at once (test_sim checks this against a real in-process run).
"""
from __future__ import annotations

import heapq
import itertools
import math
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from pp_runtime.batch import MicroBatch
from pp_runtime.config import SchedulerConfig
from pp_runtime.engine import Engine
from pp_runtime.kv_cache import BlockManager
from pp_runtime.request import Request
from pp_runtime.scheduler import Scheduler
from pp_runtime.sim.executor import SimExecutor, VirtualClock
from pp_runtime.sim.stage_cost import StageCost

ROUTERS = ("round_robin", "least_loaded")


class DummyTokens(Sequence):
    """The ``n`` token ids of a simulated prompt, without storing them (the scheduler only slices
    and counts prompt tokens; slicing returns a plain list). Without ``seq`` every id is ``token``.
    With ``seq`` (for prefix caching, which keys a block by its ids) the first ``shared`` positions
    hold ids every such prompt shares (a system prompt's) and the rest ids of prompt ``seq`` alone."""

    __slots__ = ("n", "token", "seq", "shared")

    def __init__(self, n: int, token: int = 3, seq: int | None = None, shared: int = 0) -> None:
        self.n, self.token, self.seq, self.shared = int(n), int(token), seq, int(shared)

    def __len__(self) -> int:
        return self.n

    def _at(self, i: int) -> int:
        # own ids start past 2^32 so that they never equal a shared one (a position)
        return self.token if self.seq is None else i if i < self.shared else ((self.seq + 1) << 32) + i

    def __getitem__(self, i: int | slice) -> int | list[int]:  # type: ignore[override]
        if isinstance(i, slice):
            r = range(*i.indices(self.n))
            return [self.token] * len(r) if self.seq is None else [self._at(k) for k in r]
        if -self.n <= i < self.n:
            return self._at(i % self.n)
        raise IndexError(i)

    def __iter__(self) -> Iterator[int]:
        return itertools.repeat(self.token, self.n) if self.seq is None else map(self._at, range(self.n))

    def __repr__(self) -> str:
        own = "" if self.seq is None else f", seq={self.seq}, shared={self.shared}"
        return f"DummyTokens({self.n}, token={self.token}{own})"


class SimReplica:
    """One pipeline (pp stages × tp ranks) with its own real scheduler and engine."""

    def __init__(self, index: int, sched_cfg: SchedulerConfig, num_blocks: int, block_size: int, cost: StageCost,
                 pp: int, tp: int = 1, *, eos_token_ids: tuple[int, ...] = (), seed: int = 0,
                 window: int | None = None, keep_history: bool = False, workers: list[dict] | None = None,
                 dispatch_s: float = 0.0, return_s: float = 0.0, prep_s: float | Sequence[float] = 0.0,
                 jitter: float | Sequence[float] = 0.0, token_id: int = 3, key_cost: float = 0.0,
                 prefix_caching: bool = False) -> None:
        self.index, self.pp, self.tp = index, pp, tp
        self.clock = VirtualClock()
        # prefix caching is the block manager's and the scheduler's alone: simulated as it runs
        self.scheduler = Scheduler(sched_cfg, BlockManager(num_blocks, block_size, prefix_caching), eos_token_ids,
                                   seed, depth=pp, key_cost=key_cost)
        self.executor = SimExecutor(cost, pp, tp, self.clock, dispatch_s=dispatch_s, return_s=return_s,
                                    prep_s=prep_s, jitter=jitter, seed=f"{seed}/{index}", token_id=token_id,
                                    workers=workers)
        self.engine = Engine(self.scheduler, self.executor, pp)
        self.window = max(window or 0, 2 * sched_cfg.max_batch_size + 2)
        self.keep_history = keep_history
        self.history: list[MicroBatch] = []  # every plan, only with keep_history (plans are large)
        self.queue: deque[Request] = deque()  # arrived, not yet handed to the scheduler
        self.requests: dict[int, Request] = {}  # seq_id -> request
        self.outstanding = 0  # tokens of unfinished requests routed here
        self.microbatches = 0

    @property
    def busy(self) -> bool:
        return bool(self.engine.in_flight)

    def assign(self, req: Request) -> None:
        self.queue.append(req)
        self.requests[req.seq_id] = req
        self.outstanding += len(req.prompt_token_ids) + req.params.max_tokens

    def _feed(self, rejected: list[Request]) -> None:
        waiting = self.scheduler.waiting
        while self.queue and len(waiting) < self.window:
            req = self.queue.popleft()
            if not self.scheduler.add(req):  # can never run: finished with an error by the scheduler
                req.finish_time = self.clock.now
                self._done(req)
                rejected.append(req)

    def _done(self, req: Request) -> None:
        self.outstanding -= len(req.prompt_token_ids) + req.params.max_tokens

    def _schedule(self) -> None:
        st = self.engine.stats
        t0 = time.perf_counter()
        before = len(self.engine.history)
        self.engine.schedule()
        st.schedule_s += time.perf_counter() - t0
        self.microbatches += len(self.engine.history) - before
        if self.keep_history:
            self.history.extend(self.engine.history[before:])
        self.engine.history.clear()  # MicroBatches hold token and block tables: keep none by default
        if not self.engine.in_flight and self.scheduler.has_unfinished():
            stuck = [r.request_id for r in list(self.scheduler.running) + list(self.scheduler.waiting)]
            raise RuntimeError(f"replica {self.index}: scheduler made no progress with requests {stuck[:8]} unfinished")

    def start(self) -> list[Request]:
        """An idle replica at the current time: hand over what arrived and fill the pipeline."""
        rejected: list[Request] = []
        self._feed(rejected)
        self._schedule()
        return rejected

    def advance(self) -> list[Request]:
        """Collect the oldest micro-batch (the clock moves to when it is back), postprocess it,
        then add arrivals and schedule again: the tail of one engine step and the head of the next."""
        engine, st = self.engine, self.engine.stats
        mb, tokens = engine.run()
        now = self.clock.now
        t0 = time.perf_counter()
        reqs = self.requests
        sampled = [(reqs[c.seq_id], len(reqs[c.seq_id].token_times)) for c in mb.chunks if c.sample is not None]
        finished = engine.postprocess(mb, tokens)
        for req, before in sampled:  # the scheduler stamps wall-clock times: make them virtual
            times = req.token_times
            for i in range(before, len(times)):
                times[i] = now
            if before == 0 and times:
                req.first_token_time = now
        for req in finished:
            req.finish_time = now
            self._done(req)
        st.postprocess_s += time.perf_counter() - t0
        st.steps += 1
        self._feed(finished)
        self._schedule()
        return finished


@dataclass
class SimResult:
    requests: list[Request]
    replicas: list[SimReplica]
    start: float = 0.0
    end: float = 0.0  # virtual time of the last postprocess
    wall_s: float = 0.0  # real seconds the simulation took
    schedule_wall_s: float = 0.0  # real seconds inside the real scheduler (engine.schedule)
    postprocess_wall_s: float = 0.0
    microbatches: int = 0
    history: list[MicroBatch] = field(default_factory=list)  # replica 0's plans, with keep_history


def simulate(requests: list[Request], arrivals: Sequence[float] | None, sched_cfg: SchedulerConfig,
             num_blocks: int, block_size: int, cost: StageCost | Sequence[StageCost], pp: int, tp: int = 1, *,
             replicas: int = 1,
             router: str = "round_robin", eos_token_ids: tuple[int, ...] = (), seed: int = 0,
             keep_history: bool = False, progress: bool = False, desc: str = "simulate",
             workers: Callable[[int], list[dict]] | None = None, dispatch_s: float = 0.0, return_s: float = 0.0,
             prep_s: float | Sequence[float] = 0.0, jitter: float | Sequence[float] = 0.0,
             window: int | None = None, token_id: int = 3,
             on_finish: Callable[[Request], None] | None = None, key_cost: float = 0.0,
             prefix_caching: bool = False) -> SimResult:
    """Run ``requests`` (arriving at ``arrivals``, seconds; None: all at 0) on ``replicas`` simulated
    pipelines of ``pp`` stages × ``tp`` ranks, each with its own Scheduler(sched_cfg) over
    ``num_blocks`` KV blocks; ``cost``: one StageCost for all replicas or one per replica.
    Requests already finished (errors) are passed through untouched. key_cost: the model's
    (``HeadSizes.key_cost``), for sarathi's "flops" chunk budget (0: it counts tokens).
    prefix_caching: each replica's block manager keeps prefixes (prompts then need distinct ids:
    ``DummyTokens`` with ``seq``)."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
    if replicas < 1:
        raise ValueError(f"replicas must be ≥ 1, got {replicas}")
    offsets = [0.0] * len(requests) if arrivals is None else [float(a) for a in arrivals]
    if len(offsets) != len(requests):
        raise ValueError(f"{len(offsets)} arrival times for {len(requests)} requests")
    costs = list(cost) if isinstance(cost, (list, tuple)) else [cost] * replicas
    if len(costs) != replicas:
        raise ValueError(f"{len(costs)} cost models for {replicas} replicas")
    reps = [SimReplica(i, sched_cfg, num_blocks, block_size, costs[i], pp, tp, eos_token_ids=eos_token_ids, seed=seed,
                       window=window, keep_history=keep_history, workers=workers(i) if workers else None,
                       dispatch_s=dispatch_s, return_s=return_s, prep_s=prep_s, jitter=jitter, token_id=token_id,
                       key_cost=key_cost, prefix_caching=prefix_caching)
               for i in range(replicas)]
    pending = sorted(((offsets[i], i, r) for i, r in enumerate(requests) if not r.finished), key=lambda x: x[:2])
    from tqdm import tqdm
    bar = tqdm(total=len(requests), disable=not progress, file=sys.stderr, unit="req", desc=desc,
               mininterval=0.5)
    bar.update(sum(r.finished for r in requests))

    def finished(reqs: list[Request]) -> None:
        if reqs:
            bar.update(len(reqs))
            if on_finish:
                for r in reqs:
                    on_finish(r)

    heap: list[tuple[float, int]] = []
    wall0 = time.perf_counter()
    i, n, rr = 0, len(pending), 0
    try:
        while True:
            t_event = heap[0][0] if heap else math.inf
            t_arrival = pending[i][0] if i < n else math.inf
            if t_event == math.inf and t_arrival == math.inf:
                break
            if t_arrival <= t_event:  # arrivals first: the engine adds them right after a postprocess
                touched: dict[int, SimReplica] = {}
                while i < n and pending[i][0] <= t_arrival:
                    t, _, req = pending[i]
                    i += 1
                    if router == "round_robin":
                        rep = reps[rr % replicas]
                        rr += 1
                    else:
                        rep = min(reps, key=lambda x: (x.outstanding, x.index))
                    req.arrival_time = t
                    rep.assign(req)
                    touched[rep.index] = rep
                for rep in touched.values():
                    if not rep.busy:  # idle: it was sleeping until this arrival
                        rep.clock.advance_to(t_arrival)
                        finished(rep.start())
                        if rep.busy:
                            heapq.heappush(heap, (rep.executor.next_done, rep.index))
            else:
                _, idx = heapq.heappop(heap)
                rep = reps[idx]
                finished(rep.advance())
                if rep.busy:
                    heapq.heappush(heap, (rep.executor.next_done, rep.index))
    finally:
        bar.close()
    wall = time.perf_counter() - wall0
    left = [r.request_id for r in requests if not r.finished]
    if left:
        raise RuntimeError(f"simulation ended with {len(left)} unfinished requests, e.g. {left[:5]}")
    return SimResult(requests, reps, 0.0, max(r.clock.now for r in reps), wall,
                     sum(r.engine.stats.schedule_s for r in reps), sum(r.engine.stats.postprocess_s for r in reps),
                     sum(r.microbatches for r in reps), reps[0].history)
