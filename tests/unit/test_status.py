"""`status`: one job joined from Slurm's record and the registry's, and the table it is shown in."""

from __future__ import annotations

from singularity_slurm.config import parse
from singularity_slurm.slurm_plugin.status import format_details, format_table, merge_job
from singularity_slurm.slurmcli import parse_record

CONFIG = parse({})

RUNNING = parse_record(
    "JobId=42 JobName=train UserId=jobuser(1001) GroupId=jobuser(1001) JobState=RUNNING "
    "Reason=None Requeue=1 Restarts=2 Partition=standard NodeList=n[1-2] "
    "TresPerNode=gres:gpu:2"
)


def registry_record(**changes) -> dict:
    record = {
        "job_id": 42, "user": "jobuser", "uid": 1001, "tier": "premium", "partition": "premium",
        "state": "running", "restart_count": 1, "first_started_at": 100.0, "started_at": 200.0,
        "ended_at": None,
        "nodes": {
            "n2": {"gpus": ["0", "1"], "started_at": 200.0, "services": {"agent": 11}},
            "n1": {"gpus": ["2"], "started_at": 200.0, "services": {"agent": 10}},
        },
        "events": [{"event": "node_start", "node": "n1", "time": 200.0, "restart_count": 1}],
    }
    record.update(changes)
    return record


# --- Slurm's record only --------------------------------------------------------------------------


def test_slurm_record_alone_gives_the_whole_view_without_registry() -> None:
    job = merge_job(RUNNING, None, CONFIG)

    assert job == {
        "job_id": 42, "name": "train", "user": "jobuser", "uid": 1001, "partition": "standard",
        "state": "RUNNING", "reason": None, "restart_count": 2, "requeue": True,
        "gpus_per_node": 2, "gpus": 4, "nodes": ["n1", "n2"], "tier": "standard",
        "registry": None, "managed": True, "checkpoints": [], "restores": [], "failures": [], "sizes": [],
    }


def test_reason_other_than_none_is_kept_whole() -> None:
    pending = parse_record(
        "JobId=43 UserId=jobuser(1001) JobState=PENDING Reason=Nodes required for job are DOWN "
        "Partition=basic NodeList=(null) TresPerNode=gres:gpu:1"
    )

    job = merge_job(pending, None, CONFIG)

    assert job["reason"] == "Nodes required for job are DOWN"
    assert job["nodes"] == []
    assert (job["gpus_per_node"], job["gpus"]) == (1, 1)
    assert (job["restart_count"], job["requeue"]) == (0, False)


def test_pending_multi_node_job_counts_gpus_on_every_requested_node() -> None:
    # No NodeList before it runs: the node count comes from NumNodes (its minimum, for "2-4").
    pending = parse_record(
        "JobId=47 JobState=PENDING Partition=basic NodeList=(null) NumNodes=2-4 "
        "TresPerNode=gres/gpu:2"
    )

    job = merge_job(pending, None, CONFIG)

    assert (job["gpus_per_node"], job["gpus"], job["nodes"]) == (2, 4, [])


def test_job_without_gpus_counts_zero() -> None:
    job = merge_job(parse_record("JobId=44 Partition=basic NodeList=n1"), None, CONFIG)

    assert (job["gpus_per_node"], job["gpus"]) == (0, 0)


def test_job_in_an_unmanaged_partition_has_no_tier() -> None:
    job = merge_job(parse_record("JobId=45 Partition=debug NodeList=n1"), None, CONFIG)

    assert job["tier"] is None
    assert job["managed"] is False


def test_tier_follows_the_configured_partition_names() -> None:
    config = parse({"tiers": {"premium": {"partition": "gpu-hi"}}})

    job = merge_job(parse_record("JobId=46 Partition=gpu-hi"), None, config)

    assert job["tier"] == "premium"


# --- the registry's record only -------------------------------------------------------------------


def test_registry_record_alone_for_an_ended_job() -> None:
    job = merge_job(None, registry_record(state="ended", ended_at=300.0), CONFIG)

    assert job == {
        "job_id": 42, "user": "jobuser", "uid": 1001, "partition": "premium", "state": "ENDED",
        "restart_count": 1, "nodes": ["n1", "n2"], "tier": "premium", "managed": True,
        "checkpoints": [], "restores": [], "failures": [], "sizes": [],
        "registry": {
            "state": "ended", "restart_count": 1, "first_started_at": 100.0, "started_at": 200.0,
            "ended_at": 300.0, "node_gpus": {"n2": ["0", "1"], "n1": ["2"]}, "gpu_inventory": {},
            "events": [{"event": "node_start", "node": "n1", "time": 200.0, "restart_count": 1}],
        },
        # a job without `singularityctl run` holds its allocation from the start on n1 to its end
        "sla": {"floor": 0.95, "window_s": 3600, "fraction": 0.5, "windows": 1, "violations": 1,
                "current": 0.5},
    }


def test_running_registry_job_that_slurm_forgot_is_unknown() -> None:
    assert merge_job(None, registry_record(), CONFIG)["state"] == "UNKNOWN"


