"""Worker health for the Ray executor: which worker died, hung, or raised, named in a WorkerError.

A mixin of RayExecutor (launch/ray_executor.py): its methods read the executor's actors, topology,
timeout and serve calls, and set ``failed`` so that shutdown skips its graceful part.

    infos = self._get([a.setup.remote(...) for a in self.actors], "set-up")   # names a failing worker
"""
from __future__ import annotations

import ray

from pp_runtime.topology import Topology
from pp_runtime.executor import WorkerError


class WorkerHealth:
    """Checks on the stage actors, for an executor that sets the attributes below."""

    actors: list  # one StageActor handle per rank
    topo: Topology
    timeout_s: float
    failed: bool  # a worker died or hung
    _serving: list  # each worker's serve() call

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

    def _check_alive(self, what: str, timeout: float, silent_s: float = 0.0) -> None:
        """Ping every worker; one that does not answer within ``timeout`` is hung (reported as
        silent for ``silent_s`` before that too), one whose actor is gone died."""
        pings = [a.ping.remote() for a in self.actors]
        done, _ = ray.wait(pings, num_returns=len(pings), timeout=timeout)
        for rank, ref in enumerate(pings):
            try:
                if ref not in done:
                    raise ray.exceptions.GetTimeoutError()
                ray.get(ref, timeout=0)
            except ray.exceptions.GetTimeoutError:
                self.failed = True
                raise WorkerError(f"{self._name(rank)} did not answer within {timeout + silent_s:.0f} s ({what})") from None
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
