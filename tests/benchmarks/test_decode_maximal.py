"""benchmarks/decode_maximal.py: the paper's Table 2 and the decode-maximal batch's FLOP/s.

End to end at reduced size (smoke tests: nothing here asserts a time)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks import REPO, load_script, run


def test_decode_maximal_smoke(hf_models: dict, tmp_path: Path) -> None:
    png = tmp_path / "table2.png"
    r = run(["benchmarks/decode_maximal.py", "--smoke", "--model", str(hf_models["llama"]), "--plot", str(png)], tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    row = r["by_batch"]["2"]
    assert r["chunk_ms"] > 0 and row["alone_ms"] > 0 and row["decode_only_ms"] > 0 and row["mixed_ms"] > 0
    lo, hi = r["slope_ms_90"]
    assert lo <= r["slope_ms_per_decode"] <= hi  # the median of all rounds lies inside its own bootstrap interval
    assert row["slope_ratio_90"][0] <= row["slope_ratio_90"][1]
    assert r["matmul"] == {"dtype": "float32", "size": 256, "flop_s": r["matmul"]["flop_s"]} and r["matmul"]["flop_s"] > 0
    assert r["decode_maximal"]["batch"] == "mixed2"
    assert r["decode_maximal"]["flop_s"] == r["achieved_flop_s"]["mixed2"] > 0
    assert r["flops"]["mixed2"] > r["flops"]["chunk"] > r["flops"]["decode2"] > 0
    # what the target asks: a piggybacked decode's FLOPs in a quarter of a decode alone's median time
    needs = (r["flops"]["mixed2"] - r["flops"]["chunk"]) / 2 / (0.25 * row["alone_ms"] / 1e3)
    assert row["target_needs_flop_s"] == pytest.approx(needs)
    assert row["target_needs_of_matmul"] == pytest.approx(needs / r["matmul"]["flop_s"])
    # on a CPU the host does the work and the sync is a no-op: issuing a step is all of it
    assert all(0.9 < f <= 1 for f in r["host_issue_fraction"].values())


def test_decode_maximal_chunk_after_its_cached_context(hf_models: dict, tmp_path: Path) -> None:
    """--chunk-cached: the chunk (alone and in the mixed batches) is a later chunk of its prompt, its
    queries attending to --context cached keys of its own too, which the FLOPs count."""
    from pp_runtime.chunk_budget import chunk_cost
    from stages.model_source import hf_config
    r = run(["benchmarks/decode_maximal.py", "--smoke", "--model", str(hf_models["llama"]), "--chunk-cached"], tmp_path)
    assert r["chunk"] == 16 and r["chunk_context"] == 16 and r["by_batch"]["2"]["mixed_ms"] > 0
    cfg = hf_config(hf_models["llama"])
    head = 2 * cfg.hidden_size * cfg.vocab_size
    per_token = 2 * cfg.num_layers * cfg.linear_params
    assert r["flops"]["chunk"] == pytest.approx(chunk_cost(16, 16, cfg.key_cost) * per_token + head)
    assert r["flops"]["chunk"] > chunk_cost(0, 16, cfg.key_cost) * per_token + head  # more keys than a fresh chunk's
    assert r["flops"]["mixed2"] == pytest.approx(r["flops"]["chunk"] + r["flops"]["decode2"])


def test_decode_maximal_smoke_bf16(hf_models: dict, tmp_path: Path) -> None:
    """--dtype bfloat16: the model in bf16, and the device's rate measured on bf16 matmuls."""
    r = run(["benchmarks/decode_maximal.py", "--smoke", "--model", str(hf_models["llama"]), "--dtype", "bfloat16"],
            tmp_path)
    assert r["dtype"] == "bfloat16" and r["matmul"]["dtype"] == "bfloat16"
    assert r["by_batch"]["2"]["alone_ms"] > 0 and r["decode_maximal"]["fraction_of_matmul"] > 0


def test_decode_maximal_several_chunks_and_a_profile(hf_models: dict, tmp_path: Path) -> None:
    """--chunk takes a list (one worker runs each: a 7B random model takes a minute to build), and
    --profile adds the top ops of the decode-maximal batch."""
    r = run(["benchmarks/decode_maximal.py", "--model", str(hf_models["llama"]), "--chunk", "8,16", "--decodes", "2",
             "--context", "16", "--rounds", "2", "--matmul-size", "64", "--profile", "2"], tmp_path)
    assert [x["chunk"] for x in r] == [8, 16] and all(x["cuda_decode"] == x["elementwise"] == "cpu" for x in r)
    assert r[1]["flops"]["chunk"] > r[0]["flops"]["chunk"] > 0
    top = r[0]["profile"]
    assert 0 < len(top) <= 12 and all(row["ms_per_step"] > 0 and 0 < row["share"] <= 1 for row in top)


