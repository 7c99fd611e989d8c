"""Parallel sampling (``SamplingParams.n``, pp_runtime/parallel_sampling.py): sample i of a seeded
request is what the same request with n = 1 and seed + i gives, whatever the scheduler, pp, chunk
and prefix caching; with prefix caching the prompt is prefilled once (the other samples compute
only its last partial block); a stream gives each sample its own items; abort cancels them all."""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from pp_runtime import LLM, CompletionOutput, SamplingParams
from pp_runtime.parallel_sampling import fan_out, group_outputs, per_sample, sample_params
from pp_runtime.request import MAX_N, SEED_RANGE, Request

BLOCK = 16
N = 3


def params(**kw: object) -> SamplingParams:
    return SamplingParams(**{"n": N, "max_tokens": 7, "temperature": 0.9, "top_k": 50, "seed": 11,
                             "ignore_eos": True, **kw})


def prompts() -> list[list[int]]:
    """Distinct first tokens (no prefix shared across requests): 40 tokens (two whole blocks and
    a part), 16 (one block, but its last token must be computed), 5 (no whole block), 33."""
    return [[3 + i + 7 * (k % 29) for k in range(n)] for i, n in enumerate((40, 16, 5, 33))]


def cached_tokens(prompt: list[int]) -> int:
    """What a prompt can find: its whole blocks, less the block of its last token."""
    return (len(prompt) - 1) // BLOCK * BLOCK


# ---- the plain-Python parts ------------------------------------------------------------------
def test_sample_params_add_the_index_to_the_seed() -> None:
    p = params(seed=41)
    assert [sample_params(p, i).seed for i in range(3)] == [41, 42, 43]
    assert all(sample_params(p, i).n == 1 for i in range(3))
    assert sample_params(params(seed=None), 2) == params(seed=None, n=1)  # unseeded: the sequence id decides
    top = SEED_RANGE[1] - 1  # seeds wrap within the range torch takes (its ends meet mod 2^64)
    assert sample_params(params(seed=top), 1).seed == 0 and sample_params(params(seed=top), 2).seed == 1


@pytest.mark.parametrize("kw, message", [
    ({"n": 0}, f"n must be an integer in [1, {MAX_N}]"),
    ({"n": MAX_N + 1}, f"n must be an integer in [1, {MAX_N}]"),
    ({"n": 2.0}, "n must be an integer"),
    ({"n": True}, "n must be an integer"),
    ({"n": 2, "temperature": 0.0}, "n must be 1 when sampling is greedy (temperature 0), got n=2"),
    ({"n": 2, "temperature": 1e-6}, "n must be 1 when sampling is greedy"),
])
def test_bad_n_is_named(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        SamplingParams(**kw)


def fake(rid: str, seq: int, n: int = 1, error: str | None = None) -> Request:
    req = Request(rid, seq, [1, 2, 3], SamplingParams(n=n, temperature=1.0) if n > 1 else SamplingParams())
    if error:
        req.finish("error", error)
    return req


def test_fan_out_puts_each_requests_samples_after_it_and_group_outputs_undoes_it() -> None:
    made: list[tuple[str, int, int | None]] = []

    def fork(req: Request, index: int, p: SamplingParams) -> Request:
        made.append((req.request_id, index, p.n))
        return Request(req.request_id, 100 + len(made), req.prompt_token_ids, p, index=index)

    reqs = [fake("a", 0, 3), fake("b", 1), fake("c", 2, 2, error="bad"), fake("d", 3, 2)]
    out = fan_out(reqs, fork)
    assert [(r.request_id, r.index) for r in out] == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("c", 0), ("c", 1),
                                                     ("d", 0), ("d", 1)]
    assert made == [("a", 1, 1), ("a", 2, 1), ("c", 1, 1), ("d", 1, 1)]  # a failed request too: n outputs
    assert per_sample(["A", "B", "C", "D"], out) == ["A", "A", "A", "B", "C", "C", "D", "D"]
    for r in out:
        r.output_token_ids = [r.seq_id]
        if not r.finished:
            r.finish("length")
    grouped = group_outputs(out)
    assert [o.request_id for o in grouped] == ["a", "b", "c", "d"]
    assert [[c.index for c in o.outputs] for o in grouped] == [[0, 1, 2], [0], [0, 1], [0, 1]]
    assert grouped[0].token_ids == [0] and [c.token_ids for c in grouped[0].outputs] == [[0], [101], [102]]
    assert grouped[2].finish_reason == "error" and grouped[2].outputs[0].error == "bad"


def test_one_sample_still_has_outputs_as_in_vllm() -> None:
    """``outputs[0]`` is the request's own sample (vLLM's ``out.outputs[0].token_ids``), and the
    JSONL line of an n = 1 request is unchanged: no "outputs" in it."""
    req = fake("x", 0)
    req.output_token_ids = [7, 8]
    req.finish("length")
    out = group_outputs([req])[0]
    assert out.outputs == [CompletionOutput(0, [7, 8], "length")]
    assert "outputs" not in out.to_json() and out.to_json()["token_ids"] == [7, 8]


# ---- end to end ------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[(1, True), (2, True), (2, False)],
                ids=["pp1-prefix-caching", "pp2-prefix-caching", "pp2-no-caching"])
