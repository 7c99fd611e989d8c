"""``pp-runtime simulate``: every scenario of a configs/sim/*.yaml, one run directory each.

    from pp_runtime.sim import run_simulation
    comparison = run_simulation("configs/sim/fig12.yaml", "runs/fig12")
    # runs/fig12/<scenario>/{stage_timings.jsonl, summary.json, trace.json, results.jsonl, workers.json}
    # runs/fig12/comparison.json   every scenario's metrics, ratios to the base scenario, the claims
    # runs/fig12/fig12.md          the same as text, next to the paper's numbers

Every scenario runs the same requests (pp_runtime.workload lengths, dummy token ids) on its own
deployment: memory plan (B and KV blocks, pp_runtime.sim.memory), real Scheduler with that
SchedulerConfig, cost model (pp_runtime.sim.stage_cost over roofline_cost or profile_cost) and GPU
placement (replica r, stage s, TP rank t → GPU r·pp·tp + s·tp + t, nodes filled in order, so a PP
send crosses nodes whenever the two stages sit on different nodes).
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pp_runtime.bench import compare
from pp_runtime.config import SchedulerConfig
from pp_runtime.request import Request, SamplingParams
from pp_runtime.sim.batch_shape import BatchShape
from pp_runtime.sim.config import load_sim_config
from pp_runtime.sim.memory import SimMemoryPlan, plan_memory, stage_layers, weight_bytes_per_gpu
from pp_runtime.sim.profile_cost import ProfileCostModel, StageProfiles
from pp_runtime.sim.roofline_cost import RooflineCostModel
from pp_runtime.sim.rundir import write_sim_run_dir
from pp_runtime.sim.scenario import Scenario, SimConfig
from pp_runtime.sim.simulator import DummyTokens, simulate
from pp_runtime.sim.stage_cost import PipelineCost
from pp_runtime.workload import MIN_TOKEN_ID, _arrivals, _rngs, _sample_totals, generate_workload, split_pd
from pp_runtime.workload_config import WorkloadConfig, workload_summary

DUMMY_TOKEN = MIN_TOKEN_ID


# ---- workload ----------------------------------------------------------------------------------
def workload_items(cfg: WorkloadConfig, vocab_size: int) -> list[tuple[str, object, int, float]]:
    """(request id, prompt, max_tokens, arrival_s) of ``cfg``: the lengths, ids and arrivals
    ``generate_workload`` gives (same seeded streams), with the prompt as its length only —
    a synthetic prompt's token ids never matter to a simulation, and 10,000 prompts of a few
    thousand ids would cost gigabytes. A trace keeps its token ids."""
    if cfg.kind == "trace":
        return [(it.request_id, list(it.prompt_token_ids), it.max_tokens, it.arrival_s)
                for it in generate_workload(cfg, vocab_size)]
    len_rng, _, arr_rng = _rngs(cfg.seed)
    n = cfg.num_requests
    if cfg.kind == "fixed" and cfg.prompt_len is not None:
        prompts, decodes = [cfg.prompt_len] * n, [cfg.decode_len] * n
    else:
        prompts, decodes = split_pd(_sample_totals(cfg, len_rng), float(cfg.pd_ratio))
    width = len(str(n - 1))
    return [(f"req-{i:0{width}d}", int(prompts[i]), int(decodes[i]), float(a))
            for i, a in enumerate(_arrivals(cfg, n, arr_rng))]


def make_requests(items: list[tuple[str, object, int, float]]) -> tuple[list[Request], list[float]]:
    reqs = [Request(rid, i, DummyTokens(p, DUMMY_TOKEN) if isinstance(p, int) else list(p),
                    SamplingParams(max_tokens=m, ignore_eos=True))
            for i, (rid, p, m, _) in enumerate(items)]
    return reqs, [a for *_, a in items]


# ---- deployment ----------------------------------------------------------------------------------
def make_cost_model(cfg: SimConfig) -> object:
    if cfg.cost_model.get("stages"):
        return StageProfiles.from_csvs(cfg.cost_model["stages"])
    if cfg.cost_model["kind"] == "profile":
        return ProfileCostModel.from_csv(cfg.cost_model["csv"], cfg.cost_model.get("profiled_layers",
                                                                                   cfg.model.num_layers))
    return RooflineCostModel(cfg.model, cfg.hardware, cfg.dtype_bytes)


def deployment_jitter(cfg: SimConfig, cost_model: object, pp: int) -> list[float]:
    """σ of each stage's step-time noise: the config's number (or one per stage), or (``jitter:
    profile``) the pooled one its profile rows measured (one per stage for per-stage profiles)."""
    jitter = cfg.cost_model.get("jitter", 0.0)
    if isinstance(jitter, tuple):
        if len(jitter) != pp:
            raise ValueError(f"cost_model.jitter has {len(jitter)} values, the scenario has pp={pp}")
        return list(jitter)
    if jitter != "profile":
        return [float(jitter)] * pp
    fits = [c.fit for c in cost_model] if isinstance(cost_model, list) else [cost_model.fit] * pp
    if any(f.jitter is None for f in fits):
        raise ValueError("cost_model.jitter: profile needs profiles with a total_log_sd column "
                         "(rerun `pp-runtime profile`)")
    return [f.jitter for f in fits]


@dataclass
class Deployment:
    scenario: Scenario
    memory: SimMemoryPlan
    sched_cfg: SchedulerConfig
    costs: list[PipelineCost]  # one per replica (placement may differ)
    layers: list[int]
    workers: list[list[dict]]  # per replica
    jitter: list[float]  # per stage: σ of the log-normal noise on its step times


def plan_deployment(cfg: SimConfig, sc: Scenario, cost_model: object | None = None) -> Deployment:
    m, hw, gpn = cfg.model, cfg.hardware, cfg.gpus_per_node
    mem = plan_memory(m, hw, sc.pp, sc.tp, cfg.max_model_len, cfg.block_size, cfg.memory_utilization,
                      cfg.memory_reserve_gb, cfg.dtype_bytes, sc.partition)
    if sc.max_batch_size == "auto":
        mbs = mem.max_batch_b
    elif sc.max_batch_size == "auto_per_microbatch":
        mbs = mem.per_microbatch_b
    else:
        mbs = int(sc.max_batch_size)
    # Every request whose full-length K/V fits may run (B); one micro-batch carries up to mbs.
    sched = SchedulerConfig(sc.scheduler, sc.chunk_size, mbs, sc.tile_align, cfg.max_model_len,
                            max_running=sc.max_running or max(mbs, mem.max_batch_b))
    cost_model = cost_model or make_cost_model(cfg)
    layers = stage_layers(m.num_layers, sc.pp, sc.partition)
    weights = weight_bytes_per_gpu(m, layers, sc.tp, cfg.dtype_bytes)
    starts = [sum(layers[:s]) for s in range(sc.pp)]
    if isinstance(cost_model, StageProfiles):
        cost_model = cost_model.per_stage(layers)
    costs, workers = [], []
    for r in range(sc.replicas):
        def gpu(s: int, t: int) -> int:
            return (r * sc.pp + s) * sc.tp + t
        inter = [gpu(s, 0) // gpn != gpu(s + 1, 0) // gpn for s in range(sc.pp - 1)]
        costs.append(PipelineCost(cost_model, m, hw, sc.pp, sc.tp, layers, inter, cfg.dtype_bytes))
        workers.append([{"stage": r * sc.pp + s, "tp_rank": t, "pid": 0, "node": f"sim-node{gpu(s, t) // gpn}",
                         "device": f"sim:{hw.name}:{gpu(s, t) % gpn}", "hostname": f"sim-node{gpu(s, t) // gpn}",
                         "layers": [starts[s], starts[s] + layers[s]], "weight_bytes": int(weights[s]),
                         "replica": r, "replica_stage": s, "gpu": gpu(s, t), "simulated": True}
                        for s in range(sc.pp) for t in range(sc.tp)])
    return Deployment(sc, mem, sched, costs, layers, workers, deployment_jitter(cfg, cost_model, sc.pp))


def cost_examples(dep: Deployment, cfg: SimConfig) -> list[dict]:
    """Stage times of representative micro-batches of this deployment (for the summary): a
    SARATHI batch (chunk + decodes), the same decodes alone, and one whole mid-size prompt."""
    sc, pipe = dep.scenario, dep.costs[0]
    ctx = cfg.max_model_len // 2
    dec = max(1, dep.memory.per_microbatch_b - 1)
    chunk = sc.chunk_size
    shapes = {f"sarathi: chunk {chunk} at context {ctx} + {dec} decodes": BatchShape.build([(chunk, ctx)], [ctx] * dec),
              f"decode-only: {dec} decodes at context {ctx}": BatchShape.build([], [ctx] * dec),
              f"prefill-only: one whole prompt of {ctx} tokens": BatchShape.build([(ctx, 0)])}
    out = []
    for label, shape in shapes.items():
        compute, send = pipe.shape_times(shape)
        ops = pipe.breakdown(shape)
        row = {"batch": label, "stage_ms": [c * 1e3 for c in compute], "send_ms": [x * 1e3 for x in send],
               "per_layer_ms": {k: v * 1e3 for k, v in ops.items()}}
        if isinstance(pipe.cost, RooflineCostModel):
            row["linear_bound"] = pipe.cost.linear_bounds(shape, sc.tp)
        out.append(row)
    return out


# ---- one scenario --------------------------------------------------------------------------------
def run_scenario(cfg: SimConfig, sc: Scenario, out_dir: str | Path, progress: bool = True,
                 items: list | None = None, cost_model: object | None = None) -> dict:
    """Simulate one scenario and write its run directory; returns its summary."""
    dep = plan_deployment(cfg, sc, cost_model)
    items = items if items is not None else workload_items(cfg.workload, cfg.model.vocab_size)
    reqs, arrivals = make_requests(items)
    if progress:
        print(f"simulate {sc.name}: {sc.scheduler}, tp={sc.tp} pp={sc.pp} × {sc.replicas} replica(s), "
              f"max_batch_size={dep.sched_cfg.max_batch_size}; {dep.memory.describe()}", file=sys.stderr)
    t0 = time.perf_counter()
    res = simulate(reqs, arrivals, dep.sched_cfg, dep.memory.num_blocks, cfg.block_size, dep.costs, sc.pp, sc.tp,
                   replicas=sc.replicas, router=sc.router, seed=cfg.seed, progress=progress, desc=sc.name,
                   workers=lambda r: dep.workers[r], dispatch_s=sc.dispatch_us * 1e-6, return_s=sc.return_us * 1e-6,
                   prep_s=[us * 1e-6 for us in sc.prep_us] if isinstance(sc.prep_us, tuple) else sc.prep_us * 1e-6,
                   jitter=dep.jitter, token_id=DUMMY_TOKEN, key_cost=cfg.model.key_cost)
    sim_s = time.perf_counter() - t0
    settings = {"scheduler": sc.scheduler, "pp": sc.pp, "tp": sc.tp, "chunk_size": sc.chunk_size,
                "max_batch_size": dep.sched_cfg.max_batch_size, "tile_align": sc.tile_align, "model": cfg.model.name,
                "dtype": cfg.dtype, "device": f"sim:{cfg.hardware.name}", "launcher": "sim",
                "paper_B": dep.memory.max_batch_b, "paper_B_per_microbatch": dep.memory.per_microbatch_b,
                "kv_blocks": dep.memory.num_blocks, "driver_s_per_microbatch": sc.dispatch_us * 1e-6,
                "workload": workload_summary(cfg.workload), "simulated": True, "scenario": sc.name,
                "replicas": sc.replicas, "router": sc.router, "gpus": sc.gpus, "hardware": cfg.hardware.name,
                "cost_model": dep.costs[0].describe(), "memory_plan": dep.memory.to_json(),
                "layers_per_stage": dep.layers, "jitter_per_stage": dep.jitter,
                "max_model_len": cfg.max_model_len, "block_size": cfg.block_size,
                "sim_simulate_s": sim_s, "sim_microbatches": res.microbatches,
                "sim_scheduler_s": res.schedule_wall_s, "sim_postprocess_s": res.postprocess_wall_s,
                "sim_scheduler_us_per_microbatch": 1e6 * res.schedule_wall_s / max(res.microbatches, 1),
                "cost_examples": cost_examples(dep, cfg)}
    t1 = time.perf_counter()
    workers = [w for ws in dep.workers for w in ws]
    summary = write_sim_run_dir(Path(out_dir) / sc.name, res, settings, workers, cfg.timings_tp_ranks,
                                cfg.trace_max_microbatches)
    summary["sim_write_s"] = time.perf_counter() - t1
    summary["sim_total_s"] = time.perf_counter() - t0
    (Path(out_dir) / sc.name / "summary.json").write_text(json.dumps(summary, indent=1))
    if progress:
        print(f"simulate {sc.name}: {summary['wall_s']:.1f} simulated s, bubble/request p50 "
              f"{summary['bubble_s_per_request_p50']:.3g} s; {res.microbatches} micro-batches in {sim_s:.1f} s "
              f"(scheduler {res.schedule_wall_s:.1f} s), files {summary['sim_write_s']:.1f} s", file=sys.stderr)
    return summary


# ---- all scenarios -------------------------------------------------------------------------------
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


def run_simulation(config_path: str, out_dir: str, progress: bool = True) -> dict:
    """Run every scenario of ``config_path`` (configs/sim/*.yaml); write one run directory per
    scenario under ``out_dir``, comparison.json and ``<name>.md``. Returns comparison.json's content.
    Raises ValueError naming the problem for a bad config."""
    cfg = load_sim_config(config_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for sc in cfg.scenarios:  # validate every deployment (memory, placement) before the first long run
        plan_deployment(cfg, sc)
    cost_model = make_cost_model(cfg)
    items = workload_items(cfg.workload, cfg.model.vocab_size)
    summaries = {sc.name: run_scenario(cfg, sc, out, progress, items, cost_model) for sc in cfg.scenarios}
    comp = comparison(cfg, summaries)
    (out / "comparison.json").write_text(json.dumps(comp, indent=1))
    text = format_report(cfg, comp)
    (out / f"{cfg.name}.md").write_text(text)
    if progress:
        print(text, file=sys.stderr)
    return comp
