"""`ray job submit -- pp-runtime generate ...` against a local Ray head (token auth, loopback)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_naming(text: str) -> list[int]:
    """The pids whose command line holds ``text``."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and text in (d / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(d.name))
        except OSError:  # gone meanwhile
            continue
    return pids


def stop_cluster(temp_dir: str) -> None:
    """Ends the processes of the Ray cluster under ``temp_dir`` (each names it on its command line),
    SIGTERM, then SIGKILL for those left after 10 s. Not ``ray stop``: it ends every Ray process on
    the machine, and with the suite in two xdist workers it killed the other worker's stage actors
    as they started."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in processes_naming(temp_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 10
        while processes_naming(temp_dir) and time.monotonic() < deadline:
            time.sleep(0.2)


@pytest.fixture()
def ray_head() -> Iterator[dict]:
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", RAY_AUTH_MODE="token",
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env.pop("RAY_ADDRESS", None)
    subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
    dash = free_port()
    temp_dir = tempfile.mkdtemp(prefix="rayjob-", dir="/tmp")  # short: Ray's socket paths live under it
    try:
        start = subprocess.run([str(BIN / "ray"), "start", "--head", "--node-ip-address", "127.0.0.1",
                                "--port", str(free_port()), "--dashboard-host", "127.0.0.1", "--dashboard-port",
                                str(dash), "--num-cpus", "4", "--include-dashboard", "true", "--disable-usage-stats",
                                "--temp-dir", temp_dir], env=env, capture_output=True, text=True, timeout=120)
        assert start.returncode == 0, start.stdout + start.stderr
        env["RAY_DASHBOARD"] = f"http://127.0.0.1:{dash}"
        yield env
    finally:
        stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_job_submit_generate(ray_head: dict, tmp_path: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "prompt_token_ids": list(range(3, 3 + n)), "max_tokens": 6,
                                       "ignore_eos": True}) + "\n" for i, n in enumerate((4, 19, 9))))
    job = subprocess.run([str(BIN / "ray"), "job", "submit", "--address", ray_head["RAY_DASHBOARD"], "--",
                          "pp-runtime", "generate", "--model", "llama-tiny", "--pp", "2", "--chunk-size", "5",
                          "--memory-budget-gb", "0.05", "--input", str(inp), "--output", str(out), "--quiet"],
                         env=ray_head, capture_output=True, text=True, timeout=300)
    assert job.returncode == 0 and "succeeded" in job.stdout + job.stderr, job.stdout[-3000:] + job.stderr[-3000:]
    from pp_runtime import LLM, SamplingParams
    with LLM(model="llama-tiny", memory_budget_gb=0.05) as llm:
        expected = [o.token_ids for o in llm.generate([list(range(3, 3 + n)) for n in (4, 19, 9)],
                                                      SamplingParams(max_tokens=6, ignore_eos=True))]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["r0", "r1", "r2"]
    assert [r["token_ids"] for r in rows] == expected
