"""fp32 CPU kernels in C++ (``stages/csrc/``) for what torch does slowly on a CPU.

* ``paged_decode`` (paged_decode.cpp): the torch path gathers every decode's blocks into a
  contiguous (B, L, H_kv, D) copy per layer and then runs SDPA over it, so the copy is written
  once and read twice. The kernel walks each sequence's block table: scores of the G query
  heads of a KV head against each K row, a softmax over them, then the weighted V rows.
* ``paged_prefill`` (paged_prefill.cpp): causal attention of one prefill chunk over its cached
  context plus itself, in blocks of 16 query positions that each read only the keys they can
  see (SDPA's CPU kernel computes the masked upper triangle of a cached context too),
  register-blocked products over K/V packed in 16-wide panels, a vectorised exp.
* ``rms_norm``, ``add_rms_norm_``, ``silu_mul``, ``rope_`` (elementwise.cpp): one pass each
  where torch runs RMSNorm as five kernels, SiLU on a strided half of the gate/up output and
  RoPE as four strided kernels; ``write_kv_``: a step's K and V rows into the paged caches in
  one call (two ``index_copy_`` per layer in torch); ``transpose`` (elementwise.cpp) for the skinny linear's
  transposed product, 3x torch's strided copy.
* ``pack_weight``, ``packed_linear`` (gemm.cpp): the linear layers over weights packed once
  into 16-column panels; 6 x 16 register tiles, each thread streaming its own panels once per
  call. torch.mm re-packs W on every call and blocks a few-row (decode) product poorly.
  ``quant_linear`` (gemm_quant.cpp): the same over GGUF Q4/Q8 blocks kept as stored
  (stages/quant.py), each panel's K slab dequantized into an L1 scratch that all row tiles then
  read; a few-row product takes each weight row from codes to registers instead, once for up to
  24 rows (gemm_few_rows.cpp). ``pack_weight_bf16``, ``bf16_linear`` (gemm_bf16.cpp, with the
  bf16 products of matmul precision "medium"): the bf16 path's weight words kept, and the product
  over them (the greedy LM head's: stages/greedy.py).
* ``greedy_candidates`` (greedy.cpp), ``int8_candidates`` (greedy_int8.cpp): the exact greedy LM head's columns
  that can still win, from cheap logits and their error bound; the int8 one computes its logits
  (int8 VNNI products against a Q8_0 weight's own codes) in place.
* ``panel_rows`` (embedding.cpp): embedding lookups from a tied LM head's panels, each row read
  where it lies (torch's indexing gathers its whole 16-row panel first: 16-26x slower).

Where the compiler sees AVX-512 (the box it is built on has it), the GEMM tiles, the few-row
quantized product, the prefill attention tiles and SiLU·mul run 16 lanes wide (twice the FMA
peak of 8 lanes on cores with 512-bit units); elsewhere the same kernels run 8 lanes (AVX2), or
as plain loops. The GEMM sums every output in the same k order at either width, so results do
not depend on it.

Built on first use with torch's JIT extension loader (g++, ninja) for the host CPU
(-march=native: it is built where it runs); ``scripts/setup.sh`` builds it ahead so that no run
pays the ~60 s compile. Where it cannot be built, ``available()`` is False and every caller
takes its torch path.

    out = paged_decode(q, k_cache, v_cache, tables, lens, scale)
    # q (B, H, D) fp32; caches (NB, BS, H_kv, D); tables (B, nb) int64 block ids; lens (B,) int64
    paged_prefill(q, k_cache, v_cache, table, ctx, scale, out)
    # q, out (n, H, D) fp32, the chunk's last n of ctx positions; table (nb,) int64
"""
from __future__ import annotations

import fcntl
import sys
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from stages.cpu_info import host_tag

