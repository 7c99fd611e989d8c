"""Plots from run directories (DESIGN.md §3.4) and profile output: the paper's figures, made
from what `generate --run-dir`, `bench`, `simulate` and `profile` write.

Usage::

    from pp_runtime.report import make_report
    make_report(["runs/bench"])                  # bench dir: runs/bench/<scheduler>/ + comparison.json
    make_report(["runs/a", "runs/b"], out="plots")
    make_report(["runs/profile"])                # a dir holding only profile.csv

    pp-runtime report DIR [DIR ...] [--out OUT] [--window-mbs N | --window-s S]

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
This module finds and loads the inputs and writes the plots; the plots themselves are in
run_plots.py (Gantt, bubble CDF, bubbles by cause, throughput) and profile_plots.py (per-token
cost, per-op breakdown), and what they share in figures.py. Matplotlib is used through its
object API on the Agg canvas, never pyplot, so nothing here touches a global backend or figure
registry (safe inside a long-lived process).
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from pp_runtime.profile_plots import plot_per_token_cost
from pp_runtime.run_plots import (DEFAULT_WINDOW_MBS, gantt_plots, plot_bubble_by_cause, plot_bubble_cdf,
                                  plot_throughput_vs_pd)
from pp_runtime.timing import TimingRecord

TIMINGS = "stage_timings.jsonl"
SUMMARY = "summary.json"
PROFILE = "profile.csv"
COMPARISON = "comparison.json"


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


# ---- entry point ---------------------------------------------------------------------------------
def make_report(dirs: list[str], out: str | None = None, *, window_mbs: int | None = None,
                window_s: float | None = None) -> list[str]:
    """Write every plot the inputs allow; returns the PNG paths written, in order.

    dirs: run dirs, bench dirs and/or profile dirs (see the module docstring). out: where the
    combined plots go (created if needed); default the first dir given. window_mbs/window_s:
    the Gantt chart's window (first N stage-0 micro-batches, default DEFAULT_WINDOW_MBS, or first S
    seconds).
    Raises ValueError naming a dir that is missing or has none of the inputs.
    """
    if not dirs:
        raise ValueError("no directories given")
    run_dirs, profile_dirs = resolve_dirs(dirs)
    runs = [load_run(d) for d in run_dirs]
    _disambiguate(runs)
    written: list[str] = []
    for run in runs:
        written += gantt_plots(run, window_mbs or DEFAULT_WINDOW_MBS, window_s)
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
