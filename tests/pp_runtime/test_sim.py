"""The cluster simulator (pp_runtime.sim): event ordering and bubble accounting on hand-checked
pipelines, the same plans as the real engine, cost models (roofline, fitted profile), the memory
model, and a reduced Figure 12 through the run-directory writer."""
from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from pp_runtime.batch import MicroBatch, SampleSpec, SeqChunk
from pp_runtime.config import SchedulerConfig
from pp_runtime.request import Request, SamplingParams
from pp_runtime.sim import (BatchShape, ConstantCost, DummyTokens, PipelineCost, ProfileCostModel, RooflineCostModel,
                            SimExecutor, StageProfiles, VirtualClock, fit_profile, hardware_preset, load_sim_config,
                            model_preset, plan_memory, read_profile, run_simulation, simulate, workload_items,
                            write_sim_run_dir)
from pp_runtime.sim.batch_shape import OPS
from pp_runtime.timing import TimingRecord
from pp_runtime.workload import generate_workload
from pp_runtime.workload_config import WorkloadConfig
from stages import cpu_kernels
from stages.model_source import resolve_model

REPO = Path(__file__).resolve().parents[2]
RUN_FILES = ("stage_timings.jsonl", "summary.json", "trace.json", "results.jsonl", "workers.json")
SUMMARY_KEYS = ("scheduler", "pp", "tp", "chunk_size", "max_batch_size", "num_requests", "prefill_tokens",
                "decode_tokens", "wall_s", "throughput_tok_s", "decode_tok_s", "bubble_s_per_request_p50",
                "bubble_s_per_request_p90", "bubble_fraction_per_stage", "ttft_s_p50", "ttft_s_p99", "tbt_s_p50",
                "tbt_s_p99", "microbatch_time_cv")


