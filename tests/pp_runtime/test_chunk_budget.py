"""The FLOPs chunk budget's arithmetic (pp_runtime/chunk_budget.py): plain Python."""
from __future__ import annotations

import doctest

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pp_runtime import chunk_budget
from pp_runtime.chunk_budget import chunk_cost, fit_chunk, fits


@given(start=st.integers(0, 5000), remaining=st.integers(1, 600), budget=st.floats(0.0, 2000.0),
       key_cost=st.sampled_from([0.0, 4e-5, 3.26e-4, 0.02, 1.0]))
@settings(max_examples=300, deadline=None)
def test_fit_chunk_is_the_largest_chunk_within_the_budget(start: int, remaining: int, budget: float,
                                                         key_cost: float) -> None:
    n = fit_chunk(start, remaining, budget, key_cost)
    assert 0 <= n <= remaining
    assert n == 0 or fits(chunk_cost(start, n, key_cost), budget)
    assert n == remaining or not fits(chunk_cost(start, n + 1, key_cost), budget)


def test_chunk_cost_counts_each_tokens_keys() -> None:
    # positions 3, 4, 5 attend to 4, 5, 6 keys
    assert chunk_cost(3, 3, 0.5) == pytest.approx(3 + 0.5 * (4 + 5 + 6))
    assert chunk_cost(100, 7, 0.0) == 7


def test_module_examples() -> None:
    assert doctest.testmod(chunk_budget).failed == 0


def test_a_chunk_that_exactly_fits_what_is_left_is_taken() -> None:
    # what the scheduler holds after a (1, 5) chunk out of a fresh 6-token budget: 1.02 less a
    # rounding error, exactly one fresh token's cost; refused before (seen under longest_first)
    k = 0.02
    left = chunk_cost(0, 6, k) - chunk_cost(1, 5, k)
    assert left < chunk_cost(0, 1, k)  # the float sum lands just under
    assert fit_chunk(0, 11, left, k) == 1


def test_fits_allows_rounding_not_a_token() -> None:
    assert fits(2.0, 2.0) and fits(1.02, 1.0199999999999998) and fits(279.35616000000005, 279.35616)
    assert not fits(2.0, 1.9999999) and not fits(1.02, 1.0199)
    assert fit_chunk(0, 10, 1.9999999, 1.0) == 0  # a token at position 0 costs 2 at key_cost 1
