"""The launcher's decisions, transition by transition (slurm_plugin.lifecycle)."""

from __future__ import annotations

import pytest

from singularity_slurm.slurm_plugin.lifecycle import (
    AgentLost,
    Answer,
    Checkpoint,
    CheckpointDone,
    CheckpointFailed,
    Command,
    Exit,
    FinishRun,
    Kill,
    NodesDraining,
    PeriodicDue,
    Phase,
    Requeue,
    RequeueDone,
    RequeueFailed,
    Resize,
    ResumeHere,
    Say,
    Started,
    StartFailed,
    State,
    TreeEnded,
    Warning,
    describe,
    step,
)

SUMMARY = {"seq": 3, "seconds": 1.25, "logical_bytes": 8 << 20, "new_bytes": 1 << 20, "dedup_ratio": 8.0}


def run(*events, state: State | None = None) -> tuple[State, list]:
    """Feed events in order; the final state and every action decided on the way."""
    state = state or State()
    actions: list = []
    for event in events:
        state, more = step(state, event)
        actions += more
    return state, actions


def without_says(actions: list) -> list:
    return [a for a in actions if not isinstance(a, Say)]


def running() -> State:
    return run(Started(restored=False))[0]


# --- start and restore ----------------------------------------------------------------------------


@pytest.mark.parametrize("restored", [False, True])
def test_a_started_or_restored_tree_runs_with_nothing_to_do(restored: bool) -> None:
    assert run(Started(restored)) == (State(phase=Phase.RUNNING), [])


def test_a_start_that_fails_requeues_the_job_saying_why() -> None:
    state, actions = run(StartFailed("the agent did not answer"))

    assert state.phase == Phase.REQUEUEING
    assert actions == [Say("the agent did not answer; requeueing the job"), Requeue()]


def test_a_restore_onto_gpus_that_cannot_take_the_checkpoint_requeues_away_from_them() -> None:
    state, actions = run(StartFailed("restore: checkpoint 7 holds GPU state that the GPUs of n1 cannot "
                                     "take: ...", wrong_devices=("n1",)))

    assert state.phase == Phase.REQUEUEING
    assert actions == [
        Say("restore: checkpoint 7 holds GPU state that the GPUs of n1 cannot take: ...; requeueing the "
            "job away from n1: it waits for GPUs that can take its checkpoint (gpu.on_mismatch = wait)"),
        Requeue(("n1",), keep_excluded=True)]


def test_a_job_preempted_before_its_command_started_is_requeued_without_starting() -> None:
    state, actions = run(StartFailed("the job is being preempted"))

    assert without_says(actions) == [Requeue()]
    assert state.phase == Phase.REQUEUEING


# --- the warning at each phase of the job's life ---------------------------------------------------


def test_a_warning_while_running_checkpoints_and_stops_then_requeues() -> None:
    state, actions = run(Warning("SIGUSR2"), state=running())
    assert state.phase == Phase.STOPPING
    assert actions == [Say("preemption warning (SIGUSR2): checkpointing"), Checkpoint("preempt", stop=True)]

    state, actions = run(TreeEnded("dumped", 0), CheckpointDone(SUMMARY), state=state)
    assert state.phase == Phase.REQUEUEING
    assert actions == [Say(describe("checkpoint", SUMMARY)), Requeue()]

    state, actions = run(RequeueDone(), state=state)
    assert state.phase == Phase.REQUEUED
    assert actions == [Say("requeued")]


def test_a_checkpoint_that_fails_at_the_warning_ends_the_tree_and_requeues_anyway() -> None:
    state, actions = run(Warning("SIGUSR2"), CheckpointFailed("criu dump failed"), state=running())

    assert state.phase == Phase.REQUEUEING
    assert without_says(actions) == [Checkpoint("preempt", stop=True), Kill(), Requeue()]
    assert Say("checkpoint failed: criu dump failed; the job resumes from its last good "
               "checkpoint") in actions