def _req(rid: str, seq: int, prompt_len: int, max_tokens: int) -> Request:
    return Request(rid, seq, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


# ---- hand-checked pipelines -------------------------------------------------------------------
def test_two_stages_constant_costs_hand_checked(tmp_path: Path) -> None:
    """One request, prompt 4 in chunks of 2, 2 output tokens; stage 0 takes 1 s, stage 1 takes 2 s,
    a send 0.5 s. Both chunks are in flight together; the decode waits for the last chunk's token."""
    req = _req("a", 0, 4, 2)
    cfg = SchedulerConfig("sarathi", chunk_size=2, max_batch_size=4, max_model_len=64)
    res = simulate([req], None, cfg, 16, 4, ConstantCost([1.0, 2.0], send_s=0.5), pp=2, tp=2)
    ex = res.replicas[0].executor
    # (mb, t_ready, t_start, t_end)
    assert ex.stage_rows(0) == [(0, 0.0, 0.0, 1.0), (1, 1.0, 1.0, 2.0), (2, 5.5, 5.5, 6.5)]
    assert ex.stage_rows(1) == [(0, 0.0, 1.5, 3.5), (1, 3.5, 3.5, 5.5), (2, 5.5, 7.0, 9.0)]
    assert req.first_token_time == 5.5 and req.token_times == [5.5, 9.0] and req.finish_time == 9.0
    assert res.end == 9.0 and res.microbatches == 3
    s = write_sim_run_dir(tmp_path, res, {"scheduler": "sarathi"}, [])
    # gaps: stage 0: 0, 0, 5.5 − 2; stage 1: 1.5, 0, 7 − 5.5 → the request was in all three
    assert s["bubble_s_per_request_p50"] == pytest.approx(6.5)
    assert s["bubble_fraction_per_stage"] == pytest.approx([3.5 / 9, 3.0 / 9])
    assert s["wall_s"] == 9.0 and s["ttft_s_p50"] == 5.5 and s["tbt_s_p50"] == 3.5
    rows = [json.loads(x) for x in (tmp_path / "stage_timings.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 2 * 2 and {(r["stage"], r["tp_rank"]) for r in rows} == {(0, 0), (0, 1), (1, 0), (1, 1)}


def test_decode_waits_for_last_stage_and_pipeline_depth() -> None:
    """Two requests (one-token prompts, 3 outputs each) on 3 stages of 1 s: each decode is issued
    exactly when the micro-batch that sampled its input leaves the last stage."""
    reqs = [_req("a", 0, 1, 3), _req("b", 1, 1, 3)]
    cfg = SchedulerConfig("sarathi", chunk_size=1, max_batch_size=4, max_model_len=64)
    res = simulate(reqs, None, cfg, 16, 4, ConstantCost(1.0, pp=3), pp=3, keep_history=True)
    # chunk 1 admits one prompt per micro-batch: a at 0, b at 1 (in flight together), then decodes
    plans = [[(c.seq_id, c.is_prefill) for c in mb.chunks] for mb in res.history]
    assert plans == [[(0, True)], [(1, True)], [(0, False)], [(1, False)], [(0, False)], [(1, False)]]
    assert reqs[0].token_times == [3.0, 6.0, 9.0] and reqs[1].token_times == [4.0, 7.0, 10.0]
    last = res.replicas[0].executor.stage_rows(2)
    assert [r[2] for r in last] == [2.0, 3.0, 5.0, 6.0, 8.0, 9.0]  # t_start on the last stage


def test_worker_prep_and_dispatch_hand_checked() -> None:
    """prep_s: a worker starts a plan prep_s after it is free and has the plan (sent to every
    stage at submit + dispatch_s), and never before its input arrived."""
    ex = SimExecutor(ConstantCost(1.0, pp=2), pp=2, dispatch_s=0.05, prep_s=[0.1, 0.2])
    for i in range(2):  # both at t = 0: a full pipeline
        ex.submit(MicroBatch(i, (SeqChunk(i, 0, (5,), (0,), True, SampleSpec(0.0, 1.0, 0, 0)),)))
    s0, s1 = ex.stage_rows(0), ex.stage_rows(1)
    # mb 0: stage 0 at 0.05 + 0.1; stage 1 had the plan (0.25) before its input (1.15)
    # mb 1: stage 0 free at 1.15, + 0.1; stage 1 free at 2.15, + 0.2 (its input came at 2.25)
    assert [x for r in s0 for x in r[2:]] == pytest.approx([0.15, 1.15, 1.25, 2.25])
    assert [x for r in s1 for x in r[2:]] == pytest.approx([1.15, 2.15, 2.35, 3.35])
    with pytest.raises(ValueError, match="prep_s has 1 values for pp=2"):
        SimExecutor(ConstantCost(1.0, pp=2), pp=2, prep_s=[0.1])


def _step_times(jitter: float | list[float], seed: int | str = 0, n: int = 4000) -> list[list[float]]:
    ex = SimExecutor(ConstantCost([1.0, 2.0]), pp=2, jitter=jitter, seed=seed)
    for i in range(n):
        ex.submit(MicroBatch(i, (SeqChunk(i, 0, (5,), (0,), True, SampleSpec(0.0, 1.0, 0, 0)),)))
    return [[r[3] - r[2] for r in ex.stage_rows(s)] for s in range(2)]


def test_step_jitter_is_mean_one_lognormal_and_seeded() -> None:
    """jitter σ: each stage's step time × exp(N(−σ²/2, σ)), drawn per stage and micro-batch:
    mean 1 and log-sd σ over many steps; the same draws for the same seed; σ = 0: exact."""
    s0, s1 = _step_times(0.0)
    assert set(s0) == {1.0} and set(s1) == {2.0}
    s0, s1 = _step_times([0.2, 0.0])
    logs = [math.log(x) for x in s0]
    assert statistics.mean(s0) == pytest.approx(1.0, rel=0.02) and statistics.stdev(logs) == pytest.approx(0.2, rel=0.05)
    assert s1 == pytest.approx([2.0] * len(s1), abs=1e-9)  # σ = 0 on stage 1: untouched
    assert _step_times(0.1, seed=7, n=50) == _step_times(0.1, seed=7, n=50) != _step_times(0.1, seed=8, n=50)
    for bad in (1.0, -0.1, [0.1]):
        with pytest.raises(ValueError, match="jitter must be one value or 2"):
            SimExecutor(ConstantCost([1.0, 2.0]), pp=2, jitter=bad)


def test_jitter_makes_equal_stages_wait_on_each_other() -> None:
    """Two stages of exactly 1 s never idle after the first micro-batch; with 10% jitter each
    waits for the other's slow steps (the bubble a deterministic cost model misses), while the
    mean step stays 1 s."""
    def stage1_idle(jitter: float) -> tuple[float, float]:
        reqs = [_req(f"r{i}", i, 8, 40) for i in range(8)]
        cfg = SchedulerConfig("sarathi", chunk_size=8, max_batch_size=4, max_model_len=64)
        res = simulate(reqs, None, cfg, 128, 4, ConstantCost(1.0, pp=2), pp=2, jitter=jitter, seed=3)
        rows = res.replicas[0].executor.stage_rows(1)
        idle = sum(b[2] - a[3] for a, b in zip(rows, rows[1:]))
        return idle, statistics.mean(r[3] - r[2] for r in rows)
    idle, step = stage1_idle(0.0)
    assert idle == 0.0 and step == 1.0
    idle, step = stage1_idle(0.1)
    assert idle > 1.0 and step == pytest.approx(1.0, rel=0.05)


def test_arrivals_idle_replica_and_replicas(tmp_path: Path) -> None:
    reqs = [_req(f"r{i}", i, 2, 2) for i in range(4)]
    cfg = SchedulerConfig("orca", chunk_size=8, max_batch_size=4, max_model_len=64)
    res = simulate(reqs, [0.0, 0.0, 10.0, 10.0], cfg, 16, 4, ConstantCost(1.0, pp=1), pp=1, replicas=2)
    assert [r.arrival_time for r in reqs] == [0.0, 0.0, 10.0, 10.0]
    # round robin: r0, r2 on replica 0; r1, r3 on replica 1; the idle replicas sleep until t = 10
    assert [r.first_token_time for r in reqs] == [1.0, 1.0, 11.0, 11.0]
    assert [r.finish_time for r in reqs] == [2.0, 2.0, 12.0, 12.0]
    s = write_sim_run_dir(tmp_path, res, {}, [])
    rows = [json.loads(x) for x in (tmp_path / "stage_timings.jsonl").read_text().splitlines()]
    # per replica: prefill, decode for the first request, then the same at t = 10; unique mb ids
    assert {r["stage"] for r in rows} == {0, 1} and len({r["mb"] for r in rows}) == len(rows) == 8
    # the design's bubble counts every idle gap, waiting for arrivals too: 8 s before r2 and r3
    assert s["ttft_s_p50"] == 1.0 and s["bubble_s_per_request_p50"] == 4.0 and s["bubble_s_per_request_p90"] == 8.0
    # least loaded: the long request fills replica 0, the next three go to replica 1 until it is busier
    reqs = [_req("long", 0, 40, 2)] + [_req(f"s{i}", i + 1, 4, 2) for i in range(3)]
    res = simulate(reqs, None, cfg, 64, 4, ConstantCost(1.0, pp=1), pp=1, replicas=2, router="least_loaded")
    assert [sorted(rep.requests) for rep in res.replicas] == [[0], [1, 2, 3]]


def test_executor_interface_with_the_real_engine() -> None:
    """SimExecutor satisfies what pp_runtime.engine.Engine calls: the real step() drives it."""
    from pp_runtime.engine import Engine
    from pp_runtime.kv_cache import BlockManager
    from pp_runtime.scheduler import Scheduler
    clock = VirtualClock()
    ex = SimExecutor(ConstantCost(0.5, pp=2), pp=2, tp=1, clock=clock)
    sched = Scheduler(SchedulerConfig("sarathi", 4, 4, False, 64), BlockManager(16, 4))
    eng = Engine(sched, ex, max_in_flight=2)
    sched.add(_req("a", 0, 6, 2))
    while sched.has_unfinished() or eng.in_flight:
        eng.step()
    # chunks 4 and 2 in flight together: the last leaves stage 1 at 1.5 s; one decode round trip: 2.5 s
    assert clock.now == 2.5
    assert [len(rows) for rows in ex.drain_timings()] == [3, 3] and ex.ranks() == [(0, 0), (1, 0)]
    assert ex.clock_offsets() == [0.0, 0.0]


# ---- the same plans as the real engine --------------------------------------------------------
def _plan_key(mb: MicroBatch) -> list[tuple]:
    return [(c.seq_id, c.start, c.num_tokens, c.is_prefill, c.block_table, c.sample is not None) for c in mb.chunks]


@pytest.mark.parametrize("kv_admission, prefix_caching", [("optimistic", False), ("reserve", False),
                                                           ("optimistic", True), ("reserve", True)])
@pytest.mark.parametrize("policy", ("sarathi", "orca"))
def test_same_microbatches_as_real_engine(policy: str, kv_admission: str, prefix_caching: bool) -> None:
    """A real in-process run (llama-tiny, pp=2, local executor: every micro-batch completes in issue
    order) and the simulator with constant costs issue the same plans, preemptions included
    (optimistic admission; reserve has none) and prefix hits included (the prompts then share a
    32-token system prompt); more requests than the simulator's hand-over window, so the window is
    exercised too."""
    from pp_runtime import LLM
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 120))] for _ in range(20)]
    if prefix_caching:
        prompts = [prompts[0][:32] + p for p in prompts]
    max_tokens = [rng.randrange(1, 20) for _ in prompts]
    # 23 KV blocks of 16: preemption happens. The last stage's exact greedy LM head, where the
    # kernels have bf16 products, keeps 4 bytes a vocab row and 2 a weight beside it.
    cfg = resolve_model("llama-tiny").config
    kept = cfg.vocab_size * (4 + 2 * cfg.hidden_size) / 2 ** 30 if cpu_kernels.bf16_products() else 0.0
    with LLM(model="llama-tiny", pp=2, launcher="local", scheduler=policy, chunk_size=32, max_batch_size=6,
             memory_budget_gb=0.00058 + kept, max_model_len=256, threads=1, kv_admission=kv_admission,
             enable_prefix_caching=prefix_caching) as llm:
        reqs = [llm.make_request(str(i), p, SamplingParams(max_tokens=m, ignore_eos=True))
                for i, (p, m) in enumerate(zip(prompts, max_tokens))]
        llm.run(reqs)
        real = [_plan_key(mb) for mb in llm.engine.history]
        preempted = sum(r.num_preemptions for r in reqs)
        sreqs = [Request(str(i), i, list(p), SamplingParams(max_tokens=m, ignore_eos=True))
                 for i, (p, m) in enumerate(zip(prompts, max_tokens))]
        res = simulate(sreqs, None, llm.sched_config, llm.memory.num_blocks, 16, ConstantCost(1.0, pp=2), pp=2,
                       keep_history=True, window=1, key_cost=llm.source.config.key_cost, prefix_caching=prefix_caching)
        hits = sum(r.num_cached_tokens for r in reqs)
    assert llm.sched_config.chunk_budget == "flops"  # the sim's scheduler cuts chunks by FLOPs as well
    assert (preempted > 0) == (kv_admission == "optimistic") and sum(r.num_preemptions for r in sreqs) == preempted
    assert [_plan_key(mb) for mb in res.history] == real
    assert [len(r.output_token_ids) for r in sreqs] == max_tokens
    assert (hits > 0) == prefix_caching and sum(r.num_cached_tokens for r in sreqs) == hits


