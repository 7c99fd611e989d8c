"""The user-facing Python API (DESIGN.md §3.2).

    from pp_runtime import LLM, SamplingParams
    llm = LLM(model="smollm2-135m", pp=1, scheduler="sarathi", chunk_size=256)
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=16))
    llm.shutdown()
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from pp_runtime.config import (CacheConfig, DeviceConfig, EngineConfig, ParallelConfig, SchedulerConfig)
from pp_runtime.engine import Engine
from pp_runtime.executor import WorkerError
from pp_runtime.kv_cache import BlockManager
from pp_runtime.request import Request, RequestOutput, SamplingParams
from pp_runtime.scheduler import Scheduler

DEFAULT_MAX_BATCH = 64


@dataclass(frozen=True)
class MemoryPlan:
    """Derived from the workers' memory profiles (the paper's §3: B = ⌊(M_G − M_S)/(L·m_kv)⌋)."""

    num_blocks: int
    max_batch_b: int
    budget_bytes: int
    weight_bytes: int
    kv_bytes_per_token: int
    max_model_len: int

    def describe(self) -> str:
        gib = 1 << 30
        return (f"B = ⌊(M_G − M_S)/(L·m_kv)⌋ = ⌊({self.budget_bytes / gib:.2f} GiB − "
                f"{self.weight_bytes / gib:.3f} GiB) / ({self.max_model_len} × {self.kv_bytes_per_token} B)⌋ "
                f"= {self.max_batch_b}; KV cache: {self.num_blocks} blocks")


def plan_memory(profiles: list, block_size: int, max_model_len: int) -> MemoryPlan:
    """Every stage holds the same block pool, so the tightest worker sets its size."""
    tight = min(profiles, key=lambda p: (p.budget_bytes - p.weight_bytes) / p.kv_bytes_per_token)
    free = tight.budget_bytes - tight.weight_bytes
    num_blocks = max(0, free // (block_size * tight.kv_bytes_per_token))
    return MemoryPlan(num_blocks, max(0, free // (max_model_len * tight.kv_bytes_per_token)),
                      tight.budget_bytes, tight.weight_bytes, tight.kv_bytes_per_token, max_model_len)


def build_engine_config(model: str | None = None, pp: int = 1, tp: int = 1, scheduler: str = "sarathi",
                        chunk_size: int = 256, max_batch_size: int | None = None, tile_align: bool = False,
                        dtype: str = "float32", device: str = "cpu", attention: str = "auto", seed: int = 0,
                        block_size: int = 16, memory_budget_gb: float | None = None,
                        max_model_len: int | None = None, partition: Sequence[int] | None = None,
                        threads: int = 0) -> tuple[EngineConfig, object]:
    """Resolve the model and validate every setting; raises ValueError naming the bad one.
    max_batch_size None is kept as 1 here and replaced once the memory plan gives B."""
    from stages.weights import resolve_model
    source = resolve_model(model)
    mcfg = source.config
    parallel = ParallelConfig(pp, tp, tuple(partition) if partition else None)
    parallel.check_model(mcfg)
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise ValueError("--device cuda requested but no CUDA GPU is available")
    if memory_budget_gb is not None and not memory_budget_gb > 0:
        raise ValueError(f"memory_budget_gb must be > 0, got {memory_budget_gb}")
    budget = None if memory_budget_gb is None and device == "cuda" else \
        int((4.0 if memory_budget_gb is None else memory_budget_gb) * (1 << 30))
    max_len = min(max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
    cfg = EngineConfig(
        model_path=source.path, parallel=parallel,
        scheduler=SchedulerConfig(scheduler, chunk_size, max_batch_size or 1, tile_align, max_len),
        cache=CacheConfig(block_size, budget), device=DeviceConfig(device, dtype, attention, threads), seed=seed)
    return cfg, source


@dataclass
class RunRecord:
    """One ``LLM.run``: its requests, its engine (plans issued, driver stats) and its clock span
    (wall clock for worker timings, perf_counter for request times)."""

    requests: list[Request]
    engine: Engine
    start_wall: float
    end_wall: float
    start: float
    end: float


class LLM:
    def __init__(self, model: str | None = None, pp: int = 1, tp: int = 1, launcher: str | None = None,
                 scheduler: str = "sarathi", chunk_size: int = 256, max_batch_size: int | None = None,
                 tile_align: bool = False, dtype: str = "float32", device: str = "cpu",
                 attention: str = "auto", seed: int = 0, block_size: int = 16,
                 memory_budget_gb: float | None = None, max_model_len: int | None = None,
                 partition: Sequence[int] | None = None, threads: int = 0, verbose: bool = False) -> None:
        self.config, self.source = build_engine_config(
            model, pp, tp, scheduler, chunk_size, max_batch_size, tile_align, dtype, device, attention, seed,
            block_size, memory_budget_gb, max_model_len, partition, threads)
        parallel, max_len = self.config.parallel, self.config.scheduler.max_model_len
        self.launcher = launcher or ("local" if parallel.world_size == 1 else "ray")
        self.executor = _make_executor(self.launcher, self.config, self.source)
        try:
            self.memory = plan_memory(self.executor.memory_profiles(), block_size, max_len)
            if self.memory.num_blocks * block_size < max_len:
                raise ValueError(f"memory budget too small: {self.memory.num_blocks} KV blocks hold "
                                 f"{self.memory.num_blocks * block_size} tokens, one request of max length "
                                 f"{max_len} needs {max_len}")
            mbs = max_batch_size or max(1, min(self.memory.max_batch_b, DEFAULT_MAX_BATCH))
            self.sched_config = SchedulerConfig(scheduler, chunk_size, mbs, tile_align, max_len)
            self.config = replace(self.config, scheduler=self.sched_config)
            self.executor.allocate_cache(self.memory.num_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        if verbose:
            print(self.memory.describe(), file=sys.stderr)
        self._tokenizer = None
        self._next_seq = 0
        self.broken: str | None = None  # set when a worker died: the executor is shut down

    @property
    def tokenizer(self) -> object:
        if self._tokenizer is None:
            from pp_runtime.tokenizer import load_tokenizer
            self._tokenizer = load_tokenizer(self.source.kind, self.source.path)
            if self._tokenizer is None:
                raise ValueError(f"model {self.source.path} has no tokenizer: pass token ids")
        return self._tokenizer

    def reconfigure(self, **changes: object) -> None:
        """Change the driver-side scheduling (policy, chunk_size, max_batch_size, tile_align)
        between runs, keeping the workers and their weights: ``bench`` compares schedulers this way."""
        self.sched_config = replace(self.sched_config, **changes)
        self.config = replace(self.config, scheduler=self.sched_config)

    def workers_info(self) -> list[dict]:
        return self.executor.workers_info()

    def make_request(self, request_id: str, prompt: list[int] | str | None,
                     params: SamplingParams | None, error: str | None = None) -> Request:
        """A Request, or one already finished with an error naming what is wrong with it."""
        seq_id, self._next_seq = self._next_seq, self._next_seq + 1
        ids = prompt
        if error is None and isinstance(prompt, str):
            try:
                ids = self.tokenizer.encode(prompt)
            except ValueError as e:
                error = str(e)
        req = Request(request_id, seq_id, list(ids) if isinstance(ids, (list, tuple)) else [],
                      params or SamplingParams())
        error = error or validate_prompt(ids, self.source.config.vocab_size)
        if error:
            req.finish("error", error)
        return req

    def generate(self, prompts: Sequence[list[int] | str],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 progress: bool = False, ids: Sequence[str] | None = None) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``; bad prompts come back with finish_reason 'error'."""
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        reqs = [self.make_request(ids[i] if ids else str(i), p, plist[i]) for i, p in enumerate(prompts)]
        return self.run(reqs, progress)

    def run(self, reqs: list[Request], progress: bool = False,
            on_finish: Callable[[Request], None] | None = None,
            arrivals: Sequence[float] | None = None) -> list[RequestOutput]:
        """Run prepared requests; ``arrivals`` (seconds from start, one per request) spreads them
        over time, else all arrive at once. The run's record stays in ``self.last_run``."""
        scheduler = Scheduler(self.sched_config, BlockManager(self.memory.num_blocks, self.config.cache.block_size),
                              self.source.config.eos_token_ids, self.config.seed)
        self.engine = Engine(scheduler, self.executor, self.config.parallel.pp)
        self.executor.drain_timings()  # drop records of earlier runs
        bar = _progress(len(reqs), progress)
        bar.update(sum(r.finished for r in reqs))

        def finished(req: Request) -> None:
            bar.update(1)
            if on_finish:
                on_finish(req)
        offsets = [0.0] * len(reqs) if arrivals is None else list(arrivals)
        if self.broken:
            raise WorkerError(f"this LLM's workers are gone ({self.broken}); create a new LLM")
        start_wall, start = time.time(), time.perf_counter()
        try:
            self.engine.run_until_done(finished, [(offsets[i], r) for i, r in enumerate(reqs) if not r.finished])
        except WorkerError as e:
            # Every request still comes out: the unfinished ones with the error that stopped them.
            self.broken = str(e)
            for r in reqs:
                if not r.finished:
                    r.finish("error", str(e))
                    bar.update(1)
            self.executor.shutdown()
        self.last_run = RunRecord(reqs, self.engine, start_wall, time.time(), start, time.perf_counter())
        bar.close()
        return [RequestOutput.from_request(r) for r in reqs]

    def shutdown(self) -> None:
        self.executor.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


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


def _progress(total: int, enabled: bool) -> object:
    from tqdm import tqdm
    return tqdm(total=total, disable=not enabled or total <= 1, file=sys.stderr, unit="req", desc="generate")


def _make_executor(launcher: str, cfg: EngineConfig, source: object) -> object:
    if launcher == "local":
        from pp_runtime.executor import LocalExecutor
        return LocalExecutor(cfg, source)
    if launcher == "ray":  # launch/ owns Ray; pp_runtime itself never imports it
        from launch.ray_launch import RayExecutor
        return RayExecutor(cfg, source)
    if launcher == "torchrun":
        import os
        if "RANK" not in os.environ:
            raise ValueError("--launcher torchrun runs under torchrun: "
                             "torchrun --nproc-per-node N -m launch.torchrun_main ...")
        from launch.torchrun_main import TorchrunExecutor
        return TorchrunExecutor(cfg, source)
    raise ValueError(f"--launcher must be local, ray or torchrun, got {launcher!r}")
