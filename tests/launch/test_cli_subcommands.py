"""`pp-runtime simulate`, `profile` and `report` through the CLI entry point."""
from __future__ import annotations

import json
from pathlib import Path

from launch.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_simulate_then_report(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    assert main(["simulate", "--config", str(REPO / "configs/sim/smoke.yaml"), "--out", str(out), "--quiet"]) == 0
    comp = json.loads((out / "comparison.json").read_text())
    assert {"sarathi", "orca"} <= set(comp["schedulers"])
    for name in ("sarathi", "orca"):
        assert all((out / name / f).exists() for f in ("stage_timings.jsonl", "summary.json", "trace.json"))
    assert main(["report", str(out)]) == 0
    assert (out / "bubble_cdf.png").stat().st_size > 0 and (out / "sarathi" / "gantt.png").exists()


def test_profile_quick(tmp_path: Path) -> None:
    assert main(["profile", "--model", "llama-tiny", "--grid", "quick", "--out", str(tmp_path), "--quiet"]) == 0
    assert (tmp_path / "profile.csv").read_text().startswith("kind,prefill_tokens,decode_tokens,context_len")
    assert "ratio" in json.loads((tmp_path / "table2.json").read_text())


def test_simulate_missing_config_exits_2(tmp_path: Path, capsys: object) -> None:
    assert main(["simulate", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
