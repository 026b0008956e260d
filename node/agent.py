"""The node agent: one per job per node, started by Prolog as root, stopped by Epilog.

It listens on a unix socket in the job's node-local folder and answers requests (`rpc`: framed JSON,
size-checked, at most MAX_CONNECTIONS connections at once, idle ones closed). Callers are identified
by SO_PEERCRED: only root and the job's own user are served. The job is the agent's own (from the
Prolog's command line): a request naming another (`job_id`, or a start whose environment names
another job) is refused. On the job's
batch host a thread also takes root's and operators' `checkpoint` and `migrate` requests through
Redis, authenticated by munge (`coordinator.commands`), since Slurm lets nobody else start steps in a
user's job. The agent owns the job's process tree on this node: it starts it (as the job's user, in
its own PID and mount namespace), checkpoints it with CRIU into the store, restores it from the
store, and reports how it ended.

Requests (`op`) are `rpc` frames, each answered with `{"ok": true, ...}` or
`{"ok": false, "error": "...", "kind": "..."}` (see `singularity_slurm.rpc` for the kinds and limits):
  ping                                   liveness and identity
  start {argv, cwd, output, env, rank}   start the node's tree (rank: the node's index in the job), or
                                         with `proxy`, one tree per rank the placement gives this node
  restore {rank, generation}             restore the newest valid checkpoint of the node's tree (or its
                                         part of one generation), or with `proxy` the trees of this
                                         node's ranks from `generation`
  wait {}                                block until every tree ended: {"state", "exit_status"}
  checkpoint {reason, stop, generation, common}
                                         dump (stop: the tree ends) and commit a checkpoint; `common`:
                                         generations every node has, which pruning keeps
  kill {}                                end the tree now
  requeue {exclude}                      requeue the job in Slurm (away from `exclude` nodes) and
                                         lift its requeue delay
  migrate {exclude}                      (through the launcher) checkpoint every node, the trees stop,
                                         then requeue away from `exclude`
  latest {run}                           the newest committed checkpoint of the job, or null
  generations {rank | ranks, run}        generations of this node's multi-node checkpoints, or of each
                                         rank's of a distributed job
  run_begin {command}                    the launcher of the job's next `singularityctl run` line:
                                         its key and what is known of it from before a requeue
  run_end {key, exit_status}             that run's command ended by itself
  status {}                              the tree's state and the last checkpoint
  devices {}                             the ids of this node's device proxies, in device order
  next_command {timeout}                 (the launcher) wait for an admin request (migrate,
                                         launcher_checkpoint), which the launcher carries out on every
                                         node; command_done {result} answers it, and returns once
                                         the answer reached the caller (its requeue ends the caller)

Checkpoint, restore, latest and generations take the run's key (`run`), so each `singularityctl run`
of a job restores only its own checkpoints.

A distributed job's start and restore carry `proxy: {generation, placement}` (rank -> proxy id):
the agent configures its proxies for that rendezvous generation and runs one process tree per rank
the placement gives this node (a rank is the unit of checkpoint and restore, so a job can restore on
another number of nodes and devices than it was dumped on). Its checkpoints first bring the job to
its distributed cut through the proxies (quiesce), dump every tree, and let the ranks reconnect after
the dump (resume). A proxy that dies ends the trees (`proxy_lost` in the wait answer), so the launcher
requeues the job instead of leaving its ranks waiting; so does a rank that fails, for the node's other
ranks.
"""

from __future__ import annotations

import argparse
import enum
import logging
import math
import os
import queue
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from singularity_slurm import rpc
from singularity_slurm.errors import SingularityError
from singularity_slurm.node import dumpgate, jobcgroup, runs, services
from singularity_slurm.rpc import RequestError

if TYPE_CHECKING:
    from singularity_slurm.config import Config
    from singularity_slurm.coordinator.commands import CommandServer
    from singularity_slurm.slurmcli import SlurmClient

MAX_REQUEST = rpc.MAX_REQUEST
MAX_CONNECTIONS = 32
"""Connections one agent serves at once (root has rpc.ROOT_RESERVE more): each holds a thread."""
MESH_WAIT_S = 360.0
"""How long the agent waits for a new generation's mesh (the proxies' rendezvous waits 300 s)."""
MAX_RANKS = 4096
"""Ranks one generations request may name (a job's world size)."""
MAX_COMMON = 16
"""Generations a checkpoint request may name as committed on every node (the launcher sends a few)."""
SETTLE_S = 40.0
"""The longest the Epilog waits for a checkpoint in progress before it stops the agent."""
PRUNE_SETTLE_S = 3.0
"""How long a stopping agent lets the retention of its last checkpoints run on."""
RUN_KEY = re.compile(r"[0-9]{1,4}-[0-9a-f]{16}")
_CALL = threading.local()  # per request thread: where to register callbacks for after the reply
LOG = logging.getLogger("singularity.agent")


class TreeState(enum.StrEnum):
    """State of the job's process trees on this node (one, or one per rank of a distributed job),
    which start, checkpoint and end together.

    NONE -> RUNNING (start, restore) -> CHECKPOINTING -> RUNNING (leave running) | DUMPED (stop)
    RUNNING -> EXITED (the command ended) | KILLED (kill, or the agent stops)
    """

    NONE = "none"
    RUNNING = "running"
    CHECKPOINTING = "checkpointing"
    DUMPED = "dumped"
    EXITED = "exited"
    KILLED = "killed"


