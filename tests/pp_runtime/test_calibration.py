"""``step_costs="fit"``: the calibration workload's shape, and a real calibration run at pp = 2
(in-process executor) that fits, sets and keeps the rest of the scheduling as it was."""
from __future__ import annotations

from pathlib import Path

import pytest

from pp_runtime import calibration
from pp_runtime.cost_fit import MIN_SAMPLES
from pp_runtime.llm import LLM
from pp_runtime.request import SamplingParams

TINY = dict(model="llama-tiny", launcher="local", chunk_size=8, max_batch_size=3, memory_budget_gb=0.05,
            max_model_len=128)


@pytest.mark.parametrize("max_model_len,chunk", [(128, 8), (2048, 256), (8192, 512), (8192, 2048), (64, 4096), (2, 256)])
def test_calibration_workload_has_prompt_chunks_at_every_depth(max_model_len: int, chunk: int) -> None:
    items = calibration.calibration_workload(max_model_len, chunk, vocab_size=500, seed=3)
    hi = min(calibration.MAX_LEN, max_model_len)
    assert calibration.MIN_REQUESTS <= len(items) <= calibration.MAX_REQUESTS
    assert all(hi // 4 <= it.total_len <= hi and it.max_tokens >= 1 for it in items)
    assert all(3 <= t < 500 for it in items for t in it.prompt_token_ids)
    prompt = sum(it.prompt_len for it in items)
    if calibration.MIN_REQUESTS < len(items) < calibration.MAX_REQUESTS:  # sized by the chunk count
        assert 0.6 * calibration.CHUNKS * chunk < prompt < 1.6 * calibration.CHUNKS * chunk
    assert calibration.calibration_workload(max_model_len, chunk, 500, seed=3) == items  # deterministic
    if chunk == 2048:  # sized by the chunk count too (a cap of 64 requests once gave ~19 chunks: no fit)
        assert calibration.MIN_REQUESTS < len(items) < calibration.MAX_REQUESTS


def test_calibration_workload_needs_room_for_a_token() -> None:
    with pytest.raises(ValueError, match="^step costs: a calibration run needs max_model_len ≥ 2, got 1$"):
        calibration.calibration_workload(1, 8, vocab_size=500)


def test_calibrate_under_another_policy_with_tile_align(monkeypatch: pytest.MonkeyPatch) -> None:
    """orca with tile_align and chunk_size < max_batch_size (which sarathi's tile_align refuses):
    the calibration runs sarathi without tile_align, and every setting comes back."""
    settings = dict(TINY, chunk_size=2, max_batch_size=3)
    with LLM(pp=2, scheduler="orca", tile_align=True, **settings) as llm:
        before = llm.sched_config
        calibration.calibrate(llm)
        after = llm.sched_config
        assert (after.policy, after.tile_align, after.chunk_size, after.chunk_budget) == \
            (before.policy, before.tile_align, before.chunk_size, before.chunk_budget) == ("orca", True, 2, "flops")


def test_format_costs_is_what_the_flag_takes_back() -> None:
    from launch.parser import build_parser
    text = calibration.format_costs((5.31e-4, 0.5234, 0.003125))
    assert text == "0.000531,0.523,0.00313"
    a = build_parser().parse_args(["generate", "--prompt", "x", "--step-costs", text])
    assert a.step_costs == (0.000531, 0.523, 0.00313)


def test_calibrate_fits_on_the_deployment_and_keeps_the_other_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fit sees the calibration run's micro-batches (enough with a prompt chunk, each timed on
    both stages), the costs it returns are the ones set, the policy and budget come back, and the
    tokens of a later run do not depend on the calibration."""
    seen = []
    real = calibration.fit_step_costs

    def spy(samples: list) -> tuple | None:
        seen.append(samples)
        return real(samples)

    monkeypatch.setattr(calibration, "fit_step_costs", spy)
    prompts = [[3 + (i * 7 + k) % 400 for k in range(n)] for i, n in enumerate((5, 30, 12, 61))]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(pp=2, scheduler="orca", chunk_budget="tokens", **TINY) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, params)]
        costs = calibration.calibrate(llm)
        assert len(seen) == 1 and sum(1 for s in seen[0] if s.chunks) >= MIN_SAMPLES
        assert all(s.seconds > 0 for s in seen[0])
        assert len(seen[0]) == len(llm.engine.history)  # every micro-batch timed on its stages
        assert llm.sched_config.step_costs == (costs or ())
        assert costs is None or (len(costs) == 3 and min(costs) >= 0)
        assert (llm.sched_config.policy, llm.sched_config.chunk_budget) == ("orca", "tokens")
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected


def test_step_costs_fit_at_start_up_and_given_ones(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """LLM(step_costs="fit") calibrates before serving (pp = 2) and records what it set; given
    costs are set as they are; pp = 1 runs no calibration; a bad value names the field."""
    from pp_runtime.rundir import write_run_dir
    monkeypatch.setattr(calibration, "fit_step_costs", lambda samples: (1e-3, 0.5, 2e-3))
    with LLM(pp=2, step_costs="fit", **TINY) as llm:
        assert llm.sched_config.step_costs == (1e-3, 0.5, 2e-3) and llm.config.cache.prefault  # not on a cold cache
        assert llm.last_run.requests[0].request_id.startswith("calibration-")
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
        assert write_run_dir(str(tmp_path), llm)["step_costs"] == [1e-3, 0.5, 2e-3]
    with LLM(pp=1, step_costs="fit", **TINY) as llm:
        assert llm.sched_config.step_costs == () and llm.engine is None  # nothing ran
    with LLM(pp=1, step_costs=[0.1, 0.2, 0.3], **TINY) as llm:
        assert llm.sched_config.step_costs == (0.1, 0.2, 0.3)
    with pytest.raises(ValueError, match="step_costs must be 'fit' or 3 numbers"):
        LLM(step_costs="measured", **TINY)
    with pytest.raises(ValueError, match="SchedulerConfig.step_costs must be empty or 3 finite numbers"):
        LLM(step_costs=(0.1, 0.2), **TINY)


def test_a_worker_dying_in_calibration_is_named_not_fitted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage that fails half-way through the calibration run: an error naming it, no costs set
    from half a run, the scheduling left as it was."""
    from pp_runtime.executor import WorkerError
    from tests.conftest import fail_on_call
    with LLM(pp=2, scheduler="orca", **TINY) as llm:
        fail_on_call(monkeypatch, llm.executor.workers[1], 10, "boom")
        with pytest.raises(WorkerError, match="step costs not fitted: .*stage 1.*boom"):
            calibration.calibrate(llm)
        assert llm.sched_config.step_costs == () and llm.sched_config.policy == "orca"
