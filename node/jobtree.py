"""Start a job's process tree in its own PID and mount namespace, as the job's user.

The namespace's init (pid 1) is a small `sh` running as the user: a session leader (criu needs it),
it starts the command and exits with its status, which tears the namespace down. Inside the mount
namespace /proc belongs to the new PID namespace and /dev/shm is a private tmpfs, and every
descriptor the tree holds is opened in there (stdin /dev/null, stdout and stderr the job's output file
in append mode): that is what makes the tree dumpable and restorable on any node, whatever pids are
in use there.

Root's part of the start (unshare, setsid, sh, mount, setpriv) runs by absolute path with a clean
environment: the job's environment is the user's to write. It travels in a close-on-exec memory
file that only the tree's init inherits; once setpriv has dropped to the user, a tiny step of the
agent's interpreter (`rootexec.USER_EXEC`) reads it, closes it, and becomes the user's init `sh`
with exactly that environment, so the tree holds no descriptor of ours.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from singularity_slurm import rootexec
from singularity_slurm.errors import ServiceError

# pid 1 of the namespace, as root with a clean environment: wait for the agent's go on stdin (it has
# noted this init by then, see `release`; the agent's end closed without it, nothing runs), private
# /dev/shm, then become the user (still pid 1), who reads the job's environment from fd $envfd and
# becomes the user init with it.
_ROOT_INIT = r"""
mount=$1 setpriv=$2 uid=$3 gid=$4 python=$5 user_exec=$6 envfd=$7 shell=$8 user_init=$9; shift 9
read -r go || exit 125
"$mount" -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm || exit 121
exec "$setpriv" --reuid="$uid" --regid="$gid" --init-groups -- \
    "$python" -I -S -c "$user_exec" "$envfd" "$shell" -c "$user_init" singularity-init "$@"
"""

# pid 1 as the user: open stdio inside the namespace, start the command, exit with its status.
_USER_INIT = r"""
out=$1 dir=$2; shift 2
exec </dev/null >>"$out" 2>&1 || exit 122
cd "$dir" || exit 123
"$@" &
wait $!
"""

# Root's first step when the job has cgroups: join them (writing its own pid), then become unshare,
# so that nothing of the tree ever runs outside them.
_JOIN_CGROUPS = r"""
n=$1; shift
while [ "$n" -gt 0 ]; do echo $$ >"$1" || exit 124; shift; n=$((n - 1)); done  # 124: criu.JOIN_FAILED
exec "$@"
"""

SHELL = "/bin/sh"


@dataclass(frozen=True)
class TreeSpec:
    argv: Sequence[str]
    uid: int
    gid: int
    cwd: str
    output: str  # file the tree's stdout and stderr append to
    env: Mapping[str, str]


@dataclass(frozen=True)
class Programs:
    """What root runs to start a tree: absolute paths from the system folders, never the user's PATH."""

    unshare: str
    setsid: str
    mount: str
    setpriv: str
    shell: str
    python: str  # runs rootexec.USER_EXEC as the user: the agent's own interpreter

    @classmethod
    def find(cls) -> Programs:
        return cls(*(rootexec.system_program(name) for name in ("unshare", "setsid", "mount", "setpriv")),
                   shell=SHELL, python=sys.executable)


def joining(cgroup_procs: Sequence[str], shell: str = SHELL) -> list[str]:
    """A command line prefix that writes its own pid into each of `cgroup_procs` (the cgroup.procs
    files of the job's cgroups) and then execs the rest of its arguments, there; it exits with
    criu.JOIN_FAILED where it cannot. Empty without cgroups."""
    if not cgroup_procs:
        return []
    return [shell, "-c", _JOIN_CGROUPS, "singularity-join-cgroups", str(len(cgroup_procs)), *cgroup_procs]


