"""The launcher's decisions: a pure state machine, (state, event) -> (state, actions).

`singularityctl run` reacts to a handful of things: the tree it started or restored, Slurm's warning
signal, commands from admins (checkpoint, migrate, resize), the periodic checkpoint timer, the outcome of the
checkpoints and requeues it asked for, and the loss of its node agent. `step` decides what to do
about each; `slurm_plugin.launcher` carries the actions out and feeds their outcomes back as
events. Nothing here sleeps, reads a clock or does I/O, so every transition is a unit test.

The job's phases:

    STARTING      -> RUNNING (Started)             | STOPPING (Started, a warning came first)
                  -> REQUEUEING (StartFailed)
    RUNNING       -> CHECKPOINTING (periodic, manual)
                  -> STOPPING (warning, migrate, resize, a node of the job draining)
                                                   -> REQUEUEING (checkpoint committed or failed)
                  -> FINISHED (the command ended, or Slurm is ending the job and killed it)
                  -> REQUEUEING (killed after a checkpoint, proxy lost)
    CHECKPOINTING -> RUNNING (done or failed)      | STOPPING (a warning arrived meanwhile)
    REQUEUEING    -> REQUEUED (Slurm took the requeue: the launcher waits to be ended with the job)
    REQUEUED      -> FINISHED (Slurm ends the job's steps for the requeue: SIGTERM)
                  -> STARTING (the requeue failed for good after a stop-checkpoint: restore here)
                  -> FINISHED (the requeue failed otherwise: exit non-zero, saying why)

A requeue ends every step and the batch script; the launcher never exits on its own after asking
for one before Slurm sends its SIGTERM, so the lines after `singularityctl run` in the batch script
do not run for a job that is leaving its nodes (the shell dies of the same SIGTERM).

`scontrol requeue` of a running job is Slurm's own requeue: every process of the job gets SIGTERM at
once and SIGKILL `KillWait` seconds later. The job's trees are out of reach of that signal (they live
in a cgroup of their own below the job's), so the launcher, told by Slurm's record that the SIGTERM
is a requeue, checkpoints them at the cut within that time like at a preemption.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

EXIT_SIGTERM = 143
EXIT_KILLED = 137
EXIT_LAUNCHER_FAILED = 1


class Phase(enum.StrEnum):
    """Where the launcher is in the job's life (transitions: see the module docstring)."""

    STARTING = "starting"
    RUNNING = "running"
    CHECKPOINTING = "checkpointing"
    STOPPING = "stopping"
    REQUEUEING = "requeueing"
    REQUEUED = "requeued"
    FINISHED = "finished"


# --- events ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Started:
    """The tree runs: started fresh, or restored from a checkpoint."""

    restored: bool


@dataclass(frozen=True)
class StartFailed:
    """`wrong_devices`: the nodes whose GPUs cannot take the job's checkpoint (it waits for others)."""

    error: str
    wrong_devices: tuple[str, ...] = ()


@dataclass(frozen=True)
class Warning:
    """Slurm's warning signal (or SIGTERM). `preempting`: Slurm records a preemption of the job.

    SIGURG (SIGUSR1/SIGUSR2 from a user's own `--signal`) comes only from the `--signal` set at
    submission: a preemption or the end of the time limit, both of which should checkpoint and
    requeue. SIGTERM is also how `scancel` and the time limit end a job; only a recorded
    preemption makes it a warning.
    `requeue`: Slurm is requeueing the job itself (`scontrol requeue`, the record's restart count is
    past the launcher's): checkpoint before it ends the processes, like at a preemption.
    """

    signal: str
    preempting: bool = True
    requeue: bool = False


@dataclass(frozen=True)
class TreeEnded:
    """The job's processes ended. `state`: exited | killed | dumped (as the node agents report)."""

    state: str
    exit_status: int
    proxy_lost: str | None = None  # what became of a device proxy: "n1/gpu0 died", "... could not ..."
    has_checkpoint: bool = False
    job_ending: bool = False  # Slurm is ending the job (scancel, time limit): it killed the tree


