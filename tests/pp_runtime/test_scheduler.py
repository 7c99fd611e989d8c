"""Scheduler policies driven by a fake pipeline: plain Python, no tensors, no model.

``FakePipeline`` keeps up to ``pp`` micro-batches in flight like the engine does and
"executes" the oldest one against a simulated paged KV cache: every chunk writes
(seq, position, token) into the slots its block table names, and a sampled chunk reads
its whole context back through the table. The sampled token is a hash of what it read,
so a token is a pure function of the request's history when (and only when) the cache
holds the right K/V — outputs are then independent of batching, chunking, pipelining
and preemption, and ``oracle`` predicts them without a scheduler.

Every plan is checked against the invariants of DESIGN.md §2 and of its policy as it is
issued; the tests below pick workloads that make each invariant bite.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pp_runtime.batch import MicroBatch, SeqChunk
from pp_runtime.config import ADMISSIONS, KV_ADMISSIONS, SchedulerConfig
from pp_runtime.kv_cache import BlockManager, blocks_for
from pp_runtime.request import Request, SamplingParams
from pp_runtime.chunk_budget import chunk_cost, fits
from pp_runtime.scheduler import Scheduler

VOCAB = 61
EOS = 0
POLICIES = ("sarathi", "orca", "prefill_first", "request_level")
HUGE_KV = 100_000


# ---- the fake model ---------------------------------------------------------------------------
def next_token(history: tuple[int, ...] | list[int]) -> int:
    """Deterministic 'model': the next token depends on every token before it."""
    h = 0x345678
    for t in history:
        h = (h * 1_000_003 + t + 1) % (1 << 61)
    return (h >> 7) % VOCAB


def oracle(prompt: list[int], params: SamplingParams, eos: tuple[int, ...] = (EOS,)) -> tuple[list[int], str]:
    """What any correct scheduler must produce for this request."""
    out: list[int] = []
    while True:
        tok = next_token(prompt + out)
        out.append(tok)
        if (tok in eos and not params.ignore_eos) or tok in params.stop_token_ids:
            return out, "stop"
        if len(out) >= params.max_tokens:
            return out, "length"


@dataclass
class FakePipeline:
    """The engine loop (schedule ≤ pp ahead, run the oldest, postprocess) plus invariant checks."""

    sched: Scheduler
    pp: int
    ample_kv: bool = False  # KV never runs short: batch shapes are exactly predictable
    in_flight: deque[MicroBatch] = field(default_factory=deque)
    history: list[MicroBatch] = field(default_factory=list)
    in_flight_sets: list[tuple[MicroBatch, ...]] = field(default_factory=list)
    cache: dict[tuple[int, int], tuple[int, int, int]] = field(default_factory=dict)
    reqs: dict[int, Request] = field(default_factory=dict)
    seen: set[int] = field(default_factory=set)  # seq ids that ever appeared in a plan
    reported: list[int] = field(default_factory=list)  # seq ids postprocess reported finished
    last_end: dict[int, int] = field(default_factory=dict)

    @property
    def cfg(self) -> SchedulerConfig:
        return self.sched.cfg

    def add(self, reqs: list[Request]) -> None:
        for r in reqs:
            self.reqs[r.seq_id] = r
            self.sched.add(r)

    # -- the loop --
    def fill(self) -> None:
        while len(self.in_flight) < self.pp:
            pre = self._snapshot()
            mb = self.sched.schedule()
            if mb is None:
                return
            self._check_plan(mb, pre)
            self.in_flight.append(mb)
            self.history.append(mb)
            self.in_flight_sets.append(tuple(self.in_flight))
            self._check_blocks()

    def run_oldest(self) -> list[Request]:
        mb = self.in_flight.popleft()
        for c in mb.chunks:  # as a layer does: every K/V of the batch written, then attention
            self._write(c)
        tokens = [self._attend(c) for c in mb.chunks]
        done = self.sched.postprocess(mb, [t for t in tokens if t is not None])
        for r in done:
            assert r.finished and r.seq_id not in self.reported, f"{r.request_id} reported twice"
            self.reported.append(r.seq_id)
        self._check_blocks()
        return done

    def run(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            self.fill()
            if not self.in_flight:
                assert not self.sched.has_unfinished(), "scheduler stalled with unfinished requests: " + \
                    str([(r.request_id, r.phase, r.num_scheduled) for r in self.sched.running + list(self.sched.waiting)])
                return
            self.run_oldest()
        raise AssertionError("did not finish")

    # -- the simulated model + paged cache --
    def _write(self, c: SeqChunk) -> None:
        # A slot holds what a real K/V row depends on: its position and every token up to it (with
        # prefix caching a slot another sequence wrote is right exactly when that history matches).
        bs = self.sched.blocks.block_size
        hist = self._history(c.seq_id)
        for i in range(c.num_tokens):
            pos = c.start + i
            self.cache[(c.block_table[pos // bs], pos % bs)] = (pos, next_token(hist[:pos + 1]), hist[pos])

    def _attend(self, c: SeqChunk) -> int | None:
        # Attention over the whole context, through the block table, as a worker would read it.
        bs = self.sched.blocks.block_size
        hist = self._history(c.seq_id)
        seen = [self.cache.get((c.block_table[p // bs], p % bs)) for p in range(c.context_len)]
        assert all(s is not None and s[:2] == (p, next_token(hist[:p + 1])) for p, s in enumerate(seen)), \
            f"seq {c.seq_id}: KV cache corrupted (a slot holds another history's K/V)"
        return None if c.sample is None else next_token([s[2] for s in seen])

    def _history(self, seq_id: int) -> list[int]:
        req = self.reqs[seq_id]
        return req.prompt_token_ids + req.output_token_ids

    # -- invariants --
    def _snapshot(self) -> dict:
        s = self.sched
        ready = [r for r in s.running if r.is_decoding and r.in_flight == 0]
        # Prefill work on offer, FCFS: running prompts' remainders, then admissible newcomers.
        # as (start position, tokens left)
        offered = [(r.num_scheduled, r.prefill_len - r.num_scheduled) for r in s.running if r.is_prefilling]
        # a waiting one from its cached prefix (0 without prefix caching)
        hits = {r.seq_id: len(s.blocks.cached_prefix(self._history(r.seq_id))) * s.blocks.block_size
                for r in s.waiting}
        newcomers = [r.seq_id for r in list(s.waiting)[:max(0, self.cfg.max_batch_size - len(s.running))]]
        offered += [(hits[q], self.reqs[q].num_tokens - hits[q]) for q in newcomers]
        decoding = sum(1 for r in s.running if r.is_decoding)  # ready or in flight
        return {"ready": ready, "offered": offered, "share": -(-decoding // s.depth), "hits": hits,
                "newcomers": newcomers,
                "preemptions": {q: r.num_preemptions for q, r in self.reqs.items()},
                "unfinished_seen": {q for q in self.seen if not self.reqs[q].finished}}

    def _check_plan(self, mb: MicroBatch, pre: dict) -> None:
        cfg, chunks = self.cfg, mb.chunks
        ids = [c.seq_id for c in chunks]
        assert 1 <= len(chunks) <= cfg.max_batch_size
        assert len(ids) == len(set(ids)), "a request appears twice in one micro-batch"
        assert [c.is_prefill for c in chunks] == sorted((c.is_prefill for c in chunks), reverse=True), \
            "prefill chunks must come before decodes"
        in_flight = {c.seq_id: c for m in self.in_flight for c in m.chunks}
        # (re)started by this plan: waiting before it, or preempted while it was built and taken again
        restarted = {q for q in ids if q in pre["hits"] or self.reqs[q].num_preemptions > pre["preemptions"][q]}
        for c in chunks:
            self._check_chunk(c, in_flight, c.seq_id in restarted)
            if c.seq_id in pre["hits"] and self.ample_kv:  # nothing evicted: the hit seen before, or more
                assert c.start >= pre["hits"][c.seq_id]  # (blocks of prompts planned before it in this batch)
        getattr(self, f"_check_{cfg.policy}")(mb, pre)
        self.seen.update(ids)

    def _check_chunk(self, c: SeqChunk, in_flight: dict[int, SeqChunk], restarted: bool) -> None:
        req = self.reqs[c.seq_id]
        hist = self._history(c.seq_id)
        assert not req.finished
        assert c.num_tokens >= 1
        assert list(c.token_ids) == hist[c.start:c.start + c.num_tokens], "chunk carries the wrong tokens"
        assert c.block_table == tuple(self.sched.blocks.block_table(c.seq_id))
        assert len(c.block_table) >= blocks_for(c.context_len, self.sched.blocks.block_size)
        assert (c.sample is not None) == (c.context_len == len(hist)), "sample exactly at the last known token"
        bs, caching = self.sched.blocks.block_size, self.sched.blocks.prefix_caching
        if restarted:  # it starts after whole cached blocks (none without prefix caching)
            assert c.is_prefill and c.start % bs == 0 and (caching or c.start == 0)
            assert c.seq_id not in in_flight, f"seq {c.seq_id} is already in an in-flight micro-batch"
        elif c.is_prefill and c.start > 0:  # a continuation: right after the previous chunk of this prompt
            assert self.last_end.get(c.seq_id) == c.start
            assert c.seq_id not in in_flight or in_flight[c.seq_id].is_prefill
        else:  # a decode, or a prompt (re)starting: nothing of it may be in flight
            assert c.seq_id not in in_flight, f"seq {c.seq_id} is already in an in-flight micro-batch"
        if not c.is_prefill:
            assert c.num_tokens == 1 and c.start == len(hist) - 1
        self.last_end[c.seq_id] = c.context_len

    def _check_sarathi(self, mb: MicroBatch, pre: dict) -> None:
        cfg = self.cfg
        # One slot is kept for a prefill chunk only when some prefill could take it.
        decode_cap = max(1, cfg.max_batch_size - 1) if pre["offered"] else cfg.max_batch_size
        # ... and a batch carries no more than its even share of the decoding requests
        decode_cap = min(decode_cap, pre["share"])
        n_dec = mb.decode_tokens
        assert n_dec <= decode_cap
        assert mb.prefill_tokens <= cfg.chunk_size
        if cfg.tile_align:
            assert mb.num_tokens <= cfg.chunk_size
        if self.ample_kv:
            assert n_dec == min(len(pre["ready"]), decode_cap), "decode-maximal: every ready decode up to the share rides along"
            budget = cfg.chunk_size - (n_dec if cfg.tile_align else 0)
            key_cost, spent, fresh = self.sched.key_cost if cfg.chunk_budget == "flops" else 0.0, 0.0, budget
            if cfg.chunk_budget == "flops" and cfg.step_costs and self.sched.depth > 1:
                key_cost, row, key = cfg.step_costs  # each decode costs its row and its keys (start + 1)
                spent = sum(row + key * (c.start + 1) for c in mb.chunks if not c.is_prefill)
                fresh = cfg.chunk_size  # the decodes are charged once: in spent, not also in tile_align's tokens
            expected = greedy_fill(self._offered(mb, pre), budget, cfg.max_batch_size - n_dec, key_cost, spent, fresh)
            assert mb.prefill_tokens == expected, "decode-maximal: prefill chunks fill the rest of the budget"
            if pre["offered"] and cfg.max_batch_size > 1:
                assert mb.prefill_tokens > 0

    def _offered(self, mb: MicroBatch, pre: dict) -> list[tuple[int, int]]:
        """pre's offers, a newcomer's from where it was found cached when its turn came: one this
        batch took from its chunk's start (the blocks of prompts taken before it count), one it did
        not take from what the cache holds now (all of this batch's prompt blocks)."""
        starts = {c.seq_id: c.start for c in mb.chunks}
        news = pre["newcomers"]
        bm = self.sched.blocks
        late = [starts[q] if q in starts else len(bm.cached_prefix(self._history(q))) * bm.block_size for q in news]
        return pre["offered"][:len(pre["offered"]) - len(news)] + \
            [(st, self.reqs[q].num_tokens - st) for q, st in zip(news, late)]

    def _check_whole_prompts(self, mb: MicroBatch) -> None:
        for c in mb.chunks:
            if c.is_prefill:
                req = self.reqs[c.seq_id]
                assert c.context_len == req.prefill_len and c.start % self.sched.blocks.block_size == 0, \
                    "prompt was chunked"
                assert c.sample is not None

    def _check_orca(self, mb: MicroBatch, pre: dict) -> None:
        self._check_whole_prompts(mb)
        assert mb.decode_tokens <= self.cfg.max_batch_size
        if self.ample_kv:
            assert mb.decode_tokens == min(len(pre["ready"]), self.cfg.max_batch_size)
            slots = self.cfg.max_batch_size - mb.decode_tokens
            assert len(mb.chunks) - mb.decode_tokens == min(slots, len(pre["offered"]))

    def _check_unmixed(self, mb: MicroBatch) -> None:
        assert mb.prefill_tokens == 0 or mb.decode_tokens == 0, "prefill and decode mixed"
        self._check_whole_prompts(mb)

    def _check_prefill_first(self, mb: MicroBatch, pre: dict) -> None:
        self._check_unmixed(mb)
        if self.ample_kv and pre["offered"]:
            assert mb.prefill_tokens > 0, "prefill_first runs a prompt whenever one can start"
        prefills = [c for c in mb.chunks if c.is_prefill]
        if len(prefills) > 1:  # chunk_size caps a prefill-only batch; a lone longer prompt still runs
            assert mb.prefill_tokens <= self.cfg.chunk_size

    def _check_request_level(self, mb: MicroBatch, pre: dict) -> None:
        self._check_unmixed(mb)
        new = {c.seq_id for c in mb.chunks} - self.seen
        if new:
            assert not pre["unfinished_seen"], \
                f"admitted {sorted(new)} while {sorted(pre['unfinished_seen'])} of the last batch are unfinished"

    def _check_blocks(self) -> None:
        bm = self.sched.blocks
        owned = [b for q in self.reqs for b in bm.block_table(q)]
        shared = {b for b in owned if owned.count(b) > 1}
        # only cached blocks are shared (no sequence writes into one: _execute's reads would see it)
        assert not shared if not bm.prefix_caching else shared <= set(bm._key_of), "a KV block has two owners"
        assert bm.num_free + len(set(owned)) == bm.num_blocks
        for r in self.reqs.values():
            if r in self.sched.running:
                assert bm.num_tokens(r.seq_id) == r.num_scheduled
            else:
                assert bm.block_table(r.seq_id) == [], f"{r.request_id} holds blocks while not running"
        assert len(self.sched.running) <= self.cfg.running_cap
        if self.cfg.kv_admission == "reserve":  # what the running may still allocate is free: none preempted
            ahead = sum(blocks_for(len(r.prompt_token_ids) + r.params.max_tokens - 1, bm.block_size)
                        - len(bm.block_table(r.seq_id)) for r in self.sched.running)
            assert ahead <= bm.num_free and not any(r.num_preemptions for r in self.reqs.values())
        # Whatever is in flight is still running: preemption only takes requests not in flight.
        running = {r.seq_id for r in self.sched.running}
        assert all(c.seq_id in running for m in self.in_flight for c in m.chunks), "an in-flight request was preempted"
        # Every workload here arrives at once, in seq_id order: newcomers start in arrival order (fcfs)
        # or by max_tokens, most first, ties in arrival order (longest_first); a preempted request
        # goes back to the head of the queue, ahead of every newcomer.
        def order(r: Request) -> tuple[int, int]:
            return (0 if self.cfg.admission == "fcfs" else -r.params.max_tokens, r.seq_id)
        fresh = [order(r) for r in self.sched.waiting if not r.num_preemptions]
        started = [order(r) for r in self.sched.running]
        assert fresh == sorted(fresh) and (not fresh or not started or max(started) < fresh[0])
        assert list(self.sched.waiting)[len(self.sched.waiting) - len(fresh):] == \
            [r for r in self.sched.waiting if not r.num_preemptions], "a preempted request queued behind a newcomer"


def greedy_fill(offered: list[tuple[int, int]], budget: int, slots: int, key_cost: float = 0.0,
                spent: float = 0.0, fresh: int | None = None) -> int:
    """Prefill tokens sarathi should take: FCFS, each candidate (start, tokens left) up to the
    token budget left and, with key_cost, the cost left: a token at position p costs 1 + key_cost
    · (p + 1), and the cost budget is a fresh chunk's, positions 0 .. fresh − 1 (default: budget),
    less what the decodes spent (step_costs), but at least one fresh token's. Token by token,
    independently of the scheduler's closed form; the first chunk takes at least one token."""
    fresh = budget if fresh is None else fresh
    cost = max(sum(1 + key_cost * (p + 1) for p in range(fresh)) - spent, 1 + key_cost)
    taken = 0
    for start, n in offered[:max(0, slots)]:
        if budget <= 0 or cost <= 0:
            break
        take = 0
        while take < min(n, budget) and fits(1 + key_cost * (start + take + 1), cost):
            cost -= 1 + key_cost * (start + take + 1)
            take += 1
        if take == 0 and taken:
            break
        if take == 0:  # a chunk takes at least one token
            take, cost = 1, cost - (1 + key_cost * (start + 1))
        taken, budget = taken + take, budget - take
    return taken


# ---- workload helpers -------------------------------------------------------------------------
def make_requests(lengths: list[int], max_tokens: int | list[int], seed: int = 0, ignore_eos: bool = True,
                  stop: tuple[int, ...] = (), shared: int = 0) -> list[Request]:
    """shared: the prompts' first ``shared`` tokens are the same (a system prompt)."""
    mts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(lengths)
    out = []
    for i, (n, mt) in enumerate(zip(lengths, mts)):
        prompt = [1 + (seed * 7919 + (0 if j < shared else i * 131) + j * 17) % (VOCAB - 1) for j in range(n)]
        out.append(Request(f"r{i}", i, prompt, SamplingParams(max_tokens=mt, ignore_eos=ignore_eos,
                                                              stop_token_ids=stop)))
    return out


def make_scheduler(policy: str, chunk: int, mbs: int, num_blocks: int = HUGE_KV, block_size: int = 4,
                   tile_align: bool = False, max_model_len: int = 4096, depth: int = 1,
                   key_cost: float | tuple[float, ...] = 0.0, admission: str = "fcfs",
                   prefix_caching: bool = False, kv_admission: str = "optimistic") -> Scheduler:
    """key_cost: the model's, or a tuple: measured step_costs (beside the model's KEY_COST).
    kv_admission: optimistic here (the tests below force preemptions), reserve where they ask."""
    costs = key_cost if isinstance(key_cost, tuple) else ()
    cfg = SchedulerConfig(policy, chunk, mbs, tile_align, max_model_len, admission=admission, step_costs=costs,
                          kv_admission=kv_admission)
    return Scheduler(cfg, BlockManager(num_blocks, block_size, prefix_caching), eos_token_ids=(EOS,), depth=depth,
                     key_cost=KEY_COST if costs else key_cost)


def run_workload(policy: str, pp: int, chunk: int, reqs: list[Request], mbs: int = 4, **kw: object) -> FakePipeline:
    """As LLM wires it: the scheduler's depth is the number of micro-batches the loop keeps in flight."""
    pipe = FakePipeline(make_scheduler(policy, chunk, mbs, depth=pp, **kw), pp, ample_kv=kw.get("num_blocks") is None)
    pipe.add(reqs)
    pipe.run()
    return pipe


def assert_matches_oracle(pipe: FakePipeline) -> None:
    for r in pipe.reqs.values():
        if r.finish_reason == "error":
            continue
        tokens, reason = oracle(r.prompt_token_ids, r.params)
        assert (r.output_token_ids, r.finish_reason) == (tokens, reason), r.request_id
        assert r.error is None
    runnable = [q for q, r in pipe.reqs.items() if r.finish_reason != "error"]
    assert sorted(pipe.reported) == sorted(runnable), "every request is reported finished exactly once"


LENGTHS = [5, 23, 1, 70, 12, 41, 3, 9]
# KEY_COST: sarathi's "flops" budget with a key weight large enough to bite at these lengths (a
# token at position 64 costs 2.3), and its cost floor (C = 1: no token fits, one is taken anyway)
KEY_COST = 0.02
# STEP_COSTS: measured costs (prompt key, decode row, decode key) that bite too: a decode at
# position 40 costs 2.5 tokens, so at C = 7 two decodes leave the chunk its one-token floor
STEP_COSTS = (0.01, 0.5, 0.05)
CASES = [(policy, pp, chunk, tile, kc)
         for policy in POLICIES for pp in (1, 2, 3) for chunk in (1, 7, 64)
         for tile in ((False, True) if policy == "sarathi" else (False,))
         for kc in ((0.0, KEY_COST, STEP_COSTS) if policy == "sarathi" else (0.0,))]


def case_mbs(chunk: int, tile: bool) -> int:
    return min(4, chunk) if tile else 4  # tile_align needs C ≥ max_batch_size


# ---- every policy: budgets, in-flight rules, completion, outputs -----------------------------
@pytest.mark.parametrize("policy, pp, chunk, tile, kc", CASES)
def test_all_finish_with_oracle_outputs_and_invariants(policy: str, pp: int, chunk: int, tile: bool,
                                                        kc: float | tuple[float, ...]) -> None:
    reqs = make_requests(LENGTHS, [1, 6, 12, 4, 9, 2, 7, 5])
    pipe = FakePipeline(make_scheduler(policy, chunk, case_mbs(chunk, tile), tile_align=tile, key_cost=kc), pp,
                        ample_kv=True)
    pipe.add(reqs)
    pipe.run()
    assert_matches_oracle(pipe)
    assert all(len(r.output_token_ids) == r.params.max_tokens and r.finish_reason == "length" for r in reqs)
    assert pipe.sched.blocks.num_free == pipe.sched.blocks.num_blocks
    assert not pipe.sched.running and not pipe.sched.waiting


@pytest.mark.parametrize("policy, pp, chunk, tile, kc", CASES)
def test_stops_at_eos_and_stop_ids(policy: str, pp: int, chunk: int, tile: bool,
                                   kc: float | tuple[float, ...]) -> None:
    # 16 prompts, 40 tokens each at most: some hit EOS or a stop id first, others run to the length
    # limit (asserted below), so both paths run.
    reqs = make_requests(LENGTHS * 2, 40, seed=3, ignore_eos=False, stop=(5, 11))
    pipe = FakePipeline(make_scheduler(policy, chunk, case_mbs(chunk, tile), tile_align=tile, key_cost=kc), pp)
    pipe.add(reqs)
    pipe.run()
    assert_matches_oracle(pipe)
    for r in reqs:
        if r.finish_reason == "stop":
            assert r.output_token_ids[-1] in (EOS, 5, 11)
            assert not {EOS, 5, 11} & set(r.output_token_ids[:-1])
        else:
            assert len(r.output_token_ids) == 40
    assert {r.finish_reason for r in reqs} == {"stop", "length"}


@pytest.mark.parametrize("admission", ADMISSIONS)
@pytest.mark.parametrize("policy, pp, chunk, tile, kc", CASES)
def test_preemption_under_tiny_kv_changes_no_output(policy: str, pp: int, chunk: int, tile: bool,
                                                    kc: float | tuple[float, ...], admission: str) -> None:
    lengths, max_tokens = [9, 14, 3, 20, 6, 11], [12, 8, 16, 5, 10, 9]
    big = run_workload(policy, pp, chunk, make_requests(lengths, max_tokens), mbs=case_mbs(chunk, tile),
                       tile_align=tile, key_cost=kc, admission=admission)
    # 7 blocks of 4 tokens: the largest request (20 + 5 tokens) just fits alone, a few together do not.
    small = run_workload(policy, pp, chunk, make_requests(lengths, max_tokens), mbs=case_mbs(chunk, tile),
                         tile_align=tile, num_blocks=7, key_cost=kc, admission=admission)
    assert_matches_oracle(small)
    assert [r.output_token_ids for r in small.reqs.values()] == [r.output_token_ids for r in big.reqs.values()]
    if case_mbs(chunk, tile) > 1:
        assert any(r.num_preemptions > 0 for r in small.reqs.values()), "the tiny budget should force preemption"
    assert all(r.num_preemptions == 0 for r in big.reqs.values())


@pytest.mark.parametrize("policy, pp, chunk, tile, kc", CASES)
def test_reserve_admission_under_tiny_kv_never_preempts(policy: str, pp: int, chunk: int, tile: bool,
                                                         kc: float | tuple[float, ...]) -> None:
    # The workload and 7 blocks that force preemption above; reserving each request's whole
    # length admits fewer at once and never preempts (checked on every plan), same outputs.
    lengths, max_tokens = [9, 14, 3, 20, 6, 11], [12, 8, 16, 5, 10, 9]
    pipe = run_workload(policy, pp, chunk, make_requests(lengths, max_tokens), mbs=case_mbs(chunk, tile),
                        tile_align=tile, num_blocks=7, key_cost=kc, kv_admission="reserve")
    assert_matches_oracle(pipe)
    assert all(r.num_preemptions == 0 and r.finish_reason == "length" for r in pipe.reqs.values())


@pytest.mark.parametrize("kv_admission, together", [("reserve", 5), ("optimistic", 6)])
def test_reserve_admission_runs_as_many_as_their_own_lengths_fit(kv_admission: str, together: int) -> None:
    # 16 blocks of 4: one request of max_model_len 64 fills them (the paper's B = 1), but five of
    # 8 + 4 tokens (3 blocks each, 15 in all) fit whole and start together, the sixth waits
    # (optimistic starts all six: their prompts, 2 blocks each, fit now).
    pipe = FakePipeline(make_scheduler("sarathi", 256, 8, num_blocks=16, max_model_len=64,
                                       kv_admission=kv_admission), 1)
    pipe.add(make_requests([8] * 6, 4))
    pipe.fill()
    assert len(pipe.sched.running) == together and len(pipe.sched.waiting) == 6 - together
    pipe.run()
    assert_matches_oracle(pipe)


def test_reserve_admission_waits_where_optimistic_admits_and_preempts() -> None:
    # Two requests of 4 + 12 tokens (4 blocks each) in 6 blocks: optimistic starts both (their
    # prompts fit) and preempts one as they grow; reserve runs them one after the other.
    runs = {kv: run_workload("sarathi", 1, 64, make_requests([4, 4], 12), num_blocks=6, kv_admission=kv)
            for kv in KV_ADMISSIONS}
    assert max(len(m.chunks) for m in runs["optimistic"].history) == 2
    assert sum(r.num_preemptions for r in runs["optimistic"].reqs.values()) > 0
    assert max(len(m.chunks) for m in runs["reserve"].history) == 1
    assert [r.output_token_ids for r in runs["reserve"].reqs.values()] == \
        [r.output_token_ids for r in runs["optimistic"].reqs.values()]


def test_reserve_admission_counts_shared_prefix_blocks_once() -> None:
    # 16 blocks of 4. Five prompts of one 12-token system prompt + 1 own token, 3 new tokens each:
    # 4 blocks a request (20 in all) if each held its own, but the first one's 3 prefix blocks
    # are cached for the rest, so all five fit (3 shared + 5 own blocks) and start together.
    pipe = FakePipeline(make_scheduler("sarathi", 256, 8, num_blocks=16, prefix_caching=True,
                                       kv_admission="reserve"), 1)
    first = make_requests([13], 3, shared=12)
    pipe.add(first)
    pipe.run()
    rest = make_requests([13] * 5, 3, shared=12)
    for i, r in enumerate(rest):
        r.seq_id, r.request_id = 10 + i, f"s{i}"
    pipe.add(rest)
    pipe.fill()
    assert len(pipe.sched.running) == 5 and not pipe.sched.waiting
    assert all(r.num_cached_tokens == 12 for r in rest)
    pipe.run()
    assert_matches_oracle(pipe)


def test_reserve_keeps_a_slot_for_a_prompt_that_fits_by_its_cached_prefix() -> None:
    # 9 blocks of 4; prompts of 9 tokens sharing 8, 6 new tokens: 4 blocks each alone, 2 beside a
    # holder of the prefix. With r0 and r1 decoding, r2 fits only by its hit; sarathi must still
    # keep it a slot (max_batch_size 2: one decode and its chunk), not fill both with decodes.
    cfg = SchedulerConfig("sarathi", 64, 2, max_model_len=64, max_running=4, kv_admission="reserve")
    pipe = FakePipeline(Scheduler(cfg, BlockManager(9, 4, True), eos_token_ids=(EOS,)), 1)
    pipe.add(make_requests([9, 9, 9], 6, shared=8))
    pipe.fill()
    assert [c.seq_id for c in pipe.in_flight[0].chunks] == [0, 1]
    pipe.run_oldest()
    pipe.fill()
    assert any(c.is_prefill and c.seq_id == 2 for c in pipe.in_flight[0].chunks)
    pipe.run()
    assert_matches_oracle(pipe)


def test_reserve_counts_the_kv_a_request_writes_not_its_last_token() -> None:
    # 4 blocks of 4; two requests of 4 + 5 tokens: the last sampled token ends each before any
    # step writes its K/V, so each writes 8 (2 blocks) and both fit whole at once, as under
    # optimistic, where they run together without a preemption.
    runs = {kv: FakePipeline(make_scheduler("sarathi", 64, 4, num_blocks=4, kv_admission=kv), 1)
            for kv in KV_ADMISSIONS}
    for pipe in runs.values():
        pipe.add(make_requests([4, 4], 5))
        pipe.fill()
        assert len(pipe.sched.running) == 2
        pipe.run()
        assert_matches_oracle(pipe)
        assert not any(r.num_preemptions for r in pipe.reqs.values())


def test_a_request_whose_kv_fills_the_cache_exactly_is_accepted() -> None:
    # 2 blocks of 4 hold 8 tokens' K/V: 4 + 5 and 8 + 1 write 8, 8 + 2 writes 9
    pipe = FakePipeline(make_scheduler("sarathi", 64, 4, num_blocks=2), 1)
    reqs = make_requests([4, 8, 8], [5, 1, 2])
    pipe.add(reqs)
    pipe.run()
    assert [r.finish_reason for r in reqs] == ["length", "length", "error"]
    assert reqs[2].error == "request needs 3 KV blocks for 9 tokens' K/V but the KV cache has only 2 blocks"
    assert_matches_oracle(pipe)


@pytest.mark.parametrize("kv_admission", KV_ADMISSIONS)
def test_sarathi_keeps_no_slot_for_a_prompt_that_cannot_start(kv_admission: str) -> None:
    # 6 blocks of 4, 2 a micro-batch. r0 and r1 (5 + 4 tokens) hold 2 blocks each once decoding;
    # r2's 9-token prompt needs 3 of the 2 left, so it cannot start under either admission until
    # one finishes: both decodes ride in every micro-batch meanwhile, none waits for an empty slot.
    cfg = SchedulerConfig("sarathi", 64, 2, max_model_len=64, max_running=3, kv_admission=kv_admission)
    pipe = FakePipeline(Scheduler(cfg, BlockManager(6, 4), eos_token_ids=(EOS,)), 1)
    pipe.add(make_requests([5, 5, 9], [4, 4, 1]))
    pipe.run()
    before_r2 = [m for m in pipe.history if all(c.seq_id != 2 for c in m.chunks)]
    assert [len(m.chunks) for m in before_r2] == [2] * 4
    assert_matches_oracle(pipe)


def test_bad_kv_admission_is_named() -> None:
    with pytest.raises(ValueError, match="SchedulerConfig.kv_admission must be one of reserve, optimistic, got 'eager'"):
        SchedulerConfig(kv_admission="eager")


# ---- pipelining: what may and may not be in flight together -----------------------------------
def test_consecutive_prefill_chunks_of_one_prompt_fly_together() -> None:
    pipe = run_workload("sarathi", 2, 7, make_requests([50], 3))
    both = [s for s in pipe.in_flight_sets if len(s) == 2 and
            all(c.seq_id == 0 and c.is_prefill for m in s for c in m.chunks)]
    assert both, "a long prompt should fill both stages with its own chunks"
    first, second = both[0]
    assert second.chunks[0].start == first.chunks[0].context_len
    assert_matches_oracle(pipe)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("pp", (2, 3))
def test_a_decoding_request_is_never_in_two_in_flight_batches(policy: str, pp: int) -> None:
    pipe = run_workload(policy, pp, 7, make_requests([3, 4, 2], 20))
    for group in pipe.in_flight_sets:
        decodes = [c.seq_id for m in group for c in m.chunks if not c.is_prefill]
        everything = [c.seq_id for m in group for c in m.chunks]
        for q in decodes:
            assert everything.count(q) == 1
    assert_matches_oracle(pipe)


# ---- policy-specific shapes -------------------------------------------------------------------
def test_sarathi_decode_maximal_batches() -> None:
    reqs = make_requests([30, 30, 30, 30, 30, 30, 30, 30], 12)
    pipe = FakePipeline(make_scheduler("sarathi", 16, 5), 1, ample_kv=True)
    pipe.add(reqs)
    pipe.run()
    assert_matches_oracle(pipe)
    hybrid = [m for m in pipe.history if m.prefill_tokens and m.decode_tokens]
    assert any(m.decode_tokens == 4 and m.prefill_tokens == 16 for m in hybrid), "4 decodes + a full chunk"


def test_sarathi_tile_align_batches_are_exactly_c_tokens() -> None:
    pipe = FakePipeline(make_scheduler("sarathi", 16, 5, tile_align=True), 1, ample_kv=True)
    pipe.add(make_requests([40] * 6, 10))
    pipe.run()
    assert_matches_oracle(pipe)
    hybrid = [m for m in pipe.history if m.prefill_tokens and m.decode_tokens]
    assert hybrid and all(m.num_tokens <= 16 for m in pipe.history)
    assert any(m.decode_tokens == 4 and m.num_tokens == 16 for m in hybrid)


def test_sarathi_batch_size_one_still_decodes() -> None:
    pipe = run_workload("sarathi", 2, 7, make_requests([10, 5], 4), mbs=1)
    assert all(len(m.chunks) == 1 for m in pipe.history)
    assert_matches_oracle(pipe)


def test_orca_never_chunks_and_mixes_decodes_with_whole_prompts() -> None:
    pipe = run_workload("orca", 1, 7, make_requests([30, 25, 40, 3], [2, 6, 6, 6]), mbs=3)
    assert_matches_oracle(pipe)
    assert any(m.prefill_tokens > 7 for m in pipe.history), "orca ignores the chunk size"
    assert any(m.prefill_tokens and m.decode_tokens for m in pipe.history), "orca piggybacks decodes"


def test_prefill_first_never_mixes() -> None:
    pipe = run_workload("prefill_first", 2, 64, make_requests(LENGTHS, 6))
    assert_matches_oracle(pipe)
    assert all(not (m.prefill_tokens and m.decode_tokens) for m in pipe.history)
    assert any(m.prefill_tokens for m in pipe.history) and any(m.decode_tokens for m in pipe.history)


def test_prefill_first_caps_prefill_batches_at_chunk_size() -> None:
    # chunk_size is the token cap of prefill-only batches (SchedulerConfig docstring); a prompt
    # longer than the cap still runs, alone.
    pipe = run_workload("prefill_first", 1, 20, make_requests([8, 8, 8, 30, 4], 3))
    assert_matches_oracle(pipe)
    prefill_batches = [m for m in pipe.history if m.prefill_tokens]
    assert [m.prefill_tokens for m in prefill_batches] == [16, 8, 30, 4]


def test_request_level_static_batches() -> None:
    pipe = run_workload("request_level", 2, 7, make_requests([5, 9, 3, 7, 4, 6, 2], [3, 9, 2, 4, 8, 1, 5]), mbs=3)
    assert_matches_oracle(pipe)
    # Admissions come in waves of max_batch_size, each after the previous wave finished.
    first_seen: dict[int, int] = {}
    for i, m in enumerate(pipe.history):
        for c in m.chunks:
            first_seen.setdefault(c.seq_id, i)
    waves = sorted(set(first_seen.values()))
    assert [sorted(q for q, i in first_seen.items() if i == w) for w in waves] == [[0, 1, 2], [3, 4, 5], [6]]


def test_request_level_preempted_member_rejoins_before_newcomers() -> None:
    # A tight cache forces preemption inside a static batch; newcomers still wait for the whole
    # batch (the preempted member included) to finish. FakePipeline checks that on every plan.
    pipe = run_workload("request_level", 1, 64, make_requests([6, 6, 6, 6, 6, 6], 14), mbs=3, num_blocks=12)
    assert_matches_oracle(pipe)
    assert any(r.num_preemptions for r in pipe.reqs.values())


# ---- bad requests -----------------------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
def test_impossible_requests_fail_with_a_message_others_complete(policy: str) -> None:
    reqs = make_requests([10, 60, 5, 8, 30], [5, 10, 50, 4, 3])
    reqs.append(Request("empty", 5, [], SamplingParams(max_tokens=3)))
    # max_model_len 64: r1 (70 tokens) is too long; 12 blocks × 4 = 48 tokens: r2 (55) cannot fit.
    sched = make_scheduler(policy, 7, 3, num_blocks=12, max_model_len=64)
    pipe = FakePipeline(sched, 2)
    pipe.add(reqs)
    assert reqs[1].finish_reason == "error" and "exceeds the model's max length 64" in reqs[1].error
    assert "70" in reqs[1].error
    assert reqs[2].finish_reason == "error" and "14 KV blocks" in reqs[2].error and "only 12 blocks" in reqs[2].error
    assert reqs[5].finish_reason == "error" and "empty prompt" in reqs[5].error
    pipe.run()
    assert_matches_oracle(pipe)
    assert [r.finish_reason for r in reqs] == ["length", "error", "error", "length", "length", "error"]
    assert all(r.output_token_ids == [] for r in reqs if r.finish_reason == "error")


# ---- abort ------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
def test_abort_waiting_request(policy: str) -> None:
    reqs = make_requests([5, 6, 7], 4)
    pipe = FakePipeline(make_scheduler(policy, 64, 1), 1)
    pipe.add(reqs)
    assert pipe.sched.abort(2) is reqs[2]
    assert reqs[2].finish_reason == "cancelled" and reqs[2].error == "request aborted"
    assert pipe.sched.abort(2) is None  # already gone
    pipe.run()
    assert [r.finish_reason for r in reqs] == ["length", "length", "cancelled"]
    assert all(2 not in (c.seq_id for c in m.chunks) for m in pipe.history)
    assert reqs[2].output_token_ids == []


@pytest.mark.parametrize("policy", POLICIES)
def test_abort_in_flight_decoding_request(policy: str) -> None:
    reqs = make_requests([5, 6], 10)
    pipe = FakePipeline(make_scheduler(policy, 64, 4), 2)
    pipe.add(reqs)
    while True:
        pipe.fill()
        if reqs[0].output_token_ids and reqs[0].is_decoding and reqs[0].in_flight:
            break
        pipe.run_oldest()
    produced = list(reqs[0].output_token_ids)
    assert pipe.sched.abort(0) is None  # finished when its micro-batch returns
    assert not reqs[0].finished
    done = []
    while reqs[0].in_flight:
        done += pipe.run_oldest()
    assert reqs[0] in done and reqs[0].finish_reason == "cancelled"
    assert reqs[0].output_token_ids == produced, "no token is appended after an abort"
    pipe.run()
    assert reqs[1].finish_reason == "length" and len(reqs[1].output_token_ids) == 10
    assert pipe.sched.blocks.num_free == pipe.sched.blocks.num_blocks


def test_abort_in_flight_prefill_schedules_no_further_chunks() -> None:
    reqs = make_requests([60, 4], 5)
    pipe = FakePipeline(make_scheduler("sarathi", 7, 4), 2)
    pipe.add(reqs)
    pipe.fill()
    assert reqs[0].in_flight == 2 and reqs[0].is_prefilling
    issued = len(pipe.history)
    assert pipe.sched.abort(0) is None
    pipe.run()
    assert reqs[0].finish_reason == "cancelled" and reqs[0].output_token_ids == []
    assert all(0 not in (c.seq_id for c in m.chunks) for m in pipe.history[issued:]), \
        "an aborted prompt must not get more chunks"
    assert reqs[1].finish_reason == "length"
    assert pipe.sched.blocks.num_free == pipe.sched.blocks.num_blocks


# ---- property: random workloads ---------------------------------------------------------------
@st.composite
def workloads(draw: st.DrawFn) -> dict:
    policy = draw(st.sampled_from(POLICIES))
    chunk = draw(st.sampled_from((1, 2, 7, 16, 64)))
    tile = policy == "sarathi" and draw(st.booleans())
    mbs = draw(st.integers(1, min(6, chunk) if tile else 6))
    block_size = draw(st.integers(1, 8))
    n = draw(st.integers(1, 8))
    lengths = draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
    max_tokens = draw(st.lists(st.integers(1, 12), min_size=n, max_size=n))
    need = max(blocks_for(p + m - 1, block_size) for p, m in zip(lengths, max_tokens))  # the last token writes no K/V
    # From "some requests can never fit" through "just enough for the largest" to "never short".
    num_blocks = draw(st.one_of(st.integers(1, need + 4), st.integers(need, need + 4),
                                st.integers(need, 4 * need), st.just(HUGE_KV)))
    return dict(policy=policy, pp=draw(st.integers(1, 3)), chunk=chunk, tile=tile, mbs=mbs,
                admission=draw(st.sampled_from(ADMISSIONS)), kv_admission=draw(st.sampled_from(KV_ADMISSIONS)),
                block_size=block_size, num_blocks=num_blocks, lengths=lengths, max_tokens=max_tokens,
                max_model_len=draw(st.one_of(st.just(4096), st.integers(8, 56))),
                ignore_eos=draw(st.booleans()), stop=tuple(draw(st.lists(st.integers(0, VOCAB - 1), max_size=2))),
                seed=draw(st.integers(0, 1000)), prefix_caching=draw(st.booleans()), shared=draw(st.integers(0, 40)))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads())
