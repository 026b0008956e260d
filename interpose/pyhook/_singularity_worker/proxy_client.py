"""The worker's side of the device proxy: one connection per rank, re-established after a checkpoint.

A worker holds at most three things that belong to the proxy: a unix socket, a shared-memory
mapping, and, where its GPU's proxy offers one, a buffer in the GPU's memory (`gpu_buffer`). When
the proxy answers a request with `park` (a distributed checkpoint reached its cut), the worker drops
them (the GPU buffer first, then the mapping, then the socket), waits until its rank's socket path
is served again (by the same proxy after a checkpoint that leaves the job running, or by a fresh
proxy on whatever node the job was restored on) and sends the request again. So a checkpoint image
of a worker never refers to a proxy or a peer.

Where ranks share a device and take turns on it (the proxy says so in its answer to hello), the
first hello of the process waits for the rank's first turn, and every operation's answer for its next
one (`singularity_slurm.proxy.turns`); the torch backend then runs every operation synchronously, so
that the rank computes only while it holds the turn.

Standard library and ctypes only (it runs in the job's own Python): tensors are copied by address,
so nothing here depends on torch, and no Python buffer export pins the mapping when it has to go.
`gpu_buffer` loads libcuda.so.1 only when a proxy offers a GPU buffer and a CUDA tensor comes.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence

from . import wire

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_PROT_RW = 0x1 | 0x2
_MAP_SHARED = 0x01
_MADV_DONTFORK = 10
_MAP_FAILED = ctypes.c_void_p(-1).value

RECONNECT_POLL_S = 0.02
PROXY_LOST_WAIT_S = 600.0


class ProxyError(RuntimeError):
    """The proxy refused a request (bad arguments, unsupported operation); the message says which."""


class ProxyClient:
    """One rank's connection to the proxy that serves it. Thread-safe; one request at a time."""

    def __init__(self, job_id: int | str, rank: int, world_size: int, rank_dir: str | None = None):
        """`rank_dir`: the folder of rank sockets; by default $SINGULARITY_RANK_DIR (the node agent
        sets it). The path is kept: a restored worker reconnects through it on any node."""
        rank_dir = rank_dir or os.environ.get(wire.RANK_DIR_ENV)
        if not rank_dir:
            raise ProxyError(f"${wire.RANK_DIR_ENV} is not set: run the job with `singularityctl run`, "
                             "whose node agent sets it")
        self.address = wire.rank_address(job_id, rank, rank_dir)
        self.job_id = job_id
        self.rank = rank
        self.world_size = world_size
        self.lock = threading.RLock()
        self.sock: socket.socket | None = None
        self.reader: wire.Reader | None = None
        self.shm_addr = 0
        self.shm_size = 0
        self.comms: dict[str, list[int]] = {}
        self.generation: str | None = None
        self.parks = 0
        self.started = False  # the first hello (which waits for the rank's first turn) was answered
        self.turns = False  # the ranks of this rank's device take turns (the latest hello's answer)
        self.gpu_uuid: str | None = None  # the GPU whose buffer the proxy offers (the latest hello's answer)
        self.gpu_buffer = None  # gpu_buffer.GpuBuffer, mapped while connected
        self.gpu_uuids: dict[int, str | None] = {}  # CUDA ordinal -> its GPU's UUID (None: unreadable)
        self.gpu_refused: str | None = None  # why this process stopped using GPU buffers
        os.register_at_fork(after_in_child=self._forget_in_child)

    @property
    def sliced(self) -> bool:
        """Run operations synchronously: the device takes turns, or the rank is not connected (parked
        at a cut, its next placement's answer not known yet: a restore may share its device)."""
        return self.turns or self.sock is None

    # --- connection -------------------------------------------------------------------------------

    def _connect(self) -> None:
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            try:
                sock.connect(self.address)
                break
            except OSError as exc:
                sock.close()
                if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.EAGAIN):
                    raise
            time.sleep(RECONNECT_POLL_S)
        if wire.peer_uid(sock) != 0:
            sock.close()
            raise ProxyError(f"the listener for rank {self.rank} of job {self.job_id} is not root: "
                             "refusing to send it the job's data")
        self.sock, self.reader = sock, wire.Reader(sock)
        reply = self._exchange({"op": "hello", "rank": self.rank, "world_size": self.world_size,
                                "pid": os.getpid(), "comms": self.comms, "turn": not self.started})
        self.generation = reply.get("generation")
        self.started, self.turns = True, reply.get("turns") is True
        self.gpu_uuid = reply.get("gpu") if isinstance(reply.get("gpu"), str) else None

    def _drop(self) -> None:
        """Let go of everything the proxy handed out: the mapping, then the socket.

        The proxy counts a parked rank as at rest only once its connection closes, so the GPU buffer
        and the mapping must be gone first.
        """
        if self.gpu_buffer is not None:
            try:
                self.gpu_buffer.release()
            except RuntimeError as exc:  # still mapped: the checkpoint must not take this process so
                self._end(f"cannot release the GPU buffer of the device proxy ({exc})")
        self.gpu_buffer, self.gpu_uuid, self.gpu_refused = None, None, None
        self.gpu_uuids.clear()  # after a restore a CUDA device may be another GPU
        if self.shm_addr:
            _libc.munmap(self.shm_addr, self.shm_size)
        self.shm_addr = self.shm_size = 0
        if self.sock is not None:
            self.sock.close()
        self.sock = self.reader = None

    def _forget_in_child(self) -> None:
        # A forked child (a DataLoader worker) must not keep the parent's connection open: the
        # parent could not let go of it at a checkpoint. The mapping is MADV_DONTFORK already.
        if self.sock is not None:
            try:
                os.close(self.sock.detach())
            except OSError:
                pass
        self.sock = self.reader = None
        self.shm_addr = self.shm_size = 0
        self.gpu_buffer, self.gpu_uuid = None, None  # the child has no CUDA context of the parent's
        self.lock = threading.RLock()

    def _map(self, nbytes: int) -> None:
        reply, fds = self._exchange_fds({"op": "map", "bytes": nbytes})
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise ProxyError(f"the proxy answered map without a memory region: {reply}")
        size = int(reply["bytes"])
        try:
            addr = _libc.mmap(None, size, _PROT_RW, _MAP_SHARED, fds[0], 0)
        finally:
            os.close(fds[0])
        if addr in (None, _MAP_FAILED):
            raise ProxyError(f"cannot map {size} bytes shared with the proxy: "
                             f"{os.strerror(ctypes.get_errno())}")
        _libc.madvise(addr, size, _MADV_DONTFORK)
        if self.shm_addr:
            _libc.munmap(self.shm_addr, self.shm_size)
        self.shm_addr, self.shm_size = addr, size

    def _exchange_fds(self, message: dict) -> tuple[dict, list[int]]:
        assert self.sock is not None and self.reader is not None
        wire.send(self.sock, message)
        reply, fds = self.reader.recv()
        if reply.get("error"):
            raise ProxyError(f"device proxy: {reply['error']}")
        return reply, fds

    def _exchange(self, message: dict) -> dict:
        reply, fds = self._exchange_fds(message)
        for fd in fds:
            os.close(fd)
        return reply

    # --- requests ---------------------------------------------------------------------------------

    def register_comm(self, comm: str, ranks: Sequence[int]) -> None:
        """Make a communicator known to the proxy. The first one connects: the rank's first turn on
        a shared device begins with its process group."""
        with self.lock:
            self.comms[comm] = list(ranks)
            if not self.started:
                self._guarded(self._connect)  # its hello names every communicator known
            elif self.sock is not None:
                self._guarded(lambda: self._exchange({"op": "comm", "comm": comm, "ranks": list(ranks)}))

    def call(self, message: dict, inputs: Sequence[tuple[int, int]], outputs: Sequence[tuple[int, int]],
             shm_bytes: int) -> dict:
        """Run one operation: copy `inputs` (address, length) into the shared region back to back,
        send `message`, copy the result from the region's start into `outputs`.

        A `park` answer (a checkpoint's cut) drops the connection, waits for the proxy and retries.
        """
        with self.lock:
            while True:
                if self.sock is None:
                    self._guarded(self._connect)
                    continue
                if shm_bytes > self.shm_size:
                    self._guarded(lambda: self._map(shm_bytes))
                    continue
                offset = 0
                for addr, length in inputs:
                    ctypes.memmove(self.shm_addr + offset, addr, length)
                    offset += length
                reply = self._answer(message)
                if reply is None:
                    continue
                offset = 0
                for addr, length in outputs:
                    ctypes.memmove(addr, self.shm_addr + offset, length)
                    offset += length
                return reply

    def _answer(self, message: dict) -> dict | None:
        """Send an operation and take its answer; None where it was `park` (a checkpoint's cut): the
        connection and everything the proxy handed out are dropped, and the caller sends it again."""
        reply = self._guarded(lambda: self._exchange(message))
        if reply.get("park"):
            self.parks += 1
            self._drop()
            return None
        return reply

    def call_gpu(self, message: dict, ptr: int, nbytes: int, ordinal: int) -> bool:
        """Run an allreduce of `nbytes` at device address `ptr` (CUDA device `ordinal`) through the
        proxy's GPU buffer: copy in, send `message`, copy the result back, all on the GPU. Returns
        False, having sent nothing, where the proxy offers no buffer on that GPU now (the caller then
        goes through host memory). A `park` answer drops the connection and the buffer, and retries.
        """
        with self.lock:
            while True:
                if self.sock is None:
                    self._guarded(self._connect)
                    continue
                if not self._gpu_usable(ordinal):
                    return False
                if self.gpu_buffer is None or nbytes > self.gpu_buffer.size:
                    if not self._map_gpu(nbytes, ordinal):
                        return False
                    continue
                try:
                    self.gpu_buffer.copy_in(ptr, nbytes)
                except RuntimeError as exc:  # nothing sent yet: host memory serves this one
                    self._refuse_gpu(str(exc))
                    return False
                if self._answer({**message, "gpu": True}) is None:
                    continue
                self.gpu_buffer.copy_out(ptr, nbytes)
                return True

    def _gpu_usable(self, ordinal: int) -> bool:
        if self.gpu_uuid is None or self.gpu_refused is not None:
            return False
        if ordinal not in self.gpu_uuids:
            try:
                from .gpu_buffer import device_uuid

                self.gpu_uuids[ordinal] = device_uuid(ordinal)
            except (OSError, RuntimeError) as exc:
                self.gpu_uuids[ordinal] = None
                self._refuse_gpu(f"cannot tell which GPU CUDA device {ordinal} is ({exc})")
        return self.gpu_uuids[ordinal] == self.gpu_uuid

    def _map_gpu(self, nbytes: int, ordinal: int) -> bool:
        """A buffer of at least nbytes from the proxy, the old one released first."""
        from .gpu_buffer import GpuBuffer

        asks = [nbytes]
        if self.gpu_buffer is not None:
            if 2 * self.gpu_buffer.size > nbytes:  # growing by doubling: few buffers a rank
                asks.insert(0, 2 * self.gpu_buffer.size)
            try:
                self.gpu_buffer.release()
            except RuntimeError as exc:
                self._end(f"cannot release the GPU buffer of the device proxy ({exc})")
            self.gpu_buffer = None
        for i, size in enumerate(asks):
            try:
                result = self._guarded(lambda size=size: self._exchange_fds({"op": "map_gpu", "bytes": size}))
                break
            except ProxyError as exc:
                if i == len(asks) - 1:  # the size needed itself is refused
                    self._refuse_gpu(str(exc))
                    return False
        if result is None:  # the proxy went away
            return False
        reply, fds = result
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            self._refuse_gpu(f"the proxy answered map_gpu without a buffer: {reply}")
            return False
        try:
            self.gpu_buffer = GpuBuffer(fds[0], int(reply["bytes"]), ordinal)
        except (OSError, RuntimeError) as exc:
            self._refuse_gpu(str(exc))
            return False
        return True

    def _refuse_gpu(self, why: str) -> None:
        """Stop using GPU buffers on this connection (tensors go through host memory; a new connection,
        after a checkpoint, tries again), and say why once."""
        self.gpu_refused = why
        sys.stderr.write(f"[singularity] rank {self.rank}: CUDA tensors go through host memory: {why}\n")
        sys.stderr.flush()

    def close(self) -> None:
        with self.lock:
            if self.sock is not None:
                try:
                    wire.send(self.sock, {"op": "bye"})
                except OSError:
                    pass
            self._drop()

    def _guarded(self, action):
        """Run `action`; if the proxy is gone (not parked: gone), wait to be ended by the node agent.

        A proxy that dies takes the job's collectives with it. The node agent notices, ends this
        process tree and has the job requeued from its last checkpoint; raising here instead would
        look like a failure of the user's script.
        """
        try:
            return action()
        except (OSError, EOFError, wire.ProtocolError) as exc:
            self._drop()
            self._end(f"lost the device proxy ({exc})")

    def _end(self, why: str) -> None:
        """Wait to be ended by the node agent, which requeues the job from its last checkpoint."""
        sys.stderr.write(f"[singularity] rank {self.rank}: {why}; the node agent requeues the job from its "
                         "last checkpoint\n")
        sys.stderr.flush()
        time.sleep(PROXY_LOST_WAIT_S)
        os._exit(75)
