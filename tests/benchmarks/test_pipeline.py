"""benchmarks/pipeline.py: TTFT at pp = 1 and 2, and the control plane's share of a step.

End to end at reduced size (smoke tests: nothing here asserts a time)."""
from __future__ import annotations

from pathlib import Path

from tests.benchmarks import run


def test_pipeline_smoke(tmp_path: Path) -> None:
    r = run(["benchmarks/pipeline.py", "--smoke", "--reps", "1"], tmp_path)
    assert r["ttft_pp2_t1_s"] > 0 and 0 < r["control_plane_pp2"]["driver_fraction"]
