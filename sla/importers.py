"""Published GPU-cluster traces as simulator traces.

- `philly`: Microsoft Philly's `cluster_job_log` (msr-fiddle/philly-traces; a JSON list of jobs,
  each with `jobid`, `submitted_time` and `attempts`, each attempt with `start_time`, `end_time`
  and `detail` listing the GPUs it held). A job's run time is the sum of its attempts' lengths;
  its size, the GPUs of its last attempt. Jobs that never ran are left out.
- `philly-summary`: Philly's jobs one CSV line each (columns `timestamp`, the submission;
  `duration`, the run time in seconds; `num_gpus`; optionally `cluster`, the virtual cluster), as
  the Pollux artifact publishes the Philly trace (petuum/adaptdl, `simulator/traces/philly.csv`).
  Lines have no job id: a job is named by its virtual cluster, submission, run time and size (and
  a count among lines that say the same). Jobs with no GPU, or that never ran, are left out.
  `--cluster` keeps one virtual cluster's jobs.
- `helios`: SenseTime Helios's `cluster_log.csv` (S-Lab-System-Group/HeliosData; columns `job_id`,
  `gpu_num`, `submit_time`, and `duration` or `start_time`/`end_time`). Jobs with no GPU, or that
  never ran, are left out.

Neither trace has SLA tiers or elastic jobs: each job's tier (and whether it is elastic, down to a
quarter of its request) is drawn from a hash of its id, with the given shares, so that the same
trace always gives the same jobs. Times become seconds from the first submission.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
from collections.abc import Sequence
from datetime import UTC, datetime

from .trace import TraceError, TraceJob

FORMATS = ("csv", "philly", "philly-summary", "helios")
DEFAULT_SHARES = (("premium", 0.2), ("standard", 0.3), ("basic", 0.5))


def _draw(job_id: str, salt: str) -> float:
    """A number in [0, 1) that depends on the job's id only."""
    digest = hashlib.blake2b(f"{salt}:{job_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2 ** 64


def assign(job_id: str, gpus: int, shares: Sequence[tuple[str, float]] = DEFAULT_SHARES,
           elastic_share: float = 0.5) -> tuple[str, int]:
    """The tier and the fewest devices of a job from a trace that has neither."""
    total = sum(share for _, share in shares)
    point, tier = _draw(job_id, "tier") * total, shares[-1][0]
    for name, share in shares:
        if point < share:
            tier = name
            break
        point -= share
    min_gpus = gpus
    if gpus > 1 and tier != "premium" and _draw(job_id, "elastic") < elastic_share:
        min_gpus = max(1, gpus // 4)
    return tier, min_gpus


def _time(text: object, where: str) -> float:
    if not isinstance(text, str) or not text.strip():
        raise TraceError(f"{where}: no time given ({text!r})")
    try:
        seconds = float(text)  # some traces give Unix times
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds):
            raise TraceError(f"{where}: not a time: {text!r}")
        return seconds
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise TraceError(f"{where}: not a time: {text!r} (expected YYYY-MM-DD HH:MM:SS)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def _rebase(raw: list[tuple[str, float, float, int]], shares: Sequence[tuple[str, float]],
            elastic_share: float) -> list[TraceJob]:
    if not raw:
        return []
    first = min(submit for _, submit, _, _ in raw)
    jobs = []
    for job_id, submit, duration, gpus in raw:
        tier, min_gpus = assign(job_id, gpus, shares, elastic_share)
        jobs.append(TraceJob(job_id, round(submit - first, 3), duration, gpus, tier, min_gpus))
    return sorted(jobs, key=lambda j: j.submit)


def philly(text: str, name: str = "<philly trace>", shares: Sequence[tuple[str, float]] = DEFAULT_SHARES,
           elastic_share: float = 0.5) -> list[TraceJob]:
    try:
        entries = json.loads(text)
    except ValueError as exc:
        raise TraceError(f"{name}: not a Philly cluster_job_log (JSON list of jobs): {exc}") from None
    if not isinstance(entries, list):
        raise TraceError(f"{name}: not a Philly cluster_job_log: the top level is not a list of jobs")
    raw = []
    for index, entry in enumerate(entries):
        where = f"{name}: job {index}"
        if not isinstance(entry, dict) or not isinstance(entry.get("jobid"), str):
            raise TraceError(f"{where}: not a job entry with a `jobid`")
        where = f"{name}: job {entry['jobid']}"
        attempts = entry.get("attempts") or []
        if not isinstance(attempts, list):
            raise TraceError(f"{where}: `attempts` is not a list")
        ran, gpus = 0.0, 0
        for attempt in attempts:
            if not isinstance(attempt, dict) or not attempt.get("start_time") or not attempt.get("end_time"):
                continue  # an attempt that never started or never ended
            start, end = _time(attempt["start_time"], where), _time(attempt["end_time"], where)
            if end < start:
                raise TraceError(f"{where}: an attempt ends ({attempt['end_time']}) before it starts")
            ran += end - start
            detail = attempt.get("detail") or []
            gpus = sum(len(d.get("gpus") or []) for d in detail if isinstance(d, dict)) or gpus
        if ran <= 0 or gpus <= 0:
            continue
        raw.append((entry["jobid"], _time(entry.get("submitted_time"), where), ran, gpus))
    return _rebase(raw, shares, elastic_share)


def philly_summary(text: str, name: str = "<philly summary>",
                   shares: Sequence[tuple[str, float]] = DEFAULT_SHARES, elastic_share: float = 0.5,
                   cluster: str | None = None) -> list[TraceJob]:
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in ("timestamp", "duration", "num_gpus") if c not in (reader.fieldnames or [])]
    if missing:
        raise TraceError(f"{name}:1: not a Philly job summary: it needs timestamp, duration and num_gpus; "
                         f"missing {', '.join(missing)}")
    raw = []
    seen: dict[str, int] = {}
    for row in reader:
        where = f"{name}:{reader.line_num}"
        if cluster is not None and (row.get("cluster") or "").strip() != cluster:
            continue
        try:
            gpus, duration = int(float(row["num_gpus"] or 0)), float(row["duration"] or 0)
        except (ValueError, OverflowError):
            raise TraceError(f"{where}: num_gpus and duration must be numbers, not {row['num_gpus']!r} and "
                             f"{row['duration']!r}") from None
        if not math.isfinite(duration):
            raise TraceError(f"{where}: duration is not finite: {row['duration']!r}")
        if gpus <= 0 or duration <= 0:
            continue
        submitted = _time(row["timestamp"], where)
        # named by what the line says, so that a file holding some of the lines names (and draws
        # tiers for) each job as the whole file does
        base = f"{(row.get('cluster') or 'philly').strip()}-{int(submitted)}-{int(duration)}-{gpus}"
        seen[base] = seen.get(base, -1) + 1
        raw.append((f"{base}-{seen[base]}" if seen[base] else base, submitted, duration, gpus))
    if cluster is not None and not raw:
        raise TraceError(f"{name}: no job of virtual cluster {cluster!r} ran")
    return _rebase(raw, shares, elastic_share)