# ---- cost models ------------------------------------------------------------------------------
def test_roofline_prefill_compute_bound_decode_memory_bound() -> None:
    m, hw = model_preset("llama-13b"), hardware_preset("a6000")
    cost = RooflineCostModel(m, hw)
    prefill = BatchShape.build([(512, 0)])
    decode1 = BatchShape.build([], [1024])
    assert set(cost.linear_bounds(prefill).values()) == {"compute"}
    assert set(cost.linear_bounds(decode1).values()) == {"memory"}
    c, mem = cost.attention_parts(decode1)["decode"]
    assert mem > c  # decode attention streams K/V
    pipe = PipelineCost(cost, m, hw, pp=1, tp=1)
    t_prefill = sum(pipe.shape_times(prefill)[0]) / 512
    t_decode = sum(pipe.shape_times(decode1)[0])
    assert 50 < t_decode / t_prefill < 400  # the paper: ~200× per token at batch 1
    # piggybacking: 8 decodes on a 256-token chunk cost far less than 8 decodes alone
    chunk = sum(pipe.shape_times(BatchShape.build([(256, 0)]))[0])
    mixed = sum(pipe.shape_times(BatchShape.build([(256, 0)], [1024] * 8))[0])
    alone = sum(pipe.shape_times(BatchShape.build([], [1024] * 8))[0])
    assert (mixed - chunk) < alone / 4
    # TP halves the linear work and adds all-reduces; PP sends cross nodes
    hw8 = hardware_preset("a100-80gb")
    p = PipelineCost(RooflineCostModel(model_preset("gpt3-175b"), hw8), model_preset("gpt3-175b"), hw8, pp=8, tp=8)
    compute, send = p.shape_times(BatchShape.build([(256, 1024)], [2048] * 26))
    assert len(compute) == 8 and len(send) == 7 and all(0 < s < c for s, c in zip(send, compute))
    assert p.breakdown(BatchShape.build([(256, 0)]))["allreduce"] > 0


def test_memory_model_gives_the_papers_batch_sizes() -> None:
    m, hw = model_preset("gpt3-175b"), hardware_preset("a100-80gb")
    pp8 = plan_memory(m, hw, pp=8, tp=8, max_model_len=4096, utilization=0.9)
    tp8 = plan_memory(m, hw, pp=1, tp=8, max_model_len=4096, utilization=0.9)
    assert pp8.per_microbatch_b == 27 and tp8.max_batch_b == 11  # the paper's 27 and 11
    assert pp8.max_batch_b == 219 and pp8.num_blocks * 16 >= 219 * 4096
    with pytest.raises(ValueError, match="does not fit"):
        plan_memory(m, hw, pp=1, tp=1, max_model_len=4096)


