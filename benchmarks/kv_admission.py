"""KV admission: the same requests under --kv-admission optimistic (capped at the paper's B, and at
its default cap) and reserve, paired rounds, one process.

    .venv/bin/python benchmarks/kv_admission.py                      # embedded SmolLM2, max_model_len 8192, ~3 min
    .venv/bin/python benchmarks/kv_admission.py --max-model-len 2048 # vs_hf.py's setting
    .venv/bin/python benchmarks/kv_admission.py --workload chat --max-model-len 2048 --memory-budget-gb 0.3  # ~10 min
    .venv/bin/python benchmarks/kv_admission.py --smoke --model HF_FOLDER   # tiny sizes (CI smoke test)
    .venv/bin/python benchmarks/kv_admission.py --json out.json --plot out.png

Workloads, all arriving at once, on a --memory-budget-gb KV budget at --max-model-len:
- random (vs_hf.py's): --num prompts of --min-len to --max-len seeded random tokens, exactly
  --new-tokens each (default 64; ignore_eos): every request uses what reserve sets aside.
- chat: --num chat-templated questions (a topic × a kind of answer: one sentence, a poem, three
  facts, for a child), greedy, up to --new-tokens each (default 512) until EOS: most stop well
  before max_tokens, the room reserve sets aside that they never use.
Prefix caching as --[no-]enable-prefix-caching (default on, as the runtime's; reset before every
run). Sides, each on the same LLM (reconfigured between runs): "optimistic_B" (vLLM's admission with the
count cap the runtime used to default to: the paper's B, requests of max_model_len the budget
holds, over pp, at most 64), "optimistic" (its default cap, 64) and "reserve" (each request's own
prompt + max_tokens set aside: never a preemption; 64). Per side: total tokens/s ((prompt +
generated) / wall), TTFT and request latency p50 and p99, the most requests in one micro-batch,
preemptions, prefill tokens computed (prompts, and preempted requests again); each
figure is the median of the rounds' ratios, reserve against each optimistic side. Tokens: the same
on every side at --matmul-precision highest (checked; a preempted request is recomputed to the
same tokens).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
from pairing import alternating, compare_sides, generate_side, plot_sides  # same directory: run as a script
from prefix_cache import workload  # its prompts with no shared prefix

from pp_runtime import LLM, SamplingParams
from pp_runtime.llm import DEFAULT_MAX_BATCH
from pp_runtime.timing import percentile

SMOKE_BLOCKS = 20  # --smoke --workload chat: fewer than its 8 requests need at once, so optimistic preempts
SIDES = ("optimistic_B", "optimistic", "reserve")
TOPICS = ("the moon", "rivers", "bread", "trains", "the ocean", "music", "winter", "bees", "volcanoes", "chess",
          "coffee", "libraries", "mountains", "bicycles", "clouds", "gardens")
ASKS = ("What is {}? Answer in one sentence.", "Write a short poem about {}.", "Give three facts about {}.",
        "Explain {} to a child.")


def chat_prompts(llm: LLM, num: int) -> list[list[int]]:
    """``num`` chat-templated questions, every kind of answer for a topic before the next topic."""
    texts = [ask.format(topic) for topic in TOPICS for ask in ASKS]
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": texts[i % len(texts)]}])
            for i in range(num)]


def run_side(llm: LLM, prompts: list[list[int]], new_tokens: int, ignore_eos: bool) -> dict:
    llm.reset_prefix_cache()  # every run starts cold: the rounds rerun the same prompts
    side, outs = generate_side(llm, prompts, new_tokens, ignore_eos)
    history = llm.last_run.engine.history
    latency = [o.latency_s for o in outs]
    return {**side, "latency_p50_s": percentile(latency, 50), "latency_p99_s": percentile(latency, 99),
            "max_batch_size": llm.sched_config.max_batch_size,
            "widest_batch": max(len(mb.chunks) for mb in history), "micro_batches": len(history),
            "preemptions": sum(r.num_preemptions for r in llm.last_run.requests),
            # prompts, and the prompt + output of every preempted request again (less its cached blocks)
            "computed_prefill_tokens": sum(mb.prefill_tokens for mb in history),
            "stopped_early": sum(len(o.token_ids) < new_tokens for o in outs)}


def side_config(side: str, llm: LLM) -> dict:
    """What ``reconfigure`` takes for a side (every side names its batch cap, so none is derived)."""
    if side == "optimistic_B":
        return {"kv_admission": "optimistic",
                "max_batch_size": max(1, min(llm.memory.max_batch_b // llm.config.parallel.pp, DEFAULT_MAX_BATCH))}
    return {"kv_admission": side, "max_batch_size": DEFAULT_MAX_BATCH}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model (default: the embedded SmolLM2-135M)")
    ap.add_argument("--workload", choices=("random", "chat"), default="random")
    ap.add_argument("--num", type=int, default=None, help="requests (default 32 random, 64 chat)")
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=None, help="max_tokens (default 64 random, 512 chat)")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the model's positions (8192)")
    ap.add_argument("--memory-budget-gb", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--matmul-precision", default="highest")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                    help="as the runtime's default (a preempted request's computed blocks may still be cached "
                         "when it is recomputed; the chat template's system prompt is shared)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one round")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="tokens/s and TTFT of every side as a PNG")
    a = ap.parse_args()
    chat = a.workload == "chat"
    a.num = (64 if chat else 32) if a.num is None else a.num
    a.new_tokens = (512 if chat else 64) if a.new_tokens is None else a.new_tokens
    if a.smoke:
        a.num, a.min_len, a.max_len, a.rounds, a.chunk = 8, 3, 9, 1, 16
        a.new_tokens, a.memory_budget_gb = (24, 0.109) if chat else (4, 0.05)
        if chat:  # the embedded model: SMOKE_BLOCKS, fewer than 8 requests' prompt + 24 need (preemptions)
            a.max_model_len = 256
    torch.set_num_threads(a.threads)

    def build() -> LLM:
        return LLM(model=a.model, chunk_size=a.chunk, threads=a.threads, memory_budget_gb=a.memory_budget_gb,
                   max_model_len=a.max_model_len, prefault_kv=not a.smoke, matmul_precision=a.matmul_precision,
                   kv_cache_dtype=a.kv_cache_dtype, enable_prefix_caching=a.enable_prefix_caching)
    llm = build()
    if a.smoke and chat and llm.memory.num_blocks != SMOKE_BLOCKS:
        # the weights' bytes depend on the CPU (GGUF blocks are repacked for its kernels): 0.109 GB
        # left 20 blocks on an AVX-512 box and 25 on an AVX2 one, where every request fit at once
        plan, bs = llm.memory, llm.config.cache.block_size
        a.memory_budget_gb = (plan.weight_bytes + (SMOKE_BLOCKS + 0.5) * bs * plan.kv_bytes_per_token) / 2 ** 30
        llm.shutdown()
        llm = build()
    try:
        paper_b = llm.memory.max_batch_b
        prompts = chat_prompts(llm, a.num) if chat else \
            workload(llm.source.config.vocab_size, 0, a.num, a.min_len, a.max_len)
        llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2))  # warm-up
        rounds: dict[str, list[dict]] = {side: [] for side in SIDES}
        for k, side in alternating(a.rounds, SIDES):
            llm.reconfigure(**side_config(side, llm))
            r = run_side(llm, prompts, a.new_tokens, ignore_eos=not chat)
            rounds[side].append(r)
            print(f"round {k} {side:>12}: {r['tok_s']:.1f} tok/s, TTFT p50 {r['ttft_p50_s']:.3f} s, "
                  f"latency p99 {r['latency_p99_s']:.1f} s, widest batch {r['widest_batch']}, "
                  f"{r['micro_batches']} micro-batches, {r['computed_prefill_tokens']} prefill tokens, "
                  f"{r['preemptions']} preemptions, {r['stopped_early']} of {a.num} stopped early", file=sys.stderr)
    finally:
        llm.shutdown()
    ratios = {}
    for base in SIDES[:-1]:  # same (every side's tokens against one reference) and bare: alike each time
        same, speedup, ttft, bare = compare_sides(rounds, base, "reserve")
        ratios[base] = {"tok_s": speedup, "ttft_p50": ttft}
    unused = ("json", "plot") + (("min_len", "max_len") if chat else ())
    result = {"settings": {k: v for k, v in vars(a).items() if k not in unused}, "paper_B": paper_b,
              "rounds": bare, "reserve_over": ratios, "same_tokens_share": same}
    for base, r in ratios.items():
        print(f"reserve against {base} (paper's B = {paper_b}): tokens/s ×{r['tok_s']:.2f}, TTFT p50 "
              f"×{r['ttft_p50']:.3f} (median of {a.rounds} paired rounds)")
    print(f"{same:.0%} of requests the same tokens in every run")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    if a.plot:
        plot(result, a.plot)
    if a.matmul_precision == "highest":  # after the JSON: a long run's figures are kept to look at
        assert same == 1.0, "the admission changed a token"


def plot(result: dict, path: str) -> None:
    s, rounds = result["settings"], result["rounds"]
    names = {"optimistic_B": f"optimistic,\nB cap {rounds['optimistic_B'][0]['max_batch_size']}"}
    labels = [f"{names.get(side, side)}\n(widest batch {rounds[side][0]['widest_batch']})" for side in SIDES]
    what = (f"{s['num']} chat prompts, up to {s['new_tokens']} new until EOS" if s["workload"] == "chat" else
            f"{s['num']} prompts of {s['min_len']}-{s['max_len']} tokens + {s['new_tokens']} new")
    plot_sides(rounds, SIDES, labels, f"{what}; max_model_len {s['max_model_len'] or 'model'}, "
               f"{s['memory_budget_gb']} GB, paper's B = {result['paper_B']}", path)


if __name__ == "__main__":
    main()
