"""ControlChannel over a real gloo group (two ranks on loopback, one thread each): objects
small and larger than a receive's capacity arrive whole and in order, a receive posted ahead
keeps what was sent before it was asked for, and a ``forever`` wait outlives the group's timeout."""
from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")

import datetime  # noqa: E402

import torch.distributed as dist  # noqa: E402

from pp_runtime.comm import ControlChannel, Sends  # noqa: E402


def group(store: object, rank: int, timeout_s: float) -> object:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, 2, opts)


def pair(timeout_s: float = 10.0) -> tuple[ControlChannel, ControlChannel]:
    """Two channels on one two-rank group; construction needs both ranks at once (two threads)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store0 = dist.TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
    store1 = dist.TCPStore("127.0.0.1", store0.port, None, False, timeout)
    groups: dict[int, object] = {}
    t = threading.Thread(target=lambda: groups.__setitem__(1, group(store1, 1, timeout_s)))
    t.start()
    groups[0] = group(store0, 0, timeout_s)
    t.join()
    # depth 2: up to 8 sends a peer unreceived (the first test sends 7 before receiving any)
    return ControlChannel(groups[0], depth=2), ControlChannel(groups[1], depth=2)


@pytest.mark.parametrize("size", [0, 100, ControlChannel.CAPACITY - 8, ControlChannel.CAPACITY - 7, 300_000])
def test_objects_of_any_size_arrive_whole_and_in_order(size: int) -> None:
    a, b = pair()
    objs = [bytes(range(256)) * (size // 256) + b"x" * (size % 256), ("plan", 1), None, list(range(size // 8))]
    for o in objs:
        a.send(o, 1)
    a.send([7, 8], 1, tag=1)  # another tag: its own order
    assert b.recv(0, tag=1) == [7, 8]
    assert [b.recv(0) for _ in objs] == objs
    b.send("back", 0)
    assert a.recv(1) == "back"
    a.flush()


def test_forever_outlives_the_groups_timeout() -> None:
    a, b = pair(timeout_s=1.0)
    threading.Timer(1.5, a.send, ("late", 1)).start()
    started = time.monotonic()
    assert b.recv(0, forever=True) == "late" and time.monotonic() - started >= 1.4
    with pytest.raises(RuntimeError):  # without forever, the group's timeout ends the wait
        b.recv(0)


def test_a_long_lived_sender_holds_a_bounded_number_of_sends() -> None:
    """gloo reports a send completed only once waited for: a sender that only dropped completed
    sends kept every message it ever sent alive."""
    a, b = pair()
    for i in range(50):
        a.send(("plan", i), 1)
        assert b.recv(0) == ("plan", i)
        assert a._sends.held(1) <= a._sends.cap == 8
    a.flush()
    assert a._sends.held(1) == 0


class GlooLikeWork:
    """A send handle as gloo's: not completed until someone waits for it."""

    def __init__(self, log: list, peer: int) -> None:
        self.done, self.log, self.peer = False, log, peer

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout: object = None) -> bool:
        self.done = True
        self.log.append(self.peer)
        return True


def test_sends_are_bounded_per_peer() -> None:
    """Rank 0 of torchrun sends every plan to every rank: the bound is per peer, so a send to one
    rank never waits on another rank's receive (one shared bound made rank 0 wait, at pp = 8, for
    a rank to take the plan before last; at pp >= 13 ranks waited on each other)."""
    waited: list[int] = []
    sends = Sends(depth=4, timeout=None)
    assert sends.cap == 12
    for i in range(5):
        sends.add(1, lambda: GlooLikeWork(waited, 1), torch.zeros(2))
    for i in range(100):
        sends.add(2, lambda: GlooLikeWork(waited, 2), torch.full((2,), float(i)))
        assert sends.held(2) <= sends.cap
    assert set(waited) == {2} and sends.held(1) == 5
    assert [int(t[0]) for _, t in sends._by_peer[2]] == list(range(100 - sends.held(2), 100))
    sends.flush()
    assert sends.held(1) == sends.held(2) == 0 and waited.count(1) == 5


def test_activation_sends_are_retired_on_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    from pp_runtime.comm import P2P
    sent: list[torch.Tensor] = []
    waited: list[int] = []
    monkeypatch.setattr(dist, "isend", lambda t, dst: sent.append(t) or GlooLikeWork(waited, dst))
    link = P2P(None, 1, torch.device("cpu"), depth=2)
    for i in range(100):
        link.send_forward(torch.full((4, 8), float(i)))
        assert link._sends.held(1) <= link._sends.cap == 8
    link.flush()
    assert link._sends.held(1) == 0 and len(sent) == 100 and len(waited) == 100
