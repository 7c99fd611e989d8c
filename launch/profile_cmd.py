"""`pp-runtime profile`: per-operation times of one worker (stages/profile.py), optionally with
N-1 co-located copies of itself, or of every stage worker of a deployment (--pp/--tp/--launcher).

    pp-runtime profile --model llama-tiny --grid quick --out runs/prof --colocate 2
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from launch.commands import check_writable
from launch.parser import parse_partition


def cmd_profile(a: argparse.Namespace) -> int:
    from pp_runtime.profile_grid import parse_grid
    check_writable("--out", a.out, is_dir=True)
    grid = parse_grid(a.grid)  # a bad grid fails here, before any worker or sibling starts
    if a.pp > 1 or a.tp > 1 or a.launcher:
        return _profile_deployment(a, grid)
    from stages.profile import run_profile
    barrier = a.barrier
    if a.colocate > 1:
        barrier = (str(Path(a.out) / ".barrier"), str(a.colocate))
        shutil.rmtree(barrier[0], ignore_errors=True)
    siblings = [_profile_sibling(a, k, barrier) for k in range(1, a.colocate)]
    try:
        run_profile(a.model, a.device, a.dtype, a.out, grid=a.grid, threads=a.threads, attention=a.attention,
                    kv_dtype=a.kv_cache_dtype, matmul_precision=a.matmul_precision,
                    progress=not a.quiet, ready=(lambda: _file_barrier(barrier[0], int(barrier[1])))
                    if barrier else None)
    finally:
        failed = [k for k, p in enumerate(siblings, 1) if p.wait() != 0]
    if failed:
        from pp_runtime.executor import WorkerError
        raise WorkerError(f"co-located profile(s) {failed} failed; see {a.out}/colocated-K/profile.log")
    return 0


def _profile_deployment(a: argparse.Namespace, grid: object) -> int:
    from pp_runtime.llm import LLM
    from pp_runtime.profile_deploy import profile_deployment
    if a.colocate > 1:
        raise ValueError("--colocate profiles one worker in N processes; a deployment (--pp/--tp/--launcher) "
                         "already runs all its workers at once")
    partition = parse_partition(a.partition)
    with LLM(a.model, pp=a.pp, tp=a.tp, launcher=a.launcher, dtype=a.dtype, device=a.device, attention=a.attention,
             block_size=grid.block_size, memory_budget_gb=a.memory_budget_gb, max_model_len=grid.max_len(),
             partition=partition, threads=a.threads, kv_cache_dtype=a.kv_cache_dtype,
             matmul_precision=a.matmul_precision) as llm:
        profile_deployment(llm, a.grid, a.out, progress=not a.quiet)
    print(f"per-stage profiles in {a.out}/stage-K/profile.csv")
    return 0


def _profile_sibling(a: argparse.Namespace, k: int, barrier: tuple[str, str]) -> subprocess.Popen:
    """The same profile in another process (its own model copy and cache), output in OUT/colocated-K."""
    out = Path(a.out) / f"colocated-{k}"
    out.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "launch.cli", "profile", "--device", a.device, "--dtype", a.dtype,
            "--attention", a.attention, "--threads", str(a.threads), "--grid", a.grid, "--out", str(out), "--quiet",
            "--kv-cache-dtype", a.kv_cache_dtype, "--matmul-precision", a.matmul_precision,
            "--barrier", *barrier]
    if a.model:
        args += ["--model", a.model]
    with open(out / "profile.log", "w") as log:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)


def _file_barrier(folder: str, parties: int, timeout_s: float = 600.0) -> None:
    """Co-located profiles start timing together: each drops a file, then waits for all N."""
    os.makedirs(folder, exist_ok=True)
    Path(folder, f"ready-{os.getpid()}").touch()
    deadline = time.monotonic() + timeout_s
    while len(os.listdir(folder)) < parties:
        if time.monotonic() > deadline:
            raise RuntimeError(f"co-located profiles: only {len(os.listdir(folder))} of {parties} became ready")
        time.sleep(0.05)