def spawn_argv(spec: TreeSpec, programs: Programs, env_fd: int,
               cgroup_procs: Sequence[str] = ()) -> list[str]:
    """The command line of `unshare` (after joining `cgroup_procs`, the cgroup.procs files of the
    job's cgroups); it holds no part of the job's environment (argv is public)."""
    return [*joining(cgroup_procs, programs.shell), programs.unshare, "--pid", "--fork", "--mount",
            "--mount-proc", "--propagation", "private", "--", programs.setsid, programs.shell, "-c",
            _ROOT_INIT, "singularity-root-init",
            programs.mount, programs.setpriv, str(spec.uid), str(spec.gid), programs.python,
            rootexec.USER_EXEC, str(env_fd), programs.shell, _USER_INIT, spec.output, spec.cwd,
            *spec.argv]


def spawn(spec: TreeSpec, programs: Programs | None = None,
          cgroup_procs: Sequence[str] = ()) -> subprocess.Popen:
    """Start the tree, held until `release`; the returned process is `unshare`, the parent of the
    namespace's init.

    Everything that runs as root (unshare, setsid, sh, mount, setpriv) runs with a clean
    environment; the job's environment travels in a memory file only the tree's init inherits, and
    becomes an environment once the init runs as the user.
    """
    programs = programs or Programs.find()
    try:
        env_fd = rootexec.env_memfd(spec.env)
    except OSError as exc:
        raise ServiceError(f"cannot hand the job's environment to its processes: {exc.strerror}") from exc
    try:
        return subprocess.Popen(spawn_argv(spec, programs, env_fd, cgroup_procs), env=rootexec.clean_env(),
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, close_fds=True, pass_fds=(env_fd,),
                                start_new_session=True, cwd="/")
    except OSError as exc:
        raise ServiceError(f"cannot start the job's processes: {exc.strerror}") from exc
    finally:
        os.close(env_fd)


def release(proc: subprocess.Popen) -> None:
    """Let a spawned tree run: until then its namespace init waits, so it cannot end (and leave
    `namespace_init` nothing to find) before the agent has found and noted it. Closing without the
    go (`proc.stdin.close()`) ends it unrun."""
    try:
        proc.stdin.write(b"go\n")
        proc.stdin.close()
    except BrokenPipeError:  # it ended already: its waiter says how
        pass


def namespace_init(unshare_pid: int, timeout: float = 10.0) -> int:
    """The pid (as seen from here) of the namespace's init: the child `unshare --fork` made."""
    deadline = time.monotonic() + timeout
    path = Path(f"/proc/{unshare_pid}/task/{unshare_pid}/children")
    while time.monotonic() < deadline:
        try:
            children = path.read_text().split()
        except FileNotFoundError:
            raise ServiceError(f"unshare (pid {unshare_pid}) exited before starting the job") from None
        if children:
            return int(children[0])
        time.sleep(0.01)
    raise ServiceError(f"unshare (pid {unshare_pid}) started no namespace within {timeout:.0f}s")


def is_user_shell(status: str, exe: str, uid: int, shell: str) -> bool:
    """Whether a process (its /proc status text and exe link) is the job user's init shell.

    Between root's sh and the user's sh the init is setpriv and then the interpreter that applies
    the job's environment, both already with the user's uid: only the exe tells the shell apart.
    """
    uids = next((line.split()[1:] for line in status.splitlines() if line.startswith("Uid:")), [])
    return bool(uids) and all(int(u) == uid for u in uids) and exe == os.path.realpath(shell)


def user_init_started(init_pid: int, uid: int, shell: str = SHELL) -> bool:
    """Whether the init is the user's shell (before that, a dump would capture a root shell or the
    step that applies the job's environment)."""
    try:
        status = Path(f"/proc/{init_pid}/status").read_text()
        exe = os.readlink(f"/proc/{init_pid}/exe")
    except (FileNotFoundError, ProcessLookupError):
        return False
    return is_user_shell(status, exe, uid, shell)


def kill_tree(init_pid: int) -> None:
    """SIGKILL the namespace's init: the kernel then kills every process of the namespace."""
    try:
        os.kill(init_pid, 9)
    except ProcessLookupError:
        pass
