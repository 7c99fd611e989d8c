"""Ray launcher: one actor per (stage, TP rank), placed by a placement group.

The placement group has one bundle per stage holding that stage's tp workers, with the
SPREAD strategy: a stage's TP workers always share a node (they share a bundle), and stages
land on different nodes when the cluster has them. Activations never go through Ray: the
actors form one torch.distributed world (NCCL on CUDA, gloo on CPU) whose rendezvous the
driver places on rank 0's node. Ray places, starts, pings and stops the workers.

Per micro-batch, Ray is not on the path at all: plans and tokens go over TCP connections
(pp_runtime/control.py). The driver sends each plan's pickled bytes to stage 0, every stage
forwards them to the next before it computes, and the last stage sends the sampled tokens back;
each worker runs a ``serve`` loop blocked in a socket receive (no spinning) until the next plan.
Measured at pp = 2 on the 2-core box (docs/BENCHMARKS.md, target 5): two actor-task RPCs per
micro-batch cost the driver ~1.6 ms and the control plane 7.3% of a step; a Ray compiled graph
got that to 4.2-4.5% but its channel readers spin (7% less throughput there) and it deadlocks
across nodes with more than one micro-batch in flight (ray-project/ray#49044); a gloo group got
4.8%, with three thread wake-ups per message received. Sockets work the same within a node and
across nodes.

    executor = RayExecutor(engine_config, model_source)   # embedded Ray, or RAY_ADDRESS
"""
from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import threading
import time
import weakref
from typing import Iterator

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pp_runtime.batch import MicroBatch
from pp_runtime.comm import P2P, Topology, init_distributed
from pp_runtime.control import Connection, Listener
from pp_runtime.config import EngineConfig
from pp_runtime.executor import WorkerError

PLACEMENT_TIMEOUT_S = 60.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
POLL_S = 0.5  # how often a driver waiting for tokens checks that every serve loop still runs
BROKEN_WAIT_S = 2.0  # after a broken connection, how long the serve loops get to report why


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


def _release(actors: list, pg: object) -> None:
    """What a RayExecutor holds in the cluster, freed when it is garbage-collected unshut."""
    if not ray.is_initialized():
        return
    for a in actors:
        with contextlib.suppress(Exception):
            ray.kill(a)
    with contextlib.suppress(Exception):
        remove_placement_group(pg)


