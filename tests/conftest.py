"""Shared fixtures: small random-weight HF models saved to a temporary folder (the numerical
oracle is transformers itself), prompts of assorted lengths, and GPU gating."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Keep every Ray address on loopback: without this Ray swaps 127.0.0.1 for the host's
# outward-facing IP when connecting (tests send traffic to loopback only).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Tiny models on a shared 2-core box: a second intra-op thread only adds contention (tests that
# measure threading set their own).
torch.set_num_threads(1)
ARCHS = ("llama", "mistral", "qwen2")


def run_interpreted(code: str, *args: str, timeout: int = 600) -> str:
    """stdout of ``code`` run in a child Python started with TRITON_INTERPRET=1 (Triton reads it on
    import, so not in this process), from the repository root, with ``args`` as its argv; a child
    that fails fails the test with the end of its stderr. Callers skip first where no triton is."""
    r = subprocess.run([sys.executable, "-c", code, *args], cwd=Path(__file__).parents[1], capture_output=True,
                       text=True, timeout=timeout,
                       env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def tiny_hf_config(arch: str) -> object:
    import transformers
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        return transformers.LlamaConfig(rope_theta=10000.0, **common)
    if arch == "mistral":
        return transformers.MistralConfig(rope_theta=500000.0, sliding_window=None, **common)
    common["tie_word_embeddings"] = True  # Qwen2: qkv bias and tied embeddings
    return transformers.Qwen2Config(rope_theta=1000000.0, **common)


def make_hf_model(arch: str, folder: Path, seed: int = 0) -> Path:
    import transformers
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_hf_config(arch), dtype=torch.float32)
    with torch.no_grad():  # HF zero-initialises biases; random ones actually test the qkv bias path
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_models")
    return {arch: make_hf_model(arch, root / arch, seed=i) for i, arch in enumerate(ARCHS)}


@functools.cache
def hf_causal_lm(folder: Path) -> object:
    """transformers' fp32 model of ``folder``, loaded once a session (the references only read it)."""
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_greedy(folder: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Reference tokens: transformers' own greedy generate, one unpadded prompt at a time."""
    model = hf_causal_lm(folder)
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                           min_new_tokens=max_new, pad_token_id=0, eos_token_id=None)
        outs.append(g[0, len(p):].tolist())
    return outs


def mixed_prompts(seed: int = 0, lengths: tuple[int, ...] = (5, 23, 1, 70, 12, 41)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


PREEMPT_PROMPTS = mixed_prompts(seed=3, lengths=(23, 9, 70, 12, 41, 1))


def with_and_without_preemption(folder: Path, plist: list) -> tuple[list, list]:
    """PREEMPT_PROMPTS under ``plist`` on a roomy cache, then on one of 8 blocks of 16 (128 tokens
    of KV for their 216) that preempts and recomputes: (outputs, outputs under preemption)."""
    from pp_runtime import LLM
    from pp_runtime.kv_cache import BlockManager
    kw = dict(model=str(folder), memory_budget_gb=0.05, chunk_size=16, max_batch_size=6, kv_admission="optimistic")
    with LLM(**kw) as llm:
        whole = llm.generate(PREEMPT_PROMPTS, plist)
    with LLM(**kw) as llm:
        llm.blocks = BlockManager(8, 16, False)
        reqs = [llm.make_request(str(i), p, sp) for i, (p, sp) in enumerate(zip(PREEMPT_PROMPTS, plist))]
        outs = llm.run(reqs)
    assert sum(r.num_preemptions for r in reqs) > 0
    return whole, outs


def fail_on_call(monkeypatch: pytest.MonkeyPatch, worker: object, n: int, message: str) -> None:
    """Make a local stage worker's n-th ``execute`` raise RuntimeError(message): a stage that fails
    half-way through a run (a bug, an op that fails), as a dead worker does."""
    real, calls = worker.execute, []

    def flaky(wire: tuple) -> list[int] | None:
        calls.append(1)
        if len(calls) == n:
            raise RuntimeError(message)
        return real(wire)

    monkeypatch.setattr(worker, "execute", flaky)


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# The suite's longest files, longest first (seconds in one process on the 2-core CI box: 220,
# 100, 70, 70, 65, 55, 55, 50, 50, 45): `--dist loadfile` hands each xdist worker whole files in
# collection order, so these start first and the short files fill in around them at the end.
LONGEST_FIRST = ("launch/test_ray_launch.py", "launch/test_torchrun.py", "stages/test_embedded_model.py",
                 "launch/test_worker_failure.py", "benchmarks/test_vs_hf.py", "launch/test_signals.py",
                 "launch/test_ray_cluster.py", "benchmarks/test_decode_maximal.py", "launch/test_cli.py",
                 "benchmarks/test_validate_sim.py")


def pytest_configure(config: pytest.Config) -> None:
    # keep LONGEST_FIRST's order: xdist otherwise deals files out by their count of tests, most
    # first, which left the one-test files of long benchmark runs for the end
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _file_rank(item: pytest.Item) -> int:
    path = item.path.relative_to(Path(__file__).parent).as_posix()
    return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_file_rank)  # stable: each file's own order, and the other files', kept
    for item in items:
        marker = item.get_closest_marker("gpu")
        need = marker.args[0] if marker and marker.args else 1
        if marker and gpu_count() < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU(s), found {gpu_count()}"))
