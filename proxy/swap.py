"""GPU memory of ranks that take turns on one GPU, moved to host memory while they wait.

Ranks that share a GPU take turns on it (`turns`). Their memory may not fit on the GPU together: a
model that fills most of an H200 on its own, run as two ranks on one. Then a rank's GPU memory goes
to host memory while it waits at a collective, and comes back before it computes again, through the
CUDA driver's process checkpoint API (`checkpoint.cuda`: Lock and Checkpoint move a process's GPU
memory into its own host memory and release the GPU; Restore and Unlock bring it back). The rank
notices nothing: it is blocked in its proxy for the whole time, waiting for its answer.

`proxy.gpu_swap` says when:
- auto: when the rank about to compute needs more GPU memory than is free (with
  `proxy.gpu_swap_reserve_mib` to spare), the waiting ranks' memory goes out, the one that computes
  again last first, until it fits. What a rank needs is its own footprint where its memory is out,
  or, where it is on the GPU, what it lacks of the largest footprint of a rank of the device (ranks
  of one data-parallel job are alike: a rank whose first turn comes grows to its peers' size). Once
  the ranks fit together nothing moves.
- always: every waiting rank's memory goes out at every turn (the slowest; for a GPU other work
  shares, or to measure what a swap costs).
- never: memory stays on the GPU; ranks that do not fit together fail with CUDA's out-of-memory
  error, as without the proxy.

A rank's memory comes back before its answer in every mode: a rank whose memory is out must not
compute (its CUDA calls would wait for ever). That includes a rank restored from a checkpoint taken
while its memory was out: the node agent leaves such a rank's GPU state in host memory, tells the
rank's proxy its GPU UUID pair, and the proxy brings it in (onto its GPU) at the rank's turn.

Footprints come from NVML (the memory the driver counts per process on this GPU: everything the
framework's caching allocator reserved and the CUDA context). The decision (`plan`) is a pure
function of footprints, free memory and order; `GpuMemory` is the executor that reads NVML and makes
the driver calls.
"""

from __future__ import annotations

import enum
import errno
import os
import select
import socket
import struct
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass

from singularity_slurm.checkpoint import cuda


class SwapMode(enum.StrEnum):
    """`proxy.gpu_swap`: when waiting ranks' GPU memory moves to host memory."""

    AUTO = "auto"  # when the next rank would not fit
    ALWAYS = "always"  # at every turn
    NEVER = "never"  # not at all (ranks that do not fit fail with out-of-memory)


@dataclass(frozen=True)
class Plan:
    """What happens before a rank computes: `out` ranks' memory goes to host memory, in this order,
    then the rank's own comes back if `bring_in`."""

    out: tuple[int, ...] = ()
    bring_in: bool = False


def need(incoming: int, footprints: Mapping[int, int], out: Set[int]) -> int | None:
    """The GPU memory `incoming` needs before it computes: its footprint where its memory is out;
    where it is on the GPU, what it lacks of the largest footprint among the device's ranks. A rank
    whose memory is out at a size never measured (restored so) needs the largest footprint known,
    or, where none is, an unknown amount (None)."""
    largest = max(footprints.values(), default=None)
    if incoming in out:
        return footprints.get(incoming, largest)
    return max(0, (largest or 0) - footprints.get(incoming, 0))


def plan(mode: SwapMode, incoming: int, footprints: Mapping[int, int], out: Set[int],
         evictable: Sequence[int], free: int, reserve: int) -> Plan:
    """Before `incoming` computes. `footprints`: each rank's GPU memory (as last measured while on the
    GPU); `out`: ranks whose memory is in host memory now; `evictable`: the ranks that may go out
    (waiting in the proxy, not computing), the first to go first; `free`: the GPU's free memory."""
    bring_in = incoming in out
    candidates = [rank for rank in evictable if rank != incoming and rank not in out]
    if mode == SwapMode.ALWAYS:
        return Plan(tuple(candidates), bring_in)
    if mode == SwapMode.NEVER:
        return Plan((), bring_in)
    wanted = need(incoming, footprints, out)
    if wanted is None:  # nothing to go by: every waiting rank goes out
        return Plan(tuple(candidates), bring_in)
    going: list[int] = []
    if wanted > 0:
        for rank in candidates:
            if free >= wanted + reserve:
                break
            going.append(rank)
            free += footprints.get(rank, 0)
    return Plan(tuple(going), bring_in)


def eviction_order(inside: Iterable[int], waiting: Sequence[int]) -> list[int]:
    """The ranks that may go out (those `inside` the proxy), the one whose turn comes last first:
    ranks in an operation (they queue for the turn behind every rank waiting now), then the waiting
    ranks from the back of the queue."""
    inside = set(inside)
    queued = [rank for rank in waiting if rank in inside]
    return [rank for rank in sorted(inside) if rank not in queued] + queued[::-1]


# --- executor ----------------------------------------------------------------------------------


class SwapError(Exception):
    """A rank's GPU memory could not be moved (the driver refused, or the process is gone)."""


