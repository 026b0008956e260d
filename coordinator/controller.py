"""`singularity-controller`: the SLA controller, one per cluster.

Each period it reads Slurm (jobs, and the devices nodes have free) and the registry (each job's
accounting), asks `sla.policy.decide` what to do, carries out what it may, and writes every
decision with its reason and outcome to Redis (`singularityctl sla --actions`):

- Protect / Unprotect: the job joins (leaves) the protected set: it is never shrunk, nor taken as
  room for another job, while it is in it. With `--actuate` (and `sla.protect_nodes`), while a
  protected job runs its nodes are reserved for root (`sla.reserve`): Slurm's own preemption cannot
  take them for another job. (It cannot be held off by a job update: 22.05 refuses a QOS or
  partition change of a job that is not pending.) Each reservation ends `hold_s` ahead and is
  extended every look, so a controller that stops lets its protections lapse.
- Grow / Shrink: with `--actuate`, a `resize` request, signed with munge as root and sent through
  Redis to the job's node agent, exactly as `singularityctl resize` sends it for an admin;
  without, the decision is logged as advice.
- Migrate (defragmentation): with `--actuate`, a `migrate` request away from the node, as
  `singularityctl migrate JOBID --exclude NODE` sends it; the job stays off that node.

Two copies are safe: a leader lease in Redis (`SET NX PX`, extended only by its holder) lets one
decide; the other waits its turn. `--metrics-port` serves Prometheus metrics (`prometheus_client`).
Decisions are the pure `policy.decide` of the snapshot `sla.fleet.snapshot` builds; this module is
the thin shell that gathers and acts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from singularity_slurm.config import Config, load
from singularity_slurm.errors import SingularityError
from singularity_slurm.sla import fleet, policy, report, reserve
from singularity_slurm.sla.accounting import FLOORS, attainment
from singularity_slurm.slurmcli import SlurmClient

from . import keys
from .commands import CommandClient, new_request
from .registry import CHECKPOINT_REASONS, Registry, connect

LOG = logging.getLogger("singularity.controller")
ACTIONS_KEPT = 1000
SEND_PICKUP_S = 20.0  # a resize the job's agent has not taken by then is withdrawn
SEND_TIMEOUT_S = 60.0  # how long one resize may hold up a look (its checkpoint takes longer for big jobs)
SINFO = ["sinfo", "-N", "-h", "-O", "NodeList:64,Gres:128,GresUsed:128,StateLong:40"]


class Lease:
    """Who decides: the first to set the key holds it for `lease_s`, and only it extends it."""

    _EXTEND = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
               "return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end")
    _RELEASE = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
                "return redis.call('del', KEYS[1]) else return 0 end")

    def __init__(self, client: redis.Redis, identity: str, lease_s: float):
        self.client = client
        self.identity = identity
        self.lease_ms = int(lease_s * 1000)

    def hold(self) -> bool:
        """Take the lease, or extend it if it is ours; False while another holds it."""
        if self.client.set(keys.sla_leader(), self.identity, nx=True, px=self.lease_ms):
            return True
        return bool(self.client.eval(self._EXTEND, 1, keys.sla_leader(), self.identity, self.lease_ms))

    def holder(self) -> str | None:
        return self.client.get(keys.sla_leader())

    def release(self) -> None:
        self.client.eval(self._RELEASE, 1, keys.sla_leader(), self.identity)


@dataclass
class Gathered:
    snapshot: policy.Snapshot
    slurm: dict[int, dict[str, str]]  # the Singularity jobs Slurm knows, by id
    records: dict[int, dict]  # their registry records
    gpus_per_node: int  # the most devices a usable node has
    reserved: dict[str, reserve.Held]  # the reservations of protected jobs' nodes, by name


def gpus_per_node(sinfo: str) -> int:
    """The most devices any node has, from the same `sinfo` lines as `fleet.idle_devices`."""
    most = 0
    for line in sinfo.splitlines():
        fields = line.split()
        if len(fields) >= 2:
            most = max(most, fleet._gpus(fields[1]))
    return most


class Controller:
    def __init__(self, config: Config, client: redis.Redis, slurm: SlurmClient, *, actuate: bool = False,
                 params: policy.Params | None = None, clock: Callable[[], float] = time.time,
                 send: Callable[[int, str, dict[str, Any], str], dict] | None = None, metrics: Any = None,
                 window: float | None = None, hold_s: float = 300.0):
        self.config = config
        self.hold_s = hold_s  # a protected job's node reservation ends this far ahead of each look
        self.window = float(window or config.sla.window_s)
        self.client = client
        self.slurm = slurm
        self.actuate = actuate
        self.params = params or policy.Params()
        self.clock = clock
        self.send = send or self._send
        self.metrics = metrics

    def gather(self) -> Gathered:
        now = self.clock()
        registry = Registry(self.client)
        slurm_jobs = [j for j in self.slurm.job_table("pending,running", gpus=True)
                      if self.config.tier_of_partition(j.get("Partition")) is not None]
        records = {}
        for job in slurm_jobs:
            if job.get("JobState") in ("RUNNING", "PENDING"):
                record = registry.job(int(job["JobId"]))
                if record is not None:
                    records[int(job["JobId"])] = record
        sinfo = self.slurm.run(SINFO).stdout
        reserved = reserve.parse(self.slurm.run(reserve.LIST_ARGV).stdout)
        protected = {int(j) for j in self.client.smembers(keys.sla_protected()) if str(j).isdigit()}
        by_node = fleet.idle_by_node(sinfo, reserve.closed_nodes(reserved))
        snapshot = fleet.snapshot(slurm_jobs, records, sum(by_node.values()), protected, now, self.window,
                                  self.config.elastic.max_ranks_per_device, self.config.tier_of_partition,
                                  by_node, self.slurm.preempting())
        return Gathered(snapshot, {int(j["JobId"]): j for j in slurm_jobs}, records, gpus_per_node(sinfo),
                        reserved)

    def tick(self, leading: Callable[[], bool] = lambda: True) -> list[dict[str, Any]]:
        """One look at the cluster: the decisions, each as logged (with its outcome). `leading` is
        asked before each action: one that lost the lease meanwhile does no more."""
        gathered = self.gather()
        # jobs Slurm no longer runs or holds leave the protected set (a job id may come again)
        known = {str(j) for j in gathered.slurm}
        stale = [j for j in self.client.smembers(keys.sla_protected()) if str(j) not in known]
        if stale:
            self.client.srem(keys.sla_protected(), *stale)
        actions = policy.decide(gathered.snapshot, self.params)
        if self.reserving and actions:  # the actions may take minutes: none of the holds lapses meanwhile
            self.hold_nodes(gathered, extend_only=True)
        done = []
        for action in actions:
            if not leading():
                LOG.warning("lost the lease: %d decision(s) of this look not carried out",
                            len(actions) - len(done))
                break
            done.append(self.apply(action, gathered))
        if self.reserving and leading():
            self.hold_nodes(gathered)
        if self.metrics is not None:
            self.metrics.observe(gathered, done, self.client, self.window)
        return done

    def apply(self, action: policy.Action, gathered: Gathered) -> dict[str, Any]:
        job_id = int(action.job_id)
        entry: dict[str, Any] = {"time": round(self.clock(), 3), "action": type(action).__name__.lower(),
                                 "job_id": job_id, "reason": action.reason}
        if isinstance(action, policy.Protect):
            self.client.sadd(keys.sla_protected(), job_id)
            entry["outcome"] = "protected: not shrunk, nor taken as room for another job" + (
                f"; its nodes reserved while it runs ({reserve.name_of(job_id)})"
                if self.reserving and self._preemptible(job_id, gathered) else "")
        elif isinstance(action, policy.Unprotect):
            self.client.srem(keys.sla_protected(), job_id)
            entry["outcome"] = "no longer protected"
        elif isinstance(action, policy.Migrate):
            entry["node"] = action.node
            entry["outcome"] = self._migrate(job_id, action.node, gathered)
        else:
            entry["devices"] = action.devices
            entry["outcome"] = self._resize(job_id, action.devices, gathered)
        LOG.info("%s job %s%s: %s (%s)", entry["action"], job_id,
                 f" to {entry['devices']} device(s)" if "devices" in entry
                 else f" off {entry['node']}" if "node" in entry else "", entry["outcome"], entry["reason"])
        pipe = self.client.pipeline()
        pipe.rpush(keys.sla_actions(), json.dumps(entry))
        pipe.ltrim(keys.sla_actions(), -ACTIONS_KEPT, -1)
        pipe.execute()
        return entry

    @property
    def reserving(self) -> bool:
        """Protected jobs' nodes are held by reservations (acting, and the site allows it)."""
        return self.actuate and self.config.sla.protect_nodes

    def _preemptible(self, job_id: int, gathered: Gathered) -> bool:
        """A job of a tier below the highest (tiers are configured highest first): another tier's
        jobs may preempt it, so its protection needs its nodes reserved."""
        tier = self.config.tier_of_partition(gathered.slurm.get(job_id, {}).get("Partition"))
        return tier is not None and tier != next(iter(self.config.tiers), None)

    def hold_nodes(self, gathered: Gathered, extend_only: bool = False) -> list[reserve.Step]:
        """Make, extend, move or delete the protected jobs' reservations to match who is protected
        and running now; a step Slurm refuses is logged and tried again at the next look. With
        `extend_only`, only the holds that stay are extended (before a look's actions)."""
        protected = {int(j) for j in self.client.smembers(keys.sla_protected())
                     if str(j).isdigit() and self._preemptible(int(j), gathered)}
        steps = reserve.plan(reserve.wanted_for(protected, gathered.slurm), gathered.reserved)
        if extend_only:
            steps = [step for step in steps if isinstance(step, reserve.Extend)]
        done = []
        for step in steps:
            proc = self.slurm.run(reserve.argv(step, int(self.hold_s)), check=False)
            if proc.returncode != 0:
                LOG.warning("%s: Slurm refused it: %s", " ".join(reserve.argv(step, int(self.hold_s))),
                            (proc.stderr or proc.stdout).strip())
                continue
            done.append(step)
            if not isinstance(step, reserve.Extend):
                LOG.info("%s %s%s", "reserved" if isinstance(step, reserve.Create) else "released",
                         step.name, f" on {step.nodes}" if isinstance(step, reserve.Create) else "")
        return done

    def _resize(self, job_id: int, devices: int, gathered: Gathered) -> str:
        job = gathered.slurm.get(job_id, {})
        host = job.get("BatchHost")
        per_node = gathered.gpus_per_node or devices
        if not self.actuate:
            return "advised (the controller runs without --actuate)"
        if not host:
            return "not done: Slurm shows no batch host for the job"
        nodes, per = fleet.size_for(devices, per_node)
        try:
            reply = self.send(job_id, "resize", {"nodes": [nodes, nodes], "gpus_per_node": per}, host)
        except SingularityError as exc:
            return f"failed: {exc}"
        if not reply.get("ok"):
            return f"refused: {reply.get('error')}"
        return f"resized: checkpoint {reply.get('seq')} taken, requeued for {nodes} node(s) x {per} device(s)"

    def _migrate(self, job_id: int, node: str, gathered: Gathered) -> str:
        host = gathered.slurm.get(job_id, {}).get("BatchHost")
        if not self.actuate:
            return "advised (the controller runs without --actuate)"
        if not host:
            return "not done: Slurm shows no batch host for the job"
        try:
            reply = self.send(job_id, "migrate", {"exclude": [node]}, host)
        except SingularityError as exc:
            return f"failed: {exc}"
        if not reply.get("ok"):
            return f"refused: {reply.get('error')}"
        taken = f"checkpoint {reply['seq']} taken" if reply.get("seq") is not None else "checkpointed"
        return f"migrated: {taken}, requeued away from {node}"

    def _send(self, job_id: int, op: str, args: dict[str, Any], host: str) -> dict:
        """A resize or migrate request; the wait for its answer stays well inside the lease (the
        request may still be carried out after it: the next look sees the job's new size or place)."""
        request = new_request(job_id, op, args)
        return CommandClient(self.client).send(request, where=host, say=lambda text: LOG.info("%s", text),
                                               pickup_timeout=SEND_PICKUP_S, timeout=SEND_TIMEOUT_S)