def test_sparse_registry_record_gets_defaults() -> None:
    job = merge_job(None, {"job_id": 7}, CONFIG)

    assert job == {
        "job_id": 7, "user": None, "uid": None, "partition": None, "state": "UNKNOWN",
        "restart_count": 0, "nodes": [], "tier": None, "managed": False,
        "checkpoints": [], "restores": [], "failures": [], "sizes": [],
        "registry": {"state": None, "restart_count": None, "first_started_at": None,
                     "started_at": None, "ended_at": None, "node_gpus": {}, "gpu_inventory": {},
                     "events": []},
    }


# --- both -----------------------------------------------------------------------------------------


def test_registry_tier_wins_over_the_partitions_tier() -> None:
    job = merge_job(RUNNING, registry_record(tier="premium"), CONFIG)

    assert job["partition"] == "standard"
    assert job["tier"] == "premium"


def test_slurm_fields_win_over_the_registry_for_everything_else() -> None:
    job = merge_job(RUNNING, registry_record(state="ended", restart_count=0), CONFIG)

    assert (job["state"], job["restart_count"], job["nodes"], job["user"]) == (
        "RUNNING", 2, ["n1", "n2"], "jobuser")
    assert job["registry"]["state"] == "ended"
    assert job["registry"]["node_gpus"] == {"n2": ["0", "1"], "n1": ["2"]}


def test_registry_without_a_tier_keeps_the_partitions_tier() -> None:
    job = merge_job(RUNNING, registry_record(tier=None), CONFIG)

    assert job["tier"] == "standard"
    assert job["managed"] is True


def test_registry_tier_makes_a_job_in_an_unknown_partition_managed() -> None:
    job = merge_job(parse_record("JobId=42 Partition=debug"), registry_record(), CONFIG)

    assert (job["tier"], job["managed"]) == ("premium", True)


# --- the table ------------------------------------------------------------------------------------


def test_empty_table_is_the_header_line() -> None:
    assert format_table([]) == "JOBID  USER  TIER  STATE  RESTARTS  GPUS  NODES  CKPTS  REASON"


def test_table_columns_are_aligned_and_missing_values_dashed() -> None:
    jobs = [
        merge_job(RUNNING, None, CONFIG),
        merge_job(parse_record("JobId=1234567 JobState=PENDING Reason=Priority Partition=debug"),
                  None, CONFIG),
        merge_job(None, registry_record(job_id=9, state="ended", user=None), CONFIG),
    ]

    assert format_table(jobs).splitlines() == [
        "JOBID    USER     TIER      STATE    RESTARTS  GPUS  NODES  CKPTS  REASON",
        "42       jobuser  standard  RUNNING  2         4     n1,n2  0",
        "1234567  -        -         PENDING  0         0     -      0      Priority",
        "9        -        premium   ENDED    1         0     n1,n2  0",
    ]


def test_checkpoints_and_restores_come_from_the_registry() -> None:
    checkpoint = {"seq": 3, "created_at": 250.0, "reason": "preempt", "node": "n1",
                  "logical_bytes": 600 << 20, "new_bytes": 30 << 20, "dedup_ratio": 20.0, "seconds": 4.2}
    restore = {"event": "restore", "seq": 3, "node": "n2", "seconds": 2.5, "refused": [], "time": 260.0}
    record = registry_record(checkpoints=[checkpoint])
    record["events"] = [*record["events"], restore]

    job = merge_job(RUNNING, record, CONFIG)

    assert job["checkpoints"] == [checkpoint]
    assert job["restores"] == [restore]
    assert format_table([job]).splitlines()[1].split()[7] == "1"
    details = format_details(job)
    assert "preempt" in details and "600.0 MiB" in details and "30.0 MiB" in details
    assert "checkpoint 3 on n2 in 2.5s" in details


def test_a_distributed_jobs_sizes_and_their_causes_are_listed() -> None:
    sizes = [
        {"event": "size", "how": "start", "node": "n1", "size": {"ranks": 4, "devices": 4, "nodes": 2},
         "cause": None, "was": None, "time": 300.0},
        {"event": "size", "how": "restore", "node": "n1", "size": {"ranks": 4, "devices": 2, "nodes": 1},
         "cause": "resize", "was": {"ranks": 4, "devices": 4, "nodes": 2}, "time": 400.0},
        {"event": "size", "how": "restore", "node": "n1", "size": {"ranks": "x"}, "time": 500.0},
    ]
    job = merge_job(RUNNING, registry_record(events=sizes), CONFIG)

    assert job["sizes"] == sizes
    text = format_details(job)
    assert "sizes (a distributed job's starts and restores):" in text
    assert "started: 4 ranks on 4 devices of 2 nodes\n" in text
    assert ("restored after resize: 4 ranks on 2 devices of 1 node (2 per device), was 4 ranks on 4 "
            "devices of 2 nodes\n") in text
    assert text.endswith("restored: size unknown")
