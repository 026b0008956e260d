"""The cluster as the SLA controller sees it, from Slurm's records and the registry (pure).

`snapshot` joins Slurm's jobs (`scontrol show job -o` records) with the registry's records into the
`policy.Snapshot` the decisions take; `idle_devices` counts the devices no job holds on nodes that
can run one (`sinfo -N -O NodeList,Gres,GresUsed,StateLong`); `size_for` turns a device count into
the node count and devices per node a resize asks Slurm for.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping

from .accounting import FLOORS
from .policy import JobView, NodeView, Snapshot
from .report import job_sla

USABLE_STATES = {"idle", "mixed", "allocated"}
"""Node states whose free devices a job could get (not down, drained, draining, completing...)."""


def _gpus(gres: str) -> int:
    """`gpu:4`, `gpu:a100:4(IDX:0-3)`, `gpu:0` -> the count; several kinds add up."""
    total = 0
    for item in gres.split(","):
        item = re.sub(r"\(.*?\)", "", item.strip())
        parts = item.split(":")
        if parts and parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def idle_devices(sinfo: str, closed: Collection[str] = ()) -> int:
    """Free devices on usable nodes, from `sinfo -N -h -O NodeList:40,Gres:80,GresUsed:80,StateLong:40`
    (a node listed once per partition counts once); none on `closed` nodes (reserved for a protected
    job: no other job can get them)."""
    return sum(idle_by_node(sinfo, closed).values())


def idle_by_node(sinfo: str, closed: Collection[str] = ()) -> dict[str, int]:
    """`idle_devices` node by node (usable nodes only)."""
    seen: dict[str, int] = {}
    for line in sinfo.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        node, gres, used, state = fields[0], fields[1], fields[2], fields[3].lower()
        # a flag after the state: `*` not responding, `%`/`!` powering down, `@`/`^` rebooting
        if state[-1:] in "*%!@^" or state.rstrip("~#$-") not in USABLE_STATES or node in closed:
            continue
        seen[node] = max(_gpus(gres) - _gpus(used), 0)
    return seen


def size_for(devices: int, gpus_per_node: int) -> tuple[int, int]:
    """The fewest nodes of at most `gpus_per_node` devices that hold `devices`, and the devices per
    node (every node the same: Slurm asks a count per node), at most `devices` in all."""
    if devices < 1 or gpus_per_node < 1:
        raise ValueError(f"cannot size {devices} device(s) on nodes of {gpus_per_node}")
    nodes = math.ceil(devices / gpus_per_node)
    return nodes, devices // nodes


def snapshot(slurm_jobs: Iterable[Mapping[str, str]], records: Mapping[int, dict], idle: int,
             protected: Iterable[int], now: float, window: float, max_ranks_per_device: int,
             tier_of_partition, idle_nodes: Mapping[str, int] | None = None,
             leaving: Collection[int] = ()) -> Snapshot:
    """The controller's view: every running or pending Singularity job Slurm knows, with its slack
    from the registry's accounting; a distributed job (its registry shows a size) is elastic down
    to the devices its ranks fit on (`max_ranks_per_device` to a device). With `idle_nodes`
    (`idle_by_node`), the per-node view too: where each running job holds its devices, and the
    shape (nodes x devices per node) each pending job needs to start. `leaving`: the running jobs
    Slurm is preempting (`SlurmClient.preempting`)."""
    protected, leaving = set(protected), set(leaving)
    views = []
    for job in slurm_jobs:
        state = job.get("JobState")
        if state not in ("RUNNING", "PENDING") or not job.get("JobId", "").isdigit():
            continue
        job_id = int(job["JobId"])
        tier = tier_of_partition(job.get("Partition", ""))
        if tier not in FLOORS or "TresPerNode" not in job:
            continue  # not a tier's; or its size could not be read (Slurm's table leaves it out)
        record = records.get(job_id)
        accounted = job_sla(record, now=now, window=window) if record else None
        requested = int(accounted.requested) if accounted else _devices(job)
        held = _devices(job) if state == "RUNNING" else 0
        ranks = _ranks(record)
        fewest = requested if ranks is None else min(requested, math.ceil(ranks / max_ranks_per_device))
        slack, left = window, window
        if accounted and accounted.windows:
            current = accounted.windows[-1]
            left = max(current.start + window - now, 0.0)
            had = current.fraction * (current.end - current.start)
            slack = had + left - FLOORS[tier] * window
        submitted = float(record.get("eligible_at") or 0.0) if record else 0.0
        where, shape = _placement(job, held) if idle_nodes is not None else ((), None)
        views.append(JobView(str(job_id), tier, max(requested, 1), max(fewest, 1), held, slack, left,
                             job_id in protected, submitted, where, shape,
                             leaving=held > 0 and job_id in leaving))
    nodes = tuple(NodeView(name, free) for name, free in sorted((idle_nodes or {}).items()))
    return Snapshot(idle, tuple(views), nodes)


def _placement(job: Mapping[str, str],
               held: int) -> tuple[tuple[tuple[str, int], ...], tuple[int, int] | None]:
    """A running job's devices by node (every node of its list the same count, as Slurm asks per
    node); a pending job's (nodes, devices per node). Unknown parts are empty."""
    from singularity_slurm.jobenv import expand_hostlist
    from singularity_slurm.slurmcli import parse_gpu_count

    per_node = parse_gpu_count(dict(job))
    if per_node <= 0:
        return (), None
    if held:
        try:
            nodes = expand_hostlist(job.get("NodeList", ""))
        except ValueError:
            return (), None
        return tuple((node, per_node) for node in nodes), None
    count = job.get("NumNodes", "")
    return (), ((int(count), per_node) if count.isdigit() and int(count) > 0 else None)


def _devices(job: Mapping[str, str]) -> int:
    from singularity_slurm.slurmcli import allocated_devices

    return allocated_devices(dict(job))


def _ranks(record: dict | None) -> int | None:
    """A distributed job's world size, from its latest size event."""
    if not record:
        return None
    sizes = [e for e in record.get("events") or [] if e.get("event") == "size"]
    try:
        return int(sizes[-1]["size"]["ranks"]) if sizes else None
    except (KeyError, TypeError, ValueError):
        return None
