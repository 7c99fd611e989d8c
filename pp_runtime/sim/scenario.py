"""What a simulation is: a SimConfig (one model, hardware and workload) and its Scenarios (one deployment each).

pp_runtime.sim.config builds them from configs/sim/*.yaml; a Scenario checks its own fields:

    from pp_runtime.sim.scenario import Scenario
    sc = Scenario(name="orca_pp8", scheduler="orca", tp=8, pp=8)   # ValueError naming a bad field
    sc.gpus                                                          # 64
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from pp_runtime.config import (ADMISSIONS, CHUNK_BUDGETS, DTYPE_BYTES, KV_ADMISSIONS, SCHEDULER_POLICIES,
                               are_step_costs)
from pp_runtime.sim.presets import Hardware, SimModel
from pp_runtime.sim.simulator import ROUTERS
from pp_runtime.workload_config import WorkloadConfig

BATCH_AUTO = ("auto", "auto_per_microbatch")


# Not pp_runtime.field_checks.check_int, which returns None and also takes numpy ints: these return
# the value (parse_sim_config stores it) and take plain int/float only.
def checked_int(where: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where} must be an integer ≥ {minimum}, got {value!r}")
    return value


def checked_number(where: str, value: object, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= minimum:
        raise ValueError(f"{where} must be a number ≥ {minimum}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Scenario:
    name: str
    scheduler: str
    tp: int = 1
    pp: int = 1
    replicas: int = 1
    router: str = "round_robin"
    chunk_size: int = 256
    max_batch_size: int | str = "auto"
    tile_align: bool = False
    partition: tuple[int, ...] | None = None
    dispatch_us: float = 0.0
    return_us: float = 0.0
    prep_us: float | tuple[float, ...] = 0.0
    max_running: int | None = None  # sequences that may run at once; None: max(max_batch_size, B), reserve: × pp
    chunk_budget: str = "flops"  # what sarathi's chunk_size counts, as SchedulerConfig.chunk_budget
    admission: str = "fcfs"  # the order waiting requests start in, as SchedulerConfig.admission
    # SchedulerConfig.step_costs: 3 numbers, or "fit" (fitted to a calibration run of this deployment's
    # own simulated step times, as the runtime's --step-costs fit does on real ones)
    step_costs: tuple[float, ...] | str = ()
    # as SchedulerConfig.kv_admission and CacheConfig.enable_prefix_caching; the defaults are the
    # paper's setup (B full-length requests, no prefix caching), not the runtime's
    kv_admission: str = "optimistic"
    enable_prefix_caching: bool = False

    def __post_init__(self) -> None:
        where = f"scenario {self.name!r}"
        if not isinstance(self.name, str) or not self.name or "/" in self.name or self.name.startswith("."):
            raise ValueError(f"scenario name must be a non-empty string usable as a directory name, got {self.name!r}")
        if self.scheduler not in SCHEDULER_POLICIES:
            raise ValueError(f"{where}: scheduler must be one of {', '.join(SCHEDULER_POLICIES)}, got {self.scheduler!r}")
        for k in ("tp", "pp", "replicas", "chunk_size"):
            checked_int(f"{where}: {k}", getattr(self, k))
        if self.router not in ROUTERS:
            raise ValueError(f"{where}: router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if isinstance(self.max_batch_size, str):
            if self.max_batch_size not in BATCH_AUTO:
                raise ValueError(f"{where}: max_batch_size must be an integer or one of {', '.join(BATCH_AUTO)}, "
                                 f"got {self.max_batch_size!r}")
        else:
            checked_int(f"{where}: max_batch_size", self.max_batch_size)
        if self.chunk_budget not in CHUNK_BUDGETS:
            raise ValueError(f"{where}: chunk_budget must be one of {', '.join(CHUNK_BUDGETS)}, got {self.chunk_budget!r}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"{where}: admission must be one of {', '.join(ADMISSIONS)}, got {self.admission!r}")
        if self.kv_admission not in KV_ADMISSIONS:
            raise ValueError(f"{where}: kv_admission must be one of {', '.join(KV_ADMISSIONS)}, "
                             f"got {self.kv_admission!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"{where}: enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        if self.step_costs != "fit":
            if not are_step_costs(self.step_costs):
                raise ValueError(f"{where}: step_costs must be 'fit' or 3 numbers ≥ 0 (prompt key, decode row, "
                                 f"decode key), got {self.step_costs!r}")
            object.__setattr__(self, "step_costs", tuple(float(c) for c in self.step_costs))
        if not isinstance(self.tile_align, bool):
            raise ValueError(f"{where}: tile_align must be true or false, got {self.tile_align!r}")
        if self.partition is not None:
            if not isinstance(self.partition, (list, tuple)) or len(self.partition) != self.pp:
                raise ValueError(f"{where}: partition must list {self.pp} layer counts, got {self.partition!r}")
            object.__setattr__(self, "partition", tuple(checked_int(f"{where}: partition", n) for n in self.partition))
        checked_number(f"{where}: dispatch_us", self.dispatch_us)
        checked_number(f"{where}: return_us", self.return_us)
        if isinstance(self.prep_us, (list, tuple)):
            if len(self.prep_us) != self.pp:
                raise ValueError(f"{where}: prep_us must be one number or {self.pp} (one per stage), "
                                 f"got {list(self.prep_us)}")
            object.__setattr__(self, "prep_us", tuple(checked_number(f"{where}: prep_us", x) for x in self.prep_us))
        else:
            checked_number(f"{where}: prep_us", self.prep_us)
        if self.max_running is not None:
            checked_int(f"{where}: max_running", self.max_running)

    @property
    def gpus(self) -> int:
        return self.replicas * self.pp * self.tp

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["partition"] = list(self.partition) if self.partition else None
        d["prep_us"] = list(self.prep_us) if isinstance(self.prep_us, tuple) else self.prep_us
        d["step_costs"] = list(self.step_costs) if isinstance(self.step_costs, tuple) else self.step_costs
        return d


@dataclass(frozen=True)
class SimConfig:
    name: str
    model: SimModel
    hardware: Hardware
    workload: WorkloadConfig
    scenarios: tuple[Scenario, ...]
    cost_model: dict = field(default_factory=lambda: {"kind": "roofline"})
    dtype: str = "bfloat16"
    nodes: int | None = None
    gpus_per_node: int = 8
    memory_utilization: float = 0.9
    memory_reserve_gb: float = 0.0
    block_size: int = 16
    max_model_len: int = 2048
    seed: int = 0
    base: str | None = None
    claims: tuple[dict, ...] = ()
    timings_tp_ranks: str = "all"
    trace_max_microbatches: int | None = None
    description: str = ""
    notes: tuple[str, ...] = ()
    path: str = ""

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def scenario(self, name: str) -> Scenario:
        for s in self.scenarios:
            if s.name == name:
                return s
        raise KeyError(name)

