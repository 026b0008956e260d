"""Deterministic collectives among proxies: results in rank order, bit-identical on every placement.

Each proxy runs in its own thread with an in-memory fabric (a shared inbox keyed like the mesh's), so
these tests exercise exactly the chunking and exchange of `collectives`, without sockets.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from singularity_slurm.proxy import collectives
from singularity_slurm.proxy.collectives import Group, allgather, allreduce, broadcast, chunk_bounds
from singularity_slurm.proxy.daemon import Proxy
from singularity_slurm.proxy.hal import (
    BFLOAT16,
    MIN_REGION,
    BackendError,
    HostBackend,
    backend,
    bfloat16_to_float32,
    dtype_of,
    float32_to_bfloat16,
)

# --- an in-memory fabric --------------------------------------------------------------------------


class Exchange:
    """What every proxy's fabric shares: messages by (receiver, tag, sender)."""

    def __init__(self) -> None:
        self.inbox: dict[tuple[str, str, str], bytearray] = {}
        self.cond = threading.Condition()


class MemoryFabric:
    def __init__(self, me: str, exchange: Exchange):
        self.me = me
        self.exchange = exchange

    def send(self, peer: str, tag: str, payload: Sequence) -> None:
        data = b"".join(bytes(memoryview(p).cast("B")) for p in payload)  # as the mesh sends it
        with self.exchange.cond:
            key = (peer, tag, self.me)
            assert key not in self.exchange.inbox, f"{self.me} sent {tag} to {peer} twice"
            self.exchange.inbox[key] = bytearray(data)
            self.exchange.cond.notify_all()

    def take(self, tag: str, sender: str) -> bytearray:
        key = (self.me, tag, sender)
        with self.exchange.cond:
            if not self.exchange.cond.wait_for(lambda: key in self.exchange.inbox, timeout=10):
                raise TimeoutError(f"{self.me} never got {tag} from {sender}")
            return self.exchange.inbox.pop(key)


