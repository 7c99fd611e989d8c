"""benchmarks/prefix_cache.py: prefix caching on and off over prompts that share a prefix.

End to end at reduced size (smoke tests: nothing here asserts a time)."""
from __future__ import annotations

from pathlib import Path

from tests.benchmarks import run


def test_prefix_cache_smoke(hf_models: dict, tmp_path: Path) -> None:
    png = tmp_path / "prefix_cache.png"
    r = run(["benchmarks/prefix_cache.py", "--smoke", "--model", str(hf_models["llama"]), "--plot", str(png)], tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    on, off = r["rounds"]["on"][0], r["rounds"]["off"][0]
    assert off["hit_rate"] == 0 and on["hit_rate"] > 0  # the 40 shared tokens: 2 blocks a prompt after the first
    assert on["computed_prompt_tokens"] < off["computed_prompt_tokens"] and r["tok_s_ratio_on_off"] > 0
