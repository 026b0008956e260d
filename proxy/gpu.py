"""GPU buffers shared with ranks, and reductions on the GPU: the cuda backend's device data path.

Where a GPU's proxy can (`proxy.gpu_buffers`, the driver's virtual memory calls, the kernels loaded),
it gives each rank a buffer in the GPU's memory, allocated by the proxy and handed to the worker as a
file descriptor (the driver's POSIX-fd shareable handle, sent with SCM_RIGHTS like the host regions:
a descriptor needs no shared PID namespace, which legacy CUDA IPC handles are reported to need, and
only a holder of it can map the memory). A rank's allreduce of a CUDA tensor then copies the tensor
into its buffer on the GPU, and the result back, device to device; nothing goes through host memory
in the worker.

The proxy combines the contributions:
- all members of the communicator on this GPU (ranks taking turns on one GPU, a one-GPU job): on the
  GPU, in group-rank order (`reduction_steps`, kernels of kernels/reduce.cu, whose arithmetic is the
  host backend's, so a result does not depend on where it was computed);
- members on other proxies too: each local member's buffer is copied into host memory by the proxy
  (one copy, from the GPU's own memory), reduced with the peers as host regions are (shared memory or
  the mesh), and copied back: a device-to-host pipeline. NCCL between proxies is not used.

The buffers are offered only where the worker cannot hold one while its memory is moved out: to
ranks that hold their GPU alone, or whose proxy never moves GPU memory (`offered`). At a cut, the
worker unmaps its buffer and releases the handle before it closes its connection, so its CUDA state
holds nothing of the proxy's when the driver checkpoints it.

`reduction_steps` and `offered` are pure; `CudaDevice` is the executor (cuda-python's driver
bindings; only on a node with an NVIDIA driver).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from singularity_slurm.checkpoint import cuda

from .hal import REDUCTIONS, BackendError, dtype_of

PTX = Path(__file__).with_name("kernels") / "reduce.ptx"
CUDA_ERROR_OUT_OF_MEMORY = 2
THREADS = 256
MAX_BLOCKS = 4096
_NAMES = {"float32": "float32", "float64": "float64", "float16": "float16", "bfloat16": "bfloat16",
          "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64", "uint8": "uint8",
          "bool": "bool"}
_FLOATS = ("float32", "float64", "float16", "bfloat16")


class GpuUnavailable(Exception):
    """The device data path cannot be set up here; ranks' tensors go through host memory."""


@dataclass(frozen=True)
class Step:
    """One step of a reduction on the GPU. `kernel` runs on `target` ("out": the result, of the
    operation's dtype; "acc": a float32 accumulator, for bfloat16) with the contribution `part`
    (its index in the order given) or the scalar `divisor`; `kernel` "copy" copies part into out."""

    kernel: str
    target: str
    part: int | None = None
    divisor: float | None = None


def reduction_steps(dtype: str, op: str, parts: int) -> list[Step]:
    """How `parts` contributions are combined, left to right, as HostBackend.reduce combines them:
    the same operations in the same order, so the results are the same bits."""
    dtype_of(dtype)  # refuses an unknown dtype with the supported ones
    if op not in REDUCTIONS:
        raise BackendError(f"reduction {op!r} not supported; supported: {', '.join(REDUCTIONS)}")
    if parts < 1:
        raise BackendError("a reduction needs at least one contribution")
    if op == "avg" and dtype not in _FLOATS:
        raise BackendError(f"avg needs a floating-point dtype, got {dtype}")
    step = "sum" if op == "avg" else op
    name = _NAMES[dtype]
    if dtype == "bfloat16":  # float32 throughout, one rounding at the end
        steps = [Step("sp_widen_bfloat16", "acc", part=0)]
        steps += [Step(f"sp_{step}_bfloat16", "acc", part=i) for i in range(1, parts)]
        if op == "avg":
            steps.append(Step("sp_div_float32", "acc", divisor=float(np.float32(parts))))
        steps.append(Step("sp_narrow_bfloat16", "out"))
        return steps
    steps = [Step("copy", "out", part=0)]
    steps += [Step(f"sp_{step}_{name}", "out", part=i) for i in range(1, parts)]
    if op == "avg":
        # numpy divides by the count converted to the array's dtype (float16 rounds it)
        steps.append(Step(f"sp_div_{name}", "out", divisor=float(np.dtype(dtype).type(parts))))
    return steps


