"""The transparent distributed barrier: its pure decisions, and a simulation of a whole cut."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from singularity_slurm.proxy.barrier import (
    Gate,
    Phase,
    Round,
    collective_channel,
    cut_targets,
    gate,
    local_maxima,
    p2p_channel,
    parked,
    parse_p2p,
)

# --- channels -------------------------------------------------------------------------------------


def test_a_communicator_is_one_collective_channel() -> None:
    assert collective_channel("world") == "world"


def test_point_to_point_channels_are_per_direction() -> None:
    assert p2p_channel("world", 0, 1) == "world|0>1"
    assert p2p_channel("world", 1, 0) == "world|1>0"
    assert p2p_channel("world", 0, 1) != collective_channel("world")


# --- gate -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("seq", "target"), [(1, 0), (1, 5), (5, 5), (6, 5), (1000, 1)])
def test_running_runs_every_operation(seq: int, target: int) -> None:
    assert gate(Phase.RUNNING, seq, target) == Gate.RUN


@pytest.mark.parametrize(("seq", "target"), [(1, 0), (1, 5), (5, 5), (6, 5)])
def test_draining_holds_every_new_operation(seq: int, target: int) -> None:
    assert gate(Phase.DRAINING, seq, target) == Gate.HOLD


@pytest.mark.parametrize("seq", [1, 4, 5])
def test_cutting_runs_operations_up_to_the_target(seq: int) -> None:
    assert gate(Phase.CUTTING, seq, 5) == Gate.RUN


@pytest.mark.parametrize("seq", [6, 7, 100])
def test_cutting_parks_operations_past_the_target(seq: int) -> None:
    assert gate(Phase.CUTTING, seq, 5) == Gate.PARK


def test_cutting_parks_the_first_operation_of_a_channel_nobody_had_used() -> None:
    assert gate(Phase.CUTTING, 1, 0) == Gate.PARK


@pytest.mark.parametrize(("seq", "target"), [(1, 0), (1, 5), (5, 5), (6, 5)])
def test_parked_parks_every_operation(seq: int, target: int) -> None:
    assert gate(Phase.PARKED, seq, target) == Gate.PARK


# --- local maxima and targets ---------------------------------------------------------------------


def test_local_maxima_take_the_highest_number_per_channel_over_ranks() -> None:
    issued = {0: {"world": 7, "world|0>1": 3}, 1: {"world": 8, "world|1>0": 2}, 2: {}}

    assert local_maxima(issued) == {"world": 8, "world|0>1": 3, "world|1>0": 2}


def test_local_maxima_of_ranks_that_issued_nothing_are_empty() -> None:
    assert local_maxima({}) == {}
    assert local_maxima({0: {}, 1: {}}) == {}


def test_cut_targets_take_the_highest_report_per_channel() -> None:
    reports = [{"world": 4, "tp0": 9}, {"world": 5}, {"tp1": 2, "world": 3}]

    assert cut_targets(reports) == {"world": 5, "tp0": 9, "tp1": 2}


def test_cut_targets_are_ints_even_from_decoded_json() -> None:
    targets = cut_targets([{"world": "4"}, {"world": 3.0}])

    assert targets == {"world": 4}
    assert type(targets["world"]) is int


def test_cut_targets_of_no_reports_are_empty() -> None:
    assert cut_targets([]) == {}


# --- parked ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("states", [
    {0: "parked"}, {0: "finished"}, {0: "parked", 1: "finished", 2: "parked"}, {},
])
def test_ranks_all_parked_or_finished_are_at_rest(states: dict[int, str]) -> None:
    assert parked(states) is True


@pytest.mark.parametrize("states", [
    {0: "busy"}, {0: "idle"}, {0: "absent"}, {0: "parked", 1: "busy"}, {0: "finished", 1: "absent"},
])
def test_a_rank_that_is_busy_idle_or_absent_is_not_at_rest(states: dict[int, str]) -> None:
    assert parked(states) is False


# --- the leader's round ---------------------------------------------------------------------------


def test_round_sets_targets_only_once_every_proxy_reported() -> None:
    round_ = Round(["n1/gpu0", "n1/gpu1", "n2/gpu0"])

    assert round_.report("n1/gpu0", {"world": 3}) is None
    assert round_.report("n2/gpu0", {"world": 4, "world|0>1": 1}) is None
    assert round_.targets is None
    assert round_.report("n1/gpu1", {"world": 2}) == {"world": 4, "world|0>1": 1}
    assert round_.targets == {"world": 4, "world|0>1": 1}


def test_round_gives_its_targets_once_and_a_late_report_does_not_move_them() -> None:
    round_ = Round(["a", "b"])
    round_.report("a", {"world": 1})
    assert round_.report("b", {"world": 1}) == {"world": 1}

    assert round_.report("b", {"world": 9}) is None
    assert round_.targets == {"world": 1}


def test_a_report_repeated_by_one_proxy_does_not_stand_in_for_another() -> None:
    round_ = Round(["a", "b"])

    assert round_.report("a", {"world": 1}) is None
    assert round_.report("a", {"world": 2}) is None
    assert round_.targets is None


def test_round_of_one_proxy_sets_targets_on_its_report() -> None:
    assert Round(["solo"]).report("solo", {}) == {}


def test_round_report_keeps_its_own_copy_of_the_maxima() -> None:
    round_ = Round(["a", "b"])
    maxima = {"world": 1}
    round_.report("a", maxima)
    maxima["world"] = 99

    assert round_.report("b", {"world": 2}) == {"world": 2}


def test_round_is_parked_only_when_every_proxy_parked() -> None:
    round_ = Round(["a", "b", "c"])

    assert round_.park("a") is False
    assert round_.park("a") is False
    assert round_.park("c") is False
    assert round_.park("b") is True


# --- a simulated cut ------------------------------------------------------------------------------
#
# Ranks run a program of operations, each on a channel. Rank 0 computes three times slower than the
# others. The drain reaches each proxy at its own tick, and the cut too, as control messages would. A
# collective completes once every member issued it; a send completes on issue (the receiving proxy
# buffers it, as the mesh does) and a receive once its send was issued.


@dataclass(frozen=True)
class Op:
    kind: str  # "collective" | "send" | "recv"
    channel: str


def ddp_step(rank: int, world: int) -> list[Op]:
    """Gradient allreduce in two buckets, then an allreduce inside a tensor-parallel pair."""
    return [Op("collective", collective_channel("world")), Op("collective", collective_channel("world")),
            Op("collective", collective_channel(f"tp{rank // 2}"))]


def pipeline_step(rank: int, world: int) -> list[Op]:
    """Two stages, as examples/train_pipeline.py: activations forward, their gradient back."""
    if rank == 0:
        return [Op("send", p2p_channel("world", 0, 1)), Op("recv", p2p_channel("world", 1, 0))]
    return [Op("recv", p2p_channel("world", 0, 1)), Op("send", p2p_channel("world", 1, 0))]


def ring_step(rank: int, world: int) -> list[Op]:
    """Send to the right neighbour, then receive from the left one (a ring exchange)."""
    right, left = (rank + 1) % world, (rank - 1) % world
    return [Op("send", p2p_channel("world", rank, right)), Op("recv", p2p_channel("world", left, rank))]


@dataclass
class Rank:
    rank: int
    program: list[Op]
    compute_ticks: int
    pc: int = 0
    issued: dict[str, int] = field(default_factory=dict)
    completed: dict[str, int] = field(default_factory=dict)
    in_flight: tuple[Op, int] | None = None
    computing: int = 0
    parked_at: tuple[Op, int] | None = None


@dataclass
class SimProxy:
    id: str
    ranks: list[int]
    phase: Phase = Phase.RUNNING
    targets: dict[str, int] = field(default_factory=dict)
    reported_parked: bool = False


@dataclass
class Outcome:
    ranks: dict[int, Rank]
    targets: dict[str, int]
    at_drain: dict[int, dict[str, int]]
    cut_reached: bool


def simulate(step, proxy_of: dict[int, str], drain_at: dict[str, int], cut_delay: dict[str, int],
             stuck: int | None = None, steps: int = 40, max_ticks: int = 2000) -> Outcome:
    world = len(proxy_of)
    ranks = {r: Rank(r, step(r, world) * steps, compute_ticks=3 if r == 0 else 0) for r in range(world)}
    members: dict[str, set[int]] = {}
    for rank in ranks.values():
        for op in rank.program:
            members.setdefault(op.channel, set()).add(rank.rank)
    proxies = {p: SimProxy(p, [r for r in ranks if proxy_of[r] == p]) for p in sorted(set(proxy_of.values()))}
    leader = Round(proxies)
    targets: dict[str, int] | None = None
    cut_arrives: dict[str, int] = {}
    at_drain: dict[int, dict[str, int]] = {}
    cut_reached = False

    def done(op: Op, seq: int) -> bool:
        if op.kind == "send":
            return True
        if op.kind == "recv":
            sender = int(op.channel.split("|")[1].split(">")[0])
            return ranks[sender].issued.get(op.channel, 0) >= seq
        return all(ranks[m].issued.get(op.channel, 0) >= seq for m in members[op.channel])

    for tick in range(max_ticks):
        for proxy in proxies.values():  # control messages arriving this tick
            if tick == drain_at[proxy.id]:
                proxy.phase = Phase.DRAINING
                for r in proxy.ranks:
                    at_drain[r] = dict(ranks[r].issued)
                result = leader.report(proxy.id, local_maxima({r: ranks[r].issued for r in proxy.ranks}))
                if result is not None:
                    targets = result
                    cut_arrives = {p: tick + 1 + cut_delay[p] for p in proxies}
            if cut_arrives.get(proxy.id) == tick and proxy.phase == Phase.DRAINING:
                assert targets is not None
                proxy.phase, proxy.targets = Phase.CUTTING, dict(targets)
        for rank in ranks.values():
            if rank.parked_at is not None or rank.rank == stuck and tick >= min(drain_at.values()) - 1:
                continue
            if rank.in_flight is not None:
                op, seq = rank.in_flight
                if done(op, seq):
                    rank.completed[op.channel] = seq
                    rank.in_flight, rank.pc, rank.computing = None, rank.pc + 1, rank.compute_ticks
                continue
            if rank.computing:
                rank.computing -= 1
                continue
            assert rank.pc < len(rank.program), "a rank ran out of program: lengthen the simulation"
            op = rank.program[rank.pc]
            proxy = proxies[proxy_of[rank.rank]]
            seq = rank.issued.get(op.channel, 0) + 1
            decision = gate(proxy.phase, seq, proxy.targets.get(op.channel, 0))
            if decision == Gate.RUN:
                rank.issued[op.channel] = seq
                rank.in_flight = (op, seq)
            elif decision == Gate.PARK:
                rank.parked_at = (op, seq)
        for proxy in proxies.values():
            states = {r: "parked" if ranks[r].parked_at else "busy" for r in proxy.ranks}
            if proxy.phase == Phase.CUTTING and not proxy.reported_parked and parked(states):
                proxy.reported_parked = True
                if not leader.park(proxy.id, audit(proxy, ranks)):
                    continue
                raised = leader.settle()
                if raised is None:
                    cut_reached = True
                    break
                targets = raised  # undelivered messages: their receivers run on
                for other in proxies.values():
                    other.targets, other.reported_parked = dict(raised), False
                for rank in ranks.values():
                    if rank.parked_at and rank.parked_at[1] <= raised.get(rank.parked_at[0].channel, 0):
                        rank.parked_at = None
        if cut_reached:
            break
    return Outcome(ranks, targets or {}, at_drain, cut_reached)


def audit(proxy: SimProxy, ranks: dict[int, Rank]) -> dict:
    """What a proxy reports with PARKED (see barrier.refine); channels use world ranks."""
    sent: dict[str, int] = {}
    received: dict[str, int] = {}
    parked_ops = []
    for r in proxy.ranks:
        for channel, n in ranks[r].completed.items():
            parsed = parse_p2p(channel)
            if parsed is not None:
                (sent if parsed[1] == r else received)[channel] = n
        if ranks[r].parked_at is not None:
            op, seq = ranks[r].parked_at
            parked_ops.append({"op": [op.channel, seq], "dst_of": [["world", r]]})
    return {"sent": sent, "received": received, "parked": parked_ops}


def assert_consistent_cut(outcome: Outcome) -> None:
    """Every rank parked at target + 1 of a channel, with exactly `target` ops done on each channel."""
    assert outcome.cut_reached
    for rank in outcome.ranks.values():
        assert rank.parked_at is not None, f"rank {rank.rank} did not park"
        assert rank.in_flight is None
        channels = {op.channel for op in rank.program}
        assert {c: rank.completed.get(c, 0) for c in channels} == {
            c: outcome.targets.get(c, 0) for c in channels}, f"rank {rank.rank}"
        assert rank.issued == rank.completed
        op, seq = rank.parked_at
        assert seq == outcome.targets.get(op.channel, 0) + 1


FOUR_RANKS_TWO_PROXIES = {0: "p0", 1: "p0", 2: "p1", 3: "p1"}
TIMINGS = [({"p0": t, "p1": t + d}, {"p0": c, "p1": 0})
           for t in range(0, 60, 5) for d in (0, 3) for c in (0, 2)]


@pytest.mark.parametrize(("drain_at", "cut_delay"), TIMINGS)
def test_simulated_ddp_cut_parks_every_rank_at_target_plus_one_on_every_channel(
        drain_at: dict[str, int], cut_delay: dict[str, int]) -> None:
    assert_consistent_cut(simulate(ddp_step, FOUR_RANKS_TWO_PROXIES, drain_at, cut_delay))


def test_simulated_ddp_cut_is_reached_with_the_slow_rank_behind_at_the_drain() -> None:
    outcome = simulate(ddp_step, FOUR_RANKS_TWO_PROXIES, {"p0": 12, "p1": 12}, {"p0": 0, "p1": 0})

    at_drain = {r: issued.get("world", 0) for r, issued in outcome.at_drain.items()}
    assert at_drain == {0: 2, 1: 3, 2: 3, 3: 3}  # rank 0 has not yet issued the 3rd allreduce
    assert outcome.targets == {"world": 3, "tp0": 1, "tp1": 1}
    assert_consistent_cut(outcome)
    assert {r: rank.parked_at for r, rank in outcome.ranks.items()} == {
        r: (Op("collective", "world"), 4) for r in range(4)}


@pytest.mark.parametrize(("drain_at", "cut_delay"), TIMINGS)
def test_simulated_two_stage_pipeline_cut_leaves_no_message_in_flight(
        drain_at: dict[str, int], cut_delay: dict[str, int]) -> None:
    assert_consistent_cut(simulate(pipeline_step, {0: "p0", 1: "p1"}, drain_at, cut_delay))


def test_simulated_ring_exchange_cut_leaves_no_message_in_flight() -> None:
    # At the drain rank 3 has sent 3 messages to rank 0; the slow rank 0 has sent 1 to rank 1 and
    # received 1. Targets: 0>1 = 2 (rank 1 waits in its 2nd receive), 3>0 = 3. Rank 0 runs send 2 and
    # receive 2, then parks on its 3rd send (past 2), never receiving the 3rd message rank 3 sent:
    # rank 3 completed 3 ops on 3>0, rank 0 completed 2.
    outcome = simulate(ring_step, FOUR_RANKS_TWO_PROXIES, {"p0": 10, "p1": 10}, {"p0": 0, "p1": 0})

    assert_consistent_cut(outcome)


def test_simulated_cut_is_not_reached_while_a_rank_issues_nothing() -> None:
    outcome = simulate(ddp_step, FOUR_RANKS_TWO_PROXIES, {"p0": 20, "p1": 20}, {"p0": 0, "p1": 0},
                       stuck=3, max_ticks=500)

    assert not outcome.cut_reached
    assert outcome.ranks[3].parked_at is None