def test_random_workloads_complete_with_unconstrained_outputs(w: dict) -> None:
    def reqs() -> list[Request]:
        return make_requests(w["lengths"], w["max_tokens"], w["seed"], w["ignore_eos"], w["stop"], w["shared"])
    reference = run_workload("sarathi", 1, 4096, reqs(), mbs=64)
    pipe = FakePipeline(make_scheduler(w["policy"], w["chunk"], w["mbs"], w["num_blocks"], w["block_size"],
                                       w["tile"], w["max_model_len"], admission=w["admission"],
                                       prefix_caching=w["prefix_caching"], kv_admission=w["kv_admission"]), w["pp"],
                        ample_kv=w["num_blocks"] == HUGE_KV)
    pipe.add(reqs())
    pipe.run()
    assert_matches_oracle(pipe)
    for r, ref in zip(pipe.reqs.values(), reference.reqs.values()):
        total = len(r.prompt_token_ids) + r.params.max_tokens
        impossible = total > w["max_model_len"] or blocks_for(total - 1, w["block_size"]) > w["num_blocks"]
        if impossible:
            assert r.finish_reason == "error" and r.error and not r.output_token_ids
        else:
            assert (r.output_token_ids, r.finish_reason) == (ref.output_token_ids, ref.finish_reason)
    assert pipe.sched.blocks.num_free == pipe.sched.blocks.num_blocks
    assert not pipe.sched.running and not pipe.sched.waiting
    for r in pipe.reqs.values():  # what the first admission found of the prompt, whole blocks of it
        assert r.num_cached_tokens % w["block_size"] == 0 and r.num_cached_tokens < max(1, len(r.prompt_token_ids))
        assert w["prefix_caching"] or r.num_cached_tokens == 0


