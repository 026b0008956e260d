"""The node-local spool: where a checkpoint's images lie between CRIU and the store, and back.

A dump writes the tree's pages there before they are stored, a restore the checkpoint's images
before CRIU reads them; each is removed as soon as the store (or CRIU) is done with it, and the
Epilog removes whatever a killed agent left. The spool (`paths.spool_dir`, default
/var/spool/singularity-slurm) is root's alone: no job's user can write there, so nothing in it is
theirs to swap. It must be a disk file system with room for the largest dump a node makes (the
memory of a job's trees on it), not the RAM-backed /run, where a large dump would take the memory
it checkpoints. Before a dump or restore writes, the spool's free space is compared with what it is
about to write; short of it, the checkpoint fails at once with the numbers and the fix, before the
tree is frozen.

Pure: `parse_rollup`, `dump_estimate`. I/O: `job_folder`, `work_folder`, `check_room`, `tree_bytes`.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

from singularity_slurm.errors import CheckpointError
from singularity_slurm.jobenv import valid_job_id, valid_node_name

HEADROOM = 64 << 20
"""Bytes the spool keeps free beyond a dump's estimate (CRIU's small images, the file system's own)."""


def job_path(spool_dir: Path, node: str, job_id: int) -> Path:
    """spool_dir/<node>/<job>: the job's image folders on one node (per node name: a dev cluster
    runs several on one host)."""
    return spool_dir / valid_node_name(node) / str(valid_job_id(job_id))


def node_folder(spool_dir: Path, node: str) -> Path:
    """spool_dir/<node>: the folder of one node's jobs (and its dump slots, see node.dumpgate)."""
    return spool_dir / valid_node_name(node)


def job_folder(spool_dir: Path, node: str, job_id: int) -> Path:
    """job_path, made root's and 0700 up from spool_dir, which must be a root-owned folder no one
    else may write (CheckpointError otherwise)."""
    return _root_folders(spool_dir, [node_folder(spool_dir, node), job_path(spool_dir, node, job_id)])


def slots_folder(spool_dir: Path, node: str) -> Path:
    """spool_dir/<node>/dump-slots (see node.dumpgate), made and checked as job_folder's are."""
    below = node_folder(spool_dir, node)
    return _root_folders(spool_dir, [below, below / "dump-slots"])


def _root_folders(spool_dir: Path, below: list[Path]) -> Path:
    """spool_dir and `below` (each inside the one before), made root's and 0700 where missing and
    checked as folders only root may write; the last of them."""
    spool_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder = below[-1]
    for path in (spool_dir, *below):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise CheckpointError(f"cannot make the spool folder {path}: {exc.strerror}; check "
                                  "paths.spool_dir") from exc
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
            link = ", a symlink" if stat.S_ISLNK(info.st_mode) else ""
            raise CheckpointError(
                f"the spool folder {path} is not a folder of root's that only root may write (owner uid "
                f"{info.st_uid}, mode {stat.S_IMODE(info.st_mode):o}{link}): make paths.spool_dir root's, "
                "mode 0700")
    return folder


def work_folder(spool_dir: Path, node: str, job_id: int, name: str) -> Path:
    """A fresh, empty image folder `name` of the job's in the spool."""
    folder = job_folder(spool_dir, node, job_id) / name
    os.mkdir(folder, 0o700)
    return folder


def free_bytes(folder: Path) -> int:
    info = os.statvfs(folder)
    return info.f_bavail * info.f_frsize


def check_room(folder: Path, need: int, what: str) -> None:
    """CheckpointError naming the numbers where the spool holding `folder` has less than `need`
    bytes (and HEADROOM) free."""
    free = free_bytes(folder)
    if free < need + HEADROOM:
        raise CheckpointError(
            f"the spool {folder.parent} has {free >> 20} MiB free, and {what} needs about {need >> 20} MiB "
            f"(and {HEADROOM >> 20} MiB to spare): free space there, or set paths.spool_dir to a file "
            "system with room for a job's memory")


def parse_rollup(text: str) -> dict[str, int]:
    """The sizes (bytes) in a /proc/PID/smaps_rollup."""
    sizes = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            sizes[key.strip()] = int(parts[0]) << 10
    return sizes


def dump_estimate(rollups: Iterable[Mapping[str, int]], share_cow: bool) -> int:
    """What a full dump of processes with these smaps_rollup sizes writes, at most: their anonymous
    pages, each process's in full (stock CRIU dumps a page forked processes share once per process)
    or their proportional shares (CRIU with --share-cow records such a page once), and their share
    of shared memory."""
    own = "Pss_Anon" if share_cow else "Anonymous"
    return sum(r.get(own, 0) + r.get("Pss_Shmem", 0) for r in rollups)


def tree_bytes(pids: Iterable[int], share_cow: bool) -> int:
    """dump_estimate of the live processes `pids` (those gone since are left out)."""
    rollups = []
    for pid in pids:
        try:
            rollups.append(parse_rollup(Path(f"/proc/{pid}/smaps_rollup").read_text()))
        except OSError:
            continue
    return dump_estimate(rollups, share_cow)
