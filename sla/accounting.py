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