def test_sarathi_uses_every_slot_for_decodes_when_no_prefill_can_come() -> None:
    """With max_batch_size requests all decoding and nothing to admit, no slot is held back."""
    from pp_runtime.config import SchedulerConfig
    from pp_runtime.kv_cache import BlockManager
    from pp_runtime.request import Request, SamplingParams
    from pp_runtime.scheduler import Scheduler
    s = Scheduler(SchedulerConfig("sarathi", 64, 4, False, 256), BlockManager(64, 4))
    for i in range(4):
        s.add(Request(f"r{i}", i, [3, 4, 5], SamplingParams(max_tokens=8, ignore_eos=True)))
    first = s.schedule()
    s.postprocess(first, [7] * first.num_samples)
    assert first.prefill_tokens == 12
    second = s.schedule()
    assert second.decode_tokens == 4 and second.prefill_tokens == 0
    s.postprocess(second, [7] * 4)
    s.add(Request("late", 9, [3, 4], SamplingParams(max_tokens=2)))  # cannot be admitted: 4 running
    assert s.schedule().decode_tokens == 4


@pytest.mark.parametrize("pp, decoding, shares", [(1, 4, [4]), (2, 4, [2, 2]), (2, 5, [3, 2]), (3, 7, [3, 3, 1]),
                                                  (2, 1, [1])])
