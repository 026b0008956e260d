"""Ranks taking turns on a GPU whose memory does not fit them together: the decisions (pure), and a
proxy's bookkeeping of them with real workers, where a stand-in for the GPU's memory (there is no GPU
here) keeps the account of what is on the GPU and checks that every rank computes with its memory
there and that nothing comes in where it would not fit. tests/gpu runs the same through the driver."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import tomllib

import pytest

from singularity_slurm.config import ConfigError, ProxyConfig, parse
from singularity_slurm.proxy import swap
from singularity_slurm.proxy.daemon import ProxyError, gpu_memory
from singularity_slurm.proxy.swap import Plan, SwapMode, eviction_order, need, plan

GIB = 1 << 30


# --- decisions ------------------------------------------------------------------------------------


def test_a_rank_whose_memory_is_out_needs_its_footprint_one_on_the_gpu_what_it_lacks_of_its_peers() -> None:
    footprints = {0: 6 * GIB, 1: 2 * GIB, 2: 6 * GIB}
    assert need(1, footprints, out={1}) == 2 * GIB
    assert need(1, footprints, out=set()) == 4 * GIB  # it grows to its peers' size at its first steps
    assert need(0, footprints, out=set()) == 0
    assert need(3, {}, out=set()) == 0  # nothing measured yet
    # restored with its memory out, never measured here: as large as its largest peer, or unknown
    assert need(3, footprints, out={3}) == 6 * GIB
    assert need(3, {}, out={3}) is None


def test_a_rank_out_at_an_unknown_size_has_every_waiting_rank_go_out_first() -> None:
    assert plan(SwapMode.AUTO, 3, {}, {3}, [2, 1], free=100 * GIB, reserve=GIB) == Plan((2, 1), True)
    assert plan(SwapMode.AUTO, 3, {1: GIB}, {3}, [2, 1], free=100 * GIB, reserve=GIB) == Plan((), True)


def test_auto_moves_nothing_while_the_ranks_fit_together() -> None:
    footprints = {0: 4 * GIB, 1: 4 * GIB}
    assert plan(SwapMode.AUTO, 1, footprints, set(), [0], free=10 * GIB, reserve=GIB) == Plan()
    # both on the GPU with little to spare: the next one needs nothing more, so nothing moves
    assert plan(SwapMode.AUTO, 1, footprints, set(), [0], free=GIB // 2, reserve=GIB) == Plan()


def test_auto_moves_out_the_ranks_that_compute_last_until_the_next_one_fits() -> None:
    footprints = {0: 6 * GIB, 1: 6 * GIB, 2: 6 * GIB, 3: 6 * GIB}
    # rank 3 is out and computes next; 0, 1 and 2 wait, 2 the first to go (it computes last)
    decided = plan(SwapMode.AUTO, 3, footprints, {3}, [2, 1, 0], free=2 * GIB, reserve=GIB)
    assert decided == Plan(out=(2,), bring_in=True)
    decided = plan(SwapMode.AUTO, 3, footprints, {3}, [2, 1, 0], free=0, reserve=GIB)
    assert decided == Plan(out=(2, 1), bring_in=True)


def test_auto_moves_what_it_can_where_even_that_does_not_fit() -> None:
    decided = plan(SwapMode.AUTO, 1, {0: GIB, 1: 8 * GIB}, {1}, [0], free=0, reserve=0)
    assert decided == Plan(out=(0,), bring_in=True)  # it may still run out of memory: CUDA says so


def test_always_moves_every_waiting_rank_and_never_moves_none_but_both_bring_the_rank_in() -> None:
    footprints = {0: GIB, 1: GIB, 2: GIB}
    assert plan(SwapMode.ALWAYS, 0, footprints, {0, 2}, [2, 1], free=100 * GIB, reserve=GIB) == \
        Plan(out=(1,), bring_in=True)  # 2 is out already
    assert plan(SwapMode.NEVER, 0, footprints, {0}, [2, 1], free=0, reserve=GIB) == Plan(bring_in=True)
    assert plan(SwapMode.NEVER, 1, footprints, set(), [2, 0], free=0, reserve=GIB) == Plan()


def test_the_incoming_rank_is_never_moved_out_for_itself() -> None:
    assert plan(SwapMode.ALWAYS, 1, {1: GIB}, set(), [1, 0], free=0, reserve=0) == Plan(out=(0,))


def test_eviction_order_is_the_ranks_in_an_operation_then_the_queue_from_its_back() -> None:
    assert eviction_order(inside=[3, 0, 2, 1], waiting=[2, 0]) == [1, 3, 0, 2]
    assert eviction_order(inside=[], waiting=[]) == []
    assert eviction_order(inside=[1], waiting=[2, 1]) == [1]  # only ranks the proxy may move


@pytest.mark.parametrize("text,problem", [
    ('[proxy]\ngpu_swap = "sometimes"\n', "proxy.gpu_swap = 'sometimes' is not one of auto, always, never"),
    ("[proxy]\ngpu_swap_reserve_mib = -1\n", "proxy.gpu_swap_reserve_mib must be 0..1048576 MiB, got -1"),
])
def test_bad_swap_settings_are_refused_by_name(text: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem.replace("(", r"\(").replace(".", r"\.")):
        parse(tomllib.loads(text))


def test_swap_settings_and_defaults() -> None:
    assert (ProxyConfig().gpu_swap, ProxyConfig().gpu_swap_reserve_bytes) == ("auto", GIB)
    proxy = parse(tomllib.loads('[proxy]\ngpu_swap = "always"\ngpu_swap_reserve_mib = 0\n')).proxy
    assert (proxy.gpu_swap, proxy.gpu_swap_reserve_bytes) == ("always", 0)


def test_only_a_gpus_cuda_proxy_moves_memory_and_without_a_driver_none_does(caplog) -> None:
    assert gpu_memory("n1/cpu0", "host", 60) is None
    assert gpu_memory("n1/gpu0", "host", 60) is None  # the dev cluster's stand-in GPUs
    assert gpu_memory("n1/gpu0", "cuda", 60) is None  # no NVIDIA driver or bindings here
    assert "proxy.gpu_swap has no effect" in caplog.text


def test_a_peer_is_named_by_a_pidfd_of_the_process_that_connected_refused_once_it_has_ended() -> None:
    left, right = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), None
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = f"/tmp/swap-test-{os.getpid()}.sock"
    server.bind(path)
    server.listen(1)
    try:
        child = os.fork()
        if child == 0:  # connects, then ends
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect(path)
            os._exit(0)
        right, _ = server.accept()
        os.waitpid(child, 0)
        process = swap.peer_process(right)
        if process is not None:  # the kernel's pidfd of the ended connector, or none
            assert process.pid == child and not swap.alive(process.pidfd)
            with pytest.raises(swap.SwapError, match=f"process {child} has ended"):
                swap.check(process)
            os.close(process.pidfd)

        left.connect(path)
        mine, _ = server.accept()
        process = swap.peer_process(mine)
        assert (process.pid, process.uid) == (os.getpid(), os.getuid()) and swap.alive(process.pidfd)
        swap.check(process)
        with pytest.raises(swap.SwapError, match="is no longer of uid"):
            swap.check(swap.Process(process.pid, process.pidfd, process.uid + 1))
        os.close(process.pidfd)
        mine.close()
    finally:
        left.close()
        server.close()
        if right is not None:
            right.close()
        os.unlink(path)


# --- a proxy's bookkeeping, with real workers ------------------------------------------------------

WORKER = r"""
import json, os, sys, time
from pathlib import Path

