"""One request/reply layer for the project's unix sockets: the node agent's and the proxies' control.

The bytes are `wire`'s frames (a 4-byte big-endian length, then a JSON object), the same as the ranks'
protocol; `wire` stays their one definition. On top of them this module adds what a root daemon
serving untrusted local users needs:

- a frame's size is checked from its header, before any of its body is read or allocated;
- the peer's identity (pid, uid, gid) comes from the kernel (SO_PEERCRED) and reaches the handler;
  a server may refuse a peer before reading anything from it;
- a server serves at most `max_connections` connections at once (root has a few more, so an admin
  or the Epilog is served while a user holds every ordinary slot); one more is answered `busy` and
  closed; a connection that sends no complete request within `idle_timeout` is closed;
- every reply is `{"ok": true, ...}` or `{"ok": false, "error": message, "kind": code}`, and `call`
  raises the exception class of the kind, so callers branch on classes (or `kind`), never on text;
- `call` raises only `RpcError`s: transport faults (no socket, timeout, a garbled reply) too.

Kinds: bad_request, too_large, forbidden, busy, conflict, unavailable, no_checkpoint, wrong_devices,
refused, failed (server side); unreachable, timeout, protocol (client side).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from singularity_slurm.errors import NoCheckpoint, SingularityError
from singularity_slurm.interpose.pyhook._singularity_worker import wire

LOG = logging.getLogger("singularity.rpc")
MAX_REQUEST = wire.MAX_FRAME
"""Bytes of one request or reply frame (its JSON body), unless a server or caller says otherwise."""
MAX_CONNECTIONS = 32
ROOT_RESERVE = 4
IDLE_TIMEOUT_S = 10.0
SEND_TIMEOUT_S = 10.0


# --- errors -----------------------------------------------------------------------------------------


class RpcError(SingularityError):
    """A request did not get a successful reply; `kind` says why in one word (see the module's list)."""

    kind: str = "failed"

    def __init__(self, message: str, kind: str | None = None):
        super().__init__(message)
        if kind is not None:
            self.kind = kind


class TransportError(RpcError):
    """No reply came: the server could not be reached, was too slow, or answered garbage."""


class Unreachable(TransportError):
    """The socket is missing, refuses connections, or may not be opened: is the daemon running?"""

    kind = "unreachable"


class TimedOut(TransportError):
    """The server took longer than the caller's timeout."""

    kind = "timeout"


class BrokenReply(TransportError):
    """The server closed the connection without a reply, or sent something that is not one."""

    kind = "protocol"


class RemoteError(RpcError):
    """The server answered with an error. Raised by handlers too: the server sends its message and kind.

    A handler's exception whose cause (`raise ... from exc`) is a project error of a known class takes
    that class's kind (a NoCheckpoint cause: `no_checkpoint`) unless a kind was given.
    """

    kind = "refused"


class BadRequest(RemoteError):
    """The request is malformed: not a frame or JSON object, an unknown op, an invalid field."""

    kind = "bad_request"


class TooLarge(BadRequest):
    """The request's frame is larger than the server accepts; none of it was read."""

    kind = "too_large"


class Forbidden(RemoteError):
    """The caller (by SO_PEERCRED) may not use this server."""

    kind = "forbidden"


class Busy(RemoteError):
    """The server serves as many connections as it allows: try again shortly."""

    kind = "busy"


class Conflict(RemoteError):
    """The request does not fit the server's state now (already running, nothing to checkpoint)."""

    kind = "conflict"


class Unavailable(RemoteError):
    """What the request needs is not there now (no launcher polling, no checkpoint engine)."""

    kind = "unavailable"


class NoCheckpointFound(RemoteError):
    """The job has no checkpoint that can be restored: start it from the beginning."""

    kind = "no_checkpoint"


class WrongDevices(RemoteError):
    """The job's devices on this node cannot take its checkpoint (GPUs of another type, an unhealthy
    GPU): requeue it away from the node."""

    kind = "wrong_devices"


class Failed(RemoteError):
    """The server tried and failed (an internal error, CRIU, the store); the message says what."""

    kind = "failed"


RequestError = RemoteError
"""What a handler raises for a request it cannot serve (the node agent's name for it)."""

_CLASSES: dict[str, type[RemoteError]] = {cls.kind: cls for cls in (
    RemoteError, BadRequest, TooLarge, Forbidden, Busy, Conflict, Unavailable, NoCheckpointFound,
    WrongDevices, Failed)}
_CAUSES: tuple[tuple[type[BaseException], str], ...] = ((NoCheckpoint, NoCheckpointFound.kind),)


def kind_of(exc: BaseException) -> str:
    """The kind an exception is answered with: its own; for a plain RemoteError (or another exception)
    whose cause chain holds a project error with a kind of its own (NoCheckpoint), that one."""
    if isinstance(exc, RpcError) and ("kind" in vars(exc) or type(exc).kind != RemoteError.kind):
        return exc.kind
    cause = exc.__cause__
    while cause is not None:
        for cls, kind in _CAUSES:
            if isinstance(cause, cls):
                return kind
        cause = cause.__cause__
    return exc.kind if isinstance(exc, RpcError) else Failed.kind


def error_reply(exc: BaseException) -> dict[str, Any]:
    return {"ok": False, "error": str(exc), "kind": kind_of(exc)}


def raise_for(reply: Any, where: str = "the server") -> dict[str, Any]:
    """`reply` itself if it is a successful reply; else the RpcError of its kind."""
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        raise BrokenReply(f"{where} answered something that is not a reply: {str(reply)[:200]!r}")
    if reply["ok"]:
        return reply
    message = reply.get("error")
    kind = reply.get("kind")
    message = message if isinstance(message, str) else f"{where} refused the request without a reason"
    kind = kind if isinstance(kind, str) and kind.isidentifier() else RemoteError.kind
    raise _CLASSES.get(kind, RemoteError)(message, kind)


# --- frames with deadlines ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Peer:
    """The process at the other end of a unix socket, as the kernel saw it when it connected."""

    pid: int
    uid: int
    gid: int


def peer_of(sock: socket.socket) -> Peer:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return Peer(*struct.unpack("3i", raw))


class _Timeout(Exception):
    pass


def _recv_exact(sock: socket.socket, size: int, deadline: float | None) -> bytes | None:
    """Exactly `size` bytes; None at a clean end before the first byte; EOFError in the middle."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Timeout()
            sock.settimeout(left)
        else:
            sock.settimeout(None)
        try:
            n = sock.recv_into(view[got:], min(size - got, 1 << 16))
        except TimeoutError:
            raise _Timeout() from None
        if n == 0:
            if got == 0:
                return None
            raise EOFError(f"connection closed {got} bytes into a {size}-byte read")
        got += n
    return bytes(buffer)


def read_frame(sock: socket.socket, limit: int, deadline: float | None) -> dict | None:
    """The next frame's object; None at a clean end. Its size is checked before its body is read:
    wire.FrameTooLarge. Garbage: wire.ProtocolError. Past `deadline`: _Timeout."""
    header = _recv_exact(sock, wire.HEADER_BYTES, deadline)
    if header is None:
        return None
    length = wire.frame_length(header, limit)
    body = _recv_exact(sock, length, deadline)
    if body is None:
        raise EOFError("connection closed after a frame's header")
    return wire.decode(body)


def _send_quietly(sock: socket.socket, message: dict) -> None:
    """One frame to a peer we are about to drop; never blocks the caller for long."""
    try:
        sock.settimeout(0.5)
        wire.send(sock, message)
    except (OSError, wire.ProtocolError):
        pass


# --- the client ---------------------------------------------------------------------------------------


def call(path: str | Path, payload: dict, timeout: float | None = 5.0, *, service: str = "the server",
         limit: int = MAX_REQUEST, busy_retry_s: float = 0.0) -> dict[str, Any]:
    """Send one request to the server at `path` and return its successful reply.

    Raises the RemoteError class of the reply's kind when the server refused, and a TransportError
    when no reply came within `timeout` seconds (None: wait as long as it takes). Nothing else.
    A `busy` answer is tried again, with a growing pause, for up to `busy_retry_s` seconds.
    """
    give_up = time.monotonic() + busy_retry_s
    pause = 0.1
    while True:
        try:
            return _call_once(path, payload, timeout, service, limit)
        except Busy:
            if time.monotonic() + pause > give_up:
                raise
            time.sleep(pause)
            pause = min(pause * 2, 5.0)


def _call_once(path: str | Path, payload: dict, timeout: float | None, service: str,
               limit: int) -> dict[str, Any]:
    where = f"{service} at {path}"
    op = payload.get("op", "the request")
    try:
        frame = wire.encode(payload)
    except wire.ProtocolError as exc:
        raise TooLarge(f"{op}: the request is too large to send: {exc}") from exc
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"{op}: the request cannot be sent as JSON: {exc}") from exc
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(timeout)
            try:
                sock.connect(str(path))
            except (FileNotFoundError, ConnectionRefusedError, PermissionError, NotADirectoryError) as exc:
                raise Unreachable(f"cannot reach {where}: {exc.strerror or exc}; is it running?") from exc
            except BlockingIOError as exc:  # its queue of connections not yet accepted is full
                raise Busy(f"{where} is flooded with connections; try again shortly") from exc
            try:
                sock.sendall(frame)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server dropped us (busy, forbidden, too large): read why if it said so
            try:
                reply = read_frame(sock, limit, deadline)
            except (EOFError, ConnectionResetError) as exc:
                raise BrokenReply(f"{where} broke the connection while answering {op}: {exc}") from exc
    except _Timeout:
        raise TimedOut(f"{where} did not answer {op} within {timeout:g}s") from None
    except TimeoutError as exc:
        raise TimedOut(f"{where} did not answer {op} within {timeout:g}s") from exc
    except wire.ProtocolError as exc:
        raise BrokenReply(f"{where} answered {op} with something that is not a reply: {exc}") from exc
    except RpcError:
        raise
    except OSError as exc:
        raise Unreachable(f"cannot talk to {where}: {exc.strerror or exc}") from exc
    if reply is None:
        raise BrokenReply(f"{where} closed the connection without answering {op}")
    return raise_for(reply, where)


# --- the server ---------------------------------------------------------------------------------------


@dataclass
class Call:
    """One request's context for a handler: who sent it, and what to do once the caller has the reply
    (`after_reply` callbacks run when the caller closes its connection)."""

    peer: Peer
    after_reply: list[Callable[[], None]] = field(default_factory=list)


Handler = Callable[[dict, Call], dict]
"""Serves one request: returns the whole reply ({"ok": ...}) or raises (RemoteError: its kind)."""


@dataclass(frozen=True)
class Limits:
    max_request: int = MAX_REQUEST
    max_connections: int = MAX_CONNECTIONS
    root_reserve: int = ROOT_RESERVE
    idle_timeout: float = IDLE_TIMEOUT_S
    send_timeout: float = SEND_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.root_reserve < 0 or self.max_request < 64:
            raise ValueError(f"invalid RPC limits: {self}")


def admit(uid: int, active: int, limits: Limits) -> bool:
    """Whether one more connection from `uid` is served while `active` are: everyone shares
    `max_connections`; root may go `root_reserve` past it, so it is served while users hold the rest."""
    return active < limits.max_connections + (limits.root_reserve if uid == 0 else 0)


class Throttled:
    """Warnings about refused peers, at most `burst` lines a minute: any local user can open
    connections in a loop, and the log lies on the node's own file systems."""

    def __init__(self, log: logging.Logger, burst: int = 20, window: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.log = log
        self.burst = burst
        self.window = window
        self.clock = clock
        self.started = -window
        self.logged = 0
        self.suppressed = 0
        self.lock = threading.Lock()

    def warning(self, message: str, *args: Any) -> None:
        now = self.clock()
        with self.lock:
            if now - self.started >= self.window:
                if self.suppressed:
                    self.log.warning("%d more such warnings in the last %.0f s", self.suppressed,
                                     self.window)
                self.started, self.logged, self.suppressed = now, 0, 0
            if self.logged >= self.burst:
                self.suppressed += 1
                return
            self.logged += 1
        self.log.warning(message, *args)


class Server:
    """Serves `handler` on a unix socket at `path`, one thread per connection, within `limits`.

    `allow(peer)` returns None to serve the peer, or the reason it is refused (sent as `forbidden`
    before anything is read). `name` says what serves, in messages.
    """

    def __init__(self, path: Path, handler: Handler, *, name: str, mode: int = 0o600,
                 allow: Callable[[Peer], str | None] | None = None, limits: Limits | None = None):
        self.path = path
        self.handler = handler
        self.name = name
        self.mode = mode
        self.allow = allow
        self.limits = limits or Limits()
        self.lock = threading.Lock()
        self.warn = Throttled(LOG)
        self.active = 0
        self.closed = threading.Event()
        self.listener: socket.socket | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> Server:
        """Listen; the socket appears at `path` (with `mode`) only once it listens."""
        self.path.unlink(missing_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        listener.bind(str(tmp))
        os.chmod(tmp, self.mode)
        listener.listen(socket.SOMAXCONN)  # accepting is quick: past the cap, `busy` is answered
        os.rename(tmp, self.path)
        self.listener = listener
        self.thread = threading.Thread(target=self._accept, name=f"{self.name}-accept", daemon=True)
        self.thread.start()
        return self

    def close(self) -> None:
        """Stop accepting (connections being served finish on their own) and remove the socket."""
        self.closed.set()
        if self.listener is not None:
            try:
                self.listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.listener.close()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=5)
        self.path.unlink(missing_ok=True)

    def wait(self) -> None:
        self.closed.wait()

    def _accept(self) -> None:
        assert self.listener is not None
        while not self.closed.is_set():
            try:
                sock, _ = self.listener.accept()
            except OSError as exc:
                if self.closed.is_set() or exc.errno in (errno.EBADF, errno.EINVAL):
                    return
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    LOG.warning("%s: cannot accept a connection: %s", self.name, exc)
                    self.closed.wait(0.1)
                continue
            try:
                self._admit(sock)
            except Exception:  # the server outlives any one connection
                LOG.exception("%s: could not take a connection", self.name)
                sock.close()

    def _admit(self, sock: socket.socket) -> None:
        peer = peer_of(sock)
        why = self.allow(peer) if self.allow is not None else None
        if why is not None:
            self.warn.warning("%s: refused uid %s (pid %s): %s", self.name, peer.uid, peer.pid, why)
            _send_quietly(sock, error_reply(Forbidden(why)))
            sock.close()
            return
        with self.lock:
            served = admit(peer.uid, self.active, self.limits)
            if served:
                self.active += 1
        if not served:
            self.warn.warning("%s: busy (%s connections); refused one from uid %s (pid %s)", self.name,
                        self.active, peer.uid, peer.pid)
            _send_quietly(sock, error_reply(Busy(
                f"{self.name} serves {self.limits.max_connections} connections already (its limit); "
                "try again shortly")))
            sock.close()
            return
        try:
            threading.Thread(target=self._serve, args=(sock, peer), name=f"{self.name}-conn",
                             daemon=True).start()
        except RuntimeError:  # no thread could be started
            self._release()
            sock.close()
            raise

    def _release(self) -> None:
        with self.lock:
            self.active -= 1

    def _serve(self, sock: socket.socket, peer: Peer) -> None:
        call_ = Call(peer)
        try:
            while True:
                deadline = time.monotonic() + self.limits.idle_timeout
                try:
                    request = read_frame(sock, self.limits.max_request, deadline)
                except wire.FrameTooLarge as exc:
                    self.warn.warning("%s: refused a request of %s bytes from uid %s (pid %s)", self.name,
                                exc.length, peer.uid, peer.pid)
                    self._reply(sock, error_reply(TooLarge(
                        f"request of {exc.length} bytes is over the {exc.limit}-byte limit")))
                    return  # the body was not read: the stream cannot be resynchronised
                except wire.ProtocolError as exc:
                    self._reply(sock, error_reply(BadRequest(f"bad request: {exc}")))
                    return
                except _Timeout:
                    return  # idle or too slow: drop it, its thread and its slot
                if request is None:
                    return
                try:
                    reply = self.handler(request, call_)
                except RemoteError as exc:
                    reply = error_reply(exc)
                except Exception as exc:  # the server outlives any one request
                    LOG.exception("%s: %s failed", self.name, request.get("op"))
                    reply = error_reply(Failed(f"{request.get('op')} failed: {exc}"))
                if not self._reply(sock, reply):
                    return
        except (OSError, EOFError, wire.ProtocolError):
            pass
        finally:
            self._release()  # first: a peer that sees the close finds the slot free
            sock.close()
            for callback in call_.after_reply:  # the caller closed its end: it has every answer
                try:
                    callback()
                except Exception:
                    LOG.exception("%s: a callback after a reply failed", self.name)

    def _reply(self, sock: socket.socket, reply: dict) -> bool:
        try:
            frame = wire.encode(reply)
        except (wire.ProtocolError, TypeError, ValueError) as exc:
            frame = wire.encode(error_reply(Failed(f"the reply could not be sent: {exc}")))
        try:
            sock.settimeout(self.limits.send_timeout)
            sock.sendall(frame)
        except OSError:
            return False
        return True
