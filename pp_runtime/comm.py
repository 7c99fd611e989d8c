"""Process groups and point-to-point activation transfer between stages (ranks: topology.py).

world = pp × tp workers, rank = stage · tp + tp_rank. TP rank r of stage s sends its output
to TP rank r of stage s + 1 (every TP rank holds the full hidden state after the row-parallel
all-reduce, so each pair moves one copy). Every rank creates every TP group in the same
order, as torch.distributed requires.
"""
from __future__ import annotations

import collections
import datetime
import pickle
from typing import Callable

import torch
import torch.distributed as dist

from pp_runtime.topology import Topology


def init_distributed(topo: Topology, rank: int, backend: str, init_method: str,
                     timeout_s: float = 120.0) -> object | None:
    """Join the world and build the TP groups; returns this rank's TP group (None when tp=1)."""
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=topo.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    mine = None
    stage, _ = topo.coords(rank)
    for s in range(topo.pp):  # same order on every rank
        group = dist.new_group(topo.tp_ranks(s)) if topo.tp > 1 else None
        if s == stage:
            mine = group
    return mine


class P2P:
    """Activation transfer over torch.distributed: recv from the previous stage, send to the next.

    Sends are asynchronous; a stage runs micro-batches in issue order, so its receiver posts
    matching receives in the same order. A send's tensor stays referenced until it completes
    (``Sends``).
    """

    def __init__(self, prev_rank: int | None, next_rank: int | None, device: torch.device, depth: int = 1) -> None:
        """``depth``: micro-batches in flight in the pipeline (pp), which bounds the sends kept."""
        self.prev_rank, self.next_rank, self.device = prev_rank, next_rank, device
        self._sends = Sends(depth, None)

    def recv_forward(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buf, src=self.prev_rank)
        return buf

    def send_forward(self, tensor: torch.Tensor) -> None:
        t = tensor.contiguous()
        self._sends.add(self.next_rank, lambda: dist.isend(t, dst=self.next_rank), t)

    def flush(self) -> None:
        self._sends.flush()


# A plan is awaited with no deadline: an idle deployment waits for its next run for as long as
# it lives (gloo's default would end a wait after the group's timeout).
FOREVER = datetime.timedelta(days=3650)


class ControlChannel:
    """Pickled objects over a gloo group's point-to-point ops, one message each where they fit.

    ``group`` is anything with ProcessGroup's ``send([t], dst, tag)`` / ``recv([t], src, tag)``
    (ranks are the group's own). Why one message, and receives posted ahead: gloo moves a message
    at once only to a receive already posted, otherwise the sender announces it and waits for the
    receiver's go-ahead, a round trip through both processes' network threads. A length-prefixed
    pair (size, then body) paid that for every body (the body's receive can only be posted after
    the size arrives): when the Ray launcher used this channel, plan delivery and token return
    took 1.7-1.9 ms each at pp = 2 on the busy 2-core box, 0.7-1.0 ms with this scheme. So a
    message is [payload length: int64][payload] received into a CAPACITY buffer, with only a
    larger payload's rest in a second message; and after each receive the next one from that
    peer is posted at once, so a message sent while its receiver computes is already there when
    it asks. Sends are asynchronous; their tensors stay referenced until they complete."""

    CAPACITY = 1 << 16  # bytes a receive is posted with; a plan of 24 sequences is a few KB

    def __init__(self, group: object, timeout: datetime.timedelta | None = None, depth: int = 1) -> None:
        """``timeout``: how long a receive (not marked ``forever``) or a flush waits before gloo
        raises; None: the group's own (new_group's default is 30 minutes, not the world's).
        ``depth``: micro-batches in flight (pp), which bounds the sends kept per peer."""
        self.group, self.timeout = group, timeout
        self._sends = Sends(depth, timeout)
        self._inboxes: dict[tuple[int, int], _Inbox] = {}

    def send(self, obj: object, dst: int, tag: int = 0) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        n = data.numel()
        head = torch.empty(8 + min(n, self.CAPACITY - 8), dtype=torch.uint8)
        head[:8].view(torch.int64)[0] = n
        head[8:] = data[:head.numel() - 8]
        parts = (head,) if n <= self.CAPACITY - 8 else (head, data[self.CAPACITY - 8:])
        for t in parts:
            self._sends.add(dst, lambda t=t: self.group.send([t], dst, tag), t)

    def recv(self, src: int, tag: int = 0, forever: bool = False) -> object:
        """The next object from ``src``; ``forever``: no deadline for it to start (an idle
        deployment waits for its next plan as long as it lives; a large payload's rest follows
        its head at once)."""
        inbox = self._inboxes.get((src, tag))
        if inbox is None:
            inbox = self._inboxes[(src, tag)] = _Inbox(self.group, src, tag, self.CAPACITY)
        head = inbox.take(FOREVER if forever else self.timeout)
        n = int(head[:8].view(torch.int64)[0])
        data = torch.empty(n, dtype=torch.uint8)
        first = min(n, self.CAPACITY - 8)
        data[:first] = head[8:8 + first]
        if n > first:
            _wait(self.group.recv([data[first:]], src, tag), self.timeout)
            inbox.repost()
        return pickle.loads(data.numpy().tobytes())

    def flush(self) -> None:
        self._sends.flush()