def test_sarathi_splits_decodes_evenly_over_the_micro_batches_in_flight(pp: int, decoding: int,
                                                                        shares: list[int]) -> None:
    """Uniform micro-batches: greedily the first batch took every ready decode and the rest of the
    pipeline got none (each stage idle while the other worked); now each in-flight batch carries
    an even share, and the shares keep rotating as batches come back."""
    pipe = FakePipeline(make_scheduler("sarathi", 64, 8, depth=pp), pp, ample_kv=True)
    pipe.add(make_requests([3] * decoding, 12))
    pipe.fill()
    while any(m.prefill_tokens for m in pipe.in_flight):  # the prompts (one batch) come back
        pipe.run_oldest()
        pipe.fill()
    for _ in range(3 * pp):
        assert sorted((m.decode_tokens for m in pipe.in_flight), reverse=True) == shares
        pipe.run_oldest()
        pipe.fill()
    pipe.run()
    assert_matches_oracle(pipe)


def test_scheduler_depth_must_be_positive() -> None:
    with pytest.raises(ValueError, match="depth"):
        make_scheduler("sarathi", 8, 4, depth=0)


# ---- sarathi's "flops" chunk budget ------------------------------------------------------------
def test_flops_budget_gives_deeper_chunks_fewer_tokens_of_equal_cost() -> None:
    pipe = run_workload("sarathi", 1, 64, make_requests([400], 2), key_cost=KEY_COST)
    chunks = [c for m in pipe.history for c in m.chunks if c.is_prefill]
    sizes = [c.num_tokens for c in chunks]
    assert sizes[0] == 64 and sizes[1] < 64 and all(a >= b for a, b in zip(sizes, sizes[1:-1])), sizes
    fresh = chunk_cost(0, 64, KEY_COST)
    for c in chunks[:-1]:  # each cut chunk spends the budget: one more token would not fit
        assert chunk_cost(c.start, c.num_tokens, KEY_COST) <= fresh < chunk_cost(c.start, c.num_tokens + 1, KEY_COST)
    assert_matches_oracle(pipe)


