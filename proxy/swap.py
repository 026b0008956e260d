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
proxies the restore's GPU UUID pairs, and its proxy brings it in (onto this GPU) at its turn.

Footprints come from NVML (the memory the driver counts per process on this GPU: everything the
framework's caching allocator reserved and the CUDA context). The decision (`plan`) is a pure
function of footprints, free memory and order; `GpuMemory` is the executor that reads NVML and makes
the driver calls.
"""

from __future__ import annotations

import enum
import os
import select
import socket
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


def need(incoming: int, footprints: Mapping[int, int], out: Set[int]) -> int:
    """The GPU memory `incoming` needs before it computes: its footprint where its memory is out;
    where it is on the GPU, what it lacks of the largest footprint among the device's ranks."""
    own = footprints.get(incoming, 0)
    if incoming in out:
        return own
    return max(0, max(footprints.values(), default=0) - own)


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
    going: list[int] = []
    if wanted > 0:
        for rank in candidates:
            if free >= wanted + reserve:
                break
            going.append(rank)
            free += footprints.get(rank, 0)
    return Plan(tuple(going), bring_in)


def eviction_order(inside: Iterable[int], waiting: Sequence[int]) -> list[int]:
    """The ranks that may go out, the one whose turn comes last first: ranks inside an operation (they
    queue for the turn behind every rank waiting now), then the waiting ranks from the back."""
    queued = list(waiting)
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


class GpuMemory:
    """One GPU's memory, per process (NVML), and processes' GPU state moved out and in (the driver).

    Processes are named by a pidfd (taken when the rank connected, from the socket's peer) and its
    pid: every call checks first that the process still runs, so a pid the kernel has given to
    another process since is never acted on."""

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

    def is_out(self, pid: int, pidfd: int) -> bool:
        self._check(pid, pidfd)
        try:
            return self.driver.state(pid) == cuda.CHECKPOINTED
        except cuda.CudaCheckpointFailed:
            return False  # no CUDA context (yet): nothing of it is out

    def move_out(self, pid: int, pidfd: int) -> None:
        self._check(pid, pidfd)
        try:
            cuda.suspend(self.driver, [pid])
        except cuda.CheckpointError as exc:
            raise SwapError(f"process {pid}'s GPU memory could not move to host memory: {exc}") from exc

    def move_in(self, pid: int, pidfd: int, pairs: Sequence[cuda.GpuPair] = ()) -> None:
        self._check(pid, pidfd)
        try:
            cuda.resume(self.driver, [pid], pairs)
        except cuda.CheckpointError as exc:
            raise SwapError(f"process {pid}'s GPU memory could not come back to GPU {self.index}: "
                            f"{exc}") from exc

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass

    @staticmethod
    def _check(pid: int, pidfd: int) -> None:
        if pidfd < 0 or not alive(pidfd):
            raise SwapError(f"process {pid} has ended")


SO_PEERPIDFD = 77  # Linux 6.5: a pidfd of the socket's peer, taken when it connected


def peer_pidfd(sock: socket.socket, pid: int, uid: int) -> int:
    """A pidfd of the process at the other end of a unix socket (`pid`, `uid`: its SO_PEERCRED),
    or -1 where it is gone. The kernel's own (SO_PEERPIDFD) names exactly the process that
    connected; on an older kernel the pid is opened, and kept only if that process still has the
    peer's uid (the pid may have been reused since it connected, though not by that user's ends)."""
    try:
        return sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError:
        pass
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return -1
    try:
        if os.stat(f"/proc/{pid}").st_uid == uid and alive(pidfd):
            return pidfd
    except OSError:
        pass
    os.close(pidfd)
    return -1
