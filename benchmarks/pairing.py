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

from typing import Iterator, Mapping, Sequence, TypeVar

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


def generate_side(llm: object, prompts: list[list[int]], new_tokens: int, ignore_eos: bool = True) -> tuple[dict, list]:
    """One side's run: ``prompts`` all at once, exactly ``new_tokens`` each (checked) or, without
    ``ignore_eos``, up to ``new_tokens`` each until EOS; its wall seconds, total tokens/s ((prompt
    + generated) / wall), the tokens generated, TTFT p50 and p99 and each request's tokens, and
    the outputs (for what a benchmark adds of its own)."""
    import time

    from pp_runtime import SamplingParams
    from pp_runtime.timing import percentile
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=ignore_eos))
    wall = time.perf_counter() - t
    assert not ignore_eos or all(len(o.token_ids) == new_tokens for o in outs)
    ttft = [o.ttft_s for o in outs]
    generated = sum(len(o.token_ids) for o in outs)
    return {"wall_s": wall, "tok_s": (sum(map(len, prompts)) + generated) / wall, "generated": generated,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tokens": [o.token_ids for o in outs]}, outs


def compare_sides(rounds: Mapping[str, Sequence[dict]], base: str, new: str) -> tuple[float, float, float, dict]:
    """Two setups' paired rounds (dicts with tok_s, ttft_p50_s and each request's tokens): the least
    share of requests with base's first-round tokens in any run, the medians of new / base per round
    for tokens/s and TTFT p50, and the rounds without their tokens (for JSON)."""
    import statistics
    ref = rounds[base][0]["tokens"]
    same = min(sum(x == y for x, y in zip(r["tokens"], ref)) / len(ref) for side in rounds for r in rounds[side])
    speedup, ttft = (statistics.median(ratios([r[key] for r in rounds[new]], [r[key] for r in rounds[base]]))
                     for key in ("tok_s", "ttft_p50_s"))
    bare = {side: [{k: v for k, v in r.items() if k != "tokens"} for r in rs] for side, rs in rounds.items()}
    return same, speedup, ttft, bare


def plot_sides(rounds: Mapping[str, Sequence[dict]], sides: Sequence[str], labels: Sequence[str], title: str,
               path: str) -> None:
    """Two panels, total tokens/s and TTFT p50: a bar per side at its median, its rounds as dots
    (the last side, the one compared, in blue)."""
    import statistics

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 3.6 * len(sides)), 3.4))
    for ax, key, ylabel in ((axes[0], "tok_s", "total tokens/s"), (axes[1], "ttft_p50_s", "TTFT p50 (s)")):
        for i, side in enumerate(sides):
            ys = [r[key] for r in rounds[side]]
            ax.bar(i, statistics.median(ys), color="tab:blue" if i == len(sides) - 1 else ("tab:gray", "silver")[i % 2])
            ax.plot([i] * len(ys), ys, "k.", ms=4)
        ax.set_xticks(range(len(sides)), labels, fontsize=8)
        ax.set_ylabel(ylabel)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
