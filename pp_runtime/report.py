"""Plots from run directories (DESIGN.md §3.4) and profile output: the paper's figures, made
from what `generate --run-dir`, `bench`, `simulate` and `profile` write.

Usage::

    from pp_runtime.report import make_report
    make_report(["runs/bench"])                  # bench dir: runs/bench/<scheduler>/ + comparison.json
    make_report(["runs/a", "runs/b"], out="plots")
    make_report(["runs/profile"])                # a dir holding only profile.csv

    python -m pp_runtime.report DIR [DIR ...] [--out OUT] [--window-mbs N | --window-s S]

Each argument is a run directory (stage_timings.jsonl and/or summary.json), a bench directory
(comparison.json and/or one run directory per scheduler; it stands for its run directories), a
directory with a profile.csv, or a deployment's profile (``profile --pp N``: one stage-K/ with a
profile.csv per stage). Written PNGs:

per run directory
  gantt.png            pipeline Gantt chart (Figures 1/5): one row per stage, one bar per
                       micro-batch coloured by kind, idle gaps hatched. Long runs show only the
                       first ``window_mbs`` micro-batches of stage 0 (or ``window_s`` seconds), and
                       the whole run goes to gantt_full.png.
per directory with profile.csv
  per_token_cost.png   per-token cost vs batch size (Figure 3) and the per-op breakdown of
                       decode-only vs mixed batches at the same B (Table 2).
combined, into ``out`` (default: the first directory given, a bench dir itself)
  bubble_cdf.png       CDF of per-request bubble time, one curve per run (Figure 12a).
  bubble_by_cause.png  bubble seconds by cause (PB1/PB2/PB3/other) per run, stacked.
  throughput_vs_pd.png throughput vs P:D ratio per (scheduler, chunk size) (Figure 9); only when
                       runs at two or more P:D ratios are given.

A plot whose inputs are missing is skipped; a directory with none of the inputs is a ValueError.
Matplotlib is used through its object API on the Agg canvas, never pyplot, so nothing here
touches a global backend or figure registry (safe inside a long-lived process).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import ScalarFormatter

from pp_runtime.timing import TimingRecord, request_bubbles, stage_gaps

TIMINGS = "stage_timings.jsonl"
SUMMARY = "summary.json"
PROFILE = "profile.csv"
COMPARISON = "comparison.json"

KIND_COLORS = {"prefill": "#4C72B0", "decode": "#DD8452", "mixed": "#55A868", "empty": "#9E9E9E"}
KIND_LABELS = {"prefill": "prefill only", "decode": "decode only", "mixed": "mixed prefill + decode",
               "empty": "empty"}
CAUSES = ("PB1", "PB2", "PB3", "other")
CAUSE_COLORS = {"PB1": "#C44E52", "PB2": "#8172B2", "PB3": "#CCB974", "other": "#9E9E9E"}
CAUSE_LABELS = {"PB1": "PB1: prefills of different sizes", "PB2": "PB2: prefill after decode",
                "PB3": "PB3: decodes, different KV lengths", "other": "other (stage 0 waits, ...)"}
OPS = ("preproj", "attn", "postproj", "ffn_ln1", "ffn_ln2", "others")
OP_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B2", "#9E9E9E")
IDLE_COLOR = "#BDBDBD"
DPI = 110
DEFAULT_WINDOW_MBS = 40  # ~40 bars per row is about what stays readable at 12 inches


@dataclass
class Run:
    """One run directory's data; records and summary are empty when their file is missing."""
    path: Path
    label: str
    summary: dict
    records: list[TimingRecord]
    run_start: float


# ---- finding and loading inputs ----------------------------------------------------------------
def _is_run_dir(p: Path) -> bool:
    return (p / TIMINGS).is_file() or (p / SUMMARY).is_file()


def _run_subdirs(p: Path) -> list[Path]:
    return sorted(c for c in p.iterdir() if c.is_dir() and _is_run_dir(c))


def _is_bench_dir(p: Path) -> bool:
    # comparison.json marks a bench dir; without one, a dir that is not a run itself but holds
    # run dirs (a bench cut short before the comparison was written) is read the same way.
    return (p / COMPARISON).is_file() or (not _is_run_dir(p) and bool(_run_subdirs(p)))


