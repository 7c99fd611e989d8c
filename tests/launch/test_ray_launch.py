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


LOGPROBS = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def local_logprobs(hf_models: dict, reference: tuple) -> list:
    with LLM(model=str(hf_models["llama"]), memory_budget_gb=0.05) as llm:
        return llm.generate(reference[0][:3], LOGPROBS)


@pytest.mark.parametrize("pp,tp", SHAPES)
def test_parallel_greedy_matches_single_and_hf(cluster: object, hf_models: dict, reference: tuple,
                                               local_logprobs: list, pp: int, tp: int) -> None:
    prompts, expected = reference
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(model=str(hf_models["llama"]), pp=pp, tp=tp, launcher="ray", memory_budget_gb=0.05,
             max_batch_size=4) as llm:
        infos = llm.workers_info()
        for scheduler in ("sarathi", "orca"):
            for chunk in (5, 64):  # 5 divides none of the prompt lengths
                llm.reconfigure(policy=scheduler, chunk_size=chunk)
                llm.reset_prefix_cache()  # each setting prefills every prompt across the stages again
                outs = llm.generate(prompts, params)
                assert [o.token_ids for o in outs] == expected, (scheduler, chunk)
        # logprobs come back from the last stage's TP rank 0 with the tokens, as the local engine's
        outs = llm.generate(prompts[:3], LOGPROBS)
        for o, want in zip(outs, local_logprobs):
            assert o.token_ids == want.token_ids and [list(d) for d in o.logprobs] == [list(d) for d in want.logprobs]
            assert [v.logprob for d in o.logprobs for v in d.values()] == pytest.approx(
                [v.logprob for d in want.logprobs for v in d.values()], abs=1e-5)
    assert len(infos) == pp * tp
    nodes = {}
    for w in infos:
        nodes.setdefault(w["stage"], set()).add(w["node"])
    assert all(len(n) == 1 for n in nodes.values()), "a stage's TP workers must share a node"
    stage_nodes = [next(iter(nodes[s])) for s in range(pp)]
    assert len(set(stage_nodes)) == min(pp, 3), f"stages should spread over the 3 nodes: {stage_nodes}"
    hops = sum(a != b for a, b in zip(stage_nodes, stage_nodes[1:]))
    assert hops == len(set(stage_nodes)) - 1, f"a node's stages should be consecutive: {stage_nodes}"
    # Each worker holds only its layers and its TP shard of them.
    layer_bytes = [w["layer_weight_bytes"] for w in infos]
    with LLM(model=str(hf_models["llama"]), memory_budget_gb=0.05) as one:
        full = one.workers_info()[0]["layer_weight_bytes"]
    assert sum(layer_bytes) == pytest.approx(full, rel=0.01)
    assert max(layer_bytes) <= full / (pp * tp) * (1.01 if 4 % pp == 0 else 2)


def test_half_layer_partition_with_tensor_parallel_matches_hf(cluster: object, hf_models: dict,
                                                                reference: tuple) -> None:
    """A stage boundary inside layer 1 (its attention and KV on stage 0, its MLP on stage 1), each
    stage TP-sharded over 2 ranks: the same greedy tokens as Hugging Face."""
    prompts, expected = reference
    with LLM(model=str(hf_models["llama"]), pp=2, tp=2, launcher="ray", memory_budget_gb=0.05, max_batch_size=4,
             chunk_size=5, partition=(1.5, 2.5)) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        layers = sorted({(w["stage"], tuple(w["layers"])) for w in llm.workers_info()})
    assert [o.token_ids for o in outs] == expected
    assert layers == [(0, (0, 1.5)), (1, (1.5, 4))]


@pytest.mark.parametrize("pp, partition", ((2, None), (3, None), (2, (15.5, 14.5))))
def test_embedded_model_pipeline(cluster: object, pp: int, partition: tuple[float, ...] | None) -> None:
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 28], [504, 3575, 282, 4649, 314]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with LLM(memory_budget_gb=1.0, max_model_len=512) as one:
        expected = [o.token_ids for o in one.generate(prompts, params)]
    with LLM(pp=pp, launcher="ray", memory_budget_gb=1.0, max_model_len=512, chunk_size=3, partition=partition) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params)]
        layers = [w["layers"] for w in llm.workers_info()]
        nodes = {w["node"] for w in llm.workers_info()}
        assert len(nodes) > 1  # stages on several nodes: plans and tokens cross nodes on the control group
    assert got == expected
    assert layers[0][0] == 0 and layers[-1][1] == 30 and len(layers) == pp
    if partition:  # layer 15 cut after its attention: [0, 15.5) and [15.5, 30)
        assert [b - a for a, b in layers] == list(partition)


