"""torchrun entry: SPMD, every rank hosts one StageWorker, rank 0 also drives.

    torchrun --nproc-per-node 2 -m launch.torchrun_main --model llama-tiny --pp 2 \
        --input in.jsonl --output out.jsonl
    # two nodes on one machine: the same command twice with --nnodes 2 --node-rank {0,1}
    #   --master-addr 127.0.0.1 --master-port 29511

Rank 0 runs the engine; each plan goes to every other rank as a pickled byte tensor over a
gloo control group (non-blocking sends, so rank 0 keeps the pipeline full while the other
ranks work), and the last stage returns sampled tokens to rank 0 the same way. Activations
move over the default group (NCCL on CUDA, gloo on CPU) exactly as under Ray.

Failures end on rank 0 as under Ray: a rank that dies or sends no tokens for the worker
timeout (60 s; ``PP_RUNTIME_WORKER_TIMEOUT_S``) is named in a WorkerError and every request
still gets its line. Ctrl-C and SIGTERM (torchrun's agent sends it to every rank when it is
stopped or a rank fails) are rank 0's to act on; the other ranks only note them and exit
quietly once rank 0 has gone.
"""
from __future__ import annotations

import datetime
import os
import re
import signal
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from pp_runtime.batch import MicroBatch, Sampled
from pp_runtime.comm import P2P, ControlChannel, init_distributed
from pp_runtime.config import EngineConfig
from pp_runtime.executor import WorkerError
from pp_runtime.topology import Topology
from pp_runtime.workers import worker_timeout_s


def _build_worker(cfg: EngineConfig, source: object, topo: Topology,
                  timeout_s: float) -> tuple[object, ControlChannel]:
    """Join the world (env:// from torchrun), create the TP and control groups, load the shard."""
    from stages.layers import TPContext
    from stages.worker import StageWorker
    from stages.worker_spec import WorkerSpec
    rank = int(os.environ["RANK"])
    if int(os.environ["WORLD_SIZE"]) != topo.world_size:
        raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} processes but pp×tp = {topo.world_size}")
    if os.environ.get("MASTER_ADDR", "").startswith("127.") or os.environ.get("MASTER_ADDR") == "localhost":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # single-machine runs stay on loopback
    cuda = cfg.device.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # the group's timeout bounds set-up's collectives (weights loading on every rank) and the TP
    # all-reduces; the control channel's, a step's tokens
    tp_group = init_distributed(topo, rank, "nccl" if cuda else "gloo", "env://", max(300.0, timeout_s))
    control = ControlChannel(dist.new_group(backend="gloo"),  # created on every rank, same order
                             datetime.timedelta(seconds=timeout_s), depth=topo.pp)
    stage, tp_rank = topo.coords(rank)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    link = P2P(topo.rank(stage - 1, tp_rank) if stage else None,
               topo.rank(stage + 1, tp_rank) if stage < topo.pp - 1 else None, device, depth=topo.pp)
    worker = StageWorker(WorkerSpec(source, stage, tp_rank, cfg.parallel, cfg.cache, cfg.device),
                         TPContext(tp_rank, topo.tp, tp_group), link)
    return worker, control


