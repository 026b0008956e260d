"""Restored trees get device numbers their processes have not seen before.

A restored tree's tmpfs mounts (its private /dev/shm above all) are new superblocks, and the kernel
gives each the lowest free anonymous device number (major 0). The files criu recreates on them get
inode numbers in the order criu recreates them, the same order at every restore. So the second
restore of a tree that was dumped soon after its first one recreates its shared-memory files with
exactly the (st_ino, st_dev) they had in the first: the previous tmpfs is gone by then and its device
number is the lowest free one again.

Programs keep such identities in memory. PyTorch's DataLoader passes every batch from its workers as
a /dev/shm file descriptor and looks the storage up by `(st_ino, st_dev)` of that descriptor in a
cache of the storages it already maps (`torch.multiprocessing.reductions.rebuild_storage_fd`): a
batch whose file takes the identity of a batch the process still holds is silently replaced by that
older batch, and training goes on from a different state. Found by a checkpoint taken right after a
restore: its next restore computed the following step on the previous step's inputs.

So before criu restores a tree, `reserved` takes every free anonymous device number that the
checkpoint's mounts had, or that earlier incarnations of the tree had (the checkpoint's `anon_devs`
history), by creating empty tmpfs superblocks through the mount API (fsopen, fsconfig, fsmount; never
attached anywhere, so nothing is visible on the node), and holds them until the restore is done. The
new mounts then get numbers none of the tree's processes ever saw.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("singularity.anondev")

# Syscall numbers of the mount API: the same on every architecture (the unified table, Linux 5.2).
SYS_FSOPEN, SYS_FSCONFIG, SYS_FSMOUNT = 430, 431, 432
FSOPEN_CLOEXEC = 0x1
FSCONFIG_CMD_CREATE = 6
FSMOUNT_CLOEXEC = 0x1
KERNEL_MINOR_BITS = 20  # criu records devices as the kernel encodes them: major << 20 | minor

MAX_HELD = 4096
"""At most this many placeholder superblocks (each holds a descriptor) for one restore."""
HISTORY = 256
"""Device numbers of earlier incarnations a checkpoint remembers (newest last)."""
LOCK_NAME = "anondev.lock"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class Unavailable(OSError):
    """This kernel or this process cannot create superblocks through the mount API."""


def _syscall(number: int, *args) -> int:
    result = _libc.syscall(number, *args)
    if result < 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    return result


def placeholder() -> tuple[int, int]:
    """A new, unattached tmpfs superblock: (descriptor that holds it, its device number)."""
    try:
        context = _syscall(SYS_FSOPEN, b"tmpfs", FSOPEN_CLOEXEC)
    except OSError as exc:
        raise Unavailable(exc.errno, f"fsopen(tmpfs): {exc.strerror}") from exc
    try:
        _syscall(SYS_FSCONFIG, context, FSCONFIG_CMD_CREATE, None, None, 0)
        mount = _syscall(SYS_FSMOUNT, context, FSMOUNT_CLOEXEC, 0)
    finally:
        os.close(context)
    try:
        return mount, os.fstat(mount).st_dev
    except OSError:
        os.close(mount)
        raise


def from_kernel(encoded: int) -> int:
    """A device number as criu's images hold it, as `stat` gives it."""
    return os.makedev(encoded >> KERNEL_MINOR_BITS, encoded & ((1 << KERNEL_MINOR_BITS) - 1))


def anonymous(devices: Iterable[int]) -> set[int]:
    return {d for d in devices if isinstance(d, int) and not isinstance(d, bool) and d > 0
            and os.major(d) == 0}


def checkpoint_devices(images_dir: Path) -> set[int]:
    """The anonymous device numbers of every mount of the dumped tree's namespaces.

    An image that cannot be read adds nothing (logged): criu itself judges the images, and a
    checkpoint must not fail for want of this.
    """
    import pycriu

    devices: set[int] = set()
    for image in sorted(images_dir.glob("mountpoints-*.img")):
        try:
            with open(image, "rb") as handle:
                entries = pycriu.images.load(handle)["entries"]
            devices.update(from_kernel(e["root_dev"]) for e in entries
                           if isinstance(e, dict) and isinstance(e.get("root_dev"), int))
        except Exception as exc:  # pycriu raises whatever its parser meets
            log.warning("%s: cannot read its mounts' device numbers: %s", image, exc)
    return anonymous(devices)


def history(earlier: object, current: Iterable[int]) -> list[int]:
    """What a checkpoint records: the device numbers of earlier incarnations (a checkpoint's
    `anon_devs`, anything else is ignored) and then the current ones, newest last, at most HISTORY."""
    now = anonymous(current)
    before = [d for d in earlier if anonymous([d]) and d not in now] if isinstance(earlier, list) else []
    return (list(dict.fromkeys(before)) + sorted(now))[-HISTORY:]


@contextmanager
def reserved(devices: Iterable[int], lock_file: Path | None = None) -> Iterator[set[int]]:
    """While the body runs, the free ones of `devices` (anonymous numbers) belong to this process.

    Device numbers are handed out lowest free first, so every free number up to the highest wanted
    one is taken, the wanted ones are kept and the others given back. Yields the numbers held. A
    kernel without the mount API, or a process not allowed to use it, holds nothing (logged): the
    restore goes on as it would have without this.
    `lock_file` serialises the taking between agents of one node, so that one agent's numbers
    given back are never another's wanted ones still to be taken.
    """
    wanted = anonymous(devices)
    held: dict[int, int] = {}
    if not wanted:
        yield set()
        return
    top = max(os.minor(d) for d in wanted)
    lock = None
    if lock_file is not None:
        try:
            lock = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:  # taken without the lock: a race with another agent, not a failure
            log.warning("anonymous device numbers: cannot open %s: %s", lock_file, exc)
    try:
        spare: list[int] = []
        try:
            if lock is not None:
                fcntl.flock(lock, fcntl.LOCK_EX)
            while len(held) + len(spare) < MAX_HELD:
                fd, dev = placeholder()
                if dev in wanted:
                    held[dev] = fd
                else:
                    spare.append(fd)
                if os.minor(dev) >= top:
                    break
            else:
                log.warning("anonymous device numbers: stopped after %d placeholders; numbers above "
                            "minor %d stay free", MAX_HELD, max(os.minor(d) for d in held) if held else 0)
        except Unavailable as exc:
            log.warning("cannot hold anonymous device numbers (%s): a restored tree may get the "
                        "numbers of its earlier mounts", exc)
        except OSError as exc:
            log.warning("anonymous device numbers: holding %d, stopped taking more: %s", len(held), exc)
        finally:
            for fd in spare:
                os.close(fd)
            if lock is not None:
                os.close(lock)
                lock = None
        yield set(held)
    finally:
        for fd in held.values():
            os.close(fd)
        if lock is not None:
            os.close(lock)