def resolve_dirs(dirs: Iterable[str | Path]) -> tuple[list[Path], list[Path]]:
    """(run dirs, profile dirs) of the given dirs, bench dirs expanded to their scheduler subdirs.

    Raises ValueError naming the first dir that is missing or holds none of the inputs.
    """
    runs: list[Path] = []
    profiles: list[Path] = []
    for d in map(Path, dirs):
        if not d.is_dir():
            raise ValueError(f"{d}: not a directory")
        found = False
        if (d / PROFILE).is_file():
            profiles.append(d)
            found = True
        else:  # a deployment's profile (profile --pp N): one stage-K/ per stage
            stages = sorted(c for c in d.iterdir() if c.is_dir() and (c / PROFILE).is_file())
            profiles.extend(stages)
            found = bool(stages)
        if _is_run_dir(d):
            runs.append(d)
            found = True
        elif _is_bench_dir(d):
            subs = _run_subdirs(d)
            runs.extend(subs)
            found = found or bool(subs)
        if not found:
            raise ValueError(f"{d}: no {TIMINGS}, {SUMMARY}, {PROFILE}, bench run directories or "
                             f"per-stage profile directories in it")
    return runs, profiles


def _record_from_json(d: dict) -> TimingRecord:
    return TimingRecord(stage=int(d["stage"]), tp_rank=int(d["tp_rank"]), mb=int(d["mb"]),
                        iter=int(d.get("iter", d["mb"])),
                        request_ids=tuple(str(r) for r in d.get("request_ids", ())),
                        prefill_tokens=int(d["prefill_tokens"]), decode_tokens=int(d["decode_tokens"]),
                        kv_tokens=int(d.get("kv_tokens", 0)), t_ready=float(d.get("t_ready", d["t_start"])),
                        t_start=float(d["t_start"]), t_end=float(d["t_end"]))


def load_records(path: Path) -> list[TimingRecord]:
    """stage_timings.jsonl -> records; a bad line (e.g. a half-written last one) is skipped with a warning."""
    out: list[TimingRecord] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(_record_from_json(json.loads(line)))
            except (ValueError, KeyError, TypeError) as e:
                print(f"warning: {path}:{lineno}: skipping bad timing line ({e!r})", file=sys.stderr)
    return out


def _load_summary(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
        print(f"warning: {path}: unreadable summary ({e})", file=sys.stderr)
        return {}
    return obj if isinstance(obj, dict) else {}


def load_run(path: Path) -> Run:
    summary = _load_summary(path / SUMMARY)
    records = load_records(path / TIMINGS) if (path / TIMINGS).is_file() else []
    # run_start is the zero of every time axis; an old run without it falls back to the first
    # moment any worker started waiting, the closest thing in the timings to the run's start.
    run_start = summary.get("run_start")
    if run_start is None:
        run_start = min((r.t_ready for r in records), default=0.0)
    return Run(path, str(summary.get("scheduler") or path.name), summary, records, float(run_start))


def _disambiguate(runs: list[Run]) -> None:
    """Give runs that share a scheduler name a label that tells them apart (their dir)."""
    counts: dict[str, int] = defaultdict(int)
    for r in runs:
        counts[r.label] += 1
    for r in runs:
        if counts[r.label] > 1:
            # in a bench dir the subdir is named after the scheduler, so the bench dir says more
            where = r.path.parent.name if r.path.name == r.label else r.path.name
            r.label = f"{r.label} ({where})"


# ---- shared helpers ------------------------------------------------------------------------------
def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)  # attach the Agg canvas explicitly: no pyplot, no global backend
    return fig


def _save(fig: Figure, path: Path) -> str:
    fig.savefig(path, dpi=DPI)
    return str(path)


def wants_log(values: Iterable[float]) -> bool:
    """True when the positive values span more than two decades (a linear axis would hide most)."""
    pos = [v for v in values if v > 0]
    return len(pos) >= 2 and max(pos) / min(pos) > 100


def microbatch_kind(r: TimingRecord) -> str:
    if r.prefill_tokens > 0 and r.decode_tokens > 0:
        return "mixed"
    if r.prefill_tokens > 0:
        return "prefill"
    return "decode" if r.decode_tokens > 0 else "empty"


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


def _annotate_bars(ax: Axes, fig: Figure, bars: list[tuple[TimingRecord, float, float]], y_mid: float,
                   span_s: float) -> None:
    # Label a bar only when its text fits inside it; width in pixels comes from the figure
    # size (the axes take ~85% of it), cheap enough for runs with thousands of bars.
    px_per_s = 0.85 * fig.get_figwidth() * DPI / max(span_s, 1e-12)
    fontsize = 7
    char_px = fontsize * 0.62 * DPI / 72
    for r, x, w in bars:
        text = _mb_label(r)
        if w * px_per_s <= len(text) * char_px + 4:
            text = text.replace("+", "\n")  # a mixed bar's label on two lines needs half the width
        if w * px_per_s > max(map(len, text.split("\n"))) * char_px + 4:
            ax.text(x + w / 2, y_mid, text, ha="center", va="center", fontsize=fontsize, color="white",
                    clip_on=True)


