"""GGUF blocks kept as stored (stages/quant.py, gemm_quant.cpp's quant_linear): the panels hold exactly
the weights the gguf package dequantizes to; the product sums in packed_linear's order, so it is
bit-identical to the fp32 path; a stage loaded native holds panels, fewer bytes, and computes the
same logits as one loaded dequantized, for each type, TP shard and pipeline stage."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pp_runtime.batch import SeqChunk
from pp_runtime.config import CacheConfig, DeviceConfig, ParallelConfig
from stages import cpu_kernels, quant
from stages.attention import build_metadata
from stages.layers import TPContext
from stages.model import StageModel
from stages.model_source import resolve_model
from stages.weights import load_weights
from stages.worker import StageWorker
from stages.worker_spec import WorkerSpec

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="CPU kernels could not be built here")
QTYPES = {"Q4_0": quant.Q4_0, "Q4_1": quant.Q4_1, "Q8_0": quant.Q8_0}


def quantized(rows: int, cols: int, qtype: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """(stored bytes, dequantized float32) of a random (rows, cols) weight."""
    x = 0.05 * np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType(qtype))
    return raw, torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)).copy())


@pytest.mark.parametrize("qtype", QTYPES.values(), ids=QTYPES.keys())
def test_panels_hold_the_dequantized_weights(qtype: int) -> None:
    raw, ref = quantized(48, 96, qtype)
    p = quant.to_panels(raw, qtype)
    assert p.dtype == torch.uint8 and p.shape == (3, 3, quant.QB_S8 if qtype == quant.Q8_0 else quant.QB_U4)
    assert quant.panel_shape(p) == (48, 96)
    assert torch.equal(quant.panel_rows(p, torch.arange(48)), ref)  # bit for bit
    ids = torch.tensor([0, 17, 47, 8, 8, 31])
    assert torch.equal(quant.panel_rows(p, ids), ref[ids])


@pytest.mark.parametrize("qtype", QTYPES.values(), ids=QTYPES.keys())
def test_the_kernel_reads_the_rows_the_reference_does(qtype: int, isa: str) -> None:
    """cpu_kernels.panel_rows (the embedding lookup) against torch's gather of whole panels:
    bit for bit, every id of the table once, repeats, and none; ids outside it name themselves."""
    raw, ref = quantized(64, 128, qtype, seed=3)
    p = quant.to_panels(raw, qtype)
    assert torch.equal(cpu_kernels.panel_rows(p, torch.arange(64)), ref)
    ids = torch.tensor([63, 0, 16, 15, 15, 47, 1])
    assert torch.equal(cpu_kernels.panel_rows(p, ids), quant.panel_rows(p, ids))
    assert cpu_kernels.panel_rows(p, torch.zeros(0, dtype=torch.long)).shape == (0, 128)
    for bad in (64, -1):
        with pytest.raises(RuntimeError, match=f"id {bad} out of range"):
            cpu_kernels.panel_rows(p, torch.tensor([0, bad]))


def test_to_panels_names_what_it_cannot_take() -> None:
    raw, _ = quantized(32, 64, quant.Q8_0)
    with pytest.raises(ValueError, match="not kept quantized"):
        quant.to_panels(raw, 12)  # Q4_K
    with pytest.raises(ValueError, match="panels of 16"):
        quant.to_panels(raw[:20], quant.Q8_0)
    big = quantized(16, 32, quant.Q4_0)[0].copy()
    big[:, 0:2] = np.array([9000.0], dtype=np.float16).view(np.uint8)  # d: m = −8d is past fp16's range
    with pytest.raises(ValueError, match="does not fit fp16"):
        quant.to_panels(big, quant.Q4_0)


def test_panels_keep_the_scales_in_fp16() -> None:
    """A Q4 block is 320 bytes for 512 weights: d and m in GGUF's own fp16, then 256 bytes of codes."""
    raw, _ = quantized(16, 64, quant.Q4_1)
    p = quant.to_panels(raw, quant.Q4_1)
    assert p.shape[2] == 320 == quant.DM + 256
    d = np.ascontiguousarray(raw.reshape(16, 2, 20)[:, :, 0:2]).view(np.float16)[..., 0]  # (16 rows, 2 blocks)
    assert torch.equal(quant.block_scales(p)[0, :, :16], torch.from_numpy(d.T.astype(np.float32)))


