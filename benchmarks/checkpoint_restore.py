"""Checkpoint/restore benchmark on the dev cluster: Singularity's transparent CRIU checkpoints side
by side with the usual alternative, a training script that saves itself with torch.save.

For each memory size (--ballast: MiB of random process memory added to the job) the job user
submits the reference workload (examples/train_reference.py) under `singularityctl run`, basic tier,
4 GPUs; once it has printed step --preempt-at, a premium job pinned to its node preempts it. The
job's output file and `scontrol show job -o` are polled every 0.1 s, and every event is timed here
with time.monotonic():

  warning -> stopped      the "preemption warning" line -> the batch step has exited (the
                          "requeued" line is there and Slurm no longer shows the job RUNNING)
  running -> first step   Slurm shows the requeued job RUNNING -> the first "step N" line after
                          the restart line
  running -> new progress Slurm shows it RUNNING -> the first step beyond the last one printed
                          before the preemption
  steps lost              last step printed before the restart - (first step after it - 1)
  checkpoint, stored MiB  the launcher's "checkpoint K committed" line (torch.save: file size)
  job PSS MiB             proportional set size of the training process and its DataLoader
                          workers, just before the preemption

Beside each Singularity run, in the same run, the machine's floor for the same bytes: copy them in
memory, xxh3-128 every 4 KiB page and write them durably (write + fsync) into the store's
filesystem, for all of the checkpoint's bytes and for the bytes it newly stored; and, for the
restore, read them back and write them again. With --periodic-at the job is checkpointed at that step
(`singularityctl checkpoint`, as a periodic checkpoint would be) before the preemption, so the
preemption's checkpoint stores only what changed since.

The torch.save job (examples/train_torchsave.py) runs the same way, from a batch script that
requeues itself when warned. The requeued jobs' 121 s requeue delay is lifted here for both
(`scontrol update StartTime=now`). Run as root; see benchmarks/README.md.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pwd
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from enum import StrEnum
from pathlib import Path

import click
import numpy as np
import xxhash

from singularity_slurm import config as config_mod
from singularity_slurm.errors import SingularityError
from singularity_slurm.slurmcli import SlurmClient

POLL_S = 0.1
CHANGED_ALLOWANCE_S = 0.3  # what a checkpoint after a periodic one may cost beyond 3x its changed bytes
TERMINAL = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL",
                      "DEADLINE", "OUT_OF_MEMORY", "PREEMPTED"})
TERMINAL_GRACE_S = 20.0  # a requeue may pass through an end state; only one that lasts counts
LIFT_EVERY_S = 1.0
REPO = Path(__file__).resolve().parents[1]
SINGULARITY = "Singularity"
TORCHSAVE = "torch.save"


class BenchmarkError(Exception):
    """Base of this benchmark's errors; the message names the problem and the fix."""


class CannotStart(BenchmarkError):
    """Nothing was submitted: fix the environment or the options and run again."""


class RunFailed(BenchmarkError):
    """One measurement failed: it is reported as such and the benchmark goes on."""


# --- the job's output file ---------------------------------------------------------------------

_NOTE = r"^\[(?:singularity|torchsave)\] "
STEP = re.compile(r"^step (\d+) loss ")
WARNING = re.compile(_NOTE + r".*preemption warning \(\w+\)")
REQUEUED = re.compile(_NOTE + r".*: requeued$")
RESTART = re.compile(_NOTE + r".*: restart (\d+): ")
COMMITTED = re.compile(_NOTE + r".*: checkpoint \d+ committed in ([\d.]+)s: "
                       r"([\d.]+) MiB, ([\d.]+) MiB stored")
SAVED = re.compile(r"^\[torchsave\] saved step \d+ in ([\d.]+)s: ([\d.]+) MiB")
CHECKPOINT_FAILED = re.compile(_NOTE + r".*: checkpoint failed: (.*)$")


@dataclass(frozen=True)
class Saved:
    """A checkpoint as its writer reported it: the launcher's commit line or torch.save's note."""

    seconds: float
    logical_mib: float
    stored_mib: float


@dataclass(frozen=True)
class LogView:
    """A job's output file so far (complete lines only), split at its first restart line."""

    last_step: int = 0  # the last step printed before the restart
    warned: bool = False
    requeued: bool = False
    restarted: bool = False
    first_resumed: int | None = None  # the first step printed after the restart
    last_resumed: int = 0
    checkpoint: Saved | None = None  # the launcher's preemption checkpoint, or the last torch.save
    failure: str | None = None


def parse_log(text: str) -> LogView:
    """Steps are counted from "step N" lines wherever they fall: a restored process may print its
    first step before the launcher's "restored checkpoint" line, so the run is split at the earlier
    "restart N:" line, which the launcher (or the torch.save batch script) prints first."""
    view: dict = {}
    after = False
    for line in text.split("\n")[:-1]:  # the last piece is "" or a line still being written
        if not after:
            if (m := RESTART.match(line)) and int(m[1]) >= 1:
                after = True
                view["restarted"] = True
            elif m := STEP.match(line):
                view["last_step"] = int(m[1])
            elif WARNING.match(line):
                view["warned"] = True
            elif REQUEUED.match(line):
                view["requeued"] = True
            elif m := COMMITTED.match(line):
                view["checkpoint"] = Saved(float(m[1]), float(m[2]), float(m[3]))
            elif m := SAVED.match(line):
                view["checkpoint"] = Saved(float(m[1]), float(m[2]), float(m[2]))
            elif m := CHECKPOINT_FAILED.match(line):
                view["failure"] = f"checkpoint failed: {m[1]}"
        elif m := STEP.match(line):
            view.setdefault("first_resumed", int(m[1]))
            view["last_resumed"] = int(m[1])
    return LogView(**view)


def steps_lost(last_before: int, first_after: int) -> int:
    """Steps done before the preemption that the job had to do again."""
    return last_before - (first_after - 1)


# --- what is seen, and when --------------------------------------------------------------------

