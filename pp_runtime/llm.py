"""The user-facing Python API (DESIGN.md §3.2).

    from pp_runtime import LLM, SamplingParams
    llm = LLM(model="smollm2-135m", pp=1, scheduler="sarathi", chunk_size=256)
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=16))
    for out in llm.generate_stream([[1, 2, 3]], SamplingParams(max_tokens=16)):
        out.request_id, out.token_ids, out.finished   # llm.abort(out.request_id) cancels it
    llm.shutdown()

Every request comes out, with tokens or with a reason: a bad one with finish_reason "error",
an aborted one "cancelled"; a dead worker finishes the rest with its error, and a
KeyboardInterrupt (Ctrl-C; the CLI turns SIGTERM into one) cancels them and kills the workers.
"""
from __future__ import annotations

import inspect
import numbers
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Sequence

from pp_runtime.config import (CacheConfig, DeviceConfig, EngineConfig, ParallelConfig, SchedulerConfig,
                               check_kv_dtype)
from pp_runtime.engine import Engine
from pp_runtime.executor import WorkerError
from pp_runtime.kv_cache import BlockManager
from pp_runtime.request import Request, RequestOutput, SamplingParams
from pp_runtime.scheduler import Scheduler

DEFAULT_MAX_BATCH = 64
RECONFIGURABLE = ("policy", "chunk_size", "max_batch_size", "tile_align", "chunk_budget")
SHUT_DOWN = "shut down"
INTERRUPTED = "interrupted (Ctrl-C or SIGTERM) before this request finished"
STREAM_CLOSED = "the stream was closed before this request finished"


class RunInterrupted(KeyboardInterrupt):
    """``LLM.run`` stopped by a KeyboardInterrupt. ``outputs``: every request of the run, in order,
    the finished ones with their tokens and the rest ``cancelled`` (with the tokens they had);
    ``scheduler`` and ``workers`` say what ran. The LLM's workers are already shut down: an
    interrupt can land between the stages' copies of one plan, so the pipeline is not reusable."""

    def __init__(self, outputs: list[RequestOutput], scheduler: str, workers: list[dict]) -> None:
        cancelled = sum(o.finish_reason == "cancelled" for o in outputs)
        super().__init__(f"{cancelled} of {len(outputs)} requests cancelled")
        self.outputs, self.scheduler, self.workers = outputs, scheduler, workers


@dataclass
class StreamOutput(RequestOutput):
    """One item of ``LLM.generate_stream``: a request's tokens so far. ``finished`` False: a partial
    output (finish_reason None, more tokens to come); True: the request's last item, equal to what
    ``generate`` returns for it."""

    finish_reason: str | None = None
    finished: bool = False

    @classmethod
    def partial(cls, req: Request) -> "StreamOutput":
        return cls(req.request_id, list(req.prompt_token_ids), list(req.output_token_ids), None)

    @classmethod
    def final(cls, req: Request) -> "StreamOutput":
        return cls(**vars(RequestOutput.from_request(req)), finished=True)


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
        return (f"B = ⌊(M_G − M_S)/(L·m_kv)⌋ = ⌊({self.budget_bytes / gib:.4g} GiB − "
                f"{self.weight_bytes / gib:.3g} GiB) / ({self.max_model_len} × {self.kv_bytes_per_token} B)⌋ "
                f"= {self.max_batch_b}; KV cache: {self.num_blocks} blocks")