_CSRC = Path(__file__).with_name("csrc")
# The sources, compiled as three translation units of whole files (a unity build): alone, each .cpp
# spent ~10 s of its ~15 s parsing torch's headers (bindings.cpp ~22 s, with pybind11), ~190 s of CPU
# a build, ~100 s on the 2-core boxes, and the tests build up to four ISAs; as three units, ~50 s.
# Within a unit the files share one scope, so a unit must not hold two files whose helpers share a
# name: paged_prefill's tile sizes (MR, NR) and the GEMM's, paged_decode's Args and paged_prefill's.
_UNITS = {"unit_bind_gemm.cpp": ("bindings.cpp", "gemm.cpp", "gemm_quant.cpp", "gemm_few_rows.cpp", "gemm_bf16.cpp",
                                 "int8_gemm.cpp", "embedding.cpp", "greedy.cpp", "greedy_int8.cpp"),
          "unit_decode.cpp": ("paged_decode.cpp", "elementwise.cpp"),
          "unit_prefill.cpp": ("paged_prefill.cpp",)}
TILE = 16  # paged_prefill's micro-tile width: it takes head sizes that are a multiple of it
PANEL = 16  # pack_weight's panel width: it packs weights whose output size is a multiple of it
# the most rows a product keeps fp32 under "medium" (vec.h: kBf16MinTokens): the GEMM's and the prefill
# attention's bf16 paths take more, paged_decode's under medium too (its bf16_over)
BF16_FP32_ROWS = 12



def sources_tag() -> str:
    """A checksum of csrc/'s sources: builds are named by what they compile, not where from."""
    crc = 0
    for f in sorted(_CSRC.glob("*.[ch]*")):
        crc = zlib.crc32(f.name.encode() + f.read_bytes(), crc)
    return f"{crc:08x}"


def torch_tag(torch_dir: Path | None = None) -> str:
    """A checksum of where torch is installed (this one by default): build.ninja names its include
    folders, so two environments (two virtualenvs, one cache) building into one folder rebuilt it
    in turn, each start of the other's ~2 min."""
    return f"{zlib.crc32(str(torch_dir or Path(torch.__file__).parent).encode()):08x}"


# One build per kind of CPU, source text and torch install, compiled from a copy of the sources inside
# its own folder: ninja rebuilds every object when build.ninja names other source paths, so builds named
# by checkout path rebuilt (~1 min) for every new path holding the same sources: each upload of
# `ray job submit --working-dir .`, on every node. Two checkouts of one text now share a build.
_NAME = f"pp_runtime_cpu_kernels_{host_tag()}_{sources_tag()}_{torch_tag()}"
_lock = threading.Lock()
_module: object | None = None
_failed: str | None = None


def _load() -> object | None:
    global _module, _failed
    if _module is not None or _failed is not None:  # every layer asks: no lock once settled
        return _module
    with _lock:
        if _module is None and _failed is None:
            try:
                _module = _build(_NAME, "native")
            except Exception as exc:  # no compiler, no ninja, an odd CPU: the torch paths still work
                _failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                print(f"pp_runtime: CPU kernels unavailable ({_failed}); using the torch paths", file=sys.stderr)
    return _module


