"""Logprobs (vLLM's ``SamplingParams.logprobs``): each new token's log-probability and the N
likeliest beside it, against transformers' own log-softmax on random models, greedy and sampled,
for every scheduler and several chunk sizes; asking for them changes no token; streamed and
preempted requests keep one entry a token; JSON rows carry them."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pp_runtime import LLM, Logprob, RequestOutput, SamplingParams
from tests.conftest import PREEMPT_PROMPTS, hf_causal_lm, mixed_prompts, with_and_without_preemption

PROMPTS = mixed_prompts(seed=5, lengths=(23, 9, 70, 1, 41))
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3)
DRAWN = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.7, top_p=0.9, seed=11, logprobs=0)
PARAMS = [GREEDY, DRAWN, GREEDY, DRAWN, replace(GREEDY, logprobs=None)]


def hf_log_softmax(folder: Path, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """(len(tokens), V): transformers' log-softmax at each position that predicted a token."""
    with torch.inference_mode():
        logits = hf_causal_lm(folder)(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    return logits.double().log_softmax(-1)


def assert_match(out: RequestOutput, ref: torch.Tensor, n: int) -> None:
    """One entry a token: the token first with its logprob and rank, then the n likeliest."""
    assert len(out.logprobs) == len(out.token_ids)
    for k, (tok, d) in enumerate(zip(out.token_ids, out.logprobs)):
        assert next(iter(d)) == tok and all(isinstance(v, Logprob) for v in d.values())
        for t, lp in d.items():
            assert lp.logprob == pytest.approx(float(ref[k, t]), abs=1e-4)
        higher = ref[k] > ref[k, tok]
        assert 1 + int((ref[k] > ref[k, tok] + 1e-4).sum()) <= d[tok].rank <= 1 + int(higher.sum()) + 5
        top = sorted((lp.logprob for lp in d.values() if lp.rank <= n), reverse=True)
        assert top == pytest.approx(ref[k].topk(n).values.tolist(), abs=1e-4)
        assert len(d) in (n, n + 1) if n else len(d) == 1


@pytest.fixture(scope="module")
def plain(hf_models: dict) -> list[RequestOutput]:
    """The same requests without logprobs."""
    with LLM(model=str(hf_models["llama"]), memory_budget_gb=0.05, max_batch_size=4) as llm:
        return llm.generate(PROMPTS, [replace(p, logprobs=None) for p in PARAMS])


@pytest.mark.parametrize("arch", ("llama", "qwen2"))
@pytest.mark.parametrize("scheduler, chunk", [("sarathi", 7), ("sarathi", 512), ("orca", 16),
                                               ("prefill_first", 16), ("request_level", 64)])
def test_logprobs_match_transformers(hf_models: dict, plain: list[RequestOutput], arch: str, scheduler: str,
                                     chunk: int) -> None:
    with LLM(model=str(hf_models[arch]), scheduler=scheduler, chunk_size=chunk, max_batch_size=4,
             memory_budget_gb=0.05) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
    if arch == "llama":  # asking for logprobs changes no token, greedy or seeded
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    for out, prompt, p in zip(outs, PROMPTS, PARAMS):
        if p.logprobs is None:
            assert out.logprobs is None and "logprobs" not in out.to_json()
            continue
        assert_match(out, hf_log_softmax(hf_models[arch], prompt, out.token_ids), p.logprobs)
        if p is GREEDY:  # the argmax: rank 1
            assert all(d[t].rank == 1 for t, d in zip(out.token_ids, out.logprobs))


def test_streamed_outputs_carry_the_logprobs_so_far(hf_models: dict) -> None:
    with LLM(model=str(hf_models["llama"]), memory_budget_gb=0.05, max_batch_size=4) as llm:
        whole = llm.generate(PROMPTS, PARAMS)
        for item in llm.generate_stream(PROMPTS, PARAMS):
            i = int(item.request_id)
            if PARAMS[i].logprobs is None:
                assert item.logprobs is None
            else:
                assert len(item.logprobs) == len(item.token_ids)
                assert item.logprobs == whole[i].logprobs[:len(item.token_ids)]


def test_a_preempted_request_keeps_one_entry_a_token(hf_models: dict) -> None:
    """Recomputed after a preemption, a request samples nothing again for the tokens it has."""
    plist = [replace(GREEDY if i % 2 else DRAWN, max_tokens=10) for i in range(len(PREEMPT_PROMPTS))]
    whole, outs = with_and_without_preemption(hf_models["llama"], plist)
    for out, w in zip(outs, whole):
        assert out.token_ids == w.token_ids and len(out.logprobs) == len(out.token_ids)
        assert [list(d) for d in out.logprobs] == [list(d) for d in w.logprobs]
        assert [v.logprob for d in out.logprobs for v in d.values()] == pytest.approx(
            [v.logprob for d in w.logprobs for v in d.values()], abs=1e-5)


def test_json_rows_carry_them() -> None:
    out = RequestOutput("r", [1], [5, 6], "length", logprobs=[{5: Logprob(-0.5, 1)},
                                                              {6: Logprob(-2.0, 3), 7: Logprob(-0.1, 1)}])
    assert out.to_json()["logprobs"] == [[{"token_id": 5, "logprob": -0.5, "rank": 1}],
                                         [{"token_id": 6, "logprob": -2.0, "rank": 3},
                                          {"token_id": 7, "logprob": -0.1, "rank": 1}]]