def plan_memory(profiles: list, block_size: int, max_model_len: int) -> MemoryPlan:
    """Every stage holds the same block pool, so the tightest worker sets its size. A stage
    holding only the MLP half of a layer (partition 3.5, 0.5) keeps no K/V and sets nothing."""
    holders = [p for p in profiles if p.kv_bytes_per_token > 0]
    tight = min(holders, key=lambda p: (p.budget_bytes - p.weight_bytes) / p.kv_bytes_per_token)
    free = tight.budget_bytes - tight.weight_bytes
    num_blocks = max(0, free // (block_size * tight.kv_bytes_per_token))
    return MemoryPlan(num_blocks, max(0, free // (max_model_len * tight.kv_bytes_per_token)),
                      tight.budget_bytes, tight.weight_bytes, tight.kv_bytes_per_token, max_model_len)


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
                        chunk_budget: str = "flops") -> tuple[EngineConfig, object]:
    """Resolve the model and validate every setting; raises ValueError naming the bad one.
    max_batch_size None is kept as 1 here and replaced once the memory plan gives B."""
    from stages.model_source import resolve_model
    source = resolve_model(model)
    mcfg = source.config
    parallel = ParallelConfig(pp, tp, tuple(_plain_number(n) for n in partition) if partition else None)
    parallel.check_model(mcfg)
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise ValueError("--device cuda requested but no CUDA GPU is available")
    check_kv_dtype(kv_cache_dtype, device, dtype)
    if memory_budget_gb is not None and not memory_budget_gb > 0:
        raise ValueError(f"memory_budget_gb must be > 0, got {memory_budget_gb}")
    budget = None if memory_budget_gb is None and device == "cuda" else \
        int((4.0 if memory_budget_gb is None else memory_budget_gb) * (1 << 30))
    # None means the default; anything else (0 included) is SchedulerConfig's to check by name
    max_len = mcfg.max_position_embeddings if max_model_len is None else max_model_len
    cfg = EngineConfig(
        model_path=source.path, parallel=parallel,
        scheduler=SchedulerConfig(scheduler, chunk_size, 1 if max_batch_size is None else max_batch_size, tile_align,
                                  max_len, chunk_budget=chunk_budget),
        cache=CacheConfig(block_size, budget, kv_cache_dtype), device=DeviceConfig(device, dtype, attention, threads, gguf_weights, matmul_precision),
        seed=seed)
    if max_len > mcfg.max_position_embeddings:
        raise ValueError(f"max_model_len={max_len} exceeds the model's {mcfg.max_position_embeddings} "
                         "positions (max_position_embeddings)")
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
                 partition: Sequence[float] | None = None, threads: int = 0, verbose: bool = False,
                 gguf_weights: str = "native", kv_cache_dtype: str = "auto",
                 matmul_precision: str = "highest", chunk_budget: str = "flops") -> None:
        self.config, self.source = build_engine_config(
            model, pp, tp, scheduler, chunk_size, max_batch_size, tile_align, dtype, device, attention, seed,
            block_size, memory_budget_gb, max_model_len, partition, threads, gguf_weights, kv_cache_dtype,
            matmul_precision, chunk_budget)
        parallel, max_len = self.config.parallel, self.config.scheduler.max_model_len
        self.launcher = launcher or ("local" if parallel.world_size == 1 else "ray")
        with _keep_sigterm_handler():
            self.executor = _make_executor(self.launcher, self.config, self.source)
        try:
            self.memory = plan_memory(self.executor.memory_profiles(), block_size, max_len)
            if self.memory.num_blocks * block_size < max_len:
                raise ValueError(f"memory budget too small: {self.memory.num_blocks} KV blocks hold "
                                 f"{self.memory.num_blocks * block_size} tokens, one request of max length "
                                 f"{max_len} needs {max_len}")
            # B requests fit in memory at full length; with pp micro-batches in flight each one
            # carries B/pp of them (the paper's TP-PP: 219 running, 27 per micro-batch).
            pp = self.config.parallel.pp
            mbs = max_batch_size or max(1, min(self.memory.max_batch_b // pp, DEFAULT_MAX_BATCH))
            self.sched_config = replace(self.config.scheduler, max_batch_size=mbs, max_running=mbs * pp)
            self.config = replace(self.config, scheduler=self.sched_config)
            self.executor.allocate_cache(self.memory.num_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        if verbose:
            print(self.memory.describe(), file=sys.stderr)
        self._tokenizer = None
        self._next_seq = 0
        self.broken: str | None = None  # set when a worker died or a run was interrupted: workers are gone
        self.engine: Engine | None = None
        self._active: dict[str, list[Request]] = {}  # request id -> the current run's requests (abort)
        self._open: Iterator | None = None  # the run under way (a stream may be left half-read)

    @property
    def tokenizer(self) -> object:
        if self._tokenizer is None:
            from pp_runtime.tokenizer import load_tokenizer
            self._tokenizer = load_tokenizer(self.source.kind, self.source.path)
            if self._tokenizer is None:
                raise ValueError(f"model {self.source.path} has no tokenizer: pass token ids")
        return self._tokenizer

    def reconfigure(self, **changes: object) -> None:
        """Change the driver-side scheduling (policy, chunk_size, max_batch_size, tile_align, chunk_budget)
        between runs, keeping the workers and their weights: ``bench`` compares schedulers this way.
        Anything else is fixed by the workers (max_model_len: their positions and KV pool)."""
        bad = sorted(set(changes) - set(RECONFIGURABLE))
        if bad:
            raise ValueError(f"reconfigure: {', '.join(bad)} cannot change after start; "
                             f"only {', '.join(RECONFIGURABLE)} can (create a new LLM for the rest)")
        if "max_batch_size" in changes:  # the running cap follows, as in __init__
            changes["max_running"] = changes["max_batch_size"] * self.config.parallel.pp
        self.sched_config = replace(self.sched_config, **changes)
        self.config = replace(self.config, scheduler=self.sched_config)

    def workers_info(self) -> list[dict]:
        return self.executor.workers_info()

    def make_request(self, request_id: str, prompt: list[int] | str | None,
                     params: SamplingParams | None, error: str | None = None) -> Request:
        """A Request, or one already finished with an error naming what is wrong with it."""
        seq_id, self._next_seq = self._next_seq, self._next_seq + 1
        ids = _as_token_list(prompt)
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
        """Outputs in the order of ``prompts``; bad prompts come back with finish_reason 'error'.
        A text prompt's output carries the generated text too."""
        reqs = self._requests(prompts, params, ids)
        return [self._with_text(o, p) for o, p in zip(self.run(reqs, progress), prompts)]

    def _with_text(self, out: RequestOutput, prompt: object) -> RequestOutput:
        if isinstance(prompt, str) and out.finish_reason != "error":
            out.text = self.tokenizer.decode(out.token_ids)
        return out

    def generate_stream(self, prompts: Sequence[list[int] | str],
                        params: SamplingParams | Sequence[SamplingParams] | None = None,
                        ids: Sequence[str] | None = None) -> Iterator[StreamOutput]:
        """Outputs as they come. After every pipeline step: a partial output (``finished`` False,
        every token so far) for each request that got tokens, then a final one (``finished`` True,
        equal to ``generate``'s) for each request that finished; every request ends with exactly one
        final output. ``abort(request_id)`` inside the loop (or from another thread) cancels a
        request; leaving the loop early cancels the rest once the stream is closed or the next run
        starts."""
        reqs = self._requests(prompts, params, ids)
        prompt_of = {r.seq_id: p for r, p in zip(reqs, prompts)}
        steps = self._start(reqs)
        sent: dict[int, int] = {}  # seq id -> tokens already streamed
        done: set[int] = set()  # seq ids whose final output went out
        try:
            for finished in steps:
                # Tokens arrive only in a running request's postprocess, so after each step the
                # running list (plus the finished) holds every request that got something new.
                for req in self.engine.scheduler.running:
                    if len(req.output_token_ids) > sent.get(req.seq_id, 0):
                        sent[req.seq_id] = len(req.output_token_ids)
                        yield StreamOutput.partial(req)
                for req in finished:
                    done.add(req.seq_id)
                    yield self._with_text(StreamOutput.final(req), prompt_of[req.seq_id])
            # A run started meanwhile (generate inside this loop) closes this one: its requests
            # were cancelled there, and each still ends with its one final output here.
            for req in reqs:
                if req.seq_id not in done and req.finished:
                    yield self._with_text(StreamOutput.final(req), prompt_of[req.seq_id])
        finally:
            steps.close()

    def abort(self, request_id: str) -> bool:
        """Cancel a request of the run under way (waiting, running or in flight): it finishes with
        finish_reason "cancelled" at the next step (one in flight when its micro-batch returns).
        Safe from inside a ``generate_stream`` loop and from other threads. False when no
        unfinished request of the current run has this id."""
        reqs = [r for r in self._active.get(request_id, ()) if not r.finished]
        engine = self.engine
        for req in reqs:
            engine.abort(req.seq_id)
        return bool(reqs)

    def run(self, reqs: list[Request], progress: bool = False,
            on_finish: Callable[[Request], None] | None = None,
            arrivals: Sequence[float] | None = None) -> list[RequestOutput]:
        """Run prepared requests; ``arrivals`` (seconds from start, one per request) spreads them
        over time, else all arrive at once. ``on_finish`` sees every request as it finishes (those
        finished with an error before the run first). The run's record stays in ``self.last_run``.
        A KeyboardInterrupt comes out as ``RunInterrupted``, carrying every request's output."""
        bar = _progress(len(reqs), progress)
        steps = self._start(reqs, arrivals)
        try:
            try:
                for finished in steps:
                    bar.update(len(finished))
                    for req in finished:
                        if on_finish:
                            on_finish(req)
            except KeyboardInterrupt as e:
                if isinstance(e, RunInterrupted):
                    raise
                try:
                    steps.throw(e)  # it landed out here (progress bar, on_finish): let the run handle it
                except RunInterrupted:
                    raise
                except KeyboardInterrupt:  # the run had not started or had just ended: same outcome
                    raise self._interrupted(reqs) from None
        finally:
            bar.close()
        return [RequestOutput.from_request(r) for r in reqs]

    def _requests(self, prompts: Sequence[list[int] | str],
                  params: SamplingParams | Sequence[SamplingParams] | None,
                  ids: Sequence[str] | None) -> list[Request]:
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        for name, given in (("params", plist), ("ids", ids)):
            if given is not None and len(given) != len(prompts):
                raise ValueError(f"{name} has {len(given)} entries for {len(prompts)} prompts (one each)")
        reqs = []
        for i, p in enumerate(prompts):
            bad = None if isinstance(plist[i], SamplingParams) else \
                f"params[{i}] is a {type(plist[i]).__name__}, not SamplingParams"
            reqs.append(self.make_request(ids[i] if ids else str(i), p, None if bad else plist[i], bad))
        return reqs

    def _start(self, reqs: list[Request], arrivals: Sequence[float] | None = None) -> Iterator[list[Request]]:
        """A new run, as a generator of engine steps. A run left half-read (an abandoned stream)
        is closed first: the pipeline must be idle before a new scheduler drives it."""
        if self._open is not None:
            self._open.close()
        self._open = self._steps(reqs, arrivals)
        return self._open

    def _steps(self, reqs: list[Request], arrivals: Sequence[float] | None) -> Iterator[list[Request]]:
        """One run, one engine step at a time: yields the requests finished by each (first those
        finished with an error already). Every request comes out finished: a dead worker finishes
        the rest with its error, a KeyboardInterrupt with 'cancelled' (and the workers are killed),
        closing the generator early with 'cancelled' (and the pipeline drained)."""
        if self.broken:
            raise WorkerError(f"this LLM's workers are gone ({self.broken}); create a new LLM")
        scheduler = Scheduler(self.sched_config, BlockManager(self.memory.num_blocks, self.config.cache.block_size),
                              self.source.config.eos_token_ids, self.config.seed, depth=self.config.parallel.pp,
                              key_cost=self.source.config.key_cost)
        self.engine = Engine(scheduler, self.executor, self.config.parallel.pp)
        offsets = [0.0] * len(reqs) if arrivals is None else list(arrivals)
        self._active = {}
        for r in reqs:
            self._active.setdefault(r.request_id, []).append(r)
        start_wall, start = time.time(), time.perf_counter()
        try:
            self.executor.drain_timings()  # drop records of earlier runs
            yield [r for r in reqs if r.finished]
            yield from self.engine.iterate([(offsets[i], r) for i, r in enumerate(reqs) if not r.finished])
        except WorkerError as e:
            yield self._worker_died(reqs, e)
        except KeyboardInterrupt:
            raise self._interrupted(reqs) from None
        except GeneratorExit:
            self._drain(reqs)
            raise
        finally:
            self._active = {}
            self._open = None
            self.last_run = RunRecord(reqs, self.engine, start_wall, time.time(), start, time.perf_counter())

    def _worker_died(self, reqs: list[Request], e: WorkerError) -> list[Request]:
        # Every request still comes out: the unfinished ones with the error that stopped them.
        self.broken = str(e)
        finished = _finish_rest(reqs, "error", str(e))
        self.executor.shutdown()
        return finished

    def _interrupted(self, reqs: list[Request]) -> RunInterrupted:
        _finish_rest(reqs, "cancelled", INTERRUPTED)
        self.broken = "a run was interrupted"
        workers = self.executor.workers_info()
        _kill_workers(self.executor)
        return RunInterrupted([RequestOutput.from_request(r) for r in reqs], self.sched_config.policy, workers)

    def _drain(self, reqs: list[Request]) -> None:
        """A run left early: cancel what is left and collect the micro-batches still in flight, so
        that the next run starts on an idle pipeline."""
        rest = [r for r in reqs if not r.finished]
        for r in rest:
            self.engine.abort(r.seq_id)
        try:
            for _ in self.engine.iterate():
                pass
        except WorkerError as e:
            self._worker_died(reqs, e)
        _finish_rest(reqs, "cancelled", STREAM_CLOSED)  # not arrived yet: the scheduler never saw them
        for r in rest:
            if r.finish_reason == "cancelled":  # say why, rather than the scheduler's "request aborted"
                r.error = STREAM_CLOSED

    def shutdown(self) -> None:
        self.executor.shutdown()
        self.broken = self.broken or SHUT_DOWN  # a later run says so, instead of failing on a gone worker

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            _kill_workers(self.executor)  # no goodbye: a half-delivered plan could hold it up
            self.broken = self.broken or SHUT_DOWN
        else:
            self.shutdown()


def _finish_rest(reqs: list[Request], reason: str, error: str) -> list[Request]:
    rest = [r for r in reqs if not r.finished]
    for r in rest:
        r.finish(reason, error)
    return rest


def _kill_workers(executor: object) -> None:
    """Shut the workers down without their graceful goodbye, which an interrupt can leave queued
    behind a plan that only some stages received (they would wait for activations that never come)."""
    if "graceful" in inspect.signature(executor.shutdown).parameters:
        executor.shutdown(graceful=False)
    else:
        executor.shutdown()


@contextmanager
def _keep_sigterm_handler() -> Iterator[None]:
    """Starting the workers may replace the process's SIGTERM handler (ray.init installs one that
    calls sys.exit); a handler the caller installed itself (the CLI's: SIGTERM → cancel the run)
    is put back. The default handler is left to whoever replaced it."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if callable(before) and signal.getsignal(signal.SIGTERM) is not before:
            signal.signal(signal.SIGTERM, before)


def _as_token_list(prompt: object) -> object:
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


def _progress(total: int, enabled: bool) -> object:
    from tqdm import tqdm
    return tqdm(total=total, disable=not enabled or total <= 1, file=sys.stderr, unit="req", desc="generate")


def _make_executor(launcher: str, cfg: EngineConfig, source: object) -> object:
    if launcher == "local":
        from pp_runtime.executor import LocalExecutor
        return LocalExecutor(cfg, source)
    if launcher == "ray":  # launch/ owns Ray; pp_runtime itself never imports it
        from launch.ray_executor import RayExecutor
        return RayExecutor(cfg, source)
    if launcher == "torchrun":
        import os
        if "RANK" not in os.environ:
            raise ValueError("--launcher torchrun runs under torchrun: "
                             "torchrun --nproc-per-node N -m launch.torchrun_main ...")
        from launch.torchrun_main import TorchrunExecutor
        return TorchrunExecutor(cfg, source)
    raise ValueError(f"--launcher must be local, ray or torchrun, got {launcher!r}")