def _write_profile(path: Path, head: tuple[float, float, float] | None = None, scale: float = 1.0,
                   log_sd: tuple[float, float] | None = None) -> dict:
    """A hand-made profile.csv (the columns `pp-runtime profile` writes) from known formulas (ms).
    ``head`` (floor, a, b): the LM head is max(floor, a + b·sampled), written as lm_head_ms and
    inside others_ms (as the profiler does); without it the head is others' c·sampled and the
    CSV has no lm_head_ms column (profiles written before the column existed). ``log_sd``: the
    rows' total_log_sd, alternating between the two values (no column without it)."""
    lin = {"preproj": (0.3, 0.1, 0.002), "postproj": (0.2, 0.05, 0.001), "ffn_ln1": (0.5, 0.2, 0.004),
           "ffn_ln2": (0.4, 0.1, 0.003)}  # (floor, a, b)
    attn, others = (0.05, 2e-6, 3e-5), (0.1, 0.0005, 0.02)
    rows = [("prefill", p, 0, c) for p, c in ((16, 0), (32, 0), (64, 0), (128, 0), (256, 0), (512, 0), (256, 256))]
    rows += [("decode", 0, b, 256) for b in (1, 2, 4, 8, 16, 32)] + [("mixed", 256, b, 256) for b in (1, 4, 16)]
    cols = ("kind", "prefill_tokens", "decode_tokens", "context_len", "preproj_ms", "attn_ms", "postproj_ms",
            "ffn_ln1_ms", "ffn_ln2_ms", "others_ms", "total_ms", "per_token_ms", "per_decode_token_ms")
    cols += ("lm_head_ms",) if head else ()
    cols += ("total_log_sd",) if log_sd else ()
    lines = [",".join(cols)]
    for i, (kind, p, d, c) in enumerate(rows):
        T = p + d
        pairs = p * ((c if kind == "prefill" else 0) + (p + 1) / 2)
        sampled = (1 if p else 0) + d
        ms = {op: max(f, a + b * T) for op, (f, a, b) in lin.items()}
        ms["attn"] = attn[0] + attn[1] * pairs + attn[2] * d * (c + 1)
        lm = max(head[0], head[1] + head[2] * sampled) if head else others[2] * sampled
        ms["others"] = others[0] + others[1] * T + lm
        ms = {op: v * scale for op, v in ms.items()}
        lm *= scale
        total = sum(ms.values())
        lines.append(",".join(str(x) for x in (kind, p, d, c, ms["preproj"], ms["attn"], ms["postproj"],
                                               ms["ffn_ln1"], ms["ffn_ln2"], ms["others"], total, total / T,
                                               total / d if kind == "decode" else "") + ((lm,) if head else ())
                              + ((log_sd[i % 2],) if log_sd else ())))
    path.write_text("\n".join(lines) + "\n")
    return {"lin": lin, "attn": attn, "others": others}


def test_profile_fit_recovers_hand_made_costs(tmp_path: Path) -> None:
    truth = _write_profile(tmp_path / "profile.csv")
    fit = fit_profile(read_profile(tmp_path / "profile.csv"))
    assert fit.max_rel_err < 1e-6 and min(fit.r2.values()) > 0.999999
    for op, (floor, a, b) in truth["lin"].items():
        line = fit.linear[op]
        for T in (1, 40, 100, 300, 1000):
            assert line(T) == pytest.approx(max(floor, a + b * T), rel=1e-6)
    assert fit.attn == pytest.approx(truth["attn"], rel=1e-6)
    assert fit.others == pytest.approx(truth["others"], rel=1e-6)
    # per layer and TP rank, the LM head (sampled rows) on the last stage only
    m = model_preset("smollm2-135m")
    cost = ProfileCostModel(fit, profiled_layers=m.num_layers)
    pipe = PipelineCost(cost, m, hardware_preset("a100-80gb"), pp=2, tp=1, inter_node=[False])
    shape = BatchShape.build([(128, 0)], [257] * 4)
    compute, _ = pipe.shape_times(shape)
    whole = sum(fit.op_ms(shape).values()) * 1e-3
    assert sum(compute) == pytest.approx(whole, rel=1e-9)
    assert compute[1] - compute[0] == pytest.approx(truth["others"][2] * 5 * 1e-3, rel=1e-9)
    assert set(cost.describe()["linear_ms"]) == set(OPS) - {"attn", "others"}


def test_profile_fit_lm_head_column_and_several_csvs(tmp_path: Path) -> None:
    """With lm_head_ms the head gets its own floor-line over sampled rows and the last stage
    alone pays it; several CSVs fit as one set of rows."""
    head = (9.0, 6.0, 1.5)  # a 1-row GEMM floor, then linear in rows
    truth = _write_profile(tmp_path / "a.csv", head)
    _write_profile(tmp_path / "b.csv", head)
    fit = fit_profile(read_profile(tmp_path / "a.csv"))
    assert fit.head is not None and fit.max_rel_err < 1e-6
    for n in (1, 2, 5, 17, 33):
        assert fit.head_ms(n) == pytest.approx(max(head[0], head[1] + head[2] * n), rel=1e-6)
    assert fit.others[:2] == pytest.approx(truth["others"][:2], rel=1e-6) and fit.others[2] == 0.0
    m = model_preset("smollm2-135m")
    cost = ProfileCostModel.from_csv([tmp_path / "a.csv", tmp_path / "b.csv"], m.num_layers)
    assert cost.fit.rows == 2 * fit.rows and cost.describe()["lm_head_ms"]["floor"] == pytest.approx(head[0])
    pipe = PipelineCost(cost, m, hardware_preset("a100-80gb"), pp=2, tp=1, inter_node=[False])
    shape = BatchShape.build([], [300] * 12)
    compute, _ = pipe.shape_times(shape)
    assert compute[1] - compute[0] == pytest.approx((head[1] + head[2] * 12) * 1e-3, rel=1e-9)


