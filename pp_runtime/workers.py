"""The driver's hold on its workers: the executor a ``--launcher`` names, started without losing
the caller's SIGTERM handler, and stopped without the goodbye an interrupt could leave stuck.

    with keep_sigterm_handler():
        executor = make_executor("local", cfg, source)   # or "ray", "torchrun"
    kill_workers(executor)
"""
from __future__ import annotations

import inspect
import os
import signal
import threading
from contextlib import contextmanager
from typing import Iterator

from pp_runtime.config import EngineConfig


TIMEOUT_ENV = "PP_RUNTIME_WORKER_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 60.0


def worker_timeout_s() -> float:
    """Seconds without an answer after which a worker counts as hung: ``PP_RUNTIME_WORKER_TIMEOUT_S``
    where set (a model whose steps take minutes needs more; a test, less), else DEFAULT_TIMEOUT_S."""
    text = os.environ.get(TIMEOUT_ENV)
    if text is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {text!r}")
    return value


def make_executor(launcher: str, cfg: EngineConfig, source: object, verbose: bool = False) -> object:
    if launcher == "local":
        from pp_runtime.executor import LocalExecutor
        return LocalExecutor(cfg, source)
    if launcher == "ray":  # launch/ owns Ray; pp_runtime itself never imports it
        from launch.ray_executor import RayExecutor
        return RayExecutor(cfg, source, verbose=verbose)
    if launcher == "torchrun":
        if "RANK" not in os.environ:
            raise ValueError("--launcher torchrun runs under torchrun: "
                             "torchrun --nproc-per-node N -m launch.torchrun_main ...")
        from launch.torchrun_main import TorchrunExecutor
        return TorchrunExecutor(cfg, source)
    raise ValueError(f"--launcher must be local, ray or torchrun, got {launcher!r}")


@contextmanager
def keep_sigterm_handler() -> Iterator[None]:
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


def kill_workers(executor: object) -> None:
    """Shut the workers down without their graceful goodbye, which an interrupt can leave queued
    behind a plan that only some stages received (they would wait for activations that never come)."""
    if "graceful" in inspect.signature(executor.shutdown).parameters:
        executor.shutdown(graceful=False)
    else:
        executor.shutdown()
