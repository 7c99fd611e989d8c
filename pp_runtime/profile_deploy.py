"""Profile a deployment in place: every stage worker times the grid's batches on its own layers,
through the path a real run takes (the launcher's executor, P2P sends, sampling), with the
pipeline kept full so that the stages work at the same time, as they do in a run.

    llm = LLM(pp=2, threads=1, memory_budget_gb=2.0)           # the deployment to profile
    result = profile_deployment(llm, "default", "runs/profile_pp2")
    # runs/profile_pp2/stage-0/profile.csv, stage-1/profile.csv, profile.json
    pp-runtime profile --pp 2 --threads 1 --out runs/profile_pp2  # the same from the CLI

Why: a stage worker in a running deployment is slower than the same layers profiled alone, or
even beside a second profile. Measured on the 2-core box (sarathi, pp = 2, same micro-batches):
Ray stage steps 6–13% longer than the in-process run, which was itself 8–15% over the fitted
co-located profile. A profile taken in the deployment carries that into the simulator.

A stage's row: the five timed ops from hooks in its worker (``time_ops`` micro-batches turn
them on), and ``others`` = the rest of its step (t_end − t_start of its timing log: norms,
RoPE, residuals, the embedding on the first stage, the LM head and sampling on the last, the
send to the next stage). ``lm_head_ms`` is the last stage's LM head alone. Each stage's CSV
has profile.csv's columns, so `cost_model.stages` in a simulation config takes them per stage.
profile.json adds the per-micro-batch costs around the steps (``overheads_us``: each stage's
``prep``, the tokens' ``return``), a simulation scenario's prep_us and return_us, and how noisy
the steps are (``jitter``: per-stage σ, its step-to-step part, the part adjacent stages share,
the independent σ a simulation's cost_model.jitter takes; profile_stats.stage_jitter). Only TP rank 0
of each stage is reported (its ranks run in lockstep). The driver only plans and reads
timings: no tensor here.
"""
from __future__ import annotations

import os
import random
import statistics
import sys
import time
from collections import deque

from pp_runtime.batch import MicroBatch
from pp_runtime.profile_grid import Grid, Layout, Point, grid_points, parse_grid, plan_chunks
from pp_runtime.profile_stats import rows_from_samples, stage_jitter, timed_sample
from pp_runtime.profile_tables import format_table, table2, write_csv, write_json


def check_fits(llm: object, grid: Grid) -> Layout:
    """The grid's KV layout, or ValueError naming what the deployment lacks."""
    cache, model = llm.config.cache, llm.source.config
    if any(u % 2 for span in llm.config.parallel.stage_units(model.num_layers) for u in span):
        raise ValueError(f"partition {list(llm.config.parallel.partition)}: a profile is per layer for the simulator, "
                         "which models whole layers per stage; profile a whole-layer partition")
    if grid.block_size != cache.block_size:
        raise ValueError(f"grid block_size={grid.block_size} differs from the deployment's {cache.block_size}")
    if grid.max_len() > model.max_position_embeddings:
        raise ValueError(f"grid needs {grid.max_len()} positions, the model has "
                         f"max_position_embeddings={model.max_position_embeddings}")
    if grid.max_len() > model.max_len:
        raise ValueError(f"grid needs {grid.max_len()} positions, the model's sliding window is "
                         f"{model.sliding_window} (sliding_window)")
    layout = Layout(grid)
    if layout.num_blocks > llm.memory.num_blocks:
        raise ValueError(f"grid needs {layout.num_blocks} KV blocks, the deployment has {llm.memory.num_blocks}: "
                         "raise --memory-budget-gb or use a smaller grid")
    return layout


def run_grid(executor: object, plans: list[tuple], depth: int, progress: bool) -> tuple[list[float], list[float]]:
    """Submit every plan as a ``time_ops`` micro-batch (mb id = its index), ``depth`` in flight:
    a full pipeline, every stage busy. Returns when each was submitted and when its tokens
    were back (driver clock)."""
    from tqdm import tqdm
    submitted, returned = [0.0] * len(plans), [0.0] * len(plans)
    in_flight: deque[int] = deque()

    def collect_oldest() -> None:
        executor.collect()
        returned[in_flight.popleft()] = time.time()
        bar.update(1)

    with tqdm(total=len(plans), file=sys.stderr, disable=not progress, desc="profile", unit="mb",
              leave=False) as bar:
        for mb_id, chunks in enumerate(plans):
            if len(in_flight) == depth:
                collect_oldest()
            submitted[mb_id] = time.time()
            executor.submit(MicroBatch(mb_id, chunks, time_ops=True))
            in_flight.append(mb_id)
        while in_flight:
            collect_oldest()
    return submitted, returned


