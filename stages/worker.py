"""StageWorker: one pipeline stage × TP rank — its model shard, its KV cache, its step.

``execute(plan)`` = build attention metadata → take input (embed token ids on stage 0,
P2P-receive hidden states otherwise, shape from the plan) → run the stage's layers →
send to the next stage, or (last stage) sample and return the token ids. The worker runs
whatever plan it is given, in the order given; it never decides what runs.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import time

import numpy as np
import torch

from pp_runtime.batch import MicroBatch, Sampled
from stages import cpu_kernels, triton_elementwise
from stages.attention import build_metadata
from stages.attention.metadata import AttentionMetadata
from stages.cuda_graphs import DecodeGraphs, graphs_wanted
from stages.layers import TPContext, pack_linears, set_matmul_precision
from stages.model import StageModel
from stages.op_timing import OpTimer, instrument
from stages.sampler import sample_hidden
from stages.weights import load_weights
from stages.worker_spec import MemoryProfile, WorkerSpec

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_TORCH_DTYPES = {"float16": torch.float16, "fp8": torch.float8_e4m3fn}  # "auto": the model's dtype

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def tune_cpu_allocator() -> bool:
    """Keep freed activation buffers in the process instead of handing them back to the OS.

    By default glibc serves MB-sized blocks (a step's K/V gathers and activations) from fresh
    mmaps or trims them off the heap top when freed, so every step page-faults and zero-fills
    them again. A fixed 32 MiB mmap threshold (glibc's maximum) and a 1 GiB trim threshold make
    them reusable: a decode-only step of 32 sequences at 1 thread went from 587 to 342 ms
    (docs/BENCHMARKS.md, "allocator"). Costs resident memory up to the step's peak working set,
    which the process touches anyway. No-op (False) where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):
        return False


def cache_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, prefault: bool) -> torch.Tensor:
    """A zero-filled KV cache tensor. On CPU the zeros are the OS's zero pages (numpy's calloc;
    numpy also asks for huge pages), so GiBs cost nothing until written; ``prefault`` writes them
    now, so the first run does not pay for faulting them in (CacheConfig.prefault)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    same_width = {4: np.int32, 2: np.int16, 1: np.int8}[dtype.itemsize]  # all-zero bits are 0.0
    t = torch.from_numpy(np.zeros(shape, dtype=same_width))
    return (t.zero_() if prefault else t).view(dtype)  # zeroed as ints: torch fills no fp8 tensor


class StageWorker:
    def __init__(self, spec: WorkerSpec, tp: TPContext, link: object | None) -> None:
        self.spec = spec
        if spec.device.threads:
            torch.set_num_threads(spec.device.threads)
        if spec.device.device == "cpu":
            tune_cpu_allocator()
        self.device = torch.device("cuda", torch.cuda.current_device()) if spec.device.device == "cuda" \
            else torch.device("cpu")
        self.dtype = TORCH_DTYPES[spec.device.dtype]
        self.kv_dtype = KV_TORCH_DTYPES.get(spec.cache.kv_dtype, self.dtype)
        cfg = spec.source.config
        self.units = spec.parallel.stage_units(cfg.num_layers)[spec.stage]  # half layers
        self.is_first = spec.stage == 0
        self.is_last = spec.stage == spec.parallel.pp - 1
        self.tp = tp
        self.link = link
        with torch.device(self.device):
            self.model = StageModel(cfg, self.units, tp, self.dtype, spec.device.device,
                                    spec.device.attention, self.is_first, self.is_last)
        # GGUF blocks stay as stored where the CPU GEMM reads them (fp32 activations, kernels built)
        native = spec.device.gguf_weights == "native" and self.device.type == "cpu" \
            and self.dtype == torch.float32 and cpu_kernels.available()
        self.weight_bytes = load_weights(self.model, spec.source, tp, native=native)
        pack_linears(self.model)  # CPU fp32: the GEMM kernel's layout, packed once here, not per call
        self.reduced_linears = set_matmul_precision(self.model, spec.device.matmul_precision)  # {bf16, int8}: counts
        if self.model.lm_head is not None:  # greedy rows: int8 or bf16 products, the fp32 argmax exactly
            self.weight_bytes += self.model.lm_head.prepare_argmax()  # what it keeps is resident too: M_S
        self.model.prepare_layer_loop()  # CPU kernels: the layers as one C++ call
        # CUDA: whether the fused elementwise kernels run, decided here (their probe call) and not
        # inside the first request
        self.fused_elementwise = triton_elementwise.takes(torch.empty(0, device=self.device, dtype=self.dtype))
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graphs: DecodeGraphs | None = None  # allocate_cache, where DeviceConfig.cuda_graphs
        self.block_size = spec.cache.block_size
        self.timings: list[tuple[int, float, float, float]] = []  # (mb, t_ready, t_start, t_end)
        # Per-op timing of ``time_ops`` micro-batches (an in-deployment profile): hooks exist only
        # while such batches run, so ordinary ones pay nothing for them.
        self.op_times: list[tuple[int, dict[str, float]]] = []
        self._op_timer = OpTimer(self._sync)
        self._op_hooks: contextlib.ExitStack | None = None

    # ---- set-up ----------------------------------------------------------------------------
    def info(self) -> dict:
        return {"stage": self.spec.stage, "tp_rank": self.spec.tp_rank, "pid": os.getpid(),
                "node": os.uname().nodename, "device": str(self.device), "layers": [u / 2 if u % 2 else u // 2 for u in self.units],
                "weight_bytes": self.weight_bytes, "layer_weight_bytes": self._layer_bytes(),
                "attention": self.model.backend.name, "kv_dtype": str(self.kv_dtype).removeprefix("torch."),
                "bf16_linears": self.reduced_linears["bf16"], "int8_linears": self.reduced_linears["int8"],
                "bf16_attention": getattr(self.model.backend, "bf16", False),
                "fused_elementwise": self.fused_elementwise, "cuda_graphs": self.graphs is not None}

    def _layer_bytes(self) -> int:
        """Resident bytes of the decoder layers alone (embedding and LM head excluded)."""
        return sum(p.numel() * p.element_size() for p in self.model.layers.parameters())

    def memory_profile(self) -> MemoryProfile:
        cfg = self.spec.source.config
        kv_heads = cfg.num_kv_heads // self.tp.size
        per_token = 2 * self.model.num_attention_layers * kv_heads * cfg.head_size * self.kv_dtype.itemsize
        budget = self.spec.cache.memory_budget_bytes
        total = torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" \
            else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if budget is None:  # CUDA default: 90% of the card
            budget = int(0.9 * total) if self.device.type == "cuda" else 4 << 30
        elif budget > total:  # the KV cache would fail to allocate, or swap the node to a halt
            where = "GPU" if self.device.type == "cuda" else f"node {os.uname().nodename}"
            raise ValueError(f"memory_budget_gb={budget / (1 << 30):.6g} exceeds the {total / (1 << 30):.4g} GiB "
                             f"of memory this worker's {where} has")
        return MemoryProfile(budget, self.weight_bytes, per_token)

    def allocate_cache(self, num_blocks: int) -> int:
        """One (K, V) pair of (num_blocks, block_size, H_kv/tp, D) per layer with attention (one
        block more with CUDA graphs: their padding rows' scratch); returns bytes.

        Zero-filled, because attention reads whole blocks and masks the unused tail: a masked
        key must still be finite (NaN × 0 weight is NaN). See cache_zeros for CPU pages."""
        cfg = self.spec.source.config
        self.graphs = None  # they hold the old caches: let them go before the new ones are made
        # CUDA graphs: one block more, the padding rows' scratch (no sequence is ever given it);
        # with the torch backend only (xformers builds its mask from the step's lengths on the host)
        asked = self.spec.device.cuda_graphs
        graphs = graphs_wanted(asked, self.device, self.tp.size, self.model.backend.name)
        if asked and not graphs:
            log.warning("stage %d: --cuda-graphs needs --attention torch (xformers was chosen): steps run eagerly",
                        self.spec.stage)
        shape = (num_blocks + graphs, self.block_size, cfg.num_kv_heads // self.tp.size, cfg.head_size)
        prefault = self.spec.cache.prefault
        self.kv_caches = [(cache_zeros(shape, self.kv_dtype, self.device, prefault),
                           cache_zeros(shape, self.kv_dtype, self.device, prefault))
                          for _ in range(self.model.num_attention_layers)]
        # captured on CUDA; elsewhere (tests only: DeviceConfig refuses cuda_graphs off CUDA) run eagerly
        self.graphs = DecodeGraphs(self.model, self.kv_caches, num_blocks, self.block_size,
                                   None if self.is_first else cfg.hidden_size, self.dtype,
                                   capture=self.device.type == "cuda") if graphs else None
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)

    # ---- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, wire: tuple) -> Sampled | None:
        t_ready = time.time()
        mb = MicroBatch.from_wire(wire)
        if mb.time_ops != (self._op_hooks is not None):
            self._hook_ops(mb.time_ops)
        meta = build_metadata(mb.chunks, self.block_size, self.device)
        if self.is_first:
            x = torch.tensor([t for c in mb.chunks for t in c.token_ids], dtype=torch.long, device=self.device)
        else:
            x = self.link.recv_forward((mb.num_tokens, self.spec.source.config.hidden_size), self.dtype)
        t_start = time.time()
        if mb.time_ops:
            self._op_timer.reset()
        # (T, H); the last stage's: (S, H), the sampled rows only (StageModel.forward: keep)
        h = self._graph_step(x, meta) if self.graphs is not None and not mb.time_ops else None
        if h is None:
            h = self.model(x, meta, self.kv_caches, keep=meta.sample_idx if self.is_last else None)
        tokens = None
        if not self.is_last:
            self.link.send_forward(h)
        elif h.shape[0]:  # only sampled rows reach the LM head (every TP rank's part of it)
            tokens = sample_hidden(self.model, h, [c.sample for c in mb.chunks if c.sample is not None])
        else:
            tokens = []
        self._sync()
        self.timings.append((mb.mb_id, t_ready, t_start, time.time()))
        if mb.time_ops:
            self.op_times.append((mb.mb_id, dict(self._op_timer.acc)))
        return tokens if self.tp.rank == 0 else None

    def _graph_step(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """A decode-only step's (B, H) output from its CUDA graph; None for a step it does not take
        (then it runs eagerly). A capture that fails (an op that cannot be captured) turns the
        graphs off for this worker with a warning naming the reason; the step runs eagerly."""
        if self.graphs.shape(meta) is None or (self.is_last and meta.sample_idx.numel() != meta.num_decodes):
            return None
        try:
            return self.graphs.run(x, meta)
        except Exception as e:  # noqa: BLE001 - any capture failure: eager steps still work
            log.warning("stage %d: CUDA graphs off, decode-only steps run eagerly (%s: %s)", self.spec.stage,
                        type(e).__name__, str(e).strip().splitlines()[0] if str(e).strip() else "")
            self.graphs = None
            return None

    def drain_timings(self) -> list[tuple[int, float, float, float]]:
        return _drain(self.timings)

    def drain_op_times(self) -> list[tuple[int, dict[str, float]]]:
        """(mb_id, seconds per op: preproj, attn, postproj, ffn_ln1, ffn_ln2, lm_head) of every
        ``time_ops`` micro-batch since the last drain; the rest of its step is its ``others``."""
        return _drain(self.op_times)

    def _hook_ops(self, on: bool) -> None:
        if on:
            self._op_hooks = contextlib.ExitStack()
            self._op_hooks.enter_context(instrument(self.model, self._op_timer))
        else:
            self._op_hooks.close()
            self._op_hooks = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _drain(records: list) -> list:
    """Take what is in ``records`` so far. Under Ray the steps append from the serve loop's
    thread while the drain runs on another: the slice and the delete are each atomic, and an
    append between them lands after the n taken, so nothing is lost or taken twice."""
    n = len(records)
    out = records[:n]
    del records[:n]
    return out
