"""The fused elementwise kernels of stages/triton_elementwise.py against the eager ops they replace:
in Triton's interpreter on CPU tensors where triton is installed (scripts/setup.sh installs it),
and on a GPU, each kernel and a whole model with them on and off; without a GPU, each kernel (and
the paged decode kernel) also goes through Triton's real compiler for an H200 (sm_90)."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

from stages import triton_elementwise as te
from stages.attention.torch_backend import _narrow, byte_view
from tests.conftest import mixed_prompts, run_interpreted

DTYPES = ("float32", "bfloat16", "float16")


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """fp32: to fp32 rounding. bf16/fp16: at most one unit in the last place anywhere, and equal in
    ≥ 99% of elements (the kernels round where the eager ops round; only the order of fp32 sums
    differs, which moves a result across a rounding boundary rarely)."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if got.dtype == torch.float8_e4m3fn:  # one rounding of the same fp32 value: bit for bit
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m: f"{what}: {m}")
        return
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True, msg=lambda m: f"{what}: {m}")
        return
    ulp = torch.finfo(got.dtype).eps  # one unit in the last place, relative
    torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=ulp, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")
    differ = ((got != want) & ~(got.isnan() & want.isnan())).float().mean()
    assert differ <= 0.01, f"{what}: {differ:.3%} of elements differ"


def cases(name: str, device: str) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(what, kernel output, eager output) for every kernel at a few shapes, in dtype ``name``."""
    dtype = getattr(torch, name)
    gen = torch.Generator().manual_seed(1)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 2).to(device, dtype)

    out = []
    for t, n in ((7, 576), (3, 64), (1, 100), (33, 4096)):  # SmolLM2's and LLaMA-7B's hidden, odd sizes
        x, r, w = rand(t, n), rand(t, n), rand(n)
        out.append((f"rms_norm {t}x{n}", te.rms_norm(x, w, 1e-5), te.eager_rms_norm(x, w, 1e-5)))
        h = x.clone()
        normed = te.add_rms_norm_(h, r, w, 1e-5)
        out += [(f"add_rms_norm_ sum {t}x{n}", h, x + r),
                (f"add_rms_norm_ norm {t}x{n}", normed, te.eager_rms_norm(x + r, w, 1e-5))]
    for t, hq, hkv, d in ((5, 9, 3, 64), (4, 32, 32, 128), (2, 2, 1, 16)):
        qkv = rand(t, (hq + 2 * hkv) * d)  # the fused QKV output: q and k heads rotated, v left alone
        pos = torch.randint(0, 50, (t,), generator=gen).to(device)
        freqs = torch.outer(torch.arange(50.0), 1.0 / (10000 ** (torch.arange(0, d, 2.0) / d))).to(device)
        view = qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d)
        want, v_before = te.eager_rope(view, pos, freqs.cos(), freqs.sin()), qkv[:, (hq + hkv) * d:].clone()
        assert te.rope_fits(view)
        out += [(f"rope_ {t}x{hq}+{hkv}x{d}", te.rope_(view, pos, freqs.cos(), freqs.sin()), want),
                (f"rope_ leaves v {t}x{hq}+{hkv}x{d}", qkv[:, (hq + hkv) * d:], v_before)]
    for t, i in ((6, 1536), (3, 100), (2, 11008)):
        gu = rand(t, 2 * i)
        out.append((f"silu_mul {t}x{i}", te.silu_mul(gu), te.eager_silu_mul(gu)))
    for t, hkv, d, cache in ((5, 3, 64, name), (4, 2, 16, "float16"), (2, 1, 128, name), (6, 2, 32, "float8_e4m3fn")):
        # past fp16's range (from a wider dtype), past e4m3's ±448 (from any)
        qkv = rand(t, (2 + 2 * hkv) * d) * {"float16": 1e5 if name != "float16" else 1, "float8_e4m3fn": 300}.get(cache, 1)
        qkv[0, 2 * d] = float("nan")  # kept as NaN, as torch's clamp keeps it
        k, v = (qkv[:, a * d:(a + hkv) * d].view(t, hkv, d) for a in (2, 2 + hkv))
        kc, vc = (torch.full((4, 4, hkv, d), 7.0, dtype=getattr(torch, cache), device=device) for _ in range(2))
        ref_k, ref_v = kc.clone(), vc.clone()
        slots = torch.randperm(16, generator=gen)[:t].to(device)
        assert te.kv_fits(k, v, kc, vc)
        keep = t if t == 2 else t - 1  # every row (a prefill-only step), or all but a decode's last
        kept = te.write_kv_(k, v, kc, vc, slots, keep=keep)
        for ref, x in ((ref_k, k), (ref_v, v)):  # the eager write (stages/attention/torch_backend.py)
            byte_view(ref).view(-1, hkv, d).index_copy_(0, slots, byte_view(_narrow(x, ref.dtype)))
        out += [(f"write_kv_ k {t}x{hkv}x{d} into {cache}", kc, ref_k), (f"write_kv_ v {t}x{hkv}x{d} into {cache}", vc, ref_v)]
        # what a fresh prefill attends to: the eager round trip (torch_backend's fallback)
        out += [(f"write_kv_ keeps {w} {keep} of {t} rows, {cache}", got, _narrow(x[:keep], kc.dtype).to(x.dtype))
                for w, got, x in (("k", kept[0], k), ("v", kept[1], v))]
    return out


def round_bf16_to_nearest() -> None:
    """The interpreter narrows fp32 to bf16 by cutting the low 16 bits (its own converter, numpy
    having no bf16), where a GPU rounds to nearest even; half of all casts then differ by an ulp.
    Its fp32 -> fp8 e4m3 drops a rounding's carry into the exponent (126.96 -> 64, not 128) and
    makes NaN 384, where a GPU's cvt.rn.satfinite rounds to nearest even and keeps NaN (and its
    e4m3 -> fp32 makes NaN a number). Cast those as torch does, the GPU's way, so that the
    comparison is exact."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter
    cast = interpreter.InterpreterBuilder.cast_impl
    narrow = {tl.bfloat16: (torch.bfloat16, torch.int16, np.uint16), tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8,
                                                                                     np.uint8)}

    to_fp = interpreter.InterpreterBuilder.create_fp_to_fp  # fp8's casts come this way, bf16's by cast_impl

    def torch_cast(src: interpreter.TensorHandle, dst_type: object) -> interpreter.TensorHandle:
        dtype, bits, np_bits = narrow[dst_type.scalar]
        out = torch.from_numpy(np.ascontiguousarray(src.data)).to(dtype).view(bits)
        return interpreter.TensorHandle(out.numpy().view(np_bits), dst_type.scalar)

    def rounded(self: object, src: interpreter.TensorHandle, dst_type: object) -> interpreter.TensorHandle:
        if src.dtype.scalar == tl.float32 and dst_type.scalar in narrow:
            return torch_cast(src, dst_type)
        return cast(self, src, dst_type)

    def rounded_fp(self: object, src: interpreter.TensorHandle, dst_type: object,
                   rounding_mode: object) -> interpreter.TensorHandle:
        if src.dtype.scalar == tl.float32 and dst_type.scalar in narrow:
            return torch_cast(src, dst_type)
        if src.dtype.scalar == tl.float8e4nv and dst_type.scalar == tl.float32:  # its NaN widened as torch does
            wide = torch.from_numpy(np.ascontiguousarray(src.data)).view(torch.float8_e4m3fn).float()
            return interpreter.TensorHandle(wide.numpy(), dst_type.scalar)
        return to_fp(self, src, dst_type, rounding_mode)

    interpreter.InterpreterBuilder.cast_impl = rounded
    interpreter.InterpreterBuilder.create_fp_to_fp = rounded_fp


