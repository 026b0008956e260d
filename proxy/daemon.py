"""The device proxy daemon: `singularity-proxy`, one per allocated device, started by the Prolog.

It serves the job's ranks placed on its device. A rank connects to the unix socket named after it
(`wire.rank_address`, in a folder only root creates in: `ranksock`); the proxy checks it is the job's
user, hands it a shared-memory region of at most `proxy.max_region_mib`, and runs its operations:
collectives with the job's other proxies over the mesh, in a fixed rank order.
The node agent drives it through a root-only control socket:

  configure {generation, placement}   serve a rendezvous generation (placement: rank -> proxy id)
  quiesce {timeout}                   reach the job-wide cut (see `barrier`); answers once every
                                      proxy's ranks are parked with no connection to any proxy
  resume {}                           after the dump: serve the parked ranks again
  ready {timeout}                     wait until this generation's mesh is up, or failed (mesh_error)
  status {} | stats {}                state of the ranks and the barrier | time spent per operation
  gpu_pairs {rank, pairs}             a restored rank's GPU UUIDs, old -> new (see `swap`)

A GPU's proxy may also give a rank a buffer in the GPU's memory (`gpu`: the hello's answer names the
GPU, `map_gpu` hands the buffer over), through which the rank's allreduces of CUDA tensors go without
passing through host memory in the worker.

Ranks that share the device take turns on it where `proxy.time_slicing` says so (see `turns`): a
rank's first hello waits for its turn, and each operation hands the turn on while it runs. On a GPU
whose ranks do not fit together, a waiting rank's GPU memory moves to host memory meanwhile (`swap`).

Nothing here must survive a checkpoint: a restored job gets fresh proxies and a new generation.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from singularity_slurm import faults, rpc
from singularity_slurm.config import ProxyConfig
from singularity_slurm.errors import SingularityError
from singularity_slurm.interpose.pyhook._singularity_worker import wire

from . import barrier, collectives, gpu, shared, swap
from .barrier import Gate, Phase
from .hal import BackendError, DeviceBackend, Region, backend, dtype_of
from .mesh import Mesh, MeshError
from .ranksock import RankSockets
from .rendezvous import Rendezvous, RendezvousError
from .swap import GpuMemory, SwapError, SwapMode
from .turns import Slicing, Turns, takes_turns

LOG = logging.getLogger("singularity.proxy")
MAX_DEPARTED = 64  # ranks' processes that left but still run, watched for the GPU memory they hold
MAX_GPU_MAPS = 32  # GPU buffers one rank may ask for per generation (a worker asks for doubling sizes)

# The collectives, each with what every member must say alike about it (alltoall's counts differ by
# rank, and its exchange checks each piece). Each is one operation on its communicator's channel, so
# the barrier counts it as it counts the others.
AGREE: dict[str, tuple[str, ...]] = {
    "allreduce": ("dtype", "count", "reduce"), "reduce": ("dtype", "count", "reduce", "root"),
    "broadcast": ("dtype", "count", "root"), "allgather": ("dtype", "count"),
    "gather": ("dtype", "count", "root"), "scatter": ("dtype", "count", "root"),
    "reduce_scatter": ("dtype", "count", "reduce"), "alltoall": ("dtype",), "barrier": (),
}


class RankState(enum.StrEnum):
    """A rank as its proxy sees it.

    ABSENT -> IDLE (hello) -> BUSY (in an operation) -> IDLE | PARKING (answered `park`)
    PARKING -> PARKED (the worker closed its connection: it holds nothing of the proxy's any more)
    PARKING | PARKED -> ABSENT (resume) ; IDLE | BUSY -> FINISHED (bye, or the connection closed)
    """

    ABSENT = "absent"
    IDLE = "idle"
    BUSY = "busy"
    PARKING = "parking"
    PARKED = "parked"
    FINISHED = "finished"


@dataclass
class Session:
    rank: int
    sock: socket.socket
    reader: wire.Reader
    region: Region | None = None
    comms: dict[str, int] = field(default_factory=dict)  # communicator -> this rank's place in it
    process: swap.Process | None = None  # the worker as it connected, where GPU memory may move
    inside: bool = False  # blocked in the proxy for an answer (not computing): its GPU memory may move
    on_device: bool = False  # its GPU memory was checked to be on the GPU since it connected
    gpu: gpu.DeviceBuffer | None = None  # its buffer in the GPU's memory (proxy.gpu_buffers)
    stage: Region | None = None  # the proxy's host copy of that buffer, for peers on other GPUs


@dataclass
class Pending:
    """One collective on this proxy: its local members arrive one by one; the last one runs it."""

    expected: int
    entries: dict[int, tuple[Session, dict]] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    lost: bool = False  # a peer proxy went away: every member waits, as the one running it does
    first_at: float = field(default_factory=time.monotonic)


class ProxyError(Exception):
    """A worker's request cannot be served; the message goes back to the worker."""


class Proxy:
    def __init__(self, job_id: int, job_uid: int, proxy_id: str, device: DeviceBackend,
                 rendezvous_factory, *, state_dir: Path, limits: ProxyConfig | None = None,
                 bind_host: str = "0.0.0.0", advertise_host: str = "127.0.0.1",
                 fault: Callable[[str], None] | None = None, memory: GpuMemory | None = None,
                 cuda: gpu.CudaDevice | None = None):
        self.job_id = job_id
        self.fault = fault or (lambda point: None)  # a test's fault point (singularity_slurm.faults)
        self.job_uid = job_uid
        self.id = proxy_id
        self.device = device
        self.rendezvous_factory = rendezvous_factory
        self.bind_host = bind_host
        self.advertise_host = advertise_host
        self.cond = threading.Condition()
        self.generation: str | None = None
        self.placement: dict[int, str] = {}
        self.local_ranks: list[int] = []
        self.leader: str | None = None
        self.proxies: list[str] = []
        self.mesh: Mesh | None = None
        self.mesh_error: str | None = None
        self.ready = False
        self.limits = limits or ProxyConfig()
        self.rank_sockets = RankSockets(state_dir, job_id, job_uid)
        self.listeners: dict[int, socket.socket] = {}
        self.connections: dict[int, int] = defaultdict(int)  # rank -> connections being served
        self.sessions: dict[int, Session] = {}
        self.states: dict[int, RankState] = {}
        self.issued: dict[int, dict[str, int]] = {}
        self.comms: dict[str, list[int]] = {}
        self.groups: dict[str, collectives.Group] = {}  # by communicator, for this generation's placement
        self.pending: dict[tuple[str, int], Pending] = {}
        self.phase = Phase.RUNNING
        self.targets: dict[str, int] = {}
        self.parked_ops: dict[int, tuple[str, int]] = {}  # rank -> the operation it parked on
        self.reported_parked = False
        self.round: barrier.Round | None = None
        # Cuts are numbered: the leader counts the rounds it completed, every proxy the latest it was
        # told of, so a drain request sent before its sender heard of a cut that covered it is known.
        self.rounds_done = 0
        self.cut_seen = 0
        self.cut_started: float | None = None
        self.stats: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.stats_lock = threading.Lock()
        self.stopping = False  # once set, a peer going away is the job ending, not a failure
        self.turns = Turns()
        self.sliced = False  # this generation's ranks on the device take turns
        # Peers on this host attach the members' regions (proxy.shared): which host each proxy is on.
        self.host = shared.host_identity() if self.limits.shared_memory else None
        self.peer_hosts: dict[str, str | None] = {}
        self.peer_pids: dict[str, int] = {}  # what a peer's region announcements must name
        self.shares_memory: dict[str, bool] = {}  # by communicator, for this generation
        self.peer_regions = shared.PeerRegions()
        # The GPU's memory per rank, moved to host memory while a rank waits (proxy.gpu_swap, `swap`).
        self.memory = memory
        self.cuda = cuda  # the GPU's buffers shared with ranks and its reductions (`gpu`), where set up
        self.gpu_maps: dict[int, int] = defaultdict(int)  # rank -> GPU buffers handed out this generation
        self.swap_lock = threading.Lock()  # one move at a time, decided on what is known then
        self.footprints: dict[int, int] = {}  # rank -> its GPU bytes, as last measured on the GPU
        self.out: set[int] = set()  # ranks whose GPU memory is in host memory now
        self.restored_out: set[int] = set()  # of those, ranks found so at connect (restored so)
        self.gpu_pairs: dict[int, list[swap.cuda.GpuPair]] = {}  # a restored rank's GPU UUIDs, old -> new
        # Ranks that left the proxy (bye) but whose processes still run, maybe with GPU memory: a rank
        # that would not fit beside them waits for them to end (pid -> process; closed once they end).
        self.departed: dict[int, swap.Process] = {}

    def log(self, message: str, *args) -> None:
        LOG.info("job %s proxy %s gen %s: " + message, self.job_id, self.id, self.generation, *args)

    # --- configuration ----------------------------------------------------------------------------

    def configure(self, generation: str, placement: dict[int, str]) -> dict:
        self._teardown()
        ranks = sorted(placement)
        if ranks != list(range(len(ranks))):
            raise ProxyError(f"placement must name ranks 0..N-1, got {ranks}")
        with self.swap_lock, self.cond:
            self.generation = generation
            self.placement = dict(placement)
            self.groups, self.peer_hosts, self.peer_pids, self.shares_memory = {}, {}, {}, {}
            self.local_ranks = [r for r in ranks if placement[r] == self.id]
            self.proxies = list(collectives.Group("world", tuple(placement[r] for r in ranks)).proxies)
            self.leader = self.proxies[0] if self.proxies else None
            self.states = {r: RankState.ABSENT for r in self.local_ranks}
            self.issued = {r: {} for r in self.local_ranks}
            self.phase, self.targets, self.ready, self.mesh_error = Phase.RUNNING, {}, False, None
            self.turns = Turns()
            self.footprints, self.out, self.restored_out, self.gpu_pairs = {}, set(), set(), {}
            self.gpu_maps = defaultdict(int)
            exclusive = bool(getattr(self.device, "exclusive", False))
            self.sliced = takes_turns(Slicing(self.limits.time_slicing), exclusive, len(self.local_ranks))
        if not self.local_ranks:
            self.log("serves no rank of this generation")
            return {"ranks": []}
        for rank in self.local_ranks:
            self._listen(rank)
        threading.Thread(target=self._build_mesh, daemon=True).start()
        self.log("serving ranks %s%s; proxies %s; leader %s", self.local_ranks,
                 " (taking turns)" if self.sliced else "", self.proxies, self.leader)
        return {"ranks": self.local_ranks, "turns": self.sliced}

    def _build_mesh(self) -> None:
        with self.cond:
            generation, proxies = self.generation, list(self.proxies)
        mesh: Mesh | None = None
        try:
            mesh = Mesh(self.id, str(generation), "", self.bind_host, self._on_control, self._on_lost,
                        max_payload=self.max_mesh_payload())
            rendezvous: Rendezvous = self.rendezvous_factory()
            mesh.token = rendezvous.publish(str(generation), self.id, self.advertise_host, mesh.port)
            addresses = rendezvous.wait(str(generation), proxies, timeout=300)
            with self.cond:
                if self.generation != generation:
                    raise MeshError(f"generation {generation} was replaced by {self.generation}")
                self.mesh = mesh
            mesh.connect(addresses, timeout=300)
            self._learn_hosts(mesh, generation, [p for p in proxies if p != self.id], timeout=300)
        except (OSError, MeshError, RendezvousError, SingularityError, ValueError) as exc:
            with self.cond:
                current = self.generation == generation
                if current:
                    self.mesh_error = str(exc)
                    if self.mesh is mesh:
                        self.mesh = None
                self.cond.notify_all()
            if mesh is not None:
                mesh.close()
            self.log("mesh of generation %s failed%s: %s", generation, "" if current else " (stale)", exc)
            return
        with self.cond:
            if self.generation == generation:
                self.ready = True
            self.cond.notify_all()
        self.log("mesh ready with %s", [p for p in proxies if p != self.id])

    def _learn_hosts(self, mesh: Mesh, generation: str | None, peers: list[str], timeout: float) -> None:
        """Tell every peer which host this proxy is on, and wait until each has told its own."""
        for peer in peers:
            mesh.control(peer, {"ctl": "host", "host": self.host, "pid": os.getpid()})
        deadline = time.monotonic() + timeout
        with self.cond:
            while not set(peers) <= set(self.peer_hosts):
                if self.generation != generation or mesh.closed:
                    raise MeshError(f"generation {generation} ended while its proxies said where they run")
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(peers) - set(self.peer_hosts))
                    raise MeshError(f"proxies {', '.join(missing)} did not say which host they run on "
                                    f"within {timeout:.0f}s")
                self.cond.wait(left)

    def _shares_memory(self, group: collectives.Group) -> bool:
        """Whether every proxy of the group runs on this host, in reach of each other's regions."""
        found = self.shares_memory.get(group.name)
        if found is None:
            found = self.shares_memory[group.name] = self.host is not None and len(group.proxies) > 1 and all(
                self.peer_hosts.get(p) == self.host for p in group.proxies if p != self.id)
        return found

    def _attach(self, peer: str, member: int, ref: dict, dtype: np.dtype, count: int) -> np.ndarray:
        region = shared.RegionRef.of_record(ref)
        if region.pid != self.peer_pids.get(peer):
            raise ValueError(f"proxy {peer} announced a region of pid {region.pid}, not its own "
                             f"({self.peer_pids.get(peer)})")
        return self.peer_regions.array(peer, region, shared.region_name(self.job_id), dtype, count)

    def max_mesh_payload(self) -> int:
        """The largest frame payload a peer proxy may send: every rank's region at most, plus
        alltoall's counts. A frame carries pieces of one proxy's members' regions."""
        ranks = max(1, len(self.placement))
        return self.limits.max_region_bytes * ranks + 8 * ranks * ranks + 65536

    def _listen(self, rank: int) -> None:
        sock = self.rank_sockets.listen(rank, backlog=self.limits.max_rank_connections)
        with self.cond:
            self.listeners[rank] = sock
        threading.Thread(target=self._accept, args=(rank, sock), daemon=True).start()

    def _unlisten(self, rank: int) -> None:
        sock = self.listeners.pop(rank, None)
        if sock is not None:
            self.rank_sockets.unlink(rank)
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _teardown(self) -> None:
        with self.cond:
            for rank in list(self.listeners):
                self._unlisten(rank)
            for session in self.sessions.values():
                session.sock.close()
            self.sessions.clear()
            if self.mesh is not None:
                self.mesh.close()
                self.mesh = None
            self.pending.clear()
            self.peer_regions.close()
            self.cond.notify_all()

    # --- worker connections -----------------------------------------------------------------------

    def _accept(self, rank: int, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            uid = wire.peer_uid(sock)
            if uid not in (self.job_uid, 0):
                self.log("refused a connection for rank %s from uid %s", rank, uid)
                sock.close()
                continue
            with self.cond:
                busy = self.connections[rank] >= self.limits.max_rank_connections
                if not busy:
                    self.connections[rank] += 1
            if busy:
                self.log("refused a connection for rank %s: it has %s already (proxy.max_rank_connections)",
                         rank, self.limits.max_rank_connections)
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(rank, sock), daemon=True).start()

    def _map(self, message: dict) -> Region:
        return self.device.region(self._bounded(message, "a shared region"), shared.region_name(self.job_id))

    def _bounded(self, message: dict, what: str) -> int:
        """The bytes a rank asks for, within the admin's bound."""
        nbytes = int(message["bytes"])
        limit = self.limits.max_region_bytes
        if not 0 <= nbytes <= limit:
            raise ProxyError(f"{what} of {nbytes} bytes is not between 0 and the {limit} bytes the admin "
                             f"allows (proxy.max_region_mib = {self.limits.max_region_mib}): move less data "
                             "per collective call")
        return nbytes

    def _gpu_uuid(self) -> str | None:
        """The GPU whose buffers this proxy offers its ranks now, if it does."""
        return self.cuda.uuid if self.cuda is not None and self._gpu_offered() else None

    def _gpu_offered(self) -> bool:
        return gpu.offered(self.cuda is not None and self.cuda.failed is None, self.sliced,
                           self.memory is not None and self.limits.gpu_swap != SwapMode.NEVER)

    def _map_gpu(self, session: Session, message: dict) -> tuple[gpu.DeviceBuffer, int]:
        """A new GPU buffer for the rank (its old one goes: the worker released it before asking),
        and a descriptor of it for the worker."""
        if self.cuda is None or not self._gpu_offered():
            raise ProxyError("this proxy offers no GPU buffers now: send CUDA tensors through host memory")
        with self.cond:
            if self.sessions.get(session.rank) is not session:
                raise ProxyError("say hello first")
            if self.gpu_maps[session.rank] >= MAX_GPU_MAPS:
                raise ProxyError(f"rank {session.rank} had {MAX_GPU_MAPS} GPU buffers in this generation: "
                                 "no more (ask for the largest size needed)")
            self.gpu_maps[session.rank] += 1
        nbytes = self._bounded(message, "a GPU buffer")
        self._free_gpu(session)
        try:
            session.gpu = self.cuda.alloc(nbytes)
            return session.gpu, self.cuda.export(session.gpu)
        except gpu.GpuUnavailable as exc:
            LOG.warning("job %s proxy %s: no GPU buffer for rank %s: %s", self.job_id, self.id,
                        session.rank, exc)
            raise

    def _free_gpu(self, session: Session) -> None:
        buffer, session.gpu = session.gpu, None
        if buffer is not None and self.cuda is not None:
            try:
                self.cuda.free(buffer)
            except gpu.GpuUnavailable as exc:
                LOG.warning("job %s proxy %s: freeing rank %s's GPU buffer: %s", self.job_id, self.id,
                            session.rank, exc)
        if session.stage is not None:
            session.stage.close()
            session.stage = None

    def _serve(self, rank: int, sock: socket.socket) -> None:
        try:
            self._serve_session(rank, sock)
        finally:
            with self.cond:
                self.connections[rank] -= 1

    def _serve_session(self, rank: int, sock: socket.socket) -> None:
        session = Session(rank, sock, wire.Reader(sock))
        if self.memory is not None:
            session.process = swap.peer_process(sock)
            with self.swap_lock:
                back = self.departed.pop(session.process.pid, None) if session.process else None
                if back is not None:  # it is back (after a cut): not gone
                    os.close(back.pidfd)
        parked = False
        try:
            while True:
                message, fds = session.reader.recv()
                for fd in fds:
                    os.close(fd)
                op = message.get("op")
                try:
                    if op == "hello":
                        self._hello(session, message)
                        if message.get("turn") is True and self.sliced:
                            session.inside = True
                            self._take_turn(session)
                            self._on_device(session)
                        elif not self.sliced:
                            self._on_device(session)  # restored with its GPU memory out: it comes back
                        wire.send(sock, {"ok": True, "generation": self.generation, "proxy": self.id,
                                         "turns": self.sliced,
                                         "gpu": self._gpu_uuid()})
                    elif op == "map":
                        region = self._map(message)
                        old, session.region = session.region, region
                        wire.send(sock, {"ok": True, "bytes": region.size}, [region.fd])
                        if old is not None:
                            old.release()
                    elif op == "map_gpu":
                        buffer, fd = self._map_gpu(session, message)
                        try:
                            wire.send(sock, {"ok": True, "bytes": buffer.size}, [fd])
                        finally:
                            os.close(fd)
                    elif op == "comm":
                        self._register_comm(session, str(message["comm"]), message["ranks"])
                        wire.send(sock, {"ok": True})
                    elif op == "bye":
                        return
                    else:
                        reply = self._in_turn(session, message)
                        wire.send(sock, reply)
                        if reply.get("park"):
                            parked = True
                            self._await_release(session)
                            return
                except (ProxyError, BackendError, gpu.GpuUnavailable, KeyError, ValueError, TypeError) as exc:
                    wire.send(sock, {"ok": False, "error": f"{op}: {exc}"})
        except (EOFError, OSError, wire.ProtocolError):
            pass
        finally:
            sock.close()
            if session.region is not None:
                session.region.release()
            self._free_gpu(session)
            if session.process is not None:
                with self.swap_lock:  # a rank parked at a cut comes back; one that left may hold memory on
                    process, session.process, session.inside = session.process, None, False
                    if (not parked and session.on_device and len(self.departed) < MAX_DEPARTED
                            and process.pid not in self.departed and swap.alive(process.pidfd)):
                        self.departed[process.pid] = process
                    else:
                        os.close(process.pidfd)
            with self.cond:
                if self.sessions.get(rank) is session:
                    del self.sessions[rank]
                    if self.turns.forget(rank, time.monotonic()) is not None:
                        self.cond.notify_all()
                    if not parked and self.states.get(rank) != RankState.PARKED:
                        self.states[rank] = RankState.FINISHED
                    self._check_parked()
                self.cond.notify_all()

    def _await_release(self, session: Session) -> None:
        """After `park`: wait until the worker closed its connection (it unmaps its region first)."""
        try:
            while True:
                _, fds = session.reader.recv()
                for fd in fds:
                    os.close(fd)
        except (EOFError, OSError, wire.ProtocolError):
            pass
        with self.cond:
            if self.states.get(session.rank) == RankState.PARKING:
                self.states[session.rank] = RankState.PARKED
                self._check_parked()
            self.cond.notify_all()

    def _hello(self, session: Session, message: dict) -> None:
        rank = session.rank
        if message.get("rank") != rank:
            raise ProxyError(f"connected as rank {rank} but said rank {message.get('rank')}")
        with self.cond:
            if rank not in self.local_ranks:
                raise ProxyError(f"rank {rank} is not served by proxy {self.id}")
            if message.get("world_size") != len(self.placement):
                raise ProxyError(f"world size {message.get('world_size')} differs from the job's "
                                 f"{len(self.placement)}")
            previous = self.sessions.get(rank)
            if previous is not None:
                previous.sock.close()
            self.sessions[rank] = session
            self.cond.notify_all()  # a thread of the replaced session waiting for a turn gives up
            self.states[rank] = RankState.IDLE
        for comm, ranks in (message.get("comms") or {}).items():
            self._register_comm(session, str(comm), ranks)

    def _register_comm(self, session: Session, comm: str, ranks: Any) -> None:
        if not isinstance(ranks, list) or not all(isinstance(r, int) and r in self.placement for r in ranks):
            raise ProxyError(f"communicator {comm}: ranks must be ranks of the job, got {ranks!r}")
        if len(set(ranks)) != len(ranks):
            raise ProxyError(f"communicator {comm}: ranks {ranks} name a rank twice")
        if session.rank not in ranks:  # checked first: a refused registration fixes nothing
            raise ProxyError(f"communicator {comm}: rank {session.rank} registers it but is not among its "
                             f"ranks {ranks}")
        with self.cond:
            known = self.comms.setdefault(comm, list(ranks))
            if known != list(ranks):
                raise ProxyError(f"communicator {comm} has ranks {known}, rank {session.rank} says {ranks}")
        session.comms[comm] = ranks.index(session.rank)

    def group(self, comm: str) -> collectives.Group:
        """The communicator's group in this generation's placement (made once: see Group)."""
        group = self.groups.get(comm)
        if group is None:
            with self.cond:
                group = self.groups[comm] = collectives.Group(comm, tuple(self.placement[r]
                                                                          for r in self.comms[comm]))
        return group

    # --- turns on the device -----------------------------------------------------------------------

    def _in_turn(self, session: Session, message: dict) -> dict:
        """Run an operation with the device's turn handed on meanwhile; answer once the rank holds
        the turn again (not when it parked: a parked rank holds no turn)."""
        if not self.sliced:
            reply = self._operation(session, message)
            if not session.on_device and not reply.get("park"):
                self._on_device(session)  # restored with its GPU memory out: it comes back once
            return reply
        with self.cond:
            session.inside = True
            if self.turns.release(session.rank, time.monotonic()) is not None:
                self.cond.notify_all()
        try:
            reply = self._operation(session, message)
        except (ProxyError, BackendError, KeyError, ValueError, TypeError):
            self._take_turn(session)  # the script goes on computing after the error it is told
            self._on_device(session)
            raise
        if reply.get("park"):
            with self.cond:
                session.inside = False  # it lets go of the proxy; the checkpoint takes its GPU state
        else:
            self._take_turn(session)
            self._on_device(session)
        return reply

    def _take_turn(self, session: Session) -> None:
        """Wait until the rank holds the device's turn (at once where its ranks do not take turns),
        or until its session or generation is over. A holder that keeps the turn for
        `proxy.turn_lapse_s` loses it to the rank that waited longest (it runs on beside it)."""
        rank = session.rank
        with self.cond:
            if not self.sliced or self.sessions.get(rank) is not session:
                return
            generation, started = self.generation, time.monotonic()
            self.turns.request(rank, started)
            while not self.turns.holds(rank):
                if self.generation != generation or self.stopping or self.sessions.get(rank) is not session:
                    self.turns.cancel(rank)
                    return
                lapse = self.turns.lapse_at(self.limits.turn_lapse_s)
                now = time.monotonic()
                if lapse is not None and now >= lapse:
                    held, since = self.turns.holder, self.turns.since
                    self.turns.lapse(now)
                    self.log("rank %s held the device's turn for %.0fs without a collective: rank %s runs "
                             "beside it (proxy.turn_lapse_s)", held, now - since, self.turns.holder)
                    self._count("turn", lapses=1)
                    self.cond.notify_all()
                    continue
                self.cond.wait(None if lapse is None else lapse - now)
        self._count("turn", count=1, wait_seconds=time.monotonic() - started)

    def _on_device(self, session: Session) -> None:
        """Before the rank computes again: its GPU memory back on the GPU if it is out, after the
        waiting ranks' memory has gone out as far as `proxy.gpu_swap` says (see `swap`)."""
        if self.memory is None or session.process is None:
            session.on_device = True
            return
        started = time.monotonic()
        moved: list[tuple[str, int, int]] = []
        rank = session.rank
        with self.swap_lock:
            with self.cond:
                process = session.process
                if self.sessions.get(rank) is not session or process is None:
                    return
                inside = [r for r, s in self.sessions.items() if s.inside and s is not session and s.process]
                order = swap.eviction_order(inside, list(self.turns.waiting))
                others = {r: self.sessions[r].process for r in order}
                self.turns.moving = self.turns.holds(rank)  # its turn begins once its memory is back
            try:
                decided = self._swap_plan(session, process, others, order)
                for other in decided.out:
                    if self._move_out(other, others[other]):
                        moved.append(("out", other, self.footprints.get(other, 0)))
                if decided.bring_in:
                    self._await_departed(rank)
                    pairs = ([p for p in self.gpu_pairs.get(rank, [])
                              if p.new_uuid == getattr(self.memory, "uuid", None)]
                             if rank in self.restored_out else [])
                    try:
                        self.memory.move_in(process, pairs)
                    except SwapError as exc:
                        # It cannot compute (its CUDA calls would wait for ever): it is ended as if its
                        # proxy had gone, and the node agent requeues the job from its last checkpoint.
                        self.log("rank %s: its GPU memory could not come back; dropping its connection: %s",
                                 rank, exc)
                        session.sock.close()
                        raise ProxyError(f"the rank's GPU memory could not come back: {exc}") from exc
                    self.out.discard(rank)
                    self.restored_out.discard(rank)
                    moved.append(("in", rank, self.footprints.get(rank, 0)))
            finally:
                with self.cond:
                    self.turns.begin(rank, time.monotonic())
                    self.cond.notify_all()
        with self.cond:
            session.inside, session.on_device = False, True
        if moved:
            seconds = time.monotonic() - started
            self._count("swap", count=1, seconds=seconds, out=sum(m[0] == "out" for m in moved),
                        **{"in": sum(m[0] == "in" for m in moved)},
                        bytes=sum(m[2] for m in moved))
            LOG.debug("job %s proxy %s: before rank %s computes: %s in %.3fs", self.job_id, self.id,
                      rank, moved, seconds)

    def _swap_plan(self, session: Session, process: swap.Process, others: dict[int, swap.Process],
                   order: list[int]) -> swap.Plan:
        """Under swap_lock: what moves before `session`'s rank computes, from NVML's measure now."""
        rank = session.rank
        try:
            free, used = self.memory.usage()
            for other, proc in [*others.items(), (rank, process)]:
                if other not in self.out and proc.pid in used:
                    self.footprints[other] = used[proc.pid]
            if not session.on_device and rank not in self.out and self.memory.is_out(process):
                self.out.add(rank)  # restored with its memory out: it comes back through the pairs
                self.restored_out.add(rank)
            mode = SwapMode(self.limits.gpu_swap) if self.sliced else SwapMode.NEVER
            return swap.plan(mode, rank, self.footprints, self.out, order, free,
                             self.limits.gpu_swap_reserve_bytes)
        except SwapError as exc:
            self.log("rank %s: cannot read its GPU's memory (%s): no other rank's memory moves", rank, exc)
            return swap.Plan(bring_in=rank in self.out)

    def _move_out(self, rank: int, process: swap.Process) -> bool:
        """Under swap_lock: a waiting rank's memory to host memory. Where the driver fails, what
        state it left the process in decides whether it counts as out."""
        try:
            self.memory.move_out(process)
            self.out.add(rank)
            return True
        except SwapError as exc:
            self.log("rank %s: its GPU memory stays on the GPU: %s", rank, exc)
            try:
                if self.memory.is_out(process):
                    self.out.add(rank)  # it comes back before it computes, as any rank that is out
            except SwapError:
                pass
            return False

    # --- operations -------------------------------------------------------------------------------

    def _channel(self, session: Session, message: dict) -> tuple[str, int]:
        comm = str(message["comm"])
        if comm not in session.comms:
            raise ProxyError(f"communicator {comm} was not registered")
        me = session.comms[comm]
        op = message["op"]
        if op == "send":
            return barrier.p2p_channel(comm, me, int(message["peer"])), me
        if op == "recv":
            return barrier.p2p_channel(comm, int(message["peer"]), me), me
        return barrier.collective_channel(comm), me

    def _operation(self, session: Session, message: dict) -> dict:
        channel, group_rank = self._channel(session, message)
        rank = session.rank
        with self.cond:
            while not self.ready:
                # A mesh that failed is the node agent's to act on (it ends the tree, and the job is
                # requeued): the rank waits rather than fail its training script.
                self.cond.wait(1.0)
            seq = self.issued[rank].get(channel, 0) + 1
            while True:
                decision = barrier.gate(self.phase, seq, self.targets.get(channel, 0))
                if decision != Gate.HOLD:
                    break
                self.cond.wait()
            if decision == Gate.PARK:
                self.states[rank] = RankState.PARKING
                self.parked_ops[rank] = (channel, seq)
                self._unlisten(rank)
                return {"park": True}
            self.issued[rank][channel] = seq
            self.states[rank] = RankState.BUSY
        started = time.monotonic()
        try:
            self._execute(session, message, channel, seq, group_rank)
        except MeshError:
            time.sleep(3600)  # the proxy is exiting (lost peer): let the node agent end the job
        finally:
            with self.cond:
                if self.states.get(rank) == RankState.BUSY:
                    self.states[rank] = RankState.IDLE
            self._count(message["op"], count=1, seconds=time.monotonic() - started)
        return {"ok": True}

    def _execute(self, session: Session, message: dict, channel: str, seq: int, group_rank: int) -> None:
        op = message["op"]
        if op in ("send", "recv"):
            self._point_to_point(session, message, channel, seq, group_rank)
            return
        if op not in AGREE:
            raise ProxyError(f"unknown operation {op!r}")
        group = self.group(str(message["comm"]))
        key = (channel, seq)
        with self.cond:
            pending = self.pending.get(key)
            if pending is None:
                pending = self.pending[key] = Pending(expected=len(group.members_of(self.id)))
            pending.entries[group_rank] = (session, message)
            last = len(pending.entries) == pending.expected
            if last:
                del self.pending[key]
        if last:
            self._count(op, skew_seconds=time.monotonic() - pending.first_at)
            try:
                self._collective(group, f"{channel}:{seq}", pending)
            except (BackendError, ProxyError, gpu.GpuUnavailable, ValueError) as exc:
                pending.error = str(exc)
            except MeshError:
                pending.lost = True
                raise
            except Exception as exc:  # noqa: BLE001 - every local member is told, none gets a partial result
                LOG.exception("job %s proxy %s: collective %s:%s failed", self.job_id, self.id, channel, seq)
                pending.error = f"internal error of the proxy: {type(exc).__name__}: {exc}"
            finally:
                pending.done.set()
        else:
            pending.done.wait()
        if pending.lost:
            raise MeshError("lost a peer proxy during the collective")
        if pending.error:
            raise ProxyError(pending.error)

    def _collective(self, group: collectives.Group, tag: str, pending: Pending) -> None:
        assert self.mesh is not None
        entries = pending.entries
        first = next(iter(entries.values()))[1]
        op = first["op"]
        for _session, message in entries.values():
            if message["op"] != op or any(message.get(k) != first.get(k) for k in AGREE[op]):
                raise ProxyError(f"ranks disagree on collective {tag}: {message} vs {first}")
        started = time.monotonic()
        if op == "barrier":
            collectives.barrier(self.mesh, group, tag)
            self._count(op, exchange_seconds=time.monotonic() - started)
            return
        dtype, size = str(first["dtype"]), len(group.owners)
        if op == "alltoall":
            outputs = self._alltoall(group, tag, entries, dtype)
            self._count(op, exchange_seconds=time.monotonic() - started,
                        bytes=sum(a.nbytes for a in outputs.values()))
            self._deliver(entries, dtype, outputs)
            return
        count = int(first["count"])
        if count < 0:
            raise ProxyError(f"{op}: a count of {count} elements")
        root = int(first.get("root", 0))
        if not 0 <= root < size:
            raise ProxyError(f"{op}: root {root} is not a rank of communicator {group.name} of {size}")
        if op == "scatter":
            data = self._region(entries[root][0]).array(dtype, count * size) if root in entries else None
            outputs = collectives.scatter(self.mesh, group, tag, data, root, sorted(entries), count,
                                          dtype_of(dtype))
            self._count(op, exchange_seconds=time.monotonic() - started,
                        bytes=count * dtype_of(dtype).itemsize)
            self._deliver(entries, dtype, outputs)
            return
        on_gpu = {g: s for g, (s, message) in entries.items() if message.get("gpu") is True}
        if on_gpu and op != "allreduce":
            raise ProxyError(f"{op} does not take its tensor from a GPU buffer: only allreduce does")
        if on_gpu and self._reduce_on_gpu(group, entries, dtype, count, str(first["reduce"])):
            self._count(op, gpu_reduce=1, exchange_seconds=time.monotonic() - started,
                        bytes=count * dtype_of(dtype).itemsize)
            return
        nbytes = count * dtype_of(dtype).itemsize
        for s in on_gpu.values():  # before the proxy makes a host copy of that size
            gpu.fits(self._gpu_buffer(s), nbytes)
        hosts = {g: self._host_region(s, g in on_gpu, nbytes) for g, (s, _) in entries.items()}
        inputs = {g: r.array(dtype, count) for g, r in hosts.items()}
        for g, s in on_gpu.items():  # the device-to-host pipeline: members' buffers into host memory
            self._gpu().download(self._gpu_buffer(s), inputs[g])
        if op == "allreduce" and self._shares_memory(group):  # in place, straight from each region
            pid = os.getpid()
            regions = {g: shared.RegionRef(pid, r.fd, r.ino, r.size).record() for g, r in hosts.items()}
            collectives.allreduce_shared(self.mesh, self.device, group, tag, inputs, str(first["reduce"]),
                                         regions, self._attach)
            self._count(op, shared_memory=1)
            outputs = {}
        elif op == "allreduce":  # the result lands in the members' regions, where their inputs were
            collectives.allreduce(self.mesh, self.device, group, tag, inputs, str(first["reduce"]),
                                  into=list(inputs.values()))
            outputs = {}
        elif op == "reduce":
            result = collectives.reduce(self.mesh, self.device, group, tag, inputs, str(first["reduce"]),
                                        root)
            outputs = {root: result} if result is not None else {}
        elif op == "broadcast":
            result = collectives.broadcast(self.mesh, group, tag, inputs, root)
            outputs = {g: result for g in entries if g != root}
        elif op == "allgather":
            result = collectives.allgather(self.mesh, group, tag, inputs, inputs[next(iter(inputs))].dtype)
            outputs = {g: result for g in entries}
        elif op == "gather":
            result = collectives.gather(self.mesh, group, tag, inputs, root)
            outputs = {root: result} if result is not None else {}
        else:  # reduce_scatter
            if count % size:
                raise ProxyError(f"reduce_scatter of {count} elements over {size} ranks")
            result = collectives.allreduce(self.mesh, self.device, group, tag, inputs, str(first["reduce"]))
            assert result is not None
            k = count // size
            outputs = {g: result[g * k:(g + 1) * k] for g in entries}
        for g, s in on_gpu.items():  # and the result back into them
            self._gpu().upload(inputs[g], self._gpu_buffer(s))
        if on_gpu:
            self._count(op, gpu_pipeline=1)
        self._count(op, exchange_seconds=time.monotonic() - started, bytes=inputs[next(iter(inputs))].nbytes)
        self._deliver(entries, dtype, outputs)

    def _reduce_on_gpu(self, group: collectives.Group, entries: dict[int, tuple[Session, dict]], dtype: str,
                       count: int, op: str) -> bool:
        """Every member of the communicator is on this GPU with its tensor in its buffer: reduce there,
        in group-rank order, into the first member's buffer, and copy the result to the others'."""
        if self.cuda is None or len(group.proxies) != 1:
            return False
        if not all(message.get("gpu") is True for _, message in entries.values()):
            return False
        buffers = [self._gpu_buffer(entries[g][0]) for g in range(len(group.owners))]
        self.cuda.reduce(dtype, op, buffers, buffers[0], count)
        for buffer in buffers[1:]:
            self.cuda.copy(buffer, buffers[0], count * dtype_of(dtype).itemsize)
        return True

    def _host_region(self, session: Session, on_gpu: bool, nbytes: int) -> Region:
        """Where a member's contribution is in host memory: its shared region, or, for one in its GPU
        buffer, the proxy's own host region for it (peers on this host may attach it)."""
        if not on_gpu:
            return self._region(session)
        if session.stage is None or session.stage.size < nbytes:
            old, session.stage = session.stage, self.device.region(nbytes, shared.region_name(self.job_id))
            if old is not None:
                old.close()
        return session.stage

    @staticmethod
    def _gpu_buffer(session: Session) -> gpu.DeviceBuffer:
        if session.gpu is None:
            raise ProxyError("no GPU buffer mapped: send map_gpu first")
        return session.gpu

    def _gpu(self) -> gpu.CudaDevice:
        if self.cuda is None:
            raise ProxyError("this proxy has no GPU buffers")
        return self.cuda

    def _alltoall(self, group: collectives.Group, tag: str, entries: dict[int, tuple[Session, dict]],
                  dtype: str) -> dict[int, np.ndarray]:
        assert self.mesh is not None
        size = len(group.owners)
        send: dict[int, list[int]] = {}
        recv: dict[int, list[int]] = {}
        for g, (_session, message) in entries.items():
            send[g], recv[g] = [int(n) for n in message["send"]], [int(n) for n in message["recv"]]
            if len(send[g]) != size or len(recv[g]) != size or min(send[g] + recv[g]) < 0:
                raise ProxyError(f"alltoall: rank {g} of {group.name} gives send counts {send[g]} and "
                                 f"receive counts {recv[g]}; it needs {size} of each, none negative")
        inputs = {g: self._region(s).array(dtype, sum(send[g])) for g, (s, _) in entries.items()}
        return collectives.alltoall(self.mesh, group, tag, inputs, send, recv)

    def _deliver(self, entries: dict[int, tuple[Session, dict]], dtype: str,
                 outputs: dict[int, np.ndarray]) -> None:
        """Write each member's result where its worker reads it. Every result is complete before the
        first is written, and none lies in a region written here."""
        for g, data in outputs.items():
            self._region(entries[g][0]).array(dtype, data.size)[:] = data

    def _point_to_point(self, session: Session, message: dict, channel: str, seq: int,
                        group_rank: int) -> None:
        assert self.mesh is not None
        group = self.group(str(message["comm"]))
        dtype, count, peer = str(message["dtype"]), int(message["count"]), int(message["peer"])
        if count < 0:
            raise ProxyError(f"{message['op']}: a count of {count} elements")
        if not 0 <= peer < len(group.owners):
            raise ProxyError(f"peer {peer} is not in communicator {group.name}")
        tag = f"{channel}:{seq}"
        region = self._region(session)
        if message["op"] == "send":
            self.mesh.send(group.owners[peer], tag, [np.array(region.array(dtype, count), copy=True)])
        else:
            data = np.frombuffer(self.mesh.take(tag, group.owners[peer]), dtype=region.array(dtype, 0).dtype)
            if data.size != count:
                raise ProxyError(f"recv of {count} elements got a message of {data.size}")
            region.array(dtype, count)[:] = data

    def _count(self, op: str, **values: float) -> None:
        with self.stats_lock:
            for key, value in values.items():
                self.stats[op][key] += value

    @staticmethod
    def _region(session: Session) -> Region:
        if session.region is None:
            raise ProxyError("no shared memory mapped: send map first")
        return session.region

    # --- the barrier ------------------------------------------------------------------------------

    def _check_parked(self) -> None:
        """(With the lock.) Tell the leader once every local rank is at rest during a cut."""
        if self.phase == Phase.CUTTING and not self.reported_parked and barrier.parked(
                {r: str(s) for r, s in self.states.items()}):
            self.reported_parked = True
            self._to_leader({"ctl": "parked", "from": self.id, "audit": self._audit()})

    def _audit(self) -> dict:
        """(With the lock.) Completed point-to-point operations by role, and where ranks parked."""
        sent: dict[str, int] = {}
        received: dict[str, int] = {}
        for rank, channels in self.issued.items():
            for channel, n in channels.items():
                parsed = barrier.parse_p2p(channel)
                if parsed is None or parsed[0] not in self.comms:
                    continue
                comm, src, _ = parsed
                role = sent if self.comms[comm].index(rank) == src else received
                role[channel] = n
        parked = [{"op": list(self.parked_ops[rank]),
                   "dst_of": [[comm, members.index(rank)] for comm, members in self.comms.items()
                              if rank in members]}
                  for rank, state in self.states.items()
                  if state == RankState.PARKED and rank in self.parked_ops]
        return {"sent": sent, "received": received, "parked": parked}

    def _to_leader(self, message: dict) -> None:
        threading.Thread(target=self._send_control, args=(self.leader, message), daemon=True).start()

    def _send_control(self, peer: str | None, message: dict) -> None:
        try:
            if self.mesh is not None and peer is not None:
                self.mesh.control(peer, message)
        except (OSError, KeyError) as exc:
            self.log("cannot send %s to %s: %s", message.get("ctl"), peer, exc)

    def _broadcast_control(self, message: dict) -> None:
        for peer in self.proxies:
            self._send_control(peer, message)

    def _on_control(self, sender: str, message: dict) -> None:
        kind = message.get("ctl")
        if kind == "host":
            host, pid = message.get("host"), message.get("pid")
            with self.cond:
                self.peer_hosts[sender] = host if isinstance(host, str) else None
                if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0:
                    self.peer_pids[sender] = pid
                self.cond.notify_all()
        elif kind == "drain_request" and self.id == self.leader:
            seen = message.get("seen")
            with self.cond:
                # A round completed since the sender asked and this side is still at it: that cut is
                # the one asked for (a second round would take every parked proxy back to draining).
                answered = (self.round is None and self.phase == Phase.PARKED and type(seen) is int
                            and seen < self.rounds_done)
                start = self.round is None and not answered
                if start:
                    self.round = barrier.Round(self.proxies)
                done = self.rounds_done
            if answered:
                self._send_control(sender, {"ctl": "cut_done", "round": done})
            elif start:
                self._broadcast_control({"ctl": "drain"})
        elif kind == "drain":
            with self.cond:
                self.phase = Phase.DRAINING
                self.cut_started = time.monotonic()
                self.reported_parked = False
                maxima = barrier.local_maxima(self.issued)
            self._to_leader({"ctl": "report", "from": self.id, "maxima": maxima})
        elif kind == "report" and self.round is not None:
            targets = self.round.report(message["from"], message["maxima"])
            if targets is not None:
                self._broadcast_control({"ctl": "cut", "targets": targets})
        elif kind == "cut":
            unparked: list[int] = []
            with self.cond:
                targets = {str(k): int(v) for k, v in message["targets"].items()}
                if self.phase == Phase.DRAINING:
                    self.phase, self.targets = Phase.CUTTING, targets
                    self.log("cut targets %s", self.targets)
                elif self.phase == Phase.CUTTING:
                    # Undelivered messages: ranks parked at or below the raised targets run on.
                    self.targets, self.reported_parked = targets, False
                    for rank, state in self.states.items():
                        channel, seq = self.parked_ops.get(rank, ("", 0))
                        if state in (RankState.PARKED, RankState.PARKING) and seq <= targets.get(channel, 0):
                            self.states[rank] = RankState.ABSENT
                            unparked.append(rank)
                    self.log("cut targets raised to %s; ranks %s run on", self.targets, unparked)
                self.cond.notify_all()
            for rank in unparked:
                self._listen(rank)
            with self.cond:
                self._check_parked()
        elif kind == "parked" and self.round is not None:
            if self.round.park(message["from"], message.get("audit")):
                raised = self.round.settle()
                if raised is not None:
                    self._broadcast_control({"ctl": "cut", "targets": raised})
                else:
                    with self.cond:
                        self.round = None
                        self.rounds_done += 1
                        done = self.rounds_done
                    self._broadcast_control({"ctl": "cut_done", "round": done})
        elif kind == "cut_done":
            with self.cond:
                done = message.get("round")
                if type(done) is int:
                    self.cut_seen = max(self.cut_seen, done)
                if self.phase == Phase.CUTTING:
                    self.phase = Phase.PARKED
                    self.log("cut reached in %.2fs", time.monotonic() - (self.cut_started or 0))
                    # Every rank let go of its region; after the cut each maps a new one, so the
                    # peers' old ones would only pin memory here.
                    self.peer_regions.close()
                self.cond.notify_all()
        elif kind == "abort_request" and self.id == self.leader:
            self.round = None
            self._broadcast_control({"ctl": "abort"})
        elif kind == "abort":
            self._resume(aborted=True)

    def close(self) -> None:
        """Stop serving (the job ends): peers that go away from now on are not a failure."""
        self.stopping = True
        self._teardown()
        self.rank_sockets.close()
        for process in list(self.departed.values()):  # not under swap_lock: a driver call may hang
            try:
                os.close(process.pidfd)
            except OSError:
                pass
        self.departed.clear()

    def _on_lost(self, peer: str, why: str) -> None:
        if self.stopping:
            return
        self.log("lost proxy %s (%s): exiting so the node agent requeues the job", peer, why)
        logging.shutdown()
        os._exit(3)

    def quiesce(self, timeout: float) -> dict:
        self.fault("cut")
        with self.cond:
            if not self.local_ranks:
                return {"idle": True}
            if self.phase == Phase.PARKED:
                return {"idle": False, "cut_seconds": 0.0}
            while not self.ready:
                if self.mesh_error or not self.cond.wait(timeout):
                    raise ProxyError(f"the job's proxies are not connected: {self.mesh_error or 'timeout'}")
            seen = self.cut_seen
        started = time.monotonic()
        self._to_leader({"ctl": "drain_request", "from": self.id, "seen": seen})
        deadline = started + timeout
        with self.cond:
            while self.phase != Phase.PARKED:
                left = deadline - time.monotonic()
                if left <= 0:
                    busy = {r: str(s) for r, s in self.states.items() if s not in (RankState.PARKED,
                                                                                   RankState.FINISHED)}
                    self._to_leader({"ctl": "abort_request", "from": self.id})
                    raise ProxyError(f"no consistent cut within {timeout:.0f}s (phase {self.phase}, "
                                     f"ranks not at rest: {busy}); the job continues")
                self.cond.wait(left)
        return {"idle": False, "cut_seconds": round(time.monotonic() - started, 3)}

    def _resume(self, aborted: bool = False) -> dict:
        with self.cond:
            if self.phase == Phase.RUNNING:
                return {"resumed": []}
            self.phase = Phase.RUNNING
            self.targets = {}
            resumed = [r for r, s in self.states.items() if s in (RankState.PARKED, RankState.PARKING)]
            for rank in resumed:
                self.states[rank] = RankState.ABSENT
            self.cond.notify_all()
        for rank in resumed:
            self._listen(rank)
        self.log("%s; serving ranks %s again", "cut aborted" if aborted else "resumed", resumed)
        return {"resumed": resumed}

    def resume(self) -> dict:
        return self._resume()

    def wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not self.ready and not self.mesh_error and time.monotonic() < deadline:
                self.cond.wait(min(1.0, max(0.0, deadline - time.monotonic())))
            return {"generation": self.generation, "ready": self.ready, "mesh_error": self.mesh_error}

    def status(self) -> dict:
        with self.cond:
            return {"proxy": self.id, "generation": self.generation, "phase": str(self.phase),
                    "ranks": {str(r): str(s) for r, s in self.states.items()}, "ready": self.ready,
                    "gpu_memory_out": sorted(self.out) if self.memory is not None else None,
                    "gpu_buffers": self.cuda is not None and self._gpu_offered(),
                    "leader": self.leader, "mesh_error": self.mesh_error,
                    "turns": ({"holder": self.turns.holder, "waiting": list(self.turns.waiting),
                               "handovers": self.turns.handovers, "lapses": self.turns.lapses}
                              if self.sliced else None)}

    def stats_report(self) -> dict:
        with self.stats_lock:
            report = {op: dict(values) for op, values in self.stats.items()}
        if self.mesh is not None:
            report["mesh"] = {"bytes_sent": self.mesh.bytes_sent}
        return report

    # --- control socket ---------------------------------------------------------------------------

    def handle(self, request: dict) -> dict:
        op = request.get("op")
        if op == "configure":
            placement = {int(r): str(p) for r, p in dict(request["placement"]).items()}
            return self.configure(str(request["generation"]), placement)
        if op == "quiesce":
            return self.quiesce(float(request.get("timeout") or 60.0))
        if op == "resume":
            return self.resume()
        if op == "status":
            return self.status()
        if op == "ready":
            return self.wait_ready(min(float(request.get("timeout") or 60.0), 3600.0))
        if op == "stats":
            return self.stats_report()
        if op == "gpu_pairs":
            return self.set_gpu_pairs(request["rank"], request["pairs"])
        if op == "ping":
            return {"proxy": self.id, "pid": os.getpid()}
        raise ProxyError(f"unknown op {op!r}; valid: configure, quiesce, ready, resume, status, stats, "
                         "gpu_pairs, ping")

    def _await_departed(self, rank: int) -> None:
        """Under swap_lock, before `rank`'s memory comes in: where it does not fit, wait (at most
        `proxy.turn_lapse_s`) for ranks that said bye but still hold GPU memory to end. Ranks end at
        different times: one finishing its script frees its memory a moment after its last collective."""
        with self.cond:  # a rank that reconnected is not gone
            connected = {s.process.pid for s in self.sessions.values() if s.process is not None}
        for pid, process in list(self.departed.items()):
            if pid in connected or not swap.alive(process.pidfd):
                os.close(self.departed.pop(pid).pidfd)
        if not self.departed:
            return
        deadline = time.monotonic() + self.limits.turn_lapse_s
        while self.departed:
            try:
                free, used = self.memory.usage()
            except SwapError:
                return
            if free >= self.footprints.get(rank, 0) or not any(pid in used for pid in self.departed):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                self.log("rank %s comes back onto the GPU beside ranks that left but still hold memory "
                         "(%s): it may run out of memory", rank, sorted(self.departed))
                return
            ended = set(swap.wait_any([p.pidfd for p in self.departed.values()], left))
            for pid, process in list(self.departed.items()):
                if process.pidfd in ended:
                    os.close(self.departed.pop(pid).pidfd)

    def set_gpu_pairs(self, rank: Any, pairs: Any) -> dict:
        """A restored rank's GPU UUIDs, old -> new (from the node agent, before the rank's tree is
        restored): where its GPU memory was out at the checkpoint, it comes back onto this GPU
        through them."""
        if not isinstance(rank, int) or isinstance(rank, bool) or rank not in self.local_ranks:
            raise ProxyError(f"gpu_pairs: rank {rank!r} is not served by proxy {self.id}")
        if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 for p in pairs):
            raise ProxyError("gpu_pairs: pairs must be a list of [old UUID, new UUID]")
        made = [swap.cuda.GpuPair(str(old), str(new)) for old, new in pairs]
        for pair in made:
            swap.cuda.uuid_bytes(pair.old_uuid)
            swap.cuda.uuid_bytes(pair.new_uuid)
        with self.cond:
            self.gpu_pairs[rank] = made
        return {"pairs": len(made), "moves": self.memory is not None}


