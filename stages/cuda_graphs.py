"""CUDA graphs for decode-only steps: a stage's whole forward replayed as one launch.

A decode-only step of LLaMA-7B on an H200 took 12.6 ms at 4 decodes and 13.1 ms at 64, where its
13.5 GB of weights stream in ~3 ms: the host issuing ~13 kernels a layer from Python set the pace
(docs/BENCHMARKS.md, "The second GPU run"). As vLLM does, each decode-only step is padded to one
of a few batch sizes and its forward captured once per (size, table width) and then replayed:
the host then issues a handful of copies into the graph's input buffers and one replay. Measured
on the H200 (third GPU run): 4 rows 12.3 -> 5.1 ms, 64 rows 13.2 -> 10.7 ms, the replay bit for bit
an eager step over tables as wide as its shape's (``graphs_wanted``: on by default at tp 1).

Padded rows are decodes of one key in a scratch block that no sequence owns (the worker's cache
holds one block more than the block manager hands out): they write their K/V there and attend
to it, so the real rows and the sequences' blocks get what the eager step computes, to rounding
(on a GPU the padded row count can change a product's summation order, and the decode kernel's
spans). Steps with a prefill chunk keep running eagerly (their token counts vary step to step).

Without ``capture`` (CPU tensors: the tests) the padded step runs eagerly over the same buffers:
what a replay computes, checked where no GPU is.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from stages.attention.metadata import AttentionMetadata
from stages.attention.torch_backend import decode_lens

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # vLLM's kind of ladder


def graphs_wanted(asked: bool | None, device: torch.device, tp: int, backend: str) -> bool:
    """Whether a worker replays its decode-only steps: with the torch backend only (xformers builds
    its mask from the step's lengths on the host); ``asked`` None (DeviceConfig's default) on CUDA
    at tp 1 (NCCL's all-reduce under capture is unmeasured: a TP worker replays when asked)."""
    if backend != "torch":
        return False
    return asked if asked is not None else device.type == "cuda" and tp == 1


def padded(n: int, sizes: tuple[int, ...] = BATCH_SIZES) -> int | None:
    """The smallest of ``sizes`` holding n rows (None: more than the largest)."""
    return next((s for s in sizes if s >= n), None)


@dataclass
class StaticStep:
    """One captured shape: (B_pad,) inputs and the metadata over buffers a replay reads."""

    x: torch.Tensor  # (B_pad,) token ids on the first stage, else (B_pad, H) hidden states
    meta: AttentionMetadata
    lens: torch.Tensor  # (B_pad,) context lengths, the decode kernel's
    keys: torch.Tensor  # (width · BS,) key positions, for the gathered path's padding mask
    out: torch.Tensor | None = None  # (B_pad, H): the captured forward's output
    graph: object | None = None  # torch.cuda.CUDAGraph once captured
    cache: dict = field(default_factory=dict)  # meta.backend_cache's entries that hold buffers


class DecodeGraphs:
    """Decode-only forwards of one stage, padded to ``BATCH_SIZES`` and replayed per shape."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 scratch_block: int, block_size: int, hidden: int | None, dtype: torch.dtype, capture: bool) -> None:
        self.model, self.kv_caches, self.scratch, self.bs = model, kv_caches, scratch_block, block_size
        self.hidden, self.dtype, self.capture = hidden, dtype, capture  # hidden None: token ids in
        self.steps: dict[tuple[int, int], StaticStep] = {}
        # one memory pool and one stream for every capture: the allocator reuses a pool's blocks
        # only on the stream that freed them, so shapes captured on one stream share their memory
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.stream = torch.cuda.Stream() if capture else None

    def shape(self, meta: AttentionMetadata) -> tuple[int, int] | None:
        """(B_pad, table width) of a decode-only step this takes, else None."""
        if meta.num_prefills or not meta.num_decodes:
            return None
        b = padded(meta.num_decodes)
        # the table width as a power of two: a few graphs cover every context
        return None if b is None else (b, 1 << (meta.decode_tables.shape[1] - 1).bit_length())

    def run(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's (B, H) output: its inputs copied into the shape's buffers, then a replay."""
        key = self.shape(meta)
        step = self.steps.get(key) or self._build(*key, x.device)
        self._fill(step, x, meta)
        if step.graph is not None:
            step.graph.replay()
        elif step.out is None:
            step.out = self._forward(step)
        else:  # as a replay does: the same output buffer every step
            step.out.copy_(self._forward(step))
        # a copy: the next replay overwrites the graph's output, which a send or the local
        # launcher's outbox may still hold
        return step.out[:meta.num_decodes].clone()

    def _fill(self, step: StaticStep, x: torch.Tensor, meta: AttentionMetadata) -> None:
        b, nb = meta.num_decodes, meta.decode_tables.shape[1]
        sm = step.meta
        step.x[:b].copy_(x)
        sm.positions[:b].copy_(meta.positions)
        sm.slot_mapping[:b].copy_(meta.slot_mapping)
        sm.decode_tables[:b, :nb].copy_(meta.decode_tables)  # columns past a row's context: never read
        step.lens[:b].copy_(decode_lens(meta, x.device))
        sm.ctx_lens[:b] = meta.ctx_lens  # Python values: no replay reads them, an eager run's checks may
        if b < step.lens.shape[0]:  # the padding rows as built: one key each, in the scratch block
            sm.ctx_lens[b:] = [1] * (step.lens.shape[0] - b)
            step.x[b:].zero_()
            sm.positions[b:].zero_()
            sm.slot_mapping[b:].fill_(self.scratch * sm.block_size)
            sm.decode_tables[b:].fill_(self.scratch)
            step.lens[b:].fill_(1)
        # the padding mask of the gathered path (a decode the Triton kernel does not take)
        torch.lt(step.keys, step.lens[:, None], out=sm.decode_mask)

    def _build(self, b: int, width: int, device: torch.device) -> StaticStep:
        """Buffers of the padding rows' values, then (``capture``) a warm-up and the capture."""
        long, bs = dict(dtype=torch.long, device=device), self.bs
        x = torch.zeros(b, **long) if self.hidden is None else \
            torch.zeros(b, self.hidden, dtype=self.dtype, device=device)
        keys = torch.arange(width * bs, device=device)
        meta = AttentionMetadata(
            block_size=bs, positions=torch.zeros(b, **long), slot_mapping=torch.full((b,), self.scratch * bs, **long),
            q_lens=[1] * b, ctx_lens=[1] * b, num_prefills=0, prefill_tables=[],
            decode_tables=torch.full((b, width), self.scratch, **long),
            decode_mask=(keys < 1).expand(b, -1).clone(), sample_idx=torch.arange(b, device=device), fresh_prefill=[])
        step = StaticStep(x, meta, torch.ones(b, **long), keys)
        # the buffer under the keys a layer asks decode_lens for: q's device (the decode kernel),
        # None (the CPU kernels, which these buffers feed where there is no GPU: the tests)
        step.cache = {f"decode_lens:{device}": step.lens, "decode_lens:None": step.lens}
        if self.capture:
            self._capture(step)
        self.steps[(b, width)] = step
        return step

    def _forward(self, step: StaticStep) -> torch.Tensor:
        # only the buffers' entries: anything a layer caches from a step's values (the eager RoPE's
        # cos/sin rows) is computed again, inside the graph where there is one
        step.meta.backend_cache = dict(step.cache)
        return self.model(step.x, step.meta, self.kv_caches)

    def _capture(self, step: StaticStep) -> None:
        # the warm-up compiles every Triton specialisation first (a module load cannot be
        # captured), on the stream the capture then uses: cuBLAS and others set up per-stream
        # state (workspaces) lazily, which must not happen inside the capture (torch's advice)
        side = self.stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(step)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=side):
            step.out = self._forward(step)
        step.graph = graph
        log.info("captured a decode-only step of %d rows, tables %d blocks wide", *step.x.shape[:1],
                 step.meta.decode_tables.shape[1])
