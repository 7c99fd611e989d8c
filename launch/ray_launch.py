"""Ray launcher: one actor per (stage, TP rank), placed by a placement group.

The placement group has one bundle per stage holding that stage's tp workers, with the
SPREAD strategy: a stage's TP workers always share a node (they share a bundle), and stages
land on different nodes when the cluster has them. Activations never go through Ray: the
actors form one torch.distributed world (NCCL on CUDA, gloo on CPU) whose rendezvous the
driver places on rank 0's node; Ray carries only the compact plans and the sampled tokens.

Per micro-batch, Ray is not on the path at all: plans and tokens go over a gloo control group
of the workers and the driver. The driver sends each plan's pickled bytes to stage 0, every stage
forwards them to the next before it computes, and the last stage sends the sampled tokens back;
each worker runs a ``serve`` loop that blocks in gloo's receive (no spinning) until the next
plan. Two actor-task RPCs per micro-batch cost the driver ~1.5 ms and the control plane 6.9-7.5%
of a pp = 2 step on the 2-core box; a Ray compiled graph got that to 4.2-4.5% but its channel
readers spin, costing 7% of throughput there, and deadlocks across nodes with more than one
micro-batch in flight (ray-project/ray#49044). The control group is plain TCP, so it works the
same within a node and across nodes (docs/BENCHMARKS.md, target 5).

    executor = RayExecutor(engine_config, model_source)   # embedded Ray, or RAY_ADDRESS
"""
from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import threading
import time
from typing import Iterator

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pp_runtime.batch import MicroBatch
from pp_runtime.comm import (P2P, TOKEN_TAG, ControlChannel, Topology, control_group, control_store,
                             init_distributed)
from pp_runtime.config import EngineConfig
from pp_runtime.executor import WorkerError

PLACEMENT_TIMEOUT_S = 60.0
POLL_S = 0.5  # how often a driver waiting for tokens checks that every serve loop still runs


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
    then runs plans from the control group on a thread of its own ("serve").

    ``ping`` and ``now`` run in a separate "control" thread, so a worker busy with a long
    micro-batch still answers them: liveness is told apart from slowness."""

    def __init__(self, rank: int, topo: Topology, threads: int) -> None:
        import torch
        self.rank, self.topo, self.threads = rank, topo, threads
        if threads:
            torch.set_num_threads(threads)
        _unnice()
        self.worker = None
        self.control: ControlChannel | None = None

    def address(self) -> tuple[str, int, str, int]:
        """(ip, a free port on this node, node id, pid) — rank 0's becomes the rendezvous."""
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        return ip, port, ray.get_runtime_context().get_node_id(), os.getpid()

    def setup(self, spec: object, backend: str, init_method: str) -> dict:
        import torch
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
        self.worker = StageWorker(spec, TPContext(tp_rank, self.topo.tp, group), P2P(prev_rank, next_rank, device))
        info = self.worker.info()
        info["node"] = ray.get_runtime_context().get_node_id()
        info["hostname"] = socket.gethostname()
        return info

    def memory_profile(self) -> object:
        return self.worker.memory_profile()

    def allocate_cache(self, num_blocks: int) -> int:
        return self.worker.allocate_cache(num_blocks)

    def join_control(self, host: str, port: int, timeout_s: float) -> None:
        """Join the driver's control group (it is the last rank, after every worker)."""
        store = control_store(host, port, timeout_s)
        self.control = ControlChannel(control_group(store, self.rank, self.topo.world_size + 1,
                                                    ray.util.get_node_ip_address(), timeout_s))

    @ray.method(concurrency_group="serve")
    def serve(self) -> int:
        """Run plans from the control group until the stop plan (None); returns how many ran.

        A plan comes from the driver (stage 0) or from the same TP rank of the stage before, and
        goes on to the stage after before this one computes, so the next stage has it when the
        activations arrive. The last stage's TP rank 0 sends the sampled tokens to the driver."""
        import torch
        if self.threads:
            torch.set_num_threads(self.threads)  # OpenMP's thread count is per calling thread
        stage, tp_rank = self.topo.coords(self.rank)
        driver = self.topo.world_size
        src = driver if stage == 0 else self.topo.rank(stage - 1, tp_rank)
        dst = self.topo.rank(stage + 1, tp_rank) if stage < self.topo.pp - 1 else None
        replies = dst is None and tp_rank == 0
        ran = 0
        while True:
            data = self.control.recv_raw(src, forever=True)
            if dst is not None:
                self.control.send_raw(data, dst)
            wire = self.control.decode(data)
            if wire is None:
                if replies:
                    self.control.send(None, driver, TOKEN_TAG)  # ends the driver's token reader
                break
            tokens = self.worker.execute(wire)
            if replies:
                self.control.send(tokens, driver, TOKEN_TAG)
            ran += 1
        self.control.flush()
        return ran

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
        self.control = None
        if dist.is_initialized():
            dist.destroy_process_group()


