"""Stage model numerics: chunked prefill equals one-shot prefill; pipeline stages compose."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pp_runtime.batch import SeqChunk
from pp_runtime.config import CacheConfig, DeviceConfig, ParallelConfig
from stages import cpu_kernels
from stages.attention import build_metadata
from stages.layers import TPContext
from stages.model_source import resolve_model
from stages.worker import StageWorker
from stages.worker_spec import WorkerSpec
from tests.conftest import ARCHS, hf_causal_lm, mixed_prompts

BLOCK = 4


def make_worker(path: str, pp: int = 1, stage: int = 0, kv_dtype: str = "auto",
                matmul_precision: str = "highest") -> StageWorker:
    spec = WorkerSpec(resolve_model(path), stage, 0, ParallelConfig(pp), CacheConfig(BLOCK, 1 << 26, kv_dtype),
                      DeviceConfig("cpu", "float32", "torch", matmul_precision=matmul_precision))
    w = StageWorker(spec, TPContext(), None)
    w.allocate_cache(64)
    return w


def run_chunks(w: StageWorker, prompt: list[int], chunk: int, table: tuple[int, ...]) -> torch.Tensor:
    """Logits (len(prompt), V) at every position, feeding the prompt ``chunk`` tokens at a time."""
    rows = []
    for start in range(0, len(prompt), chunk):
        ids = prompt[start:start + chunk]
        c = SeqChunk(0, start, tuple(ids), table, True, None)
        meta = build_metadata((c,), BLOCK, w.device)
        h = w.model(torch.tensor(ids, device=w.device), meta, w.kv_caches)
        rows.append(w.model.logits(h))
    return torch.cat(rows)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk", (1, 3, 16, 33))
def test_chunked_prefill_logits_equal_one_shot(hf_models: dict, arch: str, chunk: int) -> None:
    w = make_worker(str(hf_models[arch]))
    prompt = mixed_prompts(lengths=(70,))[0]
    table = tuple(range(18))  # 72 token slots
    with torch.inference_mode():
        full = run_chunks(w, prompt, len(prompt), table)
        chunked = run_chunks(w, prompt, chunk, table)
    rel = (full - chunked).abs().max() / full.abs().max()
    assert rel <= 1e-5, f"max relative difference {rel:.2e}"


def test_logits_match_transformers(isa: str, hf_models: dict) -> None:
    path = hf_models["qwen2"]
    prompt = mixed_prompts(lengths=(40,))[0]
    ref = hf_causal_lm(path)
    w = make_worker(str(path))
    with torch.inference_mode():
        expected = ref(torch.tensor([prompt])).logits[0]
        ours = run_chunks(w, prompt, 16, tuple(range(10)))
    assert torch.allclose(ours, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("partition", ((2, 2), (1, 3), (3, 1), (2.5, 1.5), (0.5, 3.5), (3.5, 0.5)))
def test_stages_compose_to_full_model(hf_models: dict, partition: tuple[float, float]) -> None:
    """Two stages (layers split as given, halves cutting a layer after its attention) hand hidden
    states over and equal the one-stage model bit for bit."""
    path = str(hf_models["llama"])
    prompt = mixed_prompts(lengths=(20,))[0]
    one = make_worker(path)
    stages = []
    for s in range(2):
        spec = WorkerSpec(resolve_model(path), s, 0, ParallelConfig(2, 1, partition), CacheConfig(BLOCK, 1 << 26),
                          DeviceConfig("cpu", "float32", "torch"))
        stages.append(StageWorker(spec, TPContext(), None))
        stages[-1].allocate_cache(8)
    # a cut layer has its attention (and KV cache) on the first stage, its MLP on the second
    assert [s.model.num_attention_layers for s in stages] == [math.ceil(partition[0]), math.floor(partition[1])]
    assert [len(s.kv_caches) for s in stages] == [s.model.num_attention_layers for s in stages]
    assert [s.info()["layers"] for s in stages] == [[0, partition[0]], [partition[0], 4]]
    profiles = [s.memory_profile().kv_bytes_per_token for s in stages]
    assert sum(profiles) == one.memory_profile().kv_bytes_per_token
    c = SeqChunk(0, 0, tuple(prompt), tuple(range(5)), True, None)
    with torch.inference_mode():
        meta = build_metadata((c,), BLOCK, one.device)
        expected = one.model.logits(one.model(torch.tensor(prompt), meta, one.kv_caches))
        h = stages[0].model(torch.tensor(prompt), meta, stages[0].kv_caches)
        got = stages[1].model.logits(stages[1].model(h, meta, stages[1].kv_caches))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
def test_half_precision_stays_in_dtype_and_tracks_float32(hf_models: dict, dtype: str) -> None:
    path = str(hf_models["llama"])
    prompt = mixed_prompts(lengths=(24,))[0]
    logits = {}
    for dt in ("float32", dtype):
        spec = WorkerSpec(resolve_model(path), 0, 0, ParallelConfig(1), CacheConfig(BLOCK, 1 << 26),
                          DeviceConfig("cpu", dt, "torch"))
        w = StageWorker(spec, TPContext(), None)
        w.allocate_cache(8)
        c = SeqChunk(0, 0, tuple(prompt), tuple(range(6)), True, None)
        with torch.inference_mode():
            h = w.model(torch.tensor(prompt), build_metadata((c,), BLOCK, w.device), w.kv_caches)
            assert h.dtype == getattr(torch, dt)
            logits[dt] = w.model.logits(h)
    err = (logits[dtype] - logits["float32"]).abs().max() / logits["float32"].abs().max()
    assert err < 0.05, f"{dtype} relative error {err:.3f}"


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_kv_cache_starts_zeroed(hf_models: dict, dtype: str) -> None:
    """Attention reads whole blocks and masks the tail: every unwritten slot must be finite (zero)."""
    spec = WorkerSpec(resolve_model(str(hf_models["llama"])), 0, 0, ParallelConfig(1), CacheConfig(BLOCK, 1 << 26),
                      DeviceConfig("cpu", dtype, "torch"))
    w = StageWorker(spec, TPContext(), None)
    w.allocate_cache(32)
    for k, v in w.kv_caches:
        assert k.dtype == getattr(torch, dtype) and not k.any() and not v.any()


@pytest.mark.parametrize("kv_dtype,dtype,shrink,tol,norm_tol", [("float16", torch.float16, 2, 2e-3, 2e-3),
                                                               ("fp8", torch.float8_e4m3fn, 4, 0.2, 0.15)])
def test_narrow_kv_cache_shrinks_the_bytes_and_tracks_float32(isa: str, hf_models: dict, kv_dtype: str,
                                                              dtype: torch.dtype, shrink: int, tol: float,
                                                              norm_tol: float) -> None:
    """--kv-cache-dtype float16 / fp8 on an fp32 model: half / a quarter of the KV bytes per token
    (2× / 4× the blocks in a budget), logits over a prompt fed in chunks (cached K/V read back)
    within the format's rounding, each logit (tol × the largest) and as a share of the logits' norm:
    fp16 rounds each value by ≤ 2⁻¹¹ (measured 0.09% / 0.06%); fp8 e4m3 by ≤ 2⁻⁴, and this random
    model's K/V are small enough that many fall under e4m3's smallest normal (2⁻⁶), where its steps
    are 2⁻⁹ apart (measured 12.7% / 8.5%; the embedded model's quality under fp8 is
    test_embedded_model's)."""
    path = str(hf_models["llama"])
    prompt = mixed_prompts(lengths=(30,))[0]
    w32, w16 = make_worker(path), make_worker(path, kv_dtype=kv_dtype)
    assert w16.memory_profile().kv_bytes_per_token * shrink == w32.memory_profile().kv_bytes_per_token
    assert all(k.dtype == dtype and v.dtype == dtype for k, v in w16.kv_caches)
    table = tuple(range(8))
    with torch.inference_mode():
        a, b = run_chunks(w32, prompt, 7, table), run_chunks(w16, prompt, 7, table)
    assert not torch.equal(a, b)  # the cache really rounds
    torch.testing.assert_close(b, a, rtol=0, atol=tol * a.abs().max().item())
    assert (b - a).norm() < norm_tol * a.norm()


@pytest.mark.skipif(not cpu_kernels.bf16_products(), reason="no AVX512-BF16 in this build")
def test_matmul_precision_medium_rounds_only_many_row_products(hf_models: dict) -> None:
    """--matmul-precision medium: every linear may take bf16 products; a chunk of more than 12
    tokens does (logits move by bf16 rounding, not more), one of up to 12 stays bit-identical."""
    path = str(hf_models["llama"])
    prompt = mixed_prompts(lengths=(40,))[0]
    fp32, mixed = make_worker(path), make_worker(path, matmul_precision="medium")
    assert fp32.info()["bf16_linears"] == 0
    layers = mixed.spec.source.config.num_layers
    assert mixed.info()["bf16_linears"] == 4 * layers + 1  # (qkv, o, gate_up, down) per layer + LM head
    assert mixed.info()["bf16_attention"] and not fp32.info()["bf16_attention"]  # chunks > 12 tokens
    table = tuple(range(16))
    with torch.inference_mode():
        a, b = run_chunks(fp32, prompt, 40, table), run_chunks(mixed, prompt, 40, table)
        assert not torch.equal(a, b)
        scale = a.abs().max().item()  # bf16 keeps ~3 digits: elementwise a few %, on average far less
        torch.testing.assert_close(b, a, rtol=0, atol=0.05 * scale)
        assert (b - a).abs().mean() < 0.005 * scale
        assert (b.argmax(-1) == a.argmax(-1)).float().mean() > 0.9
        assert torch.equal(run_chunks(fp32, prompt, 12, table), run_chunks(mixed, prompt, 12, table))


def test_matmul_precision_is_checked_by_name() -> None:
    with pytest.raises(ValueError, match="DeviceConfig.matmul_precision must be one of highest, medium, int8, got 'low'"):
        DeviceConfig(matmul_precision="low")
    with pytest.raises(ValueError, match="matmul_precision medium is for float32 models on CPU"):
        DeviceConfig("cpu", "bfloat16", matmul_precision="medium")
    with pytest.raises(ValueError, match="matmul_precision int8 is for float32 models on CPU"):
        DeviceConfig("cuda", "float32", matmul_precision="int8")
    with pytest.raises(ValueError, match="matmul_precision medium is for float32 models on CPU"):
        DeviceConfig("cuda", matmul_precision="medium")


def test_a_tied_head_is_the_embedding_on_every_split(hf_models: dict, tmp_path: Path) -> None:
    """A config that ties the head to the embedding, over a checkpoint that also carries a
    different lm_head.weight: the embedding is the head whether one stage holds both or the
    last stage holds the head alone (greedy tokens must not depend on pp); an untied config
    without lm_head.weight is an error, not a silent tie."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from stages.model_source import ModelError
    tied = tmp_path / "tied"
    shutil.copytree(hf_models["llama"], tied)  # untied: its lm_head.weight differs from the embedding
    cfg = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps(cfg | {"tie_word_embeddings": True}))
    prompt = mixed_prompts(lengths=(20,))[0]
    one = make_worker(str(tied))
    spec = lambda s: WorkerSpec(resolve_model(str(tied)), s, 0, ParallelConfig(2), CacheConfig(BLOCK, 1 << 26),
                                DeviceConfig("cpu", "float32", "torch"))
    stages = [StageWorker(spec(s), TPContext(), None) for s in range(2)]
    for s in stages:
        s.allocate_cache(8)
    c = SeqChunk(0, 0, tuple(prompt), tuple(range(5)), True, None)
    with torch.inference_mode():
        meta = build_metadata((c,), BLOCK, one.device)
        expected = one.model.logits(one.model(torch.tensor(prompt), meta, one.kv_caches))
        got = stages[1].model.logits(stages[1].model(stages[0].model(torch.tensor(prompt), meta,
                                                                      stages[0].kv_caches), meta, stages[1].kv_caches))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)

    headless = tmp_path / "headless"
    shutil.copytree(hf_models["llama"], headless)
    (st,) = headless.glob("*.safetensors")
    save_file({k: v for k, v in load_file(st).items() if k != "lm_head.weight"}, st, metadata={"format": "pt"})
    with pytest.raises(ModelError, match="no lm_head.weight, and the config says tie_word_embeddings is false"):
        make_worker(str(headless))
