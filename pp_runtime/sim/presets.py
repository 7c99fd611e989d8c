"""Hardware and model presets of the simulator (configs/sim/hardware.yaml, configs/sim/models.yaml).

    hw = hardware_preset("a100-80gb")                  # Hardware
    m = model_preset("gpt3-175b")                      # SimModel
    hw = resolve_hardware({"preset": "a100-80gb", "efficiency": {"matmul": 0.6}})   # preset + overrides
    m.layer_weight_params, m.kv_bytes_per_token_per_layer(dtype_bytes=2)

A spec given to ``resolve_*`` is a preset name, or a mapping with every field, or a mapping with
``preset: NAME`` plus the fields to override (``efficiency`` is merged key by key).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

import yaml

from pp_runtime.config import HeadSizes
from pp_runtime.configs_dir import configs_dir

EFFICIENCY_KEYS = ("matmul", "memory", "attention", "allreduce", "network")


def _number(where: str, value: object, *, positive: bool = True, at_most: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} must be a number, got {value!r}")
    v = float(value)
    if v != v or (positive and v <= 0) or (not positive and v < 0) or (at_most is not None and v > at_most):
        bound = "> 0" if positive else "≥ 0"
        raise ValueError(f"{where} must be {bound}{f' and ≤ {at_most}' if at_most else ''}, got {value!r}")
    return v


@dataclass(frozen=True)
class Hardware:
    """One GPU type and the links around it (see configs/sim/hardware.yaml for the units)."""

    name: str
    memory_gb: float
    matmul_tflops: float
    mem_bw_gbs: float
    nvlink_gbs: float
    net_gbs: float
    nvlink_latency_us: float = 5.0
    net_latency_us: float = 5.0
    gpus_per_node: int = 8
    op_overhead_us: float = 4.0
    efficiency: dict = field(default_factory=lambda: {k: 1.0 for k in EFFICIENCY_KEYS})
    description: str = ""

    def __post_init__(self) -> None:
        for name in ("memory_gb", "matmul_tflops", "mem_bw_gbs", "nvlink_gbs", "net_gbs"):
            _number(f"hardware {self.name}: {name}", getattr(self, name))
        for name in ("nvlink_latency_us", "net_latency_us", "op_overhead_us"):
            _number(f"hardware {self.name}: {name}", getattr(self, name), positive=False)
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"hardware {self.name}: gpus_per_node must be a positive integer, got {self.gpus_per_node!r}")
        eff = dict(self.efficiency)
        for k in eff:
            if k not in EFFICIENCY_KEYS:
                raise ValueError(f"hardware {self.name}: unknown efficiency key {k!r} (known: {', '.join(EFFICIENCY_KEYS)})")
        full = {k: _number(f"hardware {self.name}: efficiency.{k}", eff.get(k, 1.0), at_most=1.0)
                for k in EFFICIENCY_KEYS}
        object.__setattr__(self, "efficiency", full)

    # rates in SI units, efficiency applied
    @property
    def flops(self) -> float:
        return self.matmul_tflops * 1e12 * self.efficiency["matmul"]

    @property
    def attn_flops(self) -> float:
        return self.matmul_tflops * 1e12 * self.efficiency["attention"]

    @property
    def mem_bw(self) -> float:
        return self.mem_bw_gbs * 1e9 * self.efficiency["memory"]

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    def allreduce_s(self, nbytes: float, ranks: int) -> float:
        """Ring all-reduce of ``nbytes`` over ``ranks`` GPUs of one node: 2(n−1)/n of the data
        crosses each link, 2(n−1) latency steps."""
        if ranks <= 1:
            return 0.0
        bw = self.nvlink_gbs * 1e9 * self.efficiency["allreduce"]
        return 2 * (ranks - 1) / ranks * nbytes / bw + 2 * (ranks - 1) * self.nvlink_latency_us * 1e-6

    def p2p_s(self, nbytes: float, inter_node: bool) -> float:
        """One point-to-point send: over the node's NIC between nodes, else NVLink."""
        if inter_node:
            return nbytes / (self.net_gbs * 1e9 * self.efficiency["network"]) + self.net_latency_us * 1e-6
        return nbytes / (self.nvlink_gbs * 1e9 * self.efficiency["allreduce"]) + self.nvlink_latency_us * 1e-6

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class SimModel(HeadSizes):
    """The shape of a decoder-only transformer, as far as costs and memory go."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    gated_mlp: bool = True
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    description: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size",
                     "vocab_size", "max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"model {self.name}: {name} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name}: num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")
        if self.head_dim == 0 and self.hidden_size % self.num_heads:
            raise ValueError(f"model {self.name}: head_dim must be given when num_heads does not divide hidden_size")

    @property
    def mlp_up_size(self) -> int:
        """Output width of the first MLP matmul (gate and up fused when gated)."""
        return self.intermediate_size * (2 if self.gated_mlp else 1)

    @property
    def op_params(self) -> dict[str, int]:
        """Weights of each linear op of one layer (whole model, before TP sharding)."""
        h = self.hidden_size
        return {"preproj": h * (self.q_size + 2 * self.kv_size), "postproj": self.q_size * h,
                "ffn_ln1": h * self.mlp_up_size, "ffn_ln2": self.intermediate_size * h}

    @property
    def layer_weight_params(self) -> int:
        return sum(self.op_params.values()) + 2 * self.hidden_size  # + the two norms

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def kv_bytes_per_token_per_layer(self, dtype_bytes: int, tp: int = 1) -> float:
        """K and V of one token in one layer on one TP rank (KV heads split over TP, replicated
        when there are fewer KV heads than ranks)."""
        heads = max(self.num_kv_heads / tp, 1.0)
        return 2 * heads * self.head_size * dtype_bytes

    def check_parallel(self, pp: int, tp: int) -> None:
        if pp > self.num_layers:
            raise ValueError(f"pp={pp} exceeds model {self.name}'s num_layers={self.num_layers}")
        for name in ("num_heads", "num_kv_heads"):
            if getattr(self, name) % tp:
                raise ValueError(f"tp={tp} does not divide model {self.name}'s {name}={getattr(self, name)}")

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# ---- loading ---------------------------------------------------------------------------------
def _presets(kind: str) -> dict[str, dict]:
    path = configs_dir() / "sim" / f"{kind}.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {kind} presets {path}: {exc.strerror}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of preset names")
    return data


def hardware_names() -> list[str]:
    return sorted(_presets("hardware"))


def model_names() -> list[str]:
    return sorted(_presets("models"))


def _build(cls: type, kind: str, name: str, data: Mapping[str, Any]) -> Any:
    known = {f.name for f in fields(cls)} - {"name"}
    for key in data:
        if key not in known:
            raise ValueError(f"{kind} {name}: unknown key {key!r} (known: {', '.join(sorted(known))})")
    return cls(name=name, **dict(data))


def _resolve(cls: type, kind: str, spec: str | Mapping[str, Any]) -> Any:
    presets = _presets(kind)
    if isinstance(spec, str):
        if spec not in presets:
            raise ValueError(f"unknown {kind[:-1] if kind.endswith('s') else kind} preset {spec!r} "
                             f"(known: {', '.join(sorted(presets))})")
        return _build(cls, kind, spec, presets[spec])
    if not isinstance(spec, Mapping):
        raise ValueError(f"{kind} must be a preset name or a mapping, got {spec!r}")
    spec = dict(spec)
    base_name = spec.pop("preset", None)
    if base_name is None:
        return _build(cls, kind, str(spec.pop("name", "custom")), spec)
    base = dict(_resolve(cls, kind, base_name).to_json())
    base.pop("name")
    if "efficiency" in spec and "efficiency" in base:
        spec["efficiency"] = {**base["efficiency"], **dict(spec["efficiency"])}
    return _build(cls, kind, str(spec.pop("name", base_name)), {**base, **spec})


def hardware_preset(name: str) -> Hardware:
    return _resolve(Hardware, "hardware", name)


def model_preset(name: str) -> SimModel:
    return _resolve(SimModel, "models", name)


def resolve_hardware(spec: str | Mapping[str, Any] | Hardware) -> Hardware:
    return spec if isinstance(spec, Hardware) else _resolve(Hardware, "hardware", spec)


def resolve_model(spec: str | Mapping[str, Any] | SimModel) -> SimModel:
    return spec if isinstance(spec, SimModel) else _resolve(SimModel, "models", spec)
