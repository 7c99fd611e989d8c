"""benchmarks/validate_sim.py: profile, bench, simulate and compare.

End to end at reduced size (smoke tests: nothing here asserts a time)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks import run


def test_validate_sim_smoke(tmp_path: Path) -> None:
    r = run(["benchmarks/validate_sim.py", "--smoke", "--sim-seeds", "2", "--out", str(tmp_path / "v")], tmp_path)
    # two grids, each profiled in a pp=2 deployment: per stage, one CSV per grid
    assert [len(stage) for stage in r["profiles"]] == [2, 2]
    assert len(r["jitter"]) == 2 and all(0 <= x < 1 for x in r["jitter"]) and r["sim_seeds"] == 2
    for row in r["comparison"].values():
        assert row["throughput_tok_s"]["real"] > 0 and row["throughput_tok_s"]["sim"] > 0
        draws = row["bubble_s_per_request_p50"]["sim_draws"]
        assert len(draws) == 2 and row["bubble_s_per_request_p50"]["sim"] == pytest.approx(sum(draws) / 2)
