"""benchmarks/schedule_cost.py: what scheduling a step costs the driver.

End to end at reduced size (smoke tests: nothing here asserts a time)."""
from __future__ import annotations

from pathlib import Path

from tests.benchmarks import run


def test_schedule_cost_smoke(tmp_path: Path) -> None:
    r = run(["benchmarks/schedule_cost.py", "--smoke"], tmp_path)
    assert r["running"] == 8 and all(r[k] > 0 for k in r if k.endswith("_us"))
    assert {"prefix_caching_can_start_400_us", "no_prefix_caching_schedule_us"} <= set(r)
