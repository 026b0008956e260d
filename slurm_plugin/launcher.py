"""`singularityctl run -- CMD`: the launcher a batch script runs instead of CMD itself.

First start: the node agent starts CMD (as the job's user, in its own PID and mount namespace) with a
torchrun-compatible environment. After a requeue (restart count > 0) with a committed checkpoint,
the agent restores it instead, and the command continues where it stopped.

All preemption handling lives here: the warning signal (SIGUSR2 from the job-submit policy; SIGTERM
as a fallback) becomes a checkpoint that stops the job, then a requeue. If the checkpoint fails, the
job is requeued anyway and resumes from its last good checkpoint. Periodic checkpoints leave the job
running. Every line the launcher prints starts with "[singularity]", so the job's own output,
which shares the file, stays recognisable.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from singularity_slurm.config import Config
from singularity_slurm.coordinator.placement import PlacementError, place
from singularity_slurm.errors import SingularityError
from singularity_slurm.jobenv import job_run_dir, resolve_tier
from singularity_slurm.node.agent import request

from .slurm import SlurmClient, expand_hostlist

WARNING_SIGNALS = {"USR2": signal.SIGUSR2, "USR1": signal.SIGUSR1, "TERM": signal.SIGTERM}


class LaunchError(SingularityError):
    """The launcher cannot run the job here (not in a Slurm job, no agent)."""


@dataclass(frozen=True)
class JobInfo:
    job_id: int
    node: str
    restart_count: int
    tier: str | None
    nodes: tuple[str, ...] = ()

    @property
    def multi_node(self) -> bool:
        return len(self.nodes) > 1


def job_info(env: Mapping[str, str], config: Config) -> JobInfo:
    missing = [v for v in ("SLURM_JOB_ID", "SLURMD_NODENAME") if not env.get(v)]
    if missing:
        raise LaunchError(f"`singularityctl run` runs inside a Slurm batch job ({', '.join(missing)} unset)")
    return JobInfo(int(env["SLURM_JOB_ID"]), env["SLURMD_NODENAME"],
                   int(env.get("SLURM_RESTART_COUNT") or 0), resolve_tier(env, config),
                   tuple(expand_hostlist(env.get("SLURM_JOB_NODELIST", ""))))


def rank_environment(env: Mapping[str, str], info: JobInfo) -> dict[str, str]:
    """The job's environment plus what torchrun would set: one process tree (rank) per node.

    RANK and GROUP_RANK are the node's index; the agent call on each node fills them in.
    """
    world_size = max(len(info.nodes), 1)
    out = dict(env)
    out.update({
        "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": env.get("MASTER_ADDR", "127.0.0.1"),
        "MASTER_PORT": env.get("MASTER_PORT", str(20000 + info.job_id % 20000)),
        "SINGULARITY_JOB_ID": str(info.job_id),
    })
    return out


def distributed_environment(env: Mapping[str, str], world_size: int) -> dict[str, str]:
    """What the ranks of a `--world-size N` job get on top of `rank_environment`.

    RANK, LOCAL_RANK and LOCAL_WORLD_SIZE are set per rank by the in-tree spawner. The sitecustomize
    folder on PYTHONPATH installs the proxy backend into torch.distributed.
    """
    from singularity_slurm.interpose import HOOK_DIR

    hook = str(HOOK_DIR)
    path = env.get("PYTHONPATH")
    return {"WORLD_SIZE": str(world_size), "SINGULARITY_PROXY": "1",
            "PYTHONPATH": f"{hook}:{path}" if path else hook}


def output_target(fd: int = 1) -> str | None:
    """The file the batch script's stdout goes to (the job's -o file), if it is a path."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return target if target.startswith("/") and os.path.exists(target) else None


def mib(n: int | None) -> str:
    return f"{(n or 0) / (1 << 20):.1f} MiB"


