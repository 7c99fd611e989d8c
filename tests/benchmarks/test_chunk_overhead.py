"""benchmarks/chunk_overhead.py: a chunk's forward against its matmuls (target 2).

End to end at reduced size (smoke tests: nothing here asserts a time)."""
from __future__ import annotations

from pathlib import Path

from tests.benchmarks import run


def test_chunk_overhead_smoke(hf_models: dict, tmp_path: Path) -> None:
    r = run(["benchmarks/chunk_overhead.py", "--smoke", "--model", str(hf_models["llama"])], tmp_path)
    assert r["forward_ms_min"] > 0 and r["matmul_ms_min"] > 0 and r["ratio_median"] > 0
    assert r["bucketed_linears_ms"] > 0 and r["bucketed_attention_ms"] > 0


def test_chunk_overhead_smoke_int8(tmp_path: Path) -> None:
    """Both sides of the ratio take the linears' own products: int8 over a tiny GGUF's blocks."""
    from tests.stages.test_quant import VARIANTS, write_gguf
    model = write_gguf(tmp_path / "q4_1.gguf", VARIANTS["q4_1"])
    r = run(["benchmarks/chunk_overhead.py", "--smoke", "--model", str(model), "--matmul-precision", "int8",
             "--kv-cache-dtype", "fp8"], tmp_path)
    assert (r["matmul_precision"], r["kv_cache_dtype"]) == ("int8", "fp8")
    from stages import cpu_kernels
    from tests.stages.test_quant import LAYERS
    assert r["reduced_linears"]["int8"] == (4 * LAYERS if cpu_kernels.int8_products() else 0)  # qkv, o, gate_up, down
    assert r["forward_ms_min"] > 0 and r["matmul_ms_min"] > 0 and r["ratio_median"] > 0