def kernel_names() -> list[str]:
    """Every kernel `reduction_steps` may name."""
    names = set()
    for dtype in _NAMES:
        for op in REDUCTIONS:
            if op == "avg" and dtype not in _FLOATS:
                continue
            names.update(s.kernel for s in reduction_steps(dtype, op, 3) if s.kernel != "copy")
    return sorted(names)


def offered(ready: bool, sliced: bool, moves_memory: bool) -> bool:
    """Whether a rank gets a GPU buffer: the path is set up, and the rank's GPU memory is never moved
    to host memory while it waits (a worker cannot hold a mapping of the proxy's memory then): it
    holds its GPU alone, or its proxy does not move memory (no driver support, proxy.gpu_swap never)."""
    return ready and (not sliced or not moves_memory)


def grid(count: int) -> int:
    """Blocks of THREADS for `count` elements (the kernels loop over the rest)."""
    return max(1, min(MAX_BLOCKS, -(-count // THREADS)))


def fits(buffer: DeviceBuffer, nbytes: int) -> None:
    """Refuse a size the buffer does not hold, before anything touches it."""
    if nbytes < 0:
        raise BackendError(f"a negative size ({nbytes} bytes)")
    if nbytes > buffer.size:
        raise BackendError(f"{nbytes} bytes do not fit the rank's GPU buffer of {buffer.size}")


def allocation_size(nbytes: int, granularity: int) -> int:
    """A buffer's size: whole multiples of the driver's granularity, at least one, at least 1 MiB."""
    unit = max(granularity, 1)
    return max(1 << 20, -(-max(nbytes, 1) // unit) * unit)


@dataclass
class DeviceBuffer:
    """GPU memory the proxy allocated and maps at `ptr`."""

    ptr: int
    size: int
    handle: object  # the driver's allocation handle (CUmemGenericAllocationHandle)


class CudaDevice:
    """One GPU, found by its UUID: the proxy's context on it, buffers it shares with ranks, copies,
    and the reduction kernels. Thread-safe (one GPU operation at a time).

    Nothing happens on the GPU until a rank first asks for a buffer: a proxy whose ranks never get
    one makes no CUDA context (which takes GPU memory). Where setting up fails (no driver bindings,
    the GPU in an exclusive compute mode, the kernels not loadable), `failed` says why, every use
    raises GpuUnavailable with it, and the proxy stops offering buffers."""

    def __init__(self, uuid: str, ptx: Path = PTX):
        self.uuid = uuid
        self.ptx = ptx
        self.lock = threading.Lock()
        self.failed: str | None = None
        self._d = None
        self.functions: dict[str, object] = {}
        self.scratch: DeviceBuffer | None = None  # bfloat16's float32 accumulator
        self.context = None

    def _open(self) -> None:
        """(With the lock.) Set up on first use, or raise why that failed (or why the device failed
        since: an error of the driver's leaves the context unusable, so none is retried)."""
        if self.failed is not None:
            raise GpuUnavailable(self.failed)
        if self._d is not None:
            self._current()
            return
        try:
            self._setup()
        except Exception as exc:  # noqa: BLE001 - whatever it was, this GPU serves no buffers
            self.failed = str(exc) if isinstance(exc, GpuUnavailable) else f"{type(exc).__name__}: {exc}"
            if self._d is not None and getattr(self, "context", None) is not None:
                self._d.cuDevicePrimaryCtxRelease(self.device)
            self._d, self.context = None, None
            raise GpuUnavailable(self.failed) from exc

    def _setup(self) -> None:
        try:
            driver = self._d = cuda.driver_bindings()
        except cuda.CudaUnavailable as exc:
            raise GpuUnavailable(str(exc)) from exc
        self.ordinal, self.device = self._find(self.uuid)
        err, mode = driver.cuDeviceGetAttribute(driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_MODE,
                                                self.device)
        self._check(err, "cuDeviceGetAttribute(COMPUTE_MODE)")
        if int(mode) != int(driver.CUcomputemode.CU_COMPUTEMODE_DEFAULT):
            raise GpuUnavailable(f"GPU {self.uuid} is not in the default compute mode (mode {int(mode)}): a "
                                 "context of the proxy's would keep the ranks off it")
        err, context = driver.cuDevicePrimaryCtxRetain(self.device)
        self._check(err, "cuDevicePrimaryCtxRetain")
        self.context = context
        self._current()
        self.prop = driver.CUmemAllocationProp()
        self.prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.prop.location.id = self.ordinal
        posix_fd = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self.prop.requestedHandleTypes = posix_fd
        err, granularity = driver.cuMemGetAllocationGranularity(
            self.prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        self._check(err, "cuMemGetAllocationGranularity")
        self.granularity = int(granularity)
        try:
            image = self.ptx.read_bytes() + b"\0"
        except OSError as exc:
            raise GpuUnavailable(f"the reduction kernels ({self.ptx}) cannot be read: {exc}") from exc
        err, self.module = driver.cuModuleLoadData(image)
        self._check(err, f"cuModuleLoadData({self.ptx.name})")

    def _check(self, err, what: str) -> None:
        """Raise for a driver error; any but out-of-memory leaves the device failed for good."""
        if int(err) != 0:
            problem = f"{what} failed: {getattr(err, 'name', int(err))}"
            if int(err) != CUDA_ERROR_OUT_OF_MEMORY:
                self.failed = problem
            raise GpuUnavailable(problem)

    def _find(self, uuid: str) -> tuple[int, object]:
        d = self._d
        err, count = d.cuDeviceGetCount()
        self._check(err, "cuDeviceGetCount")
        get_uuid = getattr(d, "cuDeviceGetUuid_v2", None) or d.cuDeviceGetUuid
        for ordinal in range(int(count)):
            err, device = d.cuDeviceGet(ordinal)
            self._check(err, "cuDeviceGet")
            err, raw = get_uuid(device)
            self._check(err, "cuDeviceGetUuid")
            if format_uuid(bytes(raw.bytes)) == uuid:
                return ordinal, device
        raise GpuUnavailable(f"the driver shows no GPU {uuid}")

    def _current(self) -> None:
        (err,) = self._d.cuCtxSetCurrent(self.context)
        self._check(err, "cuCtxSetCurrent")

    # --- buffers ----------------------------------------------------------------------------------

    def alloc(self, nbytes: int) -> DeviceBuffer:
        with self.lock:
            self._open()
            d = self._d
            size = allocation_size(nbytes, self.granularity)
            err, handle = d.cuMemCreate(size, self.prop, 0)
            self._check(err, f"cuMemCreate({size})")
            ptr, mapped = None, False
            try:
                err, reserved = d.cuMemAddressReserve(size, 0, 0, 0)
                self._check(err, "cuMemAddressReserve")
                ptr = reserved
                (err,) = d.cuMemMap(ptr, size, 0, handle, 0)
                self._check(err, "cuMemMap")
                mapped = True
                access = d.CUmemAccessDesc()
                access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                access.location.id = self.ordinal
                access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                (err,) = d.cuMemSetAccess(ptr, size, [access], 1)
                self._check(err, "cuMemSetAccess")
            except GpuUnavailable:
                if mapped:
                    d.cuMemUnmap(ptr, size)
                if ptr is not None:
                    d.cuMemAddressFree(ptr, size)
                d.cuMemRelease(handle)
                raise
            return DeviceBuffer(int(ptr), size, handle)

    def export(self, buffer: DeviceBuffer) -> int:
        """A new file descriptor for the buffer's memory (the caller sends and closes it)."""
        with self.lock:
            self._open()
            err, fd = self._d.cuMemExportToShareableHandle(
                buffer.handle, self._d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
            self._check(err, "cuMemExportToShareableHandle")
            return int(fd)

    def free(self, buffer: DeviceBuffer) -> None:
        with self.lock:
            self._open()
            d = self._d
            d.cuMemUnmap(buffer.ptr, buffer.size)
            d.cuMemAddressFree(buffer.ptr, buffer.size)
            d.cuMemRelease(buffer.handle)

    # --- copies -----------------------------------------------------------------------------------

    def download(self, buffer: DeviceBuffer, into: np.ndarray) -> None:
        """The first into.nbytes bytes of the buffer into a contiguous host array."""
        fits(buffer, into.nbytes)
        with self.lock:
            self._open()
            (err,) = self._d.cuMemcpyDtoH(into.ctypes.data, buffer.ptr, into.nbytes)
            self._check(err, "cuMemcpyDtoH")

    def upload(self, data: np.ndarray, buffer: DeviceBuffer) -> None:
        fits(buffer, data.nbytes)
        data = np.ascontiguousarray(data)
        with self.lock:
            self._open()
            (err,) = self._d.cuMemcpyHtoD(buffer.ptr, data.ctypes.data, data.nbytes)
            self._check(err, "cuMemcpyHtoD")
            self._synchronize()  # from pageable memory it may return before the data is there

    def copy(self, dst: DeviceBuffer, src: DeviceBuffer, nbytes: int) -> None:
        fits(dst, nbytes)
        fits(src, nbytes)
        with self.lock:
            self._open()
            self._copy(dst.ptr, src.ptr, nbytes)
            self._synchronize()  # a device-to-device copy does not wait on the host

    def _copy(self, dst: int, src: int, nbytes: int) -> None:
        if dst != src and nbytes:
            (err,) = self._d.cuMemcpyDtoD(dst, src, nbytes)
            self._check(err, "cuMemcpyDtoD")

    # --- reductions -------------------------------------------------------------------------------

    def reduce(self, dtype: str, op: str, parts: Sequence[DeviceBuffer], out: DeviceBuffer,
               count: int) -> None:
        """out = parts[0] op parts[1] op ... (first `count` elements of each), on the GPU. `out` may
        be parts[0]; no other part is written."""
        steps = reduction_steps(dtype, op, len(parts))
        nbytes = count * dtype_of(dtype).itemsize
        for buffer in (*parts, out):
            fits(buffer, nbytes)
        with self.lock:
            self._open()
            acc = self._scratch(count * 4).ptr if dtype == "bfloat16" else 0
            for step in steps:
                target = acc if step.target == "acc" else out.ptr
                if step.kernel == "copy":
                    self._copy(target, parts[step.part or 0].ptr, nbytes)
                elif step.divisor is not None:
                    kind = ctypes.c_double if dtype == "float64" else ctypes.c_float
                    self._launch(step.kernel, ctypes.c_uint64(target), kind(step.divisor), count)
                elif step.kernel == "sp_narrow_bfloat16":
                    self._launch(step.kernel, ctypes.c_uint64(out.ptr), ctypes.c_uint64(acc), count)
                else:
                    part = parts[step.part or 0].ptr
                    self._launch(step.kernel, ctypes.c_uint64(target), ctypes.c_uint64(part), count)
            self._synchronize()

    def _synchronize(self) -> None:
        """Wait until everything queued on the GPU is done: the proxy answers a rank only after."""
        (err,) = self._d.cuCtxSynchronize()
        self._check(err, "cuCtxSynchronize")

    def _scratch(self, nbytes: int) -> DeviceBuffer:
        if self.scratch is None or self.scratch.size < nbytes:
            old, self.scratch = self.scratch, None
            if old is not None:
                self._d.cuMemFree(old.ptr)
            size = allocation_size(nbytes, 1 << 20)
            err, ptr = self._d.cuMemAlloc(size)
            self._check(err, f"cuMemAlloc({size})")
            self.scratch = DeviceBuffer(int(ptr), size, None)
        return self.scratch

    def _function(self, name: str):
        function = self.functions.get(name)
        if function is None:
            err, function = self._d.cuModuleGetFunction(self.module, name.encode())
            self._check(err, f"cuModuleGetFunction({name})")
            self.functions[name] = function
        return function

    def _launch(self, name: str, first, second, count: int) -> None:
        if not 0 <= count < 1 << 62:
            raise BackendError(f"a kernel over {count} elements")
        args = [first, second, ctypes.c_uint64(count)]
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        (err,) = self._d.cuLaunchKernel(self._function(name), grid(count), 1, 1, THREADS, 1, 1, 0, 0,
                                        ctypes.addressof(params), 0)
        self._check(err, f"cuLaunchKernel({name})")

    def close(self) -> None:
        with self.lock:
            if self._d is None:
                return
            self._current()
            if self.scratch is not None:
                self._d.cuMemFree(self.scratch.ptr)
                self.scratch = None
            self._d.cuModuleUnload(self.module)
            self._d.cuDevicePrimaryCtxRelease(self.device)


def nvml_uuid(index: int) -> str:
    """The UUID of NVML's GPU `index` (as Slurm numbers the node's GPUs)."""
    try:
        import pynvml
    except ImportError as exc:
        raise GpuUnavailable("NVML's Python bindings are not installed in the project's venv (the gpu "
                             "extra)") from exc
    try:
        pynvml.nvmlInit()
        return str(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index)))
    except pynvml.NVMLError as exc:
        raise GpuUnavailable(f"NVML cannot read GPU {index}: {exc}") from exc


def format_uuid(raw: bytes) -> str:
    """A GPU UUID's 16 bytes as NVML and nvidia-smi write it: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx."""
    if len(raw) != 16:
        raise ValueError(f"a GPU UUID has 16 bytes, got {len(raw)}")
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
