"""The spool of checkpoint images: root's alone, and a dump or restore it has no room for fails at
once with the numbers and the fix."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from singularity_slurm.errors import CheckpointError
from singularity_slurm.jobenv import InvalidJobIdentity
from singularity_slurm.node import spool

ROLLUP = """55d0c0a00000-7ffd1c7f2000 ---p 00000000 00:00 0                          [rollup]
Rss:              123456 kB
Pss:               61728 kB
Pss_Anon:          40000 kB
Pss_File:          21728 kB
Pss_Shmem:           512 kB
Anonymous:         80000 kB
Swap:                  0 kB
"""


def test_a_rollup_is_read_in_bytes() -> None:
    sizes = spool.parse_rollup(ROLLUP)
    assert (sizes["Rss"], sizes["Pss_Anon"], sizes["Anonymous"]) == (123456 << 10, 40000 << 10, 80000 << 10)


def test_a_full_dump_is_estimated_per_process_unless_criu_shares_copy_on_write_pages() -> None:
    parent = {"Anonymous": 1000 << 20, "Pss_Anon": 340 << 20, "Pss_Shmem": 1 << 20}
    worker = {"Anonymous": 1000 << 20, "Pss_Anon": 330 << 20, "Pss_Shmem": 1 << 20}
    assert spool.dump_estimate([parent, worker, worker], share_cow=False) == 3003 << 20
    assert spool.dump_estimate([parent, worker, worker], share_cow=True) == 1003 << 20


def test_a_live_tree_is_estimated_from_its_processes(tmp_path: Path) -> None:
    child = subprocess.Popen(["python3", "-c", "import sys, time; b = bytearray(32 << 20); "
                              "print(flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()  # type: ignore[union-attr]
        assert spool.tree_bytes([child.pid], share_cow=False) >= 32 << 20
        assert spool.tree_bytes([child.pid, 1 << 30], share_cow=True) >= 32 << 20  # a pid gone is left out
    finally:
        child.kill()
        child.wait()


def test_the_job_folder_is_roots_and_0700_and_a_folder_users_may_write_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the spool is root's")
    root = tmp_path / "spool"
    work = spool.work_folder(root, "n1", 42, "dump-0-1")
    assert work == root / "n1" / "42" / "dump-0-1" and work.is_dir()
    for path in (root, root / "n1", root / "n1" / "42", work):
        info = path.stat()
        assert (info.st_uid, info.st_mode & 0o777) == (0, 0o700), path
    with pytest.raises(FileExistsError):
        spool.work_folder(root, "n1", 42, "dump-0-1")  # never one a killed agent left, half full

    os.chmod(root / "n1", 0o777)
    with pytest.raises(CheckpointError, match=r"the spool folder .*/n1 is not a folder of root's that only "
                                              r"root may write \(owner uid 0, mode 777\)"):
        spool.job_folder(root, "n1", 43)
    os.chmod(root / "n1", 0o700)
    (root / "n2").symlink_to(tmp_path)
    with pytest.raises(CheckpointError, match="a symlink"):
        spool.job_folder(root, "n2", 43)
    with pytest.raises(InvalidJobIdentity, match="refusing to build paths from it"):
        spool.job_path(root, "../etc", 43)


def test_a_spool_without_room_fails_with_the_numbers_and_the_fix(tmp_path: Path) -> None:
    free = spool.free_bytes(tmp_path)
    spool.check_room(tmp_path, 0, "a dump")
    (tmp_path / "dump-0-1").mkdir()
    with pytest.raises(CheckpointError) as caught:
        spool.check_room(tmp_path / "dump-0-1", free + (1 << 30), "a full dump of job 42's tree")
    message = str(caught.value)
    assert message.startswith(f"the spool {tmp_path} has ")
    assert f"a full dump of job 42's tree needs about {(free + (1 << 30)) >> 20} MiB" in message
    assert "or set paths.spool_dir to a file system with room for a job's memory" in message


def test_a_full_dump_the_spool_has_no_room_for_fails_before_criu_freezes_the_tree(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A periodic dump (by default through the spool: its tree runs again once the images are there)."""
    from singularity_slurm.checkpoint.store import CheckpointStore
    from singularity_slurm.config import parse
    from singularity_slurm.node.engine import CheckpointEngine

    class Unreached:
        share_cow, tracks_writes = True, True

        def dump(self, *args: object, **kwargs: object) -> None:
            pytest.fail("criu was asked to dump")

    config = parse({"paths": {"store_root": str(tmp_path / "store"), "spool_dir": str(tmp_path / "spool")}})
    engine = CheckpointEngine(config, "n1", tmp_path / "run", CheckpointStore(tmp_path / "store"),
                              Unreached(), None)  # type: ignore[arg-type]
    failures: list[object] = []
    monkeypatch.setattr(engine, "_index", failures.append)
    monkeypatch.setattr(spool, "free_bytes", lambda folder: 100 << 20)
    touched = ("import time; b = bytearray(256 << 20); b[::4096] = b'x' * (64 << 10); print(flush=True); "
               "time.sleep(60)")
    child = subprocess.Popen(["python3", "-c", touched], stdout=subprocess.PIPE)  # 256 MiB it owns
    try:
        child.stdout.readline()  # type: ignore[union-attr]
        with pytest.raises(CheckpointError, match=r"the spool .*/spool/n1/42 has 100 MiB free, and a full "
                                                  r"dump of job 42's tree needs about 2\d\d MiB"):
            engine.checkpoint(42, os.getuid(), child.pid, reason="periodic", stop=False)
    finally:
        child.kill()
        child.wait()
    assert list((tmp_path / "spool" / "n1" / "42").iterdir()) == []  # its image folder is gone
    assert len(failures) == 1  # and the failure is recorded, as any failed checkpoint's


@pytest.mark.parametrize(("setting", "stop", "streams"), [("stopping", True, True), ("never", True, False),
                                                          ("always", False, True)])
def test_a_streamed_dump_needs_no_spool_room_for_its_pages_and_hands_criu_the_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str, stop: bool, streams: bool) -> None:
    from singularity_slurm.checkpoint.store import CheckpointStore
    from singularity_slurm.config import parse
    from singularity_slurm.node.engine import CheckpointEngine

    asked: list[dict] = []

    class Recording:
        share_cow, tracks_writes = True, False

        def dump(self, *args: object, **kwargs: object) -> None:
            asked.append(kwargs)
            raise CheckpointError("criu dump failed (test)")

    config = parse({"paths": {"store_root": str(tmp_path / "store"), "spool_dir": str(tmp_path / "spool")},
                    "preemption": {"stream_pages": setting}})
    engine = CheckpointEngine(config, "n1", tmp_path / "run", CheckpointStore(tmp_path / "store"),
                              Recording(), None)  # type: ignore[arg-type]
    monkeypatch.setattr(engine, "_index", lambda action: None)
    monkeypatch.setattr(spool, "free_bytes", lambda folder: 1 << 20)  # room for no tree's pages
    expected = "criu dump failed" if streams else "spool .* has 1 MiB free"
    with pytest.raises(CheckpointError, match=expected):
        engine.checkpoint(42, os.getuid(), os.getpid(), reason="preempt", stop=stop)
    assert [kw["pages"] is not None for kw in asked] == ([True] if streams else [])
    assert not list((tmp_path / "store" / "jobs" / "42" / "manifests").glob("*")), "a failed dump committed"
