"""Fixtures of the stage tests."""
from __future__ import annotations

import platform
from typing import Iterator

import pytest
import torch

from stages.cpu_info import cpu_flags


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """Runs the test at 1 and at 2 torch threads (the kernels split work across threads)."""
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


# The kernels' instances below the host's: (-march target, CPU flags it needs to run here).
_V3 = {"avx2", "fma", "f16c", "bmi2", "movbe"}
ISAS = {"avx512": ("x86-64-v4", _V3 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}),  # no BF16
        "avx2": ("x86-64-v3", _V3), "scalar": ("x86-64", set())}
_builds: dict[str, object] = {}


@pytest.fixture(params=["native", *ISAS])
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs the test on each instance of the CPU kernels: the host's build (AVX-512 with BF16 on
    this box) and builds for AVX-512 without BF16 (most Xeons before Sapphire Rapids), AVX2, and
    no vector extensions, each compiled once per session (~1 min): the paths of other CPUs,
    tested on one that can run them all. An instance whose paths the host's build takes already
    is skipped.

    A build that fails to compile fails the test: the host's build worked, so the compiler is
    there and the fault is in the code of that instance."""
    from stages import cpu_kernels
    if not cpu_kernels.available():
        pytest.skip("CPU kernels could not be built here")
    if request.param != "native":
        march, needs = ISAS[request.param]
        if platform.machine() not in ("x86_64", "AMD64") or not needs <= cpu_flags():
            pytest.skip(f"this CPU cannot run a -march={march} build")
        if cpu_kernels.isa() == request.param:  # e.g. AVX2 hosts: the same #if paths, ~1 min of compile
            pytest.skip(f"the host's build takes the {request.param} paths already (native)")
        if request.param not in _builds:
            _builds[request.param] = cpu_kernels.build(march)
        monkeypatch.setattr(cpu_kernels, "_module", _builds[request.param])
    return request.param
