"""Start a job's process tree in its own PID and mount namespace, as the job's user.

The namespace's init (pid 1) is a small `sh` running as the user: a session leader (criu needs it),
it starts the command and exits with its status, which tears the namespace down. Inside the mount
namespace /proc belongs to the new PID namespace and /dev/shm is a private tmpfs, and every
descriptor the tree holds is opened in there (stdin /dev/null, stdout and stderr the job's output file
in append mode): that is what makes the tree dumpable and restorable on any node, whatever pids are
in use there.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from singularity_slurm.errors import ServiceError

# pid 1 of the namespace, as root: private /dev/shm, then become the user (still pid 1).
_ROOT_INIT = r"""
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm || exit 121
uid=$1 gid=$2 user_init=$3; shift 3
exec setpriv --reuid="$uid" --regid="$gid" --init-groups -- sh -c "$user_init" singularity-init "$@"
"""

# pid 1 as the user: open stdio inside the namespace, start the command, exit with its status.
_USER_INIT = r"""
out=$1 dir=$2; shift 2
exec </dev/null >>"$out" 2>&1 || exit 122
cd "$dir" || exit 123
"$@" &
wait $!
"""


@dataclass(frozen=True)
class TreeSpec:
    argv: Sequence[str]
    uid: int
    gid: int
    cwd: str
    output: str  # file the tree's stdout and stderr append to
    env: Mapping[str, str]


def spawn(spec: TreeSpec) -> subprocess.Popen:
    """Start the tree; the returned process is `unshare`, the parent of the namespace's init."""
    env = dict(spec.env)
    argv = ["unshare", "--pid", "--fork", "--mount", "--mount-proc", "--propagation", "private", "--",
            "setsid", "sh", "-c", _ROOT_INIT, "singularity-root-init", str(spec.uid), str(spec.gid),
            _USER_INIT, spec.output, spec.cwd, *spec.argv]
    try:
        return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, close_fds=True, start_new_session=True)
    except OSError as exc:
        raise ServiceError(f"cannot start the job's processes: {exc.strerror}") from exc


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


def user_init_started(init_pid: int, uid: int) -> bool:
    """Whether the init has dropped to the user (before that, a dump would capture a root shell)."""
    try:
        status = Path(f"/proc/{init_pid}/status").read_text()
    except FileNotFoundError:
        return False
    for line in status.splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1]) == uid
    return False


def kill_tree(init_pid: int) -> None:
    """SIGKILL the namespace's init: the kernel then kills every process of the namespace."""
    try:
        os.kill(init_pid, 9)
    except ProcessLookupError:
        pass
