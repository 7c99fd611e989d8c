"""What the driver and a stage worker exchange as they set up: the worker's spec (its model, its
place in the pipeline, its caches) and its memory profile back.

Plain Python, apart from stages/worker.py (torch): a Ray deployment's driver pickles the specs to
its actors and unpickles their profiles without importing torch (tests/stages/test_import_time.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from pp_runtime.config import CacheConfig, DeviceConfig, ParallelConfig
from stages.model_source import ModelSource


@dataclass(frozen=True)
class WorkerSpec:
    source: ModelSource
    stage: int
    tp_rank: int
    parallel: ParallelConfig
    cache: CacheConfig
    device: DeviceConfig


@dataclass(frozen=True)
class MemoryProfile:
    """What the driver needs to size the shared block pool and the paper's B."""

    budget_bytes: int  # M_G
    weight_bytes: int  # M_S
    kv_bytes_per_token: int  # m_kv for this worker's layers and heads
