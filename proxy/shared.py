"""Memory shared between the proxies of one host: a peer's member regions, read and written in place.

The proxies of a job that run on one host (the devices of one node) need not send each other their
ranks' data over the mesh: a proxy can attach the shared-memory regions its peers hand their workers
and reduce straight from them (`collectives.allreduce_shared`). A peer tells where a region is as a
`RegionRef`: its pid and the number of the descriptor it keeps open on the region's memfd, with the
inode and size, so the region is opened again through /proc/PID/fd/FD, which only root may do, and
checked to be that very memfd, named for this job, before it is mapped; the pid must be the one the
peer gave when it said which host it runs on. A region is sealed at its size (hal), so no holder
can shrink it under a proxy that maps it.

Which peers share this host is decided from a `host_identity` each proxy announces once per
generation: the kernel's boot id and the proxy's PID namespace (the /proc paths of one proxy mean the
same to the other only in the same namespace). A proxy whose admin turned shared memory off
(`proxy.shared_memory = false`) announces none, and its groups exchange over the mesh.
"""

from __future__ import annotations

import mmap
import os
import stat
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .hal import MEMFD_NAME


@dataclass(frozen=True)
class RegionRef:
    """Where a peer can attach one of this proxy's member regions."""

    pid: int
    fd: int
    ino: int
    size: int

    def record(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def of_record(cls, record: dict) -> RegionRef:
        return cls(int(record["pid"]), int(record["fd"]), int(record["ino"]), int(record["size"]))


def host_identity() -> str | None:
    """What two proxies must both have to attach each other's regions; None where it cannot tell."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    return f"{boot} {pidns}"


def region_name(job_id: int | str) -> str:
    """The name of a job's regions' memfds: a peer attaches only its own job's."""
    return f"{MEMFD_NAME}-job{job_id}"


def attach(ref: RegionRef, name: str) -> mmap.mmap:
    """Map a peer's region read-write, once it is shown to be the memfd `name` the peer announced."""
    path = f"/proc/{ref.pid}/fd/{ref.fd}"
    target = os.readlink(path)
    if target != f"/memfd:{name} (deleted)":
        raise ValueError(f"{path} is {target}, not a shared region of this job's proxies")
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_ino != ref.ino or info.st_size != ref.size:
            raise ValueError(f"{path} is not the region the peer announced (inode {info.st_ino}, "
                             f"{info.st_size} bytes; announced inode {ref.ino}, {ref.size} bytes)")
        return mmap.mmap(fd, ref.size)
    finally:
        os.close(fd)


class PeerRegions:
    """The regions of peer proxies' members this proxy has attached, by peer and region: the
    `per_peer` most recently used of each peer stay mapped (a peer's ranks' regions, and one they had
    before a larger `map`), so an operation maps nothing new in the steady state. The proxy lets go of
    all of them at a cut, after which every rank maps a new region."""

    def __init__(self, per_peer: int = 8) -> None:
        self.per_peer = per_peer
        self.lock = threading.Lock()
        self.maps: dict[str, OrderedDict[RegionRef, mmap.mmap]] = {}

    def array(self, peer: str, ref: RegionRef, name: str, dtype: np.dtype, count: int) -> np.ndarray:
        """The first `count` elements of `dtype` of the region."""
        if count * dtype.itemsize > ref.size:
            raise ValueError(f"proxy {peer}'s region holds {ref.size} bytes, not {count} elements of {dtype}")
        with self.lock:
            held = self.maps.setdefault(peer, OrderedDict())
            region = held.get(ref)
            if region is None:
                region = held[ref] = attach(ref, name)
                while len(held) > self.per_peer:
                    _unmap(held.popitem(last=False)[1])
            held.move_to_end(ref)
            return np.frombuffer(region, dtype=dtype, count=count)

    def close(self) -> None:
        with self.lock:
            for held in self.maps.values():
                for region in held.values():
                    _unmap(region)
            self.maps.clear()


def _unmap(region: mmap.mmap) -> None:
    try:
        region.close()
    except BufferError:
        pass  # an array still views it (an operation under way): the mapping goes with the array
