"""Filling a stage: ``load_weights(model, source, ctx)`` copies just this stage's layers and
just this TP rank's shard into a StageModel (column-, row- and vocab-parallel slices, fused
q/k/v and gate/up concatenated), reading only those slices from the source
(stages/weight_sources.py); with ``native=True`` a GGUF linear weight whose blocks the CPU
GEMM reads (Q4_0, Q4_1, Q8_0) stays as stored instead, regrouped into panels (stages/quant.py).

    nbytes = load_weights(model, resolve_model(spec), TPContext(rank, size), native=True)
"""
from __future__ import annotations

import numpy as np
import torch

from pp_runtime.config import ModelConfig
from stages import quant
from stages.layers import TPContext, shard_range
from stages.model_source import ModelError, ModelSource
from stages.weight_sources import GGUFSource, Span, open_source

_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def load_weights(model: torch.nn.Module, src: ModelSource, ctx: TPContext, native: bool = False) -> int:
    """Copy this stage's shard into ``model``; returns the bytes of weights it now holds.

    native: keep GGUF matrices in their stored blocks where the CPU GEMM reads them (the caller
    checks that it runs: fp32 on CPU, kernels built); the module's weight becomes the panels."""
    source = open_source(src)
    cfg = src.config
    seen: set[int] = set()
    kept: dict[int, torch.nn.Parameter] = {}  # id(plain parameter) -> its panels
    total = 0
    for name, param in model.weight_names().items():
        if id(param) in seen:  # tied embedding / LM head: one tensor under two names
            continue
        seen.add(id(param))
        panels = _read_blocks(name, source, cfg, ctx) if native else None
        if panels is not None:
            if quant.panel_shape(panels) != tuple(param.shape):
                raise ModelError(f"{name}: stored blocks hold {quant.panel_shape(panels)}, the model needs "
                                 f"{tuple(param.shape)}")
            kept[id(param)] = torch.nn.Parameter(panels, requires_grad=False)
            total += panels.numel()
            continue
        with torch.no_grad():
            param.copy_(_read_param(name, source, cfg, ctx))
        total += param.numel() * param.element_size()
    for mod in model.modules():  # the plain tensors (never written, so never resident) go
        if id(getattr(mod, "weight", None)) in kept:
            mod.weight = kept[id(mod.weight)]
    return total


_MATRICES = ("qkv_proj", "gate_up_proj", "o_proj", "down_proj", "embed_tokens", "lm_head")


class _Unkept(Exception):
    pass


class _BlockReader:
    """read() gives stored GGUF bytes instead of floats, so _read_param's sharding serves both."""

    def __init__(self, source: GGUFSource) -> None:
        self.source, self.qtypes = source, set()

    def has(self, name: str) -> bool:
        return self.source.has(name)

    def read(self, name: str, rows: Span = None, cols: Span = None) -> np.ndarray:
        got = self.source.read_blocks(name, rows, cols)
        if got is None or (self.qtypes and got[0] not in self.qtypes):  # fused parts of two types
            raise _Unkept
        self.qtypes.add(got[0])
        return got[1]


def _read_blocks(name: str, source: object, cfg: ModelConfig, ctx: TPContext) -> torch.Tensor | None:
    """This rank's shard of a GGUF matrix as quant panels, or None (keep it as floats)."""
    if not isinstance(source, GGUFSource) or not name.endswith(".weight") or name.rsplit(".", 2)[-2] not in _MATRICES:
        return None
    reader = _BlockReader(source)
    try:
        raw = _read_param(name, reader, cfg, ctx, cat=np.concatenate)
    except _Unkept:
        return None
    if raw.shape[0] % quant.PANEL:  # an output size the panels do not cut
        return None
    return quant.to_panels(raw, reader.qtypes.pop())


def _read_param(name: str, source: object, cfg: ModelConfig, ctx: TPContext, cat: object = torch.cat) -> torch.Tensor:
    prefix, module, kind = ([""] + name.rsplit(".", 2))[-3:]  # "lm_head.weight" has no prefix
    if module in _FUSED:  # column parallel, fused: this rank's rows of each part, concatenated
        sizes = (cfg.q_size, cfg.kv_size, cfg.kv_size) if module == "qkv_proj" else (cfg.intermediate_size,) * 2
        return cat([source.read(f"{prefix}.{part}.{kind}", rows=shard_range(size, ctx))
                    for part, size in zip(_FUSED[module], sizes)])
    if module in ("o_proj", "down_proj") and kind == "weight":  # row parallel: input columns
        full_in = cfg.q_size if module == "o_proj" else cfg.intermediate_size
        return source.read(name, cols=shard_range(full_in, ctx))
    if module in ("embed_tokens", "lm_head"):  # vocab parallel: rows
        if module == "lm_head" and cfg.tie_word_embeddings:
            # Tied: the head is the embedding on every split, as when one stage holds both (one
            # tensor) and as vLLM loads it; an lm_head.weight the checkpoint also carries is not read.
            name = "model.embed_tokens.weight"
        elif module == "lm_head" and not source.has(name):
            raise ModelError(f"the checkpoint has no {name}, and the config says tie_word_embeddings is "
                             "false: no LM head to load")
        return source.read(name, rows=shard_range(cfg.vocab_size, ctx))
    return source.read(name)
