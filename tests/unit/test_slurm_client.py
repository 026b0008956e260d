"""Slurm's command lines and outputs: pure builders and parsers, and the thin client around them."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field

import pytest

from singularity_slurm.errors import SlurmCommandFailed, SlurmError
from singularity_slurm.slurmcli import (
    SlurmClient,
    SlurmVersion,
    draining,
    expand_hostlist,
    is_already_requeued,
    is_invalid_job,
    parse_config,
    parse_gpu_count,
    parse_record,
    parse_records,
    parse_sbatch_parsable,
    parse_user,
    parse_version,
    release_start_argv,
    requeue_argv,
    sbatch_argv,
    scontrol_show_job_argv,
)

JOB_LINE = (
    "JobId=42 JobName=train UserId=jobuser(1001) GroupId=jobuser(1001) MCS_label=N/A "
    "Priority=4294901758 Nice=0 Account=(null) QOS=(null) JobState=PENDING "
    "Reason=Nodes required for job are DOWN, DRAINED or reserved for jobs in higher priority "
    "partitions Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 "
    "Partition=premium NodeList=(null) TRES=cpu=1,mem=2G,node=1,billing=1 "
    "Command=/home/jobuser/train.sh --epochs 3 --lr=0.1 WorkDir=/home/jobuser "
    "TresPerNode=gres:gpu:2"
)


# --- versions -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "version"), [
    ("slurm-wlm 22.05.8\n", SlurmVersion(22, 5, 8)),
    ("slurm 24.11.5\n", SlurmVersion(24, 11, 5)),
    ("slurm 23.02", SlurmVersion(23, 2, 0)),
])
def test_parse_version_reads_major_minor_micro(text: str, version: SlurmVersion) -> None:
    assert parse_version(text) == version


def test_parse_version_without_a_number_names_the_text() -> None:
    with pytest.raises(SlurmError) as info:
        parse_version("scontrol: command not found\n")

    assert str(info.value) == "cannot read a Slurm version from 'scontrol: command not found'"


def test_versions_order_numerically_not_as_text() -> None:
    assert SlurmVersion(22, 5, 8) < SlurmVersion(23, 2) < SlurmVersion(23, 11) < SlurmVersion(24, 5)
    assert SlurmVersion(22, 5, 10) > SlurmVersion(22, 5, 9)


def test_version_prints_as_slurm_writes_it() -> None:
    assert str(SlurmVersion(22, 5, 8)) == "22.05.8"
    assert str(SlurmVersion(24, 11)) == "24.11.0"


# --- one-line records -----------------------------------------------------------------------------


def test_parse_record_keeps_values_with_spaces_whole() -> None:
    record = parse_record(JOB_LINE)

    assert record["Reason"] == (
        "Nodes required for job are DOWN, DRAINED or reserved for jobs in higher priority "
        "partitions"
    )
    assert record["Dependency"] == "(null)"


def test_parse_record_keeps_values_holding_equals_signs() -> None:
    record = parse_record(JOB_LINE)

    assert record["TRES"] == "cpu=1,mem=2G,node=1,billing=1"


def test_parse_record_does_not_split_a_command_at_an_option_with_equals() -> None:
    record = parse_record(JOB_LINE)

    assert record["Command"] == "/home/jobuser/train.sh --epochs 3 --lr=0.1"
    assert "--lr" not in record
    assert record["WorkDir"] == "/home/jobuser"


def test_parse_record_reads_every_key_of_a_job_line() -> None:
    record = parse_record(JOB_LINE)

    assert list(record) == [
        "JobId", "JobName", "UserId", "GroupId", "MCS_label", "Priority", "Nice", "Account", "QOS",
        "JobState", "Reason", "Dependency", "Requeue", "Restarts", "BatchFlag", "Reboot",
        "ExitCode", "Partition", "NodeList", "TRES", "Command", "WorkDir", "TresPerNode",
    ]
    assert record["UserId"] == "jobuser(1001)"
    assert record["ExitCode"] == "0:0"
    assert record["TresPerNode"] == "gres:gpu:2"


def test_parse_record_keys_may_hold_slashes_and_colons() -> None:
    record = parse_record("NodeName=n1 CfgTRES=cpu=4,gres/gpu=4 AllocTRES= gres/gpu:a100=2")

    assert record == {"NodeName": "n1", "CfgTRES": "cpu=4,gres/gpu=4", "AllocTRES": "",
                      "gres/gpu:a100": "2"}


def test_parse_record_of_an_empty_line_is_empty() -> None:
    assert parse_record("") == {}
    assert parse_record("   \n") == {}


def test_parse_record_ignores_words_before_the_first_key() -> None:
    assert parse_record("garbage words JobId=1") == {"JobId": "1"}


def test_parse_records_reads_one_record_per_non_blank_line() -> None:
    text = "PartitionName=premium PriorityTier=30\n\nPartitionName=basic PriorityTier=10\n"

    assert parse_records(text) == [
        {"PartitionName": "premium", "PriorityTier": "30"},
        {"PartitionName": "basic", "PriorityTier": "10"},
    ]


# --- scontrol show config -------------------------------------------------------------------------


def test_parse_config_reads_key_equals_value_lines() -> None:
    text = (
        "Configuration data as of 2024-05-01T10:00:00\n"
        "AccountingStorageBackupHost = (null)\n"
        "AuthInfo                = cred_expire=70\n"
        "SlurmctldParameters     = enable_configless,preempt_send_user_signal\n"
        "SLURM_CONF              = /etc/slurm/slurm.conf\n"
        "SLURM_VERSION           = 22.05.8\n"
        "\n"
        "Cgroup Support Configuration:\n"
        "AllowedRAMSpace         = 100.0 percent\n"
        "\n"
        "Slurmctld(primary) at host1 is UP\n"
    )

    assert parse_config(text) == {
        "AccountingStorageBackupHost": "(null)",
        "AuthInfo": "cred_expire=70",
        "SlurmctldParameters": "enable_configless,preempt_send_user_signal",
        "SLURM_CONF": "/etc/slurm/slurm.conf",
        "SLURM_VERSION": "22.05.8",
        "AllowedRAMSpace": "100.0 percent",
    }


def test_parse_config_skips_lines_whose_key_holds_spaces() -> None:
    assert parse_config("Some Heading = x\n = y\nGood = z\n") == {"Good": "z"}


# --- sbatch --parsable ----------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "job_id"), [
    ("42\n", 42), ("42;cluster\n", 42), ("  7  ", 7),
])
def test_parse_sbatch_parsable_reads_the_job_id(text: str, job_id: int) -> None:
    assert parse_sbatch_parsable(text) == job_id


@pytest.mark.parametrize("text", ["", "\n", "Submitted batch job 42\n", "-1\n", ";cluster\n",
                                  "sbatch: error: invalid partition\n"])
def test_parse_sbatch_parsable_refuses_anything_but_a_job_id(text: str) -> None:
    with pytest.raises(SlurmError) as info:
        parse_sbatch_parsable(text)

    assert str(info.value) == f"sbatch printed {text.strip()!r}, not a job id"


# --- hostlists ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("expr", "hosts"), [
    ("n[1-3,5],gpu01", ["n1", "n2", "n3", "n5", "gpu01"]),
    ("gpu[01-03]", ["gpu01", "gpu02", "gpu03"]),
    ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),
    ("gpu[01,03]", ["gpu01", "gpu03"]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("n1", ["n1"]),
    ("n1,n2", ["n1", "n2"]),
    ("a[1-2],b[3-4]", ["a1", "a2", "b3", "b4"]),
    ("rack-1-n[1-2]", ["rack-1-n1", "rack-1-n2"]),
    ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
])
def test_expand_hostlist(expr: str, hosts: list[str]) -> None:
    assert expand_hostlist(expr) == hosts


@pytest.mark.parametrize("expr", ["", "(null)", "None"])
def test_expand_hostlist_of_no_nodes_is_empty(expr: str) -> None:
    assert expand_hostlist(expr) == []


# --- GPUs and users -------------------------------------------------------------------------------


@pytest.mark.parametrize(("record", "count"), [
    ({"TresPerNode": "gres:gpu:4"}, 4),
    ({"TresPerNode": "gres/gpu:2"}, 2),
    ({"TresPerNode": "gres/gpu=2"}, 2),
    ({"TresPerNode": "gres:gpu:a100:2"}, 2),
    ({"TresPerNode": "gres/gpu:a100:3"}, 3),
    ({"TresPerNode": "gres:gpu"}, 1),
    ({"TresPerNode": "gres:gpu:a100"}, 1),
    ({"TresPerNode": "gres:gpu:2,gres:shard:4"}, 2),
    ({"Gres": "gpu:2"}, 2),
    ({"TresPerNode": "", "Gres": "gpu:3"}, 3),
])
def test_parse_gpu_count(record: dict[str, str], count: int) -> None:
    assert parse_gpu_count(record) == count


@pytest.mark.parametrize("record", [
    {}, {"TresPerNode": "(null)"}, {"TresPerNode": "N/A"}, {"TresPerNode": "gres/gpumem:10G"},
    {"TresPerNode": "gres:shard:2"},
])
def test_parse_gpu_count_without_gpus_is_zero(record: dict[str, str]) -> None:
    assert parse_gpu_count(record) == 0


@pytest.mark.parametrize(("field", "user"), [
    ("jobuser(1001)", ("jobuser", 1001)),
    ("root(0)", ("root", 0)),
    ("1001", ("1001", None)),
    ("(null)", ("(null)", None)),
    ("", ("", None)),
])
def test_parse_user(field: str, user: tuple[str, int | None]) -> None:
    assert parse_user(field) == user


# --- stderr classification ------------------------------------------------------------------------


@pytest.mark.parametrize("stderr", [
    "scontrol: error: Requeue of JobId=42 failed: Job is pending execution\n",
    "scontrol: error: Job 42 already requeued\n",
    "JOB ALREADY REQUEUED",
])
def test_is_already_requeued(stderr: str) -> None:
    assert is_already_requeued(stderr) is True


@pytest.mark.parametrize("stderr", [
    "", "scontrol: error: Invalid job id specified\n",
    "scontrol: error: Access/permission denied\n", "already done",
])
def test_other_errors_are_not_already_requeued(stderr: str) -> None:
    assert is_already_requeued(stderr) is False


def test_is_invalid_job() -> None:
    assert is_invalid_job("slurm_load_jobs error: Invalid job id specified\n") is True
    assert is_invalid_job("slurm_load_jobs error: Unable to contact slurm controller\n") is False


# --- argv builders --------------------------------------------------------------------------------


def test_sbatch_argv_is_parsable_with_options_before_the_script() -> None:
    assert sbatch_argv("job.sh", ["--singularity-sla=premium", "-N2"]) == [
        "sbatch", "--parsable", "--singularity-sla=premium", "-N2", "job.sh",
    ]


def test_sbatch_argv_without_parsable() -> None:
    assert sbatch_argv("job.sh", parsable=False) == ["sbatch", "job.sh"]


def test_scontrol_show_job_argv() -> None:
    assert scontrol_show_job_argv() == ["scontrol", "show", "job", "-o"]
    assert scontrol_show_job_argv(42) == ["scontrol", "show", "job", "-o", "42"]


def test_requeue_argv() -> None:
    assert requeue_argv(42) == ["scontrol", "requeue", "42"]
    assert requeue_argv(42, hold=True) == ["scontrol", "requeuehold", "42"]


def test_release_start_argv() -> None:
    assert release_start_argv(42) == ["scontrol", "update", "JobId=42", "StartTime=now"]


# --- the client, with its runner replaced ---------------------------------------------------------


@dataclass
class FakeRunner:
    """Stands in for subprocess.run: answers each argv from a table and records the calls."""

    answers: dict[tuple[str, ...], tuple[int, str, str]] = field(default_factory=dict)
    calls: list[dict] = field(default_factory=list)
    raises: BaseException | None = None

    def __call__(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
        self.calls.append({"argv": argv, **kwargs})
        if self.raises is not None:
            raise self.raises
        returncode, stdout, stderr = self.answers[tuple(argv)]
        return subprocess.CompletedProcess(argv, returncode, stdout, stderr)


SHOW_42 = ("scontrol", "show", "job", "-o", "42")
SHOW_ALL = ("scontrol", "show", "job", "-o")


def test_jobs_of_an_invalid_job_id_is_empty() -> None:
    runner = FakeRunner({SHOW_42: (1, "", "slurm_load_jobs error: Invalid job id specified\n")})

    assert SlurmClient(runner=runner).jobs(42) == []
    assert SlurmClient(runner=runner).job(42) is None


def test_a_jobs_preempt_time_is_read_alone_and_none_when_it_is_not_preempted() -> None:
    from singularity_slurm.slurmcli import parse_time

    argv = ("squeue", "-h", "-j", "42", "-O", "PreemptTime:40")
    preempted = FakeRunner({argv: (0, "2026-12-06T22:10:00                     \n", "")})
    assert SlurmClient(runner=preempted).preempt_time(42) == parse_time("2026-12-06T22:10:00")
    assert SlurmClient(runner=FakeRunner({argv: (0, "N/A\n", "")})).preempt_time(42) is None
    gone = FakeRunner({argv: (1, "", "slurm_load_jobs error: Invalid job id specified\n")})
    assert SlurmClient(runner=gone).preempt_time(42) is None


def test_the_jobs_slurm_is_preempting_are_those_preempted_since_their_current_run_began() -> None:
    argv = ("squeue", "-h", "-t", "running", "-O", "JobID:20,StartTime:25,PreemptTime:25")
    table = ("41                  2026-12-06T22:00:00      2026-12-06T22:10:00      \n"  # being preempted
             "42                  2026-12-06T22:00:00      N/A                      \n"
             "43                  2026-12-06T22:20:00      2026-12-06T22:10:00      \n"  # its earlier run's
             "44                  2026-12-06T22:20:00      2026-12-06T22:20:00      \n"  # in its first second
             "4x5                 2026-12-06T22:00:00      2026-12-06T22:10:00      \n"
             "46                  2026-12-06T22:00:00\n")
    assert SlurmClient(runner=FakeRunner({argv: (0, table, "")})).preempting() == {41, 44}


def test_jobs_with_no_jobs_in_the_system_is_empty() -> None:
    runner = FakeRunner({SHOW_ALL: (0, "No jobs in the system\n", "")})

    assert SlurmClient(runner=runner).jobs() == []


def test_jobs_parses_one_record_per_line() -> None:
    out = "JobId=1 JobState=RUNNING Partition=basic\nJobId=2 JobState=PENDING Partition=premium\n"
    runner = FakeRunner({SHOW_ALL: (0, out, "")})

    jobs = SlurmClient(runner=runner).jobs()

    assert jobs == [
        {"JobId": "1", "JobState": "RUNNING", "Partition": "basic"},
        {"JobId": "2", "JobState": "PENDING", "Partition": "premium"},
    ]


def test_job_returns_the_one_record() -> None:
    runner = FakeRunner({SHOW_42: (0, JOB_LINE + "\n", "")})

    job = SlurmClient(runner=runner).job(42)

    assert job is not None and job["JobId"] == "42"


def test_jobs_raises_when_slurm_fails_otherwise() -> None:
    stderr = "slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n"
    runner = FakeRunner({SHOW_42: (1, "", stderr)})

    with pytest.raises(SlurmCommandFailed) as info:
        SlurmClient(runner=runner).jobs(42)

    assert info.value.argv == list(SHOW_42)
    assert info.value.returncode == 1
    assert info.value.stderr == stderr.strip()
    assert str(info.value) == (
        f"`scontrol show job -o 42` failed with exit status 1: {stderr.strip()}"
    )


def test_requeue_is_true_when_slurm_requeued() -> None:
    runner = FakeRunner({("scontrol", "requeue", "42"): (0, "", "")})

    assert SlurmClient(runner=runner).requeue(42) is True


def test_requeue_is_false_when_slurm_had_already_requeued() -> None:
    stderr = "scontrol: error: Requeue of JobId=42 failed: Job is pending execution\n"
    runner = FakeRunner({("scontrol", "requeue", "42"): (1, "", stderr)})

    assert SlurmClient(runner=runner).requeue(42) is False


def test_requeue_raises_on_other_failures() -> None:
    stderr = "scontrol: error: Access/permission denied\n"
    runner = FakeRunner({("scontrol", "requeue", "42"): (1, "", stderr)})

    with pytest.raises(SlurmCommandFailed) as info:
        SlurmClient(runner=runner).requeue(42)

    assert info.value.argv == ["scontrol", "requeue", "42"]


def test_run_passes_capture_text_timeout_and_input() -> None:
    runner = FakeRunner({("scontrol", "--version"): (0, "slurm 22.05.8\n", "")})

    SlurmClient(timeout=12.5, runner=runner).run(["scontrol", "--version"], input="x")

    # errors="replace": a job's name or paths may hold bytes that are not UTF-8
    assert runner.calls == [{"argv": ["scontrol", "--version"], "capture_output": True,
                             "text": True, "timeout": 12.5, "input": "x", "errors": "replace"}]


def test_run_as_another_user_goes_through_runuser() -> None:
    argv = ("runuser", "-u", "jobuser", "--", "sbatch", "--parsable", "job.sh")
    runner = FakeRunner({argv: (0, "42\n", "")})

    assert SlurmClient(runner=runner).submit("job.sh", user="jobuser") == 42
    assert runner.calls[0]["argv"] == list(argv)


def test_submit_in_a_working_directory_uses_env_chdir() -> None:
    argv = ("env", "-C", "/home/jobuser", "sbatch", "--parsable", "-N2", "job.sh")
    runner = FakeRunner({argv: (0, "43;singularity-dev\n", "")})

    assert SlurmClient(runner=runner).submit("job.sh", ["-N2"], cwd="/home/jobuser") == 43


def test_submit_that_sbatch_refuses_raises_with_its_message() -> None:
    stderr = "sbatch: error: singularity: unknown SLA tier 'gold'\n"
    runner = FakeRunner({("sbatch", "--parsable", "job.sh"): (1, "", stderr)})

    with pytest.raises(SlurmCommandFailed, match="unknown SLA tier 'gold'"):
        SlurmClient(runner=runner).submit("job.sh")


def test_failed_command_without_stderr_reports_its_stdout() -> None:
    runner = FakeRunner({("scontrol", "--version"): (2, "usage: ...\n", "")})

    with pytest.raises(SlurmCommandFailed) as info:
        SlurmClient(runner=runner).version()

    assert info.value.stderr == "usage: ..."


def test_unchecked_run_returns_the_failed_process() -> None:
    runner = FakeRunner({("scontrol", "ping"): (1, "", "DOWN")})

    proc = SlurmClient(runner=runner).run(["scontrol", "ping"], check=False)

    assert (proc.returncode, proc.stderr) == (1, "DOWN")


def test_missing_slurm_tools_say_what_to_install() -> None:
    runner = FakeRunner(raises=FileNotFoundError(2, "No such file or directory"))

    with pytest.raises(SlurmError) as info:
        SlurmClient(runner=runner).version()

    assert str(info.value) == (
        "scontrol not found: install Slurm's client tools (Debian: slurm-client)"
    )
    assert isinstance(info.value.__cause__, FileNotFoundError)


def test_timeout_asks_whether_slurmctld_is_up() -> None:
    runner = FakeRunner(raises=subprocess.TimeoutExpired(["scontrol"], 30))

    with pytest.raises(SlurmError) as info:
        SlurmClient(runner=runner).jobs()

    assert str(info.value) == (
        "`scontrol show job -o` did not answer within 30s: is slurmctld up?"
    )


def test_version_config_partitions_and_nodes_are_parsed() -> None:
    runner = FakeRunner({
        ("scontrol", "--version"): (0, "slurm 24.11.5\n", ""),
        ("scontrol", "show", "config"): (0, "PreemptParameters = send_user_signal\n", ""),
        ("scontrol", "show", "partition", "-o"): (
            0, "PartitionName=premium PriorityTier=30\nPartitionName=basic PriorityTier=10\n", ""),
        ("scontrol", "show", "node", "-o"): (
            0, "NodeName=n1 State=IDLE\nNodeName=n2 State=ALLOCATED\n", ""),
    })
    client = SlurmClient(runner=runner)

    assert client.version() == SlurmVersion(24, 11, 5)
    assert client.config() == {"PreemptParameters": "send_user_signal"}
    assert client.partitions() == {
        "premium": {"PartitionName": "premium", "PriorityTier": "30"},
        "basic": {"PartitionName": "basic", "PriorityTier": "10"},
    }
    assert sorted(client.nodes()) == ["n1", "n2"]


def test_release_start_runs_scontrol_update() -> None:
    runner = FakeRunner({("scontrol", "update", "JobId=42", "StartTime=now"): (0, "", "")})

    SlurmClient(runner=runner).release_start(42)

    assert [c["argv"] for c in runner.calls] == [release_start_argv(42)]


def test_as_root_slurm_tools_run_by_absolute_path_with_a_clean_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/home/mallory/bin:/usr/bin")
    monkeypatch.setenv("LD_PRELOAD", "/home/mallory/evil.so")
    show = ("/usr/bin/scontrol", "show", "job", "-o", "42")
    runner = FakeRunner({show: (0, "JobId=42 JobState=RUNNING\n", "")})

    assert SlurmClient(runner=runner, as_root=True).job(42) == {"JobId": "42", "JobState": "RUNNING"}
    assert runner.calls[0]["env"] == {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}


def test_as_a_user_slurm_tools_run_as_the_users_own_commands() -> None:
    runner = FakeRunner({SHOW_42: (0, "JobId=42\n", "")})

    assert SlurmClient(runner=runner, as_root=False).job(42) == {"JobId": "42"}
    assert "env" not in runner.calls[0]


def test_draining_nodes_are_those_with_the_drain_flag_with_the_first_ones_reason() -> None:
    records = {r["NodeName"]: r for r in parse_records(
        "NodeName=n1 State=MIXED+DRAIN Reason=disk swap [root@2026-12-02T08:00:00]\n"
        "NodeName=n2 State=ALLOCATED\n"
        "NodeName=n3 State=IDLE+DRAIN Reason=spare [root@2026-12-01T07:00:00]\n"
        "NodeName=n4 State=DRAINING\n")}
    assert draining(records, ["n1", "n2"]) == (("n1",), "disk swap [root@2026-12-02T08:00:00]")
    assert draining(records, ["n2"]) == ((), "")
    assert draining(records, ["n3", "n1"]) == (("n3", "n1"), "spare [root@2026-12-01T07:00:00]")
    assert draining(records, ["n4"]) == (("n4",), "")  # as sinfo would write it
    # a node Slurm did not show (removed, or a stale name) is not draining
    assert draining(records, ["n9"]) == ((), "")


def test_a_jobs_record_takes_what_root_acts_on_from_squeue_not_from_the_users_comment() -> None:
    from singularity_slurm.slurmcli import job_table_argv

    forged = " BatchHost=n2 Restarts=9 JobState=PENDING Partition=premium SubmitTime=2020-01-01T00:00:00"
    line = (f"JobId=42 JobName=train UserId=jobuser(1001) JobState=RUNNING Reason=None Restarts=1 "
            f"Partition=basic SubmitTime=2026-12-07T01:00:00 NodeList=n1 BatchHost=n1 NumNodes=1 "
            f"TRES=cpu=1,node=1 Comment=mine{forged} Command=/home/jobuser/train.sh\n")
    facts = ("squeue", "-h", "-t", "all", "-j", "42", "-O",
             "JobID:20,NumNodes:10,RestartCnt:10,EligibleTime:25,SubmitTime:25,ArrayJobID:20,ArrayTaskID:20,"
             "Reason:200")
    runner = FakeRunner({
        SHOW_42: (0, line, ""),
        tuple(job_table_argv("all", 42)): (0, "42|RUNNING|basic|n1|n1|1\n", ""),
        facts: (0, f"{'42':<20}{'1':<10}{'1':<10}{'2026-12-07T01:00:00':<25}{'2026-12-07T01:00:00':<25}"
                   f"{'42':<20}{'N/A':<20}ReqNodeNotAvail, UnavailableNodes:n3\n", ""),
    })
    client = SlurmClient(runner=runner)
    assert client.job(42)["BatchHost"] == "n2"  # what scontrol's line reads as, the comment's last word
    record = client.job_record(42)
    fields = ("JobState", "Restarts", "BatchHost", "Partition", "SubmitTime", "Reason")
    assert {k: record[k] for k in fields} == {
        "JobState": "RUNNING", "Restarts": "1", "BatchHost": "n1", "Partition": "basic",
        "SubmitTime": "2026-12-07T01:00:00", "Reason": "ReqNodeNotAvail, UnavailableNodes:n3"}
    assert record["UserId"] == "jobuser(1001)"  # the rest is scontrol's
    # squeue not listing what scontrol showed: nothing is guessed
    runner.answers[tuple(job_table_argv("all", 42))] = (0, "", "")
    with pytest.raises(SlurmError, match="squeue does not list job 42"):
        client.job_record(42)


def test_a_steps_nodes_come_from_squeues_step_list_and_only_that_steps_line() -> None:
    argv = ("squeue", "-h", "-s", "-j", "42", "-o", "%i|%N")
    runner = FakeRunner({argv: (0, "42.1|n1\n42.0|n[1-2]\n42.batch|n1\n", "")})
    client = SlurmClient(runner=runner)
    assert client.step_nodes(42, 0) == "n[1-2]"
    assert client.step_nodes(42, 7) is None
    runner.answers[argv] = (0, "42.0|n1 Name=x\n", "")  # not a hostlist Slurm prints
    assert client.step_nodes(42, 0) is None
    # a task of an array: squeue names its steps ARRAYJOB_TASK.STEP
    runner.answers[argv] = (0, "40_2.0|n2\n", "")
    assert client.step_nodes(42, 0) is None
    assert client.step_nodes(42, 0, ("40", "2")) == "n2"
    runner.answers[argv] = (0, "40_2.0|n2\n40_2.0|n1\n", "")  # listed twice: which is it?
    assert client.step_nodes(42, 0, ("40", "2")) is None
