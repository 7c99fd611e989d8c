"""Roofline cost model: a per-layer op time from a :class:`~pp_runtime.sim.presets.Hardware` preset.

Op time = max(FLOPs / (peak · eff), bytes / (bandwidth · eff)) + a kernel-launch overhead. Linear
ops read their weights once per micro-batch (so decodes alone are memory-bound and ride almost free
on a prefill chunk); attention reads the K/V of every sequence it attends over.

    from pp_runtime.sim.roofline_cost import RooflineCostModel
    cost = RooflineCostModel(model_preset("gpt3-175b"), hardware_preset("a100-80gb"))  # sim.presets
    cost.layer_ops(BatchShape.build([(512, 0)]), tp=8)   # seconds per op of one layer, in OPS order
"""
from __future__ import annotations

from pp_runtime.sim.batch_shape import LINEAR_OPS, OPS, BatchShape
from pp_runtime.sim.presets import Hardware, SimModel


class RooflineCostModel:
    """Analytic roofline of ``model`` on ``hw`` (see the module docstring)."""

    def __init__(self, model: SimModel, hw: Hardware, dtype_bytes: int = 2) -> None:
        self.model, self.hw, self.dt = model, hw, dtype_bytes
        self._overhead = hw.op_overhead_us * 1e-6
        self._flops, self._attn_flops, self._bw = hw.flops, hw.attn_flops, hw.mem_bw

    def _matmul(self, tokens: int, k: float, n: float) -> tuple[float, float]:
        """(compute s, memory s) of [tokens, k] @ [k, n]: weights read once, activations in and out."""
        flops = 2.0 * tokens * k * n
        nbytes = (k * n + tokens * (k + n)) * self.dt
        return flops / self._flops, nbytes / self._bw

    def _op(self, tokens: int, k: float, n: float) -> float:
        if tokens <= 0:
            return 0.0
        c, m = self._matmul(tokens, k, n)
        return max(c, m) + self._overhead

    def linear_bounds(self, shape: BatchShape, tp: int = 1) -> dict[str, str]:
        """'compute' or 'memory' for each linear op: which side of the roofline it is on."""
        T = shape.tokens
        dims = self._linear_dims(tp)
        out = {}
        for op in LINEAR_OPS:
            c, mem = self._matmul(T, *dims[op])
            out[op] = "compute" if c >= mem else "memory"
        return out

    def attention_parts(self, shape: BatchShape, tp: int = 1) -> dict[str, tuple[float, float]]:
        """(compute s, memory s) of the prefill and decode attention kernels."""
        m, dt = self.model, self.dt
        q, kv = m.q_size / tp, max(m.num_kv_heads / tp, 1.0) * m.head_size
        out = {}
        if shape.prefill_tokens:
            flops = 4.0 * shape.prefill_pairs * q
            nbytes = (shape.prefill_kv * 2 * kv + shape.prefill_tokens * (2 * q + 2 * kv)) * dt
            out["prefill"] = (flops / self._attn_flops, nbytes / self._bw)
        if shape.decode_tokens:
            flops = 4.0 * shape.decode_kv * q
            nbytes = (shape.decode_kv * 2 * kv + shape.decode_tokens * (2 * q + 2 * kv)) * dt
            out["decode"] = (flops / self._attn_flops, nbytes / self._bw)
        return out

    def _linear_dims(self, tp: int) -> dict[str, tuple[float, float]]:
        m = self.model
        h = m.hidden_size
        return {"preproj": (h, (m.q_size + 2 * m.kv_size) / tp), "postproj": (m.q_size / tp, h),
                "ffn_ln1": (h, m.mlp_up_size / tp), "ffn_ln2": (m.intermediate_size / tp, h)}

    def layer_ops(self, shape: BatchShape, tp: int) -> tuple[float, ...]:
        T = shape.tokens
        if T <= 0:
            return (0.0,) * len(OPS)
        m = self.model
        dims = self._linear_dims(tp)
        lin = [self._op(T, *dims[op]) for op in LINEAR_OPS]
        attn = sum(max(c, mem) + self._overhead for c, mem in self.attention_parts(shape, tp).values())
        # elementwise: 2 RMSNorms (read + write h), 2 residual adds (2 reads + 1 write), RoPE on q and k,
        # the activation (SiLU·mul reads gate and up, writes one)
        elem = (10 * m.hidden_size + 2 * (m.q_size + m.kv_size) / tp
                + (3 if m.gated_mlp else 2) * m.intermediate_size / tp)
        others = T * elem * self.dt / self._bw + 6 * self._overhead
        return (lin[0], attn, lin[1], lin[2], lin[3], others)

    def embed_s(self, shape: BatchShape, tp: int) -> float:
        return shape.tokens * self.model.hidden_size * self.dt / self._bw + self._overhead

    def head_s(self, shape: BatchShape, tp: int) -> float:
        m = self.model
        return self._op(shape.sampled, m.hidden_size, m.vocab_size / tp)

    def describe(self) -> dict:
        return {"kind": "roofline", "hardware": self.hw.name, "model": self.model.name, "dtype_bytes": self.dt,
                "efficiency": dict(self.hw.efficiency), "op_overhead_us": self.hw.op_overhead_us}
