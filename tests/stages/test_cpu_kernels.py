"""The fused elementwise CPU kernels against torch, and the layer code paths that use them or
fall back (the paged attention kernels are tested with the attention backends)."""
from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from stages import cpu_kernels
from stages.cpu_info import cpu_flags, cpu_name, host_tag
from stages.layers import RMSNorm, RotaryEmbedding, linear

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="CPU kernels could not be built here")


@pytest.mark.parametrize("t,h", [(256, 576), (3, 20), (1, 7), (33, 4096)])
def test_rms_norm_and_add_rms_norm_match_torch(isa: str, threads: int, t: int, h: int) -> None:
    g = torch.Generator().manual_seed(t + h)
    x, a, w = torch.randn(t, h, generator=g) * 4, torch.randn(t, h, generator=g), torch.randn(h, generator=g)
    torch.testing.assert_close(cpu_kernels.rms_norm(x, w, 1e-5), F.rms_norm(x, (h,), w, 1e-5), rtol=1e-5, atol=1e-5)
    h_in = a.clone()
    normed = cpu_kernels.add_rms_norm_(h_in, x, w, 1e-6)
    torch.testing.assert_close(h_in, a + x)  # the residual sum, written in place
    torch.testing.assert_close(normed, F.rms_norm(a + x, (h,), w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t,i", [(256, 1536), (5, 13), (1, 8)])
def test_silu_mul_matches_torch(isa: str, threads: int, t: int, i: int) -> None:
    g = torch.Generator().manual_seed(t * i)
    gu = torch.randn(t, 2 * i, generator=g) * 5
    gu[0, :4] = torch.tensor([-200.0, -88.5, 90.0, 0.0])[:min(4, i)]  # past exp's range both ways
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_kernels.silu_mul(gu), F.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_rms_norm_module_paths_agree(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """RMSNorm.forward / add_forward on the kernels and on torch give the same values, and
    add_forward's sum is h + x either way."""
    norm = RMSNorm(64, 1e-5)
    norm.weight.data = torch.randn(64)
    h, x = torch.randn(10, 64), torch.randn(10, 64)
    fused_sum, fused = norm.add_forward(h.clone(), x)
    plain = norm(h + x)
    monkeypatch.setattr(cpu_kernels, "usable", lambda t: False)
    torch_sum, torch_norm = norm.add_forward(h.clone(), x)
    torch.testing.assert_close(fused_sum, torch_sum)
    torch.testing.assert_close(fused, torch_norm, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(plain, norm(h + x), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_kernels.rms_norm(torch.randn(64, 10).t(), norm.weight, 1e-5)


@pytest.mark.parametrize("heads,d", [(12, 64), (3, 128), (2, 10)])
def test_rope_in_place_matches_torch_path(isa: str, threads: int, heads: int, d: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rotating q's and k's heads in place inside a fused QKV row (row stride > heads · D)
    gives the torch path's values and leaves the V part alone; bad positions are refused."""
    rope = RotaryEmbedding(d, 300, 10000.0)
    g = torch.Generator().manual_seed(heads * d)
    qkv = torch.randn(37, (heads + 2) * d, generator=g)
    positions = torch.randint(0, 300, (37,), generator=g)
    x = qkv[:, :heads * d].view(37, heads, d)
    monkeypatch.setattr(cpu_kernels, "usable", lambda t: False)
    want = rope(positions, x, {})
    monkeypatch.undo()
    v_before = qkv[:, heads * d:].clone()
    got = rope(positions, x, {})
    assert got.data_ptr() == x.data_ptr()  # in place
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, heads * d:], v_before)
    with pytest.raises(RuntimeError, match="position 300 outside"):
        cpu_kernels.rope_(x[:1], torch.tensor([300]), rope.cos, rope.sin)


@pytest.mark.parametrize("r,c", [(960, 32), (7, 5), (17, 24), (8, 8), (3, 1), (4100, 13)])
def test_transpose_matches_torch(isa: str, threads: int, r: int, c: int) -> None:
    """Whole 8 x 8 register blocks and the ragged edges of both dimensions."""
    x = torch.randn(r, c, generator=torch.Generator().manual_seed(r * c))
    assert torch.equal(cpu_kernels.transpose(x), x.t().contiguous())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float8_e4m3fn], ids=["fp32", "fp16", "fp8"])
@pytest.mark.parametrize("t", [1, 5, 200])
def test_write_kv_matches_index_copy(isa: str, threads: int, dtype: torch.dtype, t: int) -> None:
    """K and V as the fused QKV output's strided views, into the caches at scattered slots: the bits
    index_copy_ of the (clamped) rows writes, into an fp16 or fp8 cache too (±inf keys become
    ±65504 / ±448; fp8 rounds to nearest even as torch's .to does, subnormals and ties included)."""
    h, hkv, d = 6, 2, 16
    g = torch.Generator().manual_seed(t)
    qkv = 100 * torch.randn(t, (h + 2 * hkv) * d, generator=g)
    # every decade fp8 holds, its subnormals (< 2⁻⁶) and their ties (odd multiples of 2⁻¹⁰), normal ties
    qkv[:, :h * d] *= torch.logspace(-4, 1, h * d)[torch.randperm(h * d, generator=g)]
    qkv.view(-1)[:8] = torch.tensor([3 * 2 ** -10, 5 * 2 ** -10, 0.99 * 2 ** -6, 1.0625, 1.1875, 232.0, 460.0, -0.0])
    qkv[0, h * d] = float("inf")
    qkv[-1, (h + hkv) * d + 3] = -float("inf")
    k, v = qkv[:, h * d:(h + hkv) * d].view(t, hkv, d), qkv[:, (h + hkv) * d:].view(t, hkv, d)
    slots = torch.randperm(64 * 4, generator=g)[:t]
    caches = [torch.zeros(64, 4, hkv, d, dtype=dtype) for _ in range(4)]
    cpu_kernels.write_kv_(k, v, caches[0], caches[1], slots)
    top = torch.finfo(dtype).max if dtype != torch.float32 else float("inf")  # an fp32 cache keeps inf
    for src, cache in ((k, caches[2]), (v, caches[3])):  # as bytes: index_copy_ takes no fp8
        cache.view(torch.uint8).view(-1, hkv, d * dtype.itemsize).index_copy_(
            0, slots, src.clamp(-top, top).to(dtype).contiguous().view(torch.uint8))
    raw = [c.view(torch.uint8) for c in caches]
    assert torch.equal(raw[0], raw[2]) and torch.equal(raw[1], raw[3])
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_kernels.write_kv_(k, v, caches[0], caches[1], slots + 64 * 4)


def test_skinny_linear_matches_f_linear(isa: str, threads: int) -> None:
    """The skinny path ((W Xᵀ) transposed back by the kernel) gives F.linear's values, contiguous."""
    w, x = torch.randn(300, 64), torch.randn(4, 64)
    y = linear(x, w)
    assert y.is_contiguous() and y.shape == (4, 300)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_a_dead_builds_lock_is_removed_and_a_live_one_waited_for(tmp_path: Path) -> None:
    """A build killed mid-way leaves torch's lock file, on which torch would wait forever at the
    next start (as CI once did, 600 s). The guard waits for a live build and drops a dead one's."""
    (tmp_path / "lock").touch()  # left by a build that died before this process started
    with cpu_kernels.build_guard(tmp_path):
        assert not (tmp_path / "lock").exists()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time, pathlib\n"
         "from stages.cpu_kernels import build_guard\n"
         "d = pathlib.Path(sys.argv[1])\n"
         "with build_guard(d):\n"
         "    (d / 'lock').touch()\n"  # what torch's FileBaton writes while it compiles
         "    print('held', flush=True)\n"
         "    time.sleep(120)\n", str(tmp_path)],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        assert holder.stdout.readline().strip() == "held"
        entered = threading.Event()
        waiter = threading.Thread(target=lambda: (cpu_kernels.build_guard(tmp_path).__enter__(), entered.set()),
                                  daemon=True)
        waiter.start()
        assert not entered.wait(1.0)  # a live build holds it: wait, don't break its lock
        holder.kill()  # dies mid-build, its lock file left behind
        assert entered.wait(30.0)
        assert not (tmp_path / "lock").exists()
    finally:
        holder.kill()
        holder.wait()


def test_each_kind_of_cpu_gets_its_own_build(tmp_path: Path) -> None:
    """A home directory shared by nodes with different CPUs must not hand one node's -march=native
    build to another (SIGILL where an instruction is missing): the build's name carries the CPU."""
    def tag(model: str, flags: str) -> str:
        f = tmp_path / "cpuinfo"
        # two logical CPUs of one kind: the repeated lines do not change the tag
        f.write_text(2 * f"processor\t: 0\nmodel name\t: {model}\nflags\t\t: {flags}\ncpu MHz\t\t: 2400\n")
        return host_tag(str(f))
    zen4 = tag("AMD EPYC", "fpu sse avx2 fma avx512f avx512_bf16")
    assert zen4 == tag("AMD EPYC", "fpu sse avx2 fma avx512f avx512_bf16")
    assert len({zen4, tag("AMD EPYC", "fpu sse avx2 fma"), tag("Intel Xeon", "fpu sse avx2 fma avx512f avx512_bf16")}) == 3
    # these sources' build, for this torch install
    assert cpu_kernels._NAME.endswith(f"{host_tag()}_{cpu_kernels.sources_tag()}_{cpu_kernels.torch_tag()}")
    assert host_tag(str(tmp_path / "missing")) == host_tag(str(tmp_path / "absent"))


def test_builds_compile_a_copy_named_by_its_text(tmp_path: Path) -> None:
    """A build compiles csrc/ as copied into its folder, so a checkout at another path (each upload
    of `ray job submit --working-dir`) finds the same build; a copy already there keeps its mtimes
    (ninja would rebuild), one that differs is replaced."""
    src = cpu_kernels._copy_sources(tmp_path / "src")
    names = sorted(p.name for p in src.iterdir())
    assert set(cpu_kernels._UNITS) <= set(names) and "vec.h" in names
    # the unity build's units hold every source once
    units = [f for files in cpu_kernels._UNITS.values() for f in files]
    assert sorted(units) == sorted(p.name for p in cpu_kernels._CSRC.glob("*.cpp"))
    assert (src / "unit_decode.cpp").read_text() == '#include "paged_decode.cpp"\n#include "elementwise.cpp"\n'
    stamps = {p.name: p.stat().st_mtime_ns for p in src.iterdir()}
    (src / "vec.h").write_text("stale")
    cpu_kernels._copy_sources(src)
    assert (src / "vec.h").read_bytes() == (cpu_kernels._CSRC / "vec.h").read_bytes()
    assert all(p.stat().st_mtime_ns == stamps[p.name] for p in src.iterdir() if p.name != "vec.h")
    assert len(cpu_kernels.sources_tag()) == 8 and cpu_kernels.sources_tag() in cpu_kernels._NAME
    # named by where torch is installed too: two virtualenvs sharing one cache rebuilt one folder in turn
    assert cpu_kernels.torch_tag() == cpu_kernels.torch_tag(Path(torch.__file__).parent)
    assert cpu_kernels.torch_tag(Path("/a/.venv/lib/torch")) != cpu_kernels.torch_tag(Path("/b/.venv/lib/torch"))


def test_each_build_takes_its_own_paths(isa: str) -> None:
    """The isa fixture's builds really are the instances they are named for, and the host's build
    uses what this CPU has (setup.sh prints it)."""
    flags = cpu_flags()
    native = ("avx512+bf16" if "avx512_bf16" in flags else "avx512") if "avx512f" in flags \
        else "avx2" if {"avx2", "fma", "f16c"} <= flags else "scalar"
    expected = {"avx512": "avx512", "avx2": "avx2", "scalar": "scalar", "native": native}[isa]
    assert cpu_kernels.isa() == expected
    assert cpu_kernels.status() == f"ready ({cpu_kernels.isa()})"


def test_cpu_flags_are_the_first_cpus_flags_line(tmp_path: Path) -> None:
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu avx2 fma\n")
    assert cpu_flags(str(f)) == {"fpu", "avx2", "fma"}
    f.write_text("processor\t: 0\nFeatures\t: fp asimd\n")  # Arm: no x86 flags line
    assert cpu_flags(str(f)) == frozenset()
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_cpu_name_is_the_model_name_line(tmp_path: Path) -> None:
    """Reports name the CPU they ran on: the first "model name", else something non-empty."""
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9R14 96-Core Processor\n\nprocessor\t: 1\nmodel name\t: other\n")
    assert cpu_name(str(f)) == "AMD EPYC 9R14 96-Core Processor"
    import platform
    assert cpu_name(str(tmp_path / "missing")) == (platform.processor() or "cpu")  # no cpuinfo: macOS, a sandbox
