"""The SLA controller's view of the cluster, from Slurm and the registry (sla.fleet)."""

from __future__ import annotations

import pytest

from singularity_slurm.sla import fleet

SINFO = """n1        gpu:4               gpu:2(IDX:0-1)                mixed
n1        gpu:4               gpu:2(IDX:0-1)                mixed
n2        gpu:4               gpu:0                         idle
n3        gpu:4               gpu:0                         drained
n4        gpu:a100:8          gpu:a100:8(IDX:0-7)           allocated
n5        gpu:4               gpu:0                         idle*
"""


def test_idle_devices_are_the_free_ones_of_usable_nodes_each_counted_once() -> None:
    assert fleet.idle_devices(SINFO) == 2 + 4  # n3 drained, n5 not responding


@pytest.mark.parametrize("devices, per_node, size", [(8, 4, (2, 4)), (4, 4, (1, 4)), (6, 4, (2, 3)),
                                                     (1, 8, (1, 1)), (5, 2, (3, 1))])
def test_a_device_count_becomes_nodes_and_devices_per_node(devices, per_node, size) -> None:
    assert fleet.size_for(devices, per_node) == size


def test_a_size_of_nothing_is_refused() -> None:
    with pytest.raises(ValueError):
        fleet.size_for(0, 4)


def tiers(partition: str) -> str | None:
    return {"premium": "premium", "standard": "standard", "basic": "basic"}.get(partition)


def test_the_snapshot_joins_slurms_jobs_with_their_accounting_and_elasticity() -> None:
    slurm_jobs = [
        {"JobId": "7", "JobState": "RUNNING", "Partition": "standard", "TresPerNode": "gres:gpu:4",
         "NumNodes": "1"},
        {"JobId": "8", "JobState": "PENDING", "Partition": "premium", "TresPerNode": "gres:gpu:2",
         "NumNodes": "1"},
        {"JobId": "9", "JobState": "RUNNING", "Partition": "debug", "TresPerNode": "gres:gpu:1"},  # no tier
        {"JobId": "10", "JobState": "COMPLETED", "Partition": "basic", "TresPerNode": ""},
        {"JobId": "11", "JobState": "RUNNING", "Partition": "basic", "NumNodes": "1"},  # size unreadable
    ]
    record = {"job_id": 7, "tier": "standard", "requested_devices": 8, "eligible_at": 0.0,
              "first_started_at": 0.0, "ended_at": None,
              "events": [{"event": "running", "node": "n1", "time": 0.0, "devices": 4},
                         {"event": "size", "time": 0.0, "size": {"ranks": 8, "devices": 4, "nodes": 1}}]}
    snap = fleet.snapshot(slurm_jobs, {7: record}, idle=3, protected=[8], now=1800.0, window=3600.0,
                          max_ranks_per_device=4, tier_of_partition=tiers)
    assert snap.free == 3
    running, pending = snap.jobs
    assert (running.job_id, running.tier, running.requested, running.min_devices, running.held) == \
        ("7", "standard", 8, 2, 4)
    # half an hour at 4 of 8: 900 s had, 1800 s left, 2520 s owed
    assert running.slack == pytest.approx(900 + 1800 - 2520) and running.window_left == pytest.approx(1800)
    assert (pending.job_id, pending.held, pending.requested, pending.protected) == ("8", 0, 2, True)
    assert not running.leaving and not pending.leaving
    # the jobs Slurm is preempting, where they still run
    leaving = fleet.snapshot(slurm_jobs, {7: record}, idle=3, protected=[8], now=1800.0, window=3600.0,
                             max_ranks_per_device=4, tier_of_partition=tiers, leaving={7, 8})
    assert [(j.job_id, j.leaving) for j in leaving.jobs] == [("7", True), ("8", False)]


def test_idle_devices_node_by_node_leave_out_unusable_and_reserved_nodes() -> None:
    assert fleet.idle_by_node(SINFO) == {"n1": 2, "n2": 4, "n4": 0}
    assert fleet.idle_by_node(SINFO, closed={"n2"}) == {"n1": 2, "n4": 0}


def test_the_per_node_view_places_running_jobs_and_shapes_pending_ones() -> None:
    slurm_jobs = [
        {"JobId": "7", "JobState": "RUNNING", "Partition": "basic", "TresPerNode": "gres:gpu:2",
         "NumNodes": "2", "NodeList": "n[1-2]"},
        {"JobId": "8", "JobState": "PENDING", "Partition": "basic", "TresPerNode": "gres/gpu=4",
         "NumNodes": "2", "NodeList": ""},
        {"JobId": "9", "JobState": "PENDING", "Partition": "basic", "TresPerNode": "gres:gpu:1",
         "NumNodes": "", "NodeList": ""},  # a node count squeue did not give: shape unknown
    ]
    snap = fleet.snapshot(slurm_jobs, {}, idle=2, protected=[], now=0.0, window=3600.0,
                          max_ranks_per_device=4, tier_of_partition=tiers, idle_nodes={"n2": 2, "n1": 0})
    running, pending, unknown = snap.jobs
    assert running.where == (("n1", 2), ("n2", 2)) and running.shape is None
    assert pending.where == () and pending.shape == (2, 4)
    assert unknown.shape is None
    assert [(n.name, n.free) for n in snap.nodes] == [("n1", 0), ("n2", 2)]
    pooled = fleet.snapshot(slurm_jobs, {}, idle=2, protected=[], now=0.0, window=3600.0,
                            max_ranks_per_device=4, tier_of_partition=tiers)
    assert pooled.nodes == () and all(j.where == () and j.shape is None for j in pooled.jobs)
