"""From per-layer op times to pipeline stages: how long one pipeline stage takes to run one
micro-batch, and how long its activations take to reach the next stage.

A :class:`CostModel` (roofline_cost, profile_cost) gives per layer and TP rank the time of the
six ``OPS``, plus the embedding (first stage) and the LM head over the sampled rows (last
stage). :class:`PipelineCost` turns that into stage times (layers × per-layer time + two TP
all-reduces per layer) and PP send times; :class:`ConstantCost` gives fixed times, for tests and
hand-checked pipelines. Both are the :class:`StageCost` the SimExecutor asks.

    from pp_runtime.sim.stage_cost import PipelineCost
    pipe = PipelineCost(RooflineCostModel(model, hw), model, hw, pp=8, tp=8)
    compute_s, send_s = pipe.stage_times(micro_batch)
"""
from __future__ import annotations

from typing import Protocol, Sequence

from pp_runtime.batch import MicroBatch
from pp_runtime.sim.batch_shape import OPS, BatchShape
from pp_runtime.sim.presets import Hardware, SimModel


class CostModel(Protocol):
    """Per-layer, per-TP-rank op times (seconds, in ``OPS`` order) and the first/last-stage extras."""

    def layer_ops(self, shape: BatchShape, tp: int) -> tuple[float, ...]: ...
    def embed_s(self, shape: BatchShape, tp: int) -> float: ...
    def head_s(self, shape: BatchShape, tp: int) -> float: ...
    def describe(self) -> dict: ...


class StageCost(Protocol):
    """What the SimExecutor needs: per-stage compute seconds and per-boundary send seconds."""

    def stage_times(self, mb: MicroBatch) -> tuple[Sequence[float], Sequence[float]]: ...


class ConstantCost:
    """Every micro-batch takes ``stage_s`` on each stage (one value, or one per stage) and
    ``send_s`` between stages; optionally plus ``per_token_s`` × its tokens on every stage."""

    def __init__(self, stage_s: float | Sequence[float], send_s: float = 0.0, pp: int | None = None,
                 per_token_s: float = 0.0) -> None:
        if isinstance(stage_s, (int, float)):
            if pp is None:
                raise ValueError("ConstantCost needs pp when stage_s is one number")
            stage_s = [float(stage_s)] * pp
        self.stage = list(stage_s)
        self.send = [float(send_s)] * (len(self.stage) - 1)
        self.per_token = per_token_s

    def stage_times(self, mb: MicroBatch) -> tuple[list[float], list[float]]:
        if self.per_token:
            extra = self.per_token * mb.num_tokens
            return [s + extra for s in self.stage], self.send
        return self.stage, self.send


class PipelineCost:
    """Stage and send times of one replica (pp stages × tp ranks) from a per-layer cost model.

    Stage s runs ``layers[s]`` layers: each = the six ops + two all-reduces of the layer's
    [tokens, hidden] output over the stage's TP ranks (NVLink ring); the first stage adds the
    embedding, the last the LM head. ``cost`` is one model for every stage, or one per stage
    (an in-deployment profile: StageProfiles.per_stage). A send carries [tokens, hidden] from each TP rank to its
    peer on the next stage, over InfiniBand when the two stages sit on different nodes.
    """

    def __init__(self, cost: CostModel | Sequence[CostModel], model: SimModel, hw: Hardware, pp: int, tp: int,
                 layers: Sequence[int] | None = None, inter_node: Sequence[bool] | None = None,
                 dtype_bytes: int = 2) -> None:
        self.costs = list(cost) if isinstance(cost, (list, tuple)) else [cost] * pp
        if len(self.costs) != pp:
            raise ValueError(f"{len(self.costs)} stage cost models for pp={pp}")
        self.cost, self.model, self.hw, self.pp, self.tp, self.dt = self.costs[0], model, hw, pp, tp, dtype_bytes
        if layers is None:
            base, extra = divmod(model.num_layers, pp)
            layers = [base + (1 if s < extra else 0) for s in range(pp)]
        if len(layers) != pp or sum(layers) != model.num_layers:
            raise ValueError(f"layers per stage {list(layers)} must be {pp} counts summing to {model.num_layers}")
        self.layers = list(layers)
        self.inter_node = list(inter_node) if inter_node is not None else [True] * (pp - 1)
        self._uniform = len(set(self.layers)) == 1 and all(c is self.cost for c in self.costs)

    def describe(self) -> dict:
        if all(c is self.cost for c in self.costs):
            return self.cost.describe()
        return {"kind": "profile", "per_stage": [c.describe() for c in self.costs]}

    def breakdown(self, shape: BatchShape) -> dict[str, float]:
        """Seconds per op of one layer on one TP rank, plus its all-reduces."""
        ops = self.cost.layer_ops(shape, self.tp)
        out = dict(zip(OPS, ops))
        out["allreduce"] = self._allreduce(shape)
        return out

    def _allreduce(self, shape: BatchShape) -> float:
        if self.tp == 1 or shape.tokens == 0:
            return 0.0
        return 2 * self.hw.allreduce_s(shape.tokens * self.model.hidden_size * self.dt, self.tp)

    def shape_times(self, shape: BatchShape) -> tuple[list[float], list[float]]:
        ar = self._allreduce(shape)
        if self._uniform:
            compute = [self.layers[0] * (sum(self.cost.layer_ops(shape, self.tp)) + ar)] * self.pp
        else:
            compute = [n * (sum(c.layer_ops(shape, self.tp)) + ar) for n, c in zip(self.layers, self.costs)]
        compute[0] += self.costs[0].embed_s(shape, self.tp)
        compute[-1] += self.costs[-1].head_s(shape, self.tp)
        nbytes = shape.tokens * self.model.hidden_size * self.dt
        send = [self.hw.p2p_s(nbytes, x) for x in self.inter_node]
        return compute, send

    def stage_times(self, mb: MicroBatch) -> tuple[list[float], list[float]]:
        return self.shape_times(BatchShape.of(mb))