# rows: none, the few-row path (K whole: groups of up to 24 rows) and its group splits, the slab path;
# K: one block, 288 (slabs of 144 start inside a block), several slabs; N: chunks of 16 panels
@pytest.mark.parametrize("qtype", [quant.Q4_1, quant.Q8_0], ids=["u4", "s8"])
@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 19, 24, 32, 36, 37, 300])
@pytest.mark.parametrize("n,k", [(16, 32), (48, 288), (4112, 64), (32, 608)])
def test_quant_linear_is_packed_linear_bit_for_bit(isa: str, threads: int, qtype: int, m: int, n: int, k: int) -> None:
    raw, w = quantized(n, k, qtype, seed=m + n + k)
    panels, packed = quant.to_panels(raw, qtype), cpu_kernels.pack_weight(w)
    g = torch.Generator().manual_seed(m)
    x, b = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    y = cpu_kernels.quant_linear(x, panels)
    assert y.shape == (m, n) and torch.equal(y, cpu_kernels.packed_linear(x, packed))
    assert torch.equal(cpu_kernels.quant_linear(x, panels, b), cpu_kernels.packed_linear(x, packed, b))
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype", [quant.Q4_1, quant.Q8_0], ids=["u4", "s8"])
@pytest.mark.parametrize("m", range(1, 37))
def test_every_few_row_grouping_is_packed_linear_bit_for_bit(isa: str, qtype: int, m: int) -> None:
    """Every row count of the few-row path (each its own cut into groups of rows), x a row-strided
    view as the fused QKV output's slices are."""
    raw, w = quantized(80, 96, qtype, seed=m)
    x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m))[:, 16:112]
    assert torch.equal(cpu_kernels.quant_linear(x, quant.to_panels(raw, qtype)),
                       cpu_kernels.packed_linear(x.contiguous(), cpu_kernels.pack_weight(w)))


