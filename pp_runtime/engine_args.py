"""The ``LLM`` keyword arguments, resolved and checked into an ``EngineConfig``.

    cfg, source = build_engine_config(model="smollm2-135m", pp=2, chunk_size=256)

Every bad setting raises ValueError naming it, before any worker starts.
"""
from __future__ import annotations

import numbers
from typing import Sequence

from pp_runtime.config import (CacheConfig, DeviceConfig, EngineConfig, ParallelConfig, SchedulerConfig,
                               check_kv_dtype)
from pp_runtime.field_checks import is_number


def _plain_number(n: object) -> object:
    """A numpy or other Real as int or float (a YAML or numpy loader may give either); else as is,
    for ParallelConfig to reject by name."""
    if isinstance(n, numbers.Real) and not isinstance(n, bool):
        return int(n) if float(n).is_integer() else float(n)
    return n


def build_engine_config(model: str | None = None, pp: int = 1, tp: int = 1, scheduler: str = "sarathi",
                        chunk_size: int = 256, max_batch_size: int | None = None, tile_align: bool = False,
                        dtype: str = "float32", device: str = "cpu", attention: str = "auto", seed: int = 0,
                        block_size: int = 16, memory_budget_gb: float | None = None,
                        max_model_len: int | None = None, partition: Sequence[float] | None = None,
                        threads: int = 0, gguf_weights: str = "native",
                        kv_cache_dtype: str = "auto", matmul_precision: str = "highest",
                        chunk_budget: str = "flops", prefault_kv: bool = False,
                        admission: str = "fcfs", step_costs: Sequence[float] | str = (),
                        enable_prefix_caching: bool = True, cuda_graphs: bool | None = None,
                        kv_admission: str = "optimistic") -> tuple[EngineConfig, object]:
    """Resolve the model and validate every setting; raises ValueError naming the bad one.
    max_batch_size None is kept as 1 here and replaced by the LLM's default (LLM._default_batch); step_costs
    "fit" is kept empty here and fitted once the workers run (pp_runtime.calibration)."""
    if isinstance(step_costs, str) and step_costs != "fit":
        raise ValueError(f"step_costs must be 'fit' or 3 numbers (prompt key, decode row, decode key), got {step_costs!r}")
    from stages.model_source import resolve_model
    source = resolve_model(model)
    mcfg = source.config
    if isinstance(partition, (str, bytes)):  # iterated, "16,14" would be five layer counts
        raise ValueError(f"partition must be a list of layer counts (e.g. [16, 14]), got {partition!r}")
    parallel = ParallelConfig(pp, tp, tuple(_plain_number(n) for n in partition) if partition else None)
    parallel.check_model(mcfg)
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise ValueError("--device cuda requested but no CUDA GPU is available")
    check_kv_dtype(kv_cache_dtype, device, dtype)
    if memory_budget_gb is not None and not (is_number(memory_budget_gb) and memory_budget_gb > 0):
        raise ValueError(f"memory_budget_gb must be a finite number > 0, got {memory_budget_gb!r}")
    budget = None if memory_budget_gb is None and device == "cuda" else \
        int((4.0 if memory_budget_gb is None else memory_budget_gb) * (1 << 30))
    # None means the default; anything else (0 included) is SchedulerConfig's to check by name
    max_len = mcfg.max_len if max_model_len is None else max_model_len
    cfg = EngineConfig(
        model_path=source.path, parallel=parallel,
        scheduler=SchedulerConfig(scheduler, chunk_size, 1 if max_batch_size is None else max_batch_size, tile_align,
                                  max_len, chunk_budget=chunk_budget, admission=admission,
                                  step_costs=() if isinstance(step_costs, str) else step_costs,
                                  kv_admission=kv_admission),
        cache=CacheConfig(block_size, budget, kv_cache_dtype, prefault_kv, enable_prefix_caching),
        device=DeviceConfig(device, dtype, attention, threads, gguf_weights, matmul_precision, cuda_graphs),
        seed=seed)
    if max_len > mcfg.max_position_embeddings:
        raise ValueError(f"max_model_len={max_len} exceeds the model's {mcfg.max_position_embeddings} "
                         "positions (max_position_embeddings)")
    if max_len > mcfg.max_len:
        raise ValueError(f"max_model_len={max_len} exceeds the model's sliding window of {mcfg.sliding_window} "
                         "tokens (sliding_window): attention here is exact within one window only")
    return cfg, source
