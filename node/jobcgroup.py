"""Keep a job's process tree inside the job's cgroups, where Slurm's limits and cleanup reach it.

The node agent (root, started by the Prolog) starts and restores the tree, so the tree is no child
of any job step and Slurm's process tracking would not see it. With `ProctrackType=proctrack/cgroup`
and `PrologFlags=Contain`, every job has an extern step whose cgroups live as long as the job on each
of its nodes; the agent moves the tree into them (a fresh tree before it runs anything, a restored
one at criu's post-restore notification, before any task runs). Then the job's limits apply to the
tree.

Out of reach of Slurm's signals: Slurm ends a job (`scontrol requeue`, `scancel`, a preemption
without the user signal, the time limit) by signalling the processes of each step's tracking cgroup
(v1: freezer; v2: the step's leaves), SIGTERM then SIGKILL `KillWait` seconds later, all at once.
A training process dies of that SIGTERM before it could be checkpointed. So in the tracking
hierarchy the tree goes one level further down, into a cgroup of its own (`step_extern/singularity`,
made by root), where the job's limits still apply but Slurm's signals do not reach: the launcher
checkpoints the tree at a requeue within `KillWait`, and the Epilog ends what is still there
(`end_below_extern`, which also ends whatever the job's user moved into cgroups of their own below
the extern step, and removes those cgroups). Where the folder is taken (the job's user owns the
extern step's folder and may have made one first), the tree stays in the extern step itself.

Which cgroups: the caller of a start or a restore (the launcher, or `agent-call` in a step of the
job on this node) is in a step of the job; the kernel says where (/proc/PID/cgroup, for the pid
SO_PEERCRED gave). Only a path with this job's `job_<id>` component counts, and the tree goes to
that job's `step_extern` beside it (cgroup v1: in every hierarchy Slurm made one in; cgroup v2: its
leaf under `user/`). Nothing is created in Slurm's hierarchy but the shelter below the extern
step: without an extern step there is no containment (and `singularityctl admin check` says how to
configure it). A start or restore from a process in none of the job's steps is refused where the
job has an extern step. (A step of the job may find no extern step on its node: Slurm 22.05 runs
neither the Prolog nor the extern step on a node a requeued job comes back to within the credential
lifetime; that tree is not contained.)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from singularity_slurm.errors import CheckpointError


@dataclass(frozen=True)
class Mount:
    """A cgroup hierarchy as mounted: v1 with its controllers (or a name=), or the v2 one."""

    point: Path
    root: str  # the hierarchy's path mounted there (/ on the host)
    controllers: frozenset[str]  # v1 options naming controllers, or {"name=X"}; empty for v2
    v2: bool


_V1_OPTIONS = re.compile(r"[a-z_]+|name=[\w.-]+")


def cgroup_mounts(mountinfo: str) -> list[Mount]:
    """Every cgroup hierarchy in a /proc/PID/mountinfo text."""
    mounts = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if len(fields) < dash + 4 or dash < 5:
            continue
        fstype, options = fields[dash + 1], fields[dash + 3].split(",")
        root, point = _unescape(fields[3]), Path(_unescape(fields[4]))
        if fstype == "cgroup2":
            mounts.append(Mount(point, root, frozenset(), True))
        elif fstype == "cgroup":
            known = {o for o in options if _V1_OPTIONS.fullmatch(o)} - {"rw", "ro", "relatime", "noexec",
                                                                         "nosuid", "nodev", "xattr"}
            mounts.append(Mount(point, root, frozenset(known), False))
    return mounts


def _unescape(text: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def memberships(proc_cgroup: str) -> list[tuple[frozenset[str], str]]:
    """(controllers, path) of each line of a /proc/PID/cgroup text; v2's line has no controllers."""
    found = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[2].startswith("/"):
            found.append((frozenset(c for c in parts[1].split(",") if c), parts[2]))
    return found


SHELTER = "singularity"
"""The cgroup below the extern step that holds the trees in the tracking hierarchy."""

