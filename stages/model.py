"""LLaMA-family decoder (LLaMA 2/3, Mistral, Qwen2, SmolLM) cut to one pipeline stage.

A stage owns half-layer units [start, end) (unit 2i: layer i's attention block, 2i + 1: its
MLP), so a stage boundary may fall inside a layer; the first stage also embeds token ids, the
last also applies the final norm and the LM head. Linear layers run once over every token of
the micro-batch (prefill chunk and decodes together); only attention looks at sequences.

    model = StageModel(cfg, (0, 2 * cfg.num_layers), TPContext(), torch.float32, "cpu", "torch", True, True)
    model.prepare_layer_loop()   # optional: the layers as one C++ call where the kernels take them
    hidden = model(token_ids, meta, kv_caches)   # (T, H)
    logits = model.logits(hidden[meta.sample_idx])   # (S, V)
    sampled = model(token_ids, meta, kv_caches, keep=meta.sample_idx)   # (S, H): what the worker runs
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pp_runtime.config import ModelConfig
from stages import cpu_kernels, triton_elementwise
from stages.attention import AttentionMetadata, make_backend
from stages.layer_loop import LayerLoop
from stages.layers import (ColumnParallelLinear, ParallelLMHead, RMSNorm, RotaryEmbedding,
                           RowParallelLinear, TPContext, VocabParallelEmbedding)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: TPContext, dtype: torch.dtype, rope: RotaryEmbedding,
                 backend: object) -> None:
        super().__init__()
        self.heads = cfg.num_heads // ctx.size
        self.kv_heads = cfg.num_kv_heads // ctx.size
        self.head_dim = cfg.head_size
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, (cfg.q_size, cfg.kv_size, cfg.kv_size),
                                             cfg.qkv_bias, ctx, dtype)
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, False, ctx, dtype)
        self.rope = rope
        self.backend = backend

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, kv: tuple[torch.Tensor, torch.Tensor],
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """(T, H) -> (T, H); with ``keep`` (S,) row indices, o_proj runs on those rows only -> (S, H)."""
        t, h, hkv, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # (T, (Hq + 2·Hkv)/tp · D): q, k, v side by side
        qk = self.rope(meta.positions, qkv[:, :(h + hkv) * d].view(t, h + hkv, d), meta.backend_cache)
        q, k = qk[:, :h], qk[:, h:]  # (T, Hq/tp, D), (T, Hkv/tp, D)
        v = qkv[:, (h + hkv) * d:].view(t, hkv, d)
        o = self.backend.forward(q, k, v, kv[0], kv[1], meta).reshape(t, -1)  # (T, Hq/tp · D)
        return self.o_proj(o if keep is None else o.index_select(0, keep))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate and up fused in one column-parallel linear."""

    def __init__(self, cfg: ModelConfig, ctx: TPContext, dtype: torch.dtype) -> None:
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, (i, i), False, ctx, dtype)
        self.down_proj = RowParallelLinear(i, cfg.hidden_size, False, ctx, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2I/tp)
        if self.down_proj.takes_gated(gate_up):  # silu · up made as the int8 product quantizes it
            return self.down_proj(gate_up, gated=True)
        # one pass on CPU: torch's SiLU on the strided gate half is 2x slower
        if cpu_kernels.usable(gate_up) and gate_up.is_contiguous():
            return self.down_proj(cpu_kernels.silu_mul(gate_up))
        if triton_elementwise.takes(gate_up) and gate_up.stride(-1) == 1:  # one kernel, not two
            return self.down_proj(triton_elementwise.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))  # in place: one (T, I) buffer fewer


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then h + mlp(norm(h)). A layer cut by a stage boundary keeps only its
    attention block (the stage before) or only its MLP block (the stage after); the residual
    stream h is what crosses the boundary, as between whole layers."""

    def __init__(self, cfg: ModelConfig, ctx: TPContext, dtype: torch.dtype, rope: RotaryEmbedding,
                 backend: object, attn: bool = True, mlp: bool = True) -> None:
        super().__init__()
        if attn:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
            self.self_attn = Attention(cfg, ctx, dtype, rope, backend)
        if mlp:
            self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
            self.mlp = MLP(cfg, ctx, dtype)
        self.has_attn, self.has_mlp = attn, mlp

    def forward(self, x: torch.Tensor, meta: AttentionMetadata,
                kv: tuple[torch.Tensor, torch.Tensor] | None, keep: torch.Tensor | None = None) -> torch.Tensor:
        """(T, H) -> (T, H); with ``keep`` (S,) row indices, only those rows go on past the
        attention (its K/V writes and keys still cover every row) -> (S, H)."""
        if not self.has_attn:
            x = x if keep is None else x.index_select(0, keep)
            return self.mlp(self.post_attention_layernorm(x)).add_(x)
        a = self.self_attn(self.input_layernorm(x), meta, kv, keep)  # (T | S, H), o_proj's fresh output
        x = x if keep is None else x.index_select(0, keep)
        if not self.has_mlp:
            return a.add_(x)
        h, hn = self.post_attention_layernorm.add_forward(a, x)
        return self.mlp(hn).add_(h)  # the MLP's output is fresh: the residual goes into it


class StageModel(nn.Module):
    def __init__(self, cfg: ModelConfig, units: tuple[int, int], ctx: TPContext, dtype: torch.dtype,
                 device: str, attention: str, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.cfg, self.units, self.is_first, self.is_last = cfg, units, is_first, is_last
        self.layer_range = (units[0] // 2, (units[1] + 1) // 2)  # layers this stage holds a part of
        self.backend = make_backend(attention, device, cfg.head_size, dtype)
        rope = RotaryEmbedding(cfg.head_size, cfg.max_position_embeddings, cfg.rope_theta)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx, dtype) if is_first else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, ctx, dtype, rope, self.backend,
                                                 attn=units[0] <= 2 * i, mlp=2 * i + 1 < units[1])
                                    for i in range(*self.layer_range))
        self.num_attention_layers = sum(layer.has_attn for layer in self.layers)  # each has a KV cache
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if is_last else None
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx, dtype) if is_last else None
        if is_first and is_last and cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # one tensor, as in the checkpoint
        self.rope = rope
        self.layer_loop: LayerLoop | None = None  # prepare_layer_loop

    def prepare_layer_loop(self) -> bool:
        """Run the layers as one C++ call (stages/layer_loop.py) on the steps whose every op would
        take a CPU kernel anyway: the same bits, without ~0.1 ms of Python a layer. Call once the
        weights are final (packed, precision set); returns whether it applies."""
        self.layer_loop = LayerLoop.build(self)
        return self.layer_loop is not None

    def weight_names(self) -> dict[str, nn.Parameter]:
        """HF checkpoint name -> parameter, with this stage's global layer indices."""
        out: dict[str, nn.Parameter] = {}
        for name, p in self.named_parameters():
            if name.startswith("layers."):
                local, rest = name[len("layers."):].split(".", 1)
                name = f"layers.{int(local) + self.layer_range[0]}.{rest}"
            out[name if name.startswith("lm_head") else f"model.{name}"] = p
        return out

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """x: token ids (T,) on the first stage, else hidden states (T, H). Returns (T, H).
        kv_caches: one (K, V) per layer with attention, in order.

        keep (the last stage: the rows it samples, ascending, distinct) -> (S, H), those rows of the (T, H):
        past the model's last attention nothing but the LM head reads the other rows, so the last
        layer's o_proj and MLP run on S rows, not T (a 256-token chunk with one sampled row skips
        ~84% of a layer's linears: ~1/36 of a 30-layer forward). A keep of every row (decodes only)
        runs the whole layer."""
        if keep is not None and not self.is_last:
            raise ValueError("StageModel.forward: keep applies to the last stage only")
        h = self.embed_tokens(x) if self.is_first else x
        # every row, ascending: keep is the identity (no copy); an empty one (a chunk that ends no
        # prompt, no decodes) is cut too: past the K/V writes, 0 rows
        if keep is not None and keep.numel() == h.shape[0]:
            keep = None
        if self.layer_loop is not None and self.layer_loop.takes(h, kv_caches):
            return self.layer_loop.forward(h, meta, kv_caches, keep)
        caches = iter(kv_caches)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h = layer(h, meta, next(caches) if layer.has_attn else None, keep if i == last else None)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(S, H) hidden at sampling positions -> (S, V) float32 logits over the full vocabulary."""
        return self.lm_head(self.norm(h)).float()

    def argmax_tokens(self, h: torch.Tensor) -> torch.Tensor:
        """(S, H) -> (S,) int64: ``logits(h).argmax(-1)``, the same ids, without the full fp32
        logits where the LM head can (ParallelLMHead.prepare_argmax): greedy rows need no more."""
        return self.lm_head(self.norm(h), argmax_only=True)
