"""A scenario's deployment: memory plan, SchedulerConfig, cost model, jitter and GPU placement.

    from pp_runtime.sim.config import load_sim_config
    from pp_runtime.sim.deployment import plan_deployment
    cfg = load_sim_config("configs/sim/fig12.yaml")
    dep = plan_deployment(cfg, cfg.scenarios[0])
    dep.sched_cfg, dep.memory.num_blocks, dep.costs[0], dep.workers[0]

Memory plan (B and KV blocks, pp_runtime.sim.memory), cost model (pp_runtime.sim.stage_cost over
roofline_cost or profile_cost) and GPU placement (replica r, stage s, TP rank t → GPU r·pp·tp + s·tp + t,
nodes filled in order, so a PP send crosses nodes whenever the two stages sit on different nodes).
"""
from __future__ import annotations

from dataclasses import dataclass

from pp_runtime.config import SchedulerConfig
from pp_runtime.sim.batch_shape import BatchShape
from pp_runtime.sim.memory import SimMemoryPlan, plan_memory, stage_layers, weight_bytes_per_gpu
from pp_runtime.sim.profile_cost import ProfileCostModel, StageProfiles
from pp_runtime.sim.roofline_cost import RooflineCostModel
from pp_runtime.sim.scenario import Scenario, SimConfig
from pp_runtime.sim.stage_cost import PipelineCost


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
    # optimistic (the paper's setup): every request whose full-length K/V fits may run (B); one
    # micro-batch carries up to mbs. reserve: pp micro-batches of mbs (as the runtime runs under
    # either admission), admitted by the requests' own lengths.
    running = mbs * sc.pp if sc.kv_admission == "reserve" else max(mbs, mem.max_batch_b)
    sched = SchedulerConfig(sc.scheduler, sc.chunk_size, mbs, sc.tile_align, cfg.max_model_len,
                            max_running=sc.max_running or running, chunk_budget=sc.chunk_budget,
                            admission=sc.admission, step_costs=() if sc.step_costs == "fit" else sc.step_costs,
                            kv_admission=sc.kv_admission)
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
