"""The SLA controller's decisions: snapshot in, actions out (sla.policy)."""

from __future__ import annotations

from singularity_slurm.sla.policy import (
    Grow,
    JobView,
    Migrate,
    NodeView,
    Params,
    Protect,
    Shrink,
    Snapshot,
    Unprotect,
    decide,
    defragment,
    fewest_to_start,
    shrink_limit,
)

PARAMS = Params(preemption_cost_s=120.0, unprotect_factor=3.0)


def job(job_id: str, tier: str, requested: int, held: int, min_devices: int | None = None,
        slack: float = 3000.0, window_left: float = 3000.0, protected: bool = False,
        submitted: float = 0.0) -> JobView:
    return JobView(job_id, tier, requested, requested if min_devices is None else min_devices, held, slack,
                   window_left, protected, submitted)


def test_a_job_that_could_not_survive_another_preemption_is_protected_and_released_with_room_again() -> None:
    snapshot = Snapshot(0, (job("s", "standard", 4, 4, slack=100), job("p", "premium", 4, 4, slack=50),
                            job("b", "basic", 4, 4, slack=-999), job("r", "standard", 4, 4, slack=400,
                                                                      protected=True),
                            job("h", "standard", 4, 4, slack=300, protected=True)))
    actions = decide(snapshot, PARAMS)
    # tier, then submission order; basic has no floor
    assert actions == [Protect("p", ""), Unprotect("r", ""), Protect("s", "")]
    assert "a preemption costs 120s" in actions[0].reason


def test_a_job_slurm_is_preempting_is_neither_protected_nor_shrunk_grown_or_moved() -> None:
    from dataclasses import replace

    # short of its floor, but already on its way out: a protection would only hold the nodes its
    # preemptor waits for
    short = job("s", "standard", 4, 4, slack=10)
    assert decide(Snapshot(0, (short,)), PARAMS) == [Protect("s", "")]
    assert decide(Snapshot(0, (replace(short, leaving=True),)), PARAMS) == []
    # an elastic basic job that would give room to a waiting one, or grow on idle devices
    elastic = job("b", "basic", 4, 4, min_devices=1)
    waiting = job("w", "premium", 2, 0)
    assert decide(Snapshot(0, (elastic, waiting)), PARAMS) == [Shrink("b", 2, "")]
    assert decide(Snapshot(0, (replace(elastic, leaving=True), waiting)), PARAMS) == []
    shrunk = job("b", "basic", 4, 2, min_devices=1)
    assert decide(Snapshot(2, (shrunk,)), PARAMS) == [Grow("b", 4, "")]
    assert decide(Snapshot(2, (replace(shrunk, leaving=True),)), PARAMS) == []


def test_lower_tier_elastic_jobs_shrink_to_make_room_for_a_waiting_job_within_their_floors() -> None:
    snapshot = Snapshot(1, (
        job("want", "premium", 6, 0),
        job("b1", "basic", 8, 8, min_devices=2),  # may give 6
        job("s1", "standard", 10, 10, min_devices=2),  # its tier's floor keeps 7 of 10
        job("b2", "basic", 4, 4, min_devices=1, protected=True),  # protected: never shrunk
    ))
    actions = decide(snapshot, PARAMS)
    assert actions == [Shrink("b1", 3, "")]  # 1 idle + 5 from the basic job
    assert "premium job want" in actions[0].reason


def test_nothing_is_shrunk_where_shrinking_cannot_make_room() -> None:
    snapshot = Snapshot(0, (job("want", "standard", 8, 0), job("b1", "basic", 8, 8, min_devices=4),
                            job("p1", "premium", 8, 8, min_devices=1)))
    assert decide(snapshot, PARAMS) == []  # the basic job gives 4 of 8; a premium job is no victim


def test_a_standard_job_is_not_shrunk_below_its_floor_or_past_what_its_window_can_afford() -> None:
    roomy = job("s", "standard", 10, 10, min_devices=1, slack=2000, window_left=3000)
    assert shrink_limit(roomy, PARAMS) == 7
    # it owes 3000 - 500 = 2500 s of the 2520 the floor asks, over 2880 usable seconds: 9 devices
    tight = job("s", "standard", 10, 10, min_devices=1, slack=500, window_left=3000)
    assert shrink_limit(tight, PARAMS) == 9
    assert shrink_limit(job("s", "standard", 10, 10, min_devices=1, slack=100), PARAMS) == 10
    assert shrink_limit(job("b", "basic", 10, 10, min_devices=1, slack=-5), PARAMS) == 1
    assert shrink_limit(job("b", "basic", 10, 10, min_devices=1, protected=True), PARAMS) == 10


def test_elastic_jobs_start_on_no_fewer_devices_than_their_tiers_floor_asks() -> None:
    assert fewest_to_start("basic", 8, 2) == 2
    assert fewest_to_start("standard", 8, 2) == 6
    assert fewest_to_start("premium", 8, 2) == 8
    assert fewest_to_start("standard", 8, 8) == 8


