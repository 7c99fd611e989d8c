"""stages.layers.linear: the skinny-row form (W Xᵀ)ᵀ used with several threads equals F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stages.layers import linear, skinny


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 128, 129, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(threads: int, rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=g), torch.randn(160, 96, generator=g)
    b = torch.randn(160, generator=g) if bias else None
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = linear(x, w, b)
        assert skinny(rows) == (2 <= rows <= (6 if threads == 1 else 128))
    finally:
        torch.set_num_threads(old)
    assert y.shape == (rows, 160) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
