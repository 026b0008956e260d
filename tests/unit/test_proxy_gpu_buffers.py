"""The proxy's GPU buffers: offered, handed over, used for allreduce, refused where they must be, freed.

Real proxies (in this process, over their real rank sockets and mesh); the GPU is a stand-in (memfds
for its memory, numpy for its copies, the host backend for its reductions: `StandInGpu` has the
interface of proxy.gpu.CudaDevice), since this machine has none. Whether the GPU kernels compute the
host backend's bits is test_proxy_gpu_kernels's; tests/gpu/check.py runs the real thing on a GPU.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from proxyjob import Job

from singularity_slurm.config import ProxyConfig
from singularity_slurm.interpose.pyhook._singularity_worker import wire
from singularity_slurm.proxy import gpu
from singularity_slurm.proxy.hal import HostBackend, dtype_of, float32_to_bfloat16

UUID = "GPU-00000000-0000-0000-0000-00000000cafe"


class StandInGpu:
    """GPU memory as memfds; copies and reductions on the host, with CudaDevice's checks."""

    def __init__(self) -> None:
        self.uuid = UUID
        self.failed: str | None = None
        self.live: dict[int, tuple[int, mmap.mmap]] = {}
        self.freed: list[int] = []
        self.reductions: list[list[int]] = []
        self.next = 1 << 40
        self.lock = threading.Lock()

    def alloc(self, nbytes: int) -> gpu.DeviceBuffer:
        size = gpu.allocation_size(nbytes, 2 << 20)
        fd = os.memfd_create("stand-in-gpu", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        with self.lock:
            ptr, self.next = self.next, self.next + size
            self.live[ptr] = (fd, mmap.mmap(fd, size))
        return gpu.DeviceBuffer(ptr, size, None)

    def export(self, buffer: gpu.DeviceBuffer) -> int:
        return os.dup(self.live[buffer.ptr][0])

    def free(self, buffer: gpu.DeviceBuffer) -> None:
        with self.lock:
            fd, memory = self.live.pop(buffer.ptr)
            self.freed.append(buffer.ptr)
        memory.close()
        os.close(fd)

    def _array(self, buffer: gpu.DeviceBuffer, dtype: np.dtype, count: int) -> np.ndarray:
        return np.frombuffer(self.live[buffer.ptr][1], dtype=dtype, count=count)

    def download(self, buffer: gpu.DeviceBuffer, into: np.ndarray) -> None:
        gpu.fits(buffer, into.nbytes)
        into[:] = self._array(buffer, into.dtype, into.size)

    def upload(self, data: np.ndarray, buffer: gpu.DeviceBuffer) -> None:
        gpu.fits(buffer, data.nbytes)
        self._array(buffer, data.dtype, data.size)[:] = data

    def copy(self, dst: gpu.DeviceBuffer, src: gpu.DeviceBuffer, nbytes: int) -> None:
        gpu.fits(dst, nbytes)
        gpu.fits(src, nbytes)
        self._array(dst, np.dtype(np.uint8), nbytes)[:] = self._array(src, np.dtype(np.uint8), nbytes)

    def reduce(self, dtype: str, op: str, parts, out: gpu.DeviceBuffer, count: int) -> None:
        gpu.reduction_steps(dtype, op, len(parts))  # refuses what the kernels refuse
        kind = dtype_of(dtype)
        for buffer in (*parts, out):
            gpu.fits(buffer, count * kind.itemsize)
        self.reductions.append([p.ptr for p in parts])
        result = HostBackend().reduce([np.array(self._array(p, kind, count)) for p in parts], op)
        self._array(out, kind, count)[:] = result


class Rank:
    """A rank's connection, speaking the wire protocol as proxy_client does."""

    def __init__(self, job: Job, rank: int, comms: dict[str, list[int]], hello: bool = True):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.sock.connect(job.address(rank))
                break
            except (ConnectionRefusedError, FileNotFoundError):
                assert time.monotonic() < deadline, "the rank's socket is not served"
                time.sleep(0.02)
        self.reader = wire.Reader(self.sock)
        self.memory: mmap.mmap | None = None
        greeting = {"op": "hello", "rank": rank, "world_size": len(job.placement), "comms": comms}
        self.hello = self.ask(greeting) if hello else {}

    def ask_fds(self, message: dict) -> tuple[dict, list[int]]:
        wire.send(self.sock, message)
        return self.reader.recv()

    def ask(self, message: dict) -> dict:
        reply, fds = self.ask_fds(message)
        for fd in fds:
            os.close(fd)
        return reply

    def map_gpu(self, nbytes: int) -> dict:
        """Ask for a buffer and map the memory it names (the stand-in's memfd) as the worker maps it."""
        reply, fds = self.ask_fds({"op": "map_gpu", "bytes": nbytes})
        if self.memory is not None:
            self.memory.close()
            self.memory = None
        if fds:
            assert len(fds) == 1 and reply["ok"], reply
            self.memory = mmap.mmap(fds[0], int(reply["bytes"]))
            os.close(fds[0])
        return reply

    def array(self, dtype: str, count: int) -> np.ndarray:
        assert self.memory is not None
        return np.frombuffer(self.memory, dtype=dtype_of(dtype), count=count)

    def close(self) -> None:
        if self.memory is not None:
            self.memory.close()
        self.sock.close()


def _together(*calls) -> list[dict]:
    """Run the ranks' requests at once (a collective waits for all of its members)."""
    replies: list[dict | None] = [None] * len(calls)

    def run(i: int) -> None:
        replies[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert all(r is not None for r in replies), replies
    return replies  # type: ignore[return-value]


def _allreduce(dtype: str, count: int, reduce: str = "sum", **extra) -> dict:
    return {"op": "allreduce", "comm": "world", "dtype": dtype, "count": count, "reduce": reduce, **extra}


def _values(rank: int, dtype: str, count: int) -> np.ndarray:
    rng = np.random.default_rng(rank)
    values = rng.standard_normal(count).astype(np.float32) * 100
    return float32_to_bfloat16(values) if dtype == "bfloat16" else values.astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_one_gpu_communicator_is_reduced_on_the_gpu_in_rank_order_into_every_buffer(job, dtype) -> None:
    stand_in = StandInGpu()
    solo = job({0: "p0", 1: "p0", 2: "p0"}, cuda={"p0": stand_in})
    ranks = [Rank(solo, r, {"world": [0, 1, 2]}) for r in range(3)]
    try:
        assert [r.hello["gpu"] for r in ranks] == [UUID] * 3
        count = 1000
        for r, rank in enumerate(ranks):
            assert rank.map_gpu(count * 4)["bytes"] >= count * 4
            rank.array(dtype, count)[:] = _values(r, dtype, count)
        replies = _together(*[lambda rank=rank: rank.ask(_allreduce(dtype, count, "avg", gpu=True))
                              for rank in ranks])
        assert all(r == {"ok": True} for r in replies), replies
        expected = HostBackend().reduce([_values(r, dtype, count) for r in range(3)], "avg")
        for rank in ranks:
            assert rank.array(dtype, count).tobytes() == expected.tobytes()
        buffers = [solo.proxies["p0"].sessions[r].gpu.ptr for r in range(3)]
        assert stand_in.reductions == [buffers]  # in group-rank order, whatever order the ranks came in
        assert solo.proxies["p0"].stats_report()["allreduce"]["gpu_reduce"] == 1
    finally:
        for rank in ranks:
            rank.close()


@pytest.mark.parametrize("shared_memory", [False, True])
def test_members_on_other_gpus_go_through_host_memory_and_get_the_same_bits(job, shared_memory) -> None:
    gpus = {"p0": StandInGpu(), "p1": StandInGpu()}
    pair = job({0: "p0", 1: "p1", 2: "p1"}, cuda=gpus, limits=ProxyConfig(shared_memory=shared_memory))
    ranks = [Rank(pair, r, {"world": [0, 1, 2]}) for r in range(3)]
    try:
        count = 4099
        for r in (0, 1):
            ranks[r].map_gpu(count * 4)
            ranks[r].array("float32", count)[:] = _values(r, "float32", count)
        assert ranks[2].ask({"op": "map", "bytes": count * 4})["ok"]  # rank 2 stages through host memory
        region = pair.proxies["p1"].sessions[2].region
        region.array("float32", count)[:] = _values(2, "float32", count)
        replies = _together(lambda: ranks[0].ask(_allreduce("float32", count, gpu=True)),
                            lambda: ranks[1].ask(_allreduce("float32", count, gpu=True)),
                            lambda: ranks[2].ask(_allreduce("float32", count)))
        assert all(r == {"ok": True} for r in replies), replies
        expected = HostBackend().reduce([_values(r, "float32", count) for r in range(3)], "sum").tobytes()
        assert ranks[0].array("float32", count).tobytes() == expected
        assert ranks[1].array("float32", count).tobytes() == expected
        assert region.array("float32", count).tobytes() == expected
        assert not gpus["p0"].reductions and not gpus["p1"].reductions  # reduced on the host
        stats = pair.proxies["p1"].stats_report()["allreduce"]
        assert stats["gpu_pipeline"] == 1 and stats.get("shared_memory", 0) == int(shared_memory)
    finally:
        for rank in ranks:
            rank.close()


def test_bad_gpu_requests_are_refused_and_change_nothing(job) -> None:
    stand_in = StandInGpu()
    limits = ProxyConfig(max_region_mib=4)
    mixed = job({0: "p0", 1: "p0", 2: "p1"}, cuda={"p0": stand_in}, limits=limits)
    zero, one = (Rank(mixed, r, {"world": [0, 1, 2], "pair": [0, 1]}) for r in range(2))
    plain = Rank(mixed, 2, {"world": [0, 1, 2]})
    try:
        assert plain.hello["gpu"] is None  # p1 has no GPU buffers
        assert "offers no GPU buffers" in plain.map_gpu(1024)["error"]
        assert "not between 0 and the 4194304 bytes" in zero.map_gpu(5 << 20)["error"]
        unmapped = {**_allreduce("float32", 10, gpu=True), "comm": "pair"}
        replies = _together(lambda: zero.ask(unmapped), lambda: one.ask(unmapped))
        assert all("no GPU buffer mapped" in r["error"] for r in replies), replies
        assert not stand_in.live
        floats = zero.map_gpu(1 << 20)["bytes"] // 4
        assert one.map_gpu(1 << 20)["bytes"] == floats * 4
        zero.array("float32", floats)[:] = 1.0
        # a count beyond the buffer: the proxy neither reads nor writes past it, nor changes it
        too_many = {**_allreduce("float32", floats + 1, gpu=True), "comm": "pair"}
        replies = _together(lambda: zero.ask(too_many), lambda: one.ask(too_many))
        assert all("do not fit the rank's GPU buffer" in r["error"] for r in replies), replies
        assert (zero.array("float32", floats) == 1.0).all()
        broadcast = {"op": "broadcast", "comm": "pair", "dtype": "float32", "count": 4, "root": 0,
                     "gpu": True}
        replies = _together(lambda: zero.ask(broadcast), lambda: one.ask(broadcast))
        assert all("does not take its tensor from a GPU buffer" in r["error"] for r in replies), replies
        assert not stand_in.reductions
    finally:
        for rank in (zero, one, plain):
            rank.close()


def test_a_buffer_needs_a_hello_first_and_a_rank_gets_a_bounded_number_per_generation(job) -> None:
    from singularity_slurm.proxy.daemon import MAX_GPU_MAPS

    stand_in = StandInGpu()
    solo = job({0: "p0"}, cuda={"p0": stand_in})
    silent = Rank(solo, 0, {}, hello=False)
    try:
        assert "say hello first" in silent.map_gpu(1024)["error"] and not stand_in.live
    finally:
        silent.close()
    rank = Rank(solo, 0, {"world": [0]})
    try:
        for _ in range(MAX_GPU_MAPS):
            assert rank.map_gpu(1024)["ok"]
        assert f"had {MAX_GPU_MAPS} GPU buffers in this generation" in rank.map_gpu(1024)["error"]
        assert len(stand_in.live) <= 1
        solo.proxies["p0"].configure("2", {0: "p0"})  # a new generation: the rank reconnects and asks again
    finally:
        rank.close()
    again = Rank(solo, 0, {"world": [0]})
    try:
        assert again.map_gpu(1024)["ok"]
    finally:
        again.close()


def test_a_ranks_buffer_is_freed_when_it_maps_a_larger_one_and_when_it_goes(job) -> None:
    stand_in = StandInGpu()
    solo = job({0: "p0"}, cuda={"p0": stand_in})
    rank = Rank(solo, 0, {"world": [0]})
    rank.map_gpu(1 << 20)
    first = solo.proxies["p0"].sessions[0].gpu.ptr
    rank.map_gpu(3 << 20)
    assert stand_in.freed == [first] and len(stand_in.live) == 1
    rank.close()
    deadline = time.monotonic() + 10
    while stand_in.live:
        assert time.monotonic() < deadline, "the departed rank's buffer was not freed"
        time.sleep(0.02)


def test_a_gpu_that_cannot_be_set_up_is_offered_no_more_and_its_ranks_are_told_why(job) -> None:
    class Broken(StandInGpu):
        def alloc(self, nbytes: int) -> gpu.DeviceBuffer:
            self.failed = "GPU GPU-x is not in the default compute mode (mode 3)"
            raise gpu.GpuUnavailable(self.failed)

    solo = job({0: "p0"}, cuda={"p0": Broken()})
    rank = Rank(solo, 0, {"world": [0]})
    try:
        assert rank.hello["gpu"] == UUID
        assert "not in the default compute mode" in rank.map_gpu(1024)["error"]
    finally:
        rank.close()
    again = Rank(solo, 0, {"world": [0]})
    try:
        assert again.hello["gpu"] is None
        assert solo.proxies["p0"].status()["gpu_buffers"] is False
    finally:
        again.close()


def test_no_buffers_where_the_admin_turned_them_off_or_the_proxy_is_not_a_gpus() -> None:
    from singularity_slurm.proxy.daemon import gpu_device

    assert gpu_device("n1/gpu0", "cuda", ProxyConfig(gpu_buffers=False), None) is None
    assert gpu_device("n1/gpu0", "host", ProxyConfig(), None) is None
    assert gpu_device("n1/cpu0", "cuda", ProxyConfig(), None) is None


# --- the worker's side: proxy_client.call_gpu ---------------------------------------------------------

class StandInBuffer:
    """gpu_buffer.GpuBuffer's interface on the stand-in GPU's memfd: "device addresses" are host ones."""

    released: list[int] = []

    def __init__(self, fd: int, size: int, ordinal: int):
        self.memory = mmap.mmap(fd, size)
        os.close(fd)
        self.view = np.frombuffer(self.memory, dtype=np.uint8)
        self.size, self.ordinal = size, ordinal

    def copy_in(self, src: int, nbytes: int) -> None:
        ctypes.memmove(self.view.ctypes.data, src, nbytes)

    def copy_out(self, dst: int, nbytes: int) -> None:
        ctypes.memmove(dst, self.view.ctypes.data, nbytes)

    def release(self) -> None:
        StandInBuffer.released.append(self.size)
        del self.view
        self.memory.close()


@pytest.fixture
def stand_in_driver(monkeypatch):
    """The worker's driver calls on the stand-in GPU: CUDA device 0 is the proxy's GPU, 1 another."""
    from singularity_slurm.interpose.pyhook._singularity_worker import gpu_buffer

    monkeypatch.setattr(gpu_buffer, "GpuBuffer", StandInBuffer)
    monkeypatch.setattr(gpu_buffer, "device_uuid", lambda ordinal: UUID if ordinal == 0 else "GPU-other")
    StandInBuffer.released.clear()


def _client(job: Job, rank: int):
    from singularity_slurm.interpose.pyhook._singularity_worker.proxy_client import ProxyClient

    client = ProxyClient(job.id, rank, len(job.placement), rank_dir=job.rank_dir)
    client.register_comm("world", sorted(job.placement))
    return client


def test_ranks_allreduce_through_their_gpu_buffers_and_release_them_before_they_disconnect(
        job, stand_in_driver) -> None:
    stand_in = StandInGpu()
    solo = job({0: "p0", 1: "p0"}, cuda={"p0": stand_in})
    clients = [_client(solo, r) for r in range(2)]
    tensors = [_values(r, "float32", 3000) for r in range(2)]
    expected = HostBackend().reduce([t.copy() for t in tensors], "sum").tobytes()
    message = _allreduce("float32", 3000)
    done = _together(*[lambda c=c, t=t: {"ok": c.call_gpu(message, t.ctypes.data, t.nbytes, 0)}
                       for c, t in zip(clients, tensors, strict=True)])
    assert done == [{"ok": True}, {"ok": True}]
    assert [t.tobytes() for t in tensors] == [expected, expected]
    assert len(stand_in.reductions) == 1
    for client in clients:
        client.close()
    assert len(StandInBuffer.released) == 2  # released by the worker before its connection closed


def test_a_tensor_on_another_gpu_or_a_proxy_without_buffers_goes_through_host_memory(
        job, stand_in_driver) -> None:
    stand_in = StandInGpu()
    pair = job({0: "p0", 1: "p1"}, cuda={"p0": stand_in})
    zero, one = _client(pair, 0), _client(pair, 1)
    try:
        tensor = np.ones(10, dtype=np.float32)
        assert zero.call_gpu(_allreduce("float32", 10), tensor.ctypes.data, tensor.nbytes, 1) is False
        assert one.call_gpu(_allreduce("float32", 10), tensor.ctypes.data, tensor.nbytes, 0) is False
        assert not stand_in.live and "allreduce" not in pair.proxies["p0"].stats_report()
    finally:
        zero.close()
        one.close()


def test_a_refused_buffer_sends_the_process_through_host_memory_and_says_why_once(
        job, stand_in_driver, capfd) -> None:
    solo = job({0: "p0"}, cuda={"p0": StandInGpu()}, limits=ProxyConfig(max_region_mib=1))
    client = _client(solo, 0)
    try:
        tensor = np.ones(1 << 19, dtype=np.float32)  # 2 MiB: more than the admin allows
        big = _allreduce("float32", tensor.size)
        assert client.call_gpu(big, tensor.ctypes.data, tensor.nbytes, 0) is False
        assert client.call_gpu(_allreduce("float32", 10), tensor.ctypes.data, 40, 0) is False
        err = capfd.readouterr().err
        assert err.count("CUDA tensors go through host memory") == 1 and "proxy.max_region_mib" in err
    finally:
        client.close()


def test_without_a_driver_the_worker_says_so_once_and_goes_through_host_memory(job, capfd) -> None:
    solo = job({0: "p0"}, cuda={"p0": StandInGpu()})  # the proxy offers a buffer; this machine has no libcuda
    client = _client(solo, 0)
    try:
        tensor = np.ones(8, dtype=np.float32)
        assert client.call_gpu(_allreduce("float32", 8), tensor.ctypes.data, tensor.nbytes, 0) is False
        assert client.call_gpu(_allreduce("float32", 8), tensor.ctypes.data, tensor.nbytes, 0) is False
        err = capfd.readouterr().err
        assert err.count("cannot tell which GPU CUDA device 0 is") == 1, err
    finally:
        client.close()


def test_a_proxy_without_a_driver_fails_to_set_up_once_and_remembers_why() -> None:
    device = gpu.CudaDevice(UUID)
    with pytest.raises(gpu.GpuUnavailable) as first:
        device.alloc(1 << 20)
    assert device.failed == str(first.value)
    assert "driver" in device.failed  # no bindings installed, or no libcuda under them
    with pytest.raises(gpu.GpuUnavailable, match="driver"):
        device.export(gpu.DeviceBuffer(0, 1 << 20, None))
    device.close()  # nothing was set up: nothing to release


HOSTILE_RANKS = r"""
import array, json, mmap, os, socket, struct, sys, threading

def connect(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(path)
    return s

def ask(s, message):
    body = json.dumps(message).encode()
    s.sendall(struct.pack("!I", len(body)) + body)
    fds = array.array("i")
    head, anc, _, _ = s.recvmsg(4, socket.CMSG_LEN(4 * fds.itemsize))
    for level, kind, data in anc:
        fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    size = struct.unpack("!I", head)[0]
    body = b""
    while len(body) < size:
        body += s.recv(size - len(body))
    return json.loads(body), list(fds)

ranks = [connect(p) for p in sys.argv[1:3]]
out = {"hello": [ask(s, {"op": "hello", "rank": r, "world_size": 2, "comms": {"pair": [0, 1]}})[0]
                 for r, s in enumerate(ranks)]}
out["huge"] = ask(ranks[0], {"op": "map_gpu", "bytes": 1 << 40})[0]
out["negative"] = ask(ranks[0], {"op": "map_gpu", "bytes": -1})[0]
sizes = []
for s in ranks:
    reply, fds = ask(s, {"op": "map_gpu", "bytes": 1 << 20})
    memory = mmap.mmap(fds[0], reply["bytes"])  # the buffer's memory: the job's own
    memory[:4] = b"\xff\xff\xff\xff"
    sizes.append(reply["bytes"])
out["sizes"] = sizes
def together(message):
    replies = [None, None]
    def run(i):
        replies[i] = ask(ranks[i], message)[0]
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return replies
base = {"op": "allreduce", "comm": "pair", "dtype": "float64", "reduce": "sum", "gpu": True}
out["past_the_end"] = together({**base, "count": sizes[0] // 8 + 1})
out["negative_count"] = together({**base, "count": -5})
out["gather"] = together({"op": "gather", "comm": "pair", "dtype": "uint8", "count": 4, "root": 0,
                          "gpu": True})
print(json.dumps(out))
"""


def test_a_hostile_job_user_gets_no_more_than_its_own_bounded_buffers(job) -> None:
    """The job's user, unprivileged, speaks the protocol itself: it asks for buffers beyond the admin's
    bound, names counts past its buffer's end or negative, and asks for GPU buffers on an operation that
    takes none. The proxy refuses each with the reason, holds no more than one buffer per rank, and
    never reads or writes past a buffer."""
    if os.getuid() != 0:
        pytest.skip("needs root to run the ranks as another user")
    stand_in = StandInGpu()
    run = job({0: "p0", 1: "p0"}, uid=4242, cuda={"p0": stand_in}, limits=ProxyConfig(max_region_mib=16))
    done = subprocess.run([sys.executable, "-c", HOSTILE_RANKS, run.address(0), run.address(1)], user=4242,
                          cwd="/", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert [h["gpu"] for h in out["hello"]] == [UUID, UUID]
    assert "not between 0 and the 16777216 bytes" in out["huge"]["error"]
    assert "not between 0 and the 16777216 bytes" in out["negative"]["error"]
    assert all("do not fit the rank's GPU buffer" in r["error"] for r in out["past_the_end"]), out
    assert all("a count of -5 elements" in r["error"] for r in out["negative_count"]), out
    assert all("does not take its tensor from a GPU buffer" in r["error"] for r in out["gather"]), out
    assert len(stand_in.live) <= 2 and not stand_in.reductions
