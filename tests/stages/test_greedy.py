"""Greedy tokens from int8 or bf16 products (stages/greedy.py): the ids of the fp32 logits' argmax, ties to
the lowest id, for each weight format and row count, on every instance of the kernels; the pieces
(candidates, gathered columns) and the worker's use of it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pp_runtime.batch import SampleSpec
from pp_runtime.config import CacheConfig, DeviceConfig, ParallelConfig
from stages import cpu_kernels, greedy, quant
from stages.layers import TPContext
from stages.model_source import resolve_model
from stages.sampler import sample, sample_hidden
from stages.worker import StageWorker
from stages.worker_spec import WorkerSpec

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="CPU kernels could not be built here")
N, K = 2064, 288  # 129 panels (an odd count), K in 9 blocks
TIES = (5, 700, 2000)  # identical weight rows: their logits tie exactly in every row


def weight(kind: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(panels the LM head holds, the fp32 rows) of a random (N, K) weight with rows TIES equal and
    row 1000 one code away from row 5 (near ties)."""
    x = 0.05 * np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32)
    for v in TIES[1:]:
        x[v] = x[TIES[0]]
    x[1000] = x[TIES[0]]
    x[1000, 7] -= 0.004 * np.sign(x[1000, 7])  # a little under the tied rows along their own direction
    if kind == "fp32":
        w = torch.from_numpy(x)
        return cpu_kernels.pack_weight(w), w
    qtype = {"s8": quant.Q8_0, "u4": quant.Q4_1}[kind]
    raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType(qtype))
    p = quant.to_panels(raw, qtype)
    return p, quant.panel_rows(p, torch.arange(N))


