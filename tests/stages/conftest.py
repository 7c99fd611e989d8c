"""Fixtures of the stage tests."""
from __future__ import annotations

from typing import Iterator

import pytest
import torch


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """Runs the test at 1 and at 2 torch threads (the kernels split work across threads)."""
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)
