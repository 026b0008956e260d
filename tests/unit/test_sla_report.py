"""`singularityctl sla`: a job's accounting from its registry record (sla.report), and the Slurm
facts the Prolog records for it (slurmcli)."""

from __future__ import annotations

import pytest

from singularity_slurm.sla import report
from singularity_slurm.slurmcli import allocated_devices, parse_time


def record(**more) -> dict:
    events = [
        {"event": "node_start", "node": "n1", "time": 1000.0, "restart_count": 0, "gpus": 4},
        {"event": "running", "node": "n1", "time": 1002.0, "devices": 4, "how": "start"},
        {"event": "checkpoint", "node": "n1", "time": 1060.0, "reason": "preempt", "seconds": 4.0,
         "stop": True},
        {"event": "node_end", "node": "n1", "time": 1061.0},
        {"event": "node_start", "node": "n2", "time": 1100.0, "restart_count": 1, "gpus": 4},
        {"event": "running", "node": "n2", "time": 1104.0, "devices": 4, "how": "restore"},
        {"event": "node_end", "node": "n2", "time": 1200.0},
    ]
    return {"job_id": 7, "user": "jobuser", "tier": "standard", "requested_devices": 4,
            "eligible_at": 990.0, "first_started_at": 1000.0, "ended_at": 1200.0, "events": events, **more}


def test_an_ended_jobs_windows_come_from_its_eligibility_and_its_timeline() -> None:
    sla = report.job_sla(record(), window=120)
    assert [(w.start, w.end) for w in sla.windows] == [(990, 1110), (1110, 1200)]
    first, second = sla.windows
    assert first.fraction == pytest.approx((1056 - 1002 + 1110 - 1104) / 120)  # 0.5
    assert first.met is False and second.met is True and second.fraction == 1.0
    assert sla.violations == 1 and sla.attainment == pytest.approx(90 / 210)
    assert sla.fraction == pytest.approx((54 + 96) / 210)
    assert report.to_json(sla)["windows"][0]["met"] is False


def test_a_running_jobs_last_window_is_open_and_counts_until_now() -> None:
    rec = record(ended_at=None)
    rec["events"] = rec["events"][:-1]
    sla = report.job_sla(rec, now=1150.0, window=120)
    assert sla.windows[-1].met is None and sla.windows[-1].end == 1150.0
    assert not sla.ended


def test_without_slurms_request_the_first_starts_devices_and_time_are_taken() -> None:
    sla = report.job_sla(record(requested_devices=None, eligible_at=None), window=1000)
    assert sla.requested == 4 and sla.eligible_at == 1000.0


def test_a_job_without_a_tier_has_no_accounting() -> None:
    assert report.job_sla(record(tier=None)) is None


def test_the_table_and_the_windows_mark_violations_and_each_tiers_attainment() -> None:
    sla = report.job_sla(record(), window=120)
    table = report.format_table([sla, report.job_sla(record(job_id=8, tier="basic"), window=120)])
    assert "standard: 0.429 of closed job time met its floor 0.70" in table
    assert "basic: 1.000 of closed job time met best effort" in table
    lines = report.format_windows(sla).splitlines()
    assert "VIOLATED" in lines[2] and lines[3].endswith("yes")


@pytest.mark.parametrize("record_, devices", [
    ({"TRES": "cpu=2,mem=1G,node=2,billing=2,gres/gpu=4"}, 4),
    ({"TRES": "cpu=2,gres/gpu:a100=8"}, 8),
    ({"TresPerNode": "gres:gpu:2", "NumNodes": "3"}, 6),
    ({"TresPerJob": "gres:gpu:5"}, 5),
    ({"TRES": "cpu=1,node=1"}, 0),
])
def test_a_jobs_devices_are_read_from_its_slurm_record(record_: dict, devices: int) -> None:
    assert allocated_devices(record_) == devices


def test_slurm_times_are_read_in_local_time_and_unknown_ones_are_none() -> None:
    import datetime

    at = datetime.datetime(2026, 12, 3, 6, 0, 0).timestamp()
    assert parse_time("2026-12-03T06:00:00") == at
    assert parse_time("Unknown") is None and parse_time(None) is None


