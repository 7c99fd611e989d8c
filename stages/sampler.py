"""Token sampling on the last stage: greedy, temperature, top-k, top-p, per-token seeds.

Every sampled row draws from its own generator seeded by the plan (request seed mixed with
the token's position), so a seeded request gets the same tokens however it was batched.

A sampled row costs a few passes over its (V,) logits and no sort of the vocabulary: top-k
takes ``torch.topk``'s k tokens; top-p draws from the whole row and redraws from the tokens
likelier than a draw that fell outside the nucleus (``_draw_nucleus``); a draw is one uniform
number against cumulative weights, block by block (``_draw``). On a Zen 3 core pair, for
49152-token rows: ``torch.multinomial`` took 1.7 ms a row and a full sort 4.5 ms; 32 rows take
9 ms here at temperature 0.8 (72 ms before), 14 ms with top-p 0.95 (237 ms). On a GPU, where
each of those host reads would wait for the device, ``batched_sampler`` draws every row at once
(on this CPU it is 3-10x slower than this loop: its float64 scans and sorts run a row at a time).

    .venv/bin/python -m stages.sampler      # time a batch of sampled rows
"""
from __future__ import annotations

import array

import torch

from pp_runtime.batch import SAMPLING_EPS, LogitsEdit, LogprobRow, Sampled, SampleSpec


# Weights per block of ``_draw``'s first level: 48 blocks for a 49152-token vocabulary.
DRAW_BLOCK = 1024


def is_greedy(s: SampleSpec) -> bool:
    """Whether ``sample`` takes this row's argmax."""
    return not (s.temperature >= SAMPLING_EPS and s.top_k != 1)


def is_plain_greedy(s: SampleSpec) -> bool:
    """Whether the row's argmax of the unedited logits is all it needs (the argmax head's rows)."""
    return is_greedy(s) and s.logprobs < 0 and s.edit is None


def sample_hidden(model: torch.nn.Module, h: torch.Tensor, specs: list[SampleSpec]) -> Sampled:
    """The tokens of the sampled rows' hidden states h (S, H) (the last stage's model): greedy
    rows that want no logprobs by their argmax alone (``model.argmax_tokens``: the same ids, less
    work), the others by ``sample`` over their logits; with the logprobs rows asked for, as
    ``Sampled`` says. Every TP rank calls it with the same specs (the LM head gathers across
    them), so every rank makes the same calls in the same order."""
    head = [i for i, s in enumerate(specs) if is_plain_greedy(s)]
    if len(head) == len(specs):
        return model.argmax_tokens(h).tolist()
    full = [i for i, s in enumerate(specs) if not is_plain_greedy(s)]
    # the head's ids are read after the draws: on a GPU one wait for both
    head_ids = model.argmax_tokens(h.index_select(0, int_tensor(head, h.device))) if head else None
    logits = model.logits(h if not head else h.index_select(0, int_tensor(full, h.device)))  # (len(full), V)
    full_specs = [specs[i] for i in full]
    tokens = sample(logits, full_specs)
    out = [0] * len(specs)
    for i, tok in zip(full, tokens):
        out[i] = tok
    if head_ids is not None:
        for i, tok in zip(head, head_ids.tolist()):
            out[i] = tok
    if all(s.logprobs < 0 for s in specs):
        return out
    rows: list[LogprobRow | None] = [None] * len(specs)
    asked = [j for j, s in enumerate(full_specs) if s.logprobs >= 0]
    if logits.is_cuda:  # every asking row at once: a few host reads a batch, not a few a row
        from stages.batched_sampler import batched_logprobs
        got = batched_logprobs(logits.index_select(0, int_tensor(asked, logits.device)), [tokens[j] for j in asked],
                               [full_specs[j].logprobs for j in asked])
    else:
        got = [token_logprobs(logits[j], tokens[j], full_specs[j].logprobs) for j in asked]
    for j, row in zip(asked, got):
        rows[full[j]] = row
    return out, rows


def token_logprobs(logits: torch.Tensor, token: int, n: int) -> LogprobRow:
    """((id, logprob, rank), ...) of logits (V,): the sampled token first, then the n likeliest
    not already given, likeliest first. Log-probabilities of the raw logits, as vLLM reports them
    (not of the tempered or cut distribution the token was drawn from); rank 1 is the likeliest."""
    lp = logits.float().log_softmax(-1)  # (V,)
    vals, ids = torch.topk(lp, n) if n else (lp[:0], lp[:0].long())  # (n,)
    return logprob_row(token, float(lp[token]), int((lp > lp[token]).sum()) + 1, ids.tolist(), vals.tolist())


