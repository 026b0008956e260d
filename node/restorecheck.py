"""What a restored process tree holds must be what its user could have opened.

CRIU restores as root and reopens every file, mapping and working folder of the image by its path.
A job can aim that at files its user may not open: it keeps an fd on a file of its own, and before
the restore swaps the path (or a folder on it) for a symlink to /etc/shadow. Checking the image
before the restore leaves a gap between check and use; so `check_tree` runs at CRIU's post-restore
notification, when every task is restored but still root's (its credentials come back later), so
the job's user can neither run, signal, trace nor take descriptors from it, and looks at what each
task actually got:
the inode behind every fd (/proc/PID/task/TID/fd/N, which stat follows to the inode itself), every
file mapping (/proc/PID/map_files), the working and root folders. For each, the job's user needs the
access the fd's flags or the mapping ask for, and search access to every folder above its real
path, decided as the kernel decides: by the inode's POSIX access ACL where it has one (named users
and groups, the mask), else by its mode bits. If anything fails, CRIU aborts the restore and kills
the tree; otherwise it continues.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from singularity_slurm.checkpoint.criu import in_user_folder

O_ACCMODE = 0o3
O_PATH = 0o10000000
_NO_PATH_PREFIXES = ("/memfd:", "/SYSV", "/dev/zero (deleted)")
"""Names of inodes that no path leads to (memfd, SysV and anonymous shared memory): the user cannot
aim them at anything, and CRIU creates them as root."""


@dataclass(frozen=True)
class Problem:
    pid: int
    what: str  # "fd 3", "mapping 7f..-7f..", "cwd", "root"
    path: str
    reason: str

    def __str__(self) -> str:
        return f"pid {self.pid} {self.what} on {self.path}: {self.reason}"


def may_access(st_mode: int, st_uid: int, st_gid: int, uid: int, gids: Iterable[int],
               read: bool = False, write: bool = False, execute: bool = False) -> bool:
    """Whether `uid` (with groups `gids`) may read/write/execute an inode, by its mode bits.

    One class of bits applies, as in the kernel: the owner's if the user owns it, else the
    group's if one of the user's groups owns it, else the others'. Root may do anything.
    """
    if uid == 0:
        return True
    if st_uid == uid:
        shift = 6
    elif st_gid in set(gids):
        shift = 3
    else:
        shift = 0
    bits = (st_mode >> shift) & 0o7
    return (not read or bool(bits & 4)) and (not write or bool(bits & 2)) and (not execute or bool(bits & 1))


ACL_XATTR = "system.posix_acl_access"
ACL_VERSION = 2
ACL_USER_OBJ, ACL_USER, ACL_GROUP_OBJ, ACL_GROUP, ACL_MASK, ACL_OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20


def parse_acl(data: bytes) -> list[tuple[int, int, int]]:
    """(tag, permission bits, id) of each entry of a `system.posix_acl_access` value; ValueError
    for anything else."""
    if len(data) < 4 or (len(data) - 4) % 8 or struct.unpack_from("<I", data)[0] != ACL_VERSION:
        raise ValueError(f"not a version {ACL_VERSION} POSIX ACL ({len(data)} bytes)")
    return [struct.unpack_from("<HHI", data, at) for at in range(4, len(data), 8)]


def acl_permits(entries: Iterable[tuple[int, int, int]], st_uid: int, st_gid: int, uid: int,
                gids: Iterable[int], want: int) -> bool:
    """Whether `uid` (with groups `gids`) gets the permission bits `want` (4 read, 2 write, 1
    search) from an inode's access ACL, in the kernel's order: the owner's entry, else a named
    user's (within the mask), else the first of the owning and named groups' entries that grants
    it (within the mask), and no other where any of the user's groups has an entry; else others'."""
    if uid == 0:
        return True
    entries = list(entries)
    mask = next((perm for tag, perm, _ in entries if tag == ACL_MASK), 0o7)
    groups = set(gids)
    for tag, perm, who in entries:
        if tag == ACL_USER_OBJ and st_uid == uid:
            return perm & want == want
        if tag == ACL_USER and who == uid:
            return perm & mask & want == want
    in_a_group = False
    for tag, perm, who in entries:
        if (tag == ACL_GROUP_OBJ and st_gid in groups) or (tag == ACL_GROUP and who in groups):
            in_a_group = True
            if perm & want == want:
                return perm & mask & want == want
    if in_a_group:
        return False
    return any(tag == ACL_OTHER and perm & want == want for tag, perm, _ in entries)


def access_acl(path: str, follow: bool = True) -> list[tuple[int, int, int]] | None:
    """The access ACL of the inode at `path` (None: it has none, or its file system keeps none);
    OSError or ValueError where it cannot be read."""
    try:
        return parse_acl(os.getxattr(path, ACL_XATTR, follow_symlinks=follow))
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP):
            return None
        raise


def permits(st: os.stat_result, acl: list[tuple[int, int, int]] | None, uid: int, gids: Iterable[int],
            read: bool = False, write: bool = False, execute: bool = False) -> bool:
    """Whether `uid` may read/write/execute the inode `st`, as the kernel's permission check decides:
    its owner by the owner's mode bits, anyone else by its ACL where it has one and its group mode
    bits (the ACL's mask) are not all clear, else by the mode bits."""
    if acl is None or st.st_uid == uid or not st.st_mode & 0o070:
        return may_access(st.st_mode, st.st_uid, st.st_gid, uid, gids, read, write, execute)
    return acl_permits(acl, st.st_uid, st.st_gid, uid, gids, 4 * read | 2 * write | execute)


def fdinfo_flags(text: str) -> int:
    """The `flags:` field (octal) of a /proc/PID/fdinfo/N file."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return int(value.strip(), 8)
    raise ValueError("no flags: line in fdinfo")


INOTIFY, FANOTIFY = "anon_inode:inotify", "anon_inode:[fanotify]"


@dataclass(frozen=True)
class Mark:
    """One watch of an inotify descriptor, as its fdinfo shows it: the watched inode's (sdev, ino)
    and its file handle."""

    sdev: int
    ino: int
    handle_type: int
    handle: bytes

    @property
    def dev(self) -> tuple[int, int]:
        """(major, minor) of the kernel's s_dev (12 bits of major, 20 of minor)."""
        return self.sdev >> 20, self.sdev & 0xFFFFF


def parse_marks(fdinfo: str) -> list[Mark]:
    """The watches in the fdinfo of an inotify descriptor; ValueError for a watch line that cannot
    be read (so that nothing unread is let through)."""
    marks = []
    for line in fdinfo.splitlines():
        head, _, rest = line.partition(" ")
        if head != "inotify":
            continue
        fields = dict(part.split(":", 1) for part in rest.split() if ":" in part)
        try:
            size = int(fields["fhandle-bytes"], 16)
            handle = bytes.fromhex(fields["f_handle"])
            marks.append(Mark(int(fields["sdev"], 16), int(fields["ino"], 16),
                              int(fields["fhandle-type"], 16), handle))
        except (KeyError, ValueError) as exc:
            raise ValueError(f"unreadable watch {line!r}") from exc
        if len(handle) != size:
            raise ValueError(f"watch {line!r}: its handle is not fhandle-bytes long")
    return marks


def mount_points(mountinfo: str) -> dict[tuple[int, int], str]:
    """(major, minor) -> a mount point of that file system, from a /proc/PID/mountinfo."""
    points: dict[tuple[int, int], str] = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 4 and ":" in fields[2]:
            major, minor = fields[2].split(":")
            point = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n")
            points.setdefault((int(major), int(minor)), point.replace("\\134", "\\"))
    return points


def open_by_handle(mount_fd: int, handle_type: int, handle: bytes) -> int:
    """An O_PATH descriptor of the inode a file handle names (root only: CAP_DAC_READ_SEARCH)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    buffer = ctypes.create_string_buffer(struct.pack("Ii", len(handle), handle_type) + handle)
    fd = libc.open_by_handle_at(mount_fd, buffer, O_PATH | os.O_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return fd


PROC_SUPER_MAGIC, PROC_ROOT_INO = 0x9FA0, 1


def fs_type(path: str) -> int:
    """The file system type (statfs's f_type) of the inode at `path`; 0 where it cannot be told."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    buffer = ctypes.create_string_buffer(256)  # struct statfs: f_type is its first word
    if libc.statfs(path.encode(), buffer) != 0:
        return 0
    return ctypes.c_long.from_buffer(buffer).value


def access_for_flags(flags: int) -> tuple[bool, bool]:
    """(read, write) an fd with these open flags needs; an O_PATH fd needs neither."""
    if flags & O_PATH:
        return False, False
    mode = flags & O_ACCMODE
    return mode in (os.O_RDONLY, os.O_RDWR), mode in (os.O_WRONLY, os.O_RDWR)


@dataclass(frozen=True)
class Mapping:
    start: str
    end: str
    perms: str  # e.g. "rw-s"
    inode: int
    path: str

    @property
    def range(self) -> str:
        """As /proc/PID/map_files names it: hex without leading zeros."""
        return f"{int(self.start, 16):x}-{int(self.end, 16):x}"

    def needs(self) -> tuple[bool, bool]:
        """(read, write) its file needs: mmap always reads; a shared writable mapping writes."""
        return True, "w" in self.perms and self.perms.endswith("s")


def parse_maps(text: str) -> list[Mapping]:
    """File-backed mappings of a /proc/PID/maps text (inode set, absolute path)."""
    found = []
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        addresses, perms, _offset, _dev, inode, path = fields
        start, _, end = addresses.partition("-")
        if int(inode) == 0 or not path.startswith("/"):
            continue
        found.append(Mapping(start, end, perms, int(inode), path))
    return found


def no_path(name: str) -> bool:
    """A name for an inode without a path (see _NO_PATH_PREFIXES), or not a path at all."""
    return not name.startswith("/") or name.startswith(_NO_PATH_PREFIXES)


# --- the live tree ----------------------------------------------------------------------------------


def tree_pids(init_pid: int) -> list[int]:
    """The processes of the tree under `init_pid`, init first (from every thread's children list)."""
    seen: list[int] = []
    todo = [init_pid]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.append(pid)
        for tid in _tasks(pid):
            try:
                todo.extend(int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
            except OSError:
                pass
    return seen


def _tasks(pid: int) -> list[str]:
    try:
        return sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except OSError:
        return []


def _at(pid: int, name: str, st: os.stat_result) -> bool:
    """Whether `name` in the task's mounts is the inode `st` (a plain look, no symlink followed last)."""
    try:
        there = os.stat(f"/proc/{pid}/root{name}", follow_symlinks=False)
    except OSError:
        return False
    return (there.st_dev, there.st_ino) == (st.st_dev, st.st_ino)


class _Checker:
    def __init__(self, uid: int, gids: Iterable[int], ignore: Iterable[tuple[int, int]] = ()):
        self.uid = uid
        self.gids = set(gids)
        self.ignore = set(ignore)  # (st_dev, st_ino) of criu's own files, open in tasks it restores
        self.problems: list[Problem] = []

    def refuse(self, pid: int, what: str, path: str, reason: str) -> None:
        self.problems.append(Problem(pid, what, path, reason))

    def inode(self, pid: int, what: str, magic: str, name: str, read: bool, write: bool,
              execute: bool = False) -> None:
        """Check the inode behind a /proc magic link and the folders above its real path."""
        try:
            st = os.stat(magic)
        except OSError as exc:
            self.refuse(pid, what, name, f"cannot be examined ({exc.strerror})")
            return
        if (st.st_dev, st.st_ino) in self.ignore:
            return
        try:
            acl = access_acl(magic)
        except (OSError, ValueError) as exc:
            self.refuse(pid, what, name, f"its ACL cannot be read ({exc})")
            return
        if not permits(st, acl, self.uid, self.gids, read, write, execute):
            want = "/".join(w for w, on in (("read", read), ("write", write), ("search", execute)) if on)
            self.refuse(pid, what, name, f"the job's user (uid {self.uid}) may not {want} it (owner uid "
                                         f"{st.st_uid}, gid {st.st_gid}, mode {stat.S_IMODE(st.st_mode):o}"
                                         f"{', by its ACL' if acl is not None else ''})")
            return
        if st.st_nlink == 0 or (name.endswith(" (deleted)") and not _at(pid, name, st)):
            # deleted (CRIU's restored ghost files still have a link of its own): no path leads to
            # it; a live file that is named "x (deleted)" is found at that name and checked
            return
        if st.st_ino == PROC_ROOT_INO and fs_type(magic) == PROC_SUPER_MAGIC:
            # the root of a proc file system: CRIU keeps one of its own (not the task's /proc) open
            # in every task it restores, and any user may open /proc
            return
        found = self.lookup(pid, what, name, search=True)
        if found is None:
            return
        try:
            end = os.fstat(found)
        finally:
            os.close(found)
        if (end.st_dev, end.st_ino) != (st.st_dev, st.st_ino):
            self.refuse(pid, what, name, "its path in the task's mounts leads to another inode (swapped "
                                         "for a symlink or another file?)")

    def lookup(self, pid: int, what: str, name: str, search: bool) -> int | None:
        """An O_PATH descriptor of `name` in the task's mounts, looked up a name at a time from the
        folder before it by descriptor, never through a symlink; with `search`, every folder on the
        way must be one the job's user may search, judged on the folder actually walked through (a
        rename meanwhile cannot pair one folder's check with another's contents). None once refused."""
        parts = [part for part in name.split("/") if part]
        try:
            fd = os.open(f"/proc/{pid}/root", O_PATH | os.O_CLOEXEC)
        except OSError as exc:
            self.refuse(pid, what, name, f"the task's root cannot be opened ({exc.strerror})")
            return None
        folder = "/"
        try:
            for at, part in enumerate(parts):
                fst = os.fstat(fd)
                if not stat.S_ISDIR(fst.st_mode):
                    self.refuse(pid, what, name, f"{folder} above it is not a folder (swapped for a "
                                                 "symlink?)")
                    return None
                if search:
                    try:
                        acl = access_acl(f"/proc/self/fd/{fd}")
                    except (OSError, ValueError) as exc:
                        self.refuse(pid, what, name, f"the ACL of folder {folder} above it cannot be read "
                                                     f"({exc})")
                        return None
                    if not permits(fst, acl, self.uid, self.gids, execute=True):
                        self.refuse(pid, what, name, f"the job's user (uid {self.uid}) may not search the "
                                                     f"folder {folder} above it (mode "
                                                     f"{stat.S_IMODE(fst.st_mode):o}"
                                                     f"{', by its ACL' if acl is not None else ''})")
                        return None
                try:
                    step = os.open(part, O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except OSError as exc:
                    self.refuse(pid, what, name, f"{part} in folder {folder} above it cannot be looked up "
                                                 f"({exc.strerror})")
                    return None
                os.close(fd)
                fd, folder = step, "/" + "/".join(parts[:at + 1])
            found, fd = fd, -1
            return found
        finally:
            if fd >= 0:
                os.close(fd)

    def task(self, pid: int, tid: str) -> None:
        base = f"/proc/{pid}/task/{tid}"
        for what in ("cwd", "root"):
            try:
                name = os.readlink(f"{base}/{what}")
            except OSError as exc:
                self.refuse(pid, what, "?", f"cannot be read ({exc.strerror})")
                continue
            self.inode(pid, what, f"{base}/{what}", name, read=False, write=False, execute=True)
        try:
            fds = os.listdir(f"{base}/fd")
        except OSError as exc:
            self.refuse(pid, "fds", base, f"cannot be listed ({exc.strerror})")
            return
        for fd in fds:
            magic = f"{base}/fd/{fd}"
            try:
                name = os.readlink(magic)
                fdinfo = Path(f"{base}/fdinfo/{fd}").read_text()
                flags = fdinfo_flags(fdinfo)
            except (OSError, ValueError) as exc:
                self.refuse(pid, f"fd {fd}", "?", f"cannot be examined ({exc})")
                continue
            if name == FANOTIFY:
                # CRIU makes the group again as root: it would report other users' processes and
                # files that a group the job's user made is never told of
                self.refuse(pid, f"fd {fd}", "?", "it is a fanotify descriptor, which root would make "
                                                  "again with root's view of the system")
                continue
            if name == INOTIFY:
                self.marks(pid, f"fd {fd}", fdinfo)
                continue
            if no_path(name):
                continue  # pipes, sockets, anonymous inodes, memfds
            read, write = access_for_flags(flags)
            self.inode(pid, f"fd {fd}", magic, name, read, write)

    def marks(self, pid: int, what: str, fdinfo: str) -> None:
        """Each inode an inotify descriptor watches must be one the job's user may read, under
        folders it may search, as inotify_add_watch asks: CRIU re-adds a watch by the path it
        recorded, as root, following whatever symlink the user put there since."""
        try:
            marks = parse_marks(fdinfo)
        except ValueError as exc:
            self.refuse(pid, what, "?", f"its inotify watches cannot be read ({exc})")
            return
        points: dict[tuple[int, int], str] | None = None
        for mark in marks:
            if points is None:
                try:
                    points = mount_points(Path(f"/proc/{pid}/mountinfo").read_text())
                except OSError as exc:
                    self.refuse(pid, what, "?", f"the task's mounts cannot be read ({exc.strerror})")
                    return
            label = f"inode {mark.ino} of device {mark.dev[0]}:{mark.dev[1]}"
            point = points.get(mark.dev)
            if point is None:
                self.refuse(pid, what, label, "it watches a file system the task has not mounted")
                continue
            point_fd = self.lookup(pid, what, point, search=False)
            if point_fd is None:
                continue
            try:
                # open_by_handle_at takes no O_PATH descriptor: the folder reopened for reading
                mount_fd = os.open(f"/proc/self/fd/{point_fd}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    watched = open_by_handle(mount_fd, mark.handle_type, mark.handle)
                finally:
                    os.close(mount_fd)
            except OSError as exc:
                self.refuse(pid, what, label, f"the watched inode cannot be opened ({exc.strerror})")
                continue
            finally:
                os.close(point_fd)
            try:
                magic = f"/proc/self/fd/{watched}"
                st, name = os.stat(magic), os.readlink(magic)
                if (st.st_ino, os.major(st.st_dev), os.minor(st.st_dev)) != (mark.ino, *mark.dev):
                    self.refuse(pid, what, label, "its file handle names another inode")
                    continue
                if st.st_nlink == 0:
                    self.refuse(pid, what, name, "it watches a deleted inode")
                    continue
                self.inode(pid, f"{what} (a watch)", magic, name, read=True, write=False)
            except OSError as exc:
                self.refuse(pid, what, label, f"the watched inode cannot be examined ({exc.strerror})")
            finally:
                os.close(watched)

    def maps(self, pid: int) -> None:
        try:
            mappings = parse_maps(Path(f"/proc/{pid}/maps").read_text())
        except OSError as exc:
            self.refuse(pid, "maps", f"/proc/{pid}/maps", f"cannot be read ({exc.strerror})")
            return
        checked: set[tuple[str, bool]] = set()
        for mapping in mappings:
            if no_path(mapping.path):
                continue
            read, write = mapping.needs()
            if (mapping.path, write) in checked:
                continue
            checked.add((mapping.path, write))
            self.inode(pid, f"mapping {mapping.range}", f"/proc/{pid}/map_files/{mapping.range}",
                       mapping.path, read, write)


def check_tree(init_pid: int, uid: int, gids: Iterable[int],
               ignore: Iterable[tuple[int, int]] = ()) -> list[Problem]:
    """Everything in the tree under `init_pid` its user could not have opened (`ignore`: the
    (st_dev, st_ino) of files criu itself holds open in the tasks while it restores them)."""
    checker = _Checker(uid, gids, ignore)
    pids = tree_pids(init_pid)
    for pid in pids:
        for tid in _tasks(pid):
            checker.task(pid, tid)
        checker.maps(pid)
    return checker.problems


# --- the images, before CRIU touches anything -------------------------------------------------------

PRIVATE_PREFIXES = ("/dev/shm/",)
"""Where CRIU may re-create files by path: the tree's own /dev/shm, a tmpfs private to its mount
namespace, which no process outside the restored (and, while restoring, root's) tree can reach."""


def _text(name: object) -> str:
    """A name as pycriu decodes it (bytes with a trailing NUL come back as text ending in '=00')."""
    if isinstance(name, bytes):
        return name.split(b"\0", 1)[0].decode(errors="replace")
    text = str(name)
    return text[:-3] if text.endswith("=00") else text


def image_risks(files: Iterable[dict], remaps: Iterable[dict]) -> list[str]:
    """What in a checkpoint CRIU would create again as root at a path its user controls.

    A deleted file still open (a ghost) or one kept through a link-remap is created again by its
    path, then its owner and mode are set by that path; the job's user could swap a folder on the
    way for a symlink while the restore runs and have root chown, chmod or unlink any file
    (`files`: files.img entries, `remaps`: remap-fpath.img entries, as pycriu loads them). Paths
    under PRIVATE_PREFIXES are safe. Unix sockets bound to a path are bound again the same way, but
    every PyTorch DataLoader holds such sockets (multiprocessing's listeners in /tmp/pymp-*), so they
    cannot be refused: SECURITY.md lists them as a known gap.
    """
    entries = {entry.get("id"): entry for entry in files}
    risks = []
    for remap in remaps:
        if remap.get("remap_type") not in ("GHOST", "LINKED"):
            continue
        entry = entries.get(remap.get("orig_id"), {})
        name = _text(entry.get("reg", {}).get("name", "?"))
        if not name.startswith(PRIVATE_PREFIXES):
            risks.append(f"a deleted file still open at {name}")
    return risks


AUTODETECTED = "CRIU:AUTOGENERATED"
"""The key criu gives a host mount it detected as external (auto_ext_mnt); its source is the host
path it binds at restore."""


def mount_risks(mounts: Iterable[dict], lstat: Callable[[str], os.stat_result] = os.lstat) -> list[str]:
    """The host mounts a checkpoint would have root bind again from a path in a folder someone but
    root could change on this host (`mounts`: mountpoints image entries, as pycriu loads them).
    The dump leaves such mounts out (criu.user_folder_mounts), as that node's folders were; this
    node's may differ, and the user may have changed them since."""
    risks = []
    for mount in mounts:
        if mount.get("ext_key") == AUTODETECTED:
            source = _text(mount.get("source", ""))
            if not source.startswith("/") or in_user_folder(source, lstat):
                risks.append(f"a host mount bound from {source}, in a folder someone but root could change")
    return risks


def check_images(image_dir: Path) -> list[str]:
    """`image_risks` and `mount_risks` of the images in `image_dir` (read with pycriu)."""
    from pycriu import images

    def load(name: str) -> list[dict]:
        try:
            with open(image_dir / name, "rb") as handle:
                return list(images.load(handle)["entries"])
        except FileNotFoundError:
            return []

    mounts = [entry for path in sorted(image_dir.glob("mountpoints-*.img")) for entry in load(path.name)]
    return image_risks(load("files.img"), load("remap-fpath.img")) + mount_risks(mounts)