def test_tokens_budget_ignores_the_key_cost() -> None:
    cfg = SchedulerConfig("sarathi", 64, 4, chunk_budget="tokens")
    pipe = FakePipeline(Scheduler(cfg, BlockManager(HUGE_KV, 4), eos_token_ids=(EOS,), key_cost=KEY_COST), 1,
                        ample_kv=True)
    pipe.add(make_requests([400], 2))
    pipe.run()
    assert [c.num_tokens for m in pipe.history for c in m.chunks if c.is_prefill] == [64] * 6 + [16]
    assert_matches_oracle(pipe)


def test_flops_budget_still_caps_tokens_at_c() -> None:
    # short fresh prompts cost less per token than a fresh C-token chunk (5 × 3 tokens + 1 of the
    # sixth: 16.6 against 18.7), but C still caps the tokens
    pipe = run_workload("sarathi", 1, 16, make_requests([3] * 12, 1), mbs=12, key_cost=KEY_COST)
    first = pipe.history[0]
    assert first.prefill_tokens == 16 and chunk_cost(0, 3, KEY_COST) * 5 + chunk_cost(0, 1, KEY_COST) \
        < chunk_cost(0, 16, KEY_COST)
    assert max(m.prefill_tokens for m in pipe.history) == 16
    assert_matches_oracle(pipe)


