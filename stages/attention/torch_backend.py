"""Reference attention backend on torch SDPA: runs on any device.

Prefill chunks: one SDPA per chunk over its gathered context, causal with the diagonal
offset by the tokens already cached (bottom-right aligned). Decodes: one batched SDPA
over their padded contexts with a padding mask. GQA through SDPA's ``enable_gqa``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from stages.attention.metadata import AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Store the new tokens' K/V (T, H_kv, D) in the paged caches (NB, BS, H_kv, D)."""
    h, d = k.shape[1:]
    k_cache.view(-1, h, d).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, h, d).index_copy_(0, meta.slot_mapping, v)


def causal_offset_mask(q_len: int, ctx_len: int, device: torch.device) -> torch.Tensor:
    """(q, ctx) bool: query i (at position ctx − q + i) sees keys 0..ctx − q + i."""
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device).unsqueeze(1)
    return torch.arange(ctx_len, device=device).unsqueeze(0) <= q_pos


class TorchAttention:
    name = "torch"

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q (T, H, D), k/v (T, H_kv, D) -> (T, H, D)."""
        write_kv(k, v, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        h_kv, d = k.shape[1:]
        flat_k, flat_v = k_cache.view(-1, h_kv, d), v_cache.view(-1, h_kv, d)
        row = 0
        for i in range(meta.num_prefills):
            n = meta.q_lens[i]
            qi = q[row:row + n].transpose(0, 1).unsqueeze(0)  # (1, H, n, D)
            if meta.fresh_prefill[i]:  # nothing cached: attend to the chunk itself, plain causal
                ki, vi, mask, causal = k[row:row + n], v[row:row + n], None, True
            else:
                slots = meta.prefill_kv_slots[i]
                ki, vi = flat_k[slots], flat_v[slots]  # (ctx, H_kv, D)
                mask, causal = causal_offset_mask(n, meta.ctx_lens[i], q.device), False
            o = F.scaled_dot_product_attention(qi, ki.transpose(0, 1).unsqueeze(0), vi.transpose(0, 1).unsqueeze(0),
                                               attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True)
            out[row:row + n] = o.squeeze(0).transpose(0, 1)
            row += n
        if meta.num_decodes:
            qd = q[row:].unsqueeze(2)  # (B, H, 1, D)
            kd = flat_k[meta.decode_slots].transpose(1, 2)  # (B, H_kv, L, D)
            vd = flat_v[meta.decode_slots].transpose(1, 2)
            mask = meta.decode_mask[:, None, None, :]  # (B, 1, 1, L)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=self.scale, enable_gqa=True)
            out[row:] = o.squeeze(2)
        return out