def test_a_warning_while_starting_or_restoring_waits_then_checkpoints_what_already_ran() -> None:
    """The started tree may have printed a step already: killing it would print that step again."""
    for restored in (True, False):
        state, actions = run(Warning("SIGUSR2"))
        assert state.phase == Phase.STARTING and state.stop_pending == "SIGUSR2"
        assert without_says(actions) == []

        state, actions = run(Started(restored=restored), state=state)
        assert state.phase == Phase.STOPPING and state.stop_pending is None
        assert without_says(actions) == [Checkpoint("preempt", stop=True)]
        assert Say("preemption warning (SIGUSR2): checkpointing") in actions


def test_a_warning_while_a_start_fails_requeues_once() -> None:
    state, actions = run(Warning("SIGUSR2"), StartFailed("no agent"))

    assert without_says(actions) == [Requeue()]
    assert state.phase == Phase.REQUEUEING


def test_a_warning_during_a_periodic_checkpoint_stops_right_after_it() -> None:
    state, actions = run(PeriodicDue(), Warning("SIGUSR2"), state=running())
    assert state.phase == Phase.CHECKPOINTING
    assert without_says(actions) == [Checkpoint("periodic", stop=False)]

    state, actions = run(CheckpointDone(SUMMARY), state=state)
    assert state.phase == Phase.STOPPING
    assert without_says(actions) == [Checkpoint("preempt", stop=True)]


def test_a_warning_during_a_failed_periodic_checkpoint_still_stops_with_a_checkpoint() -> None:
    state, actions = run(PeriodicDue(), Warning("SIGUSR2"), CheckpointFailed("store full"), state=running())

    assert state.phase == Phase.STOPPING
    assert without_says(actions) == [Checkpoint("periodic", stop=False), Checkpoint("preempt", stop=True)]


@pytest.mark.parametrize("phase", [Phase.STOPPING, Phase.REQUEUEING, Phase.REQUEUED])
def test_a_second_warning_while_leaving_changes_nothing(phase: Phase) -> None:
    assert step(State(phase=phase), Warning("SIGUSR2")) == (State(phase=phase), [])


def test_sigterm_without_a_preemption_ends_the_launcher_without_a_checkpoint() -> None:
    state, actions = run(Warning("SIGTERM", preempting=False), state=running())

    assert state.phase == Phase.FINISHED
    assert without_says(actions) == [Exit(143)]


def test_sigterm_of_a_preemption_is_a_warning() -> None:
    assert without_says(run(Warning("SIGTERM", preempting=True), state=running())[1]) == [
        Checkpoint("preempt", stop=True)]


# --- the tree ending -------------------------------------------------------------------------------


def test_a_command_that_ends_records_its_status_and_the_launcher_exits_with_it() -> None:
    state, actions = run(TreeEnded("exited", 3), state=running())

    assert state.phase == Phase.FINISHED
    assert actions == [FinishRun(3), Exit(3)]


def test_a_killed_tree_with_a_checkpoint_requeues_to_resume_from_it() -> None:
    state, actions = run(TreeEnded("exited", 137, has_checkpoint=True), state=running())

    assert state.phase == Phase.REQUEUEING
    assert without_says(actions) == [Requeue()]


def test_a_killed_tree_without_a_checkpoint_ends_with_its_status() -> None:
    assert run(TreeEnded("exited", 137), state=running())[1] == [FinishRun(137), Exit(137)]


def test_a_tree_killed_because_slurm_ends_the_job_is_not_requeued_even_with_a_checkpoint() -> None:
    # scancel: Slurm kills what its cgroups hold, perhaps before the launcher hears its SIGTERM
    state, actions = run(TreeEnded("exited", 137, has_checkpoint=True, job_ending=True), state=running())

    assert state.phase == Phase.FINISHED
    assert actions == [Say("the job is ending (cancelled or out of time) and its processes with it: "
                           "not checkpointing"), Exit(143)]


