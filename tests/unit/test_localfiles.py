"""Node-local files carried in checkpoints: what is collected, the limits, and where they go back.

Runs as root: the files are read and written by a child that drops to the unprivileged jobuser.
"""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from singularity_slurm.config import LocalFilesConfig
from singularity_slurm.node import localfiles
from singularity_slurm.node.userio import UserCreds

LIMITS = LocalFilesConfig()


@pytest.fixture
def user() -> UserCreds:
    if os.geteuid() != 0:
        pytest.skip("runs as root, to drop to the job user")
    try:
        return UserCreds.of_uid(pwd.getpwnam("jobuser").pw_uid)
    except KeyError:
        pytest.skip("needs the unprivileged user jobuser (the dev cluster creates it)")


@pytest.fixture
def state() -> Iterator[Path]:
    """A root-owned folder every user may search, like the agent's state folder."""
    path = Path(tempfile.mkdtemp(prefix="singularity-state-", dir="/tmp"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def mine(user) -> Iterator[Path]:
    """A folder under /tmp (a node-local prefix) owned by the job user."""
    path = Path(tempfile.mkdtemp(prefix="singularity-localfiles-", dir="/tmp"))
    os.chown(path, user.uid, user.gid)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def owned(path: Path, user: UserCreds, data: bytes = b"data", mode: int = 0o600) -> Path:
    path.write_bytes(data)
    os.chown(path, user.uid, user.gid)
    os.chmod(path, mode)
    return path


def test_collect_copies_the_logged_regular_files_and_the_log(user, mine, tmp_path):
    kept = owned(mine / "kept.txt", user, b"data", 0o640)
    (mine / "dir").mkdir()
    log = owned(mine / "files.log", user, f"{kept}\n{mine / 'gone.txt'}\n{mine / 'dir'}\n{kept}\n".encode())

    outcome = localfiles.collect(log, user, tmp_path / "copies", LIMITS)

    assert sorted(outcome.entries) == [localfiles.LOG_ENTRY, f"files{kept}"]
    assert outcome.entries[f"files{kept}"].read_bytes() == b"data"
    assert outcome.entries[f"files{kept}"].stat().st_mode & 0o777 == 0o640
    assert outcome.entries[f"files{kept}"].parent == tmp_path / "copies"
    assert outcome.notices == [f"not carried: {mine / 'dir'} is a folder, not a regular file"]


def test_collect_without_a_log_carries_nothing(user, mine, tmp_path):
    outcome = localfiles.collect(mine / "missing.log", user, tmp_path / "copies", LIMITS)
    assert (outcome.entries, outcome.notices) == ({}, [])


@pytest.mark.parametrize("swap", ["root_only_symlink", "fifo", "dev_zero"])
def test_a_swapped_log_is_not_read(user, mine, tmp_path, swap):
    secret = tmp_path / "secret"
    secret.write_bytes(b"/tmp/root-secret\n")
    os.chmod(secret, 0o600)
    log = mine / "files.log"
    if swap == "root_only_symlink":
        log.symlink_to(secret)
    elif swap == "fifo":
        os.mkfifo(log)
        os.chown(log, user.uid, user.gid)
    else:
        log.symlink_to("/dev/zero")

    outcome = localfiles.collect(log, user, tmp_path / "copies", LIMITS)

    assert outcome.entries == {}
    assert len(outcome.notices) == 1 and outcome.notices[0].startswith(f"not carried: {log} is a ")


def test_files_over_the_count_limit_are_left_out_with_the_key_named():
    paths = ["/tmp/a", "/tmp/b", "/tmp/c"]
    assert localfiles.over_count(paths, LocalFilesConfig(max_files=3)) == (paths, None)
    assert localfiles.over_count(paths, LocalFilesConfig(max_files=1)) == (["/tmp/a"], (
        "2 node-local files not carried (first: /tmp/b): the job wrote 3, over local_files.max_files = 1"))


def test_collect_keeps_to_the_byte_and_log_limits(user, mine, tmp_path):
    small, big = owned(mine / "small", user, b"12"), owned(mine / "big", user, b"x" * 100)
    log = owned(mine / "files.log", user, f"{small}\n{big}\n".encode())

    outcome = localfiles.collect(log, user, tmp_path / "copies",
                                 LocalFilesConfig(max_files=10, max_bytes=50, max_log_bytes=1000))
    assert sorted(outcome.entries) == [localfiles.LOG_ENTRY, f"files{small}"]
    assert outcome.notices == [
        f"not carried: {big} (100 bytes) would exceed local_files.max_bytes = 50 bytes"]

    cut = localfiles.collect(log, user, tmp_path / "copies2",
                             LocalFilesConfig(max_files=10, max_bytes=50,
                                              max_log_bytes=len(f"{small}\n") + 3))
    assert sorted(cut.entries) == [localfiles.LOG_ENTRY, f"files{small}"]
    assert cut.notices[0].endswith(f"over local_files.max_log_bytes = {len(f'{small}') + 4}: only its first "
                                   f"{len(f'{small}') + 4} bytes are used")


def restored_tree(tmp_path: Path, target: Path, data: bytes = b"\x00payload", mode: int = 0o640) -> Path:
    source = tmp_path / "restored" / "files" / str(target).lstrip("/")
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_bytes(data)
    os.chmod(source, mode)
    return tmp_path / "restored"


def test_put_back_restores_content_mode_and_missing_parents_as_the_user(user, mine, tmp_path):
    target = mine / "sub" / "out.bin"

    outcome = localfiles.put_back(restored_tree(tmp_path, target), user, LIMITS)

    assert (outcome.written, outcome.notices) == ([target], [])
    assert target.read_bytes() == b"\x00payload"
    assert target.stat().st_mode & 0o777 == 0o640
    assert (target.parent.stat().st_uid, target.stat().st_uid) == (user.uid, user.uid)


def test_put_back_refuses_paths_outside_the_local_prefixes(user, tmp_path):
    outcome = localfiles.put_back(restored_tree(tmp_path, Path("/etc/evil.conf")), user, LIMITS)

    assert outcome.written == []
    assert not Path("/etc/evil.conf").exists()


def test_put_back_does_not_follow_a_planted_symlink(user, mine, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (mine / "link").symlink_to(outside)

    outcome = localfiles.put_back(restored_tree(tmp_path, mine / "link" / "x"), user, LIMITS)

    assert outcome.written == []
    assert outcome.notices == [f"not put back: {mine / 'link'} is a symlink or not a folder"]
    assert not (outside / "x").exists()


def test_prepare_log_puts_the_content_back_as_the_user(user, state):
    log = state / "filelog" / "7" / localfiles.LOG_NAME
    assert localfiles.prepare_log(log, user.uid, user.gid, b"/tmp/a\n") == []
    assert log.read_bytes() == b"/tmp/a\n"
    assert (log.parent.stat().st_mode & 0o777, log.parent.stat().st_uid, log.stat().st_uid) == (
        0o700, user.uid, user.uid)
    assert localfiles.prepare_log(log, user.uid, user.gid) == []
    assert log.read_bytes() == b"/tmp/a\n"  # without content the log is kept as it is


def test_prepare_log_leaves_a_swapped_log_alone(user, state):
    secret = state / "secret"
    secret.write_bytes(b"root")
    os.chmod(secret, 0o600)
    log = state / "filelog" / "8" / localfiles.LOG_NAME
    localfiles.prepare_log(log, user.uid, user.gid)
    log.unlink()
    log.symlink_to(secret)

    notices = localfiles.prepare_log(log, user.uid, user.gid, b"/tmp/evil\n")

    assert notices == [f"file-log: not put back: {log} is a symlink"]
    assert secret.read_bytes() == b"root" and secret.stat().st_uid == 0


def test_tell_job_appends_to_the_users_output_only(user, mine, tmp_path):
    output = owned(mine / "job.out", user, b"line\n", 0o644)
    assert localfiles.tell_job(user, str(output), ["a\x1bb"], "[s] ")
    assert output.read_bytes() == b"line\n[s] a?b\n"
    root_file = tmp_path / "root.out"
    root_file.write_bytes(b"")
    assert not localfiles.tell_job(user, str(root_file), ["x"], "")
    assert root_file.read_bytes() == b""
