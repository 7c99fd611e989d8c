"""The bench run config (configs/runs/*.yaml): engine settings, the schedulers to compare, the workload.

    from pp_runtime.run_config import load_run_config

    run = load_run_config("configs/runs/pp2_zipf.yaml").with_overrides(pp=3, chunk_size=None)
    run.engine        # {"model": "smollm2-135m", "pp": 3, ...}: keyword arguments for pp_runtime.LLM
    run.schedulers    # ("sarathi", "orca", "prefill_first", "request_level")
    run.workload      # pp_runtime.workload_config.WorkloadConfig

``read_yaml_mapping`` reads the top-level mapping of a YAML file (simulation configs use it too).
Plain Python + PyYAML: no torch, no Ray.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

import yaml

from pp_runtime.config import SCHEDULER_POLICIES, are_step_costs, is_layer_count
from pp_runtime.configs_dir import find_config
from pp_runtime.field_checks import check_int, check_positive_number
from pp_runtime.workload_config import WorkloadConfig

# Keys of the run YAML that become pp_runtime.LLM keyword arguments. The first ten are the
# documented schema; the rest are further LLM settings accepted so a config can pin them.
ENGINE_KEYS = ("model", "pp", "tp", "chunk_size", "max_batch_size", "tile_align", "memory_budget_gb",
               "max_model_len", "threads", "seed", "launcher", "dtype", "device", "attention",
               "block_size", "partition", "gguf_weights", "kv_cache_dtype", "matmul_precision", "chunk_budget",
               "admission", "step_costs", "enable_prefix_caching", "cuda_graphs", "kv_admission")
RUN_KEYS = ENGINE_KEYS + ("schedulers", "workload")


def _check_engine(engine: Mapping[str, Any]) -> None:
    """Type/range checks of the engine keys, naming the key; deeper checks (model exists, pp fits
    the layers, memory budget) happen when pp_runtime.LLM is built."""
    for key, value in engine.items():
        if key not in ENGINE_KEYS:
            raise ValueError(f"unknown engine key {key!r} (known: {', '.join(ENGINE_KEYS)})")
        if key in ("model", "launcher", "dtype", "device", "attention", "gguf_weights", "kv_cache_dtype",
                   "matmul_precision", "chunk_budget", "admission", "kv_admission"):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{key} must be a string, got {value!r}")
        elif key in ("pp", "tp", "chunk_size", "max_batch_size", "max_model_len", "block_size"):
            check_int(key, value, 1)
        elif key in ("threads", "seed"):
            check_int(key, value, 0)
        elif key in ("tile_align", "enable_prefix_caching", "cuda_graphs"):
            if not isinstance(value, bool) and not (key == "cuda_graphs" and value is None):  # None: auto
                raise ValueError(f"{key} must be true or false, got {value!r}")
        elif key == "memory_budget_gb":
            check_positive_number(key, value)
        elif key == "step_costs":
            if value != "fit" and not (isinstance(value, (list, tuple)) and len(value) == 3 and are_step_costs(value)):
                raise ValueError(f"step_costs must be 'fit' or a list of 3 numbers ≥ 0 (prompt key, decode row, "
                                 f"decode key), got {value!r}")
        elif key == "partition":
            if not isinstance(value, (list, tuple)) or not value or not all(is_layer_count(v) for v in value):
                raise ValueError(f"partition must be a list of positive layer counts (multiples of 0.5), got {value!r}")


@dataclass(frozen=True)
class RunConfig:
    """A bench setup: engine = keyword arguments of pp_runtime.LLM (only those the YAML set; the
    scheduler policy is not among them, it comes from ``schedulers``), the policies to compare
    and the workload."""

    engine: dict[str, Any]
    workload: WorkloadConfig
    schedulers: tuple[str, ...] = SCHEDULER_POLICIES

    def __post_init__(self) -> None:
        if not isinstance(self.engine, dict):
            raise ValueError(f"RunConfig.engine must be a dict, got {type(self.engine).__name__}")
        _check_engine(self.engine)
        if not isinstance(self.workload, WorkloadConfig):
            raise ValueError("RunConfig.workload must be a WorkloadConfig")
        if isinstance(self.schedulers, str) or not isinstance(self.schedulers, (list, tuple)) \
                or not self.schedulers:
            raise ValueError(f"schedulers must be a non-empty list, got {self.schedulers!r}")
        for name in self.schedulers:
            if name not in SCHEDULER_POLICIES:
                raise ValueError(f"schedulers: unknown scheduler {name!r} (known: {', '.join(SCHEDULER_POLICIES)})")
        if len(set(self.schedulers)) != len(self.schedulers):
            raise ValueError(f"schedulers lists a scheduler twice: {list(self.schedulers)}")
        # Every request longer than the model length would come back as an error, not a result.
        longest, max_len = self.workload.max_total_len, self.engine.get("max_model_len")
        if longest is not None and max_len is not None and longest > max_len:
            raise ValueError(f"workload: requests up to {longest} tokens exceed max_model_len={max_len}")
        object.__setattr__(self, "schedulers", tuple(self.schedulers))  # a YAML list → the tuple form

    def with_overrides(self, **engine_kwargs: Any) -> RunConfig:
        """A copy with these engine values replaced (command-line overrides); None means "not
        given" and keeps the config's value. Unknown keys raise ValueError."""
        given = {k: v for k, v in engine_kwargs.items() if v is not None}
        if "partition" in given:
            given["partition"] = list(given["partition"])
        return replace(self, engine={**self.engine, **given})