PROXIES = "singularity-proxies"
"""The cgroup beside the shelter that holds the job's proxies on the node, in the tracking
hierarchy: the memory, cores and devices they use for the job count against the job's limits (in
the other hierarchies they join the extern step itself), and neither Slurm's signals nor the
freeze of a tree waiting for a dump slot reach them. Where the job's user took the name first, they
join the extern step itself, as a tree does: still the job's limits, and Slurm's SIGTERM at a
requeue then ends them, which costs only that job its checkpoint."""


def tracks(mount: Mount) -> bool:
    """Whether Slurm's process tracking signals through this hierarchy: v1's freezer, or v2."""
    return mount.v2 or "freezer" in mount.controllers


def extern_targets(proc_cgroup: str, mountinfo: str, job_id: int,
                   is_dir: Callable[[Path], bool] = os.path.isdir,
                   listdir: Callable[[Path], list[str]] = os.listdir, shelter: bool = False,
                   name: str = SHELTER) -> list[Path]:
    """The folders of the job's extern step that a process of the job's (whose /proc/PID/cgroup is
    `proc_cgroup`) points to, one per hierarchy that has one. With `shelter`, the tracking
    hierarchy's is the extern step's cgroup `name` instead (which may not exist yet)."""
    step = _step_path(job_id)
    mounts = cgroup_mounts(mountinfo)
    targets = []
    for controllers, path in memberships(proc_cgroup):
        match = step.fullmatch(path)
        if match is None:
            continue
        mount = next((m for m in mounts if (m.v2 and not controllers)
                      or (not m.v2 and controllers and controllers <= m.controllers)), None)
        if mount is None:
            continue
        base = match.group("base")
        inner = base.removeprefix(mount.root.rstrip("/")) if mount.root != "/" else base
        extern = mount.point / inner.lstrip("/") / "step_extern"
        if not is_dir(extern):
            continue
        if mount.v2:
            # processes live in leaves only: the extern step's own task folder under user/
            leaves = sorted(n for n in _list(listdir, extern / "user") if n.startswith("task_"))
            leaf = "task_special" if "task_special" in leaves else (leaves[0] if leaves else None)
            if leaf is None:
                continue
            if not shelter:
                extern = extern / "user" / leaf
        if shelter and tracks(mount):
            extern = extern / name
        if extern not in targets:
            targets.append(extern)
    return targets


_OUTSIDE_A_JOB = r"(?:/(?!job_|step_)[^/]+)*"
"""Folders above Slurm's job folder: none of them a job's or a step's (cgroups the job's user made
below a step of theirs may be named anything, `job_<id>/step_0` included)."""


def _step_path(job_id: int) -> re.Pattern[str]:
    return re.compile(rf"(?P<base>{_OUTSIDE_A_JOB}/job_{int(job_id)})/step_[^/]+(?:/.*)?")


def in_a_step(proc_cgroup: str, job_id: int) -> bool:
    """Whether a process (whose /proc/PID/cgroup is `proc_cgroup`) is in a step of the job."""
    step = _step_path(job_id)
    return any(step.fullmatch(path) for _, path in memberships(proc_cgroup))


def _list(listdir: Callable[[Path], list[str]], path: Path) -> list[str]:
    try:
        return listdir(path)
    except OSError:
        return []


def targets_of(pid: int, job_id: int, problems: list[str] | None = None,
               name: str = SHELTER) -> list[Path]:
    """The cgroups a tree of the job joins, as seen from process `pid` (a process of the job's on
    this node): the extern step's, its shelter `name` (made here) in the tracking hierarchy. Where
    the shelter cannot be had, the extern step's own folder, and the reason in `problems`."""
    try:
        proc_cgroup = Path(f"/proc/{pid}/cgroup").read_text()
        mountinfo = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return []
    plain = extern_targets(proc_cgroup, mountinfo, job_id)
    sheltered = extern_targets(proc_cgroup, mountinfo, job_id, shelter=True, name=name)
    if len(plain) != len(sheltered):  # the folders changed between the two looks
        return plain
    chosen = []
    for near, far in zip(plain, sheltered, strict=True):
        problem = make_shelter(far) if far != near else None
        if problem is not None and problems is not None:
            problems.append(problem)
        chosen.append(near if problem else far)
    return chosen


