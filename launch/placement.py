"""Where the stage workers go: one placement-group bundle per stage, checked against the cluster.

A stage's TP workers share a bundle (so a node); SPREAD puts stages on different nodes when the
cluster has them. Where nodes get several stages, SPREAD alternates bundles over them (pp = 4 on
two nodes: A, B, A, B, three cross-node hops); ``stage_bundles`` hands stages to bundles node by
node instead (A, A, B, B: one hop, the activations of every other stage boundary stay on a node).
A cluster whose nodes could never host the stages fails at once, naming what fits; one that
could is waited for up to PLACEMENT_TIMEOUT_S.

    pg = place_stages(pp, tp, "cpu")
    bundle = stage_bundles(pg)[stage]  # where stage's tp workers go
"""
from __future__ import annotations

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

PLACEMENT_TIMEOUT_S = 60.0


def place_stages(pp: int, tp: int, device: str) -> object:
    """A ready placement group for pp stages of tp workers on ``device`` ("cuda" adds a GPU each)."""
    per_worker = {"CPU": 1.0} | ({"GPU": 1.0} if device == "cuda" else {})
    bundles = [{k: v * tp for k, v in per_worker.items()} for _ in range(pp)]
    what = (f"{pp}×{tp} workers ({' + '.join(str(b) for b in bundles)}, "
            f"a stage's {tp} TP workers on one node)")
    # Fail at once when the nodes' total resources could never host the stages; only a cluster
    # that could, in principle, is worth waiting for (its resources may be busy for a while).
    capacity = _placeable_stages(per_worker, tp)
    if capacity < pp:
        raise ValueError(f"the Ray cluster cannot place {what}: its nodes can place at most "
                         f"{capacity} such stage(s) ({_describe_nodes()})")
    pg = placement_group(bundles, strategy="SPREAD")
    if not pg.wait(PLACEMENT_TIMEOUT_S):
        remove_placement_group(pg)
        raise ValueError(f"the Ray cluster could not place {what} within {PLACEMENT_TIMEOUT_S:.0f} s: "
                         f"its nodes could host {capacity} such stage(s), but their resources stayed in use")
    return pg


def stage_bundles(pg: object) -> list[int]:
    """The bundle of each stage: bundles grouped by node, nodes in the order their first bundle
    comes, so consecutive stages share a node wherever the placement allows."""
    where = placement_group_table(pg)["bundles_to_node_id"]  # {bundle index: node id}
    first = {}
    for b in sorted(where):
        first.setdefault(where[b], b)
    return sorted(where, key=lambda b: (first[where[b]], b))


def _placeable_stages(per_worker: dict, tp: int) -> int:
    """How many stages of tp workers the alive nodes could host when idle (their total resources)."""
    total = 0
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        res = node.get("Resources", {})
        total += int(min(res.get(k, 0.0) // (v * tp) for k, v in per_worker.items()))
    return total


def _describe_nodes() -> str:
    """'2 alive node(s): 2 CPU, 2 CPU' — what a capacity was computed from."""
    alive = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    sizes = [f"{r.get('CPU', 0):g} CPU" + (f" {r['GPU']:g} GPU" if r.get("GPU") else "") for r in alive]
    return f"{len(alive)} alive node(s): {', '.join(sizes)}"
