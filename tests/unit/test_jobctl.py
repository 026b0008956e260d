"""Pure decisions of `checkpoint`/`migrate`, the launcher's job environment and the requeue helper."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from singularity_slurm import errors
from singularity_slurm.config import parse
from singularity_slurm.coordinator.commands import Request
from singularity_slurm.node.release import exclude_argv, release_when_pending, resize_argvs
from singularity_slurm.slurm_plugin import jobctl
from singularity_slurm.slurm_plugin.jobctl import (
    JobControl,
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


def test_a_record_whose_job_name_reads_as_another_jobs_id_is_refused_even_for_root():
    # `sbatch -J "x JobId=999"`: scontrol prints the name after JobId, and the record names job 999
    with pytest.raises(JobControlError, match="names job '999'"):
        check_target({**RUNNING, "JobId": "999"}, 7, 0, CONFIG, "checkpoint")


def test_an_operator_may_act_on_any_job_and_a_namesake_uid_does_not_matter():
    config = parse({"admin": {"operators": ["ops"]}})

    assert check_target(dict(RUNNING), 7, 1500, config, "migrate", caller_name="ops") == RUNNING
    with pytest.raises(JobControlError, match="job 7 belongs to alice: you can only migrate your own jobs"):
        check_target(dict(RUNNING), 7, 1500, CONFIG, "migrate", caller_name="ops")
    with pytest.raises(JobControlError, match="job 7 belongs to alice: you can only migrate your own jobs"):
        check_target(dict(RUNNING), 7, 1002, config, "migrate", caller_name="bob")


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

    job_record = job  # squeue's fields over scontrol's: one record here

    def run(self, argv, check=True):
        self.calls.append(argv)

    def release_start(self, job_id):
        self.calls.append(["release", job_id])


def _no_sleep(_):
    return None


def test_the_delay_is_lifted_only_once_the_requeue_completed():
    slurm = FakeSlurm([{"JobState": "COMPLETING", "Restarts": "0"},
                       {"JobState": "PENDING", "Restarts": "1", "Reason": "BeginTime"},
                       {"JobState": "RUNNING", "Restarts": "1"}])
    assert release_when_pending(slurm, 7, 0, sleep=_no_sleep) is True
    assert slurm.calls == [["release", 7]]


def test_a_requeued_job_the_scheduler_has_not_looked_at_yet_is_released_too():
    """Right after the requeue completes the job shows Reason None, its start already delayed."""
    slurm = FakeSlurm([{"JobState": "PENDING", "Restarts": "1", "Reason": "None"},
                       {"JobState": "PENDING", "Restarts": "1", "Reason": "Resources"}])
    assert release_when_pending(slurm, 7, 0, sleep=_no_sleep) is True
    assert slurm.calls == [["release", 7]]


def test_a_delay_put_back_by_a_late_requeue_is_lifted_again():
    slurm = FakeSlurm([{"JobState": "PENDING", "Restarts": "1", "Reason": "None"},
                       {"JobState": "PENDING", "Restarts": "1", "Reason": "BeginTime"},
                       {"JobState": "RUNNING", "Restarts": "1"}])
    assert release_when_pending(slurm, 7, 0, sleep=_no_sleep) is True
    assert slurm.calls == [["release", 7], ["release", 7]]


def test_a_job_held_for_another_reason_is_left_alone():
    slurm = FakeSlurm([{"JobState": "PENDING", "Restarts": "1", "Reason": "JobHeldAdmin"}])
    assert release_when_pending(slurm, 7, 0, sleep=_no_sleep) is True
    assert slurm.calls == []


def test_a_migration_sets_the_excluded_nodes_before_lifting_the_delay():
    slurm = FakeSlurm([{"JobState": "PENDING", "Restarts": "1", "Reason": "BeginTime"},
                       {"JobState": "RUNNING", "Restarts": "1"}])
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


# --- who takes which way to the agent -------------------------------------------------------------


class JobSlurm:
    def __init__(self, record):
        self.record = record

    def job(self, job_id):
        return dict(self.record)

    job_record = job

    def nodes(self):
        return {"n1": {}, "n2": {}}


class FakeChannel:
    def __init__(self, reply):
        self.reply = reply
        self.sent: list[tuple[Request, str]] = []

    def send(self, request, *, where, say):
        self.sent.append((request, where))
        return self.reply


def no_step(*args, **kwargs):
    raise AssertionError("a job step was started")


def control(uid, channel, caller_name=None, config=CONFIG):
    return JobControl(config, JobSlurm(RUNNING), uid, say=lambda m: None, ctl="/x/singularityctl",
                      caller_name=caller_name or "someone", channel=lambda: channel)


def test_root_checkpoints_another_users_job_through_redis_not_a_step(monkeypatch):
    monkeypatch.setattr(jobctl.subprocess, "run", no_step)
    channel = FakeChannel({"ok": True, "seq": 4, "seconds": 1.0})

    assert control(0, channel, "root").checkpoint(7) == {"ok": True, "seq": 4, "seconds": 1.0}
    [(request, where)] = channel.sent
    assert (request.job_id, request.op, request.args, where) == (7, "checkpoint", {}, "n1")


def test_an_operators_migration_goes_through_redis_and_a_refusal_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(jobctl.subprocess, "run", no_step)
    config = parse({"admin": {"operators": ["ops"]}})
    channel = FakeChannel({"ok": False, "error": "refused: uid 1500 may not act on job 7"})

    with pytest.raises(JobControlError, match="^job 7: refused: uid 1500 may not act on job 7$"):
        control(1500, channel, "ops", config).migrate(7, None, wait=0)
    [(request, _)] = channel.sent
    assert (request.op, request.args) == ("migrate", {"exclude": ["n1"]})


def test_the_owner_still_uses_a_job_step(monkeypatch):
    calls = []

    def step(argv, **kwargs):
        calls.append(argv)
        return SimpleNamespace(stdout='{"ok": true, "seq": 2, "seconds": 0.1}\n', stderr="")

    monkeypatch.setattr(jobctl.subprocess, "run", step)
    channel = FakeChannel({"ok": True})

    assert control(1001, channel, "alice").checkpoint(7)["seq"] == 2
    assert calls == [agent_call_argv("/x/singularityctl", 7, "n1", "checkpoint",
                                     {"reason": "manual", "stop": False})]
    assert channel.sent == []


def test_another_user_is_refused_before_anything_is_sent(monkeypatch):
    monkeypatch.setattr(jobctl.subprocess, "run", no_step)
    channel = FakeChannel({"ok": True})

    with pytest.raises(JobControlError, match="job 7 belongs to alice: you can only checkpoint your own"):
        control(1002, channel, "bob").checkpoint(7)
    assert channel.sent == []


def test_an_unreachable_redis_is_one_line_with_the_fix(monkeypatch):
    def unreachable(redis_config, timeout):
        raise errors.RegistryError("cannot reach Redis at 127.0.0.1:6379 (Connection refused); is "
                                   "redis-server running?")

    monkeypatch.setattr(jobctl, "connect", unreachable)
    job_control = JobControl(CONFIG, JobSlurm(RUNNING), 0, say=lambda m: None)

    with pytest.raises(errors.CommandChannelError) as info:
        job_control.checkpoint(7)

    assert str(info.value) == ("cannot reach Redis at 127.0.0.1:6379 (Connection refused); is redis-server "
                               "running? (root and operators act on other users' jobs through Redis)")


def test_an_unreadable_password_file_tells_the_operator_what_to_ask_for(monkeypatch):
    def unreadable(redis_config, timeout):
        raise errors.ConfigError("cannot read the Redis password file: permission denied")

    monkeypatch.setattr(jobctl, "connect", unreadable)
    job_control = JobControl(parse({"admin": {"operators": ["ops"]}}), JobSlurm(RUNNING), 1500,
                             say=lambda m: None, caller_name="ops")

    with pytest.raises(errors.CommandChannelError) as info:
        job_control.checkpoint(7)

    assert str(info.value) == (
        "cannot read the Redis password file /etc/singularity-slurm/redis.password, through which root and "
        "operators act on other users' jobs: ask the admin for group read access (admin guide, "
        '"Operators")')


def test_a_resized_job_gets_its_node_range_and_gpus_per_node_once_pending_again():
    slurm = FakeSlurm([{"JobState": "COMPLETING", "Restarts": "0"},
                       {"JobState": "PENDING", "Restarts": "1", "Reason": "BeginTime"},
                       {"JobState": "RUNNING", "Restarts": "1"}])
    assert release_when_pending(slurm, 7, 0, sleep=_no_sleep, resize=resize_argvs(7, "1-2", "1")) is True
    assert slurm.calls == [["scontrol", "update", "JobId=7", "NumNodes=1-2"],
                           ["scontrol", "update", "JobId=7", "Gres=gpu:1"], ["release", 7]]


def test_a_resize_names_only_what_changes():
    assert resize_argvs(7, "", "2") == [["scontrol", "update", "JobId=7", "Gres=gpu:2"]]
    assert resize_argvs(7, "3-3", "") == [["scontrol", "update", "JobId=7", "NumNodes=3-3"]]


def test_a_resize_update_slurm_refuses_is_tried_again_while_the_job_is_pending():
    class Refusing(FakeSlurm):
        def run(self, argv, check=True):
            super().run(argv)
            if len(self.calls) == 1:
                raise errors.SlurmError("slurm_update error: Requested node configuration is not available")

    slurm = Refusing([{"JobState": "PENDING", "Restarts": "1", "Reason": "BeginTime"},
                      {"JobState": "PENDING", "Restarts": "1", "Reason": "BeginTime"},
                      {"JobState": "RUNNING", "Restarts": "1"}])
    assert release_when_pending(slurm, 7, 0, sleep=_no_sleep, resize=resize_argvs(7, "1-1", "")) is True
    assert slurm.calls == [["scontrol", "update", "JobId=7", "NumNodes=1-1"],
                           ["scontrol", "update", "JobId=7", "NumNodes=1-1"], ["release", 7]]


@pytest.mark.parametrize(("released", "kept"), [(True, False), (False, True)])
def test_the_release_helper_removes_its_log_once_it_lifted_the_delay(tmp_path, monkeypatch, released, kept):
    from singularity_slurm.node import release

    log = tmp_path / "release-7.log"
    log.write_text("")
    monkeypatch.setenv(release.LOG_VAR, str(log))
    monkeypatch.setattr(release, "release_when_pending", lambda *args, **kwargs: released)
    assert release.main(["7", "0"]) == (0 if released else 1)
    assert log.exists() is kept  # a release that failed keeps its log for the admin
