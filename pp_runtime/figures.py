"""What every report figure shares (pp_runtime/report.py): an Agg figure made through matplotlib's
object API, never pyplot, so nothing touches a global backend or figure registry (safe inside a
long-lived process); saving it; the log-axis test; and a micro-batch's kind with its colour."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from pp_runtime.timing import TimingRecord

KIND_COLORS = {"prefill": "#4C72B0", "decode": "#DD8452", "mixed": "#55A868", "empty": "#9E9E9E"}
KIND_LABELS = {"prefill": "prefill only", "decode": "decode only", "mixed": "mixed prefill + decode",
               "empty": "empty"}
DPI = 110


def new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)  # attach the Agg canvas explicitly: no pyplot, no global backend
    return fig


def save(fig: Figure, path: Path) -> str:
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
