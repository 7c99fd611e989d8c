"""Per-operation stage profile (stages/profile.py): files, consistency of the numbers, and
that the timing hooks leave the model as it was."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch

from pp_runtime.batch import SeqChunk
from stages.attention import build_metadata
from pp_runtime.profile_grid import GRIDS, Grid, grid_points, parse_grid
from pp_runtime.profile_stats import BUCKETS, OPS, log_sd
from pp_runtime.profile_tables import CSV_COLUMNS, format_table
from stages.profile import build_worker, measure, run_profile

QUICK = "quick;reps=9"  # a few more reps than the quick grid's 3: steadier medians, still < 1 s


def _read_csv(path: str) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    out = tmp_path_factory.mktemp("profile")
    result = run_profile("llama-tiny", "cpu", "float32", str(out), grid=QUICK, progress=False)
    return str(out), result


def test_csv_has_exact_columns_and_one_row_per_grid_point(profiled: tuple[str, dict]) -> None:
    out, _ = profiled
    cols, rows = _read_csv(f"{out}/profile.csv")
    assert cols == list(CSV_COLUMNS)
    grid = parse_grid(QUICK)
    got = [(r["kind"], int(r["prefill_tokens"]), int(r["decode_tokens"]), int(r["context_len"])) for r in rows]
    want = [(p.kind, p.prefill_tokens, p.decode_tokens, p.context_len) for p in grid_points(grid)]
    assert got == want
    assert len(set(got)) == len(got)
    assert [g for g in got if g[0] == "decode"] == [("decode", 0, b, grid.context) for b in grid.decode]
    assert [g for g in got if g[0] == "mixed"] == [("mixed", grid.mixed_prefill, b, grid.context)
                                                   for b in grid.mixed_decode]
    prefill = {(g[1], g[3]) for g in got if g[0] == "prefill"}
    assert prefill == {(p, 0) for p in grid.prefill} | {(p, grid.context) for p in grid.prefill_with_context}


def test_times_nonnegative_and_parts_add_up(profiled: tuple[str, dict]) -> None:
    out, result = profiled
    _, rows = _read_csv(f"{out}/profile.csv")
    base = {int(r["prefill_tokens"]): float(r["total_ms"]) for r in rows
            if r["kind"] == "prefill" and int(r["context_len"]) == 0}
    for r in rows:
        parts = [float(r[f"{b}_ms"]) for b in BUCKETS]
        total = float(r["total_ms"])
        assert all(p >= 0 for p in parts) and total > 0
        assert math.isclose(sum(parts), total, rel_tol=1e-4, abs_tol=1e-5)
        p, d = int(r["prefill_tokens"]), int(r["decode_tokens"])
        assert math.isclose(float(r["per_token_ms"]), total / (p + d), rel_tol=1e-4, abs_tol=1e-6)
        if r["kind"] == "prefill":
            assert r["per_decode_token_ms"] == "" and d == 0 and p > 0
        elif r["kind"] == "decode":
            assert p == 0 and math.isclose(float(r["per_decode_token_ms"]), total / d, rel_tol=1e-4, abs_tol=1e-6)
        else:
            assert math.isclose(float(r["per_decode_token_ms"]), (total - base[p]) / d, rel_tol=1e-4, abs_tol=1e-5)
    for row in result["rows"]:  # the returned rows carry the LM head (inside others) and the raw total
        assert 0 <= row["lm_head_ms"] <= row["others_ms"] + 1e-9
        assert row["measured_total_ms"] > 0 and row["reps"] == parse_grid(QUICK).reps
        assert all(row[f"{op}_ms"] > 0 for op in OPS)  # every op really ran and was timed
        assert row["total_log_sd"] is not None and 0 <= row["total_log_sd"] < 1  # the rounds' jitter


def test_log_sd_of_the_rounds() -> None:
    """total_log_sd: the sample sd of log(total) over a point's rounds (the simulator's jitter σ)."""
    assert log_sd([1.0, math.e, math.e ** 2]) == pytest.approx(1.0)
    assert log_sd([0.2, 0.2, 0.2]) == 0.0 and log_sd([0.3]) is None


def test_table2_json(profiled: tuple[str, dict]) -> None:
    out, result = profiled
    with open(f"{out}/table2.json") as f:
        t2 = json.load(f)
    for key in ("decode_alone_ms_per_token", "decode_piggybacked_ms_per_token", "ratio",
                "prefill_ms_per_token_at_256", "device", "dtype", "model", "torch_threads"):
        assert key in t2, key
    assert t2["decodes"] == 4  # the quick grid has B = 4 in both decode and mixed
    assert t2["decode_alone_ms_per_token"] > 0 and t2["prefill_ms_per_token_at_256"] > 0
    # 4 tiny decodes add ~0.1 ms, about the noise of a busy 2-core box: the ratio is None when
    # the measured marginal is not positive; test_piggybacked_decodes_are_cheaper checks > 0
    if t2["ratio"] is not None:
        assert math.isclose(t2["ratio"], t2["decode_alone_ms_per_token"] / t2["decode_piggybacked_ms_per_token"])
    assert (t2["model"], t2["device"], t2["dtype"], t2["lm_head_in"]) == ("llama-tiny", "cpu", "float32", "others_ms")
    assert t2["torch_threads"] >= 1
    assert {k: result[k] for k in t2} == t2 and len(result["rows"]) == len(grid_points(parse_grid(QUICK)))
    table = format_table(result["rows"])
    assert len(table.splitlines()) == len(result["rows"]) + 2 and "ffn_ln2" in table


def test_piggybacked_decodes_are_cheaper(tmp_path: Path) -> None:
    """32 decodes ride on an 8-token chunk: their marginal cost is positive (a few ms, well
    above the noise) and below their cost alone."""
    grid = "quick;prefill=8;prefill_with_context=;decode=32;mixed_decode=32;context=64;reps=7"
    res = run_profile("llama-tiny", "cpu", "float32", str(tmp_path), grid=grid, progress=False)
    with open(tmp_path / "table2.json") as f:
        t2 = json.load(f)
    assert t2["decodes"] == 32 and t2["decode_context_len"] == 64 and t2["mixed_prefill_tokens"] == 8
    assert t2["decode_piggybacked_ms_per_token"] > 0
    assert t2["ratio"] > 0 and t2["ratio"] == res["ratio"]


def test_hooks_removed_and_output_unchanged() -> None:
    grid = GRIDS["quick"]
    w = build_worker("llama-tiny", block_size=grid.block_size)
    w.allocate_cache(8)
    ids = tuple(range(5, 17))
    c = SeqChunk(0, 0, ids, tuple(range(3)), True, None)

    def forward() -> torch.Tensor:
        with torch.inference_mode():
            meta = build_metadata((c,), grid.block_size, w.device)
            return w.model.logits(w.model(torch.tensor(ids), meta, w.kv_caches))

    before = forward()
    backend_forward = w.model.backend.forward
    measure(w, grid)  # reallocates and fills the cache, hooks everything, unhooks
    for m in w.model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks, m
    assert "forward" not in vars(w.model.backend)
    assert w.model.backend.forward == backend_forward
    assert torch.equal(forward(), before)


def test_totals_come_from_the_unhooked_c_loop() -> None:
    """The per-op hooks need the Python layer loop; each point's total is a second forward through
    the C++ one (what a deployment runs), and the C++ loop is back after."""
    from stages import cpu_kernels
    if not cpu_kernels.available():
        pytest.skip("CPU kernels could not be built here")
    grid = GRIDS["quick"]
    w = build_worker("llama-tiny", block_size=grid.block_size)
    loop = w.model.layer_loop
    assert loop is not None
    calls = []
    inner = loop.forward
    loop.forward = lambda *a: calls.append(1) or inner(*a)  # an instance attribute: counts the C++ loop's steps
    rows = measure(w, grid)
    assert len(calls) == (grid.warmup + grid.reps) * len(rows)
    assert w.model.layer_loop is loop
    assert all(r["measured_total_ms"] > 0 and r["preproj_ms"] > 0 for r in rows)


def test_bfloat16_runs(tmp_path: Path) -> None:
    res = run_profile("llama-tiny", "cpu", "bfloat16", str(tmp_path), grid="quick;reps=1;warmup=0", progress=False)
    assert res["dtype"] == "bfloat16" and len(res["rows"]) == len(grid_points(parse_grid("quick")))
    assert all(r["total_ms"] > 0 for r in res["rows"])


def test_threads_restored(tmp_path: Path) -> None:
    before = torch.get_num_threads()
    res = run_profile("llama-tiny", "cpu", "float32", str(tmp_path), grid="quick;reps=1;warmup=0",
                      threads=2, progress=False)
    assert res["torch_threads"] == 2 and torch.get_num_threads() == before


def test_grid_parsing() -> None:
    assert parse_grid("default") == Grid() and parse_grid("quick") == GRIDS["quick"]
    g = parse_grid("prefill=64,128;decode=1,4;mixed_decode=4;context=512;reps=2")
    assert (g.prefill, g.decode, g.mixed_decode, g.context, g.reps) == ((64, 128), (1, 4), (4,), 512, 2)
    assert g.mixed_prefill == Grid().mixed_prefill and g.stat == "median"
    q = parse_grid("quick;reps=5;stat=min;prefill_with_context=")
    assert (q.reps, q.stat, q.prefill_with_context, q.decode) == (5, "min", (), GRIDS["quick"].decode)
    # the mixed rows' baseline (prefill-only at the mixed P, no context) is always measured
    assert ("prefill", 256, 0, 0) in [(p.kind, p.prefill_tokens, p.decode_tokens, p.context_len)
                                      for p in grid_points(g)]
    for bad in ("prefill=a", "nosuch=3", "reps=1,2", "decode=0", "reps=0", "context=0", "stat=mean", "quick;x"):
        with pytest.raises(ValueError):
            parse_grid(bad)


def test_grid_longer_than_model_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_position_embeddings"):
        run_profile("llama-tiny", "cpu", "float32", str(tmp_path), grid="quick;context=4096", progress=False)


def test_summary_flags_a_negative_piggybacked_cost() -> None:
    """Under outside load a mixed batch can time below its chunk alone: no ratio is printed from it."""
    from pp_runtime.profile_tables import format_summary
    t2 = {"decode_alone_ms_per_token": 30.0, "decode_piggybacked_ms_per_token": -39.7, "ratio": None, "decodes": 4,
          "decode_context_len": 256, "mixed_prefill_tokens": 256, "prefill_ms_per_token_at_256": 3.6,
          "prefill_tokens_for_per_token": 256}
    assert "noise-dominated" in format_summary(t2)
    assert "noise" not in format_summary({**t2, "decode_piggybacked_ms_per_token": 7.5, "ratio": 4.0})
