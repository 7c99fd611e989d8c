"""``pp-runtime simulate``: every scenario of a configs/sim/*.yaml, one run directory each.

    from pp_runtime.sim import run_simulation
    comparison = run_simulation("configs/sim/fig12.yaml", "runs/fig12")
    # runs/fig12/<scenario>/{stage_timings.jsonl, summary.json, trace.json, results.jsonl, workers.json}
    # runs/fig12/comparison.json   every scenario's metrics, ratios to the base scenario, the claims
    # runs/fig12/fig12.md          the same as text, next to the paper's numbers

Every scenario runs the same requests (pp_runtime.workload lengths, dummy token ids) on its own
deployment (pp_runtime.sim.deployment: memory plan, real Scheduler with that SchedulerConfig, cost
model and GPU placement); pp_runtime.sim.comparison compares the finished scenarios.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from pp_runtime.calibration import SCHEDULING, calibration_workload, format_costs
from pp_runtime.cost_fit import fit_step_costs, samples_from_run
from pp_runtime.request import Request, SamplingParams
from pp_runtime.sim.comparison import comparison, format_report
from pp_runtime.sim.config import load_sim_config
from pp_runtime.sim.deployment import Deployment, cost_examples, make_cost_model, plan_deployment
from pp_runtime.sim.rundir import write_sim_run_dir
from pp_runtime.sim.scenario import Scenario, SimConfig
from pp_runtime.sim.simulator import DummyTokens, simulate
from pp_runtime.workload import MIN_TOKEN_ID, _arrivals, _rngs, _sample_totals, generate_workload, split_pd
from pp_runtime.workload_config import WorkloadConfig, workload_summary

DUMMY_TOKEN = MIN_TOKEN_ID


# ---- workload ----------------------------------------------------------------------------------
def workload_items(cfg: WorkloadConfig, vocab_size: int) -> list[tuple[str, object, int, float]]:
    """(request id, prompt, max_tokens, arrival_s) of ``cfg``: the lengths, ids and arrivals
    ``generate_workload`` gives (same seeded streams), with the prompt as its length only —
    10,000 prompts of a few thousand ids would cost gigabytes; ``make_requests`` gives them ids
    where prefix caching needs them (DummyTokens). A trace keeps its token ids."""
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


def make_requests(items: list[tuple[str, object, int, float]],
                  shared_prefix: int | None = None) -> tuple[list[Request], list[float]]:
    """Requests of ``items``; a synthetic prompt (a length) becomes DummyTokens, with ids of its own
    past ``shared_prefix`` (the workload's) when that is given: prefix caching keys blocks by ids."""
    def prompt(i: int, p: object) -> object:
        if not isinstance(p, int):
            return list(p)
        return DummyTokens(p, DUMMY_TOKEN) if shared_prefix is None else DummyTokens(p, DUMMY_TOKEN, i, shared_prefix)
    reqs = [Request(rid, i, prompt(i, p), SamplingParams(max_tokens=m, ignore_eos=True))
            for i, (rid, p, m, _) in enumerate(items)]
    return reqs, [a for *_, a in items]


# ---- one scenario --------------------------------------------------------------------------------
def timing_kwargs(cfg: SimConfig, dep: Deployment) -> dict:
    """simulate()'s seed, control-plane times, jitter and costs of the model for ``dep``'s scenario."""
    sc = dep.scenario
    return dict(seed=cfg.seed, dispatch_s=sc.dispatch_us * 1e-6, return_s=sc.return_us * 1e-6,
                prep_s=[us * 1e-6 for us in sc.prep_us] if isinstance(sc.prep_us, tuple) else sc.prep_us * 1e-6,
                jitter=dep.jitter, token_id=DUMMY_TOKEN, key_cost=cfg.model.key_cost)


def fit_step_costs_simulated(cfg: SimConfig, dep: Deployment) -> tuple[float, float, float] | None:
    """A scenario's ``step_costs: fit``: what ``--step-costs fit`` does on a real deployment
    (pp_runtime.calibration), on one simulated replica of this one: the calibration workload
    under sarathi with the FLOPs budget, then the same least-squares fit on its simulated steps."""
    sc = dep.scenario
    work = calibration_workload(cfg.max_model_len, sc.chunk_size, cfg.model.vocab_size, cfg.seed)
    reqs, _ = make_requests([(it.request_id, it.prompt_len, it.max_tokens, 0.0) for it in work])
    sched = replace(dep.sched_cfg, **SCHEDULING)
    res = simulate(reqs, None, sched, dep.memory.num_blocks, cfg.block_size, dep.costs[0], sc.pp, sc.tp,
                   keep_history=True, **timing_kwargs(cfg, dep))
    return fit_step_costs(samples_from_run(res.history, res.replicas[0].executor.drain_timings()))


def run_scenario(cfg: SimConfig, sc: Scenario, out_dir: str | Path, progress: bool = True,
                 items: list | None = None, cost_model: object | None = None) -> dict:
    """Simulate one scenario and write its run directory; returns its summary."""
    dep = plan_deployment(cfg, sc, cost_model)
    items = items if items is not None else workload_items(cfg.workload, cfg.model.vocab_size)
    reqs, arrivals = make_requests(items, (cfg.workload.shared_prefix or 0) if sc.enable_prefix_caching else None)
    if progress:
        print(f"simulate {sc.name}: {sc.scheduler}, tp={sc.tp} pp={sc.pp} × {sc.replicas} replica(s), "
              f"max_batch_size={dep.sched_cfg.max_batch_size}; {dep.memory.describe()}", file=sys.stderr)
    if sc.step_costs == "fit":
        costs = fit_step_costs_simulated(cfg, dep)
        dep = replace(dep, sched_cfg=replace(dep.sched_cfg, step_costs=costs or ()))
        if progress:
            print(f"simulate {sc.name}: step costs " + (format_costs(costs) if costs else "not fitted (the "
                  "calibration run could not separate them): the FLOPs budget alone"), file=sys.stderr)
    t0 = time.perf_counter()
    res = simulate(reqs, arrivals, dep.sched_cfg, dep.memory.num_blocks, cfg.block_size, dep.costs, sc.pp, sc.tp,
                   replicas=sc.replicas, router=sc.router, progress=progress, desc=sc.name,
                   workers=lambda r: dep.workers[r], prefix_caching=sc.enable_prefix_caching,
                   **timing_kwargs(cfg, dep))
    sim_s = time.perf_counter() - t0
    settings = {"scheduler": sc.scheduler, "pp": sc.pp, "tp": sc.tp, "chunk_size": sc.chunk_size,
                "max_batch_size": dep.sched_cfg.max_batch_size, "tile_align": sc.tile_align,
                "chunk_budget": sc.chunk_budget, "admission": sc.admission, "kv_admission": sc.kv_admission,
                "enable_prefix_caching": sc.enable_prefix_caching,
                "step_costs": list(dep.sched_cfg.step_costs), "model": cfg.model.name,
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
