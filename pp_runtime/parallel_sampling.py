"""Parallel sampling (vLLM's ``SamplingParams.n``): n samples of one prompt as n sequences.

    reqs = fan_out(reqs, fork)     # each request with n > 1, then its n - 1 siblings right after it
    offsets = per_sample(offsets, reqs)   # a per-request list, one entry per sample
    outs = group_outputs(reqs)     # one RequestOutput per request, every sample in its .outputs

Each sample is a sequence of its own (seq id, KV blocks, sampling seed), so the scheduler, the
block manager and the stages need nothing new. The prompt is prefilled once all the same: the
siblings queue right behind the first sample, and the scheduler registers a prompt's whole blocks
in the prefix cache as soon as it plans them (kv_cache.py), so each sibling is admitted onto
those blocks and computes only the prompt's last, partial block. Without prefix caching
(``enable_prefix_caching=False``) every sample prefills the prompt itself.

As in vLLM, sample i of a request seeded with s samples with seed s + i, so sample 0 is what
the same request with n = 1 gives; unseeded samples draw from their own sequence ids.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence, TypeVar

from pp_runtime.outputs import RequestOutput
from pp_runtime.request import SEED_RANGE, Request, SamplingParams

T = TypeVar("T")


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample ``index``'s params: one sample (n = 1), seed + index when seeded (wrapping within
    SEED_RANGE, whose ends torch takes as equal mod 2^64)."""
    if params.seed is None:
        return replace(params, n=1)
    seed = params.seed + index
    return replace(params, n=1, seed=seed - (1 << 64) if seed >= SEED_RANGE[1] else seed)


def fan_out(reqs: list[Request], fork: Callable[[Request, int, SamplingParams], Request]) -> list[Request]:
    """``reqs`` with every request of n > 1 (its sample 0) followed by its samples 1 … n-1, made by
    ``fork(req, index, sample_params(req.params, index))`` (a request finished already with an
    error: samples with the same error, so an output has its n samples however it failed). The
    order matters twice: FCFS admits the siblings after sample 0 (prefix cache hits), and
    ``requests_of`` reads each request's samples as a run of indices 0, 1, …"""
    out: list[Request] = []
    for req in reqs:
        out.append(req)  # sample 0 keeps its params: seed + 0, and nothing past here reads n
        out.extend(fork(req, i, sample_params(req.params, i)) for i in range(1, req.params.n))
    return out


def requests_of(reqs: list[Request]) -> list[list[Request]]:
    """The requests of a fanned-out list, each as its samples' sequences: index 0 starts one."""
    groups: list[list[Request]] = []
    for req in reqs:
        if req.index == 0 or not groups:
            groups.append([req])
        else:
            groups[-1].append(req)
    return groups


def group_outputs(reqs: list[Request]) -> list[RequestOutput]:
    """One RequestOutput per request of a fanned-out list."""
    return [RequestOutput.from_samples(g) for g in requests_of(reqs)]


def per_sample(values: Sequence[T], reqs: list[Request]) -> list[T]:
    """``values``, one per request before ``fan_out``, repeated for each sample of ``reqs`` (after it)."""
    return [v for v, samples in zip(values, requests_of(reqs)) for _ in samples]