def test_a_lost_device_proxy_requeues_the_job() -> None:
    state, actions = run(TreeEnded("exited", 137, proxy_lost="n1/gpu0 died"), state=running())

    assert without_says(actions) == [Requeue()]
    assert "device proxy n1/gpu0 died; requeueing" in actions[0].message


def test_proxies_that_could_not_meet_requeue_the_job() -> None:
    lost = "n1/gpu0 could not reach the job's other proxies (Redis is unreachable)"
    state, actions = run(TreeEnded("exited", 137, proxy_lost=lost), state=running())

    assert without_says(actions) == [Requeue()]
    assert actions[0].message.startswith(f"device proxy {lost}; requeueing the job")


def test_a_tree_the_launcher_killed_exits_137_without_recording_the_run() -> None:
    assert run(TreeEnded("killed", 137), state=running())[1] == [Exit(137)]


def test_a_tree_dumped_by_an_agent_alone_waits_for_its_requeue() -> None:
    state, actions = run(TreeEnded("dumped", 0), state=running())

    assert state.phase == Phase.REQUEUED
    assert without_says(actions) == []


def test_a_tree_that_ends_during_a_periodic_checkpoint_is_decided_after_it() -> None:
    state, actions = run(PeriodicDue(), TreeEnded("exited", 0), state=running())
    assert without_says(actions) == [Checkpoint("periodic", stop=False)]

    state, actions = run(CheckpointDone(SUMMARY), state=state)
    assert state.phase == Phase.FINISHED
    assert without_says(actions) == [FinishRun(0), Exit(0)]


def test_a_tree_killed_during_a_committed_periodic_checkpoint_resumes_from_it() -> None:
    state, actions = run(PeriodicDue(), TreeEnded("exited", 137), CheckpointDone(SUMMARY), state=running())

    assert state.phase == Phase.REQUEUEING
    assert without_says(actions)[-1] == Requeue()


# --- agent loss, requeue outcome --------------------------------------------------------------------


@pytest.mark.parametrize("phase", [Phase.STARTING, Phase.RUNNING, Phase.CHECKPOINTING, Phase.STOPPING])
def test_losing_the_agent_requeues_through_slurm(phase: Phase) -> None:
    state, actions = step(State(phase=phase), AgentLost("connection reset"))

    assert state.phase == Phase.REQUEUEING
    assert without_says(actions) == [Requeue(through_slurm=True)]


def test_a_failed_requeue_ends_the_launcher_with_an_error() -> None:
    state, actions = run(RequeueFailed("slurmctld down"), state=State(phase=Phase.REQUEUEING))

    assert state.phase == Phase.FINISHED
    assert actions == [Say("requeue failed: slurmctld down"), Exit(1)]


def test_a_requeue_that_fails_for_good_after_a_stop_checkpoint_resumes_the_job_here() -> None:
    # a migration whose requeue Slurm never took: the job must not end with its work orphaned
    state, _ = run(Command("migrate", ("n1",), "r1"), TreeEnded("dumped", 0), CheckpointDone(SUMMARY),
                   state=running())
    assert (state.phase, state.stopped_at_checkpoint) == (Phase.REQUEUEING, True)

    state, actions = run(RequeueFailed("slurmctld down"), state=state)

    assert (state.phase, state.exclude) == (Phase.STARTING, ())
    assert actions == [Say("requeue failed: slurmctld down; resuming here from the checkpoint just taken"),
                       ResumeHere()]
    state, actions = run(Started(restored=True), state=state)
    assert (state.phase, actions) == (Phase.RUNNING, [])


def test_a_requeue_that_fails_after_a_failed_checkpoint_ends_the_launcher() -> None:
    state, _ = run(Warning("SIGUSR2"), CheckpointFailed("criu dump failed"), state=running())
    assert not state.stopped_at_checkpoint
    state, actions = run(RequeueFailed("slurmctld down"), state=state)
    assert (state.phase, actions[-1]) == (Phase.FINISHED, Exit(1))


