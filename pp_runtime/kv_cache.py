"""Paged KV block manager: plain Python, no tensors.

The driver owns this bookkeeping; every stage's worker holds a cache tensor of the same
number of blocks for its own layers, so one block table addresses all stages at once.

    bm = BlockManager(num_blocks=64, block_size=16)
    bm.allocate(seq_id=0, extra_tokens=40) # 3 blocks
    bm.append(0)                           # token 41 still fits in block 3
    bm.block_table(0)                      # [0, 1, 2]
    bm.free(0)

With ``prefix_caching`` (vLLM's automatic prefix caching) a full block whose tokens have all
been scheduled is registered under its content: (the registered block before it, its tokens).
A new sequence whose tokens start with registered blocks shares them (reference counted) and
skips their prefill; a registered block nobody holds stays cached until a new block is needed,
least recently freed first:

    bm = BlockManager(64, 16, prefix_caching=True)
    bm.allocate(0, 40)                                 # seq 0: a 40-token prompt scheduled
    bm.register(0, lambda s, e: prompt[s:e], upto=40)  # its blocks 0 and 1 are full: registered
    hit = bm.cached_prefix(other)          # [0, 1] when other starts with the same 32 tokens
    bm.take_prefix(1, hit)                 # seq 1 starts with 32 tokens in the cache: 32

Keys are exact (tuples of token ids, chained by block id), so a hit never rests on a hash.
Why registering when a chunk is planned is safe: every stage runs micro-batches in issue order,
so a later micro-batch that reads a block runs after the one that writes it, on every stage;
and within a micro-batch every attention backend writes all of the batch's K/V into the cache
before any of it is read (stages/attention), so a prompt can share a block that an earlier
prompt of the same micro-batch fills.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable, Sequence

Key = tuple[int, tuple[int, ...]]  # (registered block before this one or -1, this block's tokens)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"BlockManager needs num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: deque[int] = deque(range(num_blocks))  # unregistered and unheld
        self._tables: dict[int, list[int]] = {}
        self._tokens: dict[int, int] = {}  # tokens each sequence's blocks must hold
        self._refs = [0] * num_blocks  # sequences holding each block
        self._cached: dict[Key, int] = {}  # registered blocks by content
        self._key_of: dict[int, Key] = {}
        self._children: dict[int, set[int]] = {}  # registered block -> blocks registered after it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, unheld: oldest first
        self._chain: dict[int, tuple[int, int]] = {}  # seq -> (its blocks walked, parent for the next; -2: stop)

    @property
    def num_free(self) -> int:
        """Blocks a new allocation can take: the unheld ones, cached or not."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._key_of)

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
        return self.blocks_needed(seq_id, extra_tokens) <= self.num_free

    def allocate(self, seq_id: int, extra_tokens: int) -> list[int]:
        """Grow ``seq_id`` by ``extra_tokens``; returns its block table. Raises if blocks run out."""
        if extra_tokens < 0:  # shrinking would leave the table holding more blocks than its tokens need
            raise ValueError(f"seq {seq_id}: extra_tokens must be ≥ 0, got {extra_tokens}")
        need = self.blocks_needed(seq_id, extra_tokens)
        if need > self.num_free:
            raise MemoryError(f"seq {seq_id} needs {need} KV blocks, {self.num_free} free")
        table = self._tables.setdefault(seq_id, [])
        for _ in range(need):
            b = self._take_block()
            self._refs[b] = 1
            table.append(b)
        self._tokens[seq_id] = self.num_tokens(seq_id) + extra_tokens
        return table

    def append(self, seq_id: int) -> list[int]:
        """Room for one more token (a decode step)."""
        return self.allocate(seq_id, 1)

    def free(self, seq_id: int) -> None:
        table = self._tables.pop(seq_id, [])
        self._tokens.pop(seq_id, None)
        self._chain.pop(seq_id, None)
        for b in table:
            self._refs[b] -= 1
        self._free.extend(b for b in table if self._refs[b] == 0 and b not in self._key_of)
        # a sequence's tail blocks are the least likely to be shared: evicted first
        for b in reversed(table):
            if self._refs[b] == 0 and b in self._key_of:
                self._evictable[b] = None

    def free_all(self) -> None:
        for seq_id in list(self._tables):
            self.free(seq_id)

    # ---- prefix caching ----------------------------------------------------------------------
    def cached_prefix(self, tokens: Sequence[int]) -> list[int]:
        """Registered blocks that hold the longest prefix of ``tokens`` in whole blocks, leaving at
        least the last token to compute (its logits give the next token)."""
        hit: list[int] = []
        if not self.prefix_caching:
            return hit
        parent, bs = -1, self.block_size
        for i in range((len(tokens) - 1) // bs):
            b = self._cached.get((parent, tuple(tokens[i * bs:(i + 1) * bs])))
            if b is None:
                break
            hit.append(b)
            parent = b
        return hit

    def can_admit(self, num_tokens: int, hit: Sequence[int]) -> bool:
        """Whether a new sequence of ``num_tokens`` fits the unheld blocks, ``hit`` shared: its new
        blocks plus the hit blocks that are unheld now (taking them removes them from the pool)."""
        return blocks_for(num_tokens, self.block_size) - len(hit) + self.num_unheld(hit) <= self.num_free

    def num_unheld(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` (cached ones) no sequence holds: taking them shrinks num_free."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def take_prefix(self, seq_id: int, hit: Sequence[int]) -> int:
        """Start ``seq_id`` (no blocks yet) on the cached blocks ``hit`` (from ``cached_prefix``);
        returns the tokens they hold (a request's num_cached_tokens, which the hit rate sums)."""
        if seq_id in self._tables:
            raise ValueError(f"seq {seq_id} already holds blocks")
        for b in hit:
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1
        self._tables[seq_id] = list(hit)
        self._tokens[seq_id] = len(hit) * self.block_size
        self._chain[seq_id] = (len(hit), hit[-1] if hit else -1)
        return len(hit) * self.block_size

    def register(self, seq_id: int, tokens: Callable[[int, int], Sequence[int]], upto: int) -> None:
        """Register ``seq_id``'s blocks that tokens [0, upto) fill; ``tokens(start, end)`` gives its
        token ids. A block whose content is registered already stays unregistered (its twin is
        the one found), and the sequence's next blocks chain to the twin."""
        if not self.prefix_caching:
            return
        walked, parent = self._chain.get(seq_id, (0, -1))
        table, bs = self._tables[seq_id], self.block_size
        for i in range(walked, min(upto // bs, len(table))):
            if parent == -2:  # the block before was evicted while this sequence held a twin of it
                break
            key = (parent, tuple(tokens(i * bs, (i + 1) * bs)))
            parent = self._cached.get(key, -1)
            if parent == -1:
                parent = table[i]
                self._cached[key] = parent
                self._key_of[parent] = key
                if key[0] >= 0:
                    self._children.setdefault(key[0], set()).add(parent)
            walked = i + 1
        self._chain[seq_id] = (walked, parent)

    def reset_prefix_cache(self) -> None:
        """Forget every registered block (runs compared side by side start equal)."""
        for b in list(self._evictable):
            self._free.append(b)
        self._evictable.clear()
        self._cached.clear()
        self._key_of.clear()
        self._children.clear()
        self._chain = {s: (w, -2) for s, (w, _) in self._chain.items()}

    def _take_block(self) -> int:
        if self._free:
            return self._free.popleft()
        b, _ = self._evictable.popitem(last=False)
        self._unregister(b)
        return b

    def _unregister(self, block: int) -> None:
        """``block`` and the blocks registered after it (unreachable without it) leave the cache;
        unheld ones among the latter go to the free list. Sequences chained to them stop registering."""
        stack = [block]
        while stack:
            b = stack.pop()
            key = self._key_of.pop(b)
            del self._cached[key]
            if key[0] >= 0:
                self._children.get(key[0], set()).discard(b)
            stack.extend(self._children.pop(b, ()))
            if b != block and self._refs[b] == 0:
                del self._evictable[b]
                self._free.append(b)
        for s, (w, p) in self._chain.items():
            if p >= 0 and p not in self._key_of:
                self._chain[s] = (w, -2)
