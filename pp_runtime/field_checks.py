"""Type/range checks of config fields; every message names the field, as pp_runtime.config's do.

Shared by the workload config, trace replay and the run config:

    from pp_runtime.field_checks import check_int
    check_int("WorkloadConfig.seed", seed, 0)   # ValueError naming the field when it is not an int ≥ 0
"""
from __future__ import annotations

import math

import numpy as np


def is_int(value: object) -> bool:
    # bool is an int subclass; `pp: true` in YAML is a mistake, not 1
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return (is_int(value) or isinstance(value, (float, np.floating))) and math.isfinite(float(value))


def check_int(name: str, value: object, minimum: int) -> None:
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an integer ≥ {minimum}, got {value!r}")


def check_positive_number(name: str, value: object) -> None:
    if not is_number(value) or float(value) <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
