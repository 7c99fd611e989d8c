"""What each kind of process imports as it starts, checked in a fresh Python.

A stage worker (Ray actor, torchrun rank) imports stages.worker as it starts, so a heavy import
there is paid once per process, per run. Importing torch.nn.attention.bias at module level pulled
in torch._dynamo: `import stages.worker` took 5.8 s on the 2-core box, 3.2 s without it, and two
torchrun tests went from 39 to 29 s. A Ray deployment's driver schedules and never touches a
tensor, so it needs no torch at all (~2 s): its topology, the workers' specs and their memory
profiles are plain Python (pp_runtime/topology.py, stages/worker_spec.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# torch._dynamo: torch.compile's tracer, ~2 s; transformers: ~2 s, wanted only for a GGUF's tokenizer;
# triton: ~0.2 s, wanted only as a CUDA kernel compiles
NOT_AT_START = ("torch._dynamo", "transformers", "matplotlib", "triton")
DRIVER = NOT_AT_START + ("torch",)
# in import order: a Ray driver's modules first (no torch), then the workers' (torch, none of the above)
STARTS = (("launch.cli", DRIVER), ("launch.commands", DRIVER), ("pp_runtime.llm", DRIVER),
          ("launch.ray_executor", DRIVER), ("stages.worker", NOT_AT_START), ("launch.torchrun_main", NOT_AT_START))
CHECK = f"""
import importlib, sys
for name, unwanted in {STARTS!r}:
    importlib.import_module(name)
    print(name, *(m for m in unwanted if m in sys.modules))
"""


def test_a_start_imports_nothing_it_does_not_use() -> None:
    r = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.split("\n")[:len(STARTS)]
    assert [ln.split()[0] for ln in lines] == [name for name, _ in STARTS], r.stdout
    for ln in lines:
        assert len(ln.split()) == 1, f"importing {ln.split()[0]} imports {' '.join(ln.split()[1:])}"
