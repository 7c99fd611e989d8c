"""The profile's plan, in plain Python (no tensors): which batches a profile runs (``Grid`` →
``Point``s → ``SeqChunk``s over a ``Layout`` of KV blocks). Timed samples become rows in
profile_stats.py, and tables and files in profile_tables.py.

Shared by the in-process profile (stages/profile.py, one worker of the whole model) and the
in-deployment one (pp_runtime/profile_deploy.py, every stage worker of a running deployment).

    grid = parse_grid("decode=1,4;context=512")
    for pt in grid_points(grid): print(pt.label)
"""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, fields, replace

from pp_runtime.batch import SampleSpec, SeqChunk
from pp_runtime.kv_cache import blocks_for

KINDS = ("prefill", "decode", "mixed")
_GREEDY = SampleSpec(0.0, 1.0, 0, 0)
STATS = {"median": statistics.median, "min": min}


# ---- grid ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Grid:
    """What to run. ``context`` is the cached length of every decode and of the
    ``prefill_with_context`` rows; ``mixed_prefill`` is the chunk P of every mixed row."""

    prefill: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
    prefill_with_context: tuple[int, ...] = (256,)
    decode: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    mixed_decode: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    mixed_prefill: int = 256
    context: int = 256
    warmup: int = 1
    reps: int = 3
    block_size: int = 16
    stat: str = "median"  # per bucket over the timed rounds; "min" resists a busy shared CPU

    def __post_init__(self) -> None:
        if self.stat not in STATS:
            raise ValueError(f"grid stat must be one of {', '.join(STATS)}, got {self.stat!r}")
        for f in ("prefill", "prefill_with_context", "decode", "mixed_decode"):
            v = getattr(self, f)
            if any(not isinstance(n, int) or n <= 0 for n in v):
                raise ValueError(f"grid {f} sizes must be positive integers, got {list(v)}")
        if not (self.prefill or self.decode or self.mixed_decode):
            raise ValueError("grid has no prefill, decode or mixed sizes")
        for f in ("mixed_prefill", "reps", "block_size"):
            if getattr(self, f) <= 0:
                raise ValueError(f"grid {f} must be > 0, got {getattr(self, f)}")
        if self.context < 0 or self.warmup < 0:
            raise ValueError("grid context and warmup must be ≥ 0")
        if (self.decode or self.mixed_decode) and self.context <= 0:
            raise ValueError("grid context must be > 0 when there are decodes (they need cached tokens)")

    def prefill_points(self) -> list[tuple[int, int]]:
        """(P, cached) of every prefill-only row; P = mixed_prefill at 0 is always there (the
        baseline of the mixed rows' marginal decode cost)."""
        pts = [(p, 0) for p in self.prefill] + [(p, self.context) for p in self.prefill_with_context]
        if self.mixed_decode and (self.mixed_prefill, 0) not in pts:
            pts.append((self.mixed_prefill, 0))
        return sorted(set(pts), key=lambda x: (x[1], x[0]))

    def max_len(self) -> int:
        lens = [c + p for p, c in self.prefill_points()] + [self.context + 1]
        return max(lens)


GRIDS = {
    "default": Grid(),
    "quick": Grid(prefill=(4, 8), prefill_with_context=(4,), decode=(1, 2, 4), mixed_decode=(1, 2, 4),
                  mixed_prefill=8, context=8, warmup=1, reps=3, block_size=4),
}


def parse_grid(spec: str | Grid) -> Grid:
    """``default``, ``quick``, or overrides of the default grid:
    ``"prefill=64,256;decode=1,4;mixed_decode=4;mixed_prefill=256;context=512;reps=3;stat=min"``
    (a base may lead: ``"quick;reps=5"``). Raises ValueError naming a bad key or value."""
    if isinstance(spec, Grid):
        return spec
    spec = (spec or "default").strip()
    if spec in GRIDS:
        return GRIDS[spec]
    parts = [p.strip() for p in spec.split(";") if p.strip()]
    base = GRIDS["default"]
    if parts and parts[0] in GRIDS:
        base = GRIDS[parts.pop(0)]
    known = {f.name: f for f in fields(Grid)}
    changes: dict = {}
    for part in parts:
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in known:
            raise ValueError(f"bad grid item {part!r}: expected NAME=VALUE with NAME one of "
                             f"{', '.join(known)} (or a grid name: {', '.join(GRIDS)})")
        if key == "stat":
            changes[key] = value.strip()
            continue
        try:
            vals = tuple(int(v) for v in value.split(",") if v.strip())
        except ValueError:
            raise ValueError(f"bad grid value {part!r}: integers expected") from None
        if isinstance(getattr(base, key), tuple):
            changes[key] = vals
        elif len(vals) != 1:
            raise ValueError(f"grid {key} takes one integer, got {value!r}")
        else:
            changes[key] = vals[0]
    return replace(base, **changes)


@dataclass(frozen=True)
class Point:
    kind: str
    prefill_tokens: int
    decode_tokens: int
    context_len: int  # cached tokens before the prefill chunk (prefill) or before each decode
    # mixed: the chunk continues its own prompt after context_len cached tokens (a later chunk of
    # a long prompt, as in steady serving), where by default it is the prompt's first
    chunk_cached: bool = False

    @property
    def label(self) -> str:
        cached = " chunk cached" if self.chunk_cached else ""
        return f"{self.kind} P={self.prefill_tokens} B={self.decode_tokens} ctx={self.context_len}{cached}"


def grid_points(grid: Grid) -> list[Point]:
    pts = [Point("prefill", p, 0, c) for p, c in grid.prefill_points()]
    pts += [Point("decode", 0, b, grid.context) for b in grid.decode]
    pts += [Point("mixed", grid.mixed_prefill, b, grid.context) for b in grid.mixed_decode]
    return pts


# ---- KV layout and plans ------------------------------------------------------------------
class Layout:
    """Block regions of the cache: sequence 0 (every prefill chunk) first, then one region per
    decode sequence, each large enough for its context plus the new token."""

    def __init__(self, grid: Grid) -> None:
        bs = grid.block_size
        self.bs = bs
        self.prefill_blocks = blocks_for(max([c + p for p, c in grid.prefill_points()] + [1]), bs)
        self.decode_blocks = blocks_for(grid.context + 1, bs)
        self.max_decodes = max(list(grid.decode) + list(grid.mixed_decode) + [0])
        self.num_blocks = self.prefill_blocks + self.max_decodes * self.decode_blocks

    def prefill_table(self) -> tuple[int, ...]:
        return tuple(range(self.prefill_blocks))

    def decode_table(self, j: int) -> tuple[int, ...]:
        first = self.prefill_blocks + j * self.decode_blocks
        return tuple(range(first, first + self.decode_blocks))


def plan_chunks(point: Point, layout: Layout, vocab: int, rng: random.Random) -> tuple[SeqChunk, ...]:
    """The SeqChunks of one grid point: prefill chunk first, then the decodes (the scheduler's
    order). Token ids are random: no op's cost depends on their values."""
    chunks = []
    if point.prefill_tokens:
        ids = tuple(rng.randrange(vocab) for _ in range(point.prefill_tokens))
        start = point.context_len if point.kind == "prefill" or point.chunk_cached else 0
        chunks.append(SeqChunk(0, start, ids, layout.prefill_table(), True, _GREEDY))
    for j in range(point.decode_tokens):
        chunks.append(SeqChunk(1 + j, point.context_len, (rng.randrange(vocab),), layout.decode_table(j), False,
                               _GREEDY))
    return tuple(chunks)
