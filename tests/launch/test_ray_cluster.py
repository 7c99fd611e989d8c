"""launch/ray_cluster.py: the LLMs alive in one process share its Ray; the last one to go stops a
Ray it started, and one the caller started is left running. Each case runs in a fresh Python,
since Ray is one per process."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SHARED = """
import gc, ray, sys
from pp_runtime import LLM, SamplingParams
make = lambda: LLM(model="llama-tiny", launcher="ray", memory_budget_gb=0.05, threads=1)
p = SamplingParams(max_tokens=4)
a, b = make(), make()
want = a.generate([[3, 4, 5]], p)[0].token_ids
assert "torch" not in sys.modules, "the driver imported torch: it never touches a tensor"
a.shutdown()  # a started Ray; b's workers live in it
assert ray.is_initialized()
assert b.generate([[3, 4, 5]], p)[0].token_ids == want and not b.broken
c = make()
del c  # dropped unshut: its share is given back too
gc.collect()
assert ray.is_initialized()
b.shutdown()
assert not ray.is_initialized(), "the last LLM left Ray running"
ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
d = make()
d.shutdown()
assert ray.is_initialized(), "an LLM stopped the caller's own Ray"
ray.shutdown()
print("ok")
"""


def test_two_llms_share_ray_and_the_last_stops_it() -> None:
    r = subprocess.run([sys.executable, "-c", SHARED], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
