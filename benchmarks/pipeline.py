"""Pipeline parallelism on this box: TTFT of one long chunked prompt at pp=2 vs pp=1, and the
control-plane cost (driver work + plan delivery) as a fraction of step time at pp=2.

    .venv/bin/python benchmarks/pipeline.py            # embedded SmolLM2-135M, ~3 min
    .venv/bin/python benchmarks/pipeline.py --smoke    # llama-tiny, seconds

TTFT: prompt of --prompt-len tokens, chunk --chunk, one output token. pp=2 runs two Ray
workers with one thread each; pp=1 runs in process with 1 and with 2 threads (same cores).
Control plane (the analysis of benchmarks/pp_scaling.py): driver time = scheduling + plan
packing + sending it + postprocess, per step; delivery delay = how long a free worker
waited for a plan that had already been sent (t_ready − max(submit, its previous t_end)), per
micro-batch.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from pp_runtime import LLM, SamplingParams
from pp_scaling import control_plane as control_plane_figures  # same directory: run as a script
from stages.model_source import resolve_model


def ttft(llm: LLM, prompt: list[int], reps: int) -> float:
    llm.generate([prompt[:8]], SamplingParams(max_tokens=1))  # warm-up
    return min(llm.generate([prompt], SamplingParams(max_tokens=1))[0].ttft_s for _ in range(reps))


def control_plane(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    """One run's control-plane figures (pp_scaling.control_plane's analysis), in seconds."""
    llm.executor.drain_timings()
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    wall = time.perf_counter() - t
    c = control_plane_figures(llm, llm.executor.drain_timings())
    step, driver, delivery = (c[k] / 1e3 for k in ("mean_step_ms", "driver_ms_per_mb", "delivery_ms_per_mb"))
    return {"wall_s": wall, "microbatches": c["microbatches"], "mean_step_s": step,
            "driver_s_per_mb": driver, "delivery_s_per_mb": delivery,
            "driver_fraction": driver / step, "delivery_fraction": delivery / step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-len", type=int, default=1536)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    model = "llama-tiny" if a.smoke and a.model is None else a.model
    plen = 200 if a.smoke else a.prompt_len
    # prefault_kv: the KV pages written at start-up, so no measured prompt pays for faulting them in;
    # no prefix caching: each TTFT rep runs the same prompt again
    # (smoke: a tenth of the budget, ample for llama-tiny's prompts, and a tenth of the pages to fault in)
    common = dict(model=model, chunk_size=a.chunk, memory_budget_gb=0.1 if a.smoke else 1.0, prefault_kv=True,
                  max_model_len=2048 if model is None else None,  # another model: its own limit
                  enable_prefix_caching=False)
    g = torch.Generator().manual_seed(0)
    vocab = resolve_model(model).config.vocab_size
    prompt = torch.randint(3, vocab, (plen,), generator=g).tolist()
    r: dict = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        with LLM(**common) as llm:
            r[f"ttft_pp1_t{threads}_s"] = ttft(llm, prompt, a.reps)
    with LLM(pp=2, launcher="ray", threads=1, **common) as llm:
        r["ttft_pp2_t1_s"] = ttft(llm, prompt, a.reps)
        batch = [torch.randint(3, vocab, (64,), generator=g).tolist() for _ in range(16)]
        r["control_plane_pp2"] = control_plane(llm, batch, 8 if a.smoke else 32)
    print(f"TTFT, {plen}-token prompt, chunk {a.chunk}:")
    print(f"  pp=1, 1 thread : {r['ttft_pp1_t1_s']:.3f} s")
    print(f"  pp=1, 2 threads: {r['ttft_pp1_t2_s']:.3f} s")
    print(f"  pp=2, 1 thread per stage (Ray): {r['ttft_pp2_t1_s']:.3f} s   "
          f"speed-up vs pp=1/1 thread {r['ttft_pp1_t1_s'] / r['ttft_pp2_t1_s']:.2f}x, "
          f"vs pp=1/2 threads {r['ttft_pp1_t2_s'] / r['ttft_pp2_t1_s']:.2f}x")
    c = r["control_plane_pp2"]
    print(f"control plane at pp=2 ({c['microbatches']} micro-batches, mean stage step {c['mean_step_s'] * 1e3:.1f} ms):")
    print(f"  driver {c['driver_s_per_mb'] * 1e3:.2f} ms/mb = {c['driver_fraction']:.1%} of step; "
          f"plan delivery to a free worker {c['delivery_s_per_mb'] * 1e3:.2f} ms/mb = {c['delivery_fraction']:.1%}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
