"""Simulation configs (configs/sim/*.yaml): one model, one hardware, one workload, several scenarios.

    name: fig12                    # names the summary file: OUT/fig12.md
    description: ...
    model: gpt3-175b               # preset of configs/sim/models.yaml, or a mapping (preset: + overrides)
    hardware: a100-80gb            # preset of configs/sim/hardware.yaml, or a mapping
    dtype: bfloat16
    cluster: {nodes: 8, gpus_per_node: 8}          # gpus_per_node defaults to the hardware's
    memory: {utilization: 0.9, reserve_gb: 0, block_size: 16}
    max_model_len: 4096
    cost_model: roofline           # or {kind: profile, csv: runs/profile/profile.csv, profiled_layers: 30}
                                   # (csv may list several profiles, e.g. at two contexts: one fit)
                                   # or {kind: profile, stages: [stage-0 csv(s), stage-1 csv(s), ...]}
                                   # (`pp-runtime profile --pp N`: each stage profiled in the deployment)
                                   # any kind may add jitter: σ (log-sd of each step's time, e.g. 0.08;
                                   # or one per stage: an in-deployment profile.json's
                                   # jitter.independent), or for profiles jitter: profile (the CSVs'
                                   # round-to-round sd: it includes the box's slow drift, so it is an
                                   # upper bound that overstates bubbles; validate_sim takes the former)
    seed: 0
    workload: {kind: zipf, num_requests: 10000, ...}      # pp_runtime.workload_config.WorkloadConfig
    scenarios:
      - {name: orca_pp8, scheduler: orca, tp: 8, pp: 8}
      - {name: sarathi_pp8, scheduler: sarathi, tp: 8, pp: 8, chunk_size: 256}
      - {name: orca_tp8_x8, scheduler: orca, tp: 8, replicas: 8, router: round_robin}
    base: sarathi_pp8              # ratios in comparison.json are other / base
    claims:                        # optional: ratios to put next to the paper's
      - {name: ..., metric: wall_s, numerator: orca_pp8, denominator: sarathi_pp8, paper: 1.91}
    output: {timings_tp_ranks: all, trace_max_microbatches: null}
    notes: [free text copied into the summary]

Scenario keys: name, scheduler (sarathi|orca|prefill_first|request_level), tp, pp, replicas,
router (round_robin|least_loaded), chunk_size, max_batch_size (an integer, ``auto`` = the memory
model's B, or ``auto_per_microbatch`` = ⌊B/pp⌋, the paper's per-micro-batch figure; the
runtime's own default is 64), tile_align, chunk_budget (flops|tokens, as the runtime's),
admission (fcfs|longest_first, as the runtime's), step_costs (3 numbers, or ``fit``: fitted to a calibration run of the scenario's own
simulated steps, as ``--step-costs fit``; pp_runtime.sim.run), kv_admission (optimistic, the default and
the paper's: B full-length requests may run; or reserve, as the runtime's ``--kv-admission reserve``:
max_running then defaults to max_batch_size × pp, as the runtime runs either, and the requests' own
lengths decide), enable_prefix_caching (false by
default, as the paper; true: the real block manager keeps prefixes, and synthetic prompts get ids of their own
past the workload's shared_prefix), partition (layers per stage), dispatch_us (driver work and plan delivery per
micro-batch), return_us (sampled tokens back to the driver), prep_us (each worker's own cost of
taking a plan: task start, unpacking, attention metadata; one number or one per stage;
``pp-runtime profile --pp N`` measures it), max_running (how many sequences may
run at once; default max(max_batch_size, the memory model's B); the real ``LLM`` runs
max_batch_size × pp, which a scenario mimicking a real run sets here).
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any, Mapping

from pp_runtime.config import DTYPE_BYTES
from pp_runtime.configs_dir import find_config
from pp_runtime.run_config import read_yaml_mapping, workload_section
from pp_runtime.sim.presets import resolve_hardware, resolve_model
from pp_runtime.sim.scenario import Scenario, SimConfig, checked_int, checked_number
from pp_runtime.workload_config import WorkloadConfig

TOP_KEYS = ("name", "description", "model", "hardware", "dtype", "cluster", "memory", "max_model_len",
            "cost_model", "seed", "workload", "scenarios", "base", "claims", "output", "notes")
CLAIM_KEYS = ("name", "metric", "numerator", "denominator", "paper")


def _keys(where: str, data: Mapping, known: tuple[str, ...] | set[str]) -> None:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a mapping, got {data!r}")
    for key in data:
        if key not in known:
            raise ValueError(f"unknown key {where}.{key} (known: {', '.join(sorted(known))})")


def _cost_model(spec: object, where: Path) -> dict:
    if isinstance(spec, str):
        spec = {"kind": spec}
    _keys("cost_model", spec, ("kind", "csv", "profiled_layers", "stages", "jitter"))
    kind = spec.get("kind", "roofline")
    jitter = _jitter(spec.get("jitter", 0.0), kind)
    if kind == "roofline":
        if set(spec) - {"kind", "jitter"}:
            raise ValueError("cost_model: csv/profiled_layers/stages apply to kind 'profile' only")
        return {"kind": "roofline", "jitter": jitter}
    if kind != "profile":
        raise ValueError(f"cost_model.kind must be roofline or profile, got {kind!r}")
    if spec.get("stages") is not None:
        return {**_stage_profiles(spec, where), "jitter": jitter}
    csv = spec.get("csv")
    paths = csv if isinstance(csv, list) else [csv]
    if not paths or not all(isinstance(c, str) and c for c in paths):
        raise ValueError("cost_model.csv (a profile.csv from `pp-runtime profile`, or a list of them fitted "
                         "together) or cost_model.stages is required for kind 'profile'")
    found = _csv_files("cost_model.csv", paths, where)
    out = {"kind": "profile", "csv": found[0] if len(found) == 1 else found, "jitter": jitter}
    if spec.get("profiled_layers") is not None:
        out["profiled_layers"] = checked_int("cost_model.profiled_layers", spec["profiled_layers"])
    return out


def _jitter(value: object, kind: str) -> float | tuple[float, ...] | str:
    """σ of each simulated step's log-normal noise: a number in [0, 1), one per stage, or
    ``profile`` (each stage's pooled total_log_sd — drift between rounds included, an upper bound)."""
    if value == "profile":
        if kind != "profile":
            raise ValueError("cost_model.jitter: profile needs kind 'profile' (σ comes from the profile's rounds)")
        return value
    values = value if isinstance(value, list) else [value]
    if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1 for v in values):
        raise ValueError(f"cost_model.jitter must be a number in [0, 1), one per stage, or 'profile', got {value!r}")
    return tuple(float(v) for v in values) if isinstance(value, list) else float(value)


