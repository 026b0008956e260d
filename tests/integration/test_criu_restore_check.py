"""The restored tree is checked while it is still root's: its user cannot reach it before the check.

A real tree of the job user is dumped and restored with real CRIU (no Slurm involved). The check runs
at CRIU's post-restore notification: every task is restored but has not got its user's credentials
back, so a process of the job's user can neither signal it (SIGCONT would wake a task left merely
stopped) nor trace it or take its descriptors. A refusal makes CRIU kill the whole tree.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from conftest import run_as

from singularity_slurm import config as config_mod
from singularity_slurm.checkpoint.criu import Criu, RestoreRefused, wrapper_path

WRAPPER = wrapper_path(config_mod.load().paths.prefix)


def _uids(pid: int) -> list[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return [int(u) for u in line.split()[1:]]
    raise AssertionError(f"no Uid line for {pid}")


@pytest.fixture
def dumped(tmp_path: Path, job_user: pwd.struct_passwd):
    """Images of a sleeping tree of the job user, in its own PID and mount namespace."""
    if not WRAPPER.exists():
        pytest.fail(f"{WRAPPER} is missing: `make test` installs CRIU")
    folder = Path(tempfile.mkdtemp(prefix="criu-check-", dir="/tmp"))  # the user's output goes here
    os.chmod(folder, 0o755)
    out = folder / "out"
    out.touch()
    os.chown(out, job_user.pw_uid, job_user.pw_gid)
    images = tmp_path / "images"
    images.mkdir()
    unshare = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount", "--mount-proc", "--propagation", "private", "--",
         "setsid", "setpriv", f"--reuid={job_user.pw_uid}", f"--regid={job_user.pw_gid}",
         "--init-groups", "sh", "-c", f"exec </dev/null >>{out} 2>&1; sleep 600 & wait"],
        stderr=subprocess.DEVNULL)
    children = Path(f"/proc/{unshare.pid}/task/{unshare.pid}/children")
    deadline = time.monotonic() + 10
    while True:
        kids = children.read_text().split()
        if kids and _uids(int(kids[0]))[0] == job_user.pw_uid and \
                Path(f"/proc/{kids[0]}/task/{kids[0]}/children").read_text().split():
            break
        assert time.monotonic() < deadline, "the tree did not start"
        time.sleep(0.01)
    Criu(WRAPPER).dump(int(kids[0]), images)
    unshare.wait(timeout=30)
    yield images
    shutil.rmtree(folder, ignore_errors=True)


def test_a_refused_tree_is_checked_as_roots_unreachable_by_its_user_and_killed(dumped, job_user):
    seen: dict[str, object] = {}

    def check(pid: int) -> str:
        seen["uids"] = _uids(pid)
        # The job's user tries to wake the task the way it would wake a tree left stopped.
        seen["kill"] = run_as(job_user.pw_name, ["kill", "-CONT", str(pid)]).returncode
        seen["pid"] = pid
        return "refused for the test"

    with pytest.raises(RestoreRefused, match="refused for the test"):
        Criu(WRAPPER).restore(dumped, check=check)
    assert seen["uids"] == [0, 0, 0, 0], "the tree had its user's credentials before the check"
    assert seen["kill"] != 0, "the job's user could signal the tree before it was checked"
    assert not Path(f"/proc/{seen['pid']}").exists(), "criu left the refused tree alive"


def test_a_tree_that_passes_runs_as_its_user(dumped, job_user):
    checked: list[int] = []
    pid = Criu(WRAPPER).restore(dumped, check=lambda p: checked.append(p))
    try:
        assert checked == [pid]
        assert _uids(pid) == [job_user.pw_uid] * 4
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
