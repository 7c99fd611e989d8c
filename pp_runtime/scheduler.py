"""Micro-batch schedulers: one class, the policy is a parameter. Plain Python, no tensors.

Policies (SchedulerConfig.policy):
  sarathi        decode-maximal: ready decodes (≤ max_batch_size − 1, and an even share of the
                 decoding requests over the micro-batches in flight), then prefill chunks
                 filling the chunk budget C (C − decodes with tile_align: batches of exactly C);
                 with chunk_budget "flops" C counts FLOPs: a chunk costs at most what a fresh
                 C-token chunk does, so one deeper into its prompt takes fewer tokens.
  orca           iteration-level: ready decodes plus whole prompts, no chunking.
  prefill_first  vLLM classic: a prefill-only batch when a prompt can start, else decode-only; whole
                 prompts up to C tokens per batch (a lone longer prompt runs by itself).
  request_level  static batches: admit a batch, run it to completion, then admit the next.

Admission (SchedulerConfig.admission), for every policy: waiting requests start in arrival
order (fcfs) or most max_tokens first (longest_first), when their prompt fits the free KV blocks
(kv_admission "optimistic", the default) or when every running request's whole length fits
beside theirs ("reserve": never a preemption).

Invariants the property tests check: a decoding request is in at most one in-flight
micro-batch (its next input is the token the previous one samples); consecutive prefill
chunks of one prompt may be in flight together (stages run micro-batches in issue order).
When KV blocks run out the newest running request that is not in flight is preempted and
later recomputed from its tokens.
"""
from __future__ import annotations

import time
from bisect import bisect_right
from collections import deque
from typing import Callable, Sequence

from pp_runtime.batch import MicroBatch, Sampled, SampleSpec, SeqChunk, split_sampled
from pp_runtime.chunk_budget import chunk_cost, fit_chunk
from pp_runtime.config import SchedulerConfig
from pp_runtime.kv_cache import BlockManager, blocks_for
from pp_runtime.request import Logprob, Phase, Request

_SEED_MIX = 0x9E3779B97F4A7C15


def sample_seed(base: int, position: int) -> int:
    """Seed (62 bits) of the token sampled at ``position``: depends on nothing but the request and
    position, so a seeded request samples the same tokens however it was batched, chunked or
    preempted. Every 64 bits of the seed count (taking it mod 2^62 made seeds 2^62 apart draw
    the same tokens); seeds are in SamplingParams' SEED_RANGE, whose ends meet mod 2^64 as torch's do."""
    return _mix64((base * _SEED_MIX + position * 0x2545F4914F6CDD1D) % (1 << 64)) >> 2


def unseeded_base(engine_seed: int, seq_id: int) -> int:
    """A request without a seed samples from the engine's seed and its sequence id, scrambled
    so that it does not draw what a request seeded with a small number draws: seed 0 and the
    first unseeded request shared one stream before."""
    return _mix64((engine_seed * 1_000_003 + seq_id + _SEED_MIX) % (1 << 64))


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit ints that spreads every input bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 % (1 << 64)
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB % (1 << 64)
    return x ^ (x >> 31)


