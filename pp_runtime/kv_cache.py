"""Paged KV block manager: plain Python, no tensors.

The driver owns this bookkeeping; every stage's worker holds a cache tensor of the same
number of blocks for its own layers, so one block table addresses all stages at once.

    bm = BlockManager(num_blocks=64, block_size=16)
    bm.allocate(seq_id=0, extra_tokens=40) # 3 blocks
    bm.append(0)                           # token 41 still fits in block 3
    bm.block_table(0)                      # [0, 1, 2]
    bm.free(0)
"""
from __future__ import annotations

from collections import deque


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"BlockManager needs num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[int, list[int]] = {}
        self._tokens: dict[int, int] = {}  # tokens each sequence's blocks must hold

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def num_tokens(self, seq_id: int) -> int:
        return self._tokens.get(seq_id, 0)

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables.get(seq_id, [])

    def blocks_needed(self, seq_id: int, extra_tokens: int) -> int:
        """New blocks ``seq_id`` needs to hold ``extra_tokens`` more tokens."""
        total = self.num_tokens(seq_id) + extra_tokens
        return max(0, blocks_for(total, self.block_size) - len(self.block_table(seq_id)))

    def can_allocate(self, seq_id: int, extra_tokens: int) -> bool:
        return self.blocks_needed(seq_id, extra_tokens) <= len(self._free)

    def allocate(self, seq_id: int, extra_tokens: int) -> list[int]:
        """Grow ``seq_id`` by ``extra_tokens``; returns its block table. Raises if blocks run out."""
        if extra_tokens < 0:  # shrinking would leave the table holding more blocks than its tokens need
            raise ValueError(f"seq {seq_id}: extra_tokens must be ≥ 0, got {extra_tokens}")
        need = self.blocks_needed(seq_id, extra_tokens)
        if need > len(self._free):
            raise MemoryError(f"seq {seq_id} needs {need} KV blocks, {len(self._free)} free")
        table = self._tables.setdefault(seq_id, [])
        table.extend(self._free.popleft() for _ in range(need))
        self._tokens[seq_id] = self.num_tokens(seq_id) + extra_tokens
        return table

    def append(self, seq_id: int) -> list[int]:
        """Room for one more token (a decode step)."""
        return self.allocate(seq_id, 1)

    def free(self, seq_id: int) -> None:
        self._free.extend(self._tables.pop(seq_id, []))
        self._tokens.pop(seq_id, None)
