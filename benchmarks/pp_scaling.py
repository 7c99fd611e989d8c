"""Does pipeline parallelism pay on this box? pp=2 against pp=1 on a P:D = 10 Zipf workload
(issue 8: targets 4 pipeline efficiency, 5 control plane, 6 memory).

    .venv/bin/python benchmarks/pp_scaling.py                      # embedded model, 24 requests, ~6 min
    .venv/bin/python benchmarks/pp_scaling.py --num-requests 96    # the drain amortised, ~16 min
    .venv/bin/python benchmarks/pp_scaling.py --num-requests 48    # configs/runs/pp2_zipf.yaml's size
    .venv/bin/python benchmarks/pp_scaling.py --smoke              # llama-tiny, seconds (CI)
    .venv/bin/python benchmarks/pp_scaling.py --schedulers sarathi --temperature 0.8 --top-p 0.95   # sampled
    .venv/bin/python benchmarks/pp_scaling.py --num-requests 48 --plot pp_scaling.png   # and as a figure
    .venv/bin/python benchmarks/pp_scaling.py --num-requests 48 --matmul-precision int8 --kv-cache-dtype fp8 \
        --admissions longest_first,fcfs --rounds 3    # target 4 as last measured (~17 min)

For sarathi and orca: the same requests (total lengths Zipf θ = 0.4 in --min-len..--max-len,
P:D = 10, all at t = 0) at pp=1 (in process, one thread) and pp=2 (two Ray workers, one
thread each); throughput = (prompt + generated tokens) / wall seconds, and the pipeline
efficiency tput(pp=2) / (2 × tput(pp=1)) (target ≥ 0.9 for sarathi). sarathi's chunk budget
counts cost, not tokens ("flops": a chunk deep into its prompt takes fewer tokens, so micro-batches
take about equally long and stages wait less on each other); --chunk-budgets fit,tokens also runs
SARATHI's plain token budget, paired the same way, labelled sarathi[tokens]; --admissions
fcfs,longest_first runs each scheduler under both admission orders (longest_first: most
max_tokens first, so the longest decodes finish beside later prompts' chunks rather than in the
drain), labelled [longest_first]. Budget "fit" (the default) is "flops" with measured costs: what a
prompt key, a decode row and a decode key cost on this box, measured on the pp=2 deployment
as `--step-costs fit` does at start-up (pp_runtime/calibration.py, SchedulerConfig.step_costs);
at pp=2 each micro-batch's chunk then gets what its decodes leave of a fresh chunk's measured
cost, so consecutive micro-batches take equally long and the two stages, which wait on each
other's steps, idle less; pp=1, one micro-batch in
flight, runs as under "flops" (--chunk-budgets fit,flops pairs the two). Same batch size and KV
budget everywhere, and the same chunk unless --pp2-chunk gives pp=2 its own: at pp=2 each
request decodes once per two micro-batches, so a chunk half as long keeps a round trip's mix of
prompt and decode tokens what it is at pp=1 (SARATHI sizes the chunk from the P:D ratio and the
decodes per micro-batch). benchmarks/chunk_sweep.py measures each depth's best chunk: on the
Zen 4 box 256 stayed best at both, pp=2 at 128 piggybacking as many decodes as pp=1 but running
3.4% slower (docs/BENCHMARKS.md, target 4). Both deployments stay up and their runs alternate
(pp=1, pp=2, then pp=2, pp=1, ...) for --rounds rounds: this box drifts by 10-30% between runs
minutes apart, so each round's pp=2 run is paired with that round's pp=1 run, and the efficiency
printed is the median of the rounds' paired ratios (benchmarks/pairing.py); every variant (scheduler,
budget, admission) runs in every round, so variants compare round by round as well. Every round is warm:
each deployment first runs the workload once unmeasured.

The run ends in a drain: once the last prompt is in, the remaining requests (the longest has
~90 tokens to generate) decode one token per pass through the pipeline whatever pp is, in
micro-batches of a few rows whose cost is mostly per micro-batch, and at pp=2 there are twice
as many of them (docs/BENCHMARKS.md, target 4).

Each round's efficiency also comes as a product of four factors (pp_runtime/pipeline_loss.py):
pp=1's driver overhead × composition (pp=1's work against pp=2's micro-batches priced at pp=1's
fitted step costs: more, smaller micro-batches pay more fixed costs) × work speed (those prices
against what the two stages took: the same work slower at pp=2, where two busy cores share caches
and memory, ~3% on the Zen 3 box, and where a slow spell of the box shows) × stage utilization
(the stages' busy share of pp=2's wall). A round whose utilization is well under 1 lost it to
waits; one whose work speed is, to slower work (docs/BENCHMARKS.md, 34th session).

By phase (first scheduler, round 0): the prefill phase — until the last micro-batch with a prompt
chunk leaves the last stage — and the drain after it, when only decodes are left; each against
pp=1's summed step times of the same kinds, with how many decodes rode on chunks. The drain is
where pp=2 loses: each request advances one token per pass through the pipeline whatever pp is.
Per stage of each deployment, the step times by micro-batch kind (carrying a chunk; decode-only
by rows) and the stage's idle time show which stage bounds the run and what its excess is.

At pp=2 (sarathi run), per micro-batch and as a fraction of the mean stage step:
  * driver work: scheduling + plan packing + sending it to stage 0 + postprocess (Engine.stats);
  * plan delivery: how long a free worker waited for a plan already sent;
  * token return: from the last stage's end to the driver holding the tokens, counted from when
    the driver started waiting for them (time it spent elsewhere is not return latency).
Memory at pp=2: each worker's resident decoder-layer bytes against its 1/pp share of the whole
layer stack, its process RSS, and the KV cache allocated against budget − weights.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from launch.parser import parse_partition
from pairing import alternating, ratios  # same directory: run as a script
from pp_runtime import LLM
from pp_runtime.config import ADMISSIONS, CHUNK_BUDGETS, KV_DTYPES, MATMUL_PRECISIONS
from pp_runtime.calibration import calibrate, format_costs
from pp_runtime.pipeline_loss import FACTORS, Run, loss_factors
from pp_runtime.workload import generate_workload
from pp_runtime.workload_config import WorkloadConfig


BUDGETS = CHUNK_BUDGETS + ("fit",)  # fit: "flops" with measured step costs (run_once)


def zipf_workload(num_requests: int, min_len: int, max_len: int, temperature: float = 0.0,
                  top_p: float = 1.0) -> WorkloadConfig:
    """The paper's pipeline workload: total lengths Zipf(θ = 0.4), P:D = 10, all at t = 0; greedy
    unless a temperature is given."""
    return WorkloadConfig(kind="zipf", num_requests=num_requests, min_len=min_len, max_len=max_len, theta=0.4,
                          pd_ratio=10, arrival="all", seed=0, temperature=temperature, top_p=top_p)


def deployments(stack: contextlib.ExitStack, model: str | None, chunk: int, max_batch_size: int, kv_cache_dtype: str,
                matmul_precision: str, pp2_partition: list[float] | None = None) -> dict[int, LLM]:
    """pp=1 in this process and pp=2 on two Ray workers (layers split evenly unless pp2_partition), one
    thread per stage, the same batch size and 2 GB budget (closed with the stack)."""
    common = dict(model=model, chunk_size=chunk, max_batch_size=max_batch_size, memory_budget_gb=2.0,
                  max_model_len=2048 if model is None else None, threads=1, kv_cache_dtype=kv_cache_dtype,
                  matmul_precision=matmul_precision, enable_prefix_caching=False)  # every round: the same prompts
    own = {1: dict(launcher="local"), 2: dict(launcher="ray", partition=pp2_partition)}
    return {pp: stack.enter_context(LLM(pp=pp, **own[pp], **common)) for pp in (1, 2)}


def run_once(llm: LLM, items: list, policy: str, chunk: int, budget: str = "flops", admission: str = "fcfs",
             costs: Sequence[float] = (), *, sampling: WorkloadConfig) -> float:
    """One run of ``items``, wall seconds. budget "fit": "flops" with ``costs`` as step_costs;
    ``sampling``: the workload whose sampling every request takes."""
    llm.reconfigure(policy=policy, chunk_size=chunk, chunk_budget="flops" if budget == "fit" else budget,
                    admission=admission, step_costs=tuple(costs) if budget == "fit" else ())
    reqs = [llm.make_request(it.request_id, it.prompt_token_ids, sampling.sampling_params(it.max_tokens))
            for it in items]
    t = time.perf_counter()
    outs = llm.run(reqs)
    wall = time.perf_counter() - t
    assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs if o.error][:3]
    return wall


def control_plane(llm: LLM, timings: list[list]) -> dict:
    eng, pp = llm.engine, llm.config.parallel.pp
    steps, delivery, ends = [], [], {}
    for rank, worker in enumerate(timings):
        prev_end = None
        for mb, t_ready, t_start, t_end in worker:
            steps.append(t_end - t_start)
            free_since = eng.submit_times[mb] if prev_end is None else max(eng.submit_times[mb], prev_end)
            delivery.append(max(0.0, t_ready - free_since))
            prev_end = t_end
            if rank == len(timings) - 1:  # last stage (TP rank 0 of it with tp = 1)
                ends[mb] = t_end
    returns = [max(0.0, got - max(ask, ends[mb])) for mb, (ask, got) in eng.collect_times.items() if mb in ends]
    st = eng.stats
    step = statistics.mean(steps)
    out = {"pp": pp, "microbatches": st.steps, "mean_step_ms": step * 1e3,
           "driver_ms_per_mb": st.driver_s / st.steps * 1e3, "delivery_ms_per_mb": statistics.mean(delivery) * 1e3,
           "return_ms_per_mb": statistics.mean(returns) * 1e3}
    out["total_fraction"] = (out["driver_ms_per_mb"] + out["delivery_ms_per_mb"] + out["return_ms_per_mb"]) \
        / out["mean_step_ms"]
    return out


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def memory(llm: LLM) -> dict:
    infos = llm.executor.workers_info()
    total_layers = sum(i["layer_weight_bytes"] for i in infos)
    m = llm.memory
    kv = m.num_blocks * llm.config.cache.block_size * m.kv_bytes_per_token
    return {"layer_stack_bytes": total_layers,
            "workers": [{"stage": i["stage"], "layers": i["layers"], "layer_bytes": i["layer_weight_bytes"],
                         "share_bytes": total_layers / len(infos), "weight_bytes": i["weight_bytes"],
                         "rss_bytes": rss_bytes(i["pid"])} for i in infos],
            "budget_bytes": m.budget_bytes, "tightest_weight_bytes": m.weight_bytes, "kv_bytes": kv,
            "unused_bytes": m.budget_bytes - m.weight_bytes - kv,
            "block_bytes": llm.config.cache.block_size * m.kv_bytes_per_token}


def phase_split(llm: LLM, timings: list[list]) -> dict:
    """Where a run's time went, by phase: the prefill phase (until the last micro-batch carrying a
    prompt chunk leaves the last stage) and the drain after it, when only decodes are left. At
    pp=1, the summed step times of the two kinds of step; with one stage that is the wall time."""
    kinds = {mb.mb_id: mb.prefill_tokens > 0 for mb in llm.engine.history}
    decodes = {True: 0, False: 0}
    for mb in llm.engine.history:
        decodes[mb.prefill_tokens > 0] += mb.decode_tokens
    last = timings[-1]  # the last stage (its TP rank 0)
    start = min(w[0][1] for w in timings if w)  # the first plan in hand
    prefill_end = max((e for mb, _, _, e in last if kinds[mb]), default=start)
    out = {"piggybacked_decodes": decodes[True], "decode_only_decodes": decodes[False],
           "decode_only_microbatches": sum(1 for k in kinds.values() if not k), "microbatches": len(kinds)}
    if len(timings) == 1:
        out["prefill_s"] = sum(e - s for mb, _, s, e in last if kinds[mb])
        out["drain_s"] = sum(e - s for mb, _, s, e in last if not kinds[mb])
    else:
        out["prefill_s"], out["drain_s"] = prefill_end - start, last[-1][3] - prefill_end
    rows = {mb.mb_id: mb.decode_tokens for mb in llm.engine.history}
    out["stages"] = [stage_steps(w, kinds, rows) for w in timings]
    return out


def _step_kind(prefill: bool, rows: int) -> str:
    if prefill:
        return "chunk"
    return "decode 1" if rows <= 1 else "decode 2-3" if rows <= 3 else "decode 4-7" if rows <= 7 else "decode 8+"


def stage_steps(worker: list, kinds: dict[int, bool], rows: dict[int, int]) -> dict:
    """One stage's step times by micro-batch kind (carrying a chunk, or decode-only by rows):
    count, median and total seconds, and the stage's idle seconds between steps."""
    by: dict[str, list[float]] = {}
    idle, prev_end = 0.0, None
    for mb, _, t_start, t_end in worker:
        by.setdefault(_step_kind(kinds[mb], rows[mb]), []).append(t_end - t_start)
        idle += 0.0 if prev_end is None else max(0.0, t_start - prev_end)
        prev_end = t_end
    return {"idle_s": idle, "kinds": {k: {"n": len(v), "median_ms": statistics.median(v) * 1e3, "sum_s": sum(v)}
                                      for k, v in sorted(by.items())}}


