"""Start and stop per-job node services with pid files that cannot point at a stranger.

A pid file holds the pid and the process's start time (field 22 of /proc/PID/stat); a process whose
start time differs is another process that got the recycled pid and is never signalled. Services run
as session leaders, so stopping one stops its whole process group: nothing is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from singularity_slurm import rootexec
from singularity_slurm.errors import ServiceError

AGENT = "agent"
"""The node agent's service name: the Prolog starts it, the Epilog stops it before the proxies."""

PROXY = "proxy-"
"""The prefix of the proxies' service names (`proxy-gpu0`, `proxy-cpu1`)."""


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    argv: Sequence[str]
    ready_path: Path | None = None  # the service is ready once this exists (e.g. its socket)


def stat_fields(stat: str) -> list[str]:
    """The fields of a /proc/PID/stat text after comm: state first, then ppid, pgrp, ... (comm, field
    2, may hold spaces and parentheses: the split is after the last ')')."""
    return stat[stat.rindex(")") + 2:].split()


def ended(state: str) -> bool:
    """A process in this state has ended: a zombie not yet reaped by its parent, or dead."""
    return state in {"Z", "X"}


def proc_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot, or None when there is no such process."""
    try:
        fields = stat_fields(Path(f"/proc/{pid}/stat").read_text())
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    if ended(fields[0]):
        return None
    return int(fields[19])


def pidfile_path(run_dir: Path, name: str) -> Path:
    return run_dir / f"{name}.pid"


def read_pidfile(path: Path) -> tuple[int, int] | None:
    try:
        data = json.loads(path.read_text())
        return int(data["pid"]), int(data["start_time"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def running_pid(run_dir: Path, name: str) -> int | None:
    """The service's pid when its pid file names a live process that is really it."""
    entry = read_pidfile(pidfile_path(run_dir, name))
    if entry is None:
        return None
    pid, start_time = entry
    return pid if proc_start_time(pid) == start_time else None


def start(spec: ServiceSpec, run_dir: Path, env: dict[str, str] | None = None,
          ready_timeout: float = 10.0) -> int:
    """Start `spec` detached (own session, no inherited fds, log in run_dir) and wait until ready.

    Its environment is `env`, or by default a clean one (`rootexec.service_env`): a service never
    inherits its starter's environment, which may come from a job step.
    """
    if env is None:
        env = rootexec.service_env(os.environ)
    run_dir.mkdir(parents=True, exist_ok=True)
    existing = running_pid(run_dir, spec.name)
    if existing is not None:
        return existing
    if spec.ready_path is not None:
        # Left by a predecessor that died (a killed agent's socket): it would read as ready at once.
        spec.ready_path.unlink(missing_ok=True)
    log = open(run_dir / f"{spec.name}.log", "ab")
    try:
        proc = subprocess.Popen(
            list(spec.argv), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True, close_fds=True, env=env, cwd="/",
        )
    except OSError as exc:
        raise ServiceError(f"cannot start {spec.name} ({spec.argv[0]}): {exc.strerror}") from exc
    finally:
        log.close()
    start_time = proc_start_time(proc.pid)
    pidfile = pidfile_path(run_dir, spec.name)
    tmp = pidfile.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": proc.pid, "start_time": start_time, "argv": list(spec.argv)}))
    os.rename(tmp, pidfile)
    deadline = time.monotonic() + ready_timeout
    while spec.ready_path is not None and not spec.ready_path.exists():
        if proc.poll() is not None:
            raise ServiceError(
                f"{spec.name} exited with status {proc.returncode} while starting; "
                f"see {run_dir / (spec.name + '.log')}"
            )
        if time.monotonic() > deadline:
            stop(run_dir, spec.name)
            raise ServiceError(f"{spec.name} did not become ready within {ready_timeout:.0f}s")
        time.sleep(0.02)
    return proc.pid


# --- the job's trees -------------------------------------------------------------------------------
# The agent notes each process tree of the job it starts or restores (the pid of its namespace init,
# with the start time): a tree Slurm does not contain (no extern step cgroup, as when slurmd skipped
# the Prolog at a quick requeue) would outlive an agent killed with SIGKILL, and the Epilog ends it.
# The namespace's init is enough: when it dies the kernel kills every process of the namespace.

TREE_SUFFIX = ".tree"


def tree_note_path(run_dir: Path, pid: int) -> Path:
    return run_dir / f"tree-{pid}{TREE_SUFFIX}"


def note_tree(run_dir: Path, pid: int, parent: int | None = None) -> None:
    """Note a tree's namespace init (written whole, by rename). `parent`: the init's parent when it
    is not the caller's own child (a started tree's init is the child of `unshare`, the caller's
    unreaped child): the start time read is the init's only if the pid is still that parent's child
    after it was read. ServiceError if the init is gone already."""
    start_time = proc_start_time(pid)
    if start_time is None or (parent is not None and str(pid) not in _children(parent)):
        raise ServiceError(f"the job's tree (pid {pid}) ended before it could be noted")
    path = tree_note_path(run_dir, pid)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": pid, "start_time": start_time}))
    os.chmod(tmp, 0o600)
    os.rename(tmp, path)