def test_step_costs_make_the_chunk_pay_for_its_decodes_in_a_pipeline_only() -> None:
    # 8 long decodes (max_tokens 30) beside one long prompt: at pp = 2 with measured costs the
    # decodes' rows and keys come off the chunk's budget; at pp = 1 the costs change nothing
    def chunks(pp: int, kc: float | tuple[float, ...]) -> list[int]:
        pipe = run_workload("sarathi", pp, 64, make_requests([4] * 8 + [600], [30] * 8 + [1]), mbs=16, key_cost=kc)
        assert_matches_oracle(pipe)
        return [m.prefill_tokens for m in pipe.history if m.prefill_tokens]
    costs = (KEY_COST, 0.5, 0.05)  # the model's own key cost: only the decodes' charge differs
    assert chunks(1, costs) == chunks(1, KEY_COST)
    plain, measured = chunks(2, KEY_COST), chunks(2, costs)
    assert sum(plain) == sum(measured) == 8 * 4 + 600
    assert measured[0] == plain[0] == 64  # nothing decodes yet
    assert len(measured) > len(plain), (plain, measured)  # smaller chunks beside the decodes


def test_bad_step_costs_are_named() -> None:
    for bad in ((0.1, 0.2), (0.1, -0.2, 0.3), (0.1, float("inf"), 0.3), (True, 0.0, 0.0), ("1", 0, 0),
                (10 ** 400, 0, 0)):  # an int no float holds: a ValueError naming the field, not an OverflowError
        with pytest.raises(ValueError, match="SchedulerConfig.step_costs must be empty or 3 finite numbers"):
            SchedulerConfig("sarathi", 64, 4, step_costs=bad)
    assert SchedulerConfig("sarathi", 64, 4, step_costs=(0.0, 0, 1e-3)).step_costs == (0.0, 0, 1e-3)


