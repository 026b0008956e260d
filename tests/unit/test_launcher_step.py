"""How `singularityctl run` in a batch script becomes a job step (slurm_plugin.launcher)."""

from __future__ import annotations

import os

import pytest

from singularity_slurm.slurm_plugin.launcher import (
    FRONT_OUTPUT,
    FRONT_PID,
    JobInfo,
    front_environment,
    in_job_step,
    sigterm_cause,
    step_argv,
)


@pytest.mark.parametrize("step_id, expected", [
    ("0", True), ("12", True),
    (None, False), ("", False), ("batch", False), ("-5", False),
    (str(0xFFFFFFFB), False),  # the batch step's reserved id, as some Slurm versions print it
    (str(0xFFFFFFFC), False),  # the extern step
])
def test_only_a_real_job_step_counts_as_one(step_id: str | None, expected: bool) -> None:
    env = {} if step_id is None else {"SLURM_STEP_ID": step_id}

    assert in_job_step(env) is expected


def test_the_launcher_step_is_one_task_on_the_batch_host_sharing_the_jobs_resources() -> None:
    info = JobInfo(job_id=42, node="n2", restart_count=1, tier="basic")

    assert step_argv(info, "/opt/s/venv/bin/singularityctl", ["run", "--", "python", "train.py"]) == [
        "srun", "--jobid=42", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=n2", "--quiet",
        "--kill-on-bad-exit=1", "--export=ALL", "/opt/s/venv/bin/singularityctl", "run", "--", "python",
        "train.py"]


def test_the_step_takes_the_batch_scripts_environment_not_its_own() -> None:
    with open(f"/proc/{os.getpid()}/environ", "rb") as f:
        initial = dict(item.decode().split("=", 1) for item in f.read().split(b"\0") if b"=" in item)
    step_env = {"SLURM_STEP_ID": "3", FRONT_PID: str(os.getpid()), FRONT_OUTPUT: "/home/u/out"}

    env = front_environment(step_env)

    assert env == initial
    assert FRONT_PID not in env and FRONT_OUTPUT not in env


@pytest.mark.parametrize("pid", ["", "self", "../1", "999999999"])
def test_without_a_readable_front_the_step_keeps_its_own_environment(pid: str) -> None:
    step_env = {"SLURM_STEP_ID": "3", FRONT_PID: pid, "HOME": "/home/u"}

    assert front_environment(step_env) == step_env


@pytest.mark.parametrize(("record", "cause"), [
    ({"JobState": "COMPLETING", "Restarts": "1", "PreemptTime": "None"}, "requeue"),
    ({"JobState": "COMPLETING", "Restarts": "0", "PreemptTime": "None"}, "end"),
    ({"JobState": "CANCELLED", "Restarts": "0", "PreemptTime": "None"}, "end"),
    ({"JobState": "COMPLETING", "Restarts": "1", "PreemptTime": "2026-12-02T21:47:08"}, "preempt"),
    ({"JobState": "COMPLETING", "Restarts": "x"}, "end"),
    (None, "end"),
])
def test_a_sigterm_is_a_requeue_when_slurm_counted_a_restart_past_this_start(record, cause) -> None:
    """`scontrol requeue` counts the restart as soon as Slurm takes it, before the steps end."""
    assert sigterm_cause(record, 0) == cause


def test_a_later_start_compares_with_its_own_restart_count() -> None:
    record = {"JobState": "COMPLETING", "Restarts": "3"}
    assert (sigterm_cause(record, 3), sigterm_cause(record, 2)) == ("end", "requeue")
