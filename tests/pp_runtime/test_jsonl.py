"""The JSONL request parser (DESIGN.md §3.3): every bad line becomes an error naming the problem,
never an exception; the checks that need the model (vocabulary, length) run in LLM.make_request
and the scheduler, and are tested end to end at the bottom."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pp_runtime import LLM, SamplingParams
from pp_runtime.jsonl import parse_line, read_requests, write_results


def line(**obj: object) -> str:
    return json.dumps(obj)


def test_full_line() -> None:
    p = parse_line(line(id="r1", prompt_token_ids=[1, 2, 3], max_tokens=5, temperature=0.5, top_p=0.9,
                        top_k=7, seed=3, stop_token_ids=[9, 10], ignore_eos=True), 1)
    assert p.error is None and p.request_id == "r1" and p.prompt == [1, 2, 3]
    assert p.params == SamplingParams(max_tokens=5, temperature=0.5, top_p=0.9, top_k=7, seed=3,
                                     stop_token_ids=(9, 10), ignore_eos=True)


def test_defaults_and_generated_id() -> None:
    p = parse_line(line(prompt_token_ids=[4]), 7)
    assert p.error is None and p.request_id == "line7" and p.params == SamplingParams()
    d = SamplingParams(max_tokens=3, temperature=0.2)
    p = parse_line(line(prompt_token_ids=[4], top_k=2), 1, d)
    assert p.params == SamplingParams(max_tokens=3, temperature=0.2, top_k=2)
    assert parse_line(line(id=17, prompt_token_ids=[4]), 1).request_id == "17"


def test_logprobs_field() -> None:
    assert parse_line(line(prompt_token_ids=[4], logprobs=3), 1).params.logprobs == 3
    assert parse_line(line(prompt_token_ids=[4], logprobs=0), 1).params.logprobs == 0
    assert parse_line(line(prompt_token_ids=[4], logprobs=None), 1).params.logprobs is None  # null: none
    assert parse_line(line(prompt_token_ids=[4]), 1, SamplingParams(logprobs=2)).params.logprobs == 2
    p = parse_line(line(prompt_token_ids=[4], min_tokens=3, presence_penalty=0.5, frequency_penalty=-1,
                        repetition_penalty=1.2), 1).params
    assert (p.min_tokens, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (3, 0.5, -1.0, 1.2)


def test_n_field() -> None:
    assert parse_line(line(prompt_token_ids=[4], n=4, temperature=0.7), 1).params.n == 4
    assert parse_line(line(prompt_token_ids=[4], n=None), 1).params.n == 1  # null: the default
    assert parse_line(line(prompt_token_ids=[4]), 1, SamplingParams(n=2, temperature=1.0)).params.n == 2


def test_text_prompt() -> None:
    p = parse_line(line(id="t", prompt="hello there"), 1)
    assert p.error is None and p.prompt == "hello there"


@pytest.mark.parametrize("fields, message", [
    (dict(max_tokens=0), "max_tokens must be a positive integer, got 0"),
    (dict(max_tokens=-3), "max_tokens must be a positive integer, got -3"),
    (dict(max_tokens=2.0), "max_tokens must be a positive integer, got 2.0"),
    (dict(max_tokens=True), "max_tokens must be a positive integer, got True"),
    (dict(temperature=-0.1), "temperature must be a finite number ≥ 0, got -0.1"),
    (dict(temperature="hot"), "temperature must be a finite number ≥ 0, got 'hot'"),
    (dict(top_p=0), "top_p must be in (0, 1], got 0"),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    (dict(top_p=-0.2), "top_p must be in (0, 1], got -0.2"),
    (dict(top_k=-2), "top_k must be an integer ≥ 0 (0 or -1: off), got -2"),
    (dict(top_k=2.5), "top_k must be an integer ≥ 0 (0 or -1: off), got 2.5"),
    (dict(seed="x"), "seed must be an integer in [-2**63, 2**64), got 'x'"),
    (dict(seed=1.5), "seed must be an integer in [-2**63, 2**64), got 1.5"),
    (dict(seed=2 ** 64), f"seed must be an integer in [-2**63, 2**64), got {2 ** 64}"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list of integers, got 5"),
    (dict(stop_token_ids="ab"), "stop_token_ids must be a list of integers, got 'ab'"),
    (dict(stop_token_ids=[1, "a"]), "stop_token_ids must be integers ≥ 0 (token ids), got [1, 'a']"),
    (dict(stop_token_ids=[-5]), "stop_token_ids must be integers ≥ 0 (token ids), got [-5]"),
    (dict(ignore_eos="yes"), "ignore_eos must be true or false, got 'yes'"),
    (dict(logprobs=-1), "logprobs must be an integer in [0, 20] (alternatives per token) or null, got -1"),
    (dict(logprobs=21), "logprobs must be an integer in [0, 20] (alternatives per token) or null, got 21"),
    (dict(logprobs=True), "logprobs must be an integer in [0, 20] (alternatives per token) or null, got True"),
    (dict(logprobs="5"), "logprobs must be an integer in [0, 20] (alternatives per token) or null, got '5'"),
    (dict(min_tokens=17), "min_tokens must be an integer in [0, max_tokens=16], got 17"),
    (dict(frequency_penalty=-2.5), "frequency_penalty must be a number in [-2, 2], got -2.5"),
    (dict(repetition_penalty=-1), "repetition_penalty must be a number > 0 (1: off), got -1"),
    (dict(n=0, temperature=1), "n must be an integer in [1, 1024] (samples of the prompt), got 0"),
    (dict(n="2", temperature=1), "n must be an integer in [1, 1024] (samples of the prompt), got '2'"),
    (dict(n=3), "n must be 1 when sampling is greedy (temperature 0), got n=3"),
])
def test_bad_sampling_values(fields: dict, message: str) -> None:
    p = parse_line(line(id="bad", prompt_token_ids=[1], **fields), 4)
    assert p.request_id == "bad" and p.params is None
    assert p.error == f"line 4: {message}"


def test_stop_strings() -> None:
    p = parse_line(line(id="s", prompt_token_ids=[1], stop=["\n\n", "END"], include_stop_str_in_output=True), 1)
    assert p.error is None and p.params.stop == ("\n\n", "END") and p.params.include_stop_str_in_output
    assert parse_line(line(id="s", prompt_token_ids=[1], stop="END"), 1).params.stop == ("END",)
    for bad in ([""], [3], {"a": 1}, 5):
        p = parse_line(line(id="s", prompt_token_ids=[1], stop=bad), 2)
        assert p.error == f"line 2: stop must be a string or a list of non-empty strings, got {bad!r}"


def test_vllm_spellings_of_the_defaults_are_taken() -> None:
    """top_k -1 (vLLM's "off" before 0) and null for any field (as OpenAI-style clients send a
    field left unset) mean what the defaults do."""
    p = parse_line(line(id="v", prompt_token_ids=[1], top_k=-1, stop_token_ids=None), 1)
    assert p.error is None and p.params == SamplingParams()
    nulls = {f: None for f in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos")}
    p = parse_line(line(id="n", prompt_token_ids=[1], **nulls), 1, SamplingParams(max_tokens=7))
    assert p.error is None and p.params == SamplingParams(max_tokens=7)
    with pytest.raises(TypeError):  # by name only: older vLLM read SamplingParams(2) as n=2
        SamplingParams(2)


def test_sampling_params_take_numpy_scalars_and_check_ignore_eos() -> None:
    import numpy as np
    p = SamplingParams(max_tokens=np.int64(3), temperature=np.float32(0.5), seed=np.int64(7),
                       stop_token_ids=np.array([29, 30]), top_k=np.int32(5))
    assert p == SamplingParams(max_tokens=3, temperature=0.5, seed=7, stop_token_ids=(29, 30), top_k=5)
    assert all(type(v) in (int, float) for v in (p.max_tokens, p.temperature, p.seed, p.top_k, *p.stop_token_ids))
    with pytest.raises(ValueError, match="ignore_eos must be true or false, got 'false'"):
        SamplingParams(ignore_eos="false")  # truthy: it would have ignored EOS


@pytest.mark.parametrize("text, message", [
    ('{"id": "x", "prompt_token_ids": [1, 2', "line 3: malformed JSON"),
    ("not json at all", "line 3: malformed JSON"),
    ('{"prompt_token_ids": [1], "temperature": NaN}', "line 3: malformed JSON (NaN is not valid JSON)"),
    ('{"prompt_token_ids": [1], "top_p": Infinity}', "line 3: malformed JSON (Infinity is not valid JSON)"),
    ("[1, 2, 3]", "line 3: expected a JSON object, got list"),
    ('"just a string"', "line 3: expected a JSON object, got str"),
    ('{"id": "x"}', "line 3: needs prompt_token_ids (a list of ints) or prompt (text)"),
    ('{"id": "x", "prompt": 5}', "line 3: prompt must be text, got int"),
    (b'{"id": "\xff"}', "line 3: not UTF-8 text"),
])
def test_malformed_lines_name_the_line(text: str | bytes, message: str) -> None:
    p = parse_line(text, 3)
    assert p.params is None and p.error.startswith(message)


@pytest.mark.parametrize("value, kind", [("1 2 3", "str"), (5, "int"), (None, "NoneType"), ({"a": 1}, "dict")])
def test_prompt_token_ids_must_be_a_list(value: object, kind: str) -> None:
    # in particular a string is not taken for prompt text
    p = parse_line(line(id="p", prompt_token_ids=value), 1)
    assert p.prompt is None and p.error == f"line 1: prompt_token_ids must be a list of integers, got {kind}"


def test_infinite_temperature() -> None:
    # 1e999 is valid JSON and parses as inf: sampling at infinite temperature would be uniform
    p = parse_line('{"id": "hot", "prompt_token_ids": [1], "temperature": 1e999}', 2)
    assert p.params is None and p.error == "line 2: temperature must be a finite number ≥ 0, got inf"


def test_unknown_fields_only_warn(capsys: pytest.CaptureFixture) -> None:
    p = parse_line(line(id="u", prompt_token_ids=[1], colour="blue", best_of=2), 5)
    assert p.error is None and p.params == SamplingParams()
    err = capsys.readouterr().err
    assert "warning: line 5 (u): ignoring unknown fields best_of, colour" in err


def test_both_prompt_fields_warn_and_the_ids_win(capsys: pytest.CaptureFixture) -> None:
    p = parse_line(line(id="b", prompt_token_ids=[1, 2], prompt="hello"), 6)
    assert p.error is None and p.prompt == [1, 2]
    assert "warning: line 6 (b): both prompt_token_ids and prompt given: using prompt_token_ids" in capsys.readouterr().err


def test_read_requests_keeps_line_numbers(tmp_path: Path) -> None:
    f = tmp_path / "in.jsonl"
    # a byte-order mark on line 1 (Windows editors), a blank line, a line that is not UTF-8
    f.write_bytes(b'\xef\xbb\xbf{"prompt_token_ids": [1]}\n\n   \n{"bad\n\xff\xfe\n{"id": "z", "prompt_token_ids": [2]}')
    rows = read_requests(str(f))
    assert [r.request_id for r in rows] == ["line1", "line4", "line5", "z"]
    assert rows[0].error is None
    assert rows[1].error.startswith("line 4: malformed JSON")
    assert rows[2].error.startswith("line 5: not UTF-8 text")
    assert rows[3].error is None and rows[3].prompt == [2]


def test_write_results_round_trip(tmp_path: Path) -> None:
    rows = [{"id": "a", "token_ids": [1], "finish_reason": "length", "error": None},
            {"id": "b", "token_ids": [], "finish_reason": "error", "error": "top_p must be in (0, 1], got 2"}]
    write_results(str(tmp_path / "out.jsonl"), rows)
    assert [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()] == rows


# ---- end to end: parsed lines through LLM.make_request and the scheduler -------------------------
GOOD = [line(id="good1", prompt_token_ids=[5, 6, 7], max_tokens=4),
        line(id="good2", prompt_token_ids=list(range(3, 40)), max_tokens=6, temperature=0.8, seed=1, top_k=5),
        line(id="good3", prompt_token_ids=[9], max_tokens=3, unknown_field=1)]
BAD = {  # the model: 256-token vocabulary, 512 positions
    "empty": (line(id="empty", prompt_token_ids=[]), "empty prompt"),
    "neg": (line(id="neg", prompt_token_ids=[1, -1]), "prompt_token_ids[1] = -1 is outside the vocabulary [0, 256)"),
    "vocab": (line(id="vocab", prompt_token_ids=[256]), "prompt_token_ids[0] = 256 is outside the vocabulary [0, 256)"),
    "float": (line(id="float", prompt_token_ids=[1, 2.5]), "prompt_token_ids[1] = 2.5 is not an integer"),
    "bool": (line(id="bool", prompt_token_ids=[True]), "prompt_token_ids[0] = True is not an integer"),
    "str": (line(id="str", prompt_token_ids="1 2 3"), "prompt_token_ids must be a list of integers, got str"),
    "null": (line(id="null", prompt_token_ids=None), "prompt_token_ids must be a list of integers, got NoneType"),
    "long": (line(id="long", prompt_token_ids=[1] * 500, max_tokens=13),
             "prompt length 500 + max_tokens 13 = 513 exceeds the model's max length 512"),
    "mt0": (line(id="mt0", prompt_token_ids=[1], max_tokens=0), "max_tokens must be a positive integer, got 0"),
    "temp": (line(id="temp", prompt_token_ids=[1], temperature=-1), "temperature must be a finite number ≥ 0, got -1"),
    "topp": (line(id="topp", prompt_token_ids=[1], top_p=0), "top_p must be in (0, 1], got 0"),
    "topk": (line(id="topk", prompt_token_ids=[1], top_k=-2), "top_k must be an integer ≥ 0 (0 or -1: off), got -2"),
    "text": (line(id="text", prompt="hello"), "has no tokenizer"),
    "line": ('{"id": "broken", ', "line 16: malformed JSON"),  # its line number in the file below
}



def test_bad_requests_fail_alone(hf_models: dict, tmp_path: Path) -> None:
    lines = [GOOD[0]] + [text for text, _ in BAD.values()]
    lines[3:3] = [GOOD[1]]
    lines.append(GOOD[2])
    f = tmp_path / "in.jsonl"
    f.write_text("\n".join(lines) + "\n")
    parsed = read_requests(str(f))
    with LLM(model=str(hf_models["llama"]), memory_budget_gb=0.05) as llm:
        outs = llm.run([llm.make_request(p.request_id, p.prompt, p.params, p.error) for p in parsed])
    # Output in input order; the malformed line has no readable id and gets one from its line number.
    assert lines.index(BAD["line"][0]) == 15
    expected_ids = [json.loads(x)["id"] if x != BAD["line"][0] else "line16" for x in lines]
    assert [o.request_id for o in outs] == expected_ids
    by_id = {o.request_id: o for o in outs}
    for name, (_, message) in BAD.items():
        o = by_id["line16" if name == "line" else name]
        assert o.finish_reason == "error" and message in o.error and o.token_ids == []
    for rid, n in (("good1", 4), ("good2", 6), ("good3", 3)):
        assert by_id[rid].finish_reason == "length" and by_id[rid].error is None
        assert len(by_id[rid].token_ids) == n
