"""Soak: 1,000 JSONL requests of random lengths through a pp=2 Ray pipeline on CPU, one in ten
bad (empty, token ids outside the vocabulary, too long, bad sampling values, not JSON), all at
once into a KV cache small enough to force preemptions (no arrival times: the scheduling, and so
the preemptions, are the same on every run). Every request id comes back exactly once, in order;
each bad one with an error naming its problem; every good one with all its tokens, a sample of
them equal to an in-process reference (greedy and seeded sampling)."""
from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("ray")

from pp_runtime.jsonl import parse_line  # noqa: E402
from pp_runtime.llm import LLM  # noqa: E402

NUM, VOCAB, MAX_LEN, BLOCK = 1000, 512, 256, 16
ENGINE = dict(model="llama-tiny", pp=2, chunk_size=256, block_size=BLOCK, max_model_len=MAX_LEN, threads=1,
              max_batch_size=32)  # not the paper's B (4 here): more requests than the cache holds
# (line maker, the words its error must contain); the good requests are drawn in good_line
BAD = (
    (lambda r, i: {"id": i, "prompt_token_ids": []}, "empty prompt"),
    (lambda r, i: {"id": i, "prompt_token_ids": [5, VOCAB + r.randrange(100)]}, "outside the vocabulary"),
    (lambda r, i: {"id": i, "prompt_token_ids": [-1 - r.randrange(9)]}, "outside the vocabulary"),
    (lambda r, i: {"id": i, "prompt_token_ids": [7] * 200, "max_tokens": 57}, "exceeds the model's max length 256"),
    (lambda r, i: {"id": i, "prompt_token_ids": [7], "temperature": -0.5}, "temperature must be"),
    (lambda r, i: {"id": i, "prompt_token_ids": [7], "top_p": 0}, "top_p must be in (0, 1]"),
    (lambda r, i: {"id": i, "prompt_token_ids": [7], "max_tokens": 0}, "max_tokens must be a positive integer"),
    (lambda r, i: {"id": i, "prompt_token_ids": [7], "top_k": "many"}, "top_k must be an integer"),
    (lambda r, i: {"id": i, "prompt_token_ids": [3, 4.5]}, "is not an integer"),
    (lambda r, i: None, "malformed JSON"),
)


def good_line(r: random.Random, rid: str) -> dict:
    line = {"id": rid, "prompt_token_ids": [r.randrange(VOCAB) for _ in range(r.randint(1, 100))],
            "max_tokens": r.randint(1, 10), "ignore_eos": True}
    if r.random() < 0.3:  # seeded sampling: the same tokens however the requests were batched
        line |= {"temperature": 0.8, "top_k": 50, "seed": r.randrange(1 << 30)}
    return line


def workload(seed: int = 0) -> tuple[list[str], list[str], dict[str, str]]:
    """(JSONL lines, their ids, id -> expected error words for the bad ones).
    A line that is not JSON has no id of its own: it answers as "line<n>" (DESIGN.md §3.3)."""
    r = random.Random(seed)
    lines, ids, bad = [], [], {}
    for i in range(NUM):
        rid = f"q{i}"
        if r.random() < 0.1:
            make, words = BAD[len(bad) % len(BAD)]
            obj = make(r, rid)
            rid = rid if obj is not None else f"line{i + 1}"
            lines.append('{"id": "%s", "prompt_token_ids": [1, 2' % rid if obj is None else json.dumps(obj))
            bad[rid] = words
        else:
            lines.append(json.dumps(good_line(r, rid)))
        ids.append(rid)
    return lines, ids, bad


def test_soak_every_request_comes_back_once() -> None:
    lines, ids, bad = workload()
    assert len(set(ids)) == NUM
    parsed = [parse_line(text, n + 1) for n, text in enumerate(lines)]
    reference = LLM(**ENGINE, launcher="local", memory_budget_gb=0.05)
    plan = reference.memory
    # 64 blocks (1024 tokens) per stage against ~900 requests of up to 110 tokens: preemptions
    budget = (plan.weight_bytes + 64 * BLOCK * plan.kv_bytes_per_token) / (1 << 30)
    try:
        with LLM(**ENGINE, launcher="ray", memory_budget_gb=budget, kv_admission="optimistic") as llm:
            assert llm.memory.num_blocks == 64
            reqs = [llm.make_request(p.request_id, p.prompt, p.params, p.error) for p in parsed]
            outs = llm.run(reqs)
            preemptions = sum(r.num_preemptions for r in llm.last_run.requests)
        assert [o.request_id for o in outs] == ids  # each once, in order
        assert len(bad) >= 80 and preemptions >= 5
        for o, text in zip(outs, lines):
            if o.request_id in bad:
                assert o.finish_reason == "error" and bad[o.request_id] in o.error, (o, text)
                assert o.token_ids == []
            else:
                want = json.loads(text)["max_tokens"]
                assert o.finish_reason == "length" and o.error is None and len(o.token_ids) == want, o
        sample = [i for i, o in enumerate(outs) if o.request_id not in bad][::9]
        ref = reference.run([reference.make_request(parsed[i].request_id, parsed[i].prompt, parsed[i].params)
                             for i in sample])
    finally:
        reference.shutdown()
    assert [o.token_ids for o in ref] == [outs[i].token_ids for i in sample]
    assert any(parsed[i].params.temperature > 0 for i in sample) and any(
        parsed[i].params.temperature == 0 for i in sample)
