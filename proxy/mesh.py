"""Messages between the proxies of one job (TCP; proxies live outside the checkpointed trees).

Every frame is a header (JSON) and a payload (bytes). Data frames carry a tag and land in an inbox
keyed by (tag, sender) until the collective that needs them takes them, so operations of different
channels may interleave freely. Control frames (the barrier's) go to a callback. A lost peer is fatal
to the job's collectives: `on_lost` is called once and every waiter is woken.
"""

from __future__ import annotations

import hmac
import json
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

_HEAD = struct.Struct("!IQ")


class MeshError(Exception):
    """The mesh cannot be built or has lost a peer."""


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("peer closed the connection")
        got += k
    return buf


class Mesh:
    def __init__(self, me: str, generation: str, token: str, bind_host: str = "0.0.0.0",
                 on_control: Callable[[str, dict], None] | None = None,
                 on_lost: Callable[[str, str], None] | None = None):
        self.me = me
        self.generation = generation
        self.token = token
        self.on_control = on_control or (lambda peer, message: None)
        self.on_lost = on_lost or (lambda peer, why: None)
        self.listener = socket.create_server((bind_host, 0))
        self.port = self.listener.getsockname()[1]
        self.peers: dict[str, socket.socket] = {}
        self.send_locks: dict[str, threading.Lock] = {}
        self.inbox: dict[tuple[str, str], bytearray] = {}
        self.cond = threading.Condition()
        self.lost: str | None = None
        self.closed = False
        self.bytes_sent = 0

    # --- building ---------------------------------------------------------------------------------

    def connect(self, addresses: dict[str, tuple[str, int]], timeout: float = 120.0) -> None:
        """Connect to every peer in `addresses` (proxy id -> (host, port)): lower ids dial higher."""
        expected = set(addresses) - {self.me}
        accept = threading.Thread(target=self._accept, args=({p for p in expected if p < self.me},),
                                  daemon=True)
        accept.start()
        for peer in sorted(p for p in expected if p > self.me):
            host, port = addresses[peer]
            deadline = time.monotonic() + timeout
            while True:
                try:
                    sock = socket.create_connection((host, port), timeout=10)
                    break
                except OSError as exc:
                    if time.monotonic() > deadline:
                        raise MeshError(f"cannot reach proxy {peer} at {host}:{port}: {exc}") from exc
                    time.sleep(0.1)
            sock.settimeout(None)
            self._send_frame(sock, {"hello": self.me, "generation": self.generation,
                                    "token": self.token}, ())
            self._add(peer, sock)
        deadline = time.monotonic() + timeout
        with self.cond:
            while not expected <= set(self.peers):
                if self.closed or self.lost:
                    raise MeshError(f"mesh closed while connecting ({self.lost or 'closed'})")
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(expected - set(self.peers))
                    raise MeshError(f"proxies {', '.join(missing)} did not connect within {timeout:.0f}s")
                self.cond.wait(left)

    def _accept(self, expected: set[str]) -> None:
        while expected and not self.closed:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            try:
                sock.settimeout(10)
                header, _ = self._recv_frame(sock)
                sock.settimeout(None)
            except (OSError, EOFError, ValueError):
                sock.close()
                continue
            peer = header.get("hello")
            if (peer not in expected or header.get("generation") != self.generation
                    or not hmac.compare_digest(str(header.get("token")), self.token)):
                sock.close()  # not a proxy of this job's generation
                continue
            expected.discard(peer)
            self._add(peer, sock)

    def _add(self, peer: str, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.cond:
            self.peers[peer] = sock
            self.send_locks[peer] = threading.Lock()
            self.cond.notify_all()
        threading.Thread(target=self._read, args=(peer, sock), daemon=True).start()

    # --- frames -----------------------------------------------------------------------------------

    @staticmethod
    def _send_frame(sock: socket.socket, header: dict, payload: Sequence) -> int:
        head = json.dumps(header, separators=(",", ":")).encode()
        views = [memoryview(p).cast("B") for p in payload]
        total = sum(v.nbytes for v in views)
        sock.sendall(_HEAD.pack(len(head), total) + head)
        for view in views:
            sock.sendall(view)
        return total

    @staticmethod
    def _recv_frame(sock: socket.socket) -> tuple[dict, bytearray]:
        head_len, payload_len = _HEAD.unpack(bytes(_recv_exact(sock, _HEAD.size)))
        header = json.loads(bytes(_recv_exact(sock, head_len)))
        return header, _recv_exact(sock, payload_len)

    def _read(self, peer: str, sock: socket.socket) -> None:
        try:
            while True:
                header, payload = self._recv_frame(sock)
                if "tag" in header:
                    with self.cond:
                        self.inbox[(header["tag"], peer)] = payload
                        self.cond.notify_all()
                else:
                    self.on_control(peer, header)
        except (OSError, EOFError, ValueError) as exc:
            if self.closed:
                return
            with self.cond:
                self.lost = self.lost or peer
                self.cond.notify_all()
            self.on_lost(peer, str(exc) or type(exc).__name__)

    # --- use --------------------------------------------------------------------------------------

    def send(self, peer: str, tag: str, payload: Sequence) -> None:
        if peer == self.me:
            self.deliver(tag, self.me, b"".join(bytes(memoryview(p).cast("B")) for p in payload))
            return
        with self.send_locks[peer]:
            self.bytes_sent += self._send_frame(self.peers[peer], {"tag": tag}, payload)

    def control(self, peer: str, message: dict) -> None:
        if peer == self.me:
            self.on_control(self.me, message)
            return
        with self.send_locks[peer]:
            self._send_frame(self.peers[peer], message, ())

    def deliver(self, tag: str, sender: str, payload) -> None:
        with self.cond:
            self.inbox[(tag, sender)] = bytearray(payload)
            self.cond.notify_all()

    def take(self, tag: str, sender: str) -> bytearray:
        key = (tag, sender)
        with self.cond:
            while key not in self.inbox:
                if self.lost:
                    raise MeshError(f"lost proxy {self.lost}")
                if self.closed:
                    raise MeshError("mesh closed")
                self.cond.wait()
            return self.inbox.pop(key)

    def close(self) -> None:
        self.closed = True
        with self.cond:
            self.cond.notify_all()
        try:
            self.listener.close()
        except OSError:
            pass
        for sock in self.peers.values():
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