def test_idle_devices_no_waiting_job_can_use_grow_shrunk_jobs_higher_tiers_first() -> None:
    snapshot = Snapshot(3, (job("b", "basic", 8, 4, min_devices=2, submitted=1),
                            job("s", "standard", 8, 6, min_devices=2, submitted=5),
                            job("w", "basic", 4, 0)))  # waits for 4: cannot use 3, nor shrink its tier
    assert decide(snapshot, PARAMS) == [Grow("s", 8, ""), Grow("b", 5, "")]
    waiting_fits = Snapshot(3, (job("b", "basic", 8, 4, min_devices=2), job("w", "basic", 2, 0)))
    assert decide(waiting_fits, PARAMS) == [Grow("b", 5, "")]  # Slurm starts the waiting job on 2 of 3


def placed(job_id: str, tier: str, held: int, node: str, slack: float = 3000.0,
           protected: bool = False) -> JobView:
    return JobView(job_id, tier, held, held, held, slack, 3000.0, protected, 0.0, where=((node, held),))


def test_small_jobs_move_off_the_node_a_pending_multi_node_job_lacks_the_fewest_devices_moved() -> None:
    # 8 idle devices in all, but no node of the three has 4: a 2 x 4 job cannot start
    nodes = (NodeView("n1", 2), NodeView("n2", 3), NodeView("n3", 3))
    jobs = (placed("a", "basic", 2, "n1"), placed("b", "basic", 1, "n2"), placed("c", "basic", 1, "n3"),
            JobView("want", "basic", 8, 8, 0, 3000.0, shape=(2, 4)))
    actions = decide(Snapshot(8, jobs, nodes), PARAMS)
    # freeing n2 and n3 moves one device each; their jobs fit in n1's idle two
    assert actions == [Migrate("b", "n2", ""), Migrate("c", "n3", "")]
    assert "for basic job want (2 node(s) x 4 devices)" in actions[0].reason


def test_no_move_where_the_moved_jobs_would_not_fit_elsewhere_or_may_not_move() -> None:
    nodes = (NodeView("n1", 2), NodeView("n2", 2))
    jobs = (placed("a", "basic", 2, "n1"), placed("b", "basic", 2, "n2"),
            JobView("want", "basic", 4, 4, 0, 3000.0, shape=(1, 4)))
    # moving a off n1 frees 4 there, and a fits on n2's idle two
    assert decide(Snapshot(4, jobs, nodes), PARAMS) == [Migrate("a", "n1", "")]
    nowhere = (NodeView("n1", 1), NodeView("n2", 1))
    wide = (placed("a", "basic", 3, "n1"), placed("b", "basic", 3, "n2"),
            JobView("want", "basic", 2, 2, 0, 3000.0, shape=(1, 2)))
    assert decide(Snapshot(2, wide, nowhere), PARAMS) == []  # a 3-device job fits on no 1 idle
    higher = (placed("a", "premium", 2, "n1"), placed("b", "standard", 2, "n2", slack=50),
              JobView("want", "standard", 4, 4, 0, 3000.0, shape=(1, 4)))
    # a premium job does not move for a standard one; a standard job that cannot afford a move stays
    assert decide(Snapshot(4, higher, nodes), PARAMS) == [Protect("b", "")]
    guarded = (placed("a", "basic", 2, "n1", protected=True), placed("b", "basic", 2, "n2", protected=True),
               JobView("want", "basic", 4, 4, 0, 3000.0, shape=(1, 4)))
    assert decide(Snapshot(4, guarded, nodes), PARAMS) == []


def test_nothing_moves_without_the_per_node_view_or_where_the_job_fits_already() -> None:
    jobs = (placed("a", "basic", 2, "n1"), placed("b", "basic", 2, "n2"),
            JobView("want", "basic", 4, 4, 0, 3000.0, shape=(1, 4)))
    assert decide(Snapshot(4, jobs), PARAMS) == []  # devices as one pool: nothing to defragment
    fits = (NodeView("n1", 4), NodeView("n2", 0))
    assert decide(Snapshot(4, jobs, fits), PARAMS) == []
    one_look = (*jobs, JobView("next", "basic", 4, 4, 0, 3000.0, submitted=1.0, shape=(1, 4)))
    many = (NodeView("n1", 2), NodeView("n2", 2), NodeView("n3", 2), NodeView("n4", 2))
    assert len(decide(Snapshot(8, one_look, many), PARAMS)) == 1  # one pending job's room per look


def test_defragment_updates_the_node_view_as_if_the_moves_and_the_start_were_done() -> None:
    node_free = {"n1": 2, "n2": 3, "n3": 3}
    movable = [placed("a", "basic", 2, "n1"), placed("b", "basic", 1, "n2"), placed("c", "basic", 1, "n3")]
    moves = defragment(node_free, movable, 2, 4)
    assert [(job.job_id, node) for job, node in moves] == [("b", "n2"), ("c", "n3")]
    assert node_free == {"n1": 0, "n2": 0, "n3": 0}
    unchanged = {"n1": 1, "n2": 1}
    assert defragment(unchanged, [placed("a", "basic", 3, "n1")], 1, 4) == []
    assert unchanged == {"n1": 1, "n2": 1}
