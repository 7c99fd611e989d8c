"""Attention backends built from one AttentionMetadata: ``torch`` (anywhere) and ``xformers`` (CUDA)."""
from __future__ import annotations

import torch

from stages.attention.metadata import AttentionMetadata, build_metadata
from stages.attention.torch_backend import TorchAttention
from stages.attention.xformers_backend import XFormersAttention, xformers_unusable


def make_backend(name: str, device: str, head_size: int,
                 dtype: torch.dtype = torch.float32) -> TorchAttention | XFormersAttention:
    """The backend ``name`` for heads of ``head_size`` (softmax scale 1/√head_size). ``auto`` picks
    xformers on CUDA where it can run in ``dtype`` at that head size, else torch SDPA. Asking for
    xformers where it cannot run is a ValueError that says why."""
    why = "xformers needs device cuda" if device != "cuda" else None
    if name in ("auto", "xformers") and why is None:
        why = xformers_unusable(dtype, head_size)
    if name == "auto":
        name = "torch" if why else "xformers"
    if name == "xformers":
        if why:
            raise ValueError(f"attention backend 'xformers' cannot run: {why}; use --attention torch")
        return XFormersAttention(head_size ** -0.5)
    return TorchAttention(head_size ** -0.5)


__all__ = ["AttentionMetadata", "build_metadata", "make_backend", "TorchAttention", "XFormersAttention"]
