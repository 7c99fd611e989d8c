"""Seeded sampling through the whole engine (DESIGN.md §3.3): a request's tokens depend on its
seed only, not on what it was batched with, the chunk size, the batch size or the scheduler."""
from __future__ import annotations

from pathlib import Path

import pytest

from pp_runtime import LLM, SamplingParams
from pp_runtime.kv_cache import BlockManager
from tests.conftest import mixed_prompts

MAX_NEW = 10
SCHEDULERS = ("sarathi", "orca", "prefill_first", "request_level")
PROMPTS = mixed_prompts(seed=3, lengths=(23, 9, 70, 12, 41, 1))
TARGET = PROMPTS[0]  # the request followed across every configuration



def params(seed: int | None, **kw: object) -> SamplingParams:
    base = dict(max_tokens=MAX_NEW, temperature=0.9, top_k=40, top_p=0.95, seed=seed, ignore_eos=True)
    base.update(kw)
    return SamplingParams(**base)


def run(model: Path, prompts: list[list[int]], plist: list[SamplingParams], **kw: object) -> list[list[int]]:
    kw = {"chunk_size": 16, "max_batch_size": 4, **kw}
    with LLM(model=str(model), memory_budget_gb=0.05, **kw) as llm:
        outs = llm.generate(prompts, plist)
    assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


def crowd(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """TARGET in the middle of other requests: seeded, unseeded and greedy ones."""
    others = [params(100 + i) if i % 3 == 0 else params(None) if i % 3 == 1 else params(None, temperature=0.0)
              for i in range(len(PROMPTS) - 1)]
    prompts = PROMPTS[1:3] + [TARGET] + PROMPTS[3:]
    return prompts, others[:2] + [params(seed)] + others[2:]


@pytest.fixture(scope="module")
def alone(hf_models: dict) -> list[int]:
    return run(hf_models["llama"], [TARGET], [params(7)])[0]


def test_same_seed_alone_or_in_a_crowd(hf_models: dict, alone: list[int]) -> None:
    prompts, plist = crowd(7)
    assert run(hf_models["llama"], prompts, plist)[2] == alone


@pytest.mark.parametrize("chunk", (1, 7, 64))
def test_same_seed_any_chunk_size(hf_models: dict, alone: list[int], chunk: int) -> None:
    prompts, plist = crowd(7)
    assert run(hf_models["llama"], prompts, plist, chunk_size=chunk)[2] == alone


@pytest.mark.parametrize("mbs", (1, 2, 8))
def test_same_seed_any_max_batch_size(hf_models: dict, alone: list[int], mbs: int) -> None:
    prompts, plist = crowd(7)
    assert run(hf_models["llama"], prompts, plist, max_batch_size=mbs)[2] == alone


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_same_seed_any_scheduler(hf_models: dict, alone: list[int], scheduler: str) -> None:
    prompts, plist = crowd(7)
    assert run(hf_models["llama"], prompts, plist, scheduler=scheduler)[2] == alone


@pytest.mark.parametrize("prefix_caching", (False, True))
def test_same_seed_under_preemption(hf_models: dict, alone: list[int], prefix_caching: bool) -> None:
    # A KV cache this small forces preemption and recomputation; seeds are per position, so a
    # recomputed request samples what it would have sampled anyway (with prefix caching it may
    # find its own blocks still cached and recompute less).
    prompts, plist = crowd(7)
    with LLM(model=str(hf_models["llama"]), memory_budget_gb=0.05, chunk_size=16, max_batch_size=6,
             kv_admission="optimistic") as llm:
        llm.blocks = BlockManager(8, 16, prefix_caching)  # 128 tokens of KV for 216 tokens of requests
        reqs = [llm.make_request(str(i), p, sp) for i, (p, sp) in enumerate(zip(prompts, plist))]
        outs = llm.run(reqs)
    assert reqs[2].num_preemptions > 0  # the followed request itself was dropped and recomputed
    assert all(o.finish_reason == "length" for o in outs)
    assert outs[2].token_ids == alone


def test_different_seeds_differ(hf_models: dict, alone: list[int]) -> None:
    outs = run(hf_models["llama"], [TARGET] * 4, [params(s) for s in (7, 8, 9, 10)])
    assert outs[0] == alone  # the same prompt twice in one batch, same seed: same tokens
    assert len({tuple(o) for o in outs}) == 4


def test_sampling_is_not_greedy(hf_models: dict, alone: list[int]) -> None:
    greedy = run(hf_models["llama"], [TARGET], [params(7, temperature=0.0)])[0]
    assert alone != greedy


def test_top_k_1_is_greedy(hf_models: dict) -> None:
    prompts = PROMPTS[:4]
    greedy = run(hf_models["llama"], prompts, [params(None, temperature=0.0)] * 4)
    for seed in (None, 1, 2):
        assert run(hf_models["llama"], prompts, [params(seed, temperature=1.5, top_k=1)] * 4) == greedy


def test_unseeded_requests_follow_engine_seed(hf_models: dict) -> None:
    # Without a request seed the engine seed decides: the same run twice gives the same tokens.
    prompts = PROMPTS[:3]
    a = run(hf_models["llama"], prompts, [params(None)] * 3, seed=1)
    assert run(hf_models["llama"], prompts, [params(None)] * 3, seed=1) == a
    assert run(hf_models["llama"], prompts, [params(None)] * 3, seed=2) != a


def test_every_bit_of_a_seed_counts() -> None:
    """Seeds 2^62 apart drew the same tokens (the per-token seed was taken mod 2^62)."""
    from pp_runtime.scheduler import sample_seed
    for base in (0, 1, 12345):
        seeds = {sample_seed(s, pos) for s in (base, base + 2 ** 62, base + 2 ** 63, -base - 1) for pos in (0, 7)}
        assert len(seeds) == 8 and all(0 <= s < 2 ** 62 for s in seeds)


def test_unseeded_requests_do_not_draw_what_small_seeds_do(hf_models: dict) -> None:
    # The first two requests of a run, unseeded, beside the same prompt seeded 0 and 1: each
    # draws its own tokens (the first unseeded one and seed 0 used to share one stream).
    outs = run(hf_models["llama"], [TARGET] * 4, [params(None), params(None), params(0), params(1)], seed=0)
    assert len({tuple(o) for o in outs}) == 4