@dataclass(frozen=True)
class AgentLost:
    error: str


@dataclass(frozen=True)
class PeriodicDue:
    pass


@dataclass(frozen=True)
class Resize:
    """A new size for the job's next start: a node count range, devices on each node (None: as now)."""

    nodes: tuple[int, int] | None = None
    gpus_per_node: int | None = None

    def describe(self) -> str:
        parts = []
        if self.nodes is not None:
            low, high = self.nodes
            count = str(low) if low == high else f"{low}-{high}"
            parts.append(f"{count} node{'' if high == 1 else 's'}")
        if self.gpus_per_node is not None:
            parts.append(f"{self.gpus_per_node} device{'' if self.gpus_per_node == 1 else 's'} per node")
        return ", ".join(parts) or "the same size"


@dataclass(frozen=True)
class Command:
    """An admin request relayed by the node agent: op is "checkpoint", "migrate" or "resize".

    `refused`: why the launcher cannot carry it out (a resize that cannot hold the world size).
    """

    op: str
    exclude: tuple[str, ...] = ()
    id: str = ""  # the agent's id of the request, which the answer names
    resize: Resize | None = None
    refused: str | None = None


@dataclass(frozen=True)
class NodesDraining:
    """An admin drains nodes of the job (`scontrol update NodeName=... State=DRAIN`): it leaves them.

    `reason`: the drain's Reason, as Slurm shows it.
    """

    nodes: tuple[str, ...]
    reason: str = ""


@dataclass(frozen=True)
class CheckpointDone:
    summary: dict = field(hash=False, compare=False)


@dataclass(frozen=True)
class CheckpointFailed:
    error: str


@dataclass(frozen=True)
class RequeueDone:
    pass


@dataclass(frozen=True)
class RequeueFailed:
    error: str


Event = (Started | StartFailed | Warning | TreeEnded | AgentLost | PeriodicDue | Command | NodesDraining
         | CheckpointDone | CheckpointFailed | RequeueDone | RequeueFailed)


# --- actions --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Say:
    message: str


@dataclass(frozen=True)
class Checkpoint:
    reason: str  # periodic | manual | preempt | migrate | resize
    stop: bool


@dataclass(frozen=True)
class Kill:
    """End the tree on every node (nothing is saved)."""


@dataclass(frozen=True)
class Requeue:
    exclude: tuple[str, ...] = ()
    through_slurm: bool = False  # the agent is gone: ask Slurm directly, as the job's user
    resize: Resize | None = None  # the pending job's new size
    keep_excluded: bool = False  # `exclude` adds to the nodes the job is kept off already


@dataclass(frozen=True)
class Answer:
    """The outcome of the admin command `to` (its id)."""

    ok: bool
    error: str | None = None
    to: str = ""


@dataclass(frozen=True)
class FinishRun:
    """The command ended by itself: record its exit status, so a requeued script skips this run."""

    exit_status: int


@dataclass(frozen=True)
class Exit:
    code: int


@dataclass(frozen=True)
class ResumeHere:
    """Restore the checkpoint just taken on the job's own nodes (Slurm would not requeue it)."""


Action = Say | Checkpoint | Kill | Requeue | Answer | FinishRun | Exit | ResumeHere


# --- state ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class State:
    phase: Phase = Phase.STARTING
    stop_pending: str | None = None  # a warning that came while starting or checkpointing
    ended: TreeEnded | None = None  # the tree ended during a leave-running checkpoint
    checkpoint_reason: str | None = None  # the checkpoint in flight
    command: Command | None = None  # the admin command in flight
    exclude: tuple[str, ...] = ()  # nodes a migration leaves
    resize: Resize | None = None  # the size a resize in flight asks for
    stopped_at_checkpoint: bool = False  # the requeue in flight follows a committed stop-checkpoint
    stop_reason: str = "preempt"  # why the stop in `stop_pending` was asked for: preempt | requeue
    ending: bool = False  # Slurm has sent SIGTERM: it is ending the job's steps (a requeue, a cancel)


