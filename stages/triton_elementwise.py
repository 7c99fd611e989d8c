"""A decoder layer's elementwise ops on CUDA as one Triton kernel each.

Eager PyTorch runs RMSNorm in a reduced dtype as eight kernels (to fp32, pow, mean, add, rsqrt,
mul, back to the dtype, times the weight), the residual add before it as one more, rotate-half
RoPE as four, SiLU·mul as two and the K/V write as two (six into an fp16 cache). On an H200
with LLaMA-7B in bf16 a 512-token decode-maximal step was bound by the host issuing them (~40
kernels a layer, the host busy for 0.74-1.00 of the step; docs/BENCHMARKS.md, "The first GPU
run"). Here each is one launch and one pass:

* ``rms_norm(x, w, eps)``             (T, H) -> (T, H)
* ``add_rms_norm_(h, x, w, eps)``     h += x in place (rounded to h's dtype), returns rms_norm(h)
* ``rope_(x, positions, cos, sin)``   x (T, heads, D), rows of any stride, rotated in place
* ``silu_mul(gu)``                    (T, 2I) = [gate | up] -> silu(gate) · up (T, I)
* ``write_kv_(k, v, kc, vc, slots)``  a step's K and V rows into the paged caches (two
                                      ``index_copy_`` in torch, more where the cache is narrower);
                                      ``keep=n`` also returns the first n rows as the cache holds
                                      them (a fresh prefill's keys, eight eager kernels a layer)

Each rounds where the eager ops round (fp32 math inside, the dtype at the same points as the
reference implementations: ``x.float()`` normalised and cast back before the weight, SiLU cast
before the product, ``round(x1·cos)`` before the ``− x2·sin``), so bf16 outputs match eager ones
to the dtype's last bit in all but rare ties of the fp32 sums' order. ``takes(x)`` decides: a
CUDA tensor of a float dtype, triton importable, and this process's ``unusable(dtype)`` probe
passed (one small call of every kernel against the eager ops, once per dtype, at a worker's load:
a Triton that cannot compile or run these kernels costs a logged fallback, not a failed
request; the model's own sizes compile on its first step, as the decode kernel's do. Each
kernel was also compiled for sm_90 with Triton 3.6 at LLaMA shapes, without a GPU).

Checked in Triton's interpreter on CPU tensors (tests/stages/test_triton_elementwise.py, where
triton is installed: scripts/setup.sh installs it) and on a GPU (marked gpu).

    if triton_elementwise.takes(x):
        y = triton_elementwise.rms_norm(x, weight, eps)
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from stages.attention.triton_decode import triton_missing

# triton.language, bound by _kernels() as it compiles: the kernels' bodies name it at module level (Triton's
# JIT reads this module's globals), and importing it here cost every worker's start ~0.2 s on CPUs
tl = None

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CACHE_DTYPES = DTYPES + (torch.float8_e4m3fn,)  # the K/V write also narrows to fp8 (CacheConfig.kv_dtype)
log = logging.getLogger(__name__)
# off only for a before/after measurement (benchmarks/decode_maximal.py --cuda-elementwise)
enabled = True


def takes(x: torch.Tensor) -> bool:
    """Whether the fused kernels run for activations like x (see the module doc)."""
    return enabled and x.is_cuda and x.dtype in DTYPES and unusable(x.dtype, x.device.index) is None


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x (T, H), rows of any stride, each contiguous -> x · rsqrt(mean(x²) + eps) · w, in x's dtype."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _norm(x, x, w, eps, out, residual=False)
    return out


def add_rms_norm_(h: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """h += x (h's dtype, as ``h + x``), then rms_norm(h): the residual add and the next norm."""
    out = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    _norm(h, x, w, eps, out, residual=True)
    return out


def _norm(h: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor, residual: bool) -> None:
    t, n = h.shape
    if t == 0:
        return
    block = _pow2(n)
    _kernels()["norm"][(t,)](h, x, w, out, h.stride(0), x.stride(0), n, eps, RESIDUAL=residual, BLOCK=block,
                             num_warps=min(16, max(1, block // 256)))


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, D), D a power of two, each (heads, D) row contiguous, rotated in place in the
    rotate-half layout: x1, x2 = the halves of each head; x1 <- x1·cos − x2·sin, x2 <- x2·cos + x1·sin,
    cos/sin (P, D/2) fp32 rows at ``positions`` (T,), rounded to x's dtype first (as HF)."""
    t, heads, d = x.shape
    if t:
        # a warp per 512 elements of the (heads, D/2) tile (LLaMA-7B's 64 × 64: 8): with 4 warps it
        # took 193 registers a thread (compiled for sm_90), and spilled at 128 × 64
        _kernels()["rope"][(t,)](x, positions, cos, sin, x.stride(0), heads, HEADS=_pow2(heads), HALF=d // 2,
                                 num_warps=min(16, max(4, _pow2(heads) * d // 2 // 512)))
    return x


def heads_contiguous(x: torch.Tensor) -> bool:
    """Whether each (heads, D) row of x (T, heads, D) is contiguous, rows of any stride (a view of
    the fused QKV output is): the layout rope_, write_kv_ and the CPU kernels' write_kv_ take."""
    return x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]


def rope_fits(x: torch.Tensor) -> bool:
    """rope_'s layout: contiguous heads of a power-of-two size, rows of any stride."""
    d = x.shape[-1]
    return heads_contiguous(x) and d >= 2 and d & (d - 1) == 0


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu (T, 2I) with contiguous rows = [gate | up] -> silu(gate) · up (T, I) in gu's dtype."""
    t, n = gu.shape[0], gu.shape[1] // 2
    out = torch.empty((t, n), dtype=gu.dtype, device=gu.device)
    if t:
        block = min(1024, _pow2(n))
        _kernels()["silu_mul"][(t, -(-n // block))](gu, out, gu.stride(0), n, BLOCK=block, num_warps=4)
    return out


def fp8_native(cache: torch.Tensor) -> bool:
    """Whether Triton can load and store ``cache``'s dtype on its device: any but fp8 e4m3, which
    it compiles for sm_89 and later only (an A100 takes the eager write and gather, whose torch
    casts run anywhere); CPU tensors reach the kernels only in Triton's interpreter (the tests)."""
    return cache.dtype != torch.float8_e4m3fn or not cache.is_cuda or _sm89(cache.device.index)


@functools.cache
def _sm89(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def kv_fits(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """write_kv_'s layout: k, v (T, H_kv, D) with each (H_kv, D) row contiguous; caches
    (NB, BS, H_kv, D) contiguous, alike, of a float dtype or fp8 e4m3 (``fp8_native``)."""
    return (k_cache.dtype in CACHE_DTYPES and fp8_native(k_cache) and k_cache.dtype == v_cache.dtype
            and k_cache.shape == v_cache.shape and k_cache.is_contiguous() and v_cache.is_contiguous()
            and heads_contiguous(k) and heads_contiguous(v))


def write_kv_(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slots: torch.Tensor, keep: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Row t of k and v into slot ``slots[t]`` (flat: block · BS + offset) of the caches, in the
    cache's dtype; into fp16 or fp8 clamped to its finite range first (±65504, ±448), as the eager
    write (an inf key would make every score of its row NaN; e4m3 has no inf, and torch's cast
    makes an out-of-range value NaN). ``keep`` > 0: also the first ``keep`` rows of K and V as the
    cache now holds them, (keep, H_kv, D) each in k's dtype (``_narrow(x, cache dtype).to(k.dtype)``),
    from the same pass: an fp8 cache's fresh prefill attends to them. On an H200 the eager round
    trip (to fp32, clamp, to fp8, back) took 5.3 ms of a 2048-token LLaMA-7B step (BENCHMARKS.md)."""
    t, row = k.shape[0], k.shape[1] * k.shape[2]
    assert 0 <= keep <= t, (keep, t)  # rows past t would come back unwritten
    kept = tuple(torch.empty((keep, *k.shape[1:]), dtype=k.dtype, device=k.device) for _ in range(2)) if keep else None
    if t == 0:
        return kept
    narrower = k_cache.dtype == torch.float8_e4m3fn or (k_cache.dtype == torch.float16 and k.dtype != torch.float16)
    top = torch.finfo(k_cache.dtype).max if narrower else 0.0
    rk, rv = kept or (k, v)  # unused where KEEP is off: any pointer of k's type
    _kernels()["write_kv"][(t, 2)](k, v, k_cache, v_cache, slots, rk, rv, k.stride(0), v.stride(0), row, keep,
                                   TOP=top, KEEP=bool(keep), BLOCK=_pow2(row), num_warps=4)
    return kept


# ---- the eager ops each kernel replaces: the probe's reference, and the tests' --------------
def eager_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def eager_rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    c, s = cos[positions].unsqueeze(1).to(x.dtype), sin[positions].unsqueeze(1).to(x.dtype)  # (T, 1, D/2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((torch.mul(x1, c).addcmul_(x2, s, value=-1), torch.mul(x2, c).addcmul_(x1, s)), dim=-1)


def eager_silu_mul(gu: torch.Tensor) -> torch.Tensor:
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


@functools.cache
def unusable(dtype: torch.dtype, device: int | None) -> str | None:
    """Why the kernels cannot take ``dtype`` activations on CUDA device ``device`` (None: they can):
    triton missing, or one small call of each failing or disagreeing with the eager ops."""
    missing = triton_missing()
    if missing:
        return missing
    try:
        reason = _probe(dtype, torch.device("cuda", device))
    except Exception as e:  # a compile or launch error: the eager ops it is
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if reason:
        log.warning("fused elementwise kernels off for %s: %s; running eager ops", dtype, reason)
    return reason


def _probe(dtype: torch.dtype, device: torch.device) -> str | None:
    gen = torch.Generator().manual_seed(0)
    x, r, w = (torch.randn(shape, generator=gen).to(device, dtype) for shape in ((5, 96), (5, 96), (96,)))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    h = x.clone()
    got = {"rms_norm": rms_norm(x, w, 1e-5), "add_rms_norm_": (add_rms_norm_(h, r, w, 1e-5), h)}
    want = {"rms_norm": eager_rms_norm(x, w, 1e-5), "add_rms_norm_": (eager_rms_norm(x + r, w, 1e-5), x + r)}
    qk = torch.randn(5, 3, 16, generator=gen).to(device, dtype)
    pos = torch.tensor([0, 3, 7, 1, 2], device=device)
    table = torch.randn(8, 8, generator=gen).to(device)
    got["rope_"], want["rope_"] = rope_(qk.clone(), pos, table, table.flip(0)), eager_rope(qk, pos, table, table.flip(0))
    got["silu_mul"], want["silu_mul"] = silu_mul(x), eager_silu_mul(x)
    kc, vc = (torch.zeros(3, 2, 2, 16, dtype=dtype, device=device) for _ in range(2))  # (NB, BS, H_kv, D)
    slots = torch.tensor([5, 0, 2, 3, 1], device=device)
    got["write_kv_ keep"] = write_kv_(qk[:, :2], qk[:, 1:], kc, vc, slots, keep=3)
    got["write_kv_"] = (kc.view(6, 2, 16)[slots], vc.view(6, 2, 16)[slots])
    want["write_kv_"] = (qk[:, :2], qk[:, 1:])
    want["write_kv_ keep"] = (qk[:3, :2], qk[:3, 1:])
    for name in got:
        try:
            torch.testing.assert_close(got[name], want[name], **tol)
        except AssertionError as e:
            return f"{name} disagrees with the eager ops ({str(e).splitlines()[0]})"
    return None


@functools.cache
def _kernels() -> dict[str, object]:
    """Compiled on first use: ``triton.jit`` reads TRITON_INTERPRET here (the tests set it first)."""
    global tl
    import triton
    import triton.language as tl
    return {"norm": triton.jit(_norm_kernel), "rope": triton.jit(_rope_kernel),
            "silu_mul": triton.jit(_silu_mul_kernel), "write_kv": triton.jit(_write_kv_kernel, do_not_specialize=["keep"])}


def _norm_kernel(h_ptr, x_ptr, w_ptr, out_ptr, stride_h, stride_x, n, eps,
                 RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """One row: (h [+= x]) normalised in fp32, cast to the dtype, times the weight."""
    row = tl.program_id(0).to(tl.int64)  # row · stride past 2³¹ on long batches
    i = tl.arange(0, BLOCK)
    real = i < n
    h = tl.load(h_ptr + row * stride_h + i, mask=real, other=0.0)
    if RESIDUAL:  # h + x rounded to the dtype, as the eager add: that is the h the norm sees
        h = (h.to(tl.float32) + tl.load(x_ptr + row * stride_x + i, mask=real, other=0.0).to(tl.float32))
        h = h.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * stride_h + i, h, mask=real)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / n + eps)
    y = (hf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)  # cast back before the weight (HF's order)
    w = tl.load(w_ptr + i, mask=real, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + i, (w * y).to(out_ptr.dtype.element_ty), mask=real)  # out: contiguous


def _rope_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, stride_t, heads,
                 HEADS: tl.constexpr, HALF: tl.constexpr):
    """One token: every head of its row, both halves, rotated in place."""
    t = tl.program_id(0).to(tl.int64)
    hh = tl.arange(0, HEADS)[:, None]
    j = tl.arange(0, HALF)[None, :]
    real = hh < heads
    pos = tl.load(pos_ptr + t)
    dtype = x_ptr.dtype.element_ty
    c = tl.load(cos_ptr + pos * HALF + j).to(dtype).to(tl.float32)  # (1, HALF), in x's dtype as HF
    s = tl.load(sin_ptr + pos * HALF + j).to(dtype).to(tl.float32)
    p1 = x_ptr + t * stride_t + hh * (2 * HALF) + j
    x1 = tl.load(p1, mask=real, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=real, other=0.0).to(tl.float32)
    o1 = (x1 * c).to(dtype).to(tl.float32) - x2 * s  # round(x1·cos) − x2·sin, as mul then addcmul_
    o2 = (x2 * c).to(dtype).to(tl.float32) + x1 * s
    tl.store(p1, o1.to(dtype), mask=real)
    tl.store(p1 + HALF, o2.to(dtype), mask=real)


def _silu_mul_kernel(gu_ptr, out_ptr, stride_g, n, BLOCK: tl.constexpr):
    """BLOCK columns of one row: silu(gate) cast to the dtype, times up."""
    row = tl.program_id(0).to(tl.int64)  # row · 2I passes 2³¹ from ~37K rows at 70B's I
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    real = i < n
    g = tl.load(gu_ptr + row * stride_g + i, mask=real, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_g + n + i, mask=real, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    a = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * n + i, (a * u).to(dtype), mask=real)


def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, rk_ptr, rv_ptr, stride_k, stride_v, row, keep,
                     TOP: tl.constexpr, KEEP: tl.constexpr, BLOCK: tl.constexpr):
    """One token's K row (program (t, 0)) or V row (t, 1), cast to the cache's dtype, to its slot;
    with KEEP, rows t < keep also to rk/rv (contiguous) as the cache holds them, in k's dtype."""
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    real = i < row
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if tl.program_id(1) == 0:
        x = tl.load(k_ptr + t * stride_k + i, mask=real, other=0.0).to(tl.float32)  # exact from any of DTYPES
        dst = kc_ptr + slot * row + i
        kept = rk_ptr + t * row + i
    else:
        x = tl.load(v_ptr + t * stride_v + i, mask=real, other=0.0).to(tl.float32)
        dst = vc_ptr + slot * row + i
        kept = rv_ptr + t * row + i
    if TOP > 0:  # a wider dtype into fp16, or any into fp8: clamped to its finite range
        # NaN kept, as torch's clamp: PTX max/min would return the other operand
        x = tl.minimum(tl.maximum(x, -TOP, propagate_nan=tl.PropagateNan.ALL), TOP, propagate_nan=tl.PropagateNan.ALL)
    c = x.to(kc_ptr.dtype.element_ty)
    tl.store(dst, c, mask=real)
    if KEEP:  # the cache's value in k's dtype, rounded as torch's .to() rounds it (fp8 -> bf16: exact)
        tl.store(kept, c.to(tl.float32).to(rk_ptr.dtype.element_ty), mask=real & (t < keep))
