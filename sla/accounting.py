"""GPU-fraction accounting: what a job was given against what it asked for, window by window.

A job's timeline is a list of segments, each a span of time and the devices the job's ranks held
usefully during it: its full request while it runs on as many devices as it asked for, fewer while
it runs shrunk (k ranks time-sliced on one device count 1/k each, so 4 ranks on 2 devices hold 2),
and 0 while it is pending after a preemption, checkpointing or restoring. The fraction of a window
is ∫ held / requested dt over the window, divided by the window's length; windows start at the
job's first eligibility and follow each other back to back (an hour by default), the last one
ending with the job. A tier's floor is met in a window when the fraction is at least the floor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

FLOORS = {"premium": 0.95, "standard": 0.70, "basic": 0.0}
"""The GPU fraction each tier is promised per window (basic: best effort)."""

WINDOW_S = 3600.0


class AccountingError(ValueError):
    """A timeline that cannot be accounted (overlapping or backwards segments, a bad request)."""


@dataclass(frozen=True)
class Segment:
    """From `start` to `end` (seconds), the job held `devices` devices usefully."""

    start: float
    end: float
    devices: float


@dataclass(frozen=True)
class Window:
    """One accounting window of a job: [start, end), the fraction delivered, and whether the
    tier's floor was met (`met` is None for a window still open)."""

    start: float
    end: float
    fraction: float
    met: bool | None


def check(segments: Sequence[Segment], requested: float) -> None:
    if not (requested > 0 and math.isfinite(requested)):
        raise AccountingError(f"requested devices must be a positive number, not {requested!r}")
    last_end = -math.inf
    for i, seg in enumerate(segments):
        if not (math.isfinite(seg.start) and math.isfinite(seg.end)) or seg.end < seg.start:
            raise AccountingError(f"segment {i} runs backwards or is not finite: {seg}")
        if seg.start < last_end:
            raise AccountingError(f"segment {i} ({seg.start}..{seg.end}) overlaps the one before it, "
                                  f"which ends at {last_end}")
        if seg.devices < 0 or seg.devices > requested + 1e-9:
            raise AccountingError(f"segment {i} holds {seg.devices} devices; the job asked for {requested}")
        last_end = seg.end


def delivered(segments: Iterable[Segment], requested: float, start: float, end: float) -> float:
    """∫ held / requested dt over [start, end): device-fraction seconds."""
    total = 0.0
    for seg in segments:
        overlap = min(seg.end, end) - max(seg.start, start)
        if overlap > 0:
            total += overlap * seg.devices / requested
    return total


def windows(segments: Sequence[Segment], requested: float, eligible_at: float, until: float,
            floor: float, window: float = WINDOW_S, ended: bool = True) -> list[Window]:
    """The job's windows from `eligible_at` to `until` (its end, or now for a job still running:
    `ended=False` leaves the last window open, its `met` None)."""
    check(segments, requested)
    if not window > 0:
        raise AccountingError(f"the window must be a positive number of seconds, not {window!r}")
    out = []
    start = eligible_at
    while start < until:
        end = min(start + window, until)
        length = end - start
        fraction = delivered(segments, requested, start, end) / length
        closed = ended or end < until or length >= window
        out.append(Window(start, end, round(fraction, 6), (fraction + 1e-9 >= floor) if closed else None))
        start = end
    return out


def slack(segments: Sequence[Segment], requested: float, window_start: float, now: float, floor: float,
          window: float = WINDOW_S) -> float:
    """Seconds of full-size running the job may still lose in its current window and meet its floor
    (negative: the floor can no longer be met): what it has had, plus the rest of the window at full
    size, less what the floor asks for."""
    had = delivered(segments, requested, window_start, now)
    rest = max(window_start + window - now, 0.0)
    return had + rest - floor * window


def attainment(all_windows: Iterable[Window]) -> float | None:
    """The share of job time, over closed windows, in windows that met their floor: a job's last,
    shorter window weighs what it lasted (None: no closed window)."""
    closed = [w for w in all_windows if w.met is not None and w.end > w.start]
    total = sum(w.end - w.start for w in closed)
    if not total:
        return None
    return sum(w.end - w.start for w in closed if w.met) / total


STOPPING_REASONS = frozenset({"preempt", "migrate", "resize", "requeue", "drain"})
"""Checkpoint reasons after which the tree stays stopped (for records that do not say)."""


