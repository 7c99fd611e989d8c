"""A short real bench at pp=2 (Ray, two schedulers) produces every run-directory file with sane values."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from pp_runtime import bench
from pp_runtime.bench import compare, format_table, run_bench
from pp_runtime.run_config import load_run_config

REPO = Path(__file__).resolve().parents[2]
FILES = ("stage_timings.jsonl", "summary.json", "trace.json", "results.jsonl", "workers.json")


COSTS = (2e-3, 0.5, 4e-3)  # given step costs: every scheduler's run records them, the comparison too
PREFAULT: list[bool] = []  # CacheConfig.prefault of every LLM the bench built


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = load_run_config(REPO / "configs/runs/smoke.yaml")
    # under one 40-token system prompt, with prefix caching: over Ray's two stages too (gloo)
    cfg = replace(cfg, workload=replace(cfg.workload, num_requests=10, shared_prefix=40)).with_overrides(
        launcher="ray", step_costs=COSTS, enable_prefix_caching=True)
    out = tmp_path_factory.mktemp("bench")

    class RecordingLLM(bench.LLM):
        def __init__(self, **kw: object) -> None:
            super().__init__(**kw)
            PREFAULT.append(self.config.cache.prefault)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "LLM", RecordingLLM)
        run_bench(cfg, str(out), progress=False, verbose=False)
    return out


def test_bench_prefix_caching_over_ray(bench_dir: Path) -> None:
    """Each scheduler starts without the last one's prefixes (reset), finds the shared blocks, and
    gets the same greedy tokens however it batched and whatever it found cached."""
    runs = {s: (json.loads((bench_dir / s / "summary.json").read_text()),
                [json.loads(x)["token_ids"] for x in (bench_dir / s / "results.jsonl").read_text().splitlines()])
            for s in ("sarathi", "orca")}
    for summary, _ in runs.values():
        assert summary["enable_prefix_caching"] and summary["workload"]["shared_prefix"] == 40
        assert 0 < summary["prefix_cache_hit_tokens"] <= 9 * 32  # two whole blocks for each after the first
    assert runs["sarathi"][1] == runs["orca"][1]


def test_bench_writes_the_kv_pool_before_the_first_scheduler(bench_dir: Path) -> None:
    """sarathi runs first and is the base of every ratio: its run must not pay for the OS
    faulting the KV cache in while the later schedulers do not (CacheConfig.prefault)."""
    assert PREFAULT == [True]


@pytest.mark.parametrize("scheduler", ("sarathi", "orca"))
def test_bench_run_directory(bench_dir: Path, scheduler: str) -> None:
    d = bench_dir / scheduler
    assert all((d / f).stat().st_size > 0 for f in FILES)
    s = json.loads((d / "summary.json").read_text())
    assert s["scheduler"] == scheduler and s["pp"] == 2 and s["num_requests"] == 10 and s["num_errors"] == 0
    assert s["wall_s"] > 0 and s["throughput_tok_s"] > s["decode_tok_s"] > 0
    assert 0 <= s["bubble_s_per_request_p50"] <= s["bubble_s_per_request_p90"]
    assert len(s["bubble_fraction_per_stage"]) == 2 and all(0 <= f < 1 for f in s["bubble_fraction_per_stage"])
    assert 0 < s["ttft_s_p50"] <= s["ttft_s_p99"] and 0 < s["tbt_s_p50"] <= s["tbt_s_p99"]
    assert s["microbatch_time_cv"] >= 0 and s["workload"]["kind"] == "zipf"
    rows = [json.loads(x) for x in (d / "stage_timings.jsonl").read_text().splitlines()]
    assert {r["stage"] for r in rows} == {0, 1}
    by_mb: dict[int, dict[int, dict]] = {}
    for r in rows:
        assert r["t_ready"] <= r["t_start"] <= r["t_end"]
        by_mb.setdefault(r["mb"], {})[r["stage"]] = r
    for mb in by_mb.values():  # on the driver's clock, stage 1 starts after stage 0 ran that micro-batch
        assert mb[1]["t_start"] >= mb[0]["t_start"]
    results = [json.loads(x) for x in (d / "results.jsonl").read_text().splitlines()]
    assert len(results) == 10 and all(r["finish_reason"] == "length" for r in results)
    assert s["decode_tokens"] == sum(len(r["token_ids"]) for r in results)
    trace = json.loads((d / "trace.json").read_text())
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == len(rows)


def test_bench_comparison(bench_dir: Path) -> None:
    comp = json.loads((bench_dir / "comparison.json").read_text())
    assert comp["base"] == "sarathi" and set(comp["schedulers"]) == {"sarathi", "orca"}
    tput = {s: json.loads((bench_dir / s / "summary.json").read_text())["throughput_tok_s"] for s in ("sarathi", "orca")}
    assert comp["schedulers"]["orca"]["throughput_tok_s_ratio"] == pytest.approx(tput["orca"] / tput["sarathi"])
    assert "micro-batch CV" in format_table(comp)
    assert comp["step_costs"] == list(COSTS)
    assert "step costs (prompt key, decode row, decode key): 0.002,0.5,0.004" in format_table(comp)
    assert all(json.loads((bench_dir / s / "summary.json").read_text())["step_costs"] == list(COSTS)
               for s in ("sarathi", "orca"))


def test_compare_ratios() -> None:
    keys = ("throughput_tok_s", "decode_tok_s", "bubble_s_per_request_p50", "bubble_s_per_request_p90",
            "ttft_s_p50", "ttft_s_p99", "tbt_s_p50", "tbt_s_p99", "microbatch_time_cv")
    a = dict.fromkeys(keys, 2.0)
    b = dict.fromkeys(keys, 1.0)
    comp = compare({"sarathi": a, "orca": b})
    assert comp["schedulers"]["orca"]["throughput_tok_s_ratio"] == 0.5
