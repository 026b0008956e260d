"""Messages between the proxies of one job (TCP; proxies live outside the checkpointed trees).

Every frame is a header (JSON) and a payload (bytes). Data frames carry a tag and land in an inbox
keyed by (tag, sender) until the collective that needs them takes them, so operations of different
channels may interleave freely. Control frames (the barrier's) go to a callback. A lost peer is fatal
to the job's collectives: `on_lost` is called once and every waiter is woken.

Anyone on the network can connect to a proxy's port, so a connection is a peer only once it proved,
before anything else is read from it, that it knows the generation's token (challenge-response, see
`handshake`): the token itself never crosses the wire, and a recorded handshake is useless on another
connection. Until then it may send only a few fixed-size bytes within `HANDSHAKE_S`; handshakes run
concurrently, at most `MAX_PENDING` at once (the oldest is dropped for a new one), so garbage, slow or
unauthenticated connections are logged and dropped without delaying the real peers. A connection
dialed from this host by a socket of another uid than the proxy's (root's) is closed before it takes
a handshake slot (`peeruid`): another user of a node cannot crowd out the real peers that way. Authenticated
frames are bounded too (`MAX_HEADER`, and the payload limit the proxy derives from its region size).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from . import peeruid

LOG = logging.getLogger("singularity.proxy.mesh")

_HEAD = struct.Struct("!IQ")
MAX_HEADER = 4 << 20
"""Bytes of one frame's JSON header (a barrier report names every channel of the job: kilobytes)."""
DEFAULT_MAX_PAYLOAD = 1 << 30
_UNFILLED_FROM = 1 << 16  # payloads from this size are received into memory that is not zeroed first
HANDSHAKE_S = 5.0
"""Seconds a connection has to complete its handshake."""
MAX_PENDING = 64
"""Handshakes in progress at once; a new connection beyond that drops the oldest one."""

MAGIC = b"SGMESH01"
NONCE = 32
MAC = 32
MAX_ID = 160
_CHALLENGE = len(MAGIC) + NONCE


class MeshError(Exception):
    """The mesh cannot be built or has lost a peer."""


class HandshakeError(MeshError):
    """A connection did not prove it is a proxy of this job's generation: it is dropped."""


# --- the handshake (pure) -------------------------------------------------------------------------


def handshake_mac(token: str, role: bytes, generation: str, acceptor: str, dialer: str,
                  acceptor_nonce: bytes, dialer_nonce: bytes) -> bytes:
    """HMAC-SHA256 keyed with the generation's token over everything the handshake establishes.

    `role` (b"dial" or b"accept") keeps one side's answer from being reflected as the other's; the
    generation and both ids bind it to this pair of proxies of this generation, the two nonces to this
    connection.
    """
    fields = [role, generation.encode(), acceptor.encode(), dialer.encode(), acceptor_nonce, dialer_nonce]
    message = b"".join(struct.pack("!I", len(f)) + f for f in fields)
    return hmac.new(token.encode(), message, hashlib.sha256).digest()


def challenge(nonce: bytes) -> bytes:
    """The acceptor's first bytes: the magic and its nonce."""
    return MAGIC + nonce


def parse_challenge(data: bytes) -> bytes:
    if len(data) != _CHALLENGE or not data.startswith(MAGIC):
        raise HandshakeError("the listener did not answer as a proxy mesh")
    return data[len(MAGIC):]


def dial_message(token: str, generation: str, acceptor: str, dialer: str, acceptor_nonce: bytes,
                 dialer_nonce: bytes) -> bytes:
    """The dialer's answer: its nonce, its id (length-prefixed) and its MAC."""
    ident = dialer.encode()
    if not 0 < len(ident) <= MAX_ID:
        raise HandshakeError(f"proxy id {dialer!r} is longer than {MAX_ID} bytes")
    mac = handshake_mac(token, b"dial", generation, acceptor, dialer, acceptor_nonce, dialer_nonce)
    return dialer_nonce + bytes([len(ident)]) + ident + mac


# --- frames ---------------------------------------------------------------------------------------


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    """`n` bytes; with a deadline, a peer that takes longer in total (not per read) is cut off.

    A large buffer is not zero-filled first (every byte is received into it): an uninitialised numpy
    array of the heap's reused memory, where a bytearray would write all of it once more."""
    buf = bytearray(n) if n < _UNFILLED_FROM else np.empty(n, dtype=np.uint8)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("handshake deadline passed")
            sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("peer closed the connection")
        got += k
    return buf


