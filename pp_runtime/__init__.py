"""pp_runtime: pipeline-parallel LLM inference with SARATHI chunked prefills and
decode-maximal batching. ``from pp_runtime import LLM, SamplingParams``.

``LLM`` is imported on first use: the plain-Python parts (scheduler, workloads, timing,
reports) load without torch.
"""
from __future__ import annotations

from typing import Any

from pp_runtime.outputs import CompletionOutput, RequestOutput
from pp_runtime.request import Logprob, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pp_runtime.llm import LLM
        return LLM
    raise AttributeError(f"module 'pp_runtime' has no attribute {name!r}")
