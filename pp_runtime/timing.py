"""Stage timing records, clock alignment, bubble accounting and run summaries (DESIGN.md §3.4).

Bubble (the design's definition): on each stage, the idle gap before a micro-batch is its
t_start minus the t_end of the micro-batch that stage ran before it (for the first, minus the
run's start). A request's bubble time is the sum of those gaps over every stage for every
micro-batch it was in. TP ranks of a stage run in lock-step, so stage-level and request-level
figures use TP rank 0; every rank's records are still written.

Gaps on stages after the first are classified as the paper's pipeline bubbles where the
cause is visible in the two micro-batches around the gap:
  PB1  both carry prefill, of different sizes (prompts of different lengths);
  PB2  a prefill micro-batch follows a decode-only one;
  PB3  both are decode-only, with different KV lengths.
Anything else (stage 0's waits on the driver, equal neighbours) is "other".
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

from pp_runtime.parallel_sampling import requests_of


@dataclass(frozen=True)
class TimingRecord:
    stage: int
    tp_rank: int
    mb: int
    iter: int
    request_ids: tuple[str, ...]
    prefill_tokens: int
    decode_tokens: int
    kv_tokens: int
    t_ready: float
    t_start: float
    t_end: float

    def to_json(self) -> dict:
        d = asdict(self)
        d["request_ids"] = list(self.request_ids)
        return d


# ---- clock alignment -------------------------------------------------------------------------
def estimate_offset(driver_clock: Callable[[], float], worker_clock: Callable[[], float], samples: int = 8) -> float:
    """Offset to subtract from a worker's timestamps to get the driver's clock.

    NTP-style: read the driver clock, the worker's, the driver's again; the sample with the
    shortest round trip bounds the error best, and its midpoint is taken as simultaneous.
    """
    best_rtt, best = float("inf"), 0.0
    for _ in range(samples):
        t0 = driver_clock()
        tw = worker_clock()
        t1 = driver_clock()
        if t1 - t0 < best_rtt:
            best_rtt, best = t1 - t0, tw - (t0 + t1) / 2
    return best


def build_records(raw: list[list[tuple]], offsets: list[float], ranks: list[tuple[int, int]],
                  plans: dict[int, object], iters: dict[int, int]) -> list[TimingRecord]:
    """Worker timings [(mb, t_ready, t_start, t_end)] per rank -> records on the driver's clock."""
    out = []
    for rows, off, (stage, tp_rank) in zip(raw, offsets, ranks):
        for mb, t_ready, t_start, t_end in rows:
            plan = plans[mb]
            out.append(TimingRecord(stage, tp_rank, mb, iters.get(mb, mb), tuple(plan.request_ids),
                                    plan.prefill_tokens, plan.decode_tokens, plan.kv_tokens,
                                    t_ready - off, t_start - off, t_end - off))
    return sorted(out, key=lambda r: (r.stage, r.tp_rank, r.t_start))


# ---- bubbles ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Gap:
    stage: int
    mb: int
    seconds: float
    cause: str  # PB1 | PB2 | PB3 | other


def classify(prev: TimingRecord | None, cur: TimingRecord) -> str:
    if prev is None or cur.stage == 0:
        return "other"
    p_pre, c_pre = prev.prefill_tokens > 0, cur.prefill_tokens > 0
    if p_pre and c_pre and prev.prefill_tokens != cur.prefill_tokens:
        return "PB1"
    if not p_pre and c_pre:
        return "PB2"
    if not p_pre and not c_pre and prev.kv_tokens != cur.kv_tokens:
        return "PB3"
    return "other"


def stage_gaps(records: Iterable[TimingRecord], run_start: float) -> list[Gap]:
    """One gap per micro-batch per stage (TP rank 0), in each stage's execution order."""
    by_stage: dict[int, list[TimingRecord]] = {}
    for r in records:
        if r.tp_rank == 0:
            by_stage.setdefault(r.stage, []).append(r)
    gaps = []
    for stage, rows in sorted(by_stage.items()):
        prev = None
        for r in sorted(rows, key=lambda x: x.t_start):
            idle = max(0.0, r.t_start - (prev.t_end if prev else run_start))
            gaps.append(Gap(stage, r.mb, idle, classify(prev, r)))
            prev = r
    return gaps


def request_bubbles(records: Iterable[TimingRecord], gaps: list[Gap]) -> dict[str, float]:
    """Request id -> sum of the gaps before every micro-batch (every stage) it was in."""
    gap_of = {(g.stage, g.mb): g.seconds for g in gaps}
    out: dict[str, float] = {}
    for r in records:
        if r.tp_rank == 0:
            for rid in dict.fromkeys(r.request_ids):  # a request's n samples share a micro-batch once
                out[rid] = out.get(rid, 0.0) + gap_of[(r.stage, r.mb)]
    return out


