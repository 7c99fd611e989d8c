"""What the scheduler costs per micro-batch on the driver (target 5's control plane, its share).

    .venv/bin/python benchmarks/schedule_cost.py            # 128 running, pp = 2, ~2 s
    .venv/bin/python benchmarks/schedule_cost.py --smoke    # tiny sizes, a second

No model and no workers: the real Scheduler and BlockManager over ``--running`` decoding
requests at depth ``--pp``. Measured, each the best of 3 timings:
  * one schedule() + postprocess() of a decode micro-batch (running / pp decodes), prefix
    caching off and on;
  * sarathi's admission check for a waiting prompt (``Scheduler._can_start``, run on every
    schedule call while one waits) at each of ``--head-lengths`` tokens.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Callable

from pp_runtime.config import SchedulerConfig
from pp_runtime.kv_cache import BlockManager
from pp_runtime.request import Request, SamplingParams
from pp_runtime.scheduler import Scheduler


def per_call_us(f: Callable[[], object], n: int) -> float:
    """Best of 3 timings of n calls, in µs a call."""
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6


def step(s: Scheduler) -> None:
    """One micro-batch planned and its tokens taken back, as the engine does."""
    mb = s.schedule()
    s.postprocess(mb, [5] * sum(1 for c in mb.chunks if c.sample is not None))


def decoding_scheduler(running: int, pp: int, prefix: bool, max_len: int) -> Scheduler:
    """``running`` requests of 100-token prompts, prefilled, every one decoding."""
    batch = -(-running // pp)
    cfg = SchedulerConfig("sarathi", 256, batch, max_model_len=max_len, max_running=running + 1)
    s = Scheduler(cfg, BlockManager(4 * max_len, 16, prefix), depth=pp)
    for i in range(running):
        prompt = [1 + (i * 31 + j) % 1000 for j in range(100)]
        s.add(Request(f"r{i}", i, prompt, SamplingParams(max_tokens=max_len // 2, ignore_eos=True)))
    while s.waiting or any(r.is_prefilling for r in s.running):
        step(s)
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", type=int, default=128)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--head-lengths", default="1000,8000,32000")
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.smoke:
        a.running, a.head_lengths, a.calls = 8, "100,400", 20
    heads = [int(n) for n in a.head_lengths.split(",")]
    max_len = 2 * max(heads) + 1000
    out: dict = {"running": a.running, "pp": a.pp}
    for prefix in (False, True):
        s = decoding_scheduler(a.running, a.pp, prefix, max_len)
        key = "prefix_caching" if prefix else "no_prefix_caching"
        out[f"{key}_schedule_us"] = per_call_us(lambda: step(s), a.calls)
        for n in heads:
            head = Request("head", 10 ** 6 + n, [7 + j % 900 for j in range(n)], SamplingParams(max_tokens=10))
            out[f"{key}_can_start_{n}_us"] = per_call_us(lambda: s._can_start(head), 4 * a.calls)
        print(f"prefix caching {'on ' if prefix else 'off'}: schedule + postprocess of {-(-a.running // a.pp)} "
              f"decodes {out[f'{key}_schedule_us']:.0f} µs; a waiting prompt's admission check "
              + ", ".join(f"{n} tokens {out[f'{key}_can_start_{n}_us']:.1f} µs" for n in heads))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
