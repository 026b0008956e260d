"""Real device proxies and real torch.distributed workers, without Slurm (see `proxyjob`).

Every operation of the backend once, the distributed cut, the proxy spoken to directly, generations.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from proxyjob import Job, remove_state, state_folder

from singularity_slurm.config import ProxyConfig
from singularity_slurm.interpose.pyhook._singularity_worker import wire
from singularity_slurm.interpose.pyhook._singularity_worker.proxy_client import ProxyClient
from singularity_slurm.proxy.daemon import Proxy, ProxyError
from singularity_slurm.proxy.hal import HostBackend
from singularity_slurm.proxy.rendezvous import MemoryRendezvous

WORKER = r'''
import json, os, sys, time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from _singularity_worker import torch_backend

mode, out = sys.argv[1], Path(sys.argv[2])
dist.init_process_group("gloo", init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
result = {"backend": dist.get_backend()}


def mark(name):
    (out / f"{name}-{rank}").touch()


def until(name):
    while not (out / name).exists():
        time.sleep(0.02)


def f32(*values):
    return torch.tensor(values, dtype=torch.float32)


def record(name, operation):
    """The operation's result, or its error: an unsupported call fails on every rank alike."""
    try:
        result[name] = operation()
    except Exception as exc:
        result[name] = f"{type(exc).__name__}: {exc}"


def reduced(op):
    t = f32(rank + 1, -0.5 * (rank + 1))
    dist.all_reduce(t, op=op)
    return t.tolist()


def int64_sum():
    t = torch.tensor([rank, 1 << 40], dtype=torch.int64)
    dist.all_reduce(t)
    return t.tolist()


def broadcast():
    t = torch.arange(4, dtype=torch.float64) + 100 * rank
    dist.broadcast(t, src=world - 1)
    return t.tolist()


def all_gather():
    gathered = [torch.zeros(2, dtype=torch.int32) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([rank, 10 * rank], dtype=torch.int32))
    return [g.tolist() for g in gathered]


def all_gather_into_tensor():
    flat = torch.empty(2 * world)
    dist.all_gather_into_tensor(flat, f32(rank, rank + 0.5))
    return flat.tolist()


def reduce_scatter():
    t = torch.empty(2)
    dist.reduce_scatter(t, [torch.full((2,), float(10 * rank + j)) for j in range(world)])
    return t.tolist()


def reduce_scatter_tensor():
    t = torch.empty(2)
    dist.reduce_scatter_tensor(t, torch.arange(2.0 * world) * (rank + 1))
    return t.tolist()


def barrier():
    dist.barrier()
    return True


def ring():
    dist.send(f32(1.5 * rank), dst=(rank + 1) % world)
    t = torch.empty(1)
    dist.recv(t, src=(rank - 1) % world)
    return t.tolist()


def transposed():
    m = (torch.arange(12.0).reshape(3, 4) * (rank + 1)).t()
    dist.all_reduce(m)
    return [m.tolist(), m.is_contiguous()]


def strided():
    big = torch.full((2, 6), -1.0)
    big[:, ::2] = float(rank + 1)
    dist.all_reduce(big[:, ::2])
    return big.tolist()


def in_issue_order():
    """A broadcast issued after an async allreduce of the same strided tensor sends its result."""
    t = (torch.arange(6.0).reshape(2, 3) * (rank + 1)).t()
    work = dist.all_reduce(t, async_op=True)
    dist.broadcast(t, src=0)
    work.wait()
    return t.tolist()


def subgroup():
    pair = dist.new_group([0, world - 1])
    if rank not in (0, world - 1):
        return None
    t = f32(rank + 1)
    dist.all_reduce(t, group=pair)
    return t.tolist()


def gather():
    gathered = [f32(0) for _ in range(world)] if rank == 1 else None
    dist.gather(f32(rank + 0.25), gathered, dst=1)
    return None if gathered is None else [g.tolist() for g in gathered]


def bfloat16():
    t = torch.tensor([1.0, 0.00390625 * (rank + 1)], dtype=torch.bfloat16)
    dist.all_reduce(t)
    return t.float().tolist()


def recv_any():
    dist.recv(torch.empty(1))


