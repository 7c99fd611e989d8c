"""The benchmark scripts run end to end at reduced size (smoke tests: nothing here asserts a time)."""
from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_interpreted

REPO = Path(__file__).resolve().parents[1]


def run(args: list[str], tmp: Path) -> dict:
    out = tmp / "r.json"
    proc = subprocess.run([sys.executable] + args + ["--json", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


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


def test_prefix_cache_smoke(hf_models: dict, tmp_path: Path) -> None:
    png = tmp_path / "prefix_cache.png"
    r = run(["benchmarks/prefix_cache.py", "--smoke", "--model", str(hf_models["llama"]), "--plot", str(png)], tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    on, off = r["rounds"]["on"][0], r["rounds"]["off"][0]
    assert off["hit_rate"] == 0 and on["hit_rate"] > 0  # the 40 shared tokens: 2 blocks a prompt after the first
    assert on["computed_prompt_tokens"] < off["computed_prompt_tokens"] and r["tok_s_ratio_on_off"] > 0


def test_pipeline_smoke(tmp_path: Path) -> None:
    r = run(["benchmarks/pipeline.py", "--smoke", "--reps", "1"], tmp_path)
    assert r["ttft_pp2_t1_s"] > 0 and 0 < r["control_plane_pp2"]["driver_fraction"]


def test_core_throughput_smoke(hf_models: dict, tmp_path: Path) -> None:
    r = run(["benchmarks/core_throughput.py", "--smoke", "--model", str(hf_models["llama"])], tmp_path)
    assert r["prefill_tok_s"] > 0 and r["decode_b16_tok_s"] > 0 and r["hf_decode_b16_tok_s"] > 0


def test_chunk_overhead_smoke(hf_models: dict, tmp_path: Path) -> None:
    r = run(["benchmarks/chunk_overhead.py", "--smoke", "--model", str(hf_models["llama"])], tmp_path)
    assert r["forward_ms_min"] > 0 and r["matmul_ms_min"] > 0 and r["ratio_median"] > 0
    assert r["bucketed_linears_ms"] > 0 and r["bucketed_attention_ms"] > 0


def test_chunk_overhead_smoke_int8(tmp_path: Path) -> None:
    """Both sides of the ratio take the linears' own products: int8 over a tiny GGUF's blocks."""
    from tests.stages.test_quant import VARIANTS, write_gguf
    model = write_gguf(tmp_path / "q4_1.gguf", VARIANTS["q4_1"])
    r = run(["benchmarks/chunk_overhead.py", "--smoke", "--model", str(model), "--matmul-precision", "int8",
             "--kv-cache-dtype", "fp8"], tmp_path)
    assert (r["matmul_precision"], r["kv_cache_dtype"]) == ("int8", "fp8")
    from stages import cpu_kernels
    from tests.stages.test_quant import LAYERS
    assert r["reduced_linears"]["int8"] == (4 * LAYERS if cpu_kernels.int8_products() else 0)  # qkv, o, gate_up, down
    assert r["forward_ms_min"] > 0 and r["matmul_ms_min"] > 0 and r["ratio_median"] > 0


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
                          env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [f"decode_maximal: {flag} {why}"]


@pytest.mark.parametrize("way,why", (
    ("paged:warps=2", "'warps=2' is not KEY=INTEGER with KEY one of tokens, num_warps, num_stages, splits"),
    ("paged:splits=x", "'splits=x' is not KEY=INTEGER with KEY one of tokens, num_warps, num_stages, splits"),
    ("gathered:splits=2", "takes paged[:KEY=VALUE...] and gathered, not 'gathered:splits=2'")))
def test_decode_maximal_refuses_a_bad_decode_tuning(way: str, why: str) -> None:
    proc = subprocess.run([sys.executable, "benchmarks/decode_maximal.py", "--smoke", "--cuda-decode", f"paged,{way}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
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


def launch_ways_interpreted() -> None:
    """In a child started with TRITON_INTERPRET=1: every way of cuda_launch_overhead.py once, on
    CPU tensors at small sizes, so each call's arguments are checked where no GPU is."""
    import torch
    from benchmarks.cuda_launch_overhead import ways
    from tests.stages.test_triton_decode import patch_interpreter
    patch_interpreter()
    for fn in ways(2, 4, 16, 64, 96, 40, torch.float32, torch.device("cpu")).values():
        fn()  # raises on a wrong argument, shape or dtype
    print("ways ran")


def test_cuda_launch_overhead_ways_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    out = run_interpreted("from tests.test_benchmarks_smoke import launch_ways_interpreted; launch_ways_interpreted()",
                          timeout=300)
    assert "ways ran" in out


@pytest.mark.gpu(1)
def test_cuda_graphs_benchmark_smoke(tmp_path: Path) -> None:
    r = run(["benchmarks/cuda_graphs.py", "--model", "llama-tiny", "--decodes", "1,3", "--context", "20",
             "--rounds", "2"], tmp_path)
    assert set(r["by_batch"]) == {"1", "3"}
    assert all(row["graph_ms"] > 0 and row["max_diff"] < 0.05 for row in r["by_batch"].values())


@pytest.mark.gpu(1)
def test_cuda_launch_overhead_smoke(tmp_path: Path) -> None:
    r = run(["benchmarks/cuda_launch_overhead.py", "--calls", "20"], tmp_path)
    assert len(r["issue_us"]) == 12 and all(0 < r["issue_us"][k] <= r["done_us"][k] for k in r["issue_us"])


@pytest.mark.gpu(1)
def test_cuda_paged_decode_smoke(tmp_path: Path) -> None:
    r = run(["benchmarks/cuda_paged_decode.py", "--decodes", "4", "--context", "100", "--reps", "2"], tmp_path)
    assert set(r["ms"]) == {"gathered", "paged-backend", "paged", "paged-dot", "paged-sums", "paged-unaligned",
                            "paged-tokens16", "paged-tokens64",
                            "paged-warps1", "paged-warps2", "paged-warps4", "paged-warps8", "paged-warps2-tokens16",
                            "paged-warps2-tokens64", "paged-stages1", "paged-stages2", "paged-stages4",
                            *(f"paged-splits{n}" for n in (1, 2, 4, 8, 16))}
    assert max(r["max_err"].values()) < 1e-2  # bf16 outputs of the same attention


def test_pp_scaling_smoke(tmp_path: Path) -> None:
    png = tmp_path / "pp_scaling.png"
    r = run(["benchmarks/pp_scaling.py", "--smoke", "--chunk-budgets", "fit,tokens", "--plot", str(png),
             "--pp2-partition", "2.5,1.5", "--admissions", "fcfs,longest_first", "--temperature", "0.8",
             "--top-p", "0.95"], tmp_path)
    assert (r["workload"]["temperature"], r["workload"]["top_p"]) == (0.8, 0.95)  # every request sampled
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    labels = {"sarathi", "sarathi[tokens]", "orca", "sarathi[longest_first]", "sarathi[tokens,longest_first]",
              "orca[longest_first]"}
    assert set(r["throughput_tok_s"]) == {f"{x}_pp{pp}" for x in labels for pp in (1, 2)}
    assert set(r["efficiency"]) == labels and r["admissions"] == ["fcfs", "longest_first"]
    # fitted to pp=1's warm-up (too few micro-batches at smoke size gives None: the FLOPs budget)
    assert r["chunk_budgets"] == ["fit", "tokens"] and (r["step_costs"] is None or len(r["step_costs"]) == 3)
    for pp in ("pp1", "pp2"):  # the phases add up to the work done
        ph = r["phases"][pp]
        assert ph["prefill_s"] > 0 and ph["drain_s"] >= 0 and ph["piggybacked_decodes"] + ph["decode_only_decodes"] > 0
        assert len(ph["stages"]) == int(pp[-1])  # one step-time summary per stage
        for st in ph["stages"]:  # every micro-batch ran on every stage, and each is counted once
            assert sum(k["n"] for k in st["kinds"].values()) == ph["microbatches"]
            assert st["idle_s"] >= 0 and all(k["median_ms"] > 0 for k in st["kinds"].values())
    c = r["control_plane_pp2"]
    assert c["microbatches"] > 0 and c["mean_step_ms"] > 0 and c["return_ms_per_mb"] >= 0
    m = r["memory_pp2"]
    assert sum(w["layer_bytes"] for w in m["workers"]) == m["layer_stack_bytes"]
    assert r["pp2_partition"] == [2.5, 1.5] and m["workers"][0]["layer_bytes"] > m["workers"][1]["layer_bytes"]
    assert 0 <= m["unused_bytes"] < m["block_bytes"]  # the KV cache is the budget, to one block


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
    cs = _load("chunk_sweep")
    tput = {1: {128: [100.0, 90.0, 95.0], 256: [110.0, 100.0, 120.0]},
            2: {128: [200.0, 170.0, 190.0], 256: [180.0, 160.0, 230.0]}}
    r = cs.summarize(tput)
    assert r["best_chunk"] == {1: 256, 2: 128}
    assert r["efficiency_best_rounds"] == pytest.approx([200 / 220, 170 / 200, 190 / 240])
    assert r["efficiency_best"] == pytest.approx(170 / 200)
    assert r["efficiency_same_chunk"][128] == pytest.approx(statistics.median([1.0, 170 / 180, 1.0]))


def test_validate_sim_smoke(tmp_path: Path) -> None:
    r = run(["benchmarks/validate_sim.py", "--smoke", "--sim-seeds", "2", "--out", str(tmp_path / "v")], tmp_path)
    # two grids, each profiled in a pp=2 deployment: per stage, one CSV per grid
    assert [len(stage) for stage in r["profiles"]] == [2, 2]
    assert len(r["jitter"]) == 2 and all(0 <= x < 1 for x in r["jitter"]) and r["sim_seeds"] == 2
    for row in r["comparison"].values():
        assert row["throughput_tok_s"]["real"] > 0 and row["throughput_tok_s"]["sim"] > 0
        draws = row["bubble_s_per_request_p50"]["sim_draws"]
        assert len(draws) == 2 and row["bubble_s_per_request_p50"]["sim"] == pytest.approx(sum(draws) / 2)


def test_decode_maximal_plan_flops() -> None:
    """A micro-batch's model FLOPs by hand: linears per token, attention per key seen (the causal
    half of a chunk), the LM head per sampled row."""
    from pp_runtime.batch import SeqChunk
    from pp_runtime.config import ModelConfig
    dm = _load("decode_maximal")
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
    dm = _load("decode_maximal")
    values = [float(v) for v in range(20)]
    lo, hi = dm._bootstrap(lambda ix: sum(values[i] for i in ix) / len(ix), len(values))
    assert 6.0 < lo < 9.5 < hi < 13.0  # mean 9.5, standard error ~1.3
    assert dm._bootstrap(lambda ix: 4.0, 5) == [4.0, 4.0]


def test_pp_scaling_pairs_each_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """pp=1 and pp=2 alternate within rounds (1, 2, then 2, 1), each round's pp=2 run is divided by
    that round's pp=1 run, and the efficiency is the median of those ratios, not of medians."""
    ps = _load("pp_scaling")

    class Fake:
        def __init__(self, pp: int) -> None:
            self.pp = pp
            self.executor = self

        def drain_timings(self) -> list:
            return []

    walls = {1: [10.0, 12.0, 8.0], 2: [6.0, 4.0, 5.0]}  # seconds per round
    calls = []

    def run_once(llm: Fake, items: list, policy: str, chunk: int, budget: str, admission: str,
                 costs: tuple[float, ...] = (), sampling: object = None) -> float:
        assert sampling == "the workload"  # each run samples as the workload says
        assert budget == "flops"
        calls.append((policy, llm.pp))
        assert chunk == {1: 256, 2: 128}[llm.pp]  # each pp runs at its own chunk
        return walls[llm.pp][sum(1 for p, pp in calls if p == policy and pp == llm.pp) - 1]

    monkeypatch.setattr(ps, "run_once", run_once)
    monkeypatch.setattr(ps, "control_plane", lambda llm, t: {"pp": llm.pp})
    monkeypatch.setattr(ps, "phase_split", lambda llm, t: {})
    r = {"throughput_tok_s": {}, "efficiency": {}}
    ps.paired_runs({1: Fake(1), 2: Fake(2)}, [], 120, ps.variants(["sarathi"], ["flops"]), 3, {1: 256, 2: 128}, r,
                   "the workload")
    assert [pp for _, pp in calls] == [1, 2, 2, 1, 1, 2]
    # per round tput2 / (2 tput1) = wall1 / (2 wall2): 10/12, 12/8, 8/10; the ratio of the median
    # throughputs would be 1.0 instead
    assert r["rounds"]["sarathi"]["efficiency"] == pytest.approx([10 / 12, 1.5, 0.8])
    assert r["efficiency"]["sarathi"] == pytest.approx(10 / 12)
    assert r["throughput_tok_s"]["sarathi_pp1"] == pytest.approx(120 / 10)
    assert r["control_plane_pp2"] == {"pp": 2}
    # two variants: every round runs both (in order, then reversed), each pp=1 / pp=2 pair back to back
    calls.clear()
    r = {"throughput_tok_s": {}, "efficiency": {}}
    ps.paired_runs({1: Fake(1), 2: Fake(2)}, [], 120, ps.variants(["sarathi", "orca"], ["flops"]), 3,
                   {1: 256, 2: 128}, r, "the workload")
    assert calls == [("sarathi", 1), ("sarathi", 2), ("orca", 1), ("orca", 2),
                     ("orca", 2), ("orca", 1), ("sarathi", 2), ("sarathi", 1),
                     ("sarathi", 1), ("sarathi", 2), ("orca", 1), ("orca", 2)]
    assert r["rounds"]["orca"]["efficiency"] == pytest.approx([10 / 12, 1.5, 0.8])  # each its own rounds
    # sarathi runs once per chunk budget, the others (which do not chunk) once
    assert ps.variants(["sarathi", "orca"], ["flops", "tokens"]) == [
        ("sarathi", "sarathi", "flops", "fcfs"), ("sarathi[tokens]", "sarathi", "tokens", "fcfs"),
        ("orca", "orca", "flops", "fcfs")]
    # ... and every policy once per admission order, labelled by what differs from the first
    assert ps.variants(["sarathi", "orca"], ["flops", "tokens"], ["longest_first", "fcfs"]) == [
        ("sarathi", "sarathi", "flops", "longest_first"), ("sarathi[fcfs]", "sarathi", "flops", "fcfs"),
        ("sarathi[tokens]", "sarathi", "tokens", "longest_first"),
        ("sarathi[tokens,fcfs]", "sarathi", "tokens", "fcfs"),
        ("orca", "orca", "flops", "longest_first"), ("orca[fcfs]", "orca", "flops", "fcfs")]


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


def _load(name: str) -> object:
    """benchmarks/<name>.py as a module (the scripts import their neighbours by bare name)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return mod


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


def test_schedule_cost_smoke(tmp_path: Path) -> None:
    r = run(["benchmarks/schedule_cost.py", "--smoke"], tmp_path)
    assert r["running"] == 8 and all(r[k] > 0 for k in r if k.endswith("_us"))
    assert {"prefix_caching_can_start_400_us", "no_prefix_caching_schedule_us"} <= set(r)
