"""Parallel sampling (``SamplingParams.n``): n samples of each prompt with the prompt prefilled
once (prefix caching on, the default) against every sample prefilling it (caching off), in
paired rounds, one process.

    .venv/bin/python benchmarks/parallel_sampling.py                  # embedded SmolLM2, ~2 min
    .venv/bin/python benchmarks/parallel_sampling.py --smoke --model HF_FOLDER   # CI smoke test
    .venv/bin/python benchmarks/parallel_sampling.py --json out.json --plot out.png
    .venv/bin/python benchmarks/parallel_sampling.py --hf   # and HF generate's num_return_sequences

Workload: --num prompts of --prompt-len seeded random tokens, each sampled --n times (temperature
0.8, seeded, --new-tokens each, ignore_eos), all arriving at once. Per side: total tokens/s
((the prompts, once each, + every sample's generated tokens) / wall, as a run directory's
summary counts them), TTFT p50, prompt tokens computed; the figure is the median of the rounds'
ratios. Both sides draw the same tokens (checked): a row's products do not depend on its batch
(stages/csrc/gemm_tiles.h). With --hf, each round also
runs Hugging Face ``generate`` on the same prompts with num_return_sequences = n (sampled, the same
temperature, left-padded batch, 2 threads, a fresh process as in vs_hf.py): its total tokens/s,
counted the same way, beside ours.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from pairing import alternating, compare_sides, plot_sides, ratios  # same directory: run as a script
from vs_hf import hf_in_fresh_process

from pp_runtime import LLM, SamplingParams
from pp_runtime.timing import percentile

SIDES = ("off", "on")


def total_tokens(prompts: list[list[int]], n: int, new_tokens: int) -> int:
    """What a side's tokens/s counts: every prompt once, every sample's generated tokens."""
    return sum(map(len, prompts)) + n * new_tokens * len(prompts)


def run_side(llm: LLM, prompts: list[list[int]], n: int, new_tokens: int) -> dict:
    llm.reset_prefix_cache()
    params = SamplingParams(n=n, temperature=0.8, seed=1, max_tokens=new_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t
    tokens = [[c.token_ids for c in o.outputs] for o in outs]
    assert all(len(t) == new_tokens for sample in tokens for t in sample)
    return {"wall_s": wall, "tok_s": total_tokens(prompts, n, new_tokens) / wall,
            "ttft_p50_s": percentile([o.ttft_s for o in outs], 50),
            "computed_prompt_tokens": sum(mb.prefill_tokens for mb in llm.engine.history), "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model (default: the embedded SmolLM2-135M)")
    ap.add_argument("--num", type=int, default=8, help="prompts")
    ap.add_argument("--n", type=int, default=4, help="samples of each prompt")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--hf", action="store_true", help="also HF generate with num_return_sequences = n")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one round")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="tokens/s and TTFT of both sides as a PNG")
    a = ap.parse_args()
    if a.smoke:
        a.num, a.n, a.prompt_len, a.new_tokens, a.rounds = 3, 3, 40, 4, 1
    torch.set_num_threads(a.threads)
    kw = dict(model=a.model, chunk_size=a.chunk, threads=a.threads, memory_budget_gb=0.05 if a.smoke else 2.0,
              max_model_len=None if a.smoke else 2048, prefault_kv=not a.smoke)
    llms = {side: LLM(**kw, enable_prefix_caching=side == "on") for side in SIDES}
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, llms["on"].source.config.vocab_size, (a.prompt_len,), generator=g).tolist()
                   for _ in range(a.num)]
        for llm in llms.values():  # warm-up
            llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2))
        rounds: dict[str, list[dict]] = {side: [] for side in SIDES}
        hf: list[float] = []  # HF's total tokens/s, one a round
        for k, side in alternating(a.rounds, SIDES):
            if a.hf and side == SIDES[k % 2]:  # a round's first side: HF before it, all three back to back
                wall = hf_in_fresh_process(a.model, prompts, a.new_tokens, tuned=False,
                                           sampling={"temperature": 0.8, "n": a.n})
                hf.append(total_tokens(prompts, a.n, a.new_tokens) / wall)
                print(f"round {k}  HF: {hf[-1]:.1f} tok/s (num_return_sequences {a.n})", file=sys.stderr)
            r = run_side(llms[side], prompts, a.n, a.new_tokens)
            rounds[side].append(r)
            print(f"round {k} {side:>3}: {r['tok_s']:.1f} tok/s, TTFT p50 {r['ttft_p50_s']:.3f} s, "
                  f"computed {r['computed_prompt_tokens']} prompt tokens", file=sys.stderr)
    finally:
        for llm in llms.values():
            llm.shutdown()
    same, speedup, ttft, bare = compare_sides(rounds, "off", "on")  # tokens: per prompt, every sample's
    assert same == 1.0, "prefix caching changed a sample's tokens"
    result = {"settings": {k: v for k, v in vars(a).items() if k not in ("json", "plot")}, "rounds": bare,
              "tok_s_ratio_on_off": speedup, "ttft_p50_ratio_on_off": ttft,
              "computed_prompt_tokens": {side: rounds[side][0]["computed_prompt_tokens"] for side in SIDES}}
    if hf:  # ours (prefix caching on, the default) against HF, round by round
        result["hf_tok_s"] = hf
        result["tok_s_ratio_on_hf"] = statistics.median(ratios([r["tok_s"] for r in rounds["on"]], hf))
        print(f"against HF generate (num_return_sequences {a.n}): ×{result['tok_s_ratio_on_hf']:.2f} tokens/s "
              f"(median of {a.rounds} rounds)")
    print(f"n = {a.n}, prompt prefilled once: tokens/s ×{result['tok_s_ratio_on_off']:.2f}, TTFT p50 "
          f"×{result['ttft_p50_ratio_on_off']:.3f} (median of {a.rounds} paired rounds); prompt tokens computed "
          f"{result['computed_prompt_tokens']['off']} → {result['computed_prompt_tokens']['on']}; the same tokens")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    if a.plot:
        s = result["settings"]
        plot_sides(rounds, SIDES, ["off: every sample prefills", "on: the prompt once"],
                   f"{s['num']} prompts of {s['prompt_len']} tokens, n = {s['n']} samples of {s['new_tokens']} new",
                   a.plot)


if __name__ == "__main__":
    main()
