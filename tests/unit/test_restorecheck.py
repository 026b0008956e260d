"""What a restored tree holds is checked against its user's rights: the decisions, and a live tree."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from singularity_slurm.node import restorecheck
from singularity_slurm.node.restorecheck import (
    Mapping,
    access_for_flags,
    fdinfo_flags,
    may_access,
    parse_maps,
)

UID, GID, OTHER = 1001, 1001, 1002


@pytest.mark.parametrize("mode, owner, group, gids, want, allowed", [
    (0o600, UID, GID, [GID], "r", True),  # the owner's bits
    (0o600, UID, GID, [GID], "rw", True),
    (0o400, UID, GID, [GID], "w", False),
    (0o066, UID, GID, [GID], "r", False),  # the owner class applies even when others may read
    (0o640, 0, 50, [GID, 50], "r", True),  # a supplementary group's bits
    (0o640, 0, 50, [GID, 50], "w", False),
    (0o604, 0, 50, [GID, 50], "r", False),  # the group class applies, not others'
    (0o604, 0, 0, [GID], "r", True),  # others' bits
    (0o600, 0, 0, [GID], "r", False),  # /etc/shadow-like: root-owned 0600
    (0o640, 0, 42, [GID], "r", False),  # root's file of a group the user is not in
    (0o711, 0, 0, [GID], "x", True),  # a folder others may search
    (0o700, 0, 0, [GID], "x", False),
    (0o755, OTHER, OTHER, [GID], "w", False),  # another user's file
])
def test_may_access_reads_one_class_of_mode_bits(mode, owner, group, gids, want, allowed):
    assert may_access(mode, owner, group, UID, gids, read="r" in want, write="w" in want,
                      execute="x" in want) is allowed


def test_root_may_access_anything():
    assert may_access(0o000, 5, 5, 0, [0], read=True, write=True, execute=True)


def test_fdinfo_flags_and_the_access_they_need():
    assert fdinfo_flags("pos:\t0\nflags:\t0100002\nmnt_id:\t30\nino:\t5\n") == 0o100002
    assert access_for_flags(0o100000) == (True, False)  # O_RDONLY|O_LARGEFILE
    assert access_for_flags(0o2101) == (False, True)  # O_WRONLY|O_APPEND|O_CREAT
    assert access_for_flags(0o2) == (True, True)
    assert access_for_flags(0o10000000) == (False, False)  # O_PATH
    with pytest.raises(ValueError):
        fdinfo_flags("pos: 0\n")


def test_parse_maps_keeps_file_mappings_with_their_needs():
    text = (
        "55d0a000-55d0b000 r--p 00000000 fe:01 1234     /usr/bin/python3.11\n"
        "7f00a000-7f00b000 rw-s 00000000 fe:01 99       /tmp/shared file\n"
        "7f00c000-7f00d000 rw-p 00000000 00:00 0 \n"
        "7f00e000-7f00f000 rw-s 00000000 00:01 7        /dev/zero (deleted)\n"
        "7ffd0000-7ffd1000 r-xp 00000000 00:00 0        [vdso]\n"
    )
    maps = parse_maps(text)
    assert maps == [Mapping("55d0a000", "55d0b000", "r--p", 1234, "/usr/bin/python3.11"),
                    Mapping("7f00a000", "7f00b000", "rw-s", 99, "/tmp/shared file"),
                    Mapping("7f00e000", "7f00f000", "rw-s", 7, "/dev/zero (deleted)")]
    assert [m.needs() for m in maps[:2]] == [(True, False), (True, True)]
    assert Mapping("00400000", "0041f000", "r--p", 1, "/x").range == "400000-41f000"  # as map_files names it
    assert restorecheck.no_path(maps[2].path) and not restorecheck.no_path(maps[1].path)
    assert restorecheck.no_path("pipe:[123]") and restorecheck.no_path("/memfd:x (deleted)")


def test_folders_above():
    assert restorecheck.folders_above("/a/b/c") == ["/", "/a", "/a/b"]
    assert restorecheck.folders_above("/") == []


# --- a live tree --------------------------------------------------------------------------------------


@pytest.fixture
def jobuser() -> pwd.struct_passwd:
    if os.geteuid() != 0:
        pytest.skip("runs as root, to start a process of the job user")
    try:
        return pwd.getpwnam("jobuser")
    except KeyError:
        pytest.skip("needs the unprivileged user jobuser")


@pytest.fixture
def root_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="singularity-restorecheck-", dir="/tmp"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


NANOSLEEP = ("35", "230")  # x86_64 nanosleep, clock_nanosleep


def holding(user: pwd.struct_passwd, fd: int | None = None) -> subprocess.Popen:
    """A process of `user` that holds `fd` (opened by root, as a restore would), once `sleep` sleeps
    (before its exec it is a copy of this process, and while it starts it opens files of its own)."""
    proc = subprocess.Popen(["sleep", "60"], user=user.pw_uid, group=user.pw_gid, extra_groups=[],
                            pass_fds=[fd] if fd is not None else [], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
    deadline = time.monotonic() + 30
    while Path(f"/proc/{proc.pid}/syscall").read_text().split()[0] not in NANOSLEEP:
        assert time.monotonic() < deadline, "sleep did not start"
        time.sleep(0.005)
    return proc


def check(proc: subprocess.Popen, user: pwd.struct_passwd) -> list[restorecheck.Problem]:
    try:
        return restorecheck.check_tree(proc.pid, user.pw_uid, os.getgrouplist(user.pw_name, user.pw_gid))
    finally:
        proc.kill()
        proc.wait()


def test_a_process_holding_only_what_its_user_may_open_passes(jobuser):
    assert check(holding(jobuser), jobuser) == []


def test_an_fd_on_a_root_only_file_is_found(jobuser, root_dir):
    secret = root_dir / "shadow"
    secret.write_text("root:x\n")
    os.chmod(secret, 0o600)
    fd = os.open(secret, os.O_RDONLY)
    try:
        problems = check(holding(jobuser, fd), jobuser)
    finally:
        os.close(fd)
    assert [(p.what, p.path) for p in problems] == [(f"fd {fd}", str(secret))]
    assert "may not read it (owner uid 0, gid 0, mode 600)" in problems[0].reason


def test_a_write_fd_on_a_file_the_user_may_only_read_is_found(jobuser, root_dir):
    public = root_dir / "public"
    public.write_text("x")
    os.chmod(public, 0o644)
    fd = os.open(public, os.O_WRONLY)
    try:
        problems = check(holding(jobuser, fd), jobuser)
    finally:
        os.close(fd)
    assert [(p.what, p.path, "may not write" in p.reason) for p in problems] == [
        (f"fd {fd}", str(public), True)]


def test_an_fd_on_a_folder_the_user_could_not_reach_is_found(jobuser, root_dir):
    locked = root_dir / "locked"
    (locked / "inner").mkdir(parents=True)
    os.chmod(locked, 0o700)
    os.chmod(locked / "inner", 0o755)
    fd = os.open(locked / "inner", os.O_RDONLY | os.O_DIRECTORY)
    try:
        problems = check(holding(jobuser, fd), jobuser)
    finally:
        os.close(fd)
    assert [(p.what, p.path) for p in problems] == [(f"fd {fd}", str(locked / "inner"))]
    assert f"may not search the folder {locked} above it" in problems[0].reason


# --- the images ---------------------------------------------------------------------------------------


def _reg(id_: int, name: str) -> dict:
    return {"type": "REG", "id": id_, "reg": {"id": id_, "name": name, "flags": 0}}


def test_deleted_files_still_open_outside_the_private_dev_shm_are_risks():
    files = [_reg(1, "/tmp/ghost"), _reg(2, "/dev/shm/torch_123"), _reg(3, "/home/u/linked"),
             _reg(4, "/tmp/kept")]
    remaps = [{"orig_id": 1, "remap_id": 1, "remap_type": "GHOST"},
              {"orig_id": 2, "remap_id": 2, "remap_type": "GHOST"},
              {"orig_id": 3, "remap_id": 3, "remap_type": "LINKED"},
              {"orig_id": 4, "remap_id": 4, "remap_type": "PROCFS"}]
    assert restorecheck.image_risks(files, remaps) == [
        "a deleted file still open at /tmp/ghost", "a deleted file still open at /home/u/linked"]


def test_a_plain_tree_has_no_risks():
    assert restorecheck.image_risks([_reg(1, "/usr/bin/python3"), _reg(2, "/tmp/out")], []) == []
