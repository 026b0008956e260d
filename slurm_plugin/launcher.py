"""`singularityctl run -- CMD`: the launcher a batch script runs instead of CMD itself.

The launcher runs as a job step of its own. Written in a batch script, `singularityctl run` starts
itself again through `srun --overlap` on the batch host (`run_as_step`) and waits for that step:
Slurm's warning signal (`--signal=URG@T`, set by the policy without `B:`) goes to every step of the
job and never to the batch shell, so the launcher hears it whatever the script looks like (bash or
sh, with or without `exec`, `set -e`, lines after `run`, `sbatch --wrap`), and the shell lives on.
Run from a step already (`srun singularityctl run ...`), it is the step.

First start: the node agent starts CMD (as the job's user, in its own PID and mount namespace) with a
torchrun-compatible environment. After a requeue with a committed checkpoint of this run, the agent
restores it instead, and the command continues where it stopped. Each `singularityctl run` in a job
has an identity (its position in the batch script, and its command): after a requeue, runs that
finished return their recorded exit status at once.

The decisions are `lifecycle.step`'s; this module only carries its actions out: the agent requests,
the fan-out to every node, signals, timers. Every line the launcher prints starts with
"[singularity]", so the job's own output, which shares the file, stays recognisable.
"""

from __future__ import annotations

import json
import logging
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

from singularity_slurm import rpc
from singularity_slurm.checkpoint.generation import Generation, newest_first
from singularity_slurm.config import Config
from singularity_slurm.coordinator.placement import PlacementError, check_size, describe, place
from singularity_slurm.errors import SingularityError
from singularity_slurm.jobenv import job_run_dir, resolve_tier
from singularity_slurm.slurmcli import SlurmClient, draining, expand_hostlist

from . import lifecycle

LOG = logging.getLogger("singularity.launcher")
FRONT_PID = "SINGULARITY_LAUNCHER_FRONT"
FRONT_OUTPUT = "SINGULARITY_LAUNCHER_OUTPUT"
WARNING_SIGNALS = (signal.SIGURG, signal.SIGUSR2, signal.SIGUSR1, signal.SIGTERM)
"""The policy's warning (URG, unless configured otherwise), a user's own `--signal`, and SIGTERM."""
REQUEUE_WAIT_S = 300.0
"""How long a launcher that asked for a requeue waits for Slurm to end it with the job."""
REQUEUE_RETRY_S = 600.0
"""How long a requeue that fails (slurmctld restarting or failing over) is tried again."""
BUSY_RETRY_S = 120.0
"""How long a request the agent answers `busy` (it serves as many connections as it allows) is retried."""
REVIVE_TIMEOUT_S = 45.0
"""How long the step that brings up a new node agent and requeues through it may take (seconds, when
slurmctld answers)."""
MAX_COMMON = 8
"""Committed generations a multi-node checkpoint names to the agents, which keep the newest of them."""


class LaunchError(SingularityError):
    """The launcher cannot run the job here (not in a Slurm job, no agent).

    `kind`: the agent's error kind (`rpc`) when the agent refused or could not be reached, else None;
    `nodes`: the nodes whose agents answered so.
    """

    def __init__(self, message: str, kind: str | None = None, nodes: tuple[str, ...] = ()):
        super().__init__(message)
        self.kind = kind
        self.nodes = nodes


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


def being_preempted(job_id: int) -> bool:
    """Whether Slurm records a preemption of the job (PreemptTime), as opposed to `scancel`."""
    try:
        record = SlurmClient(timeout=10).job(job_id) or {}
    except SingularityError:
        return False
    return _preempted(record)


def _preempted(record: Mapping[str, str]) -> bool:
    return record.get("PreemptTime", "None") not in ("None", "", "Unknown")


def sigterm_cause(record: Mapping[str, str] | None, restart_count: int) -> str:
    """Why Slurm ends the job's steps, from its record at the SIGTERM: `preempt` (a preemption is
    recorded), `requeue` (`scontrol requeue`: Slurm counts the restart as soon as it accepts the
    requeue, before it ends the steps) or `end` (`scancel`, the time limit, a record Slurm cannot
    give)."""
    if not record:
        return "end"
    if _preempted(record):
        return "preempt"
    try:
        restarts = int(record.get("Restarts") or 0)
    except ValueError:
        return "end"
    return "requeue" if restarts > restart_count else "end"


