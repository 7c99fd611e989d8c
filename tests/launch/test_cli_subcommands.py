"""`pp-runtime simulate`, `profile` and `report` through the CLI entry point."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.cli import main
from pp_runtime.profile_tables import CSV_COLUMNS

REPO = Path(__file__).resolve().parents[2]


def test_simulate_then_report(tmp_path: Path) -> None:
    """simulate writes the report's PNGs itself (DESIGN.md §3.4); report writes them again."""
    out = tmp_path / "sim"
    assert main(["simulate", "--config", str(REPO / "configs/sim/smoke.yaml"), "--out", str(out), "--quiet"]) == 0
    comp = json.loads((out / "comparison.json").read_text())
    assert {"sarathi", "orca"} <= set(comp["schedulers"])
    for name in ("sarathi", "orca"):
        assert all((out / name / f).exists() for f in ("stage_timings.jsonl", "summary.json", "trace.json",
                                                        "gantt.png"))
    assert (out / "bubble_cdf.png").stat().st_size > 0
    (out / "bubble_cdf.png").unlink()
    assert main(["report", str(out)]) == 0
    assert (out / "bubble_cdf.png").stat().st_size > 0 and (out / "sarathi" / "gantt.png").exists()


def test_simulate_and_bench_take_a_bare_config_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture) -> None:
    """--config smoke from a folder without such a file: configs/sim/smoke.yaml, and the default
    --out is named after it; an unknown name is one line naming both places looked at."""
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "--config", "smoke", "--quiet"]) == 0
    assert (tmp_path / "runs" / "sim_smoke" / "comparison.json").is_file()
    assert main(["bench", "--config", "no_such_workload"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no_such_workload" in err[0] and "configs/runs/" in err[0]


def test_profile_quick(tmp_path: Path) -> None:
    assert main(["profile", "--model", "llama-tiny", "--grid", "quick", "--out", str(tmp_path), "--quiet"]) == 0
    assert (tmp_path / "profile.csv").read_text().startswith("kind,prefill_tokens,decode_tokens,context_len")
    assert "ratio" in json.loads((tmp_path / "table2.json").read_text())


def test_profile_colocated_grid_overrides(tmp_path: Path) -> None:
    """--colocate 2: a sibling process profiles the same grid at the same time, into colocated-1."""
    grid = "quick;decode=1,2;context=12"
    assert main(["profile", "--model", "llama-tiny", "--grid", grid, "--colocate", "2", "--out", str(tmp_path),
                 "--quiet"]) == 0
    for d in (tmp_path, tmp_path / "colocated-1"):
        rows = (d / "profile.csv").read_text().splitlines()
        assert rows[0].split(",") == list(CSV_COLUMNS) and any(r.startswith("decode,0,2,12,") for r in rows)
    assert len(list((tmp_path / ".barrier").iterdir())) == 2


def test_profile_bad_grid_one_line(capsys: pytest.CaptureFixture) -> None:
    assert main(["profile", "--model", "llama-tiny", "--grid", "decode=x", "--out", "/tmp/never"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad grid value" in err[0]


def test_simulate_missing_config_exits_2(tmp_path: Path, capsys: object) -> None:
    assert main(["simulate", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


def test_bench_run_dir_is_its_out(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """bench writes a run directory per scheduler under --out; --run-dir (DESIGN.md's shared
    overrides) names the same directory, and two different ones are refused."""
    rc = main(["bench", "--config", str(REPO / "configs/runs/smoke.yaml"), "--out", "/tmp/a", "--run-dir", "/tmp/b"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "bench takes one output directory" in err[0]
    rc = main(["bench", "--config", str(REPO / "configs/runs/smoke.yaml"), "--schedulers", "orca,fifo"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--schedulers: unknown fifo" in err[0]
    out = tmp_path / "bench"  # --schedulers replaces the config's list (sarathi, orca)
    assert main(["bench", "--config", str(REPO / "configs/runs/smoke.yaml"), "--run-dir", str(out), "--quiet",
                 "--schedulers", "orca"]) == 0
    comp = json.loads((out / "comparison.json").read_text())
    assert comp["base"] == "orca" and set(comp["schedulers"]) == {"orca"}
    assert (out / "orca" / "summary.json").is_file() and not (out / "sarathi").exists()
    assert (out / "orca" / "gantt.png").stat().st_size > 0 and (out / "bubble_by_cause.png").stat().st_size > 0


def test_report_gantt_window_and_a_bad_directory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`report --window-s` cuts the Gantt chart (the full one is kept beside it); a directory with
    nothing to plot is one line naming it, exit 2; the two window flags exclude each other."""
    from tests.pp_runtime.test_report import records, summary, write_run
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["report", str(empty)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(empty) in err[0]
    d = write_run(tmp_path / "r", summary("sarathi", 10, 1.0), records())
    assert main(["report", str(d), "--window-s", "0.2"]) == 0
    assert (d / "gantt.png").is_file() and (d / "gantt_full.png").is_file()
    with pytest.raises(SystemExit) as e:
        main(["report", str(d), "--window-s", "0.2", "--window-mbs", "3"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
