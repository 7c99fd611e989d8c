"""Building blocks of a stage: RMSNorm, rotary embedding and tensor-parallel linears.

Tensor parallelism follows Megatron-LM: a column-parallel linear splits its weight along
the output dim (no communication), a row-parallel linear splits along the input dim and
all-reduces partial sums. tp=1 is the same code with no communication.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from stages import cpu_kernels, greedy, quant, triton_elementwise


@dataclass(frozen=True)
class TPContext:
    """This worker's place in its stage's tensor-parallel group (group None when tp=1)."""

    rank: int = 0
    size: int = 1
    group: object | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1 and x.numel():  # every rank has the same shape: all skip an empty one alike
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def shard_range(full: int, ctx: TPContext) -> tuple[int, int]:
    """[start, end) of rank ``ctx.rank``'s equal slice of a dim of size ``full``."""
    if full % ctx.size:
        raise ValueError(f"dimension {full} is not divisible by tp={ctx.size}")
    n = full // ctx.size
    return ctx.rank * n, (ctx.rank + 1) * n


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        # In the model's dtype, as in HF: weight × normed activations stays in that dtype.
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H)
        if cpu_kernels.usable(x) and x.is_contiguous():  # one pass (torch: five kernels on CPU)
            return cpu_kernels.rms_norm(x, self.weight, self.eps)
        if triton_elementwise.takes(x) and x.dim() == 2 and x.stride(-1) == 1:  # one kernel (eager: eight in bf16)
            return triton_elementwise.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Other dtypes as the reference implementations: normalise in float32, cast back, scale.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_forward(self, h: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and this norm: (h + x, norm(h + x)). h is a fresh activation the
        caller gives up: on CPU the sum is written into it, in the same pass as the norm."""
        if cpu_kernels.usable(h) and h.is_contiguous() and x.is_contiguous():
            return h, cpu_kernels.add_rms_norm_(h, x, self.weight, self.eps)
        if triton_elementwise.takes(h) and h.dim() == 2 and h.stride(-1) == 1 and x.stride(-1) == 1:
            return h, triton_elementwise.add_rms_norm_(h, x, self.weight, self.eps)
        h = h + x
        return h, self(h)


class RotaryEmbedding(nn.Module):
    """RoPE in the rotate-half layout used by HF LLaMA/Mistral/Qwen2 checkpoints."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # (P, D/2)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cache: dict) -> torch.Tensor:
        """x (T, heads, D) -> rotated. The caller passes q's and k's heads as one tensor (they
        sit side by side in the fused QKV output), so every layer rotates both in four kernels;
        ``cache`` (per step: the attention metadata's) keeps the gathered cos/sin rows for the
        step's other layers. On CPU in fp32, and on CUDA where the Triton kernels run, the rotation
        is one pass, in place: x is then the caller's fresh QKV output and comes back rotated."""
        if cpu_kernels.usable(x) and triton_elementwise.heads_contiguous(x):
            cpu_kernels.rope_(x, positions, self.cos, self.sin)
            return x
        if triton_elementwise.takes(x) and triton_elementwise.rope_fits(x):  # in place too, one kernel
            return triton_elementwise.rope_(x, positions, self.cos, self.sin)
        key = ("rope", x.dtype)
        cs = cache.get(key)
        if cs is None:
            # in x's dtype, as HF computes q·cos + rotate_half(q)·sin
            cs = cache[key] = (self.cos[positions].unsqueeze(1).to(x.dtype),
                               self.sin[positions].unsqueeze(1).to(x.dtype))
        cos, sin = cs  # (T, 1, D/2)
        x1, x2 = x.chunk(2, dim=-1)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        o1, o2 = out.chunk(2, dim=-1)
        torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1)  # x1·cos − x2·sin
        torch.mul(x2, cos, out=o2).addcmul_(x1, sin)  # x2·cos + x1·sin
        return out


# On CPU the BLAS splits a skinny product X Wᵀ (few rows, as in a decode batch) badly: across
# threads, and on one thread in its blocking for a handful of rows; the same product taken as
# (W Xᵀ)ᵀ walks W's many rows instead. Measured on the 2-core box (docs/BENCHMARKS.md, "skinny
# GEMM"): at 2 threads 1.1-1.4x faster for 4-128 rows (slower from ~256); at 1 thread 1.2-1.6x
# for 2-6 rows (the LM head most), slower from 8.
SKINNY_ROWS = {1: (2, 6), 2: (2, 128)}  # torch threads (2 = "more than one") -> rows where it pays


