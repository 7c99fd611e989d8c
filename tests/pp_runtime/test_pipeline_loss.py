"""A pipeline's efficiency as four factors (pp_runtime/pipeline_loss.py): plain Python."""
from __future__ import annotations

import math
import random

import pytest

from pp_runtime.batch import MicroBatch, SampleSpec, SeqChunk
from pp_runtime.pipeline_loss import FACTORS, MIN_STEPS, Run, busy_seconds, loss_factors

G = SampleSpec(0.0, 1.0, 0, 0)
A, U, DR, DK = 0.03, 1e-3, 2e-3, 2e-6  # per-step, per prompt token, per decode row, per decode key (s)


def plans(n: int, seed: int, chunk: int = 256) -> list[MicroBatch]:
    """Micro-batches like a run's: a prompt chunk at some depth, decodes at their own contexts."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        start, tokens = rng.choice([0, 256, 512]), rng.randint(chunk // 2, chunk)
        chunks = [SeqChunk(0, start, tuple(range(tokens)), (0,), True, None)]
        chunks += [SeqChunk(1 + d, ctx, (1,), (0,), False, G)
                   for d, ctx in enumerate(rng.randint(50, 900) for _ in range(rng.randint(0, 20)))]
        out.append(MicroBatch(i, tuple(chunks)))
    return out


def cost(mb: MicroBatch) -> float:
    """The model's step time of ``mb`` (no prompt-key term: the fit finds it 0)."""
    dec = [c for c in mb.chunks if not c.is_prefill]
    return A + U * mb.prefill_tokens + DR * len(dec) + DK * sum(c.start + 1 for c in dec)


def serial_run(mbs: list[MicroBatch], driver_s: float = 0.0) -> Run:
    """One worker running ``mbs`` back to back, ``driver_s`` between steps."""
    t, rec = 0.0, []
    for mb in mbs:
        rec.append((mb.mb_id, t, t, t + cost(mb)))
        t += cost(mb) + driver_s
    return Run(t, mbs, [rec])


def two_stage_run(mbs: list[MicroBatch], slow: float, wall_s: float) -> Run:
    """Two workers, each taking half of a micro-batch's cost × ``slow``; the wall given."""
    recs = [[(mb.mb_id, 0.0, 0.0, cost(mb) * slow / 2) for mb in mbs] for _ in range(2)]
    return Run(wall_s, mbs, recs)


def test_same_work_at_the_same_speed_leaves_only_the_waits() -> None:
    mbs = plans(60, seed=0)
    one = serial_run(mbs)
    busy = busy_seconds(one.timings)
    f = loss_factors(one, two_stage_run(mbs, 1.0, wall_s=busy / 2 / 0.8))  # stages 80% busy
    assert f.driver == pytest.approx(1.0)
    assert f.composition == pytest.approx(1.0)
    assert f.work_speed == pytest.approx(1.0)
    assert f.utilization == pytest.approx(0.8)
    assert f.efficiency == pytest.approx(0.8)
    assert f.workers == 2 and f.microbatches == (60, 60)


@pytest.mark.parametrize("slow, driver_s", [(1.25, 0.0), (1.0, 0.004), (1.1, 0.002)])
def test_the_factors_multiply_to_the_efficiency(slow: float, driver_s: float) -> None:
    one = serial_run(plans(80, seed=1), driver_s)
    many_mbs = plans(130, seed=2, chunk=160)  # more, smaller micro-batches: more fixed costs
    many = two_stage_run(many_mbs, slow, wall_s=sum(cost(mb) for mb in many_mbs) * slow / 2 / 0.9)
    f = loss_factors(one, many)
    assert f.efficiency == pytest.approx(one.wall_s / (2 * many.wall_s))
    assert f.driver * f.composition * f.work_speed * f.utilization == pytest.approx(f.efficiency)
    assert math.prod(getattr(f, k) for k in FACTORS) == pytest.approx(f.efficiency)  # what the plot draws
    assert f.work_speed == pytest.approx(1 / slow)  # the fit recovers the model: priced exactly
    assert f.utilization == pytest.approx(0.9)
    assert f.driver == pytest.approx(1 + driver_s * 80 / busy_seconds(one.timings), rel=1e-3)
    # the same prompt tokens in more steps cost more at pp = 1's prices
    more = sum(cost(mb) for mb in many_mbs) / busy_seconds(one.timings)
    assert f.composition == pytest.approx(1 / more)
    assert f"{f.efficiency:.3f} = " in f.describe()


def test_a_run_too_short_or_without_a_term_to_price_gives_none() -> None:
    assert loss_factors(serial_run(plans(MIN_STEPS - 1, seed=3)), two_stage_run(plans(10, 4), 1, 1.0)) is None
    no_decodes = [MicroBatch(mb.mb_id, mb.chunks[:1]) for mb in plans(40, seed=5)]
    assert loss_factors(serial_run(no_decodes), two_stage_run(plans(40, 6), 1, 1.0)) is None  # decodes unpriced
    with pytest.raises(ValueError, match="one worker"):
        loss_factors(two_stage_run(plans(40, 7), 1, 1.0), two_stage_run(plans(40, 7), 1, 1.0))
