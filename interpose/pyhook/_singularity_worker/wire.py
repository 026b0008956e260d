"""The framing every proxy connection uses, and the names workers find their proxy by.

A frame is a 4-byte big-endian length and a JSON object; on the worker connection, file descriptors
(shared-memory regions) ride along with SCM_RIGHTS. Standard library only: workers import this in
their own Python environment, and a worker's checkpoint image must not depend on anything but a name
to reconnect to. The proxy (root) imports the same module.
"""

from __future__ import annotations

import json
import os
import socket
import struct

_LENGTH = struct.Struct("!I")
MAX_FRAME = 1 << 20
MAX_FDS = 4


class ProtocolError(Exception):
    """A peer sent something that is not a frame of this protocol."""


RANK_DIR_ENV = "SINGULARITY_RANK_DIR"
"""The variable the node agent gives ranks: the folder of rank sockets (`<paths.state_dir>/ranks`)."""

_SUN_PATH_MAX = 107  # sockaddr_un's sun_path holds 108 bytes, the last one a NUL


def rank_address(job_id: int | str, rank: int, rank_dir: str) -> str:
    """The unix socket the proxy serving `rank` of a job listens on: `<rank_dir>/<job>/<rank>.sock`.

    `rank_dir` is the same path on every node, and `<job>` a folder only root can create in (the
    proxy makes it; another user can neither take the name first nor replace it), so a restored
    worker reaches whichever proxy serves its rank on the node it was restored on, through the same
    path. The socket exists only while the proxy accepts the rank: a parked worker finds it missing
    until the checkpoint is over. Callers check the listener is root (SO_PEERCRED) before trusting it.
    """
    job = str(job_id)
    if not job.isdigit() or int(job) <= 0 or isinstance(job_id, bool):
        raise ValueError(f"job id must be a positive integer, got {job_id!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be a non-negative integer, got {rank!r}")
    if not rank_dir.startswith("/"):
        raise ValueError(f"the rank socket folder must be an absolute path, got {rank_dir!r}")
    path = f"{rank_dir.rstrip('/')}/{int(job)}/{rank}.sock"
    if len(path.encode()) > _SUN_PATH_MAX:
        raise ValueError(f"rank socket path {path} is longer than the {_SUN_PATH_MAX} bytes a unix socket "
                         "name may have: choose a shorter paths.state_dir")
    return path


def encode(message: dict) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME:
        raise ProtocolError(f"frame of {len(data)} bytes exceeds {MAX_FRAME}")
    return _LENGTH.pack(len(data)) + data


def send(sock: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    frame = encode(message)
    if fds:
        sent = socket.send_fds(sock, [frame], fds)
        if sent < len(frame):
            sock.sendall(frame[sent:])
    else:
        sock.sendall(frame)


class Reader:
    """Reads frames (and the descriptors that came with them) from a stream socket."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buffer = b""
        self.fds: list[int] = []

    def recv(self) -> tuple[dict, list[int]]:
        """The next frame and the descriptors received with it; EOFError at a clean end."""
        while True:
            if len(self.buffer) >= _LENGTH.size:
                (length,) = _LENGTH.unpack_from(self.buffer)
                if length > MAX_FRAME:
                    raise ProtocolError(f"frame length {length} exceeds {MAX_FRAME}")
                end = _LENGTH.size + length
                if len(self.buffer) >= end:
                    data, self.buffer = self.buffer[_LENGTH.size:end], self.buffer[end:]
                    fds, self.fds = self.fds, []
                    return decode(data), fds
            # Never read past the frame being assembled (or its length), so the buffer stays within
            # one frame of MAX_FRAME bytes, and never hold more than MAX_FDS descriptors for it.
            want = _LENGTH.size - len(self.buffer)
            if want <= 0:
                want = _LENGTH.size + _LENGTH.unpack_from(self.buffer)[0] - len(self.buffer)
            data, fds, _, _ = socket.recv_fds(self.sock, max(want, 1), MAX_FDS)
            self.fds.extend(fds)
            if len(self.fds) > MAX_FDS:
                for fd in self.fds:
                    _close_quietly(fd)
                self.fds = []
                raise ProtocolError(f"more than {MAX_FDS} descriptors came with one frame")
            if not data:
                for fd in self.fds:
                    _close_quietly(fd)
                self.fds = []
                raise EOFError("connection closed")
            self.buffer += data


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def peer_uid(sock: socket.socket) -> int:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)[1]


# --- pieces for readers that check a frame's size before reading its body (`singularity_slurm.rpc`) ---

HEADER_BYTES = _LENGTH.size


class FrameTooLarge(ProtocolError):
    """A frame's header announces more bytes than the reader accepts; nothing of the body was read."""

    def __init__(self, length: int, limit: int):
        self.length = length
        self.limit = limit
        super().__init__(f"frame length {length} exceeds {limit}")


def frame_length(header: bytes, limit: int = MAX_FRAME) -> int:
    """The body length a frame's header announces; FrameTooLarge past `limit`."""
    (length,) = _LENGTH.unpack(header)
    if length > limit:
        raise FrameTooLarge(length, limit)
    return length


def decode(data: bytes) -> dict:
    """A frame's body as the JSON object it must be."""
    try:
        message = json.loads(data)
    except ValueError as exc:
        raise ProtocolError(f"frame is not JSON: {exc}") from exc
    if not isinstance(message, dict):
        raise ProtocolError("frame is not a JSON object")
    return message
