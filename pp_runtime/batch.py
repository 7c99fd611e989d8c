"""MicroBatch: the plan of one pipeline step, as every worker of every stage receives it.

A plan lists sequence chunks: prefill chunks first, then single-token decodes. Each chunk
says where its tokens start in the sequence (= tokens already in the KV cache), which
cache blocks the sequence owns, and whether the last stage samples after it. The plan
is plain Python (no tensors, no engine objects); ``to_wire`` packs it into a tuple of
flat lists so that Ray calls and torch.distributed broadcasts stay small.
"""
from __future__ import annotations

from dataclasses import astuple, dataclass, field

# Temperatures below this are greedy, as in vLLM: dividing by them only turns ties and
# near-ties into coin flips, and such a request would lose greedy's same-tokens-everywhere promise.
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class LogitsEdit:
    """What the last stage changes in one row's logits before it picks a token, in vLLM's order:
    the penalties, then the ban of the stop ids while min_tokens is not reached."""

    banned: tuple[int, ...] = ()  # set to -inf
    presence: float = 0.0  # subtracted from each token of output_ids
    frequency: float = 0.0  # times its count, subtracted
    repetition: float = 1.0  # a positive logit of context_ids divided by it, a negative one multiplied
    output_ids: tuple[int, ...] = ()  # the distinct tokens of the output so far
    output_counts: tuple[int, ...] = ()  # how often each
    context_ids: tuple[int, ...] = ()  # the distinct tokens of prompt and output (repetition only)


@dataclass(frozen=True)
class SampleSpec:
    """Sampling for one sampled sequence; ``seed`` already mixes engine and request seeds."""

    temperature: float
    top_p: float
    top_k: int
    seed: int
    logprobs: int = -1  # -1: none; N ≥ 0: the sampled token's log-probability and the N likeliest
    edit: LogitsEdit | None = None  # None: the logits as the model gives them


# What the last stage returns for a micro-batch: its sampled token ids in plan order; or, when a
# row asked for logprobs, (those ids, per row None or ((token id, logprob, rank), ...), sampled first)
LogprobRow = tuple[tuple[int, float, int], ...]
Sampled = list[int] | tuple[list[int], list[LogprobRow | None]]


def split_sampled(sampled: Sampled) -> tuple[list[int], list[LogprobRow | None]]:
    """(token ids, per row its logprobs or None) of a last stage's return."""
    if isinstance(sampled, tuple):
        return sampled
    return sampled, [None] * len(sampled)


@dataclass(frozen=True)
class SeqChunk:
    seq_id: int
    start: int  # position of the first token of this chunk (tokens already cached before it)
    token_ids: tuple[int, ...]
    block_table: tuple[int, ...]
    is_prefill: bool
    sample: SampleSpec | None  # None: a non-final prefill chunk, nothing to sample

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens this chunk attends over: the cached ones plus itself."""
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class MicroBatch:
    mb_id: int
    chunks: tuple[SeqChunk, ...]
    request_ids: tuple[str, ...] = field(default=(), compare=False)  # for timing logs only
    time_ops: bool = field(default=False, compare=False)  # workers time each op (profile batches)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if c.is_prefill)

    @property
    def decode_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if not c.is_prefill)

    @property
    def kv_tokens(self) -> int:
        return sum(c.context_len for c in self.chunks)

    @property
    def num_samples(self) -> int:
        return sum(1 for c in self.chunks if c.sample is not None)

    def to_wire(self) -> tuple:
        """Flat lists: (mb_id, seq_ids, starts, lens, is_prefill, tokens, table_lens, tables, samples,
        time_ops)."""
        samples = [(i, s.temperature, s.top_p, s.top_k, s.seed, s.logprobs, s.edit and astuple(s.edit))
                   for i, c in enumerate(self.chunks) if (s := c.sample) is not None]
        return (self.mb_id,
                [c.seq_id for c in self.chunks],
                [c.start for c in self.chunks],
                [c.num_tokens for c in self.chunks],
                [c.is_prefill for c in self.chunks],
                [t for c in self.chunks for t in c.token_ids],
                [len(c.block_table) for c in self.chunks],
                [b for c in self.chunks for b in c.block_table],
                samples,
                self.time_ops)

    @classmethod
    def from_wire(cls, wire: tuple) -> "MicroBatch":
        mb_id, seq_ids, starts, lens, prefill, tokens, table_lens, tables, samples, time_ops = wire
        specs = {i: SampleSpec(t, p, k, s, n, e and LogitsEdit(*e)) for i, t, p, k, s, n, e in samples}
        chunks, tok_off, tab_off = [], 0, 0
        for i, seq_id in enumerate(seq_ids):
            chunks.append(SeqChunk(seq_id, starts[i], tuple(tokens[tok_off:tok_off + lens[i]]),
                                   tuple(tables[tab_off:tab_off + table_lens[i]]), prefill[i],
                                   specs.get(i)))
            tok_off += lens[i]
            tab_off += table_lens[i]
        return cls(mb_id, tuple(chunks), time_ops=time_ops)