class _DropLog:
    """Log dropped connections, at most `burst` lines per minute (a flood must not fill the log)."""

    def __init__(self, burst: int = 20):
        self.burst = burst
        self.window = 0.0
        self.logged = 0
        self.suppressed = 0
        self.lock = threading.Lock()

    def __call__(self, me: str, address: object, why: str) -> None:
        now = time.monotonic()
        with self.lock:
            if now - self.window > 60:
                if self.suppressed:
                    LOG.warning("proxy %s: %d more mesh connections dropped in the last minute",
                                me, self.suppressed)
                self.window, self.logged, self.suppressed = now, 0, 0
            if self.logged >= self.burst:
                self.suppressed += 1
                return
            self.logged += 1
        LOG.warning("proxy %s: dropped mesh connection from %s: %s", me, address, why)


class Mesh:
    def __init__(self, me: str, generation: str, token: str, bind_host: str = "0.0.0.0",
                 on_control: Callable[[str, dict], None] | None = None,
                 on_lost: Callable[[str, str], None] | None = None,
                 max_payload: int = DEFAULT_MAX_PAYLOAD, handshake_s: float = HANDSHAKE_S,
                 max_pending: int = MAX_PENDING,
                 dialer_uid: Callable[[socket.socket], int | None] = peeruid.peer_uid):
        self.me = me
        self.dialer_uid = dialer_uid  # of a dialer on this host; None for one elsewhere
        self.generation = generation
        self.token = token
        self.on_control = on_control or (lambda peer, message: None)
        self.on_lost = on_lost or (lambda peer, why: None)
        self.max_payload = max_payload
        self.handshake_s = handshake_s
        self.max_pending = max_pending
        self.listener = socket.create_server((bind_host, 0))
        self.port = self.listener.getsockname()[1]
        self.peers: dict[str, socket.socket] = {}
        self.send_locks: dict[str, threading.Lock] = {}
        self.inbox: dict[tuple[str, str], bytearray] = {}
        self.cond = threading.Condition()
        self.lost: str | None = None
        self.closed = False
        self.bytes_sent = 0
        self.expected: set[str] = set()  # peers that dial us and have not yet authenticated
        self.pending: dict[socket.socket, float] = {}  # handshakes in progress, oldest first
        self.dropped = 0
        self._log_drop = _DropLog()

    # --- building ---------------------------------------------------------------------------------

    def connect(self, addresses: dict[str, tuple[str, int]], timeout: float = 120.0) -> None:
        """Connect to every peer in `addresses` (proxy id -> (host, port)): lower ids dial higher."""
        if not self.token:
            raise MeshError("no rendezvous token: the mesh cannot authenticate its peers")
        expected = set(addresses) - {self.me}
        with self.cond:
            self.expected = {p for p in expected if p < self.me}
        threading.Thread(target=self._accept, daemon=True).start()
        for peer in sorted(p for p in expected if p > self.me):
            host, port = addresses[peer]
            self._add(peer, self._dial(peer, host, port, time.monotonic() + timeout))
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

    def _dial(self, peer: str, host: str, port: int, deadline: float) -> socket.socket:
        """A connection to `peer` that proved it knows the token; retried until `deadline`."""
        while True:
            if self.closed:
                raise MeshError("mesh closed while connecting")
            try:
                sock = socket.create_connection((host, port), timeout=self.handshake_s)
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise MeshError(f"cannot reach proxy {peer} at {host}:{port}: {exc}") from exc
                time.sleep(0.1)
                continue
            try:
                self._dial_handshake(sock, peer)
                sock.settimeout(None)
                return sock
            except (OSError, EOFError, HandshakeError) as exc:
                sock.close()
                if time.monotonic() > deadline:
                    raise MeshError(f"proxy {peer} at {host}:{port} did not authenticate: {exc}") from exc
                LOG.info("proxy %s: handshake with %s at %s:%s failed (%s); retrying", self.me, peer,
                         host, port, exc)
                time.sleep(0.1)

    def _dial_handshake(self, sock: socket.socket, peer: str) -> None:
        deadline = time.monotonic() + self.handshake_s
        acceptor_nonce = parse_challenge(bytes(_recv_exact(sock, _CHALLENGE, deadline)))
        dialer_nonce = os.urandom(NONCE)
        sock.sendall(dial_message(self.token, self.generation, peer, self.me, acceptor_nonce, dialer_nonce))
        answer = bytes(_recv_exact(sock, MAC, deadline))
        want = handshake_mac(self.token, b"accept", self.generation, peer, self.me, acceptor_nonce,
                             dialer_nonce)
        if not hmac.compare_digest(answer, want):
            raise HandshakeError(f"the listener does not know generation {self.generation}'s token")

    def _accept(self) -> None:
        while not self.closed:
            try:
                sock, address = self.listener.accept()
            except OSError:
                return
            uid = self.dialer_uid(sock)
            if uid is not None and uid != os.geteuid():  # root's proxies dial as root
                with self.cond:
                    self.dropped += 1
                self._log_drop(self.me, address, f"dialed by uid {uid} of this host: a proxy's peers "
                               "are proxies, which run as root")
                sock.close()
                continue
            with self.cond:
                if not self.expected:  # every peer that dials us is here: nobody else may be
                    self.dropped += 1
                    self._log_drop(self.me, address, "no peer is expected")
                    sock.close()
                    continue
                if len(self.pending) >= self.max_pending:
                    oldest = next(iter(self.pending))
                    del self.pending[oldest]
                    self.dropped += 1
                    self._log_drop(self.me, _address(oldest), f"{self.max_pending} handshakes pending: "
                                   "dropped the oldest")
                    _shut(oldest)
                self.pending[sock] = time.monotonic()
            threading.Thread(target=self._accept_one, args=(sock, address), daemon=True).start()

    def _accept_one(self, sock: socket.socket, address: object) -> None:
        try:
            peer = self._accept_handshake(sock)
        except (OSError, EOFError, HandshakeError) as exc:
            with self.cond:
                self.pending.pop(sock, None)
                self.dropped += 1
            self._log_drop(self.me, address, str(exc) or type(exc).__name__)
            sock.close()
            return
        with self.cond:
            still_pending = self.pending.pop(sock, None) is not None
            fresh = still_pending and peer in self.expected and not self.closed
            if fresh:
                self.expected.discard(peer)
        if not fresh:
            self._log_drop(self.me, address, f"proxy {peer} is already connected or was dropped")
            sock.close()
            return
        sock.settimeout(None)
        self._add(peer, sock)

    def _accept_handshake(self, sock: socket.socket) -> str:
        """Challenge, then read exactly the dialer's fixed-size answer; its MAC before anything else."""
        deadline = time.monotonic() + self.handshake_s
        acceptor_nonce = os.urandom(NONCE)
        sock.settimeout(self.handshake_s)
        sock.sendall(challenge(acceptor_nonce))
        head = bytes(_recv_exact(sock, NONCE + 1, deadline))
        dialer_nonce, id_len = head[:NONCE], head[NONCE]
        if id_len == 0 or id_len > MAX_ID:
            raise HandshakeError(f"claimed a proxy id of {id_len} bytes")
        rest = bytes(_recv_exact(sock, id_len + MAC, deadline))
        raw_id, mac = rest[:id_len], rest[id_len:]
        try:
            peer = raw_id.decode("ascii")
        except UnicodeDecodeError:
            raise HandshakeError("the proxy id is not ASCII") from None
        with self.cond:
            expected = peer in self.expected
        want = handshake_mac(self.token, b"dial", self.generation, self.me, peer, acceptor_nonce,
                             dialer_nonce)
        if not hmac.compare_digest(mac, want):
            raise HandshakeError(f"wrong MAC for proxy {peer[:64]!r} of generation {self.generation}")
        if not expected:
            raise HandshakeError(f"proxy {peer!r} is not a peer that dials this one")
        sock.sendall(handshake_mac(self.token, b"accept", self.generation, self.me, peer, acceptor_nonce,
                                   dialer_nonce))
        return peer

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

    def _recv_frame(self, sock: socket.socket) -> tuple[dict, bytearray]:
        head_len, payload_len = _HEAD.unpack(bytes(_recv_exact(sock, _HEAD.size)))
        if head_len > MAX_HEADER:
            raise ValueError(f"frame header of {head_len} bytes exceeds {MAX_HEADER}")
        if payload_len > self.max_payload:
            raise ValueError(f"frame payload of {payload_len} bytes exceeds {self.max_payload}")
        header = json.loads(bytes(_recv_exact(sock, head_len)))
        if not isinstance(header, dict):
            raise ValueError("frame header is not a JSON object")
        return header, _recv_exact(sock, payload_len)

    def _read(self, peer: str, sock: socket.socket) -> None:
        try:
            while True:
                header, payload = self._recv_frame(sock)
                if "tag" in header:
                    with self.cond:
                        self.inbox[(str(header["tag"]), peer)] = payload
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
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.listener.close()
        except OSError:
            pass
        with self.cond:
            pending, self.pending = list(self.pending), {}
        for sock in pending:
            _shut(sock)
        for sock in list(self.peers.values()):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


def _shut(sock: socket.socket) -> None:
    """Wake the thread reading `sock` (it then closes it)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _address(sock: socket.socket) -> object:
    try:
        return sock.getpeername()
    except OSError:
        return "?"