class RayExecutor:
    def __init__(self, cfg: EngineConfig, source: object, timeout_s: float = 60.0) -> None:
        from stages.worker import WorkerSpec
        self.cfg, self.timeout_s = cfg, timeout_s
        self.topo = Topology(cfg.parallel.pp, cfg.parallel.tp)
        self._owns_ray = _ensure_ray(self.topo.world_size)
        self.actors: list = []
        self.pg = None
        self.failed = False  # a worker died or hung: skip the graceful part of shutdown
        self.control: ControlChannel | None = None  # the driver's end of the control group
        self._reader: _TokenReader | None = None
        self._serving: list = []  # each worker's serve() call
        try:
            self.pg = self._place()
            threads = cfg.device.threads or 1
            gpu = 1 if cfg.device.device == "cuda" else 0
            for rank in range(self.topo.world_size):
                stage, _ = self.topo.coords(rank)
                strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=stage)
                self.actors.append(StageActor.options(num_cpus=1, num_gpus=gpu, scheduling_strategy=strategy)
                                   .remote(rank, self.topo, threads))
            addrs = self._get([a.address.remote() for a in self.actors], "start")
            backend = "nccl" if cfg.device.device == "cuda" else "gloo"
            init = f"tcp://{addrs[0][0]}:{addrs[0][1]}"
            specs = [WorkerSpec(source, *self.topo.coords(r), cfg.parallel, cfg.cache, cfg.device)
                     for r in range(self.topo.world_size)]
            self.infos = self._get([a.setup.remote(specs[r], backend, init) for r, a in enumerate(self.actors)],
                                   "set-up", timeout=max(300.0, timeout_s))
            self._connect()
        except BaseException:
            self.shutdown()
            raise

    def _connect(self) -> None:
        """Build the control group (workers, then the driver as the last rank; the driver serves
        its store) and start every worker's serve loop."""
        ip = ray.util.get_node_ip_address()
        store = control_store(ip, 0, self.timeout_s)
        joins = [a.join_control.remote(ip, store.port, self.timeout_s) for a in self.actors]
        # Construction waits for every worker to join (a worker that fails to join fails it at timeout_s).
        self.control = ControlChannel(control_group(store, self.topo.world_size, self.topo.world_size + 1, ip,
                                                    self.timeout_s))
        self._get(joins, "control group set-up")
        self._serving = [a.serve.remote() for a in self.actors]
        self._reader = _TokenReader(self.control, self.topo.rank(self.topo.pp - 1, 0))

    # ---- placement ---------------------------------------------------------------------------
    def _place(self) -> object:
        pp, tp = self.topo.pp, self.topo.tp
        per_worker = {"CPU": 1.0} | ({"GPU": 1.0} if self.cfg.device.device == "cuda" else {})
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

    # ---- executor interface --------------------------------------------------------------------
    def workers_info(self) -> list[dict]:
        return list(self.infos)

    def memory_profiles(self) -> list:
        return self._get([a.memory_profile.remote() for a in self.actors], "memory profile")

    def allocate_cache(self, num_blocks: int) -> int:
        return sum(self._get([a.allocate_cache.remote(num_blocks) for a in self.actors], "cache allocation"))

    def submit(self, mb: MicroBatch) -> None:
        data = self.control.encode(mb.to_wire())  # pickled once, sent to each of stage 0's TP ranks
        for rank in self.topo.tp_ranks(0):
            self.control.send_raw(data, rank)

    def collect(self) -> list[int]:
        """The oldest micro-batch's tokens. While they are not there, the serve loops are checked
        every POLL_S (one that ended raised: its error is reported) and every worker is pinged
        every ``timeout_s`` (a dead or hung one raises WorkerError naming it)."""
        waited = 0.0
        while True:
            try:
                return self._reader.get(POLL_S)
            except queue.Empty:
                self._check_serving("micro-batch")
                waited += POLL_S
                if waited >= self.timeout_s:
                    self._check_alive("micro-batch", self.timeout_s)
                    waited = 0.0
            except RuntimeError as e:  # gloo: the last stage's connection broke
                self._check_serving("micro-batch")
                raise self._died(self._name(self.topo.rank(self.topo.pp - 1, 0)), "micro-batch",
                                 self.timeout_s, e) from None

    def _check_serving(self, what: str) -> None:
        """Raise WorkerError for a serve loop that has ended (only the stop plan may end one)."""
        done, _ = ray.wait(self._serving, num_returns=len(self._serving), timeout=0)
        for rank, ref in enumerate(self._serving):
            if ref not in done:
                continue
            try:
                ray.get(ref, timeout=0)
                error = "stopped serving plans"
            except ray.exceptions.RayActorError as e:
                raise self._died(self._name(rank), what, self.timeout_s, e) from None
            except Exception as e:  # its step raised, or its link broke because another worker died
                self.failed = True
                self._check_alive(what, self.timeout_s)  # a dead worker is the cause: name it
                error = f"failed: {_first_line(e)}"
            self.failed = True
            raise WorkerError(f"{self._name(rank)} {error} during {what}")

    def drain_timings(self) -> list[list]:
        return self._get([a.drain_timings.remote() for a in self.actors], "timings")

    def drain_op_times(self) -> list[list]:
        return self._get([a.drain_op_times.remote() for a in self.actors], "op times")

    def ranks(self) -> list[tuple[int, int]]:
        return [self.topo.coords(r) for r in range(self.topo.world_size)]

    def clock_offsets(self) -> list[float]:
        """Each worker's clock minus the driver's, NTP-style over Ray round trips (nodes of a
        real cluster do not share a clock)."""
        from pp_runtime.timing import estimate_offset
        return [estimate_offset(time.time, lambda a=a: ray.get(a.now.remote(), timeout=self.timeout_s))
                for a in self.actors]

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the serve loops and the process groups (graceful), then kill every actor and free
        the placement. A failed or interrupted run kills the actors first: a hung or mid-plan
        worker would never end its serve loop, and the kill breaks the driver's pending receive."""
        if self.control is not None:
            if graceful and not self.failed:
                try:
                    for rank in self.topo.tp_ranks(0):
                        self.control.send(None, rank)  # the stop plan, forwarded stage to stage
                    self.control.flush()
                    ray.get(self._serving, timeout=10)
                except Exception:  # a worker that cannot stop its loop is killed below
                    self.failed = True
            if not graceful or self.failed:
                for a in self.actors:
                    ray.kill(a)
            self._reader.close()
            self.control = None  # after the kills: nothing waits on the group when it goes
        if self.actors:
            try:
                if graceful and not self.failed:
                    ray.get([a.shutdown.remote() for a in self.actors], timeout=10)
            except Exception:  # a dead or hung worker cannot say goodbye; kill it below
                pass
            for a in self.actors:
                ray.kill(a)
            self.actors = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False

    # ---- helpers -------------------------------------------------------------------------------
    def _get(self, refs: list, what: str, timeout: float | None = None) -> list:
        """ray.get that names the worker when one died or stopped answering.

        A result may take long (a huge orca prefill on CPU); every ``timeout`` seconds without
        one, every worker is pinged on its control thread, and only a worker that does not
        answer a ping within ``timeout`` counts as hung. A dead one fails its ping at once."""
        timeout = timeout or self.timeout_s
        out = []
        for rank, ref in enumerate(refs):
            while True:
                try:
                    out.append(ray.get(ref, timeout=timeout))
                    break
                except ray.exceptions.GetTimeoutError:
                    self._check_alive(what, timeout)
                except (ray.exceptions.RayActorError, ray.exceptions.RayChannelError) as e:
                    raise self._died(self._name(rank), what, timeout, e) from None
        return out

    def _died(self, who: str, what: str, timeout: float, e: Exception) -> WorkerError:
        """The error for a worker that died. Its peers' connections break when any worker dies,
        so the pings name the one that did (raising) before ``who`` is blamed."""
        self.failed = True
        self._check_alive(what, timeout)
        return WorkerError(f"{who} died during {what}: {str(e).splitlines()[0]}")

    def _check_alive(self, what: str, timeout: float) -> None:
        pings = [a.ping.remote() for a in self.actors]
        done, _ = ray.wait(pings, num_returns=len(pings), timeout=timeout)
        for rank, ref in enumerate(pings):
            try:
                if ref not in done:
                    raise ray.exceptions.GetTimeoutError()
                ray.get(ref, timeout=0)
            except ray.exceptions.GetTimeoutError:
                self.failed = True
                raise WorkerError(f"{self._name(rank)} did not answer within {timeout:.0f} s ({what})") from None
            except ray.exceptions.RayActorError as e:
                self.failed = True
                raise WorkerError(f"{self._name(rank)} died during {what}: {str(e).splitlines()[0]}") from None

    def _name(self, rank: int) -> str:
        stage, tp_rank = self.topo.coords(rank)
        info = getattr(self, "infos", None)
        node = f" on node {info[rank]['node'][:12]}" if info else ""
        return f"worker stage {stage} tp_rank {tp_rank}{node}"


