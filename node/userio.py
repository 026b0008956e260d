"""Reading and writing the job user's files from a child that runs as the job's user.

Root (the node agent) never opens a path the job's user controls: the file-log, the node-local
files it lists, the folders they go back into at a restore, the job's output file. It starts this
file as a child process that has dropped to the user's uid, gid and supplementary groups, with a
clean environment (`run_as_user`), so the kernel applies the user's rights to every path lookup.
The child still refuses anything but a regular file of the user: it opens with O_NOFOLLOW and
O_NONBLOCK (a symlink fails, a FIFO does not block), walks folders below a node-local prefix one
at a time with O_NOFOLLOW, and checks the open file with fstat (type and owner).

The two processes exchange frames over the child's stdin and stdout: one kind byte, a 4-byte
big-endian length, the payload (at most MAX_FRAME bytes). The parent sends a request ('Q', JSON)
and, for a write, files ('F' JSON header, 'D' data, 'E' end); the child answers with files ('F',
'D', 'E'), notices for the job's output ('N', text), files written ('K', JSON) and 'Z' when done.
The child runs as the user, who may take it over (ptrace), so the parent trusts nothing it says:
the parent bounds every frame, every byte count and the time, and kills the child when it strays.

This file runs as a script (`python -I userio.py`) and uses the standard library only.
"""

from __future__ import annotations

import errno
import json
import os
import selectors
import signal
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

HEADER = struct.Struct(">cI")
MAX_FRAME = 1 << 20
MAX_NOTICE = 1000
CHUNK = 1 << 20
CLEAN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8"}
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UserIOError(Exception):
    """The child acting as the job's user failed, timed out or broke the protocol."""


def frame(kind: bytes, payload: bytes = b"") -> bytes:
    if len(payload) > MAX_FRAME:
        raise ValueError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME}")
    return HEADER.pack(kind, len(payload)) + payload


class FrameReader:
    """Cuts a byte stream into (kind, payload) frames, refusing any payload over MAX_FRAME."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def feed(self, data: bytes) -> Iterator[tuple[bytes, bytes]]:
        self.buffer += data
        while len(self.buffer) >= HEADER.size:
            kind, length = HEADER.unpack_from(self.buffer)
            if length > MAX_FRAME:
                raise UserIOError(f"a frame of {length} bytes (the limit is {MAX_FRAME})")
            if len(self.buffer) < HEADER.size + length:
                return
            payload = bytes(self.buffer[HEADER.size:HEADER.size + length])
            del self.buffer[:HEADER.size + length]
            yield kind, payload


# --- the child: runs as the job's user ------------------------------------------------------------


class Refused(Exception):
    """A path the child will not read or write; the message goes to the job's output."""