def make_shelter(path: Path) -> str | None:
    """Make the tree's own cgroup (root's) unless it is there already; None once it is root's, else
    why it cannot be used."""
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        pass
    except OSError as exc:
        return f"cannot make {path}: {exc.strerror or exc}"
    try:
        info = os.lstat(path)
    except OSError as exc:
        return f"cannot look at {path}: {exc.strerror or exc}"
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0:
        return f"{path} is not root's (uid {info.st_uid}): someone made it before the agent"
    return None


def caller_in_a_step(pid: int, job_id: int) -> bool:
    try:
        return in_a_step(Path(f"/proc/{pid}/cgroup").read_text(), job_id)
    except OSError:
        return False


def extern_steps(job_id: int, mounts: list[Mount] | None = None) -> list[Path]:
    """The job's extern step folders on this node, in every cgroup hierarchy. Slurm makes them at
    most three levels below a hierarchy's root (v1: slurm[_<node>]/uid_<uid>/job_<id>; v2:
    system.slice/slurmstepd[_<node>].scope/job_<id>)."""
    if mounts is None:
        try:
            mounts = cgroup_mounts(Path("/proc/self/mountinfo").read_text())
        except OSError:
            return []
    found = []
    for mount in mounts:
        for depth in range(4):
            pattern = "/".join(["*"] * depth + [f"job_{int(job_id)}", "step_extern"])
            found.extend(path for path in sorted(mount.point.glob(pattern)) if path.is_dir())
    return found


def procs_files(targets: Iterable[Path]) -> list[str]:
    return [str(target / "cgroup.procs") for target in targets]


def join(pids: Iterable[int], targets: Iterable[Path]) -> list[str]:
    """Move processes (with all their threads) into every target; the problems, as text."""
    problems = []
    for target in targets:
        for pid in pids:
            try:
                with open(target / "cgroup.procs", "w") as procs:
                    procs.write(f"{pid}\n")
            except ProcessLookupError:
                continue  # it exited meanwhile
            except OSError as exc:
                problems.append(f"pid {pid} into {target}: {exc.strerror or exc}")
    return problems


def join_service(pid: int, start_time: int, targets: Iterable[Path],
                 started: Callable[[int], int | None]) -> list[str]:
    """Move one process, named by its pid and its start time (`started(pid)`, as the kernel counts
    it), into every target; the problems, as text. Its pidfd is opened before the start time is
    compared and looked at again after the moves: a process that still runs then is the one that
    was moved (its pid could not have been another's meanwhile), so a recycled pid is moved only
    where the process ended within those few writes, and that is reported (what was moved is the
    Epilog's to sweep)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return [f"pid {pid} has ended"]
    try:
        if started(pid) != start_time:
            return [f"pid {pid} is no longer the process its pid file names"]
        problems = join([pid], targets)
        if select.select([fd], [], [], 0)[0]:  # readable: it has ended
            problems.append(f"pid {pid} ended while it was moved")
        return problems
    finally:
        os.close(fd)


def tree(root_pid: int) -> list[int]:
    """`root_pid` and every process below it (children of every thread), parents first."""
    seen, order, todo = {root_pid}, [root_pid], [root_pid]
    while todo:
        pid = todo.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:
            continue
        for tid in tids:
            try:
                children = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
            except FileNotFoundError:
                continue
            for child in map(int, children):
                if child not in seen:
                    seen.add(child)
                    order.append(child)
                    todo.append(child)
    return order


def members(target: Path) -> set[int]:
    """The processes in one cgroup."""
    try:
        return {int(p) for p in (target / "cgroup.procs").read_text().split()}
    except OSError:
        return set()


@dataclass(frozen=True)
class Swept:
    """What `end_below_extern` did: the processes it ended, those still there after its wait, the
    cgroups it found below the job's extern steps, and those of them it could not remove."""

    ended: list[int]
    left: list[int]
    cgroups: list[Path]
    kept: list[Path] = field(default_factory=list)


NOTE = "cgroups.json"
"""The agent's note (in the job's root-only run folder) of the extern step folders its trees joined."""


def extern_of(target: Path) -> Path | None:
    """The extern step folder a target is in (itself, its shelter's parent, v2's user/task_x's)."""
    for folder in (target, *target.parents):
        if folder.name == "step_extern":
            return folder
    return None


