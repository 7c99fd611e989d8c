"""Fitting the pipeline budget's step costs to step times (pp_runtime/cost_fit.py): plain Python."""
from __future__ import annotations

import random

import pytest

from pp_runtime.batch import MicroBatch, SampleSpec, SeqChunk
from pp_runtime.cost_fit import MIN_SAMPLES, StepSample, fit_step_costs, samples_from_run

G = SampleSpec(0.0, 1.0, 0, 0)


def synthetic(n: int, a: float, u: float, kp: float, dr: float, dk: float, noise: float, seed: int = 0,
              independent_rows: bool = True) -> list[StepSample]:
    """Micro-batches like a run's (a chunk at some depth, some decodes at some contexts) timed by
    the module's model, times (1 + noise · N(0, 1))."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start, tokens = rng.choice([0, 256, 512, 768]), rng.randint(150, 256)
        d = rng.randint(0, 30)
        keys = tuple(rng.randint(100, 1100) if independent_rows else 600 for _ in range(d))
        s = StepSample(((start, tokens),), keys, 0.0)
        _, n_tok, k_p, n_dec, k_d = s.features()
        t = a + u * (n_tok + kp * k_p + dr * n_dec + dk * k_d)
        out.append(StepSample(s.chunks, keys, t * (1 + noise * rng.gauss(0, 1))))
    return out


@pytest.mark.parametrize("costs", [(1e-4, 0.5, 2.8e-3), (3.3e-4, 1.0, 3.3e-4), (0.0, 0.0, 1e-3)])
def test_recovers_the_costs_it_was_given(costs: tuple[float, float, float]) -> None:
    exact = fit_step_costs(synthetic(200, 0.025, 8e-4, *costs, noise=0.0))
    assert exact == pytest.approx(costs, abs=1e-9)
    noisy = fit_step_costs(synthetic(400, 0.025, 8e-4, *costs, noise=0.02, seed=1))
    assert noisy[0] == pytest.approx(costs[0], abs=3e-5)
    assert noisy[2] == pytest.approx(costs[2], abs=3e-4)


def test_a_term_the_run_cannot_tell_apart_is_dropped_not_negative() -> None:
    # every decode reads 600 keys: rows and keys are one column; true row cost 0, so noise puts
    # one of them below zero, and it goes: what is left carries the decodes' whole cost
    samples = synthetic(300, 0.025, 8e-4, 1e-4, 0.0, 2.8e-3, noise=0.03, seed=2, independent_rows=False)
    kp, dr, dk = fit_step_costs(samples)
    assert min(kp, dr, dk) >= 0.0
    assert dr + 600 * dk == pytest.approx(600 * 2.8e-3, rel=0.1)


def test_too_few_chunks_or_no_token_cost_gives_none() -> None:
    assert fit_step_costs(synthetic(MIN_SAMPLES - 1, 0.025, 8e-4, 1e-4, 0.5, 2.8e-3, 0.0)) is None
    flat = [StepSample(s.chunks, s.decode_keys, 0.1) for s in synthetic(50, 0, 1, 0, 0, 0, 0.0)]
    assert fit_step_costs(flat) is None  # step time does not grow with prompt tokens


def test_samples_sum_each_micro_batch_over_its_workers() -> None:
    mb0 = MicroBatch(0, (SeqChunk(0, 32, tuple(range(16)), (0, 1, 2), True, None),
                         SeqChunk(1, 99, (7,), (3, 4, 5, 6, 7, 8, 9), False, G)))
    mb1 = MicroBatch(1, (SeqChunk(2, 0, (1, 2, 3), (10,), True, G),))
    mb2 = MicroBatch(2, (SeqChunk(1, 100, (8,), (3, 4, 5, 6, 7, 8, 9), False, G),))  # never timed
    timings = [[(0, 0.0, 1.0, 1.5), (1, 0.0, 2.0, 2.25)],  # stage 0: (mb, ready, start, end)
               [(0, 0.0, 1.6, 1.8), (1, 0.0, 2.3, 2.4)]]
    samples = samples_from_run([mb0, mb1, mb2], timings)
    assert [s.chunks for s in samples] == [((32, 16),), ((0, 3),)]
    assert [s.decode_keys for s in samples] == [(100,), ()]
    assert [s.seconds for s in samples] == pytest.approx([0.7, 0.35])
    assert samples[0].features() == [1.0, 16.0, 16 * 32 + 16 * 17 / 2, 1.0, 100.0]
