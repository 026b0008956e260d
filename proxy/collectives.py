"""Deterministic collectives among a job's proxies.

Each function runs on every proxy that serves members of a communicator, with the contributions of
its own members (keyed by group rank), and returns what its members get. Reductions combine all
members' contributions in group-rank order in exactly one place per element (the owner of its
chunk), so a job's numbers are the same on any placement of ranks on proxies and nodes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import numpy as np

from .hal import DeviceBackend


class Fabric(Protocol):
    me: str

    def send(self, peer: str, tag: str, payload: Sequence) -> None: ...

    def take(self, tag: str, sender: str) -> bytearray: ...


@dataclass(frozen=True)
class Group:
    """A communicator as a proxy sees it: its members' proxies, in group-rank order. What the
    collectives ask of it is computed once per group (a proxy keeps one per communicator and
    generation), so an operation's control cost does not grow with the world size."""

    name: str
    owners: tuple[str, ...]  # owners[g] = proxy serving group rank g

    @cached_property
    def _members(self) -> dict[str, tuple[int, ...]]:
        members: dict[str, list[int]] = {}
        for g, owner in enumerate(self.owners):
            members.setdefault(owner, []).append(g)
        return {proxy: tuple(ranks) for proxy, ranks in members.items()}

    @cached_property
    def _order(self) -> tuple[str, ...]:
        return tuple(self._members)

    @cached_property
    def _positions(self) -> dict[str, int]:
        return {proxy: i for i, proxy in enumerate(self._order)}

    @property
    def proxies(self) -> tuple[str, ...]:
        """Proxies with members, ordered by their first member."""
        return self._order

    def position(self, proxy: str) -> int:
        """Where `proxy` stands in `proxies`."""
        return self._positions[proxy]

    def members_of(self, proxy: str) -> tuple[int, ...]:
        return self._members.get(proxy, ())


