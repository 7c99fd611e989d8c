"""GGUF block-quantized weights kept as stored, for the CPU GEMM (stages/csrc/gemm_quant.cpp).

A GGUF linear weight (N, K) is stored as blocks of 32 along K. ``to_panels`` regroups the
blocks of rows Q4_0, Q4_1 or Q8_0 into uint8 panels (N/16, K/32, QB) that ``quant_linear``
reads: per panel of 16 output columns and block of 32 k, d[16] and m[16] in fp16 (GGUF's own
scales, kept exactly), then the codes (4-bit: QB = 320; 8-bit: QB = 576), so that w = d·q + m —
Q4_1 as stored, Q4_0 with its −8 folded into m = −8d, Q8_0 with m = 0. Each weight is the fp32
value the gguf package dequantizes it to, bit for bit (d·q is exact in fp32; the one rounding is
the + m), at 1/6.4 (Q4: 0.625 B per weight) or 1/3.6 (Q8) of fp32's bytes. Why keep them: a
decode step streams every weight once, and on a CPU that stream is most of a few-row step's time
(fp32 d and m, 0.75 B per Q4 weight, left 1-4-row products of the int8 kind 14% slower).

    raw, qtype = GGUFFile(path).raw("blk.0.ffn_up.weight")     # (N, K/32 · block bytes) uint8
    panels = to_panels(raw, qtype)                             # (N/16, K/32, QB) uint8 tensor
    w = all_rows(panels)                                       # (N, K) float32, as dequantize gives
"""
from __future__ import annotations

import numpy as np
import torch

QK = 32  # weights per GGUF block (along K)
PANEL = 16  # output columns per panel (cpu_kernels.PANEL)
Q4_0, Q4_1, Q8_0 = 2, 3, 8  # GGMLQuantizationType values
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}  # fp16 d (+ fp16 m for Q4_1) + 32 codes
DM = 2 * PANEL * 2  # bytes of a block's d[16] and m[16] (fp16): where its codes start
QB_U4, QB_S8 = DM + QK * PANEL // 2, DM + QK * PANEL  # bytes of one (panel, block)


def supported(qtype: int) -> bool:
    return qtype in BLOCK_BYTES