def bubble_fraction_per_stage(records: list[TimingRecord], gaps: list[Gap], run_start: float) -> list[float]:
    stages = sorted({r.stage for r in records})
    end = max((r.t_end for r in records), default=run_start)
    span = max(end - run_start, 1e-12)
    return [sum(g.seconds for g in gaps if g.stage == s) / span for s in stages]


# ---- summary ----------------------------------------------------------------------------------
def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); 0.0 for an empty list."""
    if not xs:
        return 0.0
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def cv(xs: list[float]) -> float:
    """Coefficient of variation: stdev / mean (0 for fewer than two values)."""
    if len(xs) < 2 or statistics.mean(xs) == 0:
        return 0.0
    return statistics.pstdev(xs) / statistics.mean(xs)


def summarize(records: list[TimingRecord], run_start: float, run_end: float, requests: list,
              settings: dict) -> dict:
    """summary.json: every field of DESIGN.md §3.4 plus bubble causes and counts. ``requests``:
    the run's sequences, a request's n samples after it (parallel_sampling.fan_out); counts, TTFT
    and bubbles are per request, its prompt counted once, tokens and token gaps per sample."""
    gaps = stage_gaps(records, run_start)
    bubbles = request_bubbles(records, gaps)
    ok = lambda r: r.finish_reason not in ("error", None)  # noqa: E731
    done = [r for r in requests if ok(r)]
    served = [g for g in requests_of(requests) if any(map(ok, g))]
    prefill = sum(len(g[0].prompt_token_ids) for g in served)
    decode = sum(len(r.output_token_ids) for r in done)
    cached = sum(r.num_cached_tokens for r in done)  # a sample's prompt found in the cache, of all its samples'
    looked = sum(len(r.prompt_token_ids) for r in done)
    wall = max(run_end - run_start, 1e-12)
    ttft = [min(starts) - g[0].arrival_time for g in served
            if (starts := [r.first_token_time for r in g if r.first_token_time is not None])]
    tbt = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:])]
    per_req = [bubbles.get(g[0].request_id, 0.0) for g in served]
    mb_times = [r.t_end - r.t_start for r in records if r.tp_rank == 0]
    causes: dict[str, float] = {}
    for g in gaps:
        causes[g.cause] = causes.get(g.cause, 0.0) + g.seconds
    return {**settings,
            "num_requests": sum(r.index == 0 for r in requests),
            "num_errors": sum(r.finish_reason == "error" for r in requests if r.index == 0),
            "num_microbatches": len({r.mb for r in records}),
            "prefill_tokens": prefill, "decode_tokens": decode, "wall_s": wall,
            "throughput_tok_s": (prefill + decode) / wall, "decode_tok_s": decode / wall,
            # prompt tokens found in the prefix cache (--enable-prefix-caching), not computed
            "prefix_cache_hit_tokens": cached, "prefix_cache_hit_rate": cached / looked if looked else 0.0,
            "bubble_s_per_request_p50": percentile(per_req, 50), "bubble_s_per_request_p90": percentile(per_req, 90),
            "bubble_fraction_per_stage": bubble_fraction_per_stage(records, gaps, run_start),
            "bubble_s_by_cause": causes,
            "ttft_s_p50": percentile(ttft, 50), "ttft_s_p99": percentile(ttft, 99),
            "tbt_s_p50": percentile(tbt, 50), "tbt_s_p99": percentile(tbt, 99),
            "microbatch_time_cv": cv(mb_times)}


# ---- Chrome / Perfetto trace ----------------------------------------------------------------------
def chrome_trace(records: list[TimingRecord], run_start: float) -> dict:
    """One process per stage, one thread per TP rank, one complete ("X") slice per micro-batch."""
    events: list[dict] = []
    for stage in sorted({r.stage for r in records}):
        events.append({"name": "process_name", "ph": "M", "pid": stage, "tid": 0, "args": {"name": f"stage {stage}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": stage, "tid": 0, "args": {"sort_index": stage}})
        for tp in sorted({r.tp_rank for r in records if r.stage == stage}):
            events.append({"name": "thread_name", "ph": "M", "pid": stage, "tid": tp, "args": {"name": f"tp {tp}"}})
    for r in records:
        label = f"P{r.prefill_tokens}+D{r.decode_tokens}"
        events.append({"name": label, "cat": "microbatch", "ph": "X", "pid": r.stage, "tid": r.tp_rank,
                       "ts": (r.t_start - run_start) * 1e6, "dur": (r.t_end - r.t_start) * 1e6,
                       "args": {"mb": r.mb, "iter": r.iter, "prefill_tokens": r.prefill_tokens,
                                "decode_tokens": r.decode_tokens, "kv_tokens": r.kv_tokens,
                                "wait_input_ms": (r.t_start - r.t_ready) * 1e3,
                                "requests": len(set(r.request_ids))}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
