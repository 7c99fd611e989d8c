"""More pp·tp workers than the Ray cluster can ever place: the run fails at once (not after the
placement timeout) with one line saying how many stages the cluster can place — a ValueError from
the API, exit status 2 from the CLI. Two loopback Ray nodes of 2 CPUs each, asked for pp=3 × tp=2
(three 2-CPU stages, one per node at most: two fit)."""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from launch.cli import main  # noqa: E402
from pp_runtime import LLM  # noqa: E402

MESSAGE = ("the Ray cluster cannot place 3×2 workers ({'CPU': 2.0} + {'CPU': 2.0} + {'CPU': 2.0}, a stage's 2 TP "
           "workers on one node): its nodes can place at most 2 such stage(s) (2 alive node(s): 2 CPU, 2 CPU)")
FAST_S = 10.0  # the placement timeout is 60 s: failing fast means well before it


@pytest.fixture(scope="module")
def two_small_nodes() -> Iterator[object]:
    from ray.cluster_utils import Cluster
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                     "node_ip_address": "127.0.0.1"})
    c.add_node(num_cpus=2, node_ip_address="127.0.0.1")
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


def test_api_raises_at_once_naming_what_fits(two_small_nodes: object) -> None:
    started = time.monotonic()
    with pytest.raises(ValueError) as e:
        LLM(model="llama-tiny", pp=3, tp=2, launcher="ray", memory_budget_gb=0.05)
    assert time.monotonic() - started < FAST_S
    assert str(e.value) == MESSAGE
    assert ray.util.placement_group_table() == {} or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
    assert ray.available_resources().get("CPU") == 4.0, "a failed start must give every CPU back"


def test_cli_exits_2_with_one_line(two_small_nodes: object, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt_token_ids": [1, 2, 3], "max_tokens": 2}\n')
    started = time.monotonic()
    rc = main(["generate", "--model", "llama-tiny", "--pp", "3", "--tp", "2", "--launcher", "ray",
               "--memory-budget-gb", "0.05", "--input", str(inp), "--quiet"])
    out, err = capsys.readouterr()
    assert time.monotonic() - started < FAST_S
    assert rc == 2 and out == ""
    assert err.splitlines() == [f"pp-runtime: error: {MESSAGE}"]