class RayExecutor:
    def __init__(self, cfg: EngineConfig, source: object, timeout_s: float = 60.0) -> None:
        from stages.worker import WorkerSpec
        self.cfg, self.timeout_s = cfg, timeout_s
        self.topo = Topology(cfg.parallel.pp, cfg.parallel.tp)
        self._owns_ray = _ensure_ray(self.topo.world_size)
        self.actors: list = []
        self.pg = None
        self.failed = False  # a worker died or hung: skip the graceful part of shutdown
        self._plans: list[Connection] = []  # to stage 0's TP ranks
        self._tokens: Connection | None = None  # from the last stage's TP rank 0
        self._serving: list = []  # each worker's serve() call
        try:
            self.pg = self._place()
            # Dropped without shutdown() (an LLM deleted or never closed): free the placement and
            # the actors anyway, else the next executor waits for resources that stay in use.
            self._finalizer = weakref.finalize(self, _release, self.actors, self.pg)
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
        """Start every worker's serve loop and connect the driver to its ends of the pipeline."""
        addrs = self._get([a.open_control.remote() for a in self.actors], "control set-up")
        last = self.topo.rank(self.topo.pp - 1, 0)
        self._serving = []
        for rank, actor in enumerate(self.actors):
            stage, tp_rank = self.topo.coords(rank)
            down = addrs[self.topo.rank(stage + 1, tp_rank)] if stage < self.topo.pp - 1 else None
            self._serving.append(actor.serve.remote(down, rank == last, self.timeout_s))
        self._plans = [Connection.connect(addrs[r], "plans", self.timeout_s) for r in self.topo.tp_ranks(0)]
        self._tokens = Connection.connect(addrs[last], "tokens", self.timeout_s)

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
        data = pickle.dumps(mb.to_wire(), protocol=pickle.HIGHEST_PROTOCOL)  # once, for every stage-0 rank
        # A Ctrl-C in the middle of a send would leave half a plan on the stream, and the worker
        # waiting for the rest forever: signals wait until the plan is out.
        with _deferred_signals(STOP_SIGNALS) as caught:
            for rank, conn in zip(self.topo.tp_ranks(0), self._plans):
                try:
                    conn.send_bytes(data)
                except OSError as e:  # its connection broke: it died, or its serve loop ended
                    self._check_serving("plan delivery", BROKEN_WAIT_S)
                    raise self._died(self._name(rank), "plan delivery", self.timeout_s, e) from None
        if caught:
            signal.raise_signal(caught[0])

    def collect(self) -> list[int]:
        """The oldest micro-batch's tokens. While they are not there, the serve loops are checked
        every POLL_S (one that ended raised: its error is reported) and every worker is pinged
        every ``timeout_s`` (a dead or hung one raises WorkerError naming it)."""
        waited = 0.0
        while True:
            try:
                return self._tokens.recv(POLL_S)
            except TimeoutError:
                self._check_serving("micro-batch")
                waited += POLL_S
                if waited >= self.timeout_s:
                    self._check_alive("micro-batch", self.timeout_s)
                    waited = 0.0
            except OSError as e:  # the last stage's connection broke
                self._check_serving("micro-batch", BROKEN_WAIT_S)
                raise self._died(self._name(self.topo.rank(self.topo.pp - 1, 0)), "micro-batch",
                                 self.timeout_s, e) from None

    def _check_serving(self, what: str, wait_s: float = 0.0) -> None:
        """Raise WorkerError when a serve loop has ended (only the stop plan may end one); with
        ``wait_s``, first wait that long for all of them (a broken connection: its loops are
        ending). A dead worker is named first; else the root cause: an error that is not a broken
        connection, which one failing worker causes in its neighbours."""
        done, _ = ray.wait(self._serving, num_returns=len(self._serving), timeout=wait_s)
        if not done:
            return
        self.failed = True
        self._check_alive(what, self.timeout_s)
        ended = []
        for rank, ref in enumerate(self._serving):
            if ref in done:
                try:
                    ray.get(ref, timeout=0)
                    ended.append((rank, None))
                except Exception as e:  # its step raised, or its connections broke
                    ended.append((rank, e))
        rank, e = min(ended, key=lambda r: isinstance(getattr(r[1], "cause", r[1]), OSError))
        error = "stopped serving plans" if e is None else f"failed: {_first_line(e)}"
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
        worker would never end its serve loop."""
        if self._plans:
            if graceful and not self.failed:
                try:
                    for conn in self._plans:
                        conn.send(None)  # the stop plan, forwarded stage to stage
                    ray.get(self._serving, timeout=10)
                except Exception:  # a worker that cannot stop its loop is killed below
                    self.failed = True
            if not graceful or self.failed:
                for a in self.actors:
                    ray.kill(a)
            for conn in self._plans + [self._tokens]:
                if conn is not None:  # set-up may have failed between the two connects
                    conn.close()
            self._plans, self._tokens = [], None
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
            self._finalizer.detach()
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
                except ray.exceptions.RayActorError as e:
                    raise self._died(self._name(rank), what, timeout, e) from None
                except ray.exceptions.RayTaskError as e:
                    # The worker raised: a user's error (a bad checkpoint, a bad setting) comes out
                    # as the worker's own exception, as it would at pp = 1, not as Ray's remote
                    # traceback flattened into one line; anything else names the worker.
                    if isinstance(e.cause, ValueError):
                        raise e.cause from None
                    self.failed = True
                    raise WorkerError(f"{self._name(rank)} failed during {what}: {_first_line(e)}") from None
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
        _check_reachable(address)
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


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """A host:port RAY_ADDRESS must accept a connection: ray.init retries an unreachable GCS
    forever. Other forms ("auto", ray://, http://) fail on their own."""
    host, sep, port = address.rpartition(":")
    if "://" in address or not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ValueError(f"RAY_ADDRESS={address}: no Ray cluster answers there ({e.strerror or e})") from None


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
