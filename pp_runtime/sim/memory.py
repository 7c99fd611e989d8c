"""Memory model of a simulated deployment: the paper's B = ⌊(M_G − M_S)/(L·m_kv)⌋ per GPU.

The model is sharded TP × PP: a GPU of stage s holds 1/tp of its stage's layers (the first stage
also the embedding, the last the LM head) and the K/V of those layers for 1/tp of the KV heads.
Every stage holds the same block pool (one block table addresses all stages, as in the runtime),
so the tightest GPU sets the number of KV blocks and B.

B counts requests whose full-length K/V fits at once (the paper's batch size, and the runtime's
``pp_runtime.memory_plan.plan_memory``; the runtime's count cap is 64 a micro-batch, not B). With
PP, those requests are spread over the ``pp`` micro-batches in flight, so the paper's
per-micro-batch batch size is ⌊B / pp⌋.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from pp_runtime.sim.presets import Hardware, SimModel


@dataclass(frozen=True)
class SimMemoryPlan:
    budget_bytes: float  # M_G: usable memory per GPU
    weight_bytes: float  # M_S: of the tightest GPU
    kv_bytes_per_token: float  # m_kv per GPU (its layers, its KV heads)
    max_model_len: int  # L
    block_size: int
    num_blocks: int
    max_batch_b: int  # B: requests of length L whose K/V fits
    per_microbatch_b: int  # ⌊B / pp⌋

    def describe(self) -> str:
        gb = 1e9
        return (f"B = ⌊(M_G − M_S)/(L·m_kv)⌋ = ⌊({self.budget_bytes / gb:.2f} GB − {self.weight_bytes / gb:.2f} GB) / "
                f"({self.max_model_len} × {self.kv_bytes_per_token / 1e3:.1f} kB)⌋ = {self.max_batch_b} "
                f"({self.per_microbatch_b} per micro-batch); KV cache: {self.num_blocks} blocks of {self.block_size}")

    def to_json(self) -> dict:
        return asdict(self)


def stage_layers(num_layers: int, pp: int, partition: tuple[int, ...] | None = None) -> list[int]:
    if partition is not None:
        if len(partition) != pp or sum(partition) != num_layers or min(partition) <= 0:
            raise ValueError(f"partition {list(partition)} must be {pp} positive layer counts summing to {num_layers}")
        return list(partition)
    base, extra = divmod(num_layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


def weight_bytes_per_gpu(model: SimModel, layers: list[int], tp: int, dtype_bytes: int) -> list[float]:
    """M_S of a GPU of each stage."""
    pp = len(layers)
    out = []
    for s, n in enumerate(layers):
        params = n * model.layer_weight_params / tp
        if s == 0:
            params += model.embedding_params / tp
        if s == pp - 1:
            params += model.hidden_size  # final norm
            if not (model.tie_word_embeddings and pp == 1):
                params += model.embedding_params / tp  # LM head (a copy of tied embeddings when pp > 1)
        out.append(params * dtype_bytes)
    return out


def plan_memory(model: SimModel, hw: Hardware, pp: int, tp: int, max_model_len: int, block_size: int = 16,
                utilization: float = 0.9, reserve_gb: float = 0.0, dtype_bytes: int = 2,
                partition: tuple[int, ...] | None = None) -> SimMemoryPlan:
    """Raises ValueError when the model does not fit or one full-length request does not."""
    if not 0 < utilization <= 1:
        raise ValueError(f"memory utilization must be in (0, 1], got {utilization}")
    layers = stage_layers(model.num_layers, pp, partition)
    budget = hw.memory_bytes * utilization - reserve_gb * 1e9
    weights = weight_bytes_per_gpu(model, layers, tp, dtype_bytes)
    kv = [n * model.kv_bytes_per_token_per_layer(dtype_bytes, tp) for n in layers]
    tight = min(range(pp), key=lambda s: (budget - weights[s]) / kv[s])
    free = budget - weights[tight]
    if free <= 0:
        raise ValueError(f"model {model.name} does not fit: {weights[tight] / 1e9:.1f} GB of weights per GPU "
                         f"(tp={tp}, pp={pp}) exceed the {budget / 1e9:.1f} GB usable on {hw.name}")
    num_blocks = int(free // (block_size * kv[tight]))
    b = int(free // (max_model_len * kv[tight]))
    if b < 1:
        raise ValueError(f"memory too small: one request of max_model_len {max_model_len} needs "
                         f"{max_model_len * kv[tight] / 1e9:.2f} GB of K/V per GPU, {free / 1e9:.2f} GB are free "
                         f"(model {model.name}, tp={tp}, pp={pp}, {hw.name})")
    return SimMemoryPlan(budget, weights[tight], kv[tight], max_model_len, block_size, num_blocks, b, max(1, b // pp))