if mode == "ops":
    for name, op in (("sum", ReduceOp.SUM), ("avg", ReduceOp.AVG), ("max", ReduceOp.MAX),
                     ("min", ReduceOp.MIN), ("product", ReduceOp.PRODUCT)):
        record(name, lambda: reduced(op))
    for operation in (int64_sum, broadcast, all_gather, all_gather_into_tensor, reduce_scatter,
                      reduce_scatter_tensor, barrier, ring, transposed, strided, in_issue_order, subgroup,
                      gather, bfloat16,
                      recv_any):
        record(operation.__name__, operation)
elif mode == "idle":
    t = torch.ones(2)
    dist.all_reduce(t)
    mark("waiting")
    if rank != 0:
        until("go")
    dist.barrier()
elif mode == "loop":
    i, bad = 0, []
    while True:
        t = torch.full((3,), float(rank + i))
        dist.all_reduce(t)
        if t.tolist() != [float(sum(r + i for r in range(world)))] * 3:
            bad.append([i, t.tolist()])
        stop = torch.tensor([1.0 if (out / "stop").exists() else 0.0])
        dist.all_reduce(stop, op=ReduceOp.MAX)
        i += 1
        if i == 1:
            mark("looping")
        if stop.item():
            break
    result.update(iterations=i, bad=bad)
elif mode == "turns":
    spans, bad = [], []
    for i in range(20):
        began = time.monotonic()
        x = torch.full((4096,), float(rank + i))
        for _ in range(50):
            x = x * 1.0001 + 0.5
        spans.append([began, time.monotonic()])
        t = torch.full((3,), float(rank + i))
        dist.all_reduce(t, async_op=True).wait()
        if t.tolist() != [float(sum(r + i for r in range(world)))] * 3:
            bad.append([i, t.tolist()])
    result.update(spans=spans, bad=bad)
elif mode == "outside":
    t = f32(rank)
    dist.all_reduce(t)
    mark("here")  # each rank waits for the other's file: the first to hold the turn would hang alone
    until(f"here-{1 - rank}")
    dist.all_reduce(t)
    result["after"] = t.tolist()
elif mode == "stall":
    t = f32(rank)
    dist.all_reduce(t)
    if rank == world - 1:
        until("go")  # computes for as long as the test likes, issuing nothing
    t = f32(rank + 1)
    dist.all_reduce(t)
    result["after"] = t.tolist()
