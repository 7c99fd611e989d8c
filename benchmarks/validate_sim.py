"""Does the simulator predict a real run? Profile → bench → simulate → compare (issue 6, item 5).

    .venv/bin/python benchmarks/validate_sim.py                  # embedded model, pp=2, ~8 min
    .venv/bin/python benchmarks/validate_sim.py --bench-dir runs/pp2_real   # reuse a bench run
    .venv/bin/python benchmarks/validate_sim.py --smoke          # llama-tiny, seconds (CI)

1. Profile the bench's deployment in place (``pp-runtime profile --pp PP``: the same launcher,
   threads, KV budget and layer cut; each stage worker times its own layers while the others
   work), on the default grid and on a second grid whose decodes and chunk sit at a longer
   context (--context2); each stage's CSVs are fitted together, one cost model per stage.
2. ``pp-runtime bench`` of the run config (unless --bench-dir gives one).
3. A simulation config derived from the same run config (model, pp, chunk, batch size, running
   cap = batch size × pp as ``LLM`` sets it, KV budget, workload and seed; per-stage cost models
   fitted to step 1's CSVs; each worker's prep and the token return per micro-batch from step
   1's profile.json; the driver's own work per micro-batch from --dispatch-us; each stage's
   step-time jitter from step 1's profile.json, the part not shared with its neighbour), then
   ``pp-runtime simulate``: OUT/sim. With jitter a simulation is one draw of a noisy pipeline,
   as the bench is: --sim-seeds more draws (the workload's seed pinned, only the top-level seed
   and so the jitter moves) go to OUT/sim-seeds/seed-K.
4. Throughput and median bubble per request, real vs simulated (the mean over the draws, their
   spread beside it), per scheduler; |error| ≤ 15% is the target. Written to
   OUT/validation.json and printed.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

from pp_runtime.run_config import load_run_config

METRICS = ("throughput_tok_s", "bubble_s_per_request_p50")
CONTEXT2_GRID = "prefill=;prefill_with_context=256;decode=1,4,8,16,24;mixed_decode=4,16;context={ctx}"


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "launch.cli", *args], check=True)


def profile(out: Path, engine: dict, grids: list[str]) -> tuple[list[list[str]], dict]:
    """Per stage, the CSVs of every grid, profiled in a deployment like the bench's; and the
    deployment's per-micro-batch overheads (µs, the grids' mean) and each stage's independent
    step-time jitter (σ pooled over the grids: √ of the mean σ²)."""
    pp = engine.get("pp", 1)
    stages: list[list[str]] = [[] for _ in range(pp)]
    overheads: list[dict] = []
    for i, grid in enumerate(grids):
        d = out / f"profile{i}"
        args = ["profile", "--pp", str(pp), "--tp", str(engine.get("tp", 1)), "--launcher",
                engine.get("launcher") or ("local" if pp * engine.get("tp", 1) == 1 else "ray"),
                "--threads", str(engine.get("threads", 0)), "--grid", grid, "--out", str(d), "--quiet"]
        for key in ("model", "memory_budget_gb", "partition", "dtype"):
            if engine.get(key) is not None:
                value = engine[key]
                args += [f"--{key.replace('_', '-')}",
                         ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)]
        cli(*args)
        for s in range(pp):
            stages[s].append(str((d / f"stage-{s}" / "profile.csv").resolve()))
        summary = json.loads((d / "profile.json").read_text())
        overheads.append({**summary["overheads_us"], "jitter": summary["jitter"]["independent"]})
    mean = {"prep": [sum(o["prep"][s] for o in overheads) / len(overheads) for s in range(pp)],
            "return": sum(o["return"] for o in overheads) / len(overheads),
            "jitter": [math.sqrt(sum((o["jitter"][s] or 0.0) ** 2 for o in overheads) / len(overheads))
                       for s in range(pp)]}
    return stages, mean


def ran_with(bench: Path | None, scheduler: str, engine: dict) -> dict:
    """The KV admission and prefix caching a bench run ran under: its summary.json's (a run from
    before they were recorded: optimistic, no caching, as the runtime then ran), else the run
    YAML's, else the runtime's defaults."""
    summary = bench / scheduler / "summary.json" if bench else None
    if summary is not None and summary.is_file():
        s = json.loads(summary.read_text())
        return {"kv_admission": s.get("kv_admission", "optimistic"),
                "enable_prefix_caching": s.get("enable_prefix_caching", False)}
    return {"kv_admission": engine.get("kv_admission") or "optimistic",
            "enable_prefix_caching": engine.get("enable_prefix_caching", True)}


def sim_config(run_path: str, stage_csvs: list[list[str]], dispatch_us: float, overheads: dict,
               bench: Path | None = None) -> dict:
    """The simulation of exactly what ``pp-runtime bench --config run_path`` runs (ran, in ``bench``)."""
    cfg = load_run_config(run_path)
    e, w = cfg.engine, cfg.workload
    pp, mbs = e.get("pp", 1), e["max_batch_size"]
    budget_gib = e.get("memory_budget_gb", 4.0)
    workload = {k: v for k, v in vars(w).items() if v is not None}
    scen = [{"name": s, "scheduler": s, "pp": pp, "chunk_size": e.get("chunk_size", 256), "max_batch_size": mbs,
             "max_running": mbs * pp, "tile_align": bool(e.get("tile_align", False)),
             "chunk_budget": e.get("chunk_budget") or "flops", "admission": e.get("admission") or "fcfs",
             **ran_with(bench, s, e), "dispatch_us": dispatch_us,
             "return_us": round(overheads["return"], 1), "prep_us": [round(x, 1) for x in overheads["prep"]]}
            for s in cfg.schedulers]
    if e.get("partition"):  # the profiled layer cut: per-stage cost models hold only for it
        for sc in scen:
            sc["partition"] = list(e["partition"])
    return {"name": "validate", "description": f"simulation of `pp-runtime bench --config {run_path}`",
            "model": e.get("model") or "smollm2-135m",
            "hardware": {"preset": "cpu-2core", "memory_gb": budget_gib * (1 << 30) / 1e9},
            "dtype": e.get("dtype", "float32"), "cluster": {"nodes": 1, "gpus_per_node": max(2, pp)},
            "memory": {"utilization": 1.0, "block_size": e.get("block_size", 16)},
            "max_model_len": e["max_model_len"],
            "cost_model": {"kind": "profile", "stages": stage_csvs,
                           "jitter": [round(x, 4) for x in overheads["jitter"]]},
            "seed": e.get("seed", 0), "workload": workload, "scenarios": scen, "base": cfg.schedulers[0]}


def simulate(cfg: dict, out: Path, seeds: int) -> list[Path]:
    """``seeds`` draws of the simulation (seed 0 in OUT/sim); their run directories."""
    dirs = []
    for seed in range(seeds):
        d = out / "sim" if seed == 0 else out / "sim-seeds" / f"seed-{seed}"
        path = out / ("sim_config.yaml" if seed == 0 else f"sim-seeds/seed-{seed}.yaml")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump({**cfg, "seed": seed}, sort_keys=False))
        cli("simulate", "--config", str(path), "--out", str(d), "--quiet")
        dirs.append(d)
    return dirs


def compare(bench: Path, sims: list[Path], schedulers: list[str]) -> dict:
    out = {}
    for s in schedulers:
        if not (bench / s / "summary.json").is_file():  # a reused bench may hold fewer schedulers
            continue
        real = json.loads((bench / s / "summary.json").read_text())
        preds = [json.loads((d / s / "summary.json").read_text()) for d in sims]
        row = {}
        for m in METRICS:
            draws = [p[m] for p in preds]
            mean = statistics.mean(draws)
            row[m] = {"real": real[m], "sim": mean, "error": mean / real[m] - 1 if real[m] else None,
                      "sim_sd": statistics.stdev(draws) if len(draws) > 1 else 0.0,
                      "sim_min": min(draws), "sim_max": max(draws), "sim_draws": draws}
        out[s] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/runs/pp2_zipf.yaml", help="the bench run config")
    ap.add_argument("--out", default="runs/validate_sim")
    ap.add_argument("--bench-dir", default=None, help="an existing bench of --config (skips step 2)")
    ap.add_argument("--context2", type=int, default=768, help="context of the second profile grid")
    ap.add_argument("--dispatch-us", type=float, default=2380.0,
                    help="the driver's own work per micro-batch: postprocess, schedule, plan packing and "
                         "submission (benchmarks/pp_scaling.py's driver_ms_per_mb on this box); plan delivery, "
                         "the workers' prep and the tokens' return come from the profile")
    ap.add_argument("--sim-seeds", type=int, default=10, help="simulation draws (jitter seeds) to average")
    ap.add_argument("--smoke", action="store_true", help="configs/runs/smoke.yaml on quick grids (CI)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.smoke:
        a.config = "configs/runs/smoke.yaml"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    run = load_run_config(a.config)
    missing = [k for k in ("max_batch_size", "max_model_len") if run.engine.get(k) is None]
    if missing:  # the runtime derives them from its memory plan; the simulation must not guess them
        ap.error(f"{a.config}: engine.{' and engine.'.join(missing)} must be set for validation "
                 "(the simulation has to run the same batches)")
    grids = ["quick", "quick;context=24;prefill="] if a.smoke else ["default", CONTEXT2_GRID.format(ctx=a.context2)]
    csvs, overheads = profile(out, run.engine, grids)
    bench = Path(a.bench_dir) if a.bench_dir else out / "bench"
    schedulers = list(run.schedulers)
    if not a.bench_dir:
        cli("bench", "--config", a.config, "--out", str(bench))
    sims = simulate(sim_config(a.config, csvs, a.dispatch_us, overheads, bench), out, max(1, a.sim_seeds))
    result = {"config": a.config, "profiles": csvs, "bench_dir": str(bench), "jitter": overheads["jitter"],
              "sim_seeds": len(sims), "comparison": compare(bench, sims, schedulers)}
    print(f"{'scheduler':13s} {'metric':26s} {'real':>10s} {'simulated':>10s} {'± sd':>8s} {'error':>8s}")
    for s, row in result["comparison"].items():
        for m, v in row.items():
            err = "n/a" if v["error"] is None else f"{v['error']:+.1%}"
            print(f"{s:13s} {m:26s} {v['real']:10.4g} {v['sim']:10.4g} {v['sim_sd']:8.3g} {err:>8s}")
    (out / "validation.json").write_text(json.dumps(result, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