def test_bad_chunk_budget_and_key_cost_are_named() -> None:
    with pytest.raises(ValueError, match="SchedulerConfig.chunk_budget must be one of flops, tokens"):
        SchedulerConfig("sarathi", 64, 4, chunk_budget="bytes")
    with pytest.raises(ValueError, match="key_cost must be ≥ 0"):
        Scheduler(SchedulerConfig(), BlockManager(8, 4), key_cost=-1.0)


def test_key_cost_from_model_shapes() -> None:
    from pp_runtime.config import ModelConfig
    from pp_runtime.sim.presets import SimModel
    smol = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                       num_kv_heads=3)
    # per layer: q, o 576²; k, v 576 × 192; gate, up, down 576 × 1536; 4 × 576 FLOPs per key
    assert smol.key_cost == pytest.approx(2 * 576 / (2 * 576**2 + 2 * 576 * 192 + 3 * 576 * 1536))
    plain = SimModel("gpt-like", 12, 768, 12, 12, 3072, 50257, gated_mlp=False)
    assert plain.key_cost == pytest.approx(2 * 768 / (4 * 768**2 + 2 * 768 * 3072))


# ---- admission order ----------------------------------------------------------------------------
def first_chunks(pipe: FakePipeline) -> list[int]:
    """seq ids in the order their first prefill chunk was scheduled."""
    order: list[int] = []
    for mb in pipe.history:
        order += [c.seq_id for c in mb.chunks if c.is_prefill and c.start == 0 and c.seq_id not in order]
    return order


