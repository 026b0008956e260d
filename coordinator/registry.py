"""The job registry in Redis: written by Prolog and Epilog, read by `singularityctl status`."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from singularity_slurm.config import RedisConfig
from singularity_slurm.errors import RegistryError

from . import keys

RECORD_TTL_S = 7 * 24 * 3600
"""Records of ended jobs are kept this long, then Redis drops them."""
CHECKPOINT_REASONS = ("periodic", "manual", "preempt", "requeue", "migrate", "resize")
"""Why a checkpoint was taken: the only values a checkpoint request, the registry or a metric's label
holds (a drain moves a job with "migrate")."""
MAX_EVENTS = 10_000
"""Events kept per job, the oldest dropped first: a job that checkpoints every few minutes keeps weeks
of them, and one that asks for checkpoints without end cannot grow its record without bound."""
MAX_CHECKPOINTS = 50
"""Checkpoint summaries kept per job (the store keeps the checkpoints themselves)."""
MAX_STRING = 512
"""Characters kept of any string an event or summary holds (errors, refusals, node names)."""
MAX_ITEMS = 64
"""Entries kept of any list or object an event or summary holds."""
MAX_ENTRY_BYTES = 4096
"""Bytes of one stored event or summary; a larger one keeps only its top-level numbers and short strings."""


def bounded(value: Any, depth: int = 0) -> Any:
    """`value` (JSON-able) with strings clipped to MAX_STRING characters, lists and objects to
    MAX_ITEMS entries and nesting to 4 levels: what a job's own request or output may have put in
    an event reaches Redis only this small."""
    if isinstance(value, str):
        return value if len(value) <= MAX_STRING else value[:MAX_STRING] + "...(clipped)"
    if isinstance(value, bool | int | float) or value is None:
        return value
    if depth >= 4:
        return "...(nested too deep)"
    if isinstance(value, dict):
        return {bounded(str(k)): bounded(v, depth + 1) for k, v in list(value.items())[:MAX_ITEMS]}
    if isinstance(value, list | tuple):
        return [bounded(v, depth + 1) for v in value[:MAX_ITEMS]]
    return bounded(str(value), depth)


def entry_json(entry: dict) -> str:
    """One event or checkpoint summary as stored: bounded, and at most MAX_ENTRY_BYTES."""
    text = json.dumps(bounded(entry))
    if len(text) <= MAX_ENTRY_BYTES:
        return text
    small = {k: v for k, v in bounded(entry).items()
             if isinstance(v, bool | int | float) or v is None or (isinstance(v, str) and len(v) <= 128)}
    return json.dumps({**small, "clipped": True})


@dataclass(frozen=True)
class NodeStart:
    """What the prolog of one node reports."""

    job_id: int
    node: str
    user: str
    uid: int
    tier: str
    partition: str
    gpus: list[str]
    restart_count: int
    started_at: float
    services: dict[str, int] = field(default_factory=dict)  # name -> pid
    # the job's request and first eligibility, from Slurm's record, for the SLA accounting (kept
    # from the first start that knows them)
    requested_devices: int | None = None
    eligible_at: float | None = None
    # the node's GPUs of the job as NVML saw them at the start (node.gpus.Gpu records); None where
    # NVML could not tell
    gpu_inventory: list[dict] | None = None


def client(config: RedisConfig, timeout: float = 5.0, authenticate: bool = True) -> redis.Redis:
    """A client of the coordinator's Redis (its unix socket where configured, else TCP), not yet
    connected; without `authenticate`, one that sends no password."""
    where = ({"unix_socket_path": str(config.socket)} if config.socket else
             {"host": config.host, "port": config.port, "socket_connect_timeout": timeout})
    return redis.Redis(**where, db=config.db, password=config.password() if authenticate else None,
                       socket_timeout=timeout, decode_responses=True)


def connect(config: RedisConfig, timeout: float = 5.0) -> redis.Redis:
    """A connection to the coordinator's Redis; fails fast with the fix in the message."""
    client_ = client(config, timeout)
    where = config.address
    try:
        client_.ping()
    except redis.AuthenticationError as exc:
        raise RegistryError(
            f"Redis at {where} refused the password from "
            f"{config.password_file}: check it matches Redis's requirepass"
        ) from exc
    except redis.ResponseError as exc:
        if "NOAUTH" in str(exc):
            raise RegistryError(
                f"Redis at {where} needs a password: put it in "
                f"{config.password_file}"
            ) from exc
        raise RegistryError(f"Redis at {where}: {exc}") from exc
    except redis.RedisError as exc:
        raise RegistryError(
            f"cannot reach Redis at {where} ({exc}); is redis-server running?"
        ) from exc
    return client_


