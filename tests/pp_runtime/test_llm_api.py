"""The LLM API's reliability surface: streaming (final outputs equal ``generate``'s, partial ones
grow), ``abort`` of waiting / running / in-flight requests (from the stream loop and from another
thread), a stream left early, and memory pressure (a KV cache far below demand: preemptions
happen, outputs do not change; a request that can never fit gets an error, the rest complete).

Everything runs the in-process executor at pp=2: the engine keeps two micro-batches in flight,
so "in flight" is a real state here, without a Ray start."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pp_runtime.llm import LLM
from pp_runtime.request import SamplingParams
from pp_runtime.run_outputs import StreamOutput
from tests.conftest import fail_on_call

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=9, temperature=0.8, top_k=40, seed=7, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    # no prefix caching: the tests below run the same prompts again and compare what scheduling did
    with LLM(model="llama-tiny", pp=2, launcher="local", chunk_size=8, max_batch_size=3, memory_budget_gb=0.05,
             max_model_len=128, enable_prefix_caching=False) as m:
        yield m


def prompts() -> list[list[int]]:
    return [[3 + (i * 13 + k) % 500 for k in range(n)] for i, n in enumerate((5, 23, 1, 40, 12, 17, 9))]


def check_stream(items: list[StreamOutput], ids: list[str]) -> dict[str, StreamOutput]:
    """Every id ends with exactly one final item, after its partial ones; partials only grow."""
    finals: dict[str, StreamOutput] = {}
    seen: dict[str, list[int]] = {}
    for it in items:
        assert it.request_id not in finals, f"{it.request_id}: an item after its final one"
        prev = seen.get(it.request_id, [])
        assert it.token_ids[:len(prev)] == prev, "a stream item rewrote tokens it already gave"
        if it.finished:
            assert it.finish_reason is not None
            finals[it.request_id] = it
        else:
            assert it.finish_reason is None and len(it.token_ids) > len(prev)
        seen[it.request_id] = list(it.token_ids)
    assert sorted(finals) == sorted(ids)
    return finals


def fields(o: object) -> tuple:
    return o.request_id, o.token_ids, o.finish_reason, o.error


def test_stream_finals_equal_generate(llm: LLM) -> None:
    ps = prompts() + [[], [9999]]  # two bad ones: empty, outside the vocabulary
    params = [GREEDY, SEEDED] * 4 + [GREEDY]
    expected = llm.generate(ps, params)
    items = list(llm.generate_stream(ps, params))
    finals = check_stream(items, [str(i) for i in range(len(ps))])
    assert [fields(finals[o.request_id]) for o in expected] == [fields(o) for o in expected]
    assert sum(not it.finished for it in items) > len(ps), "no partial outputs were streamed"
    assert finals["7"].finish_reason == "error" and "empty prompt" in finals["7"].error
    assert finals["8"].finish_reason == "error" and "outside the vocabulary" in finals["8"].error


def test_abort_waiting_running_and_in_flight_from_the_stream(llm: LLM) -> None:
    ps = prompts()
    expected = {o.request_id: o for o in llm.generate(ps, GREEDY)}
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    aborted: dict[str, str] = {}  # request id -> its state when aborted
    items = []
    for it in llm.generate_stream(ps, params):
        items.append(it)
        if not aborted and not it.finished:  # the first tokens: pick one request in each state
            sched = llm.engine.scheduler
            in_flight = next(r for r in sched.running if r.in_flight)
            idle = next((r for r in sched.running if not r.in_flight), None)
            waiting = sched.waiting[-1]
            for state, req in (("in_flight", in_flight), ("running", idle), ("waiting", waiting)):
                if req is not None:
                    aborted[req.request_id] = state
                    assert llm.abort(req.request_id)
            assert "waiting" in aborted.values() and "in_flight" in aborted.values()
            assert not llm.abort("no-such-id")
    finals = check_stream(items, [str(i) for i in range(len(ps))])
    for rid, out in finals.items():
        if rid in aborted:
            assert (out.finish_reason, out.error) == ("cancelled", "request aborted"), (aborted[rid], out)
            assert len(out.token_ids) < 60
            assert out.token_ids == expected[rid].token_ids[:len(out.token_ids)]
        else:  # the others are untouched by the aborts
            assert out.finish_reason == "length" and out.token_ids[:12] == expected[rid].token_ids
    assert not llm.abort("0"), "nothing to abort once the run is over"


def test_abort_from_another_thread_during_generate(llm: LLM) -> None:
    params = [SamplingParams(max_tokens=100, ignore_eos=True), SamplingParams(max_tokens=4, ignore_eos=True)]
    short_done, issued = threading.Event(), threading.Event()
    answers: list[bool] = []

    def abort_when_running() -> None:
        short_done.wait(30)
        answers.append(llm.abort("long"))
        issued.set()

    def on_finish(req: object) -> None:
        if req.request_id == "short":  # "long" is mid-decode now; hold the loop until the abort is in
            short_done.set()
            issued.wait(30)
    t = threading.Thread(target=abort_when_running)
    t.start()
    reqs = [llm.make_request(i, p, sp) for i, p, sp in zip(("long", "short"), prompts()[:2], params)]
    outs = llm.run(reqs, on_finish=on_finish)
    t.join()
    assert answers == [True]
    assert outs[0].finish_reason == "cancelled" and 4 <= len(outs[0].token_ids) < 10, outs[0]
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 4


def test_a_call_from_another_thread_during_a_run_is_refused_by_name(llm: LLM) -> None:
    """An LLM runs one call at a time: a second thread's generate() while one runs is a clear
    error (it used to close the running generator: 'generator already executing'), and the run
    under way finishes untouched."""
    ps = prompts()
    expected = [fields(o) for o in llm.generate(ps, GREEDY)]
    errors: list[BaseException] = []

    def other_thread() -> None:
        try:
            llm.generate(ps[:1], GREEDY)
        except BaseException as e:  # noqa: BLE001 - whatever it is, the test shows it
            errors.append(e)

    def on_finish(req: object) -> None:
        if not errors:
            t = threading.Thread(target=other_thread)
            t.start()
            t.join(60)
    reqs = [llm.make_request(str(i), p, GREEDY) for i, p in enumerate(ps)]
    outs = llm.run(reqs, on_finish=on_finish)
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError), errors
    assert "running a generate() call from another thread" in str(errors[0])
    assert [fields(o) for o in outs] == expected
    # a stream merely left half-read in another thread does not hold the LLM: the next run closes it
    holder: list = []

    def read_a_little() -> None:
        stream = llm.generate_stream(ps, SamplingParams(max_tokens=50, ignore_eos=True))
        holder.append((stream, next(stream)))
    t = threading.Thread(target=read_a_little)
    t.start()
    t.join(60)
    assert holder and [fields(o) for o in llm.generate(ps, GREEDY)] == expected


def test_stream_left_early_cancels_the_rest_and_the_llm_stays_usable(llm: LLM) -> None:
    ps = prompts()
    expected = [fields(o) for o in llm.generate(ps, GREEDY)]
    stream = llm.generate_stream(ps, SamplingParams(max_tokens=50, ignore_eos=True))
    first = next(stream)
    assert not first.finished
    stream.close()  # the micro-batches in flight are collected, the requests cancelled
    run = llm.last_run
    assert all(r.finished for r in run.requests) and not llm.engine.in_flight
    assert {r.finish_reason for r in run.requests} == {"cancelled"}
    assert {r.error for r in run.requests} == {"the stream was closed before this request finished"}
    assert [fields(o) for o in llm.generate(ps, GREEDY)] == expected
    # a stream merely abandoned (never closed) is closed by the next run
    abandoned = llm.generate_stream(ps, SamplingParams(max_tokens=50, ignore_eos=True))
    for _, _ in zip(range(5), abandoned):
        pass
    assert [fields(o) for o in llm.generate(ps, GREEDY)] == expected


def test_stream_cut_short_by_a_new_run_still_ends_every_request(llm: LLM) -> None:
    """generate() inside a stream's loop closes the stream's run; the stream still gives every
    request its one final output (cancelled), and the inner run's results are right."""
    ps = prompts()
    expected = [fields(o) for o in llm.generate(ps, GREEDY)]
    items, inner = [], None
    for it in llm.generate_stream(ps, SamplingParams(max_tokens=50, ignore_eos=True)):
        items.append(it)
        if inner is None:
            inner = [fields(o) for o in llm.generate(ps, GREEDY)]
    finals = check_stream(items, [str(i) for i in range(len(ps))])
    assert {o.finish_reason for o in finals.values()} == {"cancelled"}
    assert inner == expected


