"""Ctrl-C and SIGTERM for a `pp-runtime` command; launch/cli.py: main turns the KeyboardInterrupt
into "interrupted by SIGINT/SIGTERM" and the exit status 130 or 143:

    interrupts = Interrupts(); interrupts.install()
    try: ...  # the command
    except KeyboardInterrupt: return interrupts.exit_code
    finally: interrupts.restore()
"""
from __future__ import annotations

import signal
import threading
import time


class Interrupts:
    """SIGINT and SIGTERM raise KeyboardInterrupt in the main thread: the run under way stops
    between any two steps, cancels its unfinished requests and kills its workers (LLM.run), and
    the command writes what it has. The signal is remembered here because Ray's ray.get re-raises
    a plain KeyboardInterrupt, so the exception cannot say which one it was. Repeats within
    FORCE_AFTER_S are ignored: writing results and killing workers takes a moment, and a second
    Ctrl-C in the middle would leave orphans; a later one forces its way out."""

    FORCE_AFTER_S = 10.0

    def __init__(self) -> None:
        self.signum: int | None = None
        self._first = 0.0
        self._saved: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():  # signal.signal would refuse
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._saved[sig] = signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        """main() runs in-process in tests: leave the handlers as they were."""
        for sig, handler in self._saved.items():
            if handler is not None:  # None: installed outside Python, nothing to put back
                signal.signal(sig, handler)
        self._saved = {}

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.signum is not None and time.monotonic() - self._first < self.FORCE_AFTER_S:
            return
        self.signum, self._first = signum, time.monotonic()
        raise KeyboardInterrupt(signal.Signals(signum).name)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "KeyboardInterrupt"

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGINT)  # the shell's convention: 130, 143


def ignore_interrupts() -> None:
    """The console script's last exit hook (see launch/cli.py: entry)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
