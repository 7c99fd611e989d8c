"""What a micro-batch's pieces cost on this hardware, fitted to a run's step times: the
``SchedulerConfig.step_costs`` that make a pipeline's micro-batches equal in measured cost.

    samples = samples_from_run(llm.engine.history, llm.executor.drain_timings())
    costs = fit_step_costs(samples)          # (prompt key, decode row, decode key) or None
    llm.reconfigure(step_costs=costs)

A micro-batch's step time, summed over the stages that ran it, is modelled as

    t = a + u · (n + kp · K_p + dr · D + dk · K_d)

n prompt tokens attending to K_p keys in all (a token at position p reads p + 1), D decodes
reading K_d keys in all, a the per-step overhead and u one fresh prompt token's time. Least
squares over the run's micro-batches give a, u, u·kp, u·dr, u·dk; the costs are those over u,
so in fresh prompt tokens, as the chunk budget counts (pp_runtime.chunk_budget), and any common
scale of the times (TP ranks summed, a slower clock) cancels. A run can leave two terms hard to
tell apart (decodes and the keys they read grow together): a term that comes out negative is
dropped (cost 0) and the rest refitted, so every cost is ≥ 0. Plain Python and numpy, no tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pp_runtime.batch import MicroBatch

MIN_SAMPLES = 20  # micro-batches with a prompt chunk: fewer fit noise
MIN_SHARE = 0.01  # of the mean step time, the least the prompt tokens must account for


@dataclass(frozen=True)
class StepSample:
    """One micro-batch: its prompt chunks as (start, tokens), its decodes' key counts, its step seconds."""

    chunks: tuple[tuple[int, int], ...]
    decode_keys: tuple[int, ...]
    seconds: float

    def features(self) -> list[float]:
        """[1, n, K_p, D, K_d] of the module's model."""
        n = sum(k for _, k in self.chunks)
        keys = sum(k * s + k * (k + 1) / 2 for s, k in self.chunks)
        return [1.0, float(n), keys, float(len(self.decode_keys)), float(sum(self.decode_keys))]


def samples_from_run(history: Sequence[MicroBatch], timings: Sequence[Sequence[tuple]]) -> list[StepSample]:
    """A run's micro-batches (``Engine.history``) with their step times summed over the workers
    that ran them (``Executor.drain_timings()``: per worker, (mb_id, t_ready, t_start, t_end))."""
    seconds: dict[int, float] = {}
    for worker in timings:
        for mb_id, _, t_start, t_end in worker:
            seconds[mb_id] = seconds.get(mb_id, 0.0) + (t_end - t_start)
    out = []
    for mb in history:
        if mb.mb_id not in seconds:
            continue
        chunks = tuple((c.start, c.num_tokens) for c in mb.chunks if c.is_prefill)
        keys = tuple(c.start + 1 for c in mb.chunks if not c.is_prefill)
        out.append(StepSample(chunks, keys, seconds[mb.mb_id]))
    return out


def fit_step_costs(samples: Sequence[StepSample]) -> tuple[float, float, float] | None:
    """(kp, dr, dk) in fresh prompt tokens, or None where the run cannot give them: fewer than
    MIN_SAMPLES micro-batches with a prompt chunk, or prompt tokens that account for less than
    MIN_SHARE of the mean step (the unit would be noise)."""
    if sum(1 for s in samples if s.chunks) < MIN_SAMPLES:
        return None
    x = np.array([s.features() for s in samples])  # (M, 5)
    y = np.array([s.seconds for s in samples])  # (M,)
    keep = [0, 1, 2, 3, 4]
    while True:
        coef = np.zeros(5)
        coef[keep] = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        negative = [i for i in keep[2:] if coef[i] < 0]
        if not negative:
            break
        keep.remove(min(negative, key=lambda i: coef[i] * np.abs(x[:, i]).mean()))  # the most time below 0
    u = coef[1]
    if not u * x[:, 1].mean() > MIN_SHARE * y.mean():  # prompt tokens explain next to nothing: no unit
        return None
    return float(coef[2] / u), float(coef[3] / u), float(coef[4] / u)
