"""SimExecutor: the executor interface of pp_runtime.engine.Engine with workers replaced by a cost
model and time by a virtual clock.

Stages run micro-batches in issue order. For micro-batch k submitted at virtual time t:

    ready_s  = max(free_s, t)                         the worker is idle (and the plan is sent)
    input_0  = t + dispatch_s                         the plan reaches stage 0 (and every stage)
    start_s  = max(max(free_s, input_0) + prep_s, input_s)
                                                      prep_s: the worker's own cost of taking a plan
                                                      (task start, unpacking, attention metadata)
    end_s    = start_s + compute_s(k) · ε               (cost model; ε = 1 unless jitter)
    input_s+1 = end_s + send_s(k)                     (PP send of [tokens, hidden])
    done(k)  = end_last + return_s                    sampled tokens are back at the driver

``collect()`` returns the oldest micro-batch's tokens and moves the clock to its ``done`` time
(never backwards): the engine's postprocess, and so the next schedule, happen then. A decode
is therefore schedulable only after the micro-batch that sampled its input has left the last
stage. TP ranks of a stage run in lock-step: they share one timing list.

``jitter`` σ (per stage) makes each step's time noisy, as a real one is: ε = exp(N(−σ²/2, σ)),
mean 1, drawn per stage and micro-batch from a generator seeded by ``seed``. A deterministic
cost model gives two nearly equal stages nearly no bubble; run-to-run variation of the steps
is what makes the real ones wait on each other (``pp-runtime profile`` measures σ).
"""
from __future__ import annotations

import math
import random
from collections import deque
from typing import NamedTuple, Sequence

from pp_runtime.batch import MicroBatch
from pp_runtime.sim.batch_shape import BatchShape
from pp_runtime.sim.stage_cost import StageCost


class VirtualClock:
    """Simulated seconds since the start of the run."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def advance_to(self, t: float) -> None:
        if t > self.now:
            self.now = t


class PlanInfo(NamedTuple):
    """What timing records need of a plan (pp_runtime.timing.build_records reads these fields)."""

    mb_id: int
    request_ids: tuple[str, ...]
    prefill_tokens: int
    decode_tokens: int
    kv_tokens: int


class SimExecutor:
    """pp stages × tp ranks of one replica, simulated. ``token_id`` is what every sample returns."""

    def __init__(self, cost: StageCost, pp: int, tp: int = 1, clock: VirtualClock | None = None, *,
                 dispatch_s: float = 0.0, return_s: float = 0.0, prep_s: float | Sequence[float] = 0.0,
                 jitter: float | Sequence[float] = 0.0, seed: int | str = 0, token_id: int = 3,
                 workers: list[dict] | None = None) -> None:
        if pp < 1 or tp < 1:
            raise ValueError(f"SimExecutor needs pp ≥ 1 and tp ≥ 1, got pp={pp}, tp={tp}")
        self.cost, self.pp, self.tp = cost, pp, tp
        self.clock = clock or VirtualClock()
        self.dispatch_s, self.return_s, self.token_id = dispatch_s, return_s, token_id
        self.prep_s = [float(prep_s)] * pp if isinstance(prep_s, (int, float)) else [float(x) for x in prep_s]
        if len(self.prep_s) != pp:
            raise ValueError(f"prep_s has {len(self.prep_s)} values for pp={pp}")
        self.jitter = [float(jitter)] * pp if isinstance(jitter, (int, float)) else [float(x) for x in jitter]
        if len(self.jitter) != pp or any(not 0.0 <= x < 1.0 for x in self.jitter):
            raise ValueError(f"jitter must be one value or {pp} (one per stage), each in [0, 1), got {jitter!r}")
        self._rng = random.Random(f"jitter/{seed}") if any(self.jitter) else None
        self._workers = workers
        self.free = [0.0] * pp
        self._queue: deque[tuple[MicroBatch, float]] = deque()
        self._rows: list[list[tuple[int, float, float, float]]] = [[] for _ in range(pp)]
        self.plans: dict[int, PlanInfo] = {}  # every plan submitted (compact), for timing records
        self.busy_s = [0.0] * pp

    # ---- the Executor protocol -------------------------------------------------------------
    def memory_profiles(self) -> list:
        return []

    def allocate_cache(self, num_blocks: int) -> int:
        return 0

    def workers_info(self) -> list[dict]:
        if self._workers is not None:
            return list(self._workers)
        return [{"stage": s, "tp_rank": r, "pid": 0, "node": "sim", "device": "sim"}
                for s in range(self.pp) for r in range(self.tp)]

    def submit(self, mb: MicroBatch) -> None:
        t = self.clock.now
        shape_times = getattr(self.cost, "shape_times", None)
        if shape_times is not None:  # one pass over the chunks serves the cost and the record
            shape = BatchShape.of(mb)
            compute, send = shape_times(shape)
            info = PlanInfo(mb.mb_id, mb.request_ids, shape.prefill_tokens, shape.decode_tokens,
                            shape.prefill_kv + shape.decode_kv)
        else:
            compute, send = self.cost.stage_times(mb)
            info = PlanInfo(mb.mb_id, mb.request_ids, mb.prefill_tokens, mb.decode_tokens, mb.kv_tokens)
        if self._rng is not None:
            compute = self._noisy(compute)
        arrive = plan_at = t + self.dispatch_s
        free, rows, busy, prep = self.free, self._rows, self.busy_s, self.prep_s
        end = t
        for s in range(self.pp):
            ready = free[s] if free[s] > t else t
            taken = (free[s] if free[s] > plan_at else plan_at) + prep[s]
            start = taken if taken > arrive else arrive
            end = start + compute[s]
            rows[s].append((mb.mb_id, ready, start, end))
            free[s] = end
            busy[s] += compute[s]
            if s + 1 < self.pp:
                arrive = end + send[s]
        self._queue.append((mb, end + self.return_s))
        self.plans[mb.mb_id] = info

    def _noisy(self, compute: Sequence[float]) -> list[float]:
        gauss = self._rng.gauss
        return [c * math.exp(gauss(-sd * sd / 2, sd)) if sd else c for c, sd in zip(compute, self.jitter)]

    def collect(self) -> list[int]:
        mb, done = self._queue.popleft()
        self.clock.advance_to(done)
        return [self.token_id] * mb.num_samples

    def drain_timings(self) -> list[list]:
        """Per rank (stage-major, ``ranks()`` order): [(mb_id, t_ready, t_start, t_end)] since the
        last drain; the TP ranks of a stage share one list."""
        rows, self._rows = self._rows, [[] for _ in range(self.pp)]
        return [rows[s] for s in range(self.pp) for _ in range(self.tp)]

    def ranks(self) -> list[tuple[int, int]]:
        return [(s, r) for s in range(self.pp) for r in range(self.tp)]

    def clock_offsets(self) -> list[float]:
        return [0.0] * (self.pp * self.tp)  # one virtual clock

    def shutdown(self) -> None:
        self._queue.clear()

    # ---- for the event loop ------------------------------------------------------------------
    @property
    def next_done(self) -> float | None:
        """When the oldest micro-batch in flight is back at the driver (None: nothing in flight)."""
        return self._queue[0][1] if self._queue else None

    def stage_rows(self, stage: int) -> Sequence[tuple[int, float, float, float]]:
        """Timings of one stage so far (not drained)."""
        return self._rows[stage]