def logprob_row(token: int, logprob: float, rank: int, ids: list[int], vals: list[float]) -> LogprobRow:
    """One token's row as both logprob paths give it: the sampled token's (id, logprob, rank)
    first, then the likeliest (``ids``/``vals``, likeliest first) but the sampled one, ranked from 1."""
    return ((token, logprob, rank), *((i, v, r) for r, (i, v) in enumerate(zip(ids, vals), 1) if i != token))


def sample(logits: torch.Tensor, specs: list[SampleSpec]) -> list[int]:
    """logits (S, V), one spec per row -> S token ids. On a GPU every row at once
    (``batched_sampler``: one host read a batch, where this loop reads each row's token back)."""
    if logits.is_cuda:
        from stages.batched_sampler import sample_batched  # it builds on this module's rules
        return sample_batched(logits, specs)
    return sample_rows(logits, specs)


def sample_rows(logits: torch.Tensor, specs: list[SampleSpec]) -> list[int]:
    """``sample`` a row at a time, each row's token read back as it is drawn: the CPU's way."""
    check_rows(logits, specs)
    logits = logits.float()  # half-precision logits would make the weights below coarse
    out = []
    for i, s in enumerate(specs):
        row = logits[i] if s.edit is None else edit_logits(logits[i], s.edit)
        out.append(int(row.argmax()) if is_greedy(s) else _sample_row(row, s))
    return out


def check_rows(logits: torch.Tensor, specs: list[SampleSpec]) -> None:
    if logits.shape[0] != len(specs):
        raise ValueError(f"sample: {logits.shape[0]} logit rows but {len(specs)} sampling specs")


def edit_logits(x: torch.Tensor, e: LogitsEdit) -> torch.Tensor:
    """A copy of logits x (V,) with vLLM's penalties and the min_tokens ban applied."""
    x = x.clone()
    if e.repetition != 1 and e.context_ids:
        ids = int_tensor(e.context_ids, x.device)
        v = x[ids]
        x[ids] = v * torch.where(v > 0, 1 / e.repetition, e.repetition)
    if (e.presence or e.frequency) and e.output_ids:
        counts = to_device(torch.frombuffer(array.array("f", e.output_counts), dtype=torch.float32), x.device)
        x[int_tensor(e.output_ids, x.device)] -= e.frequency * counts + e.presence
    banned = [t for t in e.banned if t < x.numel()]  # a stop id past the vocabulary is never drawn anyway
    if banned:
        x[int_tensor(banned, x.device)] = float("-inf")
    return x


def int_tensor(values: tuple[int, ...] | list[int], device: torch.device) -> torch.Tensor:
    """Token ids as an int64 tensor, through an array's buffer: 7 µs for 160 ids here where
    ``torch.tensor`` takes 39 (a penalised row has three such lists a step)."""
    return to_device(torch.frombuffer(array.array("q", values), dtype=torch.int64), device)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor t on ``device``; to a GPU through pinned memory, without waiting: a plain
    ``.to("cuda")`` of pageable memory waits until the device has run all it was given first,
    so each small copy of a step's ids would cost a sync."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _sample_row(logits: torch.Tensor, s: SampleSpec) -> int:  # logits (V,) float32
    # Weights exp((logit - max) / T): shifting the maximum to 0 first keeps every weight ≤ 1, and a
    # small temperature sends the others to 0 rather than overflowing. float32 holds it: a sampled
    # row's temperature is ≥ SAMPLING_EPS, so the exponents are ≥ -(logit range) · 1e5.
    g = torch.Generator(device=logits.device).manual_seed(s.seed)
    if 0 < s.top_k < logits.numel():
        vals, ids = _top_k(logits, s.top_k)  # (k,) likeliest first: the weights of these alone
        w = vals.sub(vals[0]).div_(s.temperature).exp_()
        if s.top_p < 1.0:
            probs = w.double() / w.sum(dtype=torch.float64)
            w = w[: int(((probs.cumsum(0) - probs) < s.top_p).sum())]  # a prefix: the mass only grows
        return int(ids[_draw(w, g)])
    w = logits.sub(logits.max()).div_(s.temperature).exp_()  # (V,) unnormalised probabilities
    if s.top_p >= 1.0:
        return _draw(w, g)
    return _draw_nucleus(w, s.top_p, g)