def test_per_stage_profiles_of_a_deployment(tmp_path: Path) -> None:
    """cost_model.stages (`pp-runtime profile --pp N`): stage s's CSV times its own layers, so a
    simulated stage takes exactly its own fitted total, whatever its layer count; the LM head
    only on the last stage; the scenario's pp must match."""
    _write_profile(tmp_path / "s0.csv")
    _write_profile(tmp_path / "s1.csv", head=(9.0, 6.0, 1.5), scale=2.0)
    m = model_preset("smollm2-135m")
    stages = StageProfiles.from_csvs([tmp_path / "s0.csv", [tmp_path / "s1.csv"]])
    with pytest.raises(ValueError, match="2 stage profiles, the scenario has pp=3"):
        stages.per_stage([10, 10, 10])
    pipe = PipelineCost(stages.per_stage([12, 18]), m, hardware_preset("a100-80gb"), pp=2, tp=1, layers=[12, 18],
                        inter_node=[False])
    f0, f1 = stages.fits
    for shape in (BatchShape.build([(256, 0)], [300] * 8), BatchShape.build([], [700] * 20),
                  BatchShape.build([(64, 512)], [])):
        compute, _ = pipe.shape_times(shape)
        assert compute[0] == pytest.approx((sum(f0.op_ms(shape).values()) - f0.head_ms(shape.sampled)) * 1e-3)
        assert compute[1] == pytest.approx(sum(f1.op_ms(shape).values()) * 1e-3)
        assert compute[1] > 2 * compute[0]  # twice the cost, plus a head
    assert [d["profiled_layers"] for d in pipe.describe()["per_stage"]] == [12, 18]
    cfg = {"name": "staged", "model": "smollm2-135m", "hardware": "a6000", "max_model_len": 512,
           "cluster": {"nodes": 1, "gpus_per_node": 2}, "memory": {"utilization": 0.05},
           "cost_model": {"kind": "profile", "stages": ["s0.csv", ["s1.csv"]]},
           "workload": {"kind": "zipf", "num_requests": 12, "min_len": 64, "max_len": 512, "theta": 0.4,
                        "pd_ratio": 10},
           "scenarios": [{"name": "sarathi", "scheduler": "sarathi", "pp": 2, "chunk_size": 128,
                          "partition": [12, 18]}]}
    (tmp_path / "staged.yaml").write_text(yaml.safe_dump(cfg))
    run_simulation(str(tmp_path / "staged.yaml"), str(tmp_path / "out"), progress=False)
    s = json.loads((tmp_path / "out/sarathi/summary.json").read_text())
    assert s["num_requests"] == 12 and len(s["cost_model"]["per_stage"]) == 2
    for change, message in (({"scenarios": [{**cfg["scenarios"][0], "pp": 1, "partition": None}]},
                             "2 stage profiles, the scenario has pp=1"),
                            ({"cost_model": {"kind": "profile", "stages": ["s0.csv"], "csv": "s0.csv"}},
                             "either stages"),
                            ({"cost_model": {"kind": "profile", "stages": ["s0.csv", "nope.csv"]}},
                             r"cost_model.stages\[1\] 'nope.csv' is not a file")):
        (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**cfg, **change}))
        with pytest.raises(ValueError, match=message):
            run_simulation(str(tmp_path / "bad.yaml"), str(tmp_path / "bad"), progress=False)


def test_scenario_max_running_caps_running_sequences(tmp_path: Path) -> None:
    from pp_runtime.sim.deployment import plan_deployment
    cfg = load_sim_config(REPO / "configs/sim/smoke.yaml")
    sc = dataclasses.replace(cfg.scenarios[0], max_batch_size=8, max_running=16)
    assert plan_deployment(cfg, sc).sched_cfg.max_running == 16
    with pytest.raises(ValueError, match="max_running"):
        dataclasses.replace(sc, max_running=0)


@pytest.mark.parametrize("budget", ["flops", "tokens"])
def test_scenario_chunk_budget_reaches_the_scheduler(budget: str) -> None:
    """A scenario simulates the runtime's chunk budget it names (validate_sim copies a bench's)."""
    from pp_runtime.sim.deployment import plan_deployment
    cfg = load_sim_config(REPO / "configs/sim/smoke.yaml")
    sc = dataclasses.replace(cfg.scenarios[0], scheduler="sarathi", chunk_budget=budget)
    assert plan_deployment(cfg, sc).sched_cfg.chunk_budget == budget
    with pytest.raises(ValueError, match="chunk_budget must be one of flops, tokens, got 'bytes'"):
        dataclasses.replace(sc, chunk_budget="bytes")


@pytest.mark.parametrize("admission", ["fcfs", "longest_first"])
def test_scenario_admission_reaches_the_scheduler(admission: str) -> None:
    """As the chunk budget: a bench run under longest_first is simulated under it (validate_sim)."""
    from pp_runtime.sim.deployment import plan_deployment
    cfg = load_sim_config(REPO / "configs/sim/smoke.yaml")
    sc = dataclasses.replace(cfg.scenarios[0], admission=admission)
    assert plan_deployment(cfg, sc).sched_cfg.admission == admission
    with pytest.raises(ValueError, match="admission must be one of fcfs, longest_first, got 'lifo'"):
        dataclasses.replace(sc, admission="lifo")


