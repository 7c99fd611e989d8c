"""torchrun entry: SPMD, every rank hosts one StageWorker, rank 0 also drives.

    torchrun --nproc-per-node 2 -m launch.torchrun_main --model llama-tiny --pp 2 \
        --input in.jsonl --output out.jsonl
    # two nodes on one machine: the same command twice with --nnodes 2 --node-rank {0,1}
    #   --master-addr 127.0.0.1 --master-port 29511

Rank 0 runs the engine; each plan goes to every other rank as a pickled byte tensor over a
gloo control group (non-blocking sends, so rank 0 keeps the pipeline full while the other
ranks work), and the last stage returns sampled tokens to rank 0 the same way. Activations
move over the default group (NCCL on CUDA, gloo on CPU) exactly as under Ray.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Callable
from collections import deque

import torch
import torch.distributed as dist

from pp_runtime.batch import MicroBatch
from pp_runtime.comm import P2P, ControlChannel, Topology, init_distributed
from pp_runtime.config import EngineConfig


def _build_worker(cfg: EngineConfig, source: object, topo: Topology) -> tuple[object, ControlChannel]:
    """Join the world (env:// from torchrun), create the TP and control groups, load the shard."""
    from stages.layers import TPContext
    from stages.worker import StageWorker, WorkerSpec
    rank = int(os.environ["RANK"])
    if int(os.environ["WORLD_SIZE"]) != topo.world_size:
        raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} processes but pp×tp = {topo.world_size}")
    if os.environ.get("MASTER_ADDR", "").startswith("127.") or os.environ.get("MASTER_ADDR") == "localhost":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # single-machine runs stay on loopback
    cuda = cfg.device.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    tp_group = init_distributed(topo, rank, "nccl" if cuda else "gloo", "env://")
    control = ControlChannel(dist.new_group(backend="gloo"))  # created on every rank, same order
    stage, tp_rank = topo.coords(rank)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    link = P2P(topo.rank(stage - 1, tp_rank) if stage else None,
               topo.rank(stage + 1, tp_rank) if stage < topo.pp - 1 else None, device)
    worker = StageWorker(WorkerSpec(source, stage, tp_rank, cfg.parallel, cfg.cache, cfg.device),
                         TPContext(tp_rank, topo.tp, tp_group), link)
    return worker, control


class TorchrunExecutor:
    """Rank 0's side: its own stage-0 worker plus the control channel to every other rank."""

    def __init__(self, cfg: EngineConfig, source: object) -> None:
        self.topo = Topology(cfg.parallel.pp, cfg.parallel.tp)
        self.worker, self.control = _build_worker(cfg, source, self.topo)
        self.last = self.topo.rank(self.topo.pp - 1, 0)
        self._in_flight: deque[tuple[MicroBatch, list[int] | None]] = deque()
        self._allocated = False

    def _others(self) -> range:
        return range(1, self.topo.world_size)

    def memory_profiles(self) -> list:
        out = [None] * self.topo.world_size
        dist.all_gather_object(out, self.worker.memory_profile(), group=self.control.group)
        return out

    def allocate_cache(self, num_blocks: int) -> int:
        """Broadcast the pool size, allocate, then gather every worker's info (mirrored by worker_loop)."""
        sizes = [num_blocks]
        dist.broadcast_object_list(sizes, src=0, group=self.control.group)
        nbytes = self.worker.allocate_cache(num_blocks)
        self._allocated = True
        self._infos: list = [None] * self.topo.world_size
        dist.all_gather_object(self._infos, self.worker.info(), group=self.control.group)
        return nbytes * self.topo.world_size

    def workers_info(self) -> list[dict]:
        return list(self._infos)

    def submit(self, mb: MicroBatch) -> None:
        wire = mb.to_wire()
        for r in self._others():
            self.control.send(("execute", wire), r)
        self._in_flight.append((mb, self.worker.execute(wire)))

    def collect(self) -> list[int]:
        mb, local = self._in_flight.popleft()
        if self.last == 0:
            return local
        return self.control.recv(self.last) if mb.num_samples else []

    def drain_timings(self) -> list[list]:
        return self._drain("timings", self.worker.drain_timings)

    def drain_op_times(self) -> list[list]:
        return self._drain("ops", self.worker.drain_op_times)

    def _drain(self, kind: str, local: Callable[[], list]) -> list[list]:
        out = [local()]
        for r in self._others():
            self.control.send((kind, None), r)
            out.append(self.control.recv(r))
        return out

    def ranks(self) -> list[tuple[int, int]]:
        return [self.topo.coords(r) for r in range(self.topo.world_size)]

    def clock_offsets(self) -> list[float]:
        from pp_runtime.timing import estimate_offset

        def remote_clock(r: int) -> float:
            self.control.send(("clock", None), r)
            return self.control.recv(r)
        return [0.0] + [estimate_offset(time.time, lambda r=r: remote_clock(r)) for r in self._others()]

    def shutdown(self) -> None:
        if not dist.is_initialized():
            return
        if not self._allocated:  # set-up failed on the driver: release ranks waiting for the pool size
            dist.broadcast_object_list([-1], src=0, group=self.control.group)
        for r in self._others() if self._allocated else ():
            self.control.send(("stop", None), r)
        self.control.flush()
        self.worker.link.flush()
        dist.destroy_process_group()