def rows(m: int, w: torch.Tensor, seed: int) -> torch.Tensor:
    """m rows of x: random ones, and every third one close to the tied rows' direction (their
    logits then lead, within the bf16 bound of each other and of row 1000's)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g)
    x[::3] = 40 * w[TIES[0]] / w[TIES[0]].norm() + 0.05 * torch.randn(x[::3].shape, generator=g)
    if m > 1:
        x[1, ::2] = 1e-40  # subnormal: bf16 products flush them (floor_term covers it)
    return x


def heads(p: torch.Tensor) -> list[greedy.Int8Head | greedy.Bf16Head]:
    """Every exact greedy head this build has for weight p (prepare's pick first), the bf16 one also
    without its kept pairs (the product then converts the weight on each call)."""
    out = [h for h in (greedy.prepare(p),) if h is not None]
    if cpu_kernels.bf16_products():
        out.append(greedy.Bf16Head(p))
        out.append(greedy.Bf16Head(p))
        out[-1].pairs = None
    return out


# rows: one, the fewest the int8 head takes, below the bf16 products, the few-row path (<= 36 rows), the slab path
@pytest.mark.parametrize("kind", ["s8", "u4", "fp32"])
@pytest.mark.parametrize("m", [1, 3, 5, 13, 32, 37, 70])
def test_argmax_tokens_are_the_fp32_argmax(isa: str, threads: int, kind: str, m: int) -> None:
    p, w = weight(kind)
    x = rows(m, w, seed=m)
    expect = cpu_kernels.panel_linear(x, p).argmax(dim=-1)
    assert (expect[::3] == TIES[0]).all()  # the tie went to the lowest id, as torch.argmax's does
    hs = heads(p)
    assert [type(h) for h in hs[:1]] == ([greedy.Int8Head] if kind == "s8" and cpu_kernels.int8_head() else
                                         [greedy.Bf16Head] if cpu_kernels.bf16_products() else [])
    for h in hs:
        got = h.argmax(x)
        assert got.dtype == torch.int64 and torch.equal(got, expect), type(h).__name__


def test_prepare_picks_int8_for_q8_weights_only() -> None:
    """Int8Head reads Q8_0 codes as they are (the weight exact): a Q4 or fp32 weight takes bf16."""
    for kind in ("s8", "u4", "fp32"):
        h = greedy.prepare(weight(kind)[0])
        want = greedy.Int8Head if kind == "s8" and cpu_kernels.int8_head() else \
            greedy.Bf16Head if cpu_kernels.bf16_products() else type(None)
        assert type(h) is want
    assert greedy.prepare(torch.zeros(4, 64)) is None  # not panels: nothing to prepare


def block_rows(g: torch.Generator) -> torch.Tensor:
    """Rows that stress x's int8 blocks: a large channel among small ones (as hidden states have), a
    block of zeros, a constant block, tiny and huge scales, subnormals."""
    x = torch.randn(9, K, generator=g)
    x[0, 3] = 60.0
    x[1, :32] = 0.0
    x[2, 32:64] = 0.37
    x[3] *= 1e-34  # block scales times d below the smallest normal float (d ~ 1e-3): flushed
    x[4] *= 1e12
    x[5, ::2] = 1e-40
    x[6, :] = -x[6, :].abs()
    x[7, 64:96] = torch.linspace(-1, 1, 32)
    x[8] = torch.randint(-127, 128, (K,), generator=g) / 32.0  # on the int8 grid: no quantization error at all
    return x


def test_int8_candidates_hold_every_logit_that_can_win(isa: str, threads: int) -> None:
    """Each row's candidates hold every v whose exact-arithmetic logit of x's int8 blocks, within
    its bound Σ_b |w_vb|·|e_b| of x's exact logit, can still reach the row's maximum: the rule the
    kernel applies to logits it never stores. And no more than a few beyond them."""
    if not cpu_kernels.int8_head():
        pytest.skip("this build has no AVX512-VNNI")
    p, w = weight("s8")
    head = greedy.Int8Head(p)
    piecewise = greedy.Int8Head(p, panels_at_once=7)  # what it keeps does not depend on the pieces it reads
    assert torch.equal(piecewise.block_norms, head.block_norms)
    x = torch.cat([block_rows(torch.Generator().manual_seed(3)), rows(13, w, seed=4)])
    xu, xs, eb, bmax = head.quantize(x)
    codes = xu.double().reshape(x.shape[0], -1, 32) - 128
    assert codes.abs().max() <= 127 and xs.dtype == torch.float32
    xq = (codes * xs.double().unsqueeze(-1)).reshape(x.shape)
    e = (xq - x.double()).reshape(x.shape[0], -1, 32).norm(dim=2)
    assert (e <= eb.double()).all()
    wb = w.double().reshape(N, -1, 32).norm(dim=2)  # (V, KB)
    assert (head.block_norms.reshape(-1, head.block_norms.shape[1], 16).permute(0, 2, 1).reshape(N, -1).double() >= wb).all()
    approx, bound = xq @ w.double().T, eb.double() @ wb.T  # (M, V)
    assert ((approx - x.double() @ w.double().T).abs() <= bound).all()
    # the logits to match are the GEMM's fp32 ones: within the bound too, floor and all
    floor = greedy.FLUSH * (p.shape[1] + 1)
    assert ((approx - cpu_kernels.panel_linear(x, p).double()).abs() <= bound + floor).all()
    assert (bound <= bmax.double().unsqueeze(1)).all()
    ids, member = cpu_kernels.int8_candidates(xu, xs, eb, bmax, p, head.block_norms, floor)
    need = approx + bound + floor >= (approx - bound).max(dim=1, keepdim=True).values - floor
    for r in range(x.shape[0]):
        kept = set(ids[member[r]].tolist())
        assert set(need[r].nonzero().flatten().tolist()) <= kept and len(kept) <= need[r].sum() + 2, r
    assert need[3].all()  # logits ~1e-34: under the floor, every column can win
    for n in (1, 2, 3, 4, 7, 9, 16):  # every tile height, one tile and several: a row's candidates are not its tile's
        sub = cpu_kernels.int8_candidates(xu[:n], xs[:n], eb[:n], bmax[:n], p, head.block_norms, floor)
        assert [set(sub[0][sub[1][r]].tolist()) for r in range(n)] == [set(ids[member[r]].tolist()) for r in range(n)]
    expect = cpu_kernels.panel_linear(x, p).argmax(dim=-1)
    assert torch.equal(head.argmax(x), expect)  # row 3's candidates are the whole vocabulary: the fp32 product
    rest = torch.cat([x[:3], x[4:]])
    assert member[torch.arange(x.shape[0]) != 3].any(dim=0).sum() * greedy.MAX_SHARE < N  # the int8 path, not the fallback
    assert torch.equal(head.argmax(rest), torch.cat([expect[:3], expect[4:]]))


def test_int8_head_takes_the_fp32_product_where_sums_could_overflow(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows whose logits could pass float32's range (or hold inf / nan) go to the fp32 product, as
    do rows too few for the int8 pass to pay: no int8 call for either."""
    if not cpu_kernels.int8_head():
        pytest.skip("this build has no AVX512-VNNI")
    p, w = weight("s8")
    head = greedy.Int8Head(p)
    x = rows(8, w, seed=5)
    x[2, 0], x[5, 1] = 1e32, float("inf")
    calls = []
    monkeypatch.setattr(cpu_kernels, "int8_candidates", lambda *a: calls.append(a))
    assert torch.equal(head.argmax(x), cpu_kernels.panel_linear(x, p).argmax(dim=-1))
    few = rows(greedy.INT8_MIN_ROWS - 1, w, seed=6)
    assert torch.equal(head.argmax(few), cpu_kernels.panel_linear(few, p).argmax(dim=-1))
    assert calls == []


def test_int8_head_takes_its_fewest_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """INT8_MIN_ROWS rows (3: with its codes fetched ahead the int8 pass beats the fp32 product
    there) go through int8_candidates, and still give the fp32 argmax."""
    if not cpu_kernels.int8_head():
        pytest.skip("this build has no AVX512-VNNI")
    p, w = weight("s8")
    head = greedy.Int8Head(p)
    real, calls = cpu_kernels.int8_candidates, []
    monkeypatch.setattr(cpu_kernels, "int8_candidates", lambda *a: calls.append(a) or real(*a))
    x = rows(greedy.INT8_MIN_ROWS, w, seed=7)
    assert torch.equal(head.argmax(x), cpu_kernels.panel_linear(x, p).argmax(dim=-1))
    assert greedy.INT8_MIN_ROWS == 3 and len(calls) == 1


def test_int8_candidates_name_what_is_wrong(isa: str) -> None:
    p, _ = weight("s8")
    head = greedy.Int8Head(p)
    xu, xs, eb, bmax = head.quantize(torch.randn(3, K))
    if not cpu_kernels.int8_head():
        with pytest.raises(RuntimeError, match="no AVX512-VNNI"):
            cpu_kernels.int8_candidates(xu, xs, eb, bmax, p, head.block_norms, 0.0)
        return
    with pytest.raises(RuntimeError, match="Q8_0 panels"):
        cpu_kernels.int8_candidates(xu, xs, eb, bmax, weight("u4")[0], head.block_norms, 0.0)
    with pytest.raises(RuntimeError, match="xu"):
        cpu_kernels.int8_candidates(xu[:, :64], xs, eb, bmax, p, head.block_norms, 0.0)
    with pytest.raises(RuntimeError, match="eb"):
        cpu_kernels.int8_candidates(xu, xs, eb[:2], bmax, p, head.block_norms, 0.0)
    with pytest.raises(RuntimeError, match="bmax"):
        cpu_kernels.int8_candidates(xu, xs, eb, bmax[:1], p, head.block_norms, 0.0)
    with pytest.raises(RuntimeError, match="bn float32"):
        cpu_kernels.int8_candidates(xu, xs, eb, bmax, p, head.block_norms[1:], 0.0)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        head.quantize(torch.randn(3, K - 1))


def test_row_norms_bound_the_rows_from_above() -> None:
    for kind in ("s8", "u4", "fp32"):
        p, w = weight(kind)
        n = greedy.row_norms(p)
        exact = w.double().norm(dim=1)
        assert n.dtype == torch.float32 and (n.double() >= exact).all() and torch.allclose(n.double(), exact)


@pytest.mark.parametrize("kind", ["s8", "u4", "fp32"])
@pytest.mark.parametrize("m", [5, 13, 37])
def test_gathered_columns_give_the_full_products_bits(kind: str, m: int) -> None:
    p, w = weight(kind)
    x = rows(m, w, seed=1)
    ids = torch.tensor([0, 3, 5, 17, 700, 1000, 2000, 2063])  # 8: padded to a panel
    sub = cpu_kernels.gather_columns(p, ids)
    assert sub.dtype == p.dtype and sub.shape[0] == 1 and sub.shape[1:] == p.shape[1:]
    assert torch.equal(cpu_kernels.panel_linear(x, sub)[:, :ids.numel()], cpu_kernels.panel_linear(x, p)[:, ids])
    assert torch.equal(sub, cpu_kernels.gather_columns(p, torch.cat([ids, ids[-1:].expand(8)])))  # padded with the last id
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.gather_columns(p, torch.tensor([N]))


def test_candidates_keep_every_value_within_the_bound(isa: str) -> None:
    g = torch.Generator().manual_seed(0)
    approx, wn, xn = torch.randn(6, 1000, generator=g), torch.rand(1000, generator=g), torch.rand(6, generator=g) + 0.5
    approx[2, 100] = approx[2, 900] = 9.0  # a tie: both kept
    c = 0.05
    ids, member = cpu_kernels.greedy_candidates(approx, xn, wn, c, 0.0)
    assert ids.dtype == torch.int64 and member.shape == (6, ids.numel()) and torch.equal(ids, ids.sort().values)
    b = c * xn[:, None] * wn[None]
    need = approx + b >= (approx - b).max(dim=1, keepdim=True).values  # the bound's exact rule
    for r in range(6):
        kept = set(ids[member[r]].tolist())
        assert set(need[r].nonzero().flatten().tolist()) <= kept
        assert int(approx[r].argmax()) in kept
        assert len(kept) <= need[r].sum() + 2  # the kernel's rounding margin adds no more than a stray one
    assert {100, 900} <= set(ids[member[2]].tolist())
    ids0, member0 = cpu_kernels.greedy_candidates(approx, xn, wn, 0.0, 0.0)  # no error: each row's maxima
    assert [ids0[member0[r]].tolist() for r in range(6)][2] == [100, 900]


@pytest.fixture(scope="module")
def q8_worker(tmp_path_factory: pytest.TempPathFactory) -> StageWorker:
    """A one-stage worker of a small LLaMA whose tied embedding / LM head is Q8_0."""
    from tests.stages.test_quant import VARIANTS, write_gguf
    path = write_gguf(tmp_path_factory.mktemp("greedy") / "m.gguf", VARIANTS["mixed"])
    spec = WorkerSpec(resolve_model(str(path)), 0, 0, ParallelConfig(1), CacheConfig(4, 1 << 24),
                      DeviceConfig("cpu", "float32", "torch"))
    return StageWorker(spec, TPContext(), None)


def test_worker_takes_the_argmax_path_for_greedy_rows_only(q8_worker: StageWorker) -> None:
    model = q8_worker.model
    assert quant.is_panels(model.lm_head.weight)
    assert type(model.lm_head.greedy) is type(greedy.prepare(model.lm_head.weight))
    if isinstance(model.lm_head.greedy, greedy.Int8Head):  # kept: a norm per block of 32 weights
        v, k = quant.panel_shape(model.lm_head.weight)
        assert model.lm_head.greedy.nbytes == v * k // 32 * 4
    assert (model.lm_head.greedy is not None) == (cpu_kernels.int8_head() or cpu_kernels.bf16_products())
    h = 3 * torch.randn(40, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = model.logits(h)
        assert torch.equal(model.argmax_tokens(h), logits.argmax(dim=-1))
        greedy_specs = [SampleSpec(0.0, 1.0, 0, i) for i in range(40)]
        assert sample_hidden(model, h, greedy_specs) == logits.argmax(dim=-1).tolist()
        mixed = greedy_specs[:39] + [SampleSpec(0.8, 0.9, 0, 7)]  # one sampled row: full logits for all
        assert sample_hidden(model, h, mixed) == sample(logits, mixed)


def test_medium_precision_keeps_its_bf16_logits(tmp_path_factory: pytest.TempPathFactory) -> None:
    """With bf16 products asked for, the LM head's logits are bf16 ones and argmax_only takes their
    argmax: nothing to make exact. On a core without AVX512-BF16 "medium" computes as "highest", so
    the exact greedy head is kept as it is there (the Xeon VM of 2026-11-27 has VNNI, not BF16)."""
    from tests.stages.test_quant import VARIANTS, write_gguf
    path = write_gguf(tmp_path_factory.mktemp("greedy_medium") / "m.gguf", VARIANTS["mixed"])
    spec = WorkerSpec(resolve_model(str(path)), 0, 0, ParallelConfig(1), CacheConfig(4, 1 << 24),
                      DeviceConfig("cpu", "float32", "torch", matmul_precision="medium"))
    model = StageWorker(spec, TPContext(), None).model
    if cpu_kernels.bf16_products():
        assert model.lm_head.greedy is None
    else:
        assert (model.lm_head.greedy is not None) == cpu_kernels.int8_head()
    h = torch.randn(20, model.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.equal(model.argmax_tokens(h), model.logits(h).argmax(dim=-1))