def skinny(rows: int) -> bool:
    lo, hi = SKINNY_ROWS[min(torch.get_num_threads(), 2)]
    return lo <= rows <= hi


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, products: str = "fp32") -> torch.Tensor:
    """F.linear(x, w, bias) for x (T, in), w (out, in), packed (see pack_linears) or block-quantized
    panels (stages.quant) -> (T, out), contiguous. products (set_matmul_precision): "bf16" lets the
    GEMM kernel round x and w to bf16 (see cpu_kernels.packed_linear); "int8" takes int8 products
    over block-quantized panels (cpu_kernels.int8_linear); "fp32" neither."""
    if w.dim() == 3:  # the GEMM kernel's layouts: rows of x must be contiguous
        x = x if x.stride(-1) == 1 else x.contiguous()
        if products == "int8" and quant.is_panels(w):
            return cpu_kernels.int8_linear(x, w, bias)
        return cpu_kernels.panel_linear(x, w, bias, products == "bf16")
    if x.device.type == "cpu" and x.dim() == 2 and skinny(x.shape[0]):
        y = torch.mm(w, x.t())  # (out, T)
        y = cpu_kernels.transpose(y) if cpu_kernels.usable(y) else y.t().contiguous()  # (T, out)
        return y if bias is None else y.add_(bias)
    return F.linear(x, w, bias)


