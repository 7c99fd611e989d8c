"""Plans and tokens between the driver and the stage workers over plain TCP connections.

    server = Listener("127.0.0.1")                 # a worker: its address goes to its peers
    conn = Connection.connect(server.address, "plans", timeout_s=10.0)
    peer, role = server.accept(timeout_s=10.0)     # -> (Connection, "plans")
    conn.send(("a", "plan")); peer.recv(timeout_s=None)

Why sockets rather than a gloo group or Ray calls (docs/BENCHMARKS.md, target 5): a blocked
``recv`` wakes the very thread that waits, when the kernel has the bytes. A Ray actor call costs
the driver ~0.8 ms per worker per micro-batch; gloo hands a message from its network thread to
the waiting thread, and its waits cannot be interrupted, so the driver needed a reader thread
too: three wake-ups per token return on a box whose cores are busy with the stages. A message
is [payload length: 8 bytes, little-endian][pickled payload]; TCP_NODELAY, since every message
is latency-bound. Plain Python: no torch, no Ray.
"""
from __future__ import annotations

import pickle
import socket
import struct

_HEADER = struct.Struct("<Q")


class Connection:
    """One TCP connection carrying length-prefixed pickled messages both ways."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._buf = bytearray()  # bytes received and not yet returned: a timed-out recv loses nothing

    @classmethod
    def connect(cls, address: tuple[str, int], role: str, timeout_s: float) -> "Connection":
        """Connect to a Listener and say what this connection carries (its first message)."""
        conn = cls(socket.create_connection(address, timeout=timeout_s))
        conn.send(role)
        return conn

    def send(self, obj: object) -> None:
        self.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def send_bytes(self, data: bytes) -> None:
        """Blocks only while the peer's receive buffer is full (it is behind by megabytes)."""
        self.sock.settimeout(None)
        self.sock.sendall(_HEADER.pack(len(data)) + data)

    def recv(self, timeout_s: float | None = None) -> object:
        return pickle.loads(self.recv_bytes(timeout_s))

    def recv_bytes(self, timeout_s: float | None = None) -> bytes:
        """The next message's payload. TimeoutError when none is complete within ``timeout_s``
        (None: wait as long as it takes), ConnectionError when the peer has gone."""
        need = self._need()
        while len(self._buf) < need:
            self.sock.settimeout(timeout_s)
            try:
                chunk = self.sock.recv(max(need - len(self._buf), 1 << 16))
            except socket.timeout:
                raise TimeoutError("no message within the timeout") from None
            if not chunk:
                raise ConnectionError("the peer closed the connection")
            self._buf += chunk
            need = self._need()
        payload = bytes(self._buf[_HEADER.size:need])
        del self._buf[:need]
        return payload

    def _need(self) -> int:
        """Bytes the buffer must hold for its first message to be complete."""
        if len(self._buf) < _HEADER.size:
            return _HEADER.size
        return _HEADER.size + _HEADER.unpack_from(self._buf)[0]

    def close(self) -> None:
        self.sock.close()


class Listener:
    """A listening socket on ``ip`` (a free port); ``accept`` returns a connection and its role."""

    def __init__(self, ip: str) -> None:
        self.sock = socket.create_server((ip, 0))
        self.address: tuple[str, int] = self.sock.getsockname()[:2]

    def accept(self, timeout_s: float) -> tuple[Connection, str]:
        self.sock.settimeout(timeout_s)
        sock, _ = self.sock.accept()
        conn = Connection(sock)
        return conn, conn.recv(timeout_s)

    def close(self) -> None:
        self.sock.close()
