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

  4. AUDIT: a send completes once the receiving proxy has the message, so a receiver can park on an
     earlier operation of another channel before it reaches the receive (a ring exchange). With the
     PARKED messages the proxies report, per point-to-point channel, the sends and receives their
     ranks completed and where each parked rank stopped. Where a message is still undelivered, the
     leader raises the target of the operation its receiver is parked on (`refine`), those ranks run
     on, and the round repeats until every message sent was received.
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


def parse_p2p(channel: str) -> tuple[str, int, int] | None:
    """(communicator, source, destination) of a point-to-point channel; None for a collective one."""
    comm, sep, pair = channel.rpartition("|")
    if not sep:
        return None
    src, _, dst = pair.partition(">")
    return comm, int(src), int(dst)


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


def refine(targets: Mapping[str, int], audits: Iterable[Mapping]) -> dict[str, int] | None:
    """Raised targets that let receivers take their undelivered messages, or None if there are none.

    An audit (one per proxy) is {"sent": {channel: n}, "received": {channel: n}, "parked": [{"op":
    [channel, seq], "dst_of": [[comm, group rank], ...]}]}: completed point-to-point operations by
    role, and for each parked rank its parked operation and the (communicator, rank) it receives as.
    A message whose receiver finished (or is parked where no target can help) stays undelivered: it
    would never have been received.
    """
    audits = list(audits)
    sent: dict[str, int] = {}
    received: dict[str, int] = {}
    for audit in audits:
        for channel, n in audit.get("sent", {}).items():
            sent[channel] = sent.get(channel, 0) + int(n)
        for channel, n in audit.get("received", {}).items():
            received[channel] = received.get(channel, 0) + int(n)
    raised = dict(targets)
    for channel, n in sent.items():
        parsed = parse_p2p(channel)
        if parsed is None or n <= received.get(channel, 0):
            continue
        comm, _, dst = parsed
        for audit in audits:
            for parked in audit.get("parked", []):
                if [comm, dst] in [list(x) for x in parked.get("dst_of", [])]:
                    op_channel, seq = parked["op"]
                    raised[op_channel] = max(raised.get(op_channel, 0), int(seq))
    return raised if raised != dict(targets) else None


class Round:
    """The leader's view of one barrier round."""

    def __init__(self, proxies: Iterable[str]):
        self.proxies = frozenset(proxies)
        self.reports: dict[str, dict[str, int]] = {}
        self.parked: set[str] = set()
        self.audits: dict[str, Mapping] = {}
        self.targets: dict[str, int] | None = None

    def report(self, proxy: str, maxima: Mapping[str, int]) -> dict[str, int] | None:
        """Record a DRAIN report; the targets once every proxy has reported, else None."""
        self.reports[proxy] = dict(maxima)
        if self.targets is None and self.proxies <= set(self.reports):
            self.targets = cut_targets(self.reports.values())
            return self.targets
        return None

    def park(self, proxy: str, audit: Mapping | None = None) -> bool:
        """Record a PARKED message; True once every proxy has parked."""
        self.parked.add(proxy)
        if audit is not None:
            self.audits[proxy] = audit
        return self.proxies <= self.parked

    def settle(self) -> dict[str, int] | None:
        """Once every proxy parked: new targets if messages are undelivered (the round goes on and
        waits for every proxy to park again), None when the cut is reached."""
        raised = refine(self.targets or {}, self.audits.values())
        if raised is not None:
            self.targets = raised
            self.parked.clear()
            self.audits.clear()
        return raised