def serve_control(proxy: Proxy, path: Path, limits: rpc.Limits | None = None) -> rpc.Server:
    """Listen for the node agent on `path` (root only); the socket appears once it listens."""

    def handle(request: dict, call: rpc.Call) -> dict:
        try:
            return {"ok": True, **proxy.handle(request)}
        except (KeyError, ValueError, TypeError) as exc:
            raise rpc.BadRequest(f"{request.get('op')}: bad request: {exc!r}") from exc
        except ProxyError as exc:
            raise rpc.RemoteError(str(exc)) from exc
        except OSError as exc:
            raise rpc.Failed(f"{request.get('op')} failed: {exc}") from exc

    def allow(peer: rpc.Peer) -> str | None:
        return None if peer.uid == 0 else "a device proxy's control socket serves root only"

    return rpc.Server(path, handle, name=f"device proxy {proxy.id}", mode=0o600, allow=allow,
                      limits=limits or rpc.Limits(max_connections=8, root_reserve=0,
                                                  idle_timeout=rpc.IDLE_TIMEOUT_S)).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="singularity-proxy",
                                     description="Device proxy for one device of one job.")
    parser.add_argument("--job-id", type=int, required=True)
    parser.add_argument("--uid", type=int, required=True, help="uid of the job's user")
    parser.add_argument("--id", required=True, help="proxy id, unique in the job (NODE/DEVICE)")
    parser.add_argument("--socket", type=Path, required=True, help="control socket for the node agent")
    parser.add_argument("--backend", default="host", help="device backend (default: host)")
    parser.add_argument("--time-slicing", choices=("auto", "turns", "concurrent"), default=None,
                        help="how ranks that share this device run (default: the configuration's "
                             "proxy.time_slicing)")
    parser.add_argument("--gpu-swap", choices=("auto", "always", "never"), default=None,
                        help="when a waiting rank's GPU memory moves to host memory (default: the "
                             "configuration's proxy.gpu_swap)")
    parser.add_argument("--rendezvous-dir", type=Path, default=None,
                        help="find peers through this folder instead of the coordinator (one machine)")
    parser.add_argument("--advertise", default=None,
                        help="address other nodes' proxies reach this one at (default: this host's)")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="folder whose ranks/ sub-folder holds the rank sockets (default: the "
                             "configuration's paths.state_dir)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(levelname)s %(message)s")

    from singularity_slurm.config import load

    from .rendezvous import FileRendezvous, RedisRendezvous

    config = load()
    limits = config.proxy
    if args.time_slicing is not None:
        limits = dataclasses.replace(limits, time_slicing=args.time_slicing)
    if args.gpu_swap is not None:
        limits = dataclasses.replace(limits, gpu_swap=args.gpu_swap)
    advertise = args.advertise or _host_address()
    if args.rendezvous_dir is not None:
        def rendezvous():
            return FileRendezvous(str(args.rendezvous_dir / str(args.job_id)))
    else:
        from singularity_slurm.coordinator.registry import connect

        def rendezvous():
            return RedisRendezvous(connect(config.redis), args.job_id)
    node = args.id.split("/", 1)[0]
    memory = gpu_memory(args.id, args.backend, config.gpu.lock_timeout_s)
    cuda = gpu_device(args.id, args.backend, limits, memory)
    proxy = Proxy(args.job_id, args.uid, args.id, backend(args.backend), rendezvous,
                  state_dir=args.state_dir or config.paths.state_dir, limits=limits,
                  advertise_host=advertise, fault=lambda point: faults.point(config, point, node),
                  memory=memory, cuda=cuda)
    server = serve_control(proxy, args.socket)
    stop = threading.Event()

    def on_signal(signum, frame):
        proxy.stopping = True  # the other nodes' proxies are being stopped too
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"device proxy {args.id} for job {args.job_id} ({args.backend}) listening on {args.socket}",
          flush=True)
    stop.wait()
    server.close()
    args.socket.unlink(missing_ok=True)
    proxy.close()
    if memory is not None:
        memory.close()
    if cuda is not None:
        cuda.close()
    print(f"device proxy {args.id} for job {args.job_id} stopped", flush=True)
    return 0


