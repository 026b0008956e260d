"""The protected jobs' node reservations: which to make, extend, move or delete (pure)."""

from __future__ import annotations

import pytest

from singularity_slurm.sla import fleet, reserve
from singularity_slurm.sla.reserve import Create, Delete, Extend, Held

OURS = ("ReservationName=singularity_protect_42 StartTime=2026-12-03T23:02:59 EndTime=2026-12-03T23:07:59 "
        "Duration=00:05:00 Nodes=n[1-2] NodeCnt=2 CoreCnt=8 Features=(null) PartitionName=(null) "
        "Flags=OVERLAP,IGNORE_JOBS,SPEC_NODES TRES=cpu=8 Users=root Groups=(null) Accounts=(null) "
        "Licenses=(null) State=ACTIVE BurstBuffer=(null) Watts=n/a MaxStartDelay=(null)")


def test_our_reservations_are_read_from_scontrols_one_line_records_and_no_others():
    maintenance = OURS.replace("singularity_protect_42", "maint").replace("n[1-2]", "n3")
    a_users = OURS.replace("_42", "_43").replace("Users=root", "Users=alice")
    lookalike = OURS.replace("_42", "_42x")
    held = reserve.parse("\n".join([OURS, maintenance, a_users, lookalike, ""]))
    assert held == {"singularity_protect_42": Held("singularity_protect_42", "n[1-2]", "2026-12-03T23:07:59")}
    assert reserve.parse("No reservations in the system\n") == {}
    assert reserve.closed_nodes(held) == {"n1", "n2"}


def test_names_carry_the_job_id_and_nothing_else_is_ours():
    assert reserve.name_of(42) == "singularity_protect_42"
    assert reserve.job_of("singularity_protect_42") == 42
    for other in ("singularity_protect_", "singularity_protect_042", "singularity_protect_4 2", "maint",
                  "singularity_protect_-1", "xsingularity_protect_4"):
        assert reserve.job_of(other) is None, other


def test_only_protected_jobs_slurm_shows_running_on_well_formed_nodes_are_wanted():
    jobs = {1: {"JobState": "RUNNING", "NodeList": "n1"}, 2: {"JobState": "PENDING", "NodeList": ""},
            3: {"JobState": "RUNNING", "NodeList": "n[1-2]"},
            4: {"JobState": "RUNNING", "NodeList": "n1 x=y"},
            5: {"JobState": "RUNNING", "NodeList": "n2"}}
    assert reserve.wanted_for([1, 2, 3, 4, 6], jobs) == {"singularity_protect_1": "n1",
                                                         "singularity_protect_3": "n[1-2]"}


def test_a_plan_deletes_the_unwanted_first_then_makes_moves_and_extends():
    existing = {"singularity_protect_1": Held("singularity_protect_1", "n1", "x"),
                "singularity_protect_2": Held("singularity_protect_2", "n[1-2]", "x"),
                "singularity_protect_9": Held("singularity_protect_9", "n2", "x")}
    wanted = {"singularity_protect_1": "n1", "singularity_protect_2": "n[2-3]", "singularity_protect_5": "n4"}
    assert reserve.plan(wanted, existing) == [
        Delete("singularity_protect_9"), Extend("singularity_protect_1"), Delete("singularity_protect_2"),
        Create("singularity_protect_2", "n[2-3]"), Create("singularity_protect_5", "n4")]
    # the same nodes written another way are the same nodes
    assert reserve.plan({"singularity_protect_2": "n1,n2"}, existing)[-1] == Extend("singularity_protect_2")
    assert reserve.plan({}, {}) == []


def test_every_reservation_ends_a_hold_ahead_so_a_stopped_controller_closes_no_node_for_good():
    assert reserve.argv(Create("singularity_protect_1", "n[1-2]"), 180) == [
        "scontrol", "create", "reservation", "ReservationName=singularity_protect_1", "StartTime=now",
        "EndTime=now+180", "Nodes=n[1-2]", "Users=root", "Flags=IGNORE_JOBS,OVERLAP"]
    assert reserve.argv(Extend("singularity_protect_1"), 180) == [
        "scontrol", "update", "ReservationName=singularity_protect_1", "EndTime=now+180"]
    assert reserve.argv(Delete("singularity_protect_1"), 180) == [
        "scontrol", "delete", "ReservationName=singularity_protect_1"]
    with pytest.raises(ValueError, match="not a node list"):
        reserve.argv(Create("singularity_protect_1", "n1 Users=alice"), 180)


def test_reserved_nodes_have_no_idle_devices_for_the_controller():
    sinfo = "n1 gpu:4 gpu:2(IDX:0-1) mixed\nn2 gpu:4 gpu:0 idle\n"
    assert fleet.idle_devices(sinfo) == 6
    assert fleet.idle_devices(sinfo, {"n2"}) == 2
