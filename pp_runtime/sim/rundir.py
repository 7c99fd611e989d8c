"""Run directories of simulated runs, in the format ``bench`` writes (DESIGN.md §3.4):
stage_timings.jsonl, summary.json, trace.json, results.jsonl, workers.json.

Records come from each replica's SimExecutor exactly as pp_runtime.rundir builds them from real
workers (pp_runtime.timing.TimingRecord, summarize, chrome_trace, RequestOutput). With R
replicas the pipelines are numbered one after the other: record ``stage`` = replica·pp + stage,
``mb`` = mb_id·R + replica (unique over the run); every line also carries ``replica``.

Large runs: TP ranks run in lock-step, so bubble accounting reads TP rank 0 only (as it does for
real runs). ``tp_ranks="first"`` writes only rank 0's lines (the summary says so);
``trace_max_microbatches`` keeps trace.json to the first N micro-batches.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from pp_runtime.outputs import RequestOutput
from pp_runtime.sim.simulator import SimResult
from pp_runtime.timing import TimingRecord, chrome_trace, percentile, summarize

CDF_POINTS = tuple(range(0, 101, 5))


def sim_records(result: SimResult) -> list[TimingRecord]:
    """TP rank 0 records of every replica, sorted by (stage, t_start)."""
    reps = result.replicas
    R = len(reps)
    out: list[TimingRecord] = []
    for rep in reps:
        ex, iters = rep.executor, rep.engine.mb_iter
        raw = ex.drain_timings()
        for s in range(ex.pp):
            stage = rep.index * ex.pp + s
            for mb, t_ready, t_start, t_end in raw[s * ex.tp]:
                p = ex.plans[mb]
                out.append(TimingRecord(stage, 0, mb * R + rep.index, iters.get(mb, mb), p.request_ids,
                                        p.prefill_tokens, p.decode_tokens, p.kv_tokens, t_ready, t_start, t_end))
    out.sort(key=lambda r: (r.stage, r.t_start))
    return out


def _request_bubbles(records: list[TimingRecord], run_start: float) -> dict[str, float]:
    """pp_runtime.timing.request_bubbles(records, stage_gaps(records, run_start)) for records of
    TP rank 0 sorted by (stage, t_start), summed per micro-batch first (pp times fewer updates)."""
    per_mb: dict[int, float] = {}
    ids: dict[int, tuple[str, ...]] = {}
    prev_stage, prev_end = None, run_start
    for r in records:
        if r.stage != prev_stage:
            prev_stage, prev_end = r.stage, run_start
        gap = r.t_start - prev_end
        per_mb[r.mb] = per_mb.get(r.mb, 0.0) + (gap if gap > 0 else 0.0)
        ids[r.mb] = r.request_ids
        prev_end = r.t_end
    out: dict[str, float] = {}
    for mb, seconds in per_mb.items():
        for rid in ids[mb]:
            out[rid] = out.get(rid, 0.0) + seconds
    return out


def _write_timings(path: Path, records: list[TimingRecord], tp: int, pp: int, R: int) -> None:
    ids_json: dict[int, str] = {}  # the same request list appears on every stage: encode it once
    with open(path, "w") as f:
        i = 0
        while i < len(records):
            j = i
            while j < len(records) and records[j].stage == records[i].stage:
                j += 1
            for rank in range(tp):
                for r in records[i:j]:
                    ids = ids_json.get(r.mb)
                    if ids is None:
                        ids = ids_json[r.mb] = json.dumps(list(r.request_ids))
                    f.write(f'{{"stage": {r.stage}, "tp_rank": {rank}, "mb": {r.mb}, "iter": {r.iter}, '
                            f'"request_ids": {ids}, "prefill_tokens": {r.prefill_tokens}, '
                            f'"decode_tokens": {r.decode_tokens}, "kv_tokens": {r.kv_tokens}, '
                            f'"t_ready": {r.t_ready!r}, "t_start": {r.t_start!r}, "t_end": {r.t_end!r}, '
                            f'"replica": {r.mb % R}}}\n')
            i = j


def _trace_records(records: list[TimingRecord], limit: int | None, tp: int) -> tuple[list[TimingRecord], bool]:
    """Records for trace.json: the first ``limit`` micro-batches to start (all when None), every
    TP rank's copy when ``tp`` > 1."""
    keep, truncated = records, False
    if limit is not None:
        first: dict[int, float] = {}
        for r in records:
            if r.mb not in first or r.t_start < first[r.mb]:
                first[r.mb] = r.t_start
        if len(first) > limit:
            ids = set(sorted(first, key=lambda mb: (first[mb], mb))[:limit])
            keep, truncated = [r for r in records if r.mb in ids], True
    if tp > 1:
        keep = [x for r in keep for x in [r] + [replace(r, tp_rank=k) for k in range(1, tp)]]
    return keep, truncated


def write_sim_run_dir(path: str | Path, result: SimResult, settings: dict, workers: list[dict],
                      tp_ranks: str = "all", trace_max_microbatches: int | None = None) -> dict:
    """Write the run directory; returns summary.json's content."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    reps = result.replicas
    pp, tp, R = reps[0].executor.pp, reps[0].executor.tp, len(reps)
    records = sim_records(result)
    reqs = result.requests
    settings = dict(settings, run_start=result.start, timings_tp_ranks=tp_ranks,
                    preemptions=sum(r.num_preemptions for r in reqs))
    summary = summarize(records, result.start, result.end, reqs, settings)
    bubbles = _request_bubbles(records, result.start)
    done = [r for r in reqs if r.finish_reason not in ("error", None)]
    per_req = [bubbles.get(r.request_id, 0.0) for r in done]
    summary["bubble_s_per_request_mean"] = sum(per_req) / len(per_req) if per_req else 0.0
    summary["bubble_s_per_request_cdf"] = [[q, percentile(per_req, q)] for q in CDF_POINTS]
    finish = sorted(r.finish_time - result.start for r in done)
    n = len(finish)
    summary["completion_s"] = {"p50": percentile(finish, 50), "p90": percentile(finish, 90),
                               "all": finish[-1] if finish else 0.0}
    # time to complete N requests: (N, seconds) at every 5% of the requests
    summary["completion_curve"] = [[k, finish[k - 1]] for k in sorted({max(1, round(n * q / 100)) for q in CDF_POINTS[1:]})
                                   ] if n else []
    summary["stage_busy_fraction"] = [b / max(result.end - result.start, 1e-12)
                                      for rep in reps for b in rep.executor.busy_s]
    _write_timings(out / "stage_timings.jsonl", records, tp if tp_ranks == "all" else 1, pp, R)
    trace_recs, truncated = _trace_records(records, trace_max_microbatches, tp if tp_ranks == "all" else 1)
    trace = chrome_trace(trace_recs, result.start)
    if truncated:
        trace["otherData"] = {"truncated": f"first {trace_max_microbatches} micro-batches of {summary['num_microbatches']}"}
    summary["trace_microbatches"] = len({r.mb for r in trace_recs})
    (out / "trace.json").write_text(json.dumps(trace))
    with open(out / "results.jsonl", "w") as f:
        for r in reqs:
            f.write(json.dumps(RequestOutput.from_request(r).to_json()) + "\n")
    (out / "workers.json").write_text(json.dumps(workers, indent=1))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
