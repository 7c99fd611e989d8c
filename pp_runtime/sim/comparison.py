"""comparison.json and the markdown report of a simulation's finished scenarios, with its claims.

    from pp_runtime.sim.comparison import comparison, format_report
    comp = comparison(cfg, {"sarathi": summary_a, "orca": summary_b})  # summaries from run_scenario
    text = format_report(cfg, comp)  # written as <name>.md next to comparison.json
"""
from __future__ import annotations

from pp_runtime.bench import compare
from pp_runtime.sim.scenario import SimConfig
from pp_runtime.workload_config import workload_summary


def claim_values(cfg: SimConfig, summaries: dict[str, dict]) -> list[dict]:
    out = []
    for c in cfg.claims:
        num, den = summaries[c["numerator"]].get(c["metric"]), summaries[c["denominator"]].get(c["metric"])
        value = num / den if isinstance(num, (int, float)) and isinstance(den, (int, float)) and den else None
        out.append({**c, "value": value, "numerator_value": num, "denominator_value": den})
    return out


SCENARIO_KEYS = ("scheduler", "pp", "tp", "replicas", "router", "gpus", "chunk_size", "max_batch_size",
                 "paper_B", "paper_B_per_microbatch", "kv_blocks", "num_requests", "num_microbatches", "wall_s",
                 "completion_s", "completion_curve", "bubble_s_per_request_p50", "bubble_s_per_request_p90",
                 "bubble_s_per_request_mean", "bubble_s_per_request_cdf", "bubble_fraction_per_stage",
                 "bubble_s_by_cause", "preemptions", "sim_simulate_s", "sim_scheduler_s",
                 "sim_scheduler_us_per_microbatch", "sim_write_s", "sim_total_s")


def comparison(cfg: SimConfig, summaries: dict[str, dict]) -> dict:
    """comparison.json: pp_runtime.bench.compare's table (keyed by scenario) plus the scenarios'
    deployments, completion times and the claims next to the paper's values."""
    base = cfg.base or next(iter(summaries))
    out = compare(summaries, base)
    out["name"] = cfg.name
    out["config"] = cfg.path
    out["scenarios"] = {n: {k: s.get(k) for k in SCENARIO_KEYS} for n, s in summaries.items()}
    out["claims"] = claim_values(cfg, summaries)
    out["setup"] = {"model": cfg.model.name, "hardware": cfg.hardware.name, "nodes": cfg.nodes,
                    "gpus_per_node": cfg.gpus_per_node, "dtype": cfg.dtype, "max_model_len": cfg.max_model_len,
                    "memory_utilization": cfg.memory_utilization, "workload": workload_summary(cfg.workload),
                    "cost_model": next(iter(summaries.values())).get("cost_model")}
    return out


def _f(x: object, digits: int = 3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def format_report(cfg: SimConfig, comp: dict) -> str:
    """The markdown summary written next to comparison.json."""
    sc = comp["scenarios"]
    st = comp["setup"]
    wl = st["workload"]
    lines = [f"# {cfg.name}: simulated", ""]
    if cfg.description:
        lines += [cfg.description.strip(), ""]
    lines += [f"- model: {cfg.model.name} ({cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}, "
              f"{cfg.model.num_heads} heads), {cfg.dtype}",
              f"- hardware: {cfg.hardware.name} ({cfg.hardware.description or 'custom'}); "
              f"{cfg.nodes or '?'} node{'' if cfg.nodes == 1 else 's'} × {cfg.gpus_per_node} GPUs; "
              f"memory utilization {cfg.memory_utilization}",
              f"- cost model: {st['cost_model'].get('kind') if st['cost_model'] else 'n/a'}",
              f"- workload: {wl['num_requests']} requests, {wl['kind']} lengths {wl.get('min_len')}–{wl.get('max_len')} "
              f"(θ = {wl.get('theta')}), P:D = {wl.get('pd_ratio')}, arrival {wl['arrival']}", ""]
    lines += ["## Scenarios", "",
              "| scenario | scheduler | TP×PP×replicas | B (per micro-batch) | max_batch_size | micro-batches | "
              "bubble/request p50 (s) | p90 (s) | time to 50% of requests (s) | time to all requests (s) | "
              "throughput (tok/s) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in sc.items():
        thr = comp["schedulers"][name]["throughput_tok_s"]
        lines.append(f"| {name} | {s['scheduler']} | {s['tp']}×{s['pp']}×{s['replicas']} | {s['paper_B']} "
                     f"({s['paper_B_per_microbatch']}) | {s['max_batch_size']} | {s['num_microbatches']} | "
                     f"{_f(s['bubble_s_per_request_p50'])} | {_f(s['bubble_s_per_request_p90'])} | "
                     f"{_f(s['completion_s']['p50'], 4)} | {_f(s['wall_s'], 4)} | {_f(thr, 4)} |")
    if comp["claims"]:
        lines += ["", "## Next to the paper", "", "| claim | simulated | paper |", "|---|---|---|"]
        for c in comp["claims"]:
            v = c["value"]
            lines.append(f"| {c['name']} ({c['metric']}: {c['numerator']} / {c['denominator']}) | "
                         f"{'n/a' if v is None else f'{v:.2f}×'} | {_f(c.get('paper'))}{'×' if c.get('paper') else ''} |")
    lines += ["", "## Simulator cost (this machine)", "",
              "| scenario | micro-batches | simulate (s) | of which real scheduler (s) | scheduler µs/micro-batch | "
              "writing files (s) |", "|---|---|---|---|---|---|"]
    for name, s in sc.items():
        lines.append(f"| {name} | {s['num_microbatches']} | {_f(s['sim_simulate_s'])} | {_f(s['sim_scheduler_s'])} | "
                     f"{_f(s['sim_scheduler_us_per_microbatch'])} | {_f(s['sim_write_s'])} |")
    if cfg.notes:
        lines += ["", "## Notes", ""] + [f"- {n.strip()}" for n in cfg.notes]
    lines += ["", "Run directories: " + ", ".join(f"`{n}/`" for n in sc) + " (pp-runtime report works on them); "
              "per-request bubble CDFs: `bubble_s_per_request_cdf` in each summary.json and in comparison.json.", ""]
    return "\n".join(lines)