ENDING_STATES = frozenset({"CANCELLED", "COMPLETING", "COMPLETED", "TIMEOUT", "FAILED", "NODE_FAIL",
                           "DEADLINE", "OUT_OF_MEMORY"})


def job_ending(job_id: int) -> bool:
    """Whether Slurm is ending the job for good (scancel, time limit): its processes then die with
    the job's cgroups, and that is no reason to requeue it. A job Slurm cannot tell about is not."""
    try:
        record = SlurmClient(timeout=10).job(job_id) or {}
    except SingularityError:
        return False
    return record.get("JobState") in ENDING_STATES and not being_preempted(job_id)


def in_job_step(env: Mapping[str, str]) -> bool:
    """Whether this process runs in a job step (srun), not in the batch script itself."""
    try:
        step = int(env.get("SLURM_STEP_ID", ""))
    except ValueError:
        return False
    return 0 <= step < 0xFFFFFFF0  # the batch and extern steps have reserved ids above this


def step_argv(info: JobInfo, ctl: str, args: list[str]) -> list[str]:
    """`srun` that runs `singularityctl ARGS` as a one-task step of the job on its batch host."""
    return ["srun", f"--jobid={info.job_id}", "--overlap", "--nodes=1", "--ntasks=1",
            f"--nodelist={info.node}", "--quiet", "--kill-on-bad-exit=1", "--export=ALL", ctl, *args]


def run_as_step(config: Config, env: Mapping[str, str], args: list[str]) -> int:
    """From the batch script: run this same `singularityctl ARGS` as a job step and wait for it.

    The step reads this process's environment (the batch script's, not the step's) and output file
    through /proc, so the command sees exactly what it would have seen in the batch script. Signals
    this process gets (SIGTERM as Slurm ends the job; the warning, should a site still send it to the
    batch shell) are passed on to the step.
    """
    info = job_info(env, config)
    ctl = str(Path(sys.executable).with_name("singularityctl"))
    child_env = {**env, FRONT_PID: str(os.getpid())}
    output = output_target()
    if output:
        child_env[FRONT_OUTPUT] = output
    try:
        proc = subprocess.Popen(step_argv(info, ctl, args), env=child_env)
    except OSError as exc:
        raise LaunchError(f"cannot start the launcher step with srun: {exc}; is Slurm's srun on "
                          "PATH?") from exc

    ended = threading.Event()  # Slurm is ending the job (SIGTERM): a requeue, a cancel, the time limit

    def forward(signum, frame):
        if signum == signal.SIGTERM:
            ended.set()
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    # Passed on rather than dying of them: a shell whose child dies of a signal prints a notice
    # ("Terminated") into the job's output when Slurm ends the job for its requeue.
    for sig in WARNING_SIGNALS:
        signal.signal(sig, forward)
    code = proc.wait()
    code = 128 - code if code < 0 else code
    if code != 0 and not ended.is_set() and being_preempted(info.job_id):
        # The warning came before the step could catch it (while Python started), or the step
        # failed while the job was being preempted: requeue, so the job resumes from its last
        # checkpoint instead of ending with this status.
        return requeue_from_front(config, info, code, ended)
    return code


def requeue_from_front(config: Config, info: JobInfo, code: int, ended: threading.Event) -> int:
    say = _stderr_say(sys.stderr)
    prefix = f"[singularity] job {info.job_id} on {info.node}"
    say(f"{prefix}: the launcher step ended with status {code} while the job is being preempted; "
        "requeueing it to resume from its last checkpoint")
    socket_path = job_run_dir(config.paths.state_dir, info.node, info.job_id) / "agent.sock"
    try:
        agent_call(socket_path, {"op": "requeue"}, timeout=120)
    except rpc.RpcError as exc:
        say(f"{prefix}: requeue failed: {exc}")
        return code
    if not ended.wait(REQUEUE_WAIT_S):  # the requeue ends the batch script with the job
        say(f"{prefix}: Slurm did not end the job within {REQUEUE_WAIT_S:.0f}s of its requeue")
    return code