def worker_loop(cfg: EngineConfig, source: object) -> None:
    """Every rank but 0: mirror rank 0's set-up collectives, then run plans until told to stop."""
    topo = Topology(cfg.parallel.pp, cfg.parallel.tp)
    worker, control = _build_worker(cfg, source, topo)
    dist.all_gather_object([None] * topo.world_size, worker.memory_profile(), group=control.group)
    sizes = [0]
    dist.broadcast_object_list(sizes, src=0, group=control.group)
    if sizes[0] < 0:  # rank 0 gave up during set-up and reported why
        dist.destroy_process_group()
        return
    worker.allocate_cache(sizes[0])
    dist.all_gather_object([None] * topo.world_size, worker.info(), group=control.group)
    while True:
        kind, wire = control.recv(0, forever=True)  # between runs the driver may idle
        if kind == "stop":
            break
        if kind in ("timings", "ops", "clock"):  # answered in order, after every plan sent before it
            answer = {"timings": worker.drain_timings, "ops": worker.drain_op_times, "clock": time.time}[kind]
            control.send(answer(), 0)
            continue
        tokens = worker.execute(wire)
        if tokens is not None and topo.rank(topo.pp - 1, 0) == dist.get_rank() and wire[8]:  # it samples
            control.send(tokens, 0)
    control.flush()
    worker.link.flush()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    from launch.cli import main as cli_main
    from launch.parser import build_parser, engine_kwargs
    argv = list(sys.argv[1:] if argv is None else argv)
    if int(os.environ.get("RANK", "0")) == 0:
        return cli_main(["generate", "--launcher", "torchrun"] + argv)
    args = build_parser().parse_args(["generate", "--launcher", "torchrun", "--quiet"] + argv)
    from pp_runtime.engine_args import build_engine_config
    kwargs = engine_kwargs(args)
    for driver_only in ("launcher", "verbose"):
        kwargs.pop(driver_only)
    try:
        cfg, source = build_engine_config(**kwargs)
        worker_loop(cfg, source)
    except ValueError as e:  # a usage error (rank 0 reports the same); one line here too
        print(f"pp-runtime[rank {os.environ['RANK']}]: error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as e:  # e.g. rank 0 gone: its store or socket closed under us
        text = str(e).strip()
        print(f"pp-runtime[rank {os.environ['RANK']}]: error: {type(e).__name__}: "
              f"{text.splitlines()[0] if text else ''}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