def helios(text: str, name: str = "<helios trace>", shares: Sequence[tuple[str, float]] = DEFAULT_SHARES,
           elastic_share: float = 0.5) -> list[TraceJob]:
    reader = csv.DictReader(io.StringIO(text))
    header = reader.fieldnames or []
    missing = [c for c in ("job_id", "gpu_num", "submit_time") if c not in header]
    if missing or not ("duration" in header or {"start_time", "end_time"} <= set(header)):
        raise TraceError(f"{name}:1: not a Helios cluster_log: it needs job_id, gpu_num, submit_time and "
                         f"duration (or start_time and end_time); missing {', '.join(missing) or 'duration'}")
    raw = []
    for row in reader:
        where = f"{name}:{reader.line_num}"
        try:
            gpus = int(float(row["gpu_num"] or 0))
        except ValueError:
            raise TraceError(f"{where}: gpu_num is not a number: {row['gpu_num']!r}") from None
        if gpus <= 0:
            continue
        if (row.get("duration") or "").strip():
            try:
                duration = float(row["duration"])
            except ValueError:
                raise TraceError(f"{where}: duration is not a number: {row['duration']!r}") from None
        elif (row.get("start_time") or "").strip() and (row.get("end_time") or "").strip():
            duration = _time(row["end_time"], where) - _time(row["start_time"], where)
        else:
            continue
        if duration <= 0:
            continue
        raw.append((row["job_id"], _time(row["submit_time"], where), duration, gpus))
    return _rebase(raw, shares, elastic_share)


def load(text: str, fmt: str, name: str, shares: Sequence[tuple[str, float]] = DEFAULT_SHARES,
         elastic_share: float = 0.5, cluster: str | None = None) -> list[TraceJob]:
    """The jobs of a trace in one of `FORMATS` (`cluster`: one virtual cluster's, philly-summary)."""
    from . import trace

    if cluster is not None and fmt != "philly-summary":
        raise TraceError(f"a virtual cluster is chosen in philly-summary traces only, not {fmt}")
    if fmt == "philly-summary":
        return philly_summary(text, name, shares, elastic_share, cluster)
    if fmt == "csv":
        return trace.parse(text, name)
    if fmt == "philly":
        return philly(text, name, shares, elastic_share)
    if fmt == "helios":
        return helios(text, name, shares, elastic_share)
    raise TraceError(f"unknown trace format {fmt!r}; valid formats: {', '.join(FORMATS)}")
