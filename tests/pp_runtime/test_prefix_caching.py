"""Prefix caching end to end (``LLM(enable_prefix_caching=True)``): prompts that share whole
blocks skip their prefill and still give transformers' greedy tokens, at pp 1 and 2, chunked or
not, within a run, across runs, and when the cache must evict; ``reset_prefix_cache`` forgets."""
from __future__ import annotations

import pytest
import torch

from pp_runtime import LLM, SamplingParams
from tests.conftest import hf_greedy

MAX_NEW = 8
BLOCK = 16
PARAMS = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


def shared_prompts(seed: int = 0) -> list[list[int]]:
    """A 40-token "system prompt" (two whole blocks and a part) under six different tails, one
    prompt twice, one that is the system prompt alone, one a block plus a token."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, 256, (40,), generator=g).tolist()
    tails = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (9, 30, 1, 17)]
    return [system + t for t in tails] + [system + tails[0], system, system[:BLOCK + 1]]


@pytest.fixture(scope="module")
def reference(hf_models: dict) -> tuple[list[list[int]], list[list[int]]]:
    prompts = shared_prompts()
    return prompts, hf_greedy(hf_models["llama"], prompts, MAX_NEW)


def cached_tokens(prompt: list[int]) -> int:
    """What a prompt can find: its whole blocks, less the block of its last token."""
    return (len(prompt) - 1) // BLOCK * BLOCK


@pytest.mark.parametrize("pp", (1, 2))
@pytest.mark.parametrize("scheduler, chunk", [("sarathi", 7), ("sarathi", 64), ("orca", 256)])
def test_shared_prefixes_give_transformers_tokens(hf_models: dict, reference: tuple, pp: int, scheduler: str,
                                                  chunk: int) -> None:
    prompts, expected = reference
    with LLM(model=str(hf_models["llama"]), pp=pp, launcher="local", scheduler=scheduler, chunk_size=chunk,
             max_batch_size=2, memory_budget_gb=0.05, enable_prefix_caching=True) as llm:
        outs = llm.generate(prompts, PARAMS)
        computed = sum(mb.prefill_tokens for mb in llm.engine.history)
    assert [o.token_ids for o in outs] == expected
    hits = [o.num_cached_tokens for o in outs]
    assert sum(hits) > 0 and all(h % BLOCK == 0 and h <= cached_tokens(p) for h, p in zip(hits, prompts))
    assert computed == sum(len(p) for p in prompts) - sum(hits), "cached tokens are not computed again"


def test_a_second_run_finds_every_whole_block(hf_models: dict, reference: tuple) -> None:
    prompts, expected = reference
    with LLM(model=str(hf_models["llama"]), chunk_size=32, max_batch_size=4, memory_budget_gb=0.05,
             enable_prefix_caching=True) as llm:
        llm.generate(prompts, PARAMS)
        again = llm.generate(prompts, PARAMS)
        llm.reset_prefix_cache()
        cold = llm.generate(prompts[:1], PARAMS)
    assert [o.token_ids for o in again] == expected
    assert [o.num_cached_tokens for o in again] == [cached_tokens(p) for p in prompts]
    assert cold[0].num_cached_tokens == 0 and cold[0].token_ids == expected[0]


@pytest.mark.parametrize("kw, on", [({}, True), ({"enable_prefix_caching": False}, False)])
def test_on_by_default_off_when_asked(hf_models: dict, reference: tuple, kw: dict, on: bool) -> None:
    prompts, expected = reference
    with LLM(model=str(hf_models["llama"]), chunk_size=32, memory_budget_gb=0.05, **kw) as llm:
        llm.generate(prompts, PARAMS)
        again = llm.generate(prompts, PARAMS)
    assert [o.token_ids for o in again] == expected
    assert all((o.num_cached_tokens > 0) == on for o in again)


def test_eviction_under_a_small_cache_changes_no_token(hf_models: dict) -> None:
    """Many prefixes through a cache of a few dozen blocks: cached blocks are evicted and reused
    (for other content) while the runs go on, and every prompt still gets its own tokens."""
    g = torch.Generator().manual_seed(1)
    systems = [torch.randint(3, 256, (48,), generator=g).tolist() for _ in range(6)]
    prompts = [s + torch.randint(3, 256, (5 + i,), generator=g).tolist() for i, s in enumerate(systems * 2)]
    expected = hf_greedy(hf_models["llama"], prompts, MAX_NEW)
    kw = dict(model=str(hf_models["llama"]), chunk_size=16, max_batch_size=3, max_model_len=128,
              memory_budget_gb=0.0009)
    with LLM(**kw, enable_prefix_caching=True) as llm:
        blocks = llm.blocks.num_blocks
        outs = [llm.generate([p], PARAMS)[0] for p in prompts]  # one at a time: the cache turns over
    assert blocks * BLOCK < sum(len(p) + MAX_NEW for p in prompts) / 2, "the cache should be too small to keep all"
    assert [o.token_ids for o in outs] == expected
    assert sum(o.num_cached_tokens for o in outs[6:]) < sum(cached_tokens(p) for p in prompts[6:]), \
        "some second visits should miss: their blocks were evicted"


def test_streamed_outputs_say_what_was_cached(hf_models: dict, reference: tuple) -> None:
    prompts, expected = reference
    with LLM(model=str(hf_models["llama"]), pp=2, launcher="local", chunk_size=16, max_batch_size=2,
             memory_budget_gb=0.05, enable_prefix_caching=True) as llm:
        items = list(llm.generate_stream(prompts, PARAMS))
    finals = {o.request_id: o for o in items if o.finished}
    assert [finals[str(i)].token_ids for i in range(len(prompts))] == expected
    assert sum(o.num_cached_tokens for o in finals.values()) > 0
    for o in items:
        assert o.num_cached_tokens == finals[o.request_id].num_cached_tokens


def test_a_run_cut_short_forgets_the_cache(hf_models: dict, reference: tuple,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """An error out of the middle of a run may leave planned blocks unwritten: none stays cached."""
    prompts, _ = reference
    with LLM(model=str(hf_models["llama"]), chunk_size=16, max_batch_size=2, memory_budget_gb=0.05,
             enable_prefix_caching=True) as llm:
        llm.generate(prompts, PARAMS)
        assert llm.blocks.num_cached > 0
        submit, calls = llm.executor.submit, []

        def failing(mb: object) -> None:
            calls.append(mb)
            if len(calls) == 3:
                raise RuntimeError("plan lost")
            submit(mb)
        monkeypatch.setattr(llm.executor, "submit", failing)
        with pytest.raises(RuntimeError, match="plan lost"):
            llm.generate([p[::-1] for p in prompts], PARAMS)
        assert llm.blocks.num_cached == 0


def test_a_conversation_finds_its_earlier_turns_generated_tokens_too(hf_models: dict) -> None:
    """Blocks a decode fills are registered as well: the next turn's prompt (prompt + answer + a new
    message) finds every whole block the first turn computed, its answer's included."""
    first = shared_prompts()[1]
    with LLM(model=str(hf_models["llama"]), chunk_size=32, memory_budget_gb=0.05, enable_prefix_caching=True) as llm:
        answer = llm.generate([first], SamplingParams(max_tokens=30, ignore_eos=True))[0].token_ids
        turn = first + answer + [7, 8, 9]
        out = llm.generate([turn], PARAMS)[0]
    computed = len(first) + len(answer) - 1  # the last answer token was sampled, never fed back
    assert out.num_cached_tokens == computed // BLOCK * BLOCK > len(first)
    assert out.token_ids == hf_greedy(hf_models["llama"], [turn], MAX_NEW)[0]
