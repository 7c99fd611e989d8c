"""A stage worker killed, hung or failing mid-run (Ray, pp=2, plans on the control group): the
run ends within the timeout bound with an error naming the worker, every request comes back
(errors for the unfinished), and no worker process survives."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from pp_runtime import LLM, SamplingParams


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_killed_stage_worker_is_reported_and_cleaned_up() -> None:
    llm = LLM(model="llama-tiny", pp=2, launcher="ray", memory_budget_gb=0.05, chunk_size=4)
    try:
        pids = {(w["stage"], w["tp_rank"]): w["pid"] for w in llm.workers_info()}
        llm.executor.timeout_s = 20.0
        victim = pids[(1, 0)]
        prompts = [list(range(3, 3 + n)) for n in (30, 12, 50, 7)] * 2
        killer = threading.Timer(0.3, os.kill, (victim, signal.SIGKILL))  # the run takes seconds
        started = time.monotonic()
        killer.start()
        outs = llm.generate(prompts, SamplingParams(max_tokens=400, ignore_eos=True))
        elapsed = time.monotonic() - started
    finally:
        llm.shutdown()
    assert elapsed < 0.3 + 20.0 + 10.0, f"took {elapsed:.1f} s"
    assert len(outs) == 8 and llm.broken and "stage 1 tp_rank 0" in llm.broken
    errors = [o for o in outs if o.finish_reason == "error"]
    assert errors and all("stage 1 tp_rank 0" in o.error for o in errors)
    deadline = time.monotonic() + 15
    while any(alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids.values() if alive(p)], "worker processes survived"
    with pytest.raises(RuntimeError, match="workers are gone"):
        llm.generate([[3, 4]], SamplingParams(max_tokens=2))


def test_hung_stage_worker_times_out_with_its_name() -> None:
    llm = LLM(model="llama-tiny", pp=2, launcher="ray", memory_budget_gb=0.05, chunk_size=4)
    try:
        pids = {(w["stage"], w["tp_rank"]): w["pid"] for w in llm.workers_info()}
        llm.executor.timeout_s = 4.0
        stopper = threading.Timer(0.5, os.kill, (pids[(0, 0)], signal.SIGSTOP))  # alive but silent
        started = time.monotonic()
        stopper.start()
        outs = llm.generate([list(range(3, 40))] * 3, SamplingParams(max_tokens=600, ignore_eos=True))
        elapsed = time.monotonic() - started
    finally:
        llm.shutdown()
    assert elapsed < 0.5 + 4.0 + 10.0, f"took {elapsed:.1f} s"
    assert "did not answer within 4 s" in llm.broken and "stage" in llm.broken
    assert all(o.finish_reason in ("error", "length") for o in outs) and any(o.finish_reason == "error" for o in outs)
    deadline = time.monotonic() + 15
    while any(alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids.values() if alive(p)], "worker processes survived"


def test_failing_step_is_reported_with_its_cause_and_worker() -> None:
    """A plan that a worker cannot run ends its serve loop: the driver reports that worker and
    the cause within a poll, not at the ping timeout, and shutdown does not wait on the loops."""
    llm = LLM(model="llama-tiny", pp=2, launcher="ray", memory_budget_gb=0.05, chunk_size=4)
    try:
        pids = [w["pid"] for w in llm.workers_info()]
        executor = llm.executor
        executor._plans[0].send(("not", "a", "plan"))  # stage 0 forwards it, then fails to unpack it
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"stage 0 tp_rank 0 .*failed: ValueError") as err:
            executor.collect()
        assert time.monotonic() - started < executor.timeout_s / 2, "found by the ping timeout, not the poll"
        assert executor.failed, err.value
    finally:
        llm.shutdown()
    deadline = time.monotonic() + 15
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if alive(p)], "worker processes survived"


def test_idle_deployment_outlives_its_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between runs the serve loops wait for a plan with no deadline: a deployment left idle for
    longer than its timeout_s still runs the next request."""
    monkeypatch.setenv("PP_RUNTIME_WORKER_TIMEOUT_S", "3")  # start-up is not held to it
    with LLM(model="llama-tiny", pp=2, launcher="ray", memory_budget_gb=0.05) as llm:
        first = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids
        time.sleep(4.0)
        again = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids
    assert again == first and len(first) == 3