def test_events_after_the_requeue_change_nothing() -> None:
    state = State(phase=Phase.REQUEUED)
    for event in (TreeEnded("exited", 0), PeriodicDue(), Warning("SIGUSR2"), AgentLost("gone"),
                  RequeueDone()):
        assert step(state, event)[0] == state


# --- periodic and admin checkpoints, migration -------------------------------------------------------


def test_a_periodic_checkpoint_leaves_the_job_running() -> None:
    state, actions = run(PeriodicDue(), CheckpointDone(SUMMARY), state=running())

    assert state == State(phase=Phase.RUNNING)
    assert actions == [Checkpoint("periodic", stop=False), Say(describe("periodic checkpoint", SUMMARY))]


def test_a_failed_periodic_checkpoint_says_so_and_the_job_continues() -> None:
    state, actions = run(PeriodicDue(), CheckpointFailed("store full"), state=running())

    assert state.phase == Phase.RUNNING
    assert actions[-1] == Say("periodic checkpoint failed, the job continues: store full")


@pytest.mark.parametrize("phase", [Phase.STARTING, Phase.CHECKPOINTING, Phase.STOPPING])
def test_the_periodic_timer_outside_running_does_nothing(phase: Phase) -> None:
    assert step(State(phase=phase), PeriodicDue()) == (State(phase=phase), [])


def test_a_requested_checkpoint_is_answered_after_it_is_committed() -> None:
    state, actions = run(Command("checkpoint"), CheckpointDone(SUMMARY), state=running())

    assert state == State(phase=Phase.RUNNING)
    assert without_says(actions) == [Checkpoint("manual", stop=False), Answer(True)]


def test_a_migration_checkpoints_answers_then_requeues_away_from_the_nodes() -> None:
    state, actions = run(Command("migrate", ("n1",), id="c1"), state=running())
    assert state.phase == Phase.STOPPING
    assert without_says(actions) == [Checkpoint("migrate", stop=True)]
    assert actions[0] == Say("migration requested (away from n1): checkpointing")

    state, actions = run(TreeEnded("dumped", 0), CheckpointDone(SUMMARY), RequeueDone(), state=state)
    assert without_says(actions) == [Answer(True, to="c1"), Requeue(("n1",))]
    assert actions[-1] == Say("requeued away from n1")
    assert state.phase == Phase.REQUEUED


def test_a_failed_migration_answers_the_error_and_requeues_in_place_from_the_last_checkpoint() -> None:
    state, actions = run(Command("migrate", ("n1",)), CheckpointFailed("no consistent cut"), state=running())

    assert without_says(actions) == [Checkpoint("migrate", stop=True), Answer(False, "no consistent cut"),
                                     Kill(), Requeue()]


@pytest.mark.parametrize("phase", [Phase.STARTING, Phase.CHECKPOINTING, Phase.STOPPING, Phase.REQUEUED])
def test_a_command_outside_running_is_refused_with_the_phase(phase: Phase) -> None:
    state, actions = step(State(phase=phase), Command("migrate", id="c7"))

    assert state == State(phase=phase)
    assert actions == [Answer(False, f"the job is {phase}; try again once it runs", to="c7")]


def test_an_unknown_command_is_refused_naming_the_valid_ones() -> None:
    assert step(running(), Command("shrink"))[1] == [
        Answer(False, "unknown command 'shrink'; valid: checkpoint, migrate, resize")]


def test_a_resize_checkpoints_answers_then_requeues_with_the_new_size() -> None:
    size = Resize((1, 2), 1)
    state, actions = run(Command("resize", id="c2", resize=size), state=running())
    assert state.phase == Phase.STOPPING
    assert actions == [Say("resize to 1-2 nodes, 1 device per node requested: checkpointing"),
                       Checkpoint("resize", stop=True)]

    state, actions = run(TreeEnded("dumped", 0), CheckpointDone(SUMMARY), RequeueDone(), state=state)
    assert without_says(actions) == [Answer(True, to="c2"), Requeue(resize=size)]
    assert actions[-1] == Say("requeued to restart on 1-2 nodes, 1 device per node")
    assert state.phase == Phase.REQUEUED


