"""A rank's buffer in its GPU's memory, given by its proxy: mapped, copied into and out of, released.

The proxy allocates the buffer and sends a file descriptor for it (the CUDA driver's POSIX-fd
shareable handle) over the rank's socket. Here the driver imports the handle, maps the memory into
this process's GPU address space on the tensor's device, and the worker copies a tensor into it and
the result out of it, device to device, waiting for each copy to finish. `release` unmaps it and
drops the handle; the proxy client calls it before it closes its connection at a cut, so that the
process's CUDA state holds nothing of the proxy's when the driver checkpoints it.

Standard library and ctypes only, on the libcuda.so.1 the job's CUDA framework has loaded (the driver
API is stable across CUDA versions; the runtime's library name is not).
"""

from __future__ import annotations

import ctypes
import os

_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class GpuBufferError(RuntimeError):
    """The driver refused a step; the message names the call and its error."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class _Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


_driver: ctypes.CDLL | None = None


def driver() -> ctypes.CDLL:
    """libcuda.so.1 (already loaded by the job's framework where it uses CUDA)."""
    global _driver
    if _driver is None:
        _driver = ctypes.CDLL("libcuda.so.1")
    return _driver


def _check(result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        try:
            driver().cuGetErrorName(result, ctypes.byref(name))
        except (AttributeError, OSError):
            pass
        raise GpuBufferError(f"{what} failed: {(name.value or b'').decode() or result}")


def _context(ordinal: int) -> None:
    """Make the device's primary context current in this thread (the one the framework uses)."""
    cu = driver()
    device = ctypes.c_int()
    _check(cu.cuDeviceGet(ctypes.byref(device), ordinal), f"cuDeviceGet({ordinal})")
    context = ctypes.c_void_p()
    _check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
    try:
        _check(cu.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    finally:
        release = getattr(cu, "cuDevicePrimaryCtxRelease_v2", None) or cu.cuDevicePrimaryCtxRelease
        release(device)  # the framework holds it too: the context stays valid and current


def device_uuid(ordinal: int) -> str:
    """The UUID of CUDA device `ordinal` (as this process numbers its GPUs), as NVML writes it."""
    cu = driver()
    device = ctypes.c_int()
    _check(cu.cuDeviceGet(ctypes.byref(device), ordinal), f"cuDeviceGet({ordinal})")
    raw = _Uuid()
    get = getattr(cu, "cuDeviceGetUuid_v2", None) or cu.cuDeviceGetUuid
    _check(get(ctypes.byref(raw), device), "cuDeviceGetUuid")
    h = bytes(raw.bytes).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class GpuBuffer:
    """The proxy's buffer, mapped on device `ordinal`. Takes over the descriptor (closes it)."""

    def __init__(self, fd: int, size: int, ordinal: int):
        cu = driver()
        self.size, self.ordinal = size, ordinal
        self.handle = ctypes.c_ulonglong()
        self.ptr = ctypes.c_ulonglong()
        try:
            _context(ordinal)
            _check(cu.cuMemImportFromShareableHandle(ctypes.byref(self.handle), ctypes.c_void_p(fd),
                                                     _CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                   "cuMemImportFromShareableHandle")
        finally:
            os.close(fd)
        try:
            length, zero = ctypes.c_size_t(size), ctypes.c_size_t(0)
            _check(cu.cuMemAddressReserve(ctypes.byref(self.ptr), length, zero, ctypes.c_ulonglong(0),
                                          ctypes.c_ulonglong(0)), "cuMemAddressReserve")
            _check(cu.cuMemMap(self.ptr, length, zero, self.handle, ctypes.c_ulonglong(0)), "cuMemMap")
            access = _AccessDesc(_Location(_CU_MEM_LOCATION_TYPE_DEVICE, ordinal),
                                 _CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            _check(cu.cuMemSetAccess(self.ptr, length, ctypes.byref(access), ctypes.c_size_t(1)),
                   "cuMemSetAccess")
        except GpuBufferError:
            self._discard()
            raise

    def _discard(self) -> None:
        """After a failed mapping: undo whatever was done, each step whatever became of the others."""
        cu = driver()
        if self.ptr.value:
            cu.cuMemUnmap(self.ptr, ctypes.c_size_t(self.size))  # fails where it was not mapped yet
            cu.cuMemAddressFree(self.ptr, ctypes.c_size_t(self.size))
        if self.handle.value:
            cu.cuMemRelease(self.handle)
        self.ptr, self.handle = ctypes.c_ulonglong(), ctypes.c_ulonglong()

    def copy_in(self, src: int, nbytes: int) -> None:
        """nbytes from device address `src` to the buffer's start; returns once they are there."""
        self._copy(self.ptr.value, src, nbytes)

    def copy_out(self, dst: int, nbytes: int) -> None:
        self._copy(dst, self.ptr.value, nbytes)

    def _copy(self, dst: int, src: int, nbytes: int) -> None:
        if nbytes > self.size:
            raise GpuBufferError(f"{nbytes} bytes do not fit the GPU buffer of {self.size}")
        cu = driver()
        _context(self.ordinal)
        _check(cu.cuMemcpyDtoDAsync_v2(ctypes.c_ulonglong(dst), ctypes.c_ulonglong(src),
                                       ctypes.c_size_t(nbytes), ctypes.c_void_p(0)), "cuMemcpyDtoDAsync")
        _check(cu.cuStreamSynchronize(ctypes.c_void_p(0)), "cuStreamSynchronize")

    def release(self) -> None:
        """Unmap and drop the buffer (after every copy into or out of it has finished: they are
        waited for). Safe to call twice; raises GpuBufferError where the driver refuses a step."""
        cu = driver()
        if self.ptr.value:
            _check(cu.cuMemUnmap(self.ptr, ctypes.c_size_t(self.size)), "cuMemUnmap")
            _check(cu.cuMemAddressFree(self.ptr, ctypes.c_size_t(self.size)), "cuMemAddressFree")
            self.ptr = ctypes.c_ulonglong()
        if self.handle.value:
            _check(cu.cuMemRelease(self.handle), "cuMemRelease")
            self.handle = ctypes.c_ulonglong()
