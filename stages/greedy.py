"""Greedy tokens from the LM head in bf16 products, exactly the tokens of its fp32 logits.

A greedy row needs only the argmax of its logits, not the logits. On a CPU with AVX512-BF16 the
LM head's bf16 products cost ~2/3 of its fp32 ones at 32 rows (49152 × 576, 2 threads), and on
SmolLM2-135M the LM head is ~1/5 of a decode's FLOPs. Each bf16 logit l̃ differs from the fp32
one l by at most c·|x|·|w_v| (plus ``floor_term`` for subnormals):

    |l̃ − l| ≤ (2u_bf16 + u_bf16² + 4K·u_fp32) · Σ_k |x_k w_vk| ≤ c · |x|₂ · |w_v|₂

(x and w rounded to bf16, u_bf16 = 2⁻⁸, each product then exact; both sums of K terms in fp32,
u_fp32 = 2⁻²⁴; Cauchy-Schwarz), so row r's fp32 argmax is among the v whose l̃ + bound reaches
max_u (l̃_u − bound_u). Those candidates (a median of 2 per row on real decode steps, the union
of 32 rows a few dozen to ~500 of 49152) are recomputed in fp32 by the same kernel on their own
columns: a product sums each output in the same order whatever the other columns are, so these
are the full product's values bit for bit, and the argmax over them, ties to the lowest id as
``torch.argmax``, is the full one's.

    tokens = argmax_tokens(x, lm_head_weight, row_norms(lm_head_weight),
                           cpu_kernels.pack_weight_bf16(lm_head_weight))  # (M,) int64

The last argument, the weight's bf16 pairs kept (2 bytes a weight), is optional: without it the
bf16 product converts the weight on every call (the same bits; at 32 rows ~1 ms more of ~6.5 on
SmolLM2's LM head at 2 threads, ~2.3 ms at 1).
"""
from __future__ import annotations

import torch

from stages import cpu_kernels, quant

U_BF16, U_FP32 = 2.0 ** -8, 2.0 ** -24
MIN_ROWS = 13  # the GEMM takes bf16 products from 3 row tiles (13 rows); fewer run fp32 anyway
MAX_SHARE = 8  # more candidates than 1/8 of the vocabulary: the full fp32 product is cheaper
TINY = 2.0 ** -126  # the smallest normal float: bf16 products flush what is below it to zero


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


def gather_columns(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The panels (same format as w) of output columns ids, padded to whole panels with the last
    id: the weight of a linear whose outputs are w's at ids."""
    pad = -ids.numel() % cpu_kernels.PANEL
    ids = torch.cat([ids, ids[-1:].expand(pad)])
    p, c = ids // cpu_kernels.PANEL, ids % cpu_kernels.PANEL
    n = ids.numel() // cpu_kernels.PANEL
    if not quant.is_panels(w):  # (NP, K, 16) fp32
        return w[p, :, c].reshape(n, cpu_kernels.PANEL, -1).transpose(1, 2).contiguous()
    np_, kb, qb = w.shape
    head = w[..., :128].reshape(np_, kb, 2, cpu_kernels.PANEL, 4)[p, :, :, c]  # (U, KB, 2, 4): d, m bytes
    head = head.reshape(n, cpu_kernels.PANEL, kb, 2, 4).permute(0, 2, 3, 1, 4).reshape(n, kb, 128)
    codes = w[..., 128:].reshape(np_, kb, -1, cpu_kernels.PANEL)[p, :, :, c]  # (U, KB, code rows)
    codes = codes.reshape(n, cpu_kernels.PANEL, kb, -1).permute(0, 2, 3, 1).reshape(n, kb, qb - 128)
    return torch.cat([head, codes], dim=-1).contiguous()


def argmax_tokens(x: torch.Tensor, w: torch.Tensor, wnorm: torch.Tensor, wb: torch.Tensor | None = None) -> torch.Tensor:
    """linear(x, w).argmax(-1) for x (M, K) fp32 and an LM head weight w held as panels (the GEMM's
    fp32 logits' argmax, bit for bit), through bf16 products where the kernels have them (over wb,
    w's ``pack_weight_bf16`` words, when given)."""
    x = x.contiguous()
    m, k = x.shape
    if m < MIN_ROWS or not cpu_kernels.bf16_products():  # few rows run fp32 products anyway
        return cpu_kernels.panel_linear(x, w).argmax(dim=-1)
    xnorm = _round_up(x.double().norm(dim=1))
    xmax, wmax = float(xnorm.max()), float(wnorm.max())
    if not torch.isfinite(xnorm).all() or xmax * wmax > 1e30:  # sums that could overflow
        return cpu_kernels.panel_linear(x, w).argmax(dim=-1)
    approx = cpu_kernels.panel_linear(x, w, bf16=True) if wb is None else cpu_kernels.bf16_linear(x, wb)  # (M, V)
    ids, member = cpu_kernels.greedy_candidates(approx, xnorm, wnorm, bound_constant(k), floor_term(k, xmax, wmax))
    if ids.numel() * MAX_SHARE > approx.shape[1]:
        return cpu_kernels.panel_linear(x, w).argmax(dim=-1)
    exact = cpu_kernels.panel_linear(x, gather_columns(w, ids))[:, :ids.numel()]  # (M, U): the full product's values there
    return ids[exact.masked_fill_(~member, float("-inf")).argmax(dim=-1)]
