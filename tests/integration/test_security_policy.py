"""The tier policy cannot be bypassed with `scontrol update` or a partition list (real slurmctld).

Each attack runs as an unprivileged user against the real slurmctld and its job_submit.lua; the
test checks the refusal, that slurmctld's log names the policy as the refuser, and that the job is
unchanged. Jobs are submitted held, so they stay pending and never use the nodes.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from conftest import Jobs, run_as

HELD_JOB = """#!/bin/bash
#SBATCH --singularity-sla=basic
#SBATCH -o out.txt
true
"""

REFUSED = "Access/permission denied"  # Slurm 22.05 drops the plugin's own message to the user


class SlurmctldLog:
    """What slurmctld writes to its log from now on."""

    def __init__(self, path: Path):
        self.path = path
        self.start = path.stat().st_size

    def new_text(self) -> str:
        with self.path.open("rb") as handle:
            handle.seek(self.start)
            return handle.read().decode(errors="replace")

    def wait_for(self, text: str, timeout: float = 10) -> str:
        deadline = time.monotonic() + timeout
        while True:
            logged = self.new_text()
            if text in logged:
                return logged
            if time.monotonic() > deadline:
                pytest.fail(f"slurmctld never logged {text!r}; it logged:\n{logged[-2000:]}")
            time.sleep(0.2)


@pytest.fixture
def ctld_log(layout) -> SlurmctldLog:
    return SlurmctldLog(layout.log_dir / "slurmctld.log")


@pytest.fixture
def held_basic_job(jobs: Jobs) -> int:
    job_id = jobs.submit(jobs.script("held.sh", HELD_JOB), "--hold")
    record = jobs.record(job_id)
    assert (record["JobState"], record["Partition"], record["Requeue"]) == ("PENDING", "basic", "1")
    return job_id


def _update(user: str, job_id: int, *changes: str) -> subprocess.CompletedProcess[str]:
    return run_as(user, ["scontrol", "update", f"JobId={job_id}", *changes])


def _refusal_logged(ctld_log: SlurmctldLog, job_id: int, uid: int, reason: str) -> None:
    ctld_log.wait_for(f"singularity: update of job {job_id} by uid {uid} refused: job {job_id} "
                      + reason)


def test_user_cannot_move_a_basic_job_to_the_premium_partition(jobs, held_basic_job, job_user,
                                                              ctld_log):
    job_id = held_basic_job

    proc = _update(job_user.pw_name, job_id, "Partition=premium")

    assert proc.returncode != 0
    assert REFUSED in proc.stderr or "cannot move to 'premium'" in proc.stderr
    _refusal_logged(ctld_log, job_id, job_user.pw_uid,
                    "runs in partition 'basic' (SLA tier basic) and cannot move to 'premium'")
    record = jobs.record(job_id)
    assert (record["Partition"], record["Requeue"]) == ("basic", "1")


def test_user_cannot_make_a_tier_job_non_requeueable(jobs, held_basic_job, job_user, ctld_log):
    job_id = held_basic_job

    proc = _update(job_user.pw_name, job_id, "Requeue=0")

    assert proc.returncode != 0
    assert REFUSED in proc.stderr or "must stay requeueable" in proc.stderr
    _refusal_logged(ctld_log, job_id, job_user.pw_uid,
                    "has SLA tier basic and must stay requeueable (Requeue=0 refused)")
    assert jobs.record(job_id)["Requeue"] == "1"


def test_users_harmless_changes_to_their_own_job_are_accepted(jobs, held_basic_job, job_user):
    job_id = held_basic_job

    proc = _update(job_user.pw_name, job_id, "Comment=policy-test", "TimeLimit=10")

    assert proc.returncode == 0, proc.stderr
    record = jobs.record(job_id)
    assert (record.get("Comment", "").strip(), record["TimeLimit"]) == ("policy-test", "00:10:00")
    assert (record["Partition"], record["Requeue"]) == ("basic", "1")


def test_another_user_cannot_change_the_job_at_all(jobs, held_basic_job, other_user, ctld_log):
    job_id = held_basic_job
    before = jobs.record(job_id)

    harmless = _update(other_user.pw_name, job_id, "Comment=not-yours")
    escalation = _update(other_user.pw_name, job_id, "Partition=premium")

    # The comment passes the policy and Slurm refuses it (not the job's owner); the partition is
    # refused by the policy before Slurm looks at the owner.
    assert harmless.returncode != 0 and escalation.returncode != 0
    ctld_log.wait_for(f"Security violation, JOB_UPDATE RPC from uid {other_user.pw_uid}")
    _refusal_logged(ctld_log, job_id, other_user.pw_uid, "runs in partition 'basic'")
    after = jobs.record(job_id)
    assert before.get("Comment") is None and after.get("Comment") is None
    assert (after["Partition"], after["Requeue"]) == ("basic", "1")


def test_root_may_move_a_job_to_another_tier(jobs, held_basic_job, ctld_log):
    job_id = held_basic_job

    proc = _update("root", job_id, "Partition=premium")

    assert proc.returncode == 0, proc.stderr
    assert jobs.record(job_id)["Partition"] == "premium"
    assert f"update of job {job_id} by uid 0 refused" not in ctld_log.new_text()


def test_partition_list_naming_a_tier_partition_is_refused_at_submit(jobs, slurm):
    # Without the --singularity-sla option, `-p standard,premium` would leave the job unmanaged.
    before = len(slurm.jobs())

    proc = jobs.sbatch(jobs.script("held.sh", "#!/bin/bash\ntrue\n"), "--hold",
                       "--partition=standard,premium")

    assert proc.returncode != 0
    assert ("the partition list 'standard,premium' names the tier partition 'standard' beside "
            "others") in proc.stderr
    assert len(slurm.jobs()) == before
