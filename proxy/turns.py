"""Turns on a device: the ranks a proxy serves compute one at a time, switching at their collectives.

When a job has fewer devices than ranks, the ranks placed on one device share it. A GPU runs one
rank's kernels well, not several ranks' interleaved (their memory may not fit together, and their
kernels would contend), so they take turns, as in Singularity's time-slicing: a rank holds its
device's turn while it computes and hands it on where it synchronises with the other ranks, which is
every collective. The proxy keeps the turn; the worker makes every operation synchronous while its
device is shared, so "computing" is exactly "between two operations":

- a rank takes its first turn when it first says hello (the process group is created);
- each operation hands the turn on as it arrives at the proxy and takes it back before its answer
  goes out, so the rank resumes computing only once it holds the turn again;
- a rank parked at a checkpoint's cut holds no turn (it handed it on with the operation it parked
  on), nor does a rank that has gone (bye, or its connection closed).

A turn lapses when a rank holds it for `proxy.turn_lapse_s` without reaching a collective (it waits
for a file another rank of its device is to write, say, or has a long stretch of work of its own):
the turn goes on to the rank that waited longest while the holder runs on beside it, rather than
hang the others; the old holder takes turns again from its next collective on.

Turns keep going during a cut: a rank behind the cut's targets needs its turn to reach them.
Whoever waits longest is next (first come, first served), so no rank starves while the others
synchronise. The order of turns does not change any result: reductions add contributions in rank
order whoever arrived first.

`Turns` is the bookkeeping alone (no locks, no waiting); the proxy calls it under its lock.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field


class Slicing(enum.StrEnum):
    """`proxy.time_slicing`: how ranks that share a device run."""

    AUTO = "auto"  # turns where the device backend needs them (a GPU), at once on CPU slots
    TURNS = "turns"  # one rank at a time on every backend
    CONCURRENT = "concurrent"  # all at once (CPU slots: the OS shares the cores)


def takes_turns(mode: Slicing, exclusive_device: bool, ranks_on_device: int) -> bool:
    """Whether the ranks of one device take turns in a generation that puts `ranks_on_device` there."""
    if ranks_on_device < 2:
        return False
    if mode == Slicing.AUTO:
        return exclusive_device
    return mode == Slicing.TURNS


@dataclass
class Turns:
    """Who holds one device's turn, and who waits for it, in order."""

    holder: int | None = None
    waiting: deque[int] = field(default_factory=deque)
    handovers: int = 0  # how often the turn went from one rank to another
    lapses: int = 0  # how often a holder lost the turn for keeping it too long
    since: float = 0.0  # when the holder got the turn (the caller's clock)
    moving: bool = False  # the holder's GPU memory is being brought back (proxy.swap): its turn waits

    def request(self, rank: int, now: float = 0.0) -> bool:
        """`rank` wants the turn: True when it holds it now (it was free, or already its own)."""
        if self.holder == rank:
            return True
        if self.holder is None and not self.waiting:
            self.holder, self.since = rank, now
            return True
        if rank not in self.waiting:
            self.waiting.append(rank)
        return False

    def lapse_at(self, limit: float) -> float | None:
        """When the holder's turn lapses for the ranks waiting (None: nobody holds it, or its memory
        is still being brought back: its turn has not begun)."""
        return None if self.holder is None or self.moving else self.since + limit

    def begin(self, rank: int, now: float) -> None:
        """`rank`'s memory is back on the device: if it holds the turn, its time runs from `now`."""
        if self.holder == rank:
            self.moving, self.since = False, now

    def lapse(self, now: float) -> int | None:
        """The holder kept the turn too long: it runs on beside the others, and the turn goes to
        whoever waited longest, from `now` (the others wait on, in order). Returns the new holder."""
        if self.holder is None or not self.waiting:
            return None
        self.holder, self.since, self.moving = self.waiting.popleft(), now, False
        self.lapses += 1
        return self.holder

    def cancel(self, rank: int) -> None:
        """`rank` stops waiting (its session or generation is over)."""
        if rank in self.waiting:
            self.waiting.remove(rank)

    def holds(self, rank: int) -> bool:
        return self.holder == rank

    def release(self, rank: int, now: float = 0.0) -> int | None:
        """`rank` lets go of the turn, if it holds it: the turn goes to whoever waited longest.
        Returns the new holder (None when nobody waits, or `rank` did not hold it)."""
        if self.holder != rank:
            return None
        self.holder = self.waiting.popleft() if self.waiting else None
        self.since, self.moving = now, False
        if self.holder is not None:
            self.handovers += 1
        return self.holder

    def forget(self, rank: int, now: float = 0.0) -> int | None:
        """`rank` is gone: it neither holds nor waits for the turn any more. Returns the new holder
        when it held the turn."""
        self.cancel(rank)
        return self.release(rank, now)
