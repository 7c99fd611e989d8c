"""vs_hf.py's figure: our engine against Hugging Face ``generate`` (matplotlib, Agg).

    .venv/bin/python benchmarks/vs_hf.py --rounds 3 --plot vs_hf.png
    plot_vs_hf(json.load(open("r.json")), Path("vs_hf.png"))   # from a --json of this version

1. tokens/s per alternated round, HF and ours at pp = 1 (fp32 and int8 products), with the 3 × HF
   target of each round;
2. every configuration the run measured once or more (medians), fp32 and reduced precision.
"""
from __future__ import annotations

from pathlib import Path

from pp_runtime.figures import new_figure, save

HF, OURS, INT8, TARGET = "#C44E52", "#4C72B0", "#55A868", "#9E9E9E"
BARS = (("hf", "HF generate", HF), ("hf_tuned", "HF, our allocator", HF), ("ours_pp1", "ours pp = 1", OURS),
        ("ours_pp1_fp32", "ours, fp32 weights", OURS), ("ours_pp2", "ours pp = 2, 1 thread/stage", OURS),
        ("ours_pp1_int8", "ours int8 products", INT8), ("hf_bf16", "HF bf16", HF),
        ("ours_pp1_medium", "ours medium + fp16 KV", OURS))


def plot_vs_hf(r: dict, path: Path, target: float = 3.0) -> str:
    """Draw ``r`` (vs_hf.py's result, or its JSON) to ``path``; returns the path."""
    total = r["prompt_tokens"] + r["new_tokens"]
    hf = [total / s for s in r["rounds"]["hf_s"]]
    ours = [total / s for s in r["rounds"]["ours_pp1_s"]]
    fig = new_figure(12.0, 4.2)
    rounds, bars = fig.subplots(1, 2, width_ratios=(1, 1.4))
    xs = list(range(len(hf)))
    rounds.plot(xs, hf, "s-", color=HF, label="HF generate")
    rounds.plot(xs, ours, "o-", color=OURS, label="ours, pp = 1")
    if "ours_pp1_int8_s" in r["rounds"]:  # runs before the int8 products had no such rounds
        rounds.plot(xs, [total / s for s in r["rounds"]["ours_pp1_int8_s"]], "^-", color=INT8, label="ours, int8 products")
    rounds.plot(xs, [target * h for h in hf], ":", color=TARGET, label=f"{target:g} × HF (target)")
    for x, h, o in zip(xs, hf, ours):
        rounds.annotate(f"{o / h:.2f}×", (x, o), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    rounds.set_xticks(xs)
    rounds.margins(x=0.12, y=0.1)  # room for the ratios above the points
    rounds.set(xlabel="alternated round", ylabel="tokens/s (prompt + generated)",
               title=f"Paired rounds: median {r['ratio_pp1']:.2f}× HF"
               + (f" (int8 products {r['ratio_pp1_int8']:.2f}×)" if "ratio_pp1_int8" in r else ""))
    rounds.legend(fontsize=8)

    kv = r.get("int8_kv_cache_dtype", "auto")  # the int8 rounds' K/V (runs before the flag: the fp32 cache)
    shown = [(label + (f" + {kv} KV" if key == "ours_pp1_int8" and kv != "auto" else ""), r[f"{key}_tok_s"], color)
             for key, label, color in BARS if f"{key}_tok_s" in r]
    ys = list(range(len(shown)))
    bars.barh(ys, [v for _, v, _ in shown], color=[c for _, _, c in shown])
    for y, (_, v, _) in zip(ys, shown):
        bars.text(v, y, f" {v:.0f}", va="center", fontsize=8)
    bars.set_yticks(ys, [label for label, _, _ in shown])
    bars.invert_yaxis()
    bars.set_xlim(0, 1.15 * max(v for _, v, _ in shown))
    bars.set(xlabel="tokens/s (medians; the paired ones over the rounds, the rest once)", title="Every configuration")
    fig.suptitle(f"{r['prompts']} prompts ({r['prompt_tokens']} tokens) × {r['new_tokens'] // r['prompts']} new tokens, "
                 "2 threads per engine (ours at pp = 2: 1 per stage)", fontsize=9)
    return save(fig, path)
