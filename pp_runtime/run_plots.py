"""Plots of runs (pp_runtime/report.py makes them): the pipeline Gantt chart of one run, and, across
runs, the CDF of per-request bubble time, bubble time by cause, and throughput vs P:D ratio."""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from pp_runtime.figures import DPI, KIND_COLORS, KIND_LABELS, microbatch_kind, new_figure, save, wants_log
from pp_runtime.timing import TimingRecord, request_bubbles, stage_gaps

if TYPE_CHECKING:  # report imports this module: no import back at run time
    from pp_runtime.report import Run

CAUSES = ("PB1", "PB2", "PB3", "other")
CAUSE_COLORS = {"PB1": "#C44E52", "PB2": "#8172B2", "PB3": "#CCB974", "other": "#9E9E9E"}
CAUSE_LABELS = {"PB1": "PB1: prefills of different sizes", "PB2": "PB2: prefill after decode",
                "PB3": "PB3: decodes, different KV lengths", "other": "other (stage 0 waits, ...)"}
IDLE_COLOR = "#BDBDBD"
DEFAULT_WINDOW_MBS = 40  # ~40 bars per row is about what stays readable at 12 inches


def _mb_label(r: TimingRecord) -> str:
    kind = microbatch_kind(r)
    if kind == "mixed":
        return f"P{r.prefill_tokens}+D{r.decode_tokens}"
    return f"P{r.prefill_tokens}" if kind == "prefill" else f"D{r.decode_tokens}"


# ---- 1. Gantt chart ------------------------------------------------------------------------------
def gantt_window(records: list[TimingRecord], run_start: float, max_microbatches: int = DEFAULT_WINDOW_MBS,
                 max_seconds: float | None = None) -> float | None:
    """End of the readable window (seconds since run_start), or None when the whole run fits.

    By micro-batches: the first N that stage 0 ran (TP rank 0), until the last stage finishes
    them, so the window shows those micro-batches crossing the whole pipeline.
    """
    rank0 = [r for r in records if r.tp_rank == 0]
    if not rank0:
        return None
    run_end = max(r.t_end for r in rank0) - run_start
    if max_seconds is not None:
        return max_seconds if run_end > max_seconds else None
    first_stage = min(r.stage for r in rank0)
    stage0 = sorted((r for r in rank0 if r.stage == first_stage), key=lambda r: r.t_start)
    if len(stage0) <= max_microbatches:
        return None
    ids = {r.mb for r in stage0[:max_microbatches]}
    return max(r.t_end for r in rank0 if r.mb in ids) - run_start


def _gantt_rows(records: list[TimingRecord]) -> list[tuple[int, int, float, float]]:
    """(stage, tp_rank, y, height) per row: a full row for TP rank 0, thin rows for other ranks."""
    rows, y = [], 0.0
    for stage, rank in sorted({(r.stage, r.tp_rank) for r in records}):
        h = 0.8 if rank == 0 else 0.25
        rows.append((stage, rank, y, h))
        y += h + (0.2 if rank == 0 else 0.1)
    return rows


def _axes_pixels(fig: Figure) -> float:
    """The time axis' width in pixels, from the figure size (the axes take ~85% of it): cheap
    enough for runs with thousands of bars."""
    return 0.85 * fig.get_figwidth() * DPI


def _annotate_bars(ax: Axes, bars: list[tuple[TimingRecord, float, float]], y_mid: float,
                   px_per_s: float) -> None:
    # Label a bar only when its text fits inside it.
    fontsize = 7
    char_px = fontsize * 0.62 * DPI / 72
    for r, x, w in bars:
        text = _mb_label(r)
        if w * px_per_s <= len(text) * char_px + 4:
            text = text.replace("+", "\n")  # a mixed bar's label on two lines needs half the width
        if w * px_per_s > max(map(len, text.split("\n"))) * char_px + 4:
            ax.text(x + w / 2, y_mid, text, ha="center", va="center", fontsize=fontsize, color="white",
                    clip_on=True)


def merged_spans(spans: list[tuple[float, float]], gap_s: float) -> list[tuple[float, float]]:
    """(start, width) spans in time order, each run of spans less than ``gap_s`` apart drawn as
    one (unchanged when gap_s is 0)."""
    if gap_s <= 0:
        return spans
    out: list[list[float]] = []
    for start, width in sorted(spans):
        if out and start - (out[-1][0] + out[-1][1]) < gap_s:
            out[-1][1] = max(out[-1][1], start + width - out[-1][0])
        else:
            out.append([start, width])
    return [(a, w) for a, w in out]


