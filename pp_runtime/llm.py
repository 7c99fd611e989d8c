"""The user-facing Python API (DESIGN.md §3.2).

    from pp_runtime import LLM, SamplingParams
    llm = LLM(model="smollm2-135m", pp=1, scheduler="sarathi", chunk_size=256)
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=16))
    for out in llm.generate_stream([[1, 2, 3]], SamplingParams(max_tokens=16)):
        out.request_id, out.token_ids, out.finished   # llm.abort(out.request_id) cancels it
    llm.shutdown()

Every request comes out, with tokens or with a reason: a bad one with finish_reason "error",
an aborted one "cancelled"; a dead worker finishes the rest with its error, and a
KeyboardInterrupt (Ctrl-C; the CLI turns SIGTERM into one) cancels them and kills the workers
(an in-process pipeline is reset instead, and the LLM takes the next call).
"""
from __future__ import annotations

import inspect
import itertools
import sys
import threading
import time
from dataclasses import replace
from typing import Callable, Iterator, Sequence

from pp_runtime import run_loop
from pp_runtime.calibration import calibrate
from pp_runtime.config import SchedulerConfig
from pp_runtime.engine import Engine
from pp_runtime.engine_args import build_engine_config
from pp_runtime.executor import WorkerError
from pp_runtime.kv_cache import BlockManager
from pp_runtime.memory_plan import plan_memory
from pp_runtime.outputs import RequestOutput
from pp_runtime.parallel_sampling import fan_out, group_outputs, per_sample, requests_of
from pp_runtime.prompt_validation import as_prompts, as_token_list, check_arrivals, per_prompt_params, validate_prompt
from pp_runtime.request import Request, SamplingParams
from pp_runtime.run_outputs import RunInterrupted, RunRecord, StreamOutput
from pp_runtime.scheduler import Scheduler
from pp_runtime.workers import keep_sigterm_handler, kill_workers, make_executor

DEFAULT_MAX_BATCH = 64
RECONFIGURABLE = ("policy", "chunk_size", "max_batch_size", "tile_align", "chunk_budget", "admission",
                  "step_costs", "kv_admission")
SHUT_DOWN = "shut down"


# what each reduced --matmul-precision needs, for the line that says it changed nothing
PRECISION_NEEDS = {"medium": ("bf16_linears", "a CPU with AVX512-BF16"),
                   "int8": ("int8_linears", "GGUF Q4_0/Q4_1/Q8_0 weights kept native on a CPU with AVX512-VNNI (AVX2: Q4_0/Q4_1 ones)")}


def admission_note(sched: SchedulerConfig, num_blocks: int) -> str:
    """How many requests may run, and what admits them (B above is the paper's count of
    full-length requests, which neither admission caps at: each counts blocks)."""
    rule = (f"a request starts once its and the running requests' prompt + max_tokens - 1 tokens fit the "
            f"{num_blocks} blocks"
            if sched.kv_admission == "reserve" else "a request starts once its prompt fits the free blocks; the "
            "newest is preempted when blocks run out")
    return (f"kv admission {sched.kv_admission}: {rule}; at most {sched.max_batch_size} a micro-batch, "
            f"{sched.running_cap} running")


def precision_note(precision: str, workers: list[dict]) -> str | None:
    """One line for a run whose reduced matmul precision no linear took (it then computes as
    "highest", as the flag's help says); None where some did, or none was asked for."""
    if precision not in PRECISION_NEEDS:
        return None
    key, needs = PRECISION_NEEDS[precision]
    if any(w.get(key) for w in workers):
        return None
    return f"pp-runtime: --matmul-precision {precision} changes no product here (it needs {needs}): computing as highest"


