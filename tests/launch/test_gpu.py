"""CUDA paths: the same code as the CPU tests with device cuda, NCCL and the xformers backend.
Marked ``gpu(n)`` and skipped when fewer than n GPUs exist (never needed by CI)."""
from __future__ import annotations

import pytest
import torch

from pp_runtime import LLM, SamplingParams
from tests.conftest import hf_greedy, mixed_prompts

PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.mark.gpu(1)
@pytest.mark.parametrize("scheduler", ("sarathi", "orca"))
@pytest.mark.parametrize("attention", ("xformers", "torch"))
def test_cuda_matches_hf(hf_models: dict, scheduler: str, attention: str) -> None:
    from stages.attention.xformers_backend import xformers_unusable
    if attention == "xformers" and xformers_unusable(torch.float32):
        pytest.skip(xformers_unusable(torch.float32))  # e.g. a wheel built for another torch
    prompts = mixed_prompts()
    expected = hf_greedy(hf_models["llama"], prompts, 10)
    with LLM(model=str(hf_models["llama"]), device="cuda", attention=attention, scheduler=scheduler,
             chunk_size=7, memory_budget_gb=2.0) as llm:
        assert llm.workers_info()[0]["attention"] == attention
        assert [o.token_ids for o in llm.generate(prompts, PARAMS)] == expected


@pytest.mark.gpu(1)
def test_cuda_fp8_kv_cache(hf_models: dict) -> None:
    """--kv-cache-dtype fp8 on CUDA: twice the blocks of a bf16 cache in the same budget, every
    request to its end (the kernels' numerics: tests/stages/test_triton_*.py)."""
    prompts, blocks = mixed_prompts(), {}
    for kv in ("auto", "fp8"):
        with LLM(model=str(hf_models["llama"]), device="cuda", dtype="bfloat16", attention="torch",
                 kv_cache_dtype=kv, chunk_size=7, memory_budget_gb=2.0) as llm:
            assert llm.workers_info()[0]["kv_dtype"] == ("bfloat16" if kv == "auto" else "float8_e4m3fn")
            outs = llm.generate(prompts, PARAMS)
            assert all(len(o.token_ids) == 10 and o.error is None for o in outs)
            blocks[kv] = llm.memory.num_blocks
    assert blocks["fp8"] >= 2 * blocks["auto"] - 1


@pytest.mark.gpu(2)
@pytest.mark.parametrize("pp,tp", ((2, 1), (1, 2)))
def test_nccl_ray_matches_single_gpu(hf_models: dict, pp: int, tp: int) -> None:
    prompts = mixed_prompts()
    # a TP worker runs eagerly (CUDA graphs are on by default at tp 1 only): so does the reference,
    # since a replay sums a decode's keys in other spans (docs/BENCHMARKS.md, "The third GPU run")
    with LLM(model=str(hf_models["llama"]), device="cuda", chunk_size=7, memory_budget_gb=2.0,
             cuda_graphs=None if tp == 1 else False) as one:
        expected = [o.token_ids for o in one.generate(prompts, PARAMS)]
    with LLM(model=str(hf_models["llama"]), pp=pp, tp=tp, launcher="ray", device="cuda", chunk_size=7,
             memory_budget_gb=2.0) as llm:
        assert [o.token_ids for o in llm.generate(prompts, PARAMS)] == expected


@pytest.mark.gpu(4)
def test_nccl_pp2_tp2(hf_models: dict) -> None:
    prompts = mixed_prompts()
    expected = hf_greedy(hf_models["llama"], prompts, 10)
    with LLM(model=str(hf_models["llama"]), pp=2, tp=2, launcher="ray", device="cuda", chunk_size=5,
             memory_budget_gb=2.0) as llm:
        assert [o.token_ids for o in llm.generate(prompts, PARAMS)] == expected