@pytest.mark.skipif(not cpu_kernels.bf16_products(), reason="no AVX512-BF16 in this build")
@pytest.mark.parametrize("qtype", [quant.Q4_1, quant.Q8_0], ids=["u4", "s8"])
@pytest.mark.parametrize("m", [7, 13, 300])
@pytest.mark.parametrize("n,k", [(48, 288), (4112, 64), (32, 608)])
def test_bf16_quant_linear_is_bf16_packed_linear_bit_for_bit(isa: str, threads: int, qtype: int, m: int, n: int,
                                                              k: int) -> None:
    """Matmul precision "medium" over stored blocks: each dequantized weight rounded to bf16 as the
    fp32 panels' are, the same tiles and slabs: the same bits."""
    raw, w = quantized(n, k, qtype, seed=m + n + k)
    panels, packed = quant.to_panels(raw, qtype), cpu_kernels.pack_weight(w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = cpu_kernels.quant_linear(x, panels, bf16=True)
    assert torch.equal(y, cpu_kernels.packed_linear(x, packed, bf16=True))
    # a build without AVX512-BF16 computes every product as "highest"
    assert torch.equal(y, cpu_kernels.quant_linear(x, panels)) == (m <= 12 or not cpu_kernels.bf16_products())


@pytest.mark.skipif(not cpu_kernels.bf16_products(), reason="no AVX512-BF16 in this build")
@pytest.mark.parametrize("qtype", [quant.Q4_1, quant.Q8_0], ids=["u4", "s8"])
@pytest.mark.parametrize("m", [1, 13, 32, 300])
def test_bf16_linear_over_kept_pairs_is_the_bf16_path_bit_for_bit(isa: str, threads: int, qtype: int, m: int) -> None:
    """pack_weight_bf16 keeps the words the bf16 path converts each slab to (the same from either
    panel format); bf16_linear over them is panel_linear's bf16 product, for every row count."""
    if not cpu_kernels.bf16_products():  # an isa build without AVX512-BF16
        with pytest.raises(RuntimeError, match="no bf16 dot products"):
            cpu_kernels.pack_weight_bf16(cpu_kernels.pack_weight(torch.ones(16, 64)))
        with pytest.raises(RuntimeError, match="no bf16 dot products"):
            cpu_kernels.bf16_linear(torch.ones(13, 64), torch.zeros(1, 32, 16, dtype=torch.int32))
        return
    raw, w = quantized(4112, 608, qtype, seed=m)
    panels, packed = quant.to_panels(raw, qtype), cpu_kernels.pack_weight(w)
    wb = cpu_kernels.pack_weight_bf16(panels)
    assert wb.shape == (257, 304, 16) and wb.dtype == torch.int32
    assert torch.equal(wb, cpu_kernels.pack_weight_bf16(packed))
    x = torch.randn(m, 608, generator=torch.Generator().manual_seed(m))
    y = cpu_kernels.bf16_linear(x, wb)
    if m > 12:  # panel_linear's bf16 path (fewer rows take fp32 products there)
        assert torch.equal(y, cpu_kernels.panel_linear(x, panels, bf16=True))
    else:  # rows of 13 in one product are the same bits row for row
        assert torch.equal(y, cpu_kernels.bf16_linear(x.repeat(13, 1), wb)[:m])
    torch.testing.assert_close(y, F.linear(x, w), rtol=2e-2, atol=2e-2)
    with pytest.raises(RuntimeError, match="K = x.size"):
        cpu_kernels.bf16_linear(x[:, :576], wb)


def test_quant_linear_rejects_a_mismatched_x(isa: str) -> None:
    raw, _ = quantized(16, 64, quant.Q4_1)
    with pytest.raises(RuntimeError, match="K = x.size"):
        cpu_kernels.quant_linear(torch.randn(3, 32), quant.to_panels(raw, quant.Q4_1))


# ---- a stage loaded from a tiny GGUF model --------------------------------------------------
H, I, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 128, 4, 2, 2, 256
VARIANTS = {  # matrices' types: all one type, or q/k/v of two types (the fused QKV stays float)
    "q4_0": dict.fromkeys(("embd", "q", "k", "v", "o", "gate", "up", "down"), quant.Q4_0),
    "q4_1": dict.fromkeys(("embd", "q", "k", "v", "o", "gate", "up", "down"), quant.Q4_1),
    "mixed": {"embd": quant.Q8_0, "q": quant.Q4_1, "k": quant.Q4_1, "v": quant.Q8_0, "o": quant.Q8_0,
              "gate": quant.Q4_0, "up": quant.Q4_0, "down": quant.Q4_1},
}


def write_gguf(path: Path, types: dict[str, int]) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_context_length(128)
    w.add_vocab_size(VOCAB)
    rng = np.random.default_rng(0)

    def add(name: str, kind: str, rows: int, cols: int) -> None:
        x = (0.1 * rng.standard_normal((rows, cols))).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(x, gguf.GGMLQuantizationType(types[kind])),
                     raw_dtype=gguf.GGMLQuantizationType(types[kind]))

    add("token_embd.weight", "embd", VOCAB, H)
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
    kv = KV_HEADS * H // HEADS
    for layer in range(LAYERS):
        for kind, rows, cols in (("q", H, H), ("k", kv, H), ("v", kv, H), ("o", H, H), ("gate", I, H),
                                 ("up", I, H), ("down", H, I)):
            gname = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output"}.get(kind, f"ffn_{kind}")
            add(f"blk.{layer}.{gname}.weight", kind, rows, cols)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{layer}.{norm}.weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf_models")
    return {name: write_gguf(folder / f"{name}.gguf", types) for name, types in VARIANTS.items()}


def stage(path: Path, ctx: TPContext, native: bool, layers: tuple[int, int] = (0, LAYERS)) -> tuple[StageModel, int]:
    src = resolve_model(str(path))
    units = (2 * layers[0], 2 * layers[1])  # half-layer units
    m = StageModel(src.config, units, ctx, torch.float32, "cpu", "torch", layers[0] == 0, layers[1] == LAYERS)
    return m, load_weights(m, src, ctx, native=native)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tp", [1, 2])
