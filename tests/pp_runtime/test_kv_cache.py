"""BlockManager: free-list accounting, block tables, growth, exhaustion and release.

Plain Python, no tensors. The property test drives random allocate/append/free sequences
against a dict model and checks, after every operation, that no block has two owners,
that free + owned blocks add up to the pool, and that every table holds exactly
ceil(tokens / block_size) blocks with its earlier blocks left where they were.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pp_runtime.kv_cache import BlockManager, blocks_for


def owned_blocks(bm: BlockManager, seq_ids: object) -> list[int]:
    return [b for s in seq_ids for b in bm.block_table(s)]


def check_invariants(bm: BlockManager, tokens: dict[int, int]) -> None:
    """Every block is free or owned by exactly one sequence; tables fit their token counts."""
    owned = owned_blocks(bm, tokens)
    assert len(owned) == len(set(owned)), "a block is owned twice"
    free = list(bm._free)
    assert len(free) == len(set(free)), "a block is on the free list twice"
    assert not set(free) & set(owned), "a block is both free and owned"
    assert bm.num_free + len(owned) == bm.num_blocks
    assert set(free) | set(owned) == set(range(bm.num_blocks))
    for seq, n in tokens.items():
        assert bm.num_tokens(seq) == n
        assert len(bm.block_table(seq)) == blocks_for(n, bm.block_size)


# ---- blocks_for and construction --------------------------------------------------------------
@pytest.mark.parametrize("tokens, size, expected", [
    (0, 16, 0), (1, 16, 1), (15, 16, 1), (16, 16, 1), (17, 16, 2), (40, 16, 3), (5, 1, 5), (7, 7, 1),
])
def test_blocks_for_rounds_up(tokens: int, size: int, expected: int) -> None:
    assert blocks_for(tokens, size) == expected


@pytest.mark.parametrize("num_blocks, block_size", [(0, 16), (4, 0), (-1, 16), (4, -2)])
def test_constructor_rejects_non_positive(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError, match="num_blocks > 0 and block_size > 0"):
        BlockManager(num_blocks, block_size)


def test_fresh_manager_is_all_free() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.num_free == 8
    assert bm.capacity_tokens == 32
    assert bm.block_table(3) == []
    assert bm.num_tokens(3) == 0
    assert bm.blocks_needed(3, 9) == 3
    check_invariants(bm, {})


# ---- allocate / append ------------------------------------------------------------------------
def test_allocate_takes_ceil_blocks_and_docstring_example() -> None:
    bm = BlockManager(num_blocks=64, block_size=16)
    table = bm.allocate(seq_id=0, extra_tokens=40)
    assert len(table) == 3 and len(set(table)) == 3
    assert bm.num_tokens(0) == 40
    assert bm.num_free == 61
    assert bm.append(0) == table  # token 41 still fits in block 3
    assert bm.num_free == 61
    assert bm.block_table(0) == [0, 1, 2]
    bm.free(0)
    assert bm.num_free == 64
    assert bm.block_table(0) == [] and bm.num_tokens(0) == 0


def test_append_grows_exactly_at_block_boundaries() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    bm.allocate(1, 4)
    assert len(bm.block_table(1)) == 1
    for n in range(5, 21):
        before = list(bm.block_table(1))
        bm.append(1)
        table = bm.block_table(1)
        assert bm.num_tokens(1) == n
        assert len(table) == blocks_for(n, 4)
        assert table[:len(before)] == before, "growing must not move earlier blocks"
        check_invariants(bm, {1: n})


def test_allocate_zero_tokens_takes_no_block() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    assert bm.allocate(5, 0) == []
    assert bm.num_free == 2
    assert bm.num_tokens(5) == 0


def test_negative_growth_is_rejected() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(0, 8)
    with pytest.raises(ValueError, match="extra_tokens"):
        bm.allocate(0, -5)
    check_invariants(bm, {0: 8})


def test_chunked_growth_equals_one_shot_allocation() -> None:
    a, b = BlockManager(32, 8), BlockManager(32, 8)
    a.allocate(0, 50)
    for n in (7, 1, 20, 13, 9):
        b.allocate(0, n)
    assert a.num_tokens(0) == b.num_tokens(0) == 50
    assert len(a.block_table(0)) == len(b.block_table(0)) == 7
    assert a.num_free == b.num_free == 25


def test_sequences_get_disjoint_tables() -> None:
    bm = BlockManager(num_blocks=20, block_size=3)
    tokens = {0: 7, 1: 1, 2: 9, 3: 3}
    for seq, n in tokens.items():
        bm.allocate(seq, n)
    for _ in range(4):  # interleaved growth
        for seq in tokens:
            bm.append(seq)
            tokens[seq] += 1
    check_invariants(bm, tokens)


# ---- exhaustion -------------------------------------------------------------------------------
def test_can_allocate_boundary() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(0, 5)  # 2 blocks, 3 free slots left in block 2
    assert bm.can_allocate(0, 3 + 8)  # fills block 2, then blocks 3 and 4
    assert not bm.can_allocate(0, 3 + 8 + 1)
    assert bm.can_allocate(1, 8)
    assert not bm.can_allocate(1, 9)


def test_memory_error_when_exhausted_leaves_state_unchanged() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.allocate(0, 4)
    before = (list(bm._free), list(bm.block_table(0)), bm.num_tokens(0))
    with pytest.raises(MemoryError, match="needs 2 KV blocks, 1 free"):
        bm.allocate(1, 3)
    with pytest.raises(MemoryError):
        bm.allocate(0, 3)
    assert (list(bm._free), list(bm.block_table(0)), bm.num_tokens(0)) == before
    assert bm.block_table(1) == [] and bm.num_tokens(1) == 0
    bm.append(0)  # exactly the last block still works
    bm.append(0)
    assert bm.num_free == 0
    with pytest.raises(MemoryError):
        bm.append(0)
    check_invariants(bm, {0: 6})


# ---- free -------------------------------------------------------------------------------------
def test_free_returns_blocks_for_reuse() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate(0, 4)
    bm.allocate(1, 4)
    assert bm.num_free == 0 and not bm.can_allocate(2, 1)
    released = set(bm.block_table(0))
    bm.free(0)
    assert bm.num_free == 2
    assert set(bm.allocate(2, 3)) == released
    check_invariants(bm, {1: 4, 2: 3})


def test_free_unknown_or_twice_is_a_no_op() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.free(9)
    bm.allocate(0, 3)
    bm.free(0)
    bm.free(0)
    assert bm.num_free == 4
    check_invariants(bm, {})


# ---- property: random allocate / append / free sequences --------------------------------------
_ops = st.lists(st.tuples(st.sampled_from(("allocate", "append", "free")), st.integers(0, 5),
                          st.integers(0, 12)), max_size=60)


@settings(max_examples=100, deadline=None)
@given(num_blocks=st.integers(1, 24), block_size=st.integers(1, 6), ops=_ops)
def test_random_operations_keep_accounting_exact(num_blocks: int, block_size: int,
                                                  ops: list[tuple[str, int, int]]) -> None:
    bm = BlockManager(num_blocks, block_size)
    model: dict[int, int] = {}  # seq -> tokens it holds
    for op, seq, n in ops:
        before = {s: list(bm.block_table(s)) for s in model}
        if op == "free":
            bm.free(seq)
            model.pop(seq, None)
        else:
            extra = 1 if op == "append" else n
            total = model.get(seq, 0) + extra
            need = blocks_for(total, block_size) - len(bm.block_table(seq))
            assert bm.can_allocate(seq, extra) == (need <= bm.num_free)
            if need <= bm.num_free:
                table = bm.allocate(seq, extra) if op == "allocate" else bm.append(seq)
                assert table == bm.block_table(seq)
                model[seq] = total
            else:
                free_before = bm.num_free
                with pytest.raises(MemoryError):
                    bm.allocate(seq, extra) if op == "allocate" else bm.append(seq)
                assert bm.num_free == free_before
        for s, table in before.items():  # nobody's existing blocks move or change owner
            if s in model:
                assert bm.block_table(s)[:len(table)] == table
        check_invariants(bm, model)
    for s in list(model):
        bm.free(s)
    assert bm.num_free == num_blocks
