"""stages/worker.py: the KV cache's CPU pages, lazy (the default) or written at allocation."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter: in the test process earlier tests leave freed, resident heap that
# glibc may hand back for the allocation, and then RSS says nothing about the tensor's pages.
PROBE = """
import json, os, torch
from stages.worker import cache_zeros
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
out, keep = [], []
for dtype in (torch.float32, torch.float16):
    for prefault in (False, True):
        # 64 MiB: above glibc's largest mmap threshold, so the zeros are a fresh mapping
        shape = ((64 << 20) // (16 * 4 * 64 * dtype.itemsize), 16, 4, 64)
        before = rss()
        t = cache_zeros(shape, dtype, torch.device("cpu"), prefault)
        grown = rss() - before
        ok = t.shape == shape and t.dtype == dtype and not t.any()
        t[-1].fill_(1.0)  # a written block reads back; the rest stays zero
        ok = ok and bool(t[-1].eq(1).all()) and not t[:-1].any()
        out.append({"dtype": str(dtype), "prefault": prefault, "grown": grown,
                    "nbytes": t.numel() * t.element_size(), "ok": ok})
        keep.append(t)  # held, so the next allocation is a new mapping too
print(json.dumps(out))
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_cache_zeros_resident_only_when_prefaulted() -> None:
    res = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(rows) == 4
    for r in rows:
        assert r["ok"], r
        if r["prefault"]:  # every page written now: the first run will not fault them in
            assert r["grown"] >= 0.9 * r["nbytes"], r
        else:  # the OS's zero pages: nothing resident until a block is written
            assert r["grown"] < 0.25 * r["nbytes"], r
