"""The rank sockets: `<state_dir>/ranks/<job>/<rank>.sock`, in folders only root can create in.

A rank's name must not be takeable by another user before its proxy binds it (abstract socket names
can be: anyone may bind any of them), yet it must be the same path on every node, so a restored worker
finds its rank's proxy wherever it lands. So the proxy (root) makes the job's folder under the
admin's state folder, after checking every folder on the way from `/` is a real directory (no
symlink), owned by root (or by the proxy's own user when it does not run as root: benchmarks), and
writable by nobody else. An ancestor such as `/tmp` may be world-writable if it is sticky: nobody else
can then rename or remove root's entry in it. The socket is bound under a temporary name, given to the
job's user (mode 0600), and renamed into place, so it appears ready to serve and only the job's user
(and root) can connect; the proxy still checks each connection's SO_PEERCRED.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import stat
import threading
from pathlib import Path

from singularity_slurm.interpose.pyhook._singularity_worker import wire

RANKS = "ranks"
_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_counter = iter(range(1 << 62))
_counter_lock = threading.Lock()


class RankSocketError(OSError):
    """The rank socket folder is unsafe or cannot be made; the message names the folder and the fix."""


def rank_dir(state_dir: Path) -> Path:
    """The folder every node's rank sockets live under (what ranks get as SINGULARITY_RANK_DIR)."""
    return state_dir / RANKS


def folder_problem(st: os.stat_result, owner: int, last: bool) -> str | None:
    """Why a folder with status `st` cannot hold root's rank sockets, or None.

    `owner` is the user the proxy runs as; `last` says the folder is the state folder or below it,
    where nobody else may create anything, sticky or not.
    """
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid not in (0, owner):
        return f"is owned by uid {st.st_uid}, not root"
    if st.st_mode & 0o022:
        if last:
            return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
        if not st.st_mode & stat.S_ISVTX:
            return f"is writable by group or others and not sticky (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def open_trusted(path: Path, owner: int | None = None) -> int:
    """A descriptor of folder `path`, walked from `/` without following a symlink, each folder checked.

    Raises RankSocketError naming the first folder that fails `folder_problem`.
    """
    owner = os.geteuid() if owner is None else owner
    if not path.is_absolute():
        raise RankSocketError(errno.EINVAL, f"{path} is not an absolute path: set paths.state_dir to one")
    fd = os.open("/", _OPEN)
    walked = Path("/")
    parts = path.parts[1:]
    try:
        for i, part in enumerate(parts):
            walked = walked / part
            try:
                child = os.open(part, _OPEN, dir_fd=fd)
            except OSError as exc:
                why = "is a symlink or not a directory" if exc.errno in (errno.ELOOP, errno.ENOTDIR) \
                    else exc.strerror
                raise RankSocketError(exc.errno, f"rank socket folder: {walked} {why}; it must be a folder "
                                      "root created, on the real path (see paths.state_dir)") from None
            os.close(fd)
            fd = child
            problem = folder_problem(os.fstat(fd), owner, last=i == len(parts) - 1)
            if problem:
                raise RankSocketError(errno.EPERM, f"rank socket folder: {walked} {problem}; refusing to "
                                      f"serve ranks there: make it root's, mode 0755 (paths.state_dir)")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _make_child(parent: int, name: str, where: Path, owner: int) -> int:
    """Open (creating, mode 0755) folder `name` in `parent`, checked as `open_trusted` checks."""
    try:
        os.mkdir(name, 0o755, dir_fd=parent)
    except FileExistsError:
        pass
    try:
        fd = os.open(name, _OPEN, dir_fd=parent)
    except OSError as exc:
        raise RankSocketError(exc.errno, f"rank socket folder: {where} cannot be opened as a folder "
                              f"({exc.strerror}): remove it") from None
    problem = folder_problem(os.fstat(fd), owner, last=True)
    if problem:
        os.close(fd)
        raise RankSocketError(errno.EPERM, f"rank socket folder: {where} {problem}: remove it")
    return fd