def test_consecutive_chunks_of_one_prompt_in_flight_together(cluster: object) -> None:
    """One long prompt fills a pp=2 pipeline: chunk k+1 is issued before chunk k returns."""
    prompt = list(range(3, 103))  # 100 tokens, chunk 16 -> 7 chunks
    with LLM(model="llama-tiny", pp=2, launcher="ray", chunk_size=16, memory_budget_gb=0.05) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0]
        history = {mb.mb_id: mb for mb in llm.engine.history}
        log = llm.engine.in_flight_log
    with LLM(model="llama-tiny", chunk_size=100, memory_budget_gb=0.05) as one:
        assert out.token_ids == one.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
    together = [ids for ids in log if len(ids) == 2
                and all(c.is_prefill and c.seq_id == 0 for i in ids for c in history[i].chunks)]
    assert len(together) >= 5, f"prefill chunks were not overlapped: {log}"


def test_cli_writes_workers_json_with_placement(cluster: object, tmp_path: object) -> None:
    from launch.cli import main
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "a", "prompt_token_ids": [5, 6, 7], "max_tokens": 3}\n')
    run_dir = tmp_path / "run"
    rc = main(["generate", "--model", "llama-tiny", "--pp", "2", "--tp", "2", "--launcher", "ray",
               "--memory-budget-gb", "0.05", "--input", str(inp), "--output", str(tmp_path / "out.jsonl"),
               "--run-dir", str(run_dir), "--quiet"])
    assert rc == 0
    import json
    workers = json.loads((run_dir / "workers.json").read_text())
    assert sorted((w["stage"], w["tp_rank"]) for w in workers) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(set(w) >= {"stage", "tp_rank", "pid", "node", "device"} for w in workers)
    node_of = {(w["stage"], w["tp_rank"]): w["node"] for w in workers}
    assert node_of[(0, 0)] == node_of[(0, 1)] and node_of[(1, 0)] == node_of[(1, 1)]
    assert node_of[(0, 0)] != node_of[(1, 0)]
    assert len({w["pid"] for w in workers}) == 4
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 1


def test_profile_in_a_ray_deployment(cluster: object, tmp_path: object) -> None:
    """`pp-runtime profile --pp 2 --tp 2` through Ray: each stage's TP rank 0 reports its layers'
    ops; the overheads around the steps come with it."""
    import json
    from launch.cli import main
    from tests.pp_runtime.test_profile_deploy import GRID, check_stage_csvs
    rc = main(["profile", "--model", "llama-tiny", "--pp", "2", "--tp", "2", "--launcher", "ray", "--grid", GRID,
               "--memory-budget-gb", "0.05", "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    check_stage_csvs(tmp_path, 2, GRID)
    summary = json.loads((tmp_path / "profile.json").read_text())
    assert summary["launcher"] == "ray" and summary["tp"] == 2 and len(summary["overheads_us"]["prep"]) == 2


def test_llm_dropped_without_shutdown_frees_its_placement(cluster: object) -> None:
    """An LLM garbage-collected unshut (no ``with``, no shutdown) frees its placement group and
    kills its actors, so a later LLM is not left waiting for resources that stay in use."""
    import gc
    llm = LLM(model="llama-tiny", pp=2, launcher="ray", memory_budget_gb=0.05)
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].finish_reason in ("length", "stop")
    pg_id = llm.executor.pg.id.hex()
    assert ray.util.placement_group_table()[pg_id]["state"] == "CREATED"
    del llm
    gc.collect()
    assert ray.util.placement_group_table()[pg_id]["state"] == "REMOVED"


def test_a_bad_checkpoint_fails_setup_with_the_workers_own_error(cluster: object, hf_models: dict,
                                                                  tmp_path: object) -> None:
    """A worker's ModelError (here: a tensor missing from the checkpoint) comes out as that error,
    as at pp = 1, not as Ray's remote traceback flattened into one line."""
    import shutil

    from safetensors.torch import load_file, save_file

    from stages.model_source import ModelError
    bad = tmp_path / "trunc"
    shutil.copytree(hf_models["llama"], bad)
    (st,) = bad.glob("*.safetensors")
    tensors = load_file(str(st))
    del tensors["model.layers.0.input_layernorm.weight"]
    save_file(tensors, str(st))
    with pytest.raises(ModelError) as e:
        LLM(model=str(bad), pp=2, launcher="ray", memory_budget_gb=0.05)
    assert str(e.value) == "checkpoint has no tensor model.layers.0.input_layernorm.weight"
