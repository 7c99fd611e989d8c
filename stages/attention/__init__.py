"""Attention backends built from one AttentionMetadata: ``torch`` (anywhere) and ``xformers`` (CUDA)."""
from __future__ import annotations

import torch

from stages.attention.metadata import AttentionMetadata, build_metadata
from stages.attention.torch_backend import TorchAttention
from stages.attention.xformers_backend import XFormersAttention, xformers_unusable


def make_backend(name: str, device: str, scale: float, dtype: torch.dtype = torch.float32,
                 head_size: int = 64) -> TorchAttention | XFormersAttention:
    """``auto`` picks xformers on CUDA where it can run in ``dtype`` at ``head_size``, else torch
    SDPA. Asking for xformers where it cannot run is a ValueError that says why."""
    why = "xformers needs device cuda" if device != "cuda" else None
    if name in ("auto", "xformers") and why is None:
        why = xformers_unusable(dtype, head_size)
    if name == "auto":
        name = "torch" if why else "xformers"
    if name == "xformers":
        if why:
            raise ValueError(f"attention backend 'xformers' cannot run: {why}; use --attention torch")
        return XFormersAttention(scale)
    return TorchAttention(scale)


__all__ = ["AttentionMetadata", "build_metadata", "make_backend", "TorchAttention", "XFormersAttention"]