def llm(request: pytest.FixtureRequest) -> Iterator[LLM]:
    pp, caching = request.param
    with LLM(model="llama-tiny", pp=pp, launcher="local", chunk_size=8, max_batch_size=4, memory_budget_gb=0.05,
             max_model_len=128, enable_prefix_caching=caching) as m:
        yield m


def one_sample_each(llm: LLM, p: SamplingParams) -> list[list[list[int]]]:
    """[request][sample]: the tokens of n = 1 runs with seed + i."""
    runs = [llm.generate(prompts(), replace(p, n=1, seed=p.seed + i)) for i in range(p.n)]
    return [[run[r].token_ids for run in runs] for r in range(len(prompts()))]


@pytest.mark.parametrize("scheduler, chunk", [("sarathi", 8), ("sarathi", 64), ("orca", 256),
                                                 ("prefill_first", 256), ("request_level", 256)])
def test_sample_i_is_seed_plus_i_and_the_prompt_is_prefilled_once(llm: LLM, scheduler: str, chunk: int) -> None:
    llm.reconfigure(policy=scheduler, chunk_size=chunk)
    llm.reset_prefix_cache()
    p = params()
    outs = llm.generate(prompts(), p)
    computed = sum(mb.prefill_tokens for mb in llm.engine.history)
    seqs = llm.last_run.requests
    assert [[c.token_ids for c in o.outputs] for o in outs] == one_sample_each(llm, p)
    assert all(len({tuple(c.token_ids) for c in o.outputs}) == N for o in outs), "samples drew the same stream"
    assert [[c.index for c in o.outputs] for o in outs] == [list(range(N))] * len(outs)
    assert all(o.token_ids == o.outputs[0].token_ids and o.finish_reason == "length" for o in outs)
    if llm.config.cache.enable_prefix_caching:  # samples 1.. start on sample 0's whole blocks
        hits = [[r.num_cached_tokens for r in seqs if r.request_id == o.request_id] for o in outs]
        assert hits == [[0] + [cached_tokens(q)] * (N - 1) for q in prompts()]
        assert computed == sum(len(q) + (N - 1) * (len(q) - cached_tokens(q)) for q in prompts())
    else:
        assert computed == N * sum(len(q) for q in prompts())


def test_unseeded_samples_differ_and_a_stream_gives_each_its_items(llm: LLM) -> None:
    llm.reconfigure(policy="sarathi", chunk_size=8)
    p = params(seed=None, n=2)
    items = list(llm.generate_stream(prompts()[:2], p, ids=["a", "b"]))
    finals: dict[tuple[str, int], object] = {}
    seen: dict[tuple[str, int], list[int]] = {}
    for it in items:
        key = (it.request_id, it.outputs[0].index)
        assert key not in finals and len(it.outputs) == 1
        assert it.token_ids[:len(seen.get(key, []))] == seen.get(key, [])
        seen[key] = list(it.token_ids)
        if it.finished:
            finals[key] = it
    assert sorted(finals) == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert all(len(f.token_ids) == p.max_tokens for f in finals.values())
    assert finals["a", 0].token_ids != finals["a", 1].token_ids


def test_abort_cancels_every_sample(llm: LLM) -> None:
    llm.reconfigure(policy="sarathi", chunk_size=8)
    stream = llm.generate_stream(prompts()[:2], params(max_tokens=30), ids=["a", "b"])
    finals = {}
    for it in stream:
        if not it.finished and it.request_id == "a" and len(it.token_ids) == 2:
            assert llm.abort("a")
        if it.finished:
            finals[it.request_id, it.outputs[0].index] = it
    assert {k: f.finish_reason for k, f in finals.items()} == {("a", i): "cancelled" for i in range(N)} | \
        {("b", i): "length" for i in range(N)}


def test_a_bad_request_has_its_n_samples_each_with_the_error(llm: LLM) -> None:
    """However it fails (a bad prompt before the run, too long for the model on arrival), a request
    of n samples comes back with n outputs, each naming the problem."""
    outs = llm.generate([[3, 999_999], [3] * 125, [3, 4]], params(max_tokens=7))
    assert [[c.finish_reason for c in o.outputs] for o in outs] == [["error"] * N, ["error"] * N, ["length"] * N]
    assert all(c.error == outs[0].error and "outside the vocabulary" in c.error for c in outs[0].outputs)
    assert all(c.error == outs[1].error and "exceeds the model's max length" in c.error for c in outs[1].outputs)
    assert [len(o.to_json()["outputs"]) for o in outs] == [N, N, N]


def test_requests_not_samples_are_counted(llm: LLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The progress bar counts a request once all its samples finished; the run directory's summary
    counts requests, its results one row each."""
    from pp_runtime import run_loop
    from pp_runtime.rundir import write_run_dir
    seen = {"total": 0, "done": 0}

    class Bar:
        def __init__(self, total: int) -> None:
            seen["total"] = total

        def update(self, k: int) -> None:
            seen["done"] += k

        def close(self) -> None:
            pass

    monkeypatch.setattr(run_loop, "progress_bar", lambda total, enabled: Bar(total))
    llm.generate(prompts(), params(), progress=True)
    assert seen == {"total": len(prompts()), "done": len(prompts())}
    summary = write_run_dir(str(tmp_path / "run"), llm)
    assert summary["num_requests"] == len(prompts()) and summary["prefill_tokens"] == sum(map(len, prompts()))
    rows = [json.loads(x) for x in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert [len(r["outputs"]) for r in rows] == [N] * len(prompts())
