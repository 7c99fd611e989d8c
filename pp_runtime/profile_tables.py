"""The profile's outputs from its rows: the paper's Table 2, ``profile.csv`` / JSON files,
and the printed table and summary line.

    t2 = table2(rows)
    write_csv(rows, "runs/profile/profile.csv"); write_json(t2, "runs/profile/table2.json")
    print(format_table(rows)); print(format_summary(t2))
"""
from __future__ import annotations

import csv
import json

from pp_runtime.profile_stats import BUCKETS

CSV_COLUMNS = ("kind", "prefill_tokens", "decode_tokens", "context_len", "preproj_ms", "attn_ms",
               "postproj_ms", "ffn_ln1_ms", "ffn_ln2_ms", "others_ms", "total_ms", "per_token_ms",
               "per_decode_token_ms", "lm_head_ms", "total_log_sd")


def _closest(values: list[int], target: int) -> int | None:
    return min(values, key=lambda v: (abs(v - target), v)) if values else None


def table2(rows: list[dict], target_decodes: int = 4, target_prefill: int = 256) -> dict:
    """The paper's Table 2 on this run: decode cost per token alone (decode-only batch of B)
    vs piggybacked (marginal cost per decode in the mixed batch with the same B)."""
    dec = {r["decode_tokens"]: r for r in rows if r["kind"] == "decode"}
    mix = {r["decode_tokens"]: r for r in rows if r["kind"] == "mixed"}
    pre = {r["prefill_tokens"]: r for r in rows if r["kind"] == "prefill" and r["context_len"] == 0}
    b = _closest(sorted(set(dec) & set(mix)), target_decodes)
    alone = dec[b]["per_decode_token_ms"] if b is not None else None
    piggy = mix[b]["per_decode_token_ms"] if b is not None else None
    p = _closest(sorted(pre), target_prefill)
    b1 = min(dec) if dec else None
    out = {
        "decode_alone_ms_per_token": alone,
        "decode_piggybacked_ms_per_token": piggy,
        "ratio": alone / piggy if alone is not None and piggy is not None and piggy > 0 else None,
        "prefill_ms_per_token_at_256": pre[p]["per_token_ms"] if p is not None else None,
        "decodes": b,
        "mixed_prefill_tokens": mix[b]["prefill_tokens"] if b is not None else None,
        "decode_context_len": dec[b]["context_len"] if b is not None else None,
        "prefill_tokens_for_per_token": p,
        "decode_b1_ms_per_token": dec[b1]["per_decode_token_ms"] if b1 is not None else None,
    }
    if out["decode_b1_ms_per_token"] is not None and out["prefill_ms_per_token_at_256"]:
        out["decode_b1_over_prefill_per_token"] = out["decode_b1_ms_per_token"] / out["prefill_ms_per_token_at_256"]
    return out


def write_json(obj: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for r in rows:
            w.writerow(["" if r[c] is None else (f"{r[c]:.6f}" if isinstance(r[c], float) else r[c])
                        for c in CSV_COLUMNS])


def format_table(rows: list[dict]) -> str:
    """Per-operation milliseconds of every row (others includes the LM head)."""
    head = ("kind", "P", "B", "ctx", "preproj", "attn", "postproj", "ffn_ln1", "ffn_ln2", "others",
            "total", "ms/tok", "ms/dec")
    lines = ["{:<8}{:>5}{:>4}{:>6}".format(*head[:4]) + "".join(f"{h:>10}" for h in head[4:])]
    for r in rows:
        cells = [r[f"{b}_ms"] for b in BUCKETS] + [r["total_ms"], r["per_token_ms"], r["per_decode_token_ms"]]
        lines.append(f"{r['kind']:<8}{r['prefill_tokens']:>5}{r['decode_tokens']:>4}{r['context_len']:>6}"
                     + "".join(f"{'-':>10}" if v is None else f"{v:>10.3f}" for v in cells))
    stat = rows[0].get("stat", "median") if rows else "median"
    lines.append(f"(ms; {stat} over reps; others = embedding, norms, RoPE, activation, residuals, LM head "
                 "on sampled rows; ms/dec for mixed = (total - prefill-only total at the same P) / B)")
    return "\n".join(lines)


def format_summary(t2: dict) -> str:
    def f(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.3f}"
    ratio = "n/a" if t2.get("ratio") is None else f"{t2['ratio']:.2f}x"
    piggy = t2["decode_piggybacked_ms_per_token"]
    if piggy is not None and piggy <= 0:  # the mixed batch ran faster than its chunk alone: noise won
        ratio = "n/a (piggybacked cost ≤ 0: the mixed and prefill-only timings are noise-dominated; rerun with more reps)"
    return (f"Table 2 ({t2.get('model')}, {t2.get('device')}, {t2.get('dtype')}, {t2.get('torch_threads')} threads): "
            f"decode alone {f(t2['decode_alone_ms_per_token'])} ms/token (B={t2['decodes']}, "
            f"ctx={t2['decode_context_len']}), piggybacked {f(t2['decode_piggybacked_ms_per_token'])} ms/token "
            f"(P={t2['mixed_prefill_tokens']}): {ratio}; prefill {f(t2['prefill_ms_per_token_at_256'])} "
            f"ms/token at P={t2['prefill_tokens_for_per_token']}")
