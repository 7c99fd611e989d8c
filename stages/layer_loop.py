"""A stage's decoder layers as one C++ call on CPU (stages/csrc/stack.h), in place of the
Python loop over them.

Per layer, stages/model.py makes ~10 nn.Module calls and ~10 kernel calls from Python: ~0.1 ms
of interpreter a layer, a quarter of a 1-row decode step at 1 thread, during which the other
OpenMP thread spins. LayerStack runs the same kernels in the same order with the same arguments,
so a step's hidden states come out bit for bit as the Python loop's; it applies where every op
of that loop would take its CPU kernel anyway. Per-op timing (stages/op_timing.py) times the
same five buckets inside the C++ loop, so a profile measures the path a deployment runs.

    loop = LayerLoop.build(model)            # None where the layers do not fit it
    if loop is not None and loop.takes(h, kv_caches):
        h = loop.forward(h, meta, kv_caches)  # (T, H)
"""
from __future__ import annotations

import torch
from torch import nn

from pp_runtime.profile_stats import OPS
from stages import cpu_kernels
from stages.attention import AttentionMetadata
from stages.attention.torch_backend import TorchAttention, decode_lens
from stages.layers import RowParallelLinear

_NONE = torch.empty(0)  # a slot the layer does not have (stack.h: numel 0)


class LayerLoop:
    def __init__(self, stack: object) -> None:
        self.stack = stack
        # stages.op_timing.OpTimer while instrumented: each op's seconds, timed inside the C++
        # loop, are added to its buckets (the hooks there fire on the Python loop only)
        self.timer: object | None = None

    @staticmethod
    def build(model: nn.Module) -> LayerLoop | None:
        """The C++ stack over ``model``'s layers (a StageModel whose weights are final: packed or
        block-quantized, precision set), or None where its Python loop would not run every op on a
        CPU kernel: no kernels, another attention backend or head size, tensor parallelism (the
        all-reduces stay in Python), weights torch multiplies, a bias after a row-parallel linear."""
        cfg, layers = model.cfg, list(model.layers)
        # a CUDA model never takes it: asked first, so that no CPU kernel build starts (~60 s) for it
        if not layers or next(model.parameters()).device.type != "cpu":
            return None
        if not (cpu_kernels.available() and type(model.backend) is TorchAttention
                and cfg.head_size % cpu_kernels.TILE == 0):
            return None
        weights, linears = [], []
        for layer in layers:
            attn = layer.self_attn if layer.has_attn else None
            mlp = layer.mlp if layer.has_mlp else None
            parts = [layer.input_layernorm.weight if attn else _NONE,
                     attn.qkv_proj.weight if attn else _NONE,
                     attn.qkv_proj.bias if attn and attn.qkv_proj.bias is not None else _NONE,
                     attn.o_proj.weight if attn else _NONE,
                     layer.post_attention_layernorm.weight if mlp else _NONE,
                     mlp.gate_up_proj.weight if mlp else _NONE,
                     mlp.down_proj.weight if mlp else _NONE]
            linears += ([attn.qkv_proj, attn.o_proj] if attn else []) + ([mlp.gate_up_proj, mlp.down_proj] if mlp else [])
            weights += [p.detach() for p in parts]
        row_parallel = [m for m in linears if isinstance(m, RowParallelLinear)]
        # one products setting for the stack: "int8" leaves fp32 panels (a QKV fused from two GGUF
        # types) on fp32 products in stack.h as set_matmul_precision does, so that mix is one too
        kinds = {m.products for m in linears}
        products = kinds.pop() if len(kinds) == 1 else "int8" if kinds == {"fp32", "int8"} else None
        if any(m.weight.dim() != 3 or m.weight.device.type != "cpu" for m in linears) \
                or any(m.ctx.size != 1 or m.bias is not None for m in row_parallel) \
                or products is None \
                or any(p.numel() and p.dim() == 1 and (p.dtype != torch.float32 or not p.is_contiguous())
                       for p in weights):
            return None
        rope = model.rope
        return LayerLoop(cpu_kernels.layer_stack(weights, cfg.num_heads, cfg.num_kv_heads, cfg.head_size,
                                                 model.backend.scale, cfg.rms_norm_eps, products,
                                                 model.backend.bf16, model.backend.decode_bf16_over, rope.cos,
                                                 rope.sin))

    @staticmethod
    def takes(h: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether this step's activations and caches are what the kernels take (the Python loop
        checks the same op by op)."""
        return cpu_kernels.usable(h) and h.dim() == 2 and h.is_contiguous() \
            and all(k.is_contiguous() and v.is_contiguous() for k, v in kv_caches)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], keep: torch.Tensor | None = None) -> torch.Tensor:
        """(T, H) -> (T, H) after every layer; kv_caches: (K, V) of each layer with attention.
        keep: (S,) rows that alone go on past the last layer's attention -> (S, H) (StageModel.forward)."""
        n = meta.num_prefills
        step = cpu_kernels.step_meta(meta.positions, meta.slot_mapping, meta.q_lens[:n], meta.ctx_lens[:n],
                                     meta.prefill_tables, meta.decode_tables if meta.num_decodes else None,
                                     decode_lens(meta) if meta.num_decodes else None)
        caches = [t for kv in kv_caches for t in kv]
        if self.timer is None:
            return self.stack.forward(h, caches, step, keep=keep)
        times = torch.zeros(len(OPS), dtype=torch.float64)  # seconds: preproj, attn, postproj, ffn_ln1, ffn_ln2
        out = self.stack.forward(h, caches, step, times, keep)
        for op, sec in zip(OPS, times.tolist()):
            self.timer.acc[op] = self.timer.acc.get(op, 0.0) + sec
        return out