class ColumnParallelLinear(nn.Module):
    """Y = XA + b with A split along its second dim (output features).

    Rank r holds the output slice r of every fused part (``out_parts``: e.g. q, k, v sizes),
    so Y leaves sharded on its last dim and needs no communication.
    """

    def __init__(self, in_features: int, out_parts: tuple[int, ...], bias: bool, ctx: TPContext,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.out_parts = tuple(p // ctx.size for p in out_parts)
        for p in out_parts:
            shard_range(p, ctx)  # raises when tp does not divide a part
        out = sum(self.out_parts)
        self.products = "fp32"  # set_matmul_precision
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out/tp)
        return linear(x, self.weight, self.bias, self.products)


class RowParallelLinear(nn.Module):
    """Y = XA + b with A split along its first dim (input features).

    X arrives sharded on its last dim (from a ColumnParallelLinear); each rank computes a
    partial product and the partials are all-reduced. The bias is added once, after.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, ctx: TPContext,
                 dtype: torch.dtype) -> None:
        super().__init__()
        lo, hi = shard_range(in_features, ctx)
        self.ctx = ctx
        self.products = "fp32"  # set_matmul_precision
        self.weight = nn.Parameter(torch.empty(out_features, hi - lo, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    def takes_gated(self, gate_up: torch.Tensor) -> bool:
        """Whether ``forward(gate_up, gated=True)`` runs here: int8 products over panels make
        silu(gate) · up from a gate/up output themselves, a row at a time as they quantize it."""
        return self.products == "int8" and quant.is_panels(self.weight) and cpu_kernels.usable(gate_up) \
            and gate_up.is_contiguous()

    def forward(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:  # (T, in/tp) -> (T, out)
        """gated (where takes_gated): x is [gate | up] (T, 2·in/tp), the product's input silu(gate) · up."""
        if gated and not self.takes_gated(x):
            raise ValueError("RowParallelLinear: a gated input needs int8 products over block-quantized panels "
                             "and a contiguous fp32 CPU input (takes_gated)")
        y = cpu_kernels.int8_linear(x, self.weight, gated=True) if gated else \
            linear(x, self.weight, products=self.products)
        y = self.ctx.all_reduce(y)
        return y if self.bias is None else y + self.bias


def embedding_rows(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ids of an embedding table (V, H), of the same table packed for a tied LM head, or of
    block-quantized panels (stages.quant) of it."""
    if w.dim() == 3 and w.device.type == ids.device.type == "cpu" and w.is_contiguous() and cpu_kernels.available() \
            and (quant.is_panels(w) or (w.dtype == torch.float32 and w.shape[2] == cpu_kernels.PANEL)):
        return cpu_kernels.panel_rows(w, ids.long())  # each row read where it lies, not its whole panel
    if quant.is_panels(w):
        return quant.panel_rows(w, ids)
    if w.dim() == 3:  # (V / P, H, P): row v is column v % P of panel v // P
        return w[ids // w.shape[2], :, ids % w.shape[2]]  # (T, H)
    return F.embedding(ids, w)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; ids outside this rank's rows give zeros,
    and the all-reduce sums the one rank that owns each id."""

    def __init__(self, vocab: int, hidden: int, ctx: TPContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.lo, self.hi = shard_range(vocab, ctx)
        self.ctx = ctx
        self.weight = nn.Parameter(torch.empty(self.hi - self.lo, hidden, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, H)
        if self.ctx.size == 1:
            return embedding_rows(self.weight, ids)
        mine = (ids >= self.lo) & (ids < self.hi)
        out = embedding_rows(self.weight, torch.where(mine, ids - self.lo, 0))
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return self.ctx.all_reduce(out)


class ParallelLMHead(nn.Module):
    """logits = h Eᵀ with E split by vocabulary rows; shards are gathered to the full vocab."""

    def __init__(self, vocab: int, hidden: int, ctx: TPContext, dtype: torch.dtype) -> None:
        super().__init__()
        lo, hi = shard_range(vocab, ctx)
        self.ctx = ctx
        self.products = "fp32"  # set_matmul_precision
        self.weight = nn.Parameter(torch.empty(hi - lo, hidden, dtype=dtype), requires_grad=False)
        self.greedy: greedy.Int8Head | greedy.Bf16Head | None = None  # prepare_argmax

    def prepare_argmax(self) -> int:
        """Make ``forward(h, argmax_only=True)`` take the exact greedy head (stages/greedy.py: int8
        or bf16 products, then the fp32 argmax exactly) where it can: one rank, fp32 products asked
        for, the weight in the GEMM's panels, kernels with either product. Call once the weight is
        final. Returns the bytes it keeps beside the weight (0: it cannot)."""
        self.greedy = None
        if self.ctx.size == 1 and self.products == "fp32":
            self.greedy = greedy.prepare(self.weight)
        return self.greedy.nbytes if self.greedy is not None else 0

    def forward(self, h: torch.Tensor, argmax_only: bool = False) -> torch.Tensor:
        """(S, H) -> (S, V) logits, or with ``argmax_only`` the (S,) int64 argmax of their float32
        values (the same ids, computed without the full fp32 product where prepare_argmax said so)."""
        if argmax_only and self.greedy is not None and cpu_kernels.usable(h):
            return self.greedy.argmax(h)
        logits = self.ctx.all_gather_last_dim(linear(h, self.weight, products=self.products))
        return logits.float().argmax(dim=-1) if argmax_only else logits


LINEARS = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)  # the modules whose products go through linear()


def pack_linears(model: nn.Module) -> int:
    """Repack every linear weight of ``model`` for cpu_kernels.packed_linear, in place of the
    plain one (same bytes: the kernel's layout, not a copy beside it); returns how many.

    Only fp32 weights on CPU whose output size is a multiple of the panel width, and only where
    the kernels are built; the rest keep F.linear. A tied embedding keeps sharing its LM head's
    (now packed) tensor and reads its rows from the panels.
    """
    packed: dict[int, nn.Parameter] = {}  # id(plain parameter) -> its packed replacement
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if isinstance(mod, LINEARS) and w.dim() == 2 and cpu_kernels.usable(w) \
                and w.shape[0] % cpu_kernels.PANEL == 0 and id(w) not in packed:
            packed[id(w)] = nn.Parameter(cpu_kernels.pack_weight(w.detach()), requires_grad=False)
    for mod in model.modules():
        if isinstance(mod, (*LINEARS, VocabParallelEmbedding)) and id(mod.weight) in packed:
            mod.weight = packed[id(mod.weight)]
    return len(packed)


def set_matmul_precision(model: nn.Module, precision: str) -> dict[str, int]:
    """Sets each linear's products: "medium" gives bf16 ones (for many rows) to every linear whose
    weight the GEMM kernel reads (packed or block-quantized) where the kernels have AVX512-BF16;
    "int8" gives int8 ones to every block-quantized (GGUF Q4_0/Q4_1/Q8_0) layer weight where they
    have AVX512-VNNI, to the Q4_0/Q4_1 ones where they have AVX2 (``cpu_kernels.int8_takes``), not
    to the LM head: its greedy rows take the exact greedy head (int8 products
    too, then the fp32 argmax exactly: stages/greedy.py), faster than int8 logits and their argmax
    (measured: ~1.5 ms less a 32-row decode step). "highest", and any linear the asked products do
    not apply to, keeps fp32. Both reduced precisions also give the CPU attention kernels bf16
    products where the kernels have AVX512-BF16 (``model.backend.bf16``; at int8 a chunk's linears
    shrink ~3x and its fp32 attention would be an eighth of it): prefill chunks of more than 12
    tokens, and decodes over an fp8 cache in steps of more than ``backend.decode_bf16_over`` (12
    under medium, 0 under int8) for heads 64 or 128 wide, up to 4 a KV head, where the kernels also
    have AVX512-VBMI (``cpu_kernels.decode_bf16``). Returns how many linears took each: {"bf16": n, "int8": n}."""
    bf16 = precision == "medium" and cpu_kernels.bf16_products()
    int8 = precision == "int8" and cpu_kernels.int8_products()
    backend = getattr(model, "backend", None)
    if hasattr(backend, "bf16"):  # the torch backend's CPU kernels
        backend.bf16 = precision in ("medium", "int8") and cpu_kernels.bf16_products()
        # medium promises fp32 up to 12 rows, int8 none
        backend.decode_bf16_over = 0 if precision == "int8" else cpu_kernels.BF16_FP32_ROWS
    n = {"bf16": 0, "int8": 0}
    for mod in model.modules():
        if isinstance(mod, LINEARS):
            w = mod.weight
            int8_here = int8 and cpu_kernels.int8_takes(w) and not isinstance(mod, ParallelLMHead)
            mod.products = "bf16" if bf16 and w.dim() == 3 else "int8" if int8_here else "fp32"
            if mod.products != "fp32":
                n[mod.products] += 1
    return n
