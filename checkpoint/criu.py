"""CRIU through pycriu: dump a job's process tree (its own PID and mount namespace) and restore it.

Facts this relies on (verified on Debian 12, kernel 6.18, criu 4.1.1):
- The tree runs in its own PID namespace whose init is a session leader, and its own mount namespace
  with a /proc of that PID namespace: the parasite of a non-root task can only use /proc when it
  belongs to the task's namespace ("can't dump unprivileged task whose /proc doesn't belong to it").
- Every file the tree holds must have been opened inside its mount namespace; a descriptor inherited
  from outside names a mount criu cannot find ("Can't lookup mount=N for fd=0").
- Restore needs `root="/"`: the namespace's root mount is the host's root, bound back in.
- A mount of a file system criu does not know (the NVIDIA driver's folder, squashfs, on GPU machines)
  fails the dump ("FS mnt ... unsupported") unless it is declared external: criu then records a key
  for it, and a restore binds the restoring host's mount at that path (`external_mounts`).
- Root may lack CAP_SYS_RESOURCE (some VMs and containers drop it); reading another user's limits
  then fails, so criu runs with the criu_prlimit shim preloaded (see shim/criu_prlimit.c).
- Stock criu dumps a page that forked processes still share copy-on-write once per process (a job's
  DataLoader workers triple its dump). The installer's criu carries the `--share-cow` patch
  (criu_patches/): such a page is recorded once, in the parent's image, and restore keeps it shared.
  The dump asks for it through an RPC configuration file wherever the criu in use knows the option.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import socket
import stat
import struct
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from singularity_slurm import rootexec
from singularity_slurm.errors import CheckpointError

from . import pagestream

SHIM_SOURCE = "criu_prlimit.c"
SHIM_LIBRARY = "criu_prlimit.so"
WRAPPER = "singularity-criu"


def build_shim(prefix: Path, compiler: str = "cc") -> Path:
    """Compile the prlimit shim into PREFIX/lib."""
    output = prefix / "lib" / SHIM_LIBRARY
    output.parent.mkdir(parents=True, exist_ok=True)
    source = resources.files(__package__).joinpath("shim", SHIM_SOURCE)
    with resources.as_file(source) as src:
        tmp = output.with_name(f".{output.name}.build")
        proc = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-Wall", "-o", str(tmp), str(src),
                               "-ldl"], capture_output=True, text=True)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise CheckpointError(f"building the criu shim failed:\n{proc.stderr.strip()}")
        os.chmod(tmp, 0o755)
        os.rename(tmp, output)
    return output


def install_filelog_shim(prefix: Path) -> Path:
    """PREFIX/lib/singularity_filelog.so, replaced only when its bytes change.

    Running jobs map this library; replacing it with an identical copy would leave them mapping a
    deleted file, which criu must then carry in every image.
    """
    from singularity_slurm.interpose import filelog

    output = prefix / "lib" / filelog.SHIM_LIBRARY
    fresh = filelog.build_shim(output.with_name(f".{output.name}.new"))
    if output.exists() and output.read_bytes() == fresh.read_bytes():
        fresh.unlink()
    else:
        os.rename(fresh, output)
    return output


def filelog_shim_path(prefix: Path) -> Path:
    from singularity_slurm.interpose import filelog

    return prefix / "lib" / filelog.SHIM_LIBRARY


def install_wrapper(prefix: Path, criu: Path) -> Path:
    """PREFIX/bin/singularity-criu: runs `criu` with the shim preloaded; what the agent executes."""
    shim = build_shim(prefix)
    install_filelog_shim(prefix)
    wrapper = prefix / "bin" / WRAPPER
    wrapper.parent.mkdir(parents=True, exist_ok=True)
    tmp = wrapper.with_name(f".{wrapper.name}.tmp")
    tmp.write_text(wrapper_script(shim, criu))
    os.chmod(tmp, 0o755)
    os.rename(tmp, wrapper)
    return wrapper


def wrapper_script(shim: Path, criu: Path) -> str:
    """criu with exactly the shim preloaded and a clean environment: whatever called it (it runs as
    root), no LD_PRELOAD, PATH or locale of anyone else's reaches it."""
    return (f"#!/bin/sh\nexec /usr/bin/env -i PATH={rootexec.SYSTEM_PATH} LC_ALL=C "
            f"LD_PRELOAD={shlex.quote(str(shim))} {shlex.quote(str(criu))} \"$@\"\n")


