"""`singularity-sim`: a discrete-event model of a Slurm cluster replaying a job trace three ways.

- `native`: Slurm's partition-priority preemption with requeue; a preempted job loses what it did
  since its own last application checkpoint (every `app_checkpoint_s` of running) and pays
  `restore_s` to start again.
- `singularity`: the same scheduling, but a preempted job is checkpointed (`checkpoint_s`, holding
  its devices) and loses nothing; it pays `restore_s` when it starts again.
- `controller`: Singularity plus the SLA controller (`policy.decide`, the daemon's own decisions):
  protected jobs are not preempted, elastic jobs shrink instead of being requeued, and shrunk jobs
  grow back on idle devices. A resize costs a checkpoint and a restore.

Scheduling, as Slurm does it with partition priorities and a simple backfill: pending jobs in tier
order (premium, standard, basic), then submission order; each starts where it fits (an elastic job
in `controller` mode on as few as its floor); one that does not fit preempts running jobs of lower
tiers (the lowest tier first, the latest started first) when that frees enough.

Placement: with `placement="pool"` (the default) devices are one pool (`nodes` x `gpus_per_node`)
and a job fits wherever enough of them are idle. With `placement="nodes"` each node's devices are
its own: a job of up to `gpus_per_node` devices runs on one node (the one with the fewest idle
devices that hold it, as Slurm packs), a larger one on as few nodes as hold it, its devices spread
evenly; preemption takes lower-tier jobs from the nodes that need the fewest devices freed; a job
that fits by count but not by node waits (fragmentation) while smaller jobs may start around it.
There, the controller's shrinks, grows and migrations come from its periodic decisions
(`policy.decide` with the per-node view), and a migrated job is checkpointed and queued again,
kept off the node it left.
"""

from __future__ import annotations

import argparse
import bisect
import enum
import heapq
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import accounting, policy, trace
from .accounting import FLOORS, Segment
from .policy import TIER_RANK

MODES = ("native", "singularity", "controller")
PLACEMENTS = ("pool", "nodes")


@dataclass(frozen=True)
class SimParams:
    nodes: int = 2
    gpus_per_node: int = 8
    mode: str = "singularity"
    checkpoint_s: float = 30.0
    restore_s: float = 60.0
    app_checkpoint_s: float = 3600.0
    window_s: float = accounting.WINDOW_S
    controller_period_s: float = 60.0
    placement: str = "pool"  # or "nodes" (see the module's docstring)
    controller_start_s: float = 0.0  # the controller's first decision (then one every period)

    @property
    def devices(self) -> int:
        return self.nodes * self.gpus_per_node


class Phase(enum.StrEnum):
    """A simulated job's phase.

    PENDING -> RUNNING | RESTORING (a start after a preemption) ; RESTORING -> RUNNING ;
    RUNNING -> CHECKPOINTING (preempted, singularity modes) | PENDING (preempted, native)
            | RESIZING (controller) | DONE ; CHECKPOINTING -> PENDING ; RESIZING -> RUNNING
    """

    PENDING = "pending"
    RESTORING = "restoring"
    RUNNING = "running"
    CHECKPOINTING = "checkpointing"
    RESIZING = "resizing"
    DONE = "done"


@dataclass
class SimJob:
    spec: trace.TraceJob
    phase: Phase = Phase.PENDING
    held: int = 0
    done: float = 0.0  # full-size seconds of work done
    since: float = 0.0  # when `done` and the segments were last brought up to date
    version: int = 0  # invalidates a job's scheduled events when its plan changes
    started_at: float | None = None
    run_start: float = 0.0  # when the current stretch of useful running began
    done_at_run_start: float = 0.0
    preemptions: int = 0
    resizes: int = 0
    lost: float = 0.0  # full-size seconds of work redone (native mode)
    finished: float | None = None
    protected: bool = False
    resize_to: int = 0  # the size a resize in progress gives the job
    where: dict[int, int] = field(default_factory=dict)  # placement "nodes": devices held, by node
    giving: dict[int, int] = field(default_factory=dict)  # what a shrink in progress frees, by node
    excluded: set[int] = field(default_factory=set)  # nodes it was migrated off
    migrations: int = 0
    segments: list[Segment] = field(default_factory=list)
    win_start: float = 0.0
    win_had: float = 0.0  # device-fraction seconds delivered in the current window

    @property
    def need(self) -> int:
        """The fewest devices it starts on where jobs are elastic."""
        return policy.fewest_to_start(self.spec.tier, self.spec.gpus, self.spec.min_gpus)

    @property
    def rate(self) -> float:
        return self.held / self.spec.gpus if self.phase == Phase.RUNNING else 0.0


