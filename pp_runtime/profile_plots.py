"""Plots of a profile.csv (pp_runtime/report.py makes them): per-token cost vs batch size
(Figure 3) beside the per-operation breakdown of decode-only vs mixed batches at the same B (Table 2)."""
from __future__ import annotations

import csv
import statistics
from collections import defaultdict
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.ticker import ScalarFormatter

from pp_runtime.figures import KIND_COLORS, new_figure, save, wants_log

OPS = ("preproj", "attn", "postproj", "ffn_ln1", "ffn_ln2", "others")
OP_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B2", "#9E9E9E")


def _num(v: str | None) -> float | None:
    try:
        return float(v) if v not in (None, "") else None
    except ValueError:
        return None


def load_profile(path: Path) -> list[dict]:
    """profile.csv rows: 'kind' stays text, every other column a float (None when empty)."""
    with open(path, newline="", encoding="utf-8") as f:
        return [{k: (v.strip() if k == "kind" else _num(v)) for k, v in row.items() if k}
                for row in csv.DictReader(f)]


def _mean_by(rows: list[dict], x: str, y: str) -> list[tuple[float, float]]:
    # several context lengths per batch size: their mean is the cost at that size
    groups: dict[float, list[float]] = defaultdict(list)
    for row in rows:
        if row.get(x) is not None and row.get(y) is not None:
            groups[row[x]].append(row[y])
    return sorted((k, statistics.mean(v)) for k, v in groups.items())


def _of_kind(rows: list[dict], kind: str) -> list[dict]:
    return [r for r in rows if r.get("kind") == kind]


def _fresh_prefills(rows: list[dict]) -> list[dict]:
    """Prefill rows of whole prompts (context_len 0); chunks after a cached context cost more
    attention and would blur the size trend, so they count only when there is nothing else."""
    pre = _of_kind(rows, "prefill")
    fresh = [r for r in pre if not r.get("context_len")]
    return fresh or pre


def _plot_cost_curves(ax: Axes, rows: list[dict]) -> None:
    curves = [("prefill only (x = prefill tokens)", _mean_by(_fresh_prefills(rows), "prefill_tokens", "per_token_ms"),
               KIND_COLORS["prefill"], "-"),
              ("decode only (x = batch size B)", _mean_by(_of_kind(rows, "decode"), "decode_tokens", "per_token_ms"),
               KIND_COLORS["decode"], "-"),
              ("decode piggybacked in mixed batch (x = B)",
               _mean_by(_of_kind(rows, "mixed"), "decode_tokens", "per_decode_token_ms"), KIND_COLORS["mixed"], "--")]
    ys: list[float] = []
    for label, pts, color, style in curves:
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", ms=4, ls=style, color=color, label=label)
            ys += [y for _, y in pts]
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(ScalarFormatter())  # 1, 4, 16 read better than 2^0, 2^2, 2^4
    if wants_log(ys):
        ax.set_yscale("log")
    ax.set_xlabel("batch size (prefill: tokens; decode: requests B)")
    ax.set_ylabel("cost per token (ms)")
    ax.set_title("Per-token cost vs batch size")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)


def _breakdown_sizes(rows: list[dict], limit: int = 3) -> list[float]:
    """Up to `limit` decode batch sizes B that have both a decode-only and a mixed row."""
    dec = {r["decode_tokens"] for r in rows if r.get("kind") == "decode" and r.get("decode_tokens")}
    mix = {r["decode_tokens"] for r in rows if r.get("kind") == "mixed" and r.get("decode_tokens")}
    common = sorted(dec & mix)
    if len(common) <= limit:
        return common
    picks = [common[round(i * (len(common) - 1) / (limit - 1))] for i in range(limit)]
    return sorted(set(picks))


def _mean_ops(rows: list[dict]) -> dict[str, float]:
    return {op: statistics.mean((r.get(f"{op}_ms") or 0.0) for r in rows) for op in OPS + ("total",)}


def _plot_op_breakdown(ax: Axes, rows: list[dict]) -> None:
    sizes = _breakdown_sizes(rows)
    if not sizes:
        ax.text(0.5, 0.5, "no decode-only and mixed rows\nat the same batch size", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_axis_off()
        return
    # groups of bars, a gap between groups: the prefill-only batch of each mixed chunk size
    # (Table 2's first column, when profiled), then decode-only vs mixed for each B
    groups: list[list[tuple[str, dict[str, float]]]] = []
    mixed_p = sorted({r["prefill_tokens"] for r in rows if r.get("kind") == "mixed" and r.get("prefill_tokens")})
    fresh = [r for r in _fresh_prefills(rows) if r.get("prefill_tokens") in mixed_p]
    prefill_group = [(f"prefill\nP={p:g}", _mean_ops([r for r in fresh if r["prefill_tokens"] == p]))
                     for p in mixed_p if any(r["prefill_tokens"] == p for r in fresh)]
    if prefill_group:
        groups.append(prefill_group)
    for b in sizes:
        pair = []
        for kind in ("decode", "mixed"):
            match = [r for r in rows if r.get("kind") == kind and r.get("decode_tokens") == b]
            pre = statistics.mean((r.get("prefill_tokens") or 0.0) for r in match)
            pair.append((f"decode\nB={b:g}" if kind == "decode" else f"mixed\nP={pre:g}+B={b:g}", _mean_ops(match)))
        groups.append(pair)
    bars = [bar for g in groups for bar in g]
    xs = [gi * 0.5 + i for i, gi in enumerate(gi for gi, g in enumerate(groups) for _ in g)]
    bottom = [0.0] * len(bars)
    for op, color in zip(OPS, OP_COLORS):
        heights = [ops[op] for _, ops in bars]
        ax.bar(xs, heights, 0.8, bottom=bottom, color=color, label=op)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for x, total in zip(xs, bottom):
        ax.annotate(f"{total:.3g}", (x, total), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=7)
    ax.set_xticks(xs, [name for name, _ in bars], fontsize=8)
    ax.set_ylabel("time per batch (ms)")
    ax.set_title("Per-operation time per batch kind")
    ax.margins(y=0.1)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: no bar hidden


def plot_per_token_cost(profile_csv: Path, path: Path) -> str | None:
    rows = load_profile(profile_csv)
    if not rows:
        return None
    fig = new_figure(13, 4.8)
    left, right = fig.subplots(1, 2, width_ratios=[1.1, 1])
    _plot_cost_curves(left, rows)
    _plot_op_breakdown(right, rows)
    fig.suptitle(f"Operation costs ({profile_csv.parent.name}/{profile_csv.name})", fontsize=10)
    return save(fig, path)
