"""benchmarks/vs_hf.py against HF generate, and the paired rounds of benchmarks/pairing.py.

End to end at reduced size (smoke tests: nothing here asserts a time)."""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

from tests.benchmarks import run


def test_vs_hf_smoke(hf_models: dict, tmp_path: Path) -> None:
    png = tmp_path / "vs_hf.png"
    r = run(["benchmarks/vs_hf.py", "--smoke", "--model", str(hf_models["llama"]), "--plot", str(png),
             "--int8-kv-cache-dtype", "fp8", "--temperature", "0.8", "--top-p", "0.95"], tmp_path)
    assert r["int8_kv_cache_dtype"] == "fp8"
    assert r["sampling"] == {"temperature": 0.8, "top_p": 0.95, "top_k": 0}  # every side samples
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert r["hf_tok_s"] > 0 and r["ours_pp1_tok_s"] > 0 and r["ours_pp2_tok_s"] > 0
    assert r["hf_bf16_tok_s"] > 0 and r["ours_pp1_medium_tok_s"] > 0
    assert r["ours_pp1_int8_tok_s"] > 0 and len(r["rounds"]["ratio_int8"]) == len(r["rounds"]["ratio"]) == 1


def test_pairing_alternates_and_takes_the_median_of_ratios() -> None:
    """benchmarks/pairing.py: sides in order, then reversed, round after round; the figure is the
    median of per-round ratios (which a drifting box leaves alone), not a ratio of medians."""
    sys.path.insert(0, "benchmarks")
    try:
        from pairing import alternating, ratios
    finally:
        sys.path.remove("benchmarks")
    assert list(alternating(3, ("a", "b"))) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]
    assert list(alternating(0, ("a", "b"))) == []
    # rounds: 10/5 = 2, 30/10 = 3, 8/8 = 1 -> median 2; median(num) / median(den) would be 10/8
    assert ratios([10.0, 30.0, 8.0], [5.0, 10.0, 8.0]) == pytest.approx([2.0, 3.0, 1.0])
    assert statistics.median(ratios([10.0, 30.0, 8.0], [5.0, 10.0, 8.0])) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="equal, non-empty"):
        ratios([1.0], [1.0, 2.0])