def outcomes_on_proxies(owners: tuple[str, ...], inputs: Sequence[np.ndarray],
                        collective: Callable[[MemoryFabric, Group, dict[int, np.ndarray]], np.ndarray],
                        ) -> dict[str, object]:
    """Run `collective` on every proxy of the group at once; what each returned or raised. No
    message may be left that nobody took."""
    group = Group("world", owners)
    exchange = Exchange()
    outcomes: dict[str, object] = {}

    def proxy(me: str) -> None:
        try:
            local = {g: inputs[g] for g in group.members_of(me)}
            outcomes[me] = collective(MemoryFabric(me, exchange), group, local)
        except BaseException as exc:  # handed to the test's thread
            outcomes[me] = exc

    threads = [threading.Thread(target=proxy, args=(p,)) for p in group.proxies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert set(outcomes) == set(group.proxies), "a proxy never returned"
    assert exchange.inbox == {}, "a message was sent that nobody took"
    return outcomes


def run_on_proxies(owners: tuple[str, ...], inputs: Sequence[np.ndarray],
                   collective: Callable[[MemoryFabric, Group, dict[int, np.ndarray]], np.ndarray],
                   ) -> dict[str, np.ndarray]:
    """Run `collective` on every proxy of the group at once; each proxy's result."""
    outcomes = outcomes_on_proxies(owners, inputs, collective)
    for outcome in outcomes.values():
        if isinstance(outcome, BaseException):
            raise outcome
    return outcomes  # type: ignore[return-value]


def reduce_all(owners: tuple[str, ...], inputs: Sequence[np.ndarray], op: str) -> dict[str, np.ndarray]:
    return run_on_proxies(owners, inputs, lambda fabric, group, local: allreduce(
        fabric, HostBackend(), group, "t:1", local, op))


def in_rank_order(inputs: Sequence[np.ndarray], op: str) -> np.ndarray:
    """The reference: ((x0 op x1) op x2) op ..., element by element, in the inputs' dtype."""
    ufunc = {"sum": np.add, "avg": np.add, "product": np.multiply, "min": np.minimum, "max": np.maximum}[op]
    acc = inputs[0].copy()
    for x in inputs[1:]:
        acc = ufunc(acc, x).astype(acc.dtype)
    if op == "avg":
        acc = (acc / np.array(len(inputs), dtype=acc.dtype)).astype(acc.dtype)
    return acc


def ragged_floats(ranks: int, size: int, seed: int = 7) -> list[np.ndarray]:
    """float32 values over six orders of magnitude, where the order of additions shows in the bits."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(size) * 10.0 ** rng.uniform(-3, 3, size)).astype(np.float32)
            for _ in range(ranks)]


PLACEMENTS_OF_4 = {
    "1 proxy x 4 ranks": ("a",) * 4,
    "2 x 2": ("a", "a", "b", "b"),
    "4 x 1": ("a", "b", "c", "d"),
    "2 x 2 interleaved": ("a", "b", "a", "b"),
    "uneven 3 + 1": ("a", "a", "a", "b"),
}
PLACEMENTS_OF_3 = {"1 x 3": ("a",) * 3, "2 + 1": ("a", "a", "b"), "1 + 2": ("a", "b", "b"),
                   "3 x 1": ("a", "b", "c")}
OPS = ["sum", "avg", "max", "min", "product"]


# --- chunks and groups ----------------------------------------------------------------------------


def test_chunk_bounds_split_evenly_with_the_remainder_to_the_first_chunks() -> None:
    assert chunk_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert chunk_bounds(9, 3) == [(0, 3), (3, 6), (6, 9)]
    assert chunk_bounds(5, 1) == [(0, 5)]


def test_chunk_bounds_of_fewer_elements_than_parts_leave_empty_chunks_at_the_end() -> None:
    assert chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert chunk_bounds(0, 2) == [(0, 0), (0, 0)]


@pytest.mark.parametrize(("n", "parts"), [(1, 1), (7, 3), (1000, 7), (3, 8)])
def test_chunk_bounds_tile_the_range(n: int, parts: int) -> None:
    bounds = chunk_bounds(n, parts)

    assert len(bounds) == parts
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(hi == lo for (_, hi), (lo, _) in zip(bounds, bounds[1:], strict=False))


def test_group_proxies_are_ordered_by_their_first_member() -> None:
    group = Group("world", ("b", "a", "b", "c", "a"))

    assert group.proxies == ("b", "a", "c")
    assert [group.position(p) for p in group.proxies] == [0, 1, 2]
    assert group.members_of("a") == (1, 4)
    assert group.members_of("b") == (0, 2)
    assert group.members_of("z") == ()
    assert group.members_of("a") is group.members_of("a")  # made once per group


# --- allreduce ------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("placement", PLACEMENTS_OF_4.values(), ids=PLACEMENTS_OF_4.keys())
def test_allreduce_of_float32_equals_the_rank_order_reduction_bit_for_bit(
        placement: tuple[str, ...], op: str) -> None:
    inputs = ragged_floats(4, 1001)

    results = reduce_all(placement, inputs, op)

    expected = in_rank_order(inputs, op)
    for proxy, result in results.items():
        assert result.dtype == np.float32
        assert result.tobytes() == expected.tobytes(), f"proxy {proxy}"


@pytest.mark.parametrize("op", OPS)
def test_allreduce_is_bit_identical_across_placements(op: str) -> None:
    inputs = ragged_floats(4, 1001, seed=11)

    seen = {name: reduce_all(placement, inputs, op)[placement[0]].tobytes()
            for name, placement in PLACEMENTS_OF_4.items()}

    assert len(set(seen.values())) == 1, {name: hash(bits) for name, bits in seen.items()}


def test_the_data_is_such_that_another_order_of_additions_changes_the_bits() -> None:
    inputs = ragged_floats(4, 1001)

    assert in_rank_order(inputs, "sum").tobytes() != in_rank_order(inputs[::-1], "sum").tobytes()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("placement", PLACEMENTS_OF_3.values(), ids=PLACEMENTS_OF_3.keys())
def test_allreduce_of_three_ranks_on_uneven_placements(placement: tuple[str, ...], op: str) -> None:
    inputs = ragged_floats(3, 257, seed=3)

    results = reduce_all(placement, inputs, op)

    for result in results.values():
        assert result.tobytes() == in_rank_order(inputs, op).tobytes()


@pytest.mark.parametrize(("op", "expected"), [
    ("sum", [111, -2]), ("max", [100, 3]), ("min", [1, -7]), ("product", [1000, -42]),
])
def test_allreduce_of_integers_is_exact(op: str, expected: list[int]) -> None:
    inputs = [np.array([1, 2], np.int64), np.array([10, 3], np.int64), np.array([100, -7], np.int64)]

    results = reduce_all(("a", "b", "b"), inputs, op)

    for result in results.values():
        assert result.dtype == np.int64
        assert result.tolist() == expected


@pytest.mark.parametrize("size", [0, 1, 3])
def test_allreduce_of_fewer_elements_than_proxies(size: int) -> None:
    inputs = [np.arange(size, dtype=np.float64) + r for r in range(4)]

    results = reduce_all(PLACEMENTS_OF_4["4 x 1"], inputs, "sum")

    for result in results.values():
        assert result.tolist() == (4 * np.arange(size) + 6).tolist()


def test_allreduce_leaves_the_inputs_untouched() -> None:
    inputs = ragged_floats(4, 64)
    before = [x.copy() for x in inputs]

    reduce_all(PLACEMENTS_OF_4["2 x 2"], inputs, "sum")
    reduce_all(PLACEMENTS_OF_4["1 proxy x 4 ranks"], inputs, "sum")

    assert all(np.array_equal(a, b) for a, b in zip(inputs, before, strict=True))


@pytest.mark.parametrize("op", ["sum", "avg", "max"])
@pytest.mark.parametrize("placement", PLACEMENTS_OF_4.values(), ids=PLACEMENTS_OF_4.keys())
def test_allreduce_into_the_inputs_own_memory_gives_every_member_the_same_bits(
        placement: tuple[str, ...], op: str) -> None:
    inputs = ragged_floats(4, 1001)
    expected = in_rank_order(inputs, op)
    regions = [x.copy() for x in inputs]  # each member's region: its input, then its result

    results = run_on_proxies(placement, regions, lambda fabric, group, local: allreduce(
        fabric, HostBackend(), group, "t:1", local, op, into=list(local.values())))

    assert set(results.values()) == {None}
    for g, region in enumerate(regions):
        assert region.tobytes() == expected.tobytes(), f"rank {g}"


def shared_memory_allreduce(placement: tuple[str, ...], regions: list[np.ndarray], op: str,
                            attach_fails: str | None = None) -> dict[str, object]:
    """allreduce_shared on every proxy, each member's region standing in as `regions[g]`; a peer's
    region is attached by its announced name (`attach_fails`: the proxy that cannot attach any).
    What each proxy returned or raised: on success, its own members' regions as they were the moment
    it returned (its workers read them then)."""
    def collective(fabric: MemoryFabric, group: Group, local: dict[int, np.ndarray]) -> dict[int, bytes]:
        def attach(peer: str, member: int, ref: dict, dtype: np.dtype, count: int) -> np.ndarray:
            assert ref == {"region": member} and peer == group.owners[member]
            if fabric.me == attach_fails:
                raise OSError(f"no access to {peer}'s /proc")
            return regions[member]

        collectives.allreduce_shared(fabric, HostBackend(), group, "t:1", local, op,
                                     {g: {"region": g} for g in local}, attach)
        return {g: region.tobytes() for g, region in local.items()}

    return outcomes_on_proxies(placement, regions, collective)


def failures(outcomes: dict[str, object]) -> dict[str, str]:
    return {p: f"{type(o).__name__}: {o}" for p, o in outcomes.items() if isinstance(o, BaseException)}


@pytest.mark.parametrize("op", ["sum", "avg", "product"])
@pytest.mark.parametrize("placement", PLACEMENTS_OF_4.values(), ids=PLACEMENTS_OF_4.keys())
def test_allreduce_in_shared_memory_gives_the_rank_order_bits_on_every_placement(
        placement: tuple[str, ...], op: str) -> None:
    inputs = ragged_floats(4, 1001)
    expected = in_rank_order(inputs, op)
    regions = [x.copy() for x in inputs]

    outcomes = shared_memory_allreduce(placement, regions, op)

    assert failures(outcomes) == {}
    seen = {g: bits for result in outcomes.values() for g, bits in result.items()}  # type: ignore[union-attr]
    assert seen == {g: expected.tobytes() for g in range(4)}  # complete when each proxy returned


def test_allreduce_in_shared_memory_of_ranks_that_disagree_on_the_count_fails_on_every_proxy() -> None:
    regions = [np.ones(4, np.float32), np.ones(5, np.float32), np.ones(5, np.float32)]

    assert failures(shared_memory_allreduce(("a", "b", "b"), regions, "sum")) == {
        "a": "ValueError: ranks disagree on the element count or type (4 of float32 here): proxy b's ranks "
             "have 5 of float32",
        "b": "ValueError: ranks disagree on the element count or type (5 of float32 here): proxy a's ranks "
             "have 4 of float32"}
    assert [r.tolist() for r in regions] == [[1.0] * 4, [1.0] * 5, [1.0] * 5]  # nothing reduced


def test_allreduce_in_shared_memory_fails_on_every_proxy_when_one_cannot_attach_a_region() -> None:
    regions = [np.ones(4, np.float32) for _ in range(3)]

    assert failures(shared_memory_allreduce(("a", "b", "c"), regions, "sum", attach_fails="c")) == {
        "a": "ValueError: proxy c: cannot attach proxy a's shared memory: no access to a's /proc",
        "b": "ValueError: proxy c: cannot attach proxy a's shared memory: no access to a's /proc",
        "c": "ValueError: cannot attach proxy a's shared memory: no access to a's /proc"}


def test_a_peer_announcing_other_ranks_than_its_own_members_fails_the_allreduce_on_every_proxy() -> None:
    regions = [np.ones(4, np.float32), np.ones(4, np.float32)]
    group = Group("world", ("a", "b"))

    def collective(fabric: MemoryFabric, grp: Group, local: dict[int, np.ndarray]) -> None:
        announced = {0: {"region": 0}} if fabric.me == "b" else {g: {"region": g} for g in local}  # b lies
        collectives.allreduce_shared(fabric, HostBackend(), grp, "t:1", local, "sum", announced,
                                     lambda peer, member, ref, dtype, count: regions[member])

    outcomes = outcomes_on_proxies(group.owners, regions, collective)

    assert failures(outcomes) == {
        "a": "ValueError: cannot attach proxy b's shared memory: it announced the regions of ranks ['0'], "
             "not of its members [1]",
        "b": "ValueError: proxy a: cannot attach proxy b's shared memory: it announced the regions of ranks "
             "['0'], not of its members [1]"}
    assert [r[:2].tolist() for r in regions] == [[1.0, 1.0]] * 2  # a, which refused, reduced nothing


def test_allreduce_in_shared_memory_of_integers_refuses_avg_on_every_proxy() -> None:
    outcomes = shared_memory_allreduce(("a", "b"), [np.array([1, 2], np.int32), np.array([3, 4], np.int32)],
                                       "avg")

    refusal = "BackendError: avg needs a floating-point dtype, got int32"
    assert failures(outcomes) == {"a": refusal, "b": refusal}


def test_allreduce_avg_of_integers_is_refused_on_every_proxy() -> None:
    inputs = [np.array([1, 2], np.int32), np.array([3, 4], np.int32)]

    with pytest.raises(BackendError, match="^avg needs a floating-point dtype, got int32$"):
        reduce_all(("a", "b"), inputs, "avg")


# --- broadcast and allgather ----------------------------------------------------------------------


@pytest.mark.parametrize(("placement", "root"), [
    (("a", "a", "b", "b"), 2), (("a", "a", "b", "b"), 1), (("a", "b", "c", "d"), 3), (("a",) * 4, 0),
])
def test_broadcast_gives_every_proxy_the_roots_data(placement: tuple[str, ...], root: int) -> None:
    inputs = [np.arange(5, dtype=np.float32) + 100 * r for r in range(4)]

    results = run_on_proxies(placement, inputs, lambda fabric, group, local: broadcast(
        fabric, group, "t:1", local, root))

    for proxy, result in results.items():
        assert result.tolist() == (np.arange(5) + 100 * root).tolist(), f"proxy {proxy}"


@pytest.mark.parametrize("placement", PLACEMENTS_OF_4.values(), ids=PLACEMENTS_OF_4.keys())
def test_allgather_concatenates_in_group_rank_order(placement: tuple[str, ...]) -> None:
    inputs = [np.full(3, 10 * r + 1, dtype=np.int32) for r in range(4)]

    results = run_on_proxies(placement, inputs, lambda fabric, group, local: allgather(
        fabric, group, "t:1", local, np.dtype(np.int32)))

    for proxy, result in results.items():
        assert result.tolist() == [1, 1, 1, 11, 11, 11, 21, 21, 21, 31, 31, 31], f"proxy {proxy}"


def test_allgather_of_empty_contributions_is_a_barrier() -> None:
    inputs = [np.empty(0, np.uint8) for _ in range(3)]

    results = run_on_proxies(("a", "b", "a"), inputs, lambda fabric, group, local: allgather(
        fabric, group, "t:1", local, np.dtype(np.uint8)))

    assert {p: r.size for p, r in results.items()} == {"a": 0, "b": 0}


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 7, 8, 9, 16])
def test_barrier_returns_on_no_proxy_before_every_proxy_has_entered(count: int) -> None:
    owners = tuple(f"p{i}" for i in range(count))
    late = owners[count // 2]  # enters only once all the others are in the barrier
    entered: set[str] = set()
    cond = threading.Condition()
    sent: dict[str, int] = {}

    def collective(fabric: MemoryFabric, group: Group, local: dict[int, np.ndarray]) -> np.ndarray:
        send = fabric.send

        def counted(peer: str, tag: str, payload: Sequence) -> None:
            sent[fabric.me] = sent.get(fabric.me, 0) + 1
            send(peer, tag, payload)

        fabric.send = counted  # type: ignore[method-assign]
        with cond:
            if fabric.me == late:
                assert cond.wait_for(lambda: len(entered) == count - 1, timeout=10)
            entered.add(fabric.me)
            cond.notify_all()
        collectives.barrier(fabric, group, "t:1")
        with cond:
            assert entered == set(owners), f"{fabric.me} left the barrier before {set(owners) - entered}"
        return np.empty(0)

    run_on_proxies(owners, [np.empty(0)] * count, collective)

    rounds = (count - 1).bit_length()  # ceil(log2 count)
    assert sent == ({p: rounds for p in owners} if count > 1 else {})


def test_barrier_of_several_ranks_per_proxy_exchanges_between_proxies_only() -> None:
    results = run_on_proxies(("a", "a", "b", "c", "c"), [np.empty(0)] * 5,
                             lambda fabric, group, local: (collectives.barrier(fabric, group, "t:1"),
                                                           np.empty(0))[1])

    assert set(results) == {"a", "b", "c"}


# --- reduce, gather, scatter, all-to-all ----------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("root", [0, 3])
@pytest.mark.parametrize("placement", PLACEMENTS_OF_4.values(), ids=PLACEMENTS_OF_4.keys())
def test_reduce_gives_the_root_the_allreduce_bits_and_the_others_nothing(
        placement: tuple[str, ...], root: int, op: str) -> None:
    inputs = ragged_floats(4, 257, seed=5)

    results = run_on_proxies(placement, inputs, lambda fabric, group, local: collectives.reduce(
        fabric, HostBackend(), group, "t:1", local, op, root))

    assert results.pop(placement[root]).tobytes() == in_rank_order(inputs, op).tobytes()
    assert all(r is None for r in results.values())


@pytest.mark.parametrize("root", [0, 2])
@pytest.mark.parametrize("placement", PLACEMENTS_OF_4.values(), ids=PLACEMENTS_OF_4.keys())
def test_gather_concatenates_on_the_roots_proxy_in_group_rank_order(placement: tuple[str, ...],
                                                                   root: int) -> None:
    inputs = [np.array([r, 10 * r], np.int64) for r in range(4)]

    results = run_on_proxies(placement, inputs, lambda fabric, group, local: collectives.gather(
        fabric, group, "t:1", local, root))

    assert results.pop(placement[root]).tolist() == [0, 0, 1, 10, 2, 20, 3, 30]
    assert all(r is None for r in results.values())


@pytest.mark.parametrize("root", [0, 3])
@pytest.mark.parametrize("placement", PLACEMENTS_OF_4.values(), ids=PLACEMENTS_OF_4.keys())
def test_scatter_gives_each_member_its_slice_of_the_roots_data(placement: tuple[str, ...], root: int) -> None:
    data = np.arange(12, dtype=np.float32)
    group = Group("world", placement)

    results = run_on_proxies(placement, [data] * 4, lambda fabric, group, local: collectives.scatter(
        fabric, group, "t:1", local.get(root), root, sorted(local), 3, np.dtype(np.float32)))

    for proxy, slices in results.items():
        assert {g: s.tolist() for g, s in slices.items()} == {
            g: [3.0 * g, 3.0 * g + 1, 3.0 * g + 2] for g in group.members_of(proxy)}
    assert not any(np.shares_memory(s, data) for slices in results.values() for s in slices.values())


def alltoall_counts(ranks: int) -> list[list[int]]:
    """send[g][j]: rank g sends g + 2j elements to rank j (uneven, some empty)."""
    return [[(g + 2 * j) % 5 for j in range(ranks)] for g in range(ranks)]


def alltoall_inputs(send: list[list[int]]) -> list[np.ndarray]:
    """Element k of rank g's piece for rank j is 1000 g + 100 j + k."""
    return [np.concatenate([1000 * g + 100 * j + np.arange(n, dtype=np.float64) for j, n in enumerate(row)])
            for g, row in enumerate(send)]


@pytest.mark.parametrize("placement", {**PLACEMENTS_OF_4, **PLACEMENTS_OF_3}.values(),
                         ids={**PLACEMENTS_OF_4, **PLACEMENTS_OF_3}.keys())
def test_alltoall_with_uneven_counts_delivers_every_piece_in_rank_order(placement: tuple[str, ...]) -> None:
    ranks = len(placement)
    send = alltoall_counts(ranks)
    recv = [[send[g][j] for g in range(ranks)] for j in range(ranks)]
    inputs = alltoall_inputs(send)

    results = run_on_proxies(placement, inputs, lambda fabric, group, local: collectives.alltoall(
        fabric, group, "t:1", local, {g: send[g] for g in local}, {g: recv[g] for g in local}))

    got = {g: a.tolist() for slices in results.values() for g, a in slices.items()}
    assert got == {j: [1000 * g + 100 * j + k for g in range(ranks) for k in range(send[g][j])]
                   for j in range(ranks)}


@pytest.mark.parametrize("placement", [("a", "b"), ("a", "a")], ids=["2 proxies", "1 proxy"])
def test_alltoall_names_the_ranks_that_disagree_on_a_pieces_size(placement: tuple[str, ...]) -> None:
    send = [[1, 2], [3, 4]]
    recv = [[1, 3], [1, 4]]  # rank 1 expects 1 element from rank 0, which sends it 2
    inputs = alltoall_inputs(send)

    with pytest.raises(ValueError, match="^rank 0 sends 2 elements to rank 1, which expects 1$"):
        run_on_proxies(placement, inputs, lambda fabric, group, local: collectives.alltoall(
            fabric, group, "t:1", local, {g: send[g] for g in local}, {g: recv[g] for g in local}))


# --- bfloat16 -------------------------------------------------------------------------------------


def bf16_inputs(ranks: int, size: int, seed: int = 13) -> list[np.ndarray]:
    """bfloat16 values (raw bits) over many magnitudes, where rounding at each step would show."""
    return [float32_to_bfloat16(x) for x in ragged_floats(ranks, size, seed)]


def bf16_reference(inputs: list[np.ndarray], op: str) -> bytes:
    """torch's own conversions: float32 values of the inputs, reduced in rank order, rounded once."""
    torch = pytest.importorskip("torch")
    values = [torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16).float() for x in inputs]
    acc = values[0].clone()
    for v in values[1:]:
        acc = {"sum": torch.add, "avg": torch.add, "product": torch.mul, "min": torch.minimum,
               "max": torch.maximum}[op](acc, v)
    if op == "avg":
        acc = acc / len(values)
    return acc.to(torch.bfloat16).view(torch.int16).numpy().tobytes()


