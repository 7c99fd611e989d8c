"""Ray launcher: one actor per (stage, TP rank), placed by a placement group.

The placement group has one bundle per stage holding that stage's tp workers, with the
SPREAD strategy: a stage's TP workers always share a node (they share a bundle), and stages
land on different nodes when the cluster has them. Activations never go through Ray: the
actors form one torch.distributed world (NCCL on CUDA, gloo on CPU) whose rendezvous the
driver places on rank 0's node; Ray carries only the compact plans and the sampled tokens.

When every worker shares the driver's node and the node has cores to spare, the per-micro-batch
path is a Ray compiled graph (plan -> every worker's ``execute`` -> tokens), built at the first
micro-batch: a plan is written once into shared-memory channels that the workers' execution
loops read, instead of one actor-task RPC per worker. Measured at pp = 2 on the 2-core box
(docs/BENCHMARKS.md, target 5): the driver's time per micro-batch 1.5-1.6 -> 0.5 ms and the
control plane 6.9-7.5% -> 4.2-4.5% of a step, but throughput 7% *lower*, because a reader
of Ray 2.60's channels spins while it waits (the driver's reader thread took ~90% of a core),
and there the stages need both cores. So the graph is used only where the waiting costs no
stage a core (GPU workers, big CPU nodes). Across nodes Ray gives remote readers a
single-buffered channel (ray-project/ray#49044) and a pipeline with more than one micro-batch
in flight deadlocks (the driver's next write waits for the last stage to take the plan before,
which waits for the driver to read its tokens; reproduced with three trivial actors on three
nodes): there, as on a busy node, the workers get ordinary actor calls.

    executor = RayExecutor(engine_config, model_source)   # embedded Ray, or RAY_ADDRESS
"""
from __future__ import annotations

import contextlib
import gc
import logging
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
from pp_runtime.comm import P2P, Topology, init_distributed
from pp_runtime.config import EngineConfig
from pp_runtime.executor import WorkerError

PLACEMENT_TIMEOUT_S = 60.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


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


@ray.remote(concurrency_groups={"control": 1})
class StageActor:
    """Hosts one StageWorker; Ray runs its calls one at a time, in submission order.

    ``ping`` and ``now`` run in a separate "control" thread, so a worker busy with a long
    micro-batch still answers them: liveness is told apart from slowness."""

    def __init__(self, rank: int, topo: Topology, threads: int) -> None:
        import torch
        self.rank, self.topo = rank, topo
        if threads:
            torch.set_num_threads(threads)
        _unnice()
        self.worker = None

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

    def execute(self, wire: tuple) -> list[int] | None:
        return self.worker.execute(wire)

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


