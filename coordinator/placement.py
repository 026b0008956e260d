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


def place(world_size: int, devices: Sequence[Sequence[str]]) -> dict[int, str]:
    """rank -> device (proxy id), given each node's devices in node order."""
    for index, node_devices in enumerate(devices):
        if not node_devices:
            raise PlacementError(f"node {index} of the job has no device proxy")
    placement: dict[int, str] = {}
    for node_devices, block in zip(devices, node_blocks(world_size, len(devices)), strict=True):
        for i, rank in enumerate(block):
            placement[rank] = node_devices[i % len(node_devices)]
    return placement


def ranks_on(placement: dict[int, str], devices: Sequence[str]) -> list[int]:
    local = set(devices)
    return sorted(r for r, device in placement.items() if device in local)