@dataclass
class Tree:
    """One process tree of the job on this node: a rank of a `--world-size` job (index = the rank),
    or the node's one tree (index = the node's place among the job's nodes)."""

    index: int
    engine: Any  # CheckpointEngine.for_tree(index): the tree's store and device history
    init_pid: int
    exit_status: int | None = None


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a unix socket."""
    peer = rpc.peer_of(sock)
    return peer.pid, peer.uid, peer.gid


def authorized(peer_uid: int, job_uid: int) -> bool:
    return peer_uid in (0, job_uid)


class AgentState:
    """What the agent knows and does; `handle` is the whole protocol."""

    def __init__(self, job_id: int, job_uid: int, node: str, engine: Any = None,
                 run_dir: Path | None = None, cut_timeout: float = 60.0, rank_dir: str | None = None):
        self.job_id = job_id
        self.rank_dir = rank_dir  # where the proxies' rank sockets are: the ranks' SINGULARITY_RANK_DIR
        self.job_uid = job_uid
        self.node = node
        self.engine = engine  # CheckpointEngine; None in tests of the protocol alone
        self.run_dir = run_dir
        self.cut_timeout = cut_timeout
        self.proxies: dict[str, Path] = {}  # proxies serving ranks of the tree: id -> control socket
        self.size: dict[str, int] | None = None  # a distributed job's ranks, devices, nodes in all
        self.rank_proxies: dict[int, str] = {}  # this node's ranks -> the proxy serving each
        self.rank_gpus: dict[int, int | None] = {}  # this node's ranks -> the GPU their proxy serves
        self.turns: list[str] = []  # of those, the proxies whose ranks take turns on their device
        self.proxy_lost: str | None = None
        # One request goes to the launcher at a time (`pending`): one command, one answer.
        self.commands: queue.Queue[dict] = queue.Queue(maxsize=1)
        self.command_results: queue.Queue[dict] = queue.Queue(maxsize=1)
        self.launcher_polls_until = 0.0
        self.pending: dict | None = None  # the request handed to the launcher, one at a time
        self.delivered: threading.Event | None = None  # set once its answer reached its caller
        self.next_run_index = 0
        self.run_key: str | None = None  # the `singularityctl run` whose tree runs here
        self.lock = threading.Condition()
        self.state = TreeState.NONE
        self.trees: dict[int, Tree] = {}
        self.epoch = 0  # counts starts and restores: a reaper or watcher of older trees does nothing
        self.exit_status: int | None = None  # once every tree ended: the first failure's, else 0
        self.failure: int | None = None  # the first non-zero status a tree ended with
        self.restoring: list[int] = []  # trees a restore in progress brought back so far
        self.stopping = False  # the agent is stopping: a restore in progress stops too
        self.last_checkpoint: dict | None = None
        self.cgroups: list[Path] = []  # the job's extern step cgroups on this node, once a caller showed them
        self.proxies_charged = False  # this node's proxies of the job are in the job's cgroups

    # --- protocol ---------------------------------------------------------------------------------

    def handle(self, request: dict, peer_uid: int, after_reply: list | None = None,
               peer_pid: int | None = None) -> dict:
        """Serve one request. `after_reply` collects callbacks to run once the caller has the reply;
        `peer_pid` (SO_PEERCRED) is where a start or restore looks for the job's cgroups."""
        if not authorized(peer_uid, self.job_uid):
            return rpc.error_reply(rpc.Forbidden(f"uid {peer_uid} may not act on job {self.job_id}"))
        _CALL.peer_pid = peer_pid
        return self.dispatch(request, after_reply)

    def dispatch(self, request: dict, after_reply: list | None = None) -> dict:
        """Carry out a request whose caller is already authorised (by SO_PEERCRED in `handle`, or by
        munge for admin requests through Redis, see `coordinator.commands`).

        `after_reply`: callbacks to run once the caller has the answer (None: run them at return).
        """
        _CALL.after_reply = after_reply
        op = request.get("op")
        named = request.get("job_id", self.job_id)
        if named != self.job_id:
            return rpc.error_reply(rpc.Forbidden(f"this agent serves job {self.job_id}, not job {named!r}: "
                                                 "send the request to that job's agent"))
        handler = getattr(self, f"op_{op}", None) if isinstance(op, str) else None
        if handler is None:
            valid = ", ".join(sorted(n[3:] for n in dir(self) if n.startswith("op_")))
            return rpc.error_reply(rpc.BadRequest(f"unknown op {op!r}; valid ops: {valid}"))
        try:
            return {"ok": True, **handler(request)}
        except RequestError as exc:
            return rpc.error_reply(exc)
        except Exception as exc:  # the agent must outlive any one request
            LOG.exception("job %s: %s failed", self.job_id, op)
            return rpc.error_reply(rpc.Failed(f"{op} failed: {exc}"))

    def op_ping(self, request: dict) -> dict:
        return {"job_id": self.job_id, "node": self.node, "pid": os.getpid()}

    @property
    def init_pid(self) -> int | None:
        """The namespace init of the first tree (status, tests)."""
        return next((tree.init_pid for tree in self.trees.values()), None)

    def op_status(self, request: dict) -> dict:
        with self.lock:
            return {"state": str(self.state), "init_pid": self.init_pid,
                    "trees": {str(t.index): t.init_pid for t in self.trees.values()},
                    "exit_status": self.exit_status, "last_checkpoint": self.last_checkpoint}

    def _need_engine(self) -> Any:
        if self.engine is None:
            raise rpc.Unavailable("this agent has no checkpoint engine")
        return self.engine

    def op_start(self, request: dict) -> dict:
        engine = self._need_engine()
        cgroups = self._job_cgroups()
        node_index = request.get("rank", 0)
        with self.lock:
            if self.state in (TreeState.RUNNING, TreeState.CHECKPOINTING):
                raise RequestError(f"job {self.job_id} already runs on {self.node}")
        ranks = self._configure_proxies(request.get("proxy"))
        if ranks is None:
            requests = {node_index: request}
        else:  # one tree per rank, each with what torchrun gives a rank
            if not isinstance(request.get("env") or {}, dict):
                raise RequestError("start needs env: an object of strings")
            extra = {"SINGULARITY_RANK_DIR": self.rank_dir} if self.rank_dir is not None else {}
            elastic = getattr(getattr(engine, "config", None), "elastic", None)
            extra.update(replica_env(request.get("env") or {}, getattr(elastic, "replica_mmap_threshold", 0)))
            requests = {rank: {**request, "env": {**(request.get("env") or {}), **extra, "RANK": str(rank),
                                                  "LOCAL_RANK": str(local),
                                                  "LOCAL_WORLD_SIZE": str(len(ranks))}}
                        for local, rank in enumerate(ranks)}
        engines = {index: engine.for_tree(index, rank=ranks is not None, gpu=self.rank_gpus.get(index))
                   for index in requests}
        specs = {index: engines[index].tree_spec(req, self.job_uid, self.job_id)
                 for index, req in requests.items()}
        self.run_key = _run_key(request)
        for tree_engine in engines.values():
            tree_engine.begin(self.job_id)
        with self.lock:
            if self.state in (TreeState.RUNNING, TreeState.CHECKPOINTING):
                raise RequestError(f"job {self.job_id} already runs on {self.node}")
            trees, waiters = [], []
            try:
                for index, spec in specs.items():
                    pid, waiter = engines[index].start(spec, cgroups)
                    trees.append(Tree(index, engines[index], pid))
                    waiters.append(waiter)
            except BaseException:
                for tree in trees:  # all of the node's trees run, or none
                    _kill(tree.init_pid)
                    self._forget(tree.init_pid)
                raise
            self._running(trees, waiters)
        LOG.info("job %s node %s: started %s (trees %s)", self.job_id, self.node,
                 specs[next(iter(specs))].argv, {t.index: t.init_pid for t in trees})
        self._record_size("start")
        self._record_running("start")
        return {"init_pid": self.init_pid, "trees": {str(t.index): t.init_pid for t in trees}}

    def op_restore(self, request: dict) -> dict:
        """Restore this node's trees: the node's one tree (its newest valid checkpoint, or its part of
        `generation`), or the ranks the placement gives this node's proxies (`generation`)."""
        engine = self._need_engine()
        cgroups = self._job_cgroups()
        generation = request.get("generation")
        with self.lock:
            if self.state in (TreeState.RUNNING, TreeState.CHECKPOINTING):
                raise RequestError(f"job {self.job_id} already runs on {self.node}")
            ranks = self._configure_proxies(request.get("proxy"))
            if ranks is not None:
                if not isinstance(generation, str):
                    raise RequestError("restore: ranks are restored from a generation: give generation")
                indices = ranks
            else:
                indices = [request.get("rank", 0)]
            engines = {index: engine.for_tree(index, rank=ranks is not None, gpu=self.rank_gpus.get(index))
                       for index in indices}
            for tree_engine in engines.values():
                tree_engine.begin(self.job_id)
            self.run_key = _run_key(request)
            trees, waiters, results = [], [], []
            try:
                for index, tree_engine in engines.items():
                    if self.stopping:
                        raise rpc.Unavailable(f"the agent of job {self.job_id} on {self.node} is stopping")
                    result = tree_engine.restore(self.job_id, self.job_uid, generation, self.run_key,
                                                 cgroups=cgroups, gpu_pairs=self._gpu_pairs_to_proxies)
                    self.restoring.append(result["init_pid"])
                    trees.append(Tree(index, tree_engine, result["init_pid"]))
                    waiters.append(result.pop("waiter"))
                    results.append(result)
            except BaseException:
                for tree in trees:
                    _kill(tree.init_pid)
                    self._forget(tree.init_pid)
                raise
            finally:
                self.restoring = []
            self._running(trees, waiters)
        LOG.info("job %s node %s: restored checkpoint %s (trees %s)", self.job_id, self.node,
                 [r["seq"] for r in results], [t.index for t in trees])
        self._record_size("restore", results[0].get("reason"), results[0].get("placement"))
        self._record_running("restore")
        return _merged(results, [t.index for t in trees])

    def _record_size(self, how: str, cause: str | None = None, was: dict | None = None) -> None:
        """For `status`: a distributed job's size at this start or restore, once per job (by the
        node that runs rank 0)."""
        index = getattr(self.engine, "_index", None)
        size = self.size
        if size is None or 0 not in self.trees or index is None:
            return
        index(lambda registry: registry.record_size(self.job_id, self.node, how, size, cause, was))

    def _record_running(self, how: str) -> None:
        """For the SLA accounting: this node's trees run from now, on the devices whose proxies
        serve their ranks (a distributed job), or on all of the job's devices here (one per proxy;
        a node without devices counts as one)."""
        index = getattr(self.engine, "_index", None)
        if index is None:
            return
        devices = len(self.proxies) if self.proxies else max(len(self.local_proxies()), 1)
        turns = len(self.turns)
        index(lambda registry: registry.record_running(self.job_id, self.node, how, devices, turns))

    def _job_cgroups(self) -> list[Path]:
        """The job's extern step cgroups, from the caller's (a process of a step of the job here).

        A caller outside every step of the job, where the job has an extern step on this node, is
        refused: what it started would not be the job's own tree."""
        pid = getattr(_CALL, "peer_pid", None)
        problems: list[str] = []
        found = jobcgroup.targets_of(pid, self.job_id, problems) if pid else []
        for problem in problems:
            LOG.warning("job %s node %s: %s; the tree stays in the extern step itself, where Slurm's "
                        "SIGTERM at a requeue reaches it", self.job_id, self.node, problem)
        if found:
            self.cgroups = found
            self._charge_proxies(pid)
            if self.run_dir is not None:
                try:
                    jobcgroup.note_externs(self.run_dir, found, self.job_id)  # what the Epilog sweeps
                except OSError as exc:
                    LOG.warning("job %s node %s: cannot note the job's cgroups: %s", self.job_id,
                                self.node, exc)
            return found
        if pid and not jobcgroup.caller_in_a_step(pid, self.job_id) and jobcgroup.extern_steps(self.job_id):
            raise rpc.Forbidden(f"job {self.job_id}: a start or restore must come from a step of the job "
                                f"on {self.node} (the caller, pid {pid}, is in none): run "
                                "`singularityctl run` in the batch script or in an srun step")
        if not self.cgroups:
            LOG.warning("job %s node %s: no extern step cgroup of the job found from pid %s; its processes "
                        "are not contained (configure ProctrackType=proctrack/cgroup and "
                        "PrologFlags=Contain)", self.job_id, self.node, pid)
        return self.cgroups

    def _charge_proxies(self, pid: int) -> None:
        """Move this node's proxies of the job (the Prolog started them, outside the job) into the
        job's cgroups as process `pid` of the job shows them, once: what they hold and use for the
        job's ranks (regions they fault in, their GPU contexts' host memory, cores) then counts
        against the job's limits, not the node's."""
        if self.proxies_charged or self.run_dir is None:
            return
        problems: list[str] = []
        targets = jobcgroup.targets_of(pid, self.job_id, problems, name=jobcgroup.PROXIES)
        for problem in problems:
            LOG.warning("job %s node %s: %s; the job's proxies run in the extern step itself, where "
                        "Slurm's SIGTERM at a requeue reaches them", self.job_id, self.node, problem)
        if not targets:
            return
        entries = [entry for pidfile in sorted(self.run_dir.glob(f"{services.PROXY}*.pid"))
                   if (entry := services.read_pidfile(pidfile)) is not None
                   and services.running_pid(self.run_dir, pidfile.stem) is not None]  # not one that ended
        failed = [problem for pid, start_time in entries
                  for problem in jobcgroup.join_service(pid, start_time, targets, services.proc_start_time)]
        for problem in failed:
            LOG.warning("job %s node %s: cannot move a proxy into the job's cgroups: %s", self.job_id,
                        self.node, problem)
        self.proxies_charged = not failed
        if not failed:
            LOG.info("job %s node %s: proxies %s in the job's cgroups %s", self.job_id, self.node,
                     [pid for pid, _ in entries], [str(t) for t in targets])

    def _running(self, trees: list[Tree], waiters: list) -> None:
        self.epoch += 1
        self.trees = {tree.index: tree for tree in trees}
        self.state = TreeState.RUNNING
        self.exit_status = None
        self.failure: int | None = None
        self.proxy_lost = None
        for tree, waiter in zip(trees, waiters, strict=True):
            threading.Thread(target=self._reap, args=(waiter, tree, self.epoch), daemon=True).start()
        if self.proxies:
            threading.Thread(target=self._watch_proxies, args=(self.epoch,), daemon=True).start()

    # --- device proxies ---------------------------------------------------------------------------

    def local_proxies(self) -> dict[str, Path]:
        """This node's proxies of the job (started by the Prolog): id -> control socket."""
        if self.run_dir is None:
            return {}
        found = {}
        for sock in self.run_dir.glob("proxy-*.sock"):
            found[f"{self.node}/{sock.stem.removeprefix('proxy-')}"] = sock
        return dict(sorted(found.items(), key=lambda item: _device_order(item[0])))

    def op_devices(self, request: dict) -> dict:
        return {"node": self.node, "proxies": list(self.local_proxies())}

    def _gpu_pairs_to_proxies(self, rank: int, pairs: list) -> bool:
        """A restored rank's GPU UUID pairs to the proxy that serves it, before its tree runs: where
        its GPU memory was out at the checkpoint (see proxy.swap), the proxy brings it onto its GPU
        through them. False where that proxy cannot (no NVML or driver bindings there): the engine
        brings it in."""
        proxy = self.rank_proxies.get(rank)
        if proxy is None or proxy not in self.proxies:
            return False
        try:
            answer = rpc.call(self.proxies[proxy], {"op": "gpu_pairs", "rank": rank,
                                                    "pairs": [[p.old_uuid, p.new_uuid] for p in pairs]},
                              timeout=30, service=f"proxy {proxy}")
        except rpc.RpcError as exc:
            raise RequestError(f"proxy {proxy}: {exc}", kind=exc.kind) from exc
        return isinstance(answer, dict) and answer.get("moves") is True

    def _configure_proxies(self, config: Any) -> list[int] | None:
        """Configure this node's proxies for a rendezvous generation; this node's ranks, or None."""
        if config is None:
            self.proxies, self.size, self.rank_proxies, self.rank_gpus = {}, None, {}, {}
            return None
        if not isinstance(config, dict) or not isinstance(config.get("generation"), str):
            raise RequestError("proxy: needs {generation: string, placement: {rank: proxy id}}")
        placement = config.get("placement")
        if isinstance(placement, dict) and len(placement) > MAX_RANKS:
            raise RequestError(f"proxy.placement names {len(placement)} ranks, more than {MAX_RANKS}")
        if not isinstance(placement, dict) or not all(
                isinstance(k, str) and k.isdigit() and isinstance(v, str) for k, v in placement.items()):
            raise RequestError("proxy.placement must map rank numbers to proxy ids")
        from singularity_slurm.coordinator import keys

        try:
            keys.generation(config["generation"])
            for proxy in placement.values():
                keys.proxy_id(proxy)
        except keys.InvalidKeyPart as exc:
            raise RequestError(f"proxy: {exc}") from None
        local = self.local_proxies()
        used = {proxy for proxy in placement.values() if proxy in local}
        ranks = sorted(int(r) for r, proxy in placement.items() if proxy in local)
        if not ranks:
            raise RequestError(f"the placement gives no rank to {self.node}'s proxies "
                               f"({', '.join(local) or 'none'})")
        bound = getattr(getattr(self.engine, "config", None), "elastic", None)
        if bound is not None:  # each rank is a tree the agent watches: no more than the site allows
            busiest = max(list(placement.values()).count(proxy) for proxy in used)
            if busiest > bound.max_ranks_per_device:
                raise RequestError(f"the placement puts {busiest} ranks on one of {self.node}'s devices, "
                                   f"more than [elastic] max_ranks_per_device = {bound.max_ranks_per_device}")
        turns = []
        for proxy in local:  # every proxy learns the generation; unused ones serve nothing
            try:
                answer = rpc.call(local[proxy], {"op": "configure", "generation": config["generation"],
                                                 "placement": placement},
                                  timeout=30, service=f"proxy {proxy}")
            except rpc.RpcError as exc:
                raise RequestError(f"proxy {proxy}: {exc}", kind=exc.kind) from exc
            if isinstance(answer, dict) and answer.get("turns") is True:
                turns.append(proxy)
        self.turns = turns
        self.proxies = {proxy: local[proxy] for proxy in sorted(used, key=_device_order)}
        self.rank_proxies = {int(r): proxy for r, proxy in placement.items() if proxy in local}
        self.rank_gpus = {rank: gpu_of_proxy(proxy) for rank, proxy in self.rank_proxies.items()}
        devices = set(placement.values())
        self.size = {"ranks": len(placement), "devices": len(devices),
                     "nodes": len({proxy.split("/", 1)[0] for proxy in devices})}
        LOG.info("job %s node %s: proxies %s serve ranks %s (generation %s)%s", self.job_id, self.node,
                 list(self.proxies), ranks, config["generation"],
                 f"; the ranks of {', '.join(turns)} take turns" if turns else "")
        return ranks

    def _proxies_call(self, payload: dict, timeout: float | None) -> list[dict]:
        def call(path: Path) -> dict:
            try:
                return rpc.call(path, payload, timeout=timeout, service="the device proxy")
            except rpc.RpcError as exc:
                return {"ok": False, "error": f"{path.name}: {exc}", "kind": exc.kind}

        with ThreadPoolExecutor(max_workers=max(len(self.proxies), 1)) as pool:
            return list(pool.map(call, self.proxies.values()))

    def _quiesce(self) -> float | None:
        """Bring the job to its distributed cut; seconds it took, None for a job without proxies."""
        if not self.proxies:
            return None
        started = time.monotonic()
        replies = self._proxies_call({"op": "quiesce", "timeout": self.cut_timeout}, self.cut_timeout + 30)
        failed = [r.get("error") for r in replies if not r.get("ok")]
        if failed:
            self._proxies_call({"op": "resume"}, 30)
            raise RequestError(f"the job's ranks did not reach a consistent cut: {failed[0]}")
        return round(time.monotonic() - started, 3)

    def _watch_proxies(self, epoch: int) -> None:
        """End the tree when one of its proxies cannot serve it (it died, or its mesh never formed):
        the launcher then requeues the job, instead of its ranks waiting or failing."""
        names = {proxy: f"proxy-{proxy.split('/', 1)[1]}" for proxy in self.proxies}
        for proxy, path in list(self.proxies.items()):
            try:
                reply = rpc.call(path, {"op": "ready", "timeout": MESH_WAIT_S}, timeout=MESH_WAIT_S + 30,
                                 service=f"proxy {proxy}")
                problem = reply.get("mesh_error") or (None if reply.get("ready") else "timed out")
            except rpc.RpcError as exc:
                problem = str(exc)
            if problem is not None:
                self._lose_tree(epoch, f"{proxy} could not reach the job's other proxies ({problem})")
                return
        while True:
            time.sleep(0.5)
            with self.lock:
                if self.epoch != epoch or self.state not in (TreeState.RUNNING, TreeState.CHECKPOINTING):
                    return
                assert self.run_dir is not None
                dead = [p for p, name in names.items() if services.running_pid(self.run_dir, name) is None]
            if dead:
                self._lose_tree(epoch, f"{dead[0]} died")
                return

    def _lose_tree(self, epoch: int, what: str) -> None:
        with self.lock:
            if self.epoch != epoch or self.state not in (TreeState.RUNNING, TreeState.CHECKPOINTING):
                return
            self.proxy_lost = what
            LOG.error("job %s node %s: device proxy %s; ending the trees so the job is requeued",
                      self.job_id, self.node, what)
            for tree in self.trees.values():
                _kill(tree.init_pid)

    def _forget(self, pid: int) -> None:
        """Drop the engine's note of a tree (for the Epilog) once it has ended or was ended here."""
        if self.run_dir is not None:
            services.forget_tree(self.run_dir, pid)

    def _reap(self, waiter, tree: Tree, epoch: int) -> None:
        status = waiter()
        self._forget(tree.init_pid)
        with self.lock:
            if self.epoch != epoch:
                return
            tree.exit_status = status
            if status != 0 and self.failure is None:
                self.failure = status
            others = [t for t in self.trees.values() if t.exit_status is None]
            if status != 0 and others and self.state == TreeState.RUNNING:
                # A failed rank would leave the node's other ranks waiting in a collective forever.
                LOG.error("job %s node %s: tree %s exited with status %s; ending the node's other trees",
                          self.job_id, self.node, tree.index, status)
                for other in others:
                    _kill(other.init_pid)
            if not others:
                self.exit_status = self.failure or 0
                if self.state == TreeState.RUNNING:
                    self.state = TreeState.EXITED
                # CHECKPOINTING: the trees ended while being dumped (CRIU's kill after a stop-dump)
            self.lock.notify_all()
        LOG.info("job %s node %s: tree %s ended with status %s", self.job_id, self.node, tree.index, status)

    def op_settle(self, request: dict) -> dict:
        """Wait (at most `timeout` seconds) until no checkpoint is in progress. The Epilog asks before
        it stops the agent: a stop-checkpoint the launcher began at `scontrol requeue` is then
        committed even where Slurm killed the launcher (after `KillWait`) while it ran; then, within
        the same time, until the retention those checkpoints began has run."""
        timeout = request.get("timeout", SETTLE_S)
        if not isinstance(timeout, int | float) or not math.isfinite(timeout):
            raise RequestError("settle: timeout must be a number of seconds")
        deadline = time.monotonic() + min(max(float(timeout), 0.0), SETTLE_S)
        with self.lock:
            while self.state == TreeState.CHECKPOINTING:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.lock.wait(left)
            state = str(self.state)
        if self.engine is not None:
            self.engine.settle(max(deadline - time.monotonic(), 0.0))
        return {"state": state}

    def op_wait(self, request: dict) -> dict:
        with self.lock:
            if self.state == TreeState.NONE:
                raise RequestError("nothing was started")
            while self.state in (TreeState.RUNNING, TreeState.CHECKPOINTING) or (
                    self.state == TreeState.DUMPED and self.exit_status is None):
                self.lock.wait()
            return {"state": str(self.state), "exit_status": self.exit_status,
                    "proxy_lost": self.proxy_lost}

    def op_checkpoint(self, request: dict) -> dict:
        self._need_engine()
        from singularity_slurm.coordinator.registry import CHECKPOINT_REASONS

        reason = request.get("reason") or "manual"
        if reason not in CHECKPOINT_REASONS:
            raise RequestError(f"checkpoint: reason must be one of {', '.join(CHECKPOINT_REASONS)}, "
                               f"got {str(reason)[:64]!r}")
        stop = bool(request.get("stop", False))
        generation = request.get("generation")
        if generation is not None and not isinstance(generation, str):
            raise RequestError("checkpoint: generation must be a string")
        common = request.get("common")
        if common is not None and not (isinstance(common, list) and len(common) <= MAX_COMMON
                                       and all(isinstance(g, str) for g in common)):
            raise RequestError(f"checkpoint: common must be a list of at most {MAX_COMMON} generations")
        with self.lock:
            if self.state != TreeState.RUNNING:
                raise RequestError(f"job {self.job_id} is {self.state} on {self.node}: nothing to checkpoint")
            self.state = TreeState.CHECKPOINTING
            trees = list(self.trees.values())
        if generation is None and (len(trees) > 1 or self.size is not None):
            # The ranks of a distributed job are checkpointed as one generation, which its launcher
            # names (a node's own request, as `singularityctl checkpoint` sends it, goes through it).
            with self.lock:
                self.state = TreeState.RUNNING
                self.lock.notify_all()
            return self._through_launcher({"op": "checkpoint"})
        run = _run_key(request) or self.run_key

        cut_seconds: float | None = None
        within_s = self._time_left(stop)
        # A tree that stops anyway is frozen while it waits for a dump slot: the waiting trees then
        # leave the node's cores to the dumps that are due first. Only a node's one tree, alone in
        # its cgroup: another tree of the job's could be in criu's hands meanwhile.
        freeze = stop and len(trees) == 1 and self.engine.config.preemption.freeze_waiting
        still = jobcgroup.freezable(self.cgroups) if freeze else []
        pause = (lambda: jobcgroup.frozen(still)) if still else None

        def dump(tree: Tree) -> dict:
            return tree.engine.checkpoint(self.job_id, self.job_uid, tree.init_pid, reason=reason,
                                          stop=stop, generation=generation, run=run, common=common,
                                          size=self.size, cut_seconds=cut_seconds, within_s=within_s,
                                          pause=pause)

        try:
            cut_seconds = self._quiesce()
            try:
                # The ranks stand at the cut: each tree is dumped on its own, all at once.
                with ThreadPoolExecutor(max_workers=len(trees)) as pool:
                    summaries = list(pool.map(dump, trees))
                summary = _merged(summaries, [t.index for t in trees])
            finally:
                if self.proxies and not stop:
                    self._proxies_call({"op": "resume"}, 30)
            if cut_seconds is not None:
                summary = {**summary, "cut_seconds": cut_seconds}
        except Exception:
            with self.lock:
                if self.state == TreeState.CHECKPOINTING:
                    alive = self.exit_status is None
                    self.state = TreeState.RUNNING if alive else TreeState.EXITED
                self.lock.notify_all()
            raise
        with self.lock:
            self.last_checkpoint = summary
            if stop:
                self.state = TreeState.DUMPED
            elif self.state == TreeState.CHECKPOINTING:
                self.state = TreeState.RUNNING if self.exit_status is None else TreeState.EXITED
            self.lock.notify_all()
        return summary

    def _time_left(self, stop: bool) -> float | None:
        """Seconds until a stopping checkpoint must be done (see dumpgate.time_left)."""
        if not stop:
            return None
        try:
            preempted_at = self.engine.slurm.preempt_time(self.job_id)
        except SingularityError as exc:
            LOG.warning("job %s: Slurm does not say whether it is preempted: %s", self.job_id, exc)
            preempted_at = None
        return dumpgate.time_left(preempted_at, stop, self.engine.config.preemption.warn_time, time.time())

    def op_kill(self, request: dict) -> dict:
        with self.lock:
            if self.trees and self.state in (TreeState.RUNNING, TreeState.CHECKPOINTING):
                self.state = TreeState.KILLED
                for tree in self.trees.values():
                    _kill(tree.init_pid)
            self.lock.notify_all()
            return {"state": str(self.state)}

    def op_requeue(self, request: dict) -> dict:
        exclude = request.get("exclude") or []
        if not isinstance(exclude, list) or not all(isinstance(n, str) and n.isprintable() and n
                                                    for n in exclude):
            raise RequestError("requeue: exclude must be a list of node names")
        keep_excluded = request.get("keep_excluded", False)
        if not isinstance(keep_excluded, bool):
            raise RequestError("requeue: keep_excluded must be true or false")
        resize = request.get("resize")
        if resize is not None:
            from singularity_slurm.coordinator.commands import Refused, resize_args

            try:
                resize = resize_args(resize)
            except Refused as exc:
                raise RequestError(f"requeue: {exc.reason}") from None
        return self._need_engine().requeue(self.job_id, exclude, resize, keep_excluded=keep_excluded)

    def op_migrate(self, request: dict) -> dict:
        exclude = request.get("exclude") or []
        if not isinstance(exclude, list) or not all(isinstance(n, str) and n for n in exclude):
            raise RequestError("migrate: exclude must be a list of node names")
        # The launcher checkpoints every node, answers, then requeues (which ends the caller's step).
        return {**self._through_launcher({"op": "migrate", "exclude": exclude}), "exclude": exclude}

    def _through_launcher(self, command: dict) -> dict:
        """Hand a request to the job's launcher and wait for its outcome."""
        if time.monotonic() >= self.launcher_polls_until:
            raise rpc.Unavailable(f"job {self.job_id} has no launcher waiting for requests on {self.node} "
                               "(not a `singularityctl run` job, or it is starting or ending); try again "
                               "once it runs")
        delivered = threading.Event()
        after_reply = getattr(_CALL, "after_reply", None)
        with self.lock:
            if self.pending is not None:
                raise rpc.Conflict(f"the job's launcher is carrying out another request "
                                   f"({self.pending['op']}); try again when it is done")
            command = {**command, "id": os.urandom(8).hex()}
            self.pending, self.delivered = command, delivered
            while not self.command_results.empty():  # an answer to a request that gave up waiting
                self.command_results.get_nowait()
        self.commands.put_nowait(command)  # empty: `pending` was None and its leftovers are drained
        try:
            result = self.command_results.get(timeout=900)
        except queue.Empty:
            raise rpc.Failed(f"the job's launcher did not carry out {command['op']}") from None
        finally:
            with self.lock:
                self.pending = None
                while not self.commands.empty():  # not taken by the launcher: withdrawn
                    self.commands.get_nowait()
            if after_reply is None:
                delivered.set()  # the caller is in this process (no connection to wait for)
            else:
                after_reply.append(delivered.set)
        if not result.get("ok"):
            raise rpc.Failed(f"{command['op']} failed: {result.get('error')}")
        return dict(result.get("summary") or {})

    def op_resize(self, request: dict) -> dict:
        """(through the launcher) checkpoint, requeue at a new size: {nodes: [MIN, MAX], gpus_per_node}."""
        from singularity_slurm.coordinator.commands import Refused, resize_args

        try:
            size = resize_args({k: request.get(k) for k in ("nodes", "gpus_per_node")})
        except Refused as exc:
            raise RequestError(exc.reason) from None
        return {**self._through_launcher({"op": "resize", **size}), **size}

    def op_launcher_checkpoint(self, request: dict) -> dict:
        return self._through_launcher({"op": "checkpoint"})

    def op_next_command(self, request: dict) -> dict:
        timeout = float(request.get("timeout") or 30)
        if not math.isfinite(timeout):
            raise RequestError("next_command: timeout must be a number of seconds")
        timeout = min(max(timeout, 0.1), 120)
        self.launcher_polls_until = time.monotonic() + timeout + 15
        try:
            return {"command": self.commands.get(timeout=timeout)}
        except queue.Empty:
            return {"command": None}

    def op_command_done(self, request: dict) -> dict:
        result = request.get("result")
        if not isinstance(result, dict):
            raise RequestError("command_done needs result: an object")
        with self.lock:
            pending = self.pending
            if pending is None or request.get("id") != pending["id"]:
                raise rpc.Conflict(f"command_done: no request {request.get('id')!r} is being carried out")
            try:
                self.command_results.put_nowait({"ok": bool(result.get("ok")), "error": result.get("error"),
                                                 "summary": result.get("summary")})
            except queue.Full:
                raise rpc.Conflict(f"command_done: request {pending['id']} was answered already") from None
        delivered = self.delivered
        if delivered is not None:
            # The launcher requeues next, which ends the caller's job step: let the answer reach it.
            delivered.wait(timeout=15)
        return {}

    def op_generations(self, request: dict) -> dict:
        """Generations of this node's tree (`rank`: its index), or of each of `ranks` (the ranks of
        a distributed job, whose checkpoints any node reads: the store is shared)."""
        engine = self._need_engine()
        run = _run_key(request)
        ranks = request.get("ranks")
        if ranks is None:
            return {"generations": engine.for_tree(request.get("rank", 0)).generations(self.job_id, run)}
        if not isinstance(ranks, list) or not ranks or len(ranks) > MAX_RANKS:
            raise RequestError(f"generations: ranks must be a list of 1 to {MAX_RANKS} ranks")
        return {"ranks": engine.rank_generations(self.job_id, ranks, run)}

    def op_latest(self, request: dict) -> dict:
        return {"checkpoint": self._need_engine().latest(self.job_id, _run_key(request))}

    def op_run_begin(self, request: dict) -> dict:
        engine = self._need_engine()
        with self.lock:
            index = self.next_run_index
            try:
                key, before = engine.run_begin(self.job_id, index, request.get("command"))
            except runs.RunRecordError as exc:
                raise RequestError(str(exc)) from exc
            self.next_run_index += 1
        LOG.info("job %s node %s: run %s begins (%s)", self.job_id, self.node, key,
                 "new" if before is None else before.get("state"))
        return {"index": index, "key": key, "record": before}

    def op_run_end(self, request: dict) -> dict:
        key, status = _run_key(request, "key"), request.get("exit_status")
        if key is None:
            raise RequestError("run_end needs key: the run's key from run_begin")
        try:
            self._need_engine().run_end(self.job_id, key, status)
        except runs.RunRecordError as exc:
            raise RequestError(str(exc)) from exc
        return {}

    def shutdown(self) -> None:
        """End the job's trees on this node. A restore in progress holds the lock for as long as
        criu takes, and the Epilog kills an agent that does not stop within seconds: the trees it
        already brought back are ended without waiting for it, and it restores no more."""
        self.stopping = True
        for pid in [*self.restoring, *(tree.init_pid for tree in list(self.trees.values()))]:
            if self.state in (TreeState.RUNNING, TreeState.CHECKPOINTING) or pid in self.restoring:
                _kill(pid)
        self.op_kill({})
        if self.engine is not None and not self.engine.settle(PRUNE_SETTLE_S):
            LOG.info("job %s node %s: stopping while old checkpoints are pruned; the store's next prune "
                     "collects what is left", self.job_id, self.node)