def open_job_folder(state_dir: Path, job_id: int) -> int:
    """A descriptor of `<state_dir>/ranks/<job_id>`, made if missing; every folder on the way checked."""
    owner = os.geteuid()
    base = open_trusted(state_dir, owner)
    try:
        ranks = _make_child(base, RANKS, state_dir / RANKS, owner)
    finally:
        os.close(base)
    try:
        return _make_child(ranks, str(int(job_id)), state_dir / RANKS / str(job_id), owner)
    finally:
        os.close(ranks)


class RankSockets:
    """The listening sockets of one proxy's ranks."""

    def __init__(self, state_dir: Path, job_id: int, job_uid: int):
        self.state_dir = state_dir
        self.job_id = job_id
        self.job_uid = job_uid
        self.bound: dict[int, tuple[int, int]] = {}  # rank -> (st_dev, st_ino) of the socket we bound
        wire.rank_address(job_id, 0, str(rank_dir(state_dir)))  # refuses a path too long for a socket

    def address(self, rank: int) -> str:
        return wire.rank_address(self.job_id, rank, str(rank_dir(self.state_dir)))

    def listen(self, rank: int, backlog: int = 8) -> socket.socket:
        """Bind and listen on `rank`'s path, replacing a stale socket there (a proxy that died)."""
        name = f"{rank}.sock"
        with _counter_lock:
            tmp = f".{rank}.{os.getpid()}.{next(_counter)}.tmp"
        folder = open_job_folder(self.state_dir, self.job_id)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            # The folder's descriptor, not its path: the folder checked is the folder used.
            sock.bind(f"/proc/self/fd/{folder}/{tmp}")
            try:
                os.chown(tmp, self.job_uid, -1, dir_fd=folder, follow_symlinks=False)
                os.chmod(f"/proc/self/fd/{folder}/{tmp}", 0o600)
                st = os.stat(tmp, dir_fd=folder, follow_symlinks=False)
                sock.listen(backlog)
                os.rename(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
            except BaseException:
                _unlink_quietly(folder, tmp)
                raise
            self.bound[rank] = (st.st_dev, st.st_ino)
            return sock
        except BaseException:
            sock.close()
            raise
        finally:
            os.close(folder)

    def unlink(self, rank: int) -> None:
        """Remove `rank`'s path if it is still the socket this proxy bound (not a newer proxy's)."""
        ident = self.bound.pop(rank, None)
        if ident is None:
            return
        try:
            folder = open_job_folder(self.state_dir, self.job_id)
        except OSError:
            return
        try:
            st = os.stat(f"{rank}.sock", dir_fd=folder, follow_symlinks=False)
            if (st.st_dev, st.st_ino) == ident:
                os.unlink(f"{rank}.sock", dir_fd=folder)
        except OSError:
            pass
        finally:
            os.close(folder)

    def close(self) -> None:
        """Unlink every socket still bound, and the job's folder once empty."""
        for rank in list(self.bound):
            self.unlink(rank)
        try:
            ranks = open_trusted(rank_dir(self.state_dir))
        except OSError:
            return
        try:
            os.rmdir(str(int(self.job_id)), dir_fd=ranks)
        except OSError:
            pass  # another proxy of the job (on this host) still serves ranks
        finally:
            os.close(ranks)


def remove_job_folder(state_dir: Path, job_id: int) -> None:
    """Remove `<state_dir>/ranks/<job_id>` and what is in it (the Epilog: a proxy that died leaves
    its sockets). Only a trusted folder is touched; rmtree does not follow symlinks."""
    try:
        ranks = open_trusted(rank_dir(state_dir))
    except OSError:
        return
    try:
        shutil.rmtree(str(int(job_id)), dir_fd=ranks)
    except FileNotFoundError:
        pass
    finally:
        os.close(ranks)


def _unlink_quietly(folder: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=folder)
    except OSError:
        pass
