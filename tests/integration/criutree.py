"""A real tree of the job user for criu round trips without Slurm: a parent holding random memory
and two forked children, in their own PID and mount namespace.

Each process reports `<role> <sha256 of its memory>` to a file of the test's: once ready, and again
at every SIGUSR1. At SIGUSR2 it overwrites a part of its memory and reports `<role>-wrote <sha256>`
(child1 starts with a MiB of its own: no longer shared with the parent).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from singularity_slurm.node import jobcgroup

ROLES = ("parent", "child1", "child2")
PROGRAM = """
import hashlib, os, signal, sys
mib, out = int(sys.argv[1]), sys.argv[2]
memory = bytearray(os.urandom(mib << 20))

def report(role):
    with open(out, "a") as f:
        f.write(f"{role} {hashlib.sha256(memory).hexdigest()}\\n")

def write(role):
    memory[4 << 20:6 << 20] = os.urandom(2 << 20)
    report(role + "-wrote")

def serve(role):
    signal.signal(signal.SIGUSR1, lambda *_: report(role))
    signal.signal(signal.SIGUSR2, lambda *_: write(role))
    report(role + "-ready")
    while True:
        signal.pause()

for role in ("child1", "child2"):
    if os.fork() == 0:
        if role == "child1":
            memory[: 1 << 20] = os.urandom(1 << 20)
        serve(role)
serve("parent")
"""


class Tree:
    def __init__(self, init: int, out: Path):
        self.init, self.out = init, out

    def reports(self, count: int, timeout: float = 30) -> dict[str, str]:
        """The first `count` reports, role -> hash (a role's later report replaces its earlier one)."""
        deadline = time.monotonic() + timeout
        while True:
            lines = self.out.read_text().splitlines()
            if len(lines) >= count:
                return dict(line.split() for line in lines[:count])
            assert time.monotonic() < deadline, f"the tree reported {lines}, not {count} lines"
            time.sleep(0.02)

    def signal_all(self, root: int, signo: int) -> list[int]:
        pids = jobcgroup.tree(root)
        for pid in pids:
            os.kill(pid, signo)
        return pids


def restore_matches(criu, folder: Path, tree: Tree, written: dict[str, str]) -> None:
    """Restore `folder` with `criu` and check that every process of the restored tree holds the
    memory it reported after its write (`written`, a `reports` that followed SIGUSR2); the
    restored tree is killed after."""
    root = criu.restore(folder)
    try:
        reported = len(tree.out.read_text().splitlines())
        assert len(tree.signal_all(root, signal.SIGUSR1)) == 3
        after = tree.reports(reported + 3)
        for role in ROLES:
            assert after[role] == written[f"{role}-wrote"], f"{role}'s memory differs after the restore"
    finally:
        os.kill(root, signal.SIGKILL)
        os.waitpid(root, 0)


@contextmanager
def running_tree(user: pwd.struct_passwd, mib: int) -> Iterator[Tree]:
    folder = Path(tempfile.mkdtemp(prefix="criu-tree-", dir="/tmp"))
    os.chmod(folder, 0o755)
    program, out = folder / "tree.py", folder / "out"
    program.write_text(PROGRAM)
    out.touch()
    os.chown(out, user.pw_uid, user.pw_gid)
    unshare = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount", "--mount-proc", "--propagation", "private", "--",
         "setsid", "setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups",
         # descriptors opened inside the mount namespace: criu cannot dump ones that name the host's
         "sh", "-c", 'exec </dev/null >/dev/null 2>&1; exec /usr/bin/python3 "$@"', "sh",
         str(program), str(mib), str(out)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        tree = Tree(0, out)
        tree.reports(3)
        children = Path(f"/proc/{unshare.pid}/task/{unshare.pid}/children").read_text()
        (tree.init,) = (int(p) for p in children.split())
        yield tree
    finally:
        for pid in jobcgroup.tree(unshare.pid):
            with suppress(ProcessLookupError):  # gone with the namespace's init, killed just before
                os.kill(pid, signal.SIGKILL)
        unshare.wait(timeout=30)
        shutil.rmtree(folder, ignore_errors=True)
