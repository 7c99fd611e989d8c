"""Which prefill chunk suits each pipeline depth: pp=1 and pp=2 at several chunks, paired.

On pp_scaling's P:D = 10 Zipf workload (issue 8, target 4: each deployment at its own best chunk).

    .venv/bin/python benchmarks/chunk_sweep.py --num-requests 48              # 128,192,256; ~13 min
    .venv/bin/python benchmarks/chunk_sweep.py --chunks 96,128,256 --rounds 3
    .venv/bin/python benchmarks/chunk_sweep.py --smoke                        # llama-tiny, seconds (CI)

Why depth moves the best chunk: a decoding request gains one token per pass through the pipeline,
and a pass is pp stage steps of chunk × layers / pp each, so its length depends on the chunk, not
on pp. At pp = 2 with pp = 1's chunk, the prefill phase takes half the wall time with passes as
long as before, so half as many decodes ride on chunks and the rest wait for the drain, where
micro-batches of a few rows pipeline badly. A chunk of ~1/pp keeps pp = 1's share of piggybacked
decodes, paid for by smaller products and more re-reads of cached K/V per prompt.

Both deployments stay up (pp_scaling.deployments) and every (pp, chunk) runs once per round, in
order in even rounds and reversed in odd ones (benchmarks/pairing.py). Prints each pp's median
throughput per chunk, each pp's best chunk, and the efficiency tput(pp=2) / (2 × tput(pp=1)) per
round, at the two best chunks and at equal chunks, with their medians.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics

from pairing import alternating, ratios  # same directory: run as a script
from pp_runtime.workload import generate_workload
from pp_runtime.workload_config import WorkloadConfig
from pp_scaling import add_workload_args, deployments, run_once, smoke_workload, zipf_workload


def sweep(llms: dict, items: list, tokens: int, chunks: list[int], rounds: int,
          wl: WorkloadConfig) -> dict[int, dict[int, list[float]]]:
    """tok/s per round for every pp and chunk: {pp: {chunk: [round 0, round 1, ...]}}."""
    out: dict[int, dict[int, list[float]]] = {pp: {c: [] for c in chunks} for pp in llms}
    for k, (pp, c) in alternating(rounds, [(pp, c) for pp in llms for c in chunks]):
        wall = run_once(llms[pp], items, "sarathi", c, sampling=wl)
        out[pp][c].append(tokens / wall)
        print(f"round {k} pp={pp} chunk {c:4d}: {tokens / wall:6.1f} tok/s", flush=True)
    return out


def summarize(tput: dict[int, dict[int, list[float]]]) -> dict:
    """Medians per (pp, chunk), each pp's best chunk by median, and the paired per-round efficiencies
    at the best chunks and at every chunk both ran."""
    med = {pp: {c: statistics.median(v) for c, v in by.items()} for pp, by in tput.items()}
    best = {pp: max(by, key=by.get) for pp, by in med.items()}
    eff_best = ratios(tput[2][best[2]], [2 * t for t in tput[1][best[1]]])
    eff_same = {c: statistics.median(ratios(tput[2][c], [2 * t for t in tput[1][c]])) for c in tput[1]}
    return {"tok_s": tput, "median_tok_s": med, "best_chunk": best, "efficiency_best_rounds": eff_best,
            "efficiency_best": statistics.median(eff_best), "efficiency_same_chunk": eff_same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(ap, num_requests=48)
    ap.add_argument("--chunks", default="128,192,256", help="comma separated, each run at both pp")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    model = smoke_workload(a)
    if a.smoke:
        a.chunks, a.rounds = "8,16", 1
    try:
        chunks = sorted({int(c) for c in a.chunks.split(",")})
    except ValueError:
        ap.error(f"--chunks: {a.chunks!r} is not a comma-separated list of integers")
    if chunks[0] < 1:
        ap.error(f"--chunks: {chunks[0]} is not a positive chunk")
    with contextlib.ExitStack() as stack:
        llms = deployments(stack, model, chunks[-1], a.max_batch_size, "auto", "highest")
        wl = zipf_workload(a.num_requests, a.min_len, a.max_len)
        items = generate_workload(wl, llms[1].source.config.vocab_size)
        tokens = sum(len(it.prompt_token_ids) + it.max_tokens for it in items)
        for pp, llm in llms.items():  # warm: a process's first run faults in the KV cache's pages
            run_once(llm, items, "sarathi", chunks[-1], sampling=wl)
        r = summarize(sweep(llms, items, tokens, chunks, a.rounds, wl))
    for pp, by in r["median_tok_s"].items():
        print(f"pp={pp} median tok/s by chunk: " + ", ".join(f"{c}: {t:.1f}" for c, t in by.items())
              + f"; best {r['best_chunk'][pp]}")
    print(f"efficiency, pp=2 at chunk {r['best_chunk'][2]} against pp=1 at {r['best_chunk'][1]}: "
          f"{r['efficiency_best']:.3f} (rounds: {', '.join(f'{e:.3f}' for e in r['efficiency_best_rounds'])}); "
          "at equal chunks: " + ", ".join(f"{c}: {e:.3f}" for c, e in r["efficiency_same_chunk"].items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"workload": {"num_requests": a.num_requests, "min_len": a.min_len, "max_len": a.max_len},
                       "chunks": chunks, "rounds": a.rounds, "max_batch_size": a.max_batch_size, **r}, f, indent=1)


if __name__ == "__main__":
    main()
