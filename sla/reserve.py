"""Protected jobs' nodes held against Slurm's own preemption: one reservation per running protected job.

Slurm 22.05 cannot exempt a running job from partition-priority preemption by a job update (a QOS or
partition change of a job that is not pending is refused; Nice, Priority or Comment are not read by
preemption). What it does honour is a reservation: a job outside it is never placed on its nodes, and
preemption only takes victims on nodes the preemptor can get. So while a protected job runs, the
controller keeps `singularity_protect_<job>` over the job's nodes, for root only (`Users=root`),
`Flags=IGNORE_JOBS,OVERLAP` (made over running jobs, beside other reservations), ending `hold_s`
from now and extended every look: a controller that dies or loses its lease lets its protections
lapse within `hold_s`, so a reservation never closes nodes for good. The cost: the nodes' other
devices stay closed to other jobs meanwhile (reservations of part of a node's GRES arrive in 23.x).

`plan(wanted, existing)` is pure: which reservations to make, extend, move (the job restarted on
other nodes) or delete (the job ended, was requeued, or is no longer protected). `argv` turns each
step into its `scontrol` command; the controller runs them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from singularity_slurm.jobenv import expand_hostlist
from singularity_slurm.slurmcli import parse_record

PREFIX = "singularity_protect_"
_NAME = re.compile(re.escape(PREFIX) + r"([1-9][0-9]{0,9})")
_NODES = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-\[\],]{0,65535}")
"""A hostlist expression as Slurm writes it (`n[1-2,5]`); anything else is not passed to scontrol."""


def name_of(job_id: int) -> str:
    return f"{PREFIX}{int(job_id)}"


def job_of(name: str) -> int | None:
    """The job a reservation of ours protects; None for any other reservation."""
    match = _NAME.fullmatch(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class Held:
    """One of our reservations, as Slurm shows it."""

    name: str
    nodes: str
    end: str  # Slurm's EndTime, as written


def parse(text: str) -> dict[str, Held]:
    """Our reservations in `scontrol show reservation -o` (others, and any not for root alone, are
    not ours to touch)."""
    held = {}
    for line in text.splitlines():
        record = parse_record(line)
        name = record.get("ReservationName", "")
        if job_of(name) is not None and record.get("Users") == "root":
            held[name] = Held(name, record.get("Nodes", ""), record.get("EndTime", ""))
    return held


def closed_nodes(held: Mapping[str, Held]) -> set[str]:
    """The nodes our reservations close to every job."""
    return {node for h in held.values() for node in expand_hostlist(h.nodes)}


@dataclass(frozen=True)
class Create:
    name: str
    nodes: str


@dataclass(frozen=True)
class Extend:
    name: str


@dataclass(frozen=True)
class Delete:
    name: str


Step = Create | Extend | Delete


def wanted_for(protected: Iterable[int], jobs: Mapping[int, Mapping[str, str]]) -> dict[str, str]:
    """Reservation name -> nodes, for every protected job Slurm shows running on well-formed nodes."""
    wanted = {}
    for job_id in sorted(set(protected)):
        job = jobs.get(job_id) or {}
        nodes = job.get("NodeList", "")
        if job.get("JobState") == "RUNNING" and _NODES.fullmatch(nodes) and expand_hostlist(nodes):
            wanted[name_of(job_id)] = nodes
    return wanted


def plan(wanted: Mapping[str, str], existing: Mapping[str, Held]) -> list[Step]:
    """Deletions first (they free nodes), then each wanted reservation made, moved or extended."""
    steps: list[Step] = [Delete(name) for name in sorted(existing) if name not in wanted]
    for name, nodes in sorted(wanted.items()):
        held = existing.get(name)
        if held is None:
            steps.append(Create(name, nodes))
        elif set(expand_hostlist(held.nodes)) != set(expand_hostlist(nodes)):
            steps += [Delete(name), Create(name, nodes)]
        else:
            steps.append(Extend(name))
    return steps


def argv(step: Step, hold_s: int) -> list[str]:
    """The `scontrol` command of one step; the reservation ends `hold_s` after it runs."""
    end = f"EndTime=now+{int(hold_s)}"
    if isinstance(step, Create):
        if not _NODES.fullmatch(step.nodes):
            raise ValueError(f"not a node list: {step.nodes!r}")
        return ["scontrol", "create", "reservation", f"ReservationName={step.name}", "StartTime=now", end,
                f"Nodes={step.nodes}", "Users=root", "Flags=IGNORE_JOBS,OVERLAP"]
    if isinstance(step, Extend):
        return ["scontrol", "update", f"ReservationName={step.name}", end]
    return ["scontrol", "delete", f"ReservationName={step.name}"]


LIST_ARGV = ["scontrol", "show", "reservation", "-o"]
