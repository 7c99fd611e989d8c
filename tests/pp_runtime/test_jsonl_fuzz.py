"""Fuzzing the JSONL request parser (DESIGN.md §3.3) with hypothesis: whatever a line holds —
arbitrary text, bytes, JSON values, request objects with arbitrary field values — ``parse_line``
never raises and returns either sampling parameters or an error message; valid lines round-trip."""
from __future__ import annotations

import json
import math

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pp_runtime.jsonl import KNOWN_FIELDS, ParsedLine, parse_line
from pp_runtime.request import SamplingParams

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12)
field_names = st.sampled_from(sorted(KNOWN_FIELDS)) | st.text(max_size=8)


def check(p: ParsedLine) -> None:
    """Exactly one of: usable parameters, or a non-empty one-line error."""
    assert isinstance(p, ParsedLine) and isinstance(p.request_id, str)
    if p.error is None:
        assert isinstance(p.params, SamplingParams)
        assert isinstance(p.prompt, (list, str))
    else:
        assert p.params is None
        assert isinstance(p.error, str) and p.error.strip()


@FUZZ
@given(st.text())
@example("")
@example("[" * 100_000)  # nesting deep enough to exhaust the JSON decoder's recursion
@example('{"id": ' + "[" * 990 + "]" * 990 + ', "prompt_token_ids": [1]}')  # decodes; its repr recurses
@example('{"prompt_token_ids": [1], "temperature": NaN}')
@example('{"prompt_token_ids": [1], "max_tokens": 1e999}')
def test_any_text_gives_params_or_an_error(text: str) -> None:
    check(parse_line(text, 1))


@FUZZ
@given(st.binary())
@example(b"\xff\xfe{}")
@example(b'\xef\xbb\xbf{"prompt_token_ids": [1]}')
def test_any_bytes_give_params_or_an_error(data: bytes) -> None:
    check(parse_line(data, 1))


@FUZZ
@given(json_values)
def test_any_json_value_gives_params_or_an_error(value: object) -> None:
    check(parse_line(json.dumps(value), 1))


@FUZZ
@given(st.dictionaries(field_names, json_values, max_size=8))
def test_any_request_object_gives_params_or_an_error(obj: dict) -> None:
    p = parse_line(json.dumps(obj), 3)
    check(p)
    # the id echoed as a string; null or absent: the line's own name
    assert p.request_id == (str(obj["id"]) if obj.get("id") is not None else "line3")


valid_params = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 10**6),
    temperature=st.floats(0, 100, allow_nan=False) | st.integers(0, 5),
    top_p=st.floats(1e-6, 1.0, allow_nan=False),
    top_k=st.integers(0, 10**5),
    seed=st.none() | st.integers(-(2**63), 2**63),
    stop_token_ids=st.lists(st.integers(0, 10**6), max_size=5).map(tuple),
    ignore_eos=st.booleans())


@FUZZ
@given(st.text(max_size=20), st.lists(st.integers(0, 10**6), max_size=30) | st.text(max_size=30), valid_params)
def test_valid_lines_round_trip(rid: str, prompt: list[int] | str, params: SamplingParams) -> None:
    obj = {"id": rid, ("prompt" if isinstance(prompt, str) else "prompt_token_ids"): prompt,
           **{f: getattr(params, f) for f in ("max_tokens", "temperature", "top_p", "top_k", "seed",
                                                "ignore_eos")},
           "stop_token_ids": list(params.stop_token_ids)}
    p = parse_line(json.dumps(obj), 9)
    assert p.error is None, p.error
    assert (p.request_id, p.prompt, p.params) == (rid, prompt, params)


@FUZZ
@given(valid_params)
def test_omitted_fields_take_the_defaults(defaults: SamplingParams) -> None:
    p = parse_line('{"prompt_token_ids": [5, 6]}', 2, defaults)
    assert (p.request_id, p.prompt, p.params, p.error) == ("line2", [5, 6], defaults, None)
    assert math.isfinite(p.params.temperature)
