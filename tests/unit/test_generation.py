"""Checkpoint generations of multi-node jobs order as (restart, ns), never as text."""

from __future__ import annotations

import pytest

from singularity_slurm.checkpoint.generation import Generation, newest_first
from singularity_slurm.errors import InvalidCheckpointRequest


def test_a_generation_round_trips_through_its_text() -> None:
    generation = Generation(10, 1764612345000000000)
    assert str(generation) == "10.1764612345000000000"
    assert Generation.parse(str(generation)) == generation


def test_restart_ten_is_newer_than_restart_nine_whatever_the_text_says() -> None:
    nine, ten = "9.1764612399000000000", "10.1764612345000000000"
    assert sorted([nine, ten], reverse=True) == [nine, ten]  # what comparing strings got wrong
    assert newest_first([nine, ten]) == [ten, nine]
    assert Generation.parse(ten) > Generation.parse(nine)


def test_within_a_restart_the_later_clock_is_newer() -> None:
    assert newest_first(["3.99", "3.100", "3.5"]) == ["3.100", "3.99", "3.5"]


def test_texts_that_name_no_generation_are_left_out() -> None:
    assert newest_first(["2.7", "g1", "", "01.5", "2.7"]) == ["2.7"]


@pytest.mark.parametrize("bad", ["", "1", "1.", ".1", "a.b", "01.2", "1.02", "-1.2", "1.2.3", " 1.2", 12,
                                 None, "1" * 10 + ".1"])
def test_anything_else_is_refused_naming_the_form(bad: object) -> None:
    with pytest.raises(InvalidCheckpointRequest, match="is not '<restart>.<nanoseconds>'"):
        Generation.parse(bad)