def wrapper_path(prefix: Path) -> Path:
    return prefix / "bin" / WRAPPER


def _log_tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no criu log)"
    errors = [line for line in text if "Error" in line and "RLIMIT_NOFILE for self" not in line]
    return "\n".join((errors or text)[-lines:])


def external_mounts(mountinfo: str, wanted: list[str] | tuple[str, ...]) -> dict[str, str]:
    """The mounts among `wanted` (absolute paths) that a tree's mount namespace has, by the key criu
    gives them: {"ext0": "/usr/local/nvidia"}. `mountinfo` is /proc/PID/mountinfo of the tree's
    init, read by root from the kernel (its mount points are escaped octal, as the kernel writes them)."""
    present = set(mount_points(mountinfo))
    return {f"ext{index}": path for index, path in enumerate(p for p in wanted if p in present)}


def mount_points(mountinfo: str) -> list[str]:
    """The mount points of a /proc/PID/mountinfo, in its order, each once."""
    return list(dict.fromkeys(entry.point for entry in mount_entries(mountinfo)))


def in_user_folder(path: str, lstat: Callable[[str], os.stat_result]) -> bool:
    """Whether `path` lies in a folder that someone but root could change: a folder on the way to
    it (from / to its parent) that is not a plain folder of root's, or that group or others may
    write (the sticky /tmp too), or that cannot be looked at. `lstat` looks at one path without
    following its last component. A verdict of False cannot be raced: only root can change a folder
    of root's that no one else may write."""
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts)):
        folder = "/" + "/".join(parts[:depth])
        try:
            st = lstat(folder)
        except OSError:
            return True
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            return True
    return False


@dataclass(frozen=True)
class MountEntry:
    """One line of a /proc/PID/mountinfo: where, and which part (`root`) of which file system."""

    point: str
    root: str
    device: str  # major:minor


def mount_entries(mountinfo: str) -> list[MountEntry]:
    entries = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 4:
            entries.append(MountEntry(_unescape(fields[4]), _unescape(fields[3]), fields[2]))
    return entries


def bind_sources(mount: MountEntry, host: list[MountEntry]) -> list[str]:
    """Every host path criu may record as the source of an auto-detected external `mount` and bind
    at restore: a host mount of the same file system whose root holds the mount's root, and below
    its mount point the rest of that root (criu picks one of them, `find_best_external_match`)."""
    sources = []
    for entry in host:
        if entry.device != mount.device:
            continue
        base = entry.root.rstrip("/")
        if mount.root != entry.root and not mount.root.startswith(base + "/"):
            continue
        rest = mount.root[len(base):].strip("/")
        sources.append(entry.point.rstrip("/") + "/" + rest if rest else entry.point)
    return sources


def user_folder_mounts(mountinfo: str, lstat: Callable[[str], os.stat_result], host_mountinfo: str = "",
                       host_lstat: Callable[[str], os.stat_result] = os.lstat) -> list[str]:
    """The mount points of a tree's namespace (`mountinfo`, its folders looked at with `lstat`)
    that lie in a folder someone but root could change (`in_user_folder`), or that criu could bind
    from such a folder of the host's (`bind_sources` among `host_mountinfo`, the mounts of criu's
    own namespace, looked at with `host_lstat`): such a mount is left out of the checkpoint (criu's
    skip_mnt), neither archived nor recorded as external. Recorded as an external host mount, its
    source would be bound again by root at restore, by path, and a user who replaced a folder on
    that path by a symlink could have root bind any folder into the job's namespace, past parents
    its user may not enter."""
    host = mount_entries(host_mountinfo)
    risky = []
    for mount in mount_entries(mountinfo):
        if mount.point == "/" or mount.point in risky:
            continue
        if in_user_folder(mount.point, lstat) or any(in_user_folder(source, host_lstat)
                                                     for source in bind_sources(mount, host)):
            risky.append(mount.point)
    return risky


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def dump_externals(mounts: dict[str, str]) -> list[str]:
    return [f"mnt[{path}]:{key}" for key, path in mounts.items()]