@pytest.mark.parametrize("policy", POLICIES)
def test_longest_first_starts_the_most_max_tokens_first_ties_in_arrival_order(policy: str) -> None:
    max_tokens = [3, 9, 1, 9, 5, 12, 3]
    fcfs = run_workload(policy, 2, 8, make_requests([6] * 7, max_tokens), mbs=1)
    longest = run_workload(policy, 2, 8, make_requests([6] * 7, max_tokens), mbs=1, admission="longest_first")
    assert first_chunks(fcfs) == [0, 1, 2, 3, 4, 5, 6]
    assert first_chunks(longest) == [5, 1, 3, 4, 0, 6, 2]  # 12, 9, 9 (arrival order), 5, 3, 3, 1
    assert_matches_oracle(longest)  # the order changes when tokens come, not which
    assert [r.output_token_ids for r in longest.reqs.values()] == [r.output_token_ids for r in fcfs.reqs.values()]


def test_longest_first_keeps_a_preempted_request_at_the_head() -> None:
    sched = make_scheduler("sarathi", 64, 4, admission="longest_first")
    old, new, newer = make_requests([5, 5, 5], [2, 7, 4])
    sched.add(old)
    assert sched.schedule() is not None and sched.running == [old]
    sched._preempt(old)  # back to waiting, as when KV blocks ran out
    sched.add(new)
    sched.add(newer)
    assert list(sched.waiting) == [old, new, newer]  # old first though it has the fewest max_tokens


def test_bad_admission_is_named() -> None:
    with pytest.raises(ValueError, match="SchedulerConfig.admission must be one of fcfs, longest_first, got 'lifo'"):
        SchedulerConfig("sarathi", 64, 4, admission="lifo")
