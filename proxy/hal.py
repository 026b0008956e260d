"""The proxy's hardware abstraction layer: memory shared with workers, and reductions.

`DeviceBackend` is what a proxy needs from a device. `HostBackend` (CPU memory, numpy) serves CPU
device slots and GPUs NVML cannot see (the dev cluster's stand-ins). `StagedCudaBackend` serves a GPU:
its ranks' CUDA tensors come through host memory (the worker copies a tensor into the region shared
with its proxy and its result back, after the work its stream queued before the call), the reduction
runs on the host in rank order, and the GPU is exclusive, so the ranks that share it take turns. A
backend reducing in device memory (CUDA IPC handles, NCCL between proxies) would implement the same
interface. Reductions combine contributions in the order given, which the caller makes the
logical-rank order: results then do not depend on arrival order or placement.

numpy has no bfloat16: its arrays here are of `BFLOAT16`, a one-field record of the raw 16 bits, which
moves, slices and concatenates like any dtype but refuses arithmetic, so nothing adds its bits as
integers by mistake. Its reductions accumulate in float32, in the order given, and round once to
bfloat16 (to nearest, ties to even, as torch converts). float16 reduces in float16, step by step.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

BFLOAT16 = np.dtype([("bfloat16", "<u2")])
DTYPES = {**{name: np.dtype(name) for name in ("float32", "float64", "float16")}, "bfloat16": BFLOAT16,
          **{name: np.dtype(name) for name in ("int8", "int16", "int32", "int64", "uint8", "bool")}}
REDUCTIONS = ("sum", "avg", "product", "min", "max")
_UFUNCS = {"sum": np.add, "avg": np.add, "product": np.multiply, "min": np.minimum, "max": np.maximum}
MIN_REGION = 1 << 20
MEMFD_NAME = "singularity-proxy"  # the regions' memfds; peers check it before they attach one


class BackendError(Exception):
    """A request the device backend cannot serve (unknown dtype or reduction)."""


@dataclass
class Region:
    """Memory shared with one worker: `fd` is handed over once and kept open, so that the proxy's
    peers on this host can attach the region too (proxy.shared); `view` is the proxy's bytes."""

    fd: int
    size: int
    map: mmap.mmap
    ino: int = 0  # the memfd's inode: what a peer checks it attached

    @property
    def view(self) -> np.ndarray:
        return np.frombuffer(self.map, dtype=np.uint8)

    def array(self, dtype: str, count: int, offset: int = 0) -> np.ndarray:
        return np.frombuffer(self.map, dtype=dtype_of(dtype), count=count, offset=offset)

    def release(self) -> None:
        """Close it and free its pages, though the worker still holds the memfd: pages the proxy
        wrote there (results) would otherwise stay resident on the proxy's account, outside the
        job's cgroups, for as long as the worker keeps the descriptor. The worker has moved to a new
        region (or gone) by then; it reads zeros should it look at this one again."""
        if self.fd >= 0:
            try:
                punch_hole(self.fd, self.size)
            except OSError:
                pass  # a file system without hole punching: the pages go with the last descriptor
        self.close()

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with it
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class DeviceBackend(Protocol):
    name: str
    exclusive: bool  # its ranks must take turns when they share it (a GPU); CPU slots need not

    def region(self, nbytes: int, name: str = MEMFD_NAME) -> Region: ...

    def reduce(self, parts: Sequence[np.ndarray], op: str) -> np.ndarray: ...


def dtype_of(name: str) -> np.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise BackendError(f"dtype {name!r} not supported; supported: {', '.join(DTYPES)}") from None


FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def punch_hole(fd: int, size: int) -> None:
    """Free the pages of bytes 0..size of a memfd (the seals on its size allow that)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    if libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, size) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot free a shared region's pages: {os.strerror(err)}")


class HostBackend:
    """CPU memory and numpy arithmetic."""

    name = "host"
    exclusive = False

    def region(self, nbytes: int, name: str = MEMFD_NAME) -> Region:
        """A memfd of whole MiB, sealed at its size: whoever holds it (the worker) can neither shrink
        it under the proxies that map it (they would fault) nor grow it."""
        size = max(MIN_REGION, -(-nbytes // MIN_REGION) * MIN_REGION)
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            return Region(fd, size, mmap.mmap(fd, size), os.fstat(fd).st_ino)
        except OSError:
            os.close(fd)
            raise

    def reduce(self, parts: Sequence[np.ndarray], op: str) -> np.ndarray:
        """parts[0] op parts[1] op ..., left to right; `avg` divides the sum by len(parts)."""
        if op not in _UFUNCS:
            raise BackendError(f"reduction {op!r} not supported; supported: {', '.join(REDUCTIONS)}")
        if parts[0].dtype == BFLOAT16:
            return float32_to_bfloat16(self.reduce([bfloat16_to_float32(p) for p in parts], op))
        acc = np.array(parts[0], copy=True)
        ufunc = _UFUNCS[op]
        for part in parts[1:]:
            ufunc(acc, part, out=acc)
        if op == "avg":
            if acc.dtype.kind != "f":
                raise BackendError(f"avg needs a floating-point dtype, got {acc.dtype}")
            np.divide(acc, len(parts), out=acc)
        return acc


def bfloat16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 values (raw bits) as float32: exact, the bits are float32's upper half."""
    return (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def float32_to_bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 rounded to bfloat16 (to nearest, ties to even; NaN stays a quiet NaN of its sign)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    nan = np.isnan(values)
    rounded[nan] = (bits[nan] >> 16) | 0x0040
    return rounded.astype(np.uint16).view(BFLOAT16)


class StagedCudaBackend(HostBackend):
    """A GPU whose ranks' tensors are staged through host memory: the host's regions and
    reductions, and one rank computing on the device at a time."""

    name = "cuda"
    exclusive = True


BACKENDS = ("host", "cuda")


def backend(name: str) -> DeviceBackend:
    if name == "host":
        return HostBackend()
    if name == "cuda":
        return StagedCudaBackend()
    raise BackendError(f"device backend {name!r} not available here; available: {', '.join(BACKENDS)}")
