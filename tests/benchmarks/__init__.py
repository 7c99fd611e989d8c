"""The benchmark scripts (benchmarks/), one test module per script, run end to end at reduced
size: smoke tests, which never assert a time. The helpers below run a script as its user would."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(args: list[str], tmp: Path) -> dict:
    """``python <args> --json OUT`` from the repository root; the JSON it wrote."""
    out = tmp / "r.json"
    proc = subprocess.run([sys.executable] + args + ["--json", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def load_script(name: str) -> object:
    """benchmarks/<name>.py as a module (the scripts import their neighbours by bare name)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return mod
