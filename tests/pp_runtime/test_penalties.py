"""vLLM's min_tokens and penalties (presence, frequency, repetition) through the whole engine:
greedy tokens equal transformers' generate (its repetition penalty and min_new_tokens) or a
step-by-step reference on transformers' logits (presence and frequency, which it lacks), for
every scheduler and several chunk sizes; they survive preemption; the plan carries them."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pp_runtime import LLM, SamplingParams
from pp_runtime.batch import LogitsEdit, MicroBatch
from pp_runtime.request import Request
from tests.conftest import PREEMPT_PROMPTS, hf_causal_lm, mixed_prompts, with_and_without_preemption

PROMPTS = mixed_prompts(seed=7, lengths=(23, 9, 70, 1, 41))
MAX_NEW = 10
SCHEDULERS = [("sarathi", 7), ("sarathi", 512), ("orca", 16), ("prefill_first", 16), ("request_level", 64)]


@torch.inference_mode()
def hf_generate(model: object, prompt: list[int], **kw: object) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                         pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def reference_penalised(model: object, prompt: list[int], presence: float, frequency: float) -> list[int]:
    """Greedy on transformers' logits with vLLM's presence and frequency penalties."""
    out: list[int] = []
    for _ in range(MAX_NEW):
        logits = model(torch.tensor([prompt + out])).logits[0, -1].clone()
        for t in set(out):
            logits[t] -= frequency * out.count(t) + presence
        out.append(int(logits.argmax()))
    return out


@pytest.fixture(scope="module")
def references(hf_models: dict) -> dict:
    m = hf_causal_lm(hf_models["llama"])
    return {"repetition": [hf_generate(m, p, repetition_penalty=1.5, eos_token_id=None) for p in PROMPTS],
            "presence_frequency": [reference_penalised(m, p, 1.5, 0.75) for p in PROMPTS]}


@pytest.mark.parametrize("scheduler, chunk", SCHEDULERS)
def test_penalties_match_the_references(hf_models: dict, references: dict, scheduler: str, chunk: int) -> None:
    base = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(model=str(hf_models["llama"]), scheduler=scheduler, chunk_size=chunk, max_batch_size=4,
             memory_budget_gb=0.05) as llm:
        plain = [o.token_ids for o in llm.generate(PROMPTS, base)]
        rep = [o.token_ids for o in llm.generate(PROMPTS, replace(base, repetition_penalty=1.5))]
        pf = [o.token_ids for o in llm.generate(PROMPTS, replace(base, presence_penalty=1.5, frequency_penalty=0.75))]
    assert rep == references["repetition"] and rep != plain
    assert pf == references["presence_frequency"] and pf != plain


def test_min_tokens_as_transformers_min_new_tokens(hf_models: dict) -> None:
    """A stop id the greedy output makes early: min_tokens bans it until then, as transformers'
    min_new_tokens does its eos ids, and the output ends where transformers' does."""
    m = hf_causal_lm(hf_models["llama"])
    with LLM(model=str(hf_models["llama"]), chunk_size=16, memory_budget_gb=0.05) as llm:
        plain = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        for prompt, out in zip(PROMPTS, plain):
            stop = out.token_ids[1]
            p = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, stop_token_ids=[stop])
            early = llm.generate([prompt], p)[0]
            assert early.finish_reason == "stop" and early.token_ids == out.token_ids[:out.token_ids.index(stop) + 1]
            for n in (1, 2, 6):
                got = llm.generate([prompt], replace(p, min_tokens=n))[0]
                want = hf_generate(m, prompt, eos_token_id=stop, min_new_tokens=n)
                assert got.token_ids == want, n
                assert stop not in got.token_ids[:n] and (got.finish_reason == "stop") == (stop in got.token_ids)


def test_penalties_survive_preemption(hf_models: dict) -> None:
    plist = [SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.75,
                            repetition_penalty=1.2, min_tokens=i) for i in range(len(PREEMPT_PROMPTS))]
    whole, outs = with_and_without_preemption(hf_models["llama"], plist)
    assert [o.token_ids for o in outs] == [o.token_ids for o in whole]


def test_the_plan_carries_the_edit_and_counts_only_new_tokens() -> None:
    req = Request("r", 0, [5, 6, 5], SamplingParams(max_tokens=9, min_tokens=2, stop_token_ids=[9],
                                                     frequency_penalty=0.5, repetition_penalty=1.1))
    first = req.logits_edit(frozenset({2}))
    assert first == LogitsEdit((2, 9), 0.0, 0.5, 1.1, (), (), tuple({5, 6}))
    req.output_token_ids += [7, 5]
    second = req.logits_edit(frozenset({2}))  # two outputs: min_tokens reached, no ban
    assert second.banned == () and dict(zip(second.output_ids, second.output_counts)) == {7: 1, 5: 1}
    assert set(second.context_ids) == {5, 6, 7}
    req.output_token_ids += [7]
    third = req.logits_edit(frozenset())
    assert dict(zip(third.output_ids, third.output_counts)) == {7: 2, 5: 1}
    assert Request("q", 1, [1], SamplingParams(min_tokens=3, ignore_eos=True)).logits_edit(frozenset({2})) is None
    # through the wire and back
    from pp_runtime.batch import SampleSpec, SeqChunk
    mb = MicroBatch(3, (SeqChunk(0, 3, (7,), (0,), False, SampleSpec(0.0, 1.0, 0, 1, -1, second)),))
    assert MicroBatch.from_wire(mb.to_wire()) == mb


@pytest.mark.parametrize("kw, message", [
    (dict(min_tokens=-1), "min_tokens must be an integer in [0, max_tokens=16], got -1"),
    (dict(min_tokens=17), "min_tokens must be an integer in [0, max_tokens=16], got 17"),
    (dict(presence_penalty=2.5), "presence_penalty must be a number in [-2, 2], got 2.5"),
    (dict(frequency_penalty="x"), "frequency_penalty must be a number in [-2, 2], got 'x'"),
    (dict(repetition_penalty=0), "repetition_penalty must be a number > 0 (1: off), got 0"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty must be a number > 0 (1: off), got nan"),
])
def test_bad_values_name_the_field(kw: dict, message: str) -> None:
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    assert str(e.value) == message
