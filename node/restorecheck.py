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
access the fd's flags or the mapping ask for, by the inode's mode bits, and search access to every
folder above its real path. If anything fails, CRIU aborts the restore and kills the tree;
otherwise it continues.

Only the owner/group/other mode bits are read: an ACL that grants more than the bits is not honoured
(the checkpoint is refused, never wrongly accepted).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

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


def fdinfo_flags(text: str) -> int:
    """The `flags:` field (octal) of a /proc/PID/fdinfo/N file."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return int(value.strip(), 8)
    raise ValueError("no flags: line in fdinfo")


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


def folders_above(path: str) -> list[str]:
    """'/a/b/c' -> ['/', '/a', '/a/b']."""
    parts = [p for p in path.split("/") if p]
    return ["/" + "/".join(parts[:i]) for i in range(len(parts))]


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
        if not may_access(st.st_mode, st.st_uid, st.st_gid, self.uid, self.gids, read, write, execute):
            want = "/".join(w for w, on in (("read", read), ("write", write), ("search", execute)) if on)
            self.refuse(pid, what, name, f"the job's user (uid {self.uid}) may not {want} it (owner uid "
                                         f"{st.st_uid}, gid {st.st_gid}, mode {stat.S_IMODE(st.st_mode):o})")
            return
        if name.endswith(" (deleted)"):
            return
        root = f"/proc/{pid}/root"
        for folder in folders_above(name):
            try:
                fst = os.lstat(root + folder)
            except OSError as exc:
                self.refuse(pid, what, name, f"folder {folder} above it cannot be examined ({exc.strerror})")
                return
            if not stat.S_ISDIR(fst.st_mode):
                self.refuse(pid, what, name, f"{folder} above it is not a folder (swapped for a symlink?)")
                return
            if not may_access(fst.st_mode, fst.st_uid, fst.st_gid, self.uid, self.gids, execute=True):
                self.refuse(pid, what, name, f"the job's user (uid {self.uid}) may not search the folder "
                                             f"{folder} above it (mode {stat.S_IMODE(fst.st_mode):o})")
                return

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
                flags = fdinfo_flags(Path(f"{base}/fdinfo/{fd}").read_text())
            except (OSError, ValueError) as exc:
                self.refuse(pid, f"fd {fd}", "?", f"cannot be examined ({exc})")
                continue
            if no_path(name):
                continue  # pipes, sockets, anonymous inodes, memfds
            read, write = access_for_flags(flags)
            self.inode(pid, f"fd {fd}", magic, name, read, write)

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


def check_images(image_dir: Path) -> list[str]:
    """`image_risks` of the images in `image_dir` (read with pycriu)."""
    from pycriu import images

    def load(name: str) -> list[dict]:
        try:
            with open(image_dir / name, "rb") as handle:
                return list(images.load(handle)["entries"])
        except FileNotFoundError:
            return []

    return image_risks(load("files.img"), load("remap-fpath.img"))