def _build(name: str, march: str) -> object:
    """Compiles (or takes from torch's cache) the kernels for ``-march=<march>`` as module ``name``."""
    from torch.utils.cpp_extension import _get_build_directory, load
    build_dir = Path(_get_build_directory(name, verbose=False))
    with build_guard(build_dir):
        src = _copy_sources(build_dir / "src")
        # -fopenmp: at::parallel_for is header code that splits work only under OpenMP
        return load(name, sources=[str(src / u) for u in _UNITS],
                    extra_cflags=["-O3", f"-march={march}", "-ffast-math", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)


def _copy_sources(dest: Path) -> Path:
    """csrc/ copied to ``dest``, each file written only where its bytes differ (a new mtime would
    make ninja rebuild); under build_guard's lock, so no build reads a half-written copy."""
    dest.mkdir(parents=True, exist_ok=True)
    units = {name: "".join(f'#include "{f}"\n' for f in files).encode() for name, files in _UNITS.items()}
    for name, data in [(f.name, f.read_bytes()) for f in _CSRC.glob("*.[ch]*")] + list(units.items()):
        target = dest / name
        if not target.exists() or target.read_bytes() != data:
            tmp = target.with_suffix(target.suffix + ".tmp")
            tmp.write_bytes(data)
            tmp.replace(target)
    return dest


def build(march: str) -> object:
    """The kernels built for another x86-64 target: "x86-64-v4" takes the AVX-512 paths without
    BF16, "x86-64-v3" the AVX2 ones, "x86-64" the plain loops (a ~1 min compile on 2 cores, cached). The tests
    run them on a CPU that has everything, so that other CPUs' paths are tested too; the runtime
    uses the host's build only."""
    return _build(f"{_NAME}_{march.replace('-', '_')}", march)


@contextmanager
def build_guard(build_dir: Path) -> Iterator[None]:
    """Holds an OS lock on ``build_dir`` for one build, and drops a lock file that a dead build left.

    torch's own lock is a plain file (FileBaton) that it waits on forever: a build killed mid-way
    (Ctrl-C, OOM, a cancelled CI job) leaves it behind and every later start would hang. Its age
    says nothing (a copied cache, or a build killed a minute ago), so every build of ours first
    takes a flock, which the kernel releases when its holder dies: once we hold it, no build of
    ours is running, and a lock file there is a dead one's."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "pp_runtime.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # waits while a live build of ours compiles (~1 min)
        lock = build_dir / "lock"
        if lock.exists():
            print(f"pp_runtime: removing the lock of a build that died: {lock}", file=sys.stderr)
            lock.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def available() -> bool:
    return _load() is not None


def status() -> str:
    """'ready (<isa()>)' or why not (scripts/setup.sh prints it after building)."""
    return f"ready ({isa()})" if available() else f"not built ({_failed})"


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels take this activation: fp32, on CPU, built."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and available()


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, scale: float, bf16: bool = False, bf16_over: int = BF16_FP32_ROWS) -> torch.Tensor:
    """(B, H, D) attention of each decode over the first lens[b] slots of its block table.

    bf16 (where ``bf16_products()``): a call of more than ``bf16_over`` decodes over an fp8 cache,
    with heads 64 or 128 wide and up to 4 query heads a KV head, takes the two products in bf16 where the build also has
    AVX512-VBMI (``decode_bf16()``): q and the softmax weights rounded to bf16, K and V exact (every
    fp8 value is a bf16 one), fp32 sums; ~2x fewer instructions than the fp32 walk, which is bound
    by them. Every other call stays fp32 (BF16_FP32_ROWS: as a product of up to 12 rows does under "medium")."""
    return _load().paged_decode(q.contiguous(), k_cache, v_cache, tables, lens, scale, bf16, bf16_over)


def decode_bf16() -> bool:
    """Whether paged_decode's bf16 path is in this build (AVX512-BF16 and AVX512-VBMI)."""
    return available() and _load().decode_bf16()


def cost_runs(costs: list[int], parts: int) -> list[int]:
    """How paged_decode cuts its tasks (a task's cost: its sequence's keys + 32) among ``parts``
    threads: the edges (parts + 1) of runs of consecutive tasks of about equal cost."""
    return _load().cost_runs(costs, parts)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, ctx: int,
                  scale: float, out: torch.Tensor, bf16: bool = False) -> None:
    """Causal attention of a chunk q (n, H, D), the last n of ctx positions, into out (n, H, D).

    Its K/V must already be in the cache. q and out may be row-strided views (a slice of the
    fused QKV output, rows of the step's output); each (H, D) row must be contiguous. bf16 (where
    ``bf16_products()``): a chunk of more than 12 tokens rounds q, K, the softmax weights and V to
    bf16 for the two products, sums in fp32, as a GPU's bf16 attention (matmul precision "medium"
    and "int8"); a shorter one stays the fp32 path, as a product of up to 12 rows does.
    """
    _load().paged_prefill(q, k_cache, v_cache, table, ctx, scale, out, bf16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x · rsqrt(mean(x²) + eps) · weight over the rows of a contiguous (T, H) x."""
    return _load().rms_norm(x, weight, eps)


def add_rms_norm_(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h += x in place (a residual add), then returns rms_norm(h); both contiguous (T, H)."""
    return _load().add_rms_norm_(h, x, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2I) = [gate | up], contiguous -> silu(gate) · up, (T, I)."""
    return _load().silu_mul(gate_up)


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half RoPE of x (T, heads, D) in place; its (heads, D) rows contiguous, any row
    stride (q's and k's heads of the fused QKV output). cos/sin: (P, D/2) tables by position."""
    _load().rope_(x, positions, cos, sin)


def write_kv_(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slots: torch.Tensor) -> None:
    """k, v (T, H_kv, D) fp32 (contiguous (H_kv, D) rows, any row stride) into the caches (NB, BS,
    H_kv, D) at flat slots (T,) int64, as ``index_copy_`` on their (NB·BS, H_kv, D) views would
    (an fp16 cache: clamped to ±65504, rounded to nearest even)."""
    _load().write_kv_(k, v, k_cache, v_cache, slots)


def transpose(x: torch.Tensor) -> torch.Tensor:
    """(R, C) contiguous -> (C, R) contiguous, in 8 x 8 register blocks."""
    return _load().transpose(x)


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """(N, K) fp32, N a multiple of PANEL -> (N / PANEL, K, PANEL): the layout packed_linear reads."""
    return _load().pack_weight(w)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
                  bf16: bool = False) -> torch.Tensor:
    """x (M, K) (rows contiguous, any row stride) times the packed (N, K) weight's transpose: (M, N).
    bf16: where ``bf16_products()``, a product of more than 12 rows (K even) rounds x and W to
    bf16 and sums in fp32 (matmul precision "medium"); fewer rows stay fp32."""
    return _load().packed_linear(x, packed, bias, bf16)