def actions(client: redis.Redis, limit: int = ACTIONS_KEPT) -> list[dict]:
    """The controller's logged decisions, oldest first."""
    out = []
    for raw in client.lrange(keys.sla_actions(), -limit, -1):
        try:
            out.append(json.loads(raw))
        except ValueError:
            continue
    return out


def unseen(events: list[dict], last: dict | None) -> list[dict]:
    """The events after `last`, the newest one counted before (the registry keeps only a job's last
    MAX_EVENTS, so positions move): all of them where `last` is None or was dropped since."""
    if last is not None:
        for at in range(len(events) - 1, -1, -1):
            if events[at] == last:
                return events[at + 1:]
    return events


class Metrics:
    """What the controller exports to Prometheus: the fleet and the tiers' guarantees."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.leader = Gauge("singularity_controller_leader", "1 while this controller holds the lease",
                            registry=r)
        self.idle = Gauge("singularity_devices_idle", "devices free on usable nodes", registry=r)
        self.held = Gauge("singularity_devices_allocated", "devices held by Singularity jobs", ["tier"],
                          registry=r)
        self.jobs = Gauge("singularity_jobs", "Singularity jobs Slurm knows", ["tier", "state"], registry=r)
        self.attainment = Gauge("singularity_sla_attainment",
                                "share of closed job time, over the registry's jobs, in windows that met "
                                "the tier's floor", ["tier"], registry=r)
        self.fraction = Histogram("singularity_gpu_fraction", "GPU fraction of each closed window", ["tier"],
                                  buckets=(0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0), registry=r)
        self.checkpoints = Counter("singularity_checkpoints", "checkpoints committed, by reason (preempt, "
                                   "requeue, resize, migrate (a drain's too), periodic, manual)", ["reason"],
                                   registry=r)
        self.checkpoint_seconds = Histogram("singularity_checkpoint_seconds", "checkpoint duration",
                                            buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300), registry=r)
        self.checkpoint_bytes = Counter("singularity_checkpoint_new_bytes", "bytes checkpoints added to the "
                                        "store", registry=r)
        self.restores = Counter("singularity_restores", "restores", registry=r)
        self.restore_seconds = Histogram("singularity_restore_seconds", "restore duration",
                                         buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300), registry=r)
        self.decisions = Counter("singularity_controller_actions", "the controller's decisions", ["action"],
                                 registry=r)
        self._seen_events: dict[int, dict] = {}  # job -> the last of its events counted
        self._seen_windows: set[tuple[int, float]] = set()
        self._first = True

    def serve(self, port: int, address: str = "") -> None:
        from prometheus_client import start_http_server

        start_http_server(port, addr=address, registry=self.registry)

    def observe(self, gathered: Gathered, done: list[dict], client: redis.Redis, window: float) -> None:
        self.idle.set(gathered.snapshot.free)
        counts: dict[tuple[str, str], int] = {}
        held: dict[str, int] = dict.fromkeys(FLOORS, 0)
        for view in gathered.snapshot.jobs:
            state = "running" if view.running else "pending"
            counts[(view.tier, state)] = counts.get((view.tier, state), 0) + 1
            held[view.tier] += view.held
        for tier in FLOORS:
            self.held.labels(tier).set(held[tier])
            for state in ("running", "pending"):
                self.jobs.labels(tier, state).set(counts.get((tier, state), 0))
        for entry in done:
            self.decisions.labels(entry["action"]).inc()
        registry = Registry(client)
        windows: dict[str, list] = {tier: [] for tier in FLOORS}
        job_ids = registry.job_ids()
        for gone in set(self._seen_events) - set(job_ids):  # records Redis has dropped
            del self._seen_events[gone]
        for job_id in job_ids:
            record = registry.job(job_id)
            if record is None:
                continue
            accounted = report.job_sla(record, window=window)
            if accounted is not None:
                windows[accounted.tier].extend(accounted.windows)
                for w in accounted.windows:
                    if w.met is not None and (job_id, w.start) not in self._seen_windows:
                        self._seen_windows.add((job_id, w.start))
                        if not self._first:
                            self.fraction.labels(accounted.tier).observe(w.fraction)
            events = record.get("events") or []
            fresh = unseen(events, self._seen_events.get(job_id))
            for event in fresh:
                if self._first:
                    break
                if event.get("event") == "checkpoint":
                    reason = event.get("reason")
                    self.checkpoints.labels(reason if reason in CHECKPOINT_REASONS else "other").inc()
                    if isinstance(event.get("seconds"), int | float):
                        self.checkpoint_seconds.observe(event["seconds"])
                elif event.get("event") == "restore":
                    self.restores.inc()
                    if isinstance(event.get("seconds"), int | float):
                        self.restore_seconds.observe(event["seconds"])
            if not self._first:
                seqs = {e.get("seq") for e in fresh if e.get("event") == "checkpoint"}
                for summary in record.get("checkpoints") or []:
                    if summary.get("seq") in seqs and isinstance(summary.get("new_bytes"), int):
                        self.checkpoint_bytes.inc(summary["new_bytes"])
            if events:
                self._seen_events[job_id] = events[-1]
        for tier, spans in windows.items():
            value = attainment(spans)
            if value is not None:
                self.attainment.labels(tier).set(value)
        self._first = False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="singularity-controller",
        description="The SLA controller: reads Slurm and the registry every --period seconds, protects jobs "
                    "whose tier's floor is at risk, grows shrunk jobs onto idle devices and shrinks elastic "
                    "lower-tier jobs to make room (with --actuate), logs every decision "
                    "(singularityctl sla --actions) and serves Prometheus metrics. Run one per cluster, as "
                    "root; a second copy waits for the first's lease.")
    parser.add_argument("--period", type=float, default=30.0, help="seconds between looks (default 30)")
    parser.add_argument("--lease", type=float, default=None,
                        help="seconds the leader lease lasts unless extended (default 3 periods)")
    parser.add_argument("--actuate", action="store_true",
                        help="carry out grows and shrinks (resize requests) and reserve protected "
                             "running jobs' nodes (sla.protect_nodes); without, they are logged as advice")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="serve Prometheus metrics on this port")
    parser.add_argument("--metrics-address", default="127.0.0.1", help="address to serve them on (127.0.0.1)")
    parser.add_argument("--window", type=int, default=None, metavar="SECONDS",
                        help="accounting window (default: the configuration's sla.window_s)")
    parser.add_argument("--preemption-cost", type=float, default=policy.Params.preemption_cost_s,
                        metavar="SECONDS", help="what a preemption or resize costs a job: a job with less "
                        f"slack in its window is protected (default {policy.Params.preemption_cost_s:g})")
    parser.add_argument("--once", action="store_true", help="decide once (taking the lease) and exit")
    parser.add_argument("--json", action="store_true", help="with --once: print the decisions as JSON")
    args = parser.parse_args(argv)
    if not (args.period > 0) or (args.lease is not None and not args.lease > 0):
        parser.error("--period and --lease must be positive numbers of seconds")
    if not args.preemption_cost >= 0:
        parser.error("--preemption-cost must be a number of seconds, not negative")
    if args.window is not None and not 10 <= args.window <= 86400:
        parser.error("--window must be 10..86400 seconds")
    if args.metrics_port is not None and not 1 <= args.metrics_port <= 65535:
        parser.error("--metrics-port must be 1..65535")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = load()
        client = connect(config.redis)
    except SingularityError as exc:
        print(f"singularity-controller: {exc}", file=sys.stderr)
        return 2
    identity = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
    lease_s = args.lease or max(3 * args.period, 3 * SEND_TIMEOUT_S)
    lease = Lease(client, identity, lease_s)
    metrics = None
    if args.metrics_port is not None:
        metrics = Metrics()
        metrics.serve(args.metrics_port, args.metrics_address)
    controller = Controller(config, client, SlurmClient(), actuate=args.actuate, metrics=metrics,
                            params=policy.Params(preemption_cost_s=args.preemption_cost), window=args.window,
                            hold_s=max(60.0, 6 * args.period, lease_s))
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        while not stopping.is_set():
            try:
                leading = lease.hold()
            except redis.RedisError as exc:
                # Redis is away (restarting, unreachable): nobody can decide; try again next period
                LOG.warning("cannot reach Redis for the leader lease: %s", exc)
                if args.once:
                    print(f"singularity-controller: cannot reach Redis: {exc}", file=sys.stderr)
                    return 2
                if metrics is not None:
                    metrics.leader.set(0)
                stopping.wait(args.period)
                continue
            if metrics is not None:
                metrics.leader.set(1 if leading else 0)
            if leading:
                try:
                    done = controller.tick(leading=lease.hold)
                except Exception as exc:  # noqa: BLE001 - one bad look (Slurm, Redis, a record) is logged, not fatal
                    LOG.warning("this look at the cluster failed: %s", exc)
                    done = []
                if args.once:
                    if args.json:
                        print(json.dumps(done, indent=2))
                    return 0
            elif args.once:
                try:
                    holder = lease.holder()
                except redis.RedisError:
                    holder = "another controller"
                print(f"singularity-controller: {holder} holds the lease; not deciding", file=sys.stderr)
                return 1
            stopping.wait(args.period)
    finally:
        try:
            lease.release()
        except redis.RedisError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