def test_inputs_as_numpy_and_mismatched_lists(llm: LLM) -> None:
    ps = prompts()[:3]
    expected = [fields(o) for o in llm.generate(ps, GREEDY)]
    as_numpy = [np.array(p, dtype=np.int64) for p in ps]  # numpy arrays of numpy integers
    assert [fields(o) for o in llm.generate(as_numpy, GREEDY)] == expected
    with pytest.raises(ValueError, match="params has 2 entries for 3 prompts"):
        llm.generate(ps, [GREEDY, GREEDY])
    with pytest.raises(ValueError, match="ids has 4 entries for 3 prompts"):
        llm.generate(ps, GREEDY, ids=["a", "b", "c", "d"])
    # a params entry that is not SamplingParams fails its own request only
    outs = llm.generate(ps, [GREEDY, {"max_tokens": 12}, GREEDY])
    assert outs[1].finish_reason == "error" and outs[1].error == "params[1] is a dict, not SamplingParams"
    assert [fields(outs[i]) for i in (0, 2)] == [expected[0], expected[2]]


def test_one_text_or_one_list_of_ids_is_one_prompt(llm: LLM) -> None:
    # as in vLLM; iterated, a text became a request per character and an id list one per id
    ids = prompts()[0]
    expected = [fields(o) for o in llm.generate([ids], GREEDY)]
    assert [fields(o) for o in llm.generate(ids, GREEDY)] == expected
    assert [fields(o) for o in llm.generate(np.array(ids), GREEDY)] == expected
    assert [fields(o) for o in llm.generate(tuple(ids), GREEDY)] == expected
    outs = llm.generate("hello", GREEDY)  # llama-tiny has no tokenizer: one error, not five
    assert len(outs) == 1 and outs[0].finish_reason == "error"


