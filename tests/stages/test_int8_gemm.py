"""int8 products (stages/csrc/int8_gemm.cpp, matmul precision "int8"): x's rows rounded per block
of 32 to int8 codes with one scale each; the product sums those codes against the GGUF weight's
own codes exactly, so it is the float64 product of the rounded x, up to fp32 sums over blocks; and
against the fp32 product its error is x's rounding alone. A stage at "int8" takes it on every
block-quantized linear and stays close to the fp32 one; elsewhere "int8" computes as "highest"."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pp_runtime.config import CacheConfig, DeviceConfig, ParallelConfig
from stages import cpu_kernels, quant
from stages.layers import RowParallelLinear, TPContext
from stages.model_source import resolve_model
from stages.worker import StageWorker
from stages.worker_spec import WorkerSpec
from tests.stages.test_quant import LAYERS, QTYPES, VARIANTS, quantized, write_gguf

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="CPU kernels could not be built here")
needs_int8 = pytest.mark.skipif(not cpu_kernels.int8_products(), reason="no AVX512-VNNI + VBMI or AVX2 in this build")
U = 2.0 ** -24


def strided(m: int, k: int, seed: int = 0) -> torch.Tensor:
    """(m, k) rows at a row stride past k, with an outlier channel (a hidden state's max/rms ~19)."""
    x = torch.randn(m, k + 40, generator=torch.Generator().manual_seed(seed))[:, 8:k + 8]
    x[:, k // 3] *= 20
    return x


def dequantized_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x as int8_linear rounds it, float64; each k's block scale)."""
    xq, xs, _ = cpu_kernels.quantize_rows(x)
    m, k = x.shape
    scale = xs.double().repeat_interleave(quant.QK, dim=1)  # (M, K)
    return xq.double() * scale, scale


@needs_int8
def test_quantize_rows_rounds_each_block_on_its_own_scale() -> None:
    x = strided(5, 96)
    x[2, 32:64] = 0  # a block of zeros: scale 0, codes 0
    xq, xs, xc = cpu_kernels.quantize_rows(x)
    assert xq.dtype == torch.int8 and xq.shape == (5, 96) and xs.shape == xc.shape == (5, 3)
    assert int(xq.abs().max()) == 127 and int(xq.min()) >= -127
    blocks = x.reshape(5, 3, 32)
    assert torch.equal(xs, blocks.abs().amax(-1) / 127)
    assert xs[2, 1] == 0 and not xq[2, 32:64].any()
    xd, scale = dequantized_rows(x)
    assert ((xd - x.double()).abs() <= scale / 2 * (1 + 1e-6)).all()  # round to nearest
    assert torch.equal(xc, xs * xq.reshape(5, 3, 32).sum(-1).float())


@needs_int8
@pytest.mark.parametrize("qtype", QTYPES.values(), ids=QTYPES.keys())
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 16, 17, 37, 300])  # tiles of 8 rows and every remainder
@pytest.mark.parametrize("n,k", [(16, 32), (48, 288), (32, 608)])
def test_int8_linear_sums_its_own_codes(threads: int, qtype: int, m: int, n: int, k: int) -> None:
    raw, w = quantized(n, k, qtype)
    p = quant.to_panels(raw, qtype)
    x = strided(m, k, seed=m)
    bias = torch.randn(n)
    y = cpu_kernels.int8_linear(x, p, bias)
    assert y.shape == (m, n) and y.dtype == torch.float32 and y.is_contiguous()
    xd, _ = dequantized_rows(x)
    ref = xd @ w.double().T + bias.double()
    # exact int32 sums per block; fp32 for the block scales and the sum over k / 32 blocks
    bound = (k // quant.QK + 4) * 4 * U * ((xd.abs() @ w.double().abs().T) + bias.double().abs())
    assert ((y.double() - ref).abs() <= bound).all()
    torch.set_num_threads(1)  # the threads fixture puts the count back
    assert torch.equal(cpu_kernels.int8_linear(x, p, bias), y)  # each output from one tile: any split


@needs_int8
@pytest.mark.parametrize("qtype", QTYPES.values(), ids=QTYPES.keys())
def test_int8_linear_is_off_by_the_rounding_of_x_alone(qtype: int) -> None:
    raw, w = quantized(64, 576, qtype)
    p = quant.to_panels(raw, qtype)
    x = strided(20, 576)
    y = cpu_kernels.int8_linear(x, p).double()
    exact = x.double() @ w.double().T
    _, scale = dequantized_rows(x)
    bound = (scale / 2) @ w.double().abs().T * (1 + 1e-5) + 40 * U * (x.double().abs() @ w.double().abs().T)
    err = (y - exact).abs()
    assert (err <= bound).all()
    assert err.max() > 0  # it really rounds: the fp32 product is another number
    assert (err / exact.abs().max()).max() < 0.02


@needs_int8
@pytest.mark.parametrize("qtype", QTYPES.values(), ids=QTYPES.keys())
@pytest.mark.parametrize("m", [1, 8, 9, 300])  # one tile (rows quantized in place) and tiled
def test_a_gated_input_is_silu_mul_made_as_it_is_quantized(threads: int, qtype: int, m: int) -> None:
    """int8_linear(gu, gated=True), the down product of an MLP: bit for bit the product of
    silu_mul(gu), from a gate/up output with a row stride past its width; a gu of the wrong width
    names the width it wanted."""
    raw, _ = quantized(48, 288, qtype)
    p = quant.to_panels(raw, qtype)
    gu = 3 * torch.randn(m, 2 * 288 + 24, generator=torch.Generator().manual_seed(m))[:, 16:2 * 288 + 16]
    y = cpu_kernels.int8_linear(gu, p, gated=True)
    assert torch.equal(y, cpu_kernels.int8_linear(cpu_kernels.silu_mul(gu.contiguous()), p))
    with pytest.raises(RuntimeError, match="x \\(M, 576\\): \\[gate \\| up\\]"):
        cpu_kernels.int8_linear(gu[:, :288], p, gated=True)


def test_a_row_parallel_linear_refuses_a_gated_input_it_cannot_take() -> None:
    """Only int8 products over panels make silu·up themselves (takes_gated); elsewhere a gated
    call is a named error, not a kernel's."""
    lin = RowParallelLinear(64, 32, False, TPContext(), torch.float32)  # fp32 weights, fp32 products
    assert not lin.takes_gated(torch.randn(3, 128))
    with pytest.raises(ValueError, match="takes_gated"):
        lin(torch.randn(3, 128), gated=True)


@needs_int8
def test_int8_linear_names_what_it_cannot_take() -> None:
    raw, _ = quantized(32, 64, quant.Q8_0)
    p = quant.to_panels(raw, quant.Q8_0)
    with pytest.raises(RuntimeError, match="x \\(M, 64\\)"):
        cpu_kernels.int8_linear(torch.randn(3, 96), p)
    with pytest.raises(RuntimeError, match="uint8 panels"):
        cpu_kernels.int8_linear(torch.randn(3, 64), torch.randn(2, 64, 16))
    with pytest.raises(RuntimeError, match="bias of 32"):
        cpu_kernels.int8_linear(torch.randn(3, 64), p, torch.randn(31))
    assert cpu_kernels.int8_linear(torch.randn(0, 64), p).shape == (0, 32)


def test_other_builds_say_they_have_no_int8_products(isa: str) -> None:
    """A build with neither VNNI nor AVX2 (the scalar one) refuses by name, and says so up front."""
    raw, _ = quantized(32, 64, quant.Q4_1)
    p = quant.to_panels(raw, quant.Q4_1)
    q8 = quant.to_panels(quantized(32, 64, quant.Q8_0)[0], quant.Q8_0)
    if cpu_kernels.int8_products():
        assert cpu_kernels.int8_linear(torch.randn(2, 64), p).shape == (2, 32)
        # taken for Q4 panels everywhere, for Q8_0 ones where VNNI makes them pay (the VNNI build,
        # which has the int8 greedy head too), not on the AVX2 path (AVX2 and AVX-512 without VNNI)
        assert cpu_kernels.int8_takes(p) and cpu_kernels.int8_takes(q8) == cpu_kernels.int8_head()
        assert not cpu_kernels.int8_takes(cpu_kernels.pack_weight(torch.randn(32, 64)))
    else:
        assert not cpu_kernels.int8_takes(p) and not cpu_kernels.int8_takes(q8)
        with pytest.raises(RuntimeError, match="int8_products\\(\\) is false"):
            cpu_kernels.int8_linear(torch.randn(2, 64), p)


# ---- a stage at matmul precision "int8" ------------------------------------------------------
def worker(path: Path, precision: str, kv_dtype: str = "auto") -> StageWorker:
    spec = WorkerSpec(resolve_model(str(path)), 0, 0, ParallelConfig(1), CacheConfig(4, 1 << 24, kv_dtype),
                      DeviceConfig("cpu", "float32", "torch", matmul_precision=precision))
    w = StageWorker(spec, TPContext(), None)
    w.allocate_cache(64)
    return w


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("int8_models")
    return {name: write_gguf(folder / f"{name}.gguf", types) for name, types in VARIANTS.items()}


def prefill_logits(w: StageWorker, ids: list[int]) -> torch.Tensor:
    from pp_runtime.batch import SeqChunk
    from stages.attention import build_metadata
    meta = build_metadata((SeqChunk(0, 0, tuple(ids), tuple(range(64)), True, None),), 4, w.device)
    with torch.inference_mode():
        return w.model.logits(w.model(torch.tensor(ids), meta, w.kv_caches))


@pytest.mark.parametrize("variant", VARIANTS)
def test_int8_stage_takes_every_block_quantized_linear(gguf_models: dict, variant: str) -> None:
    """Every layer linear held as panels (4 a layer; "mixed" fuses one QKV from two types into fp32,
    which keeps fp32 products), where the build has the products; the LM head keeps fp32 ones (its
    greedy rows: the exact greedy head)."""
    fp32, int8 = worker(gguf_models[variant], "highest"), worker(gguf_models[variant], "int8")
    assert fp32.info()["int8_linears"] == 0 and fp32.info()["bf16_linears"] == 0
    panels = LAYERS * (3 if variant == "mixed" else 4)
    if not cpu_kernels.int8_head():  # the AVX2 path: Q8_0 products stay fp32, mixed's o
        panels -= LAYERS if variant == "mixed" else 0
    assert int8.info()["int8_linears"] == (panels if cpu_kernels.int8_products() else 0)
    assert int8.model.lm_head.products == "fp32"
    assert int8.info()["bf16_attention"] == cpu_kernels.bf16_products() and not fp32.info()["bf16_attention"]
    assert (int8.model.lm_head.greedy is None) == (fp32.model.lm_head.greedy is None)
    ids = [(7 * i) % 250 + 3 for i in range(40)]
    a, b = prefill_logits(fp32, ids), prefill_logits(int8, ids)
    if not cpu_kernels.int8_products():
        assert torch.equal(a, b)  # computes as "highest"
        return
    assert not torch.equal(a, b)
    assert ((b - a).norm() / a.norm()) < 0.05  # a few roundings of ~0.5% each, not more