def restore_externals(mounts: dict[str, str]) -> list[str]:
    return [f"mnt[{key}]:{path}" for key, path in mounts.items()]


@dataclass(frozen=True)
class DumpResult:
    images_dir: Path
    pid: int
    leave_running: bool
    received: pagestream.Received | None = None  # the pages, where criu sent them to a stream


class _PageReceiver:
    """The agent's end of a dump's page stream, read by a thread of its own while criu dumps."""

    def __init__(self, sink: pagestream.Sink, layout: struct.Struct, settle: Callable[[], None] | None):
        self.layout, self.settle = layout, settle
        self.ours, self.criu_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for end in (self.ours, self.criu_end):
            end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, STREAM_BUFFER)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_BUFFER)
        self.sink = sink
        self.outcome: pagestream.Received | BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="criu-pages", daemon=True)

    def start(self) -> None:
        self.criu_end.close()  # criu holds its copy: its exit ends the stream
        self.thread.start()

    def _run(self) -> None:
        try:
            self.outcome = pagestream.receive(self.ours, self.sink, self.layout, self.settle)
        except BaseException as exc:  # noqa: BLE001 - handed to the dumping thread
            self.outcome = exc
            # criu may be waiting for an answer or writing into a full socket: the end of the stream
            # makes it fail the dump (it ignores SIGPIPE), let the tree run on and answer the dumper
            with contextlib.suppress(OSError):
                self.ours.shutdown(socket.SHUT_RDWR)

    def failure(self) -> BaseException | None:
        """Why the stream failed (once criu has ended), None where it did not."""
        self.thread.join()
        return self.outcome if isinstance(self.outcome, BaseException) else None

    def result(self) -> pagestream.Received:
        self.thread.join()
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        assert self.outcome is not None
        return self.outcome

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.ours.shutdown(socket.SHUT_RDWR)  # a receiver still reading sees the end
        if self.thread.is_alive():
            self.thread.join()
        self.ours.close()
        self.criu_end.close()


STREAM_BUFFER = 4 << 20
"""Socket buffer of a page stream (the kernel caps it at net.core.[rw]mem_max)."""


def frozen_seconds(images_dir: Path) -> float | None:
    """How long criu kept the tree frozen during its dump (its `stats-dump` image's frozen time);
    None where the image is missing or unreadable."""
    try:
        import pycriu

        with open(images_dir / "stats-dump", "rb") as handle:
            entries = pycriu.images.load(handle)["entries"]
        return int(entries[0]["dump"]["frozen_time"]) / 1e6
    except Exception:  # pycriu raises whatever its parser meets; the figure is for accounting only
        return None


SHARE_COW = "share-cow"
TRACK_WRITES = "track-writes"
TRACK_INCREMENTAL = "track-incremental"
PATCHED_OPTIONS = (SHARE_COW, TRACK_WRITES, TRACK_INCREMENTAL)