def plot_gantt(run: Run, path: Path, t_max: float | None = None, window_note: str = "") -> str:
    """Gantt chart of the run (or of [0, t_max] seconds since run_start) to path."""
    t0 = run.run_start
    records = [r for r in run.records if t_max is None or r.t_start - t0 < t_max]
    rows = _gantt_rows(records)
    fig = _new_figure(12, 1.3 + 0.75 * sum(1 if rk == 0 else 0.4 for _, rk, _, _ in rows))
    ax = fig.add_subplot()
    span = t_max if t_max is not None else max(r.t_end for r in records) - t0
    gaps = {(g.stage, g.mb): g.seconds for g in stage_gaps(run.records, t0)}
    kinds_seen: set[str] = set()
    for stage, rank, y, h in rows:
        mine = [r for r in records if r.stage == stage and r.tp_rank == rank]
        by_kind: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for r in mine:
            by_kind[microbatch_kind(r)].append((r.t_start - t0, r.t_end - r.t_start))
        for kind, spans in by_kind.items():
            kinds_seen.add(kind)
            ax.broken_barh(spans, (y, h), facecolors=KIND_COLORS[kind], edgecolors="white", linewidths=0.4)
        if rank == 0:
            # the idle gap before each micro-batch is exactly what the bubble accounting counts
            idle = [(r.t_start - t0 - gaps[(stage, r.mb)], gaps[(stage, r.mb)]) for r in mine
                    if gaps.get((stage, r.mb), 0.0) > 0]
            ax.broken_barh(idle, (y, h), facecolors="none", edgecolors=IDLE_COLOR, hatch="////", linewidths=0)
            _annotate_bars(ax, fig, [(r, r.t_start - t0, r.t_end - r.t_start) for r in mine], y + h / 2, span)
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
    return _save(fig, path)


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
    fig = _new_figure(7, 4.5)
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
    return _save(fig, path)


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
    fig = _new_figure(max(7.0, 3.5 + 1.1 * len(data)), 4.5)
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
    return _save(fig, path)


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
    fig = _new_figure(7, 4.5)
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
    return _save(fig, path)


# ---- 4. per-token cost from profile.csv -----------------------------------------------------------
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
    fig = _new_figure(13, 4.8)
    left, right = fig.subplots(1, 2, width_ratios=[1.1, 1])
    _plot_cost_curves(left, rows)
    _plot_op_breakdown(right, rows)
    fig.suptitle(f"Operation costs ({profile_csv.parent.name}/{PROFILE})", fontsize=10)
    return _save(fig, path)


# ---- entry point ---------------------------------------------------------------------------------
def make_report(dirs: list[str], out: str | None = None, *, window_mbs: int = DEFAULT_WINDOW_MBS,
                window_s: float | None = None) -> list[str]:
    """Write every plot the inputs allow; returns the PNG paths written, in order.

    dirs: run dirs, bench dirs and/or profile dirs (see the module docstring). out: where the
    combined plots go (created if needed); default the first dir given. window_mbs/window_s:
    the Gantt chart's window (first N stage-0 micro-batches, or first S seconds).
    Raises ValueError naming a dir that is missing or has none of the inputs.
    """
    if not dirs:
        raise ValueError("no directories given")
    run_dirs, profile_dirs = resolve_dirs(dirs)
    runs = [load_run(d) for d in run_dirs]
    _disambiguate(runs)
    written: list[str] = []
    for run in runs:
        written += gantt_plots(run, window_mbs, window_s)
    for d in profile_dirs:
        if (p := plot_per_token_cost(d / PROFILE, d / "per_token_cost.png")) is not None:
            written.append(p)
    if runs:
        dest = Path(out) if out is not None else Path(dirs[0])
        dest.mkdir(parents=True, exist_ok=True)
        for plot, name in ((plot_bubble_cdf, "bubble_cdf.png"), (plot_bubble_by_cause, "bubble_by_cause.png"),
                           (plot_throughput_vs_pd, "throughput_vs_pd.png")):
            if (p := plot(runs, dest / name)) is not None:
                written.append(p)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pp_runtime.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", help="run, bench or profile directories")
    ap.add_argument("--out", help="directory for the combined plots (default: the first DIR)")
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--window-mbs", type=int, default=DEFAULT_WINDOW_MBS,
                       help="Gantt window: first N stage-0 micro-batches (default %(default)s)")
    group.add_argument("--window-s", type=float, help="Gantt window: first S seconds")
    args = ap.parse_args(argv)
    try:
        paths = make_report(args.dirs, args.out, window_mbs=args.window_mbs, window_s=args.window_s)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
