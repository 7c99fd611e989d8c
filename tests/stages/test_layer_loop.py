"""The C++ layer loop (stages/layer_loop.py, stages/csrc/stack.h) against the Python loop over the
same layers: the same hidden states and the same KV caches, bit for bit, for every kind of step
(fresh and cached prefill chunks, decodes, several chunks with decodes), half-layer stages,
fp32/bf16 products (the prefill attention's too), fp32/fp16/fp8 caches, GGUF panels and every kernel build; and where it must not
apply (tensor parallelism, weights torch multiplies), the Python loop runs; per-op timing runs
inside the C++ loop."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pp_runtime.batch import SeqChunk
from pp_runtime.config import CacheConfig, DeviceConfig, ParallelConfig
from stages import cpu_kernels
from stages.attention import build_metadata
from stages.layers import TPContext
from stages.model import StageModel
from stages.model_source import resolve_model
from pp_runtime.profile_stats import OPS
from stages.op_timing import OpTimer, instrument
from stages.profile import fill_cache
from stages.worker import StageWorker
from stages.worker_spec import WorkerSpec
from tests.conftest import ARCHS

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="CPU kernels could not be built here")
BLOCK = 4


def table(seq: int) -> tuple[int, ...]:
    return tuple(range(16 * seq, 16 * seq + 16))  # 64 slots a sequence


def prefill(seq: int, start: int, n: int) -> SeqChunk:
    return SeqChunk(seq, start, tuple((7 * seq + 5 * i) % 250 + 3 for i in range(n)), table(seq), True, None)


def decode(seq: int, pos: int) -> SeqChunk:
    return SeqChunk(seq, pos, ((11 * seq + pos) % 250 + 3,), table(seq), False, None)


STEPS = {
    "fresh_chunk": (prefill(0, 0, 20),),
    "cached_chunk_and_decodes": (prefill(0, 20, 13), decode(1, 30), decode(2, 7), decode(3, 63)),
    "decodes": tuple(decode(s, 9 * s + 1) for s in range(1, 4)),
    "many_decodes": tuple(decode(s, 3 * s) for s in range(1, 16)),  # 15 rows: bf16 products under "medium"
    "two_chunks_and_decodes": (prefill(0, 8, 17), prefill(1, 0, 3), decode(2, 40), decode(3, 12)),
}


def worker(path: str, pp: int = 1, stage: int = 0, partition: tuple[float, ...] | None = None,
           precision: str = "highest", kv_dtype: str = "auto", gguf_weights: str = "native") -> StageWorker:
    spec = WorkerSpec(resolve_model(path), stage, 0, ParallelConfig(pp, 1, partition), CacheConfig(BLOCK, 1 << 26, kv_dtype),
                      DeviceConfig("cpu", "float32", "torch", matmul_precision=precision, gguf_weights=gguf_weights))
    w = StageWorker(spec, TPContext(), None)
    w.allocate_cache(16 * 16)  # 16 sequences' tables
    fill_cache(w)  # the decodes' contexts: random K/V
    return w


def both_loops(w: StageWorker, chunks: tuple[SeqChunk, ...]) -> None:
    """One step through the Python loop and the same step, from the same caches, through the C++ one."""
    loop = w.model.layer_loop
    assert loop is not None
    meta = build_metadata(chunks, BLOCK, w.device)
    ids = [t for c in chunks for t in c.token_ids]
    x = torch.tensor(ids) if w.is_first else \
        torch.randn(len(ids), w.spec.source.config.hidden_size, generator=torch.Generator().manual_seed(len(ids)))
    before = [(k.clone(), v.clone()) for k, v in w.kv_caches]
    out = {}
    with torch.inference_mode():
        for on in (False, True):
            for (k, v), (k0, v0) in zip(w.kv_caches, before):
                k.copy_(k0)
                v.copy_(v0)
            w.model.layer_loop = loop if on else None
            out[on] = (w.model(x, meta, w.kv_caches), [t.clone() for kv in w.kv_caches for t in kv])
    w.model.layer_loop = loop
    assert torch.equal(out[True][0], out[False][0])
    assert all(torch.equal(a, b) for a, b in zip(out[True][1], out[False][1]))


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("arch", ARCHS)
def test_c_loop_is_the_python_loop_bit_for_bit(hf_models: dict, threads: int, arch: str, step: str) -> None:
    both_loops(worker(str(hf_models[arch])), STEPS[step])


@pytest.mark.parametrize("precision,kv_dtype", [("medium", "auto"), ("highest", "float16"), ("medium", "float16"),
                                              ("highest", "fp8"), ("medium", "fp8"), ("int8", "fp8")])
@pytest.mark.parametrize("step", STEPS)
def test_bf16_products_and_fp16_caches(hf_models: dict, threads: int, precision: str, kv_dtype: str, step: str) -> None:
    both_loops(worker(str(hf_models["qwen2"]), precision=precision, kv_dtype=kv_dtype), STEPS[step])


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama with SmolLM2's head shape (64 wide, 3 query heads a KV head): the one the decode
    kernel's tiled and bf16 walks take (the shared tiny models' 16-wide heads take its plain loops)."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=512,
                                   rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=False,
                                   bos_token_id=1, eos_token_id=2)
    folder = tmp_path_factory.mktemp("wide_heads") / "llama"
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("precision,step,bf16", [("int8", "decodes", True), ("int8", "many_decodes", True),
                                                 ("medium", "decodes", False), ("medium", "many_decodes", True),
                                                 ("highest", "many_decodes", False)])
def test_decode_attention_bf16_reaches_both_loops(wide_heads: Path, precision: str, step: str, bf16: bool) -> None:
    """Over an fp8 cache the decodes' attention takes bf16 products in steps of more than 12 decodes
    under "medium" (up to 12 rows stay fp32) and in every step under "int8", in the C++ loop as in
    the Python one: the step's output changes when the decodes are kept fp32 exactly where it should."""
    if not cpu_kernels.decode_bf16():
        pytest.skip("no bf16 decode attention in this build")
    w = worker(str(wide_heads), precision=precision, kv_dtype="fp8")
    chunks = STEPS[step]
    both_loops(w, chunks)
    meta = build_metadata(chunks, BLOCK, w.device)
    ids = torch.tensor([c.token_ids[0] for c in chunks])
    with torch.inference_mode():
        out = w.model(ids, meta, w.kv_caches)  # each run writes its step's K/V before its attention reads them
        w.model.backend.decode_bf16_over = 1 << 30  # decodes fp32, in both loops
        w.model.prepare_layer_loop()
        fp32 = w.model(ids, meta, w.kv_caches)
    both_loops(w, chunks)
    assert torch.equal(out, fp32) != bf16