def replica_env(env: Mapping[str, str], threshold: int) -> dict[str, str]:
    """What the ranks of a distributed job get besides their own environment: glibc's fixed mmap
    threshold, which turns off its dynamic one. Each large allocation then gets a mapping of its own,
    and torch's 64-byte aligned tensor starts at the same place in its page in every replica; with
    the threshold that follows each rank's own history (a rank that logs allocates more), the same
    parameters and momentum lie at different offsets and no page of one replica is a page of
    another. A job that tunes glibc's threshold itself keeps its setting."""
    if not isinstance(env, Mapping):
        return {}  # refused with the reason where the request's environment is checked
    tunables = env.get("GLIBC_TUNABLES")
    if threshold <= 0 or "MALLOC_MMAP_THRESHOLD_" in env or (isinstance(tunables, str)
                                                            and "mmap_threshold" in tunables):
        return {}
    return {"MALLOC_MMAP_THRESHOLD_": str(threshold)}


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _merged(summaries: list[dict], trees: list[int]) -> dict:
    """One answer for the checkpoints or restores of a node's trees (one: as it is)."""
    if len(summaries) == 1:
        return {**summaries[0], "trees": trees}
    first = summaries[0]
    merged = {**first, "trees": trees,
              "logical_bytes": sum(s["logical_bytes"] for s in summaries),
              "new_bytes": sum(s["new_bytes"] for s in summaries),
              "seconds": max((s["seconds"] or 0.0) for s in summaries),
              "dedup_ratio": None}
    if any("waited_s" in s for s in summaries):
        merged["waited_s"] = max(s.get("waited_s") or 0.0 for s in summaries)
    for key in ("refused", "notices"):
        if any(key in s for s in summaries):
            merged[key] = [item for s in summaries for item in s.get(key, [])]
    return merged


