"""Greedy tokens from cheap products, exactly the tokens of the LM head's fp32 logits.

A greedy row needs only the argmax of its logits, not the logits. On SmolLM2-135M the LM head is
~1/5 of a decode's FLOPs. Two cheaper products give logits l̃ within a known bound of the fp32
ones l, so that row r's fp32 argmax is among the v whose l̃ + bound reaches max_u (l̃_u − bound_u):

* ``Int8Head``, a Q8_0 weight on a CPU with AVX512-VNNI: x cut into blocks of 32, each rounded
  to int8 codes with its own scale, against the weight's own codes (exact int32 sums: 64
  multiply-adds an instruction). The weight is exact, x is off by e, so per block b of K
  |l̃ − l| ≤ Σ_b |w_vb|₂ · |e_b|₂ (Cauchy-Schwarz), plus the sum's fp32 roundings and the fp32
  GEMM's own distance from l ((K + 2)·2⁻²⁴ · Σ_b |w_vb|₂ · |x_b|₂; both folded into e's norms)
  and ``FLUSH`` for results under the smallest normal float. It keeps 4 bytes per
  block of 32 weights (their norms): 3.5 MB on SmolLM2.
* ``Bf16Head``, any other panels on a CPU with AVX512-BF16: x and w rounded to bf16
  (u_bf16 = 2⁻⁸, each product then exact, both sums of K terms in fp32, u_fp32 = 2⁻²⁴), so
  |l̃ − l| ≤ (2u_bf16 + u_bf16² + 4K·u_fp32) · Σ_k |x_k w_vk| ≤ c · |x|₂ · |w_v|₂, plus
  ``floor_term`` for subnormals. It keeps the weight's bf16 pairs (2 bytes a weight) so that no
  call converts them again.

Those candidates (a median of 1–2 per row on real decode steps, the union of 32 rows a few
dozen to a few hundred of 49152) are recomputed in fp32 by the GEMM on their own columns: a
product sums each output in the same order whatever the other columns are, so these are the full
product's values bit for bit, and the argmax over them, ties to the lowest id as
``torch.argmax``, is the full one's.

    head = prepare(lm_head_weight)   # None where neither product is built
    tokens = head.argmax(x)          # (M,) int64, x (M, K) float32
"""
from __future__ import annotations

import torch

from stages import cpu_kernels, quant

U_BF16, U_FP32 = 2.0 ** -8, 2.0 ** -24
MIN_ROWS = 13  # the GEMM takes bf16 products from 3 row tiles (13 rows); fewer run fp32 anyway
INT8_MIN_ROWS = 3  # below, the fp32 product is about as fast as int8 + the exact pass, or faster (Zen 4,
# paired, int8 / fp32 since its codes are fetched ahead: 1 / 2 / 3 rows x1.18 / 0.97 / 0.73 at 1 thread,
# x1.30 / 1.03 / 0.86 at 2)
MAX_SHARE = 8  # more candidates than 1/8 of the vocabulary: the full fp32 product is cheaper
TINY = 2.0 ** -126  # the smallest normal float: bf16 products flush what is below it to zero
FLUSH = 2.0 ** -105  # what each of an int8 logit's block terms (< 2¹⁹ · TINY) and sums can lose to flushing


def bound_constant(k: int) -> float:
    """c of the bound c·|x|·|w_v| for a K-term bf16 product against its fp32 one (module doc),
    with 2⁻²⁰ more for the norms' and c·|x|'s own rounding."""
    return (2 * U_BF16 + U_BF16 ** 2 + 4 * k * U_FP32) * (1 + 2.0 ** -20)


def floor_term(k: int, xmax: float, wmax: float) -> float:
    """The bound's absolute part: bf16 dot products treat subnormal inputs as zero and flush
    subnormal sums, each time an error under 2⁻¹²⁶ · max(|x|, |w|, 1) (|x|₂ and |w_v|₂ bound
    every element), at most 2K + 2 times in a K-term product."""
    return (2 * k + 2) * TINY * (1 + xmax) * (1 + wmax)


def _round_up(x: torch.Tensor) -> torch.Tensor:
    """float64 -> the float32 at or above each value."""
    f = x.float()
    return torch.where(f.double() < x, torch.nextafter(f, torch.full_like(f, float("inf"))), f)


