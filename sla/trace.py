"""Job traces for the simulator: one CSV row per job.

Columns (a header row names them; their order is free, other columns are ignored):

    job_id      any text, unique in the trace
    submit_s    seconds from the start of the trace at which the job is submitted (>= 0)
    duration_s  how long the job runs on its full request, undisturbed (> 0)
    gpus        devices the job asks for (a whole number >= 1)
    tier        premium | standard | basic
    min_gpus    (optional) the fewest devices the job may run on, time-sliced: an elastic job's floor
                (default: gpus, not elastic)
    checkpoint_s  (optional) this job's checkpoint: seconds from a preemption or resize until its
                devices are free (default: the simulator's --checkpoint-s)
    restore_s   (optional) this job's restore: seconds from a restart until it runs again (default:
                the simulator's --restore-s)

A job that runs on fewer devices than it asked for progresses at held/requested of its full speed.
Checkpoint and restore costs grow with a job's memory: a trace measured on a real cluster (as the
dev cluster's SLA test measures one) gives each job its own.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .accounting import FLOORS

REQUIRED = ("job_id", "submit_s", "duration_s", "gpus", "tier")


class TraceError(ValueError):
    """A trace that cannot be simulated; the message names the file, the line and the fix."""


@dataclass(frozen=True)
class TraceJob:
    job_id: str
    submit: float
    duration: float
    gpus: int
    tier: str
    min_gpus: int
    checkpoint_s: float | None = None  # None: the simulation's
    restore_s: float | None = None

    @property
    def elastic(self) -> bool:
        return self.min_gpus < self.gpus


def read(path: Path) -> list[TraceJob]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise TraceError(f"cannot read the trace {path}: {exc.strerror or exc}") from exc
    return parse(text, str(path))


def parse(text: str, name: str = "<trace>") -> list[TraceJob]:
    """The jobs of a CSV trace, in submission order (ties in the file's order)."""
    reader = csv.DictReader(io.StringIO(text))
    header = reader.fieldnames or []
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise TraceError(f"{name}:1: the header lacks column(s) {', '.join(missing)}; a trace needs "
                         f"{', '.join(REQUIRED)} (and optionally min_gpus, checkpoint_s, restore_s)")
    jobs = []
    seen: dict[str, int] = {}
    for row in reader:
        line = reader.line_num
        jobs.append(_job(row, f"{name}:{line}", seen, line))
    return sorted(jobs, key=lambda j: j.submit)


def _job(row: dict, where: str, seen: dict[str, int], line: int) -> TraceJob:
    job_id = (row.get("job_id") or "").strip()
    if not job_id:
        raise TraceError(f"{where}: job_id is empty")
    if job_id in seen:
        raise TraceError(f"{where}: job_id {job_id!r} is on line {seen[job_id]} already")
    seen[job_id] = line
    submit = _number(row, "submit_s", where)
    if submit < 0:
        raise TraceError(f"{where}: submit_s is negative ({submit:g}); times count from the trace's start")
    duration = _number(row, "duration_s", where)
    if duration <= 0:
        raise TraceError(f"{where}: duration_s must be positive, not {duration:g}")
    gpus = _count(row, "gpus", where)
    tier = (row.get("tier") or "").strip()
    if tier not in FLOORS:
        raise TraceError(f"{where}: unknown tier {tier!r}; valid tiers: {', '.join(FLOORS)}")
    min_gpus = _count(row, "min_gpus", where) if (row.get("min_gpus") or "").strip() else gpus
    if min_gpus > gpus:
        raise TraceError(f"{where}: min_gpus ({min_gpus}) is more than gpus ({gpus})")
    costs = []
    for column in ("checkpoint_s", "restore_s"):
        value = _number(row, column, where) if (row.get(column) or "").strip() else None
        if value is not None and value < 0:
            raise TraceError(f"{where}: {column} is negative ({value:g}); a cost is 0 seconds or more")
        costs.append(value)
    return TraceJob(job_id, submit, duration, gpus, tier, min_gpus, *costs)


def _number(row: dict, column: str, where: str) -> float:
    raw = (row.get(column) or "").strip()
    try:
        value = float(raw)
    except ValueError:
        raise TraceError(f"{where}: {column} is not a number: {raw!r}") from None
    if not math.isfinite(value):
        raise TraceError(f"{where}: {column} is not finite: {raw!r}")
    return value


def _count(row: dict, column: str, where: str) -> int:
    raw = (row.get(column) or "").strip()
    if not raw.isdigit() or int(raw) < 1:
        raise TraceError(f"{where}: {column} must be a whole number of devices >= 1, not {raw!r}")
    return int(raw)


def write(jobs: Iterable[TraceJob]) -> str:
    """The CSV text of `jobs` (what `parse` reads back)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    jobs = list(jobs)
    costs = any(j.checkpoint_s is not None or j.restore_s is not None for j in jobs)
    writer.writerow([*REQUIRED, "min_gpus", *(("checkpoint_s", "restore_s") if costs else ())])
    for j in jobs:
        row = [j.job_id, _seconds(j.submit), _seconds(j.duration), j.gpus, j.tier, j.min_gpus]
        if costs:
            row += ["" if v is None else _seconds(v) for v in (j.checkpoint_s, j.restore_s)]
        writer.writerow(row)
    return out.getvalue()


def _seconds(value: float) -> str:
    """A number of seconds, exactly (what `float` reads back), without a trailing `.0`."""
    return str(int(value)) if value == int(value) else repr(float(value))