def test_a_resize_the_launcher_refused_is_answered_and_changes_nothing() -> None:
    state = running()
    assert step(state, Command("resize", id="c3", resize=Resize((5, 5)), refused="world size 4 ...")) == (
        state, [Answer(False, "world size 4 ...", to="c3")])


def test_a_failed_resize_checkpoint_requeues_at_the_old_size_from_the_last_checkpoint() -> None:
    state, actions = run(Command("resize", resize=Resize(None, 2)), CheckpointFailed("no cut"),
                         state=running())
    assert without_says(actions) == [Checkpoint("resize", stop=True), Answer(False, "no cut"), Kill(),
                                     Requeue()]


def test_a_requeue_that_fails_after_a_resize_checkpoint_resumes_here_at_the_old_size() -> None:
    state, _ = run(Command("resize", resize=Resize((1, 1))), TreeEnded("dumped", 0), CheckpointDone(SUMMARY),
                   RequeueFailed("slurmctld away"), state=running())
    assert (state.phase, state.resize) == (Phase.STARTING, None)


@pytest.mark.parametrize(("size", "text"), [
    (Resize((2, 2)), "2 nodes"), (Resize((1, 1)), "1 node"), (Resize(None, 1), "1 device per node"),
    (Resize((1, 3), 4), "1-3 nodes, 4 devices per node"), (Resize(), "the same size")])
def test_a_size_reads_as_it_is_asked(size: Resize, text: str) -> None:
    assert size.describe() == text


def test_a_drained_node_moves_the_job_off_it_without_excluding_it_for_good() -> None:
    state, actions = run(NodesDraining(("n1",), "maint [root@08:00]"), state=running())
    assert state.phase == Phase.STOPPING
    assert actions == [Say("n1 draining (maint [root@08:00]): checkpointing to move the job off"),
                       Checkpoint("migrate", stop=True)]

    state, actions = run(TreeEnded("dumped", 0), CheckpointDone(SUMMARY), RequeueDone(), state=state)
    # Slurm starts nothing on a drained node; one resumed later may run the job again
    assert without_says(actions) == [Requeue()]
    assert state.phase == Phase.REQUEUED


def test_a_drain_seen_while_the_job_is_not_running_waits_for_the_next_look() -> None:
    for phase in (Phase.STARTING, Phase.CHECKPOINTING, Phase.STOPPING, Phase.REQUEUEING, Phase.REQUEUED):
        assert step(State(phase=phase), NodesDraining(("n1", "n2"))) == (State(phase=phase), [])
    # seen again once the checkpoint in flight is done
    state = run(PeriodicDue(), CheckpointDone(SUMMARY), state=running())[0]
    assert without_says(step(state, NodesDraining(("n2",)))[1]) == [Checkpoint("migrate", stop=True)]


def test_a_failed_checkpoint_for_a_drain_resumes_from_the_last_good_one() -> None:
    state, actions = run(NodesDraining(("n1",)), CheckpointFailed("criu failed"), state=running())
    assert without_says(actions) == [Checkpoint("migrate", stop=True), Kill(), Requeue()]
    assert state.phase == Phase.REQUEUEING


def test_a_warning_during_a_migration_changes_nothing() -> None:
    state = run(Command("migrate", ("n1",)), state=running())[0]

    assert step(state, Warning("SIGUSR2")) == (state, [])


def test_something_that_is_not_an_event_is_a_programming_error() -> None:
    with pytest.raises(TypeError, match="not a launcher event"):
        step(State(), "go")  # type: ignore[arg-type]


