"""What a restored tree holds is checked against its user's rights: the decisions, and a live tree."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import struct
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


def check_holding(user: pwd.struct_passwd, fd: int) -> list[restorecheck.Problem]:
    """`check` of a process of `user` holding `fd`, which is closed after."""
    try:
        return check(holding(user, fd), user)
    finally:
        os.close(fd)


def test_a_process_holding_only_what_its_user_may_open_passes(jobuser):
    assert check(holding(jobuser), jobuser) == []


def test_an_fd_on_a_root_only_file_is_found(jobuser, root_dir):
    secret = root_dir / "shadow"
    secret.write_text("root:x\n")
    os.chmod(secret, 0o600)
    fd = os.open(secret, os.O_RDONLY)
    problems = check_holding(jobuser, fd)
    assert [(p.what, p.path) for p in problems] == [(f"fd {fd}", str(secret))]
    assert "may not read it (owner uid 0, gid 0, mode 600)" in problems[0].reason


def test_a_write_fd_on_a_file_the_user_may_only_read_is_found(jobuser, root_dir):
    public = root_dir / "public"
    public.write_text("x")
    os.chmod(public, 0o644)
    fd = os.open(public, os.O_WRONLY)
    problems = check_holding(jobuser, fd)
    assert [(p.what, p.path, "may not write" in p.reason) for p in problems] == [
        (f"fd {fd}", str(public), True)]


def test_an_fd_on_a_folder_the_user_could_not_reach_is_found(jobuser, root_dir):
    locked = root_dir / "locked"
    (locked / "inner").mkdir(parents=True)
    os.chmod(locked, 0o700)
    os.chmod(locked / "inner", 0o755)
    fd = os.open(locked / "inner", os.O_RDONLY | os.O_DIRECTORY)
    problems = check_holding(jobuser, fd)
    assert [(p.what, p.path) for p in problems] == [(f"fd {fd}", str(locked / "inner"))]
    assert f"may not search the folder {locked} above it" in problems[0].reason


def test_an_fd_whose_path_now_leads_to_another_inode_is_found(jobuser, root_dir):
    # a file under a folder another file system was mounted over since it was opened: its path
    # (what the folders were checked along) leads to the mounted file, not to the one the fd holds
    (root_dir / "sub").mkdir(mode=0o755)
    held = root_dir / "sub" / "file"
    held.write_text("under the mount")
    os.chmod(held, 0o644)
    fd = os.open(held, os.O_RDONLY)
    proc = holding(jobuser, fd)
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(root_dir / "sub")],
                       check=True)
        try:
            held.write_text("on the mount")
            os.chmod(held, 0o644)
            problems = check(proc, jobuser)
        finally:
            subprocess.run(["umount", str(root_dir / "sub")], check=True)
    finally:
        os.close(fd)
    assert [(p.what, p.path) for p in problems] == [(f"fd {fd}", str(held))]
    assert problems[0].reason.startswith("its path in the task's mounts leads to another inode")


# --- POSIX ACLs -----------------------------------------------------------------------------------------

U, G, J = 1000, 1000, 1001  # owner, owning group, the job's user
A = restorecheck


def acl(*entries: tuple[int, int, int]) -> bytes:
    return struct.pack("<I", A.ACL_VERSION) + b"".join(struct.pack("<HHI", *e) for e in entries)


def full(user: int = 0, group: int = 0, other: int = 0, mask: int = 7, named_users=(), named_groups=()):
    return A.parse_acl(acl((A.ACL_USER_OBJ, user, 0), *((A.ACL_USER, p, i) for i, p in named_users),
                           (A.ACL_GROUP_OBJ, group, 0), *((A.ACL_GROUP, p, i) for i, p in named_groups),
                           (A.ACL_MASK, mask, 0), (A.ACL_OTHER, other, 0)))


@pytest.mark.parametrize("entries, gids, want, allowed", [
    (full(other=4, named_users=[(J, 0)]), [J], 4, False),  # a named entry denies what others may
    (full(other=0, named_users=[(J, 6)]), [J], 6, True),  # and grants what the mode bits do not
    (full(other=0, named_users=[(J, 6)], mask=4), [J], 6, False),  # within the mask
    (full(other=4, named_groups=[(77, 0)]), [J, 77], 4, False),  # a group entry, and none grants
    (full(other=0, named_groups=[(77, 0), (78, 4)]), [J, 77, 78], 4, True),  # one of them grants
    (full(group=4, other=4, mask=0), [J, G], 4, False),  # the owning group, masked out
    (full(user=0, other=7), [U], 4, False),  # the owner's entry, whatever others get
])
def test_an_acl_is_read_as_the_kernel_reads_it(entries, gids, want, allowed):
    uid = U if gids == [U] else J
    assert A.acl_permits(entries, U, G, uid, gids, want) is allowed


def test_the_owner_and_an_inode_without_group_bits_are_judged_by_the_mode_bits():
    entries = full(user=0, group=4, other=4, named_users=[(J, 4)])
    owned = os.stat_result((0o100604, 0, 0, 1, J, G, 0, 0, 0, 0))
    assert A.permits(owned, entries, J, [J], read=True)  # the owner's mode bits say r, whatever the ACL
    masked = os.stat_result((0o100600, 0, 0, 1, U, G, 0, 0, 0, 0))
    assert not A.permits(masked, entries, J, [J], read=True)  # no group bits: the ACL is not looked at
    grouped = os.stat_result((0o100640, 0, 0, 1, U, G, 0, 0, 0, 0))
    assert A.permits(grouped, entries, J, [J], read=True)


def test_a_malformed_acl_is_an_error():
    for data in (b"", struct.pack("<I", 3), acl((A.ACL_OTHER, 4, 0))[:-1]):
        with pytest.raises(ValueError, match="not a version 2 POSIX ACL"):
            A.parse_acl(data)


def _set_acl(path: Path, data: bytes) -> None:
    try:
        os.setxattr(path, A.ACL_XATTR, data)
    except OSError as exc:
        pytest.skip(f"{path.parent} keeps no POSIX ACLs ({exc.strerror})")


def test_an_fd_on_a_file_whose_acl_denies_its_user_what_others_may_is_found(jobuser, root_dir):
    # another user's file, readable by all by its mode bits, with a named entry shutting the job's
    # user out: the kernel refuses it, and so must the check
    private = root_dir / "private"
    private.write_text("not for jobuser\n")
    os.chmod(private, 0o644)
    _set_acl(private, acl((A.ACL_USER_OBJ, 6, 0), (A.ACL_USER, 0, jobuser.pw_uid), (A.ACL_GROUP_OBJ, 4, 0),
                          (A.ACL_MASK, 4, 0), (A.ACL_OTHER, 4, 0)))
    assert subprocess.run(["cat", str(private)], user=jobuser.pw_uid, group=jobuser.pw_gid, extra_groups=[],
                          capture_output=True).returncode != 0, "the kernel let the job's user read it"
    fd = os.open(private, os.O_RDONLY)
    problems = check_holding(jobuser, fd)
    assert [(p.what, p.path) for p in problems] == [(f"fd {fd}", str(private))]
    assert "may not read it (owner uid 0, gid 0, mode 644, by its ACL)" in problems[0].reason


def test_an_fd_on_a_file_an_acl_lets_its_user_read_passes(jobuser, root_dir):
    shared = root_dir / "shared"
    shared.write_text("for jobuser\n")
    os.chmod(shared, 0o600)
    _set_acl(shared, acl((A.ACL_USER_OBJ, 6, 0), (A.ACL_USER, 4, jobuser.pw_uid), (A.ACL_GROUP_OBJ, 0, 0),
                         (A.ACL_MASK, 4, 0), (A.ACL_OTHER, 0, 0)))
    fd = os.open(shared, os.O_RDONLY)
    assert check_holding(jobuser, fd) == []


def test_a_folder_whose_acl_denies_its_user_search_is_found(jobuser, root_dir):
    fenced = root_dir / "fenced"
    (fenced / "inner").mkdir(parents=True)
    os.chmod(fenced, 0o755)
    _set_acl(fenced, acl((A.ACL_USER_OBJ, 7, 0), (A.ACL_USER, 0, jobuser.pw_uid), (A.ACL_GROUP_OBJ, 5, 0),
                         (A.ACL_MASK, 5, 0), (A.ACL_OTHER, 5, 0)))
    fd = os.open(fenced / "inner", os.O_RDONLY | os.O_DIRECTORY)
    problems = check_holding(jobuser, fd)
    assert [(p.what, p.path) for p in problems] == [(f"fd {fd}", str(fenced / "inner"))]
    assert f"may not search the folder {fenced} above it (mode 755, by its ACL)" in problems[0].reason


# --- fsnotify marks --------------------------------------------------------------------------------------


def _inotify_watching(*paths: Path) -> int:
    """An inotify descriptor of root's watching `paths`, as CRIU re-creates one at a restore."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_CLOEXEC)
    assert fd >= 0, os.strerror(ctypes.get_errno())
    for path in paths:
        assert libc.inotify_add_watch(fd, str(path).encode(), 0x100 | 0x200) >= 0, path  # create, delete
    return fd


