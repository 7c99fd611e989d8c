"""The last stage's sampler on hand-made logits: greedy, temperature, top-k, top-p and seeds.
The tests of ``sample``'s rules run twice (``both``): a row at a time as on the CPU
(``sample_rows``), and every row at once as on a GPU (``batched_sampler``), here on CPU tensors."""
from __future__ import annotations

import math

import pytest
import torch

from pp_runtime.batch import LogitsEdit, SampleSpec
import stages.batched_sampler
from stages.sampler import edit_logits, sample, sample_hidden, sample_rows, token_logprobs

SEEDS = range(300)


@pytest.fixture(params=["rows", "batched"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """This module's ``sample`` as either implementation, whatever the tensors' device."""
    fn = sample_rows if request.param == "rows" else stages.batched_sampler.sample_batched
    monkeypatch.setitem(globals(), "sample", fn)
    return request.param


both = pytest.mark.usefixtures("impl")


def spec(temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0) -> SampleSpec:
    return SampleSpec(temperature, top_p, top_k, seed)


def draws(logits: torch.Tensor, **kw: object) -> list[int]:
    """One draw per seed, all in one call: rows are independent, each with its own generator."""
    rows = logits.expand(len(SEEDS), -1)
    return sample(rows, [spec(seed=s, **kw) for s in SEEDS])


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(50, generator=torch.Generator().manual_seed(1)) * 2


@both
def test_greedy_is_argmax(logits: torch.Tensor) -> None:
    batch = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    expected = batch.argmax(-1).tolist()
    assert sample(batch, [spec(temperature=0.0, seed=s) for s in range(6)]) == expected
    # top_k = 1 is greedy at any temperature
    assert sample(batch, [spec(temperature=5.0, top_k=1, seed=s) for s in range(6)]) == expected


@both
def test_tiny_temperature_tends_to_greedy(logits: torch.Tensor) -> None:
    # Also exercises the overflow guard: logits / 1e-4 would be ±inf without the shift to 0.
    for t in (1e-3, 1e-4):
        assert set(draws(logits, temperature=t)) == {int(logits.argmax())}


@both
def test_temperature_under_1e_5_is_greedy() -> None:
    """As in vLLM: an exact tie at the top goes to the first token, as greedy's argmax, not to a
    coin flip (which T = 1e-6 made of it)."""
    tie = torch.tensor([0.0, 3.0, 3.0, 1.0])
    for t in (1e-6, 1e-30, 5e-324):
        assert set(draws(tie, temperature=t)) == {1}
    assert set(draws(tie, temperature=1e-3)) == {1, 2}  # above it: sampled


@both
def test_seeds_reproducible_and_independent_of_batch(logits: torch.Tensor) -> None:
    first = draws(logits)
    assert draws(logits) == first
    assert len(set(first)) > 10  # different seeds really draw different tokens
    # A row's token depends on its own logits and seed only, not on its neighbours.
    other = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    for s in (0, 7, 123):
        mixed = torch.cat([other[:2], logits[None], other[2:]])
        specs = [spec(seed=1000), spec(seed=1001), spec(seed=s), spec(temperature=0.0, seed=5)]
        assert sample(mixed, specs)[2] == first[s]


@both
def test_top_k_keeps_only_k(logits: torch.Tensor) -> None:
    k = 5
    top = set(torch.topk(logits, k).indices.tolist())
    got = set(draws(logits, temperature=3.0, top_k=k))  # hot: without the cut, others would show up
    assert got <= top
    assert got == top  # 300 draws at temperature 3 see all five
    assert not set(draws(logits, temperature=3.0)) <= top  # the control: no cut, more tokens
    # k ≥ vocabulary size means no cut at all
    assert draws(logits, top_k=50) == draws(logits, top_k=0) == draws(logits, top_k=1000)


@both
def test_top_p_keeps_minimal_nucleus() -> None:
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
    logits = probs.log()
    # 0.5 < 0.7 ≤ 0.8: the nucleus is {1, 3}
    assert set(draws(logits, top_p=0.7)) == {1, 3}
    # 0.8 < 0.9 ≤ 0.95: {1, 3, 2}
    assert set(draws(logits, top_p=0.9)) == {1, 2, 3}
    # below the top token's own mass: the top token alone, never an empty set
    assert set(draws(logits, top_p=0.4)) == {1}
    assert set(draws(logits, top_p=1e-6)) == {1}
    assert set(draws(logits, top_p=1.0)) == {0, 1, 2, 3}


@both
def test_top_p_applies_to_tempered_distribution() -> None:
    logits = torch.tensor([0.05, 0.5, 0.15, 0.3]).log()
    # temperature 0.5 squares the probabilities: 0.25, 0.09, 0.0225, 0.0025 (÷ 0.365):
    # the top token holds 0.685 of the mass, so top_p 0.6 keeps it alone
    assert set(draws(logits, temperature=0.5, top_p=0.6)) == {1}
    assert set(draws(logits, temperature=1.0, top_p=0.6)) == {1, 3}


@both
def test_top_k_then_top_p(logits: torch.Tensor) -> None:
    top2 = set(torch.topk(logits, 2).indices.tolist())
    assert set(draws(logits, temperature=3.0, top_k=2, top_p=0.999)) == top2


@both
def test_frequencies_follow_softmax() -> None:
    # 300 draws from (0.7, 0.2, 0.1): each count within 4 standard deviations of its mean.
    probs = torch.tensor([0.7, 0.2, 0.1])
    got = draws(probs.log())
    n = len(got)
    for tok, p in enumerate(probs.tolist()):
        assert abs(got.count(tok) - n * p) < 4 * math.sqrt(n * p * (1 - p))


@both
def test_half_precision_logits_and_minus_inf(logits: torch.Tensor) -> None:
    x = logits.clone()
    x[10:] = float("-inf")  # e.g. a masked vocabulary tail
    assert set(draws(x.half(), temperature=2.0)) <= set(range(10))


@both
def test_rows_and_specs_must_match() -> None:
    with pytest.raises(ValueError, match="2 logit rows but 1 sampling specs"):
        sample(torch.zeros(2, 4), [spec()])


def counts_follow(got: list[int], probs: dict[int, float]) -> None:
    """Every draw is one of probs' tokens, each count within 4 standard deviations of its mean."""
    n = len(got)
    assert set(got) <= set(probs)
    for tok, p in probs.items():
        assert abs(got.count(tok) - n * p) < 4 * math.sqrt(n * p * (1 - p)) + 1, (tok, got.count(tok), n * p)


def many(logits: torch.Tensor, n: int = 2000, **kw: object) -> list[int]:
    return sample(logits.expand(n, -1), [spec(seed=s, **kw) for s in range(n)])


@both
def test_top_p_draws_in_proportion_inside_the_nucleus() -> None:
    # (0.4, 0.3, 0.2, 0.1), top_p 0.8: the mass before the last token is 0.9 ≥ 0.8, so the nucleus
    # is the first three, drawn 4 : 3 : 2 (the rejected draws of token 3 are drawn again).
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    counts_follow(many(logits, top_p=0.8), {0: 4 / 9, 1: 3 / 9, 2: 2 / 9})


@both
def test_top_p_orders_ties_by_token_id() -> None:
    """Four equal tokens: the mass before each is 0, 0.25, 0.5, 0.75, so top_p 0.5 keeps tokens 0
    and 1 (one draw in two is rejected and drawn again) and 0.6 keeps three."""
    flat = torch.zeros(4)
    counts_follow(many(flat, top_p=0.5), {0: 0.5, 1: 0.5})
    counts_follow(many(flat, top_p=0.6), {0: 1 / 3, 1: 1 / 3, 2: 1 / 3})
    # ties below a likelier token: (0.4, 0.2, 0.2, 0.2) at 0.7 keeps 0, 1, 2 (before 2: 0.6 < 0.7)
    counts_follow(many(torch.tensor([0.4, 0.2, 0.2, 0.2]).log(), top_p=0.7), {0: 0.5, 1: 0.25, 2: 0.25})


@both
def test_top_p_on_a_large_vocabulary_matches_the_sorted_nucleus() -> None:
    """Against the definition by a full sort, over a vocabulary of several draw blocks."""
    x = torch.randn(5000, generator=torch.Generator().manual_seed(4)) * 2
    probs, order = x.double().softmax(-1).sort(descending=True)
    nucleus = set(order[(probs.cumsum(0) - probs) < 0.3].tolist())
    assert 10 < len(nucleus) < 100
    got = set(many(x, n=1000, top_p=0.3))
    assert got <= nucleus and len(got) > len(nucleus) // 2
    assert not set(many(x, n=300)) <= nucleus  # the control: without the cut, others show up


@both
def test_draws_across_blocks_follow_the_weights() -> None:
    """The draw finds its block, then its token: mass in three blocks, one of them the last,
    partial one (3000 = 2 × 1024 + 952), in proportion and at the right ids."""
    x = torch.full((3000,), float("-inf"))
    x[[5, 1500, 2999]] = torch.tensor([0.5, 0.3, 0.2]).log()
    counts_follow(many(x), {5: 0.5, 1500: 0.3, 2999: 0.2})
    assert set(many(x, n=50, top_k=2)) == {5, 1500}


@both
def test_top_k_keeps_ties_with_the_kth() -> None:
    got = set(many(torch.tensor([3.0, 2.0, 2.0, 1.0, 2.0]), n=300, temperature=5.0, top_k=2))
    assert got == {0, 1, 2, 4}  # the three tied with the 2nd all stay, as in vLLM


@both
def test_nan_logits_fail_by_name() -> None:
    x = torch.zeros(8)
    x[3] = float("nan")
    for kw in ({}, {"top_p": 0.9}, {"top_k": 4}):
        with pytest.raises(ValueError, match="logits hold NaN or inf"):
            sample(x[None], [spec(**kw)])


@both
@pytest.mark.parametrize("cut", [{}, {"top_k": 3}, {"top_p": 0.99}, {"top_k": 3, "top_p": 0.99}])
def test_temperature_reshapes_the_draws(cut: dict) -> None:
    """T = 2 takes square roots of (0.5, 0.3, 0.2, 1e-12): each path (no cut, top-k, top-p, both)
    draws in proportion to the tempered weights (the fourth token is left out by every cut)."""
    w = torch.tensor([0.5, 0.3, 0.2, 1e-12]).sqrt()
    expect = {i: float(w[i] / w[:3].sum()) for i in range(3)}
    counts_follow(many(torch.tensor([0.5, 0.3, 0.2, 1e-12]).log(), temperature=2.0, **cut), expect)


def test_token_logprobs_are_the_raw_log_softmax() -> None:
    """The sampled token first with its rank, then the n likeliest not already given; of the raw
    logits, whatever temperature or cut the token was drawn under."""
    x = torch.tensor([1.0, 3.0, 2.0, 0.5, 2.5])
    lp = x.log_softmax(-1)
    assert token_logprobs(x, 2, 0) == ((2, pytest.approx(float(lp[2])), 3),)
    row = token_logprobs(x, 2, 3)  # the likeliest three are 1, 4, 2: token 2 is not repeated
    assert [(t, r) for t, _, r in row] == [(2, 3), (1, 1), (4, 2)]
    assert [v for _, v, _ in row] == pytest.approx([float(lp[2]), float(lp[1]), float(lp[4])])
    row = token_logprobs(x.half(), 0, 1)  # half logits: log-softmax in fp32
    assert [(t, r) for t, _, r in row] == [(0, 4), (1, 1)]
    assert row[0][1] == pytest.approx(float(lp[0]), abs=2e-3)


class TinyHead(torch.nn.Module):
    """A last stage's model for ``sample_hidden``: logits h W^T, argmax_tokens counting its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.randn(50, 8, generator=torch.Generator().manual_seed(5))
        self.argmax_rows: list[int] = []

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.w.T

    def argmax_tokens(self, h: torch.Tensor) -> torch.Tensor:
        self.argmax_rows.append(h.shape[0])
        return self.logits(h).argmax(-1)


def test_sample_hidden_takes_the_full_logits_only_for_rows_that_need_them() -> None:
    head = TinyHead()
    h = torch.randn(4, 8, generator=torch.Generator().manual_seed(6))
    logits = head.logits(h)
    greedy, drawn = spec(temperature=0.0), spec(temperature=1.0, seed=3)
    assert sample_hidden(head, h, [greedy] * 4) == logits.argmax(-1).tolist() and head.argmax_rows == [4]
    specs = [greedy, drawn, SampleSpec(0.0, 1.0, 0, 0, 2), SampleSpec(1.0, 1.0, 0, 9, 0)]
    tokens, rows = sample_hidden(head, h, specs)
    assert head.argmax_rows == [4, 1]  # only row 0 is greedy without logprobs
    assert tokens == sample(logits, specs)
    assert rows[0] is None and rows[1] is None
    for i, n in ((2, 2), (3, 0)):  # the rows' logits computed apart from the others: equal to rounding
        want = token_logprobs(logits[i], tokens[i], n)
        assert [(t, r) for t, _, r in rows[i]] == [(t, r) for t, _, r in want]
        assert [v for _, v, _ in rows[i]] == pytest.approx([v for _, v, _ in want], abs=1e-6)
    assert rows[2][0][2] == 1  # greedy: the sampled token is the likeliest


@both
def test_edit_logits_applies_vllms_penalties_then_the_ban() -> None:
    x = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    e = LogitsEdit(banned=(3, 99), presence=0.5, frequency=0.25, repetition=2.0, output_ids=(0, 1),
                   output_counts=(2, 1), context_ids=(0, 1, 4))
    # repetition: 2 / 2 = 1, -1 · 2 = -2, -2 · 2 = -4; then 1 - 0.25 · 2 - 0.5 = 0, -2 - 0.25 - 0.5 = -2.75;
    # 3 banned; 99 is past the vocabulary (a stop id the model never makes)
    assert edit_logits(x, e).tolist() == [0.0, -2.75, 0.5, float("-inf"), -4.0]
    assert x.tolist() == [2.0, -1.0, 0.5, 3.0, -2.0]  # a copy
    rows = x.expand(300, -1)
    # greedy: the argmax of the edited row; sampled: never a banned token, the rest as tempered
    assert sample(rows[:1], [SampleSpec(0.0, 1.0, 0, 0, -1, e)]) == [2]
    got = sample(rows, [SampleSpec(1.0, 1.0, 0, s, -1, LogitsEdit(banned=(3,))) for s in range(300)])
    assert 3 not in got and {0, 2} <= set(got)


def test_edited_rows_leave_the_argmax_head() -> None:
    head = TinyHead()
    h = torch.randn(3, 8, generator=torch.Generator().manual_seed(7))
    logits = head.logits(h)
    top = int(logits[1].argmax())
    specs = [spec(temperature=0.0), SampleSpec(0.0, 1.0, 0, 0, -1, LogitsEdit(banned=(top,))), spec(temperature=0.0)]
    tokens = sample_hidden(head, h, specs)
    assert head.argmax_rows == [2] and tokens[1] == int(logits[1].topk(2).indices[1]) != top


def test_uniform_of_a_seed_is_fixed_and_spread() -> None:
    """The batched sampler's one number a row: the same for a seed, in [0, 1), and spread evenly
    over neighbouring seeds (each tenth of [0, 1) within 4σ of its 1000 expected among 10000)."""
    from stages.batched_sampler import uniform
    us = [uniform(s) for s in range(10000)]
    assert us == [uniform(s) for s in range(10000)] and all(0.0 <= u < 1.0 for u in us)
    assert uniform(2 ** 63 + 5) != uniform(5) and 0 <= uniform(-1) < 1  # any int: wrapped to 64 bits
    for b in range(10):
        assert abs(sum(b / 10 <= u < (b + 1) / 10 for u in us) - 1000) < 4 * math.sqrt(1000 * 0.9)


def test_batched_mixed_rows_match_their_rules() -> None:
    """One batch of every kind of row: greedy rows (T 0, top_k 1, an edited one) take the argmax of
    their (edited) logits, and each sampled row's token is the one it draws alone."""
    from stages.batched_sampler import sample_batched
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(8)) * 2
    ban = int(x[2].argmax())
    specs = [spec(temperature=0.0), spec(temperature=0.9, top_p=0.8, seed=11),
             SampleSpec(0.0, 1.0, 0, 0, -1, LogitsEdit(banned=(ban,))), spec(temperature=2.0, top_k=1, seed=3),
             spec(temperature=1.3, top_k=4, seed=12), SampleSpec(1.0, 1.0, 0, 13, -1, LogitsEdit(banned=(ban,)))]
    got = sample_batched(x, specs)
    assert got[0] == int(x[0].argmax()) and got[3] == int(x[3].argmax())
    assert got[2] == int(x[2].topk(2).indices[1]) != ban
    for i in (1, 4, 5):
        assert got[i] == sample_batched(x[i:i + 1], specs[i:i + 1])[0]
    assert got[4] in set(x[4].topk(4).indices.tolist())


def test_batched_draws_at_the_ends_of_the_unit_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """u = 0 takes the first token with weight; u · total rounding up to the total takes the last
    token with weight, never an id past it (zero weights at both ends of the row)."""
    x = torch.full((2, 3000), float("-inf"))
    x[:, 7:12] = 0.0
    specs = [spec(seed=0), spec(seed=1, top_p=0.9)]
    for u, want in ((0.0, 7), (1.0, 11)):
        monkeypatch.setattr(stages.batched_sampler, "uniform", lambda seed, u=u: u)
        assert stages.batched_sampler.sample_batched(x, specs)[0] == want
    # top-p 0.9 of five equal tokens keeps all five (0.8 before the fifth): u = 1 takes the fifth
    assert stages.batched_sampler.sample_batched(x, specs)[1] == 11


def test_batched_logprobs_are_the_per_row_ones() -> None:
    """On a GPU the logprobs rows are made together: the same ids, ranks and values as
    ``token_logprobs`` row by row, for sampled tokens anywhere in the ranking and any N (0-20)."""
    from stages.batched_sampler import batched_logprobs
    x = torch.randn(6, 500, generator=torch.Generator().manual_seed(10)) * 3
    tokens = [int(x[0].argmax()), 7, int(x[2].topk(3).indices[2]), 499, 0, int(x[5].argmin())]
    ns = [0, 20, 2, 1, 5, 3]
    got = batched_logprobs(x, tokens, ns)
    for a, row in enumerate(got):
        want = token_logprobs(x[a], tokens[a], ns[a])
        assert [(t, r) for t, _, r in row] == [(t, r) for t, _, r in want]
        assert [v for _, v, _ in row] == pytest.approx([v for _, v, _ in want], abs=1e-5)
    assert got[0][0][2] == 1 and len(got[0]) == 1 and len(got[1]) == 21 and got[5][0][2] == 500


@pytest.mark.gpu(1)
def test_batched_sampler_on_cuda_reads_the_device_once() -> None:
    """On a GPU ``sample`` takes the batched path: the tokens of 64 sampled rows (top-p, top-k and
    penalties among them) are those the same path draws from the CPU copy of the logits (but for
    a draw that lands on a boundary the two devices' sums round apart), with a handful of device
    syncs for the batch, not one or more a row."""
    import warnings
    x = torch.randn(64, 49152, generator=torch.Generator().manual_seed(9)) * 3
    specs = [SampleSpec(0.8, (0.95, 1.0)[i % 2], (0, 50)[i % 3 == 0], i,
                        -1, LogitsEdit(banned=(1,), repetition=1.2, context_ids=(5, 6)) if i % 5 == 0 else None)
             for i in range(64)]
    want = stages.batched_sampler.sample_batched(x, specs)
    xc = x.cuda()
    sample(xc, specs)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = sample(xc, specs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sum(a == b for a, b in zip(got, want)) >= 60
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert 1 <= len(syncs) <= 8, [str(w.message) for w in syncs]


@pytest.mark.gpu(1)
def test_sample_hidden_on_cuda_gives_the_cpus_logprobs() -> None:
    """Greedy rows asking for logprobs, beside plain greedy ones, through the batched logprobs on
    CUDA: the CPU's tokens, ranks and values."""
    head = TinyHead()
    h = torch.randn(5, 8, generator=torch.Generator().manual_seed(11))
    specs = [SampleSpec(0.0, 1.0, 0, 0, n) for n in (-1, 0, 3, -1, 20)]
    want_tokens, want_rows = sample_hidden(head, h, specs)
    head.w = head.w.cuda()
    tokens, rows = sample_hidden(head, h.cuda(), specs)
    assert tokens == want_tokens and [r is None for r in rows] == [r is None for r in want_rows]
    for row, want in zip(rows, want_rows):
        if want is not None:
            assert [(t, r) for t, _, r in row] == [(t, r) for t, _, r in want]
            assert [v for _, v, _ in row] == pytest.approx([v for _, v, _ in want], abs=1e-4)