def describe_type(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return "not a regular file"


def check_regular(st: os.stat_result, path: str, uid: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise Refused(f"{path} is {describe_type(st.st_mode)}, not a regular file")
    if st.st_uid != uid:
        raise Refused(f"{path} belongs to uid {st.st_uid}, not to the job's user (uid {uid})")


def _split(path: str, bases: Sequence[str]) -> tuple[str, list[str]]:
    """The base folder `path` lies under and the components below it."""
    for base in bases:
        base = base.rstrip("/") or "/"
        if base == "/" or path.startswith(base + "/"):
            rest = [part for part in path[len(base):].split("/") if part]
            if rest and not any(part in (".", "..") for part in rest):
                return base, rest
    raise Refused(f"{path} is not under {', '.join(bases)}")


def open_below(path: str, bases: Sequence[str], flags: int, mode: int = 0o600,
               make_dirs: bool = False) -> int:
    """Open `path`, one folder at a time below its base, never following a symlink."""
    base, parts = _split(path, bases)
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        walked = base.rstrip("/")
        for part in parts[:-1]:
            walked += "/" + part
            try:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not make_dirs:
                    raise Refused(f"{walked} does not exist") from None
                try:
                    os.mkdir(part, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise Refused(f"{walked} is a symlink or not a folder") from None
                raise
            os.close(fd)
            fd = nxt
        try:
            return os.open(parts[-1], flags | _OPEN_FLAGS, mode, dir_fd=fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise Refused(f"{path} is a symlink") from None
            raise
    finally:
        os.close(fd)


class _Child:
    def __init__(self) -> None:
        self.out = sys.stdout.buffer
        self.uid = os.getuid()

    def send(self, kind: bytes, payload: bytes = b"") -> None:
        self.out.write(frame(kind, payload))

    def notice(self, text: str) -> None:
        self.send(b"N", text[:MAX_NOTICE].encode(errors="replace"))

    def frames(self) -> Iterator[tuple[bytes, bytes]]:
        reader = FrameReader()
        while chunk := sys.stdin.buffer.read1(CHUNK):
            yield from reader.feed(chunk)

    def read(self, request: dict) -> None:
        """Send each of `paths` (regular files of the user) while the byte budget lasts."""
        budget = int(request["budget"])
        for path in request["paths"]:
            try:
                fd = open_below(path, request["bases"], os.O_RDONLY)
            except Refused as exc:
                self.notice(f"not carried: {exc}")
                continue
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    self.notice(f"not carried: {path}: {exc.strerror}")
                continue
            try:
                st = os.fstat(fd)
                check_regular(st, path, self.uid)
            except Refused as exc:
                os.close(fd)
                self.notice(f"not carried: {exc}")
                continue
            with os.fdopen(fd, "rb", buffering=0) as handle:
                size = st.st_size
                if size > budget:
                    if not request.get("truncate"):
                        self.notice(f"not carried: {path} ({size} bytes) would exceed "
                                    f"{request['limit_name']} = {request['limit']} bytes")
                        continue
                    self.notice(f"{path} holds {size} bytes, over {request['limit_name']} = "
                                f"{request['limit']}: only its first {budget} bytes are used")
                    size = budget
                self.send(b"F", json.dumps({"path": path, "mode": stat.S_IMODE(st.st_mode)}).encode())
                left = size
                while left > 0 and (data := handle.read(min(CHUNK, left))):
                    self.send(b"D", data)
                    left -= len(data)
                self.send(b"E")
                budget -= size - left

    def write(self, request: dict) -> None:
        """Write the files that follow ('F', 'D'..., 'E'), creating missing folders as the user."""
        fd: int | None = None
        current: dict = {}
        for kind, payload in self.frames():
            if kind == b"F":
                current = json.loads(payload)
                fd = self._open_for_write(current, request["bases"])
            elif kind == b"D" and fd is not None:
                view = memoryview(payload)
                while view:
                    view = view[os.write(fd, view):]
            elif kind == b"E" and fd is not None:
                os.fchmod(fd, int(current["mode"]) & 0o777)
                os.close(fd)
                fd = None
                self.send(b"K", json.dumps({"path": current["path"]}).encode())

    def _open_for_write(self, header: dict, bases: Sequence[str]) -> int | None:
        path = header["path"]
        try:
            fd = open_below(path, bases, os.O_WRONLY | os.O_CREAT, 0o600, make_dirs=True)
        except Refused as exc:
            self.notice(f"not put back: {exc}")
            return None
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # O_WRONLY|O_NONBLOCK on a FIFO without a reader
                self.notice(f"not put back: {path} is a FIFO or device, not a regular file")
            else:
                self.notice(f"not put back: {path}: {exc.strerror}")
            return None
        try:
            check_regular(os.fstat(fd), path, self.uid)
        except Refused as exc:
            os.close(fd)
            self.notice(f"not put back: {exc}")
            return None
        if header.get("truncate", True):
            os.ftruncate(fd, 0)
        return fd

    def append(self, request: dict) -> None:
        path = request["path"]
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | _OPEN_FLAGS)
        except OSError as exc:
            self.notice(f"cannot append to {path}: {exc.strerror}")
            return
        try:
            check_regular(os.fstat(fd), path, self.uid)
            data = memoryview(request["text"].encode(errors="replace"))
            while data:
                data = data[os.write(fd, data):]
        except Refused as exc:
            self.notice(f"cannot append to it: {exc}")
        finally:
            os.close(fd)


def child_main() -> int:
    os.umask(0o077)
    child = _Child()
    frames = child.frames()
    kind, payload = next(frames, (b"", b""))
    if kind != b"Q":
        return 2
    request = json.loads(payload)
    op = request.get("op")
    if op == "read":
        child.read(request)
    elif op == "write":
        # The remaining frames are the files: hand the same stream on.
        child.frames = lambda: frames  # type: ignore[method-assign]
        child.write(request)
    elif op == "append":
        child.append(request)
    else:
        return 2
    child.send(b"Z")
    child.out.flush()
    return 0


# --- the parent: root ------------------------------------------------------------------------------


@dataclass(frozen=True)
class UserCreds:
    """Who the child runs as: the job's uid, primary gid and every group of the user."""

    uid: int
    gid: int
    groups: tuple[int, ...]

    @classmethod
    def of_uid(cls, uid: int) -> UserCreds:
        import pwd

        entry = pwd.getpwuid(uid)
        return cls(uid, entry.pw_gid, tuple(os.getgrouplist(entry.pw_name, entry.pw_gid)))


def run_as_user(creds: UserCreds, request: dict, on_frame: Callable[[bytes, bytes], None],
                outgoing: Iterable[bytes] = (), timeout: float = 60.0) -> None:
    """Run one request in a child that is the job's user; `on_frame` gets every frame it sends.

    `outgoing`: framed bytes for the child's stdin after the request. The child is killed, and
    UserIOError raised, when it outlives `timeout`, sends a bad frame, exits without finishing, or
    when `on_frame` raises UserIOError (the caller's own limits).
    """
    argv = [sys.executable, "-I", "-S", os.path.abspath(__file__)]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            user=creds.uid, group=creds.gid, extra_groups=list(creds.groups),
                            env=dict(CLEAN_ENV), close_fds=True, cwd="/", start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        _exchange(proc, frame(b"Q", json.dumps(request).encode()), outgoing, on_frame, deadline)
    except BaseException:
        _kill(proc)
        raise


def _exchange(proc: subprocess.Popen, first: bytes, outgoing: Iterable[bytes],
              on_frame: Callable[[bytes, bytes], None], deadline: float) -> None:
    assert proc.stdin and proc.stdout and proc.stderr
    pending = _chain(first, outgoing)
    buffer = b""
    errors = bytearray()
    reader = FrameReader()
    done = False
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        os.set_blocking(stream.fileno(), False)
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdin, selectors.EVENT_WRITE)
        selector.register(proc.stdout, selectors.EVENT_READ)
        selector.register(proc.stderr, selectors.EVENT_READ)
        while len(selector.get_map()):
            left = deadline - time.monotonic()
            if left <= 0:
                raise UserIOError("the child acting as the job's user did not finish in time")
            for key, _ in selector.select(timeout=min(left, 1.0)):
                if key.fileobj is proc.stdin:
                    if not buffer:
                        buffer = next(pending, b"")
                    if not buffer:
                        selector.unregister(proc.stdin)
                        proc.stdin.close()
                        continue
                    try:
                        buffer = buffer[os.write(proc.stdin.fileno(), buffer):]
                    except BlockingIOError:
                        pass
                    except BrokenPipeError:  # the child stopped reading: it says why on stdout
                        selector.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                data = os.read(key.fileobj.fileno(), CHUNK)  # type: ignore[union-attr]
                if not data:
                    selector.unregister(key.fileobj)
                    continue
                if key.fileobj is proc.stderr:
                    errors += data[:max(0, 4000 - len(errors))]
                    continue
                for kind, payload in reader.feed(data):
                    if done:
                        raise UserIOError("the child acting as the job's user sent frames after 'Z'")
                    if kind == b"Z":
                        done = True
                    else:
                        on_frame(kind, payload)
    if proc.stdin and not proc.stdin.closed:
        proc.stdin.close()
    try:
        code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise UserIOError("the child acting as the job's user did not exit in time") from None
    if code != 0 or not done:
        tail = errors.decode(errors="replace").strip().splitlines()[-3:]
        raise UserIOError(f"the child acting as the job's user failed (exit status {code}): "
                          f"{' / '.join(tail) or 'no message'}")


def _chain(first: bytes, rest: Iterable[bytes]) -> Iterator[bytes]:
    yield first
    yield from rest


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.kill(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass


if __name__ == "__main__":
    sys.exit(child_main())
