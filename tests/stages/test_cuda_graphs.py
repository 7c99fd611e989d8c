"""stages/cuda_graphs.py: a decode-only step padded to a captured batch size computes what the
eager step computes, for its real rows and in every block a sequence owns. Here the padded step
runs eagerly over the graph's buffers (``capture=False``: no GPU); the capture and replay
themselves run on CUDA only (marked gpu)."""
from __future__ import annotations

import random

import pytest
import torch

from pp_runtime import LLM, SamplingParams
from pp_runtime.batch import SeqChunk
from pp_runtime.config import DeviceConfig
from stages.attention import build_metadata
from stages.cuda_graphs import BATCH_SIZES, DecodeGraphs, graphs_wanted, padded
from tests.conftest import hf_greedy, mixed_prompts, run_interpreted
from tests.stages.test_model import BLOCK, make_worker

NB = 64  # the caches' blocks a sequence may own; block NB is the scratch block


def test_padded_sizes() -> None:
    assert [padded(n) for n in (1, 2, 3, 5, 17, 33, 256)] == [1, 2, 4, 8, 24, 48, 256]
    assert padded(257) is None and BATCH_SIZES == tuple(sorted(BATCH_SIZES))


def test_device_config_cuda_graphs() -> None:
    assert DeviceConfig("cuda", "bfloat16", cuda_graphs=True).cuda_graphs
    with pytest.raises(ValueError, match="DeviceConfig.cuda_graphs needs attention torch or auto"):
        DeviceConfig("cuda", "bfloat16", "xformers", cuda_graphs=True)
    with pytest.raises(ValueError, match="DeviceConfig.cuda_graphs needs device cuda, got 'cpu'"):
        DeviceConfig("cpu", cuda_graphs=True)
    with pytest.raises(ValueError, match="DeviceConfig.cuda_graphs must be true or false, got 1"):
        DeviceConfig("cuda", cuda_graphs=1)
    assert DeviceConfig("cpu").cuda_graphs is None and DeviceConfig("cuda", "bfloat16", "xformers").cuda_graphs is None


@pytest.mark.parametrize("asked", (None, True, False))
def test_graphs_wanted_by_default_on_cuda_at_tp_1(asked: bool | None) -> None:
    """The default (None) replays on CUDA with the torch backend at tp 1, as vLLM's; asked, at any
    tp; never with xformers, or where turned off."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert graphs_wanted(asked, cuda, 1, "torch") is (asked is not False)
    assert graphs_wanted(asked, cuda, 2, "torch") is (asked is True)
    assert graphs_wanted(asked, cpu, 1, "torch") is (asked is True)  # True off CUDA: the tests' eager buffers
    assert not graphs_wanted(asked, cuda, 1, "xformers")


def test_cpu_workers_run_eagerly_by_default(hf_models: dict) -> None:
    with LLM(model=str(hf_models["llama"]), launcher="local", memory_budget_gb=0.5) as llm:
        assert all(w.graphs is None and not w.info()["cuda_graphs"] for w in llm.executor.workers)
        assert all(w.kv_caches[0][0].shape[0] == llm.memory.num_blocks for w in llm.executor.workers)


def decode_step(rng: random.Random, contexts: list[int], vocab: int) -> tuple[SeqChunk, ...]:
    """Decodes at these contexts, each over its own blocks of the first NB, scattered."""
    blocks = rng.sample(range(NB), NB)
    chunks, used = [], 0
    for i, ctx in enumerate(contexts):
        n = -(-(ctx + 1) // BLOCK)
        chunks.append(SeqChunk(i, ctx, (rng.randrange(vocab),), tuple(blocks[used:used + n]), False, None))
        used += n
    return tuple(chunks)


def padded_vs_eager(folder: str, stage: int, attention: str = "cpu") -> None:
    """Steps of 3, 5, 7 and again 5 decodes (padded to 4, 8, 8, 8; the last reuses the third's
    buffers with fewer rows and narrower tables) on the first stage of one or the second of two,
    each after new K/V in every block (as if other sequences held them since: a stale padding row
    shows). ``attention``: "cpu", the CPU kernels (the layers as one C++ call); "triton" and
    "gathered", CUDA's Python layers with the decodes through the Triton kernel (in Triton's
    interpreter) or gathered for SDPA under the padding mask."""
    w = make_worker(folder, pp=1 + stage, stage=stage)
    w.allocate_cache(NB + 1)
    if attention != "cpu":
        from stages.attention import TorchAttention, triton_decode
        w.model.layer_loop = None
        TorchAttention._use_paged_kernel = staticmethod(lambda q: False)
        triton_decode.usable = lambda q, k, v: attention == "triton"
    gen = torch.Generator().manual_seed(0)
    eager_caches = [(k.clone(), v.clone()) for k, v in w.kv_caches]
    cfg = w.spec.source.config
    graphs = DecodeGraphs(w.model, w.kv_caches, NB, BLOCK, cfg.hidden_size if stage else None, w.dtype, capture=False)
    rng = random.Random(1)
    for contexts in ([5, 17, 2], [30, 1, 9, 12, 4], [3, 3, 40, 7, 22, 16, 11], [8, 45, 6, 13, 2]):
        for (k, v), (ek, ev) in zip(w.kv_caches, eager_caches):
            for c, ec in ((k, ek), (v, ev)):
                c.copy_(torch.randn(c.shape, generator=gen))
                ec.copy_(c)
        chunks = decode_step(rng, contexts, cfg.vocab_size)
        meta = build_metadata(chunks, BLOCK, w.device)
        x = torch.tensor([c.token_ids[0] for c in chunks]) if stage == 0 else \
            torch.randn(len(chunks), cfg.hidden_size, generator=gen)
        with torch.inference_mode():
            want = w.model(x, build_metadata(chunks, BLOCK, w.device), eager_caches)
            got = graphs.run(x, meta)
        assert graphs.shape(meta) == (padded(len(chunks)), 1 << (meta.decode_tables.shape[1] - 1).bit_length())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for (k, v), (ek, ev) in zip(w.kv_caches, eager_caches):  # the blocks sequences own: alike
            torch.testing.assert_close(k[:NB], ek[:NB], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(v[:NB], ev[:NB], rtol=1e-6, atol=1e-6)
    assert set(graphs.steps) == {(4, 8), (8, 8), (8, 16)}


@pytest.mark.parametrize("stage", (0, 1), ids=("token-ids-in", "hidden-in"))
def test_padded_step_matches_the_eager_step(hf_models: dict, stage: int) -> None:
    padded_vs_eager(str(hf_models["llama"]), stage)


def interpreted(folder: str) -> None:
    """In a child started with TRITON_INTERPRET=1: CUDA's attention path over the padded buffers."""
    from tests.stages.test_triton_decode import patch_interpreter
    patch_interpreter()
    for attention in ("triton", "gathered"):
        for stage in (0, 1):
            padded_vs_eager(folder, stage, attention)
    print("padded steps match")


