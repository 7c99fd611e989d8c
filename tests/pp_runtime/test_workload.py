"""Workloads (pp_runtime.workload, pp_runtime.workload_config, pp_runtime.run_config): length
distributions, P:D split, arrivals and determinism checked statistically against their
definitions; trace replay; run-config YAML loading and its errors. Pure numpy, a few seconds."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pp_runtime.config import SCHEDULER_POLICIES
from pp_runtime.run_config import RunConfig, load_run_config
from pp_runtime.workload import WorkItem, generate_workload, save_trace, split_pd, zipf_pmf
from pp_runtime.workload_config import WorkloadConfig, workload_summary

RUNS = Path(__file__).resolve().parents[2] / "configs" / "runs"
VOCAB = 512
N = 20000


def totals(items: list[WorkItem]) -> np.ndarray:
    return np.array([it.total_len for it in items])


def zipf_cfg(theta: float, n: int = N, **kw: object) -> WorkloadConfig:
    return WorkloadConfig(kind="zipf", num_requests=n, min_len=16, max_len=96, theta=theta, pd_ratio=4, **kw)


# --- lengths -----------------------------------------------------------------------------------

def test_zipf_matches_bounded_pmf() -> None:
    lens = totals(generate_workload(zipf_cfg(0.8), VOCAB))
    pmf = zipf_pmf(16, 96, 0.8)
    assert lens.min() >= 16 and lens.max() <= 96
    expected_mean = float(np.dot(np.arange(16, 97), pmf))
    assert abs(lens.mean() - expected_mean) / expected_mean < 0.02
    freq = np.bincount(lens - 16, minlength=len(pmf)) / len(lens)
    for i in range(5):  # the most likely lengths, ~4% to 9% each: 3 standard errors is < 0.7%
        se = np.sqrt(pmf[i] * (1 - pmf[i]) / len(lens))
        assert abs(freq[i] - pmf[i]) < 4 * se, (i, freq[i], pmf[i])
    assert freq[0] > freq[10] > freq[80]  # shorter lengths more likely


def test_zipf_pmf_shape() -> None:
    pmf = zipf_pmf(10, 14, 1.0)
    np.testing.assert_allclose(pmf, np.array([1, 1 / 2, 1 / 3, 1 / 4, 1 / 5]) / sum([1, 1 / 2, 1 / 3, 1 / 4, 1 / 5]))
    np.testing.assert_allclose(zipf_pmf(5, 9, 0.0), np.full(5, 0.2))


def test_zipf_theta_zero_is_uniform_and_larger_theta_shorter() -> None:
    lens0 = totals(generate_workload(zipf_cfg(0.0), VOCAB))
    assert abs(lens0.mean() - 56.0) / 56.0 < 0.02
    freq = np.bincount(lens0 - 16, minlength=81) / len(lens0)
    assert freq.max() < 2.0 / 81 and freq.min() > 0.4 / 81
    means = [totals(generate_workload(zipf_cfg(t, n=5000), VOCAB)).mean() for t in (0.0, 0.4, 1.0, 2.0)]
    assert means == sorted(means, reverse=True) and means[0] > means[-1] + 10


def test_uniform_lengths() -> None:
    cfg = WorkloadConfig(kind="uniform", num_requests=10000, min_len=32, max_len=160, pd_ratio=2)
    lens = totals(generate_workload(cfg, VOCAB))
    assert lens.min() == 32 and lens.max() == 160
    assert abs(lens.mean() - 96.0) / 96.0 < 0.02


def test_fixed_lengths() -> None:
    items = generate_workload(WorkloadConfig(kind="fixed", num_requests=5, prompt_len=7, decode_len=3), VOCAB)
    assert [(it.prompt_len, it.max_tokens) for it in items] == [(7, 3)] * 5
    items = generate_workload(WorkloadConfig(kind="fixed", num_requests=3, length=110, pd_ratio=10), VOCAB)
    assert [(it.prompt_len, it.max_tokens) for it in items] == [(100, 10)] * 3


# --- P:D split ---------------------------------------------------------------------------------

@pytest.mark.parametrize("pd", [0.5, 1, 4, 10])
def test_pd_ratio(pd: float) -> None:
    cfg = WorkloadConfig(kind="zipf", num_requests=1000, min_len=256, max_len=1024, theta=0.4, pd_ratio=pd)
    items = generate_workload(cfg, VOCAB)
    prompt = sum(it.prompt_len for it in items)
    decode = sum(it.max_tokens for it in items)
    assert abs(prompt / decode - pd) / pd < 0.05
    # every item is the split of a sampled total: same totals as the same seed at any other P:D
    other = generate_workload(replace(cfg, pd_ratio=3), VOCAB)
    assert [it.total_len for it in items] == [it.total_len for it in other]
    assert all(it.prompt_len >= 1 and it.max_tokens >= 1 for it in items)


def test_split_pd_rules() -> None:
    prompt, decode = split_pd(np.array([2, 3, 11, 22, 1000]), 10.0)
    assert prompt.tolist() == [1, 2, 10, 20, 909] and decode.tolist() == [1, 1, 1, 2, 91]
    prompt, decode = split_pd(np.array([2, 5]), 0.01)  # tiny ratio: prompt still ≥ 1
    assert prompt.tolist() == [1, 1] and decode.tolist() == [1, 4]
    prompt, decode = split_pd(np.array([5, 7]), 1.0)  # half rounds up, not to even
    assert prompt.tolist() == [3, 4] and decode.tolist() == [2, 3]


# --- arrivals ----------------------------------------------------------------------------------

def test_poisson_arrivals() -> None:
    rate = 50.0
    items = generate_workload(zipf_cfg(0.4, arrival="poisson", rate=rate), VOCAB)
    t = np.array([it.arrival_s for it in items])
    assert np.all(np.diff(t) >= 0) and t[0] > 0
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert abs(gaps.mean() - 1 / rate) * rate < 0.05
    assert abs(gaps.std() - 1 / rate) * rate < 0.05  # exponential: std = mean
    # arrivals draw from their own stream: the lengths are those of arrival "all"
    assert [it.total_len for it in items] == totals(generate_workload(zipf_cfg(0.4), VOCAB)).tolist()


def test_all_arrivals_are_zero() -> None:
    assert {it.arrival_s for it in generate_workload(zipf_cfg(0.4, n=50), VOCAB)} == {0.0}


# --- determinism and token ids -----------------------------------------------------------------

def test_deterministic_by_seed() -> None:
    cfg = zipf_cfg(0.4, n=200, arrival="poisson", rate=10.0, seed=7)
    assert generate_workload(cfg, VOCAB) == generate_workload(cfg, VOCAB)
    other = generate_workload(replace(cfg, seed=8), VOCAB)
    a = generate_workload(cfg, VOCAB)
    assert [it.total_len for it in a] != [it.total_len for it in other]
    assert [it.prompt_token_ids for it in a] != [it.prompt_token_ids for it in other]
    assert [it.arrival_s for it in a] != [it.arrival_s for it in other]


def test_token_ids_in_range_and_ids_unique() -> None:
    items = generate_workload(zipf_cfg(0.4, n=2000), 7)
    ids = np.concatenate([it.prompt_token_ids for it in items])
    assert ids.min() == 3 and ids.max() == 6
    assert all(isinstance(t, int) for t in items[0].prompt_token_ids)
    assert len({it.request_id for it in items}) == 2000 and items[0].request_id == "req-0000"
    with pytest.raises(ValueError, match="vocab_size"):
        generate_workload(zipf_cfg(0.4, n=2), 3)


def test_shared_prefix_changes_only_the_first_tokens() -> None:
    cfg = zipf_cfg(0.4, n=50, seed=3)
    plain = generate_workload(cfg, VOCAB)
    shared = generate_workload(replace(cfg, shared_prefix=40), VOCAB)
    head = max((it.prompt_token_ids for it in shared), key=len)[:40]
    assert len(head) == 40 and min(len(it.prompt_token_ids) for it in shared) < 40  # both cases below
    for a, b in zip(plain, shared):
        assert (a.total_len, a.max_tokens, a.arrival_s) == (b.total_len, b.max_tokens, b.arrival_s)
        n = len(b.prompt_token_ids)
        assert b.prompt_token_ids[:40] == head[:n] and b.prompt_token_ids[40:] == a.prompt_token_ids[40:]
    assert generate_workload(replace(cfg, shared_prefix=40), VOCAB) == shared
    assert workload_summary(replace(cfg, shared_prefix=40))["shared_prefix"] == 40
    with pytest.raises(ValueError, match="WorkloadConfig.shared_prefix"):
        replace(cfg, shared_prefix=0)
    with pytest.raises(ValueError, match="shared_prefix does not apply to kind 'trace'"):
        WorkloadConfig(kind="trace", trace_path="t.jsonl", shared_prefix=8)


# --- traces ------------------------------------------------------------------------------------

def test_trace_round_trip(tmp_path: Path) -> None:
    items = generate_workload(zipf_cfg(0.4, n=30, arrival="poisson", rate=5.0), VOCAB)
    save_trace(items, tmp_path / "t.jsonl")
    cfg = WorkloadConfig(kind="trace", trace_path=str(tmp_path / "t.jsonl"))
    assert generate_workload(cfg, VOCAB) == items
    assert generate_workload(replace(cfg, num_requests=4), VOCAB) == items[:4]


def test_trace_lengths_only(tmp_path: Path) -> None:
    lines = [{"prompt_len": 5, "decode_len": 2}, {"prompt_token_ids": [9, 8], "max_tokens": 3, "id": "x"}]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    cfg = WorkloadConfig(kind="trace", trace_path=str(tmp_path / "t.jsonl"), arrival="poisson", rate=2.0)
    a, b = generate_workload(cfg, VOCAB)
    assert (a.request_id, a.prompt_len, a.max_tokens) == ("trace-0", 5, 2)
    assert (b.request_id, b.prompt_token_ids, b.max_tokens) == ("x", [9, 8], 3)
    assert all(3 <= t < VOCAB for t in a.prompt_token_ids) and 0 < a.arrival_s < b.arrival_s


@pytest.mark.parametrize("line, match", [
    ('{"max_tokens": 3}', "prompt_token_ids or prompt_len"),
    ('{"prompt_token_ids": [1, 600], "max_tokens": 3}', "vocabulary"),
    ('{"prompt_len": 4}', "max_tokens or decode_len"),
    ('{"prompt_len": 4, "max_tokens": 0}', "max_tokens"),
    ('{"prompt_len": 4, "max_tokens": 2, "arrival_s": -1}', "arrival_s"),
    ("not json", "line 1: not JSON"),
])
def test_bad_trace_lines(tmp_path: Path, line: str, match: str) -> None:
    (tmp_path / "t.jsonl").write_text(line + "\n")
    with pytest.raises(ValueError, match=match):
        generate_workload(WorkloadConfig(kind="trace", trace_path=str(tmp_path / "t.jsonl")), VOCAB)


def test_trace_missing_file() -> None:
    with pytest.raises(ValueError, match="trace_path"):
        generate_workload(WorkloadConfig(kind="trace", trace_path="/nonexistent/t.jsonl"), VOCAB)


# --- run configs -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["pp2_zipf", "pp3_zipf", "smoke", "poisson"])
def test_shipped_configs_load(name: str) -> None:
    run = load_run_config(RUNS / f"{name}.yaml")
    assert run.engine["pp"] in (2, 3) and set(run.schedulers) <= set(SCHEDULER_POLICIES)
    items = generate_workload(run.workload, VOCAB)
    assert len(items) == run.workload.num_requests
    assert max(it.total_len for it in items) <= run.engine["max_model_len"]
    json.dumps(workload_summary(run.workload))


def test_all_config_files_load() -> None:
    files = sorted(RUNS.glob("*.yaml"))
    assert len(files) >= 4
    for f in files:
        load_run_config(f)


def test_pp2_zipf_contents() -> None:
    run = load_run_config(RUNS / "pp2_zipf.yaml")
    assert run.engine == {"model": "smollm2-135m", "pp": 2, "tp": 1, "chunk_size": 256, "max_batch_size": 24,
                          "tile_align": False, "memory_budget_gb": 2.0, "max_model_len": 2048, "threads": 1,
                          "seed": 0}
    assert run.schedulers == SCHEDULER_POLICIES
    assert workload_summary(run.workload) == {"kind": "zipf", "num_requests": 48, "pd_ratio": 10, "theta": 0.4,
                                              "min_len": 256, "max_len": 1024, "arrival": "all", "rate": None,
                                              "seed": 0}


def test_minimal_config_and_overrides(tmp_path: Path) -> None:
    f = tmp_path / "r.yaml"
    f.write_text("seed: 3\nworkload: {kind: fixed, num_requests: 2, prompt_len: 4, decode_len: 2}\n")
    run = load_run_config(f)
    assert run.engine == {"seed": 3} and run.schedulers == SCHEDULER_POLICIES
    assert run.workload.seed == 3  # a workload without its own seed takes the run's
    over = run.with_overrides(pp=2, chunk_size=None, tile_align=True, model="llama-tiny")
    assert over.engine == {"seed": 3, "pp": 2, "tile_align": True, "model": "llama-tiny"}
    assert run.engine == {"seed": 3}  # the original is untouched
    with pytest.raises(ValueError, match="scheduler"):
        run.with_overrides(scheduler="orca")
    with pytest.raises(ValueError, match="pp"):
        run.with_overrides(pp=0)
    assert replace(run, schedulers=("orca",)).schedulers == ("orca",)
    for costs in ("fit", [5e-4, 0.5, 0.003]):  # measured at start-up, or given
        f.write_text(f"step_costs: {costs}\nworkload: {{kind: fixed, num_requests: 2, prompt_len: 4, decode_len: 2}}\n")
        assert load_run_config(f).engine == {"step_costs": costs}
    assert run.with_overrides(step_costs=(1e-3, 0.2, 0.0)).engine["step_costs"] == (1e-3, 0.2, 0.0)


def test_trace_path_relative_to_config(tmp_path: Path) -> None:
    save_trace([WorkItem("a", [5, 6], 2)], tmp_path / "t.jsonl")
    (tmp_path / "r.yaml").write_text("workload: {kind: trace, trace_path: t.jsonl}\n")
    run = load_run_config(tmp_path / "r.yaml")
    assert generate_workload(run.workload, VOCAB) == [WorkItem("a", [5, 6], 2, 0.0)]


@pytest.mark.parametrize("text, match", [
    ("pp: 2\nfoo: 1\nworkload: {kind: fixed, num_requests: 1, prompt_len: 2, decode_len: 1}", "'foo'"),
    ("pp: 2", "workload is required"),
    ("workload: {kind: zipf, num_requests: 4, min_len: 8, max_len: 16, theta: 0.4, pd_ratio: 2, bogus: 1}",
     "workload.bogus"),
    ("workload: {kind: zipf, num_requests: 4, min_len: 8, max_len: 16, theta: 0.4, pd_ratio: 0}", "pd_ratio"),
    ("workload: {kind: zipf, num_requests: 4, min_len: 8, max_len: 16, theta: 0.4, pd_ratio: -1}", "pd_ratio"),
    ("workload: {kind: zipf, num_requests: 4, min_len: 8, max_len: 16, theta: 0.4}", "pd_ratio"),
    ("workload: {kind: zipf, num_requests: 4, min_len: 32, max_len: 16, theta: 0.4, pd_ratio: 2}", "min_len"),
    ("workload: {kind: zipf, num_requests: 4, min_len: 8, max_len: 16, theta: -0.1, pd_ratio: 2}", "theta"),
    ("workload: {kind: zipf, num_requests: 4, min_len: 8, max_len: 16, pd_ratio: 2}", "theta"),
    ("workload: {kind: uniform, num_requests: 4, min_len: 8, max_len: 16, pd_ratio: 2, arrival: poisson}",
     "rate"),
    ("workload: {kind: uniform, num_requests: 4, min_len: 8, max_len: 16, pd_ratio: 2, arrival: poisson, rate: 0}",
     "rate"),
    ("workload: {kind: uniform, num_requests: 4, min_len: 8, max_len: 16, pd_ratio: 2, arrival: later}", "arrival"),
    ("workload: {kind: uniform, num_requests: 4, min_len: 8, max_len: 16, pd_ratio: 2, theta: 1}", "theta"),
    ("workload: {kind: gauss, num_requests: 4}", "kind"),
    ("workload: {kind: uniform, min_len: 8, max_len: 16, pd_ratio: 2}", "num_requests"),
    ("workload: {kind: fixed, num_requests: 1, prompt_len: 2}", "decode_len"),
    ("workload: {kind: fixed, num_requests: 1, length: 10}", "pd_ratio"),
    ("workload: {kind: trace}", "trace_path"),
    ("workload: {kind: trace, trace_path: 5}", "trace_path must be a file path"),
    ("schedulers: [sarathi, fifo]\nworkload: {kind: fixed, num_requests: 1, prompt_len: 2, decode_len: 1}",
     "fifo"),
    ("schedulers: []\nworkload: {kind: fixed, num_requests: 1, prompt_len: 2, decode_len: 1}", "schedulers"),
    ("pp: 0\nworkload: {kind: fixed, num_requests: 1, prompt_len: 2, decode_len: 1}", "pp"),
    ("kv_cache_dtype: 16\nworkload: {kind: fixed, num_requests: 1, prompt_len: 2, decode_len: 1}", "kv_cache_dtype"),
    ("matmul_precision: 1\nworkload: {kind: fixed, num_requests: 1, prompt_len: 2, decode_len: 1}", "matmul_precision"),
    ("partition: [2.25, 1.75]\nworkload: {kind: fixed, num_requests: 1, prompt_len: 2, decode_len: 1}",
     "multiples of 0.5"),
    ("tile_align: 1\nworkload: {kind: fixed, num_requests: 1, prompt_len: 2, decode_len: 1}", "tile_align"),
    ("chunk_budget: 1\nworkload: {kind: fixed, num_requests: 1, prompt_len: 2, decode_len: 1}", "chunk_budget"),
    ("admission: 1\nworkload: {kind: fixed, num_requests: 1, prompt_len: 2, decode_len: 1}", "admission"),
    ("enable_prefix_caching: yes please\nworkload: {kind: fixed, num_requests: 1, prompt_len: 2, decode_len: 1}",
     "enable_prefix_caching must be true or false"),
    ("cuda_graphs: 1\nworkload: {kind: fixed, num_requests: 1, prompt_len: 2, decode_len: 1}",
     "cuda_graphs must be true or false"),
    ("step_costs: measure\nworkload: {kind: fixed, num_requests: 1, prompt_len: 2, decode_len: 1}",
     "step_costs must be 'fit' or a list of 3 numbers"),
    ("step_costs: [0.1, -0.5, 0]\nworkload: {kind: fixed, num_requests: 1, prompt_len: 2, decode_len: 1}",
     "step_costs must be 'fit' or a list of 3 numbers"),
    ("step_costs: [0.1, 0.5]\nworkload: {kind: fixed, num_requests: 1, prompt_len: 2, decode_len: 1}",
     "step_costs must be 'fit' or a list of 3 numbers"),
    ("memory_budget_gb: -2\nworkload: {kind: fixed, num_requests: 1, prompt_len: 2, decode_len: 1}",
     "memory_budget_gb"),
    ("max_model_len: 64\nworkload: {kind: uniform, num_requests: 4, min_len: 8, max_len: 100, pd_ratio: 2}",
     "max_model_len"),
    ("- just a list", "mapping"),
    ("pp: [", "invalid YAML"),
])
def test_bad_run_configs(tmp_path: Path, text: str, match: str) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(text + "\n")
    with pytest.raises(ValueError, match=match):
        load_run_config(f)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        load_run_config(tmp_path / "nope.yaml")


def test_workload_config_direct_errors() -> None:
    with pytest.raises(ValueError, match="WorkloadConfig.pd_ratio"):
        WorkloadConfig(kind="uniform", num_requests=1, min_len=4, max_len=8, pd_ratio=float("nan"))
    with pytest.raises(ValueError, match="WorkloadConfig.num_requests"):
        WorkloadConfig(kind="fixed", num_requests=0, prompt_len=1, decode_len=1)
    with pytest.raises(ValueError, match="not both"):
        WorkloadConfig(kind="fixed", num_requests=1, prompt_len=1, decode_len=1, length=4, pd_ratio=1)
    with pytest.raises(ValueError, match="RunConfig.workload"):
        RunConfig(engine={}, workload={"kind": "fixed"})  # type: ignore[arg-type]


def test_sampling_fields() -> None:
    """Every request of a workload samples as it says (greedy by default), each to its decode length."""
    base = dict(kind="fixed", num_requests=2, prompt_len=4, decode_len=3)
    p = WorkloadConfig(**base).sampling_params(3)
    assert (p.temperature, p.max_tokens, p.ignore_eos) == (0.0, 3, True)
    cfg = WorkloadConfig(**base, temperature=0.8, top_p=0.9, top_k=20)
    p = cfg.sampling_params(5)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.8, 0.9, 20, 5)
    assert {k: workload_summary(cfg)[k] for k in ("temperature", "top_p", "top_k")} == dict(temperature=0.8, top_p=0.9,
                                                                                       top_k=20)
    assert "temperature" not in workload_summary(WorkloadConfig(**base))
    with pytest.raises(ValueError, match="WorkloadConfig.temperature must be a finite number ≥ 0, got -1"):
        WorkloadConfig(**base, temperature=-1)
    with pytest.raises(ValueError, match=r"WorkloadConfig.top_p must be in \(0, 1\], got 2"):
        WorkloadConfig(**base, top_p=2)
