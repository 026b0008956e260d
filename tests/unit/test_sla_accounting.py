"""GPU-fraction accounting, window by window (sla.accounting)."""

from __future__ import annotations

import pytest

from singularity_slurm.sla.accounting import (
    AccountingError,
    Segment,
    Window,
    attainment,
    check,
    clip,
    segments_from_events,
    slack,
    windows,
)

HOUR = 3600.0


def test_a_job_on_its_whole_request_for_an_hour_gets_the_full_fraction() -> None:
    assert windows([Segment(0, HOUR, 4)], 4, 0, HOUR, 0.95) == [Window(0, HOUR, 1.0, True)]


def test_pending_after_a_preemption_counts_nothing_and_time_slicing_counts_its_share() -> None:
    # ran 20 min on 4 of 4, pending 20 min, then 20 min with 4 ranks on 2 devices (2 per device)
    segments = [Segment(0, 1200, 4), Segment(2400, 3600, 2)]
    [window] = windows(segments, 4, 0, HOUR, 0.70)
    assert window.fraction == pytest.approx((1200 + 600) / 3600)
    assert window.met is False  # 0.5 < 0.70
    assert windows(segments, 4, 0, HOUR, 0.0)[0].met is True  # basic: best effort


def test_windows_follow_each_other_from_eligibility_and_the_last_ends_with_the_job() -> None:
    # eligible at 100, ran from 1900 to the end at 100 + 1.5 h
    segments = [Segment(1900, 100 + 1.5 * HOUR, 1)]
    first, last = windows(segments, 1, 100, 100 + 1.5 * HOUR, 0.70)
    assert (first.start, first.end, first.fraction, first.met) == (100, 100 + HOUR, 0.5, False)
    assert (last.start, last.end, last.fraction, last.met) == (100 + HOUR, 100 + 1.5 * HOUR, 1.0, True)


def test_a_running_jobs_last_window_stays_open() -> None:
    [window] = windows([Segment(0, 600, 1)], 1, 0, 600, 0.95, ended=False)
    assert window.met is None and window.fraction == 1.0


def test_a_short_test_window_is_configurable() -> None:
    assert [w.fraction for w in windows([Segment(0, 30, 2)], 2, 0, 60, 0.5, window=20)] == [1.0, 0.5, 0.0]


@pytest.mark.parametrize("segments, requested, problem", [
    ([Segment(10, 5, 1)], 1, "backwards"),
    ([Segment(0, 10, 1), Segment(5, 20, 1)], 1, "overlaps"),
    ([Segment(0, 10, 3)], 2, "asked for 2"),
    ([Segment(0, 10, -1)], 2, "holds -1"),
    ([Segment(0, float("inf"), 1)], 1, "not finite"),
    ([], 0, "positive number"),
])
def test_a_timeline_that_cannot_be_accounted_is_refused_saying_why(segments, requested, problem) -> None:
    with pytest.raises(AccountingError, match=problem):
        check(segments, requested)


def test_slack_is_what_the_window_can_still_lose_at_full_size() -> None:
    # half an hour in, with 20 min delivered: it can lose 3600 * 0.3 - 600 = 480 s more at 0.70
    assert slack([Segment(0, 1200, 1)], 1, 0, 1800, 0.70) == pytest.approx(1200 + 1800 - 2520)
    assert slack([Segment(0, 100, 1)], 1, 0, 3000, 0.95) < 0  # cannot be met any more


def test_attainment_weighs_each_window_by_how_long_it_lasted() -> None:
    wins = [Window(0, 3600, 1.0, True), Window(3600, 3960, 0.2, False), Window(3960, 4000, 0.5, None)]
    assert attainment(wins) == pytest.approx(3600 / 3960)
    assert attainment([Window(0, 10, 1.0, None)]) is None


# --- a job's timeline from its registry events ----------------------------------------------------


def ev(kind: str, at: float, node: str = "n1", **more) -> dict:
    return {"event": kind, "node": node, "time": at, **more}


def test_a_preempted_job_runs_until_its_checkpoint_began_and_again_once_restored() -> None:
    events = [ev("node_start", 0, gpus=4), ev("running", 2, devices=4),
              ev("checkpoint", 100, reason="preempt", seconds=6.0, stop=True), ev("node_end", 101),
              ev("node_start", 160, gpus=4), ev("restore", 165), ev("running", 165, devices=4),
              ev("node_end", 300)]
    assert segments_from_events(events, 4) == [Segment(2, 94, 4), Segment(165, 300, 4)]


def test_a_periodic_checkpoint_stops_the_job_for_its_dump_only() -> None:
    events = [ev("running", 0, devices=2), ev("checkpoint", 50, reason="periodic", seconds=10, stop=False,
                                            dump_seconds=3), ev("node_end", 100)]
    assert segments_from_events(events, 2) == [Segment(0, 40, 2), Segment(43, 100, 2)]