@pytest.mark.parametrize("op", OPS)
def test_bfloat16_allreduce_accumulates_in_float32_in_rank_order_and_rounds_once_on_every_placement(
        op: str) -> None:
    inputs = bf16_inputs(4, 1001)

    seen = {name: reduce_all(placement, inputs, op) for name, placement in PLACEMENTS_OF_4.items()}

    for name, results in seen.items():
        for proxy, result in results.items():
            assert result.dtype == BFLOAT16
            assert result.tobytes() == bf16_reference(inputs, op), f"{name}, proxy {proxy}"


def test_bfloat16_sum_rounding_once_differs_from_rounding_at_each_step() -> None:
    inputs = bf16_inputs(4, 1001)
    stepwise = inputs[0]
    for x in inputs[1:]:
        stepwise = float32_to_bfloat16(bfloat16_to_float32(stepwise) + bfloat16_to_float32(x))

    assert HostBackend().reduce(inputs, "sum").tobytes() != stepwise.tobytes()


def test_bfloat16_rounds_to_nearest_even_as_torch_does() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    values = np.concatenate([rng.integers(0, 1 << 32, 20000, dtype=np.uint64).astype(np.uint32),
                             np.array([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x00008000, 0x80000001],
                                      np.uint32)]).view(np.float32)
    values = values[~np.isnan(values)]

    ours = float32_to_bfloat16(values).view(np.uint16)

    assert ours.tobytes() == torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    assert bfloat16_to_float32(ours.view(BFLOAT16)).tobytes() == torch.from_numpy(
        ours.view(np.int16).copy()).view(torch.bfloat16).float().numpy().tobytes()


