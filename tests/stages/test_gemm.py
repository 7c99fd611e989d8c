"""The packed GEMM (stages/csrc/gemm*.cpp) against F.linear, and pack_linears on a stage model:
which weights it packs, that the tied embedding still reads the right rows, that the bytes held
do not change."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pp_runtime.config import CacheConfig, DeviceConfig, ParallelConfig
from stages import cpu_kernels
from stages.layers import TPContext, embedding_rows, linear, pack_linears, set_matmul_precision
from stages.model import StageModel
from stages.model_source import resolve_model
from stages.weights import load_weights
from stages.worker import StageWorker
from stages.worker_spec import WorkerSpec

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="CPU kernels could not be built here")


# rows: 0, one, every tile size and the 7/8/9 splits (up to two tiles: K in one slab), a few
# blocks of 72 with a ragged end; K: under, at and over one 256-deep slab; N: one panel, a few
# chunks of one panel, chunks of the largest size (16 panels) with a ragged last one
@pytest.mark.parametrize("m", [0, 1, 2, 5, 6, 7, 8, 9, 13, 32, 73, 300])
@pytest.mark.parametrize("n,k", [(16, 40), (96, 256), (48, 600), (4112, 24)])
def test_packed_linear_matches_f_linear(isa: str, threads: int, m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x, b = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    packed = cpu_kernels.pack_weight(w)
    assert packed.shape == (n // 16, k, 16)
    y = cpu_kernels.packed_linear(x, packed)
    assert y.shape == (m, n) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cpu_kernels.packed_linear(x, packed, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("weights", ["fp32", "q4_1"])
def test_a_rows_product_does_not_depend_on_its_batch(isa: str, threads: int, weights: str) -> None:
    """Batch invariance: a row's product has the same bits whatever rows share its call. Up to 12
    rows (two tiles) K is one slab; from 13 it is cut into slabs, each of which resumes the sums so
    far, so every output is one chain of FMAs over K either way. Before, 13+ rows summed each slab
    on its own and differed at ~1e-5, and a seeded sample could draw another token in a bigger
    batch (K = 608: slabs of 208, 208 and 192; with a bias, added once the sums are whole)."""
    from stages import quant
    from tests.stages.test_quant import quantized
    g = torch.Generator().manual_seed(5)
    x, b = torch.randn(300, 608, generator=g), torch.randn(48, generator=g)
    if weights == "fp32":
        w = cpu_kernels.pack_weight(torch.randn(48, 608, generator=g))
    else:
        w = quant.to_panels(quantized(48, 608, quant.Q4_1)[0], quant.Q4_1)
    for bias in (None, b):
        alone = torch.cat([cpu_kernels.panel_linear(x[r:r + 1], w, bias) for r in range(300)])
        for m in (2, 12, 13, 40, 300):
            assert torch.equal(cpu_kernels.panel_linear(x[:m], w, bias), alone[:m]), f"{m} rows"


bf16_only = pytest.mark.skipif(not cpu_kernels.bf16_products(), reason="no AVX512-BF16 in this build")


@pytest.mark.parametrize("m", [12, 13, 19, 73, 300])
@pytest.mark.parametrize("n,k", [(16, 40), (96, 256), (48, 600), (4112, 24), (80, 34), (32, 1200), (48, 35)])
def test_bf16_products_are_fp32_sums_of_bf16_rounded_inputs(isa: str, threads: int, m: int, n: int, k: int) -> None:
    """Matmul precision "medium": past two row tiles (12 rows) x and W are rounded to bf16 (nearest
    even, as torch's .bfloat16()) and their products summed in fp32; up to 12 rows, or an odd K
    (no whole k-pairs), the fp32 path runs unchanged, and so does every product of a build without
    AVX512-BF16. K: under one 32-float conversion step, ragged tails of 2 and 24, one, two and
    three slabs (576 deep at most: 256; 600 = 2 x 304; 1200 = 3 x 400)."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x, b = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    packed = cpu_kernels.pack_weight(w)
    y = cpu_kernels.packed_linear(x, packed, b, bf16=True)
    if m <= 12 or k % 2 or not cpu_kernels.bf16_products():
        assert torch.equal(y, cpu_kernels.packed_linear(x, packed, b))
        return
    exact = x.bfloat16().double() @ w.bfloat16().double().T + b.double()  # bf16 products are exact in fp32
    torch.testing.assert_close(y, exact.float(), rtol=1e-5, atol=1e-4)
    # and it is not the fp32 product: the rounding of the inputs shows
    assert (y - F.linear(x, w, b)).abs().max() > 1e-3


def test_medium_computes_as_highest_without_avx512_bf16(monkeypatch: pytest.MonkeyPatch, hf_models: dict) -> None:
    """Where the kernels lack AVX512-BF16, "medium" flags no linear and every product stays fp32."""
    m = _model(str(hf_models["llama"]))
    pack_linears(m)
    if cpu_kernels.bf16_products():
        assert set_matmul_precision(m, "medium") == {"bf16": 4 * m.cfg.num_layers + 1, "int8": 0}
        assert set_matmul_precision(m, "highest") == {"bf16": 0, "int8": 0}
    monkeypatch.setattr(cpu_kernels, "bf16_products", lambda: False)
    assert set_matmul_precision(m, "medium") == {"bf16": 0, "int8": 0}
    assert all(getattr(mod, "products", "fp32") == "fp32" for mod in m.modules())
    assert set_matmul_precision(m, "int8") == {"bf16": 0, "int8": 0}  # packed fp32 weights: not GGUF blocks


@bf16_only
@pytest.mark.parametrize("n", [32, 48])
def test_bf16_row_results_do_not_depend_on_the_tile_they_fall_in(n: int) -> None:
    """Rows that a big product runs in 12-row tiles (two full row tiles at once) and a 13-row
    product runs in smaller tiles come out bit for bit the same: every output sums its k pairs
    in order whatever the tile (n = 48: a panel pair and a single panel)."""
    g = torch.Generator().manual_seed(n)
    w, x = torch.randn(n, 1200, generator=g), torch.randn(300, 1200, generator=g)
    packed = cpu_kernels.pack_weight(w)
    big = cpu_kernels.packed_linear(x, packed, bf16=True)
    for r0 in (0, 7, 287):
        assert torch.equal(big[r0:r0 + 13], cpu_kernels.packed_linear(x[r0:r0 + 13], packed, bf16=True))


@bf16_only
def test_bf16_products_take_row_strided_x() -> None:
    w, x = torch.randn(32, 24), torch.randn(40, 50)
    packed = cpu_kernels.pack_weight(w)
    assert torch.equal(linear(x[:, 3:27], packed, products="bf16"), linear(x[:, 3:27].contiguous(), packed, products="bf16"))


def test_packed_linear_takes_row_strided_x_and_rejects_bad_shapes(isa: str) -> None:
    w, x = torch.randn(32, 24), torch.randn(10, 50)
    packed = cpu_kernels.pack_weight(w)
    torch.testing.assert_close(linear(x[:, 3:27], packed), F.linear(x[:, 3:27], w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x[:, 3:27].t().contiguous().t(), packed), F.linear(x[:, 3:27], w),
                               rtol=1e-5, atol=1e-5)  # column-strided: copied first
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu_kernels.pack_weight(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="K = x.size"):
        cpu_kernels.packed_linear(torch.randn(3, 25), packed)


def test_embedding_rows_of_a_packed_table(isa: str) -> None:
    w = torch.randn(64, 12)
    ids = torch.tensor([0, 15, 16, 17, 63, 5, 5])
    assert torch.equal(embedding_rows(cpu_kernels.pack_weight(w), ids), w[ids])
    assert torch.equal(embedding_rows(w, ids), w[ids])


def _model(folder: str, dtype: torch.dtype = torch.float32) -> StageModel:
    src = resolve_model(folder)
    m = StageModel(src.config, (0, 2 * src.config.num_layers), TPContext(), dtype, "cpu", "torch", True, True)
    load_weights(m, src, TPContext())
    return m


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_pack_linears_packs_every_linear_in_place(hf_models: dict, arch: str) -> None:
    """Every linear of the tiny models (all sizes multiples of 16) is packed; the tied Qwen2
    embedding keeps sharing the LM head's tensor; the parameter bytes are the same."""
    plain = _model(str(hf_models[arch]))
    before = {n: p.clone() for n, p in plain.named_parameters()}
    nbytes = sum(p.numel() for p in plain.parameters())
    n_linear = 4 * len(plain.layers) + 1
    assert pack_linears(plain) == n_linear
    assert sum(p.numel() for p in plain.parameters()) == nbytes
    tied = arch == "qwen2"
    assert (plain.embed_tokens.weight is plain.lm_head.weight) == tied
    assert plain.embed_tokens.weight.dim() == (3 if tied else 2)
    for name, p in plain.named_parameters():
        if p.dim() == 3:  # unpack and compare with the loaded weight
            assert torch.equal(p.transpose(1, 2).reshape(-1, p.shape[1]), before[name]), name
    ids = torch.tensor([1, 7, 255, 16])
    assert torch.equal(plain.embed_tokens(ids), before["embed_tokens.weight"][ids])
    assert pack_linears(plain) == 0  # already packed: nothing left


def test_pack_linears_leaves_other_dtypes_and_the_worker_numbers(hf_models: dict) -> None:
    m = _model(str(hf_models["llama"]), torch.bfloat16)
    assert pack_linears(m) == 0 and all(p.dim() <= 2 for p in m.parameters())
    spec = WorkerSpec(resolve_model(str(hf_models["llama"])), 0, 0, ParallelConfig(1), CacheConfig(4, 1 << 26),
                      DeviceConfig("cpu", "float32", "torch"))
    w = StageWorker(spec, TPContext(), None)
    assert w.model.layers[0].mlp.gate_up_proj.weight.dim() == 3  # the worker packs at load
    # what the LM head's exact greedy path keeps beside its (V, K) weight is resident too: the row
    # norms (4 bytes a row) and the bf16 pairs (2 bytes a weight)
    v, k = w.model.lm_head.weight.shape[0] * cpu_kernels.PANEL, w.model.lm_head.weight.shape[1]
    kept = v * 4 + v * k * 2 if cpu_kernels.bf16_products() else 0
    assert w.weight_bytes == sum(p.numel() * 4 for p in w.model.parameters()) + kept


def test_a_bad_bias_names_the_product() -> None:
    """A bias of the wrong length or dtype: one error naming the product it was given to."""
    from stages import quant
    from tests.stages.test_int8_gemm import quantized
    if not cpu_kernels.available():
        pytest.skip("CPU kernels could not be built here")
    w = torch.randn(32, 64)
    raw, _ = quantized(32, 64, quant.Q8_0)
    x = torch.randn(3, 64)
    for name, call in (("packed_linear", lambda b: cpu_kernels.packed_linear(x, cpu_kernels.pack_weight(w), b)),
                       ("quant_linear", lambda b: cpu_kernels.quant_linear(x, quant.to_panels(raw, quant.Q8_0), b))):
        for bad in (torch.randn(31), torch.randn(32, dtype=torch.float64)):
            with pytest.raises(RuntimeError, match=f"{name}: bias of 32 float32"):
                call(bad)
        assert call(torch.zeros(32)).shape == (3, 32)
