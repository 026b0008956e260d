"""`singularityctl checkpoint|migrate|resize JOBID`: act on a running job through its node agent.

The owner's request travels as a job step (`srun --jobid=J --overlap`) to the job's batch node, where
it talks to the job's node agent over its unix socket; Slurm lets a user start steps only in their own
jobs, and the agent serves only the job's user and root (SO_PEERCRED). Slurm refuses root's and
anyone else's steps in another user's job, so root and the operators named in `[admin] operators` go
through Redis instead, with the request signed by munge (`coordinator.commands`); the agent checks
the signer itself. The checks below exist to say clearly, before anything is sent, who may do what.
"""

from __future__ import annotations

import json
import pwd
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from singularity_slurm.config import Config
from singularity_slurm.coordinator.commands import CommandClient, new_request
from singularity_slurm.coordinator.registry import connect
from singularity_slurm.errors import CommandChannelError, ConfigError, RegistryError, SingularityError
from singularity_slurm.slurmcli import SlurmClient, expand_hostlist, parse_user


class JobControlError(SingularityError):
    """The job cannot be checkpointed or migrated now; the message says why."""


def check_target(record: dict[str, str] | None, job_id: int, caller_uid: int, config: Config,
                 action: str, caller_name: str | None = None) -> dict[str, str]:
    """Refuse anything but a running, managed job of the caller (any job for root and operators)."""
    if record is None:
        raise JobControlError(f"no job {job_id}: Slurm does not know it (finished jobs are forgotten "
                              "after MinJobAge)")
    if record.get("JobId") != str(job_id):
        # the job's own name (printed after JobId) can read as ` JobId=N`: the request would go to N
        raise JobControlError(f"Slurm's record for job {job_id} names job {record.get('JobId')!r} (the job's "
                              "name may imitate Slurm's fields, or an array's own record is gone): refusing "
                              "to act on it")
    user, uid = parse_user(record.get("UserId", ""))
    if uid != caller_uid and not config.admin.is_admin(caller_uid, caller_name):
        raise JobControlError(f"job {job_id} belongs to {user}: you can only {action} your own jobs")
    state = record.get("JobState")
    if state != "RUNNING":
        raise JobControlError(f"job {job_id} is {state}: only a running job can be {action}ed"
                              if not action.endswith("e") else
                              f"job {job_id} is {state}: only a running job can be {action}d")
    if config.tier_of_partition(record.get("Partition")) is None:
        raise JobControlError(f"job {job_id} runs in partition {record.get('Partition')}, which belongs to "
                              "no SLA tier: Singularity does not manage it")
    if not record.get("BatchHost"):
        raise JobControlError(f"job {job_id} has no batch host yet; try again in a moment")
    return record


def agent_call_argv(ctl: str, job_id: int, host: str, op: str, args: dict[str, Any]) -> list[str]:
    return ["srun", f"--jobid={job_id}", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={host}",
            "--quiet", ctl, "agent-call", op, json.dumps(args)]


def parse_agent_reply(stdout: str, stderr: str) -> dict[str, Any]:
    for line in reversed(stdout.strip().splitlines()):
        try:
            reply = json.loads(line)
        except ValueError:
            continue
        if isinstance(reply, dict):
            return reply
    raise JobControlError(f"no answer from the job's node agent: {stderr.strip() or stdout.strip()}")


