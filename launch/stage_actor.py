"""The Ray actor that hosts one pipeline stage's worker (one per stage × TP rank).

Created by launch/ray_executor.py's RayExecutor, which calls its set-up methods one at a time
and then leaves it in ``serve``, running the plans that arrive on its control connections:

    actor = StageActor.options(num_cpus=1, scheduling_strategy=...).remote(rank, topo, threads)
"""
from __future__ import annotations

import os
import pickle
import socket
import time

import ray

from pp_runtime.control import Connection, Listener
from pp_runtime.topology import Topology


def _unnice() -> None:
    """Ray starts worker processes at nice 15 so that its own daemons win the CPU; a stage
    worker *is* the compute, and at nice 15 every background process on its cores (Ray's own,
    the driver, the OS) preempts it. Back to 0 where allowed (raising priority may need
    CAP_SYS_NICE; embedded Ray is also started with worker_niceness 0)."""
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    except (PermissionError, OSError, AttributeError):
        pass


@ray.remote(concurrency_groups={"control": 1, "serve": 1})
class StageActor:
    """Hosts one StageWorker. Set-up calls run one at a time, in submission order; ``serve``
    then runs plans from its control connections on a thread of its own ("serve").

    ``ping`` and ``now`` run in a separate "control" thread, so a worker busy with a long
    micro-batch still answers them: liveness is told apart from slowness."""

    def __init__(self, rank: int, topo: Topology, threads: int) -> None:
        import torch
        self.rank, self.topo, self.threads = rank, topo, threads
        if threads:
            torch.set_num_threads(threads)
        _unnice()
        self.worker = None
        self.listener: Listener | None = None

    def address(self) -> tuple[str, int, str, int]:
        """(ip, a free port on this node, node id, pid) — rank 0's becomes the rendezvous."""
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        return ip, port, ray.get_runtime_context().get_node_id(), os.getpid()

    def setup(self, spec: object, backend: str, init_method: str) -> dict:
        import torch

        from pp_runtime.comm import P2P, init_distributed  # torch: in the worker, not the driver
        from stages.layers import TPContext
        from stages.worker import StageWorker
        if init_method.startswith("tcp://127."):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback-only clusters
        stage, tp_rank = self.topo.coords(self.rank)
        if spec.device.device == "cuda":
            torch.cuda.set_device(0)  # Ray exposes exactly this actor's GPU as device 0
        group = init_distributed(self.topo, self.rank, backend, init_method)
        device = torch.device("cuda", 0) if spec.device.device == "cuda" else torch.device("cpu")
        prev_rank = self.topo.rank(stage - 1, tp_rank) if stage > 0 else None
        next_rank = self.topo.rank(stage + 1, tp_rank) if stage < self.topo.pp - 1 else None
        link = P2P(prev_rank, next_rank, device, depth=self.topo.pp)
        self.worker = StageWorker(spec, TPContext(tp_rank, self.topo.tp, group), link)
        info = self.worker.info()
        info["node"] = ray.get_runtime_context().get_node_id()
        info["hostname"] = socket.gethostname()
        return info

    def memory_profile(self) -> object:
        return self.worker.memory_profile()

    def allocate_cache(self, num_blocks: int) -> int:
        return self.worker.allocate_cache(num_blocks)

    def open_control(self) -> tuple[str, int]:
        """Listen for this worker's control connections; their address (this node's IP)."""
        self.listener = Listener(ray.util.get_node_ip_address())
        return self.listener.address

    @ray.method(concurrency_group="serve")
    def serve(self, downstream: tuple[str, int] | None, replies: bool, timeout_s: float) -> int:
        """Run plans as they arrive until the stop plan (None); returns how many ran.

        Plans come from the driver (stage 0) or from the same TP rank of the stage before, and go
        on to ``downstream`` (the stage after) before this one computes, so the next stage has
        its plan when the activations arrive. With ``replies`` (the last stage's TP rank 0) the
        sampled tokens go back to the driver."""
        import torch
        if self.threads:
            torch.set_num_threads(self.threads)  # OpenMP's thread count is per calling thread
        down = Connection.connect(downstream, "plans", timeout_s) if downstream else None
        conns = dict(reversed(self.listener.accept(timeout_s)) for _ in range(1 + replies))
        self.listener.close()
        up, out = conns["plans"], conns.get("tokens")
        ran = 0
        try:
            while True:
                data = up.recv_bytes()  # no deadline: an idle deployment waits for its next run
                if down is not None:
                    down.send_bytes(data)
                wire = pickle.loads(data)
                if wire is None:
                    return ran
                tokens = self.worker.execute(wire)
                if out is not None:
                    out.send(tokens)
                ran += 1
        finally:
            for conn in (up, down, out):
                if conn is not None:
                    conn.close()

    def drain_timings(self) -> list:
        return self.worker.drain_timings()

    def drain_op_times(self) -> list:
        return self.worker.drain_op_times()

    @ray.method(concurrency_group="control")
    def now(self) -> float:
        return time.time()

    @ray.method(concurrency_group="control")
    def ping(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        import torch.distributed as dist
        if self.worker is not None:
            self.worker.link.flush()
        if dist.is_initialized():
            dist.destroy_process_group()
