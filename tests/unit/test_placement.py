"""Where a distributed job's ranks run: blocks per node, one rank per device, round robin beyond."""

from __future__ import annotations

import pytest

from singularity_slurm.coordinator.placement import PlacementError, check_size, node_blocks, place, ranks_on


def placement_error(call, *args) -> str:
    with pytest.raises(PlacementError) as info:
        call(*args)
    return str(info.value)


# --- node blocks ----------------------------------------------------------------------------------


def test_ranks_spread_evenly_in_consecutive_blocks() -> None:
    assert node_blocks(8, 2) == [range(0, 4), range(4, 8)]
    assert node_blocks(6, 3) == [range(0, 2), range(2, 4), range(4, 6)]


def test_the_remainder_goes_to_the_lowest_nodes() -> None:
    assert node_blocks(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert node_blocks(5, 4) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]


def test_one_node_takes_every_rank() -> None:
    assert node_blocks(5, 1) == [range(0, 5)]


def test_as_many_ranks_as_nodes_gives_one_rank_each() -> None:
    assert node_blocks(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]


@pytest.mark.parametrize(("world", "nodes"), [(1, 1), (7, 3), (100, 7), (64, 64)])
def test_blocks_cover_every_rank_once_and_differ_by_at_most_one(world: int, nodes: int) -> None:
    blocks = node_blocks(world, nodes)

    assert [r for block in blocks for r in block] == list(range(world))
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
    assert [len(b) for b in blocks] == sorted((len(b) for b in blocks), reverse=True)


@pytest.mark.parametrize("world", [0, -1])
def test_world_size_below_one_is_refused(world: int) -> None:
    assert placement_error(node_blocks, world, 1) == f"world size must be at least 1, got {world}"


def test_no_node_is_refused() -> None:
    assert placement_error(node_blocks, 4, 0) == "a job has at least one node"


def test_fewer_ranks_than_nodes_is_refused_with_the_way_out() -> None:
    assert placement_error(node_blocks, 2, 3) == (
        "world size 2 is smaller than the job's 3 nodes: every node runs at least one rank; "
        "ask for fewer nodes or more ranks")


# --- place ----------------------------------------------------------------------------------------


def test_one_rank_per_device_in_device_order() -> None:
    devices = [["n1/gpu0", "n1/gpu1"], ["n2/gpu0", "n2/gpu1"]]

    assert place(4, devices) == {0: "n1/gpu0", 1: "n1/gpu1", 2: "n2/gpu0", 3: "n2/gpu1"}


def test_more_ranks_than_devices_go_round_robin_within_the_node() -> None:
    assert place(5, [["n1/gpu0", "n1/gpu1"]]) == {
        0: "n1/gpu0", 1: "n1/gpu1", 2: "n1/gpu0", 3: "n1/gpu1", 4: "n1/gpu0"}


def test_fewer_ranks_than_devices_leave_the_last_devices_unused() -> None:
    assert place(3, [["n1/gpu0", "n1/gpu1"], ["n2/gpu0", "n2/gpu1"]]) == {
        0: "n1/gpu0", 1: "n1/gpu1", 2: "n2/gpu0"}


def test_nodes_with_different_device_counts_each_take_their_block() -> None:
    placement = place(5, [["n1/cpu0"], ["n2/gpu0", "n2/gpu1", "n2/gpu2"]])

    assert placement == {0: "n1/cpu0", 1: "n1/cpu0", 2: "n1/cpu0", 3: "n2/gpu0", 4: "n2/gpu1"}


def test_a_node_without_devices_is_refused_by_its_index() -> None:
    assert placement_error(place, 4, [["n1/gpu0"], []]) == "node 1 of the job has no device proxy"


def test_place_refuses_fewer_ranks_than_nodes() -> None:
    assert placement_error(place, 1, [["n1/gpu0"], ["n2/gpu0"]]).startswith(
        "world size 1 is smaller than the job's 2 nodes")


def test_place_refuses_a_world_size_of_zero() -> None:
    assert placement_error(place, 0, [["n1/gpu0"]]) == "world size must be at least 1, got 0"


def test_place_refuses_a_job_without_nodes() -> None:
    assert placement_error(place, 2, []) == "a job has at least one node"


def test_placement_error_is_a_value_error() -> None:
    assert issubclass(PlacementError, ValueError)


# --- ranks on a node ------------------------------------------------------------------------------


def test_ranks_on_lists_the_ranks_of_the_devices_given_sorted() -> None:
    placement = {0: "n1/gpu0", 1: "n1/gpu1", 2: "n2/gpu0", 3: "n1/gpu0", 4: "n2/gpu1"}

    assert ranks_on(placement, ["n1/gpu1", "n1/gpu0"]) == [0, 1, 3]
    assert ranks_on(placement, ["n2/gpu0", "n2/gpu1"]) == [2, 4]


def test_ranks_on_devices_without_ranks_is_empty() -> None:
    assert ranks_on({0: "n1/gpu0"}, ["n2/gpu0"]) == []
    assert ranks_on({0: "n1/gpu0"}, []) == []


# --- ranks sharing devices, sizes ----------------------------------------------------------------


def test_ranks_beyond_the_devices_take_turns_up_to_the_configured_bound() -> None:
    assert place(4, [["a/0"]], max_per_device=4) == {0: "a/0", 1: "a/0", 2: "a/0", 3: "a/0"}
    assert place(5, [["a/0", "a/1"]], max_per_device=3) == {0: "a/0", 1: "a/1", 2: "a/0", 3: "a/1", 4: "a/0"}
    assert placement_error(place, 5, [["a/0", "a/1"]], 2) == (
        "5 ranks on 2 devices would put 3 ranks on one device, more than [elastic] max_ranks_per_device = "
        "2: give the job at least 3 devices")


def test_a_size_is_checked_at_every_node_count_of_its_range() -> None:
    check_size(4, (1, 2), 2, max_per_device=2)
    check_size(4, (4, 4), 1, max_per_device=1)
    assert placement_error(check_size, 4, (1, 2), 1, 2) == (
        "4 ranks on 1 device would put 4 ranks on one device, more than [elastic] max_ranks_per_device = "
        "2: give the job at least 2 devices")
    assert placement_error(check_size, 4, (1, 5), 1, 4) == (
        "world size 4 cannot run on 5 nodes: every node runs at least one rank; ask for at most 4 nodes")
    assert placement_error(check_size, 4, (2, 1), 1, 4) == (
        "a node count range runs from 1 up (MIN <= MAX), got 2-1")
    assert placement_error(check_size, 4, (1, 1), 0, 4) == (
        "a distributed job needs at least one device per node, got 0")