def plot_gantt(run: Run, path: Path, t_max: float | None = None, window_note: str = "") -> str:
    """Gantt chart of the run (or of [0, t_max] seconds since run_start) to path."""
    t0 = run.run_start
    records = [r for r in run.records if t_max is None or r.t_start - t0 < t_max]
    rows = _gantt_rows(records)
    fig = new_figure(12, 1.3 + 0.75 * sum(1 if rk == 0 else 0.4 for _, rk, _, _ in rows))
    ax = fig.add_subplot()
    span = t_max if t_max is not None else max(r.t_end for r in records) - t0
    gaps = {(g.stage, g.mb): g.seconds for g in stage_gaps(run.records, t0)}
    kinds_seen: set[str] = set()
    pixels = _axes_pixels(fig)
    px_s = max(span, 1e-12) / pixels  # seconds a pixel
    by_row: dict[tuple[int, int], list[TimingRecord]] = defaultdict(list)
    for r in records:
        by_row[(r.stage, r.tp_rank)].append(r)
    for stage, rank, y, h in rows:
        mine = by_row[(stage, rank)]
        # A row with more bars than pixels (a long simulated run) is drawn at pixel resolution:
        # bars of a kind closer than a pixel merge, else drawing 10^5 bars takes minutes.
        merge_s = px_s if len(mine) > pixels else 0.0
        by_kind: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for r in mine:
            by_kind[microbatch_kind(r)].append((r.t_start - t0, r.t_end - r.t_start))
        edges = 0.0 if merge_s else 0.4  # white separators would paint over bars a pixel wide
        for kind, spans in by_kind.items():
            kinds_seen.add(kind)
            ax.broken_barh(merged_spans(spans, merge_s), (y, h), facecolors=KIND_COLORS[kind], edgecolors="white",
                           linewidths=edges)
        if rank == 0:
            # the idle gap before each micro-batch is exactly what the bubble accounting counts
            # (at pixel resolution only gaps of a pixel or more: merged, the many short ones would
            # hatch the busy time between them)
            idle = [(r.t_start - t0 - gaps[(stage, r.mb)], gaps[(stage, r.mb)]) for r in mine
                    if gaps.get((stage, r.mb), 0.0) > merge_s]
            ax.broken_barh(idle, (y, h), facecolors="none", edgecolors=IDLE_COLOR, hatch="////", linewidths=0)
            _annotate_bars(ax, [(r, r.t_start - t0, r.t_end - r.t_start) for r in mine], y + h / 2, 1 / px_s)
    ax.set_yticks([y + h / 2 for _, _, y, h in rows],
                  [f"stage {s}" if rk == 0 else f"tp rank {rk}" for s, rk, _, _ in rows])
    for tick, (_, rk, _, _) in zip(ax.get_yticklabels(), rows):
        tick.set_fontsize(9 if rk == 0 else 6)
    ax.set_ylim(rows[-1][2] + rows[-1][3] + 0.1, -0.1)  # stage 0 on top, as in the paper
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel("time since run start (s)")
    ax.grid(axis="x", alpha=0.3)
    s = run.summary
    settings = ", ".join(f"{k}={s[k]}" for k in ("pp", "tp", "chunk_size") if k in s)
    ax.set_title(f"Pipeline schedule: {run.label}" + (f" ({settings})" if settings else "")
                 + (f" — {window_note}" if window_note else ""))
    handles = [Patch(facecolor=KIND_COLORS[k], label=KIND_LABELS[k]) for k in KIND_COLORS if k in kinds_seen]
    handles.append(Patch(facecolor="white", edgecolor=IDLE_COLOR, hatch="////", label="idle (bubble)"))
    # outside the axes, below the x label: a legend inside would cover bars
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False)
    return save(fig, path)


def gantt_plots(run: Run, window_mbs: int = DEFAULT_WINDOW_MBS, window_s: float | None = None) -> list[str]:
    """gantt.png (windowed when the run is long) and, for a long run, gantt_full.png."""
    if not run.records:
        return []
    t_max = gantt_window(run.records, run.run_start, window_mbs, window_s)
    note = f"first {window_s:g} s" if window_s is not None else f"first {window_mbs} micro-batches of stage 0"
    out = [plot_gantt(run, run.path / "gantt.png", t_max, note if t_max is not None else "")]
    if t_max is not None:
        out.append(plot_gantt(run, run.path / "gantt_full.png"))
    return out


# ---- 2. bubble CDF -------------------------------------------------------------------------------
def request_bubble_times(records: list[TimingRecord], run_start: float) -> list[float]:
    """Per-request bubble seconds (timing.request_bubbles over timing.stage_gaps), sorted."""
    return sorted(request_bubbles(records, stage_gaps(records, run_start)).values())