class LLM:
    def __init__(self, model: str | None = None, pp: int = 1, tp: int = 1, launcher: str | None = None,
                 scheduler: str = "sarathi", chunk_size: int = 256, max_batch_size: int | None = None,
                 tile_align: bool = False, dtype: str = "float32", device: str = "cpu",
                 attention: str = "auto", seed: int = 0, block_size: int = 16,
                 memory_budget_gb: float | None = None, max_model_len: int | None = None,
                 partition: Sequence[float] | None = None, threads: int = 0, verbose: bool = False,
                 gguf_weights: str = "native", kv_cache_dtype: str = "auto",
                 matmul_precision: str = "highest", chunk_budget: str = "flops", prefault_kv: bool = False,
                 admission: str = "fcfs", step_costs: Sequence[float] | str = (),
                 enable_prefix_caching: bool = True, cuda_graphs: bool | None = None,
                 kv_admission: str = "optimistic") -> None:
        fit = isinstance(step_costs, str) and step_costs == "fit"  # other strings: build_engine_config names them
        self.config, self.source = build_engine_config(
            model, pp, tp, scheduler, chunk_size, max_batch_size, tile_align, dtype, device, attention, seed,
            block_size, memory_budget_gb, max_model_len, partition, threads, gguf_weights, kv_cache_dtype,
            matmul_precision, chunk_budget,
            # a calibration run on a cold cache would charge the OS's first touch of each KV page to
            # the first (shallow) prompt chunks and price a key too low (~0.37e-3 against ~0.52e-3)
            prefault_kv or fit, admission, step_costs, enable_prefix_caching, cuda_graphs, kv_admission)
        parallel, max_len = self.config.parallel, self.config.scheduler.max_model_len
        self.launcher = launcher or ("local" if parallel.world_size == 1 else "ray")
        with keep_sigterm_handler():
            self.executor = make_executor(self.launcher, self.config, self.source, verbose)
        try:
            self.memory = plan_memory(self.executor.memory_profiles(), block_size, max_len)
            if self.memory.num_blocks * block_size < max_len:
                raise ValueError(f"memory budget too small: {self.memory.num_blocks} KV blocks hold "
                                 f"{self.memory.num_blocks * block_size} tokens, one request of max length "
                                 f"{max_len} needs {max_len}")
            self._batch_given = max_batch_size is not None  # else reconfigure re-derives the default
            mbs = max_batch_size or self._default_batch(self.config.scheduler)
            self.sched_config = replace(self.config.scheduler, max_batch_size=mbs,
                                        max_running=mbs * self.config.parallel.pp)
            self.config = replace(self.config, scheduler=self.sched_config)
            self.executor.allocate_cache(self.memory.num_blocks)
            # one block manager for the LLM's life: cached prefixes outlive the run that computed them
            self.blocks = BlockManager(self.memory.num_blocks, block_size, self.config.cache.enable_prefix_caching)
        except BaseException:
            self.executor.shutdown()
            raise
        if verbose:
            print(self.memory.describe(), file=sys.stderr)
            print(admission_note(self.sched_config, self.memory.num_blocks), file=sys.stderr)
            note = precision_note(self.config.device.matmul_precision, self.executor.workers_info())
            if note:
                print(note, file=sys.stderr)
        self._tokenizer = None
        self._next_seq = 0
        # set when a worker died, the LLM was shut down, or a run of workers in other processes was
        # interrupted: the workers are gone
        self.broken: str | None = None
        self.engine: Engine | None = None
        self._active: dict[str, list[Request]] = {}  # request id -> the current run's requests (abort)
        self._open: Iterator | None = None  # the run under way (a stream may be left half-read)
        self._run_thread: int | None = None  # the thread inside run() (generate), if any
        self._start_lock = threading.Lock()
        if fit:  # measured on these workers, before the first request is served
            try:
                calibrate(self, verbose)
            except BaseException:
                self.shutdown()
                raise

    @property
    def tokenizer(self) -> object:
        if self._tokenizer is None:
            from pp_runtime.tokenizer import load_tokenizer
            self._tokenizer = load_tokenizer(self.source.kind, self.source.path)
            if self._tokenizer is None:
                raise ValueError(f"model {self.source.path} has no tokenizer: pass token ids")
        return self._tokenizer

    def reconfigure(self, **changes: object) -> None:
        """Change the driver-side scheduling (policy, chunk_size, max_batch_size, tile_align, chunk_budget,
        admission, step_costs, kv_admission) between runs, keeping the workers and their weights: ``bench``
        compares schedulers this way. Anything else is fixed by the workers (max_model_len: their positions and KV pool)."""
        bad = sorted(set(changes) - set(RECONFIGURABLE))
        if bad:
            raise ValueError(f"reconfigure: {', '.join(bad)} cannot change after start; "
                             f"only {', '.join(RECONFIGURABLE)} can (create a new LLM for the rest)")
        given = "max_batch_size" in changes
        if not given and not self._batch_given:  # the default for the new scheduling
            changes = {**changes, "max_batch_size": self._default_batch(replace(self.sched_config, **changes,
                                                                                max_batch_size=1))}
        sched = replace(self.sched_config, **changes)  # validated here, before anything uses it
        if "max_batch_size" in changes:  # the running cap follows, as in __init__
            sched = replace(sched, max_running=sched.max_batch_size * self.config.parallel.pp)
        self.sched_config = sched
        self.config = replace(self.config, scheduler=self.sched_config)
        self._batch_given = self._batch_given or given

    def _default_batch(self, sched: SchedulerConfig) -> int:
        """The micro-batch cap when none is given: 64 (pp × 64 running), under either admission,
        since both count KV blocks, not requests. The paper's B (requests of max_model_len the
        budget holds) is no cap: under reserve requests are admitted by their own lengths, and
        under optimistic (vLLM's, whose max_num_seqs is no memory cap either) requests that stop
        early at EOS leave room that B would not use (chat prompts, max_tokens 512, a 0.3 GB
        budget: B caps 2 running, 0.58x of reserve's tokens/s; docs/BENCHMARKS.md, twenty-second
        session). sarathi's tile_align: at most C (its batches are C tokens, decodes included)."""
        aligned = sched.tile_align and sched.policy == "sarathi"
        return min(DEFAULT_MAX_BATCH, sched.chunk_size) if aligned else DEFAULT_MAX_BATCH

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (vLLM's name): runs compared side by side start equal."""
        self.blocks.reset_prefix_cache()

    def workers_info(self) -> list[dict]:
        return self.executor.workers_info()

    def make_request(self, request_id: str, prompt: list[int] | str | None,
                     params: SamplingParams | None, error: str | None = None) -> Request:
        """A Request, or one already finished with an error naming what is wrong with it."""
        seq_id, self._next_seq = self._next_seq, self._next_seq + 1
        ids = as_token_list(prompt)
        if error is None and isinstance(prompt, str):
            try:
                ids = self.tokenizer.encode(prompt)
            except ValueError as e:
                error = str(e)
        req = Request(request_id, seq_id, list(ids) if isinstance(ids, (list, tuple)) else [],
                      params or SamplingParams())
        if error is None and isinstance(prompt, str) and not ids:  # not "prompt_token_ids …" for a text
            error = "empty prompt: the text has no tokens"
        error = error or validate_prompt(ids, self.source.config.vocab_size)
        if error is None and req.params.stop:
            try:
                req.stop_check = self._stop_check(req.params)
            except ValueError as e:
                error = f"stop strings need the model's tokenizer ({e})"
        if error:
            req.finish("error", error)
        return req

    def _stop_check(self, params: SamplingParams) -> Callable[..., bool]:
        from pp_runtime.tokenizer import StopStrings
        return StopStrings(self.tokenizer, params.stop, params.include_stop_str_in_output)

    def _fork(self, req: Request, index: int, params: SamplingParams) -> Request:
        """Sample ``index`` of ``req``'s prompt (parallel_sampling.fan_out), a sequence of its own."""
        seq_id, self._next_seq = self._next_seq, self._next_seq + 1
        twin = Request(req.request_id, seq_id, req.prompt_token_ids, params, index=index)
        if req.finished:  # a bad request: each sample says why
            twin.finish(req.finish_reason, req.error)
        elif params.stop:  # its own: a stop check holds the text so far
            twin.stop_check = self._stop_check(params)
        return twin

    def generate(self, prompts: Sequence[list[int] | str],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 progress: bool = False, ids: Sequence[str] | None = None) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``; bad prompts come back with finish_reason 'error'.
        A text prompt's output carries the generated text too; one text or one list of token ids
        alone is one prompt."""
        prompts = as_prompts(prompts)
        reqs = self._requests(prompts, params, ids)
        return [self.with_text(o, p) for o, p in zip(self.run(reqs, progress), prompts)]

    def with_text(self, out: RequestOutput, prompt: object) -> RequestOutput:
        """``out`` with the text of its tokens where its prompt was text (and it did not fail), and
        none where it was token ids (a stop string's cut text is not kept for those either)."""
        if not isinstance(prompt, str):  # token ids in, token ids out, however the request ended
            out.clear_texts()
        else:  # each sample's, but where cut at a stop string already (a failed one needs no tokenizer)
            out.fill_texts(lambda ids: self.tokenizer.decode_output(ids))
        return out

    def generate_stream(self, prompts: Sequence[list[int] | str],
                        params: SamplingParams | Sequence[SamplingParams] | None = None,
                        ids: Sequence[str] | None = None) -> Iterator[StreamOutput]:
        """Outputs as they come. After every pipeline step: a partial output (``finished`` False,
        every token so far, and for a text prompt its text so far) for each request that got
        tokens, then a final one (``finished`` True,
        equal to ``generate``'s) for each request that finished; every request ends with exactly one
        final output (with SamplingParams.n > 1, each of its samples: ``outputs[0].index`` says
        which). ``abort(request_id)`` inside the loop (or from another thread) cancels a request;
        leaving the loop early cancels the rest once the stream is closed or the next run starts."""
        prompts = as_prompts(prompts)
        reqs = fan_out(self._requests(prompts, params, ids), self._fork)
        prompts = per_sample(prompts, reqs)
        prompt_of = {r.seq_id: p for r, p in zip(reqs, prompts)}
        # a text prompt's partial outputs carry the text so far, decoded incrementally
        texts = {r.seq_id: self.tokenizer.text_stream() for r, p in zip(reqs, prompts) if isinstance(p, str)}
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
                        out = StreamOutput.partial(req)
                        if req.seq_id in texts:
                            out.text = out.outputs[0].text = _held_back(texts[req.seq_id].update(out.token_ids),
                                                                        req.params)
                        yield out
                for req in finished:
                    done.add(req.seq_id)
                    yield self.with_text(StreamOutput.final(req), prompt_of[req.seq_id])
            # A run started meanwhile (generate inside this loop) closes this one: its requests
            # were cancelled there, and each still ends with its one final output here.
            for req in reqs:
                if req.seq_id not in done and req.finished:
                    yield self.with_text(StreamOutput.final(req), prompt_of[req.seq_id])
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
        """Run prepared requests (one output each, its n samples in ``outputs``); ``arrivals`` (seconds
        from start, one per request) spreads them over time, else all arrive at once. ``on_finish``
        sees every sequence (a request's, or each of its samples) as it finishes (those finished with
        an error before the run first). The run's record stays in ``self.last_run``.
        A KeyboardInterrupt comes out as ``RunInterrupted``, carrying every request's output."""
        if arrivals is not None:
            arrivals = check_arrivals(arrivals, len(reqs))
        reqs = fan_out(reqs, self._fork)  # n > 1: one sequence a sample
        arrivals = None if arrivals is None else per_sample(arrivals, reqs)
        with self._start_lock:
            self._check_one_caller()
            outer, self._run_thread = self._run_thread, threading.get_ident()  # outer: a run() in on_finish
        try:
            return self._run(reqs, progress, on_finish, arrivals)
        finally:
            self._run_thread = outer

    def _run(self, reqs: list[Request], progress: bool, on_finish: Callable[[Request], None] | None,
             arrivals: Sequence[float] | None) -> list[RequestOutput]:
        groups = requests_of(reqs)
        bar = run_loop.progress_bar(len(groups), progress)  # requests done, each once its n samples are
        left: dict[int, set[int]] = {}  # seq id -> its request's samples (seq ids) not finished yet
        for g in groups:
            ids = {r.seq_id for r in g}
            left.update(dict.fromkeys(ids, ids))
        steps = self._start(reqs, arrivals)

        def deliver(finished: list[Request]) -> None:
            for req in finished:
                ids = left.pop(req.seq_id)
                ids.discard(req.seq_id)
                bar.update(not ids)
                if on_finish:
                    on_finish(req)
        try:
            try:
                for finished in steps:
                    deliver(finished)
            except KeyboardInterrupt as e:
                if isinstance(e, RunInterrupted):
                    raise
                try:
                    finished = steps.throw(e)  # it landed out here (progress bar, on_finish): let the run handle it
                except RunInterrupted:
                    raise
                except KeyboardInterrupt:  # the run had not started or had just ended: same outcome
                    raise run_loop.interrupted(self, reqs) from None
                except StopIteration:
                    finished = []
                # the run made it a worker's error (a launcher's signal after a worker died): its requests
                for batch in itertools.chain([finished], steps):
                    deliver(batch)
        finally:
            bar.close()
            # an on_finish that raised leaves the run here: drained now (the rest cancelled, their
            # blocks freed), not held until the next call (a no-op for a run that ended)
            steps.close()
        return group_outputs(reqs)

    def _requests(self, prompts: Sequence[list[int] | str],
                  params: SamplingParams | Sequence[SamplingParams] | None,
                  ids: Sequence[str] | None) -> list[Request]:
        return [self.make_request(rid, p, sp, bad)
                for (rid, sp, bad), p in zip(per_prompt_params(prompts, params, ids), prompts)]

    def _start(self, reqs: list[Request], arrivals: Sequence[float] | None = None) -> Iterator[list[Request]]:
        """A new run, as a generator of engine steps. A run left half-read (an abandoned stream)
        is closed first: the pipeline must be idle before a new scheduler drives it."""
        with self._start_lock:
            self._check_one_caller()
            if self._open is not None:
                self._open.close()
            self._open = self._steps(reqs, arrivals)
            return self._open

    def _check_one_caller(self) -> None:
        """One call at a time: a call from another thread while a generate() runs there, or while
        a stream is inside a step there, is refused rather than interleaved with it (a stream
        merely left half-read is closed by the next run, whatever its thread)."""
        busy = self._run_thread not in (None, threading.get_ident()) or (
            self._open is not None and inspect.getgeneratorstate(self._open) == inspect.GEN_RUNNING)
        if busy:
            raise RuntimeError("this LLM is running a generate() call from another thread: an LLM runs one "
                               "call at a time (pass all the prompts to one call, or use an LLM per thread)")

    def _steps(self, reqs: list[Request], arrivals: Sequence[float] | None) -> Iterator[list[Request]]:
        """One run (``run_loop.steps``), with this LLM's bookkeeping around it: a fresh engine,
        the run's requests by id for ``abort``, and its record in ``last_run`` once it ends."""
        if self.broken:
            raise WorkerError(f"this LLM's workers are gone ({self.broken}); create a new LLM")
        self.blocks.free_all()  # a run leaves none held (the pipeline drains); this makes sure
        scheduler = Scheduler(self.sched_config, self.blocks, self.source.config.eos_token_ids, self.config.seed,
                              depth=self.config.parallel.pp, key_cost=self.source.config.key_cost)
        self.engine = Engine(scheduler, self.executor, self.config.parallel.pp)
        offsets = [0.0] * len(reqs) if arrivals is None else list(arrivals)
        self._active = {}
        for r in reqs:
            self._active.setdefault(r.request_id, []).append(r)
        start_wall, start = time.time(), time.perf_counter()
        try:
            yield from run_loop.steps(self, reqs, offsets)
        except GeneratorExit:  # a stream left early: drained, every planned block written
            raise
        except BaseException:  # cut short: a block registered as planned may never have been written
            self.blocks.reset_prefix_cache()
            raise
        finally:
            self._active = {}
            self._open = None
            self.last_run = RunRecord(reqs, self.engine, start_wall, time.time(), start, time.perf_counter())

    def shutdown(self) -> None:
        self.executor.shutdown()
        self.broken = self.broken or SHUT_DOWN  # a later run says so, instead of failing on a gone worker

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            kill_workers(self.executor)  # no goodbye: a half-delivered plan could hold it up
            self.broken = self.broken or SHUT_DOWN
        else:
            self.shutdown()


def _held_back(text: str, params: SamplingParams) -> str:
    """A streamed text without its last characters that may begin a stop string (as vLLM's stream
    holds them back): the final text, cut before the stop string, then still extends every partial."""
    if not params.stop or params.include_stop_str_in_output:
        return text
    return text[:max(0, len(text) - max(map(len, params.stop)) + 1)]