def segments_from_events(events: Iterable[dict], requested: float,
                         known_from: float | None = None) -> list[Segment]:
    """A job's timeline from its registry events (each with `event`, `node`, `time`):

    - `running` (node, devices): from then the node's trees run on `devices`;
    - `checkpoint` (node, seconds, stop, dump_seconds, frozen_seconds, cut_seconds): the tree stops
      when criu freezes it, `frozen_seconds` before its dump ended (`dump_seconds` after the
      checkpoint began, `seconds` before `time`), or where criu's figure is missing when the
      checkpoint began; a distributed job's ranks stop earlier, when they began to reach their cut
      (`cut_seconds` before their wait for dump slots, `waited_seconds` before the checkpoint
      began), and wait there until every rank's image is committed (`time`); a tree frozen while it
      waited for a dump slot (`waited_frozen`) stopped `waited_seconds` before the checkpoint
      began; a stopping one ends the node's running there, another only until its dump ended (a
      distributed job's: until its commit);
    - `node_start`, `node_end`: the node's running ends (a new allocation, the job's end there); in a
      job with no `running` event at all (its script never ran `singularityctl run`), a node's
      start begins its running, on its `gpus` (or 1).

    `known_from`: where the events begin after older ones were dropped (the registry keeps the last
    MAX_EVENTS), the state then is unknown: every node the events name is taken as running on all
    `requested` devices from that time, until an event says otherwise.

    The devices of all nodes add up, at most `requested`; the result is back to back, merged."""
    per_node: dict[str, list[tuple[float, float, float]]] = {}
    open_: dict[str, tuple[float, float]] = {}  # node -> (since, devices)
    gaps: list[tuple[float, float, str]] = []

    def close(node: str, at: float) -> None:
        if node in open_:
            since, devices = open_.pop(node)
            if at > since:
                per_node.setdefault(node, []).append((since, at, devices))

    timed = sorted((e for e in events if isinstance(e.get("time"), int | float)), key=lambda e: e["time"])
    if known_from is not None:
        for node in sorted({str(e.get("node")) for e in timed}):
            open_[node] = (known_from, float(requested))
    # a job that never ran `singularityctl run` holds its allocation from each node's start to its end
    plain = not any(e.get("event") == "running" for e in timed)
    for event in timed:
        node, at, kind = str(event.get("node")), float(event["time"]), event.get("event")
        if kind == "node_start" and plain:
            close(node, at)
            gpus = event.get("gpus")
            open_[node] = (at, float(gpus) if isinstance(gpus, int | float) and gpus > 0 else 1.0)
        elif kind == "running":
            close(node, at)
            devices = event.get("devices")
            open_[node] = (at, float(devices) if isinstance(devices, int | float) and devices > 0 else 1.0)
        elif kind == "checkpoint":
            began = at - _seconds(event, "seconds")
            dumped = began + _seconds(event, "dump_seconds")  # criu's dump ended
            frozen = event.get("frozen_seconds")
            # the tree stopped running when criu froze it (its own figure), else when the checkpoint began
            freeze = max(dumped - float(frozen), began) if isinstance(frozen, int | float) and frozen >= 0 \
                else began
            waited = _seconds(event, "waited_seconds")
            if event.get("cut_seconds") is not None:
                # the ranks park at the cut, wait there for their dump slots, and resume once every
                # rank's image is committed
                freeze, dumped = began - waited - _seconds(event, "cut_seconds"), max(at, dumped)
            elif event.get("waited_frozen") is True:
                freeze = min(freeze, began - waited)
            stop = event.get("stop")
            if stop is None:
                stop = event.get("reason") in STOPPING_REASONS
            if stop:
                close(node, freeze)
            elif dumped > freeze:
                gaps.append((freeze, dumped, node))
        elif kind in ("node_start", "node_end"):
            close(node, at)
    # a node still running is counted until the caller's `until`
    for node, (since, devices) in open_.items():
        per_node.setdefault(node, []).append((since, math.inf, devices))

    cuts: dict[float, float] = {}  # time -> change in devices
    for node, spans in per_node.items():
        node_gaps = sorted((a, b) for a, b, n in gaps if n == node)
        for start, end, devices in spans:
            for piece_start, piece_end in _minus(start, end, node_gaps):
                cuts[piece_start] = cuts.get(piece_start, 0.0) + devices
                cuts[piece_end] = cuts.get(piece_end, 0.0) - devices
    segments: list[Segment] = []
    level, last = 0.0, None
    for at in sorted(cuts):
        if last is not None and at > last and level > 1e-9:
            held = min(level, requested)
            if segments and segments[-1].end == last and segments[-1].devices == held:
                segments[-1] = Segment(segments[-1].start, at, held)
            else:
                segments.append(Segment(last, at, held))
        level += cuts[at]
        last = at
    return segments


def _seconds(event: dict, name: str) -> float:
    value = event.get(name)
    return max(float(value), 0.0) if isinstance(value, int | float) else 0.0


def _minus(start: float, end: float, gaps: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """[start, end) less the (sorted) gaps."""
    pieces, at = [], start
    for gap_start, gap_end in gaps:
        if gap_end <= at or gap_start >= end:
            continue
        if gap_start > at:
            pieces.append((at, gap_start))
        at = max(at, gap_end)
    if at < end:
        pieces.append((at, end))
    return pieces


def clip(segments: Sequence[Segment], until: float) -> list[Segment]:
    """The segments up to `until` (a job still running: now)."""
    return [Segment(s.start, min(s.end, until), s.devices) for s in segments if s.start < until]