def test_reconfigure_changes_scheduling_only_and_resizes_the_running_set(llm: LLM) -> None:
    ps = prompts()
    expected = [fields(o) for o in llm.generate(ps, GREEDY)]
    with pytest.raises(ValueError, match="reconfigure: max_model_len cannot change after start"):
        llm.reconfigure(max_model_len=4096)
    with pytest.raises(ValueError, match="max_batch_size must be a positive integer"):
        llm.reconfigure(max_batch_size=0)
    try:
        llm.reconfigure(max_batch_size=6)
        assert llm.sched_config.max_running == 12  # pp × max_batch_size, as a new LLM would have
        assert [fields(o) for o in llm.generate(ps, GREEDY)] == expected
        assert max(mb.decode_tokens + (mb.prefill_tokens > 0) for mb in llm.engine.history) > 3
    finally:
        llm.reconfigure(max_batch_size=3)
    assert llm.sched_config.max_running == 6


def test_run_dir_records_the_scheduling_the_run_ran_under(llm: LLM, tmp_path: Path) -> None:
    """longest_first gives the same greedy tokens; a reconfigure after the run does not rewrite
    what write_run_dir says the run used."""
    from pp_runtime.rundir import write_run_dir
    ps = prompts()
    params = [SamplingParams(max_tokens=2 + 3 * i % 7) for i in range(len(ps))]
    expected = [fields(o) for o in llm.generate(ps, params)]
    try:
        llm.reconfigure(admission="longest_first", chunk_budget="tokens", kv_admission="reserve")
        assert [fields(o) for o in llm.generate(ps, params)] == expected
    finally:
        llm.reconfigure(admission="fcfs", chunk_budget="flops", kv_admission="optimistic")
    summary = write_run_dir(str(tmp_path), llm)
    assert (summary["admission"], summary["chunk_budget"], summary["step_costs"], summary["kv_admission"]) == \
        ("longest_first", "tokens", [], "reserve")
    before = llm.sched_config
    with pytest.raises(ValueError, match="SchedulerConfig.kv_admission must be one of reserve, optimistic, got 'eager'"):
        llm.reconfigure(kv_admission="eager")
    assert llm.sched_config == before
    # measured step costs (pp = 2 here: they apply) reshape the micro-batches, not the tokens
    with pytest.raises(ValueError, match="SchedulerConfig.step_costs must be empty or 3 finite numbers"):
        llm.reconfigure(step_costs=(0.1, -1.0, 0.0))
    try:
        llm.reconfigure(step_costs=(0.01, 0.5, 0.05))
        assert [fields(o) for o in llm.generate(ps, params)] == expected
    finally:
        llm.reconfigure(step_costs=())
    assert write_run_dir(str(tmp_path / "costs"), llm)["step_costs"] == [0.01, 0.5, 0.05]


