"""In-deployment profile (pp_runtime/profile_deploy.py): per-stage CSVs with the profile's
columns, numbers that add up, the LM head on the last stage only, and a deployment that runs
as before afterwards (the op hooks come off). The Ray path: tests/launch/test_ray_launch.py."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from pp_runtime import LLM, SamplingParams
from pp_runtime.profile_deploy import profile_deployment
from pp_runtime.profile_grid import Point, grid_points, parse_grid
from pp_runtime.profile_stats import OPS, stage_jitter
from pp_runtime.profile_tables import CSV_COLUMNS
from pp_runtime.sim import StageProfiles

GRID = "quick;reps=2"
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]


def check_stage_csvs(out: Path, pp: int, grid: str) -> list[list[dict]]:
    """Every stage's CSV: exact columns, a row per grid point, parts that add up; the LM head
    (and sampling) only on the last stage. Returns the rows per stage."""
    points = grid_points(parse_grid(grid))
    summary = json.loads((out / "profile.json").read_text())
    assert summary["pp"] == pp and [s["stage"] for s in summary["stages"]] == list(range(pp))
    stages = []
    for s in range(pp):
        with open(out / f"stage-{s}" / "profile.csv", newline="") as f:
            reader = csv.DictReader(f)
            assert tuple(reader.fieldnames) == CSV_COLUMNS
            rows = list(reader)
        assert [(r["kind"], int(r["prefill_tokens"]), int(r["decode_tokens"]), int(r["context_len"]))
                for r in rows] == [(p.kind, p.prefill_tokens, p.decode_tokens, p.context_len) for p in points]
        for r in rows:
            parts = sum(float(r[f"{b}_ms"]) for b in OPS + ("others",))
            assert float(r["total_ms"]) == pytest.approx(parts, rel=1e-4)
            assert all(float(r[f"{op}_ms"]) > 0 for op in OPS)
            head = float(r["lm_head_ms"])
            assert (head > 0) if s == pp - 1 else head == 0.0
        stages.append(rows)
    return stages


@pytest.mark.parametrize("caching", (False, True))
def test_local_pp2_profile_then_generate_unchanged(tmp_path: Path, caching: bool) -> None:
    # with prefix caching the second run would find the first run's blocks, which the grid overwrote
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(model="llama-tiny", pp=2, launcher="local", memory_budget_gb=0.05, block_size=4,
             enable_prefix_caching=caching) as llm:
        before = [o.token_ids for o in llm.generate(PROMPTS, params)]
        result = profile_deployment(llm, GRID, str(tmp_path), progress=False)
        after = [o.token_ids for o in llm.generate(PROMPTS, params)]
        # the op hooks come off with the first ordinary micro-batch
        hooks = [len(m._forward_hooks) + len(m._forward_pre_hooks) for w in llm.executor.workers
                 for m in w.model.modules()]
        backends = ["forward" in vars(w.model.backend) for w in llm.executor.workers]
    assert before == after and sum(hooks) == 0 and not any(backends), "profiling must leave the deployment as it was"
    rows = check_stage_csvs(tmp_path, 2, GRID)
    summary = json.loads((tmp_path / "profile.json").read_text())
    over, jit = summary["overheads_us"], summary["jitter"]
    assert len(over["prep"]) == 2 and min(over["prep"]) >= 0 and over["return"] >= 0
    assert len(jit["sigma"]) == len(jit["independent"]) == 2 and -1 <= jit["shared_corr"] <= 1
    assert all(0 <= i <= s for i, s in zip(jit["independent"], jit["sigma"]))
    assert len(result["rows"]) == 2 and result["stages"][1]["layers"] == [2, 4]
    # the simulator takes them per stage
    fits = StageProfiles.from_csvs([[str(tmp_path / f"stage-{s}" / "profile.csv")] for s in range(2)])
    assert len(fits.per_stage([2, 2])) == 2 and all(f.rows == len(rows[0]) for f in fits.fits)


def test_grid_that_does_not_fit_names_the_problem(tmp_path: Path) -> None:
    with LLM(model="llama-tiny", pp=2, launcher="local", memory_budget_gb=0.05, block_size=4) as llm:
        with pytest.raises(ValueError, match="block_size=16 differs from the deployment's 4"):
            profile_deployment(llm, "default", str(tmp_path), progress=False)
        ctx = llm.source.config.max_position_embeddings - 1
        decodes = llm.memory.num_blocks // -(-(ctx + 1) // 4) + 1  # one more than fits at full length
        with pytest.raises(ValueError, match="KV blocks, the deployment has"):
            profile_deployment(llm, f"quick;context={ctx};decode={decodes};prefill=;prefill_with_context=;"
                               "mixed_decode=", str(tmp_path), progress=False)


def test_cli_profile_pp2(tmp_path: Path) -> None:
    from launch.cli import main
    rc = main(["profile", "--model", "llama-tiny", "--pp", "2", "--launcher", "local", "--grid", GRID,
               "--memory-budget-gb", "0.05", "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    check_stage_csvs(tmp_path, 2, GRID)
    assert main(["profile", "--model", "llama-tiny", "--pp", "2", "--launcher", "local", "--colocate", "2",
                 "--out", str(tmp_path / "x"), "--quiet"]) == 2


def test_stage_jitter_short_term_shared_and_independent() -> None:
    """stage_jitter: deviations of log(step) from the point's mean log; sigma = their pooled sd,
    short = √(mean squared successive difference / 2), ρ = the correlation of the successive
    differences between adjacent stages, independent = short·√(1 − max(ρ, 0))."""
    a, b = Point("decode", 0, 4, 64), Point("prefill", 32, 0, 0)
    order = [a, b, a, b, a, b]
    def run(devs: list[float], scale: float = 1.0) -> list[tuple[Point, float]]:
        return [(pt, scale * (1.0 if pt is a else 2.0) * math.exp(x)) for pt, x in zip(order, devs)]
    devs = [0.1, 0.2, -0.1, 0.0, 0.0, -0.2]  # each point's deviations already sum to 0
    short = math.sqrt((0.1 ** 2 + 0.3 ** 2 + 0.1 ** 2 + 0.0 + 0.2 ** 2) / (2 * 5))
    same = stage_jitter([run(devs), run(devs, 3.0)])
    assert same["sigma"] == pytest.approx([math.sqrt(0.10 / 4)] * 2) and same["short"] == pytest.approx([short] * 2)
    assert same["shared_corr"] == pytest.approx(1.0) and same["independent"] == pytest.approx([0.0, 0.0], abs=1e-9)
    opposite = stage_jitter([run(devs), run([-x for x in devs])])
    assert opposite["shared_corr"] == pytest.approx(-1.0) and opposite["independent"] == pytest.approx([short] * 2)
    # a box drifting slowly (+1% a step, no noise) inflates sigma, much less the short-term part
    drift = stage_jitter([run([0.01 * j for j in range(6)])])
    assert drift["short"][0] < drift["sigma"][0] / 2 and drift["shared_corr"] is None
    assert drift["independent"] == drift["short"]


def test_a_half_layer_partition_is_refused_by_name(tmp_path: Path) -> None:
    """The simulator models whole layers per stage: profiling a cut layer would spread its costs
    wrongly, so it is a clear error before any batch runs."""
    with LLM(model="llama-tiny", pp=2, launcher="local", partition=(2.5, 1.5), memory_budget_gb=0.05) as llm:
        with pytest.raises(ValueError, match=r"partition \[2.5, 1.5\].*whole-layer partition"):
            profile_deployment(llm, "quick", str(tmp_path), progress=False)
