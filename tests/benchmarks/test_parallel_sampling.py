"""benchmarks/parallel_sampling.py: n samples a prompt, the prompt prefilled once or by every sample.

End to end at reduced size (smoke tests: nothing here asserts a time)."""
from __future__ import annotations

from pathlib import Path

from tests.benchmarks import run


def test_parallel_sampling_smoke(hf_models: dict, tmp_path: Path) -> None:
    png = tmp_path / "parallel_sampling.png"
    r = run(["benchmarks/parallel_sampling.py", "--smoke", "--model", str(hf_models["llama"]), "--plot", str(png),
             "--hf"], tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # 3 prompts of 40 tokens, 3 samples each: off computes every sample's prompt; on, samples 1 and
    # 2 start on sample 0's two whole blocks and compute the last 8 tokens
    assert r["computed_prompt_tokens"] == {"off": 3 * 3 * 40, "on": 3 * (40 + 2 * 8)}
    assert r["tok_s_ratio_on_off"] > 0 and len(r["hf_tok_s"]) == 1 and r["tok_s_ratio_on_hf"] > 0
