"""A process's CUDA state moved into its host memory around a criu dump, and back onto a GPU after.

The CUDA driver's process checkpoint API (driver >= 570, through cuda-python's driver bindings) acts
on another process by pid: Lock blocks the target's further CUDA calls, Checkpoint copies its GPU
memory into its host memory and releases the GPU, Restore puts it back (on the same GPUs, or on others
of the same type named by UUID pairs), Unlock lets its CUDA calls run again.

Facts this relies on (verified on an NVIDIA H200, driver 580.159.04, CUDA 13.0, torch 2.11 and
criu 4.1.1, by tests/gpu/probe.py; benchmarks/results/gpu_probe-20261204-063700.json):
- criu alone cannot dump a process that holds GPU memory: "Can't handle non-regular mapping" on the
  device mapping it finds in /proc/PID/maps.
- After Lock and Checkpoint the target keeps running (its CUDA calls wait) with no /dev/nvidia*
  descriptor and no device mapping, so criu dumps it like any process; its GPU memory is in the image
  (all the caching allocator reserved, not only what tensors use).
- A restored target is in the "checkpointed" state; Restore then Unlock resume it, also where it has
  another host pid than at the dump (the init of a new PID namespace). The training log of a job
  checkpointed and restored twice this way is byte-identical to an undisturbed run's.
- Inside a mount namespace, the driver's folder may be a mount criu cannot dump (/usr/local/nvidia,
  squashfs: "FS mnt ... unsupported"): `criu.external_mounts` names such mounts, which a restore binds
  from the restoring host.

The decisions (which calls bring a set of processes to a state) are pure functions of their states;
`Driver` is the thin executor that makes the calls.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from singularity_slurm.errors import CheckpointError

RUNNING, LOCKED, CHECKPOINTED, FAILED = "running", "locked", "checkpointed", "failed"
_STATES = (RUNNING, LOCKED, CHECKPOINTED, FAILED)  # CUprocessState's values, in order
DEVICE_PREFIX = "/dev/nvidia"


class CudaUnavailable(CheckpointError):
    """A process holds GPU memory but this node cannot checkpoint CUDA state (no driver bindings, or
    a driver without the checkpoint API)."""


class CudaCheckpointFailed(CheckpointError):
    """The driver refused a checkpoint call; the processes were put back to running where possible."""


@dataclass(frozen=True)
class Call:
    action: str  # lock, checkpoint, restore, unlock
    pid: int


def holds_device(maps: str) -> bool:
    """Whether a process's /proc/PID/maps text maps an NVIDIA device file (what criu cannot dump).
    Libraries named libnvidia-* are regular files and do not count."""
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(DEVICE_PREFIX):
            return True
    return False


def loads_cuda(maps: str) -> bool:
    """Whether a process's /proc/PID/maps text maps the CUDA driver library: a process that may hold
    CUDA state, on the GPU or (checkpointed) in its own memory."""
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].rsplit("/", 1)[-1].startswith("libcuda.so"):
            return True
    return False


def namespace_pid(status: str) -> int | None:
    """A process's pid in its innermost PID namespace, from its /proc/PID/status text (NSpid's last
    field): what stays the same across a criu restore, where the host pid changes."""
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            fields = line.split()[1:]
            return int(fields[-1]) if fields else None
    return None


def device_indices(fd_targets: Iterable[str]) -> list[int]:
    """The GPU numbers of /dev/nvidiaN among a process's descriptor targets (readlink of
    /proc/PID/fd/*); nvidiactl, nvidia-uvm and the like name no GPU."""
    found = set()
    for target in fd_targets:
        digits = target.removeprefix(DEVICE_PREFIX)
        if target.startswith(DEVICE_PREFIX) and digits.isdigit():
            found.add(int(digits))
    return sorted(found)


def to_checkpointed(states: Mapping[int, str]) -> list[Call]:
    """Every process locked first (none of them runs CUDA work while another is copied out), then
    each checkpointed. A process already past a step skips it; a failed one cannot be saved."""
    _refuse_failed(states)
    locks = [Call("lock", pid) for pid, state in states.items() if state == RUNNING]
    saves = [Call("checkpoint", pid) for pid, state in states.items() if state in (RUNNING, LOCKED)]
    return locks + saves


def to_running(states: Mapping[int, str]) -> list[Call]:
    """Back to running: a checkpointed process is restored (its memory back on the GPU) then
    unlocked, a locked one unlocked."""
    _refuse_failed(states)
    calls: list[Call] = []
    for pid, state in states.items():
        if state == CHECKPOINTED:
            calls.append(Call("restore", pid))
        if state in (CHECKPOINTED, LOCKED):
            calls.append(Call("unlock", pid))
    return calls


def _refuse_failed(states: Mapping[int, str]) -> None:
    failed = sorted(pid for pid, state in states.items() if state == FAILED)
    if failed:
        raise CudaCheckpointFailed(f"the CUDA driver reports the GPU state of process(es) "
                                   f"{', '.join(map(str, failed))} as failed: it cannot be saved or resumed")


@dataclass(frozen=True)
class GpuPair:
    old_uuid: str
    new_uuid: str


def driver_bindings():
    """cuda-python's driver bindings (`cuda.bindings.driver`), the driver initialised; CudaUnavailable
    where the bindings are not installed or there is no usable driver."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise CudaUnavailable("cuda-python's driver bindings are not installed in the project's venv: "
                              "install the gpu extra (pip install 'singularity-slurm[gpu]')") from exc
    try:
        (err,) = driver.cuInit(0)
    except RuntimeError as exc:  # the bindings could not load libcuda.so.1
        raise CudaUnavailable(f"no NVIDIA driver on this node: {exc}") from exc
    if int(err) != 0:
        raise CudaUnavailable(f"the NVIDIA driver does not initialise: cuInit failed: "
                              f"{getattr(err, 'name', int(err))}")
    return driver


class Driver:
    """The driver's checkpoint calls through cuda-python (`cuda.bindings.driver`)."""

    def __init__(self, lock_timeout_ms: int = 60_000):
        driver = self._d = driver_bindings()
        missing = [name for name in ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
                                     "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock",
                                     "cuCheckpointProcessGetState") if not hasattr(driver, name)]
        if missing:
            raise CudaUnavailable(f"cuda-python's bindings lack {', '.join(missing)}: install "
                                  "cuda-bindings >= 12.8")
        err, version = driver.cuDriverGetVersion()
        self._check(err, "cuDriverGetVersion")
        self.version = version
        if version < 12080:
            cuda_version = f"{version // 1000}.{version % 1000 // 10}"
            raise CudaUnavailable(f"the NVIDIA driver supports CUDA {cuda_version}: checkpointing GPU "
                                  "state needs driver 570 or newer (CUDA 12.8)")
        self.lock_timeout_ms = lock_timeout_ms

    def _check(self, err, what: str) -> None:
        if int(err) != 0:
            name = getattr(err, "name", str(int(err)))
            raise CudaCheckpointFailed(f"{what} failed: {name}")

    def state(self, pid: int) -> str:
        err, state = self._d.cuCheckpointProcessGetState(pid)
        self._check(err, f"cuCheckpointProcessGetState({pid})")
        return _STATES[int(state)] if 0 <= int(state) < len(_STATES) else FAILED

    def states(self, pids: Iterable[int]) -> dict[int, str]:
        return {pid: self.state(pid) for pid in pids}

    def call(self, call: Call, pairs: Sequence[GpuPair] = ()) -> None:
        d = self._d
        if call.action == "lock":
            args = d.CUcheckpointLockArgs()
            args.timeoutMs = self.lock_timeout_ms
            (err,) = d.cuCheckpointProcessLock(call.pid, args)
        elif call.action == "checkpoint":
            (err,) = d.cuCheckpointProcessCheckpoint(call.pid, None)
        elif call.action == "restore":
            args = None
            if pairs:
                args = d.CUcheckpointRestoreArgs()
                args.gpuPairs = [self._pair(pair) for pair in pairs]
                args.gpuPairsCount = len(pairs)
            (err,) = d.cuCheckpointProcessRestore(call.pid, args)
        elif call.action == "unlock":
            (err,) = d.cuCheckpointProcessUnlock(call.pid, None)
        else:
            raise ValueError(call.action)
        self._check(err, f"cuCheckpointProcess{call.action.capitalize()}({call.pid})")

    def _pair(self, pair: GpuPair):
        made = self._d.CUcheckpointGpuPair()
        made.oldUuid = self._uuid(pair.old_uuid)
        made.newUuid = self._uuid(pair.new_uuid)
        return made

    def _uuid(self, text: str):
        uuid = self._d.CUuuid()  # its `bytes` is read-only: its 16 bytes are written in place
        raw = uuid_bytes(text)
        ctypes.memmove(uuid.getPtr(), raw, len(raw))
        return uuid


def uuid_bytes(text: str) -> bytes:
    """NVML's 'GPU-a5c3924d-63ed-c3f1-7577-7955e543ac4d' as the driver's 16 bytes."""
    digits = text.removeprefix("GPU-").replace("-", "")
    if len(digits) != 32:
        raise ValueError(f"not a GPU UUID: {text!r}")
    return bytes.fromhex(digits)


def _mapping(pids: Iterable[int], test: Callable[[str], bool]) -> list[int]:
    """The processes among `pids` whose /proc/PID/maps text passes `test` (read by root from the
    kernel; a process that ended meanwhile is skipped)."""
    found = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                if test(maps.read()):
                    found.append(pid)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def gpu_tasks(pids: Iterable[int]) -> list[int]:
    """The processes among `pids` that map an NVIDIA device (what holds GPU state on a GPU)."""
    return _mapping(pids, holds_device)


def cuda_tasks(pids: Iterable[int]) -> list[int]:
    """The processes among `pids` that map the CUDA driver's library (they may hold CUDA state)."""
    return _mapping(pids, loads_cuda)


def checkpointed_tasks(driver: Driver, pids: Iterable[int]) -> list[int]:
    """The processes among `pids` whose GPU state is checkpointed in their own memory while they run
    on: ranks sharing a GPU whose proxy moved their memory out while they wait (proxy.swap). One the
    driver knows nothing of (no CUDA context: a forked DataLoader worker) is not among them."""
    found = []
    for pid in pids:
        try:
            if driver.state(pid) == CHECKPOINTED:
                found.append(pid)
        except CudaCheckpointFailed:
            continue
    return found


def opened_gpus(pids: Iterable[int]) -> list[int]:
    """The GPU numbers (/dev/nvidiaN) the processes hold open (for the GPU check script: the node
    agent takes a job's GPUs from Slurm only, since a job can fake these in a namespace of its own)."""
    targets = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except FileNotFoundError:
            continue
        for fd in fds:
            try:
                targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
    return device_indices(targets)


def inner_pids(pids: Iterable[int]) -> dict[int, int]:
    """host pid -> pid in its innermost namespace, for the processes that still exist."""
    found = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as status:
                inner = namespace_pid(status.read())
        except (FileNotFoundError, ProcessLookupError):
            continue
        if inner is not None:
            found[pid] = inner
    return found


def suspend(driver: Driver, pids: Sequence[int]) -> None:
    """Lock and checkpoint every process; on a refusal, put back to running what was moved."""
    try:
        for call in to_checkpointed(driver.states(pids)):
            driver.call(call)
    except CheckpointError as exc:
        try:
            resume(driver, pids)
        except CheckpointError as again:
            raise CudaCheckpointFailed(f"{exc}; putting the processes back failed too: {again}") from exc
        raise


def resume(driver: Driver, pids: Sequence[int], pairs: Sequence[GpuPair] = ()) -> int:
    """Bring every process back to running (restored onto the GPUs `pairs` name); returns how many
    had GPU state to restore."""
    states = driver.states(pids)
    for call in to_running(states):
        driver.call(call, pairs)
    return sum(state == CHECKPOINTED for state in states.values())
