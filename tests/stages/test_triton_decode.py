"""The CUDA paged decode kernel (stages/attention/triton_decode.py) against a dense reference:
in Triton's interpreter on CPU tensors where triton is installed (the GPU image has it, CI's
venv does not), and on a GPU, wired into the torch backend, against its gather path."""
from __future__ import annotations

import pytest
import torch

from stages.attention import TorchAttention, build_metadata
from stages.attention import triton_decode
from tests.conftest import run_interpreted

BS, HKV, NB = 16, 2, 64
LENS = (1, 15, 16, 17, 64, 150)  # one key; a block less one; a block; a block and one; whole steps (16, 32, 64 keys); ten blocks, partial


def decodes(g: int, d: int, dtype: torch.dtype, device: str, seed: int = 0, kv_dtype: torch.dtype | None = None) -> tuple:
    """q (B, H, D) and (NB, BS, HKV, D) caches (in ``kv_dtype``, default q's); each decode's
    blocks scattered over the cache, its table row padded with its first block (as build_metadata
    pads)."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(NB, generator=gen).tolist()
    nbs = [-(-n // BS) for n in LENS]
    rows, used = [], 0
    for nb in nbs:
        rows.append(order[used:used + nb] + [order[used]] * (max(nbs) - nb))
        used += nb
    q = torch.randn(len(LENS), g * HKV, d, generator=gen)
    kc, vc = (torch.randn(NB, BS, HKV, d, generator=gen) for _ in range(2))
    tables, lens = torch.tensor(rows), torch.tensor(LENS)
    kc, vc = (c.to(device, kv_dtype or dtype) for c in (kc, vc))
    return (q.to(device, dtype), kc, vc, tables.to(device), lens.to(device))


def reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
              scale: float) -> torch.Tensor:
    """fp32 softmax over each decode's keys, read slot by slot."""
    out = torch.empty(q.shape, dtype=torch.float32)
    g = q.shape[1] // kc.shape[2]
    for i, n in enumerate(lens.tolist()):
        slots = [(tables[i, p // BS].item(), p % BS) for p in range(n)]
        keys = torch.stack([kc[b, o] for b, o in slots]).float().repeat_interleave(g, dim=1)  # (L, H, D)
        vals = torch.stack([vc[b, o] for b, o in slots]).float().repeat_interleave(g, dim=1)
        s = torch.einsum("hd,lhd->hl", q[i].float(), keys) * scale
        out[i] = torch.einsum("hl,lhd->hd", s.softmax(-1), vals)
    return out


# splits: 1, the output written directly; 3, spans merged over a padded split axis, the one-key
# context's second and third spans empty; 8, most spans of the short contexts empty. Every head
# shape at every splits, each dtype with each (the interpreter takes ~3 s a case): fp32 queries
# take the fp32 products (dot -1 picks 0), bf16 ones over a bf16 cache tl.dot (dot -1 picks 1).
SHAPES, SPLITS, DTYPES = ((1, 128), (3, 64), (4, 64), (2, 16)), (1, 3, 8), ("float32", "bfloat16")
CASES = [(g, d, DTYPES[(i + j) % 2], splits, DTYPES[(i + j) % 2], -1)
         for i, (g, d) in enumerate(SHAPES) for j, splits in enumerate(SPLITS)]
# an fp8 cache (CacheConfig.kv_dtype) under bf16 and fp32 queries, whole and in spans; bf16 and
# fp16 queries through the fp32 products (dot 0) and fp16 through tl.dot
CASES += [(1, 128, "bfloat16", 1, "float8_e4m3fn", -1), (3, 64, "float32", 3, "float8_e4m3fn", -1),
          (1, 128, "bfloat16", 3, "bfloat16", 0), (3, 64, "float16", 1, "float8_e4m3fn", 0),
          (4, 64, "float16", 3, "float16", 1), (2, 16, "bfloat16", 1, "float8_e4m3fn", 1)]


def patch_interpreter() -> None:
    """Two of the interpreter's faults, which a GPU does not have. It holds a scalar as a (1,)
    array and makes it an index with int(array), which numpy >= 2.4 refuses, so a loop to a loaded
    bound fails: index through the array's one element instead. It holds bf16 as its uint16 bits
    and tl.dot multiplies those as integers: widen them to the fp32 they stand for first (exact)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter
    patch, dot = interpreter._patch_lang_tensor, interpreter.InterpreterBuilder.create_dot

    def patched(tensor: type, scope: object) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def widened(h: object) -> object:
        if h.dtype.scalar != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def bf16_dot(self: object, a: object, b: object, *args: object) -> object:
        return dot(self, widened(a), widened(b), *args)

    interpreter._patch_lang_tensor = patched
    interpreter.InterpreterBuilder.create_dot = bf16_dot


def interpret_cases() -> None:
    """Runs in a child process started with TRITON_INTERPRET=1 (triton reads it on import, and
    its own library functions are built then)."""
    patch_interpreter()
    for k, (g, d, name, splits, kv_name, dot) in enumerate(CASES):
        dtype = getattr(torch, name)
        q, kc, vc, tables, lens = decodes(g, d, dtype, "cpu", kv_dtype=getattr(torch, kv_name))
        # (3, 64) (every splits, both dtypes) and one fp8 case write into a layer's output, after a
        # prefill's rows; the rest allocate their own
        layer_out = torch.zeros(len(LENS) + 2, q.shape[1], d, dtype=dtype) if g == 3 else None
        out = triton_decode.paged_decode(q, kc, vc, tables, lens, d ** -0.5, splits=splits, dot=dot,
                                         out=None if layer_out is None else layer_out[2:])
        if layer_out is not None:
            assert out.data_ptr() == layer_out[2:].data_ptr() and not layer_out[:2].any(), CASES[k]
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding (and P's, by tl.dot)
        torch.testing.assert_close(out.float(), reference(q, kc, vc, tables, lens, d ** -0.5), rtol=tol, atol=tol,
                                   msg=lambda m, c=CASES[k]: f"{c}: {m}")
    print(f"{len(CASES)} cases match")


def test_paged_decode_interpreted() -> None:
    pytest.importorskip("triton")
    out = run_interpreted("from tests.stages.test_triton_decode import interpret_cases; interpret_cases()")
    assert f"{len(CASES)} cases match" in out


def test_usable_only_where_the_kernel_is_right() -> None:
    q, kc, vc, *_ = decodes(1, 64, torch.float32, "cpu")
    assert triton_decode.shapes_fit(q, kc, vc)
    assert not triton_decode.usable(q, kc, vc)  # a CPU tensor: the CPU kernels' job
    q96, kc96, vc96, *_ = decodes(1, 96, torch.float32, "cpu")
    assert not triton_decode.shapes_fit(q96, kc96, vc96)  # Triton's aranges take powers of two
    wide = torch.zeros(NB, BS, HKV, 128)
    assert not triton_decode.shapes_fit(q, kc, wide[..., :64])  # V read at K's offsets: must be laid out alike
    assert not triton_decode.shapes_fit(q, kc, vc.half())
    assert triton_decode.shapes_fit(q, kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn))  # widened as loaded
    assert not triton_decode.shapes_fit(q.to(torch.float8_e4m3fn), kc, vc)
    q6 = decodes(3, 64, torch.float32, "cpu")[0]  # 6 query heads over 2 KV heads
    assert triton_decode.shapes_fit(q6, kc, vc) and not triton_decode.shapes_fit(q6[:, :5], kc, vc)


def test_dot_products_by_default_over_a_cache_of_the_queries_16_bit_dtype() -> None:
    """tl.dot where the H200 measured it faster (bf16 queries and cache), the fp32 sums over an fp8
    cache (its widening for tl.dot cost more) and for fp32 queries, which tl.dot would round."""
    bf16, fp16, fp8, fp32 = torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float32
    q = torch.zeros(2, 4, 64)
    assert triton_decode.takes_dot(q.to(bf16), bf16) and triton_decode.takes_dot(q.to(fp16), fp16)
    assert triton_decode.takes_dot(q.to(bf16)) and not triton_decode.takes_dot(q.to(bf16), fp8)
    assert not triton_decode.takes_dot(q.to(fp16), bf16) and not triton_decode.takes_dot(q, fp32)
    _, kc, vc, tables, lens = decodes(2, 64, fp32, "cpu")
    with pytest.raises(ValueError, match="dot products take fp16 queries, or bf16 ones from sm_80, not torch.float32"):
        triton_decode.paged_decode(q, kc, vc, tables[:2], lens[:2], 0.125, dot=1)


def test_choose_splits_fills_the_sms_with_spans_of_whole_steps() -> None:
    cpu, sms = torch.device("cpu"), 132  # the interpreter's stand-in for an H100/H200
    assert triton_decode.choose_splits(64 * 32, 512, 32, cpu) == 1  # LLaMA-7B, 64 decodes: 2048 programs
    assert triton_decode.choose_splits(8 * sms, 1 << 20, 32, cpu) == 1
    assert triton_decode.choose_splits(16 * 32, 2048, 32, cpu) == 2  # 512 programs
    assert triton_decode.choose_splits(4 * 32, 4096, 32, cpu) == 8  # 128 programs: ~8 an SM
    assert triton_decode.choose_splits(4 * 32, 512, 32, cpu) == 1  # too few keys to pay the merge
    assert triton_decode.choose_splits(1 * 8, 32768, 32, cpu) == 64  # one decode, 8 KV heads, a long context
    assert triton_decode.choose_splits(1 * 8, 1024, 32, cpu) == 2  # spans of at least 16 steps
    assert triton_decode.choose_splits(1, 1 << 20, 16, cpu) == 64  # the merge's tile bounds it


def test_choose_warps_takes_one_over_fp8_with_many_programs_in_few_spans() -> None:
    """The H200's measured shapes (LLaMA-7B's heads, 32 keys a step: a 4K product): 1 warp over an
    fp8 cache at 64 x 512 and 16 x 2048 (2 spans), 2 at 4 x 4096 (8 spans) and 4 x 512 (128
    programs), 2 over a bf16 cache everywhere; 4 for a product past 4K."""
    cpu, fp8, bf16 = torch.device("cpu"), torch.float8_e4m3fn, torch.bfloat16
    for b, keys in ((64, 512), (16, 2048), (4, 4096), (4, 512)):
        splits = triton_decode.choose_splits(b * 32, keys, 32, cpu)
        want = 1 if (b, keys) in ((64, 512), (16, 2048)) else 2
        assert triton_decode.choose_warps(4096, fp8, b * 32 * splits, splits, cpu) == want, (b, keys)
        assert triton_decode.choose_warps(4096, bf16, b * 32 * splits, splits, cpu) == 2
    assert triton_decode.choose_warps(16384, fp8, 4096, 1, cpu) == 4


@pytest.mark.gpu(1)
@pytest.mark.parametrize("splits", (1, 3, 0), ids=("whole", "3-spans", "chosen"))
@pytest.mark.parametrize("dtype,dot", ((torch.float32, -1), (torch.bfloat16, -1), (torch.bfloat16, 0)),
                         ids=("fp32", "bf16-dot", "bf16-sums"))
@pytest.mark.parametrize("g,d", ((1, 128), (3, 64)))
def test_paged_decode_on_cuda(g: int, d: int, dtype: torch.dtype, dot: int, splits: int) -> None:
    q, kc, vc, tables, lens = decodes(g, d, dtype, "cuda")
    assert triton_decode.usable(q, kc, vc)
    out = triton_decode.paged_decode(q, kc, vc, tables, lens, d ** -0.5, splits=splits, dot=dot)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float().cpu(), reference(q.cpu(), kc.cpu(), vc.cpu(), tables.cpu(), lens.cpu(),
                                                            d ** -0.5), rtol=tol, atol=tol)


@pytest.mark.gpu(1)
@pytest.mark.parametrize("kv_dtype", (torch.float32, torch.float8_e4m3fn), ids=("auto", "fp8"))
def test_torch_backend_decodes_through_the_kernel_on_cuda(kv_dtype: torch.dtype) -> None:
    """The mixed batch of test_attention, on CUDA: the kernel's decodes and the Triton K/V write
    (into an fp8 cache: the same rounding) against the gather path and the eager write."""
    from tests.stages.test_attention import mixed_batch
    chunks, q, k, v, kc, vc = (x.cuda() if isinstance(x, torch.Tensor) else x for x in mixed_batch(3))
    kc, vc = kc.to(kv_dtype), vc.to(kv_dtype)
    meta = build_metadata(chunks, 4, torch.device("cuda"))
    backend = TorchAttention(q.shape[-1] ** -0.5)
    assert triton_decode.usable(q, kc, vc)  # else this compares the gather path with itself
    ours = backend.forward(q, k, v, kc.clone(), vc.clone(), meta)
    backend.paged_cuda = False
    from stages import triton_elementwise
    triton_elementwise.enabled = False  # the eager K/V write for the reference
    try:
        ref = backend.forward(q, k, v, kc.clone(), vc.clone(), build_metadata(chunks, 4, torch.device("cuda")))
    finally:
        triton_elementwise.enabled = True
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu(1)
@pytest.mark.parametrize("kv_dtype", (torch.bfloat16, torch.float8_e4m3fn), ids=("bf16", "fp8"))
@pytest.mark.parametrize("g", (1, 3))
def test_long_contexts_split_into_spans_on_cuda(g: int, kv_dtype: torch.dtype) -> None:
    """4 decodes of 4096 keys over 8 KV heads: 32 programs, so choose_splits cuts each decode's
    keys into spans (the merge runs); against a dense softmax over the gathered keys in fp32."""
    b, hkv, d, bs, ctx = 4, 8, 128, 16, (4096, 4000, 3333, 17)
    nb = -(-max(ctx) // bs)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, g * hkv, d, generator=gen).cuda().bfloat16()
    kc, vc = (torch.randn(b * nb, bs, hkv, d, generator=gen).cuda().to(kv_dtype) for _ in range(2))
    tables = torch.randperm(b * nb, generator=gen).view(b, nb).cuda()
    lens = torch.tensor(ctx).cuda()
    assert triton_decode.choose_splits(b * hkv, nb * bs, 32, q.device) >= 8
    out = triton_decode.paged_decode(q, kc, vc, tables, lens, d ** -0.5)
    kf, vf = kc.float(), vc.float()  # torch indexes no fp8 tensor
    for i, n in enumerate(ctx):
        keys = kf[tables[i]].flatten(0, 1)[:n].repeat_interleave(g, dim=1)  # (n, H, D)
        vals = vf[tables[i]].flatten(0, 1)[:n].repeat_interleave(g, dim=1)
        p = torch.einsum("hd,nhd->hn", q[i].float(), keys).mul(d ** -0.5).softmax(-1)
        torch.testing.assert_close(out[i].float(), torch.einsum("hn,nhd->hd", p, vals), rtol=1e-2, atol=1e-2)