def test_stage_failure_ends_the_run_with_its_error_and_marks_the_llm_broken(monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception inside a local stage (a bug, an op that fails) is a dead worker: the run's
    unfinished requests get its error naming the stage, finished ones keep their tokens, and the
    LLM refuses further runs instead of pairing leftover plans with new micro-batches."""
    from pp_runtime.executor import WorkerError
    with LLM(model="llama-tiny", pp=2, launcher="local", chunk_size=8, max_batch_size=3,
             memory_budget_gb=0.05) as m:
        fail_on_call(monkeypatch, m.executor.workers[1], 12, "boom\nsecond line")
        outs = m.generate([[5, 6, 7], list(range(3, 60))], [SamplingParams(max_tokens=1), GREEDY])
        assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 1  # finished before
        assert outs[1].finish_reason == "error"
        assert outs[1].error == "worker stage 1 tp_rank 0 (in this process) failed: boom"
        with pytest.raises(WorkerError, match="workers are gone"):
            m.generate([[5, 6, 7]], GREEDY)


@pytest.mark.parametrize("where", ("mid_step", "on_finish"))
def test_ctrl_c_on_an_in_process_llm_keeps_it_usable(llm: LLM, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """A KeyboardInterrupt (Ctrl-C in a notebook) inside a stage, after stage 0 handed its
    activations on, or in the caller's callback: the run ends with every request's output
    (RunInterrupted), and the in-process pipeline is reset rather than discarded, so the next
    call gives the same tokens without reloading the weights."""
    from pp_runtime.run_outputs import RunInterrupted
    ps = prompts()
    expected = [fields(o) for o in llm.generate(ps, GREEDY)]
    reqs = [llm.make_request(str(i), p, GREEDY) for i, p in enumerate(ps)]
    on_finish = None
    if where == "mid_step":
        worker, calls = llm.executor.workers[1], []
        real = worker.execute

        def interrupted_step(wire: tuple) -> list[int] | None:
            calls.append(1)
            if len(calls) == 6:
                raise KeyboardInterrupt
            return real(wire)
        monkeypatch.setattr(worker, "execute", interrupted_step)
    else:
        def on_finish(req: object) -> None:
            raise KeyboardInterrupt
    with pytest.raises(RunInterrupted) as e:
        llm.run(reqs, on_finish=on_finish)
    monkeypatch.undo()
    outs = e.value.outputs
    assert len(outs) == len(ps) and "cancelled" in {o.finish_reason for o in outs}
    assert not llm.broken
    assert [fields(o) for o in llm.generate(ps, GREEDY)] == expected


@pytest.mark.parametrize("where", ("mid_step", "on_finish"))
def test_a_signal_after_a_worker_died_reports_the_worker(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """torchrun's agent SIGTERMs rank 0 once another rank has died, which can arrive before any
    wait of rank 0's failed: an executor that can tell (``fault``) turns the interrupt into that
    worker's error, every unfinished request carrying it, and not "cancelled"; where the signal
    lands in the caller's callback, the requests the run then finishes still reach it."""
    from pp_runtime.executor import WorkerError
    with LLM(model="llama-tiny", pp=2, launcher="local", chunk_size=8, max_batch_size=3, memory_budget_gb=0.05,
             max_model_len=128) as m:
        calls, seen = [], []
        if where == "mid_step":
            worker = m.executor.workers[1]
            real = worker.execute

            def signalled(wire: tuple) -> list[int] | None:
                calls.append(1)
                if len(calls) == 4:
                    raise KeyboardInterrupt("SIGTERM")
                return real(wire)
            monkeypatch.setattr(worker, "execute", signalled)

        def on_finish(req: object) -> None:
            seen.append(req.request_id)
            if where == "on_finish" and len(seen) == 1:
                raise KeyboardInterrupt("SIGTERM")
        monkeypatch.setattr(m.executor, "fault", lambda: WorkerError("worker stage 1 tp_rank 0 died: gone"),
                            raising=False)
        reqs = [m.make_request(str(i), p, GREEDY) for i, p in enumerate(prompts())]
        outs = m.run(reqs, on_finish=on_finish)
        assert len(outs) == len(prompts()) and {o.finish_reason for o in outs} <= {"length", "error"}
        assert {o.error for o in outs if o.finish_reason == "error"} == {"worker stage 1 tp_rank 0 died: gone"}
        assert m.broken == "worker stage 1 tp_rank 0 died: gone"
        assert sorted(seen) == sorted(r.request_id for r in reqs)  # every request reached the callback once


def test_a_callback_that_raises_ends_its_run_at_once(llm: LLM) -> None:
    """The caller's exception comes out, and the run is drained there: no blocks stay held until
    the next call, which runs as usual."""
    ps = prompts()
    expected = [fields(o) for o in llm.generate(ps, GREEDY)]

    def on_finish(req: object) -> None:
        raise ValueError("the caller's own bug")
    reqs = [llm.make_request(str(i), p, GREEDY) for i, p in enumerate(ps)]
    with pytest.raises(ValueError, match="the caller's own bug"):
        llm.run(reqs, on_finish=on_finish)
    assert llm._open is None and all(r.finished for r in reqs) and not llm.engine.in_flight
    assert llm.blocks.num_free == llm.blocks.num_blocks
    assert [fields(o) for o in llm.generate(ps, GREEDY)] == expected


def test_stop_strings_on_a_model_without_a_tokenizer_fail_alone(llm: LLM) -> None:
    outs = llm.generate(prompts()[:2], [SamplingParams(max_tokens=3, stop=["x"]), GREEDY])
    assert outs[0].finish_reason == "error" and outs[0].error.startswith("stop strings need the model's tokenizer")
    assert outs[1].finish_reason == "length"


def test_a_stop_check_finishes_the_request_at_that_token(llm: LLM) -> None:
    """The scheduler calls a request's stop_check after each new token (no tokenizer in it): the
    request stops there, its text set by the check, and its blocks are freed."""
    ps = prompts()
    full = llm.generate(ps[:2], GREEDY)
    reqs = [llm.make_request(str(i), p, GREEDY) for i, p in enumerate(ps[:2])]

    def third_token(req: object) -> bool:
        if len(req.output_token_ids) < 3:
            return False
        req.text = "cut"
        return True
    reqs[0].stop_check = third_token
    outs = llm.run(reqs)
    assert (outs[0].finish_reason, outs[0].token_ids, outs[0].text) == ("stop", full[0].token_ids[:3], "cut")
    assert fields(outs[1]) == fields(full[1]) and llm.blocks.num_free == llm.blocks.num_blocks


def test_llm_after_shutdown_says_so() -> None:
    from pp_runtime.executor import WorkerError
    with LLM(model="llama-tiny", launcher="local", memory_budget_gb=0.05) as m:
        pass
    with pytest.raises(WorkerError, match=r"workers are gone \(shut down\)"):
        m.generate([[5, 6, 7]], GREEDY)


@pytest.mark.parametrize("kw, message", [
    (dict(max_model_len=0), "max_model_len must be a positive integer"),
    (dict(max_batch_size=0), "max_batch_size must be a positive integer"),
    (dict(max_model_len=5000), "max_model_len=5000 exceeds the model's 1024 positions"),
    (dict(seed=1.5), "EngineConfig.seed must be an integer, got 1.5"),
    (dict(memory_budget_gb=100000), r"memory_budget_gb=100000 exceeds the .* GiB of memory this worker's node"),
    (dict(memory_budget_gb="4"), "memory_budget_gb must be a finite number > 0, got '4'"),
    (dict(memory_budget_gb=float("inf")), "memory_budget_gb must be a finite number > 0, got inf"),
    (dict(threads=1.5), "DeviceConfig.threads must be an integer ≥ 0, got 1.5"),
    (dict(partition="2,2"), r"partition must be a list of layer counts \(e.g. \[16, 14\]\), got '2,2'"),
    (dict(tile_align="yes"), "SchedulerConfig.tile_align must be true or false, got 'yes'"),
])
def test_constructor_values_are_checked_not_replaced(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(model="llama-tiny", launcher="local", **{"memory_budget_gb": 0.05, **kw})


def test_run_arrivals_are_checked_before_the_run(llm: LLM) -> None:
    """A NaN or infinite arrival would never come (the run would wait forever), a short list would
    leave requests without a time: each is one ValueError naming the entry, and nothing runs."""
    ps = prompts()[:2]
    for arrivals, message in (([0.0], "arrivals has 1 entries for 2 requests"),
                              ([0.0, float("nan")], r"arrivals\[1\] must be a finite number of seconds ≥ 0, got nan"),
                              ([float("inf"), 0.0], r"arrivals\[0\] must be .* got inf"),
                              ([0.0, -1], r"arrivals\[1\] must be .* got -1"),
                              ([0.0, "1"], r"arrivals\[1\] must be .* got '1'")):
        reqs = [llm.make_request(f"r{i}", p, GREEDY) for i, p in enumerate(ps)]
        with pytest.raises(ValueError, match=message):
            llm.run(reqs, arrivals=arrivals)
        assert not any(r.finished for r in reqs)
    reqs = [llm.make_request(f"r{i}", p, GREEDY) for i, p in enumerate(ps)]
    outs = llm.run(reqs, arrivals=[0.0, np.float64(0.01)])
    assert [o.finish_reason for o in outs] == ["length", "length"]


def test_reconfigure_checks_max_batch_size_before_using_it(llm: LLM) -> None:
    before = llm.sched_config
    with pytest.raises(ValueError, match="max_batch_size must be a positive integer, got None"):
        llm.reconfigure(max_batch_size=None)
    assert llm.sched_config == before


@pytest.mark.parametrize("kv_admission", ["reserve", "optimistic"])
def test_default_max_batch_size_is_64_whatever_b(kv_admission: str) -> None:
    """Without --max-batch-size a micro-batch holds up to 64 sequences and pp × that many may run
    (every micro-batch in flight full), under either admission, whatever the paper's B: both
    admit by KV blocks, so B (full-length requests the budget holds) is no count cap."""
    kw = dict(model="llama-tiny", pp=2, launcher="local", max_model_len=128, kv_admission=kv_admission)
    with LLM(model="llama-tiny", launcher="local", max_model_len=128, memory_budget_gb=0.002) as m:
        assert m.sched_config.kv_admission == "optimistic"  # the default, vLLM's
    bs = []
    for budget_gb in (0.002, 0.05):  # B on either side of 2 × 64
        with LLM(**kw, memory_budget_gb=budget_gb) as m:
            bs.append(m.memory.max_batch_b)
            assert m.memory.max_batch_b == m.memory.num_blocks * 16 // 128
            assert (m.sched_config.max_batch_size, m.sched_config.max_running) == (64, 128)
    assert bs[0] < 2 * 64 < bs[1]
    with LLM(**kw, tile_align=True, chunk_size=32) as m:  # tile_align: C tokens a batch, decodes included
        assert (m.sched_config.max_batch_size, m.sched_config.max_running) == (32, 64)
        m.reconfigure(tile_align=False)  # the default follows the scheduling (bench's next scheduler)
        assert (m.sched_config.max_batch_size, m.sched_config.max_running) == (64, 128)
        m.reconfigure(tile_align=True, chunk_size=16)
        assert m.sched_config.max_batch_size == 16
        m.reconfigure(max_batch_size=8)  # given: kept through later changes
        m.reconfigure(tile_align=False, chunk_size=64)
        assert (m.sched_config.max_batch_size, m.sched_config.max_running) == (8, 16)


def _two_full_requests_llm(**kw: object) -> LLM:
    """llama-tiny whose KV budget holds B = 2 requests of max_model_len 256 (blocks of 8)."""
    kw = dict(model="llama-tiny", launcher="local", chunk_size=64, block_size=8, max_model_len=256, **kw)
    plan = LLM(**kw, memory_budget_gb=0.05)
    budget = (plan.memory.weight_bytes + 2 * 256 * plan.memory.kv_bytes_per_token) / (1 << 30)
    plan.shutdown()
    llm = LLM(**kw, memory_budget_gb=budget)
    assert llm.memory.max_batch_b == 2
    return llm


SHORT_PROMPTS = [[5 + (i * 13 + k) % 300 for k in range(8 + i % 9)] for i in range(12)]


def test_either_admission_runs_more_short_requests_than_b_at_once() -> None:
    """The KV budget holds B = 2 requests of max_model_len 256, but 12 of ≤ 24 tokens fit whole:
    under either admission all 12 start together (one micro-batch of 12 decodes), with no
    preemption and the same tokens."""
    out = {}
    with _two_full_requests_llm() as llm:
        for kv in ("reserve", "optimistic"):
            llm.reconfigure(kv_admission=kv)
            out[kv] = [o.token_ids for o in llm.generate(SHORT_PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))]
            assert max(m.decode_tokens for m in llm.last_run.engine.history) == 12
            assert sum(r.num_preemptions for r in llm.last_run.requests) == 0
    assert out["reserve"] == out["optimistic"]


def test_requests_that_stop_early_run_wider_under_optimistic() -> None:
    """max_tokens 200 that each request's stop token ends within 4: reserve counts the 200 (two
    requests of ≤ 216 tokens fill the 64 blocks), optimistic only the blocks in use (all 12 run at
    once); the tokens are the same."""
    with _two_full_requests_llm(enable_prefix_caching=False) as llm:
        first = llm.generate(SHORT_PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
        # each request's stop token: its output's 4th token, which ends it at its first occurrence
        params = [SamplingParams(max_tokens=200, stop_token_ids=[o.token_ids[3]]) for o in first]
        out, widest = {}, {}
        for kv in ("reserve", "optimistic"):
            llm.reconfigure(kv_admission=kv)
            outs = llm.generate(SHORT_PROMPTS, params)
            assert all(o.finish_reason == "stop" and len(o.token_ids) <= 4 for o in outs)
            out[kv] = [o.token_ids for o in outs]
            widest[kv] = max(len(m.chunks) for m in llm.last_run.engine.history)
        assert out["reserve"] == out["optimistic"]
        assert out["reserve"] == [o.token_ids[:len(t)] for o, t in zip(first, out["reserve"])]
    assert widest == {"reserve": 2, "optimistic": 12}


# ---- memory pressure ----------------------------------------------------------------------------
@pytest.mark.parametrize("scheduler", ["sarathi", "orca"])
def test_kv_cache_far_below_demand_preempts_without_changing_outputs(scheduler: str, tmp_path: Path) -> None:
    from pp_runtime.rundir import write_run_dir
    block, max_len = 8, 128
    kw = dict(model="llama-tiny", pp=2, launcher="local", chunk_size=16, block_size=block, max_model_len=max_len,
              scheduler=scheduler)
    big = LLM(**kw, memory_budget_gb=0.05)
    # Just one max-length request's worth of blocks (16), against demand of ~10 times that.
    plan = big.memory
    budget = (plan.weight_bytes + (max_len // block) * block * plan.kv_bytes_per_token) / (1 << 30)
    small = LLM(**kw, memory_budget_gb=budget, max_batch_size=8, kv_admission="optimistic")
    assert small.memory.num_blocks == max_len // block < big.memory.num_blocks // 100
    ps = [[3 + (i * 31 + k) % 500 for k in range(10 + 7 * i % 40)] for i in range(12)]
    params = [SamplingParams(max_tokens=60 - len(p) % 20, ignore_eos=True, **(
        {"temperature": 0.9, "seed": i} if i % 3 == 0 else {})) for i, p in enumerate(ps)]
    ps.insert(5, [7] * 100)  # 100 + 40 > 128 tokens: it can never fit
    params.insert(5, SamplingParams(max_tokens=40))
    try:
        expected = big.generate(ps, params)
        got = small.generate(ps, params)
        summary = write_run_dir(str(tmp_path), small)
    finally:
        big.shutdown()
        small.shutdown()
    assert [fields(o) for o in got] == [fields(o) for o in expected]
    assert got[5].finish_reason == "error" and "exceeds the model's max length 128" in got[5].error
    assert all(o.finish_reason == "length" for i, o in enumerate(got) if i != 5)
    preemptions = sum(r.num_preemptions for r in small.last_run.requests)
    assert preemptions >= 5 and summary["preemptions"] == preemptions


def test_narrow_kv_caches_hold_more_tokens_in_the_same_budget() -> None:
    """LLM(kv_cache_dtype="float16" / "fp8") at pp = 2: every stage's cache is half / a quarter, the
    plan holds 2× / 4× the blocks for the same budget, and a run completes; a bad value names the
    setting."""
    kw = dict(model="llama-tiny", pp=2, launcher="local", chunk_size=8, max_batch_size=3, memory_budget_gb=0.05)
    plans = {}
    for kv in ("auto", "float16", "fp8"):
        with LLM(kv_cache_dtype=kv, **kw) as llm:
            plans[kv] = llm.memory
            out = llm.generate([list(range(3, 40))], SamplingParams(max_tokens=5, ignore_eos=True))[0]
            assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert plans["float16"].kv_bytes_per_token * 2 == plans["auto"].kv_bytes_per_token
    assert plans["float16"].num_blocks >= 2 * plans["auto"].num_blocks - 1
    assert plans["fp8"].kv_bytes_per_token * 4 == plans["auto"].kv_bytes_per_token
    assert plans["fp8"].num_blocks >= 4 * plans["auto"].num_blocks - 3
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto or float16 or fp8, got 'int4'"):
        LLM(kv_cache_dtype="int4", **kw)


@pytest.mark.parametrize("partition", ((3.5, 0.5), (np.float64(2.5), np.int64(1), np.float64(0.5)), (0.5, 0.5, 3)))
def test_half_layer_partitions_generate_what_one_stage_does(partition: tuple) -> None:
    """Cut layers in a local pipeline, including a stage holding only an MLP half (no KV cache:
    it must not size the block pool) and numpy numbers as a config file's loader may give them."""
    prompts = [list(range(3, 40)), list(range(50, 61))]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    kw = dict(model="llama-tiny", launcher="local", chunk_size=8, max_batch_size=3, memory_budget_gb=0.05)
    with LLM(**kw) as one:
        expected = [o.token_ids for o in one.generate(prompts, params)]
        blocks = one.memory.num_blocks
    with LLM(pp=len(partition), partition=partition, **kw) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
        assert llm.memory.num_blocks >= blocks  # the stages with attention hold fewer layers' K/V each