def user_name(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


class JobControl:
    def __init__(self, config: Config, slurm: SlurmClient, caller_uid: int,
                 say: Callable[[str], None] = print, ctl: str | None = None,
                 caller_name: str | None = None, channel: Callable[[], CommandClient] | None = None):
        self.config = config
        self.slurm = slurm
        self.caller_uid = caller_uid
        self.caller_name = caller_name if caller_name is not None else user_name(caller_uid)
        self.say = say
        self.ctl = ctl or str(Path(sys.executable).with_name("singularityctl"))
        self.channel = channel or self._connect

    def _check(self, job_id: int, action: str) -> dict[str, str]:
        # state, partition and batch host from squeue's fields: the job's comment cannot redirect
        # an operator's request
        return check_target(self.slurm.job_record(job_id), job_id, self.caller_uid, self.config, action,
                            self.caller_name)

    def _owner(self, record: dict[str, str]) -> bool:
        return parse_user(record.get("UserId", ""))[1] == self.caller_uid

    def _step(self, record: dict[str, str], op: str, args: dict[str, Any]) -> dict[str, Any]:
        """The owner's way: a job step on the batch host talks to the agent's socket."""
        argv = agent_call_argv(self.ctl, int(record["JobId"]), record["BatchHost"], op, args)
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired as exc:
            job = record["JobId"]
            raise JobControlError(f"job {job}: no answer from its node agent on {record['BatchHost']} within "
                                  f"{exc.timeout:.0f}s; the request may still be carried out: check with "
                                  f"`singularityctl status {job}`") from exc
        except OSError as exc:
            raise JobControlError(f"cannot start `srun` to reach job {record['JobId']}'s node agent: {exc}; "
                                  "is Slurm's srun on PATH?") from exc
        return self._answer(record, parse_agent_reply(proc.stdout, proc.stderr))

    def _through_redis(self, record: dict[str, str], op: str, args: dict[str, Any]) -> dict[str, Any]:
        """Root's and operators' way: a munge-signed request through Redis (the agent checks the signer)."""
        request = new_request(int(record["JobId"]), op, args)
        reply = self.channel().send(request, where=record["BatchHost"], say=self.say)
        return self._answer(record, reply)

    def _answer(self, record: dict[str, str], reply: dict[str, Any]) -> dict[str, Any]:
        if not reply.get("ok"):
            raise JobControlError(f"job {record['JobId']}: {reply.get('error')}")
        return reply

    def _connect(self) -> CommandClient:
        redis_config = self.config.redis
        try:
            return CommandClient(connect(redis_config, timeout=10))
        except ConfigError as exc:
            raise CommandChannelError(
                f"cannot read the Redis password file {redis_config.password_file}, through which root and "
                "operators act on other users' jobs: ask the admin for group read access (admin guide, "
                "\"Operators\")") from exc
        except RegistryError as exc:
            raise CommandChannelError(f"{exc} (root and operators act on other users' jobs through "
                                      "Redis)") from exc

    def checkpoint(self, job_id: int) -> dict[str, Any]:
        record = self._check(job_id, "checkpoint")
        nodes = expand_hostlist(record.get("NodeList", ""))
        where = ",".join(nodes) or record["BatchHost"]
        self.say(f"checkpointing job {job_id} on {where} (it keeps running)...")
        if not self._owner(record):
            return self._through_redis(record, "checkpoint", {})
        if len(nodes) > 1:  # only the job's launcher can checkpoint every node
            return self._step(record, "launcher_checkpoint", {})
        return self._step(record, "checkpoint", {"reason": "manual", "stop": False})

    def migrate(self, job_id: int, exclude: list[str] | None, wait: float = 180.0) -> dict[str, Any]:
        record = self._check(job_id, "migrate")
        nodes = expand_hostlist(record.get("NodeList", ""))
        exclude = exclude or nodes
        unknown = sorted(set(exclude) - set(self.slurm.nodes()))
        if unknown:
            raise JobControlError(f"--exclude names unknown node(s) {', '.join(unknown)}")
        restarts = int(record.get("Restarts", 0) or 0)
        self.say(f"migrating job {job_id} away from {','.join(exclude)}: checkpointing...")
        call = self._step if self._owner(record) else self._through_redis
        reply = call(record, "migrate", {"exclude": exclude})
        self.say(f"checkpoint {reply['seq']} committed in {reply['seconds']:.1f}s; job requeued")
        return self._running_again(job_id, restarts, reply, wait)

    def resize(self, job_id: int, nodes: tuple[int, int] | None, gpus_per_node: int | None,
               wait: float = 180.0) -> dict[str, Any]:
        """Checkpoint a distributed job, requeue it with a new node count range and GPUs per node,
        and (unless `wait` is 0) wait until it runs again; its launcher refuses a size that cannot
        hold the job's world size, before anything stops."""
        from singularity_slurm.coordinator.commands import Refused, resize_args

        try:
            args = resize_args({"nodes": list(nodes) if nodes else None, "gpus_per_node": gpus_per_node})
        except Refused as exc:
            raise JobControlError(exc.reason) from None
        record = self._check(job_id, "resize")
        restarts = int(record.get("Restarts", 0) or 0)
        self.say(f"resizing job {job_id} (now {record.get('NumNodes')} node(s) on "
                 f"{record.get('NodeList')}): checkpointing...")
        call = self._step if self._owner(record) else self._through_redis
        reply = call(record, "resize", args)
        self.say(f"checkpoint {reply['seq']} committed in {reply['seconds']:.1f}s; job requeued at its "
                 "new size")
        return self._running_again(job_id, restarts, reply, wait)

    def _running_again(self, job_id: int, restarts: int, reply: dict[str, Any],
                       wait: float) -> dict[str, Any]:
        if wait <= 0:
            return reply
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            now = self.slurm.job(job_id) or {}
            if (int(now.get("Restarts", 0) or 0) > restarts and now.get("JobState") == "RUNNING"
                    and now.get("NodeList")):
                self.say(f"job {job_id} runs again on {now['NodeList']} (restart "
                         f"{now.get('Restarts')})")
                return {**reply, "nodes": expand_hostlist(now["NodeList"])}
            time.sleep(0.5)
        self.say(f"job {job_id} is requeued but not running again after {wait:.0f}s: "
                 f"{(self.slurm.job(job_id) or {}).get('Reason')}")
        return reply