def test_bfloat16_nan_stays_nan_and_bits_refuse_integer_arithmetic() -> None:
    nan = float32_to_bfloat16(np.array([np.nan, -np.nan], np.float32))

    assert np.isnan(bfloat16_to_float32(nan)).all()
    assert HostBackend().reduce([nan, float32_to_bfloat16(np.ones(2, np.float32))], "sum").view(
        np.uint16).tolist() == nan.view(np.uint16).tolist()
    with pytest.raises(TypeError):
        np.add(nan, nan)


# --- the host backend -----------------------------------------------------------------------------


def test_reduce_combines_left_to_right_and_copies() -> None:
    parts = [np.array([1.0, 8.0]), np.array([2.0, 4.0]), np.array([3.0, 2.0])]

    result = HostBackend().reduce(parts, "avg")

    assert result.tolist() == [2.0, 14.0 / 3.0]
    assert parts[0].tolist() == [1.0, 8.0]


def test_reduce_refuses_an_unknown_operation_naming_the_supported_ones() -> None:
    with pytest.raises(BackendError) as info:
        HostBackend().reduce([np.ones(2)], "mean")

    assert str(info.value) == "reduction 'mean' not supported; supported: sum, avg, product, min, max"


@pytest.mark.parametrize("dtype", ["int8", "int64", "uint8", "bool"])
def test_reduce_refuses_avg_of_non_floating_dtypes(dtype: str) -> None:
    with pytest.raises(BackendError) as info:
        HostBackend().reduce([np.ones(2, dtype), np.ones(2, dtype)], "avg")

    assert str(info.value) == f"avg needs a floating-point dtype, got {dtype}"


