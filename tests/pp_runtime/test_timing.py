"""Bubble accounting on hand-made timing records with known answers, clock-offset correction,
summary fields and the Chrome trace schema."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pp_runtime.timing import (TimingRecord, bubble_fraction_per_stage, build_records, chrome_trace, classify,
                               cv, estimate_offset, percentile, request_bubbles, stage_gaps, summarize)

SUMMARY_FIELDS = ("scheduler", "pp", "tp", "chunk_size", "max_batch_size", "num_requests", "prefill_tokens",
                  "decode_tokens", "wall_s", "throughput_tok_s", "decode_tok_s", "bubble_s_per_request_p50",
                  "bubble_s_per_request_p90", "bubble_fraction_per_stage", "ttft_s_p50", "ttft_s_p99",
                  "tbt_s_p50", "tbt_s_p99", "microbatch_time_cv")


def rec(stage: int, mb: int, start: float, end: float, reqs: tuple[str, ...], p: int = 0, d: int = 0,
        kv: int = 0, tp: int = 0) -> TimingRecord:
    return TimingRecord(stage, tp, mb, mb, reqs, p, d, kv, start, start, end)


def two_stage_pipeline() -> list[TimingRecord]:
    """Run starts at t=0. Stage 0: mb0 [0,2] (A prefill 8), mb1 [2,3] (B prefill 4), mb2 [5,6] (A decode).
    Stage 1: mb0 [2,4], mb1 [4,5], mb2 [6,7]. Known gaps: s0: 0,0,2; s1: 2,0,1."""
    return [rec(0, 0, 0, 2, ("A",), p=8, kv=8), rec(0, 1, 2, 3, ("B",), p=4, kv=4),
            rec(0, 2, 5, 6, ("A",), d=1, kv=9),
            rec(1, 0, 2, 4, ("A",), p=8, kv=8), rec(1, 1, 4, 5, ("B",), p=4, kv=4),
            rec(1, 2, 6, 7, ("A",), d=1, kv=9),
            rec(1, 0, 2, 4.5, ("A",), p=8, kv=8, tp=1)]  # a TP peer: written, not double counted


def test_stage_gaps_and_request_bubbles_known_answer() -> None:
    records = two_stage_pipeline()
    gaps = stage_gaps(records, run_start=0.0)
    assert [(g.stage, g.mb, g.seconds) for g in gaps] == [(0, 0, 0), (0, 1, 0), (0, 2, 2), (1, 0, 2), (1, 1, 0),
                                                         (1, 2, 1)]
    # A: s0 mb0 0 + s0 mb2 2 + s1 mb0 2 + s1 mb2 1 = 5; B: 0 + 0 = 0
    assert request_bubbles(records, gaps) == {"A": 5.0, "B": 0.0}
    assert bubble_fraction_per_stage(records, gaps, 0.0) == pytest.approx([2 / 7, 3 / 7])


def test_classify_pipeline_bubbles() -> None:
    pre8, pre4 = rec(1, 0, 0, 1, (), p=8), rec(1, 1, 0, 1, (), p=4)
    dec9, dec12 = rec(1, 2, 0, 1, (), d=1, kv=9), rec(1, 3, 0, 1, (), d=1, kv=12)
    assert classify(pre8, pre4) == "PB1"
    assert classify(dec9, pre4) == "PB2"
    assert classify(dec9, dec12) == "PB3"
    assert classify(dec9, dec9) == "other"
    assert classify(None, pre8) == "other"
    assert classify(rec(0, 0, 0, 1, (), d=1), rec(0, 1, 0, 1, (), p=3)) == "other"  # stage 0: driver waits


def test_clock_offset_estimate_and_correction() -> None:
    clock = {"t": 100.0}

    def driver() -> float:
        clock["t"] += 0.001
        return clock["t"]

    def worker() -> float:  # 3.5 s ahead of the driver, read mid-way through the round trip
        clock["t"] += 0.001
        return clock["t"] + 3.5
    assert estimate_offset(driver, worker) == pytest.approx(3.5, abs=1e-9)
    plan = SimpleNamespace(request_ids=("A",), prefill_tokens=3, decode_tokens=0, kv_tokens=3)
    raw = [[(0, 10.0, 10.5, 11.0)], [(0, 14.5, 15.0, 15.5)]]
    records = build_records(raw, [0.0, 3.5], [(0, 0), (1, 0)], {0: plan}, {0: 0})
    assert [(r.stage, r.t_start, r.t_end) for r in records] == [(0, 10.5, 11.0), (1, 11.5, 12.0)]


def req(rid: str, arrival: float, times: list[float], n_prompt: int, cached: int = 0, index: int = 0,
        reason: str = "length") -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, arrival_time=arrival, first_token_time=times[0] if times else None,
                           token_times=times, prompt_token_ids=[1] * n_prompt, output_token_ids=[2] * len(times),
                           finish_reason=reason, num_cached_tokens=cached, index=index)


def test_summary_has_every_design_field() -> None:
    reqs = [req("A", 0.0, [2.0, 6.0, 7.0], 8), req("B", 0.0, [3.0, 5.0], 4, cached=3)]
    s = summarize(two_stage_pipeline(), 0.0, 7.0, reqs, {"scheduler": "sarathi", "pp": 2, "tp": 1,
                                                         "chunk_size": 8, "max_batch_size": 4})
    assert all(k in s for k in SUMMARY_FIELDS)
    assert s["prefill_tokens"] == 12 and s["decode_tokens"] == 5 and s["wall_s"] == 7.0
    assert s["throughput_tok_s"] == pytest.approx(17 / 7)
    assert s["prefix_cache_hit_tokens"] == 3 and s["prefix_cache_hit_rate"] == pytest.approx(3 / 12)
    assert s["bubble_s_per_request_p50"] == pytest.approx(2.5)
    assert s["ttft_s_p50"] == pytest.approx(2.5)
    assert s["tbt_s_p50"] == pytest.approx(2.0)  # gaps 4, 1, 2
    assert s["microbatch_time_cv"] == pytest.approx(cv([2, 1, 1, 2, 1, 1]))
    json.dumps(s)


def test_a_request_of_n_samples_counts_once() -> None:
    """SamplingParams.n: A's two samples share micro-batches; A is one request (its prompt once, its
    first token the earlier sample's, its bubble each shared micro-batch's gap once), while tokens
    and token gaps are each sample's. C failed with both its samples."""
    records = [rec(0, 0, 0, 2, ("A", "A"), p=10, kv=10), rec(0, 1, 2, 3, ("B",), p=4, kv=4),
               rec(0, 2, 5, 6, ("A", "A", "B"), d=3, kv=12)]
    reqs = [req("A", 0.0, [2.0, 6.0], 8), req("A", 0.0, [3.0, 6.0], 8, cached=0, index=1),
            req("B", 0.0, [3.0, 6.0], 4), req("C", 0.0, [], 5, reason="error"),
            req("C", 0.0, [], 5, index=1, reason="error")]
    s = summarize(records, 0.0, 7.0, reqs, {})
    assert s["num_requests"] == 3 and s["num_errors"] == 1
    assert s["prefill_tokens"] == 8 + 4 and s["decode_tokens"] == 6
    assert request_bubbles(records, stage_gaps(records, 0.0)) == {"A": 2.0, "B": 2.0}
    assert s["bubble_s_per_request_p50"] == pytest.approx(2.0)
    assert s["ttft_s_p50"] == pytest.approx(2.5) and s["ttft_s_p99"] == pytest.approx(2.99)  # A 2, B 3
    assert s["tbt_s_p50"] == pytest.approx(3.0)  # 4, 3, 3
    assert chrome_trace(records, 0.0)["traceEvents"][-1]["args"]["requests"] == 2


def test_percentile_and_cv() -> None:
    assert percentile([], 50) == 0.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert cv([1, 1, 1]) == 0.0
    assert cv([1, 3]) == pytest.approx(0.5)


def test_chrome_trace_schema() -> None:
    trace = chrome_trace(two_stage_pipeline(), 0.0)
    events = json.loads(json.dumps(trace))["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == 7
    for e in slices:
        assert {"name", "ph", "ts", "dur", "pid", "tid", "args"} <= set(e) and e["dur"] >= 0
    assert slices[0]["name"] == "P8+D0" and slices[0]["ts"] == 0 and slices[0]["dur"] == 2e6
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    assert names == {(0, "stage 0"), (1, "stage 1")}
    assert {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"} == {(0, 0), (1, 0), (1, 1)}
