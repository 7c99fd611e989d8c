"""JSONL request and result lines (DESIGN.md §3.3).

A malformed line or a bad field never stops the run: it becomes a request that is already
finished with ``finish_reason: "error"`` and a message naming the problem (and the line).
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
from collections import Counter
from dataclasses import dataclass

from pp_runtime.request import SamplingParams

SAMPLING_FIELDS = ("n", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "stop",
                   "include_stop_str_in_output", "logprobs", "min_tokens", "presence_penalty", "frequency_penalty",
                   "repetition_penalty")
KNOWN_FIELDS = frozenset(("id", "prompt_token_ids", "prompt") + SAMPLING_FIELDS)


@dataclass
class ParsedLine:
    request_id: str
    prompt: list[int] | str | None
    params: SamplingParams | None
    error: str | None = None


def _reject_constant(name: str) -> float:
    # Python's json accepts NaN and Infinity, which are not JSON and make no sampling value.
    raise ValueError(f"{name} is not valid JSON")


def parse_line(line: str | bytes, lineno: int, defaults: SamplingParams | None = None) -> ParsedLine:
    try:
        return _parse_line(line, lineno, defaults)
    except RecursionError:  # "[[[[…" a thousand deep: the decoder (or a repr of what it made) gives up
        return ParsedLine(f"line{lineno}", None, None, f"line {lineno}: malformed JSON (nested too deeply)")


def _parse_line(line: str | bytes, lineno: int, defaults: SamplingParams | None) -> ParsedLine:
    rid = f"line{lineno}"
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8-sig")  # -sig: a byte-order mark on line 1 is not an error
        except UnicodeDecodeError as e:
            return ParsedLine(rid, None, None, f"line {lineno}: not UTF-8 text ({e.reason} at byte {e.start})")
    try:
        obj = json.loads(line, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        return ParsedLine(rid, None, None, f"line {lineno}: malformed JSON ({e.msg}, column {e.colno})")
    except ValueError as e:
        return ParsedLine(rid, None, None, f"line {lineno}: malformed JSON ({e})")
    if not isinstance(obj, dict):
        return ParsedLine(rid, None, None, f"line {lineno}: expected a JSON object, got {type(obj).__name__}")
    if obj.get("id") is not None:  # echoed as a string; null or absent: the line's own name
        rid = str(obj["id"])
    unknown = sorted(set(obj) - KNOWN_FIELDS)
    if unknown:
        print(f"warning: line {lineno} ({rid}): ignoring unknown fields {', '.join(unknown)}", file=sys.stderr)
    if "prompt_token_ids" in obj and "prompt" in obj:
        print(f"warning: line {lineno} ({rid}): both prompt_token_ids and prompt given: using prompt_token_ids",
              file=sys.stderr)
    if "prompt_token_ids" in obj:
        prompt = obj["prompt_token_ids"]  # its items are checked against the vocabulary by LLM.make_request
        if not isinstance(prompt, list):  # a string here must not be taken for prompt text
            return ParsedLine(rid, None, None,
                              f"line {lineno}: prompt_token_ids must be a list of integers, got {type(prompt).__name__}")
    elif isinstance(obj.get("prompt"), str):
        prompt = obj["prompt"]
    elif "prompt" in obj:
        return ParsedLine(rid, None, None, f"line {lineno}: prompt must be text, got {type(obj['prompt']).__name__}")
    else:
        return ParsedLine(rid, None, None, f"line {lineno}: needs prompt_token_ids (a list of ints) or prompt (text)")
    base = defaults or SamplingParams()
    kwargs = {f: getattr(base, f) for f in SAMPLING_FIELDS}
    # null is "not given" (the default), as OpenAI-style clients send it
    kwargs.update({f: obj[f] for f in SAMPLING_FIELDS if obj.get(f) is not None})
    error = _field_error(kwargs)
    if error:
        return ParsedLine(rid, prompt, None, f"line {lineno}: {error}")
    try:
        params = SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        return ParsedLine(rid, prompt, None, f"line {lineno}: {e}")
    return ParsedLine(rid, prompt, params)


def _field_error(kwargs: dict) -> str | None:
    """Checks SamplingParams leaves to its callers: JSON types it would coerce or misreport."""
    stops = kwargs["stop_token_ids"]
    if not isinstance(stops, (list, tuple, type(None))):  # a string would be iterated
        return f"stop_token_ids must be a list of integers, got {stops!r}"
    t = kwargs["temperature"]
    if isinstance(t, float) and not math.isfinite(t):  # 1e999 parses as inf: sampling would be uniform
        return f"temperature must be a finite number ≥ 0, got {t!r}"
    return None


def read_requests(path: str, defaults: SamplingParams | None = None) -> list[ParsedLine]:
    """The requests of a JSONL file ("-": standard input), one ParsedLine per non-blank line."""
    # Bytes, not text: one line that is not UTF-8 becomes an error line instead of stopping the run.
    with contextlib.nullcontext(sys.stdin.buffer) if path == "-" else open(path, "rb") as f:
        lines = [parse_line(line, i, defaults) for i, line in enumerate(f, 1) if line.strip()]
    # results keep input order, so duplicates lose nothing, but matching by id would be ambiguous
    counts = Counter(x.request_id for x in lines)
    dups = [rid for rid, n in counts.items() if n > 1]
    if dups:
        print(f"warning: {len(dups)} request ids appear more than once (first: {dups[0]!r}); "
              "results stay in input order", file=sys.stderr)
    return lines


def write_results(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