import torch
import torch.distributed as dist

mode, out = sys.argv[1], Path(sys.argv[2])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
spans, bad = [], []
for i in range(3 if mode == "short" else 12):
    began = time.monotonic()
    x = torch.full((4096,), float(rank + i))
    for _ in range(20):
        x = x * 1.0001 + 0.5
    spans.append([began, time.monotonic()])
    t = torch.full((3,), float(rank + i))
    dist.all_reduce(t)
    if t.tolist() != [float(sum(r + i for r in range(world)))] * 3:
        bad.append([i, t.tolist()])
dist.destroy_process_group()
(out / f"result-{rank}.json").write_text(json.dumps({"spans": spans, "bad": bad, "pid": os.getpid()}))
"""


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


class GpuStandIn:
    """What a proxy's GpuMemory tells it, for a GPU of `total` bytes whose ranks hold `each` bytes
    while their memory is on it. It records every move (the caller's monotonic clock is the workers'
    too) and what would have run out of memory."""

    def __init__(self, total: int, each: int, out: set[int] | None = None, delay: float = 0.0):
        self.total, self.each, self.delay = total, each, delay  # delay: seconds a move takes
        self.out = set(out or ())
        self.seen: set[int] = set()
        self.moves: list[tuple[float, str, int]] = []
        self.overfull: list[int] = []
        self.pairs: list[list] = []
        self.refused: list[int] = []  # processes the proxy named that had ended
        self.lock = threading.Lock()

    def _check(self, process: swap.Process) -> int:
        """What GpuMemory checks before every call: the named process still runs as its user."""
        try:
            swap.check(process)
        except swap.SwapError:
            self.refused.append(process.pid)
            raise
        return process.pid

    def resident(self) -> list[int]:
        """The processes with memory on the GPU: seen, not out, and still running (an ended
        process's memory is free again)."""
        return [pid for pid in self.seen if pid not in self.out and running(pid)]

    def usage(self) -> tuple[int, dict[int, int]]:
        with self.lock:
            on = self.resident()
            return max(0, self.total - self.each * len(on)), {pid: self.each for pid in on}

    def is_out(self, process: swap.Process) -> bool:
        pid = self._check(process)
        with self.lock:
            self.seen.add(pid)
            return pid in self.out

    def move_out(self, process: swap.Process) -> None:
        pid = self._check(process)
        time.sleep(self.delay)
        with self.lock:
            assert pid not in self.out, f"{pid} moved out twice"
            self.out.add(pid)
            self.moves.append((time.monotonic(), "out", pid))

    def move_in(self, process: swap.Process, pairs=()) -> None:
        pid = self._check(process)
        time.sleep(self.delay)
        with self.lock:
            assert pid in self.out, f"{pid} moved in while on the GPU"
            if self.total - self.each * len(self.resident()) < self.each:
                self.overfull.append(pid)
            self.out.discard(pid)
            self.pairs.append([[p.old_uuid, p.new_uuid] for p in pairs])
            self.moves.append((time.monotonic(), "in", pid))

    def was_out(self, pid: int, began: float, ended: float) -> bool:
        """Whether `pid`'s memory was out at any time in [began, ended]."""
        out = pid in self.out_at_start
        for at, what, who in self.moves:
            if who != pid:
                continue
            if at > ended:
                break
            if at > began and out:
                return True
            out = what == "out"
        return out

    def start(self) -> None:
        self.out_at_start = set(self.out)


def check_every_rank_computed_on_the_gpu(run, results: dict[int, dict], gpu: GpuStandIn) -> None:
    assert {r: res["bad"] for r, res in results.items()} == {r: [] for r in results}
    for rank, result in results.items():
        for began, ended in result["spans"]:
            assert not gpu.was_out(result["pid"], began, ended), f"rank {rank} computed with its memory out"
    assert gpu.overfull == []


def test_ranks_that_do_not_fit_together_move_out_while_they_wait_and_compute_on_the_gpu(job) -> None:
    gpu = GpuStandIn(total=10 * GIB, each=6 * GIB)  # two ranks of 6 GiB on a 10 GiB GPU
    gpu.start()
    run = job({0: "p0", 1: "p0"}, limits=ProxyConfig(time_slicing="turns"), memory={"p0": gpu})
    run.start(WORKER, "swap")
    results = run.results()

    check_every_rank_computed_on_the_gpu(run, results, gpu)
    pids = {results[r]["pid"] for r in results}
    assert {who for _, _, who in gpu.moves} == pids
    handovers = run.proxies["p0"].status()["turns"]["handovers"]
    assert sum(what == "out" for _, what, _ in gpu.moves) >= handovers - 1 >= 10  # at every handover
    stats = run.proxies["p0"].stats_report()["swap"]
    assert stats["out"] == sum(what == "out" for _, what, _ in gpu.moves)
    assert stats["bytes"] >= stats["out"] * 6 * GIB


def test_moves_slower_than_the_turn_lapse_keep_every_rank_on_the_gpu_and_none_beside_another(job) -> None:
    """Moves that take longer than proxy.turn_lapse_s (the rule itself: test_turns): every rank
    computes with its memory on the GPU, nothing comes in where it does not fit, no turn lapses."""
    gpu = GpuStandIn(total=10 * GIB, each=6 * GIB, delay=0.6)
    gpu.start()
    run = job({0: "p0", 1: "p0"}, limits=ProxyConfig(time_slicing="turns", turn_lapse_s=1),
              memory={"p0": gpu})
    run.start(WORKER, "short")
    results = run.results()

    check_every_rank_computed_on_the_gpu(run, results, gpu)
    assert sum(what == "out" for _, what, _ in gpu.moves) >= 2
    assert run.proxies["p0"].status()["turns"]["lapses"] == 0


def test_ranks_that_fit_together_stay_on_the_gpu_unless_the_admin_says_always(job) -> None:
    fits = GpuStandIn(total=20 * GIB, each=6 * GIB)
    fits.start()
    run = job({0: "p0", 1: "p0", 2: "p0"}, limits=ProxyConfig(time_slicing="turns"), memory={"p0": fits})
    run.start(WORKER, "swap")
    check_every_rank_computed_on_the_gpu(run, run.results(), fits)
    assert fits.moves == []

    always = GpuStandIn(total=20 * GIB, each=6 * GIB)
    always.start()
    run = job({0: "p0", 1: "p0"}, limits=ProxyConfig(time_slicing="turns", gpu_swap="always"),
              memory={"p0": always})
    run.start(WORKER, "swap")
    check_every_rank_computed_on_the_gpu(run, run.results(), always)
    assert sum(what == "out" for _, what, _ in always.moves) >= 10


def test_never_leaves_memory_on_the_gpu(job) -> None:
    gpu = GpuStandIn(total=10 * GIB, each=6 * GIB)
    gpu.start()
    run = job({0: "p0", 1: "p0"}, limits=ProxyConfig(time_slicing="turns", gpu_swap="never"),
              memory={"p0": gpu})
    run.start(WORKER, "swap")
    run.results()
    assert gpu.moves == []  # on a GPU, the second rank would have failed with out-of-memory


@pytest.mark.parametrize("slicing", ["turns", "concurrent"])
def test_a_rank_restored_with_its_memory_out_comes_back_onto_the_gpu_through_the_restores_pairs(
        job, slicing: str) -> None:
    gpu = GpuStandIn(total=100 * GIB, each=6 * GIB)
    gpu.uuid = "GPU-66666666-7777-8888-9999-000000000000"  # this proxy's GPU
    run = job({0: "p0", 1: "p0"}, limits=ProxyConfig(time_slicing=slicing), memory={"p0": gpu})
    mine = ["GPU-11111111-2222-3333-4444-555555555555", gpu.uuid]
    pairs = [mine, ["GPU-22222222-2222-3333-4444-555555555555", "GPU-77777777-7777-8888-9999-000000000000"]]
    answer = run.proxies["p0"].handle({"op": "gpu_pairs", "rank": 1, "pairs": pairs})
    assert answer == {"pairs": 2, "moves": True}
    run.start(WORKER, "swap")
    gpu.seen = {run.workers[0].pid, run.workers[1].pid}
    gpu.out = {run.workers[1].pid}  # as a restore leaves it, before it reconnects
    gpu.start()
    results = run.results()

    check_every_rank_computed_on_the_gpu(run, results, gpu)
    assert [(what, who) for _, what, who in gpu.moves] == [("in", run.workers[1].pid)]
    assert gpu.pairs == [[mine]]  # once, and only the pair onto this proxy's GPU


def test_bad_gpu_pairs_are_refused_and_change_nothing(job) -> None:
    run = job({0: "p0"})
    proxy = run.proxies["p0"]
    good = [["GPU-11111111-2222-3333-4444-555555555555", "GPU-66666666-7777-8888-9999-000000000000"]]
    for rank, bad, problem in ((0, "GPU-1", "pairs must be a list"), (0, [["a"]], "pairs must be a list"),
                               (0, [["GPU-1", "GPU-2"]], "not a GPU UUID: 'GPU-1'"),
                               (1, good, "rank 1 is not served by proxy p0"),
                               ("0", good, "rank '0' is not served by proxy p0")):
        with pytest.raises((ProxyError, ValueError), match=problem):
            proxy.handle({"op": "gpu_pairs", "rank": rank, "pairs": bad})
    assert proxy.gpu_pairs == {}


ENDED_CONNECTOR = r"""
import os, socket, struct, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(20)
s.connect(sys.argv[1])  # the proxy's peer: this process, which now ends and leaves the socket to a child
connector = os.getpid()
if os.fork() != 0:
    os._exit(0)
while os.getppid() == connector:
    time.sleep(0.01)
body = b'{"op":"hello","rank":0,"world_size":1}'
s.sendall(struct.pack("!I", len(body)) + body)
print(connector, "answered" if s.recv(4) else "dropped", flush=True)
"""


def test_the_proxy_acts_on_no_process_once_the_one_that_connected_has_ended(job) -> None:
    """A hostile job user connects from a process that then ends, hoping the kernel gives its pid to
    another process (another user's) for the root proxy's driver calls to act on: the proxy names the
    connecting process by a pidfd and refuses every call once that process has ended."""
    if os.getuid() != 0:
        pytest.skip("needs root to run the connector as another user")
    gpu = GpuStandIn(total=10 * GIB, each=6 * GIB)
    run = job({0: "p0"}, uid=4242, memory={"p0": gpu})
    done = subprocess.run([sys.executable, "-c", ENDED_CONNECTOR, run.address(0)], user=4242, cwd="/",
                          capture_output=True, text=True, timeout=60)
    connector, answer = done.stdout.split()
    assert answer == "answered", done.stderr  # the rank is served; nothing of its GPU state is touched
    assert gpu.refused == [int(connector)] and gpu.seen == set() and gpu.moves == []
