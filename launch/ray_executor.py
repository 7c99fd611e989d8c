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

Alongside: launch/placement.py (the bundles), launch/stage_actor.py (the actor),
launch/worker_health.py (naming a dead, hung or failing worker), launch/ray_cluster.py (joining
or starting Ray).

    executor = RayExecutor(engine_config, model_source)   # embedded Ray, or RAY_ADDRESS
"""
from __future__ import annotations

import contextlib
import pickle
import signal
import time
import weakref

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from launch.deferred_signals import _deferred_signals
from launch.placement import place_stages, stage_bundles
from launch.ray_cluster import acquire_ray, release_ray
from launch.stage_actor import StageActor
from launch.worker_health import WorkerHealth
from pp_runtime.batch import MicroBatch, Sampled
from pp_runtime.control import Connection
from pp_runtime.config import EngineConfig
from pp_runtime.topology import Topology
from pp_runtime.workers import worker_timeout_s

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
POLL_S = 0.5  # how often a driver waiting for tokens checks that every serve loop still runs
BROKEN_WAIT_S = 2.0  # after a broken connection, how long the serve loops get to report why


def _release(actors: list, pg: object) -> None:
    """What a RayExecutor holds in the cluster, freed when it is garbage-collected unshut."""
    if not ray.is_initialized():
        return
    for a in actors:
        with contextlib.suppress(Exception):
            ray.kill(a)
    with contextlib.suppress(Exception):
        remove_placement_group(pg)


class RayExecutor(WorkerHealth):
    def __init__(self, cfg: EngineConfig, source: object, timeout_s: float | None = None,
                 verbose: bool = False) -> None:
        from stages.worker_spec import WorkerSpec  # plain Python: the driver does not import torch
        self.cfg, self.timeout_s = cfg, worker_timeout_s() if timeout_s is None else timeout_s
        self.topo = Topology(cfg.parallel.pp, cfg.parallel.tp)
        acquire_ray(self.topo.world_size, verbose)
        # released by shutdown, or when the executor is dropped unshut (after _release below:
        # finalizers run newest first)
        self._ray_hold = weakref.finalize(self, release_ray)
        self.actors: list = []
        self.pg = None
        self.failed = False  # a worker died or hung: skip the graceful part of shutdown
        self._plans: list[Connection] = []  # to stage 0's TP ranks
        self._tokens: Connection | None = None  # from the last stage's TP rank 0
        self._serving: list = []  # each worker's serve() call
        try:
            self.pg = place_stages(self.topo.pp, self.topo.tp, cfg.device.device)
            # Dropped without shutdown() (an LLM deleted or never closed): free the placement and
            # the actors anyway, else the next executor waits for resources that stay in use.
            self._finalizer = weakref.finalize(self, _release, self.actors, self.pg)
            threads = cfg.device.threads or 1
            gpu = 1 if cfg.device.device == "cuda" else 0
            bundles = stage_bundles(self.pg)
            for rank in range(self.topo.world_size):
                stage, _ = self.topo.coords(rank)
                strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundles[stage])
                self.actors.append(StageActor.options(num_cpus=1, num_gpus=gpu, scheduling_strategy=strategy)
                                   .remote(rank, self.topo, threads))
            # start-up, like set-up below, is not held to the serving timeout: a worker process
            # imports torch and its kernels first, which took > 2 s on a busy 2-core node
            addrs = self._get([a.address.remote() for a in self.actors], "start", timeout=max(300.0, self.timeout_s))
            backend = "nccl" if cfg.device.device == "cuda" else "gloo"
            init = f"tcp://{addrs[0][0]}:{addrs[0][1]}"
            specs = [WorkerSpec(source, *self.topo.coords(r), cfg.parallel, cfg.cache, cfg.device)
                     for r in range(self.topo.world_size)]
            self.infos = self._get([a.setup.remote(specs[r], backend, init) for r, a in enumerate(self.actors)],
                                   "set-up", timeout=max(300.0, self.timeout_s))
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

    def collect(self) -> Sampled:
        """The oldest micro-batch's tokens. While they are not there, the serve loops are checked
        every POLL_S (one that ended raised: its error is reported), and after ``timeout_s`` / 2
        without them every worker is pinged with the other half as its deadline (a dead or hung
        one raises WorkerError naming it, within ``timeout_s`` of the silence's start)."""
        since = time.monotonic()
        while True:
            try:
                return self._tokens.recv(POLL_S)
            except TimeoutError:
                self._check_serving("micro-batch")
                silent = time.monotonic() - since
                if silent >= self.timeout_s / 2:
                    self._check_alive("micro-batch", self.timeout_s / 2, silent)
                    since = time.monotonic()
            except OSError as e:  # the last stage's connection broke
                self._check_serving("micro-batch", BROKEN_WAIT_S)
                raise self._died(self._name(self.topo.rank(self.topo.pp - 1, 0)), "micro-batch",
                                 self.timeout_s, e) from None

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
        self._ray_hold()  # once: a finalizer runs at most once
