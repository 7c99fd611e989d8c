"""Where a pipeline's efficiency goes: pp = N's throughput against N × pp = 1's, as a product of
four factors measured from the two runs of the same requests (benchmarks/pp_scaling.py).

    f = loss_factors(Run(wall1, llm1.engine.history, timings1), Run(wall2, llm2.engine.history, timings2))
    f.efficiency == f.driver * f.composition * f.work_speed * f.utilization   # = wall1 / (N · wall2)

With T the walls, S1 pp = 1's summed step times, S2 pp = N's step times summed over its stages,
and Ŝ2 pp = N's micro-batches priced at pp = 1's step costs (cost_fit's model, t = a + u·(n + …),
least squares over pp = 1's own micro-batches, so that it prices them at S1 exactly):

    T1 / (N·T2) = T1/S1 · S1/Ŝ2 · Ŝ2/S2 · S2/(N·T2)
                  driver  composition  work speed  utilization

* driver: pp = 1's wall over its steps (≥ 1: the driver's own time between steps, which pp = N
  overlaps with the stages' work);
* composition: pp = 1's work over pp = N's, both at pp = 1's prices (< 1 where pp = N ran more
  micro-batches, each with its fixed cost, or different ones: smaller chunks, fewer decodes on them);
* work speed: what pp = N's micro-batches cost at pp = 1's prices over what its stages took (< 1
  where the same work ran slower spread over processes: cores that share caches and memory, a
  host that slows a busy VM);
* utilization: the stages' mean busy share of pp = N's wall (< 1: stages waiting on each other,
  the pipeline filling and draining, the control plane).

Plain Python and numpy, no tensors: the runs' plans (``Engine.history``) and each worker's
(mb_id, t_ready, t_start, t_end) step records (``Executor.drain_timings()``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pp_runtime.batch import MicroBatch
from pp_runtime.cost_fit import samples_from_run

MIN_STEPS = 8  # pp = 1 micro-batches below which the price fit (5 terms) is noise
FACTORS = ("driver", "composition", "work_speed", "utilization")  # LossFactors' fields whose product is efficiency


@dataclass(frozen=True)
class Run:
    """One run of a workload: wall seconds, the plans issued (``Engine.history``) and every
    worker's step records (``Executor.drain_timings()``, one list per worker)."""

    wall_s: float
    history: Sequence[MicroBatch]
    timings: Sequence[Sequence[tuple]]


@dataclass(frozen=True)
class LossFactors:
    """A pipeline run's efficiency against a one-worker run and the four factors whose product
    it is (the module's docstring says what each measures)."""

    efficiency: float  # T1 / (N · T2)
    driver: float  # T1 / S1
    composition: float  # S1 / Ŝ2
    work_speed: float  # Ŝ2 / S2
    utilization: float  # S2 / (N · T2)
    workers: int  # N: pp × tp of the second run
    microbatches: tuple[int, int]  # (first run, second run)

    def describe(self) -> str:
        return (f"{self.efficiency:.3f} = pp=1 driver {self.driver:.3f} × composition {self.composition:.3f} "
                f"({self.microbatches[0]} vs {self.microbatches[1]} micro-batches) × work speed "
                f"{self.work_speed:.3f} × stage utilization {self.utilization:.3f}")


def busy_seconds(timings: Sequence[Sequence[tuple]]) -> float:
    """Every worker's step seconds, summed."""
    return sum(t_end - t_start for worker in timings for _, _, t_start, t_end in worker)


def loss_factors(one: Run, many: Run) -> LossFactors | None:
    """The four factors of ``many``'s efficiency against ``one`` (a one-stage, one-rank run of the
    same requests), N being ``many``'s workers (with TP ranks, each counts: per-worker efficiency);
    None where pp = 1's run is too short to price its micro-batches (fewer than
    MIN_STEPS, or a rank-deficient fit) or a run has no time in it."""
    if len(one.timings) != 1:
        raise ValueError(f"loss_factors: the first run must have one worker, got {len(one.timings)}")
    s1 = samples_from_run(one.history, one.timings)
    s2 = samples_from_run(many.history, many.timings)
    if len(s1) < MIN_STEPS or not s2:
        return None
    x1 = np.array([s.features() for s in s1])  # (M1, 5): [1, n, K_p, D, K_d]
    y1 = np.array([s.seconds for s in s1])  # (M1,)
    coef, _, rank, _ = np.linalg.lstsq(x1, y1, rcond=None)
    # a term pp = 1 never varies on its own (no decodes, or every decode at one context) has no
    # price of its own, and pp = N's batches, which vary it differently, would be priced at a guess
    if rank < x1.shape[1]:
        return None
    priced2 = float(np.array([s.features() for s in s2]).sum(axis=0) @ coef)
    busy1, busy2 = busy_seconds(one.timings), busy_seconds(many.timings)
    n = len(many.timings)
    if min(one.wall_s, many.wall_s, busy1, busy2, priced2) <= 0:
        return None
    return LossFactors(efficiency=one.wall_s / (n * many.wall_s), driver=one.wall_s / busy1,
                       composition=busy1 / priced2, work_speed=priced2 / busy2, utilization=busy2 / (n * many.wall_s),
                       workers=n, microbatches=(len(s1), len(s2)))
