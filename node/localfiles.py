"""Files a job wrote on node-local storage, carried inside its checkpoints.

The file-log shim (interpose/filelog) records, in a per-job log, every file under a node-local
prefix (/tmp, /var/tmp, /dev/shm) the job's processes opened for writing. At a checkpoint those that
still exist travel in the checkpoint under `files/<absolute path>`, with the log itself; before a
restore they are written back, so the restored processes find them on whatever node they land.
The log is written by the job and is therefore untrusted: only regular files owned by the job's
user, under the node-local prefixes, are taken, and they are put back without following symlinks
and owned by that user.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from singularity_slurm.interpose import filelog

LOG_NAME = "files.log"
PREFIX = "files"
LOG_ENTRY = "filelog/" + LOG_NAME


def log_path(state_dir: Path, job_id: int) -> Path:
    """The job's file log: one path for the job on every node, so restored processes find it."""
    return state_dir / "filelog" / str(job_id) / LOG_NAME


def prepare_log(path: Path, uid: int, gid: int, content: bytes | None = None) -> None:
    """Create the log (and its folder) owned by the job's user; with `content`, put it back."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chown(path.parent, uid, gid)
    os.chmod(path.parent, 0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_TRUNC if content else 0), 0o600)
    try:
        os.fchown(fd, uid, gid)
        if content:
            os.write(fd, content)
    finally:
        os.close(fd)


def collect(log: Path, uid: int) -> dict[str, Path]:
    """Checkpoint entries for the job's node-local files: {'files/tmp/x': Path('/tmp/x'), ...}."""
    entries: dict[str, Path] = {}
    if log.exists():
        entries[LOG_ENTRY] = log
        for path in filelog.existing_files(filelog.read_log(log), owner=uid):
            entries[f"{PREFIX}{path}"] = path
    return entries


def _safe_target(target: Path) -> bool:
    """Under a node-local prefix, with no symlink on the way (the job could have planted one)."""
    if not any(filelog.is_under(str(target), p) for p in filelog.DEFAULT_LOCAL_PATHS):
        return False
    probe = Path("/")
    for part in target.parent.parts[1:]:
        probe = probe / part
        try:
            if stat.S_ISLNK(os.lstat(probe).st_mode):
                return False
        except FileNotFoundError:
            return True
    return True


def put_back(restored: Path, uid: int, gid: int) -> list[Path]:
    """Write the files of a downloaded checkpoint (`restored/files/...`) back to their places."""
    written = []
    root = restored / PREFIX
    if not root.is_dir():
        return written
    for source in sorted(p for p in root.rglob("*") if p.is_file()):
        target = Path("/") / source.relative_to(root)
        if not _safe_target(target):
            continue
        for parent in reversed(target.parents):
            if not parent.exists():
                parent.mkdir(mode=0o700)
                os.chown(parent, uid, gid)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                     stat.S_IMODE(source.stat().st_mode))
        try:
            os.fchown(fd, uid, gid)
            with open(source, "rb") as handle:
                while chunk := handle.read(1 << 20):
                    os.write(fd, chunk)
        finally:
            os.close(fd)
        written.append(target)
    return written