@pytest.mark.parametrize("partition", [(1.5, 2.5), (2.5, 1.5), (1, 3)])
@pytest.mark.parametrize("stage", [0, 1])
def test_stages_and_half_layers(hf_models: dict, partition: tuple[float, float], stage: int) -> None:
    """A stage cut inside a layer holds its attention only (the first stage) or its MLP only."""
    w = worker(str(hf_models["llama"]), pp=2, stage=stage, partition=partition)
    for chunks in STEPS.values():
        both_loops(w, chunks)


def test_every_kernel_build(hf_models: dict, isa: str) -> None:
    w = worker(str(hf_models["mistral"]))  # built after the isa fixture: its LayerStack is that build's
    for chunks in STEPS.values():
        both_loops(w, chunks)


@pytest.mark.parametrize("precision", ["highest", "int8"])
def test_gguf_panels(tmp_path: Path, precision: str) -> None:
    """Block-quantized panels, and fp32 ones where a fused QKV mixes two types, in one stack; at
    "int8" the panels take int8 products and the fp32 ones keep fp32, in both loops alike."""
    from tests.stages.test_quant import VARIANTS, write_gguf
    pytest.importorskip("gguf")
    w = worker(str(write_gguf(tmp_path / "mixed.gguf", VARIANTS["mixed"])), precision=precision)
    # 2 layers of o, gate_up, down; without VNNI (the AVX2 path) the Q8_0 o keeps fp32 products
    int8 = 6 if cpu_kernels.int8_head() else 4
    assert w.info()["int8_linears"] == (int8 if precision == "int8" and cpu_kernels.int8_products() else 0)
    assert {p.dtype for layer in w.model.layers for p in layer.parameters() if p.dim() == 3} == {torch.uint8, torch.float32}
    for chunks in STEPS.values():
        both_loops(w, chunks)