def variants(policies: list[str], budgets: list[str],
             admissions: Sequence[str] = ("fcfs",)) -> list[tuple[str, str, str, str]]:
    """(label, policy, chunk budget, admission) to run: every policy once per admission order, sarathi
    also once per budget (the others do not chunk); a label names what differs from the first
    budget and admission, e.g. sarathi[tokens,longest_first]."""
    out = []
    for policy in policies:
        for budget in budgets if policy == "sarathi" else budgets[:1]:
            for admission in admissions:
                tags = [x for x, first in ((budget, budgets[0]), (admission, admissions[0])) if x != first]
                out.append((f"{policy}[{','.join(tags)}]" if tags else policy, policy, budget, admission))
    return out


def paired_runs(llms: dict[int, LLM], items: list, tokens: int, runs: list[tuple[str, str, str, str]], rounds: int,
                chunks: dict[int, int], r: dict, wl: WorkloadConfig) -> None:
    """Every variant's runs at pp=1 and pp=2 (chunk per pp): each round runs every variant (in order,
    then reversed the next round), each variant's pp=1 and pp=2 back to back (alternating which goes
    first), so that the box's drift moves a round's variants together and a comparison of variants
    pairs by round too. Per-round figures in r, by label; per-phase and control-plane figures come
    from the first variant's round 0."""
    r["rounds"] = {}
    per = {label: {1: [], 2: []} for label, *_ in runs}
    factors: dict[str, list] = {label: [] for label, *_ in runs}
    for k, (label, policy, budget, admission) in alternating(rounds, runs):
        done = {}
        for pp in (1, 2) if k % 2 == 0 else (2, 1):
            llm = llms[pp]
            llm.executor.drain_timings()
            wall = run_once(llm, items, policy, chunks[pp], budget, admission, r.get("step_costs") or (), sampling=wl)
            per[label][pp].append(tokens / wall)
            print(f"{label:15s} pp={pp} round {k}: {tokens} tokens in {wall:7.1f} s = {tokens / wall:6.1f} tok/s",
                  flush=True)
            timings = llm.executor.drain_timings()
            done[pp] = Run(wall, list(llm.engine.history), timings)
            if label == runs[0][0] and k == 0:
                r.setdefault("phases", {})[f"pp{pp}"] = phase_split(llm, timings)
                if pp == 2:
                    r["control_plane_pp2"] = control_plane(llm, timings)
        f = loss_factors(done[1], done[2])
        factors[label].append(None if f is None else asdict(f))
        print(f"{label:15s} round {k} efficiency " + ("(its factors: too few pp=1 steps to price)" if f is None
                                                      else f.describe()), flush=True)
    for label, *_ in runs:
        eff = ratios(per[label][2], [2 * t for t in per[label][1]])  # tput2 / (2 tput1) per round
        r["rounds"][label] = {"pp1_tok_s": per[label][1], "pp2_tok_s": per[label][2], "efficiency": eff,
                              "factors": factors[label]}
        for pp in (1, 2):
            r["throughput_tok_s"][f"{label}_pp{pp}"] = statistics.median(per[label][pp])
        r["efficiency"][label] = statistics.median(eff)


