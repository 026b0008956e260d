"""The node's dump slots: how many checkpoints one node dumps and stores at once, and in what order.

When several jobs of a node are preempted at once, their dumps share the node's disk and cores.
All at once, each takes as long as all of them together, and the one whose kill comes first is
no sooner done than the last. So a node runs at most `preemption.concurrent_dumps` of them at
once (0: no limit); the others wait, earliest deadline first (a preemption's deadline: its
warning's time + `preemption.warn_time`, when Slurm kills the job; a checkpoint without one, a
periodic checkpoint, goes after every one that has a deadline), then in the order they came.
Each checkpoint's summary says how long it waited (`waited_s`), and the job's output says it too.
A checkpoint may bring a `pause` that holds its tree still while it waits (the agent freezes a
stopping tree's cgroup: jobs that only wait then leave the cores to the dumps that are due).

The slots are a folder of root's in the node's spool (spool_dir/<node>/dump-slots): the agents
of the node's jobs are separate processes. A checkpoint that wants a slot binds a datagram socket
named for its ticket in `waiting/`; taking a slot renames it to `holding/`; giving it back
removes it and sends a byte to every waiting socket, which then look again. All of that happens
under `gate.lock` (flock). A ticket names its agent's pid and start time: the ticket of an agent
that died (killed in the middle of a dump) is seen dead by the next one to look, and removed;
waiters look again every LIVENESS_S in case a holder died without a word. No one else can write
in the folder, so a job's user can neither queue nor wake anything.

Pure: `Ticket`, `time_left`, `deadline_ms`, `admitted`. I/O: `DumpGate`.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import re
import select
import socket
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from singularity_slurm.errors import CheckpointError
from singularity_slurm.node.services import proc_start_time

LOG = logging.getLogger("singularity.dumpgate")

LIVENESS_S = 1.0
"""How often a waiting checkpoint looks again without being woken: only for a holder that died."""

NO_DEADLINE_MS = 10**13 - 1
"""The deadline of a checkpoint without one (13 digits of milliseconds: far beyond any uptime)."""


_TICKET = re.compile(r"[0-9]{1,20}(?:-[0-9]{1,20}){5}")


@dataclass(frozen=True, order=True)
class Ticket:
    """A checkpoint's place in the node's queue; tickets sort in the order slots are given.

    `deadline_ms`: CLOCK_MONOTONIC milliseconds (one clock for every process of the host) by
    which the checkpoint must be done; `arrived_ns`: when it asked."""

    deadline_ms: int
    arrived_ns: int
    job_id: int
    tree: int
    pid: int
    start: int  # the agent's start time (clock ticks since boot): a pid reused later is not it

    @property
    def name(self) -> str:
        return f"{self.deadline_ms:013d}-{self.arrived_ns}-{self.job_id}-{self.tree}-{self.pid}-{self.start}"

    @classmethod
    def parse(cls, name: str) -> Ticket | None:
        """The ticket a file name stands for; None for a name no ticket has."""
        if not _TICKET.fullmatch(name):
            return None
        return cls(*(int(p) for p in name.split("-")))


def deadline_ms(now_s: float, within_s: float | None) -> int:
    """A checkpoint's deadline on the monotonic clock `now_s`; `within_s` None: it has none."""
    if within_s is None or not math.isfinite(within_s):
        return NO_DEADLINE_MS
    return min(NO_DEADLINE_MS - 1, int((now_s + max(within_s, 0.0)) * 1000))


def time_left(preempted_at: float | None, stop: bool, warn_time: int, now: float) -> float | None:
    """Seconds left at Unix time `now` for a checkpoint: one that keeps the job running has no
    deadline (None); a stopping one of a job Slurm is preempting (since `preempted_at`, Slurm's
    PreemptTime) must be done `warn_time` after the preemption began (`warn_time` <= GraceTime, as
    `admin check` verifies); any other stopping one (scontrol requeue, a migration, a resize)
    `warn_time` from now. The deadline comes from Slurm, never from the request: its sender is the
    job's user, who could put its dumps ahead of every other job's on the node."""
    if not stop:
        return None
    if preempted_at is None:
        return float(warn_time)
    return max(0.0, preempted_at + warn_time - now)


def admitted(me: Ticket, waiting: Sequence[Ticket], holding: int, slots: int) -> bool:
    """Whether `me`, one of `waiting`, takes a slot now, `holding` of the `slots` being taken
    (slots 0: no limit). The earliest tickets take the free slots."""
    if slots <= 0:
        return True
    free = slots - holding
    return free > 0 and me in sorted(waiting)[:free]


def _alive(ticket: Ticket) -> bool:
    return proc_start_time(ticket.pid) == ticket.start


