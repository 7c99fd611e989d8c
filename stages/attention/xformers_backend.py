"""xformers attention backend (CUDA): the whole mixed batch in one kernel call.

Every chunk's context (cached + new K/V) is gathered into one packed key sequence, and a
``BlockDiagonalCausalFromBottomRightMask`` built from (q_lens, ctx_lens) keeps each chunk
to its own keys, causal with the offset of its cached tokens; decodes are chunks of one
query. GQA uses xformers' (B, M, G, H, K) layout with K/V broadcast over each group.
"""
from __future__ import annotations

import functools

import torch

from stages.attention.metadata import AttentionMetadata
from stages.attention.torch_backend import byte_view, write_kv


@functools.cache
def xformers_unusable(dtype: torch.dtype = torch.bfloat16, head_size: int = 64) -> str | None:
    """Why xformers' attention cannot run here in ``dtype`` at ``head_size`` (None: it can). That
    it imports is not enough: a wheel built for another torch imports, warns, and has no CUDA
    operator (seen with xformers 0.0.35, built for torch 2.10, under torch 2.11), so one tiny
    causal call decides, once per process."""
    try:
        import xformers.ops as xops
        from xformers.ops.fmha.attn_bias import BlockDiagonalCausalFromBottomRightMask
    except Exception as e:  # ImportError, or a broken build
        return f"xformers does not import ({_first_line(e)})"
    if not torch.cuda.is_available():
        return "xformers needs CUDA, which is not available"
    name = str(dtype).removeprefix("torch.")
    try:
        q = torch.zeros(1, 2, 1, 1, head_size, dtype=dtype, device="cuda")  # (B, M, G, H/G, D), our layout
        bias = BlockDiagonalCausalFromBottomRightMask.from_seqlens([2], [2], device=q.device)
        xops.memory_efficient_attention_forward(q, q, q, attn_bias=bias)
    except NotImplementedError as e:  # "No operator found ..."
        return f"xformers has no attention operator for {name} at head size {head_size} here ({_first_line(e)})"
    except Exception as e:  # anything else (CUDA init, memory): not xformers' verdict, but not usable now
        return f"xformers' probe call failed ({_first_line(e)})"
    return None


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


class XFormersAttention:
    name = "xformers"

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def bias(self, meta: AttentionMetadata) -> object:
        """Built once per micro-batch and shared by all layers."""
        if "xformers_bias" not in meta.backend_cache:
            from xformers.ops.fmha.attn_bias import BlockDiagonalCausalFromBottomRightMask
            # on the step's device: xformers' default is "cuda", i.e. the current device, not the tensors'
            meta.backend_cache["xformers_bias"] = BlockDiagonalCausalFromBottomRightMask.from_seqlens(
                meta.q_lens, meta.ctx_lens, device=meta.positions.device)
        return meta.backend_cache["xformers_bias"]

    def packed_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, meta: AttentionMetadata
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write new K/V, then q (1, T, G, H/G, D) and packed contexts k/v (1, ΣL, G, H/G, D)."""
        write_kv(k, v, k_cache, v_cache, meta)
        t, h, d = q.shape
        g = k.shape[1]
        slots = meta.all_kv_slots()
        # a narrower cache (CacheConfig.kv_dtype) widened to q's dtype: xformers takes one dtype
        kk, vv = (byte_view(c).view(-1, g, d)[slots].view(c.dtype).to(q.dtype).unsqueeze(2).expand(-1, g, h // g, d)
                  for c in (k_cache, v_cache))
        return q.view(1, t, g, h // g, d), kk.unsqueeze(0), vv.unsqueeze(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        import xformers.ops as xops
        q5, k5, v5 = self.packed_inputs(q, k, v, k_cache, v_cache, meta)
        out = xops.memory_efficient_attention_forward(q5, k5, v5, attn_bias=self.bias(meta), scale=self.scale)
        return out.view(q.shape)
