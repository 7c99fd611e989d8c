"""Paged decode attention on CUDA: one Triton kernel that reads each decode's K/V in place.

The torch path gathers every decode's blocks into a contiguous copy (``index_select``) and
then SDPA reads the copy: K/V cross memory three times. On an H200, LLaMA-7B in bf16 with 64
decodes at 512 context, that gather alone was 9.3 ms of a 35.7 ms decode-maximal step
(docs/BENCHMARKS.md). Here one program per (decode, KV head) walks the sequence's keys
``TOKENS`` at a time, each key's block looked up in its table row, and keeps an online softmax
for the G query heads that share the KV head, in fp32; K/V are read once. Over a bf16/fp16 cache
the two products run on tensor cores (``tl.dot``, the heads padded to 16 rows), which on the H200
moved the kernel from 2.5 to 3.1 TB/s of K/V: summing fp32 products across threads, not HBM, had
set its pace.

Checked against a dense reference and the gather path on a GPU (tests/stages/test_triton_decode.py,
marked gpu) and, with no GPU, in Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors),
where triton is installed.
"""
from __future__ import annotations

import functools

import torch

from stages import triton_elementwise

# triton.language, bound by _kernel() as it compiles: the kernel's body names it at module level (Triton's
# JIT reads this module's globals), and importing it here cost every worker's start ~0.2 s on CPUs
tl = None

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CACHE_DTYPES = DTYPES + (torch.float8_e4m3fn,)  # K/V widened to fp32 as they are loaded


@functools.cache
def triton_missing() -> str | None:
    """Why the kernel cannot be built here (None: it can)."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"triton does not import ({type(e).__name__})"
    return None


def usable(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether this kernel takes these decodes: CUDA tensors, triton importable, shapes it handles
    (``shapes_fit``) and a cache dtype Triton compiles for this GPU (fp8: sm_89 and later)."""
    return (q.is_cuda and shapes_fit(q, k_cache, v_cache) and triton_missing() is None
            and triton_elementwise.fp8_native(k_cache))


def shapes_fit(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """q (B, H, D) of a float dtype with contiguous head rows; K and V caches alike, (NB, BS, H_kv,
    D) contiguous (the kernel reads V at K's offsets), of a float dtype or fp8 e4m3; H a multiple
    of H_kv; D a power of two (Triton's aranges)."""
    d, h, h_kv = q.shape[-1], q.shape[-2], k_cache.shape[2]
    return (q.dtype in DTYPES and k_cache.dtype in CACHE_DTYPES and k_cache.shape == v_cache.shape
            and k_cache.dtype == v_cache.dtype and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[3] == d
            and d & (d - 1) == 0 and h % h_kv == 0 and q.stride(-1) == 1)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, scale: float, tokens: int = 0, num_warps: int = 0, num_stages: int = 3,
                 splits: int = 0, aligned: bool = True, dot: int = -1, out: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, H, D) one query per decode; caches (NB, BS, H_kv, D); tables (B, nb_max) block ids;
    lens (B,) context lengths (≥ 1), both on q's device -> (B, H, D) in q's dtype, written into
    ``out`` where given (any strides with contiguous head rows: a slice of the layer's output).
    ``splits`` > 1 cuts each decode's keys into that many spans, one program each, merged by a
    second kernel (flash-decoding); 0 picks it (``choose_splits``). ``tokens``, ``num_warps`` (0:
    ``choose_warps``), ``num_stages`` and ``aligned`` (tell
    Triton that K/V rows start 16-element aligned, so that it loads them in 16-byte vectors) are
    tuning knobs for benchmarks/cuda_paged_decode.py. ``dot`` 1: the scores and the weighted sum
    of V as tensor-core products (``tl.dot``) in q's 16-bit dtype, the G query heads padded to 16
    rows and the softmax weights rounded to that dtype before they weigh V, as flash attention
    does; 0: fp32 products summed across threads; -1: 1 for 16-bit queries over a cache of their
    dtype (``takes_dot``)."""
    b, h, d = q.shape
    bs, h_kv = k_cache.shape[1], k_cache.shape[2]
    g = h // h_kv
    g_pad = 1 << (g - 1).bit_length()
    dot = takes_dot(q, k_cache.dtype) if dot < 0 else bool(dot)
    if dot and not takes_dot(q):
        raise ValueError(f"paged_decode: dot products take fp16 queries, or bf16 ones from sm_80, not {q.dtype}")
    if dot:  # tl.dot's tiles are at least 16 x 16: padding rows are loaded as 0 and never stored
        g_pad = max(g_pad, 16)
        # 8 KB of bf16 K a step at D = 128, as the fp32 product's 32 keys; the tiles sit in the
        # tensor cores' fragments, not as a (G, TOKENS, D) product in registers
        tokens = tokens or max(16, 4096 // d)
    # keys per step: the (G_PAD, TOKENS, D) fp32 product kept at ~4K elements (32 registers a
    # thread of 4 warps; LLaMA-7B: 32 keys, 8 KB of K a step) down to 16 keys (G_PAD · D > 256:
    # 16 keys of 8 heads of 128 make 16K elements, which spill; H200-measured shapes did not)
    tokens = tokens or max(16, 4096 // (g_pad * d))
    # the table's width bounds every context without reading lens back from the device
    splits = splits or choose_splits(b * h_kv, tables.shape[1] * bs, tokens, q.device)
    num_warps = num_warps or (2 if dot else choose_warps(g_pad * d * tokens, k_cache.dtype, b * h_kv * splits, splits,
                                                          q.device))
    out = torch.empty_like(q) if out is None else out
    # each span's unnormalised output, running max and denominator, (B, H, S, D) then (B, H, S)
    # twice, in one allocation: a host-bound step pays each allocation and launch a layer
    part = torch.empty(b * h * splits * (d + 2), device=q.device, dtype=torch.float32) if splits > 1 else out
    _kernel(_paged_decode_kernel)[(b, h_kv, splits)](
        q, k_cache, v_cache, tables, lens, out, part, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        tables.stride(0), out.stride(0), out.stride(1),
        G=g, G_PAD=g_pad, D=d, BS=bs, TOKENS=tokens, S=splits, ALIGN=min(d, 16) if aligned else 1, DOT=dot,
        num_warps=num_warps, num_stages=num_stages)
    if splits > 1:
        _kernel(_merge_kernel)[(b, h)](part, out, out.stride(0), out.stride(1), H=h, D=d, S=splits,
                                       S_PAD=1 << (splits - 1).bit_length())
    return out


def takes_dot(q: torch.Tensor, cache_dtype: torch.dtype | None = None) -> bool:
    """Whether the kernel's products can run on tensor cores (16-bit queries, bf16 ones from sm_80,
    whose tensor cores first take bf16: an fp32 model keeps fp32 products) and, given the cache's
    dtype, whether they do by default: over a cache of q's dtype. On the H200 with LLaMA-7B's heads,
    64 decodes x 512 keys, a bf16 cache 0.218 -> 0.173 ms (the 512 + 64 step 6.2 -> 4.8 ms of decode
    kernel); an fp8 cache 0.156 -> 0.257 ms, its widening to bf16 for tl.dot costing more than the
    fp32 sums (docs/BENCHMARKS.md). CPU tensors reach the kernel only in Triton's interpreter."""
    tensor_cores = q.dtype == torch.float16 or (q.dtype == torch.bfloat16 and (not q.is_cuda or _sm80(q.device.index)))
    return tensor_cores and cache_dtype in (None, q.dtype)


