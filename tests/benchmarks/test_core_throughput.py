"""benchmarks/core_throughput.py: prefill and decode throughput against HF.

End to end at reduced size (smoke tests: nothing here asserts a time)."""
from __future__ import annotations

from pathlib import Path

from tests.benchmarks import run


def test_core_throughput_smoke(hf_models: dict, tmp_path: Path) -> None:
    r = run(["benchmarks/core_throughput.py", "--smoke", "--model", str(hf_models["llama"])], tmp_path)
    assert r["prefill_tok_s"] > 0 and r["decode_b16_tok_s"] > 0 and r["hf_decode_b16_tok_s"] > 0
