"""The per-micro-batch path through a Ray compiled graph (embedded Ray: every worker on the
driver's node), used where its spinning readers cost no stage a core: same tokens as the local
launcher over several runs, and the reader thread keeps an execution's results together while
the driver's wait times out."""
from __future__ import annotations

import queue
import time
from dataclasses import replace

import pytest

ray = pytest.importorskip("ray")

from launch.ray_launch import _ResultReader  # noqa: E402
from pp_runtime import LLM, SamplingParams  # noqa: E402

PROMPTS = [list(range(3, 3 + n)) for n in (30, 12, 50, 7)]


def test_graph_only_where_waiting_costs_no_stage_a_core(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))  # 2 workers + 2: pays
    with LLM(model="llama-tiny", pp=2, launcher="ray", memory_budget_gb=0.05) as llm:
        assert llm.executor._use_graph
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(3)))
        assert not llm.executor._graph_pays()
        cfg = llm.executor.cfg  # threads=0 counts 1 per worker; 2 threads each need 2 × 2 + 2 cores
        llm.executor.cfg = replace(cfg, device=replace(cfg.device, threads=2))
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(5)))
        assert not llm.executor._graph_pays()


def test_compiled_graph_matches_local_over_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from launch.ray_launch import RayExecutor
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    with LLM(model="llama-tiny", memory_budget_gb=0.05, chunk_size=8) as one:
        expected = [o.token_ids for o in one.generate(PROMPTS, params)]
    monkeypatch.setattr(RayExecutor, "_graph_pays", lambda self: True)  # this box may lack the cores
    with LLM(model="llama-tiny", pp=2, launcher="ray", memory_budget_gb=0.05, chunk_size=8) as llm:
        outs = llm.generate(PROMPTS, params)
        assert llm.executor._dag is not None, "one node: the compiled graph should carry the plans"
        again = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=5, ignore_eos=True))  # same graph
    assert [o.token_ids for o in outs] == expected
    assert again[0].token_ids == expected[0][:5]


@ray.remote(num_cpus=0)
class Stage:
    def __init__(self, delay: float) -> None:
        self.delay = delay

    def step(self, x: int) -> int:
        time.sleep(self.delay)
        return x + 1


def test_reader_keeps_results_of_two_outputs_together_through_timeouts() -> None:
    """Two outputs, the second slow: a driver-side wait that times out between them must not
    lose the first (Ray's own timed-out read would; then results pair across executions)."""
    from ray.dag import InputNode, MultiOutputNode
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    try:
        fast, slow = Stage.remote(0.0), Stage.remote(0.3)
        with InputNode() as x:
            node = MultiOutputNode([fast.step.bind(x), slow.step.bind(x)])
        graph = node.experimental_compile(_max_inflight_executions=3)
        reader = _ResultReader()
        try:
            for i in (10, 20):
                reader.put(graph.execute(i))
            with pytest.raises(queue.Empty):
                reader.get(0.05)  # the first output is in, the second is not
            assert reader.get(30.0) == [11, 11]
            assert reader.get(30.0) == [21, 21]
        finally:
            graph.teardown()
            reader.close()
    finally:
        ray.shutdown()
