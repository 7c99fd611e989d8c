"""KV admission: the same requests under --kv-admission reserve and optimistic, paired rounds, one process.

    .venv/bin/python benchmarks/kv_admission.py                      # embedded SmolLM2, max_model_len 8192, ~3 min
    .venv/bin/python benchmarks/kv_admission.py --max-model-len 2048 # vs_hf.py's setting
    .venv/bin/python benchmarks/kv_admission.py --smoke --model HF_FOLDER   # tiny sizes (CI smoke test)
    .venv/bin/python benchmarks/kv_admission.py --json out.json --plot out.png

Workload: vs_hf.py's, --num prompts of --min-len to --max-len seeded random tokens, --new-tokens
each (ignore_eos), all arriving at once, on a --memory-budget-gb KV budget at --max-model-len.
"optimistic" runs with its default batch cap, the paper's B (requests of max_model_len the budget
holds) over pp, at most 64; "reserve" admits by each request's own prompt + max_tokens, at most 64.
Per side: total tokens/s ((prompt + generated) / wall), TTFT p50 and p99, the most requests in one
micro-batch, preemptions; the figure is the median of the rounds' ratios. Tokens: the same on both
sides at --matmul-precision highest (checked).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
from pairing import alternating, compare_sides, generate_side, plot_sides  # same directory: run as a script
from prefix_cache import workload  # its prompts with no shared prefix

from pp_runtime import LLM, SamplingParams

SIDES = ("optimistic", "reserve")


def run_side(llm: LLM, prompts: list[list[int]], new_tokens: int) -> dict:
    side, _ = generate_side(llm, prompts, new_tokens)
    history = llm.last_run.engine.history
    return {**side, "widest_batch": max(len(mb.chunks) for mb in history), "micro_batches": len(history),
            "preemptions": sum(r.num_preemptions for r in llm.last_run.requests)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model (default: the embedded SmolLM2-135M)")
    ap.add_argument("--num", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the model's positions (8192)")
    ap.add_argument("--memory-budget-gb", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--matmul-precision", default="highest")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one round")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="tokens/s and TTFT of both sides as a PNG")
    a = ap.parse_args()
    if a.smoke:
        a.num, a.min_len, a.max_len, a.new_tokens, a.rounds, a.chunk = 8, 3, 9, 4, 1, 16
        a.memory_budget_gb = 0.05
    torch.set_num_threads(a.threads)
    kw = dict(model=a.model, chunk_size=a.chunk, threads=a.threads, memory_budget_gb=a.memory_budget_gb,
              max_model_len=a.max_model_len, prefault_kv=not a.smoke, matmul_precision=a.matmul_precision,
              kv_cache_dtype=a.kv_cache_dtype, enable_prefix_caching=False)  # every round: the same prompts
    llms = {side: LLM(**kw, kv_admission=side) for side in SIDES}
    try:
        paper_b = llms["optimistic"].memory.max_batch_b
        prompts = workload(llms["reserve"].source.config.vocab_size, 0, a.num, a.min_len, a.max_len)
        for llm in llms.values():  # warm-up
            llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2))
        rounds: dict[str, list[dict]] = {side: [] for side in SIDES}
        for k, side in alternating(a.rounds, SIDES):
            r = run_side(llms[side], prompts, a.new_tokens)
            rounds[side].append(r)
            print(f"round {k} {side:>10}: {r['tok_s']:.1f} tok/s, TTFT p50 {r['ttft_p50_s']:.3f} s, "
                  f"widest batch {r['widest_batch']}, {r['micro_batches']} micro-batches, "
                  f"{r['preemptions']} preemptions", file=sys.stderr)
    finally:
        for llm in llms.values():
            llm.shutdown()
    same, speedup, ttft, bare = compare_sides(rounds, "optimistic", "reserve")
    if a.matmul_precision == "highest":
        assert same == 1.0, "the admission changed a token"
    result = {"settings": {k: v for k, v in vars(a).items() if k not in ("json", "plot")}, "paper_B": paper_b,
              "rounds": bare, "tok_s_ratio_reserve_optimistic": speedup, "ttft_p50_ratio_reserve_optimistic": ttft,
              "same_tokens_share": same}
    print(f"reserve against optimistic (paper's B = {paper_b}): tokens/s ×{speedup:.2f}, TTFT p50 ×{ttft:.3f} "
          f"(median of {a.rounds} paired rounds); {same:.0%} of requests the same tokens in every run")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    if a.plot:
        plot(result, a.plot)


def plot(result: dict, path: str) -> None:
    s = result["settings"]
    plot_sides(result["rounds"], SIDES, [f"{side}\n(widest batch {result['rounds'][side][0]['widest_batch']})"
                                         for side in SIDES],
               f"{s['num']} prompts of {s['min_len']}-{s['max_len']} tokens + {s['new_tokens']} new; "
               f"max_model_len {s['max_model_len'] or 'model'}, paper's B = {result['paper_B']}", path)


if __name__ == "__main__":
    main()