def _queue_key(req: Request) -> tuple[int, int]:
    """Where a request sorts in a longest_first queue: preempted ones (back at the head, in the order
    they went back) before every fresh one, fresh ones by max_tokens, most first. The queue stays
    sorted by this key, so a new request goes in by bisection, after its equals (FCFS among ties)."""
    return (0, 0) if req.num_preemptions else (1, -req.params.max_tokens)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager,
                 eos_token_ids: tuple[int, ...] = (), seed: int = 0, depth: int = 1,
                 key_cost: float = 0.0) -> None:
        """depth: micro-batches the engine keeps in flight (the pipeline's stages). key_cost: the
        model's (``HeadSizes.key_cost``), which sarathi's "flops" chunk budget charges per key a
        prompt token attends to; 0 (no model known): the budget counts tokens either way."""
        if depth < 1:
            raise ValueError(f"Scheduler depth must be ≥ 1, got {depth}")
        if not key_cost >= 0:
            raise ValueError(f"Scheduler key_cost must be ≥ 0, got {key_cost}")
        self.cfg = cfg
        self.depth = depth
        self.key_cost = key_cost
        self.blocks = blocks
        self.eos_token_ids = frozenset(eos_token_ids)
        self.seed = seed
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: oldest first, newest preempted first
        self._by_seq: dict[int, Request] = {}
        self._aborted: set[int] = set()
        self._next_mb = 0
        self._policy: Callable[[], list[tuple[Request, int]]] = {
            "sarathi": self._sarathi, "orca": self._orca,
            "prefill_first": self._prefill_first, "request_level": self._request_level,
        }[cfg.policy]

    # ---- requests in and out -------------------------------------------------------------
    def add(self, req: Request) -> bool:
        """Queue ``req``; a request that can never run is finished with an error instead."""
        error = self._check(req)
        if error:
            req.finish("error", error)
            return False
        self._by_seq[req.seq_id] = req
        if self.cfg.admission == "longest_first":
            self.waiting.insert(bisect_right(self.waiting, _queue_key(req), key=_queue_key), req)
        else:
            self.waiting.append(req)
        return True

    def _check(self, req: Request) -> str | None:
        if not req.prompt_token_ids:  # nothing to prefill: it would be scheduled as a 0-token chunk
            return "empty prompt: prompt_token_ids has no tokens"
        total = len(req.prompt_token_ids) + req.params.max_tokens
        if total > self.cfg.max_model_len:
            return (f"prompt length {len(req.prompt_token_ids)} + max_tokens {req.params.max_tokens} = "
                    f"{total} exceeds the model's max length {self.cfg.max_model_len}")
        need = self._whole_blocks(req)
        if need > self.blocks.num_blocks:
            return (f"request needs {need} KV blocks for {total - 1} tokens' K/V but the KV cache has only "
                    f"{self.blocks.num_blocks} blocks")
        return None

    def abort(self, seq_id: int) -> Request | None:
        """Cancel a request; one in flight is finished when its micro-batch returns."""
        req = self._by_seq.get(seq_id)
        if req is None or req.finished:
            return None
        if req.in_flight:
            self._aborted.add(seq_id)
            return None
        self._finish(req, "cancelled", "request aborted")
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- schedule ------------------------------------------------------------------------
    def schedule(self) -> MicroBatch | None:
        plan = self._policy()
        if not plan:
            return None
        chunks = [self._chunk(req, n) for req, n in plan]
        # Prefill chunks first, then decodes: attention treats the decodes as one batch.
        chunks.sort(key=lambda c: not c.is_prefill)
        mb = MicroBatch(self._next_mb, tuple(chunks),
                        tuple(self._by_seq[c.seq_id].request_id for c in chunks))
        self._next_mb += 1
        for c in chunks:  # a decode that fills its block (prompt chunks registered as planned)
            if not c.is_prefill:
                self.blocks.register(c.seq_id, self._by_seq[c.seq_id].tokens_slice, c.context_len)
        return mb

    def _chunk(self, req: Request, n: int) -> SeqChunk:
        start = req.num_scheduled
        is_prefill = req.is_prefilling
        req.num_scheduled += n
        req.in_flight += 1
        sample = None
        if req.num_scheduled == req.num_tokens:  # every known token is in: sample the next one
            p = req.params
            base = p.seed if p.seed is not None else unseeded_base(self.seed, req.seq_id)
            sample = SampleSpec(p.temperature, p.top_p, p.top_k, sample_seed(base, req.num_tokens),
                                -1 if p.logprobs is None else p.logprobs, req.logits_edit(self.eos_token_ids))
        return SeqChunk(req.seq_id, start, tuple(req.tokens_slice(start, start + n)),
                        tuple(self.blocks.block_table(req.seq_id)), is_prefill, sample)

    def _ready_decodes(self, limit: int) -> list[Request]:
        return [r for r in self.running if r.is_decoding and r.in_flight == 0][:max(limit, 0)]

    def _take_decodes(self, plan: list[tuple[Request, int]], limit: int) -> None:
        for req in self._ready_decodes(limit):
            if req.phase is Phase.RUNNING and self._reserve(req, 1, plan):
                plan.append((req, 1))

    def _take_prefills(self, plan: list[tuple[Request, int]], budget: int | None, chunked: bool,
                       admit: Callable[[Request], bool] = lambda req: True, key_cost: float = 0.0,
                       spent: float = 0.0, fresh: int | None = None) -> None:
        """Add prefill work in FCFS order. budget: most prompt tokens (None: no cap, whole prompts);
        with key_cost > 0 (chunked) the chunks' chunk_cost is also capped, at a fresh chunk of
        ``fresh`` tokens' (default: budget) less ``spent`` (the decodes' measured cost), never below
        one fresh token's (a prompt always moves). ``admit`` says which waiting requests may start now."""
        slots = self.cfg.max_batch_size - len(plan)
        fresh = budget if fresh is None else fresh
        cost = None if budget is None else max(chunk_cost(0, fresh, key_cost) - spent, chunk_cost(0, 1, key_cost))
        taken = False
        for req, was_running in self._prefill_candidates(admit):
            if slots <= 0 or (budget is not None and (budget <= 0 or cost <= 0)):
                return
            if was_running and req.phase is not Phase.RUNNING:
                continue  # preempted while this batch was being built
            running = req.phase is Phase.RUNNING
            if not running and len(self.running) >= self.cfg.running_cap:
                return
            # a waiting prompt (a preempted one too: recomputed) starts after its cached blocks
            hit = [] if running else self._hit(req)
            start = req.num_scheduled if running else len(hit) * self.blocks.block_size
            remaining = (req.prefill_len if running else req.num_tokens) - start
            n = remaining if not chunked or budget is None else fit_chunk(start, min(remaining, budget), cost, key_cost)
            if n == 0:
                if taken:
                    return  # what is left of the cost budget buys no token of this prompt
                n = 1  # a chunk takes at least one token: a prompt deep past the budget still moves
            if not chunked and budget is not None and n > budget and any(r.is_prefilling for r, _ in plan):
                return  # whole prompts only: the next one does not fit this batch
            if req.phase is Phase.WAITING:
                # Admit only what fits in free blocks now: a newcomer never preempts older work.
                if not self.blocks.can_admit(req.num_tokens, hit) or not self._reservable(req, hit):
                    return
                self.waiting.remove(req)
                req.admit(self.blocks.take_prefix(req.seq_id, hit))
                self.running.append(req)
            if not self._reserve(req, n, plan):
                return
            plan.append((req, n))
            # found by the prompts admitted after it, this batch's too: every layer writes the
            # batch's K/V before any attention reads the cache (kv_cache.py)
            self.blocks.register(req.seq_id, req.tokens_slice, start + n)
            slots -= 1
            taken = True
            if budget is not None:
                budget -= n
                cost -= chunk_cost(start, n, key_cost)

    def _prefill_candidates(self, admit: Callable[[Request], bool]) -> list[tuple[Request, bool]]:
        """Running prompts first (FCFS), then waiting ones; a snapshot, with where each came from."""
        # An aborted prompt gets no further chunks: it finishes once those in flight return.
        running = [(r, True) for r in self.running if r.is_prefilling and r.seq_id not in self._aborted]
        return running + [(r, False) for r in self.waiting if admit(r)]

    def _hit(self, req: Request) -> list[int]:
        """The cached blocks a waiting ``req`` would start on (none without prefix caching: then no
        copy of its tokens is made)."""
        return self.blocks.cached_prefix(req.tokens_slice(0, req.num_tokens)) if self.blocks.prefix_caching else []

    def _can_start(self, req: Request) -> bool:
        """Whether waiting ``req`` would be admitted now (_take_prefills' test), before this batch's
        decodes allocate: its prompt fits the unheld blocks, and under reserve its whole length."""
        hit = self._hit(req)
        return self.blocks.can_admit(req.num_tokens, hit) and self._reservable(req, hit)

    def _reservable(self, req: Request, hit: Sequence[int] | None = None) -> bool:
        """kv_admission "reserve": every block the running requests may still allocate (their whole
        length's less those they hold) and all ``req`` will take (its cached ``hit`` blocks that no
        one holds, and its whole length's less the hits) fit the unheld blocks now, so no block a
        running request asks for is ever missing. Blocks shared by prefix caching count once:
        after admission a sequence only allocates fresh blocks. ``hit``: ``_hit(req)``, looked up
        here when not given (only under reserve: optimistic needs no copy of the prompt)."""
        if self.cfg.kv_admission != "reserve":
            return True
        hit = self._hit(req) if hit is None else hit
        bm = self.blocks
        ahead = sum(self._whole_blocks(r) - len(bm.block_table(r.seq_id)) for r in self.running)
        return ahead + self._whole_blocks(req) - len(hit) + bm.num_unheld(hit) <= bm.num_free

    def _whole_blocks(self, req: Request) -> int:
        """Blocks for every K/V a request can write: its prompt and all its tokens but the last
        sampled one, which ends it before any step reads it back."""
        return blocks_for(len(req.prompt_token_ids) + req.params.max_tokens - 1, self.blocks.block_size)

    def _reserve(self, req: Request, n: int, plan: list[tuple[Request, int]]) -> bool:
        """Blocks for ``n`` more tokens of ``req``, preempting newer idle requests if needed."""
        planned = {r.seq_id for r, _ in plan}
        while not self.blocks.can_allocate(req.seq_id, n):
            newer = self.running[self.running.index(req) + 1:]
            victim = next((r for r in reversed(newer) if r.in_flight == 0 and r.seq_id not in planned), None)
            if victim is None:
                return False
            self._preempt(victim)
        self.blocks.allocate(req.seq_id, n)
        return True

    def _preempt(self, req: Request) -> None:
        self.blocks.free(req.seq_id)
        self.running.remove(req)
        req.preempt()
        self.waiting.appendleft(req)

    # ---- policies: each returns [(request, tokens to run)] ---------------------------------
    def _sarathi(self) -> list[tuple[Request, int]]:
        plan: list[tuple[Request, int]] = []
        # Leave one slot for a prefill chunk, but only when one could use it: with every running
        # request decoding and no room to admit, a reserved slot would just halve the decode rate.
        head = self.waiting[0] if self.waiting else None
        prefill_possible = any(r.is_prefilling for r in self.running) or (
            head is not None and len(self.running) < self.cfg.running_cap and self._can_start(head))
        limit = self.cfg.max_batch_size - 1 if prefill_possible else self.cfg.max_batch_size
        self._take_decodes(plan, min(max(1, limit), self._decode_share()))
        budget = self.cfg.chunk_size - (len(plan) if self.cfg.tile_align else 0)
        key_cost, spent, fresh = self.key_cost if self.cfg.chunk_budget == "flops" else 0.0, 0.0, None
        if self.cfg.chunk_budget == "flops" and self.cfg.step_costs and self.depth > 1:
            # equal measured cost per micro-batch (SchedulerConfig.step_costs): a decode costs its
            # row and the keys it reads (all its tokens so far), the chunk gets what is left of a
            # fresh C-token chunk's cost (tile_align's C − decodes caps its tokens, not that again)
            key_cost, row, key = self.cfg.step_costs
            spent, fresh = sum(row + key * req.num_tokens for req, _ in plan), self.cfg.chunk_size
        self._take_prefills(plan, budget, chunked=True, key_cost=key_cost, spent=spent, fresh=fresh)
        return plan

    def _decode_share(self) -> int:
        """Uniform micro-batches, as SARATHI builds them for pipelines: with ``depth`` in flight, each
        carries an even share of the decoding requests. Greedily, the first batch took every ready decode and the next
        found none ready (all in flight), so in a decode-heavy phase one stage idled while the other
        worked: measured at pp = 2, a 4-request decode ran at pp = 1's speed."""
        decoding = sum(1 for r in self.running if r.is_decoding)
        return -(-decoding // self.depth)

    def _orca(self) -> list[tuple[Request, int]]:
        plan: list[tuple[Request, int]] = []
        self._take_decodes(plan, self.cfg.max_batch_size)
        self._take_prefills(plan, None, chunked=False)
        return plan

    def _prefill_first(self) -> list[tuple[Request, int]]:
        plan: list[tuple[Request, int]] = []
        # chunk_size caps a prefill-only batch (vLLM's max_num_batched_tokens); whole prompts only,
        # so a lone prompt longer than the cap still runs, by itself.
        self._take_prefills(plan, self.cfg.chunk_size, chunked=False)
        if not plan:
            self._take_decodes(plan, self.cfg.max_batch_size)
        return plan

    def _request_level(self) -> list[tuple[Request, int]]:
        plan: list[tuple[Request, int]] = []
        # A new static batch starts only when the previous one has completely drained. A member
        # preempted mid-batch is still a member: it rejoins as soon as it fits, and no newcomer
        # may start beside it (waiting requests with preemptions all belong to the current batch).
        drained = not self.running and not any(r.num_preemptions for r in self.waiting)
        self._take_prefills(plan, None, chunked=False, admit=lambda req: drained or req.num_preemptions > 0)
        if not plan:
            self._take_decodes(plan, self.cfg.max_batch_size)
        return plan

    # ---- postprocess ---------------------------------------------------------------------
    def postprocess(self, mb: MicroBatch, sampled: Sampled) -> list[Request]:
        """Apply the sampled tokens of ``mb`` (one per sampled chunk, in order; with their logprobs
        where asked: ``Sampled``); return finished requests."""
        tokens, logprobs = split_sampled(sampled)
        if len(tokens) != mb.num_samples:
            raise RuntimeError(f"micro-batch {mb.mb_id}: expected {mb.num_samples} tokens, got {len(tokens)}")
        now = time.perf_counter()
        finished: list[Request] = []
        it = iter(zip(tokens, logprobs))
        for chunk in mb.chunks:
            req = self._by_seq[chunk.seq_id]
            req.in_flight -= 1
            token, lps = next(it) if chunk.sample is not None else (None, None)
            if req.finished:
                continue
            if chunk.seq_id in self._aborted and req.in_flight == 0:
                self._aborted.discard(chunk.seq_id)
                self._finish(req, "cancelled", "request aborted")
                finished.append(req)
                continue
            if token is None:
                continue
            req.output_token_ids.append(token)
            if lps is not None:
                req.output_logprobs.append({t: Logprob(lp, rank) for t, lp, rank in lps})
            req.token_times.append(now)
            if req.first_token_time is None:
                req.first_token_time = now
            reason = self._stop_reason(req, token)
            if reason:
                self._finish(req, reason)
                finished.append(req)
        return finished

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        # Within min_tokens nothing stops it (its stop ids were banned from the logits), and a stop
        # string completed there does not count, as in vLLM: the check only reads the text's new end.
        early = len(req.output_token_ids) <= p.min_tokens
        if not early and ((token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids):
            return "stop"
        if req.stop_check is not None and (req.stop_check(req, search=False) if early else req.stop_check(req)):
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.cfg.max_model_len:
            return "length"
        return None

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        self.blocks.free(req.seq_id)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.finish(reason, error)
        self._by_seq.pop(req.seq_id, None)
