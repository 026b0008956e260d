"""Files a job wrote on node-local storage, carried inside its checkpoints.

The file-log shim (interpose/filelog) records, in a per-job log, every file under a node-local
prefix (/tmp, /var/tmp, /dev/shm) the job's processes opened for writing. At a checkpoint those that
still exist travel in the checkpoint under `files/<absolute path>`, with the log itself; before a
restore they are written back, so the restored processes find them on whatever node they land.

The log, the files it names and the folders they go back into are the job user's: root never opens
them. A child running as the job's user (`userio`) reads them into a root-only work folder at a
checkpoint and writes them back at a restore; it takes only regular files of the user and never
follows a symlink, so a log or file swapped for a symlink, a FIFO, a device or another user's file
is left alone with a notice for the job's output. Counts and sizes are bounded (`LocalFilesConfig`):
what is over a limit is not carried, and the notice names the limit and its configuration key.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from singularity_slurm.config import LocalFilesConfig
from singularity_slurm.interpose import filelog

from .userio import CHUNK, UserCreds, UserIOError, frame, run_as_user

LOG_NAME = "files.log"
PREFIX = "files"
LOG_ENTRY = "filelog/" + LOG_NAME
MAX_NOTICES = 50
BASE_TIMEOUT_S = 30.0
BYTES_PER_S = 20 << 20
"""The slowest copy rate the child is given time for (on top of BASE_TIMEOUT_S)."""


@dataclass
class Outcome:
    """What a collect or put_back did: checkpoint entries or files written, and notices for the job."""

    entries: dict[str, Path] = field(default_factory=dict)
    written: list[Path] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)

    def notice(self, text: str) -> None:
        if len(self.notices) < MAX_NOTICES:
            self.notices.append(text)
        elif len(self.notices) == MAX_NOTICES:
            self.notices.append("(more notices left out)")


def log_path(filelog_dir: Path, job_id: int, tree: int = 0) -> Path:
    """The file log of one of the job's process trees (`tree`: its rank, or its node's index): the
    same path on every node, so restored processes find it wherever they land.

    The folder is the job's user's, so the job can write there as much as it likes: `filelog_dir`
    (`paths.filelog_dir`) lies on disk, not on the size-limited tmpfs that /run is on most systems,
    which the node's own daemons need.
    """
    return filelog_dir / str(job_id) / (LOG_NAME if tree == 0 else f"files-{tree}.log")


def timeout_for(total_bytes: int) -> float:
    return BASE_TIMEOUT_S + total_bytes / BYTES_PER_S


def over_count(paths: list[str], limits: LocalFilesConfig) -> tuple[list[str], str | None]:
    """The paths that may be carried, and the notice when some are left out for the count limit."""
    if len(paths) <= limits.max_files:
        return paths, None
    left_out = paths[limits.max_files:]
    return paths[:limits.max_files], (
        f"{len(left_out)} node-local files not carried (first: {left_out[0]}): the job wrote "
        f"{len(paths)}, over local_files.max_files = {limits.max_files}")


def sanitize(text: str) -> str:
    """A notice from the user's child as one printable line (it may be forged by the user)."""
    return "".join(c if c.isprintable() else "?" for c in text)[:1000]


def _job_folder(folder: Path, uid: int, gid: int) -> None:
    """filelog_dir/<job>, owned by the job's user; every folder above it is root's."""
    folder.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchown(fd, uid, gid)
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def prepare_log(path: Path, uid: int, gid: int, content: bytes | None = None) -> list[str]:
    """Create the log (its folder owned by the job's user); with `content`, put it back.

    The log itself is created or rewritten by a child running as the user. Returns notices for
    the job's output (a log that is not a regular file of the user is left alone).
    """
    _job_folder(path.parent, uid, gid)
    creds = UserCreds(uid, gid, UserCreds.of_uid(uid).groups)
    outcome = Outcome()
    data = content or b""
    files = [frame(b"F", json.dumps({"path": str(path), "mode": 0o600, "truncate": bool(content)}).encode()),
             *_chunks(data), frame(b"E")]
    _run(creds, {"op": "write", "bases": [str(path.parent)]}, outcome, iter(files),
         timeout_for(len(data)), "the file-log")
    return [f"file-log: {n}" for n in outcome.notices]


def collect(log: Path, creds: UserCreds, work: Path, limits: LocalFilesConfig) -> Outcome:
    """Checkpoint entries for the job's node-local files: {'files/tmp/x': copy of /tmp/x, ...}.

    Copies land in `work` (a root-only folder the caller removes): the log, then the files it
    names, as far as the limits allow.
    """
    outcome = Outcome()
    work.mkdir(mode=0o700, exist_ok=True)
    log_copy = _Copies(work, outcome, {str(log)}, limits.max_log_bytes)
    _run(creds, {"op": "read", "paths": [str(log)], "bases": [str(log.parent)],
                 "budget": limits.max_log_bytes, "truncate": True, "limit": limits.max_log_bytes,
                 "limit_name": "local_files.max_log_bytes"},
         outcome, iter(()), timeout_for(limits.max_log_bytes), "the file-log", log_copy.on_frame)
    if str(log) not in log_copy.done:
        return outcome
    copy = log_copy.done[str(log)]
    outcome.entries[LOG_ENTRY] = copy
    paths = filelog.parse_log(copy.read_bytes(), filelog.DEFAULT_LOCAL_PATHS)
    paths, notice = over_count(paths, limits)
    if notice:
        outcome.notice(notice)
    if not paths:
        return outcome
    copies = _Copies(work, outcome, set(paths), limits.max_bytes)
    _run(creds, {"op": "read", "paths": paths, "bases": list(filelog.DEFAULT_LOCAL_PATHS),
                 "budget": limits.max_bytes, "truncate": False, "limit": limits.max_bytes,
                 "limit_name": "local_files.max_bytes"},
         outcome, iter(()), timeout_for(limits.max_bytes), "the node-local files", copies.on_frame)
    for path, source in copies.done.items():
        outcome.entries[f"{PREFIX}{path}"] = source
    return outcome