def test_padded_step_on_cudas_attention_path(hf_models: dict) -> None:
    """The decode kernel reads the lengths buffer, the gathered path the padding mask: both refilled."""
    pytest.importorskip("triton")
    out = run_interpreted(f"from tests.stages.test_cuda_graphs import interpreted; interpreted({str(hf_models['llama'])!r})")
    assert "padded steps match" in out


def test_a_steps_output_outlives_the_next_step(hf_models: dict) -> None:
    """A send in flight or the local launcher's outbox may still hold a step's output when the
    same shape runs again, which overwrites the graph's output buffer: run returns a copy."""
    w = make_worker(str(hf_models["llama"]))
    w.allocate_cache(NB + 1)
    graphs = DecodeGraphs(w.model, w.kv_caches, NB, BLOCK, None, w.dtype, capture=False)
    rng = random.Random(2)
    with torch.inference_mode():
        first = graphs.run(torch.tensor([3, 4, 5]), build_metadata(decode_step(rng, [4, 9, 2], 100), BLOCK, w.device))
        kept = first.clone()
        graphs.run(torch.tensor([7, 8, 9]), build_metadata(decode_step(rng, [8, 1, 3], 100), BLOCK, w.device))
    assert torch.equal(first, kept) and len(graphs.steps) == 1  # one shape, its buffers reused


def test_steps_with_a_prefill_are_not_taken(hf_models: dict) -> None:
    w = make_worker(str(hf_models["llama"]))
    graphs = DecodeGraphs(w.model, w.kv_caches, NB - 1, BLOCK, None, w.dtype, capture=False)
    chunks = (SeqChunk(0, 0, (1, 2, 3), (0,), True, None), SeqChunk(1, 4, (5,), (1, 2), False, None))
    assert graphs.shape(build_metadata(chunks, BLOCK, w.device)) is None
    many = tuple(SeqChunk(i, 0, (1,), (i % NB,), False, None) for i in range(BATCH_SIZES[-1] + 1))
    assert graphs.shape(build_metadata(many, BLOCK, w.device)) is None  # past the largest size


@pytest.mark.parametrize("pp", (1, 2))
def test_engine_through_padded_steps_gives_transformers_tokens(hf_models: dict, pp: int,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's own wiring (allocate_cache's scratch block, execute's decode-only steps through
    DecodeGraphs, the last stage's sampled rows) in a whole engine on CPU, where the padded steps
    run eagerly (DeviceConfig's CUDA-only check lifted): transformers' greedy tokens, and the
    decode-only steps went through the graphs' buffers."""
    monkeypatch.setattr(DeviceConfig, "__post_init__", lambda self: None)
    prompts = mixed_prompts()
    expected = hf_greedy(hf_models["llama"], prompts, 12)
    with LLM(model=str(hf_models["llama"]), pp=pp, launcher="local", chunk_size=7, memory_budget_gb=0.5,
             cuda_graphs=True) as llm:
        assert [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))] == expected
        assert all(w.graphs.steps and w.info()["cuda_graphs"] for w in llm.executor.workers)
        assert all(w.kv_caches[0][0].shape[0] == llm.memory.num_blocks + 1 for w in llm.executor.workers)


@pytest.mark.gpu(1)
def test_cuda_graphs_give_the_eager_tokens(hf_models: dict) -> None:
    """The engine on CUDA with decode-only steps replayed: the tokens of transformers' greedy
    generate (fp32, as the eager CUDA test), and the graphs were captured, not abandoned."""
    prompts = mixed_prompts()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = hf_greedy(hf_models["llama"], prompts, 12)
    with LLM(model=str(hf_models["llama"]), device="cuda", attention="torch", chunk_size=7, memory_budget_gb=2.0,
             cuda_graphs=True) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
        worker = llm.executor.workers[0]
        assert worker.graphs is not None and any(s.graph is not None for s in worker.graphs.steps.values())
