"""Sarathi's chunk budget in FLOPs: what a prompt chunk costs, and the largest chunk a budget buys.

A prompt token's linear layers cost the same wherever it sits in its prompt, but its attention
grows with the keys before it: the token at position p attends to p + 1 keys. With key_cost =
(attention FLOPs per key) / (linear FLOPs per token) (``HeadSizes.key_cost``), a chunk's cost in
fresh-token units is chunk_cost, and capping every chunk at chunk_cost(0, C) keeps micro-batches
equal in work however deep into its prompt a chunk is: equal stage steps, so no pipeline bubbles.

    >>> fit_chunk(0, 1000, chunk_cost(0, 256, 3.26e-4), 3.26e-4)      # a fresh chunk: C tokens
    256
    >>> fit_chunk(2048, 1000, chunk_cost(0, 256, 3.26e-4), 3.26e-4)   # deep in the prompt: fewer
    157
"""
from __future__ import annotations

import math

_SLACK = 1e-12  # relative: far above a budget's rounding after a batch's subtractions, far below a token


def fits(cost: float, budget: float) -> bool:
    """cost ≤ budget, within the float rounding of a budget the scheduler holds after subtracting
    earlier chunks' costs (a chunk that fits exactly can come out 1e-16 over: 1.02 asked of a
    1.0199999 left)."""
    return cost <= budget + _SLACK * max(1.0, abs(budget))


def chunk_cost(start: int, n: int, key_cost: float) -> float:
    """Cost of prompt tokens start .. start + n − 1 in tokens: each costs 1 for its linear layers
    plus key_cost per key it attends to (position p attends to p + 1 keys, itself included)."""
    return n + key_cost * (n * start + n * (n + 1) / 2)


def fit_chunk(start: int, remaining: int, budget: float, key_cost: float) -> int:
    """The most tokens (≤ remaining) from position ``start`` whose chunk_cost fits in budget (``fits``)."""
    if key_cost <= 0:
        return max(0, min(remaining, int(budget)))
    # chunk_cost(n) = budget is (k/2)·n² + (1 + k(start + ½))·n − budget = 0: its positive root,
    # then a step either way for float rounding
    b = 1 + key_cost * (start + 0.5)
    n = max(0, min(remaining, int((math.sqrt(b * b + 2 * key_cost * budget) - b) / key_cost)))
    while n > 0 and not fits(chunk_cost(start, n, key_cost), budget):
        n -= 1
    while n < remaining and fits(chunk_cost(start, n + 1, key_cost), budget):
        n += 1
    return n
