"""The transparent distributed barrier: decisions as pure functions of plain data.

A job's workers issue operations on channels: one channel per communicator for collectives, and one
per (communicator, source, destination) for point-to-point messages. Every member of a channel issues
the same sequence of operations on it. A checkpoint needs a cut where, on every channel, every member
has completed the same number of operations and none is in flight.

The round, run by the leader proxy (the one serving rank 0):
  1. DRAIN: every proxy holds new operations and reports, per channel, the highest sequence number
     any of its ranks has issued.
  2. CUT: the target of a channel is the highest number reported for it. Proxies run held and new
     operations up to their channel's target and answer the next one with `park`: the worker drops
     its connection and waits. An operation issued before the drain has a number at or below the
     target, so everything in flight completes; the first operation past the target on any channel
     is where each rank stops.
  3. PARKED: when every rank of a proxy is parked (or finished), it says so; when all have, the cut
     is reached and the node agents dump.
Ranks that are behind (a slow rank 0) simply catch up to the target before they park: the cut is
within one step of the request, wherever each rank was.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping


class Phase(enum.StrEnum):
    """A proxy's barrier phase.

    RUNNING -> DRAINING (leader's DRAIN) -> CUTTING (leader's CUT) -> PARKED (leader's CUT_DONE)
    PARKED -> RUNNING (the node agent's resume, after the dump)
    DRAINING | CUTTING -> RUNNING (ABORT: the cut was not reached in time)
    """

    RUNNING = "running"
    DRAINING = "draining"
    CUTTING = "cutting"
    PARKED = "parked"


class Gate(enum.StrEnum):
    RUN = "run"
    HOLD = "hold"
    PARK = "park"


def collective_channel(comm: str) -> str:
    return comm


def p2p_channel(comm: str, src: int, dst: int) -> str:
    return f"{comm}|{src}>{dst}"


def gate(phase: Phase, seq: int, target: int) -> Gate:
    """What to do with operation number `seq` (1-based) of a channel whose cut target is `target`
    (0 for a channel nobody had used when the cut was set)."""
    if phase == Phase.RUNNING:
        return Gate.RUN
    if phase == Phase.DRAINING:
        return Gate.HOLD
    if phase == Phase.CUTTING and seq <= target:
        return Gate.RUN
    return Gate.PARK


def local_maxima(issued: Mapping[int, Mapping[str, int]]) -> dict[str, int]:
    """Per channel, the highest sequence number any of a proxy's ranks issued: {rank: {channel: n}}."""
    out: dict[str, int] = {}
    for channels in issued.values():
        for channel, n in channels.items():
            out[channel] = max(out.get(channel, 0), n)
    return out


def cut_targets(reports: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """The cut: per channel, the highest number any proxy reported."""
    targets: dict[str, int] = {}
    for report in reports:
        for channel, n in report.items():
            targets[channel] = max(targets.get(channel, 0), int(n))
    return targets


def parked(states: Mapping[int, str]) -> bool:
    """Whether a proxy's ranks ({rank: "parked" | "finished" | "busy" | "absent"}) are all at rest."""
    return all(state in ("parked", "finished") for state in states.values())


class Round:
    """The leader's view of one barrier round."""

    def __init__(self, proxies: Iterable[str]):
        self.proxies = frozenset(proxies)
        self.reports: dict[str, dict[str, int]] = {}
        self.parked: set[str] = set()
        self.targets: dict[str, int] | None = None

    def report(self, proxy: str, maxima: Mapping[str, int]) -> dict[str, int] | None:
        """Record a DRAIN report; the targets once every proxy has reported, else None."""
        self.reports[proxy] = dict(maxima)
        if self.targets is None and self.proxies <= set(self.reports):
            self.targets = cut_targets(self.reports.values())
            return self.targets
        return None

    def park(self, proxy: str) -> bool:
        """Record a PARKED message; True once every proxy has parked (the cut is reached)."""
        self.parked.add(proxy)
        return self.proxies <= self.parked