class TorchrunExecutor:
    """Rank 0's side: its own stage-0 worker plus the control channel to every other rank."""

    def __init__(self, cfg: EngineConfig, source: object) -> None:
        self.topo = Topology(cfg.parallel.pp, cfg.parallel.tp)
        self.timeout_s = worker_timeout_s()
        self.worker, self.control = _build_worker(cfg, source, self.topo, self.timeout_s)
        self.last = self.topo.rank(self.topo.pp - 1, 0)
        self._in_flight: deque[tuple[MicroBatch, list[int] | None]] = deque()
        self._allocated = False
        self._infos: list = []
        self.failed = False  # a rank died or hung: no goodbye to send, nothing to flush

    @contextmanager
    def _talking_to(self, rank: int, what: str) -> Iterator[None]:
        """Turn gloo's error for a dead or silent peer into a WorkerError naming the rank at fault:
        one on this node that is gone or stopped, else ``rank``, the one this call waited on."""
        try:
            yield
        except RuntimeError as e:
            if not _from_comm(e):  # this rank's own step failed: not a peer's doing
                raise
            self._failing()
            state, culprit = _local_fault(self._infos) or ("", rank)
            # gloo's "[…/pair.cc:553] Connection closed by peer [addr]:port. This is typically…"
            text = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip()).split(". ")[0].splitlines()[0]
            if "Timed out" in text or state == "stopped":
                raise WorkerError(f"{self._name(culprit)} did not answer within {self.timeout_s:.0f} s "
                                  f"({what})") from None
            raise WorkerError(f"{self._name(culprit)} died during {what}: {text}") from None

    def fault(self) -> WorkerError | None:
        """After a signal: the rank on this node that died or stopped, as the WorkerError a wait on
        it would have raised, else None. torchrun's agent SIGTERMs every rank once one has died, and
        that can reach rank 0 before any wait of its own failed (a CI run on a slow box saw it):
        the run then ended by the worker's death, not by a user's SIGTERM."""
        found = _local_fault(self._infos) if self._infos else None
        if found is None:
            return None
        self._failing()
        state, rank = found
        if state == "stopped":
            return WorkerError(f"{self._name(rank)} is stopped (SIGSTOP or a debugger), and the run was signalled")
        return WorkerError(f"{self._name(rank)} died: its process is gone, and torchrun's agent stopped the run")

    def _failing(self) -> None:
        """A rank failed and this run ends with its error. torchrun's agent SIGTERMs every rank once
        one has failed; what finished must be written first (the agent kills after its grace)."""
        self.failed = True
        if threading.current_thread() is threading.main_thread():  # signal.signal's rule
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def _name(self, rank: int) -> str:
        stage, tp_rank = self.topo.coords(rank)
        info = self._infos[rank] if self._infos else None
        where = f" on node {info['node']} (pid {info['pid']})" if info else ""
        return f"worker stage {stage} tp_rank {tp_rank}{where}"

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
            with self._talking_to(r, "plan delivery"):
                self.control.send(("execute", wire), r)
        # this rank's own stage: its sends to the next stage and its TP all-reduces
        with self._talking_to(self.topo.rank(1, 0) if self.topo.pp > 1 else 1, "micro-batch"):
            self._in_flight.append((mb, self.worker.execute(wire)))

    def collect(self) -> Sampled:
        mb, local = self._in_flight.popleft()
        if self.last == 0:
            return local
        with self._talking_to(self.last, "micro-batch"):
            return self.control.recv(self.last) if mb.num_samples else []

    def drain_timings(self) -> list[list]:
        return self._drain("timings", self.worker.drain_timings)

    def drain_op_times(self) -> list[list]:
        return self._drain("ops", self.worker.drain_op_times)

    def _drain(self, kind: str, local: Callable[[], list]) -> list[list]:
        out = [local()]
        for r in self._others():
            with self._talking_to(r, kind):
                self.control.send((kind, None), r)
                out.append(self.control.recv(r))
        return out

    def ranks(self) -> list[tuple[int, int]]:
        return [self.topo.coords(r) for r in range(self.topo.world_size)]

    def clock_offsets(self) -> list[float]:
        from pp_runtime.timing import estimate_offset

        def remote_clock(r: int) -> float:
            with self._talking_to(r, "clock"):
                self.control.send(("clock", None), r)
                return self.control.recv(r)
        return [0.0] + [estimate_offset(time.time, lambda r=r: remote_clock(r)) for r in self._others()]

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every rank's loop and leave the process groups. After a failure or an interrupt
        (``graceful`` False: a plan may have reached only some ranks) nothing is sent: the other
        ranks end when this process exits and their connections to it close."""
        if not dist.is_initialized():
            return
        if not graceful or self.failed:
            self.failed = True
            return
        if not self._allocated:  # set-up failed on the driver: release ranks waiting for the pool size
            dist.broadcast_object_list([-1], src=0, group=self.control.group)
        for r in self._others() if self._allocated else ():
            with self._talking_to(r, "shutdown"):
                self.control.send(("stop", None), r)
        with self._talking_to(1 if self.topo.world_size > 1 else 0, "shutdown"):
            self.control.flush()
            self.worker.link.flush()
        dist.destroy_process_group()


def _from_comm(e: RuntimeError) -> bool:
    """Whether ``e`` is gloo's or NCCL's: a peer closed its connection or did not answer in time."""
    text = str(e)
    return any(mark in text for mark in ("gloo", "NCCL", "Connection closed", "Timed out", "pair closure"))


def _local_fault(infos: list[dict]) -> tuple[str, int] | None:
    """("died" or "stopped", rank) of the first rank on this node whose process is gone or
    stopped (SIGSTOP, a debugger), read from /proc; None where none is or nothing is known."""
    here = os.uname().nodename
    for rank, info in enumerate(infos):
        if rank == 0 or info.get("node") != here:
            continue
        try:
            with open(f"/proc/{info['pid']}/stat") as f:
                state = f.read().rsplit(")", 1)[-1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return "died", rank
        if state in "ZXx":
            return "died", rank
        if state in "Tt":
            return "stopped", rank
    return None


def _note_signals() -> list[int]:
    """Ctrl-C reaches every process of the terminal's group, and torchrun's agent SIGTERMs every
    rank: rank 0 acts (writes what finished and exits, which ends the waits here); this rank only
    notes the signal, to end quietly with its status once rank 0 is gone."""
    caught: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: caught.append(signum))
    return caught


def _signal_noted(caught: list[int], grace_s: float = 1.0) -> bool:
    """Whether this rank was signalled too, given the moment for its handler to run: a group's
    Ctrl-C reaches every rank at once, but rank 0's exit can fail a wait here before this rank's
    handler has run (a CI run saw it once), which then read as a crash. A sleep runs
    pending handlers; a rank 0 that really crashed costs this rank a second before it says so."""
    deadline = time.monotonic() + grace_s
    while not caught and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(caught)


def worker_loop(cfg: EngineConfig, source: object) -> None:
    """Every rank but 0: mirror rank 0's set-up collectives, then run plans until told to stop."""
    topo = Topology(cfg.parallel.pp, cfg.parallel.tp)
    worker, control = _build_worker(cfg, source, topo, worker_timeout_s())
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
    caught = _note_signals()
    try:
        cfg, source = build_engine_config(**kwargs)
        worker_loop(cfg, source)
    except ValueError as e:  # a usage error (rank 0 reports the same); one line here too
        print(f"pp-runtime[rank {os.environ['RANK']}]: error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as e:  # e.g. rank 0 gone: its store or socket closed under us
        if _signal_noted(caught):  # rank 0 went because it was told to: nothing here to report
            return 128 + caught[0]
        text = str(e).strip()
        print(f"pp-runtime[rank {os.environ['RANK']}]: error: {type(e).__name__}: "
              f"{text.splitlines()[0] if text else ''}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