class Event(StrEnum):
    """What happens to one measured job, in this order; each needs the one in REQUIRES first:
    RUNNING -> READY -> WARNED -> STOPPED -> (PENDING) -> RUNNING_AGAIN -> RESUMED -> CAUGHT_UP.
    PENDING may be missed between two polls; nothing needs it.
    """

    RUNNING = "running"
    READY = "ready to preempt"
    WARNED = "warned"
    STOPPED = "stopped"
    PENDING = "pending again"
    RUNNING_AGAIN = "running again"
    RESUMED = "first step"
    CAUGHT_UP = "new progress"


REQUIRES = {Event.RUNNING: None, Event.READY: Event.RUNNING, Event.WARNED: Event.READY,
            Event.STOPPED: Event.WARNED, Event.PENDING: Event.STOPPED, Event.RUNNING_AGAIN: Event.STOPPED,
            Event.RESUMED: Event.RUNNING_AGAIN, Event.CAUGHT_UP: Event.RESUMED}


@dataclass(frozen=True)
class Observation:
    """One poll: Slurm's record of the job (state None: Slurm no longer knows it) and its log."""

    state: str | None
    reason: str
    restarts: int
    node: str
    log: LogView


def observe(record: Mapping[str, str] | None, log: LogView) -> Observation:
    record = record or {}
    return Observation(record.get("JobState"), record.get("Reason", ""),
                       int(record.get("Restarts") or 0), record.get("NodeList", ""), log)


def holds(event: Event, obs: Observation, preempt_at: int, requeued_line: bool) -> bool:
    requeued = obs.restarts > 0  # a new job starts at 0
    match event:
        case Event.RUNNING:
            return obs.state == "RUNNING"
        case Event.READY:
            return obs.log.last_step >= preempt_at
        case Event.WARNED:
            return obs.log.warned
        case Event.STOPPED:
            if obs.log.requeued or not requeued_line:
                return obs.state not in (None, "RUNNING") or obs.log.restarted
            # No "requeued" line, yet the job is back: Slurm requeued it itself (the launcher was
            # killed at the end of GraceTime). Seen only now; measure() reports no stop time.
            return obs.log.restarted or (requeued and obs.state == "RUNNING")
        case Event.PENDING:
            return obs.state == "PENDING" and requeued
        case Event.RUNNING_AGAIN:
            return obs.state == "RUNNING" and requeued
        case Event.RESUMED:
            return obs.log.first_resumed is not None
        case Event.CAUGHT_UP:
            return obs.log.last_resumed > obs.log.last_step
    raise AssertionError(event)


def new_events(seen: Mapping[Event, float], obs: Observation, preempt_at: int,
               requeued_line: bool) -> list[Event]:
    """The events that hold now for the first time, in order (several may arrive in one poll)."""
    found: list[Event] = []
    for event in Event:
        need = REQUIRES[event]
        if event not in seen and (need is None or need in seen or need in found) \
                and holds(event, obs, preempt_at, requeued_line):
            found.append(event)
    return found


def lift_due(obs: Observation, seen: Mapping[Event, float], last_lift: float | None, now: float) -> bool:
    """Lift the requeue delay once the job is pending again, and again while Slurm still shows it
    (the delay is set when the requeue completes, so an early lift can be overwritten)."""
    if Event.STOPPED not in seen or Event.RUNNING_AGAIN in seen:
        return False
    if obs.state != "PENDING" or obs.restarts == 0:
        return False
    return last_lift is None or (obs.reason == "BeginTime" and now - last_lift >= LIFT_EVERY_S)


def problem(obs: Observation, seen: Mapping[Event, float], preempted: bool, terminal_since: float | None,
            now: float, elapsed: float, timeout: float) -> str | None:
    """Why this measurement cannot succeed, or None while it still can."""
    if obs.state is None:
        return "Slurm no longer knows the job (cancelled and purged?)"
    if obs.log.warned and not preempted:
        return ("it was preempted before the benchmark preempted it: another job wants its node; "
                "run the benchmark on an otherwise idle cluster")
    if obs.state in TERMINAL and terminal_since is not None and now - terminal_since >= TERMINAL_GRACE_S:
        hint = ""
        if obs.state == "COMPLETED" and Event.CAUGHT_UP not in seen:
            hint = "; it finished first: raise --steps"
        if obs.state == "CANCELLED":
            hint = "; cancelled by someone else (an integration test session cancels all of the user's jobs)"
        return f"it ended {obs.state} ({obs.reason}){hint}"
    if elapsed > timeout:
        waiting = next((e for e in Event if e not in seen and e != Event.PENDING), None)
        return (f"no '{waiting}' within --job-timeout {timeout:.0f}s (Slurm: {obs.state}, {obs.reason}, "
                f"last step {obs.log.last_step})")
    return None


# --- results -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Result:
    """One measured preemption (or, from summarize(), the median of several)."""

    workload: str
    ballast_mib: int
    runs: int = 1
    job_id: int | None = None
    nodes: str = ""
    pss_mib: float | None = None
    checkpoint_mib: float | None = None
    stored_mib: float | None = None
    save_s: float | None = None  # the writer's own figure: launcher commit time, torch.save time
    signal_s: float | None = None  # premium job submitted -> warning line
    stop_s: float | None = None  # warning -> stopped
    first_step_s: float | None = None  # running again -> first step
    progress_s: float | None = None  # running again -> first step beyond the pre-preemption one
    outage_s: float | None = None  # warning -> new progress (includes the premium job's run)
    last_step: int | None = None
    first_step_after: int | None = None
    steps_lost: float | None = None
    periodic_s: float | None = None  # the checkpoint taken at --periodic-at (singularityctl's seconds)
    floor_all_s: float | None = None  # copy + xxh3 + durable write of the checkpoint's bytes
    floor_stored_s: float | None = None  # the same for the bytes it newly stored
    floor_restore_s: float | None = None  # read the checkpoint's bytes back and write them again
    floor_unique_s: float | None = None  # copy + xxh3 + durable write of the job's PSS
    changed_mib: float | None = None  # pages whose content differs from the checkpoint before (counted here)
    floor_changed_s: float | None = None  # copy + xxh3 + durable write of those pages
    note: str = ""