@dataclass(frozen=True)
class Outcome:
    mode: str
    jobs: int
    makespan_s: float
    horizon_s: float  # the span the fleet figures cover: from 0 to the last submission
    utilization: float  # device-seconds held / device-seconds available, over the horizon
    goodput: float  # device-seconds of progress kept / device-seconds available, over the horizon
    attainment: dict[str, float | None]  # per tier: the share of job windows meeting the floor
    mean_fraction: dict[str, float | None]
    completion_s: dict[str, dict[str, float]]  # per tier: mean, p50, p95 of submit -> end
    preemptions: int
    resizes: int
    lost_device_s: float  # device-seconds of work preempted jobs lost and did again (native)
    sim_seconds: float
    migrations: int = 0


class Simulation:
    """The event loop; `run()` returns the outcome."""

    def __init__(self, jobs: Sequence[trace.TraceJob], params: SimParams,
                 policy_params: policy.Params | None = None):
        if params.mode not in MODES:
            raise ValueError(f"unknown mode {params.mode!r}; valid modes: {', '.join(MODES)}")
        if params.placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {params.placement!r}; valid: {', '.join(PLACEMENTS)}")
        too_big = [j for j in jobs if j.min_gpus > params.devices]
        if too_big:
            raise trace.TraceError(f"job {too_big[0].job_id} asks for {too_big[0].min_gpus} devices; the "
                                   f"cluster has {params.devices} ({params.nodes} x {params.gpus_per_node})")
        seen: set[str] = set()
        for j in jobs:
            if j.job_id in seen:
                raise trace.TraceError(f"job {j.job_id} is in the trace twice")
            seen.add(j.job_id)
        self.params = params
        self.policy = policy_params or policy.Params(preemption_cost_s=params.checkpoint_s + params.restore_s)
        self.jobs = {j.job_id: SimJob(j, since=j.submit, win_start=j.submit) for j in jobs}
        self.free = params.devices
        self.by_node = params.placement == "nodes"
        self.node_free = [params.gpus_per_node] * params.nodes if self.by_node else []
        self.node_coming = [0] * params.nodes if self.by_node else []  # what checkpoints will free there
        self.unreserved_nodes: list[int] = list(self.node_free)
        self.now = 0.0
        self.events: list[tuple[float, int, str, str, int]] = []
        self.seq = 0
        self.pending: dict[str, list[SimJob]] = {tier: [] for tier in TIER_RANK}  # by submission
        self.active: dict[str, SimJob] = {}  # holding devices
        self.horizon = (max((j.submit for j in jobs), default=0.0)
                        or max((j.duration for j in jobs), default=1.0))
        self.held_seconds = 0.0  # within the horizon
        self.kept_seconds = 0.0  # device-seconds of progress within the horizon, less what was lost
        self.coming = 0  # devices that checkpoints in progress (preemptions, shrinks) will free
        self.held_by_tier = dict.fromkeys(TIER_RANK, 0)  # devices held, by tier
        self.unreserved = self.free  # idle devices no waiting job is promised (after `_schedule`)
        self.actions: list[tuple[float, policy.Action]] = []
        self.timeline: list[tuple[float, str, str, int]] = []
        """What happened, in order: (time, what, job id, devices): `start` (on `devices`),
        `preempt`, `end`, and the controller's `protect`, `unprotect`, and the `shrink` and `grow`
        (to `devices`) it carried out (as in `singularityctl sla --actions`)."""
        for job in self.jobs.values():
            self._at(job.spec.submit, "submit", job)
        if params.mode == "controller":
            self._at(params.controller_start_s, "tick", None)

    # --- events ---------------------------------------------------------------------------------

    def _at(self, when: float, kind: str, job: SimJob | None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, kind, job.spec.job_id if job else "",
                                     job.version if job else 0))

    def run(self) -> Outcome:
        began = time.perf_counter()
        left = len(self.jobs)
        while self.events and left:
            when, _, kind, job_id, version = heapq.heappop(self.events)
            self.now = when
            job = self.jobs.get(job_id)
            if job is not None and version != job.version:
                continue  # a plan that changed since
            if kind == "submit":
                self._queue(job)
            elif kind == "finish":
                self._update(job)
                self._release(job)
                job.phase, job.finished = Phase.DONE, when
                self.timeline.append((when, "end", job_id, 0))
                left -= 1
            elif kind == "checkpointed":  # a preempted job's dump is done: its devices are free
                self._update(job)
                self.coming -= job.held
                for node, count in job.where.items():
                    self.node_coming[node] -= count
                self._release(job)
                job.phase = Phase.PENDING
                self._queue(job)
            elif kind == "resized":  # a resize's checkpoint is done: what it gives up is free
                self._update(job)
                if job.resize_to < job.held:
                    self.free += job.held - job.resize_to
                    self.coming -= job.held - job.resize_to
                    self.held_by_tier[job.spec.tier] -= job.held - job.resize_to
                    job.held = job.resize_to
                    for node, count in job.giving.items():
                        self.node_free[node] += count
                        self.node_coming[node] -= count
                        job.where[node] -= count
                        if not job.where[node]:
                            del job.where[node]
                    job.giving = {}
                job.version += 1
                self._at(when + self._restore_s(job), "running", job)
            elif kind == "running":  # restored, or resized
                self._update(job)
                self._run(job)
            elif kind == "tick":
                self._control()
                if left:
                    self._at(when + self.params.controller_period_s, "tick", None)
            if self.by_node:
                self._schedule_nodes()
            else:
                self._schedule()
        return self._outcome(time.perf_counter() - began)

    # --- bookkeeping ----------------------------------------------------------------------------

    def _update(self, job: SimJob) -> None:
        """Bring a job's work, accounting segments and current window up to now."""
        now, rate = self.now, job.rate
        if now > job.since:
            job.done += rate * (now - job.since)
            devices = job.held if job.phase == Phase.RUNNING else 0
            if devices:
                last = job.segments[-1] if job.segments else None
                if last is not None and last.end == job.since and last.devices == devices:
                    job.segments[-1] = Segment(last.start, now, devices)
                else:
                    job.segments.append(Segment(job.since, now, devices))
            inside = max(min(now, self.horizon) - max(job.since, 0.0), 0.0)
            self.held_seconds += job.held * inside
            self.kept_seconds += devices * inside
            self._window(job, job.since, now, devices)
        job.since = now

    def _window(self, job: SimJob, start: float, end: float, devices: int) -> None:
        w = self.params.window_s
        while start < end:
            boundary = job.win_start + w
            if end < boundary:
                job.win_had += (end - start) * devices / job.spec.gpus
                return
            job.win_had += (boundary - start) * devices / job.spec.gpus
            job.win_start, job.win_had, start = boundary, 0.0, boundary

    def _view(self, job: SimJob) -> policy.JobView:
        """The job as the controller sees it now (its slack from its current window; a pending
        job's is not looked at, and its accounting is brought up to date when it starts)."""
        if job.phase == Phase.PENDING:
            shares = self._shares(job.spec.gpus) if self.by_node else None
            return policy.JobView(job.spec.job_id, job.spec.tier, job.spec.gpus, job.spec.min_gpus, 0, 0.0,
                                  self.params.window_s, job.protected, job.spec.submit,
                                  shape=(len(shares), shares[0]) if shares else None)
        self._update(job)
        self._window(job, self.now, self.now, 0)
        rest = max(job.win_start + self.params.window_s - self.now, 0.0)
        slack = job.win_had + rest - FLOORS[job.spec.tier] * self.params.window_s
        return policy.JobView(job.spec.job_id, job.spec.tier, job.spec.gpus, job.spec.min_gpus,
                              job.held if job.phase == Phase.RUNNING else 0, slack, rest, job.protected,
                              job.spec.submit, tuple((f"n{n}", c) for n, c in sorted(job.where.items())))

    def _release(self, job: SimJob) -> None:
        for node, count in job.where.items():
            self.node_free[node] += count
        job.where = {}
        self.free += job.held
        self.held_by_tier[job.spec.tier] -= job.held
        job.held = 0
        self.active.pop(job.spec.job_id, None)
        job.version += 1

    def _run(self, job: SimJob) -> None:
        job.phase = Phase.RUNNING
        job.run_start, job.done_at_run_start = self.now, job.done
        job.version += 1
        rate = job.rate
        self._at(self.now + max(job.spec.duration - job.done, 0.0) / rate, "finish", job)

    # --- scheduling -----------------------------------------------------------------------------

    def _queue(self, job: SimJob) -> None:
        bisect.insort(self.pending[job.spec.tier], job, key=lambda j: (j.spec.submit, j.spec.job_id))

    def _start(self, job: SimJob, devices: int, where: dict[int, int] | None = None) -> None:
        self._update(job)
        self.pending[job.spec.tier].remove(job)
        self.free -= devices
        for node, count in (where or {}).items():
            self.node_free[node] -= count
        job.where = dict(where or {})
        self.held_by_tier[job.spec.tier] += devices
        job.held = devices
        self.active[job.spec.job_id] = job
        if job.started_at is None:
            job.started_at = self.now
        self.timeline.append((self.now, "start", job.spec.job_id, devices))
        if (job.preemptions or job.migrations) and self._restore_s(job) > 0:
            job.phase = Phase.RESTORING
            job.version += 1
            self._at(self.now + self._restore_s(job), "running", job)
        else:
            self._run(job)

    def _preemptible(self, tier: str) -> list[SimJob]:
        return sorted((j for j in self.active.values()
                       if TIER_RANK[j.spec.tier] > TIER_RANK[tier]
                       and j.phase in (Phase.RUNNING, Phase.RESTORING)
                       and not j.protected),
                      key=lambda j: (-TIER_RANK[j.spec.tier], -(j.started_at or 0.0), j.spec.job_id))

    def _checkpoint_s(self, job: SimJob) -> float:
        return self.params.checkpoint_s if job.spec.checkpoint_s is None else job.spec.checkpoint_s

    def _restore_s(self, job: SimJob) -> float:
        return self.params.restore_s if job.spec.restore_s is None else job.spec.restore_s

    def _preempt(self, job: SimJob) -> None:
        self._update(job)
        self.timeline.append((self.now, "preempt", job.spec.job_id, 0))
        job.preemptions += 1
        if self.params.mode == "native":
            saved = job.done  # still restarting: nothing done since the last start
            if job.phase == Phase.RUNNING:
                kept = math.floor((self.now - job.run_start) / self.params.app_checkpoint_s) \
                    * self.params.app_checkpoint_s * job.rate
                saved = job.done_at_run_start + kept
            job.lost += job.done - saved
            if self.now <= self.horizon:
                self.kept_seconds -= (job.done - saved) * job.spec.gpus
            job.done = saved
            self._release(job)
            job.phase = Phase.PENDING
            self._queue(job)
            return
        self._checkpoint(job)

    def _checkpoint(self, job: SimJob) -> None:
        """The job stops at a checkpoint; its devices are free once it is done."""
        job.phase = Phase.CHECKPOINTING
        self.coming += job.held
        for node, count in job.where.items():
            self.node_coming[node] += count
        job.version += 1
        self._at(self.now + self._checkpoint_s(job), "checkpointed", job)

    def _schedule(self) -> None:
        """One pass of the scheduler, in priority order. A job that must wait for devices being freed
        (a preempted or shrinking job's checkpoint) keeps them, and the idle ones it needs, from
        later jobs. In `controller` mode, elastic jobs of lower tiers are shrunk (within their
        floors) rather than preempted whole where that makes room."""
        elastic = self.params.mode == "controller"
        free, coming = self.free, self.coming
        for tier in TIER_RANK:
            queue = self.pending[tier]
            if not queue:
                continue
            victims: list[SimJob] | None = None
            room = 0
            below = sum(held for t, held in self.held_by_tier.items() if TIER_RANK[t] > TIER_RANK[tier])
            for job in list(queue):
                need = job.need if elastic else job.spec.gpus
                if need <= free:
                    got = min(job.spec.gpus, free)
                    self._start(job, got)
                    free -= got
                    continue
                if free + coming < need:
                    if victims is None and free + coming + below < need:
                        if free == 0 and coming <= 0 and below == 0:
                            break  # nothing in this tier can start or preempt
                        continue  # not even every lower-tier job would make room
                    if victims is None:
                        victims = self._preemptible(tier)
                        room = sum(v.held for v in victims)
                    if free + coming + room < need:
                        if free == 0 and coming <= 0 and not victims:
                            break  # nothing in this tier can start or preempt
                        continue
                    short = need - free - coming
                    gives = {v.spec.job_id: v.held - policy.shrink_limit(self._view(v), self.policy)
                             for v in victims if elastic and v.phase == Phase.RUNNING and v.spec.elastic}
                    shrinkable = [v for v in victims if gives.get(v.spec.job_id, 0) > 0]
                    if shrinkable and sum(gives[v.spec.job_id] for v in shrinkable) >= short:
                        for victim in shrinkable:
                            if short <= 0:
                                break
                            give = min(gives[victim.spec.job_id], short)
                            held = victim.held
                            if self._resize(victim, held - give):
                                self.timeline.append((self.now, "shrink", victim.spec.job_id, held - give))
                                self.actions.append((self.now, policy.Shrink(
                                    victim.spec.job_id, held - give,
                                    f"makes room for {job.spec.tier} job {job.spec.job_id}")))
                                short -= give
                                coming += give
                                victims.remove(victim)
                                room -= held
                    while short > 0 and victims:
                        victim = victims.pop(0)
                        held = victim.held
                        room -= held
                        short -= held
                        self._preempt(victim)
                        if self.params.mode == "native":
                            free += held
                        else:
                            coming += held
                    if need <= free:  # native mode frees at once
                        got = min(job.spec.gpus, free)
                        self._start(job, got)
                        free -= got
                        continue
                take = min(free, need)
                free -= take
                coming -= need - take
        self.unreserved = free


    # --- placement "nodes" ----------------------------------------------------------------------

    def _shares(self, devices: int) -> list[int]:
        """A job's devices per node: one node up to `gpus_per_node`, else as few nodes as hold them,
        spread evenly (largest share first)."""
        k = max(math.ceil(devices / self.params.gpus_per_node), 1)
        base, extra = divmod(devices, k)
        return [base + 1] * extra + [base] * (k - extra)

    def _fit(self, job: SimJob, devices: int, idle: list[int]) -> dict[int, int] | None:
        """Where `devices` of the job fit in `idle` now: each share on the node with the fewest idle
        devices that hold it, none on a node it was migrated off."""
        chosen: dict[int, int] = {}
        for share in self._shares(devices):
            best = -1
            for node, free in enumerate(idle):
                if free >= share and node not in chosen and node not in job.excluded \
                        and (best < 0 or free < idle[best]):
                    best = node
            if best < 0:
                return None
            chosen[best] = share
        return chosen

    def _make_room(self, job: SimJob, devices: int, idle: list[int], coming: list[int]
                   ) -> tuple[dict[int, int], list[SimJob]] | None:
        """The nodes a waiting job takes and the lower-tier jobs to preempt there: for each share,
        the node that needs the fewest devices preempted (what checkpoints in progress free counts
        as free), its victims in preemption order. None where no such nodes exist."""
        on_node: dict[int, list[SimJob]] = {}
        for victim in self._preemptible(job.spec.tier):
            for node in victim.where:
                on_node.setdefault(node, []).append(victim)
        chosen: dict[int, int] = {}
        victims: list[SimJob] = []
        taken: set[str] = set()
        for share in self._shares(devices):
            best: tuple[int, int, list[SimJob]] | None = None
            for node in range(len(idle)):
                if node in chosen or node in job.excluded:
                    continue
                have = idle[node] + coming[node] + sum(v.where.get(node, 0) for v in victims)
                picked, cost = [], 0
                for victim in on_node.get(node, ()):
                    if have >= share:
                        break
                    if victim.spec.job_id not in taken:
                        picked.append(victim)
                        have += victim.where[node]
                        cost += victim.held
                if have >= share and (best is None or cost < best[1]):
                    best = (node, cost, picked)
                    if cost == 0:
                        break
            if best is None:
                return None
            chosen[best[0]] = share
            victims.extend(best[2])
            taken.update(v.spec.job_id for v in best[2])
        return chosen, victims

    def _grow_places(self, job: SimJob, extra: int) -> dict[int, int]:
        """Idle devices no waiting job is promised for a grow: on the job's own nodes first."""
        idle = self.unreserved_nodes
        order = sorted(range(len(idle)), key=lambda n: (n not in job.where, -idle[n], n))
        taken: dict[int, int] = {}
        for node in order:
            if extra <= 0:
                break
            count = min(idle[node], self.node_free[node], extra)
            if count > 0 and node not in job.excluded:
                taken[node] = count
                extra -= count
        return taken

    def _shrink_places(self, job: SimJob, give: int) -> dict[int, int]:
        """What a shrink frees, by node: from the nodes where the job holds the fewest first."""
        giving: dict[int, int] = {}
        for node in sorted(job.where, key=lambda n: (job.where[n], n)):
            if give <= 0:
                break
            count = min(job.where[node], give)
            giving[node] = count
            give -= count
        return giving

    def _schedule_nodes(self) -> None:
        """`_schedule` for placement "nodes": a job starts where it fits node by node (an elastic
        one in `controller` mode on as many of its devices as fit, at least its floor); one that
        does not fit preempts lower-tier jobs on the nodes that need the fewest freed, and keeps
        those nodes' devices from later jobs while their checkpoints run."""
        elastic = self.params.mode == "controller"
        idle, coming = list(self.node_free), list(self.node_coming)
        total = sum(idle)
        for tier in TIER_RANK:
            queue = self.pending[tier]
            below = sum(held for t, held in self.held_by_tier.items() if TIER_RANK[t] > TIER_RANK[tier])
            for job in list(queue):
                if total == 0 and not below and not any(coming):
                    break
                need = job.need if elastic else job.spec.gpus
                place = None
                for size in dict.fromkeys((min(job.spec.gpus, total), need)):
                    if need <= size <= total:
                        place = self._fit(job, size, idle)
                        if place:
                            break
                if place:
                    for node, count in place.items():
                        idle[node] -= count
                    total -= sum(place.values())
                    self._start(job, sum(place.values()), place)
                    continue
                plan = self._make_room(job, need, idle, coming)
                if plan is None:
                    continue  # fragmented, or nothing below it to preempt: it waits
                place, victims = plan
                for victim in victims:
                    held = victim.held
                    was = dict(victim.where)
                    self._preempt(victim)
                    below -= held
                    for node, count in was.items():
                        if self.params.mode == "native":
                            idle[node] += count
                            total += count
                        else:
                            coming[node] += count
                if self.params.mode == "native" and all(idle[n] >= c for n, c in place.items()):
                    for node, count in place.items():
                        idle[node] -= count
                    total -= sum(place.values())
                    self._start(job, sum(place.values()), place)
                    continue
                for node, count in place.items():  # kept for it while the checkpoints run
                    now = min(idle[node], count)
                    idle[node] -= now
                    total -= now
                    coming[node] -= count - now
        self.unreserved = total
        self.unreserved_nodes = idle

    # --- the controller -------------------------------------------------------------------------

    def _control(self) -> None:
        waiting = (j for queue in self.pending.values() for j in queue)
        views = [self._view(job) for job in (*self.active.values(), *waiting)
                 if job.phase in (Phase.RUNNING, Phase.PENDING)]
        nodes = tuple(policy.NodeView(f"n{i}", free) for i, free in enumerate(self.unreserved_nodes))
        # idle devices the scheduler keeps for a job that waits for a checkpoint are not idle to it
        for action in policy.decide(policy.Snapshot(self.unreserved, tuple(views), nodes), self.policy):
            self.actions.append((self.now, action))
            job = self.jobs[action.job_id]
            if isinstance(action, policy.Protect | policy.Unprotect):
                job.protected = isinstance(action, policy.Protect)
                self.timeline.append((self.now, type(action).__name__.lower(), action.job_id, 0))
            elif isinstance(action, policy.Migrate):
                if job.phase == Phase.RUNNING:
                    self._update(job)
                    job.migrations += 1
                    job.excluded.add(int(action.node[1:]))
                    self.timeline.append((self.now, "migrate", action.job_id, 0))
                    self._checkpoint(job)
            elif self._resize(job, action.devices):
                self.timeline.append((self.now, type(action).__name__.lower(), action.job_id, job.resize_to))

    def _resize(self, job: SimJob, devices: int) -> bool:
        """Checkpoint a running job and restart it on `devices` (a grow takes idle devices at once
        and holds them through the restart; a shrink frees what it gives up once its checkpoint is
        done). False where nothing would change."""
        self._update(job)
        if devices > job.held:
            devices = job.held + min(devices - job.held, self.free)
        devices = max(devices, job.spec.min_gpus)
        if devices == job.held or job.phase != Phase.RUNNING:
            return False
        if self.by_node and devices > job.held:
            taken = self._grow_places(job, devices - job.held)
            if not taken:
                return False
            devices = job.held + sum(taken.values())
            for node, count in taken.items():
                self.node_free[node] -= count
                job.where[node] = job.where.get(node, 0) + count
        job.resizes += 1
        job.phase = Phase.RESIZING
        job.resize_to = devices
        if devices > job.held:
            self.free -= devices - job.held
            self.held_by_tier[job.spec.tier] += devices - job.held
            job.held = devices
        else:
            self.coming += job.held - devices
            if self.by_node:
                job.giving = self._shrink_places(job, job.held - devices)
                for node, count in job.giving.items():
                    self.node_coming[node] += count
        job.version += 1
        self._at(self.now + self._checkpoint_s(job), "resized", job)
        return True

    # --- results --------------------------------------------------------------------------------

    def _outcome(self, seconds: float) -> Outcome:
        jobs = list(self.jobs.values())
        end = max((j.finished or 0.0) for j in jobs) if jobs else 0.0
        capacity = self.params.devices * self.horizon
        attainment: dict[str, float | None] = {}
        fractions: dict[str, float | None] = {}
        completion: dict[str, dict[str, float]] = {}
        for tier in FLOORS:
            of_tier = [j for j in jobs if j.spec.tier == tier and j.finished is not None]
            wins = [w for j in of_tier for w in accounting.windows(
                j.segments, j.spec.gpus, j.spec.submit, j.finished, FLOORS[tier], self.params.window_s)]
            attainment[tier] = accounting.attainment(wins)
            fractions[tier] = round(statistics.fmean(w.fraction for w in wins), 4) if wins else None
            times = sorted(j.finished - j.spec.submit for j in of_tier)
            if times:
                completion[tier] = {"mean": round(statistics.fmean(times), 1),
                                    "p50": round(_quantile(times, 0.5), 1),
                                    "p95": round(_quantile(times, 0.95), 1)}
        return Outcome(self.params.mode, len(jobs), round(end, 1), round(self.horizon, 1),
                       round(self.held_seconds / capacity, 4), round(self.kept_seconds / capacity, 4),
                       attainment, fractions, completion,
                       sum(j.preemptions for j in jobs), sum(j.resizes for j in jobs),
                       round(sum(j.lost * j.spec.gpus for j in jobs), 1), round(seconds, 3),
                       sum(j.migrations for j in jobs))