def supports(binary: Path, option: str) -> bool:
    """Whether `binary` (criu, or its wrapper) knows `--option`: stock criu refuses the patches'."""
    try:
        proc = subprocess.run([str(binary), f"--{option}", "--version"], capture_output=True,
                              text=True, timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0 and "Version" in proc.stdout


def version_of(binary: Path) -> tuple[int, ...]:
    """The version `binary` (criu, or its wrapper) reports, as (4, 1, 1)."""
    try:
        proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CheckpointError(f"cannot run {binary} --version: {exc}") from exc
    match = re.search(r"Version:\s*(\d+(?:\.\d+)*)", proc.stdout)
    if proc.returncode != 0 or match is None:
        raise CheckpointError(f"{binary} --version said {proc.stdout.strip() or proc.stderr.strip()!r}, "
                              "not a criu version: reinstall with `make install`")
    return tuple(int(part) for part in match[1].split("."))


UFFDIO_API = 0xC018AA3F  # _IOWR(0xAA, 0x3F, struct uffdio_api)
UFFD_USER_MODE_ONLY = 1
UFFD_FEATURES_TRACKING = (1 << 13) | (1 << 15)  # WP_UNPOPULATED | WP_ASYNC (Linux 6.7)


def kernel_tracks_writes() -> bool:
    """Whether this kernel has what the write tracker needs: an asynchronous write-protecting
    userfaultfd (and with it the PAGEMAP_SCAN ioctl, both Linux 6.7), asked of the kernel itself."""
    import ctypes
    import fcntl
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(323 if os.uname().machine == "x86_64" else 282,  # userfaultfd (x86_64, aarch64)
                      os.O_CLOEXEC | UFFD_USER_MODE_ONLY)
    if fd < 0:
        return False
    try:
        fcntl.ioctl(fd, UFFDIO_API, bytearray(struct.pack("QQQ", 0xAA, UFFD_FEATURES_TRACKING, 0)))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


class Criu:
    """Dump and restore through pycriu's swrk mode, one criu process per call.

    `share_cow` and `track_writes`: whether dumps use the patches' options (None: wherever the
    binary knows them, asked once)."""

    def __init__(self, binary: Path, share_cow: bool | None = None, track_writes: bool | None = None):
        self.binary = binary
        self._known = {SHARE_COW: share_cow, TRACK_WRITES: track_writes}
        self._version: tuple[int, ...] | None = None

    @property
    def version(self) -> tuple[int, ...]:
        if self._version is None:
            self._version = version_of(self.binary)
        return self._version

    def _knows(self, option: str) -> bool:
        if self._known[option] is None:
            self._known[option] = supports(self.binary, option)
        return bool(self._known[option])

    @property
    def share_cow(self) -> bool:
        """Dumps record pages that forked processes still share copy on write once."""
        return self._knows(SHARE_COW)

    @property
    def tracks_writes(self) -> bool:
        """Dumps can arm a write tracker, and later dumps leave unwritten pages to the armed one's."""
        return self._knows(TRACK_WRITES)

    def _client(self):
        try:
            import pycriu
        except ImportError as exc:
            raise CheckpointError(
                "pycriu is not importable: install it into the project's venv "
                "(`singularityctl devcluster up` does; it ships as Debian's python3-pycriu)"
            ) from exc
        client = pycriu.criu()
        client.use_binary(str(self.binary))
        return pycriu, client

    def _swrk(self, launch: Sequence[str], keep: socket.socket | None = None
              ) -> tuple[socket.socket, subprocess.Popen]:
        """criu's RPC worker (`criu swrk FD`), started through `launch` (none: directly), and our end
        of its socket. Started as pycriu starts it (inheriting this process's environment), as a
        child of this process: a restored tree (rst_sibling) is this process's child too. `keep`:
        another socket it inherits, at the same fd number."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fds = (theirs.fileno(), *((keep.fileno(),) if keep is not None else ()))
        try:
            proc = subprocess.Popen([*launch, str(self.binary), "swrk", str(theirs.fileno())],
                                    pass_fds=fds, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        return ours, proc

    def dump(self, pid: int, images_dir: Path, leave_running: bool = False,
             external: dict[str, str] | None = None, arm: bool = False, incremental: bool = False,
             skip_mounts: Sequence[str] = (), pages: pagestream.Sink | None = None,
             settle_pages: Callable[[], None] | None = None) -> DumpResult:
        """Dump the tree of `pid`; `external`: its mounts that criu records by key, not content
        (see external_mounts); `skip_mounts`: mount points left out of the checkpoint altogether
        (see user_folder_mounts). `arm`: leave each process a write tracker (a periodic dump);
        `incremental`: pages not written since the last armed dump are PE_PARENT holes, which
        `incremental.compose` fills from that dump's checkpoint. Both need `tracks_writes`.
        `pages`: where the page maps' pages go (checkpoint.pagestream): criu sends them over a
        socket instead of writing them into `images_dir`, and the result's `received` says what came;
        `settle_pages` makes what the sink took durable before criu is told the stream arrived (a
        failure there fails the dump, and the tree runs on)."""
        if (arm or incremental) and not self.tracks_writes:
            raise CheckpointError(f"{self.binary} runs a criu without the track-writes patch; "
                                  "reinstall with `singularityctl devcluster up` or `make install`")
        self._client()  # pycriu is there
        from pycriu import rpc_pb2 as rpc

        images_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(images_dir, os.O_DIRECTORY)
        conf = images_dir.with_name(f".{images_dir.name}.criu.conf")
        options = [o for o, on in ((SHARE_COW, self.share_cow), (TRACK_WRITES, arm),
                                   (TRACK_INCREMENTAL, incremental)) if on]
        req = rpc.criu_req()
        req.type = rpc.DUMP
        req.opts.images_dir_fd = fd
        req.opts.pid = pid
        req.opts.leave_running = leave_running
        req.opts.log_file = "dump.log"
        req.opts.log_level = 4
        req.opts.file_locks = True
        req.opts.external.extend(dump_externals(external or {}))
        req.opts.skip_mnt.extend(skip_mounts)
        _host_mounts_external(req.opts)
        _ignore_cgroups(req.opts)
        stream = None
        try:
            if options:
                # criu's RPC has no fields for the patches' options: a configuration file of the
                # caller's (root's, beside the images) carries them
                conf.write_text("".join(f"{option}\n" for option in options))
                req.opts.config_file = str(conf.absolute())
            if pages is not None:
                stream = _PageReceiver(pages, pagestream.header_layout(self.version), settle_pages)
                req.opts.ps.fd = stream.criu_end.fileno()
                req.opts.ps.port = 0
            try:
                resp = self._call(req, rpc, keep=stream.criu_end if stream else None,
                                  started=stream.start if stream else None)
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"criu dump of pid {pid}: lost criu: {exc}") from exc
            if not resp.success:
                cause = stream.failure() if stream else None
                if cause is not None and not isinstance(cause, pagestream.PageStreamCut):
                    raise cause  # the store (or the stream) failed: criu failed the dump for it
                left_out = (f"\nleft out of the checkpoint, in folders someone but root could change: "
                            f"{', '.join(skip_mounts)} (a process that holds a file there, or works "
                            "there, cannot be checkpointed)" if skip_mounts else "")
                raise CheckpointError(
                    f"criu dump of pid {pid} failed (errno {resp.cr_errno}){left_out}\n"
                    f"{_log_tail(images_dir / 'dump.log')}")
            received = stream.result() if stream else None  # criu has ended: so has its stream
        finally:
            if stream is not None:
                stream.close()
            os.close(fd)
            conf.unlink(missing_ok=True)
        return DumpResult(images_dir, pid, leave_running, received)

    def _call(self, req, rpc, keep: socket.socket | None = None,
              started: Callable[[], None] | None = None):
        """One request to a criu swrk of our own, its notifications answered with success; the
        answer. `keep`: a socket criu inherits (at its own fd number); `started` runs once criu runs."""
        sock, swrk = self._swrk((), keep=keep)
        try:
            if started is not None:
                started()
            sock.send(req.SerializeToString())
            while True:
                resp = _receive(sock, rpc)
                if resp.type != rpc.NOTIFY:
                    return resp
                ack = rpc.criu_req()
                ack.type = rpc.NOTIFY
                ack.notify_success = True
                sock.send(ack.SerializeToString())
        finally:
            sock.close()
            swrk.wait()

    def restore(self, images_dir: Path, check: Callable[[int], str | None] | None = None,
                external: dict[str, str] | None = None, launch: Sequence[str] = ()) -> int:
        """Restore the tree as a child of this process; returns the pid of its root (the ns init).

        `check(root_pid)` runs once every task is restored but before any of them runs or gets the
        job's credentials back (criu's post-restore notification: the tasks still belong to root,
        so the job's user can neither signal, trace nor take descriptors from them). A message from
        it aborts the restore: criu kills the tree, and RestoreRefused carries the message.
        `external`: the dump's external mounts (key -> path), bound from this host's same path.
        `launch`: a command line that execs the rest of its arguments once it has put itself where
        the tree belongs (the job's cgroups, `node.jobtree.joining`): criu then runs there, and so
        does every task it forks, from the first page it restores and the first socket it makes.
        Joined only after the restore, the tree's restored memory stayed charged to the agent's
        cgroup (no cgroup version moves charges with a task), out of the job's memory limit.
        """
        self._client()  # pycriu is there
        from pycriu import rpc_pb2 as rpc

        fd = os.open(images_dir, os.O_DIRECTORY)
        req = rpc.criu_req()
        req.type = rpc.RESTORE
        req.opts.images_dir_fd = fd
        req.opts.log_file = "restore.log"
        req.opts.log_level = 4
        req.opts.root = "/"
        req.opts.rst_sibling = True
        req.opts.file_locks = True
        req.opts.notify_scripts = check is not None
        req.opts.external.extend(restore_externals(external or {}))
        _host_mounts_external(req.opts)
        _ignore_cgroups(req.opts)
        root_pid = 0
        refusal: str | None = None
        swrk: subprocess.Popen | None = None
        try:
            try:
                sock, swrk = self._swrk(launch)
                try:
                    sock.send(req.SerializeToString())
                    while True:
                        resp = _receive(sock, rpc)
                        if resp.type != rpc.NOTIFY:
                            break
                        root_pid = resp.notify.pid or root_pid
                        ok = True
                        if resp.notify.script == "post-restore" and check is not None:
                            try:
                                refusal = check(root_pid) if root_pid else "criu named no restored task"
                            except Exception as exc:  # the tree must not run unchecked
                                refusal = f"the restored tree could not be checked: {exc}"
                            ok = refusal is None
                        ack = rpc.criu_req()
                        ack.type = rpc.NOTIFY
                        ack.notify_success = ok
                        sock.send(ack.SerializeToString())
                finally:
                    sock.close()
                    swrk.wait()
            except (OSError, ValueError) as exc:
                if swrk is not None and swrk.returncode == JOIN_FAILED:
                    raise RestoreFailed(f"criu restore from {images_dir}: criu could not join the "
                                        f"cgroups of its tree ({' '.join(launch[5:])})") from exc
                raise RestoreFailed(f"criu restore from {images_dir}: lost criu: {exc}") from exc
        finally:
            os.close(fd)
        if refusal is not None:
            reap(root_pid)
            raise RestoreRefused(refusal)
        if not resp.success:
            reap(root_pid)
            raise RestoreFailed(
                f"criu restore from {images_dir} failed (errno {resp.cr_errno})\n"
                f"{_log_tail(images_dir / 'restore.log')}"
            )
        return resp.restore.pid


class RestoreRefused(CheckpointError):
    """The restored tree held what its user may not open: criu killed it before it ran."""


class RestoreFailed(CheckpointError):
    """criu could not restore these images (its log says why): try an older checkpoint."""


def _host_mounts_external(opts) -> None:
    """The host's mounts that the tree's mount namespace holds (it began as a copy of the host's)
    are recorded as external, by their host path, and bound from the restoring host: neither their
    content nor their state at the dump is the job's. Without this criu archives every tmpfs it
    finds there, the host's /run, /dev/shm (the other jobs' shared memory, hidden under the job's
    own) and any tmpfs an admin mounted, into each checkpoint, and re-creates them at restore as
    the dump left them. The mounts made inside the namespace (the job's private /dev/shm, its
    /proc) are the job's: criu still dumps and re-creates those."""
    opts.auto_ext_mnt = True


def _ignore_cgroups(opts) -> None:
    """criu neither records nor re-creates the tree's cgroups: they are the job's, on the node where
    it ran, and the caller puts a restored tree into the new job's own (see node.jobcgroup)."""
    from pycriu import rpc_pb2 as rpc

    opts.manage_cgroups = False
    opts.manage_cgroups_mode = rpc.IGNORE


JOIN_FAILED = 124
"""The status of a `launch` command that could not put itself into a cgroup (node.jobtree)."""


def _receive(sock, rpc):
    """One message from criu's RPC socket (SOCK_SEQPACKET: one message per recv)."""
    size = len(sock.recv(1, socket.MSG_TRUNC | socket.MSG_PEEK))
    if size == 0:
        raise OSError("criu closed its socket without an answer")
    resp = rpc.criu_resp()
    resp.ParseFromString(sock.recv(size))
    return resp


def reap(pid: int) -> None:
    """Collect a restored root that was killed (a child of this process, by rst_sibling)."""
    if pid <= 0:
        return
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
