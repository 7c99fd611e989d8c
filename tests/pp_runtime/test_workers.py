"""pp_runtime/workers.py: the worker timeout from PP_RUNTIME_WORKER_TIMEOUT_S, checked by name."""
from __future__ import annotations

import pytest

from pp_runtime.workers import DEFAULT_TIMEOUT_S, TIMEOUT_ENV, worker_timeout_s


def test_worker_timeout_defaults_and_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert worker_timeout_s() == DEFAULT_TIMEOUT_S == 60.0
    monkeypatch.setenv(TIMEOUT_ENV, "2.5")
    assert worker_timeout_s() == 2.5


@pytest.mark.parametrize("text", ["0", "-1", "abc", "inf", "nan", ""])
def test_bad_worker_timeout_is_named(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv(TIMEOUT_ENV, text)
    with pytest.raises(ValueError, match=f"PP_RUNTIME_WORKER_TIMEOUT_S must be a positive number of seconds, got '{text}'"):
        worker_timeout_s()