@functools.cache
def _sm80(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 0)


def choose_splits(programs: int, max_keys: int, tokens: int, device: torch.device) -> int:
    """Spans per decode: enough for ~8 (decode, KV head, span) programs an SM, each span at
    least 16 steps of keys (shorter contexts read too little K/V to pay the merge's launch,
    allocation and pass over the partials), a power of two; none where the programs already
    reach that. On an H200 with LLaMA-7B's heads (2 warps): 64 decodes x 512 keys (2048
    programs) 0.221 ms whole, 0.227 in 2 spans; 16 x 2048 (512) 0.289 -> 0.227 in 2; 4 x 4096
    (128) 0.434 -> 0.128 in 8; SmolLM2's 64 x 512 over 3 KV heads (192) 0.134 -> 0.089 in 2."""
    # at most 64: the merge holds a (decode, head)'s spans as one (S, D) tile in registers
    splits = min(-(-8 * _sm_count(device) // programs), max_keys // (16 * tokens), 64)
    return 1 << max(splits, 1).bit_length() - 1


def choose_warps(product: int, cache_dtype: torch.dtype, programs: int, splits: int, device: torch.device) -> int:
    """Warps a program: 2 where a step's fp32 product is up to 4K elements (on an H200 with
    LLaMA-7B's heads, 32 keys a step: 1.28x faster than 4 at 64 decodes x 512 keys, as fast or
    faster at 16 x 2048 and 4 x 4096); 1 over an fp8 cache with many programs in few spans (64 x
    512: 0.201 -> 0.173 ms, 0.204 -> 0.156 in another call, 16 x 2048 in 2 spans: 0.214 -> 0.190;
    in the 2048 + 64 step 6.0 -> 4.3 ms; but 4 x 4096 in 8 spans 0.128 -> 0.148 and 4 x 512, 128
    programs, 0.093 -> 0.106; kernel-alone runs of one variant varied ~15%, so the exclusions are
    cautious); a larger product (8 heads of 128 share a KV head) keeps 4, unmeasured with fewer
    threads to hold it (docs/BENCHMARKS.md)."""
    if product > 4096:
        return 4
    return 1 if cache_dtype == torch.float8_e4m3fn and splits <= 2 and programs >= 4 * _sm_count(device) else 2


@functools.cache
def _sm_count(device: torch.device) -> int:
    # CPU tensors only reach here in Triton's interpreter (the tests): an H100/H200's 132
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


@functools.cache
def _kernel(fn: object) -> object:
    """Compiled on first use: ``triton.jit`` reads TRITON_INTERPRET here (the tests set it first)."""
    global tl
    import triton
    import triton.language as tl
    return triton.jit(fn)


def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, part_ptr, scale,
                         stride_qb, stride_qh, stride_kblk, stride_kslot, stride_kh, stride_tb,
                         stride_ob, stride_oh,
                         G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                         TOKENS: tl.constexpr, S: tl.constexpr, ALIGN: tl.constexpr, DOT: tl.constexpr):
    """One (decode, KV head, span): the G heads' online softmax over the span's keys, TOKENS at a
    time; the output itself where S = 1, else the span's partials for _merge_kernel. DOT: both
    products by tl.dot in q's dtype (K/V converted to it as loaded), else in fp32 by tl.sum."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    t = tl.arange(0, TOKENS)
    heads = kvh * G + g
    has_head = g < G
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=has_head[:, None], other=0.0)  # (G_PAD, D)
    if not DOT:
        q = q.to(tl.float32) * scale
    ctx = tl.load(lens_ptr + seq)
    span = tl.cdiv(tl.cdiv(ctx, S), TOKENS) * TOKENS  # whole steps: only a decode's last span is ragged
    lo = split * span
    hi = tl.minimum(lo + span, ctx)  # lo >= hi: an empty span (a short context), m stays -inf
    m = tl.full((G_PAD,), float("-inf"), tl.float32)  # running max of each head's scores
    den = tl.zeros((G_PAD,), tl.float32)  # running softmax denominator
    acc = tl.zeros((G_PAD, D), tl.float32)
    for start in range(lo, hi, TOKENS):
        pos = start + t
        real = pos < hi
        blk = tl.load(table_ptr + seq * stride_tb + pos // BS, mask=real, other=0)
        row = blk.to(tl.int64) * stride_kblk + (pos % BS) * stride_kslot + kvh * stride_kh  # (TOKENS,)
        row = tl.multiple_of(row, ALIGN)  # every stride is a multiple of D: rows start aligned
        k = tl.load(k_ptr + row[:, None] + d[None, :], mask=real[:, None], other=0.0)  # (TOKENS, D)
        if DOT:  # fp8 widens to q's dtype exactly; products summed in fp32
            s = tl.dot(q, tl.trans(k.to(q_ptr.dtype.element_ty))) * scale  # (G_PAD, TOKENS)
        else:
            s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        s = tl.where(real[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)  # 0 on the first step (m = -inf); a step holds >= 1 key: m_new finite
        p = tl.exp(s - m_new[:, None])
        den = den * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + row[:, None] + d[None, :], mask=real[:, None], other=0.0)
        if DOT:
            pv = tl.dot(p.to(q_ptr.dtype.element_ty), v.to(q_ptr.dtype.element_ty))  # (G_PAD, D) fp32
        else:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m = m_new
    if S == 1:
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 (acc / den[:, None]).to(out_ptr.dtype.element_ty), mask=has_head[:, None])
    else:  # partials of (seq, head, split): acc in (B, H, S, D), then max and den in (B, H, S) each
        cells = tl.num_programs(0) * tl.num_programs(1) * G * S
        cell = (seq * (tl.num_programs(1) * G) + heads) * S + split  # (G_PAD,)
        tl.store(part_ptr + cell[:, None] * D + d[None, :], acc, mask=has_head[:, None])
        tl.store(part_ptr + cells * D + cell, m, mask=has_head)
        tl.store(part_ptr + cells * (D + 1) + cell, den, mask=has_head)


def _merge_kernel(part_ptr, out_ptr, stride_ob, stride_oh,
                  H: tl.constexpr, D: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr):
    """One (decode, head): its spans' partials rescaled to their common max and summed."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D)
    cells = tl.num_programs(0) * H * S
    cell = (seq * H + head) * S + s  # (S_PAD,)
    m = tl.load(part_ptr + cells * D + cell, mask=s < S, other=float("-inf"))
    top = tl.max(m, axis=0)  # finite: the first span starts at key 0 and every context holds one
    w = tl.exp(m - top)  # 0 for an empty span or padding
    den = tl.sum(w * tl.load(part_ptr + cells * (D + 1) + cell, mask=s < S, other=0.0), axis=0)
    acc = tl.load(part_ptr + cell[:, None] * D + d[None, :], mask=(s < S)[:, None], other=0.0)  # (S_PAD, D)
    o = tl.sum(w[:, None] * acc, axis=0) / den  # (D,)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, o.to(out_ptr.dtype.element_ty))