class RayExecutor:
    def __init__(self, cfg: EngineConfig, source: object, timeout_s: float = 60.0) -> None:
        from stages.worker import WorkerSpec
        self.cfg, self.timeout_s = cfg, timeout_s
        self.topo = Topology(cfg.parallel.pp, cfg.parallel.tp)
        self._owns_ray = _ensure_ray(self.topo.world_size)
        self.actors: list = []
        self.pg = None
        self.failed = False  # a worker died or hung: skip the graceful part of shutdown
        self._dag = None  # the compiled graph, built at the first micro-batch, and its reader
        self._reader: _ResultReader | None = None
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
        except BaseException:
            self.shutdown()
            raise
        self._use_graph = self._graph_pays()
        self._in_flight: list[list] = []  # actor calls' refs per micro-batch (the graph's reader keeps its own)

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
        wire = mb.to_wire()  # packed once, read by every worker
        graph = self._graph()
        if graph is None:
            self._in_flight.append([a.execute.remote(wire) for a in self.actors])
            return
        with _deferred_signals(STOP_SIGNALS) as caught:  # see _ResultReader
            refs = graph.execute(wire)
        _redeliver(caught)
        self._reader.put(refs)

    def collect(self) -> list[int]:
        if self._dag is not None:
            results = self._get_graph_results()
        else:
            results = self._get(self._in_flight.pop(0), "micro-batch")
        return results[self.topo.rank(self.topo.pp - 1, 0)]

    def _get_graph_results(self) -> list:
        """The oldest execution's results from the reader thread. Every ``timeout_s`` without
        them every worker is pinged (a dead or hung one raises WorkerError naming it); a broken
        channel means a worker died, and the pings say which."""
        while True:
            try:
                return self._reader.get(self.timeout_s)
            except queue.Empty:
                self._check_alive("micro-batch", self.timeout_s)
            except (ray.exceptions.RayChannelError, ray.exceptions.RayActorError) as e:
                raise self._died("a worker", "micro-batch", self.timeout_s, e) from None

    def _graph(self) -> object | None:
        """plan -> every worker's execute -> their results, compiled once where it pays (None
        otherwise: see the module docstring and _graph_pays). Up to pp micro-batches are
        in flight (the engine's depth); one more slot lets the driver hand in the next plan while
        it reads the oldest one's tokens."""
        if self._dag is None and self._use_graph:
            from ray.dag import InputNode, MultiOutputNode
            with InputNode() as plan:
                outputs = MultiOutputNode([a.execute.bind(plan) for a in self.actors])
            self._dag = outputs.experimental_compile(_max_inflight_executions=self.topo.pp + 1,
                                                     _submit_timeout=self.timeout_s)
            self._reader = _ResultReader()
        return self._dag

    def _graph_pays(self) -> bool:
        """Every worker on the driver's node (a cross-node graph deadlocks), and a core for each
        worker thread plus two (the driver and its reader thread spin while they wait)."""
        here = ray.get_runtime_context().get_node_id()
        if any(info["node"] != here for info in self.infos):
            return False
        return len(os.sched_getaffinity(0)) >= self.topo.world_size * (self.cfg.device.threads or 1) + 2

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
        """Tear down the compiled graph and process groups (graceful), then kill every actor and
        free the placement. A failed or interrupted run kills the actors first: a graph's teardown
        waits for every execution loop, and a hung or mid-plan worker would never end its own."""
        # After a kill, Ray logs each dead execution loop's ActorDiedError as a traceback (from our
        # teardown, or from its own monitor thread's, which ours waits for): expected here, and
        # the run's own error already names what failed.
        with _quiet("ray.dag.compiled_dag_node", logging.WARNING if graceful and not self.failed else logging.CRITICAL):
            if not graceful or self.failed:
                for a in self.actors:
                    ray.kill(a)
            if self._dag is not None:
                self._dag.teardown()
                self._reader.close()  # its read, if any, ended with the channels
                # Nothing may hold the graph past ray.shutdown: results never collected (an
                # interrupted run) keep it alive through their references.
                self._dag = None
                gc.collect()
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
        """The error for a worker that died. A compiled graph's channels break when any of its
        workers dies, so the pings name the one that did (raising) before ``who`` is blamed."""
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


class _ResultReader:
    """Reads a compiled graph's results, oldest execution first, on a thread of its own.

    A read must never be cut short: Ray reads an execution's outputs channel by channel, and a
    read that times out or is interrupted after the first has lost those already read (the next
    read pairs one worker's result with another's from the micro-batch before: seen as "expected
    3 tokens, got 4"), and a KeyboardInterrupt raised inside Ray's read left the process to die
    with SIGSEGV at exit. So this thread reads without a timeout and the driver waits on a queue,
    where timeouts (worker pings) and signals are harmless. Teardown closes the channels, which
    ends a read in progress."""

    def __init__(self) -> None:
        self._refs: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="pp-runtime-graph-reader", daemon=True).start()

    def put(self, refs: list) -> None:
        self._refs.put(refs)

    def get(self, timeout: float) -> list:
        """The next execution's results; queue.Empty after ``timeout`` s, or the read's error."""
        ok, value = self._results.get(timeout=timeout)
        if not ok:
            raise value
        return value

    def close(self) -> None:
        self._refs.put(None)

    def _run(self) -> None:
        while (refs := self._refs.get()) is not None:
            try:
                self._results.put((True, ray.get(refs, timeout=-1)))  # -1: no timeout (None: Ray's 10 s)
            except Exception as e:  # a broken channel: every later read fails the same way
                self._results.put((False, e))


def _redeliver(caught: list) -> None:
    """Run the handler of a signal held by _deferred_signals, now that it is safe to."""
    if caught:
        signal.raise_signal(caught[0])


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


@contextlib.contextmanager
def _quiet(logger: str, level: int) -> Iterator[None]:
    """Only records of ``level`` and up from this logger inside the block (a graph's teardown
    logs each step at INFO)."""
    log = logging.getLogger(logger)
    before = log.level
    log.setLevel(level)
    try:
        yield
    finally:
        log.setLevel(before)


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