def span(seen: Mapping[Event, float], start: Event | float | None, end: Event) -> float | None:
    begin = seen.get(start) if isinstance(start, Event) else start
    return None if begin is None or end not in seen else round(seen[end] - begin, 3)


def measure(base: Result, seen: Mapping[Event, float], log: LogView, premium_at: float | None) -> Result:
    first = log.first_resumed
    saved = log.checkpoint
    notes = [base.note, log.failure or ""]
    stop_s = span(seen, Event.WARNED, Event.STOPPED)
    if base.workload == SINGULARITY and Event.STOPPED in seen and not log.requeued:
        stop_s = None
        notes.append("the launcher never said 'requeued': Slurm requeued the job itself after GraceTime")
    return replace(
        base,
        checkpoint_mib=saved.logical_mib if saved else None,
        stored_mib=saved.stored_mib if saved else None, save_s=saved.seconds if saved else None,
        signal_s=span(seen, premium_at, Event.WARNED), stop_s=stop_s,
        first_step_s=span(seen, Event.RUNNING_AGAIN, Event.RESUMED),
        progress_s=span(seen, Event.RUNNING_AGAIN, Event.CAUGHT_UP),
        outage_s=span(seen, Event.WARNED, Event.CAUGHT_UP),
        last_step=log.last_step if log.last_step else None, first_step_after=first,
        steps_lost=steps_lost(log.last_step, first) if first is not None else None,
        note="; ".join(n for n in notes if n))


_NUMBERS = [f.name for f in fields(Result) if f.name not in {"workload", "ballast_mib", "runs", "job_id",
                                                              "nodes", "note"}]


def summarize(results: Sequence[Result]) -> list[Result]:
    """One row per (workload, ballast): the median of each figure over the runs that have it."""
    groups: dict[tuple[str, int], list[Result]] = {}
    for r in results:
        groups.setdefault((r.workload, r.ballast_mib), []).append(r)
    rows = []
    for (workload, ballast), runs in groups.items():
        if len(runs) == 1:
            rows.append(runs[0])
            continue
        medians = {}
        for name in _NUMBERS:
            values = [getattr(r, name) for r in runs if getattr(r, name) is not None]
            medians[name] = statistics.median(values) if values else None
        failed = sum(1 for r in runs if r.note.startswith("failed"))
        rows.append(Result(workload, ballast, runs=len(runs), note=f"{failed} of {len(runs)} failed"
                           if failed else "", **medians))
    return rows