def interpret_cases() -> None:
    """Runs in a child process started with TRITON_INTERPRET=1 (triton reads it on import)."""
    round_bf16_to_nearest()
    n = 0
    for name in DTYPES:
        for what, got, want in cases(name, "cpu"):
            close(got, want, f"{name} {what}")
            n += 1
        assert te._probe(getattr(torch, name), torch.device("cpu")) is None, name  # the runtime's own check
    model_with_and_without(Path(sys.argv[1]))
    print(f"{n} cases match")


def model_with_and_without(folder: Path) -> None:
    """The wiring (stages/layers.py, model.py): a random LLaMA in bf16 on CPU tensors, where the
    CPU kernels (fp32 only) leave every op to the CUDA path; chunked prefill logits with the
    kernels taking CPU tensors, against the eager ops; with a bf16 cache and an fp8 one (whose
    fresh prefill attends to the K/V the fused write hands back, else to the eager round trip)."""
    from tests.conftest import make_hf_model
    from tests.stages.test_model import run_chunks
    te.takes = lambda x: te.enabled and x.dtype in te.DTYPES  # the interpreter runs on CPU tensors
    model = make_hf_model("llama", folder)
    for kv_dtype in ("auto", "fp8"):
        logits = {}
        for on in (True, False):
            te.enabled = on
            w = bf16_worker(model, "cpu", kv_dtype=kv_dtype)
            with torch.inference_mode():
                logits[on] = run_chunks(w, mixed_prompts(lengths=(20,))[0], 7, tuple(range(8)))
        # bit for bit here; 1% of the largest logit still fails a kernel that truncates where eager rounds (~5%)
        torch.testing.assert_close(logits[True], logits[False], rtol=0, atol=1e-2 * float(logits[False].abs().max()),
                                   msg=lambda m: f"kv {kv_dtype}: {m}")