class DumpGate:
    """The dump slots of one node (see the module's text). `folder` makes (where missing) and
    returns their folder, one of root's that no one else may write, as the spool's are."""

    def __init__(self, folder: Callable[[], Path], slots: int, liveness_s: float = LIVENESS_S,
                 clock: Callable[[], float] = time.monotonic):
        self.folder = folder
        self.slots = slots
        self.liveness_s = liveness_s
        self.clock = clock

    def _open(self) -> tuple[int, int, int]:
        """(folder, waiting/, holding/) as descriptors, made where missing and checked as root's."""
        fds: list[int] = []
        try:
            folder = self.folder()
            for path in (folder, folder / "waiting", folder / "holding"):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path, 0o700)
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
                fds.append(fd)
                info = os.fstat(fd)
                if info.st_uid != os.geteuid() or info.st_mode & 0o022:
                    raise CheckpointError(f"the dump slots' folder {path} is not root's alone (owner uid "
                                          f"{info.st_uid}, mode {stat.S_IMODE(info.st_mode):o}): remove it")
        except (OSError, CheckpointError) as exc:
            for fd in fds:
                os.close(fd)
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"cannot open the node's dump slots: {exc}") from exc
        return fds[0], fds[1], fds[2]

    @contextlib.contextmanager
    def slot(self, job_id: int, tree: int, within_s: float | None,
             pause: Callable[[], contextlib.AbstractContextManager] | None = None) -> Iterator[float]:
        """Hold one of the node's slots for the body; yields the seconds waited for it. `pause`:
        what holds the tree still while it has to wait (entered once the first look finds no slot
        free, left when its slot is taken, before the body)."""
        if self.slots <= 0:
            yield 0.0
            return
        asked = self.clock()
        me = Ticket(deadline_ms(asked, within_s), time.monotonic_ns(), job_id, tree, os.getpid(),
                    proc_start_time(os.getpid()) or 0)
        top, waiting, holding = self._open()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        lock: int | None = None
        held = False
        try:
            try:
                lock = os.open("gate.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                               dir_fd=top)
                # Bound through the folder's descriptor: a socket path is at most 107 bytes.
                sock.bind(f"/proc/self/fd/{waiting}/{me.name}")
                sock.setblocking(False)
                with contextlib.ExitStack() as paused:
                    hold = (lambda: paused.enter_context(pause())) if pause is not None else None
                    taken = self._wait(me, sock, lock, waiting, holding, hold)
                    held = True
                waited = taken - asked
            except OSError as exc:
                raise CheckpointError(f"cannot take one of the node's dump slots: {exc}") from exc
            if waited >= 0.05:
                LOG.info("job %s tree %s: a dump slot after %.2fs", job_id, tree, waited)
            yield waited
        finally:
            if lock is not None:
                try:
                    with self._locked(lock):
                        os.unlink(me.name, dir_fd=holding if held else waiting)
                        self._wake(waiting)
                except OSError as exc:  # the next one to look removes a dead agent's ticket
                    LOG.warning("job %s tree %s: dump slot not given back cleanly: %s", job_id, tree, exc)
                os.close(lock)
            sock.close()
            for fd in (holding, waiting, top):
                os.close(fd)

    @contextlib.contextmanager
    def _locked(self, lock: int) -> Iterator[None]:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)

    def _tickets(self, folder: int) -> list[Ticket]:
        """The live tickets in `folder` (a descriptor); dead ones and strangers are removed."""
        found = []
        for name in os.listdir(folder):
            ticket = Ticket.parse(name)
            if ticket is not None and _alive(ticket):
                found.append(ticket)
                continue
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(name, dir_fd=folder)
        return found

    def _wait(self, me: Ticket, sock: socket.socket, lock: int, waiting: int, holding: int,
              hold: Callable[[], object] | None = None) -> float:
        """Wait for `me`'s turn and take its slot; returns the clock's time then. `hold` is called
        once, when the first look finds no slot for `me`."""
        first = True
        while True:
            with self._locked(lock):
                queue = self._tickets(waiting)
                if me not in queue:  # only a stranger could have removed it: the folder is not root's alone
                    raise CheckpointError("this checkpoint's ticket left the node's dump slots' queue")
                if admitted(me, queue, len(self._tickets(holding)), self.slots):
                    os.rename(me.name, me.name, src_dir_fd=waiting, dst_dir_fd=holding)
                    return self.clock()
            if first and hold is not None:
                hold()
            first = False
            select.select([sock], [], [], self.liveness_s)
            with contextlib.suppress(BlockingIOError):
                while True:
                    sock.recv(16)

    def _wake(self, waiting: int) -> None:
        """A byte to every waiting checkpoint: a slot may be free (called under the gate's lock)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as out:
            out.setblocking(False)
            for name in os.listdir(waiting):
                if Ticket.parse(name) is None:
                    continue
                # A full queue (EAGAIN) is woken already; a closed one (ECONNREFUSED) is dead.
                with contextlib.suppress(OSError):
                    out.sendto(b"w", f"/proc/self/fd/{waiting}/{name}")
