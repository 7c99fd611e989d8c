"""benchmarks/kv_admission.py: reserve against optimistic KV admission.

End to end at reduced size (smoke tests: nothing here asserts a time)."""
from __future__ import annotations

from pathlib import Path

from tests.benchmarks import run


def test_kv_admission_smoke(hf_models: dict, tmp_path: Path) -> None:
    png = tmp_path / "kv_admission.png"
    r = run(["benchmarks/kv_admission.py", "--smoke", "--model", str(hf_models["llama"]), "--plot", str(png)], tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert r["same_tokens_share"] == 1.0 and set(r["reserve_over"]) == {"optimistic_B", "optimistic"}
    assert all(x["tok_s"] > 0 for x in r["reserve_over"].values())
    assert all(r["rounds"][s][0]["preemptions"] == 0 for s in ("reserve", "optimistic", "optimistic_B"))
    assert r["rounds"]["optimistic"][0]["max_batch_size"] == r["rounds"]["reserve"][0]["max_batch_size"] == 64
    assert r["rounds"]["optimistic_B"][0]["max_batch_size"] == min(r["paper_B"], 64)  # pp = 1


def test_kv_admission_chat_smoke(tmp_path: Path) -> None:
    """The chat workload on the embedded model (its tokenizer's chat template): some answers stop
    at EOS; 20 blocks hold fewer than the 8 requests need, so optimistic preempts, reserve does
    not, the B cap runs one at a time, and every side gives the same tokens."""
    r = run(["benchmarks/kv_admission.py", "--smoke", "--workload", "chat"], tmp_path)
    assert r["same_tokens_share"] == 1.0 and r["paper_B"] == 1
    rounds = {side: r["rounds"][side][0] for side in ("reserve", "optimistic", "optimistic_B")}
    assert all(0 < got["stopped_early"] < 8 for got in rounds.values())
    assert rounds["optimistic"]["preemptions"] > 0 and rounds["reserve"]["preemptions"] == 0
    assert rounds["optimistic_B"]["widest_batch"] == 1 < rounds["reserve"]["widest_batch"] <= rounds["optimistic"]["widest_batch"]