def test_scenario_step_costs_given_or_fitted_on_its_own_simulated_steps(tmp_path: Path) -> None:
    """Given costs reach the scheduler as they are; "fit" fits the scenario's own simulated steps,
    as --step-costs fit fits real ones: on the roofline a decode's attention reads its K/V at
    memory speed, so decodes cost time the FLOPs budget does not charge; the run directory
    records what the scenario ran with; bad values are named. (LLaMA-13B on A6000s: a prompt key
    is so cheap beside the linears that the fit may price it 0.)"""
    from pp_runtime.sim.deployment import plan_deployment
    from pp_runtime.sim.run import fit_step_costs_simulated, run_scenario
    cfg = load_sim_config(REPO / "configs/sim/smoke.yaml")
    given = dataclasses.replace(cfg.scenarios[0], step_costs=[1e-3, 0.5, 2e-3])
    assert given.step_costs == (1e-3, 0.5, 2e-3) == plan_deployment(cfg, given).sched_cfg.step_costs
    fit = dataclasses.replace(cfg.scenarios[0], step_costs="fit")
    assert plan_deployment(cfg, fit).sched_cfg.step_costs == ()  # fitted when the scenario runs
    kp, dr, dk = fit_step_costs_simulated(cfg, plan_deployment(cfg, fit))
    assert min(kp, dr, dk) >= 0 and dr + 500 * dk > 1  # a decode at 500 keys: more than a prompt token
    small = dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, num_requests=12))
    summary = run_scenario(small, fit, tmp_path, progress=False)
    assert summary["step_costs"] == pytest.approx([kp, dr, dk]) and summary["num_errors"] == 0
    for bad in ("fits", [1e-3, 0.5], [1e-3, -0.5, 0.0]):
        with pytest.raises(ValueError, match="step_costs must be"):
            dataclasses.replace(fit, step_costs=bad)
    # orca with tile_align and a chunk below max_batch_size (which sarathi's tile_align refuses):
    # calibrated as the runtime calibrates, sarathi without tile_align
    orca = dataclasses.replace(fit, scheduler="orca", tile_align=True, chunk_size=64, max_batch_size=96)
    assert fit_step_costs_simulated(cfg, plan_deployment(cfg, orca)) is not None


def test_scenario_prefix_caching_shares_the_workloads_system_prompt(tmp_path: Path) -> None:
    """smoke.yaml's 64 requests under one 200-token system prompt: with the scenario's
    enable_prefix_caching its 12 whole blocks are computed once (the real block manager keeps
    them; the prompts' own ids past the prefix never match), and the simulated run is shorter;
    kv_admission reaches the scheduler; bad values are named."""
    from pp_runtime.sim.deployment import plan_deployment
    from pp_runtime.sim.run import run_scenario
    cfg = load_sim_config(REPO / "configs/sim/smoke.yaml")
    cfg = dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, shared_prefix=200))
    out = {}
    for on in (False, True):
        sc = dataclasses.replace(cfg.scenarios[0], name=f"pc{on}", enable_prefix_caching=on)
        out[on] = run_scenario(cfg, sc, tmp_path, progress=False)
        assert out[on]["enable_prefix_caching"] is on and out[on]["num_errors"] == 0
    assert out[False]["prefix_cache_hit_tokens"] == 0
    assert out[True]["prefix_cache_hit_tokens"] >= 63 * 192  # every prompt after the first (some may be in flight together)
    assert out[True]["wall_s"] < out[False]["wall_s"]
    sc = dataclasses.replace(cfg.scenarios[0], kv_admission="reserve")
    assert plan_deployment(cfg, sc).sched_cfg.kv_admission == "reserve" and cfg.scenarios[0].kv_admission == "optimistic"
    # reserve runs pp micro-batches of max_batch_size, as the runtime; optimistic at most B
    reserve, optimistic = plan_deployment(cfg, sc), plan_deployment(cfg, cfg.scenarios[0])
    assert reserve.sched_cfg.max_running == 2 * reserve.sched_cfg.max_batch_size
    assert optimistic.sched_cfg.max_running == max(optimistic.sched_cfg.max_batch_size, optimistic.memory.max_batch_b)
    with pytest.raises(ValueError, match="kv_admission must be one of reserve, optimistic, got 'eager'"):
        dataclasses.replace(sc, kv_admission="eager")
    with pytest.raises(ValueError, match="enable_prefix_caching must be true or false, got 'yes'"):
        dataclasses.replace(sc, enable_prefix_caching="yes")


def test_validate_sim_copies_the_runs_admission(tmp_path: Path) -> None:
    run = tmp_path / "run.yaml"
    run.write_text("max_batch_size: 4\nmax_model_len: 64\nadmission: longest_first\nschedulers: [sarathi, orca]\n"
                   "workload: {kind: fixed, num_requests: 2, prompt_len: 8, decode_len: 2}\n")
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from validate_sim import sim_config
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    cfg = sim_config(str(run), [["stage0.csv"]], 10.0, {"return": 5.0, "prep": [3.0], "jitter": [0.0]})
    assert [sc["admission"] for sc in cfg["scenarios"]] == ["longest_first", "longest_first"]
    # the runtime's defaults where the run leaves them, the run's own otherwise
    assert all(sc["kv_admission"] == "optimistic" and sc["enable_prefix_caching"] for sc in cfg["scenarios"])
    run.write_text(run.read_text() + "kv_admission: reserve\nenable_prefix_caching: false\n")
    cfg = sim_config(str(run), [["stage0.csv"]], 10.0, {"return": 5.0, "prep": [3.0], "jitter": [0.0]})
    assert all(sc["kv_admission"] == "reserve" and not sc["enable_prefix_caching"] for sc in cfg["scenarios"])
    # a reused bench: what each scheduler's run recorded (an older run without the keys: optimistic, no caching)
    (tmp_path / "bench" / "sarathi").mkdir(parents=True)
    (tmp_path / "bench" / "sarathi" / "summary.json").write_text('{"kv_admission": "reserve", "enable_prefix_caching": true}')
    (tmp_path / "bench" / "orca").mkdir()
    (tmp_path / "bench" / "orca" / "summary.json").write_text("{}")
    cfg = sim_config(str(run), [["stage0.csv"]], 10.0, {"return": 5.0, "prep": [3.0], "jitter": [0.0]}, tmp_path / "bench")
    assert [(sc["kv_admission"], sc["enable_prefix_caching"]) for sc in cfg["scenarios"]] == \
        [("reserve", True), ("optimistic", False)]