def test_not_built_where_an_op_would_leave_the_kernels(hf_models: dict) -> None:
    src = resolve_model(str(hf_models["llama"]))
    units = (0, 2 * src.config.num_layers)
    plain = StageModel(src.config, units, TPContext(), torch.float32, "cpu", "torch", True, True)
    assert not plain.prepare_layer_loop()  # weights torch multiplies: not packed
    w = worker(str(hf_models["llama"]))
    assert w.model.prepare_layer_loop()
    tp = StageModel(src.config, units, TPContext(0, 2), torch.float32, "cpu", "torch", True, True)
    from stages.layers import pack_linears
    pack_linears(tp)
    assert not tp.prepare_layer_loop()  # the all-reduces stay in Python
    # a bf16 activation: the step takes the Python loop, which runs torch's ops
    assert not w.model.layer_loop.takes(torch.zeros(3, src.config.hidden_size, dtype=torch.bfloat16), w.kv_caches)


def test_a_model_off_the_cpu_never_asks_for_the_kernels(hf_models: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA model (here: on the meta device) gets no C++ loop, decided before anything would
    start a CPU kernel build (a minute, and a compiler a GPU image may lack)."""
    src = resolve_model(str(hf_models["llama"]))
    with torch.device("meta"):
        model = StageModel(src.config, (0, 2 * src.config.num_layers), TPContext(), torch.float32, "meta", "torch",
                           True, True)

    def no_build() -> bool:
        raise AssertionError("asked for the CPU kernels")
    monkeypatch.setattr(cpu_kernels, "available", no_build)
    assert not model.prepare_layer_loop()


def test_per_op_timing_inside_the_c_loop(hf_models: dict) -> None:
    """Instrumented, the C++ loop still runs and times the five buckets itself (the hooks fire on
    the Python loop only); the same step through the Python loop fills the same buckets."""
    w = worker(str(hf_models["llama"]))
    loop = w.model.layer_loop
    timer = OpTimer(sync=lambda: None)
    chunks = STEPS["cached_chunk_and_decodes"]
    ids = torch.tensor([t for c in chunks for t in c.token_ids])
    got = {}
    with torch.inference_mode(), instrument(w.model, timer):
        assert w.model.layer_loop is loop and loop.timer is timer
        for on in (True, False):
            w.model.layer_loop = loop if on else None
            timer.reset()
            w.model(ids, build_metadata(chunks, BLOCK, w.device), w.kv_caches)
            got[on] = dict(timer.acc)
        w.model.layer_loop = loop
    assert loop.timer is None and w.model.layer_loop is loop
    for op in OPS:
        assert got[True][op] > 0 and got[False][op] > 0, op
    assert got[True]["lm_head"] == got[False]["lm_head"] == 0  # not called here


def test_timer_buckets_need_a_float64_tensor(hf_models: dict) -> None:
    w = worker(str(hf_models["llama"]))
    chunks = STEPS["decodes"]
    meta = build_metadata(chunks, BLOCK, w.device)
    step = cpu_kernels.step_meta(meta.positions, meta.slot_mapping, [], [], [], meta.decode_tables,
                                 torch.tensor(meta.ctx_lens, dtype=torch.long))
    caches = [t for kv in w.kv_caches for t in kv]
    h = torch.zeros(len(chunks), w.spec.source.config.hidden_size)
    with pytest.raises(RuntimeError, match="float64"):
        w.model.layer_loop.stack.forward(h, caches, step, torch.zeros(5))


def sampled_rows(chunks: tuple[SeqChunk, ...], which: str) -> torch.Tensor:
    """Rows a last stage samples: the last row of every chunk ("ends"), of the first one only, or none."""
    ends = torch.tensor([c.num_tokens for c in chunks]).cumsum(0) - 1
    return {"ends": ends, "first": ends[:1], "none": ends[:0]}[which]


def keep_step(w: StageWorker, chunks: tuple[SeqChunk, ...], keep: torch.Tensor, loop_on: bool,
              before: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """From the caches ``before``, the step whole and then with ``keep``: [output], [caches after]."""
    loop = w.model.layer_loop
    assert loop is not None
    meta = build_metadata(chunks, BLOCK, w.device)
    x = torch.tensor([t for c in chunks for t in c.token_ids]) if w.is_first else \
        torch.randn(sum(c.num_tokens for c in chunks), w.spec.source.config.hidden_size,
                    generator=torch.Generator().manual_seed(3))
    outs, caches = [], []
    with torch.inference_mode():
        w.model.layer_loop = loop if loop_on else None
        for k_ in (None, keep):
            for (k, v), (k0, v0) in zip(w.kv_caches, before):
                k.copy_(k0)
                v.copy_(v0)
            outs.append(w.model(x, meta, w.kv_caches, keep=k_))
            caches.append([t.clone() for kv in w.kv_caches for t in kv])
    w.model.layer_loop = loop
    return outs, caches


# how far a product of the sampled rows alone may land from the same rows of the whole product: fp32
# sums in another blocking; at "medium" 12 rows or fewer take fp32 products, more take bf16
KEEP_TOL = {"highest": 1e-5, "int8": 1e-5, "medium": 3e-2}


@pytest.mark.parametrize("which", ["ends", "first", "none"])
@pytest.mark.parametrize("precision,kv_dtype", [("highest", "auto"), ("medium", "fp8"), ("int8", "fp8")])
@pytest.mark.parametrize("partition", [None, (2.5, 1.5), (3.5, 0.5)])
def test_only_the_sampled_rows_go_past_the_last_attention(hf_models: dict, partition: tuple[float, float] | None,
                                                         precision: str, kv_dtype: str, which: str) -> None:
    """The last stage's keep (StageModel.forward): (S, H), the same bits from both loops, the same
    caches as the whole step writes, and rows within rounding of the whole step's; none sampled: 0
    rows, the K/V still written; (3.5, 0.5): the last stage holds only the last layer's MLP."""
    w = worker(str(hf_models["llama"]), pp=1 if partition is None else 2, stage=0 if partition is None else 1,
               partition=partition, precision=precision, kv_dtype=kv_dtype)
    before = [(k.clone(), v.clone()) for k, v in w.kv_caches]
    for chunks in STEPS.values():
        keep = sampled_rows(chunks, which)
        (full_c, kept_c), caches_c = keep_step(w, chunks, keep, True, before)
        (full_p, kept_p), caches_p = keep_step(w, chunks, keep, False, before)
        assert kept_c.shape == (keep.numel(), w.spec.source.config.hidden_size)
        assert torch.equal(kept_c, kept_p)
        for whole, kept in (caches_c, caches_p):  # every row's K/V, whatever is kept
            assert all(torch.equal(a, b) for a, b in zip(whole, kept))
        assert all(torch.equal(a, b) for a, b in zip(caches_c[1], caches_p[1]))
        tol = KEEP_TOL[precision]
        torch.testing.assert_close(kept_c, full_c[keep], rtol=tol, atol=tol)
    first = worker(str(hf_models["llama"]), pp=2, stage=0, partition=(2, 2))  # built outside: only the call may raise
    meta = build_metadata(STEPS["decodes"], BLOCK, first.device)
    with pytest.raises(ValueError, match="last stage"):
        first.model(torch.tensor([c.token_ids[0] for c in STEPS["decodes"]]), meta, first.kv_caches,
                    keep=torch.tensor([0]))