# --- Slurm's own requeue (`scontrol requeue`) and the SIGTERM that ends the steps -------------------


def test_scontrol_requeue_checkpoints_at_its_sigterm_and_exits_once_requeued() -> None:
    """Slurm already requeues the job: the launcher's requeue only lifts the delay, and nothing more
    is coming, so it exits as soon as the requeue is done."""
    state, actions = run(Warning("SIGTERM", requeue=True), state=running())
    assert state.phase == Phase.STOPPING and state.ending
    assert actions == [Say("Slurm is requeueing the job (scontrol requeue): checkpointing"),
                       Checkpoint("requeue", stop=True)]

    state, actions = run(TreeEnded("dumped", 0), CheckpointDone(SUMMARY), RequeueDone(), state=state)
    assert state.phase == Phase.FINISHED
    assert without_says(actions) == [Requeue(), Exit(143)]


def test_scontrol_requeue_while_starting_stops_once_the_tree_runs_and_says_why() -> None:
    state, actions = run(Warning("SIGTERM", requeue=True))
    assert (state.phase, state.stop_pending, state.stop_reason) == (Phase.STARTING, "SIGTERM", "requeue")
    assert actions == [Say("scontrol requeue while starting: stopping once that ends")]

    state, actions = run(Started(restored=True), state=state)
    assert state.phase == Phase.STOPPING and state.stop_reason == "preempt"
    assert without_says(actions) == [Checkpoint("requeue", stop=True)]


def test_scontrol_requeue_during_a_periodic_checkpoint_stops_after_it() -> None:
    state, _ = run(PeriodicDue(), Warning("SIGTERM", requeue=True), state=running())
    state, actions = run(CheckpointDone(SUMMARY), state=state)
    assert state.phase == Phase.STOPPING
    assert Checkpoint("requeue", stop=True) in actions
    assert Say("Slurm is requeueing the job (scontrol requeue): checkpointing") in actions


def test_the_sigterm_of_its_own_requeue_ends_a_requeued_launcher_at_once() -> None:
    state, actions = run(Warning("SIGURG"), TreeEnded("dumped", 0), CheckpointDone(SUMMARY), RequeueDone(),
                         state=running())
    assert state.phase == Phase.REQUEUED and Exit(143) not in actions

    state, actions = run(Warning("SIGTERM", preempting=True), state=state)
    assert (state.phase, actions) == (Phase.FINISHED, [Exit(143)])


def test_a_sigterm_that_comes_while_the_requeue_is_asked_for_ends_the_launcher_once_it_is_done() -> None:
    state, _ = run(Warning("SIGURG"), TreeEnded("dumped", 0), CheckpointDone(SUMMARY), state=running())
    assert state.phase == Phase.REQUEUEING
    state, actions = run(Warning("SIGTERM", preempting=False), state=state)
    assert actions == [] and state.ending
    state, actions = run(RequeueDone(), state=state)
    assert (state.phase, actions[-1]) == (Phase.FINISHED, Exit(143))


def test_other_warnings_after_the_requeue_wait_for_slurms_sigterm() -> None:
    state = State(phase=Phase.REQUEUED)
    assert step(state, Warning("SIGUSR1")) == (state, [])


def test_a_requeue_that_fails_while_slurm_ends_the_steps_ends_the_launcher_rather_than_resume() -> None:
    """Slurm's SIGTERM came: its steps are going, so resuming here would only be killed."""
    state, _ = run(Warning("SIGTERM", requeue=True), TreeEnded("dumped", 0), CheckpointDone(SUMMARY),
                   state=running())
    assert (state.phase, state.stopped_at_checkpoint, state.ending) == (Phase.REQUEUEING, True, True)

    state, actions = run(RequeueFailed("slurmctld down"), state=state)

    assert state.phase == Phase.FINISHED
    assert actions == [Say("requeue failed: slurmctld down; Slurm is ending the job's steps"), Exit(143)]