def _requeue(state: State, why: str, exclude: tuple[str, ...] = ()) -> tuple[State, list[Action]]:
    return (replace(state, phase=Phase.REQUEUEING, checkpoint_reason=None),
            [Say(why), Requeue(exclude)])


def _stop(state: State, reason: str, signame: str | None = None) -> tuple[State, list[Action]]:
    if reason == "requeue":
        what = "Slurm is requeueing the job (scontrol requeue)"
    else:
        what = f"preemption warning ({signame})" if signame else f"{reason} requested"
    return (replace(state, phase=Phase.STOPPING, stop_pending=None, stop_reason="preempt",
                    checkpoint_reason=reason),
            [Say(f"{what}: checkpointing"), Checkpoint(reason, stop=True)])


def _tree_ended(state: State, event: TreeEnded) -> tuple[State, list[Action]]:
    if event.state == "dumped":
        # Checkpointed and stopped by someone else (an agent answering a migration on its own).
        return replace(state, phase=Phase.REQUEUED), [Say("checkpointed for migration; the job is being "
                                                          "requeued")]
    if event.state == "killed":
        return replace(state, phase=Phase.FINISHED), [Exit(EXIT_KILLED)]
    if event.job_ending:
        # Its processes died with the job's cgroups, perhaps before the launcher heard the SIGTERM.
        return (replace(state, phase=Phase.FINISHED),
                [Say("the job is ending (cancelled or out of time) and its processes with it: "
                     "not checkpointing"), Exit(EXIT_SIGTERM)])
    if event.proxy_lost:
        return _requeue(state, f"device proxy {event.proxy_lost}; requeueing the job to resume from "
                               "its last checkpoint")
    if event.exit_status >= 128 and event.has_checkpoint:
        return _requeue(state, f"the job's processes were killed (status {event.exit_status}); requeueing "
                               "to resume from the last checkpoint")
    return (replace(state, phase=Phase.FINISHED),
            [FinishRun(event.exit_status), Exit(event.exit_status)])