def add_workload_args(ap: argparse.ArgumentParser, num_requests: int) -> None:
    """The workload and deployment flags this script and chunk_sweep.py share; --smoke sets them
    small (smoke_workload)."""
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-requests", type=int, default=num_requests)
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--max-batch-size", type=int, default=32,
                    help="sequences per micro-batch, the same for both deployments (the engine's own default, "
                         "⌊B/pp⌋ capped at 64, would differ between them); pp=2 runs up to twice as many requests. "
                         "At P:D = 10 a 256-token chunk per micro-batch needs ~25 decodes beside it, ~51 running "
                         "requests at pp=2: 24 would cap it and bring decode-only micro-batches back mid-run")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", default=None)


def smoke_workload(a: argparse.Namespace) -> str | None:
    """The model to run: under --smoke llama-tiny (unless --model) on 6 requests of 24-64 tokens."""
    if a.smoke:
        a.num_requests, a.min_len, a.max_len = 6, 24, 64
    return "llama-tiny" if a.smoke and a.model is None else a.model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(ap, num_requests=24)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--pp2-chunk", type=int, default=None, help="pp=2's chunk (default: --chunk)")
    ap.add_argument("--pp2-partition", default=None, type=parse_partition,
                    help="pp=2's layers per stage, e.g. 15.5,14.5 (default: an even split); the last stage also "
                         "runs the LM head")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_DTYPES)
    ap.add_argument("--matmul-precision", default="highest", choices=MATMUL_PRECISIONS,
                    help="medium: products of > 12 rows (prefill chunks, decode batches of 13+) on bf16 inputs "
                         "(AVX512-BF16)")
    ap.add_argument("--schedulers", default="sarathi,orca")
    ap.add_argument("--chunk-budgets", default="fit",
                    help="sarathi's chunk budgets to run, comma separated (fit,flops: both, paired; the first "
                         "is the one reported as sarathi): fit (flops with the step costs measured on pp=2 as "
                         "--step-costs fit does, "
                         "SchedulerConfig.step_costs: at pp=2 micro-batches of equal measured cost), flops, tokens")
    ap.add_argument("--admissions", default="fcfs",
                    help="admission orders to run, comma separated (fcfs,longest_first: both, paired; the first "
                         "is the one reported unlabelled). longest_first starts the most max_tokens first, so "
                         "the longest decodes finish beside later prompts' chunks instead of in the drain")
    ap.add_argument("--rounds", type=int, default=2, help="pp=1 / pp=2 pairs per scheduler")
    ap.add_argument("--temperature", type=float, default=0.0, help="every request samples (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus sampling")
    ap.add_argument("--plot", default=None, help="draw the rounds and round 0's phases to this PNG (pp_scaling_plot.py)")
    a = ap.parse_args()
    model = smoke_workload(a)
    if a.smoke:
        a.chunk, a.rounds = 16, 1
    wl = zipf_workload(a.num_requests, a.min_len, a.max_len, a.temperature, a.top_p)
    policies = a.schedulers.split(",")
    budgets = a.chunk_budgets.split(",")
    bad = [b for b in budgets if b not in BUDGETS]
    if bad:
        ap.error(f"--chunk-budgets: {', '.join(bad)} not among {', '.join(BUDGETS)}")
    admissions = a.admissions.split(",")
    bad = [x for x in admissions if x not in ADMISSIONS]
    if bad:
        ap.error(f"--admissions: {', '.join(bad)} not among {', '.join(ADMISSIONS)}")
    runs = variants(policies, budgets, admissions)
    r: dict = {"workload": {"num_requests": a.num_requests, "min_len": a.min_len, "max_len": a.max_len,
                            "pd_ratio": 10, "theta": 0.4, "temperature": a.temperature, "top_p": a.top_p},
               "chunk": a.chunk, "max_batch_size": a.max_batch_size,
               "kv_cache_dtype": a.kv_cache_dtype, "matmul_precision": a.matmul_precision,
               "pp2_chunk": a.pp2_chunk or a.chunk, "pp2_partition": a.pp2_partition, "chunk_budgets": budgets,
               "admissions": admissions,
               "warmup": "one unmeasured run per pp",
               "throughput_tok_s": {}, "efficiency": {}}
    with contextlib.ExitStack() as stack:
        llms = deployments(stack, model, a.chunk, a.max_batch_size, a.kv_cache_dtype, a.matmul_precision,
                           a.pp2_partition)
        items = generate_workload(wl, llms[1].source.config.vocab_size)
        tokens = sum(len(it.prompt_token_ids) + it.max_tokens for it in items)
        chunks = {1: a.chunk, 2: a.pp2_chunk or a.chunk}
        _, policy, budget, admission = runs[0]
        for pp, llm in llms.items():
            # A whole unmeasured run each: a process's first run is 2-8% slower (the OS faults in and
            # zeroes the KV cache's pages as blocks are first written), which would flatter whichever
            # side pays it more in round 0.
            run_once(llm, items, policy, chunks[pp], budget, admission, sampling=wl)
        if "fit" in budgets:  # what `--step-costs fit` measures at start-up, on the deployment that uses them
            r["step_costs"] = calibrate(llms[2])  # warm now, as start-up's is (CacheConfig.prefault)
            print("step costs measured on pp=2 (fresh prompt tokens per prompt key, decode row, decode key): "
                  + (format_costs(r["step_costs"]) if r["step_costs"] else "none, the FLOPs budget's"), flush=True)
        paired_runs(llms, items, tokens, runs, a.rounds, chunks, r, wl)
        r["memory_pp2"] = memory(llms[2])
    print("pipeline efficiency tput(pp=2) / (2 × tput(pp=1)), median of paired rounds, target >= 0.9 for sarathi: "
          + ", ".join(f"{p} {e:.3f} (rounds: {', '.join(f'{x:.3f}' for x in r['rounds'][p]['efficiency'])})"
                      for p, e in r["efficiency"].items()))
    for label, rr in r["rounds"].items():  # pp_runtime/pipeline_loss.py: what each factor means
        fs = [f for f in rr["factors"] if f is not None]
        if fs:
            print(f"  {label} factors, median of rounds: " + ", ".join(
                f"{k.replace('_', ' ')} {statistics.median(f[k] for f in fs):.3f}"
                for k in FACTORS))
    ph = r["phases"]
    print(f"{runs[0][0]} by phase, round 0 (pp=1: summed step times; pp=2: wall): prefill phase "
          f"{ph['pp1']['prefill_s']:.2f} s at pp=1, {ph['pp2']['prefill_s']:.2f} s at pp=2 = "
          f"{ph['pp1']['prefill_s'] / (2 * ph['pp2']['prefill_s']):.3f} of ideal; drain (decode-only) "
          f"{ph['pp1']['drain_s']:.2f} s vs {ph['pp2']['drain_s']:.2f} s = "
          f"{ph['pp1']['drain_s'] / (2 * max(ph['pp2']['drain_s'], 1e-9)):.3f}; decodes on chunks "
          f"{ph['pp1']['piggybacked_decodes']} vs {ph['pp2']['piggybacked_decodes']}, in decode-only micro-batches "
          f"{ph['pp1']['decode_only_decodes']} ({ph['pp1']['decode_only_microbatches']}) vs "
          f"{ph['pp2']['decode_only_decodes']} ({ph['pp2']['decode_only_microbatches']})")
    for pp in ("pp1", "pp2"):
        for i, st in enumerate(ph[pp]["stages"]):
            print(f"  {pp} stage {i} steps (n, median ms, total s): " + "; ".join(
                f"{k} {v['n']}, {v['median_ms']:.1f}, {v['sum_s']:.2f}" for k, v in st["kinds"].items())
                + f"; idle {st['idle_s']:.2f} s")
    c = r["control_plane_pp2"]
    print(f"control plane at pp=2 ({c['microbatches']} micro-batches, mean stage step {c['mean_step_ms']:.1f} ms): "
          f"driver {c['driver_ms_per_mb']:.2f} + delivery {c['delivery_ms_per_mb']:.2f} + token return "
          f"{c['return_ms_per_mb']:.2f} ms = {c['total_fraction']:.1%} of a step (target < 5%)")
    m = r["memory_pp2"]
    for w in m["workers"]:
        rss = "n/a" if w["rss_bytes"] is None else f"{w['rss_bytes'] / 2**20:.0f} MiB"
        print(f"stage {w['stage']} layers {w['layers']}: layer weights {w['layer_bytes'] / 1e6:.1f} MB "
              f"(share {w['share_bytes'] / 1e6:.1f} MB), all weights {w['weight_bytes'] / 1e6:.1f} MB, RSS {rss}")
    print(f"KV cache {m['kv_bytes'] / 2**20:.1f} MiB = budget {m['budget_bytes'] / 2**20:.1f} MiB − weights "
          f"{m['tightest_weight_bytes'] / 2**20:.1f} MiB − {m['unused_bytes']} B unused (< one block of "
          f"{m['block_bytes']} B)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    if a.plot:
        from pp_scaling_plot import plot_pp_scaling  # same directory: run as a script
        print(f"figure: {plot_pp_scaling(r, Path(a.plot))}")


if __name__ == "__main__":
    main()