def test_dtype_of_a_supported_name() -> None:
    assert dtype_of("float16") == np.dtype(np.float16)
    assert dtype_of("bool") == np.dtype(bool)
    assert dtype_of("bfloat16") == BFLOAT16 and BFLOAT16.itemsize == 2


@pytest.mark.parametrize("name", ["complex64", "uint16", "object", ""])
def test_dtype_of_an_unsupported_name_lists_the_supported_ones(name: str) -> None:
    with pytest.raises(BackendError) as info:
        dtype_of(name)

    assert str(info.value) == (f"dtype {name!r} not supported; supported: float32, float64, float16, "
                               "bfloat16, int8, int16, int32, int64, uint8, bool")


def test_backend_by_name() -> None:
    assert (backend("host").name, backend("host").exclusive) == ("host", False)
    assert (backend("cuda").name, backend("cuda").exclusive) == ("cuda", True)  # a GPU's ranks take turns
    with pytest.raises(BackendError) as info:
        backend("nccl")
    assert str(info.value) == "device backend 'nccl' not available here; available: host, cuda"


@pytest.mark.parametrize(("asked", "size"), [
    (0, MIN_REGION), (1, MIN_REGION), (MIN_REGION, MIN_REGION), (MIN_REGION + 1, 2 * MIN_REGION),
])
def test_regions_are_whole_mebibytes_of_shared_memory(asked: int, size: int) -> None:
    region = HostBackend().region(asked)
    try:
        assert region.size == size
        assert region.view.size == size
        region.array("int32", 2)[:] = [7, -1]
        assert region.view[:8].tobytes() == np.array([7, -1], np.int32).tobytes()
        assert region.fd >= 0
    finally:
        region.close()
    assert region.fd == -1


