"""The bookkeeping of a device's turns: one holder, the others served in the order they asked."""

from __future__ import annotations

import pytest

from singularity_slurm.proxy.turns import Slicing, Turns, takes_turns


def test_the_first_rank_to_ask_holds_the_free_turn_and_the_others_wait_in_order() -> None:
    turns = Turns()

    assert [turns.request(r) for r in (2, 0, 1)] == [True, False, False]
    assert (turns.holder, list(turns.waiting)) == (2, [0, 1])


def test_a_released_turn_goes_to_whoever_waited_longest() -> None:
    turns = Turns()
    for rank in (2, 0, 1):
        turns.request(rank)

    assert turns.release(2) == 0
    assert turns.request(2) is False  # it asks again, behind rank 1
    assert [turns.release(0), turns.release(1), turns.release(2)] == [1, 2, None]
    assert (turns.holder, list(turns.waiting), turns.handovers) == (None, [], 3)


def test_asking_again_neither_queues_twice_nor_loses_a_held_turn() -> None:
    turns = Turns()
    turns.request(0)
    turns.request(1)

    assert turns.request(0) is True and turns.request(1) is False
    assert list(turns.waiting) == [1]


def test_only_the_holder_can_release_the_turn() -> None:
    turns = Turns()
    turns.request(0)
    turns.request(1)

    assert turns.release(1) is None
    assert (turns.holder, list(turns.waiting)) == (0, [1])


def test_a_rank_that_goes_away_holds_and_waits_for_nothing() -> None:
    turns = Turns()
    for rank in (0, 1, 2):
        turns.request(rank)

    assert turns.forget(1) is None  # it only waited
    assert list(turns.waiting) == [2]
    assert turns.forget(0) == 2  # it held the turn: the next one gets it
    assert turns.forget(2) is None
    assert (turns.holder, list(turns.waiting)) == (None, [])
    assert turns.request(5) is True


def test_a_lapsed_turn_goes_to_whoever_waited_longest_from_then_on() -> None:
    turns = Turns()
    assert turns.lapse_at(10) is None  # nobody holds it
    for rank, now in ((0, 100.0), (1, 101.0), (2, 102.0)):
        turns.request(rank, now=now)

    assert turns.lapse_at(10) == 110.0
    assert turns.lapse(110.0) == 1
    assert (turns.holder, list(turns.waiting), turns.lapses) == (1, [2], 1)
    assert turns.lapse_at(10) == 120.0  # the new holder's own time: rank 2 waits on
    assert turns.release(0, now=111.0) is None  # the old holder, beside it, holds nothing
    assert turns.release(1, now=112.0) == 2


def test_a_cancelled_waiter_waits_no_more_and_a_lapse_needs_a_waiter() -> None:
    turns = Turns()
    turns.request(0)
    turns.request(1)
    turns.cancel(1)
    turns.cancel(1)

    assert (turns.holder, list(turns.waiting)) == (0, [])
    assert turns.lapse(50.0) is None and turns.lapses == 0


@pytest.mark.parametrize(("mode", "exclusive", "ranks", "expected"), [
    (Slicing.AUTO, True, 2, True),  # a GPU shared by two ranks
    (Slicing.AUTO, False, 4, False),  # CPU slots: the OS shares the cores
    (Slicing.TURNS, False, 2, True),
    (Slicing.CONCURRENT, True, 4, False),
    (Slicing.TURNS, True, 1, False),  # one rank on its device has nothing to take turns with
    (Slicing.AUTO, True, 0, False),
])
def test_which_devices_take_turns(mode: Slicing, exclusive: bool, ranks: int, expected: bool) -> None:
    assert takes_turns(mode, exclusive, ranks) is expected


def test_a_turn_does_not_lapse_while_its_holders_memory_is_brought_back_and_runs_from_then() -> None:
    turns = Turns()
    turns.request(0, now=0.0)
    turns.request(1, now=0.0)
    turns.moving = True  # rank 0's GPU memory is coming back (proxy.swap): it does not compute yet
    assert turns.lapse_at(10) is None
    turns.begin(0, now=25.0)
    assert (turns.moving, turns.lapse_at(10)) == (False, 35.0)
    turns.begin(1, now=40.0)  # not the holder: nothing changes
    assert turns.lapse_at(10) == 35.0
    turns.moving = True
    assert turns.release(0, now=50.0) == 1 and not turns.moving  # a new holder's turn is its own