class _Copies:
    """Receives the files the child reads, into root-only copies, within the asked paths and bytes."""

    def __init__(self, work: Path, outcome: Outcome, allowed: set[str], budget: int):
        self.work, self.outcome, self.allowed, self.budget = work, outcome, allowed, budget
        self.done: dict[str, Path] = {}
        self.fd: int | None = None
        self.path = ""
        self.copy: Path | None = None

    def on_frame(self, kind: bytes, payload: bytes) -> None:
        if kind == b"F":
            header = json.loads(payload)
            path, mode = header.get("path"), header.get("mode")
            if (self.fd is not None or path not in self.allowed or path in self.done
                    or not isinstance(mode, int)):
                raise UserIOError(f"unexpected file header {payload[:200]!r}")
            self.path = path
            self.copy = self.work / f"{len(self.done):06d}-{os.urandom(4).hex()}"
            self.fd = os.open(self.copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode & 0o777)
        elif kind == b"D":
            if self.fd is None or len(payload) > self.budget:
                raise UserIOError("file data outside a file, or over the byte limit")
            self.budget -= len(payload)
            view = memoryview(payload)
            while view:
                view = view[os.write(self.fd, view):]
        elif kind == b"E":
            if self.fd is None or self.copy is None:
                raise UserIOError("end of a file that was not begun")
            os.close(self.fd)
            self.fd = None
            self.done[self.path] = self.copy
        else:
            raise UserIOError(f"unexpected frame kind {kind!r}")

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _chunks(data: bytes) -> Iterator[bytes]:
    for offset in range(0, len(data), CHUNK):
        yield frame(b"D", data[offset:offset + CHUNK])


def _run(creds: UserCreds, request: dict, outcome: Outcome, outgoing: Iterator[bytes], timeout: float,
         what: str, on_file=None) -> None:
    def on_frame(kind: bytes, payload: bytes) -> None:
        if kind == b"N":
            outcome.notice(sanitize(payload.decode(errors="replace")))
        elif kind == b"K":
            path = json.loads(payload).get("path")
            if isinstance(path, str):
                outcome.written.append(Path(path))
        elif on_file is not None:
            on_file(kind, payload)
        else:
            raise UserIOError(f"unexpected frame kind {kind!r}")

    try:
        run_as_user(creds, request, on_frame, outgoing, timeout=timeout)
    except (UserIOError, ValueError, OSError) as exc:
        outcome.notice(f"{what} could not be handled as the job's user: {exc}")
        owner = getattr(on_file, "__self__", None)
        if isinstance(owner, _Copies):
            owner.close()
            owner.done.clear()  # a child that strayed: carry none of what it sent


def is_local(target: Path) -> bool:
    """Under a node-local prefix: the only places files are put back."""
    return any(filelog.is_under(str(target), p) for p in filelog.DEFAULT_LOCAL_PATHS)


def put_back(restored: Path, creds: UserCreds, limits: LocalFilesConfig) -> Outcome:
    """Write the files of a downloaded checkpoint (`restored/files/...`, root's) back, as the user."""
    outcome = Outcome()
    root = restored / PREFIX
    if not root.is_dir():
        return outcome
    sources = []
    for source in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
        target = Path("/") / source.relative_to(root)
        if is_local(target):
            sources.append((source, target))
        else:
            outcome.notice(f"not put back: {target} is not under {', '.join(filelog.DEFAULT_LOCAL_PATHS)}")
    total = sum(source.stat().st_size for source, _ in sources)
    if not sources:
        return outcome

    def files() -> Iterator[bytes]:
        for source, target in sources:
            mode = source.stat().st_mode & 0o777
            yield frame(b"F", json.dumps({"path": str(target), "mode": mode, "truncate": True}).encode())
            with open(source, "rb") as handle:
                while data := handle.read(CHUNK):
                    yield frame(b"D", data)
            yield frame(b"E")

    _run(creds, {"op": "write", "bases": list(filelog.DEFAULT_LOCAL_PATHS)}, outcome, files(),
         timeout_for(max(total, 0)), "the node-local files")
    return outcome


def tell_job(creds: UserCreds, output: str | None, lines: list[str], prefix: str) -> bool:
    """Append notices to the job's output file, as the job's user; False when it could not."""
    if not lines or not output or not output.startswith("/"):
        return False
    text = "".join(f"{prefix}{sanitize(line)}\n" for line in lines)
    outcome = Outcome()
    _run(creds, {"op": "append", "path": output, "text": text}, outcome, iter(()), BASE_TIMEOUT_S,
         "the job's output")
    return not outcome.notices


def output_of(pid: int) -> str | None:
    """The file a process's stdout names (the job's output), or None (gone, deleted, not a file)."""
    try:
        target = os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        return None
    if not target.startswith("/") or target.endswith(" (deleted)"):
        return None
    return target