def row_norms(w: torch.Tensor, rows_at_once: int = 4096) -> torch.Tensor:
    """|w_v|₂ (V,) float32, rounded up, of the (V, K) weight an LM head holds as block-quantized
    panels (stages.quant) or fp32 panels (cpu_kernels.pack_weight): in float64, a few thousand
    rows at a time (the weight dequantized whole would be V·K·4 bytes)."""
    if quant.is_panels(w):  # whole panels at a time: rows_at_once / 16 of them
        step = max(1, rows_at_once // cpu_kernels.PANEL)
        parts = [quant.all_rows(w[i:i + step]).double().norm(dim=1) for i in range(0, w.shape[0], step)]
        return _round_up(torch.cat(parts))
    return _round_up(w.double().pow(2).sum(dim=1).sqrt().reshape(-1))  # (V/16, K, 16) -> (V,)


def is_q8(w: torch.Tensor) -> bool:
    return quant.is_panels(w) and w.shape[2] == quant.QB_S8


def prepare(w: torch.Tensor) -> Int8Head | Bf16Head | None:
    """The exact greedy head over LM head weight w (panels: stages.quant or cpu_kernels.pack_weight)
    where these kernels have a cheaper product for it, else None (the fp32 product it is)."""
    if w.dim() != 3 or w.device.type != "cpu" or not cpu_kernels.available():
        return None
    if is_q8(w) and cpu_kernels.int8_head():
        return Int8Head(w)
    if cpu_kernels.bf16_products():
        return Bf16Head(w)
    return None


def _exact_argmax(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, member: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of the fp32 product over its candidates (ids, marked by member)."""
    if ids.numel() * MAX_SHARE > w.shape[0] * cpu_kernels.PANEL:  # V: 16 columns a panel
        return cpu_kernels.panel_linear(x, w).argmax(dim=-1)
    exact = cpu_kernels.panel_linear(x, cpu_kernels.gather_columns(w, ids))[:, :ids.numel()]  # (M, U): the full product's values there
    return ids[exact.masked_fill_(~member, float("-inf")).argmax(dim=-1)]


def _sums_may_overflow(xnorm: torch.Tensor, wmax: float) -> bool:
    return not bool(torch.isfinite(xnorm).all()) or float(xnorm.max()) * wmax > 1e30


class Bf16Head:
    """Candidates from bf16 products (module doc), over the weight's bf16 pairs kept."""

    def __init__(self, w: torch.Tensor) -> None:
        self.weight, self.row_norms = w, row_norms(w)
        k = quant.panel_shape(w)[1] if quant.is_panels(w) else w.shape[1]
        self.pairs = cpu_kernels.pack_weight_bf16(w) if k % 2 == 0 else None  # bf16 pairs: K even

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.row_norms, self.pairs) if t is not None)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """linear(x, w).argmax(-1) for x (M, K) fp32: the GEMM's fp32 logits' argmax, bit for bit."""
        x, w = x.contiguous(), self.weight
        if x.shape[0] < MIN_ROWS:  # few rows run fp32 products anyway
            return cpu_kernels.panel_linear(x, w).argmax(dim=-1)
        xnorm, wmax = _round_up(x.double().norm(dim=1)), float(self.row_norms.max())
        if _sums_may_overflow(xnorm, wmax):
            return cpu_kernels.panel_linear(x, w).argmax(dim=-1)
        k = x.shape[1]
        approx = cpu_kernels.panel_linear(x, w, bf16=True) if self.pairs is None else cpu_kernels.bf16_linear(x, self.pairs)
        ids, member = cpu_kernels.greedy_candidates(approx, xnorm, self.row_norms, bound_constant(k),
                                                    floor_term(k, float(xnorm.max()), wmax))
        return _exact_argmax(x, w, ids, member)


class Int8Head:
    """Candidates from int8 products against a Q8_0 weight's own codes (module doc)."""

    def __init__(self, w: torch.Tensor, panels_at_once: int = 256) -> None:
        self.weight = w
        norms = []
        for i in range(0, w.shape[0], panels_at_once):  # float64 codes of the whole weight: 8 bytes a weight
            p = w[i:i + panels_at_once]
            codes = p[..., quant.DM:].view(torch.int8).reshape(*p.shape[:2], quant.QK, cpu_kernels.PANEL)  # (n, KB, 32, 16)
            d = quant.block_scales(p)[..., :cpu_kernels.PANEL]  # (n, KB, 16): the blocks' scales
            # |w_b|₂ = |d| · |q_b|₂, in float64 (one rounding, relative 2⁻⁵³), then up to float32
            norms.append(_round_up(d.double().abs() * codes.double().norm(dim=2) * (1 + 2.0 ** -40)))
        self.block_norms = torch.cat(norms).contiguous()  # (NP, KB, 16)
        self.block_max = self.block_norms.amax(dim=(0, 2)).double()  # (KB,) over every v: bounds a row's bounds
        self.wmax = float(self.block_norms.double().pow(2).sum(dim=1).sqrt().max())  # ≥ every |w_v|₂

    @property
    def nbytes(self) -> int:
        return self.block_norms.numel() * self.block_norms.element_size()

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """linear(x, w).argmax(-1) for x (M, K) fp32: the GEMM's fp32 logits' argmax, bit for bit."""
        x, w = x.contiguous(), self.weight
        if x.shape[0] < INT8_MIN_ROWS or _sums_may_overflow(x.double().norm(dim=1), self.wmax):
            return cpu_kernels.panel_linear(x, w).argmax(dim=-1)
        ids, member = cpu_kernels.int8_candidates(*self.quantize(x), w, self.block_norms,
                                                  FLUSH * (w.shape[1] + 1))
        return _exact_argmax(x, w, ids, member)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (M, K) fp32 -> (xu (M, K) uint8 codes + 128, xs (M, K/32) fp32 scales, eb (M, K/32),
        bmax (M,)): x ≈ xs · (xu − 128) per block of 32 with |codes| ≤ 127; eb ≥ the block's |e|₂
        plus what int8_candidates' fp32 sums can round and the GEMM's fp32 logit's own error
        (cpu_kernels.quantize_blocks); bmax ≥ Σ_b max_v |w_vb|₂ · eb_b, every bound of the row."""
        return cpu_kernels.quantize_blocks(x, self.block_max)