def quant_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None = None,
                 bf16: bool = False) -> torch.Tensor:
    """x (M, K) times the transpose of the (N, K) weight held as block-quantized panels
    (stages.quant.to_panels): (M, N), summed in the same order as packed_linear; bf16 as there
    (each dequantized weight rounded to bf16)."""
    return _load().quant_linear(x, panels, bias, bf16)


def panel_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                 bf16: bool = False) -> torch.Tensor:
    """x (M, K) times a weight held in either of the GEMM's panel formats: ``quant_linear`` for
    block-quantized panels (uint8), ``packed_linear`` for fp32 ones."""
    return _load().panel_linear(x, w, bias, bf16)


def int8_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None = None,
                gated: bool = False) -> torch.Tensor:
    """x (M, K) times the transpose of block-quantized panels (Q4_0, Q4_1, Q8_0) in int8 products:
    each row's block of 32 rounded to int8 codes with one scale (``quantize_rows``), exact int32
    sums against the weight's codes, fp32 across blocks (matmul precision "int8"; int8_products()).
    gated: x is a gate/up output [gate | up] (M, 2K) and the product's input silu_mul(x), made a
    row at a time as it is quantized (the same bits as silu_mul, never stored whole)."""
    return _load().int8_linear(x, panels, bias, gated)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K) fp32 -> (codes (M, K) int8, scales (M, K/32), scale · Σ codes (M, K/32)): per block
    of 32, codes round(x · 127 / max|x|) and scale max|x| / 127, as int8_linear quantizes x."""
    xq, xs, xc = _load().quantize_rows(x)
    return xq, xs, xc


def pack_weight_bf16(w: torch.Tensor) -> torch.Tensor:
    """Panels (fp32 from ``pack_weight`` or block-quantized uint8) -> (N/16, K/2, 16) int32 words of
    bf16 pairs, the words the bf16 path converts each slab to on every call, kept (2 bytes a weight;
    AVX512-BF16 builds only, see ``bf16_products``)."""
    return _load().pack_weight_bf16(w)


def bf16_linear(x: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
    """x (M, K) times a ``pack_weight_bf16`` weight in bf16 products (fp32 sums) for every M: for
    M > 12 bit for bit ``panel_linear(x, w, bf16=True)`` over the panels wb was packed from."""
    return _load().bf16_linear(x, wb)


def greedy_candidates(approx: torch.Tensor, xnorm: torch.Tensor, wnorm: torch.Tensor, c: float,
                      floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """approx (M, V) logits within c·xnorm[r]·wnorm[v] + floor of the exact ones -> (ids (U,) int64, the
    ascending union of every row's candidates; member (M, U) bool): row r's exact argmax is among
    the ids its member row marks (stages/greedy.py)."""
    ids, member = _load().greedy_candidates(approx, xnorm, wnorm, c, floor)
    return ids, member


def int8_candidates(xu: torch.Tensor, xs: torch.Tensor, eb: torch.Tensor, bmax: torch.Tensor, w: torch.Tensor,
                    block_norms: torch.Tensor, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """greedy_candidates over the logits of x ≈ xs · (xu − 128) per block of 32 (M, K) against Q8_0
    panels w (V/16, K/32, 576), computed in exact int8 products and bounded by Σ_b block_norms ·
    eb (+ floor) from x's, none of them stored (greedy.Int8Head, quantize_blocks)."""
    ids, member = _load().int8_candidates(xu, xs, eb, bmax, w, block_norms, floor)
    return ids, member


def quantize_blocks(x: torch.Tensor, block_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K) fp32 rows -> int8_candidates' (xu, xs, eb, bmax) (greedy.Int8Head.quantize)."""
    xu, xs, eb, bmax = _load().quantize_blocks(x, block_max)
    return xu, xs, eb, bmax


def gather_columns(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The panels (fp32 or block-quantized, as w) of w's output columns ids (U,), padded to whole
    panels with the last id."""
    return _load().gather_columns(w, ids)


def panel_rows(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ids (T,) of the (V, K) table that panels w hold (block-quantized: stages.quant; fp32:
    pack_weight), as float32 (T, K): stages.quant.panel_rows' values, read where they lie."""
    return _load().panel_rows(w, ids)


def layer_stack(weights: list[torch.Tensor], heads: int, kv_heads: int, head_dim: int, scale: float, eps: float,
                products: str, attn_bf16: bool, decode_bf16_over: int, cos: torch.Tensor, sin: torch.Tensor) -> object:
    """stack.h's LayerStack over 7 tensors a layer (stages/layer_loop.py): ``.forward(h, caches,
    step_meta(...))`` runs them all in one call; products: the linears' ("fp32", "bf16", "int8");
    attn_bf16, decode_bf16_over: the attention kernels' (``paged_prefill``'s bf16, ``paged_decode``'s
    bf16 and bf16_over)."""
    return _load().LayerStack(weights, heads, kv_heads, head_dim, scale, eps, products, attn_bf16, decode_bf16_over,
                              cos, sin)


def step_meta(positions: torch.Tensor, slots: torch.Tensor, q_lens: list[int], ctx_lens: list[int],
              prefill_tables: list[torch.Tensor], decode_tables: torch.Tensor | None,
              decode_lens: torch.Tensor | None) -> object:
    """A step's attention metadata as LayerStack.forward takes it (prefill chunks' lists only)."""
    return _load().StepMeta(positions, slots, q_lens, ctx_lens, prefill_tables, decode_tables, decode_lens)


def bf16_products() -> bool:
    """Whether the GEMM was built with AVX512-BF16 dot products (matmul precision "medium" uses
    them; without, it computes as "highest")."""
    return available() and _load().bf16_products()


def int8_products() -> bool:
    """Whether int8_linear runs here (built with AVX512-VNNI and VBMI, or with AVX2: vpmaddubsw;
    matmul precision "int8" uses it, without it computes as "highest")."""
    return available() and _load().int8_products()


def int8_takes(w: torch.Tensor) -> bool:
    """Whether matmul precision "int8" takes int8_linear for weight ``w``: block-quantized panels
    whose int8 product is the faster one here (VNNI builds: all; AVX2 builds: Q4_0/Q4_1 ones, their
    Q8_0 product no faster than the fp32 one)."""
    return available() and _load().int8_takes(w)


def int8_head() -> bool:
    """Whether int8_candidates runs here (built with AVX512-VNNI and VBMI): the exact greedy head's
    int8 products over a Q8_0 LM head (stages/greedy.py)."""
    return available() and _load().int8_head()


def isa() -> str:
    """The vector instructions the built kernels use: "avx512+bf16", "avx512", "avx2" or "scalar"."""
    return _load().isa()
