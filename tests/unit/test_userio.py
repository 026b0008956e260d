"""The child that reads and writes the job user's files really is the user, and refuses what is not a
regular file of the user without ever blocking (these tests run as root; the child drops to jobuser)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from singularity_slurm.node.userio import (
    HEADER,
    MAX_FRAME,
    FrameReader,
    UserCreds,
    UserIOError,
    frame,
    run_as_user,
)


def _user(name: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pytest.skip(f"needs the unprivileged user {name} (the dev cluster creates it)")


@pytest.fixture
def user() -> UserCreds:
    if os.geteuid() != 0:
        pytest.skip("runs as root, to drop to the job user")
    return UserCreds.of_uid(_user("jobuser").pw_uid)


@pytest.fixture
def folder(user: UserCreds) -> Iterator[Path]:
    """A folder under /tmp owned by the job user."""
    path = Path(tempfile.mkdtemp(prefix="singularity-userio-", dir="/tmp"))
    os.chown(path, user.uid, user.gid)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def read(user: UserCreds, paths: list[str], budget: int = 1 << 20, timeout: float = 30) -> tuple[dict, list]:
    files: dict[str, bytes] = {}
    notices: list[str] = []
    current: list[str] = []

    def on_frame(kind: bytes, payload: bytes) -> None:
        if kind == b"F":
            current[:] = [json.loads(payload)["path"]]
            files[current[0]] = b""
        elif kind == b"D":
            files[current[0]] += payload
        elif kind == b"N":
            notices.append(payload.decode())

    run_as_user(user, {"op": "read", "paths": paths, "bases": ["/tmp"], "budget": budget, "truncate": False,
                       "limit": budget, "limit_name": "local_files.max_bytes"}, on_frame, timeout=timeout)
    return files, notices


def owned(path: Path, user: UserCreds, data: bytes = b"data", mode: int = 0o600) -> Path:
    path.write_bytes(data)
    os.chown(path, user.uid, user.gid)
    os.chmod(path, mode)
    return path


def test_the_child_reads_a_regular_file_of_the_user(user, folder):
    path = owned(folder / "mine.txt", user, b"payload")
    assert read(user, [str(path)]) == ({str(path): b"payload"}, [])


def test_the_child_cannot_read_a_root_only_file(user, folder):
    secret = folder / "secret"
    secret.write_bytes(b"root only")
    os.chmod(secret, 0o600)  # root's, 0600: only a child that really dropped to the user fails here

    files, notices = read(user, [str(secret)])

    assert files == {}
    assert notices == [f"not carried: {secret}: Permission denied"]


@pytest.mark.parametrize("kind", ["fifo", "dev_zero_link", "folder", "link_to_own_file"])
def test_what_is_not_a_regular_file_is_refused_without_blocking(user, folder, kind):
    path = folder / "x"
    if kind == "fifo":
        os.mkfifo(path)
        os.chown(path, user.uid, user.gid)
        why = "is a FIFO, not a regular file"
    elif kind == "dev_zero_link":
        path.symlink_to("/dev/zero")
        why = "is a symlink"
    elif kind == "folder":
        path.mkdir()
        os.chown(path, user.uid, user.gid)
        why = "is a folder, not a regular file"
    else:
        path.symlink_to(owned(folder / "real", user))
        why = "is a symlink"
    started = time.monotonic()

    files, notices = read(user, [str(path)], timeout=20)

    assert time.monotonic() - started < 10
    assert files == {}
    assert notices == [f"not carried: {path} {why}"]


def test_another_users_file_is_refused(user, folder):
    other = _user("jobuser2")
    path = folder / "theirs"
    path.write_bytes(b"theirs")
    os.chown(path, other.pw_uid, other.pw_gid)
    os.chmod(path, 0o644)

    files, notices = read(user, [str(path)])

    assert files == {}
    assert notices == [
        f"not carried: {path} belongs to uid {other.pw_uid}, not to the job's user (uid {user.uid})"]


def test_a_symlinked_parent_folder_is_refused(user, folder):
    real = folder / "real"
    real.mkdir()
    os.chown(real, user.uid, user.gid)
    owned(real / "f", user)
    (folder / "link").symlink_to(real)

    files, notices = read(user, [str(folder / "link" / "f")])

    assert files == {}
    assert notices == [f"not carried: {folder / 'link'} is a symlink or not a folder"]


def test_a_file_over_the_byte_budget_is_not_carried(user, folder):
    small, big = owned(folder / "small", user, b"12"), owned(folder / "big", user, b"x" * 10)

    files, notices = read(user, [str(small), str(big)], budget=5)

    assert files == {str(small): b"12"}
    assert notices == [f"not carried: {big} (10 bytes) would exceed local_files.max_bytes = 5 bytes"]


def write(user: UserCreds, files: dict[str, bytes], mode: int = 0o640) -> tuple[list[str], list[str]]:
    written: list[str] = []
    notices: list[str] = []

    def on_frame(kind: bytes, payload: bytes) -> None:
        if kind == b"K":
            written.append(json.loads(payload)["path"])
        elif kind == b"N":
            notices.append(payload.decode())

    outgoing = []
    for path, data in files.items():
        outgoing += [frame(b"F", json.dumps({"path": path, "mode": mode}).encode()), frame(b"D", data),
                     frame(b"E")]
    run_as_user(user, {"op": "write", "bases": ["/tmp"]}, on_frame, iter(outgoing), timeout=30)
    return written, notices


def test_the_child_writes_files_and_their_folders_as_the_user(user, folder):
    target = folder / "a" / "b" / "out"

    assert write(user, {str(target): b"content"}) == ([str(target)], [])
    assert target.read_bytes() == b"content"
    for path in (folder / "a", folder / "a" / "b", target):
        assert (path.stat().st_uid, path.stat().st_gid) == (user.uid, user.gid)
    assert stat.S_IMODE(target.stat().st_mode) == 0o640


def test_the_child_cannot_write_into_a_root_folder(user, folder):
    root_dir = folder / "rootdir"
    root_dir.mkdir(mode=0o755)

    written, notices = write(user, {str(root_dir / "x"): b"no"})

    assert written == [] and notices == [f"not put back: {root_dir / 'x'}: Permission denied"]
    assert not (root_dir / "x").exists()


def test_writes_through_symlinks_fifos_and_other_users_files_are_refused(user, folder):
    other = _user("jobuser2")
    victim = folder / "victim"
    victim.write_bytes(b"root's")
    (folder / "link").symlink_to(victim)
    os.mkfifo(folder / "fifo")
    os.chown(folder / "fifo", user.uid, user.gid)
    theirs = folder / "theirs"
    theirs.write_bytes(b"theirs")
    os.chown(theirs, other.pw_uid, other.pw_gid)
    os.chmod(theirs, 0o666)
    victim_dir = folder / "vdir"
    victim_dir.mkdir()
    os.chown(victim_dir, user.uid, user.gid)
    (folder / "dirlink").symlink_to(victim_dir)

    written, notices = write(user, {str(folder / "link"): b"x", str(folder / "fifo"): b"x",
                                    str(theirs): b"x", str(folder / "dirlink" / "f"): b"x"})

    assert written == []
    assert notices == [
        f"not put back: {folder / 'link'} is a symlink",
        f"not put back: {folder / 'fifo'} is a FIFO or device, not a regular file",
        f"not put back: {theirs} belongs to uid {other.pw_uid}, not to the job's user (uid {user.uid})",
        f"not put back: {folder / 'dirlink'} is a symlink or not a folder",
    ]
    assert victim.read_bytes() == b"root's" and theirs.read_bytes() == b"theirs"
    assert list(victim_dir.iterdir()) == []


def test_a_child_that_outlives_its_timeout_is_killed(user, folder):
    def slow() -> Iterator[bytes]:
        yield frame(b"F", json.dumps({"path": str(folder / "f"), "mode": 0o600}).encode())
        time.sleep(1.5)
        yield frame(b"E")

    started = time.monotonic()
    with pytest.raises(UserIOError, match="did not finish in time"):
        run_as_user(user, {"op": "write", "bases": ["/tmp"]}, lambda kind, payload: None, slow(), timeout=1)
    assert time.monotonic() - started < 5


def test_frames_over_the_limit_are_refused_before_they_are_read():
    reader = FrameReader()
    with pytest.raises(UserIOError, match="frame of"):
        list(reader.feed(HEADER.pack(b"D", MAX_FRAME + 1)))
    assert list(FrameReader().feed(frame(b"N", b"hi") + frame(b"Z")[:3])) == [(b"N", b"hi")]