def test_watches_are_read_from_fdinfo():
    fdinfo = ("pos:\t0\nflags:\t02000000\nmnt_id:\t15\nino:\t1057\n"
              "inotify wd:1 ino:2a sdev:800001 mask:300 ignored_mask:0 fhandle-bytes:8 fhandle-type:1 "
              "f_handle:2a000000a1b2c3d4\n")
    (watch,) = restorecheck.parse_marks(fdinfo)
    assert (watch.ino, watch.dev, watch.handle_type, watch.handle) == (
        0x2A, (8, 1), 1, bytes.fromhex("2a000000a1b2c3d4"))
    with pytest.raises(ValueError, match="unreadable watch"):
        restorecheck.parse_marks("inotify wd:1 ino:2a sdev:800001 mask:300\n")
    with pytest.raises(ValueError, match="its handle is not fhandle-bytes long"):
        restorecheck.parse_marks("inotify wd:1 ino:2a sdev:800001 fhandle-bytes:8 fhandle-type:1 "
                                 "f_handle:2a\n")


def test_a_fanotify_descriptor_is_found(jobuser):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.fanotify_init(0, os.O_RDONLY)  # as root, as CRIU makes the group again
    assert fd >= 0, os.strerror(ctypes.get_errno())
    problems = check_holding(jobuser, fd)
    assert [(p.what, p.reason) for p in problems] == [
        (f"fd {fd}", "it is a fanotify descriptor, which root would make again with root's view of the "
                     "system")]


