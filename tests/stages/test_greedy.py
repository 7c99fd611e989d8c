"""Greedy tokens from bf16 products (stages/greedy.py): the ids of the fp32 logits' argmax, ties to
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
from stages.worker import StageWorker, WorkerSpec

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


# rows: below the bf16 products, the few-row path (<= 36 rows), the slab path
@pytest.mark.parametrize("kind", ["s8", "u4", "fp32"])
@pytest.mark.parametrize("m", [1, 13, 32, 37, 70])
def test_argmax_tokens_are_the_fp32_argmax(isa: str, threads: int, kind: str, m: int) -> None:
    p, w = weight(kind)
    x = rows(m, w, seed=m)
    expect = cpu_kernels.panel_linear(x, p).argmax(dim=-1)
    got = greedy.argmax_tokens(x, p, greedy.row_norms(p))
    assert got.dtype == torch.int64 and torch.equal(got, expect)
    if cpu_kernels.bf16_products():  # the same over the weight's bf16 pairs kept
        assert torch.equal(greedy.argmax_tokens(x, p, greedy.row_norms(p), cpu_kernels.pack_weight_bf16(p)), expect)
    assert (expect[::3] == TIES[0]).all()  # the tie went to the lowest id, as torch.argmax's does


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
    sub = greedy.gather_columns(p, ids)
    assert sub.dtype == p.dtype and sub.shape[0] == 1 and sub.shape[1:] == p.shape[1:]
    assert torch.equal(cpu_kernels.panel_linear(x, sub)[:, :ids.numel()], cpu_kernels.panel_linear(x, p)[:, ids])


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
    assert (model.lm_head.row_norms is not None) == cpu_kernels.bf16_products()
    assert (model.lm_head.weight_bf16 is not None) == cpu_kernels.bf16_products()
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
    argmax: nothing to make exact."""
    from tests.stages.test_quant import VARIANTS, write_gguf
    path = write_gguf(tmp_path_factory.mktemp("greedy_medium") / "m.gguf", VARIANTS["mixed"])
    spec = WorkerSpec(resolve_model(str(path)), 0, 0, ParallelConfig(1), CacheConfig(4, 1 << 24),
                      DeviceConfig("cpu", "float32", "torch", matmul_precision="medium"))
    model = StageWorker(spec, TPContext(), None).model
    assert model.lm_head.row_norms is None
    h = torch.randn(20, model.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.equal(model.argmax_tokens(h), model.logits(h).argmax(dim=-1))