def _wait(work: object, timeout: datetime.timedelta | None) -> None:
    work.wait() if timeout is None else work.wait(timeout)


class Sends:
    """Asynchronous sends in flight, per peer, each (work, tensor) kept until it completes (the
    tensor must outlive the transfer). gloo reports a send completed only once it has been
    waited for, so dropping completed ones alone kept every tensor a stage ever sent (stage 0 of
    a pp = 2 deployment grew by an activation a micro-batch for as long as it lived). So past
    ``cap`` sends to one peer the oldest is waited for. A gloo send completes once its peer has
    posted the matching receive, and every peer posts its receive for micro-batch k by the time
    micro-batch k + depth is issued (at most depth are in flight; a control inbox posts the next
    receive as it takes one), so with cap > 2 · depth (two sends a message at most) the wait is
    for a send whose receive is posted: it returns at once, and no two ranks wait on each other.
    Per peer, because rank 0 of torchrun sends each plan to every rank."""

    def __init__(self, depth: int, timeout: datetime.timedelta | None) -> None:
        self.cap, self.timeout = 2 * depth + 4, timeout
        self._by_peer: dict[int, collections.deque] = collections.defaultdict(collections.deque)

    def add(self, peer: int, send: Callable[[], object], tensor: torch.Tensor) -> None:
        """``send()`` starts the transfer of ``tensor`` and returns its work handle."""
        pending = self._by_peer[peer]
        while pending and (len(pending) >= self.cap or pending[0][0].is_completed()):
            _wait(pending.popleft()[0], self.timeout)
        pending.append((send(), tensor))

    def held(self, peer: int) -> int:
        return len(self._by_peer[peer])

    def flush(self) -> None:
        for pending in self._by_peer.values():
            while pending:
                _wait(pending.popleft()[0], self.timeout)


class _Inbox:
    """Receives from one (peer, tag), each posted as soon as the one before has arrived; two
    buffers, so a message's bytes stay intact until the next take."""

    def __init__(self, group: object, src: int, tag: int, capacity: int) -> None:
        self.group, self.src, self.tag = group, src, tag
        self._bufs = [torch.empty(capacity, dtype=torch.uint8) for _ in range(2)]
        self._i = 0
        self._work = self._post()

    def _post(self) -> object:
        return self.group.recv([self._bufs[self._i]], self.src, self.tag)

    def take(self, timeout: datetime.timedelta | None) -> torch.Tensor:
        """The next message's buffer (valid until the take after next). The receive after it is
        posted here, unless the payload overflows: gloo matches a peer's messages of one tag in
        order, so the payload's rest must be received first (then ``repost``)."""
        _wait(self._work, timeout)
        buf = self._bufs[self._i]
        self._i ^= 1
        fits = int(buf[:8].view(torch.int64)[0]) <= buf.numel() - 8
        self._work = self._post() if fits else None
        return buf

    def repost(self) -> None:
        self._work = self._post()


class LocalLink:
    """In-process stand-in for P2P: stages of one process hand hidden states through queues.

    ``links = LocalLink.chain(pp)`` gives stage s a link that receives from stage s − 1's
    queue and sends into its own.
    """

    def __init__(self, inbox: collections.deque | None, outbox: collections.deque | None) -> None:
        self.inbox, self.outbox = inbox, outbox

    @staticmethod
    def chain(pp: int) -> list["LocalLink"]:
        queues: list[collections.deque] = [collections.deque() for _ in range(pp - 1)]
        return [LocalLink(queues[s - 1] if s > 0 else None, queues[s] if s < pp - 1 else None)
                for s in range(pp)]

    def send_forward(self, tensor: torch.Tensor) -> None:
        self.outbox.append(tensor)

    def recv_forward(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = self.inbox.popleft()
        if tuple(t.shape) != tuple(shape):
            raise RuntimeError(f"pipeline plan/shape mismatch: expected {shape}, got {tuple(t.shape)}")
        return t

    def flush(self) -> None:
        pass
