"""decode_maximal.py's figure: the paper's Table 2 as three panels (matplotlib, Agg, no pyplot).

    .venv/bin/python benchmarks/decode_maximal.py --plot table2.png     # measure, then draw
    plot_table2(json.load(open("r.json")), Path("table2.png"))        # from a --json of one result
                                                                      # (of several: the list's items)

1. step time against B: the chunk plus B decodes, the fitted slope through the chunk alone, and
   the B decodes alone;
2. cost per decode: piggybacked (paired, per B, and the slope) against alone, with the target's
   line at a quarter of alone;
3. each batch's model FLOP/s as a fraction of the device's matmul rate.
"""
from __future__ import annotations

from pathlib import Path

from pp_runtime.figures import new_figure, save

MIXED, ALONE, SLOPE = "#55A868", "#DD8452", "#4C72B0"


def plot_table2(r: dict, path: Path) -> str:
    """Draw ``r`` (decode_maximal.measure's result, or its JSON) to ``path``; returns the path."""
    rows = {int(b): row for b, row in r["by_batch"].items()}  # JSON keys are strings
    bs = sorted(rows)
    slope, chunk = r["slope_ms_per_decode"], r["chunk_ms"]
    fig = new_figure(13.5, 4.2)
    steps, per, util = fig.subplots(1, 3)

    steps.plot([0] + bs, [chunk] + [rows[b]["mixed_ms"] for b in bs], "o-", color=MIXED,
               label=f"chunk of {r['chunk']} + B decodes")
    steps.plot([0, bs[-1]], [chunk, chunk + slope * bs[-1]], "--", color=SLOPE,
               label=f"chunk + slope × B ({slope:.2f} ms per decode)")
    steps.plot(bs, [rows[b]["decode_only_ms"] for b in bs], "s-", color=ALONE, label="B decodes alone")
    steps.set(xlabel="decodes B", ylabel="step time, ms (median of rounds)", title="Step time")
    steps.legend(fontsize=8)

    per.plot(bs, [rows[b]["alone_ms"] for b in bs], "s-", color=ALONE, label="alone: step / B")
    per.plot(bs, [rows[b]["alone_ms"] / 4 for b in bs], ":", color=ALONE, label="target: ¼ of alone")
    per.plot(bs, [rows[b]["marginal_ms"] for b in bs], "o-", color=MIXED, label="piggybacked (paired, per B)")
    per.axhline(slope, ls="--", color=SLOPE, label="piggybacked (slope over B)")
    per.set(xlabel="decodes B", ylabel="ms per decode", title="Cost of one decode")
    per.set_xscale("log", base=2)
    per.legend(fontsize=8)

    kinds = list(r["achieved_flop_s"])
    rate = r["matmul"]["flop_s"]
    util.bar(range(len(kinds)), [r["achieved_flop_s"][k] / rate for k in kinds],
             color=[ALONE if k.startswith("decode") else MIXED for k in kinds])
    util.axhline(1.0, color="#9E9E9E", lw=0.8)
    util.set_xticks(range(len(kinds)), kinds, rotation=60, fontsize=8)
    util.set(ylabel=f"model FLOP/s ÷ {r['matmul']['dtype']} matmul ({rate / 1e12:.3g} TFLOP/s)",
             title="Utilisation")

    fig.suptitle(f"{r['device_name']} ({r['dtype']}, {r['threads']} thread(s), matmul precision "
                 f"{r['matmul_precision']}, KV {r['kv_cache_dtype']}): chunk {r['chunk']}, context {r['context']}, "
                 f"{r['rounds']} rounds", fontsize=9)
    return save(fig, path)
