"""What this CPU is, from /proc/cpuinfo: the name of its kernels' build and its feature flags.

    host_tag()   # '3f9c01ab': one kernel build per kind of CPU (stages/cpu_kernels.py)
    cpu_flags()  # {'avx2', 'avx512f', 'avx512_bf16', ...}: which instruction sets can run here
    cpu_name()   # 'AMD EPYC 9R14 ...': for reports
"""
from __future__ import annotations

import hashlib
import platform

CPUINFO = "/proc/cpuinfo"


def _lines(cpuinfo: str, keys: tuple[str, ...]) -> list[str]:
    """The lines of ``cpuinfo`` that start with one of ``keys`` (none where it cannot be read)."""
    try:
        with open(cpuinfo) as f:
            return [ln for ln in f if ln.startswith(keys)]
    except OSError:
        return []


def host_tag(cpuinfo: str = CPUINFO) -> str:
    """8 hex digits naming this CPU (model and feature flags).

    torch's build cache keys a build on its sources and flags, and "-march=native" reads the
    same on every host: with a home directory shared across nodes, a node without AVX-512 would
    load another node's AVX-512 build and die of SIGILL. One build per kind of CPU instead."""
    lines = _lines(cpuinfo, ("model name", "flags", "Features", "CPU part"))
    key = "".join(dict.fromkeys(lines)) or f"{platform.machine()} {platform.processor()}"
    return hashlib.sha1(key.encode()).hexdigest()[:8]


def cpu_flags(cpuinfo: str = CPUINFO) -> frozenset[str]:
    """The first CPU's feature flags (x86 "flags"; empty where cpuinfo has none)."""
    flags = _lines(cpuinfo, ("flags",))
    return frozenset(flags[0].split(":", 1)[1].split()) if flags else frozenset()


def cpu_name(cpuinfo: str = CPUINFO) -> str:
    """The CPU's model name (x86 "model name"), else what ``platform`` knows, else "cpu"."""
    names = _lines(cpuinfo, ("model name",))
    return names[0].split(":", 1)[1].strip() if names else (platform.processor() or "cpu")