class _TokenReader:
    """Receives the last stage's tokens, one message per micro-batch, on a thread of its own:
    gloo's wait cannot be interrupted, so the driver waits on a queue instead, where timeouts
    (liveness checks) and Ctrl-C are harmless. It ends at the stop plan's goodbye (None) or when
    a worker's connection breaks (after a kill)."""

    def __init__(self, control: ControlChannel, src: int) -> None:
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(control, src), name="pp-runtime-token-reader",
                                        daemon=True)
        self._thread.start()

    def get(self, timeout: float) -> list[int]:
        """The next micro-batch's tokens; queue.Empty after ``timeout`` s, or the receive's error."""
        ok, value = self._results.get(timeout=timeout)
        if not ok:
            raise value
        return value

    def close(self) -> None:
        self._thread.join(timeout=10)

    def _run(self, control: ControlChannel, src: int) -> None:
        while True:
            try:
                tokens = control.recv(src, TOKEN_TAG, forever=True)
            except RuntimeError as e:  # gloo: a peer's connection closed; every later receive fails too
                self._results.put((False, e))
                return
            if tokens is None:
                return
            self._results.put((True, tokens))


def _first_line(e: BaseException) -> str:
    """'ValueError: what went wrong' for an error raised in a worker (Ray wraps it)."""
    cause = getattr(e, "cause", None) or e
    text = str(cause).strip()
    return f"{type(cause).__name__}: {text.splitlines()[0] if text else ''}"


def _ensure_ray(world_size: int) -> bool:
    """Join RAY_ADDRESS's cluster, or start an embedded local Ray; True when we started it."""
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
        return True
    # address="local": always a fresh embedded instance, never an unrelated cluster that happens
    # to run on this machine (plain ray.init() would join it). A Ctrl-C in the middle of starting
    # the node would leave its agents running with no one to stop them: hold it until the node
    # is up, then shut the node down and deliver it.
    with _deferred_signals() as interrupted:
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, world_size), include_dashboard=False,
                 log_to_driver=False, _node_ip_address="127.0.0.1", _system_config={"worker_niceness": 0})
    if interrupted:
        ray.shutdown()
        raise KeyboardInterrupt
    return True


@contextlib.contextmanager
def _deferred_signals(signums: tuple[int, ...] = (signal.SIGINT,)) -> Iterator[list]:
    """Record these signals instead of running their handlers inside the block (main thread only;
    elsewhere Python runs no signal handlers anyway)."""
    caught: list = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in signums}
    try:
        yield caught
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


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
