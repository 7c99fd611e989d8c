"""BlockManager with prefix caching: registration, hits, sharing, eviction (least recently freed
first, a block's successors with it), twins, the last-token rule, reset.

The property test drives random sequences over a 3-token alphabet (so prompts share prefixes
often) and checks after every operation that each block is held, cached-and-unheld or free,
exactly once; that reference counts equal the tables holding a block; and that every block a
sequence holds under a registered key holds exactly that sequence's tokens there.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pp_runtime.kv_cache import BlockManager, blocks_for


def start(bm: BlockManager, seq: int, tokens: list[int]) -> int:
    """What the scheduler does for a whole prompt: share the cached prefix, allocate the rest,
    register what the prompt fills. Returns the tokens found cached."""
    cached = bm.take_prefix(seq, bm.cached_prefix(tokens))
    bm.allocate(seq, len(tokens) - cached)
    bm.register(seq, lambda s, e: tokens[s:e], len(tokens))
    return cached


def test_docstring_example() -> None:
    prompt, other = list(range(40)), list(range(32)) + [99] * 9
    bm = BlockManager(64, 16, prefix_caching=True)
    bm.allocate(0, 40)
    bm.register(0, lambda s, e: prompt[s:e], upto=40)
    hit = bm.cached_prefix(other)
    assert hit == bm.block_table(0)[:2]
    assert bm.take_prefix(1, hit) == 32
    assert bm.num_cached == 2


def test_off_by_default_finds_nothing() -> None:
    bm = BlockManager(8, 4)
    tokens = list(range(12))
    assert start(bm, 0, tokens) == 0
    assert bm.num_cached == 0 and bm.cached_prefix(tokens) == []


@pytest.mark.parametrize("length, blocks", [(1, 0), (4, 0), (5, 1), (8, 1), (9, 2), (12, 2), (13, 3)])
def test_the_last_token_is_always_computed(length: int, blocks: int) -> None:
    """A hit leaves at least one token to compute: its logits give the next token."""
    bm = BlockManager(16, 4, prefix_caching=True)
    start(bm, 0, list(range(20)))
    assert len(bm.cached_prefix(list(range(length)))) == blocks


def test_only_whole_blocks_whose_tokens_match_from_the_start() -> None:
    bm = BlockManager(16, 4, prefix_caching=True)
    start(bm, 0, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # blocks [1-4], [5-8] registered, [9, 10] partial
    assert len(bm.cached_prefix([1, 2, 3, 4, 5, 6, 7, 8, 0])) == 2
    assert len(bm.cached_prefix([1, 2, 3, 4, 5, 6, 7, 0, 0])) == 1
    assert bm.cached_prefix([0, 2, 3, 4, 5, 6, 7, 8, 0]) == []  # block 2 equal, block 1 not: no hit
    assert bm.cached_prefix([5, 6, 7, 8, 1, 2, 3, 4, 0]) == []
    assert bm.num_cached == 2


def test_shared_blocks_are_held_until_every_holder_frees() -> None:
    bm = BlockManager(6, 4, prefix_caching=True)
    a, b = list(range(10)), list(range(8)) + [50, 51, 52]
    start(bm, 0, a)
    assert start(bm, 1, b) == 8
    assert bm.block_table(1)[:2] == bm.block_table(0)[:2]
    assert bm.num_free == 6 - 3 - 1  # a: 3 blocks, b: 2 shared + 1 own
    bm.free(0)
    assert bm.num_free == 6 - 3  # a's partial block is free; the shared two are still held
    bm.free(1)
    assert bm.num_free == 6 and bm.num_cached == 2  # unheld, still cached
    assert start(bm, 2, a) == 8


def test_eviction_takes_the_least_recently_freed_and_tail_blocks_first() -> None:
    bm = BlockManager(3, 2, prefix_caching=True)
    start(bm, 0, [1, 2, 3, 4, 5])  # [1 2] [3 4] registered, [5] partial: all 3 blocks
    bm.free(0)  # [5]'s block free; [3 4] then [1 2] up for eviction (the tail first)
    start(bm, 1, [7, 8, 9])  # 2 blocks: the free one, then the oldest cached: [3 4]
    assert len(bm.cached_prefix([1, 2, 3, 4, 5])) == 1
    bm.free(1)  # [7 8] cached, freed after [1 2]
    start(bm, 2, [0, 0, 0, 0, 0])  # 3 blocks: [9]'s, then [1 2], then [7 8]
    assert bm.cached_prefix([1, 2, 3]) == [] and bm.cached_prefix([7, 8, 9]) == []
    assert bm.num_cached == 2  # seq 2's own [0 0] [0 0]


def test_evicting_a_block_drops_the_blocks_registered_after_it() -> None:
    bm = BlockManager(5, 2, prefix_caching=True)
    a = [1, 2, 3, 4, 5]
    start(bm, 0, a[:3])  # seq 0: [1 2] registered, [3] partial
    bm.take_prefix(1, [])  # seq 1 admitted beside it: its [1 2] is a twin
    bm.allocate(1, 5)
    bm.register(1, lambda s, e: a[s:e], 5)  # seq 1's [3 4] registered after seq 0's [1 2]
    assert len(bm.cached_prefix(a)) == 2
    bm.free(0)  # seq 0's [1 2] unheld, the only cached block up for eviction
    bm.allocate(2, 2 * 2)  # the free block, then the eviction
    assert bm.num_cached == 0 and bm.cached_prefix(a) == []  # seq 1's [3 4] is unreachable: gone too
    bm.free(1)
    assert len(bm._free) == 3 and not bm._evictable  # seq 1's blocks are plain free blocks now


def test_twins_are_not_registered_and_chains_continue_through_the_first() -> None:
    bm = BlockManager(16, 2, prefix_caching=True)
    a = [1, 2, 3, 4, 5]
    bm.take_prefix(0, [])
    bm.take_prefix(1, [])  # both admitted before either registered (the same micro-batch)
    bm.allocate(0, 5)
    bm.allocate(1, 5)
    bm.register(0, lambda s, e: a[s:e], 5)
    bm.register(1, lambda s, e: a[s:e], 5)
    assert bm.num_cached == 2  # seq 1's two full blocks are twins of seq 0's
    b = a + [6, 7]
    bm.allocate(1, 2)  # seq 1 fills its third block [5 6]: registered after seq 0's [3 4]
    bm.register(1, lambda s, e: b[s:e], 7)
    hit = bm.cached_prefix(b + [8])
    assert hit == bm.block_table(0)[:2] + [bm.block_table(1)[2]]


def test_a_twin_chain_whose_predecessor_is_evicted_stops_registering() -> None:
    bm = BlockManager(3, 2, prefix_caching=True)
    a = [1, 2, 3, 4, 5, 6]
    start(bm, 0, a[:3])  # [1 2] registered, [3] partial
    bm.take_prefix(1, [])
    bm.allocate(1, 2)
    bm.register(1, lambda s, e: a[s:e], 2)  # seq 1's [1 2] is a twin: its chain goes on from seq 0's
    bm.free(0)  # seq 0's [1 2] is unheld now, and the only free blocks are cached ones or seq 0's partial
    bm.allocate(1, 4)  # 2 blocks: the partial one, then the cached [1 2] is evicted (and reused)
    bm.register(1, lambda s, e: a[s:e], 6)
    assert bm.num_cached == 0, "seq 1's [3 4] chained to an evicted block would be found under the wrong content"


def test_can_admit_counts_unheld_hits_against_the_pool() -> None:
    bm = BlockManager(3, 2, prefix_caching=True)
    start(bm, 0, [1, 2, 3, 4, 5])
    bm.free(0)  # 3 unheld blocks, 2 of them cached
    hit = bm.cached_prefix([1, 2, 3, 4, 9])
    assert len(hit) == 2
    assert bm.can_admit(5, hit)  # 2 shared + 1 new = the 3 blocks
    assert not bm.can_admit(7, hit)


def test_reset_forgets_every_block() -> None:
    bm = BlockManager(4, 2, prefix_caching=True)
    start(bm, 0, [1, 2, 3, 4, 5])
    bm.free(0)
    bm.reset_prefix_cache()
    assert bm.num_cached == 0 and bm.num_free == 4 and len(bm._free) == 4
    assert bm.cached_prefix([1, 2, 3, 4, 5]) == []


def test_take_prefix_needs_a_fresh_sequence() -> None:
    bm = BlockManager(4, 2, prefix_caching=True)
    bm.allocate(0, 3)
    with pytest.raises(ValueError, match="seq 0 already holds blocks"):
        bm.take_prefix(0, [])


# ---- property: random prompts that share prefixes -------------------------------------------
_ops = st.lists(st.tuples(st.sampled_from(("start", "grow", "free")), st.integers(0, 5),
                          st.lists(st.integers(0, 2), min_size=1, max_size=14)), max_size=50)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 16), block_size=st.integers(1, 4), ops=_ops)
def test_random_sharing_keeps_accounting_and_contents_exact(num_blocks: int, block_size: int,
                                                            ops: list[tuple[str, int, list[int]]]) -> None:
    bm = BlockManager(num_blocks, block_size, prefix_caching=True)
    held: dict[int, list[int]] = {}  # seq -> its tokens
    for op, seq, tokens in ops:
        if op == "free":
            bm.free(seq)
            held.pop(seq, None)
        elif op == "start" and seq not in held:
            hit = bm.cached_prefix(tokens)
            if bm.can_admit(len(tokens), hit):
                start(bm, seq, tokens)
                held[seq] = list(tokens)
        elif op == "grow" and seq in held and bm.can_allocate(seq, len(tokens)):
            held[seq] += tokens
            bm.allocate(seq, len(tokens))
            bm.register(seq, lambda s, e, t=held[seq]: t[s:e], len(held[seq]))
        check(bm, held)


def check(bm: BlockManager, held: dict[int, list[int]]) -> None:
    tables = {s: bm.block_table(s) for s in held}
    owned = [b for t in tables.values() for b in t]
    free, evictable = list(bm._free), list(bm._evictable)
    assert len(free) == len(set(free)) and not set(free) & set(evictable) and not set(free) & set(owned)
    assert not set(evictable) & set(owned), "a held block is up for eviction"
    assert set(free) | set(evictable) | set(owned) == set(range(bm.num_blocks))
    assert set(evictable) <= set(bm._key_of), "an unregistered block waits in the cache"
    for b in range(bm.num_blocks):
        assert bm._refs[b] == owned.count(b)
    for s, t in tables.items():
        assert len(t) == blocks_for(len(held[s]), bm.block_size) and bm.num_tokens(s) == len(held[s])
        bs, parent = bm.block_size, -1
        for i, b in enumerate(t):  # a registered block of this table holds this sequence's tokens
            key = bm._key_of.get(b)
            if key is not None:
                assert key[1] == tuple(held[s][i * bs:(i + 1) * bs])
                assert parent == -1 or key[0] == parent or key[0] in bm._key_of
            parent = b
    for key, b in bm._cached.items():
        assert bm._key_of[b] == key and (key[0] == -1 or key[0] in bm._key_of)
