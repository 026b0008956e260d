"""Deterministic collectives among a job's proxies.

Each function runs on every proxy that serves members of a communicator, with the contributions of
its own members (keyed by group rank), and returns what its members get. Reductions combine all
members' contributions in group-rank order in exactly one place per element (the owner of its
chunk), so a job's numbers are the same on any placement of ranks on proxies and nodes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .hal import DeviceBackend


class Fabric(Protocol):
    me: str

    def send(self, peer: str, tag: str, payload: Sequence) -> None: ...

    def take(self, tag: str, sender: str) -> bytearray: ...


@dataclass(frozen=True)
class Group:
    """A communicator as a proxy sees it: its members' proxies, in group-rank order."""

    name: str
    owners: tuple[str, ...]  # owners[g] = proxy serving group rank g

    @property
    def proxies(self) -> list[str]:
        """Proxies with members, ordered by their first member."""
        seen: list[str] = []
        for proxy in self.owners:
            if proxy not in seen:
                seen.append(proxy)
        return seen

    def members_of(self, proxy: str) -> list[int]:
        return [g for g, owner in enumerate(self.owners) if owner == proxy]


def chunk_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(n, parts)
    bounds, lo = [], 0
    for i in range(parts):
        hi = lo + base + (1 if i < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def allreduce(fabric: Fabric, backend: DeviceBackend, group: Group, tag: str,
              inputs: Mapping[int, np.ndarray], op: str) -> np.ndarray:
    """Reduce-scatter to chunk owners, then all-gather the reduced chunks."""
    proxies = group.proxies
    first = next(iter(inputs.values()))
    if len(proxies) == 1:
        return backend.reduce([inputs[g] for g in range(len(group.owners))], op)
    bounds = chunk_bounds(first.size, len(proxies))
    me = proxies.index(fabric.me)
    local = sorted(inputs)
    for j, peer in enumerate(proxies):
        if peer != fabric.me:
            lo, hi = bounds[j]
            fabric.send(peer, f"{tag}:rs", [inputs[g][lo:hi] for g in local])
    lo, hi = bounds[me]
    parts = {g: inputs[g][lo:hi] for g in local}
    for peer in proxies:
        if peer != fabric.me:
            members = group.members_of(peer)
            data = np.frombuffer(fabric.take(f"{tag}:rs", peer), dtype=first.dtype)
            for i, g in enumerate(members):
                parts[g] = data[i * (hi - lo):(i + 1) * (hi - lo)]
    chunk = backend.reduce([parts[g] for g in range(len(group.owners))], op)
    result = np.empty(first.size, dtype=first.dtype)
    result[lo:hi] = chunk
    for peer in proxies:
        if peer != fabric.me:
            fabric.send(peer, f"{tag}:ag", [chunk])
    for j, peer in enumerate(proxies):
        if peer != fabric.me:
            plo, phi = bounds[j]
            result[plo:phi] = np.frombuffer(fabric.take(f"{tag}:ag", peer), dtype=first.dtype)
    return result


def broadcast(fabric: Fabric, group: Group, tag: str, inputs: Mapping[int, np.ndarray],
              root: int) -> np.ndarray:
    owner = group.owners[root]
    if owner == fabric.me:
        data = inputs[root]
        for peer in group.proxies:
            if peer != fabric.me:
                fabric.send(peer, tag, [data])
        return data
    sample = next(iter(inputs.values()))
    return np.frombuffer(fabric.take(tag, owner), dtype=sample.dtype)


def allgather(fabric: Fabric, group: Group, tag: str, inputs: Mapping[int, np.ndarray],
              dtype: np.dtype) -> np.ndarray:
    """Every member's contribution, concatenated in group-rank order."""
    local = sorted(inputs)
    for peer in group.proxies:
        if peer != fabric.me:
            fabric.send(peer, tag, [inputs[g] for g in local])
    pieces: dict[int, np.ndarray] = dict(inputs)
    for peer in group.proxies:
        if peer != fabric.me:
            members = group.members_of(peer)
            data = np.frombuffer(fabric.take(tag, peer), dtype=dtype)
            size = data.size // max(len(members), 1)
            for i, g in enumerate(members):
                pieces[g] = data[i * size:(i + 1) * size]
    return np.concatenate([pieces[g] for g in range(len(group.owners))])