def test_sim_config_workload_takes_file_seed_and_trace_beside_it(tmp_path: Path) -> None:
    """The workload section is read as a run config's is: the top-level seed, a trace path relative to the file."""
    from pp_runtime.workload import WorkItem, save_trace
    data = yaml.safe_load((REPO / "configs/sim/smoke.yaml").read_text())
    data["seed"] = 7
    (tmp_path / "seeded.yaml").write_text(yaml.safe_dump(data))
    assert load_sim_config(tmp_path / "seeded.yaml").workload.seed == 7
    save_trace([WorkItem("a", [5, 6], 2)], tmp_path / "t.jsonl")
    data["workload"] = {"kind": "trace", "trace_path": "t.jsonl"}
    (tmp_path / "traced.yaml").write_text(yaml.safe_dump(data))
    assert load_sim_config(tmp_path / "traced.yaml").workload.trace_path == str(tmp_path / "t.jsonl")


# ---- workload, config, run directories ----------------------------------------------------------
@pytest.mark.parametrize("wl", [
    dict(kind="zipf", num_requests=40, min_len=64, max_len=512, theta=0.4, pd_ratio=10, seed=3),
    dict(kind="uniform", num_requests=12, min_len=8, max_len=40, pd_ratio=2, arrival="poisson", rate=5.0),
    dict(kind="fixed", num_requests=5, prompt_len=7, decode_len=3)])
def test_workload_lengths_match_generate_workload(wl: dict) -> None:
    cfg = WorkloadConfig(**wl)
    items = workload_items(cfg, 1000)
    ref = generate_workload(cfg, 1000)
    assert [(i, p, m, a) for i, p, m, a in items] == [(r.request_id, r.prompt_len, r.max_tokens, r.arrival_s) for r in ref]
    t = DummyTokens(5)
    assert len(t) == 5 and t[1:4] == [3, 3, 3] and list(t) == [3] * 5 and t[-1] == 3
    # with a seq: the shared positions' ids are every such prompt's, the rest this prompt's alone
    a, b = DummyTokens(6, 3, seq=0, shared=4), DummyTokens(6, 3, seq=1, shared=4)
    assert a[:4] == b[:4] == list(a)[:4] and a[4] != b[4] and a[-1] == list(a)[5] == a[4:][1]
    assert len(set(a) | set(b)) == 8 and a[0:6:2] == [a[0], a[2], a[4]]


def _fig12_small(tmp_path: Path, n: int, scenarios: list[str] | None = None, **changes: object) -> Path:
    data = yaml.safe_load((REPO / "configs/sim/fig12.yaml").read_text())
    data["workload"]["num_requests"] = n
    if scenarios:
        data["scenarios"] = [s for s in data["scenarios"] if s["name"] in scenarios]
        data["claims"] = [c for c in data["claims"] if c["numerator"] in scenarios and c["denominator"] in scenarios]
    data.update(changes)
    path = tmp_path / "fig12_small.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    return path


def test_reduced_fig12_sarathi_bubbles_below_orca(tmp_path: Path) -> None:
    cfg_path = _fig12_small(tmp_path, 150, ["orca_tp8_pp8", "sarathi_tp8_pp8", "orca_tp8_x8"])
    out = tmp_path / "out"
    comp = run_simulation(str(cfg_path), str(out), progress=False)
    orca, sarathi = comp["scenarios"]["orca_tp8_pp8"], comp["scenarios"]["sarathi_tp8_pp8"]
    assert sarathi["bubble_s_per_request_p50"] < orca["bubble_s_per_request_p50"]
    assert sarathi["wall_s"] < orca["wall_s"]
    assert sarathi["paper_B_per_microbatch"] == 27 and comp["scenarios"]["orca_tp8_x8"]["paper_B"] == 11
    claims = {c["name"]: c for c in comp["claims"]}
    assert all(c["value"] is not None and c["value"] > 0 for c in claims.values())
    assert comp["base"] == "sarathi_tp8_pp8" and set(comp["schedulers"]) == set(comp["scenarios"])
    assert (out / "comparison.json").is_file() and "| orca_tp8_pp8 |" in (out / "fig12.md").read_text()
    for name in comp["scenarios"]:
        d = out / name
        assert all((d / f).stat().st_size > 0 for f in RUN_FILES)
        s = json.loads((d / "summary.json").read_text())
        assert all(k in s for k in SUMMARY_KEYS) and s["num_requests"] == 150 and s["num_errors"] == 0
        assert s["launcher"] == "sim" and s["run_start"] == 0.0
        rec_fields = {f.name for f in fields(TimingRecord)}
        lines = (d / "stage_timings.jsonl").read_text().splitlines()
        for line in lines[:50] + lines[-50:]:
            row = json.loads(line)
            TimingRecord(**{k: row[k] for k in rec_fields})
            assert row["t_ready"] <= row["t_start"] <= row["t_end"]
        results = [json.loads(x) for x in (d / "results.jsonl").read_text().splitlines()]
        assert len(results) == 150 and all(r["finish_reason"] == "length" for r in results)
        assert s["decode_tokens"] == sum(len(r["token_ids"]) for r in results)
        assert 0 < s["ttft_s_p50"] <= s["wall_s"] and s["completion_s"]["all"] == pytest.approx(s["wall_s"])
        workers = json.loads((d / "workers.json").read_text())
        assert len(workers) == 64 and {w["node"] for w in workers} == {f"sim-node{i}" for i in range(8)}