def _num(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    if digits == 0 and not float(value).is_integer():  # a median of steps
        digits = 1
    return f"{value:.{digits}f}"


COLUMNS: list[tuple[str, Callable[[Result], str]]] = [
    ("workload", lambda r: r.workload + (f" (median of {r.runs})" if r.runs > 1 else "")),
    ("ballast MiB", lambda r: str(r.ballast_mib)),
    ("job PSS MiB", lambda r: _num(r.pss_mib)),
    ("checkpoint MiB", lambda r: _num(r.checkpoint_mib)),
    ("stored MiB", lambda r: _num(r.stored_mib)),
    ("warning -> stopped s", lambda r: _num(r.stop_s)),
    ("running -> first step s", lambda r: _num(r.first_step_s)),
    ("running -> new progress s", lambda r: _num(r.progress_s)),
    ("steps lost", lambda r: _num(r.steps_lost, 0)),
    ("changed MiB", lambda r: _num(r.changed_mib)),
    ("floor: unique / changed / restore s", lambda r: "n/a" if r.floor_unique_s is None else
     f"{_num(r.floor_unique_s, 2)} / {_num(r.floor_changed_s, 2)} / {_num(r.floor_restore_s, 2)}"),
    ("floor: all / stored s", lambda r: "n/a" if r.floor_all_s is None else
     f"{_num(r.floor_all_s, 2)} / {_num(r.floor_stored_s, 2)}"),
    ("note", lambda r: r.note),
]


def format_table(rows: Iterable[Result]) -> str:
    lines = ["| " + " | ".join(name for name, _ in COLUMNS) + " |",
             "|" + "|".join("---" if name in ("workload", "note") else "---:" for name, _ in COLUMNS) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(cell(row).replace("|", "/") for _, cell in COLUMNS) + " |")
    return "\n".join(lines)


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "n/a"
    return f"{a / b:.2f}x ({a:.1f} / {b:.1f})"


def changed_target(r: Result) -> str:
    """A checkpoint after a periodic one against its target: 3 x the floor of its changed bytes + 0.3 s."""
    limit = 3 * r.floor_changed_s + CHANGED_ALLOWANCE_S
    verdict = "n/a" if r.stop_s is None else "within" if r.stop_s <= limit else "over"
    return (f", against 3 x the floor of its {_num(r.changed_mib)} MiB changed since the checkpoint "
            f"before + {CHANGED_ALLOWANCE_S} s = {limit:.2f} s: {_num(r.stop_s)} s, {verdict} "
            f"({ratio(r.stop_s, r.floor_changed_s)} the floor)")


def format_ratios(rows: Sequence[Result]) -> list[str]:
    """Ratios between rows of the same run: on a shared machine they travel better than seconds."""
    ours = {r.ballast_mib: r for r in rows if r.workload == SINGULARITY}
    theirs = {r.ballast_mib: r for r in rows if r.workload != SINGULARITY}
    lines = []
    for ballast in sorted(ours):
        r = ours[ballast]
        if r.floor_all_s is None:
            continue
        lines.append(f"- Singularity at {ballast} MiB against the machine's floor: warning -> stopped / "
                     f"floor of the job's {_num(r.pss_mib)} MiB unique bytes (PSS) "
                     f"{ratio(r.stop_s, r.floor_unique_s)}"
                     + (changed_target(r) if r.floor_changed_s is not None else "")
                     + f"; / floor of all {_num(r.checkpoint_mib)} MiB {ratio(r.stop_s, r.floor_all_s)}, / "
                     f"floor of the {_num(r.stored_mib)} MiB stored {ratio(r.stop_s, r.floor_stored_s)}; "
                     f"running -> first step / restore floor {ratio(r.first_step_s, r.floor_restore_s)}")
    for ballast in sorted(set(ours) & set(theirs)):
        s, t = ours[ballast], theirs[ballast]
        lines.append(f"- ballast {ballast} MiB, Singularity / {t.workload}: running -> new progress "
                     f"{ratio(s.progress_s, t.progress_s)}; running -> first step "
                     f"{ratio(s.first_step_s, t.first_step_s)}; warning -> stopped "
                     f"{ratio(s.stop_s, t.stop_s)}; steps lost {_num(s.steps_lost, 0)} vs "
                     f"{_num(t.steps_lost, 0)}")
    if len(ours) > 1:
        base = ours[min(ours)]
        for ballast in sorted(ours)[1:]:
            r = ours[ballast]
            lines.append(f"- Singularity at {ballast} MiB / at {base.ballast_mib} MiB: checkpoint "
                         f"{ratio(r.checkpoint_mib, base.checkpoint_mib)}; stored "
                         f"{ratio(r.stored_mib, base.stored_mib)}; warning -> stopped "
                         f"{ratio(r.stop_s, base.stop_s)}; running -> new progress "
                         f"{ratio(r.progress_s, base.progress_s)}")
    return lines


DEFINITIONS = [
    "warning -> stopped: from the preemption warning line to the batch step's exit (Singularity: "
    "checkpoint, commit and requeue; torch.save: only the requeue, it saved while running)",
    "running -> first step: from Slurm showing the requeued job RUNNING to its first step line",
    "running -> new progress: from RUNNING to the first step beyond the last one printed before the "
    "preemption (for torch.save this includes doing the lost steps again)",
    "steps lost: last step before the preemption - (first step after it - 1)",
    "job PSS: proportional set size of the training process and its DataLoader workers just before "
    "the preemption; checkpoint / stored MiB: the launcher's commit line (logical size, newly stored "
    "bytes); for torch.save the size of its file",
    "times are taken by the benchmark polling every 0.1 s: about 0.1-0.2 s resolution; compare rows "
    "of one run, not runs on different days or machines",
    "floor: what bytes cost at least on this machine, measured right after the run: copy in memory, "
    "xxh3-128 per 4 KiB page, write and fsync into the store's filesystem (unique: the job's PSS, the "
    "bytes it owns; changed: the pages whose content differs from the checkpoint before, counted here "
    "from the two checkpoints' page contents, not from the tool's own tracking; all: every byte of the "
    "checkpoint; stored: the bytes it newly stored); restore: read the checkpoint's bytes back and "
    "write them again",
    f"targets: a first checkpoint's warning -> stopped within 2x the floor of the unique bytes; one "
    f"after a periodic checkpoint within 3x the floor of the changed bytes + {CHANGED_ALLOWANCE_S} s",
]


def format_report(meta: Mapping[str, object], rows: Sequence[Result]) -> str:
    ratios = format_ratios(rows)
    return "\n".join([
        "# Checkpoint/restore benchmark", "", ", ".join(f"{k} {v}" for k, v in meta.items()), "",
        format_table(rows), "", *(["Ratios (same run):", "", *ratios, ""] if ratios else []),
        *(f"- {line}" for line in DEFINITIONS), ""])


# --- the job's processes -----------------------------------------------------------------------

def parse_environ(data: bytes) -> dict[str, str]:
    pairs = (item.decode(errors="replace").partition("=") for item in data.split(b"\0") if item)
    return {key: value for key, _, value in pairs}


def is_training_process(argv: Sequence[str], env: Mapping[str, str], job_id: int, script: str) -> bool:
    """The training process and its workers (`python SCRIPT ...`), not the launcher or the shell."""
    return len(argv) >= 2 and Path(argv[1]).name == script and env.get("SLURM_JOB_ID") == str(job_id)


def parse_pss_kib(smaps_rollup: str) -> int | None:
    for line in smaps_rollup.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return None


def job_pss_mib(job_id: int, uid: int, script: str, proc: Path = Path("/proc")) -> float | None:
    total, found = 0, 0
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            argv = [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0")]
            if not is_training_process(argv, parse_environ((entry / "environ").read_bytes()), job_id, script):
                continue
            kib = parse_pss_kib((entry / "smaps_rollup").read_text())
        except OSError:  # gone meanwhile
            continue
        if kib is not None:
            total, found = total + kib, found + 1
    return round(total / 1024, 1) if found else None


# --- batch scripts -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Settings:
    user: str
    ctl: str
    python: str
    steps: int
    sleep: float
    preempt_at: int
    save_every: int
    premium_sleep: float
    job_timeout: float
    periodic_at: int = 0  # 0: no checkpoint before the preemption
    floor_dir: str = ""  # where the floor is measured ("": not at all)


FLOOR_BLOCK = 64 << 20
PAGE = 4096


def floor_seconds(total_mib: float, stored_mib: float, folder: Path, *others: float) -> tuple[float, ...]:
    """(all, stored, restore, *others): what copying, hashing (xxh3-128 per page) and durably writing
    `total_mib` and `stored_mib` MiB cost on this machine, reading `total_mib` back and writing it
    again, and writing each of `others` MiB. The bytes are random, so no cache can shortcut them."""
    block = os.urandom(FLOOR_BLOCK)
    target, copy = folder / f".floor-{os.getpid()}", folder / f".floor-{os.getpid()}.restored"

    def write(mib: float, path: Path = target) -> float:
        started, left = time.perf_counter(), int(mib * 2**20)
        with open(path, "wb") as out:
            while left > 0:
                piece = bytearray(block[:min(left, FLOOR_BLOCK)])  # the copy out of the process
                view = memoryview(piece)
                for at in range(0, len(piece), PAGE):
                    xxhash.xxh3_128_digest(view[at:at + PAGE])
                out.write(piece)
                left -= len(piece)
            out.flush()
            os.fsync(out.fileno())
        return time.perf_counter() - started

    def write_alone(mib: float) -> float:
        """`write` into a new file (truncating a large one would be timed too), removed after."""
        alone = folder / f".floor-{os.getpid()}.alone"
        try:
            return write(mib, alone)
        finally:
            alone.unlink(missing_ok=True)

    try:
        measured = [write_alone(mib) for mib in others]
        stored = write_alone(stored_mib)
        everything = write(total_mib)
        started = time.perf_counter()
        with open(target, "rb") as source, open(copy, "wb") as out:
            while data := source.read(FLOOR_BLOCK):
                out.write(data)
        restore = time.perf_counter() - started
        return (everything, stored, restore, *measured)
    finally:
        target.unlink(missing_ok=True)
        copy.unlink(missing_ok=True)


def changed_mib(store_root: Path, job: int) -> float | None:
    """MiB of process memory whose content changed between the job's last two checkpoints (the
    periodic one and the preemption's): pages, by process and address, whose chunk differs or that
    the earlier checkpoint lacks. Counted from the checkpoints' contents, so whatever criu's own
    tracking claims, a page that changed counts."""
    from singularity_slurm.checkpoint import images
    from singularity_slurm.node.engine import job_store

    store = job_store(store_root)
    seqs = store.seqs(job)
    if len(seqs) < 2:
        return None
    before, after = (images.base_tables(store, store.read(job, seq)) for seq in seqs[-2:])
    changed = 0
    for pid, pages in after.items():
        old = before.get(pid)
        if old is None:
            changed += len(pages.vaddrs)
            continue
        where = np.searchsorted(old.vaddrs, pages.vaddrs)
        inside = where < len(old.vaddrs)
        same = np.zeros(len(pages.vaddrs), bool)
        same[inside] = ((old.vaddrs[where[inside]] == pages.vaddrs[inside])
                        & (old.digests[where[inside]] == pages.digests[inside]))
        changed += int((~same).sum())
    return changed * PAGE / 2**20


TORCHSAVE_WARN_S = 30
"""Seconds of warning the torch.save job asks Slurm for: the dev cluster's GraceTime."""


def training_script(kind: str, ballast: int, s: Settings) -> str:
    args = f"--steps {s.steps} --sleep {s.sleep}" + (f" --ballast-mb {ballast}" if ballast else "")
    head = "#!/bin/bash\n#SBATCH --singularity-sla=basic\n#SBATCH --gres=gpu:4\n#SBATCH -o train.out\n"
    if kind == SINGULARITY:
        return head + f"exec {s.ctl} run -- {s.python} train_reference.py {args}\n"
    # What a careful user writes without Singularity: a warning signal to the batch shell (`B:`; the
    # tier's own warning goes to job steps only, and this job runs none) and a requeue on it. The
    # training runs in the background so that bash handles the signal at once instead of after the
    # child exits, and is stopped first, as the preemption would: otherwise it trains (and saves) on
    # while the requeue completes, which flatters the alternative.
    who = 'job $SLURM_JOB_ID on $SLURMD_NODENAME'
    head += f"#SBATCH --signal=B:USR2@{TORCHSAVE_WARN_S}\n"
    return head + f"""echo "[torchsave] {who}: restart ${{SLURM_RESTART_COUNT:-0}}: starting"
on_warning() {{
  echo "[torchsave] {who}: preemption warning (SIG$1): requeueing"
  kill -9 "$TRAIN_PID" 2>/dev/null
  scontrol requeue "$SLURM_JOB_ID"
  echo "[torchsave] {who}: requeued"
  exit 0
}}
trap 'on_warning USR2' USR2
{s.python} train_torchsave.py {args} --save-every {s.save_every} &
TRAIN_PID=$!
wait $TRAIN_PID
"""


def premium_script(sleep: float) -> str:
    return (f"#!/bin/bash\n#SBATCH --singularity-sla=premium\n#SBATCH --gres=gpu:4\n"
            f"#SBATCH -o premium-%j.out\nsleep {sleep}\n")


def parse_sizes(text: str) -> list[int]:
    if text.strip().lower() in ("", "none"):
        return []
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError as exc:
        raise CannotStart(f"sizes are MiB, comma-separated (e.g. 0,256,1024), not {text!r}") from exc
    if any(size < 0 for size in sizes):
        raise CannotStart(f"sizes must be >= 0 MiB, got {text!r}")
    return list(dict.fromkeys(sizes))


def settings_problems(s: Settings) -> list[str]:
    found = []
    if s.sleep <= 0:
        found.append("--sleep must be > 0: the job must still be running when it is restored")
    if s.preempt_at < 1 or s.save_every < 1:
        found.append("--preempt-at and --save-every must be at least 1")
    if s.periodic_at and not 0 < s.periodic_at < s.preempt_at - 10:
        found.append("--periodic-at must come at least 10 steps before --preempt-at (or be 0: none)")
    if s.sleep > 0 and (s.steps - s.preempt_at) * s.sleep < 60:
        found.append(f"the job would finish too soon after the preemption: give --steps at least "
                     f"{s.preempt_at + math.ceil(60 / s.sleep)}")
    return found


def plan_runs(ours: Sequence[int], theirs: Sequence[int]) -> list[tuple[str, int]]:
    """Smallest size first; at each size Singularity, then torch.save, so compared runs are adjacent."""
    return [(kind, size) for size in sorted(set(ours) | set(theirs))
            for kind, sizes in ((SINGULARITY, ours), (TORCHSAVE, theirs)) if size in sizes]


# --- the driver --------------------------------------------------------------------------------

@dataclass
class Tracking:
    """What the driver has learned about one job so far; kept when a measurement fails halfway."""

    seen: dict[Event, float] = field(default_factory=dict)
    log: LogView = field(default_factory=LogView)
    premium_id: int | None = None
    premium_at: float | None = None
    periodic_s: float | None = None
    periodic_done: bool = False
    pss_mib: float | None = None
    nodes: list[str] = field(default_factory=list)


class Bench:
    """Submits, preempts and watches one job at a time; cancels what it submitted when stopped."""

    def __init__(self, slurm: SlurmClient, settings: Settings, say: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self.slurm, self.s, self.say, self.clock, self.sleep = slurm, settings, say, clock, sleep
        self.user = pwd.getpwnam(settings.user)
        self.active: set[int] = set()

    def own(self, path: Path) -> Path:
        os.chown(path, self.user.pw_uid, self.user.pw_gid)
        return path

    def submit(self, folder: Path, name: str, text: str, *options: str) -> int:
        script = folder / name
        script.write_text(text)
        script.chmod(0o755)
        self.own(script)
        try:
            job_id = self.slurm.submit(str(script), options, user=self.s.user, cwd=str(folder))
        except SingularityError as exc:
            raise RunFailed(f"sbatch {name} as {self.s.user} failed: {exc}") from exc
        self.active.add(job_id)
        return job_id

    def run(self, kind: str, ballast: int, folder: Path) -> Result:
        label = SINGULARITY if kind == SINGULARITY else f"torch.save every {self.s.save_every} steps"
        example = "train_reference.py" if kind == SINGULARITY else "train_torchsave.py"
        folder.mkdir(parents=True)
        self.own(folder)
        self.own(Path(shutil.copy(REPO / "examples" / example, folder)))
        track, note, job = Tracking(), "", None
        try:
            job = self.submit(folder, "train.sh", training_script(kind, ballast, self.s))
            self.say(f"{label}, ballast {ballast} MiB: job {job} submitted ({folder})")
            self.watch(job, folder, example, kind == SINGULARITY, track)
        except RunFailed as exc:
            note = f"failed: {exc}"
            self.say(f"{label}, ballast {ballast} MiB: job {job} FAILED: {exc}")
        # counted before the job is cancelled: the Epilog of an ended job may retire its checkpoints
        changed = (changed_mib(Path(self.s.floor_dir), job)
                   if kind == SINGULARITY and self.s.floor_dir and self.s.periodic_at and job else None)
        if job is not None:
            self.retire(job, track.premium_id, at_once=bool(note))
        base = Result(label, ballast, job_id=job, nodes=" -> ".join(track.nodes), pss_mib=track.pss_mib,
                      periodic_s=track.periodic_s, note=note)
        result = measure(base, track.seen, track.log, track.premium_at)
        if kind == SINGULARITY and self.s.floor_dir and result.checkpoint_mib:
            result = replace(result, changed_mib=None if changed is None else round(changed, 1))
            self.say(f"{label}, ballast {ballast} MiB: measuring the floor for "
                     f"{result.checkpoint_mib:.0f} MiB ({result.stored_mib:.0f} MiB stored, PSS "
                     f"{result.pss_mib or 0:.0f} MiB, {'n/a' if changed is None else f'{changed:.0f}'} "
                     "MiB changed)")
            every, stored, restore, unique, *rest = floor_seconds(
                result.checkpoint_mib, result.stored_mib or 0.0, Path(self.s.floor_dir),
                result.pss_mib or 0.0, *([changed] if changed is not None else []))
            result = replace(result, floor_all_s=round(every, 3), floor_stored_s=round(stored, 3),
                             floor_restore_s=round(restore, 3), floor_unique_s=round(unique, 3),
                             floor_changed_s=round(rest[0], 3) if rest else None)
        return result

    def checkpoint_now(self, job: int, track: Tracking) -> None:
        """A checkpoint of the running job, as the periodic one would take (the job runs on)."""
        track.periodic_done = True
        try:  # as long as the checkpoint takes (a big job's takes minutes)
            proc = subprocess.run(["runuser", "-u", self.s.user, "--", self.s.ctl, "checkpoint", str(job),
                                   "--json"], capture_output=True, text=True, timeout=self.s.job_timeout)
        except subprocess.TimeoutExpired as exc:
            raise RunFailed(f"singularityctl checkpoint {job} did not answer in "
                            f"{self.s.job_timeout:.0f}s") from exc
        if proc.returncode != 0:
            raise RunFailed(f"singularityctl checkpoint {job} failed: {proc.stderr.strip()}")
        reply = json.loads(proc.stdout)
        track.periodic_s = float(reply["seconds"])
        self.say(f"job {job}: checkpoint {reply['seq']} before the preemption: {reply['seconds']:.1f}s, "
                 f"{reply['logical_bytes'] / 2**20:.0f} MiB, {reply['new_bytes'] / 2**20:.0f} MiB stored")

    def watch(self, job: int, folder: Path, script: str, requeued_line: bool, track: Tracking) -> None:
        started = self.clock()
        last_lift = terminal_since = None
        status: tuple[str | None, str] | None = None
        record: dict[str, str] | None = {"JobState": "PENDING", "Reason": "submitted"}
        while Event.CAUGHT_UP not in track.seen:
            tick = self.clock()
            try:
                record = self.slurm.job(job)
            except SingularityError as exc:  # a busy slurmctld: go on with what it said last
                self.say(f"job {job}: {exc}")
            try:
                track.log = parse_log((folder / "train.out").read_text(errors="replace"))
            except FileNotFoundError:
                pass
            now = self.clock()
            obs = observe(record, track.log)
            if (obs.state, obs.reason) != status:
                status = (obs.state, obs.reason)
                where = f" on {obs.node}" if obs.node else ""
                self.say(f"job {job}: Slurm {obs.state} ({obs.reason}){where} +{now - started:.1f}s")
            for event in new_events(track.seen, obs, self.s.preempt_at, requeued_line):
                track.seen[event] = now
                self.say(f"job {job}: {event} +{now - started:.1f}s (last step {obs.log.last_step})")
                if event in (Event.RUNNING, Event.RUNNING_AGAIN):
                    track.nodes.append(obs.node)
            if (requeued_line and self.s.periodic_at and not track.periodic_done
                    and obs.log.last_step >= self.s.periodic_at):
                self.checkpoint_now(job, track)
            if Event.READY in track.seen and track.premium_id is None:
                self.preempt(job, obs.node, folder, script, track)
            if lift_due(obs, track.seen, last_lift, now):
                last_lift = now
                try:
                    self.slurm.release_start(job)
                    self.say(f"job {job}: requeue delay lifted (it was pending: {obs.reason})")
                except SingularityError as exc:
                    self.say(f"job {job}: lifting the requeue delay failed: {exc}")
            terminal_since = (terminal_since or now) if obs.state in TERMINAL else None
            why = problem(obs, track.seen, track.premium_id is not None, terminal_since, now,
                          now - started, self.s.job_timeout)
            if why:
                raise RunFailed(f"job {job}: {why}")
            self.sleep(max(0.0, POLL_S - (self.clock() - tick)))

    def preempt(self, job: int, node: str, folder: Path, script: str, track: Tracking) -> None:
        track.pss_mib = job_pss_mib(job, self.user.pw_uid, script)
        track.premium_id = self.submit(folder, "premium.sh", premium_script(self.s.premium_sleep),
                                       f"--nodelist={node}")
        track.premium_at = self.clock()
        self.say(f"job {job}: premium job {track.premium_id} submitted on {node} "
                 f"(job PSS {_num(track.pss_mib)} MiB)")

    def ended(self, job: int) -> bool:
        try:
            record = self.slurm.job(job)
        except SingularityError:
            return False
        return record is None or record.get("JobState") in TERMINAL

    def cancel(self, job: int) -> None:
        # A plain scancel sends SIGTERM first. The launcher checkpoints and requeues on SIGTERM when
        # Slurm shows the job preempted, and this job just was. SIGKILL ends the batch step at once.
        self.slurm.run(["scancel", "--signal=KILL", str(job)], check=False)
        deadline = self.clock() + 5
        while not self.ended(job) and self.clock() < deadline:
            self.sleep(0.2)
        self.slurm.run(["scancel", str(job)], check=False)  # a pending job, or one that lives on

    def retire(self, job: int, premium: int | None, at_once: bool = False) -> None:
        """Cancel the measured job; let the premium job finish its sleep unless the run failed."""
        self.cancel(job)
        if premium is not None and at_once:
            self.slurm.run(["scancel", str(premium)], check=False)
        deadline = self.clock() + self.s.premium_sleep + 30
        waiting = [j for j in (job, premium) if j is not None and not self.ended(j)]
        while waiting and self.clock() < deadline:
            self.sleep(0.5)
            waiting = [j for j in waiting if not self.ended(j)]
        for j in waiting:
            self.say(f"job {j} has not ended; cancelling it")
            self.cancel(j)
        self.active -= {job, premium}

    def cancel_all(self) -> None:
        for job in sorted(self.active):
            self.say(f"cancelling job {job}")
            self.cancel(job)
        self.active.clear()


def _say(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def prepare(slurm: SlurmClient, settings: Settings, workdir: Path) -> list[str]:
    """Checks that need the machine; returns notes worth printing. Nothing is submitted."""
    if os.geteuid() != 0:
        raise CannotStart("run it as root: it submits jobs as the job user (runuser) and lifts their "
                          "requeue delay (scontrol update)")
    try:
        pwd.getpwnam(settings.user)
    except KeyError as exc:
        raise CannotStart(f"no user {settings.user!r}: `singularityctl devcluster up` creates jobuser, "
                          "or pass --user") from exc
    for path in (settings.ctl, settings.python, REPO / "examples" / "train_torchsave.py"):
        if not os.access(path, os.R_OK):
            raise CannotStart(f"{path} is missing: run `make install` first")
    ping = slurm.run(["scontrol", "ping"], check=False)
    if ping.returncode != 0 or "UP" not in ping.stdout:
        raise CannotStart("the dev cluster is not running: `singularityctl devcluster up` "
                          "(or `make demo`) starts it")
    if workdir.exists() and any(workdir.iterdir()):
        raise CannotStart(f"{workdir} is not empty: give a new --workdir")
    others = [r for r in slurm.jobs() if r.get("JobState") in ("RUNNING", "PENDING", "COMPLETING")]
    if others:
        ids = ", ".join(f"{r.get('JobId')} ({r.get('UserId', '?').split('(')[0]}, {r.get('JobState')})"
                        for r in others[:8])
        return [f"{len(others)} other job(s) on the cluster: {ids}. The benchmark's jobs may wait for "
                "GPUs and its numbers get noisier; an integration test session would cancel its jobs."]
    return []


@contextlib.contextmanager
def configured(path: Path, section: str, key: str, value: str) -> Iterator[None]:
    """The TOML file `path` with `key = value` in `[section]` while the block runs (the nodes'
    agents read it at each job's start), its bytes put back after."""
    original = path.read_bytes()
    path.write_text(with_setting(original.decode(), section, key, value))
    try:
        config_mod.load(path)
        yield
    finally:
        path.write_bytes(original)


def with_setting(text: str, section: str, key: str, value: str) -> str:
    """A TOML text with `key = value` in `[section]`: an existing line of the key replaced, else
    one added under the section's header (or a new section at the end)."""
    lines, inside, done = text.splitlines(), False, False
    out = []
    for line in lines:
        header = re.fullmatch(r"\s*\[([^\]]+)\]\s*", line)
        if header:
            if inside and not done:
                out.append(f"{key} = {value}")
                done = True
            inside = header[1].strip() == section
        elif inside and re.match(rf"\s*{re.escape(key)}\s*=", line):
            line, done = f"{key} = {value}", True
        out.append(line)
    if inside and not done:
        out.append(f"{key} = {value}")
        done = True
    if not done:
        out += ["", f"[{section}]", f"{key} = {value}"]
    return "\n".join(out) + "\n"


def _git_commit() -> str:
    proc = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=False)
    return proc.stdout.strip() or "unknown"


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--ballast", default="0,256,1024", show_default=True, envvar="BENCH_BALLAST",
              help="Job memory sizes for Singularity: MiB of random process memory, comma-separated.")
@click.option("--torchsave-ballast", default="0", show_default=True, envvar="BENCH_TORCHSAVE_BALLAST",
              help="Sizes at which the torch.save alternative runs too ('none': not at all).")
@click.option("--steps", default=2000, show_default=True, envvar="BENCH_STEPS",
              help="Steps the job would run (it is cancelled once measured).")
@click.option("--sleep", "step_sleep", default=0.1, show_default=True, envvar="BENCH_SLEEP",
              help="Pause per training step (seconds).")
@click.option("--preempt-at", default=125, show_default=True, envvar="BENCH_PREEMPT_AT",
              help="Preempt once the job has printed this step.")
@click.option("--periodic-at", default=0, show_default=True, envvar="BENCH_PERIODIC_AT",
              help="Checkpoint the Singularity job at this step, before the preemption (0: no).")
@click.option("--floor/--no-floor", default=True, show_default=True, envvar="BENCH_FLOOR",
              help="Measure the machine's floor for each checkpoint's bytes beside it.")
@click.option("--save-every", default=50, show_default=True, envvar="BENCH_SAVE_EVERY",
              help="torch.save interval of the alternative (steps).")
@click.option("--premium-sleep", default=5.0, show_default=True, envvar="BENCH_PREMIUM_SLEEP",
              help="How long the premium job holds the node (seconds).")
@click.option("--job-timeout", default=600.0, show_default=True, envvar="BENCH_JOB_TIMEOUT",
              help="Give up on one measurement after this many seconds from its submission.")
@click.option("--repeat", default=1, show_default=True, type=click.IntRange(1), envvar="BENCH_REPEAT",
              help="Measure everything N times; the table shows medians.")
@click.option("--user", default="jobuser", show_default=True, envvar="SINGULARITY_DEVCLUSTER_USER",
              help="The non-root user that submits the jobs.")
@click.option("--workdir", type=click.Path(path_type=Path), envvar="BENCH_WORKDIR",
              help="Folder for the jobs' scripts and output [default: ~USER/bench-TIMESTAMP].")
@click.option("--results-dir", type=click.Path(path_type=Path), default=REPO / "benchmarks" / "results",
              show_default=True, envvar="BENCH_RESULTS_DIR", help="Where the report is written.")
@click.option("--stream-pages", type=click.Choice(config_mod.STREAM_PAGES), envvar="BENCH_STREAM_PAGES",
              help="Run with this preemption.stream_pages (written into the cluster's configuration for "
                   "the run, the file put back after) [default: as configured].")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of the Markdown report.")
def main(ballast: str, torchsave_ballast: str, steps: int, step_sleep: float, preempt_at: int,
         periodic_at: int, floor: bool, save_every: int, premium_sleep: float, job_timeout: float,
         repeat: int, user: str, workdir: Path | None, results_dir: Path, stream_pages: str | None,
         as_json: bool) -> None:
    """Measure checkpoint and restore of preempted jobs on the dev cluster, Singularity against
    torch.save. Run as root; it takes about a minute per job (see benchmarks/README.md)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    slurm = SlurmClient()
    try:
        paths = config_mod.load().paths
        prefix = paths.prefix
        settings = Settings(user, str(prefix / "venv" / "bin" / "singularityctl"),
                            str(prefix / "venv" / "bin" / "python"), steps, step_sleep, preempt_at,
                            save_every, premium_sleep, job_timeout, periodic_at,
                            str(paths.store_root) if floor else "")
        if problems := settings_problems(settings):
            raise CannotStart("; ".join(problems))
        runs = plan_runs(parse_sizes(ballast), parse_sizes(torchsave_ballast))
        if not runs:
            raise CannotStart("nothing to measure: give --ballast or --torchsave-ballast sizes")
        try:
            workdir = workdir or Path(pwd.getpwnam(user).pw_dir) / f"bench-{stamp}"
        except KeyError as exc:
            raise CannotStart(f"no user {user!r}: `singularityctl devcluster up` creates jobuser, "
                              "or pass --user") from exc
        for note in prepare(slurm, settings, workdir):
            _say(note)
        meta = {"date": stamp, "host": socket.gethostname(), "cpus": os.cpu_count(),
                "slurm": str(slurm.version()), "commit": _git_commit(), "step sleep": f"{step_sleep}s",
                "preempt at step": preempt_at, "torch.save every": f"{save_every} steps",
                "premium job": f"{premium_sleep}s", "repeat": repeat,
                "checkpoint before the preemption": f"step {periodic_at}" if periodic_at else "none",
                "stream pages": stream_pages or config_mod.load().preemption.stream_pages}
    except (CannotStart, SingularityError) as exc:
        raise click.ClickException(str(exc)) from exc

    bench = Bench(slurm, settings, _say)
    workdir.mkdir(parents=True, exist_ok=True)
    bench.own(workdir)
    signal.signal(signal.SIGTERM, _interrupted)
    results: list[Result] = []
    total = len(runs) * repeat
    setting = (configured(config_mod.config_path(), "preemption", "stream_pages", f'"{stream_pages}"')
               if stream_pages else contextlib.nullcontext())
    try:
        with setting:
            for rep in range(1, repeat + 1):
                for kind, size in runs:
                    _say(f"--- run {len(results) + 1} of {total}: {kind}, ballast {size} MiB")
                    slug = "singularity" if kind == SINGULARITY else "torchsave"
                    results.append(bench.run(kind, size, workdir / f"{slug}-{size}mib-{rep}"))
    except KeyboardInterrupt:
        _say("interrupted")
        sys.exit(130)
    finally:
        bench.cancel_all()

    rows = summarize(results)
    report = format_report(meta, rows)
    results_dir.mkdir(parents=True, exist_ok=True)
    md_path = results_dir / f"checkpoint_restore-{stamp}.md"
    md_path.write_text(report)
    data = {"meta": {k: str(v) for k, v in meta.items()}, "summary": [asdict(r) for r in rows],
            "runs": [asdict(r) for r in results]}
    json_path = md_path.with_suffix(".json")
    json_path.write_text(json.dumps(data, indent=2) + "\n")
    click.echo(json.dumps(data, indent=2) if as_json else report)
    _say(f"report: {md_path} (JSON: {json_path}); job folders and logs: {workdir}")
    stored = [str(r.job_id) for r in results if r.workload == SINGULARITY and r.job_id is not None]
    if stored:
        _say(f"the Singularity jobs' checkpoints: {paths.store_root}/jobs/{{{','.join(stored)}}}, until "
             "the store's retention of ended jobs (store.retention_min) removes them")
    sys.exit(1 if any(r.note.startswith("failed") for r in results) else 0)


if __name__ == "__main__":
    main()