def test_kernels_interpreted(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    out = run_interpreted("from tests.stages.test_triton_elementwise import interpret_cases; interpret_cases()",
                          str(tmp_path))
    assert "cases match" in out


def test_fp8_caches_only_where_triton_compiles_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton has no e4m3 before sm_89 (an A100 is sm_80): there the eager write and gather run."""
    from types import SimpleNamespace
    cache = SimpleNamespace(dtype=torch.float8_e4m3fn, is_cuda=True, device=torch.device("cuda", 0))
    for sm89 in (False, True):
        monkeypatch.setattr(te, "_sm89", lambda index, ok=sm89: ok)
        assert te.fp8_native(cache) is sm89
        assert te.fp8_native(SimpleNamespace(dtype=torch.bfloat16, is_cuda=True, device=cache.device))
    assert te.fp8_native(torch.zeros(1, dtype=torch.float8_e4m3fn))  # CPU: the interpreter's


def test_takes_only_cuda_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not te.takes(torch.zeros(2, 8))  # the CPU kernels' job
    monkeypatch.setattr(te, "enabled", False)
    assert not te.takes(torch.zeros(2, 8))
    assert te.rope_fits(torch.zeros(3, 4, 64)) and not te.rope_fits(torch.zeros(3, 4, 96))
    assert not te.rope_fits(torch.zeros(3, 64, 4).transpose(1, 2))
    k, cache = torch.zeros(3, 2, 16), torch.zeros(4, 4, 2, 16)
    assert te.kv_fits(k, k, cache, cache)
    assert not te.kv_fits(k, k, cache, cache.half())  # the two caches alike
    assert te.kv_fits(k, k, cache.to(torch.float8_e4m3fn), cache.to(torch.float8_e4m3fn))  # narrowed as it is written
    assert not te.kv_fits(torch.zeros(3, 16, 2).transpose(1, 2), k, cache, cache)


def test_workers_say_whether_the_kernels_run(hf_models: dict) -> None:
    assert bf16_worker(hf_models["llama"], "cpu", "float32").info()["fused_elementwise"] is False


def test_a_failing_probe_means_eager_ops_with_the_reason(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    def broken(dtype: torch.dtype, device: torch.device) -> str | None:
        raise RuntimeError("PassManager::run failed\nmore lines")

    monkeypatch.setattr(te, "_probe", broken)
    monkeypatch.setattr(te, "triton_missing", lambda: None)
    with caplog.at_level(logging.WARNING):
        reason = te.unusable.__wrapped__(torch.bfloat16, 0)
    assert reason == "RuntimeError: PassManager::run failed"
    assert "running eager ops" in caplog.text
    monkeypatch.setattr(te, "_probe", lambda dtype, device: "rope_ disagrees with the eager ops (...)")
    assert te.unusable.__wrapped__(torch.bfloat16, 0).startswith("rope_ disagrees")
    monkeypatch.setattr(te, "triton_missing", lambda: "triton does not import (ImportError)")
    assert te.unusable.__wrapped__(torch.bfloat16, 0) == "triton does not import (ImportError)"


@pytest.mark.gpu(1)
@pytest.mark.parametrize("name", DTYPES)
def test_kernels_on_cuda(name: str) -> None:
    assert te.unusable(getattr(torch, name), torch.cuda.current_device()) is None
    for what, got, want in cases(name, "cuda"):
        close(got, want, f"{name} {what}")


@pytest.mark.gpu(1)
@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_model_with_and_without_the_kernels_on_cuda(hf_models: dict, dtype: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The random LLaMA on CUDA: chunked prefill logits, fused ops on and off."""
    from tests.stages.test_model import run_chunks
    w = bf16_worker(hf_models["llama"], "cuda", dtype)
    assert w.info()["fused_elementwise"]  # decided at load
    prompt = mixed_prompts(lengths=(40,))[0]
    assert te.takes(torch.zeros(1, device="cuda", dtype=getattr(torch, dtype)))
    with torch.inference_mode():
        fused = run_chunks(w, prompt, 7, tuple(range(10)))
        monkeypatch.setattr(te, "enabled", False)
        eager = run_chunks(w, prompt, 7, tuple(range(10)))
    tol = 1e-4 if dtype == "float32" else 3e-2
    torch.testing.assert_close(fused, eager, rtol=0, atol=tol * float(eager.abs().max()))


def bf16_worker(folder: Path, device: str, dtype: str = "bfloat16", kv_dtype: str = "auto") -> object:
    """A one-stage worker of the HF model in ``folder`` (test_model's block size), its cache for 32 blocks."""
    from pp_runtime.config import CacheConfig, DeviceConfig, ParallelConfig
    from stages.layers import TPContext
    from stages.model_source import resolve_model
    from stages.worker import StageWorker
    from stages.worker_spec import WorkerSpec
    from tests.stages.test_model import BLOCK
    spec = WorkerSpec(resolve_model(str(folder)), 0, 0, ParallelConfig(1), CacheConfig(BLOCK, 1 << 26, kv_dtype),
                      DeviceConfig(device, dtype, "torch"))
    w = StageWorker(spec, TPContext(), None)
    w.allocate_cache(32)
    return w


def compile_for_hopper(fn: object, sig: dict[str, str], consts: dict[str, object], warps: int) -> str:
    """PTX of ``fn`` compiled for sm_90 by Triton's own compiler and ptxas: no GPU needed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    kernel = triton.compile(ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    return kernel.asm["ptx"]


@pytest.mark.parametrize("dt", ("bf16", "fp32"))
def test_kernels_compile_for_an_h200(dt: str) -> None:
    """What the interpreter cannot tell: each kernel at LLaMA-7B's sizes through the real compiler
    (types across branches, casts, int64 offsets); the fp16 cache's clamp keeps NaN (max.NaN)."""
    pytest.importorskip("triton")
    from stages.attention import triton_decode
    k = te._kernels()
    ptr = {n: f"*{dt}" for n in ("h_ptr", "x_ptr", "w_ptr", "out_ptr")}
    compile_for_hopper(k["norm"], {**ptr, "stride_h": "i32", "stride_x": "i32", "n": "i32", "eps": "fp32"},
                       {"RESIDUAL": True, "BLOCK": 4096}, 16)
    compile_for_hopper(k["rope"], {"x_ptr": f"*{dt}", "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                                   "stride_t": "i32", "heads": "i32"}, {"HEADS": 64, "HALF": 64}, 8)
    compile_for_hopper(k["silu_mul"], {"gu_ptr": f"*{dt}", "out_ptr": f"*{dt}", "stride_g": "i32", "n": "i32"},
                       {"BLOCK": 1024}, 4)
    kv_sig = {"k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "slot_ptr": "*i64", "rk_ptr": f"*{dt}", "rv_ptr": f"*{dt}",
              "stride_k": "i32", "stride_v": "i32", "row": "i32", "keep": "i32"}
    ptx = compile_for_hopper(k["write_kv"], {**kv_sig, "kc_ptr": "*fp16", "vc_ptr": "*fp16"},
                             {"TOP": 65504.0, "KEEP": False, "BLOCK": 4096}, 4)
    assert "max.NaN" in ptx and "min.NaN" in ptx
    for keep in (False, True):  # a fresh prefill's rows kept as the cache holds them
        ptx = compile_for_hopper(k["write_kv"], {**kv_sig, "kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv"},
                                 {"TOP": 448.0, "KEEP": keep, "BLOCK": 4096}, 4)
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx  # round to nearest even, as torch's cast
    decode_sig = {"q_ptr": f"*{dt}", "k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "table_ptr": "*i64", "lens_ptr": "*i64",
                  "out_ptr": f"*{dt}", "part_ptr": "*fp32", "scale": "fp32",
                  **{s: "i32" for s in ("stride_qb", "stride_qh", "stride_kblk", "stride_kslot", "stride_kh",
                                        "stride_tb", "stride_ob", "stride_oh")}}
    for splits in (1, 8):  # the output written directly; partials for the merge
        compile_for_hopper(triton_decode._kernel(triton_decode._paged_decode_kernel), decode_sig,
                           {"G": 1, "G_PAD": 1, "D": 128, "BS": 16, "TOKENS": 32, "S": splits, "ALIGN": 16}, 2)
    for warps in (1, 2):  # an fp8 cache: 1 warp where choose_warps takes it
        compile_for_hopper(triton_decode._kernel(triton_decode._paged_decode_kernel),
                           {**decode_sig, "k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv"},
                           {"G": 1, "G_PAD": 1, "D": 128, "BS": 16, "TOKENS": 32, "S": 1, "ALIGN": 16}, warps)
    compile_for_hopper(triton_decode._kernel(triton_decode._merge_kernel),
                       {"part_ptr": "*fp32", "out_ptr": f"*{dt}",
                        "stride_ob": "i32", "stride_oh": "i32"}, {"H": 32, "D": 128, "S": 8, "S_PAD": 8}, 4)
