"""Paired rounds, for comparing two setups on a box whose speed drifts between runs.

    for k, side in alternating(rounds, ("hf", "ours")):   # hf, ours, then ours, hf, ...
        times[side].append(run(side))
    figure = statistics.median(ratios(times["hf"], times["ours"]))

On the project's CPU box the same run can take 10-30% more or less minutes later, more than most
changes measured. Each round runs both setups back to back (in alternating order, so neither
always goes first), each round gives one ratio, and the figure is the median of those ratios, not
the ratio of the two medians: a slow stretch of the box then moves both sides of a round.
"""
from __future__ import annotations

from typing import Iterator, Sequence, TypeVar

T = TypeVar("T")


def alternating(rounds: int, sides: Sequence[T]) -> Iterator[tuple[int, T]]:
    """(round, side) for every side in every round: in order in even rounds, reversed in odd."""
    for k in range(rounds):
        for side in (sides if k % 2 == 0 else list(reversed(sides))):
            yield k, side


def ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """num[k] / den[k] for every round (same length, every round complete): the figure is their
    median."""
    if len(num) != len(den) or not num:
        raise ValueError(f"paired rounds need equal, non-empty lists (got {len(num)} and {len(den)})")
    return [n / d for n, d in zip(num, den)]
