"""torchrun SPMD path: pp=2 on two local processes (and as two 'nodes' on 127.0.0.1) gives
the same tokens as the Ray launcher and the in-process engine; a rank that dies or hangs, and
Ctrl-C or SIGTERM, end the run with every request's line and one line saying why."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pp_runtime import LLM, SamplingParams
from tests.conftest import mixed_prompts
from tests.launch.test_worker_failure import alive

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
ARGS = ["-m", "launch.torchrun_main", "--model", "llama-tiny", "--pp", "2", "--chunk-size", "7",
        "--memory-budget-gb", "0.05", "--quiet"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def requests_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    prompts = [[t % 500 for t in p] for p in mixed_prompts(seed=3)]
    path = tmp_path_factory.mktemp("torchrun") / "in.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt_token_ids": p, "max_tokens": 9, "ignore_eos": True,
                                        "logprobs": 2}) + "\n" for i, p in enumerate(prompts)))
    return path, prompts


def read_tokens(path: Path) -> list[list[int]]:
    return [json.loads(line)["token_ids"] for line in path.read_text().splitlines()]


def run(cmd: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_torchrun_pp2_matches_ray_and_local(requests_file: tuple, tmp_path: Path) -> None:
    path, prompts = requests_file
    out = tmp_path / "out.jsonl"
    proc = run(TORCHRUN + ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                           str(free_port())] + ARGS + ["--input", str(path), "--output", str(out)])
    log, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, log[-3000:]
    params = SamplingParams(max_tokens=9, ignore_eos=True, logprobs=2)
    with LLM(model="llama-tiny", pp=2, launcher="ray", chunk_size=7, memory_budget_gb=0.05) as llm:
        ray_tokens = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(model="llama-tiny", chunk_size=7, memory_budget_gb=0.05) as llm:
        local = llm.generate(prompts, params)
    assert read_tokens(out) == ray_tokens == [o.token_ids for o in local]
    # the logprobs came back over the control channel with the tokens (JSONL rows: DESIGN.md §3.3 + logprobs)
    rows = [json.loads(line)["logprobs"] for line in out.read_text().splitlines()]
    want = [o.to_json()["logprobs"] for o in local]
    assert [[e["token_id"] for t in r for e in t] for r in rows] == [[e["token_id"] for t in r for e in t] for r in want]
    assert [e["logprob"] for r in rows for t in r for e in t] == pytest.approx(
        [e["logprob"] for r in want for t in r for e in t], abs=1e-5)


def test_torchrun_two_nodes_on_loopback(requests_file: tuple, tmp_path: Path) -> None:
    path, prompts = requests_file
    out = tmp_path / "out.jsonl"
    port = str(free_port())
    procs = [run(TORCHRUN + ["--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1",
                             "--master-addr", "127.0.0.1", "--master-port", port] + ARGS
                 + ["--input", str(path), "--output", str(out)]) for rank in (0, 1)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-2000:] for log in logs)
    with LLM(model="llama-tiny", chunk_size=7, memory_budget_gb=0.05) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=9, ignore_eos=True))]
    assert read_tokens(out) == expected


@pytest.fixture(scope="module")
def long_requests(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16 requests: 4 finish within a few steps, 12 decode for 900 (one a micro-batch, --max-batch-size 1:
    ~18 s; the fault lands among them however fast the box is)."""
    path = tmp_path_factory.mktemp("torchrun_faults") / "long.jsonl"
    rows = [{"id": f"r{i}", "prompt_token_ids": [3 + (i * 7 + j) % 400 for j in range(10 + 3 * i)],
             "max_tokens": 4 if i < 4 else 900, "ignore_eos": True} for i in range(16)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("fault", ["kill", "stop", "sigint", "sigterm"])
def test_torchrun_fault_ends_the_run_with_every_result(long_requests: Path, tmp_path: Path, fault: str) -> None:
    """Stage 1's rank killed or stopped mid-run, or Ctrl-C / SIGTERM to the whole job: rank 0 writes a
    line for every request (the 4 short ones finished, the rest with the error naming the worker,
    or cancelled) and says why in one line, within the worker timeout; no rank is left running."""
    out, run_dir = tmp_path / "out.jsonl", tmp_path / "rd"
    env = dict(os.environ, PYTHONPATH=str(REPO), PP_RUNTIME_WORKER_TIMEOUT_S="4")
    cmd = TORCHRUN + ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port())] + \
        ARGS + ["--max-batch-size", "1", "--input", str(long_requests), "--output", str(out), "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "workers.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = json.loads((run_dir / "workers.json").read_text())
        victim = next(w["pid"] for w in workers if w["stage"] == 1)
        time.sleep(1.5)  # the short requests finish (in ~0.1 s on an idle box); the long ones decode
        started = time.monotonic()
        if fault in ("kill", "stop"):
            os.kill(victim, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        else:  # a terminal's Ctrl-C reaches the whole group; a scheduler's SIGTERM the agent, which relays it
            os.killpg(proc.pid, signal.SIGINT) if fault == "sigint" else os.kill(proc.pid, signal.SIGTERM)
        while not out.exists() and time.monotonic() - started < 60:
            time.sleep(0.1)
        elapsed = time.monotonic() - started
        if fault == "stop":  # else torchrun's agent waits its 30 s grace before killing it
            os.kill(victim, signal.SIGKILL)
        log, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert elapsed < 4 + 10, f"results written {elapsed:.1f} s after the fault\n{log[-3000:]}"
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in lines] == [f"r{i}" for i in range(16)]
    assert [r["finish_reason"] for r in lines[:4]] == ["length"] * 4, (lines[:4], log[-3000:])
    ours = [line for line in log.splitlines() if line.startswith("pp-runtime")]
    # kill: rank 0's wait on the dead rank fails, or torchrun's agent, having seen it die, SIGTERMs
    # rank 0 first (TorchrunExecutor.fault)
    expected = {"kill": "worker stage 1 tp_rank 0 on node .* died( during (micro-batch|plan delivery): "
                        ".*(closed|reset) by peer|: its process is gone, and torchrun's agent stopped the run)",
                "stop": "worker stage 1 tp_rank 0 on node .* did not answer within 4 s \\(micro-batch\\)",
                "sigint": "interrupted by SIGINT: 12 of 16 requests cancelled",
                "sigterm": "interrupted by SIGTERM: 12 of 16 requests cancelled"}[fault]
    assert len(ours) == 1 and re.search(expected, ours[0]), log[-3000:]
    reason = "error" if fault in ("kill", "stop") else "cancelled"
    assert {r["finish_reason"] for r in lines[4:]} == {reason}
    ours_traced = [line for line in log.splitlines()  # torchrun's agent prints its own; our ranks none
                   if any(f'File "{REPO / d}' in line for d in ("launch", "pp_runtime", "stages"))]
    assert not ours_traced, log[-3000:]
    assert not [w["pid"] for w in workers if alive(w["pid"])], "a rank survived"
