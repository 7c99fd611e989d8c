"""pp_scaling.py's figure: pipeline efficiency and where pp = 2 loses it (matplotlib, Agg).

    .venv/bin/python benchmarks/pp_scaling.py --num-requests 48 --plot pp_scaling.png
    plot_pp_scaling(json.load(open("r.json")), Path("pp_scaling.png"))   # from a --json of this version

1. throughput per paired round, each scheduler at pp = 1 and pp = 2, and the ideal 2 × pp = 1;
2. efficiency per round (pp = 2 over 2 × pp = 1) against the 0.9 target;
3. round 0 of the first scheduler by phase: the prefill phase and the decode-only drain at pp = 1
   (summed step times), at pp = 2 (wall) and ideally (half of pp = 1's), with each stage's idle time;
4. the first scheduler's efficiency per round as its four factors (pp_runtime/pipeline_loss.py):
   a factor under 1 is where that round lost.
"""
from __future__ import annotations

from pathlib import Path

from pp_runtime.figures import new_figure, save
from pp_runtime.pipeline_loss import FACTORS

PALETTE = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3")
PREFILL, DRAIN, IDLE = "#55A868", "#DD8452", "#9E9E9E"


def plot_pp_scaling(r: dict, path: Path, target: float = 0.9) -> str:
    """Draw ``r`` (pp_scaling.py's result, or its JSON) to ``path``; returns the path."""
    fig = new_figure(18.0, 4.2)
    tput, eff, phases, factors = fig.subplots(1, 4)
    for i, (label, rounds) in enumerate(r["rounds"].items()):
        color = PALETTE[i % len(PALETTE)]
        xs = range(len(rounds["pp1_tok_s"]))
        tput.plot(xs, rounds["pp1_tok_s"], "s--", color=color, label=f"{label} pp = 1")
        tput.plot(xs, rounds["pp2_tok_s"], "o-", color=color, label=f"{label} pp = 2")
        tput.plot(xs, [2 * t for t in rounds["pp1_tok_s"]], ":", color=color, label=f"{label} 2 × pp = 1")
        eff.plot(xs, rounds["efficiency"], "o-", color=color, label=f"{label} (median {r['efficiency'][label]:.3f})")
    for ax in (tput, eff):
        ax.set_xticks(list(range(max(len(v["efficiency"]) for v in r["rounds"].values()))))
    tput.set(xlabel="paired round", ylabel="tokens/s", title="Throughput")
    tput.legend(fontsize=7)
    eff.axhline(target, ls="--", color=IDLE, label=f"target {target}")
    eff.set(xlabel="paired round", ylabel="tput(pp = 2) / (2 × tput(pp = 1))", title="Pipeline efficiency")
    eff.legend(fontsize=8)

    ph = r.get("phases")
    if ph:
        rows = [("pp = 1", ph["pp1"]["prefill_s"], ph["pp1"]["drain_s"]),
                ("ideal pp = 2", ph["pp1"]["prefill_s"] / 2, ph["pp1"]["drain_s"] / 2),
                ("pp = 2", ph["pp2"]["prefill_s"], ph["pp2"]["drain_s"])]
        ys = range(len(rows))
        phases.barh(ys, [p for _, p, _ in rows], color=PREFILL, label="prefill phase")
        phases.barh(ys, [d for _, _, d in rows], left=[p for _, p, _ in rows], color=DRAIN,
                    label="drain (decode-only)")
        for y, (_, p, d) in zip(ys, rows):
            phases.text(p + d, y, f" {p + d:.1f} s", va="center", fontsize=8)
        idle = ", ".join(f"stage {i} {st['idle_s']:.2f} s" for i, st in enumerate(ph["pp2"]["stages"]))
        phases.set_yticks(list(ys), [name for name, _, _ in rows])
        phases.set(xlabel=f"seconds (pp = 2 idle: {idle})", title=f"{next(iter(r['rounds']))}, round 0, by phase")
        phases.set_xlim(0, 1.25 * max(p + d for _, p, d in rows))
        phases.legend(fontsize=8, loc="center right")
    plot_factors(factors, *next(iter(r["rounds"].items())))
    w = r["workload"]
    fig.suptitle(f"{w['num_requests']} requests, prompts {w['min_len']}-{w['max_len']}, P:D = {w['pd_ratio']} Zipf; "
                 f"chunk {r['chunk']} (pp = 2: {r['pp2_chunk']}), batch {r['max_batch_size']}, "
                 f"matmul precision {r['matmul_precision']}, KV {r['kv_cache_dtype']}", fontsize=9)
    return save(fig, path)


def plot_factors(ax: object, label: str, rounds: dict) -> None:
    """Grouped bars: each round's four factors (a JSON from before them, or a round too short to
    price, draws none)."""
    per = [(k, f) for k, f in enumerate(rounds.get("factors") or []) if f]
    width = 0.8 / len(FACTORS)
    for i, name in enumerate(FACTORS):
        ax.bar([k + (i - (len(FACTORS) - 1) / 2) * width for k, _ in per], [f[name] for _, f in per], width,
               color=PALETTE[i], label=name.replace("_", " "))
    for k, f in per:
        ax.text(k, 1.02, f"{f['efficiency']:.3f}", ha="center", fontsize=8)
    ax.axhline(1.0, ls="--", color=IDLE)
    ax.set_xticks([k for k, _ in per])
    ax.set_ylim(0.5, 1.12)
    ax.set(xlabel="paired round (efficiency above)", ylabel="factor", title=f"{label}: where each round lost it")
    ax.legend(fontsize=7, loc="lower right")