def step(state: State, event: Event) -> tuple[State, list[Action]]:
    """The launcher's whole decision table."""
    phase = state.phase

    if isinstance(event, Warning):
        if event.signal == "SIGTERM":
            state = replace(state, ending=True)
            if phase == Phase.REQUEUED:
                # The requeue's end of every step has come: the shell dies of it, and so may this.
                return replace(state, phase=Phase.FINISHED), [Exit(EXIT_SIGTERM)]
        if not event.preempting:
            if phase in (Phase.REQUEUEING, Phase.REQUEUED, Phase.FINISHED):
                return state, []
            return (replace(state, phase=Phase.FINISHED),
                    [Say(f"{event.signal} without a preemption (job cancelled or out of time): "
                         "not checkpointing"), Exit(EXIT_SIGTERM)])
        reason = "requeue" if event.requeue else "preempt"
        if phase == Phase.RUNNING:
            return _stop(state, reason, event.signal)
        if phase in (Phase.STARTING, Phase.CHECKPOINTING):
            # The agent cannot dump a tree that is being started, restored or dumped: stop after.
            what = "scontrol requeue" if event.requeue else f"preemption warning ({event.signal})"
            return (replace(state, stop_pending=event.signal, stop_reason=reason),
                    [Say(f"{what} while {phase}: stopping once that ends")])
        return state, []  # already stopping or leaving

    if isinstance(event, Started):
        if state.stop_pending:
            # The tree runs already and may have printed or written something since the checkpoint
            # it came from: killing it would make the next start do that again. Dump it.
            return _stop(replace(state, phase=Phase.RUNNING), state.stop_reason, state.stop_pending)
        return replace(state, phase=Phase.RUNNING), []

    if isinstance(event, StartFailed) and event.wrong_devices:
        nodes = ",".join(event.wrong_devices)
        return (replace(state, phase=Phase.REQUEUEING, checkpoint_reason=None, stop_pending=None),
                [Say(f"{event.error}; requeueing the job away from {nodes}: it waits for GPUs that can "
                     "take its checkpoint (gpu.on_mismatch = wait)"),
                 Requeue(event.wrong_devices, keep_excluded=True)])

    if isinstance(event, StartFailed):
        return _requeue(replace(state, stop_pending=None), f"{event.error}; requeueing the job")

    if isinstance(event, PeriodicDue):
        if phase != Phase.RUNNING:
            return state, []
        return (replace(state, phase=Phase.CHECKPOINTING, checkpoint_reason="periodic"),
                [Checkpoint("periodic", stop=False)])

    if isinstance(event, Command):
        if phase != Phase.RUNNING:
            return state, [Answer(False, f"the job is {phase}; try again once it runs", event.id)]
        if event.op == "migrate":
            away = ",".join(event.exclude) or "nothing"
            new, actions = _stop(replace(state, command=event, exclude=event.exclude), "migrate")
            return new, [Say(f"migration requested (away from {away}): checkpointing"), *actions[1:]]
        if event.op == "checkpoint":
            return (replace(state, phase=Phase.CHECKPOINTING, command=event, checkpoint_reason="manual"),
                    [Checkpoint("manual", stop=False)])
        if event.op == "resize":
            if event.refused is not None or event.resize is None:
                return state, [Answer(False, event.refused or "resize: no size given", event.id)]
            new, actions = _stop(replace(state, command=event, resize=event.resize), "resize")
            return new, [Say(f"resize to {event.resize.describe()} requested: checkpointing"), *actions[1:]]
        return state, [Answer(False, f"unknown command {event.op!r}; valid: checkpoint, migrate, resize",
                              event.id)]

    if isinstance(event, NodesDraining):
        if phase != Phase.RUNNING:
            return state, []  # the watch reports the drain again once the job runs
        why = f" ({event.reason})" if event.reason else ""
        # No exclusion: Slurm places no job on a drained node, and one that is resumed is fine again.
        new, actions = _stop(state, "migrate")
        return new, [Say(f"{','.join(event.nodes)} draining{why}: checkpointing to move the job off"),
                     *actions[1:]]

    if isinstance(event, CheckpointDone | CheckpointFailed):
        return _checkpoint_outcome(state, event)

    if isinstance(event, TreeEnded):
        if phase in (Phase.STOPPING, Phase.REQUEUEING, Phase.REQUEUED, Phase.FINISHED):
            return state, []  # the stop-dump ends the tree; a requeue ends it too
        if phase == Phase.CHECKPOINTING:
            return replace(state, ended=event), []  # decided once the checkpoint's outcome is known
        return _tree_ended(state, event)

    if isinstance(event, AgentLost):
        if phase in (Phase.REQUEUED, Phase.FINISHED):
            return state, []
        return (replace(state, phase=Phase.REQUEUEING),
                [Say(f"lost the node agent ({event.error}); requeueing from the last checkpoint"),
                 Requeue(through_slurm=True)])

    if isinstance(event, RequeueDone):
        if phase != Phase.REQUEUEING:
            return state, []
        said = Say("requeued" + (f" away from {','.join(state.exclude)}" if state.exclude else "") + (
            f" to restart on {state.resize.describe()}" if state.resize else ""))
        if state.ending:  # Slurm's SIGTERM came already: nothing more will
            return replace(state, phase=Phase.FINISHED), [said, Exit(EXIT_SIGTERM)]
        return replace(state, phase=Phase.REQUEUED), [said]

    if isinstance(event, RequeueFailed):
        if phase == Phase.REQUEUEING and state.ending:
            # Slurm is ending the job's steps already (its own requeue or a cancel): nothing can
            # resume here, and the checkpoint, if one was just taken, is what a restart finds.
            return (replace(state, phase=Phase.FINISHED),
                    [Say(f"requeue failed: {event.error}; Slurm is ending the job's steps"),
                     Exit(EXIT_SIGTERM)])
        if phase == Phase.REQUEUEING and state.stopped_at_checkpoint:
            # The tree is stopped and its checkpoint committed: rather than end the job with its
            # work orphaned, it goes on here from that checkpoint.
            return (replace(state, phase=Phase.STARTING, stopped_at_checkpoint=False, exclude=(),
                            resize=None),
                    [Say(f"requeue failed: {event.error}; resuming here from the checkpoint just taken"),
                     ResumeHere()])
        return (replace(state, phase=Phase.FINISHED),
                [Say(f"requeue failed: {event.error}"), Exit(EXIT_LAUNCHER_FAILED)])

    raise TypeError(f"not a launcher event: {event!r}")