def test_the_job_table_takes_only_fields_no_user_writes_and_a_name_cannot_forge_another_job() -> None:
    from singularity_slurm.errors import SlurmError
    from singularity_slurm.slurmcli import job_table_argv, parse_gpus_per_node, parse_job_table, parse_record

    # scontrol's one-line record: a job name holding " JobId=7" names job 7 (the reason for the table)
    assert parse_record("JobId=12 JobName=x JobId=7 JobState=RUNNING")["JobId"] == "7"
    argv = job_table_argv("pending,running")
    assert argv[:4] == ["squeue", "-h", "-t", "pending,running"]
    assert "%j" not in argv[-1] and "%b" not in argv[-1]
    text = "12|RUNNING|basic|n1|n[1-2]|2\n13|PENDING|premium|n/a||1\n14|RUNNING|basic|login1|n3|1\n"
    table = parse_job_table(text)
    assert table == [
        {"JobId": "12", "JobState": "RUNNING", "Partition": "basic", "BatchHost": "n1", "NodeList": "n[1-2]",
         "NumNodes": "2"},
        {"JobId": "13", "JobState": "PENDING", "Partition": "premium", "BatchHost": "", "NodeList": "",
         "NumNodes": "1"},
        # an salloc job: squeue's batch host is its submit host, none of its nodes
        {"JobId": "14", "JobState": "RUNNING", "Partition": "basic", "BatchHost": "", "NodeList": "n3",
         "NumNodes": "1"},
    ]
    for broken in ("15_2|RUNNING|basic\n", "12|RUNNING|basic|n1|n1|1\n"):  # not Slurm's shape; twice
        with pytest.raises(SlurmError):
            parse_job_table(text + broken)
    # GPUs per node hold a GRES type the user wrote: read apart, only for the table's jobs, exactly once
    per_node = "12|gres:gpu:4\n13|N/A\n14|gres:gpu:x|y\n14|gres:gpu:1\n99|gres:gpu:64\n12b|x\n"
    assert parse_gpus_per_node(per_node, ["12", "13", "14"]) == {"12": "gres:gpu:4", "13": ""}
    assert allocated_devices({**table[0], "TresPerNode": "gres:gpu:4"}) == 8


def _context(gpus: list[str]):
    from singularity_slurm.jobenv import JobContext

    return JobContext(job_id=5, user="jobuser", uid=1001, node="n1", partition="basic", tier="basic",
                      gpus=gpus, restart_count=0)


def _slurm(out: str):
    import subprocess

    from singularity_slurm.slurmcli import SlurmClient

    def runner(argv, **_):
        assert argv[0] == "squeue" and "-O" in argv  # fixed columns, never scontrol's record
        return subprocess.CompletedProcess(argv, 0, out, "")
    return SlurmClient(runner=runner, as_root=False)


def test_the_prolog_takes_the_request_from_its_own_nodes_gpus_and_the_eligible_time_from_squeue() -> None:
    from singularity_slurm.prolog.main import SLA_LOOKBACK_S, sla_facts

    now = parse_time("2026-12-03T07:00:00")
    line = ("5                   2         0         2026-12-03T06:00:00      2026-12-03T05:59:00      "
            "5                   N/A                 None\n")
    assert sla_facts(_context(["0", "1"]), _slurm(line), now) == (4, parse_time("2026-12-03T06:00:00"))
    assert sla_facts(_context([]), _slurm(line), now)[0] == 2  # no GPUs: one per node
    early = line.replace("2026-12-03T06:00:00", "1970-01-02T00:00:00")
    assert sla_facts(_context(["0"]), _slurm(early), now)[1] == parse_time("2026-12-03T05:59:00")
    old = line.replace("2026-12-03T06:00:00", "2026-10-01T00:00:00").replace("2026-12-03T05:59:00",
                                                                             "2026-10-01T00:00:00")
    assert sla_facts(_context(["0"]), _slurm(old), now)[1] == now - SLA_LOOKBACK_S
    assert sla_facts(_context(["0"]), _slurm("garbage\n"), now) == (None, None)
    assert sla_facts(_context(["0"]), _slurm("5 \u00b2 0 x y 5 N/A None\n"), now) == (1, None)  # no int("²")


def test_a_job_older_than_the_window_bound_keeps_its_latest_windows_on_the_same_grid() -> None:
    rec = record(eligible_at=1000.0 - 10 * (report.MAX_WINDOWS + 5), ended_at=1200.0)
    sla = report.job_sla(rec, window=10)
    assert len(sla.windows) == report.MAX_WINDOWS
    assert sla.windows[-1].end == 1200.0 and (sla.windows[0].start - rec["eligible_at"]) % 10 == 0