def _run_key(request: dict, field: str = "run") -> str | None:
    key = request.get(field)
    if key is None:
        return None
    if not isinstance(key, str) or not RUN_KEY.fullmatch(key):
        raise RequestError(f"{field} must be a run key from run_begin, got {key!r}")
    return key


def gpu_of_proxy(proxy: str) -> int | None:
    """The GPU (Slurm's number) a proxy id NODE/gpuN serves; None for a CPU slot."""
    device = proxy.split("/", 1)[-1]
    return int(device[3:]) if device.startswith("gpu") and device[3:].isdigit() else None


def _device_order(proxy: str) -> tuple[str, int, str]:
    """n1/gpu10 after n1/gpu2."""
    device = proxy.split("/", 1)[-1]
    kind = device.rstrip("0123456789")
    number = device[len(kind):]
    return (kind, int(number) if number else -1, proxy)


def serve(socket_path: Path, state: AgentState, limits: rpc.Limits | None = None) -> None:
    """Serve the agent's socket until SIGTERM or SIGINT; anyone may connect, SO_PEERCRED decides who
    is served (root and the job's user; others get `forbidden` before anything is read)."""

    def allow(peer: rpc.Peer) -> str | None:
        if authorized(peer.uid, state.job_uid):
            return None
        return f"uid {peer.uid} may not act on job {state.job_id}: only root and the job's user may"

    server = rpc.Server(socket_path, lambda request, call: state.handle(request, call.peer.uid,
                                                                        call.after_reply, call.peer.pid),
                        name=f"the node agent of job {state.job_id}", mode=0o666, allow=allow,
                        limits=limits or rpc.Limits(max_connections=MAX_CONNECTIONS))
    # The kernel may deliver SIGTERM to any thread, which would not wake a main thread blocked on a
    # lock; the wakeup fd is written by whichever thread gets it, and the main thread reads it.
    wake_r, wake_w = socket.socketpair()
    wake_w.setblocking(False)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, frame: None)
    previous = signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
    server.start()  # the socket appears only once it is listening
    print(f"node agent for job {state.job_id} on {state.node} listening on {socket_path}",
          flush=True)
    try:
        while wake_r.recv(1)[0] not in (signal.SIGTERM, signal.SIGINT):
            pass
    finally:
        signal.set_wakeup_fd(previous)
        wake_r.close()
        wake_w.close()
        state.shutdown()
        server.close()
        print(f"node agent for job {state.job_id} on {state.node} stopped", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="singularity-node-agent",
                                     description="Per-job node agent (started by the prolog).")
    parser.add_argument("--job-id", type=int, required=True)
    parser.add_argument("--uid", type=int, required=True, help="uid of the job's user")
    parser.add_argument("--node", required=True)
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--restart", type=int, default=None,
                        help="the job's Slurm restart count (fences out checkpoints of older restarts)")
    parser.add_argument("--gpus", default="",
                        help="the job's GPUs on this node as Slurm numbers them (0,1,...)")
    parser.add_argument("--no-engine", action="store_true",
                        help="serve ping/status only (no CRIU, no store)")
    parser.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                        help="connections served at once; more are answered busy "
                             f"[default: {MAX_CONNECTIONS}]")
    parser.add_argument("--idle-timeout", type=float, default=rpc.IDLE_TIMEOUT_S,
                        help="seconds a connection may take to send a whole request "
                             f"[default: {rpc.IDLE_TIMEOUT_S:g}]")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s %(levelname)s %(message)s")
    engine = None
    cut_timeout = 60.0
    rank_dir = None
    if not args.no_engine:
        from singularity_slurm.proxy.ranksock import rank_dir as rank_socket_dir

        from .engine import CheckpointEngine

        engine = CheckpointEngine.from_config(args.node, args.socket.parent)
        engine.restart = args.restart
        engine.gpus = gpu_indices(args.gpus)
        cut_timeout = float(engine.config.proxy.cut_timeout)
        rank_dir = str(rank_socket_dir(engine.config.paths.state_dir))
    # Trees an earlier agent of the job started here and could not end (it was killed, and a later
    # step of the job started this one): nothing manages them any more.
    for extern in jobcgroup.noted_externs(args.socket.parent, args.job_id):
        jobcgroup.thaw(extern / jobcgroup.SHELTER)  # one frozen while it waited for a dump slot
    orphans = services.end_trees(args.socket.parent)
    if orphans.ended or orphans.left:
        LOG.warning("job %s node %s: ended trees %s of an earlier agent%s", args.job_id, args.node,
                    orphans.ended, f"; still running: {orphans.left}" if orphans.left else "")
    state = AgentState(args.job_id, args.uid, args.node, engine, run_dir=args.socket.parent,
                       cut_timeout=cut_timeout, rank_dir=rank_dir)
    commands = admin_commands(state, engine.config, engine.slurm) if engine is not None else None
    if commands is not None:
        commands.start()
    try:
        serve(args.socket, state, rpc.Limits(max_connections=args.max_connections,
                                             idle_timeout=args.idle_timeout))
    finally:
        if commands is not None:
            commands.stop()
    return 0


def gpu_indices(text: str) -> list[int]:
    """--gpus 0,2 -> [0, 2] (the Prolog writes it from Slurm's record of the job)."""
    items = [item for item in text.split(",") if item]
    if not all(item.isdigit() for item in items):
        raise SystemExit(f"singularity-node-agent: --gpus must list GPU numbers, got {text!r}")
    return [int(item) for item in items]


def admin_commands(state: AgentState, config: Config, slurm: SlurmClient) -> CommandServer:
    """The thread that takes root's and operators' requests through Redis (on the batch host only:
    Slurm's record of the job says which node that is)."""
    from singularity_slurm.coordinator.commands import BLOCK_S, CommandServer
    from singularity_slurm.coordinator.registry import connect

    return CommandServer(state, job_id=state.job_id, job_uid=state.job_uid, node=state.node,
                         operators=config.admin.operators,
                         connect=lambda: connect(config.redis, timeout=BLOCK_S + 10),
                         locate=lambda: slurm.job_row(state.job_id))  # BatchHost, NodeList: no user text


if __name__ == "__main__":
    sys.exit(main())
