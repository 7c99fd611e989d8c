"""The report (pp_runtime/report.py, with run_plots.py, profile_plots.py and figures.py): every
plot is written from hand-made run, bench and profile directories, the bubble CDF carries the
numbers of the design's bubble definition, missing inputs skip their plot, and a directory with
no inputs is an error naming it."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import matplotlib.image
import pytest

from pp_runtime.figures import wants_log
from pp_runtime.report import load_records, load_run, make_report
from pp_runtime.run_plots import cdf_points, gantt_window, merged_spans, request_bubble_times, throughput_series
from pp_runtime.timing import TimingRecord

T0 = 1000.0  # absolute wall-clock zero of the run: the report must subtract it

# 2 stages, tp=1: two prefills (a: 8 tokens, b: 4), a decode of a and b, then a mixed batch
# (a, b decode + c's 4-token prefill). (mb, request_ids, prefill, decode, kv, stage 0 span, stage 1 span)
MBS = [
    (0, ("a",), 8, 0, 8, (0.00, 0.10), (0.10, 0.20)),
    (1, ("b",), 4, 0, 4, (0.10, 0.15), (0.20, 0.25)),
    (2, ("a", "b"), 0, 2, 14, (0.25, 0.27), (0.27, 0.29)),
    (3, ("a", "b", "c"), 4, 2, 20, (0.30, 0.36), (0.36, 0.42)),
]
# Gaps, stage 0: 0, 0, .10, .03; stage 1: .10, 0, .02, .07 (the first one is measured from T0).
# a: mb0 .10 + mb2 .12 + mb3 .10 = .32; b: 0 + .12 + .10 = .22; c: mb3 .10.
EXPECTED_BUBBLES = [0.10, 0.22, 0.32]


def records(mbs: list[tuple] = MBS, tp: int = 1) -> list[dict]:
    out = []
    for mb, rids, p, d, kv, *spans in mbs:
        for stage, (s, e) in enumerate(spans):
            for rank in range(tp):
                out.append({"stage": stage, "tp_rank": rank, "mb": mb, "iter": mb, "request_ids": list(rids),
                            "prefill_tokens": p, "decode_tokens": d, "kv_tokens": kv,
                            "t_ready": T0 + s - 0.01, "t_start": T0 + s, "t_end": T0 + e})
    return out


def summary(scheduler: str, pd_ratio: float, throughput: float, chunk: int = 256) -> dict:
    return {"scheduler": scheduler, "pp": 2, "tp": 1, "chunk_size": chunk, "max_batch_size": 8,
            "num_requests": 3, "prefill_tokens": 16, "decode_tokens": 4, "wall_s": 0.42,
            "throughput_tok_s": throughput, "decode_tok_s": 9.5, "bubble_s_per_request_p50": 0.22,
            "bubble_s_per_request_p90": 0.30, "bubble_fraction_per_stage": [0.31, 0.45],
            "bubble_s_by_cause": {"PB1": 0.0, "PB2": 0.07, "PB3": 0.02, "other": 0.23},
            "ttft_s_p50": 0.2, "ttft_s_p99": 0.4, "tbt_s_p50": 0.05, "tbt_s_p99": 0.1,
            "microbatch_time_cv": 0.5, "run_start": T0,
            "workload": {"kind": "synthetic", "pd_ratio": pd_ratio, "theta": 0.5, "min_len": 4, "max_len": 8,
                         "num_requests": 3, "arrival": "offline"}}


def write_run(d: Path, summ: dict | None = None, recs: list[dict] | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    if summ is not None:
        (d / "summary.json").write_text(json.dumps(summ))
    if recs is not None:
        (d / "stage_timings.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d


def write_bench(d: Path, pd_ratio: float) -> Path:
    for sched, tput in (("sarathi", 120.0), ("orca", 80.0)):
        write_run(d / sched, summary(sched, pd_ratio, tput * pd_ratio / 10), records())
    (d / "comparison.json").write_text(json.dumps({"sarathi": {"throughput_tok_s": 1.0},
                                                   "orca": {"throughput_tok_s": 0.67}}))
    return d


PROFILE_COLS = ["kind", "prefill_tokens", "decode_tokens", "context_len", "preproj_ms", "attn_ms", "postproj_ms",
                "ffn_ln1_ms", "ffn_ln2_ms", "others_ms", "total_ms", "per_token_ms", "per_decode_token_ms"]


def write_profile(d: Path) -> Path:
    """Rows shaped like stages/profile.py's grid: fresh prefills, one chunk after a cached
    context, decodes at two context lengths, and mixed batches of one P with several B."""
    d.mkdir(parents=True, exist_ok=True)
    rows = []
    for p, ctx in ((16, 0), (64, 0), (240, 0), (1024, 0), (240, 512)):
        total = 2.0 + 0.01 * p + 0.002 * ctx
        rows.append(["prefill", p, 0, ctx, *[total / 6] * 6, total, total / p, ""])
    for b in (1, 4, 16):
        for ctx in (128, 512):
            total = 1.5 + 0.02 * b + ctx * 1e-4
            rows.append(["decode", 0, b, ctx, *[total / 6] * 6, total, total / b, total / b])
    for b in (4, 16):
        total = 2.0 + 0.01 * 240 + 0.03 * b
        rows.append(["mixed", 240, b, 256, *[total / 6] * 6, total, total / (240 + b), 0.03])
    with open(d / "profile.csv", "w", newline="") as f:
        csv.writer(f).writerows([PROFILE_COLS, *rows])
    return d


def assert_png(path: str | Path) -> None:
    data = Path(path).read_bytes()
    assert data.startswith(b"\x89PNG"), path
    img = matplotlib.image.imread(path)
    assert img.shape[0] > 0 and img.shape[1] > 0, path


def names(paths: list[str]) -> set[str]:
    return {str(Path(p).relative_to(Path(p).parents[1])) for p in paths}


# ---- the numbers -----------------------------------------------------------------------------------
def test_cdf_points_on_known_values() -> None:
    xs, ys = cdf_points([0.3, 0.1, 0.2, 0.1])
    assert xs == [0.1, 0.1, 0.2, 0.3]
    assert ys == [0.25, 0.5, 0.75, 1.0]
    assert cdf_points([]) == ([], [])


def test_request_bubble_times_follow_the_design_definition(tmp_path: Path) -> None:
    write_run(tmp_path, recs=records(tp=2))  # rank 1 duplicates rank 0 and must not double-count
    got = request_bubble_times(load_records(tmp_path / "stage_timings.jsonl"), T0)
    assert got == pytest.approx(EXPECTED_BUBBLES)


def test_wants_log_only_past_two_decades() -> None:
    assert not wants_log([0.0, 0.1, 5.0])
    assert wants_log([0.0, 0.01, 5.0])
    assert not wants_log([3.0])


def test_gantt_window_covers_first_n_stage0_microbatches_across_the_pipeline() -> None:
    mbs = [(i, (f"r{i}",), 0, 1, 10, (i * 0.1, i * 0.1 + 0.05), (i * 0.1 + 0.05, i * 0.1 + 0.1)) for i in range(50)]
    recs = [TimingRecord(**{**r, "request_ids": tuple(r["request_ids"])}) for r in records(mbs)]
    # mb 39 ends on stage 1 at 3.9 + 0.1
    assert gantt_window(recs, T0, max_microbatches=40) == pytest.approx(4.0)
    assert gantt_window(recs, T0, max_microbatches=50) is None
    assert gantt_window(recs, T0, max_seconds=1.5) == 1.5
    assert gantt_window(recs, T0, max_seconds=100.0) is None


def test_throughput_series_groups_by_scheduler_and_chunk(tmp_path: Path) -> None:
    runs = [load_run(write_run(tmp_path / n, summary(s, pd, t, c)))
            for n, s, pd, t, c in (("a", "sarathi", 50, 5.0, 256), ("b", "sarathi", 10, 1.0, 256),
                                   ("c", "sarathi", 10, 2.0, 512), ("d", "orca", 10, 3.0, 256))]
    assert throughput_series(runs) == {"orca, chunk 256": [(10.0, 3.0)],
                                       "sarathi, chunk 256": [(10.0, 1.0), (50.0, 5.0)],
                                       "sarathi, chunk 512": [(10.0, 2.0)]}


# ---- the plots ---------------------------------------------------------------------------------------
def test_two_bench_dirs_give_every_plot(tmp_path: Path) -> None:
    b10, b50 = write_bench(tmp_path / "pd10", 10), write_bench(tmp_path / "pd50", 50)
    paths = make_report([str(b10), str(b50)])
    assert names(paths) == {"sarathi/gantt.png", "orca/gantt.png", "pd10/bubble_cdf.png",
                            "pd10/bubble_by_cause.png", "pd10/throughput_vs_pd.png"}
    for p in paths:
        assert_png(p)
    assert (b10 / "throughput_vs_pd.png").is_file() and not (b50 / "throughput_vs_pd.png").exists()
    assert (b50 / "orca" / "gantt.png").is_file()


def test_one_bench_dir_has_no_pd_plot_and_out_dir_is_used(tmp_path: Path) -> None:
    bench = write_bench(tmp_path / "bench", 10)
    out = tmp_path / "plots" / "combined"
    paths = make_report([str(bench)], out=str(out))
    assert {Path(p).name for p in paths if Path(p).parent == out} == {"bubble_cdf.png", "bubble_by_cause.png"}
    assert not (bench / "bubble_cdf.png").exists()
    for p in paths:
        assert_png(p)


def test_plain_run_dirs_with_tp_and_long_run(tmp_path: Path) -> None:
    short = write_run(tmp_path / "short", summary("sarathi", 10, 100.0), records(tp=2))
    mbs = [(i, (f"r{i % 5}",), 8 if i % 3 == 0 else 0, 4, 10 + i, (i * 0.1, i * 0.1 + 0.06),
            (i * 0.1 + 0.07, i * 0.1 + 0.12)) for i in range(60)]
    long = write_run(tmp_path / "long", summary("orca", 50, 60.0), records(mbs))
    paths = make_report([str(short), str(long)])
    assert names(paths) == {"short/gantt.png", "long/gantt.png", "long/gantt_full.png", "short/bubble_cdf.png",
                            "short/bubble_by_cause.png", "short/throughput_vs_pd.png"}
    for p in paths:
        assert_png(p)


def test_merged_spans_join_what_is_closer_than_the_gap() -> None:
    spans = [(5.0, 1.0), (0.0, 1.0), (1.5, 1.0), (2.6, 0.1)]
    assert merged_spans(spans, 0.0) == spans  # no pixel limit: every bar as it is
    flat = lambda g: [x for span in merged_spans(spans, g) for x in span]
    assert flat(0.6) == pytest.approx([0.0, 2.7, 5.0, 1.0])
    assert flat(0.4) == pytest.approx([0.0, 1.0, 1.5, 1.2, 5.0, 1.0])


def test_a_run_with_more_bars_than_pixels(tmp_path: Path) -> None:
    """A long simulated run (10^5 micro-batches a stage) is drawn at pixel resolution: bars closer
    than a pixel merge, idle gaps under a pixel are not hatched (they would cover the busy time).
    fig12's sarathi run (650k records): 125 s bar by bar, 25 s so."""
    mbs = [(i, (f"r{i % 7}",), 8 if i % 4 == 0 else 0, 4, 10 + i % 50, (i * 1.0, i * 1.0 + 0.9),
            (i * 1.0 + 0.95, i * 1.0 + 1.9)) for i in range(20000)]
    run = write_run(tmp_path / "sim", summary("sarathi", 10, 100.0), records(mbs))
    paths = make_report([str(run)])
    assert "sim/gantt_full.png" in names(paths)
    for p in paths:
        assert_png(p)


