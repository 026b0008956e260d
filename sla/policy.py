"""The SLA controller's decisions: a snapshot of the cluster in, actions out.

Slurm stays the scheduler of record: it starts pending jobs on idle devices and preempts lower tiers
for higher ones (partition priority). The controller only nudges it, through actions the daemon
carries out with Slurm's own interfaces and Singularity's actuators, and the simulator carries out
on its model:

- `Protect` a job whose window is about to miss its floor: once it could not survive one more
  preemption (its slack, the full-size seconds it may still lose this window, is less than what a
  preemption costs it), it is not preempted or shrunk until it has room again (`Unprotect`, at a
  few times that cost, so it does not flap).
- `Shrink` elastic jobs of lower tiers (within their floors, protected ones never) to make room for
  a higher-tier job that cannot start, rather than have Slurm requeue them whole.
- `Grow` jobs running below their request when idle devices are left that no pending job can use,
  higher tiers first.
- `Migrate` small jobs off a node (checkpoint, requeue away from it, restore elsewhere) where a
  pending multi-device job would fit in the idle devices by count but not by node: the fewest
  devices moved, only jobs of its tier or lower that can afford the move, and only where the moved
  jobs fit on the other nodes' idle devices. This needs the snapshot's per-node view; without it,
  devices are one pool and nothing is migrated.

Every action carries its reason, for the log and `singularityctl sla --actions`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .accounting import FLOORS, WINDOW_S

TIER_RANK = {"premium": 0, "standard": 1, "basic": 2}
"""Lower ranks preempt higher ones (the partition priorities of the tiers)."""


@dataclass(frozen=True)
class JobView:
    """One job as the controller sees it. `held` 0: pending; `slack`: seconds of full-size running it
    may still lose in its current window and meet its floor (accounting.slack); `window_left`: the
    seconds left in that window."""

    job_id: str
    tier: str
    requested: int
    min_devices: int
    held: int
    slack: float
    window_left: float = WINDOW_S
    protected: bool = False
    submitted: float = 0.0
    where: tuple[tuple[str, int], ...] = ()  # a running job's devices by node: (node, count)
    shape: tuple[int, int] | None = None  # a pending job's (nodes, devices per node), where known
    leaving: bool = False  # Slurm is preempting it: it still holds its devices, but not for long

    @property
    def running(self) -> bool:
        return self.held > 0

    @property
    def elastic(self) -> bool:
        return self.min_devices < self.requested


@dataclass(frozen=True)
class NodeView:
    name: str
    free: int  # idle devices a job could get there


@dataclass(frozen=True)
class Snapshot:
    free: int  # idle devices
    jobs: tuple[JobView, ...]
    nodes: tuple[NodeView, ...] = ()  # per node, where known (defragmentation needs it)


@dataclass(frozen=True)
class Params:
    preemption_cost_s: float = 120.0  # what one preemption or resize costs a job (checkpoint, wait, restore)
    unprotect_factor: float = 3.0
    defragment: bool = True  # migrate small jobs where a pending one fits by count but not by node


@dataclass(frozen=True)
class Protect:
    job_id: str
    reason: str = field(compare=False)


@dataclass(frozen=True)
class Unprotect:
    job_id: str
    reason: str = field(compare=False)


@dataclass(frozen=True)
class Shrink:
    job_id: str
    devices: int  # the job's new size
    reason: str = field(compare=False)


@dataclass(frozen=True)
class Grow:
    job_id: str
    devices: int
    reason: str = field(compare=False)


@dataclass(frozen=True)
class Migrate:
    job_id: str
    node: str  # the node it leaves (and is kept off, as `singularityctl migrate` does)
    reason: str = field(compare=False)


Action = Protect | Unprotect | Shrink | Grow | Migrate


def _order(job: JobView) -> tuple[int, float, str]:
    return TIER_RANK[job.tier], job.submitted, job.job_id


def fewest_to_start(tier: str, requested: int, min_devices: int) -> int:
    """The fewest devices an elastic job starts on: its own floor, and for a tier with a floor,
    the share of its request that floor asks for (started smaller, it would miss it window after
    window until it grew)."""
    return min(requested, max(min_devices, math.ceil(FLOORS[tier] * requested - 1e-9)))


def shrink_limit(job: JobView, params: Params | None = None) -> int:
    """The fewest devices a running job may be shrunk to (its `held`: it may not be shrunk): its own
    floor (`min_devices`), the share of its request its tier's floor asks for (a shrunk job may stay
    shrunk for whole windows), and, for a tier with a floor, what its current window can still
    afford once the resize's cost is paid. A protected job is never shrunk."""
    params = params or Params()
    if job.protected or not job.running:
        return job.held
    floor = FLOORS[job.tier]
    fewest = fewest_to_start(job.tier, job.requested, job.min_devices)
    if floor > 0:
        usable = job.window_left - params.preemption_cost_s
        if usable <= 0 or job.slack < params.preemption_cost_s:
            return job.held
        # after the resize: had + usable * d / requested >= floor * window, and
        # had = slack - window_left + floor * window
        owed = job.window_left - job.slack  # floor * window - had
        fewest = max(fewest, math.ceil(job.requested * owed / usable - 1e-9))
    return min(max(fewest, 1), job.held)