def test_native_load_holds_the_same_weights_in_fewer_bytes(gguf_models: dict, variant: str, tp: int) -> None:
    for rank in range(tp):  # each TP rank's shard: rows of column-parallel, columns of row-parallel
        ctx = TPContext(rank, tp)
        plain, plain_bytes = stage(gguf_models[variant], ctx, native=False)
        native, native_bytes = stage(gguf_models[variant], ctx, native=True)
        kept = 0
        for (name, a), (_, b) in zip(plain.named_parameters(), native.named_parameters()):
            if quant.is_panels(b):
                kept += 1
                assert torch.equal(quant.panel_rows(b, torch.arange(a.shape[0])), a), name
            else:
                assert torch.equal(a, b), name
        # every matrix (4 per layer, the tied embedding / LM head) but a QKV fused from two types
        assert kept == LAYERS * (3 if variant == "mixed" else 4) + 1
        assert native.lm_head.weight is native.embed_tokens.weight
        assert native_bytes == sum(p.numel() * p.element_size() for p in native.parameters())
        assert native_bytes < plain_bytes / (2 if variant == "mixed" else 4)


def test_a_column_shard_that_cuts_a_block_stays_float(gguf_models: dict) -> None:
    src = resolve_model(str(gguf_models["q4_1"]))
    from stages.weight_sources import GGUFSource
    source = GGUFSource(src.path, src.config)
    assert source.read_blocks("model.layers.0.self_attn.o_proj.weight", cols=(0, 16)) is None
    assert source.read_blocks("model.layers.0.self_attn.o_proj.weight", cols=(32, 64))[1].shape == (H, 20)
    assert source.read_blocks("model.norm.weight") is None  # 1-D, F32


def logits_after(w: StageWorker, prompt: list[int]) -> torch.Tensor:
    """Logits of a 2-chunk prefill's last position and of 3 greedy decodes after it."""
    table = tuple(range(16))
    out, pos, ids = [], 0, prompt
    with torch.inference_mode():
        for step in range(5):
            chunk = ids[:9] if step == 0 else ids
            c = SeqChunk(0, pos, tuple(chunk), table, True, None)
            h = w.model(torch.tensor(chunk), build_metadata((c,), 4, w.device), w.kv_caches)
            logits = w.model.logits(h[-1:])
            out.append(logits)
            pos += len(chunk)
            ids = ids[9:] if step == 0 else [int(logits.argmax())]
    return torch.cat(out)


@pytest.mark.parametrize("variant", VARIANTS)
def test_native_stage_computes_the_dequantized_logits(gguf_models: dict, variant: str) -> None:
    prompt = [(7 * i + 3) % VOCAB for i in range(20)]
    got = {}
    for mode in ("native", "dequantize"):
        spec = WorkerSpec(resolve_model(str(gguf_models[variant])), 0, 0, ParallelConfig(1), CacheConfig(4, 1 << 24),
                          DeviceConfig("cpu", "float32", "torch", gguf_weights=mode))
        w = StageWorker(spec, TPContext(), None)
        w.allocate_cache(16)
        assert quant.is_panels(w.model.layers[0].mlp.down_proj.weight) == (mode == "native")
        got[mode] = logits_after(w, prompt)
    assert torch.equal(got["native"], got["dequantize"])  # the same weights, summed in the same order


def test_gguf_weights_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="DeviceConfig.gguf_weights"):
        DeviceConfig("cpu", "float32", "torch", gguf_weights="int4")


@pytest.mark.parametrize("qtype", [quant.Q4_0, quant.Q4_1, quant.Q8_0])
def test_all_rows_are_panel_rows_of_every_row(qtype: int) -> None:
    """The whole weight at once, panel by panel: the same float32 rows as panel_rows, in row order."""
    x = np.random.default_rng(qtype).standard_normal((48, 96)).astype(np.float32)
    p = quant.to_panels(gguf.quants.quantize(x, gguf.GGMLQuantizationType(qtype)), qtype)
    rows = quant.all_rows(p)
    assert rows.shape == (48, 96) and rows.dtype == torch.float32
    assert torch.equal(rows, quant.panel_rows(p, torch.arange(48)))
