"""What a worker imports: every stage worker (Ray actor, torchrun rank) and every CLI run imports
stages.worker as it starts, so a heavy import there is paid once per process, per run. Importing
torch.nn.attention.bias at module level pulled in torch._dynamo: `import stages.worker` took 5.8 s
on the 2-core box, 3.2 s without it, and two torchrun tests went from 39 to 29 s."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# torch._dynamo: torch.compile's tracer, ~2 s; transformers: ~2 s, wanted only for a GGUF's tokenizer;
# triton: ~0.2 s, wanted only as a CUDA kernel compiles
NOT_AT_START = ("torch._dynamo", "transformers", "matplotlib", "triton")


# what each kind of process imports as it starts: a stage worker, a Ray actor, a torchrun rank, the CLI
STARTS = ("stages.worker", "launch.stage_actor", "launch.torchrun_main", "launch.cli")
CHECK = f"""
import importlib, sys
for name in {STARTS!r}:
    importlib.import_module(name)
    print(name, *(m for m in {NOT_AT_START!r} if m in sys.modules))
"""


def test_a_worker_start_imports_nothing_it_does_not_use() -> None:
    r = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.split("\n")[:len(STARTS)]
    assert [ln.split()[0] for ln in lines] == list(STARTS), r.stdout
    for ln in lines:
        assert len(ln.split()) == 1, f"importing {ln.split()[0]} imports {' '.join(ln.split()[1:])}"