def note_externs(run_dir: Path, targets: Iterable[Path], job_id: int) -> None:
    """Add the extern step folders of `targets` to the note for the Epilog (0600, written
    atomically): those of earlier trees stay."""
    externs = sorted({str(e) for e in map(extern_of, targets) if e is not None}
                     | {str(e) for e in noted_externs(run_dir, job_id)})
    temp = run_dir / f".{NOTE}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(externs, out)
    os.replace(temp, run_dir / NOTE)


def noted_externs(run_dir: Path, job_id: int) -> list[Path]:
    """The extern step folders the job's agent noted here: only cgroupfs folders of this job's."""
    try:
        noted = json.loads((run_dir / NOTE).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(noted, list):
        return []
    shape = re.compile(rf"/sys/fs/cgroup{_OUTSIDE_A_JOB}/job_{int(job_id)}/step_extern")
    return [Path(p) for p in noted if isinstance(p, str) and shape.fullmatch(p) and ".." not in p]


def below_extern(externs: Iterable[Path], unreadable: list[Path] | None = None) -> list[Path]:
    """Every cgroup below these extern steps (the trees' shelter, and any the job's user made),
    deepest first; folders that could not be listed go to `unreadable`. cgroupfs holds no symlinks,
    and none would be followed."""
    found = []
    for extern in externs:
        for folder, _, _ in os.walk(extern, topdown=False, onerror=lambda exc: _note(unreadable, exc)):
            if Path(folder) != extern:
                found.append(Path(folder))
    return found


def _note(unreadable: list[Path] | None, exc: OSError) -> None:
    """A folder os.walk could not list (one that is gone meanwhile is no problem)."""
    if unreadable is not None and exc.filename and not isinstance(exc, FileNotFoundError):
        unreadable.append(Path(exc.filename))


def _write_interface(cgroup: Path, name: str, value: bytes) -> None:
    """Write one of a cgroup's interface files, if it has it (not following a link)."""
    try:
        fd = os.open(cgroup / name, os.O_WRONLY | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        os.write(fd, value)
    except OSError:
        pass
    finally:
        os.close(fd)


def thaw(cgroup: Path) -> None:
    """Let a frozen cgroup's processes run (v1 freezer, v2 cgroup.freeze): a frozen task does not
    die of SIGKILL until it is thawed."""
    _write_interface(cgroup, "freezer.state", b"THAWED")
    _write_interface(cgroup, "cgroup.freeze", b"0")


def freezable(targets: Iterable[Path]) -> list[Path]:
    """Of the cgroups a tree joined, those that hold it alone: its shelter (where the shelter could
    not be had, the tree is in the extern step, which holds Slurm's own process too). `frozen`
    checks that each is root's, through the descriptor it then writes by."""
    return [target for target in targets if target.name == SHELTER]


_FREEZERS = (("freezer.state", b"FROZEN", b"THAWED", "freezer.state", b"THAWED"),  # v1
             ("cgroup.freeze", b"1", b"0", "cgroup.events", b"frozen 0"))  # v2
"""(file, frozen, thawed, where the state shows, what it shows once thawed) of each freezer."""


def _write_at(folder: int, name: str, value: bytes) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
    try:
        os.write(fd, value)
    finally:
        os.close(fd)


def _thawed_at(folder: int, name: str, shows: bytes) -> bool:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
    try:
        text = os.read(fd, 4096)
    finally:
        os.close(fd)
    return shows in (line.strip() for line in text.splitlines())


def _open_root_cgroup(cgroup: Path) -> int | None:
    """A descriptor of `cgroup` if it is a folder of root's (not followed through a link); the
    descriptor keeps naming it if its user renames it and makes another in its place."""
    try:
        fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    if os.fstat(fd).st_uid != 0:
        os.close(fd)
        return None
    return fd


class ThawFailed(CheckpointError):
    """A tree frozen while it waited could not be let run again: criu cannot seize a frozen task."""


@contextlib.contextmanager
def frozen(cgroups: Sequence[Path]) -> Iterator[list[Path]]:
    """Freeze these cgroups (`freezable`'s, each only if it is root's) for the body and thaw them
    after it, whatever happened; yields those that froze. The cgroup freezer is invisible to the
    processes (no signal, no state a dump records): a tree frozen while it waits for a dump slot is
    dumped, once thawed, exactly as it stood. A cgroup that cannot be frozen leaves its tree running,
    which costs only time; one that froze and then does not show thawed (a frozen cgroup above it)
    raises ThawFailed. Each cgroup is written through one descriptor, opened and checked first."""
    done: list[tuple[Path, int, tuple[str, bytes, bytes, str, bytes]]] = []
    opened: list[int] = []
    try:
        for cgroup in cgroups:
            fd = _open_root_cgroup(cgroup)
            if fd is None:
                continue
            opened.append(fd)
            for face in _FREEZERS:
                try:
                    _write_at(fd, face[0], face[1])
                except OSError:
                    continue
                done.append((cgroup, fd, face))
                break
        yield [cgroup for cgroup, _, _ in done]
    finally:
        problems = []
        for cgroup, fd, (name, _, thawed, shows_in, shows) in done:
            try:
                _write_at(fd, name, thawed)
                if not _thawed_at(fd, shows_in, shows):
                    problems.append(f"{cgroup}: it is still frozen (a cgroup above it is)")
            except OSError as exc:
                problems.append(f"{cgroup}: {exc.strerror or exc}")
        for fd in opened:
            os.close(fd)
        if problems:
            raise ThawFailed(f"the job's tree was frozen while it waited and cannot be thawed: "
                             f"{'; '.join(problems)}")


def _kill_member(pid: int, cgroup: Path) -> bool:
    """SIGKILL `pid` if it is (still) in `cgroup`: the pidfd opened first names the process that the
    membership check then finds, so a recycled pid elsewhere is never signalled."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        if pid not in members(cgroup):
            return False
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)


def end_below_extern(externs: Sequence[Path], timeout: float = 10.0) -> Swept:
    """End every process in a cgroup below the job's extern steps (`externs`, as the agent noted
    them), wait for them (at most `timeout`), and remove those cgroups, then the extern step and job
    folders Slurm could not remove while they were in use (for the Epilog, once every step of the
    job has ended on this node).

    Each pass looks again (a process may make cgroups until it dies). The extern step itself, which
    is root's, is frozen while its processes are signalled (v1: no cgroup below a frozen one can
    thaw itself) and its whole subtree killed at once where the kernel can (v2's cgroup.kill, which
    frozen tasks obey too); then the cgroups below are thawed, the user's own freeze included, and
    the extern step last, so every pending SIGKILL is delivered."""
    ended: set[int] = set()
    seen: list[Path] = []
    unreadable: list[Path] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            cgroups = below_extern(externs, unreadable)
            seen += [cgroup for cgroup in cgroups if cgroup not in seen]
            present = [(pid, cgroup) for cgroup in cgroups for pid in members(cgroup)]
            if not present or time.monotonic() >= deadline:
                break
            for extern in externs:
                _write_interface(extern, "freezer.state", b"FROZEN")
            for pid, cgroup in present:
                if _kill_member(pid, cgroup):
                    ended.add(pid)
            for extern in externs:
                _write_interface(extern, "cgroup.kill", b"1")
            for cgroup in cgroups:
                thaw(cgroup)
            for extern in externs:
                thaw(extern)
            time.sleep(0.05)
    finally:
        for extern in externs:
            thaw(extern)
    cgroups = below_extern(externs, unreadable)
    seen += [cgroup for cgroup in cgroups if cgroup not in seen]
    left = sorted({pid for cgroup in cgroups for pid in members(cgroup)})
    kept = [cgroup for cgroup in cgroups if not _rmdir(cgroup)]
    for extern in externs:
        if _rmdir(extern):  # where Slurm has not yet: it removes its own folders when it can
            _rmdir(extern.parent)  # job_<id>: Slurm's steps here are over
    kept += [folder for folder in unreadable if folder not in kept]
    return Swept(sorted(ended - set(left)), left, seen, kept)


def _rmdir(path: Path) -> bool:
    try:
        os.rmdir(path)
        return True
    except OSError:  # in use, or has other cgroups: Slurm's to remove
        return False
