"""Memory shared between the proxies of one host: a peer's member regions, read and written in place.

The proxies of a job that run on one host (the devices of one node) need not send each other their
ranks' data over the mesh: a proxy can attach the shared-memory regions its peers hand their workers
and reduce straight from them (`collectives.allreduce_shared`). A peer tells where a region is as a
`RegionRef`: its pid and the number of the descriptor it keeps open on the region's memfd, with the
inode and size, so the region is opened again through /proc/PID/fd/FD, which only root may do, and
checked to be that very memfd before it is mapped.

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


def attach(ref: RegionRef) -> mmap.mmap:
    """Map a peer's region read-write, once it is shown to be the memfd the peer named."""
    path = f"/proc/{ref.pid}/fd/{ref.fd}"
    target = os.readlink(path)
    if not target.startswith(f"/memfd:{MEMFD_NAME}"):
        raise ValueError(f"{path} is {target}, not a proxy's shared region")
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_ino != ref.ino or info.st_size != ref.size:
            raise ValueError(f"{path} is not the region the peer announced (inode {info.st_ino}, "
                             f"{info.st_size} bytes; announced inode {ref.ino}, {ref.size} bytes)")
        return mmap.mmap(fd, ref.size)
    finally:
        os.close(fd)


class PeerRegions:
    """The regions of peer proxies' members this proxy has attached, one per (peer, member): a
    member's newer region replaces its older one."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.maps: dict[tuple[str, int], tuple[RegionRef, mmap.mmap]] = {}

    def array(self, peer: str, member: int, ref: RegionRef, dtype: np.dtype, count: int) -> np.ndarray:
        """The first `count` elements of `dtype` of the region."""
        if count * dtype.itemsize > ref.size:
            raise ValueError(f"proxy {peer}'s region for rank {member} holds {ref.size} bytes, "
                             f"not {count} elements of {dtype}")
        with self.lock:
            held = self.maps.get((peer, member))
            if held is None or held[0] != ref:
                if held is not None:
                    _unmap(held[1])
                held = self.maps[(peer, member)] = (ref, attach(ref))
        return np.frombuffer(held[1], dtype=dtype, count=count)

    def close(self) -> None:
        with self.lock:
            for _ref, region in self.maps.values():
                _unmap(region)
            self.maps.clear()


def _unmap(region: mmap.mmap) -> None:
    try:
        region.close()
    except BufferError:
        pass  # an array still views it: the mapping goes with the array