def _quantile(values: Sequence[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def compare(jobs: Sequence[trace.TraceJob], params: SimParams) -> list[Outcome]:
    """The same trace under every mode, side by side."""
    return [Simulation(jobs, SimParams(**{**asdict(params), "mode": mode})).run() for mode in MODES]


def table(outcomes: Sequence[Outcome]) -> str:
    """A Markdown table of the outcomes."""
    def share(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    moved = any(o.migrations for o in outcomes)  # only placement "nodes" migrates
    rows = ["| mode | utilization | goodput | premium SLA | standard SLA | preemptions | resizes | "
            + ("migrations | " if moved else "") + "lost work (GPU-h) | mean JCT basic (h) |",
            "|---|---|---|---|---|---|---|---|---|" + ("---|" if moved else "")]
    for o in outcomes:
        jct = o.completion_s.get("basic", {}).get("mean")
        rows.append(f"| {o.mode} | {o.utilization:.3f} | {o.goodput:.3f} | "
                    f"{share(o.attainment['premium'])} | "
                    f"{share(o.attainment['standard'])} | {o.preemptions} | {o.resizes} | "
                    + (f"{o.migrations} | " if moved else "")
                    + f"{o.lost_device_s / 3600:.1f} | {'-' if jct is None else f'{jct / 3600:.2f}'} |")
    return "\n".join(rows)


def plot(outcomes: Sequence[Outcome], path: Path, title: str) -> None:
    """A figure of the outcomes side by side: fleet figures, SLA attainment per tier, and job
    completion times per tier (needs matplotlib: the `sim` extra)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SimError("--plot needs matplotlib: pip install 'singularity-slurm[sim]'") from None
    modes = [o.mode for o in outcomes]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), constrained_layout=True)
    width = 0.8 / len(modes)

    def bars(ax, groups, values_of, ylabel):
        for i, o in enumerate(outcomes):
            values = [values_of(o, g) for g in groups]
            ax.bar([x + i * width for x in range(len(groups))], [v or 0 for v in values], width, label=o.mode)
        ax.set_xticks([x + width * (len(modes) - 1) / 2 for x in range(len(groups))], groups)
        ax.set_ylabel(ylabel)

    bars(axes[0], ["utilization", "goodput"], lambda o, g: getattr(o, g), "share of device time")
    axes[0].set_ylim(0, 1.05)
    tiers = [t for t in FLOORS if FLOORS[t] > 0]
    bars(axes[1], tiers, lambda o, t: o.attainment.get(t), "SLA attainment (job time meeting the floor)")
    axes[1].set_ylim(0, 1.05)
    bars(axes[2], list(FLOORS), lambda o, t: o.completion_s.get(t, {}).get("mean", 0) / 3600,
         "mean job completion time (h)")
    axes[0].legend(loc="lower right")
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


class SimError(Exception):
    """What the simulator cannot do as asked; the message says why."""


def _shares(text: str) -> tuple[tuple[str, float], ...]:
    shares = []
    for part in text.split(","):
        tier, _, share = part.partition("=")
        if tier.strip() not in FLOORS:
            raise argparse.ArgumentTypeError(f"unknown tier {tier.strip()!r} in {text!r}; "
                                             f"valid: {', '.join(FLOORS)}")
        try:
            value = float(share)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a share: {share!r} in {text!r} "
                                             "(e.g. premium=0.2)") from None
        if not (math.isfinite(value) and value >= 0):
            raise argparse.ArgumentTypeError(f"a share must be a non-negative number, not {share!r}")
        shares.append((tier.strip(), value))
    if not sum(v for _, v in shares) > 0:
        raise argparse.ArgumentTypeError(f"the shares in {text!r} add up to nothing")
    return tuple(shares)


def main(argv: list[str] | None = None) -> int:
    from . import importers, synth

    parser = argparse.ArgumentParser(
        prog="singularity-sim",
        description="Replay a job trace on a simulated Slurm cluster under Slurm's native preemption "
                    "(native), Singularity's work-conserving checkpoints (singularity), and Singularity "
                    "with the SLA controller's elasticity, protection and (with --placement nodes) "
                    "defragmentation (controller), side by side, and report utilization, goodput, "
                    "per-tier SLA attainment, completion times, preemptions, resizes and migrations.",
        epilog="Trace formats: csv (job_id, submit_s, duration_s, gpus, tier[, min_gpus, checkpoint_s, "
               "restore_s]; see singularity_slurm.sla.trace), philly (Philly's cluster_job_log JSON), "
               "philly-summary (Philly's jobs one CSV line each: timestamp, duration, num_gpus[, cluster], "
               "as the Pollux artifact publishes them), helios (Helios's cluster_log.csv). Published "
               "traces have no tiers: --tier-shares and --elastic-share draw them per job, the same way "
               "every run. Exit status: 0, or 2 for a bad trace or option.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("trace", type=Path, nargs="?", help="the job trace")
    source.add_argument("--synthetic", type=int, metavar="JOBS",
                        help="simulate a synthetic trace of JOBS jobs shaped like published ones instead")
    parser.add_argument("--format", choices=importers.FORMATS, default="csv", help="the trace's format (csv)")
    parser.add_argument("--cluster", metavar="VC",
                        help="philly-summary: simulate this virtual cluster's jobs only")
    parser.add_argument("--tier-shares", type=_shares, default=importers.DEFAULT_SHARES,
                        metavar="premium=P,standard=S,basic=B",
                        help="tiers drawn for a trace without them "
                             "(default premium=0.2,standard=0.3,basic=0.5)")
    parser.add_argument("--elastic-share", type=float, default=0.5,
                        help="share of multi-device non-premium jobs drawn elastic (default 0.5)")
    parser.add_argument("--load", type=float, default=1.0,
                        help="--synthetic: offered load as a share of the cluster's capacity (default 1.0)")
    parser.add_argument("--seed", type=int, default=1, help="--synthetic: random seed (default 1)")
    parser.add_argument("--nodes", type=int, default=SimParams.nodes,
                        help=f"nodes (default {SimParams.nodes})")
    parser.add_argument("--gpus-per-node", type=int, default=SimParams.gpus_per_node,
                        help=f"devices per node (default {SimParams.gpus_per_node})")
    parser.add_argument("--mode", choices=[*MODES, "all"], default="all", help="which model to run (all)")
    parser.add_argument("--placement", choices=PLACEMENTS, default="pool",
                        help="pool: a cluster's devices are one pool (default); nodes: each node's are "
                             "its own, so jobs fragment and the controller migrates small jobs to make "
                             "room for larger ones")
    parser.add_argument("--checkpoint-s", type=float, default=SimParams.checkpoint_s,
                        help=f"seconds a preempted job takes to checkpoint, holding its devices "
                             f"(default {SimParams.checkpoint_s:g})")
    parser.add_argument("--restore-s", type=float, default=SimParams.restore_s,
                        help=f"seconds a job takes to start again after a preemption or resize "
                             f"(default {SimParams.restore_s:g})")
    parser.add_argument("--app-checkpoint-s", type=float, default=SimParams.app_checkpoint_s,
                        help=f"native: how often a job checkpoints itself "
                             f"(default {SimParams.app_checkpoint_s:g})")
    parser.add_argument("--window-s", type=float, default=SimParams.window_s,
                        help=f"the SLA accounting window (default {SimParams.window_s:g})")
    parser.add_argument("--controller-period-s", type=float, default=SimParams.controller_period_s,
                        help=f"controller: how often it decides "
                             f"(default {SimParams.controller_period_s:g})")
    parser.add_argument("--write-trace", type=Path, metavar="FILE",
                        help="also write the trace simulated, as csv")
    parser.add_argument("--plot", type=Path, metavar="FILE",
                        help="also draw the outcomes (PNG; needs matplotlib)")
    parser.add_argument("--json", action="store_true", help="print the outcomes as JSON")
    args = parser.parse_args(argv)
    if args.nodes < 1 or args.gpus_per_node < 1:
        parser.error("--nodes and --gpus-per-node must be at least 1")
    if args.cluster is not None and args.synthetic is not None:
        parser.error("--cluster chooses a virtual cluster of a philly-summary trace, not of --synthetic")
    if args.synthetic is not None and args.synthetic < 1:
        parser.error("--synthetic needs at least 1 job")
    if not (0 <= args.elastic_share <= 1):
        parser.error("--elastic-share must be between 0 and 1")
    if not (math.isfinite(args.load) and args.load > 0):
        parser.error("--load must be a positive number")
    for name in ("checkpoint_s", "restore_s", "app_checkpoint_s", "window_s", "controller_period_s"):
        value = getattr(args, name)
        positive = name in ("app_checkpoint_s", "window_s", "controller_period_s")
        if not (math.isfinite(value) and value >= 0) or (positive and value == 0):
            parser.error(f"--{name.replace('_', '-')} must be a {'positive' if positive else 'non-negative'} "
                         f"number of seconds, not {value:g}")
    params = SimParams(args.nodes, args.gpus_per_node, "singularity", args.checkpoint_s, args.restore_s,
                       args.app_checkpoint_s, args.window_s, args.controller_period_s, args.placement)
    try:
        if args.synthetic is not None:
            jobs = synth.generate(args.synthetic, params.devices, args.load, args.seed,
                                  elastic_share=args.elastic_share)
            name = f"synthetic trace ({args.synthetic} jobs, load {args.load:g}, seed {args.seed})"
        else:
            try:
                text = args.trace.read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise trace.TraceError(f"cannot read the trace {args.trace}: "
                                       f"{getattr(exc, 'strerror', None) or exc}") from None
            jobs = importers.load(text, args.format, str(args.trace), args.tier_shares, args.elastic_share,
                                  args.cluster)
            name = f"{args.trace.name} ({len(jobs)} jobs)"
        if not jobs:
            raise trace.TraceError(f"{args.trace}: the trace holds no job to simulate")
        if args.write_trace:
            args.write_trace.write_text(trace.write(jobs))
        if args.mode == "all":
            outcomes = compare(jobs, params)
        else:
            outcomes = [Simulation(jobs, SimParams(**{**asdict(params), "mode": args.mode})).run()]
        if args.plot:
            plot(outcomes, args.plot, f"{name} on {args.nodes} x {args.gpus_per_node} devices")
    except (trace.TraceError, SimError, OSError) as exc:
        print(f"singularity-sim: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([asdict(o) for o in outcomes], indent=2))
    else:
        print(f"{name} on {args.nodes} x {args.gpus_per_node} devices")
        print(table(outcomes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