def _csv_files(field: str, paths: list, where: Path) -> list[str]:
    """Each path as given, or relative to the config file's folder; ValueError naming a missing one."""
    found = []
    for c in paths:
        p = Path(c)
        if not p.is_absolute() and (where.parent / p).is_file():
            p = where.parent / p
        if not p.is_file():
            raise ValueError(f"{field} {c!r} is not a file")
        found.append(str(p))
    return found


def _stage_profiles(spec: dict, where: Path) -> dict:
    """``stages``: one entry per pipeline stage, a profile.csv or a list of them, from an
    in-deployment profile (``pp-runtime profile --pp N``: OUT/stage-K/profile.csv)."""
    stages = spec["stages"]
    if spec.get("csv") is not None or spec.get("profiled_layers") is not None:
        raise ValueError("cost_model: give either stages (one profile per stage) or csv/profiled_layers")
    if not isinstance(stages, list) or not stages:
        raise ValueError(f"cost_model.stages must list one profile.csv (or a list of them) per stage, got {stages!r}")
    out = []
    for s, entry in enumerate(stages):
        paths = entry if isinstance(entry, list) else [entry]
        if not paths or not all(isinstance(c, str) and c for c in paths):
            raise ValueError(f"cost_model.stages[{s}] must be a profile.csv path or a list of them, got {entry!r}")
        out.append(_csv_files(f"cost_model.stages[{s}]", paths, where))
    return {"kind": "profile", "stages": out}


def _claims(data: object, names: set[str]) -> tuple[dict, ...]:
    if data is None:
        return ()
    if not isinstance(data, list):
        raise ValueError(f"claims must be a list, got {data!r}")
    out = []
    for i, c in enumerate(data):
        _keys(f"claims[{i}]", c, CLAIM_KEYS)
        for k in ("name", "metric", "numerator", "denominator"):
            if not isinstance(c.get(k), str):
                raise ValueError(f"claims[{i}].{k} must be a string, got {c.get(k)!r}")
        for k in ("numerator", "denominator"):
            if c[k] not in names:
                raise ValueError(f"claims[{i}].{k} names no scenario: {c[k]!r} (scenarios: {', '.join(sorted(names))})")
        if c.get("paper") is not None:
            checked_number(f"claims[{i}].paper", c["paper"])
        out.append(dict(c))
    return tuple(out)