def test_allreduce_of_ranks_that_disagree_on_the_count_fails_on_every_proxy_without_hanging() -> None:
    inputs = [np.ones(2, np.float32), np.ones(3, np.float32)]
    group = Group("world", ("a", "b"))
    exchange = Exchange()
    errors: dict[str, str] = {}

    def proxy(me: str) -> None:
        try:
            allreduce(MemoryFabric(me, exchange), HostBackend(), group, "t:1",
                      {g: inputs[g] for g in group.members_of(me)}, "sum")
        except ValueError as exc:
            errors[me] = str(exc)

    threads = [threading.Thread(target=proxy, args=(p,)) for p in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    assert errors == {
        "a": "ranks disagree on the element count (2 here): proxy b sent 2 elements of chunk 0 for ranks "
             "[1], not 1 each",
        "b": "ranks disagree on the element count (3 here): proxy a sent 1 elements of chunk 0, not 2"}
    assert exchange.inbox == {}


def test_a_proxy_makes_each_communicators_group_once_per_generation(tmp_path) -> None:
    proxy = Proxy(1, 0, "n1/gpu0", HostBackend(), None, state_dir=tmp_path)
    proxy.configure("1", {0: "n2/gpu0", 1: "n2/gpu1"})  # serves no rank of it: no socket, no mesh
    proxy.comms["world"] = [0, 1]
    first = proxy.group("world")
    assert proxy.group("world") is first and first.owners == ("n2/gpu0", "n2/gpu1")
    proxy.configure("2", {0: "n2/gpu0", 1: "n2/gpu0"})  # a new generation places the ranks anew
    assert proxy.group("world").owners == ("n2/gpu0", "n2/gpu0")