def gpu_device(proxy_id: str, backend_name: str, limits: ProxyConfig,
               memory: GpuMemory | None) -> gpu.CudaDevice | None:
    """The GPU's buffers shared with ranks and its reductions, for a GPU's `cuda` proxy where
    proxy.gpu_buffers allows them; None elsewhere, or where they cannot be set up (CUDA tensors then
    go through host memory)."""
    device = proxy_id.split("/", 1)[-1]
    if backend_name != "cuda" or not limits.gpu_buffers:
        return None
    if not device.startswith("gpu") or not device[3:].isdigit():
        return None
    try:
        uuid = memory.uuid if memory is not None else gpu.nvml_uuid(int(device[3:]))
        return gpu.CudaDevice(uuid)  # set up when a rank first asks for a buffer
    except gpu.GpuUnavailable as exc:
        LOG.warning("proxy %s: ranks' CUDA tensors go through host memory (no GPU buffers): %s",
                    proxy_id, exc)
        return None


def gpu_memory(proxy_id: str, backend_name: str, lock_timeout_s: int) -> GpuMemory | None:
    """The GPU's memory per rank, for a GPU's `cuda` proxy (NODE/gpuN: NVML's index N, as Slurm
    numbers it); None elsewhere, or where the driver cannot move it (then it stays on the GPU)."""
    device = proxy_id.split("/", 1)[-1]
    if backend_name != "cuda" or not device.startswith("gpu") or not device[3:].isdigit():
        return None
    try:
        return GpuMemory(int(device[3:]), lock_timeout_s * 1000)
    except swap.cuda.CheckpointError as exc:
        LOG.warning("proxy %s: ranks' GPU memory stays on the GPU while they wait (proxy.gpu_swap has "
                    "no effect): %s", proxy_id, exc)
        return None


def _host_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


if __name__ == "__main__":
    sys.exit(main())
