"""Weight sources: read(name, rows, cols) -> float32 tensor of one checkpoint tensor's slice.

Names are the HF ones (model.layers.{i}.self_attn.q_proj.weight, ...); each source maps them to
its format and reads only the rows / columns asked for: safetensors slices, GGUF tensors
dequantized on demand (or kept as stored blocks, ``read_blocks``), seeded random presets.

    source = open_source(resolve_model(spec))
    w = source.read("model.layers.0.mlp.up_proj.weight", rows=(0, 64))
"""
from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import torch

from pp_runtime.config import ModelConfig
from stages import quant
from stages.model_source import ModelError, ModelSource, gguf_reader

Span = tuple[int, int] | None


class SafetensorsSource:
    def __init__(self, folder: str) -> None:
        from safetensors import safe_open
        self._files: dict[str, object] = {}
        self._where: dict[str, str] = {}
        for f in sorted(Path(folder).glob("*.safetensors")):
            try:
                handle = safe_open(str(f), framework="pt")
            except Exception as e:  # SafetensorError, OSError: a truncated or foreign file
                raise ModelError(f"{f} is not a readable safetensors file ({str(e).splitlines()[0]})") from None
            self._files[str(f)] = handle
            for key in handle.keys():
                self._where[key] = str(f)

    def has(self, name: str) -> bool:
        return name in self._where

    def read(self, name: str, rows: Span = None, cols: Span = None) -> torch.Tensor:
        if name not in self._where:
            raise ModelError(f"checkpoint has no tensor {name}")
        sl = self._files[self._where[name]].get_slice(name)
        r = slice(*rows) if rows else slice(None)
        t = sl[r] if cols is None else sl[r, slice(*cols)]
        return t.float()


def _gguf_name(name: str) -> str:
    table = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if name in table:
        return table[name]
    parts = name.split(".")  # model.layers.{i}.{module}.{proj}.{weight|bias}
    layer, rest = parts[2], ".".join(parts[3:])
    local = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{local[module]}.{kind}"


class GGUFSource:
    """Dequantizes only the tensors (and, for column shards, only the rows) that are read."""

    def __init__(self, path: str, cfg: ModelConfig) -> None:
        self._file = gguf_reader(path)
        self.cfg = cfg

    def has(self, name: str) -> bool:
        return _gguf_name(name) in self._file.tensors

    def read(self, name: str, rows: Span = None, cols: Span = None) -> torch.Tensor:
        gname = _gguf_name(name)
        if gname not in self._file.tensors:
            raise ModelError(f"GGUF file has no tensor {gname} (for {name})")
        one_d = len(self._file.tensors[gname].dims) == 1
        arr = self._file.read(gname, None if one_d else rows)
        out = torch.from_numpy(np.array(arr, dtype=np.float32))  # a writable copy
        # llama.cpp's converter permutes q/k rows of LLaMA for its interleaved RoPE; undo it per
        # head (shards are whole heads, so this works on a row slice too).
        if self.cfg.architecture == "llama" and (".q_proj." in name or ".k_proj." in name):
            out = _unpermute(out, self.cfg.head_size)
        return out if cols is None else out[:, cols[0]:cols[1]]

    def read_blocks(self, name: str, rows: Span = None, cols: Span = None) -> tuple[int, np.ndarray] | None:
        """(qtype, stored bytes (rows, blocks · block bytes)) of this slice of a matrix, or None
        where its blocks cannot be kept: a type stages.quant does not read, a column slice that
        cuts a block."""
        info = self._file.tensors.get(_gguf_name(name))
        if info is None or len(info.dims) != 2 or not quant.supported(info.qtype):
            return None
        data, qtype = self._file.raw(info.name, rows)
        if cols is not None:
            if cols[0] % quant.QK or cols[1] % quant.QK:
                return None
            bb = quant.BLOCK_BYTES[qtype]
            data = data[:, cols[0] // quant.QK * bb: cols[1] // quant.QK * bb]
        if self.cfg.architecture == "llama" and (".q_proj." in name or ".k_proj." in name):
            data = _unpermute(torch.from_numpy(np.array(data)), self.cfg.head_size).numpy()  # whole rows move
        return qtype, data


def _unpermute(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    heads = w.shape[0] // head_dim
    rest = w.shape[1:]
    return w.reshape(heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


class RandomSource:
    """Seeded random weights: each full tensor is a pure function of (seed, name), so every
    worker builds the same model and slices its own shard."""

    def __init__(self, cfg: ModelConfig, seed: int) -> None:
        self.cfg, self.seed = cfg, seed

    def has(self, name: str) -> bool:
        return not (name == "lm_head.weight" and self.cfg.tie_word_embeddings)

    def read(self, name: str, rows: Span = None, cols: Span = None) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        shape = _full_shape(self.cfg, name)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            t = 0.02 * torch.randn(shape, generator=g)
        t = t if rows is None else t[rows[0]:rows[1]]
        return t if cols is None else t[:, cols[0]:cols[1]]


def _full_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes = {"q_proj": (cfg.q_size, h), "k_proj": (cfg.kv_size, h), "v_proj": (cfg.kv_size, h),
              "o_proj": (h, cfg.q_size), "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
              "embed_tokens": (cfg.vocab_size, h), "lm_head": (cfg.vocab_size, h)}
    module, kind = name.rsplit(".", 2)[-2:]
    if kind == "bias":
        return (shapes[module][0],)
    return shapes.get(module, (h,))


def open_source(src: ModelSource) -> SafetensorsSource | GGUFSource | RandomSource:
    if src.kind == "hf":
        return SafetensorsSource(src.path)
    if src.kind == "gguf":
        return GGUFSource(src.path, src.config)
    return RandomSource(src.config, src.seed)

