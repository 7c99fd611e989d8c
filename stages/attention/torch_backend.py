"""Reference attention backend on torch SDPA: runs on any device.

On CPU in fp32 the kernels of ``stages.cpu_kernels`` read K/V blocks in place: a causal one per
prefill chunk (it skips the keys a query block cannot see), one for all decodes. Elsewhere
(and for head sizes the kernels do not tile): prefill chunks as one SDPA per chunk over its
gathered context, causal with the diagonal offset by the tokens already cached (bottom-right
aligned); decodes on CUDA in one Triton kernel that reads their blocks in place
(``triton_decode``), elsewhere as one batched SDPA over their gathered, padded contexts with a
padding mask. GQA through SDPA's ``enable_gqa``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from stages import cpu_kernels, triton_elementwise
from stages.attention import triton_decode
from stages.attention.metadata import AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata, keep: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Store the new tokens' K/V (T, H_kv, D) in the paged caches (NB, BS, H_kv, D), rounded to
    the cache's dtype where it is narrower (``CacheConfig.kv_dtype``). ``keep``: where the fused
    CUDA write runs, also the first ``keep`` rows of K and V as the cache holds them, in k's dtype
    (else None: the caller rounds them itself)."""
    if (cpu_kernels.usable(k) and triton_elementwise.heads_contiguous(k) and triton_elementwise.heads_contiguous(v)
            and k_cache.is_contiguous() and v_cache.is_contiguous()):
        # one call for both, ~1 us a layer where two index_copy_ took ~40 (a 32-row decode step)
        cpu_kernels.write_kv_(k, v, k_cache, v_cache, meta.slot_mapping)
        return None
    if triton_elementwise.takes(k) and triton_elementwise.kv_fits(k, v, k_cache, v_cache):
        return triton_elementwise.write_kv_(k, v, k_cache, v_cache, meta.slot_mapping, keep)  # one kernel for both
    h, d = k.shape[1:]
    for x, cache in ((k, k_cache), (v, v_cache)):
        byte_view(cache).view(-1, h, d).index_copy_(0, meta.slot_mapping, byte_view(_narrow(x, cache.dtype)))
    return None


