"""Attention backends: the torch backend against a dense reference, and the xformers
backend's packing and mask (built from the same metadata) checked on CPU by running its
exact inputs through a dense softmax attention — only the CUDA kernel call is left out."""
from __future__ import annotations

import pytest
import torch

from pp_runtime.batch import SeqChunk
from stages import cpu_kernels
from stages.attention import TorchAttention, XFormersAttention, build_metadata, make_backend

BS, H, HKV, D = 4, 4, 2, 8


def causal_offset_mask(q_len: int, ctx_len: int, device: torch.device) -> torch.Tensor:
    """(q, ctx) bool: query i (at position ctx − q + i) sees keys 0..ctx − q + i (the reference's
    mask, built by hand where the backend passes SDPA torch's bottom-right causal bias)."""
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device).unsqueeze(1)
    return torch.arange(ctx_len, device=device).unsqueeze(0) <= q_pos


def mixed_batch(seed: int = 0, d: int = D) -> tuple:
    """Two prefill chunks (one fresh, one continuing) and three decodes with assorted contexts."""
    g = torch.Generator().manual_seed(seed)
    specs = [(0, 0, 6, True), (1, 5, 4, True), (2, 9, 1, False), (3, 2, 1, False), (4, 13, 1, False)]
    chunks, tables, next_block = [], {}, 0
    for seq, start, n, pre in specs:
        nb = -(-(start + n) // BS)
        tables[seq] = tuple(range(next_block, next_block + nb))
        next_block += nb
        chunks.append(SeqChunk(seq, start, tuple(range(n)), tables[seq], pre, None))
    k_cache = torch.randn(next_block, BS, HKV, d, generator=g)
    v_cache = torch.randn(next_block, BS, HKV, d, generator=g)
    t = sum(c.num_tokens for c in chunks)
    q, k, v = torch.randn(t, H, d, generator=g), torch.randn(t, HKV, d, generator=g), torch.randn(t, HKV, d, generator=g)
    return tuple(chunks), q, k, v, k_cache, v_cache


def dense_reference(chunks: tuple, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """Per token: softmax over its sequence's keys at positions ≤ its own (after the K/V write)."""
    out, row = torch.empty_like(q), 0
    for c in chunks:
        flat = [(b, o) for b in c.block_table for o in range(BS)][:c.context_len]
        keys = torch.stack([k_cache[b, o] for b, o in flat]).repeat_interleave(H // HKV, dim=1)  # (L, H, D)
        vals = torch.stack([v_cache[b, o] for b, o in flat]).repeat_interleave(H // HKV, dim=1)
        for i in range(c.num_tokens):
            pos = c.start + i
            s = torch.einsum("hd,lhd->hl", q[row], keys[:pos + 1]) * q.shape[-1] ** -0.5
            out[row] = torch.einsum("hl,lhd->hd", s.softmax(-1), vals[:pos + 1])
            row += 1
    return out


@pytest.mark.parametrize("d", [D, 16])
@pytest.mark.parametrize("paged_kernel", [True, False])
def test_torch_backend_matches_dense(isa: str, paged_kernel: bool, d: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every path: the CPU paged kernels (K/V read in place; the prefill one tiles head sizes
    that are a multiple of 16, so D = 8 takes SDPA for the chunks) and gather + SDPA."""
    if paged_kernel and not cpu_kernels.available():
        pytest.skip("CPU paged-attention kernel could not be built here")
    if not paged_kernel and isa != "native":
        pytest.skip("gather + SDPA does not run the kernels: once is enough")
    monkeypatch.setattr(TorchAttention, "_use_paged_kernel", staticmethod(lambda q: paged_kernel))
    chunks, q, k, v, kc, vc = mixed_batch(d=d)
    meta = build_metadata(chunks, BS, torch.device("cpu"))
    out = TorchAttention(d ** -0.5).forward(q, k, v, kc, vc, meta)
    torch.testing.assert_close(out, dense_reference(chunks, q, kc, vc), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("costs,parts,edges", [
    ([10] * 8, 2, [0, 4, 8]),                      # equal costs: equal counts
    ([100, 1, 1, 1, 1, 1], 2, [0, 1, 6]),          # one long context against many short ones
    ([1, 1, 1, 1, 1, 100], 2, [0, 5, 6]),
    ([1, 2, 3, 4, 5, 6, 7, 8], 2, [0, 5, 8]),      # sorted by length: 15 | 21, not 10 | 26
    ([1000, 1, 1, 1], 4, [0, 0, 1, 1, 4]),         # more threads than the cut needs: empty runs
    ([5], 3, [0, 0, 1, 1]), ([], 2, [0, 0, 0]), ([7, 7], 1, [0, 2])])
def test_decode_attention_cuts_its_tasks_by_cost(costs: list[int], parts: int, edges: list[int]) -> None:
    """paged_decode's threads take runs of consecutive tasks of about equal cost (its keys), not of
    equal counts: a step's contexts differ by up to ~8x, and come sorted under longest_first."""
    if not cpu_kernels.available():
        pytest.skip("CPU paged-attention kernel could not be built here")
    assert cpu_kernels.cost_runs(costs, parts) == edges
    with pytest.raises(RuntimeError, match="parts must be >= 1"):
        cpu_kernels.cost_runs(costs, 0)


@pytest.mark.parametrize("lens", [[140, 1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 120], [1, 2, 140], [140, 1]])
def test_paged_kernel_computes_each_sequence_once_whatever_the_cut(lens: list[int]) -> None:
    """With uneven runs (one long context among short ones), every sequence is still computed, once,
    by one task: 2 threads give 1 thread's bits (a sequence a cut dropped would leave its rows
    unwritten)."""
    if not cpu_kernels.available():
        pytest.skip("CPU paged-attention kernel could not be built here")
    g = torch.Generator().manual_seed(len(lens))
    b, bs, nb = len(lens), 16, 9
    kc, vc = torch.randn(200, bs, 3, 64, generator=g), torch.randn(200, bs, 3, 64, generator=g)
    tables = torch.randperm(200, generator=g)[:b * nb].view(b, nb).contiguous()
    q = torch.randn(b, 9, 64, generator=g)
    outs = []
    old = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            outs.append(cpu_kernels.paged_decode(q, kc, vc, tables, torch.tensor(lens), 0.125))
        finally:
            torch.set_num_threads(old)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("b", [13, 1])
@pytest.mark.parametrize("hkv,grp,d", [(3, 3, 64), (2, 5, 64), (2, 4, 128), (2, 3, 32), (4, 1, 64), (2, 2, 128),
                                       (1, 8, 64), (2, 3, 128), (1, 8, 128), (2, 1, 128), (2, 2, 64), (1, 4, 64)])
def test_paged_kernel_matches_gather_sdpa_at_scale(isa: str, threads: int, b: int, hkv: int, grp: int, d: int) -> None:
    """Real head shapes (SmolLM2: 9 query / 3 KV heads, D = 64), scattered blocks, ragged lengths;
    and shapes that take the kernel's other paths: the register-tiled one for each group size it
    is built for (1, 2, 3, 4, 8: 4 / 2 / 1 rows at once; at 16 lanes one or several output slices
    per head, e.g. 3 x 128 and 8 x 128), a task per sequence (b = 13) or per KV
    head (b = 1 on 2 threads); the plain loops for head / group sizes not fixed at compile time
    (64 and 5, 32 and 3)."""
    if not cpu_kernels.available():
        pytest.skip("CPU paged-attention kernel could not be built here")
    g = torch.Generator().manual_seed(threads)
    bs, nb = 16, 9
    kc, vc = torch.randn(200, bs, hkv, d, generator=g), torch.randn(200, bs, hkv, d, generator=g)
    tables = torch.randperm(200, generator=g)[:b * nb].view(b, nb).contiguous()
    lens = torch.randint(1, nb * bs + 1, (b,), generator=g)
    q = torch.randn(b, hkv * grp, d, generator=g)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_kernels.paged_decode(q, kc, vc, tables, lens, d ** -0.5)
    finally:
        torch.set_num_threads(old)
    kd = kc[tables.reshape(-1)].view(b, -1, hkv, d).transpose(1, 2)
    vd = vc[tables.reshape(-1)].view(b, -1, hkv, d).transpose(1, 2)
    mask = (torch.arange(nb * bs)[None, :] < lens[:, None])[:, None, None, :]
    ref = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, ref.squeeze(2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("hkv,grp,d", [(3, 3, 64), (2, 4, 128), (1, 5, 48), (4, 1, 16)])
@pytest.mark.parametrize("n,ctx", [(256, 256), (100, 300), (37, 600), (1, 1), (1, 77), (17, 17)])
def test_paged_prefill_matches_gather_sdpa(isa: str, threads: int, hkv: int, grp: int, d: int, n: int, ctx: int) -> None:
    """The causal prefill kernel: a chunk that is the last n of ctx positions, scattered
    blocks, q a strided slice of a fused QKV row and out a slice of a bigger buffer; contexts
    past 256 keys take several online-softmax steps, and large scores test its rescaling."""
    if not cpu_kernels.available():
        pytest.skip("CPU paged-attention kernel could not be built here")
    g = torch.Generator().manual_seed(n * 7 + ctx)
    bs, h = 16, hkv * grp
    nb = -(-ctx // bs)
    kc, vc = torch.randn(nb + 9, bs, hkv, d, generator=g) * 3, torch.randn(nb + 9, bs, hkv, d, generator=g)
    table = torch.randperm(nb + 9, generator=g)[:nb]
    qkv = torch.randn(n, (h + 2 * hkv) * d, generator=g) * 3
    q = qkv[:, :h * d].view(n, h, d)
    buf = torch.full((n + 2, h, d), float("nan"))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_kernels.paged_prefill(q, kc, vc, table, ctx, d ** -0.5, buf[1:n + 1])
    finally:
        torch.set_num_threads(old)
    keys = kc[table].view(-1, hkv, d)[:ctx].transpose(0, 1)  # (H_kv, ctx, D)
    vals = vc[table].view(-1, hkv, d)[:ctx].transpose(0, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), keys, vals, attn_mask=causal_offset_mask(n, ctx, q.device), enable_gqa=True)
    torch.testing.assert_close(buf[1:n + 1], ref.transpose(0, 1), rtol=1e-4, atol=1e-4)  # logits of sd ~9
    assert buf[0].isnan().all() and buf[n + 1].isnan().all()  # nothing written outside out


def bf16_reference(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, n: int, ctx: int, scale: float) -> torch.Tensor:
    """Causal attention with q, K, the softmax weights and V rounded to bf16 and everything else in
    fp32: q (n, H, D), keys / vals (H_kv, ctx, D) -> (n, H, D)."""
    g = q.shape[1] // keys.shape[0]
    kb, vb = (t.bfloat16().float().repeat_interleave(g, 0) for t in (keys, vals))  # (H, ctx, D)
    s = q.bfloat16().float().transpose(0, 1) @ kb.transpose(1, 2) * scale  # (H, n, ctx)
    s = s.masked_fill(~causal_offset_mask(n, ctx, q.device), float("-inf"))
    p = (s - s.amax(-1, keepdim=True)).exp()
    return ((p.bfloat16().float() @ vb) / p.sum(-1, keepdim=True)).transpose(0, 1)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bs,kv", [(16, torch.float32), (5, torch.float8_e4m3fn), (16, torch.float16)])
@pytest.mark.parametrize("hkv,grp,d", [(3, 3, 64), (2, 4, 128), (1, 5, 48), (4, 1, 16)])
@pytest.mark.parametrize("n,ctx", [(256, 256), (100, 300), (37, 600), (1, 1), (12, 77), (13, 13), (40, 41)])
def test_paged_prefill_bf16_products(threads: int, bs: int, kv: torch.dtype, hkv: int, grp: int, d: int, n: int,
                                     ctx: int) -> None:
    """The prefill kernel's bf16 path (matmul precision "medium" and "int8"): q, K, the softmax
    weights and V rounded to bf16, fp32 sums, against that rounding done by torch. Up to 4 panels
    a tile (d = 128 takes two groups, 48 three panels, 16 one), contexts of several softmax steps
    (whose weights round against a running max, not the row's: the 6e-3), odd contexts (a V pair half padding)
    and an odd block size (V rows without a pair in their block), fp32 / fp8 / fp16 caches; chunks
    of up to 12 tokens keep the fp32 path. The fp32
    kernel misses the same reference 28x or more further on average, so a bf16 flag that went
    unused would fail here."""
    if not cpu_kernels.bf16_products():
        pytest.skip("no AVX512-BF16 in this build")
    g = torch.Generator().manual_seed(n * 7 + ctx)
    h, nb = hkv * grp, -(-ctx // bs)
    kc = (torch.randn(nb + 9, bs, hkv, d, generator=g) * 3).to(kv)
    vc = torch.randn(nb + 9, bs, hkv, d, generator=g).to(kv)
    table = torch.randperm(nb + 9, generator=g)[:nb]
    qkv = torch.randn(n, (h + 2 * hkv) * d, generator=g) * 3
    q = qkv[:, :h * d].view(n, h, d)
    out, out32 = torch.full((n + 2, h, d), float("nan")), torch.empty(n, h, d)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_kernels.paged_prefill(q, kc, vc, table, ctx, d ** -0.5, out[1:n + 1], bf16=True)
        cpu_kernels.paged_prefill(q, kc, vc, table, ctx, d ** -0.5, out32)
    finally:
        torch.set_num_threads(old)
    keys, vals = (c[table].view(-1, hkv, d)[:ctx].float().transpose(0, 1) for c in (kc, vc))  # (H_kv, ctx, D)
    ref = bf16_reference(q, keys, vals, n, ctx, d ** -0.5)
    assert out[0].isnan().all() and out[n + 1].isnan().all()  # nothing written outside out
    if n <= 12:  # a short chunk keeps fp32, bit for bit (as a product of up to 12 rows does)
        assert torch.equal(out[1:n + 1], out32)
        return
    torch.testing.assert_close(out[1:n + 1], ref, rtol=1e-3, atol=6e-3)  # measured: at most 3.9e-3
    assert (out32 - ref).abs().mean() > 10 * (out[1:n + 1] - ref).abs().mean()  # measured: >= 28x


def test_paged_prefill_bf16_needs_the_instructions(isa: str) -> None:
    """Asked of a build without AVX512-BF16, the bf16 path is an error naming what it needs."""
    if cpu_kernels.bf16_products():
        pytest.skip("this build has AVX512-BF16")
    kc = torch.zeros(1, 16, 1, 16)
    q = torch.zeros(1, 1, 16)
    with pytest.raises(RuntimeError, match="AVX512-BF16"):
        cpu_kernels.paged_prefill(q, kc, kc, torch.zeros(1, dtype=torch.long), 1, 0.25, torch.empty_like(q), bf16=True)


def decode_bf16_reference(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, lens: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """Each decode's attention with q and the softmax weights rounded to bf16, K and V as given,
    everything else in fp32: q (B, H, D), keys / vals (B, L, H_kv, D) -> (B, H, D)."""
    g = q.shape[1] // keys.shape[2]
    out = torch.empty_like(q)
    for b, n in enumerate(lens.tolist()):
        kb, vb = (t[b, :n].float().repeat_interleave(g, 1) for t in (keys, vals))  # (n, H, D)
        s = torch.einsum("hd,lhd->hl", q[b].bfloat16().float(), kb) * scale
        p = (s - s.amax(-1, keepdim=True)).exp()
        out[b] = torch.einsum("hl,lhd->hd", p.bfloat16().float(), vb) / p.sum(-1, keepdim=True)
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("b,bs,over", [(13, 16, 12), (20, 5, 12), (12, 16, 12), (4, 16, 0), (1, 7, 0)])
@pytest.mark.parametrize("kv", [torch.float8_e4m3fn, torch.float16], ids=["fp8", "fp16"])
@pytest.mark.parametrize("hkv,grp,d", [(3, 3, 64), (2, 4, 128), (1, 1, 64), (4, 2, 128), (1, 8, 64), (2, 5, 64)])
def test_paged_decode_bf16_products(threads: int, b: int, bs: int, over: int, kv: torch.dtype, hkv: int, grp: int,
                                    d: int) -> None:
    """The decode kernel's bf16 path (matmul precision "medium": calls of more than 12 decodes;
    "int8": every call): over an fp8 cache, a call of more than ``bf16_over`` decodes with up to 4
    query heads a KV head rounds q and the softmax weights to bf16 and reads K / V exactly, against
    that rounding done by torch (the fp32 walk misses the same reference ~1000x further on average,
    so a flag that went unused fails here). Ragged lengths (1 key, odd counts: a V row without a
    pair), odd block sizes, 64 and 128 wide heads, a task per sequence or (1 decode, 2 threads) per
    KV head; 12 decodes under 12, an fp16 cache, and groups of 5 or 8 keep the fp32 walk, bit for bit."""
    if not cpu_kernels.decode_bf16():
        pytest.skip("no AVX512-BF16 + AVX512-VBMI in this build")
    g = torch.Generator().manual_seed(b * 31 + hkv * grp + d)
    nb = -(-300 // bs)
    kc = (torch.randn(b * nb + 7, bs, hkv, d, generator=g) * 3).to(kv)
    vc = torch.randn(b * nb + 7, bs, hkv, d, generator=g).to(kv)
    tables = torch.randperm(b * nb + 7, generator=g)[:b * nb].view(b, nb).contiguous()
    lens = torch.randint(1, nb * bs + 1, (b,), generator=g)
    lens[:3] = torch.tensor([nb * bs, 1, 17])[:b]
    q = torch.randn(b, hkv * grp, d, generator=g) * 3
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_kernels.paged_decode(q, kc, vc, tables, lens, d ** -0.5, bf16=True, bf16_over=over)
        out32 = cpu_kernels.paged_decode(q, kc, vc, tables, lens, d ** -0.5)
    finally:
        torch.set_num_threads(old)
    if b <= over or kv != torch.float8_e4m3fn or grp > 4:
        assert torch.equal(out, out32)
        return
    keys, vals = (c[tables.reshape(-1)].view(b, nb * bs, hkv, d) for c in (kc, vc))
    ref = decode_bf16_reference(q, keys, vals, lens, d ** -0.5)
    # measured: at most 5e-6; a softmax weight rounding to the other bf16 neighbour than torch's moves an
    # output by up to ~1e-4, and the ratio below is what tells the bf16 walk from the fp32 one
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
    assert (out32 - ref).abs().mean() > 100 * (out - ref).abs().mean()  # measured: ~4000x


def test_paged_decode_bf16_needs_the_instructions(isa: str) -> None:
    """Asked of a build without AVX512-BF16, the decode kernel's bf16 flag is an error naming
    what it needs (as the prefill kernel's); a build with it takes the flag."""
    kc = torch.zeros(1, 16, 1, 64, dtype=torch.float8_e4m3fn)
    q = torch.zeros(13, 1, 64)
    tables, lens = torch.zeros(13, 1, dtype=torch.long), torch.ones(13, dtype=torch.long)
    if cpu_kernels.bf16_products():
        assert cpu_kernels.paged_decode(q, kc, kc, tables, lens, 0.125, bf16=True).eq(0).all()
        return
    assert not cpu_kernels.decode_bf16()
    with pytest.raises(RuntimeError, match="AVX512-BF16"):
        cpu_kernels.paged_decode(q, kc, kc, tables, lens, 0.125, bf16=True)


@pytest.mark.parametrize("kv_dtype", (torch.float32, torch.float16, torch.float8_e4m3fn), ids=("auto", "fp16", "fp8"))
def test_xformers_packing_and_mask_match_torch_backend(monkeypatch: pytest.MonkeyPatch, kv_dtype: torch.dtype) -> None:
    """A narrower cache (CacheConfig.kv_dtype) reaches xformers widened to q's dtype."""
    pytest.importorskip("xformers.ops.fmha.attn_bias")  # imported before CUDA is faked below
    chunks, q, k, v, kc, vc = mixed_batch(1)
    kc, vc = kc.to(kv_dtype), vc.to(kv_dtype)
    meta = build_metadata(chunks, BS, torch.device("cpu"))
    backend = XFormersAttention(D ** -0.5)
    q5, k5, v5 = backend.packed_inputs(q, k, v, kc.clone(), vc.clone(), meta)
    assert k5.dtype == v5.dtype == q.dtype
    # where CUDA is there, xformers' default device for a bias is "cuda", whatever the step's is
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        assert backend.bias(meta).q_seqinfo.seqstart.device == meta.positions.device
    bias = backend.bias(meta).materialize((q5.shape[1], k5.shape[1]))  # (T, ΣL) additive mask
    qf, kf, vf = (x[0].flatten(1, 2).transpose(0, 1) for x in (q5, k5, v5))  # (H, T|ΣL, D)
    dense = torch.softmax(qf @ kf.transpose(1, 2) * D ** -0.5 + bias, -1) @ vf
    expected = TorchAttention(D ** -0.5).forward(q, k, v, kc, vc, meta)
    torch.testing.assert_close(dense.transpose(0, 1), expected, rtol=1e-5, atol=1e-5)


def test_backend_selection() -> None:
    assert make_backend("auto", "cpu", D).name == "torch"
    with pytest.raises(ValueError, match="'xformers' cannot run: xformers needs device cuda"):
        make_backend("xformers", "cpu", D)


def test_xformers_that_imports_but_cannot_run_is_not_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wheel built for another torch imports but has no operator: auto falls back to torch SDPA,
    and asking for xformers says why (here the tiny probe call fails for want of a GPU; on the H200
    image it failed with NotImplementedError, "no attention operator for bfloat16 at head size")."""
    pytest.importorskip("xformers.ops")
    from stages.attention.xformers_backend import xformers_unusable
    xformers_unusable.cache_clear()
    if torch.cuda.is_available():
        pytest.skip("the probe would run for real")
    assert xformers_unusable(torch.float32) == "xformers needs CUDA, which is not available"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    xformers_unusable.cache_clear()
    try:
        # a CPU build of torch fails the probe's CUDA allocation, not xformers' dispatch
        assert xformers_unusable(torch.bfloat16).startswith("xformers' probe call failed (")
        assert make_backend("auto", "cuda", D, torch.bfloat16).name == "torch"
        with pytest.raises(ValueError, match="cannot run: xformers' probe call failed"):
            make_backend("xformers", "cuda", D, torch.bfloat16)
    finally:
        xformers_unusable.cache_clear()


@pytest.mark.gpu
def test_xformers_kernel_matches_torch_on_cuda() -> None:
    from stages.attention.xformers_backend import xformers_unusable
    if xformers_unusable(torch.float32):
        pytest.skip(xformers_unusable(torch.float32))
    chunks, q, k, v, kc, vc = (x.cuda() if isinstance(x, torch.Tensor) else x for x in mixed_batch(2))
    meta = build_metadata(chunks, BS, torch.device("cuda"))
    ours = make_backend("xformers", "cuda", D).forward(q, k, v, kc.clone(), vc.clone(), meta)
    ref = TorchAttention(D ** -0.5).forward(q, k, v, kc, vc, meta)
    torch.testing.assert_close(ours, ref, rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("hkv", [8, 32], ids=["gqa", "mha"])
def test_later_chunks_attend_bottom_right_on_cuda(hkv: int) -> None:
    """bf16 chunks of 96 and 40 tokens after 200 and 1000 cached ones, 32 heads of 128: SDPA takes
    torch's bottom-right causal bias (flash on this GPU, for GQA too, where a bool mask left the math
    path) and must give the dense reference's attention."""
    g, bs, d = torch.Generator().manual_seed(0), 16, 128
    specs, chunks, next_block = [(0, 200, 96), (1, 1000, 40)], [], 0
    for seq, start, n in specs:
        nb = -(-(start + n) // bs)
        chunks.append(SeqChunk(seq, start, tuple(range(n)), tuple(range(next_block, next_block + nb)), True, None))
        next_block += nb
    kc, vc = (torch.randn(next_block, bs, hkv, d, generator=g).bfloat16().cuda() for _ in range(2))
    t = sum(n for *_, n in specs)
    q = torch.randn(t, 32, d, generator=g).bfloat16().cuda()
    k, v = (torch.randn(t, hkv, d, generator=g).bfloat16().cuda() for _ in range(2))
    meta = build_metadata(tuple(chunks), bs, torch.device("cuda"))
    out = TorchAttention(d ** -0.5).forward(q, k, v, kc, vc, meta).float()
    row = 0
    for c in chunks:  # fp32 over the written cache: every key up to each query's own position
        keys = kc[list(c.block_table)].flatten(0, 1)[:c.context_len].float().repeat_interleave(32 // hkv, dim=1)
        vals = vc[list(c.block_table)].flatten(0, 1)[:c.context_len].float().repeat_interleave(32 // hkv, dim=1)
        s = torch.einsum("nhd,lhd->hnl", q[row:row + c.num_tokens].float(), keys) * d ** -0.5
        s = s.masked_fill(~causal_offset_mask(c.num_tokens, c.context_len, q.device), float("-inf"))
        ref = torch.einsum("hnl,lhd->nhd", s.softmax(-1), vals)
        torch.testing.assert_close(out[row:row + c.num_tokens], ref, rtol=2e-2, atol=2e-2)
        row += c.num_tokens


NARROW = [torch.float16, torch.float8_e4m3fn]


@pytest.mark.parametrize("narrow", NARROW, ids=["fp16", "fp8"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("hkv,grp,d", [(3, 3, 64), (2, 4, 128), (2, 5, 64), (1, 5, 48), (1, 8, 64), (2, 2, 128),
                                       (2, 1, 64)])
def test_kernels_read_narrow_caches_as_their_float32_widening(isa: str, threads: int, hkv: int, grp: int, d: int,
                                                              narrow: torch.dtype) -> None:
    """--kv-cache-dtype float16 / fp8: both kernels widen each K/V element exactly as it is read, so the
    register-tiled decode path (fp8 read as value · 2⁻⁸, the 2⁸ folded into the score scale and the
    softmax's 1 / sum: powers of two, so the same roundings) and the prefill kernel (which widens
    while packing) give bit for bit
    the fp32 kernel's result on the widened cache; the plain-loop decode path (group 5) may sum in
    another order once the compiler vectorises the widening, so it is held to float rounding, and so
    is every decode of the build without vector extensions (plain loops only)."""
    if not cpu_kernels.available():
        pytest.skip("CPU paged-attention kernel could not be built here")
    g = torch.Generator().manual_seed(d + grp)
    bs, b, nb = 16, 5, 8
    kh = torch.randn(60, bs, hkv, d, generator=g).to(narrow)
    vh = torch.randn(60, bs, hkv, d, generator=g).to(narrow)
    tables = torch.randperm(60, generator=g)[:b * nb].view(b, nb).contiguous()
    lens = torch.tensor([1, 17, 50, 100, 128])
    q = torch.randn(b, hkv * grp, d, generator=g)
    n, ctx = 40, 100
    qp = torch.randn(n, hkv * grp, d, generator=g)
    out16, out32 = torch.empty_like(qp), torch.empty_like(qp)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dec16 = cpu_kernels.paged_decode(q, kh, vh, tables, lens, d ** -0.5)
        dec32 = cpu_kernels.paged_decode(q, kh.float(), vh.float(), tables, lens, d ** -0.5)
        if d % cpu_kernels.TILE == 0:
            cpu_kernels.paged_prefill(qp, kh, vh, tables[0], ctx, d ** -0.5, out16)
            cpu_kernels.paged_prefill(qp, kh.float(), vh.float(), tables[0], ctx, d ** -0.5, out32)
    finally:
        torch.set_num_threads(old)
    if grp in (1, 2, 3, 4, 8) and d in (64, 128) and cpu_kernels.isa() != "scalar":
        assert torch.equal(dec16, dec32)
    else:
        torch.testing.assert_close(dec16, dec32, rtol=1e-6, atol=1e-6)
    assert torch.equal(out16, out32)


@pytest.mark.parametrize("narrow", NARROW, ids=["fp16", "fp8"])
@pytest.mark.parametrize("paged_kernel", [True, False])
def test_torch_backend_with_narrow_cache_matches_dense_on_the_rounded_kv(isa: str, paged_kernel: bool,
                                                                         narrow: torch.dtype,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp16 or fp8 cache: the new tokens' K/V are rounded once as they are written, and every path
    (kernels, gather + SDPA, a fresh chunk attending to itself) attends over those rounded values."""
    if paged_kernel and not cpu_kernels.available():
        pytest.skip("CPU paged-attention kernel could not be built here")
    if not paged_kernel and isa != "native":
        pytest.skip("gather + SDPA does not run the kernels: once is enough")
    monkeypatch.setattr(TorchAttention, "_use_paged_kernel", staticmethod(lambda q: paged_kernel))
    chunks, q, k, v, kc, vc = mixed_batch(d=16)
    kc16, vc16 = kc.to(narrow), vc.to(narrow)
    meta = build_metadata(chunks, BS, torch.device("cpu"))
    out = TorchAttention(16 ** -0.5).forward(q, k, v, kc16, vc16, meta)
    assert kc16.dtype == narrow  # written in place, still narrow
    torch.testing.assert_close(out, dense_reference(chunks, q, kc16.float(), vc16.float()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("narrow", NARROW, ids=["fp16", "fp8"])
@pytest.mark.parametrize("paged_kernel", [True, False])
def test_narrow_cache_write_clamps_to_its_finite_range(paged_kernel: bool, narrow: torch.dtype,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A K/V value past the cache's range is stored as its largest finite value (fp16 ±65504, fp8
    ±448), not inf or NaN (an inf key makes the row NaN), by the kernels and by torch alike."""
    if paged_kernel and not cpu_kernels.available():
        pytest.skip("CPU paged-attention kernel could not be built here")
    monkeypatch.setattr(cpu_kernels, "usable", lambda x: paged_kernel and x.dtype == torch.float32)
    chunks, q, k, v, kc, vc = mixed_batch(d=16)
    k[0, 0, 0], v[1, 1, 1] = 1e6, -1e6
    kc16, vc16 = kc.to(narrow), vc.to(narrow)
    meta = build_metadata(chunks, BS, torch.device("cpu"))
    out = TorchAttention(16 ** -0.5).forward(q, k, v, kc16, vc16, meta)
    top = torch.finfo(narrow).max
    assert torch.isfinite(kc16.float()).all() and torch.isfinite(vc16.float()).all() and not out.isnan().any()
    assert kc16.float().max() == top and vc16.float().min() == -top


@pytest.mark.parametrize("narrow", NARROW, ids=["fp16", "fp8"])
def test_narrow_cache_write_from_bf16_clamps_in_float32(narrow: torch.dtype) -> None:
    """bf16 has no 65504: clamped in bf16 it rounded to 65536, which fp16 stored as inf."""
    from stages.attention.torch_backend import _narrow
    x = torch.tensor([1e6, -1e6, 3.0], dtype=torch.bfloat16)
    top = torch.finfo(narrow).max
    assert _narrow(x, narrow).float().tolist() == [top, -top, 3.0]


def test_decode_kernel_is_asked_once_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer's q and caches are alike: whether the CUDA decode kernel takes them is asked
    once per step (meta.backend_cache), not once per layer on a host-bound step."""
    from stages.attention import triton_decode
    asked = []
    monkeypatch.setattr(cpu_kernels, "usable", lambda x: False)
    monkeypatch.setattr(triton_decode, "usable", lambda *a: asked.append(a) or False)
    chunks, q, k, v, kc, vc = mixed_batch()
    meta = build_metadata(chunks, BS, torch.device("cpu"))
    backend = TorchAttention(q.shape[-1] ** -0.5)
    outs = [backend.forward(q, k, v, kc, vc, meta) for _ in range(3)]  # three layers of one step
    assert len(asked) == 1 and all(torch.equal(o, outs[0]) for o in outs)
    backend.forward(q, k, v, kc, vc, build_metadata(chunks, BS, torch.device("cpu")))  # the next step asks again
    assert len(asked) == 2
