"""torchrun SPMD path: pp=2 on two local processes (and as two 'nodes' on 127.0.0.1) gives
the same tokens as the Ray launcher and the in-process engine."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pp_runtime import LLM, SamplingParams
from tests.conftest import mixed_prompts

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
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt_token_ids": p, "max_tokens": 9, "ignore_eos": True})
                            + "\n" for i, p in enumerate(prompts)))
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
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    with LLM(model="llama-tiny", pp=2, launcher="ray", chunk_size=7, memory_budget_gb=0.05) as llm:
        ray_tokens = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(model="llama-tiny", chunk_size=7, memory_budget_gb=0.05) as llm:
        local_tokens = [o.token_ids for o in llm.generate(prompts, params)]
    assert read_tokens(out) == ray_tokens == local_tokens


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
