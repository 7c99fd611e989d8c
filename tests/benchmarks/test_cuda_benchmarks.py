"""The CUDA benchmarks: cuda_launch_overhead.py (its ways also run in Triton's interpreter on
CPU), cuda_graphs.py and cuda_paged_decode.py.

End to end at reduced size (smoke tests: nothing here asserts a time)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks import run
from tests.conftest import run_interpreted


def launch_ways_interpreted() -> None:
    """In a child started with TRITON_INTERPRET=1: every way of cuda_launch_overhead.py once, on
    CPU tensors at small sizes, so each call's arguments are checked where no GPU is."""
    import torch
    from benchmarks.cuda_launch_overhead import ways
    from tests.stages.test_triton_decode import patch_interpreter
    patch_interpreter()
    for fn in ways(2, 4, 16, 64, 96, 40, torch.float32, torch.device("cpu")).values():
        fn()  # raises on a wrong argument, shape or dtype
    print("ways ran")


def test_cuda_launch_overhead_ways_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    out = run_interpreted("from tests.benchmarks.test_cuda_benchmarks import launch_ways_interpreted; launch_ways_interpreted()",
                          timeout=300)
    assert "ways ran" in out


@pytest.mark.gpu(1)
def test_cuda_graphs_benchmark_smoke(tmp_path: Path) -> None:
    r = run(["benchmarks/cuda_graphs.py", "--model", "llama-tiny", "--decodes", "1,3", "--context", "20",
             "--rounds", "2"], tmp_path)
    assert set(r["by_batch"]) == {"1", "3"}
    assert all(row["graph_ms"] > 0 and row["max_diff"] < 0.05 for row in r["by_batch"].values())


@pytest.mark.gpu(1)
def test_cuda_launch_overhead_smoke(tmp_path: Path) -> None:
    r = run(["benchmarks/cuda_launch_overhead.py", "--calls", "20"], tmp_path)
    assert len(r["issue_us"]) == 12 and all(0 < r["issue_us"][k] <= r["done_us"][k] for k in r["issue_us"])


@pytest.mark.gpu(1)
def test_cuda_paged_decode_smoke(tmp_path: Path) -> None:
    r = run(["benchmarks/cuda_paged_decode.py", "--decodes", "4", "--context", "100", "--reps", "2"], tmp_path)
    assert set(r["ms"]) == {"gathered", "paged-backend", "paged", "paged-dot", "paged-sums", "paged-unaligned",
                            "paged-tokens16", "paged-tokens64",
                            "paged-warps1", "paged-warps2", "paged-warps4", "paged-warps8", "paged-warps2-tokens16",
                            "paged-warps2-tokens64", "paged-stages1", "paged-stages2", "paged-stages4",
                            *(f"paged-splits{n}" for n in (1, 2, 4, 8, 16))}
    assert max(r["max_err"].values()) < 1e-2  # bf16 outputs of the same attention
