"""Pure decisions of `checkpoint`/`migrate`, the launcher's job environment and the requeue helper."""

from __future__ import annotations

import pytest

from singularity_slurm.config import parse
from singularity_slurm.node.release import exclude_argv, release_when_pending
from singularity_slurm.slurm_plugin.jobctl import (
    JobControlError,
    agent_call_argv,
    check_target,
    parse_agent_reply,
)
from singularity_slurm.slurm_plugin.launcher import LaunchError, job_info, rank_environment

CONFIG = parse({})
RUNNING = {"JobId": "7", "UserId": "alice(1001)", "JobState": "RUNNING", "Partition": "basic",
           "BatchHost": "n1", "NodeList": "n1"}


def test_a_running_managed_job_of_the_caller_is_accepted():
    assert check_target(dict(RUNNING), 7, 1001, CONFIG, "migrate") == RUNNING


def test_root_may_act_on_any_job():
    assert check_target(dict(RUNNING), 7, 0, CONFIG, "checkpoint") == RUNNING


@pytest.mark.parametrize(("record", "uid", "message"), [
    (None, 1001, "no job 7: Slurm does not know it"),
    (RUNNING, 1002, "job 7 belongs to alice: you can only migrate your own jobs"),
    ({**RUNNING, "JobState": "PENDING"}, 1001, "job 7 is PENDING: only a running job can be migrated"),
    ({**RUNNING, "Partition": "debug"}, 1001, "partition debug, which belongs to no SLA tier"),
    ({**RUNNING, "BatchHost": ""}, 1001, "has no batch host yet"),
])
def test_other_jobs_are_refused_with_the_reason(record, uid, message):
    with pytest.raises(JobControlError, match=message):
        check_target(record, 7, uid, CONFIG, "migrate")


def test_checkpoint_refusal_reads_naturally():
    with pytest.raises(JobControlError, match="only a running job can be checkpointed"):
        check_target({**RUNNING, "JobState": "COMPLETED"}, 7, 1001, CONFIG, "checkpoint")


def test_agent_call_is_a_step_on_the_batch_host():
    argv = agent_call_argv("/opt/x/singularityctl", 7, "n2", "migrate", {"exclude": ["n2"]})
    assert argv == ["srun", "--jobid=7", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=n2",
                    "--quiet", "/opt/x/singularityctl", "agent-call", "migrate", '{"exclude": ["n2"]}']


def test_agent_reply_is_the_last_json_line():
    assert parse_agent_reply('noise\n{"ok": true, "seq": 3}\n', "") == {"ok": True, "seq": 3}
    with pytest.raises(JobControlError, match="no answer from the job's node agent: srun: error"):
        parse_agent_reply("", "srun: error: boom")


def test_job_info_needs_a_slurm_job():
    with pytest.raises(LaunchError, match="SLURM_JOB_ID, SLURMD_NODENAME unset"):
        job_info({}, CONFIG)
    info = job_info({"SLURM_JOB_ID": "9", "SLURMD_NODENAME": "n2", "SLURM_RESTART_COUNT": "2",
                     "SLURM_JOB_PARTITION": "premium"}, CONFIG)
    assert (info.job_id, info.node, info.restart_count, info.tier) == (9, "n2", 2, "premium")


def test_rank_environment_is_torchrun_compatible_and_keeps_the_job_environment():
    info = job_info({"SLURM_JOB_ID": "9", "SLURMD_NODENAME": "n2"}, CONFIG)
    env = rank_environment({"PATH": "/bin", "MASTER_PORT": "1234"}, info)
    assert env["PATH"] == "/bin"
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")} == {
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "1234"}
    assert env["SINGULARITY_JOB_ID"] == "9"


class FakeSlurm:
    """The two calls release_when_pending makes, answered from a script of job records."""

    def __init__(self, records):
        self.records = list(records)
        self.calls = []

    def job(self, job_id):
        return self.records.pop(0) if len(self.records) > 1 else self.records[0]

    def run(self, argv, check=True):
        self.calls.append(argv)

    def release_start(self, job_id):
        self.calls.append(["release", job_id])


def _no_sleep(_):
    return None


def test_the_delay_is_lifted_only_once_the_requeue_completed():
    slurm = FakeSlurm([{"JobState": "COMPLETING", "Restarts": "0"},
                       {"JobState": "PENDING", "Restarts": "1", "Reason": "BeginTime"}])
    assert release_when_pending(slurm, 7, 0, sleep=_no_sleep) is True
    assert slurm.calls == [["release", 7]]


def test_a_migration_sets_the_excluded_nodes_before_lifting_the_delay():
    slurm = FakeSlurm([{"JobState": "PENDING", "Restarts": "1", "Reason": "BeginTime"}])
    assert release_when_pending(slurm, 7, 0, exclude=["n1"], sleep=_no_sleep) is True
    assert slurm.calls == [exclude_argv(7, ["n1"]), ["release", 7]]
    assert exclude_argv(7, ["n1", "n2"]) == ["scontrol", "update", "JobId=7", "ExcNodeList=n1,n2"]


def test_the_helper_gives_up_when_the_job_never_comes_back():
    ticks = iter(range(1000))
    slurm = FakeSlurm([{"JobState": "COMPLETING", "Restarts": "0"}])
    assert release_when_pending(slurm, 7, 0, timeout=5, clock=lambda: next(ticks),
                                sleep=_no_sleep) is False
    assert slurm.calls == []


def test_a_job_slurm_forgot_is_not_waited_for():
    slurm = FakeSlurm([None])
    assert release_when_pending(slurm, 7, 0, sleep=_no_sleep) is False