def test_bubble_cdf_spanning_decades_with_zero_bubbles(tmp_path: Path) -> None:
    # one stage: x waits 0, y 1 ms, z 1 s -> a log axis that must still show the zero
    mbs = [(0, ("x",), 4, 0, 4, (0.0, 0.01)), (1, ("y",), 4, 0, 4, (0.011, 0.02)),
           (2, ("z",), 4, 0, 4, (1.02, 1.03))]
    d = write_run(tmp_path / "r", summary("sarathi", 10, 1.0), records(mbs))
    assert request_bubble_times(load_records(d / "stage_timings.jsonl"), T0) == pytest.approx([0.0, 0.001, 1.0])
    assert "r/bubble_cdf.png" in names(make_report([str(d)]))
    assert_png(d / "bubble_cdf.png")


def test_profile_only_dir(tmp_path: Path) -> None:
    d = write_profile(tmp_path / "prof")
    paths = make_report([str(d)])
    assert paths == [str(d / "per_token_cost.png")]
    assert_png(paths[0])


def test_deployment_profile_dir_plots_each_stage(tmp_path: Path) -> None:
    """profile --pp 2 writes OUT/stage-0/, OUT/stage-1/: OUT itself is a valid report input."""
    out = tmp_path / "deploy"
    stages = [write_profile(out / f"stage-{s}") for s in range(2)]
    assert make_report([str(out)]) == [str(d / "per_token_cost.png") for d in stages]