def _f16(b: np.ndarray) -> np.ndarray:
    """(..., 2) uint8 little-endian fp16 -> (...) float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _codes(blocks: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(n, kb, block bytes) -> d (n, kb), m (n, kb) float32 and codes (n, kb, 32)."""
    d = _f16(blocks[..., 0:2])
    if qtype == Q8_0:
        return d, np.zeros_like(d), blocks[..., 2:34].view(np.int8)
    start = 4 if qtype == Q4_1 else 2
    qs = blocks[..., start:start + QK // 2]  # element j in the low nibble of byte j, j + 16 in the high
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    m = _f16(blocks[..., 2:4]) if qtype == Q4_1 else -8.0 * d  # Q4_0: d·(q − 8) = d·q − 8d, exact
    return d, m, codes


def to_panels(raw: np.ndarray, qtype: int) -> torch.Tensor:
    """GGUF rows (N, K/32 · block bytes) of one qtype -> (N/16, K/32, QB) uint8 panels."""
    if not supported(qtype):
        raise ValueError(f"GGUF type {qtype} is not kept quantized (Q4_0, Q4_1, Q8_0 are)")
    n, row_bytes = raw.shape
    if n % PANEL or row_bytes % BLOCK_BYTES[qtype]:
        raise ValueError(f"a ({n} rows, {row_bytes} bytes) GGUF weight does not cut into panels of {PANEL}")
    kb = row_bytes // BLOCK_BYTES[qtype]
    d, m, codes = _codes(raw.reshape(n, kb, BLOCK_BYTES[qtype]), qtype)
    np_ = n // PANEL

    def by_panel(a: np.ndarray) -> np.ndarray:  # (n, kb, ...) -> (N/16, kb, ..., 16)
        a = a.reshape(np_, PANEL, kb, *a.shape[2:])
        return np.moveaxis(a, 1, -1)

    scales = np.concatenate([by_panel(d), by_panel(m)], axis=-1)  # (NP, kb, 32) float32
    with np.errstate(over="ignore"):  # an overflow is the error below
        halves = scales.astype(np.float16)
    if not np.array_equal(halves.astype(np.float32), scales, equal_nan=True):  # Q4_0's m = −8d past fp16's range
        raise ValueError(f"GGUF type {qtype}: a block's scale or offset does not fit fp16")
    q = by_panel(codes)  # (NP, kb, 32, 16): row k of a block holds its 16 columns
    if qtype == Q8_0:
        qbytes = np.ascontiguousarray(q).view(np.uint8).reshape(np_, kb, QK * PANEL)
    else:  # rows 2i and 2i + 1 in 16 bytes: byte j holds column j of row 2i (low nibble), of 2i + 1 (high)
        qbytes = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).astype(np.uint8).reshape(np_, kb, QK * PANEL // 2)
    out = np.concatenate([np.ascontiguousarray(halves).view(np.uint8), qbytes], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(out))


def is_panels(w: torch.Tensor) -> bool:
    return w.dim() == 3 and w.dtype == torch.uint8


def panel_shape(w: torch.Tensor) -> tuple[int, int]:
    """(N, K) of the weight a panel tensor holds."""
    return w.shape[0] * PANEL, w.shape[1] * QK


def _dequantize(d: torch.Tensor, m: torch.Tensor, code_bytes: torch.Tensor, s8: bool) -> torch.Tensor:
    """One output row per leading index: d, m (..., kb) and its code bytes (..., kb, 32 or 16: row
    pairs, 2i in the low nibble) -> (..., kb · 32) float32. Two ops, not addcmul: d·q (exact) then
    one rounding for + m, as the gguf package does."""
    q = code_bytes.view(torch.int8) if s8 else torch.stack([code_bytes & 0x0F, code_bytes >> 4], dim=-1).flatten(-2)
    return (q.float() * d.unsqueeze(-1)).add_(m.unsqueeze(-1)).flatten(-2)


def _code_bytes(blk: torch.Tensor) -> torch.Tensor:
    """(T, kb, QB) blocks -> their code bytes (T, kb, 32 or 16, 16): byte row r, output column j."""
    t, kb, qb = blk.shape
    return blk[..., DM:].reshape(t, kb, QK if qb == QB_S8 else QK // 2, PANEL)


def block_scales(blk: torch.Tensor) -> torch.Tensor:
    """(..., QB) blocks -> (..., 32) float32: d[16] then m[16], widened exactly from fp16."""
    return blk[..., :DM].contiguous().view(torch.float16).float()


def all_rows(w: torch.Tensor) -> torch.Tensor:
    """Every row of the (N, K) weight held by panels w, as float32 (N, K): panel_rows(w, arange(N))
    without its gather of a whole panel per row (16x the bytes)."""
    t, kb = w.shape[:2]
    scales = block_scales(w).transpose(1, 2)  # (P, 32, kb): d[16], m[16]
    rows = _dequantize(scales[:, :PANEL], scales[:, PANEL:], _code_bytes(w).permute(0, 3, 1, 2), w.shape[2] == QB_S8)
    return rows.reshape(t * PANEL, kb * QK)  # (P, 16, K): panel p's column j is row 16p + j


def panel_rows(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ids (T,) of the (N, K) weight held by panels w, as float32 (T, K): an embedding lookup
    from a tied LM head, or the whole weight for a check."""
    p, c = ids // PANEL, ids % PANEL
    blk = w[p]  # (T, kb, QB)
    ar = torch.arange(ids.numel())
    scales = block_scales(blk)  # (T, kb, 32): d[16], m[16]
    code_bytes = _code_bytes(blk)[ar, :, :, c]  # (T, kb, 32 or 16): this row's column only
    return _dequantize(scales[ar, :, c], scales[ar, :, PANEL + c], code_bytes, w.shape[2] == QB_S8)