@pytest.mark.parametrize("flag,way,why", (
    ("--cuda-decode", "paged", "compares the torch backend's two decode paths on CUDA"),
    ("--cuda-elementwise", "fused", "compares the CUDA path's fused and eager elementwise ops")))
def test_decode_maximal_refuses_a_cuda_way_on_cpu(hf_models: dict, flag: str, way: str, why: str) -> None:
    proc = subprocess.run([sys.executable, "benchmarks/decode_maximal.py", "--smoke", "--model", str(hf_models["llama"]),
                           flag, way], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [f"decode_maximal: {flag} {why}"]


@pytest.mark.parametrize("way,why", (
    ("paged:warps=2", "'warps=2' is not KEY=INTEGER with KEY one of tokens, num_warps, num_stages, splits"),
    ("paged:splits=x", "'splits=x' is not KEY=INTEGER with KEY one of tokens, num_warps, num_stages, splits"),
    ("gathered:splits=2", "takes paged[:KEY=VALUE...] and gathered, not 'gathered:splits=2'")))
def test_decode_maximal_refuses_a_bad_decode_tuning(way: str, why: str) -> None:
    proc = subprocess.run([sys.executable, "benchmarks/decode_maximal.py", "--smoke", "--cuda-decode", f"paged,{way}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1 and why in proc.stderr


@pytest.mark.gpu(1)
def test_decode_maximal_decode_tunings_on_cuda(hf_models: dict, tmp_path: Path) -> None:
    r = run(["benchmarks/decode_maximal.py", "--smoke", "--model", str(hf_models["llama"]), "--device", "cuda",
             "--dtype", "bfloat16", "--attention", "torch", "--cuda-decode", "paged,paged:splits=2:num_warps=2,gathered"],
            tmp_path)
    assert [x["cuda_decode"] for x in r] == ["paged", "paged:splits=2:num_warps=2", "gathered"]
    assert all(x["chunk_ms"] > 0 for x in r)


@pytest.mark.gpu(1)
def test_decode_maximal_fused_and_eager_elementwise_on_cuda(hf_models: dict, tmp_path: Path) -> None:
    r = run(["benchmarks/decode_maximal.py", "--smoke", "--model", str(hf_models["llama"]), "--device", "cuda",
             "--dtype", "bfloat16", "--cuda-elementwise", "fused,eager"], tmp_path)
    assert [x["elementwise"] for x in r] == ["fused", "eager"] and all(x["chunk_ms"] > 0 for x in r)


def test_decode_maximal_plan_flops() -> None:
    """A micro-batch's model FLOPs by hand: linears per token, attention per key seen (the causal
    half of a chunk), the LM head per sampled row."""
    from pp_runtime.batch import SeqChunk
    from pp_runtime.config import ModelConfig
    dm = load_script("decode_maximal")
    cfg = ModelConfig(vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=3, num_heads=2, num_kv_heads=1)
    linear = 8 * (8 + 2 * 4) + 8 * 8 + 3 * 8 * 16  # q, k, v; o; gate, up, down (head size 4, one KV head)
    assert cfg.linear_params == linear
    greedy = object()
    chunk = SeqChunk(0, 10, (1, 2, 3), (0,), True, greedy)  # positions 10, 11, 12: 11 + 12 + 13 keys
    decode = SeqChunk(1, 20, (4,), (1, 2), False, greedy)  # position 20: 21 keys
    quiet = SeqChunk(2, 0, (5, 6), (3,), True, None)  # a non-final chunk: nothing sampled; 1 + 2 keys
    tokens, keys, sampled = 3 + 1 + 2, 11 + 12 + 13 + 21 + 1 + 2, 2
    expected = 2 * 3 * linear * tokens + 4 * 3 * 8 * keys + 2 * 8 * 100 * sampled
    assert dm.plan_flops(cfg, (chunk, decode, quiet)) == pytest.approx(expected, rel=1e-12)


def test_decode_maximal_bootstrap_interval() -> None:
    """The interval resamples rounds: it spans the spread of a statistic over rounds, is ordered,
    and collapses when every round agrees."""
    dm = load_script("decode_maximal")
    values = [float(v) for v in range(20)]
    lo, hi = dm._bootstrap(lambda ix: sum(values[i] for i in ix) / len(ix), len(values))
    assert 6.0 < lo < 9.5 < hi < 13.0  # mean 9.5, standard error ~1.3
    assert dm._bootstrap(lambda ix: 4.0, 5) == [4.0, 4.0]
