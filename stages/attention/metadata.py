"""One attention-metadata object for a mixed micro-batch, built once per step and shared by
every layer of the stage and by both backends.

Token layout of a micro-batch: the prefill chunks' tokens first (chunk after chunk), then
one token per decode. Chunk i has ``q_lens[i]`` new tokens at positions
``[starts[i], starts[i] + q_lens[i])`` and attends over ``ctx_lens[i] = starts[i] + q_lens[i]``
cached-plus-new tokens. K/V live in a paged cache of shape (num_blocks, block_size, H_kv, D);
the flat slot of position p of a sequence is ``table[p // bs] * bs + p % bs``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pp_runtime.batch import SeqChunk


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # (T,) position of every new token
    slot_mapping: torch.Tensor  # (T,) cache slot each new token's K/V is written to
    q_lens: list[int]  # per chunk, prefills then decodes
    ctx_lens: list[int]
    num_prefills: int
    num_prefill_tokens: int
    prefill_kv_slots: list[torch.Tensor]  # per prefill chunk: (ctx_len,) slots of its whole context
    decode_slots: torch.Tensor | None  # (D, L_max) padded slots of each decode's context
    decode_mask: torch.Tensor | None  # (D, L_max) True where a slot is real
    sample_idx: torch.Tensor  # (S,) token rows whose logits are sampled
    fresh_prefill: list[bool]  # per prefill chunk: nothing cached before it (start == 0)
    backend_cache: dict = field(default_factory=dict)  # per-step objects a backend builds once

    def all_kv_slots(self) -> torch.Tensor:
        """(ΣL,) every chunk's context slots, packed in chunk order."""
        parts = list(self.prefill_kv_slots)
        if self.decode_slots is not None:
            parts.append(self.decode_slots[self.decode_mask])  # row-major: decode after decode
        return torch.cat(parts)

    @property
    def num_decodes(self) -> int:
        return len(self.q_lens) - self.num_prefills


def _slots(table: torch.Tensor, start: int, end: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(start, end)
    return table[pos // block_size] * block_size + pos % block_size


def build_metadata(chunks: tuple[SeqChunk, ...], block_size: int, device: torch.device) -> AttentionMetadata:
    """Chunks must come prefills first (the scheduler's order)."""
    positions, slots, sample_rows, kv_slots, fresh = [], [], [], [], []
    q_lens, ctx_lens, decode_tables = [], [], []
    num_prefills = sum(1 for c in chunks if c.is_prefill)
    row = 0
    for i, c in enumerate(chunks):
        table = torch.tensor(c.block_table, dtype=torch.long)
        positions.append(torch.arange(c.start, c.context_len))
        slots.append(_slots(table, c.start, c.context_len, block_size))
        q_lens.append(c.num_tokens)
        ctx_lens.append(c.context_len)
        if i < num_prefills:
            kv_slots.append(_slots(table, 0, c.context_len, block_size).to(device))
            fresh.append(c.start == 0)
        else:
            decode_tables.append(_slots(table, 0, c.context_len, block_size))
        row += c.num_tokens
        if c.sample is not None:
            sample_rows.append(row - 1)
    decode_slots = decode_mask = None
    if decode_tables:
        lmax = max(len(s) for s in decode_tables)
        decode_slots = torch.zeros(len(decode_tables), lmax, dtype=torch.long)
        decode_mask = torch.zeros(len(decode_tables), lmax, dtype=torch.bool)
        for j, s in enumerate(decode_tables):
            # Pad with the sequence's own first slot: the cache is allocated uninitialised, and
            # a masked-out key must still be finite (NaN × 0 weight is NaN).
            decode_slots[j, :] = s[0]
            decode_slots[j, :len(s)] = s
            decode_mask[j, :len(s)] = True
        decode_slots, decode_mask = decode_slots.to(device), decode_mask.to(device)
    return AttentionMetadata(
        positions=torch.cat(positions).to(device), slot_mapping=torch.cat(slots).to(device),
        q_lens=q_lens, ctx_lens=ctx_lens, num_prefills=num_prefills,
        num_prefill_tokens=sum(q_lens[:num_prefills]), prefill_kv_slots=kv_slots,
        decode_slots=decode_slots, decode_mask=decode_mask,
        sample_idx=torch.tensor(sample_rows, dtype=torch.long, device=device), fresh_prefill=fresh)
