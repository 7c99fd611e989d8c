"""stages/worker.py: the KV cache's CPU pages, lazy (the default) or written at allocation."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from stages.worker import cache_zeros

pytestmark = pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
@pytest.mark.parametrize("prefault", (False, True))
def test_cache_zeros_resident_only_when_prefaulted(dtype: torch.dtype, prefault: bool) -> None:
    # 64 MiB: above glibc's largest mmap threshold, so the zeros are a fresh mapping either way
    shape = ((64 << 20) // (16 * 4 * 64 * dtype.itemsize), 16, 4, 64)
    before = _rss()
    t = cache_zeros(shape, dtype, torch.device("cpu"), prefault)
    grown = _rss() - before
    assert t.shape == shape and t.dtype == dtype and not t.any()
    nbytes = t.numel() * t.element_size()
    if prefault:  # every page written now: the first run will not fault them in
        assert grown >= 0.9 * nbytes, (grown, nbytes)
    else:  # the OS's zero pages: nothing resident until a block is written
        assert grown < 0.25 * nbytes, (grown, nbytes)
    t[-1].fill_(1.0)  # a written block reads back; the rest stays zero
    assert t[-1].eq(1).all() and not t[:-1].any()