def parse_sim_config(data: Mapping[str, Any], path: str | Path = "<config>") -> SimConfig:
    path = Path(path)
    _keys("sim config", data, TOP_KEYS)
    for k in ("model", "hardware", "workload", "scenarios"):
        if k not in data:
            raise ValueError(f"sim config: {k} is required")
    model, hw = resolve_model(data["model"]), resolve_hardware(data["hardware"])
    dtype = data.get("dtype", "bfloat16")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    cluster = data.get("cluster") or {}
    _keys("cluster", cluster, ("nodes", "gpus_per_node"))
    gpn = checked_int("cluster.gpus_per_node", cluster.get("gpus_per_node", hw.gpus_per_node))
    nodes = None if cluster.get("nodes") is None else checked_int("cluster.nodes", cluster["nodes"])
    mem = data.get("memory") or {}
    _keys("memory", mem, ("utilization", "reserve_gb", "block_size"))
    util = checked_number("memory.utilization", mem.get("utilization", 0.9))
    if not 0 < util <= 1:
        raise ValueError(f"memory.utilization must be in (0, 1], got {util}")
    max_len = checked_int("max_model_len", data.get("max_model_len", model.max_position_embeddings))
    if max_len > model.max_position_embeddings:
        raise ValueError(f"max_model_len={max_len} exceeds model {model.name}'s max_position_embeddings="
                         f"{model.max_position_embeddings}")
    workload = WorkloadConfig.from_dict(workload_section(data, path))
    if workload.max_total_len is not None and workload.max_total_len > max_len:
        raise ValueError(f"workload: requests up to {workload.max_total_len} tokens exceed max_model_len={max_len}")
    raw = data["scenarios"]
    if not isinstance(raw, list) or not raw:
        raise ValueError("scenarios must be a non-empty list")
    known = {f.name for f in fields(Scenario)}
    scenarios = []
    for i, s in enumerate(raw):
        _keys(f"scenarios[{i}]", s, known)
        if "name" not in s or "scheduler" not in s:
            raise ValueError(f"scenarios[{i}]: name and scheduler are required")
        sc = Scenario(**dict(s))
        model.check_parallel(sc.pp, sc.tp)
        if sc.tp > gpn or gpn % sc.tp:
            raise ValueError(f"scenario {sc.name!r}: tp={sc.tp} must divide gpus_per_node={gpn} (a stage's TP ranks share a node)")
        if nodes is not None and sc.gpus > nodes * gpn:
            raise ValueError(f"scenario {sc.name!r} needs {sc.gpus} GPUs, the cluster has {nodes} × {gpn}")
        scenarios.append(sc)
    names = [s.name for s in scenarios]
    if len(set(names)) != len(names):
        raise ValueError(f"scenario names must be unique, got {names}")
    base = data.get("base")
    if base is not None and base not in names:
        raise ValueError(f"base {base!r} names no scenario (scenarios: {', '.join(names)})")
    out = data.get("output") or {}
    _keys("output", out, ("timings_tp_ranks", "trace_max_microbatches"))
    ranks = out.get("timings_tp_ranks", "all")
    if ranks not in ("all", "first"):
        raise ValueError(f"output.timings_tp_ranks must be all or first, got {ranks!r}")
    trace_max = out.get("trace_max_microbatches")
    if trace_max is not None:
        checked_int("output.trace_max_microbatches", trace_max)
    notes = data.get("notes") or ()
    if isinstance(notes, str) or not all(isinstance(n, str) for n in notes):
        raise ValueError("notes must be a list of strings")
    name = data.get("name", path.stem)
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"name must be a non-empty string without '/', got {name!r}")
    return SimConfig(name=name, model=model, hardware=hw, workload=workload, scenarios=tuple(scenarios),
                     cost_model=_cost_model(data.get("cost_model", "roofline"), path), dtype=dtype, nodes=nodes,
                     gpus_per_node=gpn, memory_utilization=util,
                     memory_reserve_gb=checked_number("memory.reserve_gb", mem.get("reserve_gb", 0.0)),
                     block_size=checked_int("memory.block_size", mem.get("block_size", 16)), max_model_len=max_len,
                     seed=checked_int("seed", data.get("seed", 0), 0), base=base,
                     claims=_claims(data.get("claims"), set(names)),
                     timings_tp_ranks=ranks, trace_max_microbatches=trace_max,
                     description=str(data.get("description", "")), notes=tuple(notes), path=str(path))


def load_sim_config(path: str | Path) -> SimConfig:
    """Read and validate a configs/sim/*.yaml (a path, or a bare name looked up in configs/sim/);
    ValueError names the bad key or value."""
    path = find_config(path, "sim")
    data = read_yaml_mapping(path, "sim config")
    try:
        return parse_sim_config(data, path)
    except ValueError as exc:
        raise ValueError(f"sim config {path}: {exc}") from None