def test_jitter_from_the_profile_rounds(tmp_path: Path) -> None:
    """cost_model.jitter: profile takes each stage's σ from its CSVs (pooled total_log_sd of the
    rows: √(mean of squares)); a number applies to every stage; bad values name the field."""
    _write_profile(tmp_path / "s0.csv", log_sd=(0.03, 0.04))
    _write_profile(tmp_path / "s1.csv", log_sd=(0.12, 0.16))
    _write_profile(tmp_path / "old.csv")  # written before the column existed
    assert fit_profile(read_profile(tmp_path / "s0.csv")).jitter == pytest.approx(math.sqrt((0.03**2 + 0.04**2) / 2),
                                                                                  rel=0.05)
    assert fit_profile(read_profile(tmp_path / "old.csv")).jitter is None
    cfg = {"name": "jit", "model": "smollm2-135m", "hardware": "a6000", "max_model_len": 512,
           "cluster": {"nodes": 1, "gpus_per_node": 2}, "memory": {"utilization": 0.05},
           "cost_model": {"kind": "profile", "stages": ["s0.csv", "s1.csv"], "jitter": "profile"},
           "workload": {"kind": "zipf", "num_requests": 12, "min_len": 64, "max_len": 512, "theta": 0.4,
                        "pd_ratio": 10},
           "scenarios": [{"name": "sarathi", "scheduler": "sarathi", "pp": 2, "chunk_size": 128}]}
    (tmp_path / "jit.yaml").write_text(yaml.safe_dump(cfg))
    run_simulation(str(tmp_path / "jit.yaml"), str(tmp_path / "out"), progress=False)
    s = json.loads((tmp_path / "out/sarathi/summary.json").read_text())
    want = [fit_profile(read_profile(tmp_path / f"s{k}.csv")).jitter for k in (0, 1)]
    assert s["jitter_per_stage"] == pytest.approx(want) and want[1] == pytest.approx(4 * want[0])
    for key, value, message in (("stages", ["s0.csv", "old.csv"], "profile needs profiles with a total_log_sd column"),
                                ("jitter", 0.05, None), ("jitter", [0.05, 0.05], None),
                                ("jitter", [0.1], "jitter has 1 values, the scenario has pp=2"),
                                ("jitter", 1.5, r"cost_model.jitter must be a number in \[0, 1\)"),
                                ("jitter", "lots", r"cost_model.jitter must be a number in \[0, 1\)")):
        (tmp_path / "c.yaml").write_text(yaml.safe_dump({**cfg, "cost_model": {**cfg["cost_model"], key: value}}))
        if message is None:
            run_simulation(str(tmp_path / "c.yaml"), str(tmp_path / "c"), progress=False)
            assert json.loads((tmp_path / "c/sarathi/summary.json").read_text())["jitter_per_stage"] == [0.05, 0.05]
            continue
        with pytest.raises(ValueError, match=message):
            run_simulation(str(tmp_path / "c.yaml"), str(tmp_path / "c"), progress=False)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({**cfg, "cost_model": {"kind": "roofline", "jitter": "profile"}}))
    with pytest.raises(ValueError, match="jitter: profile needs kind 'profile'"):
        load_sim_config(tmp_path / "r.yaml")


def test_run_simulation_with_a_fitted_profile(tmp_path: Path) -> None:
    _write_profile(tmp_path / "profile.csv")
    cfg = {"name": "tiny", "model": "smollm2-135m", "hardware": "a6000", "max_model_len": 512,
           "cluster": {"nodes": 1, "gpus_per_node": 2}, "memory": {"utilization": 0.05},
           "cost_model": {"kind": "profile", "csv": "profile.csv"},
           "workload": {"kind": "zipf", "num_requests": 30, "min_len": 64, "max_len": 512, "theta": 0.4,
                        "pd_ratio": 10},
           "scenarios": [{"name": "sarathi", "scheduler": "sarathi", "pp": 2, "chunk_size": 128},
                         {"name": "orca", "scheduler": "orca", "pp": 2}]}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    comp = run_simulation(str(path), str(tmp_path / "out"), progress=False)
    assert comp["base"] == "sarathi" and comp["setup"]["cost_model"]["kind"] == "profile"
    s = json.loads((tmp_path / "out/sarathi/summary.json").read_text())
    assert s["num_requests"] == 30 and s["wall_s"] > 0 and s["cost_model"]["rows"] == 16


def test_config_errors_name_the_problem(tmp_path: Path) -> None:
    base = yaml.safe_load((REPO / "configs/sim/fig12.yaml").read_text())
    cases = [({"bogus": 1}, "unknown key sim config.bogus"),
             ({"hardware": "tpu"}, "unknown hardware preset 'tpu'"),
             ({"scenarios": [{"name": "x", "scheduler": "fifo"}]}, "scheduler must be one of"),
             ({"scenarios": [{"name": "x", "scheduler": "orca", "tp": 16}]}, "tp=16 must divide gpus_per_node=8"),
             ({"scenarios": [{"name": "x", "scheduler": "orca", "tp": 8, "pp": 8, "replicas": 2}]}, "needs 128 GPUs"),
             ({"scenarios": [{"name": "x", "scheduler": "orca", "tp": 8, "pp": 1}], "claims": None,
               "base": "y"}, "base 'y' names no scenario"),
             ({"max_model_len": 2048}, "exceed max_model_len=2048")]
    for i, (change, message) in enumerate(cases):
        p = tmp_path / f"c{i}.yaml"
        p.write_text(yaml.safe_dump({**base, **change}, allow_unicode=True))
        with pytest.raises(ValueError, match=message):
            load_sim_config(p)
    cfg = load_sim_config(REPO / "configs/sim/fig12.yaml")
    assert cfg.workload.num_requests == 10_000 and cfg.model.num_layers == 96 and cfg.hardware.name == "a100-80gb"


def test_shipped_configs(tmp_path: Path) -> None:
    """Every configs/sim/*.yaml scenario file loads and plans its deployments; smoke.yaml runs."""
    from pp_runtime.sim.deployment import plan_deployment
    presets = {"hardware.yaml", "models.yaml"}
    paths = [p for p in sorted((REPO / "configs/sim").glob("*.yaml")) if p.name not in presets]
    assert {p.name for p in paths} >= {"fig12.yaml", "smoke.yaml"}
    for p in paths:
        cfg = load_sim_config(p)
        for sc in cfg.scenarios:
            plan_deployment(cfg, sc)
    comp = run_simulation(str(REPO / "configs/sim/smoke.yaml"), str(tmp_path), progress=False)
    assert comp["claims"][1]["value"] > 1.0 and (tmp_path / "smoke.md").is_file()