class Registry:
    """Reads and writes job records; takes its Redis connection from the caller."""

    def __init__(self, client: redis.Redis, clock=time.time):
        self.redis = client
        self.clock = clock

    def _event(self, job_id: int, event: dict, pipe: Any = None) -> None:
        """Append one event (bounded) to the job's list, which keeps the last MAX_EVENTS, and count
        it (three commands, in `pipe` where one is given, else at once): the job's record then says
        how many of its events were dropped (`events_dropped`)."""
        run = pipe if pipe is not None else self.redis.pipeline()
        run.rpush(keys.job_events(job_id), entry_json(event))
        run.ltrim(keys.job_events(job_id), -MAX_EVENTS, -1)
        run.incr(keys.job_events_total(job_id))
        if pipe is None:
            run.execute()

    def record_node_start(self, start: NodeStart) -> None:
        now = self.clock()
        pipe = self.redis.pipeline()
        pipe.hset(keys.job(start.job_id), mapping={
            "job_id": start.job_id,
            "user": start.user,
            "uid": start.uid,
            "tier": start.tier,
            "partition": start.partition,
            "restart_count": start.restart_count,
            "state": "running",
            "updated_at": now,
        })
        pipe.hsetnx(keys.job(start.job_id), "first_started_at", start.started_at)
        if start.requested_devices:
            pipe.hsetnx(keys.job(start.job_id), "requested_devices", start.requested_devices)
        if start.eligible_at:
            pipe.hsetnx(keys.job(start.job_id), "eligible_at", start.eligible_at)
        pipe.hset(keys.job(start.job_id), "started_at", start.started_at)
        pipe.hset(keys.job_node(start.job_id, start.node), mapping={
            "gpus": ",".join(start.gpus),
            "started_at": start.started_at,
            "services": json.dumps(start.services),
            "gpu_inventory": json.dumps(start.gpu_inventory),
        })
        pipe.sadd(keys.job_nodes(start.job_id), start.node)
        self._event(start.job_id, {
            "event": "node_start", "node": start.node, "time": start.started_at,
            "restart_count": start.restart_count, "gpus": len(start.gpus),
        }, pipe)
        pipe.zadd(keys.jobs(), {str(start.job_id): now})
        pipe.zremrangebyscore(keys.jobs(), "-inf", now - RECORD_TTL_S)
        for key in (keys.job(start.job_id), keys.job_nodes(start.job_id), keys.job_events(start.job_id),
                    keys.job_events_total(start.job_id), keys.job_checkpoints(start.job_id),
                    keys.job_node(start.job_id, start.node)):
            pipe.persist(key)
        pipe.execute()

    def record_node_end(self, job_id: int, node: str, ended_at: float) -> None:
        """Drop the node's part; the last node to end marks the job ended and starts its TTL."""
        now = self.clock()
        pipe = self.redis.pipeline()
        pipe.delete(keys.job_node(job_id, node))
        pipe.srem(keys.job_nodes(job_id), node)
        pipe.scard(keys.job_nodes(job_id))
        self._event(job_id, {"event": "node_end", "node": node, "time": ended_at}, pipe)
        remaining = pipe.execute()[2]
        if remaining == 0 and self.redis.exists(keys.job(job_id)):
            pipe = self.redis.pipeline()
            pipe.hset(keys.job(job_id), mapping={"state": "ended", "ended_at": ended_at,
                                                 "updated_at": now})
            pipe.zadd(keys.jobs(), {str(job_id): now})
            for key in (keys.job(job_id), keys.job_events(job_id), keys.job_events_total(job_id),
                        keys.job_checkpoints(job_id)):
                pipe.expire(key, RECORD_TTL_S)
            pipe.execute()

    def record_checkpoint(self, job_id: int, summary: dict, stop: bool | None = None,
                          dump_seconds: float | None = None, frozen_seconds: float | None = None,
                          cut_seconds: float | None = None, waited_seconds: float | None = None,
                          waited_frozen: bool = False) -> None:
        """Index a committed checkpoint (the store stays the truth; this only serves `status` and
        the SLA accounting: how long it took, when its dump ended, how long criu kept the tree frozen,
        how long the ranks took to reach the cut before it, how long it waited for one of the node's
        dump slots and whether it was frozen meanwhile, whether the tree stays stopped)."""
        pipe = self.redis.pipeline()
        pipe.rpush(keys.job_checkpoints(job_id), entry_json(summary))
        pipe.ltrim(keys.job_checkpoints(job_id), -MAX_CHECKPOINTS, -1)
        self._event(job_id,
                    {"event": "checkpoint", "seq": summary.get("seq"), "reason": summary.get("reason"),
                     "node": summary.get("node"), "seconds": summary.get("seconds"), "stop": stop,
                     "dump_seconds": dump_seconds, "frozen_seconds": frozen_seconds,
                     **({"cut_seconds": cut_seconds} if cut_seconds is not None else {}),
                     **({"waited_seconds": waited_seconds} if waited_seconds else {}),
                     **({"waited_frozen": True} if waited_frozen and waited_seconds else {}),
                     "time": self.clock()}, pipe)
        pipe.execute()

    def record_running(self, job_id: int, node: str, how: str, devices: int, turns: int = 0) -> None:
        """From now the job's trees on `node` run (`how`: start | restore) on `devices` of its
        devices (for the SLA accounting), `turns` of which their ranks take turns on."""
        self._event(job_id, {"event": "running", "how": how, "node": node, "devices": devices,
                             "turns": turns, "time": self.clock()})

    def record_failure(self, job_id: int, node: str, reason: str, error: str) -> None:
        """A checkpoint that failed (the job then resumes from its last good one)."""
        self._event(job_id, {"event": "checkpoint_failed", "reason": reason, "node": node,
                             "error": error, "time": self.clock()})

    def record_restore(self, job_id: int, node: str, seq: int, seconds: float | None,
                       refused: list[dict]) -> None:
        self._event(job_id, {"event": "restore", "seq": seq, "node": node, "seconds": seconds,
                             "refused": refused, "time": self.clock()})

    def record_size(self, job_id: int, node: str, how: str, size: dict, cause: str | None = None,
                    was: dict | None = None) -> None:
        """A distributed job's size at a start or restore (`how`), with what stopped it before (the
        checkpoint's reason: preempt, resize, migrate...) and the size it had then."""
        self._event(job_id, {"event": "size", "how": how, "node": node, "size": size,
                             "cause": cause, "was": was, "time": self.clock()})

    def checkpoints(self, job_id: int) -> list[dict]:
        return [json.loads(e) for e in self.redis.lrange(keys.job_checkpoints(job_id), 0, -1)]

    def job(self, job_id: int) -> dict | None:
        record = self.redis.hgetall(keys.job(job_id))
        if not record:
            return None
        nodes = {}
        for node in sorted(self.redis.smembers(keys.job_nodes(job_id))):
            raw = self.redis.hgetall(keys.job_node(job_id, node))
            nodes[node] = {
                "gpus": [g for g in raw.get("gpus", "").split(",") if g],
                "started_at": float(raw.get("started_at", 0) or 0),
                "services": json.loads(raw.get("services") or "{}"),
                "gpu_inventory": json.loads(raw.get("gpu_inventory") or "null"),
            }
        pipe = self.redis.pipeline()  # the list and its count as of one moment
        pipe.lrange(keys.job_events(job_id), 0, -1)
        pipe.get(keys.job_events_total(job_id))
        listed, total = pipe.execute()
        events = [json.loads(e) for e in listed]
        # a record from before the count: a full list may have lost some
        dropped = (max(int(total) - len(events), 0) if total is not None
                   else int(len(events) >= MAX_EVENTS))
        try:
            return {
                "job_id": int(record["job_id"]),
                "user": record.get("user"),
                "uid": int(record.get("uid", -1)),
                "tier": record.get("tier"),
                "partition": record.get("partition"),
                "state": record.get("state"),
                "restart_count": int(record.get("restart_count", 0)),
                "first_started_at": float(record.get("first_started_at", 0) or 0),
                "requested_devices": (int(record["requested_devices"]) if "requested_devices" in record
                                      else None),
                "eligible_at": float(record["eligible_at"]) if "eligible_at" in record else None,
                "started_at": float(record.get("started_at", 0) or 0),
                "ended_at": float(record["ended_at"]) if "ended_at" in record else None,
                "nodes": nodes,
                "events": events,
                # events pushed out of the list (its oldest): the SLA accounting then gives the job
                # full service before the oldest it still has, so flooding its own history gains nothing
                "events_dropped": dropped,
                "checkpoints": self.checkpoints(job_id),
            }
        except (KeyError, ValueError) as exc:
            raise RegistryError(f"malformed record {keys.job(job_id)}: {record!r}") from exc

    def job_ids(self) -> list[int]:
        return [int(j) for j in self.redis.zrange(keys.jobs(), 0, -1)]
