"""The driver's and workers' control connections (pp_runtime/control.py) on loopback: messages
of any size arrive whole and in order, a receive that times out mid-message loses nothing, a
closed peer is a ConnectionError, and the first message names the connection's role."""
from __future__ import annotations

import pickle
import socket
import threading
import time

import pytest

from pp_runtime.control import Connection, Listener


def connected(role: str = "plans") -> tuple[Connection, Connection, Listener]:
    listener = Listener("127.0.0.1")
    a = Connection.connect(listener.address, role, timeout_s=5.0)
    b, got = listener.accept(timeout_s=5.0)
    assert got == role
    return a, b, listener


@pytest.mark.parametrize("size", [0, 1, 7, 8, 65_536, 3_000_000])
def test_messages_of_any_size_arrive_whole_and_in_order(size: int) -> None:
    a, b, _ = connected()
    objs = [bytes(range(256)) * (size // 256) + b"x" * (size % 256), None, ("plan", size), list(range(size // 64))]
    sender = threading.Thread(target=lambda: [a.send(o) for o in objs])  # a big one fills the socket buffer
    sender.start()
    assert [b.recv(timeout_s=10.0) for _ in objs] == objs
    sender.join()
    b.send("back")
    assert a.recv(timeout_s=5.0) == "back"


def test_a_timed_out_receive_keeps_the_partial_message() -> None:
    a, b, _ = connected()
    data = pickle.dumps(list(range(1000)))
    frame = len(data).to_bytes(8, "little") + data
    a.sock.sendall(frame[:5])  # not even the whole length yet
    with pytest.raises(TimeoutError):
        b.recv(timeout_s=0.1)
    a.sock.sendall(frame[5:300])
    with pytest.raises(TimeoutError):
        b.recv(timeout_s=0.1)
    a.sock.sendall(frame[300:])
    a.send("next")
    assert b.recv(timeout_s=5.0) == list(range(1000)) and b.recv(timeout_s=5.0) == "next"


def test_no_timeout_waits_and_a_closed_peer_is_a_connection_error() -> None:
    a, b, _ = connected("tokens")
    threading.Timer(0.3, a.send, ("late",)).start()
    started = time.monotonic()
    assert b.recv() == "late" and time.monotonic() - started >= 0.25
    a.close()
    with pytest.raises(ConnectionError):
        b.recv(timeout_s=5.0)


def test_accept_times_out_when_no_one_connects() -> None:
    listener = Listener("127.0.0.1")
    with pytest.raises(socket.timeout):
        listener.accept(timeout_s=0.1)
    listener.close()