def _draw(w: torch.Tensor, g: torch.Generator) -> int:
    """An index drawn with probability w[i] / sum(w) (w (n,) ≥ 0, not all 0): the first whose
    cumulative weight passes one uniform number times the total; a zero-weight index never does.
    In two levels, block then index, since a cumulative sum over the whole row is a sequential
    scan (76 µs for 49152 weights here) where block sums vectorise."""
    if w.numel() % DRAW_BLOCK:  # zero weights to whole blocks
        w = torch.nn.functional.pad(w, (0, -w.numel() % DRAW_BLOCK))
    blocks = w.view(-1, DRAW_BLOCK)  # (nb, DRAW_BLOCK)
    cdf = blocks.sum(1, dtype=torch.float64).cumsum(0)  # (nb,)
    total = float(cdf[-1])
    if not (0 < total < float("inf")):  # NaN or inf logits (a model gone wrong): say so, never loop
        raise ValueError(f"sampling: the logits' weights sum to {total}; the logits hold NaN or inf")
    target = float(torch.rand((), generator=g, dtype=torch.float64, device=w.device)) * total
    # u · total may round up to the total: then the last block that has weight.
    b = min(int(torch.searchsorted(cdf, target, right=True)), int((cdf < total).sum()))
    rem = target - (float(cdf[b - 1]) if b else 0.0)  # ≥ 0: the blocks before b hold ≤ target
    local = blocks[b].cumsum(0, dtype=torch.float64)  # (DRAW_BLOCK,)
    i = int(torch.searchsorted(local, rem, right=True))
    if i == DRAW_BLOCK or blocks[b, i] == 0:  # rem rounded past the block's own total
        i = int(blocks[b].nonzero()[-1])
    return b * DRAW_BLOCK + i


def _draw_nucleus(w: torch.Tensor, p: float, g: torch.Generator) -> int:
    """An index drawn from the nucleus of w (V,): order the tokens likeliest first (ties by id) and
    keep each while the tokens before it hold less than p of the mass (so the likeliest always
    stays); drawn with probability ∝ w inside it. Without sorting: draw from the whole row and
    accept the token if it is in the nucleus, else draw again from the tokens before it only.
    Every such set still holds the whole nucleus, so an accepted token has the nucleus's
    distribution, and a rejection (chance ≤ 1 - p) only shrinks the set."""
    total = float(w.sum(dtype=torch.float64))
    while True:
        j = _draw(w, g)
        wj = w[j]
        likelier = w > wj
        before = float(torch.where(likelier, w, 0).sum(dtype=torch.float64))
        ties = w[:j] == wj
        before += float(wj) * int(ties.sum())
        if before < p * total:
            return j
        w = torch.where(likelier, w, 0)
        w[:j] = torch.where(ties, wj, w[:j])


def _top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k likeliest tokens' (logits, ids) of x (V,), 0 < k < V, likeliest first; tokens tied
    with the kth are kept too, as vLLM keeps them."""
    vals, ids = torch.topk(x, k)
    if not bool(torch.isfinite(vals[0])):  # topk puts NaN first
        raise ValueError(f"sampling: the likeliest logit is {float(vals[0])}; the logits hold NaN or inf")
    if vals[-1] > float("-inf") and int((x == vals[-1]).sum()) > int((vals == vals[-1]).sum()):
        ids = (x >= vals[-1]).nonzero().squeeze(1)  # rare: more tokens tie with the kth
        vals, order = torch.sort(x[ids], descending=True, stable=True)
        ids = ids[order]
    return vals, ids


if __name__ == "__main__":
    import time
    torch.manual_seed(0)
    for rows in (1, 8, 32):
        logits = torch.randn(rows, 49152) * 3
        for name, s in (("T 0.8", SampleSpec(0.8, 1.0, 0, 1)), ("T 0.8, top_p 0.95", SampleSpec(0.8, 0.95, 0, 1)),
                        ("T 0.8, top_k 50", SampleSpec(0.8, 1.0, 50, 1))):
            sample(logits, [s] * rows)
            t = time.perf_counter()
            for _ in range(5):
                sample(logits, [s] * rows)
            print(f"{rows:3d} rows, {name:18s} {(time.perf_counter() - t) / 5 * 1e3:7.2f} ms")