def front_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The batch script's environment, for a launcher step started by `run_as_step`."""
    pid = env.get(FRONT_PID, "")
    if not pid.isdigit():
        return dict(env)
    path = Path(f"/proc/{pid}/environ")
    try:
        if path.stat().st_uid != os.getuid():
            return dict(env)
        raw = path.read_bytes()
    except OSError:
        return dict(env)
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep:
            out[name.decode(errors="surrogateescape")] = value.decode(errors="surrogateescape")
    out.pop(FRONT_PID, None)
    out.pop(FRONT_OUTPUT, None)
    return out


class Launcher:
    """Carries out `lifecycle.step`'s actions for one `singularityctl run`."""

    def __init__(self, config: Config, env: Mapping[str, str], say: Callable[[str], None] | None = None,
                 checkpoint_interval_s: float | None = None, grace_s: float = 600.0,
                 world_size: int | None = None, requeue_wait_s: float = REQUEUE_WAIT_S,
                 requeue_retry_s: float = REQUEUE_RETRY_S):
        self.config = config
        self.world_size = world_size
        self.attempt = 0
        self.committed: list[str] = []  # generations every tree committed, newest first (multi-tree)
        self.placement: dict[int, str] = {}  # rank -> proxy of the current start or restore
        self.devices_per_node = 0  # device proxies each node of the job has (the fewest of them)
        self.output = env.get(FRONT_OUTPUT)
        self.env = front_environment(env)
        self.info = job_info(self.env, config)
        self.socket = job_run_dir(config.paths.state_dir, self.info.node, self.info.job_id) / "agent.sock"
        self._say = say or _stderr_say(sys.stderr)
        if checkpoint_interval_s is None and self.info.tier:
            minutes = config.tiers[self.info.tier].checkpoint_interval_min
            checkpoint_interval_s = minutes * 60.0 if minutes else None
        self.interval = checkpoint_interval_s
        self.grace_s = grace_s
        self.requeue_wait_s = requeue_wait_s
        self.requeue_retry_s = requeue_retry_s
        self.run_key: str | None = None
        self.last_summary: dict | None = None
        self.events: queue.Queue[lifecycle.Event | _Signal | _Exited] = queue.Queue()
        self.actions: queue.Queue[lifecycle.Action | None] = queue.Queue()
        self.to_file = False  # Slurm is ending the steps: say straight into the job's output file

    def say(self, message: str) -> None:
        """One line per line of `message`, each starting "[singularity]" (criu's errors span several),
        so the job's own output beside them stays recognisable."""
        prefix = f"[singularity] job {self.info.job_id} on {self.info.node}:"
        lines = [line for line in message.splitlines() if line.strip()] or [""]
        text = [f"{prefix} {lines[0]}", *(f"{prefix}   {line}" for line in lines[1:])]
        if self.to_file and self.output:
            # This step's output reaches the file through the batch script's srun, which dies with
            # the batch step once Slurm ends the job; the file is opened for appending, as Slurm has it.
            try:
                with open(self.output, "a") as out:
                    out.write("".join(line + "\n" for line in text))
                return
            except OSError:
                pass
        for line in text:
            self._say(line)

    def agent(self, payload: dict, timeout: float | None = 30.0) -> dict:
        try:
            return agent_call(self.socket, payload, timeout=timeout)
        except rpc.TransportError as exc:
            raise LaunchError(f"the node agent did not answer {payload['op']}: {exc}; is the Prolog "
                              "configured (`singularityctl admin check`)?", exc.kind) from exc
        except rpc.RemoteError as exc:
            raise LaunchError(f"{payload['op']}: {exc}", exc.kind, (self.info.node,)) from exc

    def fanout(self, op: str, payload: dict | None = None, timeout: float | None = None,
               nodes: list[str] | None = None) -> list[dict]:
        """The same request to the agent of every node of the job, or of `nodes` (a job step, one
        task per node). The step's start brings up a node's services where they are missing (the
        SPANK plugin), so this also reaches an agent that had died.

        Each node's reply is returned in node order; any failed reply raises, naming the node.
        """
        ctl = str(Path(sys.executable).with_name("singularityctl"))
        nodes = nodes or self.info.nodes
        n = len(nodes)
        argv = ["srun", f"--jobid={self.info.job_id}", "--overlap", f"--nodes={n}", f"--ntasks={n}",
                "--ntasks-per-node=1", "--label", "--quiet", "--kill-on-bad-exit=0",
                *([f"--nodelist={','.join(nodes)}"] if nodes != self.info.nodes else []), ctl, "agent-call",
                op, json.dumps(payload or {})]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise LaunchError(f"{op} on every node did not finish within {timeout:.0f}s") from exc
        replies = parse_labelled_replies(proc.stdout, n)
        missing = [nodes[i] for i, r in enumerate(replies) if r is None]
        if missing:
            raise LaunchError(f"{op}: no answer from the agents of {', '.join(missing)}: "
                              f"{proc.stderr.strip()[-500:]}")
        failed = [(nodes[i], r) for i, r in enumerate(replies) if not r.get("ok")]
        if failed:
            kinds = {str(r.get("kind")) for _, r in failed}
            why = "; ".join(f"{node}: {r.get('error')}" for node, r in failed)
            raise LaunchError(f"{op} failed on {why}", kinds.pop() if len(kinds) == 1 else None,
                              tuple(node for node, _ in failed))
        return replies  # type: ignore[return-value]

    @property
    def multi_tree(self) -> bool:
        """Whether the job runs more than one process tree: one per node, or one per rank (a
        `--world-size` job). Its checkpoints are then generations that every tree commits."""
        return self.info.multi_node or self.world_size is not None

    def every_node(self, op: str, payload: dict | None = None, timeout: float | None = None) -> list[dict]:
        """One request to this node's agent, or to every node's for a multi-node job."""
        if self.info.multi_node:
            return self.fanout(op, payload, timeout=timeout)
        return [self.agent({"op": op, **(payload or {})}, timeout=timeout)]

    # --- run --------------------------------------------------------------------------------------

    def run(self, argv: list[str], early_signals: list[int] | None = None) -> int:
        """Run the command to its end; `early_signals`: what arrived before the launcher existed."""
        if not argv:
            raise LaunchError("nothing to run: give the command after `--`")
        for sig in WARNING_SIGNALS:
            signal.signal(sig, lambda signum, frame: self.events.put(_Signal(signal.Signals(signum).name)))
        for signum in early_signals or ():
            self.events.put(_Signal(signal.Signals(signum).name))
        begun = self.agent({"op": "run_begin", "command": argv})
        self.run_key = begun["key"]
        record = begun.get("record") or {}
        if record.get("state") == "finished":
            status = int(record.get("exit_status") or 0)
            self.say(f"run {begun['index']} ({' '.join(argv)}) finished before the requeue with status "
                     f"{status}: not running it again")
            return status
        threading.Thread(target=self._carry_out, daemon=True).start()
        state = lifecycle.State()
        if self.being_preempted():
            state, actions = lifecycle.step(state, lifecycle.StartFailed("the job is being preempted"))
        else:
            actions = []
            threading.Thread(target=self._launch, args=(argv, record.get("state") == "running"),
                             daemon=True).start()
        for action in actions:
            self.actions.put(action)
        return self.loop(state)

    def loop(self, state: lifecycle.State) -> int:
        next_periodic = time.monotonic() + self.interval if self.interval else None
        requeued_at: float | None = None
        while True:
            if state.phase == lifecycle.Phase.REQUEUED:
                requeued_at = requeued_at or time.monotonic()
                timeout: float | None = max(0.0, requeued_at + self.requeue_wait_s - time.monotonic())
            else:
                timeout = max(0.0, next_periodic - time.monotonic()) if next_periodic else None
            try:
                event = self.events.get(timeout=timeout)
            except queue.Empty:
                if state.phase == lifecycle.Phase.REQUEUED:
                    self.say(f"Slurm did not end the job within {self.requeue_wait_s:.0f}s of its requeue")
                    return lifecycle.EXIT_LAUNCHER_FAILED
                event = lifecycle.PeriodicDue()
                next_periodic = time.monotonic() + self.interval if self.interval else None
            if isinstance(event, _Exited):
                return event.code
            if isinstance(event, _Signal):
                self.to_file = self.to_file or event.name == "SIGTERM"
                cause = self.sigterm_cause() if event.name == "SIGTERM" else "preempt"
                event = lifecycle.Warning(event.name, cause != "end", requeue=cause == "requeue")
            before = state.phase
            state, actions = lifecycle.step(state, event)
            if state.phase != before:
                LOG.info("job %s node %s: %s -> %s on %s", self.info.job_id, self.info.node, before,
                         state.phase, type(event).__name__)
            for action in actions:
                self.actions.put(action)

    def _carry_out(self) -> None:
        """The action runner: one action at a time, in the order decided; outcomes become events."""
        while True:
            action = self.actions.get()
            try:
                self._act(action)
            except Exception as exc:  # an action's failure must reach the machine, not kill the thread
                LOG.exception("action %s failed", action)
                self.say(f"internal error while carrying out {type(action).__name__}: {exc}")

    def _act(self, action: lifecycle.Action) -> None:
        if isinstance(action, lifecycle.Say):
            self.say(action.message)
        elif isinstance(action, lifecycle.Exit):
            self.events.put(_Exited(action.code))
        elif isinstance(action, lifecycle.Checkpoint):
            timeout = self.grace_s if action.stop else None
            try:
                summary = self.checkpoint(action.reason, action.stop, timeout)
            except LaunchError as exc:
                self.events.put(lifecycle.CheckpointFailed(str(exc)))
            else:
                self.events.put(lifecycle.CheckpointDone(summary))
        elif isinstance(action, lifecycle.Kill):
            try:
                self.every_node("kill", timeout=60)
            except LaunchError as exc:
                self.say(f"could not end the job's processes: {exc}")
        elif isinstance(action, lifecycle.Requeue):
            self.requeue(action)
        elif isinstance(action, lifecycle.Answer):
            result = {"ok": action.ok, "error": action.error, "summary": self.last_summary}
            try:
                self.agent({"op": "command_done", "id": action.to, "result": result}, timeout=60)
            except LaunchError as exc:
                self.say(f"could not answer the request: {exc}")
        elif isinstance(action, lifecycle.ResumeHere):
            threading.Thread(target=self._resume_here, daemon=True).start()
        elif isinstance(action, lifecycle.FinishRun):
            try:
                self.agent({"op": "run_end", "key": self.run_key, "exit_status": action.exit_status})
            except LaunchError as exc:
                self.say(f"could not record the end of this run: {exc}")

    def requeue(self, action: lifecycle.Requeue) -> None:
        """Through this node's agent (which also lifts Slurm's requeue delay and keeps a migrated job
        off the nodes it leaves); if it is gone, through a new one that a step on this node brings
        up; as the last resort through Slurm itself, with its delay."""
        deadline = time.monotonic() + self.requeue_retry_s
        pause = 2.0
        while True:
            problems = self._requeue_once(action)
            if problems is None:
                self.events.put(lifecycle.RequeueDone())
                return
            if time.monotonic() + pause > deadline:
                self.events.put(lifecycle.RequeueFailed("; ".join(problems)))
                return
            if pause == 2.0:
                self.say(f"requeue failed ({problems[-1]}); trying again for "
                         f"{self.requeue_retry_s / 60:.0f} min (is slurmctld up?)")
            time.sleep(pause)  # Slurm's controller is away (restarting, failing over): wait for it
            pause = min(pause * 2, 30.0)

    def _requeue_once(self, action: lifecycle.Requeue) -> list[str] | None:
        """One round of the requeue's ways; None once one took, else what each said."""
        payload: dict[str, Any] = {"exclude": list(action.exclude),
                                   **({"keep_excluded": True} if action.keep_excluded else {})}
        if action.resize is not None:
            payload["resize"] = {"nodes": list(action.resize.nodes) if action.resize.nodes else None,
                                 "gpus_per_node": action.resize.gpus_per_node}
        problems = []
        if not action.through_slurm:
            try:
                self.agent({"op": "requeue", **payload}, timeout=120)
            except LaunchError as exc:
                problems.append(str(exc))
            else:
                return None
        try:
            self.fanout("requeue", payload, timeout=REVIVE_TIMEOUT_S, nodes=[self.info.node])
        except LaunchError as exc:
            problems.append(str(exc))  # or the requeue ended the step before it answered
        else:
            return None
        try:
            requeued_now = SlurmClient(timeout=30).requeue(self.info.job_id)
        except SingularityError as exc:
            return [*problems, str(exc)]
        if requeued_now:
            self.say("requeued through Slurm, with its requeue delay"
                     + (f", and not kept off {','.join(action.exclude)}" if action.exclude else "")
                     + (", at the size it had" if action.resize else "")
                     + f" (the node agent could not: {problems[-1]})")
        return None

    # --- start, restore, the tree -----------------------------------------------------------------

    def _resume_here(self) -> None:
        try:
            restored = self.restore()
        except LaunchError as exc:
            self.events.put(lifecycle.StartFailed(str(exc)))
            return
        if not restored:
            self.events.put(lifecycle.StartFailed("the checkpoint just taken could not be restored"))
            return
        self.events.put(lifecycle.Started(True))
        threading.Thread(target=self._wait_for_tree, daemon=True).start()

    def _launch(self, argv: list[str], resume: bool) -> None:
        try:
            restored = resume and self.info.restart_count > 0 and self.restore()
            if not restored:
                self.start(argv)
        except LaunchError as exc:
            wrong = exc.nodes if exc.kind == rpc.WrongDevices.kind else ()
            self.events.put(lifecycle.StartFailed(str(exc), wrong_devices=wrong))
            return
        self.events.put(lifecycle.Started(restored))
        threading.Thread(target=self._wait_for_tree, daemon=True).start()
        threading.Thread(target=self._poll_commands, daemon=True).start()
        if self.config.elastic.drain_poll_s:
            threading.Thread(target=self._watch_drains, args=(self.config.elastic.drain_poll_s,),
                             daemon=True).start()

    def _watch_drains(self, interval: float) -> None:
        """Slurm tells nobody that an admin drains a node: look at the job's nodes now and then."""
        nodes = self.info.nodes or (self.info.node,)
        while True:
            time.sleep(interval)
            try:
                found, reason = draining(SlurmClient(timeout=10).nodes(nodes), nodes)
            except SingularityError:
                continue  # slurmctld away: look again later
            if found:
                self.events.put(lifecycle.NodesDraining(found, reason))

    def _poll_commands(self) -> None:
        """Admin requests (checkpoint, migrate) reach the batch host's agent; fetch them."""
        while True:
            try:
                reply = agent_call(self.socket, {"op": "next_command", "timeout": 30}, timeout=60)
            except rpc.RpcError:
                time.sleep(5)  # an agent that is away or refuses the poll: do not spin
                continue
            if reply.get("command"):
                self.events.put(self.command_event(reply["command"]))

    def command_event(self, command: dict) -> lifecycle.Command:
        """An admin request as the state machine's event; a resize this job cannot take is refused."""
        op, ident = str(command.get("op")), str(command.get("id") or "")
        if op != "resize":
            return lifecycle.Command(op, tuple(command.get("exclude") or ()), ident)
        nodes = command.get("nodes")
        resize = lifecycle.Resize(tuple(nodes) if nodes else None, command.get("gpus_per_node"))
        return lifecycle.Command(op, (), ident, resize=resize, refused=self.resize_refusal(resize))

    def resize_refusal(self, resize: lifecycle.Resize) -> str | None:
        """Why the job cannot run at `resize` (None: it can), said before anything stops."""
        if self.world_size is None:
            return ("resize: this job is not distributed (its `singularityctl run` has no --world-size): its "
                    "process trees are one per node, and their number cannot change; use migrate to move it")
        nodes = resize.nodes or (len(self.info.nodes) or 1,) * 2
        per_node = resize.gpus_per_node if resize.gpus_per_node is not None else self.devices_per_node
        try:
            check_size(self.world_size, nodes, per_node, self.config.elastic.max_ranks_per_device)
        except PlacementError as exc:
            return f"resize to {resize.describe()}: {exc}"
        return None

    def proxy_config(self) -> dict | None:
        """The rendezvous of a distributed job's proxies for this start or restore, or None."""
        if self.world_size is None:
            return None
        devices = [r["proxies"] for r in self.every_node("devices", timeout=120)]
        self.devices_per_node = min((len(d) for d in devices), default=0)
        try:
            placement = place(self.world_size, devices, self.config.elastic.max_ranks_per_device)
        except PlacementError as exc:
            raise LaunchError(f"--world-size {self.world_size}: {exc}") from exc
        self.attempt += 1
        self.placement = placement
        return {"generation": f"{self.info.restart_count}.{self.attempt}",
                "placement": {str(r): d for r, d in placement.items()}}

    def start(self, argv: list[str]) -> None:
        output = (self.output or output_target() or self.job_stdout()
                  or str(Path.cwd() / f"singularity-{self.info.job_id}.out"))
        env = rank_environment(self.env, self.info)
        payload: dict[str, Any] = {"cwd": str(Path.cwd()), "output": output, "run": self.run_key}
        proxy = self.proxy_config()
        if proxy is not None:
            env.update(distributed_environment(env, self.world_size or 1))
            payload["proxy"] = proxy
        payload.update(argv=argv, env=env)
        self.every_node("start", payload, timeout=120)
        where = (f" on {len(self.info.nodes)} nodes ({','.join(self.info.nodes)})"
                 if self.info.multi_node else "")
        ranks = f", {self.size()}" if self.world_size else ""
        self.say(f"started {' '.join(argv)}{where} (tier {self.info.tier or 'unmanaged'}{ranks})")

    def job_stdout(self) -> str | None:
        """The job's output file as Slurm records it (a launcher in the user's own `srun` step,
        whose stdout is a pipe to srun)."""
        try:
            path = (SlurmClient(timeout=10).job(self.info.job_id) or {}).get("StdOut", "")
        except SingularityError:
            return None
        return path if path.startswith("/") else None

    def restore(self) -> bool:
        self.say(f"restart {self.info.restart_count}: restoring the last checkpoint")
        if self.multi_tree:
            return self.restore_all_trees()
        try:
            reply = self.agent({"op": "restore", "run": self.run_key, "proxy": self.proxy_config()},
                               timeout=None)
        except LaunchError as exc:
            if exc.kind == rpc.NoCheckpointFound.kind:
                if " refused: " in str(exc):  # checkpoints were refused on the way: say which and why
                    self.say(str(exc).removeprefix("restore: "))
                self.say("no committed checkpoint: starting from the beginning")
                return False
            raise
        for refused in reply.get("refused", []):
            self.say(f"checkpoint {refused['seq']} refused: {refused['reason']}")
        self.say(f"restored checkpoint {reply['seq']} ({reply['reason']}, taken on {reply['node']}, "
                 f"{lifecycle.mib(reply['logical_bytes'])}) in {reply['seconds']:.1f}s")
        return True

    def tree_generations(self) -> list[set[str]]:
        """The generations each of the job's trees committed: every rank's (read from the shared
        store by this node's agent), or every node's (each from its own agent)."""
        if self.world_size is not None:
            reply = self.agent({"op": "generations", "run": self.run_key,
                                "ranks": list(range(self.world_size))}, timeout=120)
            return [set(generations) for generations in reply["ranks"].values()]
        return [set(r["generations"]) for r in self.fanout("generations", {"run": self.run_key}, timeout=120)]

    def restore_all_trees(self) -> bool:
        """Restore every tree from the newest generation that every tree committed and verifies."""
        try:
            per_tree = self.tree_generations()
        except LaunchError as exc:
            self.say(f"cannot list the trees' checkpoints ({exc}): starting from the beginning")
            return False
        common = newest_first(set.intersection(*per_tree))
        what = "distributed" if self.world_size is not None else "multi-node"
        for generation in common:
            try:
                replies = self.every_node("restore", {"generation": generation, "run": self.run_key,
                                                      "proxy": self.proxy_config()})
            except LaunchError as exc:
                self.say(f"{what} checkpoint {generation} refused: {exc}")
                try:
                    self.every_node("kill", timeout=60)
                except LaunchError:
                    pass
                if exc.kind == rpc.WrongDevices.kind:
                    raise  # older generations hold the same GPUs' state: wait for nodes that fit
                continue
            self.committed = common[common.index(generation):]
            logical = sum(r["logical_bytes"] for r in replies)
            was = next((r["placement"] for r in replies if r.get("placement")), None)
            size = ""
            if self.world_size is not None:
                size = f": {self.size()}" + (f", was {self.size(was)}" if was else "")
            nodes = ",".join(self.info.nodes or (self.info.node,))
            self.say(f"restored {what} checkpoint {generation} on {nodes} ({lifecycle.mib(logical)}) in "
                     f"{max(r['seconds'] for r in replies):.1f}s{size}")
            return True
        self.say(f"no checkpoint that every {'rank' if self.world_size is not None else 'node'} committed: "
                 "starting from the beginning")
        return False

    def size(self, was: dict | None = None) -> str:
        """"4 ranks on 2 devices of 1 node (2 per device)" for this start or restore, or a checkpoint's."""
        if was is None:
            devices = set(self.placement.values())
            ranks, nodes = len(self.placement), len({d.split("/", 1)[0] for d in devices})
            count = len(devices)
        else:
            ranks, count, nodes = (int(was.get(k) or 0) for k in ("ranks", "devices", "nodes"))
        return describe(ranks, count, nodes)

    def _wait_for_tree(self) -> None:
        try:
            replies = self.every_node("wait")
        except LaunchError as exc:
            self.events.put(lifecycle.AgentLost(str(exc)))
            return
        states = {r.get("state") for r in replies}
        status = max(int(r.get("exit_status") or 0) for r in replies)
        state = "dumped" if "dumped" in states else "killed" if "killed" in states else "exited"
        lost = next((r["proxy_lost"] for r in replies if r.get("proxy_lost")), None)
        ending = status >= 128 and not lost and job_ending(self.info.job_id)
        self.events.put(lifecycle.TreeEnded(state, status, lost,
                                            has_checkpoint=status >= 128 and self.has_checkpoint(),
                                            job_ending=ending))

    def has_checkpoint(self) -> bool:
        try:
            if self.multi_tree:
                return bool(set.intersection(*self.tree_generations()))
            return self.agent({"op": "latest", "run": self.run_key}).get("checkpoint") is not None
        except LaunchError:
            return False

    def checkpoint(self, reason: str, stop: bool, timeout: float | None) -> dict:
        """Checkpoint the job's processes on every node; one summary."""
        payload = {"reason": reason, "stop": stop, "run": self.run_key}
        if not self.multi_tree:
            summary = self.agent({"op": "checkpoint", **payload}, timeout=timeout)
        else:
            generation = str(Generation(self.info.restart_count, time.time_ns()))
            common = self.committed[:MAX_COMMON] or None
            replies = self.every_node("checkpoint", {**payload, "generation": generation, "common": common},
                                      timeout=timeout)
            self.committed.insert(0, generation)
            cuts = [r["cut_seconds"] for r in replies if r.get("cut_seconds") is not None]
            summary = {"seq": generation, "seconds": max(r["seconds"] for r in replies),
                       "cut_seconds": max(cuts) if cuts else None,
                       "logical_bytes": sum(r["logical_bytes"] for r in replies),
                       "new_bytes": sum(r["new_bytes"] for r in replies), "dedup_ratio": None,
                       "waited_s": max(r.get("waited_s") or 0.0 for r in replies)}
        self.last_summary = {k: v for k, v in summary.items() if k != "ok"}
        return summary

    def being_preempted(self) -> bool:
        return being_preempted(self.info.job_id)

    def sigterm_cause(self) -> str:
        try:
            record = SlurmClient(timeout=10).job(self.info.job_id)
        except SingularityError:
            record = None
        return sigterm_cause(record, self.info.restart_count)


@dataclass(frozen=True)
class _Signal:
    name: str


@dataclass(frozen=True)
class _Exited:
    code: int

def agent_call(path: Path, payload: dict, timeout: float | None) -> dict:
    """`rpc.call` to the node agent; `busy` (every connection slot taken) is retried for BUSY_RETRY_S."""
    return rpc.call(path, payload, timeout=timeout, service="the node agent", busy_retry_s=BUSY_RETRY_S)


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