result["parks"] = torch_backend.client().parks
(out / f"result-{rank}.json").write_text(json.dumps(result))
'''


LIGHT_WORKER = r"""
import ctypes, sys
from pathlib import Path

from singularity_slurm.interpose.pyhook._singularity_worker.proxy_client import ProxyClient

job, out, rank_dir = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
client = ProxyClient(job, 0, 1, rank_dir)
client.register_comm("world", [0])
value = (ctypes.c_float * 1)(1.0)
span = (ctypes.addressof(value), 4)
while not (out / "stop").exists():
    client.call({"op": "allreduce", "comm": "world", "dtype": "float32", "count": 1, "reduce": "sum"},
                [span], [span], 4)
client.close()
"""


def socket_inodes(pid: int) -> set[str]:
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(target[len("socket:["):-1])
    return found


def table_inodes(*tables: str) -> set[str]:
    inodes = set()
    for table in tables:
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            inodes.add(fields[9] if "tcp" in table else fields[6])
    return inodes


def holds_proxy_resources(pid: int) -> bool:
    """Whether a worker holds any socket or still maps memory a proxy shared with it."""
    return bool(socket_inodes(pid)) or "singularity-proxy" in Path(f"/proc/{pid}/maps").read_text()


def refused(address: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(address)
        except (ConnectionRefusedError, FileNotFoundError):
            return True
    return False


# --- workers through the proxies ------------------------------------------------------------------


@pytest.fixture(scope="module", params=[{"time_slicing": "concurrent"}, {"time_slicing": "turns"},
                                        {"time_slicing": "concurrent", "shared_memory": False}],
                ids=["concurrent", "turns", "over-the-mesh"])
def ops_results(tmp_path_factory: pytest.TempPathFactory, request) -> Iterator[dict[int, dict]]:
    """Every operation of the backend, once, by three workers on two proxies (two ranks on one, at
    once or taking turns; the proxies reducing from each other's memory, or sending over the mesh)."""
    run = Job(tmp_path_factory.mktemp("ops"), {0: "p0", 1: "p0", 2: "p1"},
              limits=ProxyConfig(**request.param))
    try:
        run.start(WORKER, "ops")
        results = run.results()
        # both proxies took every allreduce the same way: from each other's memory, or over the mesh
        (shared,) = {proxy.stats["allreduce"]["shared_memory"] for proxy in run.proxies.values()}
        assert shared == 0 if request.param.get("shared_memory") is False else shared >= 5
        yield results
    finally:
        run.close()


def test_torch_collectives_through_proxies_give_exact_results(ops_results: dict[int, dict]) -> None:
    for rank, result in ops_results.items():
        supported = {k: v for k, v in result.items()
                     if k not in ("all_gather_into_tensor", "reduce_scatter_tensor")}
        assert supported == {
            "backend": "singularity",
            "sum": [6.0, -3.0], "avg": [2.0, -1.0], "max": [3.0, -0.5], "min": [1.0, -1.5],
            "product": [6.0, -0.75],
            "int64_sum": [3, 3 << 40],
            "broadcast": [200.0, 201.0, 202.0, 203.0],
            "all_gather": [[0, 0], [1, 10], [2, 20]],
            "reduce_scatter": [30.0 + 3 * rank] * 2,
            "barrier": True,
            "ring": [1.5 * ((rank - 1) % 3)],
            "transposed": [(np.arange(12.0).reshape(3, 4) * 6).T.tolist(), False],
            "strided": [[6.0, -1.0] * 3] * 2,
            "in_issue_order": (np.arange(6.0).reshape(2, 3) * 6).T.tolist(),
            "subgroup": [4.0] if rank in (0, 2) else None,
            "gather": [[0.25], [1.25], [2.25]] if rank == 1 else None,
            "bfloat16": [3.0, 0.0234375],
            "recv_any": "ProxyError: recv from any source is not supported by the singularity backend: "
                        "receive from a named source rank instead (supported: allreduce, reduce, broadcast, "
                        "allgather, gather, scatter, reduce_scatter, alltoall, barrier, monitored_barrier, "
                        "send, recv)",
            "parks": 0,
        }, f"rank {rank}"


def test_torch_single_tensor_gather_and_scatter_through_proxies(ops_results: dict[int, dict]) -> None:
    assert {r: (res["all_gather_into_tensor"], res["reduce_scatter_tensor"])
            for r, res in ops_results.items()} == {
        r: ([0.0, 0.5, 1.0, 1.5, 2.0, 2.5], [12.0 * r, 12.0 * r + 6]) for r in range(3)}


def test_ranks_sharing_a_device_compute_one_at_a_time_when_they_take_turns(job) -> None:
    run = job({0: "p0", 1: "p0", 2: "p0", 3: "p1"}, limits=ProxyConfig(time_slicing="turns"))
    run.start(WORKER, "turns")
    results = run.results()

    assert {r: res["bad"] for r, res in results.items()} == {r: [] for r in range(4)}
    shared = sorted((began, ended, rank) for rank in (0, 1, 2) for began, ended in results[rank]["spans"])
    overlaps = [(a, b) for a, b in zip(shared, shared[1:], strict=False) if b[0] < a[1]]
    assert not overlaps, f"ranks of one device computed at once: {overlaps[:3]}"
    turns = run.proxies["p0"].status()["turns"]
    assert turns["holder"] is None and turns["waiting"] == []  # every rank gave its turn back at its end
    assert turns["handovers"] >= 20  # every iteration passed the device on
    assert run.proxies["p1"].status()["turns"] is None  # one rank there: nothing to take turns for
    assert run.proxies["p0"].stats_report()["turn"]["count"] >= 3 * 21


def test_a_turn_held_outside_collectives_lapses_and_the_waiting_rank_runs_beside_it(job) -> None:
    run = job({0: "p0", 1: "p0"}, limits=ProxyConfig(time_slicing="turns", turn_lapse_s=1))
    run.start(WORKER, "outside")
    results = run.results()

    assert {r: res["after"] for r, res in results.items()} == {0: [2.0], 1: [2.0]}
    assert run.proxies["p0"].status()["turns"]["lapses"] == 1
    assert run.proxies["p0"].stats_report()["turn"]["lapses"] == 1


def test_ranks_sharing_a_device_at_once_overlap_and_get_the_same_numbers(job) -> None:
    run = job({0: "p0", 1: "p0", 2: "p0", 3: "p1"}, limits=ProxyConfig(time_slicing="concurrent"))
    run.start(WORKER, "turns")
    results = run.results()

    assert {r: res["bad"] for r, res in results.items()} == {r: [] for r in range(4)}
    assert run.proxies["p0"].status()["turns"] is None
    assert "turn" not in run.proxies["p0"].stats_report()


def test_a_worker_waiting_in_a_collective_holds_one_unix_socket_and_no_tcp_socket(job) -> None:
    run = job({0: "p0", 1: "p1"})
    run.start(WORKER, "idle")
    run.wait_for_files("waiting")
    run.wait_for("rank 0 in its barrier", lambda: run.proxies["p0"].status()["ranks"] == {"0": "busy"})

    try:
        tcp = table_inodes("/proc/net/tcp", "/proc/net/tcp6")
        unix = table_inodes("/proc/net/unix")
        for rank, proc in run.workers.items():
            sockets = socket_inodes(proc.pid)
            assert len(sockets) == 1, f"rank {rank}: {sockets}"
            assert sockets <= unix, f"rank {rank}"
            assert not sockets & tcp, f"rank {rank} holds a TCP socket"
        assert tcp, "the proxies' own mesh is TCP: the table cannot be empty"
    finally:
        run.touch("go")

    assert {r["parks"] for r in run.results().values()} == {0}


# --- the distributed cut --------------------------------------------------------------------------


@pytest.mark.parametrize("slicing", ["concurrent", "turns"])
def test_quiesce_parks_every_rank_without_sockets_and_resume_lets_the_job_finish(job, slicing: str) -> None:
    run = job({0: "p0", 1: "p0", 2: "p1"}, limits=ProxyConfig(time_slicing=slicing))
    run.start(WORKER, "loop")
    run.wait_for_files("looping")

    answers = run.on_every_proxy(lambda p: p.quiesce(timeout=30))

    assert all(isinstance(a, dict) and a["idle"] is False for a in answers.values()), answers
    assert {p.id: p.status()["phase"] for p in run.proxies.values()} == {"p0": "parked", "p1": "parked"}
    assert {p.id: p.status()["ranks"] for p in run.proxies.values()} == {
        "p0": {"0": "parked", "1": "parked"}, "p1": {"2": "parked"}}
    # Both asked for the cut at once and got one round; a request its sender sent before it heard of
    # that cut is answered with it, and takes no parked proxy back to draining.
    leader = run.proxies[run.proxies["p1"].leader]
    assert leader.rounds_done == 1 and {p.cut_seen for p in run.proxies.values()} == {1}
    leader._on_control("p1", {"ctl": "drain_request", "from": "p1", "seen": 0})
    assert leader.round is None and leader.rounds_done == 1
    assert {p.status()["phase"] for p in run.proxies.values()} == {"parked"}
    # the proxies reduced from each other's regions, and let go of them at the cut
    assert all(p.stats["allreduce"]["shared_memory"] > 0 and p.peer_regions.maps == {}
               for p in run.proxies.values())
    for proxy in run.proxies.values():  # every rank did exactly the cut's number of operations
        for rank in proxy.local_ranks:
            assert proxy.issued[rank] == proxy.targets, f"rank {rank}"
    # A worker lets go of both once it has read its `park` answer (see the xfail test below).
    run.wait_for("every rank to let go of the proxy", lambda: not any(
        holds_proxy_resources(proc.pid) for proc in run.workers.values()), timeout=10)
    for rank in run.workers:
        assert refused(run.address(rank)), f"rank {rank}'s name is still served"

    assert run.on_every_proxy(lambda p: p.resume()) == {"p0": {"resumed": [0, 1]}, "p1": {"resumed": [2]}}
    run.wait_for("every rank reconnected", lambda: all(
        s not in ("parked", "absent") for p in run.proxies.values() for s in p.status()["ranks"].values()))
    run.touch("stop")
    results = run.results()

    assert {r: (res["bad"], res["parks"]) for r, res in results.items()} == {r: ([], 1) for r in range(3)}
    assert len({res["iterations"] for res in results.values()}) == 1
    assert {p.status()["phase"] for p in run.proxies.values()} == {"running"}


def test_quiesce_gives_up_when_a_rank_issues_nothing_and_the_job_continues(job) -> None:
    run = job({0: "p0", 1: "p1"})
    run.start(WORKER, "stall")
    # in its second allreduce (busy in the first, it would reach the cut's targets as rank 1 joins)
    run.wait_for("rank 0 waiting for the computing rank 1", lambda: (
        run.proxies["p0"].status()["ranks"], run.proxies["p1"].status()["ranks"],
        sum(run.proxies["p0"].issued[0].values()), sum(run.proxies["p1"].issued[1].values())) == (
        {"0": "busy"}, {"1": "idle"}, 2, 1))

    started = time.monotonic()
    answers = run.on_every_proxy(lambda p: p.quiesce(timeout=2))

    assert 2 <= time.monotonic() - started < 15
    assert all(isinstance(a, ProxyError) for a in answers.values()), answers
    assert re.fullmatch(r"no consistent cut within 2s \(phase (cutting|running), ranks not at rest: "
                        r"\{0: 'busy'\}\); the job continues", str(answers["p0"]))
    assert re.fullmatch(r"no consistent cut within 2s \(phase (cutting|running), ranks not at rest: "
                        r"\{1: 'idle'\}\); the job continues", str(answers["p1"]))
    run.wait_for("the cut to be aborted", lambda: {p.status()["phase"] for p in run.proxies.values()} == {
        "running"})
    run.touch("go")
    results = run.results()

    assert {r: (res["after"], res["parks"]) for r, res in results.items()} == {0: ([3.0], 0), 1: ([3.0], 0)}


# --- one proxy, spoken to directly ----------------------------------------------------------------


class RawRank:
    """A worker's connection without the client library: frames as given."""

    def __init__(self, address: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.sock.connect(address)
                break
            except (ConnectionRefusedError, FileNotFoundError):
                assert time.monotonic() < deadline, f"{address} is not served"
                time.sleep(0.02)
        self.reader = wire.Reader(self.sock)

    def ask(self, message: dict) -> dict:
        wire.send(self.sock, message)
        reply, fds = self.reader.recv()
        for fd in fds:
            os.close(fd)
        return reply

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def solo(job) -> Iterator[Job]:
    """A job of two ranks on one proxy, no workers."""
    yield job({0: "p0", 1: "p0"})


def test_the_proxy_is_served_by_root(solo: Job) -> None:
    rank = RawRank(solo.address(0))
    try:
        assert wire.peer_uid(rank.sock) == 0 or os.getuid() != 0
        assert rank.ask({"op": "hello", "rank": 0, "world_size": 2}) == {
            "ok": True, "generation": "1", "proxy": "p0", "turns": False, "gpu": None}
    finally:
        rank.close()


def test_a_first_hello_on_a_shared_device_waits_for_the_turn_its_holder_hands_on(job) -> None:
    run = job({0: "p0", 1: "p0"}, limits=ProxyConfig(time_slicing="turns"))
    first, second = RawRank(run.address(0)), RawRank(run.address(1))
    try:
        assert first.ask({"op": "hello", "rank": 0, "world_size": 2, "turn": True})["turns"] is True
        answers: list[dict] = []
        waiter = threading.Thread(target=lambda: answers.append(
            second.ask({"op": "hello", "rank": 1, "world_size": 2, "turn": True})))
        waiter.start()
        waiting = {"holder": 0, "waiting": [1], "handovers": 0, "lapses": 0}
        run.wait_for("rank 1 waiting for the turn", lambda: run.proxies["p0"].status()["turns"] == waiting)
        assert answers == []

        wire.send(first.sock, {"op": "bye"})  # the holder goes: its turn goes on
        waiter.join(timeout=10)
        assert answers and answers[0]["ok"] is True
        assert run.proxies["p0"].status()["turns"] == {"holder": 1, "waiting": [], "handovers": 1,
                                                       "lapses": 0}
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize(("hello", "error"), [
    ({"op": "hello", "rank": 1, "world_size": 2}, "hello: connected as rank 0 but said rank 1"),
    ({"op": "hello", "rank": 0, "world_size": 3}, "hello: world size 3 differs from the job's 2"),
    ({"op": "hello", "rank": 0, "world_size": 2, "comms": {"world": [0, 5]}},
     "hello: communicator world: ranks must be ranks of the job, got [0, 5]"),
])
def test_a_hello_that_does_not_match_the_job_is_refused(solo: Job, hello: dict, error: str) -> None:
    rank = RawRank(solo.address(0))
    try:
        assert rank.ask(hello) == {"ok": False, "error": error}
    finally:
        rank.close()


def test_operations_that_cannot_be_served_are_refused_and_the_connection_goes_on(solo: Job) -> None:
    rank = RawRank(solo.address(0))
    try:
        assert rank.ask({"op": "hello", "rank": 0, "world_size": 2, "comms": {"world": [0, 1]}})["ok"]
        assert rank.ask({"op": "allreduce", "comm": "other", "dtype": "float32", "count": 1,
                         "reduce": "sum"}) == {
            "ok": False, "error": "allreduce: communicator other was not registered"}
        assert rank.ask({"op": "comm", "comm": "world", "ranks": [1, 0]}) == {
            "ok": False, "error": "comm: communicator world has ranks [0, 1], rank 0 says [1, 0]"}
        assert rank.ask({"op": "allgatherv", "comm": "world"}) == {
            "ok": False, "error": "allgatherv: unknown operation 'allgatherv'"}
        assert rank.ask({"op": "map", "bytes": 4096})["bytes"] == 1 << 20
        assert rank.ask({"op": "comm", "comm": "self", "ranks": [0]}) == {"ok": True}
        refusal = rank.ask({"op": "allreduce", "comm": "self", "dtype": "complex64", "count": 1,
                            "reduce": "sum"})
        assert refusal["ok"] is False and refusal["error"].startswith("allreduce: ")
        assert "complex64" in refusal["error"]
        assert rank.ask({"op": "comm", "comm": "self", "ranks": [0]}) == {"ok": True}
    finally:
        rank.close()


def test_regions_a_rank_keeps_the_descriptors_of_hold_no_memory_of_the_proxys(solo: Job) -> None:
    """A hostile rank asks for region after region and keeps every descriptor, with the proxy
    writing a result into each: once a region is replaced, or the connection ends, its pages are
    freed, so the memory the proxy faulted in for the rank is its current region at most."""
    rank = RawRank(solo.address(0))
    kept: list[int] = []
    count = (8 << 20) // 4  # 8 MiB of float32

    def ask_keep(message: dict) -> dict:
        wire.send(rank.sock, message)
        reply, fds = rank.reader.recv()
        kept.extend(fds)
        return reply

    try:
        assert rank.ask({"op": "hello", "rank": 0, "world_size": 2})["ok"]
        assert rank.ask({"op": "comm", "comm": "self", "ranks": [0]}) == {"ok": True}
        for _ in range(4):
            assert ask_keep({"op": "map", "bytes": count * 4})["bytes"] == 8 << 20
            reply = rank.ask({"op": "allreduce", "comm": "self", "dtype": "float32", "count": count,
                              "reduce": "sum"})
            assert reply["ok"], reply
        resident = [os.fstat(fd).st_blocks * 512 for fd in kept]
        assert resident[:-1] == [0, 0, 0], resident  # the replaced ones: freed, though still held
        assert resident[-1] == 8 << 20  # the one in use: the proxy wrote every page of the result
        rank.close()
        solo.wait_for("the connection's end", lambda: os.fstat(kept[-1]).st_blocks == 0)
    finally:
        rank.close()
        for fd in kept:
            os.close(fd)


def test_a_connection_from_another_user_is_refused(job) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to connect as another user")
    run = job({0: "p0"}, uid=4242)
    probe = ("import socket, struct\n"
             "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(10)\n"
             f"path = {run.address(0)!r}\n"
             "body = b'{\"op\":\"hello\",\"rank\":0,\"world_size\":1}'\n"
             "try:\n"
             "    s.connect(path)\n"
             "    s.sendall(struct.pack('!I', len(body)) + body)\n"
             "    print('dropped' if s.recv(100) == b'' else 'answered')\n"
             "except PermissionError:\n"
             "    print('denied')\n"
             "except (BrokenPipeError, ConnectionResetError):\n"
             "    print('dropped')\n")

    as_nobody = subprocess.run([sys.executable, "-c", probe], user=65534, capture_output=True, text=True,
                               timeout=30, cwd="/")
    as_job_user = subprocess.run([sys.executable, "-c", probe], user=4242, capture_output=True, text=True,
                                 timeout=30, cwd="/")

    assert as_nobody.stdout == "denied\n", as_nobody.stderr  # the socket is the job user's, mode 0600
    assert as_job_user.stdout == "answered\n", as_job_user.stderr


# --- point to point across a cut ------------------------------------------------------------------


def p2p(client: ProxyClient, op: str, peer: int, array: np.ndarray) -> None:
    span = (array.ctypes.data, array.nbytes)
    client.call({"op": op, "comm": "world", "dtype": "float32", "count": array.size, "peer": peer},
                [span] if op == "send" else [], [span] if op == "recv" else [], array.nbytes)


def test_a_ring_exchange_cut_leaves_no_message_in_flight(job) -> None:
    run = job({0: "p0", 1: "p1"})
    run.wait_for("the mesh", lambda: all(p.status()["ready"] for p in run.proxies.values()))
    clients = {r: ProxyClient(run.id, r, 2, run.rank_dir) for r in (0, 1)}
    for client in clients.values():
        client.register_comm("world", [0, 1])
    got = {0: np.zeros(1, np.float32), 1: np.zeros(1, np.float32)}
    p2p(clients[1], "send", 0, np.array([1.0], np.float32))  # the fast rank 1 sends its step's message
    quiesced = threading.Thread(target=run.on_every_proxy, args=(lambda p: p.quiesce(timeout=30),),
                                daemon=True)
    quiesced.start()
    run.wait_for("the cut", lambda: {p.phase for p in run.proxies.values()} == {"cutting"})
    # The slow rank 0 now starts its step: send to 1, then receive from 1. Rank 1 receives from 0.
    # Then both start the next step (rank 0 sends, rank 1 sends): that is where they park.
    ranks = [threading.Thread(target=lambda: (p2p(clients[0], "send", 1, np.array([2.0], np.float32)),
                                              p2p(clients[0], "recv", 1, got[0]),
                                              p2p(clients[0], "send", 1, np.array([3.0], np.float32))),
                              daemon=True),
             threading.Thread(target=lambda: (p2p(clients[1], "recv", 0, got[1]),
                                              p2p(clients[1], "send", 0, np.array([4.0], np.float32))),
                              daemon=True)]
    for thread in ranks:
        thread.start()
    quiesced.join(timeout=60)
    try:
        assert {p.id: p.status()["phase"] for p in run.proxies.values()} == {"p0": "parked", "p1": "parked"}
        sent = run.proxies["p1"].issued[1].get("world|1>0", 0)
        received = run.proxies["p0"].issued[0].get("world|1>0", 0)
        assert (sent, received) == (received, received), "rank 1 sent a message rank 0 has not received"
        assert all(not p.mesh.inbox for p in run.proxies.values() if p.mesh is not None)
        assert (got[0][0], got[1][0]) == (1.0, 2.0)  # both messages of the step were delivered
    finally:
        run.on_every_proxy(lambda p: p.resume())
        for thread in ranks:
            thread.join(timeout=30)
        for client in clients.values():
            client.close()
    assert (got[0].tolist(), got[1].tolist()) == ([1.0], [2.0])


# --- the cut's promise: nothing of a proxy in a worker ---------------------------------------------


def test_quiesce_answers_only_once_every_worker_let_go_of_the_proxy(job, tmp_path: Path) -> None:
    run = job({0: "p0"})
    proxy = run.proxies["p0"]
    with open(tmp_path / "worker-0.log", "wb") as log:  # no torch: the client library alone
        worker = run.workers[0] = subprocess.Popen(
            [sys.executable, "-c", LIGHT_WORKER, str(run.id), str(tmp_path), run.rank_dir], stdout=log,
            stderr=subprocess.STDOUT)
    run.wait_for("the worker's operations", lambda: proxy.issued.get(0, {}).get("world", 0) > 10)
    proxy._on_control(proxy.id, {"ctl": "drain"})  # the drain reached this proxy: the next operation waits
    time.sleep(0.5)
    os.kill(worker.pid, signal.SIGSTOP)  # a worker slow to read its answer (a loaded node)
    outcome: dict = {}
    quiesce = threading.Thread(target=lambda: outcome.update(proxy.quiesce(timeout=20)), daemon=True)
    try:
        quiesce.start()
        time.sleep(2)
        # Its request was answered `park`, but it has not let go: no cut yet.
        assert quiesce.is_alive() and proxy.status()["ranks"] == {"0": "parking"}
        os.kill(worker.pid, signal.SIGCONT)
        quiesce.join(timeout=20)
        assert outcome.get("idle") is False
        assert not holds_proxy_resources(worker.pid), (
            "the cut was reported while the worker held the proxy's socket or memory")
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        proxy.resume()
        run.touch("stop")
        assert worker.wait(timeout=30) == 0, run.log(0)


# --- generations ----------------------------------------------------------------------------------


class FirstGenerationGivesUpFast(MemoryRendezvous):
    """Generation 1's proxies wait 0.3 s for their peers instead of the daemon's 300 s."""

    def wait(self, generation: str, proxies, timeout: float) -> dict:
        return super().wait(generation, proxies, 0.3 if generation == "1" else timeout)


def test_a_reconfigured_proxy_does_not_take_the_failure_of_its_previous_generation() -> None:
    job_id = int.from_bytes(os.urandom(4), "big") + 10**10
    rendezvous = FirstGenerationGivesUpFast()
    state = state_folder()
    proxies = [Proxy(job_id, os.getuid(), name, HostBackend(), lambda: rendezvous, state_dir=state,
                     bind_host="127.0.0.1")
               for name in ("b", "c")]
    b, c = proxies
    try:
        b.configure("1", {0: "a", 1: "b"})  # a restore attempt whose peer `a` never comes
        b.configure("2", {0: "b", 1: "c"})  # the next attempt: its peer `c` is still starting
        time.sleep(1.0)  # generation 1 has given up by now

        assert (b.status()["generation"], b.status()["ready"]) == ("2", False)
        assert b.status()["mesh_error"] is None, "generation 2 is failed by generation 1's rendezvous"
    finally:
        c.configure("2", {0: "b", 1: "c"})
        deadline = time.monotonic() + 10
        while not (b.ready and c.ready) and time.monotonic() < deadline:
            time.sleep(0.02)
        for proxy in proxies:
            proxy.stopping = True
        for proxy in proxies:
            proxy.close()
        remove_state(state)


def test_a_rendezvous_whose_coordinator_is_down_fails_the_mesh_and_says_so_to_the_agent() -> None:
    from singularity_slurm.errors import RegistryError

    def unreachable():
        raise RegistryError("cannot reach Redis at 127.0.0.1:1 (Connection refused)")

    state = state_folder()
    proxy = Proxy(int.from_bytes(os.urandom(4), "big") + 10**10, os.getuid(), "a", HostBackend(), unreachable,
                  state_dir=state, bind_host="127.0.0.1")
    try:
        proxy.configure("1", {0: "a", 1: "b"})

        reply = proxy.wait_ready(10)

        assert (reply["generation"], reply["ready"]) == ("1", False)
        assert "cannot reach Redis at 127.0.0.1:1" in reply["mesh_error"]
    finally:
        proxy.stopping = True
        proxy.close()
        remove_state(state)


def test_the_redis_rendezvous_turns_an_outage_into_a_rendezvous_error() -> None:
    import redis

    from singularity_slurm.proxy.rendezvous import RedisRendezvous, RendezvousError

    down = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=1, socket_timeout=1)
    rendezvous = RedisRendezvous(down, 42)
    with pytest.raises(RendezvousError, match="the coordinator's Redis is unreachable during the "
                                              "rendezvous of generation 3 of job 42"):
        rendezvous.publish("3", "n1/gpu0", "127.0.0.1", 4000)
    with pytest.raises(RendezvousError):
        rendezvous.wait("3", ["n1/gpu0"], timeout=5)


def test_a_refused_communicator_registration_fixes_nothing(tmp_path) -> None:
    from singularity_slurm.proxy.daemon import Session

    proxy = Proxy(7, os.getuid(), "n1/cpu0", HostBackend(), lambda: None, state_dir=tmp_path)
    proxy.placement = {0: "n1/cpu0", 1: "n1/cpu0", 2: "n1/cpu0"}
    zero, two = (Session(rank, None, None) for rank in (0, 2))  # type: ignore[arg-type]
    with pytest.raises(ProxyError, match="rank 2 registers it but is not among its ranks"):
        proxy._register_comm(two, "pair", [0, 1])
    with pytest.raises(ProxyError, match="name a rank twice"):
        proxy._register_comm(zero, "pair", [0, 0, 1])
    assert "pair" not in proxy.comms
    proxy._register_comm(zero, "pair", [0, 2])  # what the refused ones said did not stick
    assert proxy.comms["pair"] == [0, 2] and zero.comms == {"pair": 0}
