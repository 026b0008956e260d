"""A job's SLA accounting from its registry record: what `singularityctl sla` shows (pure)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from .accounting import FLOORS, Segment, Window, attainment, clip, segments_from_events, windows

MAX_WINDOWS = 10_000
"""Windows accounted per job at most (its latest ones): a bound on the work one record costs."""


@dataclass(frozen=True)
class JobSla:
    job_id: int
    user: str | None
    tier: str
    floor: float
    requested: float  # the devices the fractions are of
    eligible_at: float
    until: float  # the job's end, or now
    ended: bool
    windows: tuple[Window, ...]

    @property
    def violations(self) -> int:
        return sum(1 for w in self.windows if w.met is False)

    @property
    def attainment(self) -> float | None:
        return attainment(self.windows)

    @property
    def fraction(self) -> float | None:
        """Over the job's whole life so far."""
        total = sum(w.end - w.start for w in self.windows)
        return sum(w.fraction * (w.end - w.start) for w in self.windows) / total if total else None


def job_sla(record: dict, now: float | None = None, window: float = 3600.0) -> JobSla | None:
    """The accounting of one registry record (Registry.job); None for a job without a tier."""
    tier = record.get("tier")
    if tier not in FLOORS:
        return None
    events = record.get("events") or []
    requested = record.get("requested_devices") or _first_devices(events) or 1
    eligible = next((record[k] for k in ("eligible_at", "first_started_at") if record.get(k) is not None),
                    None)
    if eligible is None:
        eligible = _first_time(events)
    ended = record.get("ended_at") is not None
    until = record["ended_at"] if ended else (time.time() if now is None else now)
    if eligible is not None and (until - eligible) / window > MAX_WINDOWS:
        # a job older than MAX_WINDOWS windows: its latest ones, on the same grid
        eligible += (math.ceil((until - eligible) / window) - MAX_WINDOWS) * window
    if eligible is None or until <= eligible:
        spans: list[Window] = []
    else:
        # Where older events were dropped (the registry keeps a job's last MAX_EVENTS), what came
        # before the oldest one left, and the state then, count as full service: a job that floods
        # its own history with events looks better served, never starved, and gains no protection.
        oldest = _first_time(events) if record.get("events_dropped") else None
        segments = [s for s in clip(segments_from_events(events, requested, known_from=oldest), until)
                    if s.end > eligible]
        segments = [Segment(max(s.start, eligible), s.end, s.devices) for s in segments]
        if oldest is not None and oldest > eligible:
            segments = [Segment(eligible, min(oldest, until), float(requested)), *segments]
        spans = windows(segments, requested, eligible, until, FLOORS[tier], window, ended=ended)
    return JobSla(int(record["job_id"]), record.get("user"), tier, FLOORS[tier], float(requested),
                  float(until if eligible is None else eligible), float(until), ended, tuple(spans))


def _first_devices(events: Sequence[dict]) -> int:
    """The devices of the job's first start, where Slurm's request was not recorded."""
    first = [e for e in events if e.get("event") == "node_start"]
    if not first:
        return 0
    restart = first[0].get("restart_count")
    return sum(int(e.get("gpus") or 1) for e in first if e.get("restart_count") == restart) or 0


def _first_time(events: Sequence[dict]) -> float | None:
    times = [e["time"] for e in events if isinstance(e.get("time"), int | float)]
    return min(times) if times else None


def to_json(sla: JobSla) -> dict:
    return {
        "job_id": sla.job_id, "user": sla.user, "tier": sla.tier, "floor": sla.floor,
        "requested_devices": sla.requested, "eligible_at": sla.eligible_at, "until": sla.until,
        "ended": sla.ended, "fraction": _round(sla.fraction), "attainment": _round(sla.attainment),
        "violations": sla.violations, "windows": [asdict(w) for w in sla.windows],
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _clock(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


def format_table(jobs: Sequence[JobSla]) -> str:
    """One line per job, and per tier the share of job time meeting its floor."""
    rows = [f"{'JOBID':>8}  {'USER':10} {'TIER':9} {'FLOOR':>5}  {'DEVICES':>7}  {'WINDOWS':>7}  "
            f"{'FRACTION':>8}  {'MET':>5}  VIOLATIONS"]
    for j in jobs:
        floor = "-" if j.floor <= 0 else f"{j.floor:.2f}"
        rows.append(f"{j.job_id:>8}  {(j.user or '?')[:10]:10} {j.tier:9} {floor:>5}  {j.requested:>7g}  "
                    f"{len(j.windows):>7}  {_share(j.fraction):>8}  {_share(j.attainment):>5}  "
                    f"{j.violations or '-'}")
    rows.append("")
    for tier, floor in FLOORS.items():
        of_tier = [w for j in jobs if j.tier == tier for w in j.windows]
        if of_tier:
            rows.append(f"{tier}: {_share(attainment(of_tier))} of closed job time met "
                        f"{'its floor ' + format(floor, '.2f') if floor > 0 else 'best effort'}")
    return "\n".join(rows).rstrip()


def format_windows(sla: JobSla) -> str:
    """One job's windows, violations marked."""
    floor = "best effort" if sla.floor <= 0 else f"floor {sla.floor:.2f}"
    lines = [f"job {sla.job_id} ({sla.user or '?'}), {sla.tier} ({floor}), "
             f"{sla.requested:g} device(s), {'ended' if sla.ended else 'running or pending'}",
             f"  {'WINDOW START':19}  {'END':19}  {'FRACTION':>8}  MET"]
    for w in sla.windows:
        met = "open" if w.met is None else ("yes" if w.met else "VIOLATED")
        lines.append(f"  {_clock(w.start):19}  {_clock(w.end):19}  {w.fraction:>8.3f}  {met}")
    if not sla.windows:
        lines.append("  (no window yet)")
    lines.append(f"  over its life: {_share(sla.fraction)}; "
                 f"windows meeting the floor: {_share(sla.attainment)}")
    return "\n".join(lines)
