"""pp_runtime: pipeline-parallel LLM inference with SARATHI chunked prefills and
decode-maximal batching. ``from pp_runtime import LLM, SamplingParams``."""
from pp_runtime.llm import LLM
from pp_runtime.request import RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
