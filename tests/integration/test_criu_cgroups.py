"""A restored tree's memory is charged to the cgroups it is restored into, from its first page.

The node agent used to move a restored tree into the job's cgroups at criu's post-restore
notification, after criu had written every page: no cgroup version moves charges with a task, so
the whole restored memory stayed charged to the agent's cgroup, outside the job's memory limit (and
the sockets criu made stayed the agent's cgroup's). Now criu itself starts in the job's cgroups
(`Criu.restore(launch=jobtree.joining(...))`). A real criu round trip of the job user's tree (a
parent holding 48 MiB, two forked children), no Slurm: restored the old way and the new way into
cgroups of their own, side by side.
"""

from __future__ import annotations

import os
import pwd
import signal
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from criutree import running_tree

from singularity_slurm import config as config_mod
from singularity_slurm.checkpoint.criu import Criu, RestoreFailed, wrapper_path
from singularity_slurm.node import jobcgroup, jobtree

pytestmark = pytest.mark.integration

WRAPPER = wrapper_path(config_mod.load().paths.prefix)
MIB = 48
V2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()


@contextmanager
def memory_cgroup() -> Iterator[Path]:
    """A memory cgroup of the test's own (cgroup v1's memory hierarchy, or v2's), removed after."""
    base = Path("/sys/fs/cgroup") if V2 else Path("/sys/fs/cgroup/memory")
    cgroup = base / f"singularity-test-{uuid.uuid4().hex[:12]}"
    cgroup.mkdir()
    try:
        yield cgroup
    finally:
        deadline = time.monotonic() + 30
        while True:
            try:
                cgroup.rmdir()
                break
            except OSError:  # its last tasks are still exiting
                assert time.monotonic() < deadline, f"{cgroup} still holds {jobcgroup.members(cgroup)}"
                time.sleep(0.05)


def anonymous_bytes(cgroup: Path) -> int:
    """The anonymous memory charged to the cgroup (not the page cache of the images criu read)."""
    stat = dict(line.split() for line in (cgroup / "memory.stat").read_text().splitlines())
    return int(stat["anon" if V2 else "rss"])


def end(root: int) -> None:
    os.kill(root, signal.SIGKILL)
    os.waitpid(root, 0)


def test_a_restored_trees_memory_is_charged_to_the_cgroup_criu_restored_it_in(
        job_user: pwd.struct_passwd, tmp_path: Path):
    if not WRAPPER.exists():
        pytest.fail(f"{WRAPPER} is missing: `make test` installs CRIU")
    images = tmp_path / "images"
    with running_tree(job_user, MIB) as tree, memory_cgroup() as after, memory_cgroup() as within:
        Criu(WRAPPER).dump(tree.init, images)

        # as before: restored, then moved in at the post-restore notification
        root = Criu(WRAPPER).restore(images, check=lambda pid: "; ".join(
            jobcgroup.join(jobcgroup.tree(pid), [after])) or None)
        try:
            assert set(jobcgroup.tree(root)) <= jobcgroup.members(after)
            moved_in = anonymous_bytes(after)
        finally:
            end(root)

        root = Criu(WRAPPER).restore(images, launch=jobtree.joining([str(within / "cgroup.procs")]))
        try:
            pids = jobcgroup.tree(root)
            assert len(pids) == 3 and set(pids) <= jobcgroup.members(within)
            restored_within = anonymous_bytes(within)
        finally:
            end(root)

    assert restored_within >= MIB << 20, restored_within  # the parent's memory, at least
    assert moved_in < 8 << 20, moved_in  # what the old way charged: pages touched after the move


def test_a_restore_whose_cgroup_cannot_be_joined_fails_clearly(job_user: pwd.struct_passwd, tmp_path: Path):
    """criu never runs outside the cgroups it was to run in: the restore fails (and the agent tries
    an older checkpoint, or starts the job over), naming them."""
    images = tmp_path / "images"
    with running_tree(job_user, 1) as tree:
        Criu(WRAPPER).dump(tree.init, images)
        gone = tmp_path / "no-such-cgroup" / "cgroup.procs"
        with pytest.raises(RestoreFailed) as failed:
            Criu(WRAPPER).restore(images, launch=jobtree.joining([str(gone)]))
        assert f"criu could not join the cgroups of its tree ({gone})" in str(failed.value)
        assert not (images / "restore.log").exists()  # criu did not start