def test_the_nodes_of_a_job_add_up_and_time_sliced_ranks_count_their_devices_only() -> None:
    # 4 ranks: on 2 nodes x 2 devices, then resized to 1 node x 1 device (4 ranks on it)
    events = [ev("running", 0, "n1", devices=2), ev("running", 1, "n2", devices=2),
              ev("checkpoint", 60, "n1", reason="resize", seconds=5),
              ev("checkpoint", 60, "n2", reason="resize", seconds=5),
              ev("node_end", 61, "n1"), ev("node_end", 61, "n2"), ev("running", 90, "n1", devices=1),
              ev("node_end", 150, "n1")]
    assert segments_from_events(events, 4) == [Segment(0, 1, 2), Segment(1, 55, 4), Segment(90, 150, 1)]
    [window] = windows(segments_from_events(events, 4), 4, 0, 150, 0.70, window=150)
    assert window.fraction == pytest.approx((2 * 1 + 4 * 54 + 1 * 60) / 4 / 150)


def test_a_job_still_running_counts_until_now_and_junk_events_are_ignored() -> None:
    events = [ev("running", 10, devices=1), {"event": "running", "time": "soon"}, {"event": "x"},
              ev("running", 20, "n2", devices=-3)]
    segments = clip(segments_from_events(events, 2), 30)
    assert segments == [Segment(10, 20, 1), Segment(20, 30, 2)]


def test_a_job_that_never_ran_singularityctl_run_holds_its_allocation_from_start_to_end() -> None:
    events = [ev("node_start", 0, gpus=2), ev("node_end", 50), ev("node_start", 70, "n2", gpus=2),
              ev("node_end", 100, "n2")]
    assert segments_from_events(events, 2) == [Segment(0, 50, 2), Segment(70, 100, 2)]


def test_criu_s_own_frozen_time_places_the_stop_where_the_tree_was_frozen() -> None:
    # began at 40, dump ended 3 s later, the tree frozen its last 1 s; a preemption's dump: frozen for good
    periodic = ev("checkpoint", 50, reason="periodic", seconds=10, stop=False, dump_seconds=3,
                  frozen_seconds=1)
    assert segments_from_events([ev("running", 0, devices=1), periodic, ev("node_end", 100)], 1) == [
        Segment(0, 42, 1), Segment(43, 100, 1)]
    preempt = ev("checkpoint", 50, reason="preempt", seconds=10, stop=True, dump_seconds=3, frozen_seconds=1)
    assert segments_from_events([ev("running", 0, devices=1), preempt, ev("node_end", 51)], 1) == [
        Segment(0, 42, 1)]


def test_a_tree_frozen_while_it_waited_for_a_dump_slot_stopped_when_it_began_to_wait() -> None:
    # its checkpoint began at 40, after 12 s of waiting for a slot: frozen from 28 on
    preempt = ev("checkpoint", 50, reason="preempt", seconds=10, stop=True, dump_seconds=3, frozen_seconds=1,
                 waited_seconds=12, waited_frozen=True)
    assert segments_from_events([ev("running", 0, devices=1), preempt, ev("node_end", 51)], 1) == [
        Segment(0, 28, 1)]
    # one that ran on while it waited stopped when criu froze it
    ran_on = {k: v for k, v in preempt.items() if k != "waited_frozen"}
    assert segments_from_events([ev("running", 0, devices=1), ran_on, ev("node_end", 51)], 1) == [
        Segment(0, 42, 1)]


def test_a_distributed_job_stops_from_its_cut_until_its_images_are_committed() -> None:
    # its checkpoint began at 40, after 2.5 s of bringing the ranks to the cut, where they waited
    # until the image was committed at 50
    periodic = ev("checkpoint", 50, reason="periodic", seconds=10, stop=False, dump_seconds=3,
                  frozen_seconds=1, cut_seconds=2.5)
    assert segments_from_events([ev("running", 0, devices=2), periodic, ev("node_end", 100)], 2) == [
        Segment(0, 37.5, 2), Segment(50, 100, 2)]
    preempt = ev("checkpoint", 50, reason="preempt", seconds=10, stop=True, dump_seconds=3, frozen_seconds=1,
                 cut_seconds=2.5)
    assert segments_from_events([ev("running", 0, devices=2), preempt, ev("node_end", 51)], 2) == [
        Segment(0, 37.5, 2)]
    # its ranks reached the cut, then waited 4 s there for a dump slot of the node
    waited = ev("checkpoint", 50, reason="preempt", seconds=10, stop=True, dump_seconds=3, frozen_seconds=1,
                cut_seconds=2.5, waited_seconds=4)
    assert segments_from_events([ev("running", 0, devices=2), waited, ev("node_end", 51)], 2) == [
        Segment(0, 33.5, 2)]
