"""benchmarks/pp_scaling.py: pp = 2 against twice pp = 1 in paired rounds (target 4).

End to end at reduced size (smoke tests: nothing here asserts a time)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks import load_script, run


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
    for rounds in r["rounds"].values():  # each round's efficiency as the product of its factors
        for eff, f in zip(rounds["efficiency"], rounds["factors"]):
            assert f is None or f["driver"] * f["composition"] * f["work_speed"] * f["utilization"] == \
                pytest.approx(f["efficiency"]) == pytest.approx(eff, rel=1e-6)
    c = r["control_plane_pp2"]
    assert c["microbatches"] > 0 and c["mean_step_ms"] > 0 and c["return_ms_per_mb"] >= 0
    m = r["memory_pp2"]
    assert sum(w["layer_bytes"] for w in m["workers"]) == m["layer_stack_bytes"]
    assert r["pp2_partition"] == [2.5, 1.5] and m["workers"][0]["layer_bytes"] > m["workers"][1]["layer_bytes"]
    assert 0 <= m["unused_bytes"] < m["block_bytes"]  # the KV cache is the budget, to one block


def test_pp_scaling_pairs_each_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """pp=1 and pp=2 alternate within rounds (1, 2, then 2, 1), each round's pp=2 run is divided by
    that round's pp=1 run, and the efficiency is the median of those ratios, not of medians."""
    ps = load_script("pp_scaling")

    class Fake:
        def __init__(self, pp: int) -> None:
            self.pp = pp
            self.executor = self
            self.engine = self
            self.history: list = []  # no micro-batches: too few to price, so no factors

        def drain_timings(self) -> list:
            return [[] for _ in range(self.pp)]  # a worker per stage, no step recorded

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
    assert r["rounds"]["sarathi"]["factors"] == [None, None, None]
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


@pytest.mark.parametrize("factors", [None, [None, {"efficiency": 0.72, "driver": 1.0, "composition": 0.97,
                                                   "work_speed": 0.8, "utilization": 0.93}]])
def test_plot_draws_the_factors_it_has(tmp_path: Path, factors: list | None) -> None:
    """The figure's fourth panel: the rounds that have factors (a JSON from before them has none)."""
    plot = load_script("pp_scaling_plot")
    rounds = {"pp1_tok_s": [100.0, 110.0], "pp2_tok_s": [150.0, 160.0], "efficiency": [0.75, 0.727]}
    if factors is not None:
        rounds["factors"] = factors
    r = {"rounds": {"sarathi": rounds}, "efficiency": {"sarathi": 0.74}, "chunk": 256, "pp2_chunk": 256,
         "max_batch_size": 32, "matmul_precision": "highest", "kv_cache_dtype": "auto",
         "workload": {"num_requests": 4, "min_len": 8, "max_len": 16, "pd_ratio": 10}}
    out = plot.plot_pp_scaling(r, tmp_path / "f.png")
    assert Path(out).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
