"""Prompt checks: a bad prompt finishes its request with an error naming what is wrong.

    prompts = as_prompts("Hello")                 # ["Hello"]: one text (or one id list) is one prompt
    ids = as_token_list(np.array([1, 2, 3]))      # [1, 2, 3], plain ints
    validate_prompt(ids, vocab_size=49152)        # None when fine, else the error message
    per_prompt_params(prompts, params, ids)       # (request id, params, error) for each prompt
    check_arrivals([0.0, 0.5], num_requests=2)    # [0.0, 0.5]; ValueError naming a bad entry
"""
from __future__ import annotations

import math
import numbers
from typing import Sequence

from pp_runtime.field_checks import is_int
from pp_runtime.request import SamplingParams


def as_prompts(prompts: object) -> list:
    """``generate``'s prompts as a list: one text, or one flat sequence of token ids, is a single
    prompt, as in vLLM (iterated, a text would become a request per character)."""
    if isinstance(prompts, str):
        return [prompts]
    flat = as_token_list(prompts)
    if isinstance(flat, list) and flat and all(is_int(t) for t in flat):
        return [prompts]
    return list(prompts)


def as_token_list(prompt: object) -> object:
    """A numpy array (or anything with ``tolist``) as a plain list, numpy integers as ints; the
    rest as given, for validate_prompt to judge."""
    if hasattr(prompt, "tolist") and not isinstance(prompt, (str, list, tuple)):
        prompt = prompt.tolist()
    if isinstance(prompt, (list, tuple)):
        return [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t for t in prompt]
    return prompt


def validate_prompt(ids: object, vocab_size: int) -> str | None:
    if not isinstance(ids, (list, tuple)):
        return f"prompt_token_ids must be a list of integers, got {type(ids).__name__}"
    if not ids:
        return "empty prompt: prompt_token_ids has no tokens"
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            return f"prompt_token_ids[{i}] = {t!r} is not an integer"
        if not 0 <= t < vocab_size:
            return f"prompt_token_ids[{i}] = {t} is outside the vocabulary [0, {vocab_size})"
    return None


def per_prompt_params(prompts: Sequence[object], params: SamplingParams | Sequence[SamplingParams] | None,
                      ids: Sequence[str] | None) -> list[tuple[str, SamplingParams | None, str | None]]:
    """``generate``'s params and ids, one each per prompt: a count that does not match raises
    ValueError; a params entry that is not SamplingParams becomes that request's error."""
    params = params or SamplingParams()
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    for name, given in (("params", plist), ("ids", ids)):
        if given is not None and len(given) != len(prompts):
            raise ValueError(f"{name} has {len(given)} entries for {len(prompts)} prompts (one each)")
    out = []
    for i in range(len(prompts)):
        bad = None if isinstance(plist[i], SamplingParams) else \
            f"params[{i}] is a {type(plist[i]).__name__}, not SamplingParams"
        out.append((ids[i] if ids else str(i), None if bad else plist[i], bad))
    return out


def check_arrivals(arrivals: Sequence[object], num_requests: int) -> list[float]:
    """Arrival offsets (seconds from the run's start), one per request, as floats. A whole-run
    argument, so a bad one is a ValueError: a NaN would never arrive (the run would spin
    forever), an infinite one neither, and a short list would leave requests without a time."""
    offsets = list(arrivals)
    if len(offsets) != num_requests:
        raise ValueError(f"arrivals has {len(offsets)} entries for {num_requests} requests")
    for i, t in enumerate(offsets):
        if not isinstance(t, numbers.Real) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise ValueError(f"arrivals[{i}] must be a finite number of seconds ≥ 0, got {t!r}")
    return [float(t) for t in offsets]