def chunk_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(n, parts)
    bounds, lo = [], 0
    for i in range(parts):
        hi = lo + base + (1 if i < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def allreduce(fabric: Fabric, backend: DeviceBackend, group: Group, tag: str,
              inputs: Mapping[int, np.ndarray], op: str,
              into: Sequence[np.ndarray] = ()) -> np.ndarray | None:
    """Reduce-scatter to chunk owners, then all-gather the reduced chunks.

    Returns the result; or, given `into` (arrays of the inputs' size: the local members' regions),
    writes it there chunk by chunk as each is complete and returns None. An input may be one of
    them: each chunk of an input has been sent or reduced before that chunk is written.
    """
    proxies = group.proxies
    first = next(iter(inputs.values()))
    if len(proxies) == 1:
        return _place(backend.reduce([inputs[g] for g in range(len(group.owners))], op), into)
    bounds = chunk_bounds(first.size, len(proxies))
    me = group.position(fabric.me)
    local = sorted(inputs)
    for j, peer in enumerate(proxies):
        if peer != fabric.me:
            lo, hi = bounds[j]
            fabric.send(peer, f"{tag}:rs", [inputs[g][lo:hi] for g in local])
    lo, hi = bounds[me]
    parts = {g: inputs[g][lo:hi] for g in local}
    # Proxies whose ranks disagree on the count cut different chunks: each finishes the exchange
    # (so no peer waits forever) and then fails.
    wrong: list[str] = []
    for peer in proxies:
        if peer != fabric.me:
            members = group.members_of(peer)
            data = np.frombuffer(fabric.take(f"{tag}:rs", peer), dtype=first.dtype)
            if data.size != len(members) * (hi - lo):
                wrong.append(f"proxy {peer} sent {data.size} elements of chunk {me} for ranks "
                             f"{list(members)}, not {hi - lo} each")
                data = np.zeros(len(members) * (hi - lo), dtype=first.dtype)
            for i, g in enumerate(members):
                parts[g] = data[i * (hi - lo):(i + 1) * (hi - lo)]
    chunk = backend.reduce([parts[g] for g in range(len(group.owners))], op)
    targets = list(into) or [np.empty(first.size, dtype=first.dtype)]
    for target in targets:
        target[lo:hi] = chunk
    for peer in proxies:
        if peer != fabric.me:
            fabric.send(peer, f"{tag}:ag", [chunk])
    for j, peer in enumerate(proxies):
        if peer != fabric.me:
            plo, phi = bounds[j]
            data = np.frombuffer(fabric.take(f"{tag}:ag", peer), dtype=first.dtype)
            if data.size != phi - plo:
                wrong.append(f"proxy {peer} sent {data.size} elements of chunk {j}, not {phi - plo}")
            else:
                for target in targets:
                    target[plo:phi] = data
    if wrong:
        raise ValueError(f"ranks disagree on the element count ({first.size} here): {'; '.join(wrong)}")
    return None if into else targets[0]


Attach = Callable[[str, int, Mapping[str, int], np.dtype, int], np.ndarray]
"""(peer, group rank, where that member's region is, dtype, count) -> the region's elements."""


def allreduce_shared(fabric: Fabric, backend: DeviceBackend, group: Group, tag: str,
                     inputs: Mapping[int, np.ndarray], op: str, regions: Mapping[int, Mapping[str, int]],
                     attach: Attach) -> None:
    """Allreduce among proxies that share memory (one host), in place: no data crosses the mesh.

    `inputs` are this proxy's members' regions and take their result; `regions` tells the peers where
    they are. Each proxy announces its members' regions, attaches its peers' ones (`attach`), reduces
    its own chunk from every member's region in group-rank order, as `allreduce` does, and writes the
    result into every member's region; then each tells the others it is done and waits until all
    are. The chunks are disjoint, so no proxy touches what another one reads or writes, and a
    member's region holds its whole result once every proxy is done. A proxy that cannot take part
    (another element count, a region it cannot attach, a reduction the backend refuses) still says
    done, with its reason, so every proxy returns and each raises.
    """
    proxies = group.proxies
    peers = [p for p in proxies if p != fabric.me]
    first = next(iter(inputs.values()))
    announce = json.dumps({"count": first.size, "dtype": first.dtype.str,
                           "regions": {str(g): dict(ref) for g, ref in regions.items()}}).encode()
    for peer in peers:
        fabric.send(peer, f"{tag}:at", [announce])
    arrays: dict[int, np.ndarray] = dict(inputs)
    errors: list[Exception] = []
    for peer in peers:
        told = fabric.take(f"{tag}:at", peer)  # every peer's, whatever comes of the others
        try:
            told = json.loads(bytes(told))
            if (told["count"], told["dtype"]) != (first.size, first.dtype.str):
                errors.append(ValueError(f"ranks disagree on the element count or type ({first.size} of "
                                         f"{first.dtype} here): proxy {peer}'s ranks have "
                                         f"{told['count']} of {np.dtype(told['dtype'])}"))
                continue
            if sorted(int(g) for g in told["regions"]) != list(group.members_of(peer)):
                raise ValueError(f"it announced the regions of ranks {sorted(told['regions'])}, not of "
                                 f"its members {list(group.members_of(peer))}")
            for g, ref in told["regions"].items():
                arrays[int(g)] = attach(peer, int(g), ref, first.dtype, first.size)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            errors.append(ValueError(f"cannot attach proxy {peer}'s shared memory: {exc}"))
    if not errors:
        lo, hi = chunk_bounds(first.size, len(proxies))[group.position(fabric.me)]
        try:
            chunk = backend.reduce([arrays[g][lo:hi] for g in range(len(group.owners))], op)
            for array in arrays.values():
                array[lo:hi] = chunk
        except Exception as exc:  # noqa: BLE001 - told to the peers, which wait for this proxy's word
            errors.append(exc)
    done = json.dumps([str(exc) for exc in errors[:1]]).encode()
    for peer in peers:
        fabric.send(peer, f"{tag}:dn", [done])
    for peer in peers:
        theirs = json.loads(bytes(fabric.take(f"{tag}:dn", peer)))
        if theirs:
            errors.append(ValueError(f"proxy {peer}: {theirs[0]}"))
    if errors:
        raise errors[0]


def _place(result: np.ndarray, into: Sequence[np.ndarray]) -> np.ndarray | None:
    """`result`, or None once it is copied into each of `into`."""
    for target in into:
        target[:] = result
    return None if into else result


def barrier(fabric: Fabric, group: Group, tag: str) -> None:
    """Return once every proxy of the group has entered: a dissemination barrier.

    In round k each proxy tells the one 2**k places after it that it has got this far and waits for
    the one 2**k places before it; after ceil(log2 P) rounds each has heard, directly or through
    others, from all P. A proxy sends and receives log2 P empty messages instead of P - 1 each way,
    so a barrier's cost barely grows with the job.
    """
    proxies = group.proxies
    count, me = len(proxies), group.position(fabric.me)
    distance, round_ = 1, 0
    while distance < count:
        fabric.send(proxies[(me + distance) % count], f"{tag}:d{round_}", ())
        fabric.take(f"{tag}:d{round_}", proxies[(me - distance) % count])
        distance, round_ = distance * 2, round_ + 1


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


def reduce(fabric: Fabric, backend: DeviceBackend, group: Group, tag: str,
           inputs: Mapping[int, np.ndarray], op: str, root: int) -> np.ndarray | None:
    """The contributions reduced in group-rank order on the root's proxy (None on the others).

    Each element is combined exactly as allreduce combines it, so the root gets the same bits.
    """
    parts = _at_root(fabric, group, tag, inputs, root)
    return None if parts is None else backend.reduce(parts, op)


def gather(fabric: Fabric, group: Group, tag: str, inputs: Mapping[int, np.ndarray],
           root: int) -> np.ndarray | None:
    """Every member's contribution, concatenated in group-rank order, on the root's proxy."""
    parts = _at_root(fabric, group, tag, inputs, root)
    return None if parts is None else np.concatenate(parts)


def _at_root(fabric: Fabric, group: Group, tag: str, inputs: Mapping[int, np.ndarray],
             root: int) -> list[np.ndarray] | None:
    """On the root's proxy, every member's contribution in group-rank order; None elsewhere (this
    proxy's contributions are sent to the root's)."""
    owner = group.owners[root]
    local = sorted(inputs)
    if owner != fabric.me:
        fabric.send(owner, tag, [inputs[g] for g in local])
        return None
    first = inputs[local[0]]
    pieces: dict[int, np.ndarray] = dict(inputs)
    for peer in group.proxies:
        if peer != fabric.me:
            members = group.members_of(peer)
            data = np.frombuffer(fabric.take(tag, peer), dtype=first.dtype)
            if data.size != first.size * len(members):
                raise ValueError(f"proxy {peer} sent {data.size} elements for ranks {list(members)}, "
                                 f"expected {first.size} each")
            for i, g in enumerate(members):
                pieces[g] = data[i * first.size:(i + 1) * first.size]
    return [pieces[g] for g in range(len(group.owners))]


def scatter(fabric: Fabric, group: Group, tag: str, data: np.ndarray | None, root: int,
            members: Sequence[int], count: int, dtype: np.dtype) -> dict[int, np.ndarray]:
    """Slice g of the root's `data` (`count` elements each) for each of this proxy's `members`.

    The root's own members get copies: their results are written where `data` lies.
    """
    owner = group.owners[root]
    if owner == fabric.me:
        assert data is not None
        if data.size != count * len(group.owners):
            raise ValueError(f"the root has {data.size} elements for {len(group.owners)} ranks "
                             f"of {count}")
        for peer in group.proxies:
            if peer != fabric.me:
                fabric.send(peer, tag, [data[g * count:(g + 1) * count] for g in group.members_of(peer)])
        return {g: data[g * count:(g + 1) * count].copy() for g in members}
    received = np.frombuffer(fabric.take(tag, owner), dtype=dtype)
    if received.size != count * len(members):
        raise ValueError(f"the root sent {received.size} elements for ranks {list(members)} of "
                         f"{count} each")
    return {g: received[i * count:(i + 1) * count] for i, g in enumerate(members)}


def alltoall(fabric: Fabric, group: Group, tag: str, inputs: Mapping[int, np.ndarray],
             send: Mapping[int, Sequence[int]], recv: Mapping[int, Sequence[int]]) -> dict[int, np.ndarray]:
    """Member g's input is split into pieces for ranks 0..n-1 (`send[g]` elements each); each local
    member j gets its pieces from ranks 0..n-1 (`recv[j]` elements each), concatenated in rank order.

    A message to a proxy carries, ahead of the data, the counts its senders meant for each of its
    members, so a rank that expects another size than its peer sends is named, not misread.
    """
    local = sorted(inputs)
    first = inputs[local[0]]
    offsets = {g: np.concatenate([[0], np.cumsum(send[g], dtype=np.int64)]) for g in local}

    def piece(g: int, j: int) -> np.ndarray:
        return inputs[g][offsets[g][j]:offsets[g][j + 1]]

    for peer in group.proxies:
        if peer != fabric.me:
            targets = group.members_of(peer)
            counts = np.array([send[g][j] for g in local for j in targets], dtype=np.int64)
            fabric.send(peer, tag, [counts, *(piece(g, j) for g in local for j in targets)])
    pieces: dict[tuple[int, int], np.ndarray] = {(g, j): piece(g, j) for g in local for j in local}
    for peer in group.proxies:
        if peer != fabric.me:
            senders = group.members_of(peer)
            raw = fabric.take(tag, peer)
            head = len(senders) * len(local)
            counts = np.frombuffer(raw, dtype=np.int64, count=head).tolist()
            data = np.frombuffer(raw, dtype=first.dtype, offset=8 * head)
            at = 0
            for k, (g, j) in enumerate((g, j) for g in senders for j in local):
                pieces[g, j] = data[at:at + counts[k]]
                at += counts[k]
    for (g, j), data in pieces.items():
        if data.size != recv[j][g]:
            raise ValueError(f"rank {g} sends {data.size} elements to rank {j}, which expects "
                             f"{recv[j][g]}")
    return {j: np.concatenate([pieces[g, j] for g in range(len(group.owners))]) for j in local}
