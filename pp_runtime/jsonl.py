"""JSONL request and result lines (DESIGN.md §3.3).

A malformed line or a bad field never stops the run: it becomes a request that is already
finished with ``finish_reason: "error"`` and a message naming the problem (and the line).
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from pp_runtime.request import SamplingParams

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos")
KNOWN_FIELDS = frozenset(("id", "prompt_token_ids", "prompt") + SAMPLING_FIELDS)


@dataclass
class ParsedLine:
    request_id: str
    prompt: list[int] | str | None
    params: SamplingParams | None
    error: str | None = None


def parse_line(line: str, lineno: int, defaults: SamplingParams | None = None) -> ParsedLine:
    rid = f"line{lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return ParsedLine(rid, None, None, f"line {lineno}: malformed JSON ({e.msg})")
    if not isinstance(obj, dict):
        return ParsedLine(rid, None, None, f"line {lineno}: expected a JSON object, got {type(obj).__name__}")
    rid = str(obj.get("id", rid))
    unknown = sorted(set(obj) - KNOWN_FIELDS)
    if unknown:
        print(f"warning: line {lineno} ({rid}): ignoring unknown fields {', '.join(unknown)}", file=sys.stderr)
    if "prompt_token_ids" in obj:
        prompt = obj["prompt_token_ids"]
    elif isinstance(obj.get("prompt"), str):
        prompt = obj["prompt"]
    else:
        return ParsedLine(rid, None, None, f"line {lineno}: needs prompt_token_ids (a list of ints) or prompt (text)")
    base = defaults or SamplingParams()
    kwargs = {f: getattr(base, f) for f in SAMPLING_FIELDS}
    kwargs.update({f: obj[f] for f in SAMPLING_FIELDS if f in obj})
    if isinstance(kwargs["stop_token_ids"], list):
        kwargs["stop_token_ids"] = tuple(kwargs["stop_token_ids"])
    if not isinstance(kwargs["ignore_eos"], bool):
        return ParsedLine(rid, prompt, None, f"ignore_eos must be true or false, got {kwargs['ignore_eos']!r}")
    try:
        params = SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        return ParsedLine(rid, prompt, None, str(e))
    return ParsedLine(rid, prompt, params)


def read_requests(path: str, defaults: SamplingParams | None = None) -> list[ParsedLine]:
    with open(path) as f:
        return [parse_line(line, i, defaults) for i, line in enumerate(f, 1) if line.strip()]


def write_results(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
