"""Keep a job's process tree inside the job's cgroups, where Slurm's limits and cleanup reach it.

The node agent (root, started by the Prolog) starts and restores the tree, so the tree is no child
of any job step and Slurm's process tracking would not see it. With `ProctrackType=proctrack/cgroup`
and `PrologFlags=Contain`, every job has an extern step whose cgroups live as long as the job on each
of its nodes; the agent moves the tree into them (a fresh tree before it runs anything, a restored
one at criu's post-restore notification, before any task runs). Then the job's limits apply to the
tree, and when the job ends, or is requeued, Slurm kills what is left of it, even if the agent died.

Which cgroups: the caller of a start or a restore (the launcher, or `agent-call` in a step of the
job on this node) is in a step of the job; the kernel says where (/proc/PID/cgroup, for the pid
SO_PEERCRED gave). Only a path with this job's `job_<id>` component counts, and the tree goes to
that job's `step_extern` beside it (cgroup v1: in every hierarchy Slurm made one in; cgroup v2: its
leaf under `user/`). Nothing is created in Slurm's hierarchy: without an extern step there is no
containment (and `singularityctl admin check` says how to configure it). A start or restore from a
process in none of the job's steps is refused where the job has an extern step. (A step of the job
may find no extern step on its node: Slurm 22.05 runs neither the Prolog nor the extern step on a
node a requeued job comes back to within the credential lifetime; that tree is not contained.)
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path


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


def extern_targets(proc_cgroup: str, mountinfo: str, job_id: int,
                   is_dir: Callable[[Path], bool] = os.path.isdir,
                   listdir: Callable[[Path], list[str]] = os.listdir) -> list[Path]:
    """The folders of the job's extern step that a process of the job's (whose /proc/PID/cgroup is
    `proc_cgroup`) points to, one per hierarchy that has one."""
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
            extern = extern / "user" / leaf
        if extern not in targets:
            targets.append(extern)
    return targets


def _step_path(job_id: int) -> re.Pattern[str]:
    return re.compile(rf"(?P<base>(?:/[^/]+)*?/job_{int(job_id)})/step_[^/]+(?:/.*)?")


def in_a_step(proc_cgroup: str, job_id: int) -> bool:
    """Whether a process (whose /proc/PID/cgroup is `proc_cgroup`) is in a step of the job."""
    step = _step_path(job_id)
    return any(step.fullmatch(path) for _, path in memberships(proc_cgroup))


def _list(listdir: Callable[[Path], list[str]], path: Path) -> list[str]:
    try:
        return listdir(path)
    except OSError:
        return []


def targets_of(pid: int, job_id: int) -> list[Path]:
    """The job's extern cgroups, as seen from process `pid` (a process of the job's on this node)."""
    try:
        proc_cgroup = Path(f"/proc/{pid}/cgroup").read_text()
        mountinfo = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return []
    return extern_targets(proc_cgroup, mountinfo, job_id)


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