def decide(snapshot: Snapshot, params: Params | None = None) -> list[Action]:
    """What the controller does now (at most one action per job), in three steps:

    1. protect each running job of a tier with a floor whose slack is below a preemption's cost,
       and release those that have a few times that cost again (a job Slurm is preempting is
       neither, nor touched by the later steps);
    2. for each pending job (tier, then submission order) that idle devices cannot hold, shrink
       running jobs of lower tiers (lowest tier first, those with the most to give first, each no
       lower than `shrink_limit`) where that makes room for it; where one would fit in the idle
       devices by count but not by node (the snapshot's per-node view and its shape known),
       migrate small jobs off the nodes it lacks (`defragment`; one pending job per look);
    3. give idle devices that no pending job can use to running jobs below their request, higher
       tiers first.
    """
    params = params or Params()
    actions: list[Action] = []
    protected = {j.job_id for j in snapshot.jobs if j.protected}
    for job in sorted(snapshot.jobs, key=_order):
        if not job.running or job.leaving or FLOORS[job.tier] <= 0:
            continue
        if not job.protected and job.slack < params.preemption_cost_s:
            protected.add(job.job_id)
            actions.append(Protect(job.job_id, f"{job.tier} job can lose only {max(job.slack, 0):.0f}s "
                                               f"more this window; a preemption costs "
                                               f"{params.preemption_cost_s:.0f}s"))
        elif job.protected and job.slack >= params.unprotect_factor * params.preemption_cost_s:
            protected.discard(job.job_id)
            actions.append(Unprotect(job.job_id, f"{job.tier} job has {job.slack:.0f}s of slack again"))
    # A job Slurm is preempting is left alone: protecting it would not stop its preemption, only
    # reserve the nodes its preemptor is waiting for; resizing or moving it would race its requeue.
    touched: set[str] = {a.job_id for a in actions} | {j.job_id for j in snapshot.jobs if j.leaving}

    # what each running job could give, by tier rank
    gives: dict[str, int] = {}
    room_by_rank = dict.fromkeys(TIER_RANK.values(), 0)
    for job in snapshot.jobs:
        if job.running and job.job_id not in protected and job.job_id not in touched:
            give = job.held - shrink_limit(job, params)
            if give > 0:
                gives[job.job_id] = give
                room_by_rank[TIER_RANK[job.tier]] += give
    candidates = sorted((j for j in snapshot.jobs if j.job_id in gives),
                        key=lambda j: (-TIER_RANK[j.tier], -gives[j.job_id], j.job_id))

    free = snapshot.free
    node_free = {node.name: node.free for node in snapshot.nodes}
    defragmented = False  # one pending job's room is made at a time
    pending = sorted((j for j in snapshot.jobs if not j.running), key=_order)
    for want in pending:
        need, rank = fewest_to_start(want.tier, want.requested, want.min_devices), TIER_RANK[want.tier]
        if need <= free:
            free -= min(want.requested, free)  # Slurm starts it on idle devices by itself
            if node_free and want.shape and not _take(node_free, *want.shape) and params.defragment \
                    and not defragmented:
                movable = [j for j in snapshot.jobs if j.running and len(j.where) == 1
                           and j.job_id not in protected and j.job_id not in touched
                           and TIER_RANK[j.tier] >= rank and _can_move(j, params)]
                moves = defragment(node_free, movable, *want.shape)
                if moves:
                    defragmented = True
                    nodes, per = want.shape
                    for job, node in moves:
                        touched.add(job.job_id)
                        actions.append(Migrate(job.job_id, node,
                                               f"frees {node} for {want.tier} job {want.job_id} "
                                               f"({nodes} node(s) x {per} devices)"))
            continue
        room = sum(r for k, r in room_by_rank.items() if k > rank)
        if free + room < need:
            if free == 0 and not any(room_by_rank.values()):
                break
            continue  # shrinking cannot make room: Slurm's preemption decides
        short = need - free
        for victim in list(candidates):
            if short <= 0:
                break
            if TIER_RANK[victim.tier] <= rank:
                continue
            give = min(gives[victim.job_id], short)
            short -= give
            candidates.remove(victim)
            room_by_rank[TIER_RANK[victim.tier]] -= gives[victim.job_id]
            touched.add(victim.job_id)
            actions.append(Shrink(victim.job_id, victim.held - give,
                                  f"makes room for {want.tier} job {want.job_id} ({need} devices)"))
        free = 0  # what was freed goes to the waiting job

    if free > 0 and all(fewest_to_start(j.tier, j.requested, j.min_devices) > free for j in pending):
        for job in sorted((j for j in snapshot.jobs if j.running and j.held < j.requested
                           and j.job_id not in touched), key=_order):
            if free <= 0:
                break
            grow = min(job.requested - job.held, free)
            free -= grow
            actions.append(Grow(job.job_id, job.held + grow,
                                f"{grow} idle device(s) no pending job can use"))
    return actions