def alive(pidfd: int) -> bool:
    """Whether the process a pidfd refers to still runs: while it does, its pid is not reused."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return not poller.poll(0)


def wait_any(pidfds: Sequence[int], timeout: float) -> list[int]:
    """Wait until one of the processes ends (at most `timeout` seconds): the pidfds of those that have."""
    poller = select.poll()
    for pidfd in pidfds:
        poller.register(pidfd, select.POLLIN)
    return [fd for fd, _ in poller.poll(max(0, int(timeout * 1000)))]


@dataclass(frozen=True)
class Process:
    """A rank's process as its proxy names it: the pid its socket's peer had at connect, a pidfd of
    that process, and the uid it connected as."""

    pid: int
    pidfd: int
    uid: int


def check(process: Process) -> None:
    """Refuse a process that has ended (its pid may be another process's by now) or has changed
    its user (it ran a set-user-id program) since it connected."""
    if process.pidfd < 0 or not alive(process.pidfd):
        raise SwapError(f"process {process.pid} has ended")
    try:
        if os.stat(f"/proc/{process.pid}").st_uid != process.uid:
            raise SwapError(f"process {process.pid} is no longer of uid {process.uid}")
    except FileNotFoundError:
        raise SwapError(f"process {process.pid} has ended") from None


class GpuMemory:
    """One GPU's memory, per process (NVML), and processes' GPU state moved out and in (the driver).

    Every driver call is made only after `check` found the process still running as the user it
    connected as: while it runs, its pid is not reused."""

    def __init__(self, index: int, lock_timeout_ms: int = 60_000):
        try:
            import pynvml
        except ImportError as exc:
            raise cuda.CudaUnavailable("NVML's Python bindings are not installed in the project's "
                                       "venv: install the gpu extra (pip install "
                                       "'singularity-slurm[gpu]')") from exc
        self.driver = cuda.Driver(lock_timeout_ms)
        try:
            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.uuid = str(pynvml.nvmlDeviceGetUUID(self.handle))
        except pynvml.NVMLError as exc:
            raise cuda.CudaUnavailable(f"NVML cannot read GPU {index}: {exc}") from exc
        self.nvml = pynvml
        self.index = index

    def usage(self) -> tuple[int, dict[int, int]]:
        """The GPU's free bytes, and the bytes each process (host pid) holds on it."""
        try:
            free = int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).free)
            processes = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except self.nvml.NVMLError as exc:
            raise SwapError(f"NVML cannot read GPU {self.index}'s memory: {exc}") from exc
        return free, {int(p.pid): int(p.usedGpuMemory or 0) for p in processes}

    def _state(self, process: Process) -> str | None:
        check(process)
        try:
            return self.driver.state(process.pid)
        except cuda.CudaCheckpointFailed:
            return None  # no CUDA context (yet)

    def _run(self, process: Process, calls: Sequence[cuda.Call],
             pairs: Sequence[cuda.GpuPair] = ()) -> None:
        for call in calls:
            check(process)
            self.driver.call(call, pairs)

    def is_out(self, process: Process) -> bool:
        """Whether the process cannot run its CUDA work now (its memory out, or locked)."""
        return self._state(process) in (cuda.CHECKPOINTED, cuda.LOCKED)

    def move_out(self, process: Process) -> None:
        state = self._state(process)
        if state is None:
            return
        try:
            self._run(process, cuda.to_checkpointed({process.pid: state}))
        except cuda.CheckpointError as exc:
            try:  # back to running, as far as it got
                self._run(process, cuda.to_running({process.pid: self._state(process) or cuda.RUNNING}))
            except (cuda.CheckpointError, SwapError):
                pass
            raise SwapError(f"process {process.pid}'s GPU memory could not move to host memory: "
                            f"{exc}") from exc

    def move_in(self, process: Process, pairs: Sequence[cuda.GpuPair] = ()) -> None:
        state = self._state(process)
        try:
            self._run(process, cuda.to_running({process.pid: state or cuda.RUNNING}), pairs)
        except cuda.CheckpointError as exc:
            raise SwapError(f"process {process.pid}'s GPU memory could not come back to GPU "
                            f"{self.index}: {exc}") from exc

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass


SO_PEERPIDFD = 77  # Linux 6.5: a pidfd of the socket's peer, taken when it connected


def peer_process(sock: socket.socket) -> Process | None:
    """The process at the other end of a unix socket, as it was when it connected (SO_PEERCRED),
    with a pidfd of it; None where it is gone. The kernel's own pidfd (SO_PEERPIDFD) names exactly
    the process that connected; a kernel without it has the pid opened, kept only if that process
    still runs as the peer's uid."""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      struct.calcsize("3i")))
    try:
        return Process(pid, sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD), uid)
    except OSError as exc:
        if exc.errno != errno.ENOPROTOOPT:
            return None  # gone (ESRCH), or a pidfd the kernel would not give
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        process = Process(pid, pidfd, uid)
        check(process)
        return process
    except SwapError:
        os.close(pidfd)
        return None
