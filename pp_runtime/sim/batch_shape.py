"""What a micro-batch's cost depends on: its :class:`BatchShape` (prefill tokens, decode tokens and
the KV lengths they attend over), and the six per-layer operations a cost model times (``OPS``:
preproj = QKV, attn, postproj = O, ffn_ln1 = gate/up, ffn_ln2 = down, others = norms, RoPE,
activation, residuals), the order the profiler measures them in.

    from pp_runtime.sim.batch_shape import BatchShape
    shape = BatchShape.of(micro_batch)                       # or, by hand:
    shape = BatchShape.build([(256, 1024)], [2048] * 8)      # a 256-token chunk after 1024 cached + 8 decodes
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pp_runtime.batch import MicroBatch

OPS = ("preproj", "attn", "postproj", "ffn_ln1", "ffn_ln2", "others")
LINEAR_OPS = ("preproj", "postproj", "ffn_ln1", "ffn_ln2")


@dataclass(frozen=True)
class BatchShape:
    """What a micro-batch's cost depends on.

    prefill_pairs: Σ over prefill chunks of n·(start + (n+1)/2), the (query, key) pairs causal
    attention computes; prefill_kv: Σ (start + n), K/V rows the prefill chunks read; decode_kv:
    Σ over decodes of their context (start + 1); sampled: rows the LM head runs on.
    """

    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_pairs: float = 0.0
    prefill_kv: int = 0
    decode_kv: int = 0
    sampled: int = 0
    prefill_chunks: int = 0

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    @classmethod
    def of(cls, mb: MicroBatch) -> "BatchShape":
        p = d = pkv = dkv = s = nchunks = 0
        pairs = 0.0
        for c in mb.chunks:
            n = len(c.token_ids)
            if c.sample is not None:
                s += 1
            if c.is_prefill:
                p += n
                nchunks += 1
                pairs += n * (c.start + (n + 1) / 2)
                pkv += c.start + n
            else:
                d += n
                dkv += c.start + n
        return cls(p, d, pairs, pkv, dkv, s, nchunks)

    @classmethod
    def build(cls, prefill: Sequence[tuple[int, int]] = (), decode_contexts: Sequence[int] = (),
              sampled: int | None = None) -> "BatchShape":
        """From (chunk tokens, cached tokens before it) pairs and the context of each decode
        (cached tokens + its new one); ``sampled`` defaults to one row per chunk and per decode."""
        pairs = sum(n * (c + (n + 1) / 2) for n, c in prefill)
        return cls(sum(n for n, _ in prefill), len(decode_contexts), pairs, sum(n + c for n, c in prefill),
                   sum(decode_contexts), len(prefill) + len(decode_contexts) if sampled is None else sampled,
                   len(prefill))