def _can_move(job: JobView, params: Params) -> bool:
    """A move costs the job what a preemption does: a job of a tier with a floor must afford it."""
    return FLOORS[job.tier] <= 0 or job.slack >= params.preemption_cost_s


def _take(node_free: dict[str, int], nodes: int, per_node: int) -> bool:
    """Place `nodes` x `per_node` devices on the nodes with the fewest idle devices that hold them
    (best fit, as Slurm packs); False, and nothing taken, where fewer nodes can."""
    fitting = sorted((n for n, f in node_free.items() if f >= per_node), key=lambda n: (node_free[n], n))
    if len(fitting) < nodes:
        return False
    for node in fitting[:nodes]:
        node_free[node] -= per_node
    return True


def defragment(node_free: dict[str, int], movable: list[JobView], nodes: int,
               per_node: int) -> list[tuple[JobView, str]]:
    """The moves that give a pending job of `nodes` x `per_node` devices its nodes: for each node it
    lacks, the node that needs the fewest devices moved off it (its smallest `movable` one-node jobs
    first), each moved job placed on another node's idle devices (best fit; not on a node being
    freed, nor on what the pending job takes of a node that already fits). Updates `node_free` as if
    the moves and the job's start were done; [] (and nothing changed) where no such moves exist."""
    fitting = [n for n, f in node_free.items() if f >= per_node]
    missing = nodes - len(fitting)
    if missing <= 0:
        return []
    options = []
    for node, idle in node_free.items():
        if idle >= per_node:
            continue
        chosen, got = [], idle
        for job in sorted((j for j in movable if j.where[0][0] == node), key=lambda j: (j.held, j.job_id)):
            if got >= per_node:
                break
            chosen.append(job)
            got += job.held
        if got >= per_node:
            options.append((sum(j.held for j in chosen), len(chosen), node, chosen))
    if len(options) < missing:
        return []
    targets = sorted(options, key=lambda o: o[:3])[:missing]
    freed = {node for _, _, node, _ in targets}
    room = {n: f - (per_node if n in fitting else 0) for n, f in node_free.items() if n not in freed}
    moves = []
    for job in sorted((j for _, _, _, chosen in targets for j in chosen), key=lambda j: (-j.held, j.job_id)):
        homes = sorted((n for n, f in room.items() if f >= job.held), key=lambda n: (room[n], n))
        if not homes:
            return []
        room[homes[0]] -= job.held
        moves.append((job, job.where[0][0]))
    for node in freed:
        room[node] = node_free[node] + sum(job.held for job, left in moves if left == node) - per_node
    node_free.update(room)
    return moves
