"""Single-process throughput of the core engine against the box's fp32 GEMM rate and HF.

    .venv/bin/python benchmarks/core_throughput.py            # embedded SmolLM2-135M, ~3 min
    .venv/bin/python benchmarks/core_throughput.py --smoke    # tiny sizes, seconds

Measured in one run, same threads for everyone:
  * GEMM rate: fp32 matmuls of the model's own linear shapes at 256 tokens (the ceiling);
  * prefill tokens/s at chunk 256 (sarathi) and the FLOP rate it implies (2 × params per token);
  * decode tokens/s at batch 1 and 16;
  * the same three workloads through Hugging Face transformers (forward / generate).
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def gemm_rate(hidden: int, inter: int, q: int, kv: int, tokens: int, reps: int) -> float:
    """FLOP/s of the layer's matmuls (qkv, o, gate+up, down) at ``tokens`` rows."""
    shapes = [(hidden, q + 2 * kv), (q, hidden), (hidden, 2 * inter), (inter, hidden)]
    mats = [(torch.randn(tokens, i), torch.randn(i, o)) for i, o in shapes]
    flops = sum(2 * tokens * i * o for i, o in shapes)
    for a, b in mats:
        a @ b
    t = time.perf_counter()
    for _ in range(reps):
        for a, b in mats:
            a @ b
    return flops * reps / (time.perf_counter() - t)


def ours(model: str | None, prompts: list[list[int]], max_tokens: int, sampling: dict | None = None,
         **engine: object) -> float:
    """Wall seconds for our engine on ``prompts`` (all submitted at once), after a warm-up; greedy
    unless ``sampling`` gives SamplingParams fields (temperature, top_p, top_k, seed)."""
    from pp_runtime import LLM, SamplingParams
    # the embedded model: 2048 of its 8192 positions (the memory plan's B); another model: its own limit
    with LLM(model=model, memory_budget_gb=2.0, max_model_len=2048 if model is None else None, prefault_kv=True,
             enable_prefix_caching=False,  # measured on compute: a fresh engine either way
             **engine) as llm:
        llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2))  # warm-up
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **(sampling or {})))
        dt = time.perf_counter() - t
    assert all(len(o.token_ids) == max_tokens for o in outs)
    return dt


def hf_model(model: str | None, dtype: torch.dtype = torch.float32) -> object:
    """The same checkpoint in transformers (fp32 unless ``dtype``, eval); a random preset has no HF form."""
    import transformers
    from stages.model_source import resolve_model
    src = resolve_model(model)
    if src.kind == "random":
        raise SystemExit("the HF comparison needs a real checkpoint (HF folder or GGUF)")
    path = __import__("pathlib").Path(src.path)
    kw = {"gguf_file": path.name} if src.kind == "gguf" else {}
    folder = path.parent if src.kind == "gguf" else path
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, **kw).eval()


@torch.inference_mode()
def hf_prefill(m: object, prompts: list[list[int]]) -> float:
    m(torch.tensor([prompts[0][:8]]))
    t = time.perf_counter()
    for p in prompts:
        m(torch.tensor([p]), logits_to_keep=1)
    return time.perf_counter() - t


@torch.inference_mode()
def hf_decode(m: object, prompts: list[list[int]], max_tokens: int) -> float:
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    m.generate(ids[:, :4], max_new_tokens=2, do_sample=False, pad_token_id=0)
    t = time.perf_counter()
    m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
               do_sample=False, pad_token_id=0)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    ap.add_argument("--json", default=None, help="write the figures here too")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from stages.model_source import resolve_model
    cfg = resolve_model(a.model).config
    n_prefill, plen, dec_new = (2, 64, 4) if a.smoke else (4, 1024, 32)
    g = torch.Generator().manual_seed(0)
    long = [torch.randint(3, cfg.vocab_size, (plen,), generator=g).tolist() for _ in range(n_prefill)]
    short = [torch.randint(3, cfg.vocab_size, (16,), generator=g).tolist() for _ in range(16)]
    flops_tok = 2 * cfg.params_per_token_flops(lm_head=False)  # prefill positions skip the LM head
    r: dict[str, float] = {"gemm_flops": gemm_rate(cfg.hidden_size, cfg.intermediate_size, cfg.q_size,
                                                    cfg.kv_size, 256, 3 if a.smoke else 20)}
    prefill_s = ours(a.model, long, 1, chunk_size=256, max_batch_size=8)
    r["prefill_tok_s"] = n_prefill * plen / prefill_s
    r["prefill_flops"] = r["prefill_tok_s"] * flops_tok
    r["decode_b1_tok_s"] = dec_new / ours(a.model, short[:1], dec_new, chunk_size=256, max_batch_size=1)
    r["decode_b16_tok_s"] = 16 * dec_new / ours(a.model, short, dec_new, chunk_size=256, max_batch_size=16)
    m = hf_model(a.model)
    r["hf_prefill_tok_s"] = n_prefill * plen / hf_prefill(m, long)
    r["hf_decode_b1_tok_s"] = dec_new / hf_decode(m, short[:1], dec_new)
    r["hf_decode_b16_tok_s"] = 16 * dec_new / hf_decode(m, short, dec_new)
    print(f"threads={a.threads}  layer params/token={cfg.params_per_token_flops(lm_head=False) / 1e6:.1f} M")
    print(f"fp32 GEMM rate (model shapes, 256 rows): {r['gemm_flops'] / 1e9:8.1f} GFLOP/s")
    print(f"prefill, chunk 256: {r['prefill_tok_s']:8.1f} tok/s = {r['prefill_flops'] / 1e9:.1f} GFLOP/s "
          f"({r['prefill_flops'] / r['gemm_flops']:.0%} of GEMM)   HF: {r['hf_prefill_tok_s']:8.1f} tok/s")
    print(f"decode, batch 1:    {r['decode_b1_tok_s']:8.1f} tok/s   HF: {r['hf_decode_b1_tok_s']:8.1f} tok/s")
    print(f"decode, batch 16:   {r['decode_b16_tok_s']:8.1f} tok/s   HF: {r['hf_decode_b16_tok_s']:8.1f} tok/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
