"""Where a distributed job's logical ranks run: a pure function of the world size and the devices.

Ranks are spread over the job's nodes as evenly as possible (lower node indices take the remainder),
consecutively, so that a node's ranks are one block; within a node they go one per device, round robin
when a node has more ranks than devices. The world size is the job's invariant; this mapping is
recomputed at every start and restore from the devices the allocation has then.
"""

from __future__ import annotations

from collections.abc import Sequence


class PlacementError(ValueError):
    """The world size cannot be placed on the devices given."""


def node_blocks(world_size: int, nodes: int) -> list[range]:
    """Ranks of each node: consecutive blocks, sizes differing by at most one."""
    if world_size < 1:
        raise PlacementError(f"world size must be at least 1, got {world_size}")
    if nodes < 1:
        raise PlacementError("a job has at least one node")
    if world_size < nodes:
        raise PlacementError(f"world size {world_size} is smaller than the job's {nodes} nodes: every "
                             "node runs at least one rank; ask for fewer nodes or more ranks")
    base, extra = divmod(world_size, nodes)
    blocks, start = [], 0
    for i in range(nodes):
        size = base + (1 if i < extra else 0)
        blocks.append(range(start, start + size))
        start += size
    return blocks


def place(world_size: int, devices: Sequence[Sequence[str]],
          max_per_device: int | None = None) -> dict[int, str]:
    """rank -> device (proxy id), given each node's devices in node order.

    Ranks beyond a node's device count share its devices, taking turns; `max_per_device` bounds how
    many may share one (`[elastic] max_ranks_per_device`).
    """
    for index, node_devices in enumerate(devices):
        if not node_devices:
            raise PlacementError(f"node {index} of the job has no device proxy")
    placement: dict[int, str] = {}
    for node_devices, block in zip(devices, node_blocks(world_size, len(devices)), strict=True):
        for i, rank in enumerate(block):
            placement[rank] = node_devices[i % len(node_devices)]
    if max_per_device is not None:
        busiest = max(list(placement.values()).count(d) for d in set(placement.values()))
        if busiest > max_per_device:
            total = sum(len(d) for d in devices)
            where = f"{total} device{'' if total == 1 else 's'}"
            raise PlacementError(f"{world_size} ranks on {where} would put {busiest} ranks on one device,"
                                 f" more than [elastic] max_ranks_per_device = {max_per_device}: "
                                 f"give the job at least {-(-world_size // max_per_device)} devices")
    return placement


def describe(ranks: int, devices: int, nodes: int) -> str:
    """"4 ranks on 2 devices of 1 node (2 per device)": a distributed job's size, as users read it."""
    per = f" ({-(-ranks // devices)} per device)" if devices and ranks > devices else ""
    return (f"{ranks} ranks on {devices} device{'' if devices == 1 else 's'} of {nodes} "
            f"node{'' if nodes == 1 else 's'}{per}")


def check_size(world_size: int, nodes: tuple[int, int], devices_per_node: int, max_per_device: int) -> None:
    """Refuse a size (a node count range, devices on each node) that cannot hold the world size on
    any node count of the range: every node needs a rank, and no device more than `max_per_device`."""
    low, high = nodes
    if not 1 <= low <= high:
        raise PlacementError(f"a node count range runs from 1 up (MIN <= MAX), got {low}-{high}")
    if devices_per_node < 1:
        raise PlacementError(f"a distributed job needs at least one device per node, got {devices_per_node}")
    if world_size < high:
        raise PlacementError(f"world size {world_size} cannot run on {high} nodes: every node runs at least "
                             f"one rank; ask for at most {world_size} nodes")
    for count in range(low, high + 1):
        place(world_size, [[f"{n}/{d}" for d in range(devices_per_node)] for n in range(count)],
              max_per_device)


def ranks_on(placement: dict[int, str], devices: Sequence[str]) -> list[int]:
    local = set(devices)
    return sorted(r for r, device in placement.items() if device in local)