def read_yaml_mapping(path: Path, what: str) -> dict:
    """A YAML file whose top level is a mapping; ValueError names ``what`` and the path when it
    cannot be read, is not YAML or is not a mapping (run and simulation configs alike)."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {what} {str(path)!r}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{what} {path}: invalid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path}: expected a mapping at the top level")
    return data


def workload_section(data: Mapping[str, Any], path: Path) -> object:
    """A config file's ``workload`` mapping as WorkloadConfig.from_dict takes it: the file's top-level
    seed unless the workload sets its own, and a relative trace_path found beside the file read from
    there (not from the working directory). Anything but a mapping is returned as is, for
    from_dict to name what is wrong with it. Shared by run configs and simulator configs."""
    wl = data["workload"]
    if isinstance(wl, Mapping):
        wl = dict(wl)
        wl.setdefault("seed", data.get("seed", 0))
        trace = wl.get("trace_path")
        if isinstance(trace, str) and not Path(trace).is_absolute() and (path.parent / trace).is_file():
            wl["trace_path"] = str(path.parent / trace)
    return wl


def load_run_config(path: str | Path) -> RunConfig:
    """Read a run YAML (configs/runs/*.yaml). Every key is optional except ``workload``; an
    unknown key raises ValueError naming it. A relative workload.trace_path is taken relative to
    the YAML's folder when the file is there, else as given (relative to the working directory).
    A workload without its own seed uses the run's seed. A bare name (``pp2_zipf``) that is not
    a file here is looked up in configs/runs/ (configs_dir.find_config)."""
    path = find_config(path, "runs")
    data = read_yaml_mapping(path, "run config")
    for key in data:
        if key not in RUN_KEYS:
            raise ValueError(f"run config {path}: unknown key {key!r} (known: {', '.join(RUN_KEYS)})")
    if "workload" not in data:
        raise ValueError(f"run config {path}: workload is required")
    wl = workload_section(data, path)
    try:
        engine = {k: data[k] for k in ENGINE_KEYS if k in data}
        return RunConfig(engine=engine, workload=WorkloadConfig.from_dict(wl),
                         schedulers=data.get("schedulers", SCHEDULER_POLICIES))
    except ValueError as exc:
        raise ValueError(f"run config {path}: {exc}") from None
