"""Sampling every row of a batch at once, with one host read for the whole batch.

``sampler.sample`` reads each row's token back as soon as it has drawn it (a few small kernels and
a host read a row): on a CPU that costs nothing, but on a GPU every read waits for the device, so a
step of 64 sampled rows would wait 64 times. Here the rows are drawn together by the same rules
(temperature; top-k keeping the tokens tied with the kth; top-p keeping, likeliest first and ties
by id, each token while those before it hold less than top_p of the mass; vLLM's penalties and the
min_tokens ban), and the batch's tokens come back in one read. Top-p sorts its rows' weights:
cheap on a GPU, where the per-row sampler's rejection draws would each cost a read.

Each row's draw is one uniform number made on the host from the row's seed (``uniform``), so a
seeded request gets the same tokens however it is batched, and no device generator is seeded per
row. The draws differ from ``sampler.sample``'s for the same seed (another order of the same
distribution); the distribution is the same.

    .venv/bin/python -m stages.batched_sampler      # time it against the per-row sampler here
"""
from __future__ import annotations

import torch

from pp_runtime.batch import LogprobRow, SampleSpec
from stages.sampler import check_rows, edit_logits, int_tensor, is_greedy, logprob_row, to_device

_MASK64 = (1 << 64) - 1


def uniform(seed: int) -> float:
    """A number in [0, 1) made from ``seed`` alone: splitmix64's output function, top 53 bits."""
    z = (seed + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) * 2.0 ** -53


def sample_batched(logits: torch.Tensor, specs: list[SampleSpec]) -> list[int]:
    """logits (S, V), one spec per row -> S token ids; the device is read once."""
    check_rows(logits, specs)
    x = logits.float()  # (S, V); half-precision logits would make the weights coarse
    edited = [i for i, s in enumerate(specs) if s.edit is not None]
    if edited:
        x = x.clone() if x is logits else x
        for i in edited:
            x[i] = edit_logits(x[i], specs[i].edit)
    tokens = x.argmax(1)  # (S,) the greedy rows' ids
    rows = [i for i, s in enumerate(specs) if not is_greedy(s)]
    if rows:
        if len(rows) == len(specs):
            tokens = _draw_rows(x, specs)
        else:
            idx = int_tensor(rows, x.device)
            tokens.index_copy_(0, idx, _draw_rows(x.index_select(0, idx), [specs[i] for i in rows]))
    out = tokens.tolist()
    if -1 in out:  # NaN or inf logits (a model gone wrong): say so, as the per-row sampler does
        raise ValueError("sampling: the logits' weights sum to nan or inf; the logits hold NaN or inf")
    return out


def _draw_rows(x: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
    """One token id per row of x (R, V) float32, each row drawn under its spec (none greedy);
    -1 for a row whose weights are not a finite positive sum."""
    r, v = x.shape
    # (R, 3) per row: temperature, top_p, uniform; one host-to-device copy for them all
    params = to_device(torch.tensor([(s.temperature, s.top_p, uniform(s.seed)) for s in specs],
                                    dtype=torch.float64), x.device)
    ks = [s.top_k if 0 < s.top_k < v else 0 for s in specs]
    if any(ks):
        x = _cut_top_k(x, ks)
    # exp((x - max) / T): the maximum shifted to 0 keeps every weight ≤ 1; a small T sends the
    # others to 0 rather than overflowing (T ≥ SAMPLING_EPS for a sampled row)
    w = x.sub(x.amax(1, keepdim=True)).div_(params[:, :1].float()).exp_()  # (R, V)
    cut = [j for j, s in enumerate(specs) if s.top_p < 1.0]
    if cut:
        if len(cut) == r:
            w = _cut_top_p(w, params[:, 1])
        else:
            idx = int_tensor(cut, x.device)
            w.index_copy_(0, idx, _cut_top_p(w.index_select(0, idx), params[:, 1].index_select(0, idx)))
    cdf = w.cumsum(1, dtype=torch.float64)  # (R, V)
    total = cdf[:, -1]  # (R,)
    target = params[:, 2] * total
    j = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)  # first cdf past the target
    # u · total may round up to the total (j = V): then the last token that has weight
    last = (v - 1) - (w > 0).flip(1).to(torch.uint8).argmax(1)
    j = torch.minimum(j, last)
    bad = ~torch.isfinite(total) | (total <= 0)
    return torch.where(bad, -1, j)


def _cut_top_k(x: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """x (R, V) with every logit below its row's kth largest at -inf (k = 0: no cut); tokens tied
    with the kth stay, as vLLM keeps them."""
    k = int_tensor(ks, x.device)  # (R,)
    kth = torch.topk(x, max(ks), dim=1).values.gather(1, (k.clamp(min=1) - 1)[:, None])  # (R, 1)
    kth = torch.where(k[:, None] > 0, kth, float("-inf"))
    return x.masked_fill(x < kth, float("-inf"))


def _cut_top_p(w: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """w (C, V) with the weights outside each row's nucleus zeroed (p (C,) float64): ordered
    likeliest first, ties by id, a token stays while those before it hold less than p of the mass."""
    sw, order = torch.sort(w, dim=1, descending=True, stable=True)  # (C, V)
    csum = sw.cumsum(1, dtype=torch.float64)
    keep = (csum - sw) < p[:, None] * csum[:, -1:]  # the likeliest always stays: 0 < p · total
    return w.masked_fill(~torch.zeros_like(keep).scatter_(1, order, keep), 0.0)


def batched_logprobs(logits: torch.Tensor, tokens: list[int], ns: list[int]) -> list[LogprobRow]:
    """``sampler.token_logprobs`` of every row of logits (A, V) at once, row a's token tokens[a]
    and its n ns[a]; the device is read three times for the batch."""
    lp = logits.float().log_softmax(-1)  # (A, V)
    chosen = lp.gather(1, int_tensor(tokens, lp.device)[:, None])  # (A, 1)
    rank = (lp > chosen).sum(1) + 1  # (A,) 1: the likeliest
    top = max(ns)
    vals, ids = torch.topk(lp, top, dim=1) if top else (lp[:, :0], lp[:, :0].long())  # (A, top)
    chosen_l, rank_l, vals_l, ids_l = chosen.squeeze(1).tolist(), rank.tolist(), vals.tolist(), ids.tolist()
    return [logprob_row(t, c, r, ids_l[a][:n], vals_l[a][:n])
            for a, (t, n, c, r) in enumerate(zip(tokens, ns, chosen_l, rank_l))]


if __name__ == "__main__":
    import time

    from stages.sampler import sample_rows
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for rows in (1, 8, 32, 64):
        logits = (torch.randn(rows, 49152) * 3).to(device)
        for name, s in (("T 0.8", SampleSpec(0.8, 1.0, 0, 1)), ("T 0.8, top_p 0.95", SampleSpec(0.8, 0.95, 0, 1)),
                        ("T 0.8, top_k 50", SampleSpec(0.8, 1.0, 50, 1))):
            ms = {}
            for label, fn in (("per row", sample_rows), ("batched", sample_batched)):
                fn(logits, [s] * rows)
                t = time.perf_counter()
                for _ in range(5):
                    fn(logits, [s] * rows)
                ms[label] = (time.perf_counter() - t) / 5 * 1e3
            print(f"{device} {rows:3d} rows, {name:18s} per row {ms['per row']:7.2f} ms, batched {ms['batched']:7.2f} ms")
