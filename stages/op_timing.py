"""Per-operation timers for a stage model: forward hooks on the four linears of every layer and
on the LM head, a wrapper around the attention backend's ``forward``; where the stage runs its
layers as one C++ call (stages/layer_loop.py), that call times the same buckets itself.

    timer = OpTimer(sync=lambda: None)
    with instrument(model, timer):
        timer.reset(); model(ids, meta, kv)   # timer.acc: seconds per op ("lm_head" included)
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

import torch

from pp_runtime.profile_stats import OPS

_LINEARS = {"preproj": "self_attn.qkv_proj", "postproj": "self_attn.o_proj",
            "ffn_ln1": "mlp.gate_up_proj", "ffn_ln2": "mlp.down_proj"}


class OpTimer:
    """Accumulates seconds per bucket; ``sync`` runs at every boundary (CUDA synchronize)."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.acc: dict[str, float] = {}
        self._t0: dict[str, float] = {}

    def reset(self) -> None:
        self.acc = {op: 0.0 for op in OPS + ("lm_head",)}

    def start(self, op: str) -> None:
        self.sync()
        self._t0[op] = time.perf_counter()

    def stop(self, op: str) -> None:
        self.sync()
        self.acc[op] = self.acc.get(op, 0.0) + time.perf_counter() - self._t0.pop(op)


@contextlib.contextmanager
def instrument(model: torch.nn.Module, timer: OpTimer) -> Iterator[None]:
    """Hooks on every layer's four linears and the LM head, a timing wrapper on the attention
    backend's ``forward``; all removed on exit (also on error)."""
    handles = []
    backend = model.backend
    had_own = "forward" in vars(backend)
    saved = vars(backend).get("forward")
    loop = model.layer_loop
    if loop is not None:  # the C++ layer loop times its ops itself; the hooks below fire on the Python one
        loop.timer = timer
    try:
        for layer in model.layers:
            for op, path in _LINEARS.items():
                if not hasattr(layer, path.split(".")[0]):
                    continue  # the other half of a layer cut by a stage boundary
                mod = layer.get_submodule(path)
                handles.append(mod.register_forward_pre_hook(lambda m, a, op=op: timer.start(op)))
                handles.append(mod.register_forward_hook(lambda m, a, o, op=op: timer.stop(op)))
        if model.lm_head is not None:
            handles.append(model.lm_head.register_forward_pre_hook(lambda m, a: timer.start("lm_head")))
            handles.append(model.lm_head.register_forward_hook(lambda m, a, o: timer.stop("lm_head")))
        inner = backend.forward

        def timed_forward(*args: object, **kwargs: object) -> torch.Tensor:
            timer.start("attn")
            try:
                return inner(*args, **kwargs)
            finally:
                timer.stop("attn")

        backend.forward = timed_forward
        yield
    finally:
        if loop is not None:
            loop.timer = None
        for h in handles:
            h.remove()
        if had_own:
            backend.forward = saved
        else:
            vars(backend).pop("forward", None)