def _checkpoint_outcome(state: State, event: CheckpointDone | CheckpointFailed) -> tuple[State, list[Action]]:
    ok = isinstance(event, CheckpointDone)
    reason = state.checkpoint_reason
    if state.phase == Phase.STOPPING:
        actions: list[Action] = []
        if state.command is not None:
            actions.append(_answer(state.command, event))
        if ok:
            actions.append(Say(describe("checkpoint", event.summary)))  # type: ignore[union-attr]
        else:
            actions += [Say(f"{'migration ' if reason == 'migrate' else ''}checkpoint failed: "
                            f"{event.error}; the job resumes from its last good checkpoint"),  # type: ignore[union-attr]
                        Kill()]
        new = replace(state, phase=Phase.REQUEUEING, command=None, checkpoint_reason=None,
                      stopped_at_checkpoint=ok)
        return new, [*actions, Requeue(state.exclude if ok else (), resize=state.resize if ok else None)]
    if state.phase != Phase.CHECKPOINTING:
        return state, []
    what = "requested checkpoint" if reason == "manual" else "periodic checkpoint"
    actions = []
    if state.command is not None:
        actions.append(_answer(state.command, event))
    actions.append(Say(describe(what, event.summary) if ok  # type: ignore[union-attr]
                       else f"{what} failed, the job continues: {event.error}"))  # type: ignore[union-attr]
    back = replace(state, phase=Phase.RUNNING, command=None, checkpoint_reason=None, ended=None)
    if state.ended is not None:
        new, more = _tree_ended(back, replace(state.ended, has_checkpoint=state.ended.has_checkpoint or ok))
        return new, [*actions, *more]
    if state.stop_pending:
        new, more = _stop(back, state.stop_reason, state.stop_pending)
        return new, [*actions, *more]
    return back, actions


def _answer(command: Command, event: CheckpointDone | CheckpointFailed) -> Answer:
    if isinstance(event, CheckpointDone):
        return Answer(True, to=command.id)
    return Answer(False, event.error, command.id)


def mib(n: int | None) -> str:
    return f"{(n or 0) / (1 << 20):.1f} MiB"


def describe(what: str, summary: dict) -> str:
    """One line about a committed checkpoint, for the job's output."""
    ratio = summary.get("dedup_ratio")
    cut = summary.get("cut_seconds")
    seconds = summary.get("seconds") or 0.0
    return (f"{what} {summary.get('seq')} committed in {seconds:.1f}s"
            + (f" (distributed cut in {cut:.2f}s)" if cut is not None else "") + ": "
            f"{mib(summary.get('logical_bytes'))}, {mib(summary.get('new_bytes'))} stored"
            + (f" (dedup {ratio:.1f}x)" if ratio else "") + waited(summary))


def waited(summary: dict) -> str:
    """How long the checkpoint waited for the node's dump slots (see node.dumpgate), where it did."""
    seconds = summary.get("waited_s") or 0.0
    return f"; waited {seconds:.1f}s for a dump slot of the node" if seconds >= 0.05 else ""