def overheads_us(stage_rows: list[list[tuple]], submitted: list[float], returned: list[float],
                 keep: dict[int, Point]) -> dict:
    """The deployment's per-micro-batch costs outside the stages' steps (medians over the kept
    micro-batches, µs), as the simulator's scenario takes them: ``prep`` per stage — from the
    moment the worker is free and has what it needs (stage 0: the plan, submitted; later stages:
    the previous stage's output, sent) to its step's start (task start, unpacking, metadata,
    receive); ``return`` — the last stage's end to the tokens at the driver. ``stage_rows``: per
    stage, (mb, t_ready, t_start, t_end) on the driver's clock."""
    by_stage = [{mb: (t_start, t_end) for mb, _, t_start, t_end in rows} for rows in stage_rows]
    prep = []
    for s, recs in enumerate(by_stage):
        waits = []
        for mb in keep:
            if mb - 1 not in recs:
                continue
            need = submitted[mb] if s == 0 else by_stage[s - 1][mb][1]
            waits.append(recs[mb][0] - max(recs[mb - 1][1], need))
        prep.append(max(0.0, statistics.median(waits)) * 1e6 if waits else 0.0)
    back = [returned[mb] - by_stage[-1][mb][1] for mb in keep]
    return {"prep": prep, "return": max(0.0, statistics.median(back)) * 1e6 if back else 0.0}


def stage_samples(timings: list, op_times: list, keep: dict[int, Point],
                  points: list[Point]) -> dict[Point, list[dict[str, float]]]:
    """One worker's records of the kept (timed-round) micro-batches, per grid point, in seconds."""
    step = {mb: t_end - t_start for mb, _, t_start, t_end in timings}
    samples: dict[Point, list[dict[str, float]]] = {pt: [] for pt in points}
    for mb, acc in op_times:
        if mb not in keep:
            continue
        samples[keep[mb]].append(timed_sample(acc, step[mb]))
    return samples


def profile_deployment(llm: object, grid: str | Grid, out_dir: str, progress: bool = True,
                       seed: int = 0) -> dict:
    """Profile ``llm``'s deployment (idle: between runs) on ``grid``; write
    ``out_dir/stage-K/{profile.csv,table2.json}`` and ``out_dir/profile.json``; print each
    stage's table. Returns profile.json's fields plus ``rows`` (per stage)."""
    g = parse_grid(grid)
    layout = check_fits(llm, g)
    rng = random.Random(seed)
    points = grid_points(g)
    per_round = [plan_chunks(pt, layout, llm.source.config.vocab_size, rng) for pt in points]
    rounds = g.warmup + g.reps
    plans = per_round * rounds  # round-major: drift on a shared machine hits every point alike
    executor, pp = llm.executor, llm.config.parallel.pp
    llm.reset_prefix_cache()  # the grid writes its own K/V over blocks the prefix cache may hold
    executor.drain_timings()  # entries of earlier runs are not ours
    executor.drain_op_times()
    submitted, returned = run_grid(executor, plans, pp, progress)
    timings, op_times = executor.drain_timings(), executor.drain_op_times()
    keep = {i: points[i % len(points)] for i in range(g.warmup * len(points), len(plans))}
    ranks, offsets = executor.ranks(), executor.clock_offsets()
    infos = llm.workers_info()
    rank0 = [ranks.index((s, 0)) for s in range(pp)]
    on_driver_clock = [[(mb, a - offsets[w], b - offsets[w], c - offsets[w]) for mb, a, b, c in timings[w]]
                       for w in rank0]
    stages, all_rows, runs = [], [], []
    for s in range(pp):
        w = rank0[s]
        runs.append([(keep[mb], t_end - t_start) for mb, _, t_start, t_end in sorted(timings[w]) if mb in keep])
        rows = rows_from_samples(points, stage_samples(timings[w], op_times[w], keep, points), g.stat)
        d = os.path.join(out_dir, f"stage-{s}")
        os.makedirs(d, exist_ok=True)
        csv_path, t2_path = os.path.join(d, "profile.csv"), os.path.join(d, "table2.json")
        write_csv(rows, csv_path)
        t2 = {**table2(rows), "stage": s, "layers": infos[w]["layers"]}
        write_json(t2, t2_path)
        print(f"stage {s} (layers {infos[w]['layers'][0]}..{infos[w]['layers'][1] - 1}):")
        print(format_table(rows))
        stages.append({"stage": s, "layers": infos[w]["layers"], "csv": csv_path, "table2": t2_path})
        all_rows.append(rows)
    cfg = llm.config
    summary = {"pp": pp, "tp": cfg.parallel.tp, "launcher": llm.launcher, "threads": cfg.device.threads,
               "device": cfg.device.device, "dtype": cfg.device.dtype, "kv_cache_dtype": cfg.cache.kv_dtype,
               "matmul_precision": cfg.device.matmul_precision, "grid": grid if isinstance(grid, str) else
               "custom", "warmup": g.warmup, "reps": g.reps, "stat": g.stat, "stages": stages,
               "overheads_us": overheads_us(on_driver_clock, submitted, returned, keep),
               "jitter": stage_jitter(runs)}
    write_json(summary, os.path.join(out_dir, "profile.json"))
    return {**summary, "rows": all_rows}
