"""Prefix caching on a shared-prompt workload: the same requests with and without
--enable-prefix-caching, in paired rounds, one process.

    .venv/bin/python benchmarks/prefix_cache.py                    # embedded SmolLM2, ~3 min
    .venv/bin/python benchmarks/prefix_cache.py --smoke --model HF_FOLDER   # tiny sizes (CI smoke test)
    .venv/bin/python benchmarks/prefix_cache.py --json out.json --plot out.png
    .venv/bin/python benchmarks/prefix_cache.py --pp 2 --threads 1   # two Ray stages a side, a thread each

Workload: a --shared-token prefix (a system prompt with few-shot examples; seeded random ids,
since the compute does not depend on which tokens) under --num distinct tails of --min-tail to
--max-tail tokens, --new-tokens each (ignore_eos), all arriving at once. Every round runs both
engines (alternating which goes first); the caching engine's cache is reset before each of its
runs, so its first request computes the prefix every round, as the first request after a
server starts would. Per side: total tokens/s ((prompt + generated) / wall), TTFT p50 and p99,
prompt tokens computed, the hit rate; the figure is the median of the rounds' ratios. Tokens:
the same on both sides at --matmul-precision highest (checked); medium and int8 round by a
product's row count, so a tail computed as a chunk of its own can flip a near-tie (the share of
requests with the same tokens is printed).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
from pairing import alternating, compare_sides, generate_side, plot_sides  # same directory: run as a script

from pp_runtime import LLM, SamplingParams

SIDES = ("off", "on")


def workload(vocab: int, shared: int, num: int, min_tail: int, max_tail: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab, (shared,), generator=g).tolist()
    lens = torch.randint(min_tail, max_tail + 1, (num,), generator=g).tolist()
    return [prefix + torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def run_side(llm: LLM, prompts: list[list[int]], new_tokens: int) -> dict:
    llm.reset_prefix_cache()
    side, outs = generate_side(llm, prompts, new_tokens)
    return {**side, "computed_prompt_tokens": sum(mb.prefill_tokens for mb in llm.engine.history),
            "hit_rate": sum(o.num_cached_tokens for o in outs) / sum(map(len, prompts))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model (default: the embedded SmolLM2-135M)")
    ap.add_argument("--shared", type=int, default=512, help="tokens every prompt starts with")
    ap.add_argument("--num", type=int, default=32)
    ap.add_argument("--min-tail", type=int, default=16)
    ap.add_argument("--max-tail", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (Ray actors past 1)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per worker")
    ap.add_argument("--matmul-precision", default="highest")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one round")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="tokens/s and TTFT of both sides as a PNG")
    a = ap.parse_args()
    if a.smoke:
        a.shared, a.num, a.min_tail, a.max_tail, a.new_tokens, a.rounds = 40, 6, 3, 9, 4, 1
    torch.set_num_threads(a.threads)
    kw = dict(model=a.model, pp=a.pp, chunk_size=a.chunk, threads=a.threads, memory_budget_gb=0.05 if a.smoke else 2.0,
              max_model_len=None if a.smoke else 2048, prefault_kv=not a.smoke,
              matmul_precision=a.matmul_precision, kv_cache_dtype=a.kv_cache_dtype)
    if a.pp > 1:  # both sides' stage actors at once: Ray's embedded node would count only the cores
        import ray
        ray.init(address="local", num_cpus=2 * a.pp, include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1", _system_config={"worker_niceness": 0})
    llms = {side: LLM(**kw, enable_prefix_caching=side == "on") for side in SIDES}
    try:
        prompts = workload(llms["on"].source.config.vocab_size, a.shared, a.num, a.min_tail, a.max_tail)
        for llm in llms.values():  # warm-up
            llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2))
        rounds: dict[str, list[dict]] = {side: [] for side in SIDES}
        for k, side in alternating(a.rounds, SIDES):
            r = run_side(llms[side], prompts, a.new_tokens)
            rounds[side].append(r)
            print(f"round {k} {side:>3}: {r['tok_s']:.1f} tok/s, TTFT p50 {r['ttft_p50_s']:.3f} s, "
                  f"computed {r['computed_prompt_tokens']} prompt tokens, hit rate {r['hit_rate']:.3f}",
                  file=sys.stderr)
    finally:
        for llm in llms.values():
            llm.shutdown()
    same, speedup, ttft, bare = compare_sides(rounds, "off", "on")
    if a.matmul_precision == "highest":
        assert same == 1.0, "prefix caching changed a token"
    result = {"settings": {k: v for k, v in vars(a).items() if k not in ("json", "plot")}, "rounds": bare,
              "tok_s_ratio_on_off": speedup, "ttft_p50_ratio_on_off": ttft, "same_tokens_share": same}
    print(f"prefix caching: tokens/s ×{speedup:.2f}, TTFT p50 ×{ttft:.3f} (median of {a.rounds} paired rounds); "
          f"{same:.0%} of requests the same tokens in every run")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    if a.plot:
        plot(result, a.plot)


def plot(result: dict, path: str) -> None:
    s = result["settings"]
    plot_sides(result["rounds"], SIDES, [f"prefix caching {side}" for side in SIDES],
               f"{s['num']} prompts: {s['shared']} shared + {s['min_tail']}-{s['max_tail']} own tokens, "
               f"{s['new_tokens']} new", path)


if __name__ == "__main__":
    main()