class Launcher:
    def __init__(self, config: Config, env: Mapping[str, str], say: Callable[[str], None] | None = None,
                 checkpoint_interval_s: float | None = None, grace_s: float = 600.0,
                 world_size: int | None = None):
        self.config = config
        self.world_size = world_size
        self.attempt = 0
        self.env = dict(env)
        self.info = job_info(env, config)
        self.socket = job_run_dir(config.paths.state_dir, self.info.node, self.info.job_id) / "agent.sock"
        self._say = say or _stderr_say(sys.stderr)
        if checkpoint_interval_s is None and self.info.tier:
            minutes = config.tiers[self.info.tier].checkpoint_interval_min
            checkpoint_interval_s = minutes * 60.0 if minutes else None
        self.interval = checkpoint_interval_s
        self.grace_s = grace_s
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()

    def say(self, message: str) -> None:
        self._say(f"[singularity] job {self.info.job_id} on {self.info.node}: {message}")

    def agent(self, payload: dict, timeout: float | None = 30.0) -> dict:
        try:
            reply = request(self.socket, payload, timeout=timeout)
        except (OSError, ValueError) as exc:
            raise LaunchError(f"the node agent at {self.socket} did not answer {payload['op']}: {exc}; "
                              "is the Prolog configured (`singularityctl admin check`)?") from exc
        if not reply.get("ok"):
            raise LaunchError(f"{payload['op']}: {reply.get('error')}")
        return reply

    def fanout(self, op: str, payload: dict | None = None, timeout: float | None = None) -> list[dict]:
        """The same request to the agent of every node of the job (a job step, one task per node).

        Each node's reply is returned in node order; any failed reply raises, naming the node.
        """
        ctl = str(Path(sys.executable).with_name("singularityctl"))
        n = len(self.info.nodes)
        argv = ["srun", f"--jobid={self.info.job_id}", "--overlap", f"--nodes={n}", f"--ntasks={n}",
                "--ntasks-per-node=1", "--label", "--quiet", "--kill-on-bad-exit=0", ctl, "agent-call",
                op, json.dumps(payload or {})]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise LaunchError(f"{op} on every node did not finish within {timeout:.0f}s") from exc
        replies = parse_labelled_replies(proc.stdout, n)
        missing = [self.info.nodes[i] for i, r in enumerate(replies) if r is None]
        if missing:
            raise LaunchError(f"{op}: no answer from the agents of {', '.join(missing)}: "
                              f"{proc.stderr.strip()[-500:]}")
        failed = [f"{self.info.nodes[i]}: {r.get('error')}" for i, r in enumerate(replies) if not r.get("ok")]
        if failed:
            raise LaunchError(f"{op} failed on " + "; ".join(failed))
        return replies  # type: ignore[return-value]

    # --- signals ----------------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        def on_signal(signum, frame):
            self.events.put(("signal", signal.Signals(signum).name))

        for sig in (signal.SIGUSR2, signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, on_signal)

    # --- run --------------------------------------------------------------------------------------

    def run(self, argv: list[str]) -> int:
        if not argv:
            raise LaunchError("nothing to run: give the command after `--`")
        self.install_signal_handlers()
        restored = False
        if self.info.restart_count > 0:
            restored = self.restore()
        if not restored:
            self.start(argv)
        threading.Thread(target=self._wait_for_tree, daemon=True).start()
        if self.info.multi_node:
            threading.Thread(target=self._poll_commands, daemon=True).start()
        return self.loop()

    def _poll_commands(self) -> None:
        """Admin requests that need every node (a migration) reach the batch host's agent; fetch them."""
        while True:
            try:
                reply = request(self.socket, {"op": "next_command", "timeout": 30}, timeout=60)
            except (OSError, ValueError):
                time.sleep(5)
                continue
            if not reply.get("ok"):
                time.sleep(5)  # an agent that refuses the poll: do not spin
            elif reply.get("command"):
                self.events.put(("command", reply["command"]))

    def proxy_config(self) -> dict | None:
        """The rendezvous of a distributed job's proxies for this start or restore, or None."""
        if self.world_size is None:
            return None
        if self.info.multi_node:
            devices = [r["proxies"] for r in self.fanout("devices", timeout=120)]
        else:
            devices = [self.agent({"op": "devices"})["proxies"]]
        try:
            placement = place(self.world_size, devices)
        except PlacementError as exc:
            raise LaunchError(f"--world-size {self.world_size}: {exc}") from exc
        self.attempt += 1
        return {"generation": f"{self.info.restart_count}.{self.attempt}",
                "placement": {str(r): d for r, d in placement.items()}}

    def start(self, argv: list[str]) -> None:
        output = output_target() or str(Path.cwd() / f"singularity-{self.info.job_id}.out")
        env = rank_environment(self.env, self.info)
        payload: dict[str, Any] = {"cwd": str(Path.cwd()), "output": output}
        proxy = self.proxy_config()
        if proxy is not None:
            env.update(distributed_environment(env, self.world_size or 1))
            payload["proxy"] = proxy
            argv = [sys.executable, "-m", "singularity_slurm.interpose.spawn", "--", *argv]
        payload.update(argv=argv, env=env)
        if self.info.multi_node:
            self.fanout("start", payload, timeout=120)
            where = f" on {len(self.info.nodes)} nodes ({','.join(self.info.nodes)})"
        else:
            self.agent({"op": "start", **payload})
            where = ""
        ranks = f", {self.world_size} ranks" if self.world_size else ""
        self.say(f"started {' '.join(argv)}{where} (tier {self.info.tier or 'unmanaged'}{ranks})")

    def restore(self) -> bool:
        self.say(f"restart {self.info.restart_count}: restoring the last checkpoint")
        if self.info.multi_node:
            return self.restore_all_nodes()
        try:
            reply = self.agent({"op": "restore", "proxy": self.proxy_config()}, timeout=None)
        except LaunchError as exc:
            if "no committed checkpoint" in str(exc):
                self.say("no committed checkpoint: starting from the beginning")
                return False
            raise
        for refused in reply.get("refused", []):
            self.say(f"checkpoint {refused['seq']} refused: {refused['reason']}")
        self.say(f"restored checkpoint {reply['seq']} ({reply['reason']}, taken on {reply['node']}, "
                 f"{mib(reply['logical_bytes'])}) in {reply['seconds']:.1f}s")
        return True

    def restore_all_nodes(self) -> bool:
        """Restore every node from the newest generation that every node committed and verifies."""
        try:
            per_node = [set(r["generations"]) for r in self.fanout("generations", timeout=120)]
        except LaunchError as exc:
            self.say(f"cannot list the nodes' checkpoints ({exc}): starting from the beginning")
            return False
        common = sorted(set.intersection(*per_node), reverse=True)
        for generation in common:
            try:
                replies = self.fanout("restore", {"generation": generation, "proxy": self.proxy_config()})
            except LaunchError as exc:
                self.say(f"multi-node checkpoint {generation} refused: {exc}")
                try:
                    self.fanout("kill", timeout=60)
                except LaunchError:
                    pass
                continue
            logical = sum(r["logical_bytes"] for r in replies)
            self.say(f"restored multi-node checkpoint {generation} on {','.join(self.info.nodes)} "
                     f"({mib(logical)}) in {max(r['seconds'] for r in replies):.1f}s")
            return True
        self.say("no checkpoint that every node committed: starting from the beginning")
        return False

    def _wait_for_tree(self) -> None:
        if self.info.multi_node:
            try:
                replies = self.fanout("wait")
            except LaunchError as exc:
                self.events.put(("lost", str(exc)))
                return
            states = {r.get("state") for r in replies}
            status = max(int(r.get("exit_status") or 0) for r in replies)
            state = "dumped" if "dumped" in states else "killed" if "killed" in states else "exited"
            lost = next((r["proxy_lost"] for r in replies if r.get("proxy_lost")), None)
            self.events.put(("ended", {"state": state, "exit_status": status, "proxy_lost": lost}))
            return
        try:
            reply = request(self.socket, {"op": "wait"}, timeout=None)
        except (OSError, ValueError) as exc:
            self.events.put(("lost", str(exc)))
            return
        self.events.put(("ended", reply))

    def checkpoint(self, reason: str, stop: bool, timeout: float | None) -> dict:
        """Checkpoint the job's processes on every node; one summary."""
        if not self.info.multi_node:
            return self.agent({"op": "checkpoint", "reason": reason, "stop": stop}, timeout=timeout)
        generation = f"{self.info.restart_count}.{time.time_ns()}"
        replies = self.fanout("checkpoint", {"reason": reason, "stop": stop, "generation": generation},
                              timeout=timeout)
        cuts = [r["cut_seconds"] for r in replies if r.get("cut_seconds") is not None]
        return {"seq": generation, "seconds": max(r["seconds"] for r in replies),
                "cut_seconds": max(cuts) if cuts else None,
                "logical_bytes": sum(r["logical_bytes"] for r in replies),
                "new_bytes": sum(r["new_bytes"] for r in replies), "dedup_ratio": None}

    def loop(self) -> int:
        next_periodic = time.monotonic() + self.interval if self.interval else None
        while True:
            timeout = max(0.0, next_periodic - time.monotonic()) if next_periodic else None
            try:
                kind, value = self.events.get(timeout=timeout)
            except queue.Empty:
                self.periodic_checkpoint()
                next_periodic = time.monotonic() + self.interval if self.interval else None
                continue
            if kind == "signal":
                if value == "SIGTERM" and not self.being_preempted():
                    self.say("SIGTERM without a preemption (job cancelled or out of time): not checkpointing")
                    return 143
                return self.preempt(value)
            if kind == "lost":
                self.say(f"lost the node agent ({value}); requeueing from the last checkpoint")
                return 1
            if kind == "ended":
                return self.ended(value)
            if kind == "command" and value.get("op") == "migrate":
                return self.migrate(list(value.get("exclude") or []))
            if kind == "command" and value.get("op") == "checkpoint":
                self.manual_checkpoint()

    def being_preempted(self) -> bool:
        """Whether a SIGTERM is Slurm preempting the job (it records PreemptTime), not `scancel`.

        SIGTERM is the fallback warning where preemption does not send the user signal; `scancel`
        and the end of the time limit send it too, and those must not checkpoint and requeue.
        """
        try:
            record = SlurmClient(timeout=10).job(self.info.job_id) or {}
        except SingularityError:
            return True  # cannot tell: a needless checkpoint costs less than a lost job
        return record.get("PreemptTime", "None") not in ("None", "", "Unknown")

    def ended(self, reply: dict) -> int:
        state, status = reply.get("state"), int(reply.get("exit_status") or 0)
        if state == "dumped":
            # Checkpointed to move (singularityctl migrate): Slurm ends this step as it requeues the job.
            self.say("checkpointed for migration; the job is being requeued")
            time.sleep(120)
            return 0
        if state == "killed":
            return 137
        if reply.get("proxy_lost"):
            self.say(f"device proxy {reply['proxy_lost']} died; requeueing the job to resume from its last "
                     "checkpoint")
            self.agent({"op": "requeue"})
            return 0
        if status >= 128:
            try:
                if self.info.multi_node:
                    common = set.intersection(*(set(r["generations"])
                                                for r in self.fanout("generations", timeout=120)))
                    latest = {"seq": max(common)} if common else None
                else:
                    latest = self.agent({"op": "latest"}).get("checkpoint")
            except LaunchError:
                latest = None
            if latest:
                self.say(f"the job's processes were killed (status {status}); requeueing to resume from "
                         f"checkpoint {latest['seq']}")
                self.agent({"op": "requeue"})
                return 0
        return status

    def periodic_checkpoint(self) -> None:
        try:
            reply = self.checkpoint("periodic", stop=False, timeout=None)
        except LaunchError as exc:
            self.say(f"periodic checkpoint failed, the job continues: {exc}")
            return
        self.say(self.describe("periodic checkpoint", reply))

    def describe(self, what: str, reply: dict) -> str:
        ratio = reply.get("dedup_ratio")
        cut = reply.get("cut_seconds")
        return (f"{what} {reply['seq']} committed in {reply['seconds']:.1f}s"
                + (f" (distributed cut in {cut:.2f}s)" if cut is not None else "") + ": "
                f"{mib(reply['logical_bytes'])}, {mib(reply['new_bytes'])} stored"
                + (f" (dedup {ratio:.1f}x)" if ratio else ""))

    def manual_checkpoint(self) -> None:
        try:
            reply = self.checkpoint("manual", stop=False, timeout=None)
        except LaunchError as exc:
            self.say(f"requested checkpoint failed, the job continues: {exc}")
            self.agent({"op": "command_done", "result": {"ok": False, "error": str(exc)}})
            return
        self.say(self.describe("requested checkpoint", reply))
        self.agent({"op": "command_done", "result": {"ok": True, "summary": reply}})

    def migrate(self, exclude: list[str]) -> int:
        """Checkpoint every node (the trees stop), then requeue away from `exclude`."""
        self.say(f"migration requested (away from {','.join(exclude) or 'nothing'}): checkpointing")
        try:
            reply = self.checkpoint("migrate", stop=True, timeout=self.grace_s)
        except LaunchError as exc:
            self.agent({"op": "command_done", "result": {"ok": False, "error": str(exc)}})
            self.say(f"migration checkpoint failed: {exc}; the job resumes from its last good checkpoint")
            try:
                self.fanout("kill", timeout=60)
            except LaunchError:
                pass
            self.agent({"op": "requeue"})
            return 0
        self.say(self.describe("checkpoint", reply))
        self.agent({"op": "command_done", "result": {"ok": True, "summary": reply}})
        time.sleep(1.0)  # the requeue ends the caller's step: let it print its answer first
        self.agent({"op": "requeue", "exclude": exclude})
        self.say(f"requeued away from {','.join(exclude)}")
        return 0

    def preempt(self, signame: str) -> int:
        self.say(f"preemption warning ({signame}): checkpointing")
        try:
            reply = self.checkpoint("preempt", stop=True, timeout=self.grace_s)
            self.say(self.describe("checkpoint", reply))
        except LaunchError as exc:
            self.say(f"checkpoint failed: {exc}; the job resumes from its last good checkpoint")
            try:
                if self.info.multi_node:
                    self.fanout("kill", timeout=60)
                else:
                    self.agent({"op": "kill"})
            except LaunchError:
                pass
        try:
            reply = self.agent({"op": "requeue"})
            self.say("requeued")
        except LaunchError as exc:
            self.say(f"requeue failed: {exc}")
            return 1
        return 0


def parse_labelled_replies(stdout: str, tasks: int) -> list[dict | None]:
    """`srun --label` output ("3: {json}") -> one reply per task, None where a task printed none."""
    replies: list[dict | None] = [None] * tasks
    for line in stdout.splitlines():
        label, sep, text = line.partition(":")
        if not sep or not label.strip().isdigit():
            continue
        index = int(label)
        try:
            reply = json.loads(text)
        except ValueError:
            continue
        if 0 <= index < tasks and isinstance(reply, dict):
            replies[index] = reply
    return replies


def _stderr_say(stream: TextIO) -> Callable[[str], None]:
    def say(line: str) -> None:
        stream.write(line + "\n")
        stream.flush()

    return say

