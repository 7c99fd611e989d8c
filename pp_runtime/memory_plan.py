"""How many KV blocks (and full-length requests) fit, from the workers' memory profiles.

    plan = plan_memory(executor.memory_profiles(), block_size=16, max_model_len=2048)
    executor.allocate_cache(plan.num_blocks); print(plan.describe())
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryPlan:
    """Derived from the workers' memory profiles (the paper's §3: B = ⌊(M_G − M_S)/(L·m_kv)⌋)."""

    num_blocks: int
    max_batch_b: int
    budget_bytes: int
    weight_bytes: int
    kv_bytes_per_token: int
    max_model_len: int

    def describe(self) -> str:
        gib = 1 << 30
        return (f"B = ⌊(M_G − M_S)/(L·m_kv)⌋ = ⌊({self.budget_bytes / gib:.4g} GiB − "
                f"{self.weight_bytes / gib:.3g} GiB) / ({self.max_model_len} × {self.kv_bytes_per_token} B)⌋ "
                f"= {self.max_batch_b}; KV cache: {self.num_blocks} blocks")


def plan_memory(profiles: list, block_size: int, max_model_len: int) -> MemoryPlan:
    """Every stage holds the same block pool, so the tightest worker sets its size. A stage
    holding only the MLP half of a layer (partition 3.5, 0.5) keeps no K/V and sets nothing."""
    holders = [p for p in profiles if p.kv_bytes_per_token > 0]
    tight = min(holders, key=lambda p: (p.budget_bytes - p.weight_bytes) / p.kv_bytes_per_token)
    free = tight.budget_bytes - tight.weight_bytes
    num_blocks = max(0, free // (block_size * tight.kv_bytes_per_token))
    return MemoryPlan(num_blocks, max(0, free // (max_model_len * tight.kv_bytes_per_token)),
                      tight.budget_bytes, tight.weight_bytes, tight.kv_bytes_per_token, max_model_len)