def test_missing_inputs_skip_their_plots(tmp_path: Path) -> None:
    # summary only: no Gantt, no CDF, but the summary's bubble causes still plot
    only_summary = write_run(tmp_path / "s", summary("sarathi", 10, 100.0))
    assert names(make_report([str(only_summary)])) == {"s/bubble_by_cause.png"}
    # timings only: run_start falls back to the first t_ready; causes are recomputed from the gaps
    only_timings = write_run(tmp_path / "t", recs=records())
    assert names(make_report([str(only_timings)])) == {"t/gantt.png", "t/bubble_cdf.png", "t/bubble_by_cause.png"}
    # an empty timings file and no summary: nothing to plot, but no error either
    empty_timings = write_run(tmp_path / "e", recs=[])
    assert make_report([str(empty_timings)]) == []
    # a profile with a header only
    prof = tmp_path / "p"
    prof.mkdir()
    (prof / "profile.csv").write_text(",".join(PROFILE_COLS) + "\n")
    assert make_report([str(prof)]) == []


def test_profile_without_matching_batch_sizes_still_plots(tmp_path: Path) -> None:
    d = tmp_path / "prof"
    d.mkdir()
    with open(d / "profile.csv", "w", newline="") as f:
        csv.writer(f).writerows([PROFILE_COLS, ["prefill", 32, 0, 32, 1, 1, 1, 1, 1, 1, 6, 0.19, ""],
                                 ["decode", 0, 2, 64, 1, 1, 1, 1, 1, 1, 6, 3.0, 3.0]])
    assert_png(make_report([str(d)])[0])


def test_bad_timing_line_is_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = write_run(tmp_path / "r", summary("sarathi", 10, 1.0), records())
    with open(d / "stage_timings.jsonl", "a") as f:
        f.write('{"stage": 0, "tp_rank": 0, "mb"')  # a run killed mid-write
    assert len(load_records(d / "stage_timings.jsonl")) == len(records())
    assert "skipping bad timing line" in capsys.readouterr().err


def test_empty_or_missing_dir_is_an_error_naming_it(tmp_path: Path) -> None:
    empty = tmp_path / "empty_run"
    empty.mkdir()
    with pytest.raises(ValueError, match="empty_run"):
        make_report([str(empty)])
    with pytest.raises(ValueError, match="nowhere"):
        make_report([str(tmp_path / "nowhere")])
    with pytest.raises(ValueError):
        make_report([])
