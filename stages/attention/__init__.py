"""Attention backends built from one AttentionMetadata: ``torch`` (anywhere) and ``xformers`` (CUDA)."""
from __future__ import annotations

from stages.attention.metadata import AttentionMetadata, build_metadata
from stages.attention.torch_backend import TorchAttention
from stages.attention.xformers_backend import XFormersAttention, xformers_available


def make_backend(name: str, device: str, scale: float) -> TorchAttention | XFormersAttention:
    """``auto`` picks xformers on CUDA when it imports, else torch SDPA."""
    if name == "auto":
        name = "xformers" if device == "cuda" and xformers_available() else "torch"
    if name == "xformers":
        if device != "cuda" or not xformers_available():
            raise ValueError("attention backend 'xformers' needs CUDA and an importable xformers; "
                             "use --attention torch on this machine")
        return XFormersAttention(scale)
    return TorchAttention(scale)


__all__ = ["AttentionMetadata", "build_metadata", "make_backend", "TorchAttention", "XFormersAttention"]
