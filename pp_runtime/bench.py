"""`pp-runtime bench`: one workload under several schedulers, on the same warm workers.

    pp-runtime bench --config configs/runs/pp2_zipf.yaml --out runs/pp2
    # runs/pp2/<scheduler>/{stage_timings.jsonl, summary.json, trace.json, results.jsonl, workers.json}
    # runs/pp2/comparison.json: every scheduler's metrics and their ratios to sarathi

Only the driver-side policy changes between schedulers (``LLM.reconfigure``): weights, KV
pool and placement are identical, so the comparison isolates scheduling. The KV pool is written
once at start-up and a short request runs first, so the first scheduler does not run cold.
With ``step_costs: fit`` (or ``--step-costs fit``) the costs are measured once at start-up
(pp_runtime.calibration) and every scheduler runs with them; only sarathi's FLOPs budget uses them.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from pp_runtime.calibration import format_costs
from pp_runtime.llm import LLM
from pp_runtime.request import SamplingParams
from pp_runtime.run_config import RunConfig
from pp_runtime.rundir import write_run_dir
from pp_runtime.workload import generate_workload
from pp_runtime.workload_config import workload_summary

# (summary key, label, True when higher is better)
METRICS = (("throughput_tok_s", "throughput tok/s", True), ("decode_tok_s", "decode tok/s", True),
           ("bubble_s_per_request_p50", "bubble/req p50 s", False),
           ("bubble_s_per_request_p90", "bubble/req p90 s", False),
           ("ttft_s_p50", "TTFT p50 s", False), ("ttft_s_p99", "TTFT p99 s", False),
           ("tbt_s_p50", "TBT p50 s", False), ("tbt_s_p99", "TBT p99 s", False),
           ("microbatch_time_cv", "micro-batch CV", False))


def run_bench(cfg: RunConfig, out: str, progress: bool = True, verbose: bool = True) -> dict:
    """Run every scheduler of ``cfg``; returns comparison.json's content."""
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    summaries: dict[str, dict] = {}
    # Every KV page written before the first scheduler runs: otherwise the first one pays for the
    # OS faulting the cache in (CacheConfig.prefault) and the comparison leans against it.
    with LLM(**cfg.engine, scheduler=cfg.schedulers[0], verbose=verbose, prefault_kv=True) as llm:
        items = generate_workload(cfg.workload, llm.source.config.vocab_size)
        _warm_up(llm)
        for policy in cfg.schedulers:
            llm.reconfigure(policy=policy)
            llm.reset_prefix_cache()  # each scheduler starts without the last one's prefixes
            if verbose:
                print(f"bench: {policy} on {len(items)} requests", file=sys.stderr)
            reqs = [llm.make_request(it.request_id, it.prompt_token_ids, cfg.workload.sampling_params(it.max_tokens))
                    for it in items]
            llm.run(reqs, progress=progress, arrivals=[it.arrival_s for it in items])
            summaries[policy] = write_run_dir(str(root / policy), llm,
                                              extra={"workload": workload_summary(cfg.workload)})
    comparison = compare(summaries)
    # measured (step_costs: fit) or given: what sarathi's pipeline micro-batches were sized by
    comparison["step_costs"] = list(llm.sched_config.step_costs)
    (root / "comparison.json").write_text(json.dumps(comparison, indent=1))
    return comparison


def _warm_up(llm: LLM) -> None:
    """One short request first, so no scheduler pays for lazy initialisation."""
    llm.run([llm.make_request("warmup", [3, 4, 5, 6], SamplingParams(max_tokens=2))])


def compare(summaries: dict[str, dict], base: str = "sarathi") -> dict:
    """Each scheduler's metrics, and each metric as a ratio to ``base`` (other / base)."""
    ref = summaries.get(base) or next(iter(summaries.values()))
    out: dict = {"base": base if base in summaries else next(iter(summaries)), "schedulers": {}}
    for name, s in summaries.items():
        row = {}
        for key, _, _ in METRICS:
            row[key] = s[key]
            row[f"{key}_ratio"] = s[key] / ref[key] if ref[key] else None
        out["schedulers"][name] = row
    return out


def format_table(comparison: dict) -> str:
    """Metrics down, schedulers across: 'value (× base)'."""
    names = list(comparison["schedulers"])
    width = max(22, *(len(n) + 2 for n in names))
    lines = [f"{'metric':18s}" + "".join(f"{n:>{width}s}" for n in names)]
    for key, label, _ in METRICS:
        cells = []
        for n in names:
            row = comparison["schedulers"][n]
            ratio = row[f"{key}_ratio"]
            cells.append(f"{row[key]:>{width - 10}.4g} ({'n/a' if ratio is None else f'{ratio:.2f}x'})")
        lines.append(f"{label:18s}" + "".join(f"{c:>{width}s}" for c in cells))
    lines.append(f"(ratios: scheduler / {comparison['base']})")
    if comparison.get("step_costs"):  # what sarathi's pipeline micro-batches were sized by
        lines.append("step costs (prompt key, decode row, decode key): " + format_costs(comparison["step_costs"]))
    return "\n".join(lines)
