"""Writing a run directory (DESIGN.md §3.4) from a finished ``LLM.run``.

    llm.run(reqs)
    summary = write_run_dir("runs/x", llm, extra={"workload": {...}})

stage_timings.jsonl, summary.json, trace.json, results.jsonl and workers.json; the report's
PNGs are added by the commands (launch/commands.py: write_plots) or ``pp-runtime report``.
"""
from __future__ import annotations

import json
from pathlib import Path

from pp_runtime.parallel_sampling import group_outputs
from pp_runtime.timing import TimingRecord, build_records, chrome_trace, summarize

WORKER_FIELDS = ("stage", "tp_rank", "pid", "node", "device", "hostname", "layers", "weight_bytes",
                 "layer_weight_bytes", "attention", "kv_dtype", "bf16_linears", "int8_linears",
                 "bf16_attention", "fused_elementwise", "cuda_graphs")


def collect_records(llm: object) -> list[TimingRecord]:
    """The last run's worker timings, moved onto the driver's clock."""
    run = llm.last_run
    ex = llm.executor
    raw, offsets, ranks = ex.drain_timings(), ex.clock_offsets(), ex.ranks()
    plans = {mb.mb_id: mb for mb in run.engine.history}
    return build_records(raw, offsets, ranks, plans, run.engine.mb_iter)


def run_settings(llm: object, run: object) -> dict:
    c = llm.config
    s = run.engine.scheduler.cfg  # the scheduling the run ran under (reconfigure may have changed llm.config since)
    return {"scheduler": s.policy, "pp": c.parallel.pp, "tp": c.parallel.tp,
            "chunk_size": s.chunk_size, "max_batch_size": s.max_batch_size,
            "tile_align": s.tile_align, "chunk_budget": s.chunk_budget,
            "admission": s.admission, "kv_admission": s.kv_admission, "step_costs": list(s.step_costs),
            "model": c.model_path,
            "dtype": c.device.dtype,
            "device": c.device.device, "launcher": llm.launcher, "paper_B": llm.memory.max_batch_b,
            "kv_blocks": llm.memory.num_blocks, "kv_cache_dtype": c.cache.kv_dtype,
            "enable_prefix_caching": c.cache.enable_prefix_caching, "cuda_graphs": c.device.cuda_graphs,
            "matmul_precision": c.device.matmul_precision,
            "partition": list(c.parallel.partition) if c.parallel.partition else None}


def write_run_dir(path: str, llm: object, extra: dict | None = None) -> dict:
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    run = llm.last_run
    records = collect_records(llm)
    st = run.engine.stats
    settings = run_settings(llm, run) | {"run_start": run.start_wall,
                                         "driver_s_per_microbatch": st.driver_s / max(st.steps, 1),
                                         "preemptions": sum(r.num_preemptions for r in run.requests)} | (extra or {})
    summary = summarize(records, run.start_wall, run.end_wall, run.requests, settings)
    _jsonl(out / "stage_timings.jsonl", [r.to_json() for r in records])
    _jsonl(out / "results.jsonl", [o.to_json() for o in group_outputs(run.requests)])
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "trace.json").write_text(json.dumps(chrome_trace(records, run.start_wall)))
    (out / "workers.json").write_text(json.dumps(
        [{k: w[k] for k in WORKER_FIELDS if k in w} for w in llm.workers_info()], indent=1))
    return summary


def _jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