def test_a_watch_on_a_folder_its_user_may_not_read_is_found(jobuser, root_dir):
    # the job watched a folder of its own; before the restore it became a symlink to another
    # user's private folder, and root's CRIU followed it
    private = root_dir / "victim"
    private.mkdir(mode=0o700)
    (private / "inner").mkdir(mode=0o755)
    fd = _inotify_watching(private, private / "inner")
    problems = check_holding(jobuser, fd)
    found = {p.path: (p.what, p.reason) for p in problems}  # the kernel lists the newest mark first
    assert sorted(found) == [str(private), str(private / "inner")] and len(problems) == 2
    assert found[str(private)][0] == f"fd {fd} (a watch)"
    assert "may not read it (owner uid 0, gid 0, mode 700)" in found[str(private)][1]
    assert f"may not search the folder {private} above it" in found[str(private / "inner")][1]


def test_a_watch_on_what_its_user_may_read_passes(jobuser, root_dir):
    public = root_dir / "public"
    public.mkdir(mode=0o755)
    (public / "file").write_text("x")
    fd = _inotify_watching(public, public / "file")
    assert check_holding(jobuser, fd) == []


# --- the images ---------------------------------------------------------------------------------------


def _reg(id_: int, name: str) -> dict:
    return {"type": "REG", "id": id_, "reg": {"id": id_, "name": name, "flags": 0}}


def test_host_mounts_a_restore_would_bind_from_a_folder_someone_but_root_could_change_are_risks():
    """Checked on the restoring node, whose folders may not be the dumping node's: a recorded
    source under /tmp, or whose folder became a symlink there, is refused; root's folders pass."""
    folder, link = stat.S_IFDIR, stat.S_IFLNK
    host = {"/": (folder | 0o755, 0), "/dev": (folder | 0o755, 0), "/dev/shm": (folder | 0o1777, 0),
            "/srv": (folder | 0o755, 0), "/srv/data": (folder | 0o755, 0),
            "/tmp": (folder | 0o1777, 0), "/scratch": (link | 0o777, 0), "/home": (folder | 0o755, 0),
            "/home/alice": (folder | 0o755, 1001)}

    def lstat(path: str) -> os.stat_result:
        if path not in host:
            raise FileNotFoundError(path)
        mode, uid = host[path]
        return os.stat_result((mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))

    auto = restorecheck.AUTODETECTED
    mounts = [{"ext_key": auto, "source": path} for path in (
        "/srv/data/mnt/", "/dev/shm/", "/tmp/mnt", "/scratch/mnt", "/home/alice/fuse", "relative/mnt",
        "/gone/mnt")] + [{"ext_key": None, "source": "/dev/vda"}, {"ext_key": "ext0", "source": "/tmp/x"}]

    assert restorecheck.mount_risks(mounts, lstat) == [
        f"a host mount bound from {path}, in a folder someone but root could change"
        for path in ("/tmp/mnt", "/scratch/mnt", "/home/alice/fuse", "relative/mnt", "/gone/mnt")]


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