def _children(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []


def forget_tree(run_dir: Path, pid: int) -> None:
    tree_note_path(run_dir, pid).unlink(missing_ok=True)


@dataclass(frozen=True)
class EndedTrees:
    ended: list[int]  # noted trees that were running and were ended
    left: list[int]  # noted trees still running after the timeout (their notes are kept)


def end_trees(run_dir: Path, timeout: float = 10.0) -> EndedTrees:
    """SIGKILL every noted tree whose init still runs, and wait until they have ended (at most
    `timeout`). A note names its process exactly: the signal goes through a pidfd opened before the
    start time is compared, so a pid recycled in between is never signalled. Notes of ended trees
    (and of stale ones) are dropped."""
    live: dict[Path, tuple[int, int]] = {}
    for note in sorted(run_dir.glob(f"tree-*{TREE_SUFFIX}")):
        entry = read_pidfile(note)
        if entry is not None and entry[0] > 1 and _kill_exactly(*entry):
            live[note] = entry
        else:
            note.unlink(missing_ok=True)
    deadline = time.monotonic() + timeout
    while any(proc_start_time(pid) == start for pid, start in live.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = []
    for note, (pid, start) in live.items():
        if proc_start_time(pid) == start:
            left.append(pid)
        else:
            note.unlink(missing_ok=True)
    return EndedTrees([pid for pid, _ in live.values() if pid not in left], left)


def _kill_exactly(pid: int, start_time: int) -> bool:
    """SIGKILL `pid` if it is the process that started at `start_time`; whether it was signalled."""
    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return False
    try:
        if proc_start_time(pid) != start_time:
            return False
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs. Members that ended but are not reaped yet do not
    count: a service's parent is init, which may reap only every second or two."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return group_has_live_member(pgid, _proc_stats())


def group_has_live_member(pgid: int, stats: Iterable[str]) -> bool:
    """Whether one of these /proc/PID/stat texts is of a process of group `pgid` that has not ended."""
    for stat in stats:
        try:
            fields = stat_fields(stat)
            if int(fields[2]) == pgid and not ended(fields[0]):
                return True
        except (ValueError, IndexError):
            continue
    return False


def _proc_stats() -> Iterator[str]:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                yield Path(entry.path, "stat").read_text()
            except OSError:
                continue  # it exited meanwhile


def _orphaned_group(run_dir: Path, name: str) -> int | None:
    """The group id of a service whose leader died but whose children live on.

    Linux does not reuse a pid while a process group of that id exists, so a live group whose id is
    the dead leader's pid is still the service's. A live process with that pid and another start
    time is a stranger (the group emptied and the pid was recycled): never ours.
    """
    entry = read_pidfile(pidfile_path(run_dir, name))
    if entry is None:
        return None
    pid, _ = entry
    if proc_start_time(pid) is None and _group_alive(pid):
        return pid
    return None


def stop(run_dir: Path, name: str, timeout: float = 5.0) -> bool:
    """SIGTERM the service's process group, SIGKILL what is left after `timeout`; False if not running."""
    return bool(_stop_each(run_dir, [name], timeout))


def _stop_each(run_dir: Path, names: Iterable[str], timeout: float) -> list[str]:
    """Stop these services together: SIGTERM every group, wait for all of them (at most `timeout`),
    SIGKILL what is left. Returns the names that were running."""
    groups = {}
    for name in names:
        pid = running_pid(run_dir, name) or _orphaned_group(run_dir, name)
        if pid is None:
            pidfile_path(run_dir, name).unlink(missing_ok=True)
        else:
            groups[name] = pid
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        for pid in groups.values():
            if _group_alive(pid):
                try:
                    os.killpg(pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + wait
        while any(_group_alive(pid) for pid in groups.values()) and time.monotonic() < deadline:
            for pid in groups.values():
                _reap(pid)
            time.sleep(0.05)
        if not any(_group_alive(pid) for pid in groups.values()):
            break
    for name in groups:
        pidfile_path(run_dir, name).unlink(missing_ok=True)
    return list(groups)


def _reap(pid: int) -> None:
    """Collect the service if it is our own child (a prolog and epilog in one test process)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def stop_all(run_dir: Path, timeout: float = 5.0, first: Sequence[str] = ()) -> list[str]:
    """Stop every service with a pid file in run_dir: those named in `first` (that are there), then
    all the others together. Returns the names that were running, in that order."""
    names = [pidfile.stem for pidfile in sorted(run_dir.glob("*.pid"))]
    early = [name for name in first if name in names]
    return (_stop_each(run_dir, early, timeout)
            + _stop_each(run_dir, [name for name in names if name not in early], timeout))
