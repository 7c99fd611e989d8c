"""``step_costs="fit"`` (``--step-costs fit``): measure what a micro-batch's pieces cost on this
deployment before serving, so that a pipeline's micro-batches are equal in measured cost.

    llm = LLM(model="smollm2-135m", pp=2, step_costs="fit")   # calls calibrate(llm) at start-up
    llm.sched_config.step_costs                                 # (prompt key, decode row, decode key)

One run of a synthetic workload (Zipf lengths, P:D = 10, all at once: prompt chunks at every
depth beside decodes of every length) under sarathi with the FLOPs budget and no step costs,
then ``cost_fit.fit_step_costs`` on its micro-batches' step times. The workload is sized so the
run has about CHUNKS micro-batches with a prompt chunk, a few times what the fit needs, and
lengths up to the deployment's max_model_len (at most 1024, the paper's Zipf range). Only a
pipeline uses the costs: with one stage nothing is run. ``LLM`` writes the KV cache's pages before
calibrating (CacheConfig.prefault): on a cold cache the OS's first touch of each page lands on the
first, shallow chunks and the fit prices a prompt key ~30% low. Plain Python, no tensors.
"""
from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING

from tqdm import tqdm

from pp_runtime.cost_fit import fit_step_costs, samples_from_run
from pp_runtime.executor import WorkerError
from pp_runtime.request import SamplingParams
from pp_runtime.workload import WorkItem, generate_workload, split_pd, zipf_pmf
from pp_runtime.workload_config import WorkloadConfig

if TYPE_CHECKING:
    from pp_runtime.llm import LLM

CHUNKS = 60  # prompt tokens ≈ CHUNKS × chunk_size: ~3× cost_fit.MIN_SAMPLES chunk micro-batches
MAX_LEN, THETA, PD_RATIO = 1024, 0.4, 10.0  # the paper's Zipf workload, as configs/runs/pp2_zipf.yaml
# at most MAX_REQUESTS: ~CHUNKS chunks of 2048 tokens at the mean Zipf prompt (~600 tokens) take ~200;
# the ones past the running cap wait their turn, as any workload's do
MIN_REQUESTS, MAX_REQUESTS = 8, 512
# The scheduling a calibration run takes, on a real deployment (calibrate) or a simulated one
# (pp_runtime.sim.run): sarathi's FLOPs budget with no costs yet; tile_align off, since another
# policy's chunk_size may be below max_batch_size, which sarathi's tile_align refuses, and the
# costs do not depend on it
SCHEDULING = dict(policy="sarathi", chunk_budget="flops", tile_align=False, step_costs=())


def calibration_workload(max_model_len: int, chunk_size: int, vocab_size: int, seed: int = 0) -> list[WorkItem]:
    """Zipf(θ = 0.4) total lengths on [L/4, L], L = min(1024, max_model_len), split P:D = 10,
    enough requests for ~CHUNKS chunks of ``chunk_size`` prompt tokens (between 8 and 512).
    Raises ValueError where max_model_len leaves no room for a prompt and a token (< 2)."""
    if max_model_len < 2:
        raise ValueError(f"step costs: a calibration run needs max_model_len ≥ 2, got {max_model_len}")
    hi = min(MAX_LEN, max_model_len)
    lo = max(2, hi // 4)
    pmf = zipf_pmf(lo, hi, THETA)
    mean_total = lo + sum(i * p for i, p in enumerate(pmf))
    mean_prompt = float(split_pd([round(mean_total)], PD_RATIO)[0][0])
    n = min(MAX_REQUESTS, max(MIN_REQUESTS, math.ceil(CHUNKS * chunk_size / mean_prompt)))
    cfg = WorkloadConfig(kind="zipf", num_requests=n, min_len=lo, max_len=hi, theta=THETA, pd_ratio=PD_RATIO,
                         seed=seed)
    return generate_workload(cfg, vocab_size)


def calibrate(llm: LLM, verbose: bool = False) -> tuple[float, float, float] | None:
    """Run the calibration workload on ``llm``'s workers, fit the step costs and set them
    (``llm.reconfigure``); the other scheduling settings are left as they were. Returns the costs,
    or None where the run could not give them (its step costs are then left empty: the FLOPs
    budget alone). With one pipeline stage nothing runs and None comes back."""
    if llm.config.parallel.pp == 1:
        if verbose:
            print("pp-runtime: step costs not fitted: with one pipeline stage they change nothing", file=sys.stderr)
        return None
    before = llm.sched_config
    items = calibration_workload(before.max_model_len, before.chunk_size, llm.source.config.vocab_size, llm.config.seed)
    if verbose:
        print(f"pp-runtime: fitting step costs on {len(items)} synthetic requests", file=sys.stderr)
    llm.reconfigure(**SCHEDULING)
    costs = None
    try:
        reqs = [llm.make_request(f"calibration-{it.request_id}", it.prompt_token_ids,
                                 SamplingParams(max_tokens=it.max_tokens, ignore_eos=True)) for it in items]
        with tqdm(total=len(reqs), disable=not verbose, file=sys.stderr, unit="req", desc="calibration") as bar:
            llm.run(reqs, on_finish=lambda _: bar.update())
        if llm.broken:  # a worker died or hung: name it, rather than fit half a run
            raise WorkerError(f"step costs not fitted: {llm.broken}")
        costs = fit_step_costs(samples_from_run(llm.engine.history, llm.executor.drain_timings()))
    finally:
        # every setting SCHEDULING changed comes back (a key added there cannot be missed here)
        llm.reconfigure(**{**{k: getattr(before, k) for k in SCHEDULING}, "step_costs": costs or ()})
    if verbose:
        print("pp-runtime: " + (f"step costs {format_costs(costs)} (fresh prompt tokens per prompt key, decode "
                                f"row, decode key; --step-costs {format_costs(costs)} reuses them)"
                                if costs else "step costs not fitted (the run could not separate them): the FLOPs budget alone"),
              file=sys.stderr)
    return costs


def format_costs(costs: tuple[float, ...]) -> str:
    """'0.000531,0.523,0.00313' (3 significant digits each): what --step-costs takes back."""
    return ",".join(f"{c:.3g}" for c in costs)