def _narrow(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache's dtype, clamped to its finite range (fp16 ±65504, fp8 e4m3 ±448), since an
    inf key would turn every score of the row into NaN."""
    if x.dtype == dtype:
        return x
    if dtype in (torch.float16, torch.float8_e4m3fn):
        top = torch.finfo(dtype).max
        # in fp32: bf16 has no 65504, a clamp in bf16 gave 65536, which fp16 made inf
        x = x.float().clamp(-top, top)
    return x.to(dtype)


def byte_view(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache as its bytes: torch's index_copy_ / index_select take no float8 tensors."""
    return cache.view(torch.uint8) if cache.dtype.itemsize == 1 else cache


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The cache's blocks ``blocks`` (n,) as (n, BS, H_kv, D), in the cache's dtype."""
    return byte_view(cache).index_select(0, blocks).view(cache.dtype)


def _causal_lower_right(n: int, ctx: int) -> torch.Tensor:
    """SDPA's bottom-right causal mask for n queries over ctx keys. Imported here, not at the top:
    torch.nn.attention.bias imports torch._dynamo, ~2 s of every worker's and CLI run's start-up
    (tests/stages/test_import_time.py), for a mask only later chunks off the CPU kernels need."""
    from torch.nn.attention.bias import causal_lower_right
    return causal_lower_right(n, ctx)


def decode_lens(meta: AttentionMetadata, device: torch.device | None = None) -> torch.Tensor:
    """(D,) int64 context length of every decode (on the CPU, or ``device``), built once per step."""
    key = f"decode_lens:{device}"
    if key not in meta.backend_cache:
        meta.backend_cache[key] = torch.tensor(meta.ctx_lens[meta.num_prefills:], dtype=torch.long, device=device)
    return meta.backend_cache[key]


class TorchAttention:
    name = "torch"

    def __init__(self, scale: float) -> None:
        self.scale = scale
        # the CPU attention kernels' products in bf16 (set_matmul_precision sets it for "medium" and
        # "int8" where the kernels have AVX512-BF16): prefill chunks of more than 12 tokens, and
        # steps of more than decode_bf16_over decodes over an fp8 cache (cpu_kernels.paged_decode):
        # 12 under "medium", whose steps of up to 12 rows stay fp32; 0 under "int8", which promises
        # no fp32 rows (its GGUF linears take int8 at every row count) and whose small decode steps
        # (a pipeline's, a drain's) gain the same
        self.bf16 = False
        self.decode_bf16_over = cpu_kernels.BF16_FP32_ROWS
        # on CUDA, decodes read K/V in place (triton_decode) where it can run, else gathered; off
        # only for a before/after measurement (benchmarks/decode_maximal.py --cuda-decode)
        self.paged_cuda = True
        # the Triton kernel's tuning knobs (triton_decode.paged_decode's tokens, num_warps,
        # num_stages, splits), set only by decode_maximal.py --cuda-decode paged:KEY=VALUE
        self.decode_tuning: dict[str, int] = {}

    @staticmethod
    def _use_paged_kernel(q: torch.Tensor) -> bool:
        return cpu_kernels.usable(q)

    @staticmethod
    def _decode_kernel_takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             meta: AttentionMetadata) -> bool:
        """triton_decode.usable, asked once per step: every layer's q and caches are alike, and on a
        host-bound CUDA step each layer's Python counts."""
        if "triton_decode" not in meta.backend_cache:
            meta.backend_cache["triton_decode"] = triton_decode.usable(q, k_cache, v_cache)
        return meta.backend_cache["triton_decode"]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q (T, H, D), k/v (T, H_kv, D) -> (T, H, D)."""
        h_kv, d = k.shape[1:]
        kernels = self._use_paged_kernel(q)
        paged = kernels and d % cpu_kernels.TILE == 0
        # a fresh prefill attends to its own K/V as the cache holds them (rounded where it is
        # narrower, as every later chunk and decode reads them): the write hands them back
        rounds = not paged and k_cache.dtype != k.dtype and any(meta.fresh_prefill)
        kept = write_kv(k, v, k_cache, v_cache, meta, sum(meta.q_lens[:meta.num_prefills]) if rounds else 0)
        out = torch.empty_like(q)
        row = 0
        for i in range(meta.num_prefills):
            n, ctx = meta.q_lens[i], meta.ctx_lens[i]
            if paged:  # causal blocks only, K/V read in place (the chunk's own were just written)
                cpu_kernels.paged_prefill(q[row:row + n], k_cache, v_cache, meta.prefill_tables[i], ctx, self.scale,
                                          out[row:row + n], self.bf16)
                row += n
                continue
            qi = q[row:row + n].transpose(0, 1).unsqueeze(0)  # (1, H, n, D)
            if meta.fresh_prefill[i]:  # nothing cached: attend to the chunk itself, plain causal
                if kept is not None:
                    ki, vi = (t[row:row + n] for t in kept)
                else:  # as the cache holds them (an fp16 cache rounds them), as the kernels read them
                    ki, vi = (_narrow(t[row:row + n], k_cache.dtype).to(q.dtype) for t in (k, v))
                mask, causal = None, True
            else:  # whole blocks of the context, then trimmed to its length
                table = meta.prefill_tables[i]
                ki = _gather(k_cache, table).view(-1, h_kv, d)[:ctx].to(q.dtype)  # (ctx, H_kv, D)
                vi = _gather(v_cache, table).view(-1, h_kv, d)[:ctx].to(q.dtype)
                # query i (at position ctx − n + i) sees keys 0..ctx − n + i: causal aligned to the
                # bottom right, which SDPA's flash kernel takes as such on CUDA. An explicit (n, ctx)
                # mask rules flash out, and with GQA the memory-efficient kernel too (it wants as
                # many K/V heads as q's), leaving the math path: the fp32 scores materialised
                mask, causal = _causal_lower_right(n, ctx), False
            o = F.scaled_dot_product_attention(qi, ki.transpose(0, 1).unsqueeze(0), vi.transpose(0, 1).unsqueeze(0),
                                               attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True)
            out[row:row + n] = o.squeeze(0).transpose(0, 1)
            row += n
        if meta.num_decodes and kernels:  # K/V read in place, no gather
            out[row:] = cpu_kernels.paged_decode(q[row:], k_cache, v_cache, meta.decode_tables,
                                               decode_lens(meta), self.scale, self.bf16,
                                               self.decode_bf16_over)
        elif meta.num_decodes and self.paged_cuda and self._decode_kernel_takes(q, k_cache, v_cache, meta):
            triton_decode.paged_decode(q[row:], k_cache, v_cache, meta.decode_tables, decode_lens(meta, q.device),
                                       self.scale, out=out[row:], **self.decode_tuning)  # in place: no copy
        elif meta.num_decodes:
            b = meta.num_decodes
            idx = meta.decode_tables.reshape(-1)
            kd = _gather(k_cache, idx).view(b, -1, h_kv, d).transpose(1, 2).to(q.dtype)  # (B, H_kv, L, D)
            vd = _gather(v_cache, idx).view(b, -1, h_kv, d).transpose(1, 2).to(q.dtype)
            mask = meta.decode_mask[:, None, None, :]  # (B, 1, 1, L)
            o = F.scaled_dot_product_attention(q[row:].unsqueeze(2), kd, vd, attn_mask=mask, scale=self.scale,
                                               enable_gqa=True)  # (B, H, 1, D)
            out[row:] = o.squeeze(2)
        return out
