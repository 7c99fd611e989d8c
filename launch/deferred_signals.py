"""Signals held back while a block runs, delivered by the caller afterwards.

Used where an interrupt half-way would leave something behind: Ray starting its node
(launch/ray_cluster.py), a plan half-sent to stage 0 (launch/ray_executor.py).

    with _deferred_signals((signal.SIGINT, signal.SIGTERM)) as caught:
        ...                      # not interrupted here
    if caught:
        signal.raise_signal(caught[0])
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


@contextlib.contextmanager
def _deferred_signals(signums: tuple[int, ...] = (signal.SIGINT,)) -> Iterator[list]:
    """Record these signals instead of running their handlers inside the block (main thread only;
    elsewhere Python runs no signal handlers anyway)."""
    caught: list = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in signums}
    try:
        yield caught
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
