"""Attention backends: the torch backend against a dense reference, and the xformers
backend's packing and mask (built from the same metadata) checked on CPU by running its
exact inputs through a dense softmax attention — only the CUDA kernel call is left out."""
from __future__ import annotations

import pytest
import torch

from pp_runtime.batch import SeqChunk
from stages.attention import TorchAttention, XFormersAttention, build_metadata, cpu_paged, make_backend

BS, H, HKV, D = 4, 4, 2, 8


def mixed_batch(seed: int = 0) -> tuple:
    """Two prefill chunks (one fresh, one continuing) and three decodes with assorted contexts."""
    g = torch.Generator().manual_seed(seed)
    specs = [(0, 0, 6, True), (1, 5, 4, True), (2, 9, 1, False), (3, 2, 1, False), (4, 13, 1, False)]
    chunks, tables, next_block = [], {}, 0
    for seq, start, n, pre in specs:
        nb = -(-(start + n) // BS)
        tables[seq] = tuple(range(next_block, next_block + nb))
        next_block += nb
        chunks.append(SeqChunk(seq, start, tuple(range(n)), tables[seq], pre, None))
    k_cache = torch.randn(next_block, BS, HKV, D, generator=g)
    v_cache = torch.randn(next_block, BS, HKV, D, generator=g)
    t = sum(c.num_tokens for c in chunks)
    q, k, v = torch.randn(t, H, D, generator=g), torch.randn(t, HKV, D, generator=g), torch.randn(t, HKV, D, generator=g)
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
            s = torch.einsum("hd,lhd->hl", q[row], keys[:pos + 1]) * D ** -0.5
            out[row] = torch.einsum("hl,lhd->hd", s.softmax(-1), vals[:pos + 1])
            row += 1
    return out


@pytest.mark.parametrize("paged_kernel", [True, False])
def test_torch_backend_matches_dense(paged_kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both decode paths: the CPU paged kernel (K/V read in place) and gather + SDPA."""
    if paged_kernel and not cpu_paged.available():
        pytest.skip("CPU paged-attention kernel could not be built here")
    monkeypatch.setattr(TorchAttention, "_use_paged_kernel", staticmethod(lambda q: paged_kernel))
    chunks, q, k, v, kc, vc = mixed_batch()
    meta = build_metadata(chunks, BS, torch.device("cpu"))
    out = TorchAttention(D ** -0.5).forward(q, k, v, kc, vc, meta)
    torch.testing.assert_close(out, dense_reference(chunks, q, kc, vc), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("hkv,grp,d", [(3, 3, 64), (2, 5, 64), (2, 4, 128), (2, 3, 32)])
def test_paged_kernel_matches_gather_sdpa_at_scale(threads: int, hkv: int, grp: int, d: int) -> None:
    """Real head shapes (SmolLM2: 9 query / 3 KV heads, D = 64), scattered blocks, ragged lengths;
    and shapes that take the kernel's other paths (head size / group size fixed at compile time
    or not: 64 and 5, 128 and 4, 32 and 3)."""
    if not cpu_paged.available():
        pytest.skip("CPU paged-attention kernel could not be built here")
    g = torch.Generator().manual_seed(threads)
    b, bs, nb = 13, 16, 9
    kc, vc = torch.randn(200, bs, hkv, d, generator=g), torch.randn(200, bs, hkv, d, generator=g)
    tables = torch.randperm(200, generator=g)[:b * nb].view(b, nb).contiguous()
    lens = torch.randint(1, nb * bs + 1, (b,), generator=g)
    q = torch.randn(b, hkv * grp, d, generator=g)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_paged.paged_decode(q, kc, vc, tables, lens, d ** -0.5)
    finally:
        torch.set_num_threads(old)
    kd = kc[tables.reshape(-1)].view(b, -1, hkv, d).transpose(1, 2)
    vd = vc[tables.reshape(-1)].view(b, -1, hkv, d).transpose(1, 2)
    mask = (torch.arange(nb * bs)[None, :] < lens[:, None])[:, None, None, :]
    ref = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, ref.squeeze(2), rtol=1e-5, atol=1e-5)


def test_xformers_packing_and_mask_match_torch_backend() -> None:
    pytest.importorskip("xformers")
    chunks, q, k, v, kc, vc = mixed_batch(1)
    meta = build_metadata(chunks, BS, torch.device("cpu"))
    backend = XFormersAttention(D ** -0.5)
    q5, k5, v5 = backend.packed_inputs(q, k, v, kc.clone(), vc.clone(), meta)
    bias = backend.bias(meta).materialize((q5.shape[1], k5.shape[1]))  # (T, ΣL) additive mask
    qf, kf, vf = (x[0].flatten(1, 2).transpose(0, 1) for x in (q5, k5, v5))  # (H, T|ΣL, D)
    dense = torch.softmax(qf @ kf.transpose(1, 2) * D ** -0.5 + bias, -1) @ vf
    expected = TorchAttention(D ** -0.5).forward(q, k, v, kc, vc, meta)
    torch.testing.assert_close(dense.transpose(0, 1), expected, rtol=1e-5, atol=1e-5)


def test_backend_selection() -> None:
    assert make_backend("auto", "cpu", 1.0).name == "torch"
    with pytest.raises(ValueError, match="xformers"):
        make_backend("xformers", "cpu", 1.0)


@pytest.mark.gpu
def test_xformers_kernel_matches_torch_on_cuda() -> None:
    chunks, q, k, v, kc, vc = (x.cuda() if isinstance(x, torch.Tensor) else x for x in mixed_batch(2))
    meta = build_metadata(chunks, BS, torch.device("cuda"))
    ours = make_backend("xformers", "cuda", D ** -0.5).forward(q, k, v, kc.clone(), vc.clone(), meta)
    ref = TorchAttention(D ** -0.5).forward(q, k, v, kc, vc, meta)
    torch.testing.assert_close(ours, ref, rtol=2e-3, atol=2e-3)
