"""benchmarks/chunk_sweep.py: target 4 at each pp's best chunk.

End to end at reduced size (smoke tests: nothing here asserts a time)."""
from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from tests.benchmarks import load_script, run


def test_chunk_sweep_smoke(tmp_path: Path) -> None:
    r = run(["benchmarks/chunk_sweep.py", "--smoke"], tmp_path)
    assert r["chunks"] == [8, 16]
    for pp in ("1", "2"):  # every (pp, chunk) ran once, and the best chunk is the fastest median
        assert {c: len(v) for c, v in r["tok_s"][pp].items()} == {"8": 1, "16": 1}
        med = r["median_tok_s"][pp]
        assert med[str(r["best_chunk"][pp])] == max(med.values()) > 0
    assert r["efficiency_best"] == pytest.approx(statistics.median(r["efficiency_best_rounds"]))
    assert set(r["efficiency_same_chunk"]) == {"8", "16"}


def test_chunk_sweep_pairs_rounds_at_the_best_chunks() -> None:
    """Each pp's best chunk is the one with the highest median, and the efficiency pairs those two
    chunks round by round (pp=2's tok/s over twice pp=1's)."""
    cs = load_script("chunk_sweep")
    tput = {1: {128: [100.0, 90.0, 95.0], 256: [110.0, 100.0, 120.0]},
            2: {128: [200.0, 170.0, 190.0], 256: [180.0, 160.0, 230.0]}}
    r = cs.summarize(tput)
    assert r["best_chunk"] == {1: 256, 2: 128}
    assert r["efficiency_best_rounds"] == pytest.approx([200 / 220, 170 / 200, 190 / 240])
    assert r["efficiency_best"] == pytest.approx(170 / 200)
    assert r["efficiency_same_chunk"][128] == pytest.approx(statistics.median([1.0, 170 / 180, 1.0]))
