"""GPU-fraction accounting, window by window (sla.accounting)."""

from __future__ import annotations

import pytest

from singularity_slurm.sla.accounting import (
    AccountingError,
    Segment,
    Window,
    attainment,
    check,
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
