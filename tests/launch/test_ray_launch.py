"""Ray launcher on a simulated multi-node cluster (ray.cluster_utils.Cluster, loopback only):
greedy outputs for several (pp, tp) equal pp=tp=1 and Hugging Face; placement keeps a stage's
TP workers on one node and spreads stages over nodes."""
from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from pp_runtime import LLM, SamplingParams  # noqa: E402
from tests.conftest import hf_greedy, mixed_prompts  # noqa: E402

MAX_NEW = 10
SHAPES = ((2, 1), (3, 1), (4, 1), (1, 2), (2, 2))


@pytest.fixture(scope="module")
def cluster() -> object:
    from ray.cluster_utils import Cluster
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False,
                                                     "node_ip_address": "127.0.0.1"})
    for _ in range(2):
        c.add_node(num_cpus=4, node_ip_address="127.0.0.1")
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def reference(hf_models: dict) -> tuple:
    prompts = mixed_prompts()
    expected = hf_greedy(hf_models["llama"], prompts, MAX_NEW)
    with LLM(model=str(hf_models["llama"]), chunk_size=5, memory_budget_gb=0.05) as llm:
        local = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))]
    assert local == expected
    return prompts, expected


@pytest.mark.parametrize("pp,tp", SHAPES)
def test_parallel_greedy_matches_single_and_hf(cluster: object, hf_models: dict, reference: tuple,
                                               pp: int, tp: int) -> None:
    prompts, expected = reference
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(model=str(hf_models["llama"]), pp=pp, tp=tp, launcher="ray", memory_budget_gb=0.05,
             max_batch_size=4) as llm:
        infos = llm.workers_info()
        for scheduler in ("sarathi", "orca"):
            for chunk in (5, 64):  # 5 divides none of the prompt lengths
                llm.reconfigure(policy=scheduler, chunk_size=chunk)
                outs = llm.generate(prompts, params)
                assert [o.token_ids for o in outs] == expected, (scheduler, chunk)
    assert len(infos) == pp * tp
    nodes = {}
    for w in infos:
        nodes.setdefault(w["stage"], set()).add(w["node"])
    assert all(len(n) == 1 for n in nodes.values()), "a stage's TP workers must share a node"
    stage_nodes = [next(iter(nodes[s])) for s in range(pp)]
    assert len(set(stage_nodes)) == min(pp, 3), f"stages should spread over the 3 nodes: {stage_nodes}"
    # Each worker holds only its layers and its TP shard of them.
    layer_bytes = [w["layer_weight_bytes"] for w in infos]
    with LLM(model=str(hf_models["llama"]), memory_budget_gb=0.05) as one:
        full = one.workers_info()[0]["layer_weight_bytes"]
    assert sum(layer_bytes) == pytest.approx(full, rel=0.01)
    assert max(layer_bytes) <= full / (pp * tp) * (1.01 if 4 % pp == 0 else 2)


@pytest.mark.parametrize("pp", (2, 3))
def test_embedded_model_pipeline(cluster: object, pp: int) -> None:
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 28], [504, 3575, 282, 4649, 314]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with LLM(memory_budget_gb=1.0, max_model_len=512) as one:
        expected = [o.token_ids for o in one.generate(prompts, params)]
    with LLM(pp=pp, launcher="ray", memory_budget_gb=1.0, max_model_len=512, chunk_size=3) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params)]
        layers = [w["layers"] for w in llm.workers_info()]
    assert got == expected
    assert layers[0][0] == 0 and layers[-1][1] == 30 and len(layers) == pp
