"""Greedy tokens equal transformers' generate on random LLaMA, Mistral and Qwen2 models, for
every scheduler and chunk sizes {1, 7, 64, ≥ prompt} on prompts longer and shorter than a chunk."""
from __future__ import annotations

import pytest

from pp_runtime import LLM, SamplingParams
from tests.conftest import ARCHS, hf_greedy, mixed_prompts

MAX_NEW = 12
SCHEDULERS = ("sarathi", "orca", "prefill_first", "request_level")


@pytest.fixture(scope="module")
def references(hf_models: dict) -> dict:
    prompts = mixed_prompts()
    return {arch: (prompts, hf_greedy(hf_models[arch], prompts, MAX_NEW)) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("chunk", (1, 7, 64, 512))
def test_greedy_matches_hf(hf_models: dict, references: dict, arch: str, scheduler: str, chunk: int) -> None:
    prompts, expected = references[arch]
    with LLM(model=str(hf_models[arch]), scheduler=scheduler, chunk_size=chunk, max_batch_size=4,
             memory_budget_gb=0.05) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)


@pytest.mark.parametrize("tile_align", (False, True))
def test_tile_align_matches_hf(hf_models: dict, references: dict, tile_align: bool) -> None:
    prompts, expected = references["llama"]
    with LLM(model=str(hf_models["llama"]), chunk_size=16, max_batch_size=4, tile_align=tile_align,
             memory_budget_gb=0.05, chunk_budget="tokens") as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        history = list(llm.engine.history)
    assert [o.token_ids for o in outs] == expected
    # A batch holding a prefill chunk cut short by the budget used the whole budget: C tokens in
    # all with tile alignment, C prefill tokens (plus the decodes riding along) without.
    cut = [mb for mb in history if any(c.is_prefill and c.sample is None for c in mb.chunks)]
    assert len(cut) >= 5 and any(mb.decode_tokens for mb in cut)
    for mb in cut:
        assert (mb.num_tokens if tile_align else mb.prefill_tokens) == 16
    assert max(mb.num_tokens for mb in history) <= 16 + (0 if tile_align else 3)


def test_flops_chunk_budget_changes_the_chunks_not_the_tokens(hf_models: dict, references: dict) -> None:
    """The default budget cuts a chunk deep into its prompt shorter (its tokens attend to more
    keys) and the greedy tokens stay transformers'; "tokens" fills C with every cut batch."""
    from pp_runtime.chunk_budget import chunk_cost, fits
    prompts, expected = references["llama"]
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(model=str(hf_models["llama"]), chunk_size=16, max_batch_size=4, memory_budget_gb=0.05) as llm:
        assert llm.sched_config.chunk_budget == "flops"
        key_cost = llm.source.config.key_cost
        outs = llm.generate(prompts, params)
        flops = list(llm.engine.history)
        llm.reconfigure(chunk_budget="tokens")
        llm.reset_prefix_cache()  # every prompt cut into chunks again, not found cached
        again = llm.generate(prompts, params)
        tokens = list(llm.engine.history)
    assert [o.token_ids for o in outs] == expected == [o.token_ids for o in again]

    def cut(history: list) -> list:  # batches whose prefill stopped at the budget
        return [mb for mb in history if any(c.is_prefill and c.sample is None for c in mb.chunks)]
    assert all(mb.prefill_tokens == 16 for mb in cut(tokens))
    assert any(mb.prefill_tokens < 16 for mb in cut(flops))
    fresh = chunk_cost(0, 16, key_cost)
    for mb in flops:
        spent = sum(chunk_cost(c.start, c.num_tokens, key_cost) for c in mb.chunks if c.is_prefill)
        assert mb.prefill_tokens <= 16 and (fits(spent, fresh) or mb.prefill_tokens == 1)