def cdf_points(values: Iterable[float]) -> tuple[list[float], list[float]]:
    """Empirical CDF: sorted values and the fraction of values <= each (i/n, i = 1..n)."""
    xs = sorted(values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def plot_bubble_cdf(runs: list[Run], path: Path) -> str | None:
    series = [(r.label, request_bubble_times(r.records, r.run_start)) for r in runs if r.records]
    series = [(label, v) for label, v in series if v]
    if not series:
        return None
    fig = new_figure(7, 4.5)
    ax = fig.add_subplot()
    for label, values in series:
        xs, ys = cdf_points(values)
        p50 = statistics.median(values)
        # start the step at (first value, 0) so the curve rises at the smallest bubble
        ax.step([xs[0]] + xs, [0.0] + ys, where="post", label=f"{label}: p50 {p50:.3g} s, n={len(values)}")
    every = [v for _, vs in series for v in vs]
    scale_note = ""
    if wants_log(every):
        pos = min(v for v in every if v > 0)
        if min(every) <= 0:
            # zero-bubble requests are real data; symlog keeps them where log would drop them
            ax.set_xscale("symlog", linthresh=pos)
            # the default locator also ticks inside the linear part, where labels collide with 0
            ax.set_xticks([0.0] + [10.0 ** k for k in range(math.ceil(math.log10(pos)),
                                                            math.ceil(math.log10(max(every))) + 1)])
            scale_note = f", log above {pos:.2g} s"
        else:
            ax.set_xscale("log")
            scale_note = ", log scale"
    ax.set_xlabel(f"bubble time per request (s{scale_note})")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.set_title("CDF of per-request pipeline bubble time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, path)


# ---- 5. bubble by cause --------------------------------------------------------------------------
def bubble_by_cause(run: Run) -> dict[str, float] | None:
    """Seconds per cause: the summary's figures, else recomputed from the timings, else None."""
    causes = run.summary.get("bubble_s_by_cause")
    if isinstance(causes, dict):
        return {c: float(causes.get(c, 0.0)) for c in CAUSES}
    if run.records:
        out = dict.fromkeys(CAUSES, 0.0)
        for g in stage_gaps(run.records, run.run_start):
            out[g.cause if g.cause in out else "other"] += g.seconds
        return out
    return None


def plot_bubble_by_cause(runs: list[Run], path: Path) -> str | None:
    data = [(r.label, c) for r in runs if (c := bubble_by_cause(r)) is not None]
    if not data:
        return None
    fig = new_figure(max(7.0, 3.5 + 1.1 * len(data)), 4.5)
    ax = fig.add_subplot()
    xs = list(range(len(data)))
    bottom = [0.0] * len(data)
    for cause in CAUSES:
        heights = [c[cause] for _, c in data]
        ax.bar(xs, heights, 0.6, bottom=bottom, color=CAUSE_COLORS[cause], label=CAUSE_LABELS[cause])
        bottom = [b + h for b, h in zip(bottom, heights)]
    for x, total in zip(xs, bottom):
        ax.annotate(f"{total:.3g} s", (x, total), xytext=(0, 2), textcoords="offset points", ha="center",
                    fontsize=8)
    crowded = len(data) > 4  # long labels side by side overlap: slant them
    ax.set_xticks(xs, [label for label, _ in data], rotation=20 if crowded else 0,
                  ha="right" if crowded else "center")
    ax.set_ylabel("bubble time, all stages (s)")
    ax.set_title("Pipeline bubbles by cause")
    ax.margins(y=0.12)
    handles, labels = ax.get_legend_handles_labels()
    # reversed so the legend stacks like the bars; outside so no bar is hidden
    ax.legend(handles[::-1], labels[::-1], fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save(fig, path)


# ---- 3. throughput vs P:D ------------------------------------------------------------------------
def throughput_series(runs: list[Run]) -> dict[str, list[tuple[float, float]]]:
    """'scheduler, chunk C' -> [(pd_ratio, throughput tok/s)] sorted by P:D, from the summaries."""
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in runs:
        s = r.summary
        workload = s.get("workload")
        pd = workload.get("pd_ratio") if isinstance(workload, dict) else None
        if pd is None or s.get("throughput_tok_s") is None:
            continue
        key = f"{s.get('scheduler', r.path.name)}, chunk {s.get('chunk_size', '?')}"
        out[key].append((float(pd), float(s["throughput_tok_s"])))
    return {k: sorted(v) for k, v in sorted(out.items())}


def plot_throughput_vs_pd(runs: list[Run], path: Path) -> str | None:
    series = throughput_series(runs)
    ratios = {pd for pts in series.values() for pd, _ in pts}
    if len(ratios) < 2:  # one P:D ratio is a point, not a trend
        return None
    fig = new_figure(7, 4.5)
    ax = fig.add_subplot()
    for key, pts in series.items():
        ax.plot([p for p, _ in pts], [t for _, t in pts], marker="o", label=key)
    if wants_log(ratios):
        ax.set_xscale("log")
    ax.set_xlabel("P:D ratio (prompt tokens / decode tokens)")
    ax.set_ylabel("throughput (tokens/s, prefill + decode)")
    ax.set_ylim(bottom=0)
    ax.set_title("Throughput vs P:D ratio")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, path)
