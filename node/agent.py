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
  start {argv, cwd, output, env, rank}   start the tree (rank: the node's index in the job)
  restore {rank, generation}             restore the newest valid checkpoint of the job (or, in a
                                         multi-node job, this node's part of one generation)
  wait {}                                block until the tree ends: {"state", "exit_status"}
  checkpoint {reason, stop, generation, common}
                                         dump (stop: the tree ends) and commit a checkpoint; `common`:
                                         generations every node has, which pruning keeps
  kill {}                                end the tree now
  requeue {exclude}                      requeue the job in Slurm (away from `exclude` nodes) and
                                         lift its requeue delay
  migrate {exclude}                      (through the launcher) checkpoint every node, the trees stop,
                                         then requeue away from `exclude`
  latest {run}                           the newest committed checkpoint of the job, or null
  generations {rank, run}                generations of this node's multi-node checkpoints
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
the agent configures its proxies for that rendezvous generation and starts this node's ranks. Its
checkpoints then first bring the job to its distributed cut through the proxies (quiesce), and let
the ranks reconnect after the dump (resume). A proxy that dies ends the tree (`proxy_lost` in the
wait answer), so the launcher requeues the job instead of leaving its ranks waiting.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from singularity_slurm import rpc
from singularity_slurm.node import jobcgroup, runs, services
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
MAX_COMMON = 16
"""Generations a checkpoint request may name as committed on every node (the launcher sends a few)."""
RUN_KEY = re.compile(r"[0-9]{1,4}-[0-9a-f]{16}")
_CALL = threading.local()  # per request thread: where to register callbacks for after the reply
LOG = logging.getLogger("singularity.agent")


class TreeState(enum.StrEnum):
    """State of the job's process tree on this node.

    NONE -> RUNNING (start, restore) -> CHECKPOINTING -> RUNNING (leave running) | DUMPED (stop)
    RUNNING -> EXITED (the command ended) | KILLED (kill, or the agent stops)
    """

    NONE = "none"
    RUNNING = "running"
    CHECKPOINTING = "checkpointing"
    DUMPED = "dumped"
    EXITED = "exited"
    KILLED = "killed"


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
        self.init_pid: int | None = None
        self.exit_status: int | None = None
        self.last_checkpoint: dict | None = None
        self.cgroups: list[Path] = []  # the job's extern step cgroups on this node, once a caller showed them

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

    def op_status(self, request: dict) -> dict:
        with self.lock:
            return {"state": str(self.state), "init_pid": self.init_pid,
                    "exit_status": self.exit_status, "last_checkpoint": self.last_checkpoint}

    def _need_engine(self) -> Any:
        if self.engine is None:
            raise rpc.Unavailable("this agent has no checkpoint engine")
        return self.engine

    def op_start(self, request: dict) -> dict:
        engine = self._need_engine()
        cgroups = self._job_cgroups()
        engine.use_rank(request.get("rank", 0))
        with self.lock:
            if self.state in (TreeState.RUNNING, TreeState.CHECKPOINTING):
                raise RequestError(f"job {self.job_id} already runs on {self.node}")
        ranks = self._configure_proxies(request.get("proxy"))
        if ranks is not None:
            extra = {"SINGULARITY_LOCAL_RANKS": ",".join(map(str, ranks))}
            if self.rank_dir is not None:
                extra["SINGULARITY_RANK_DIR"] = self.rank_dir
            request = {**request, "env": {**(request.get("env") or {}), **extra}}
        spec = engine.tree_spec(request, self.job_uid, self.job_id)
        self.run_key = _run_key(request)
        engine.begin(self.job_id)
        with self.lock:
            if self.state in (TreeState.RUNNING, TreeState.CHECKPOINTING):
                raise RequestError(f"job {self.job_id} already runs on {self.node}")
            self.init_pid, waiter = engine.start(spec, cgroups)
            self._running(waiter)
        LOG.info("job %s node %s: started %s (ns init pid %s)", self.job_id, self.node,
                 spec.argv, self.init_pid)
        return {"init_pid": self.init_pid}

    def op_restore(self, request: dict) -> dict:
        engine = self._need_engine()
        cgroups = self._job_cgroups()
        with self.lock:
            if self.state in (TreeState.RUNNING, TreeState.CHECKPOINTING):
                raise RequestError(f"job {self.job_id} already runs on {self.node}")
            engine.use_rank(request.get("rank", 0))
            engine.begin(self.job_id)
            self._configure_proxies(request.get("proxy"))
            self.run_key = _run_key(request)
            result = engine.restore(self.job_id, self.job_uid, request.get("generation"), self.run_key,
                                    cgroups=cgroups)
            self.init_pid = result["init_pid"]
            self._running(result.pop("waiter"))
        LOG.info("job %s node %s: restored checkpoint %s", self.job_id, self.node, result["seq"])
        return result

    def _job_cgroups(self) -> list[Path]:
        """The job's extern step cgroups, from the caller's (a process of a step of the job here).

        A caller outside every step of the job, where the job has an extern step on this node, is
        refused: what it started would not be the job's own tree."""
        pid = getattr(_CALL, "peer_pid", None)
        found = jobcgroup.targets_of(pid, self.job_id) if pid else []
        if found:
            self.cgroups = found
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

    def _running(self, waiter) -> None:
        self.state = TreeState.RUNNING
        self.exit_status = None
        self.proxy_lost = None
        threading.Thread(target=self._reap, args=(waiter, self.init_pid), daemon=True).start()
        if self.proxies:
            threading.Thread(target=self._watch_proxies, args=(self.init_pid,), daemon=True).start()

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

    def _configure_proxies(self, config: Any) -> list[int] | None:
        """Configure this node's proxies for a rendezvous generation; this node's ranks, or None."""
        if config is None:
            self.proxies = {}
            return None
        if not isinstance(config, dict) or not isinstance(config.get("generation"), str):
            raise RequestError("proxy: needs {generation: string, placement: {rank: proxy id}}")
        placement = config.get("placement")
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
        for proxy in local:  # every proxy learns the generation; unused ones serve nothing
            try:
                rpc.call(local[proxy], {"op": "configure", "generation": config["generation"],
                                        "placement": placement}, timeout=30, service=f"proxy {proxy}")
            except rpc.RpcError as exc:
                raise RequestError(f"proxy {proxy}: {exc}", kind=exc.kind) from exc
        self.proxies = {proxy: local[proxy] for proxy in sorted(used, key=_device_order)}
        LOG.info("job %s node %s: proxies %s serve ranks %s (generation %s)", self.job_id, self.node,
                 list(self.proxies), ranks, config["generation"])
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

    def _watch_proxies(self, init_pid: int) -> None:
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
                self._lose_tree(init_pid, f"{proxy} could not reach the job's other proxies ({problem})")
                return
        while True:
            time.sleep(0.5)
            with self.lock:
                if self.init_pid != init_pid or self.state not in (TreeState.RUNNING,
                                                                   TreeState.CHECKPOINTING):
                    return
                assert self.run_dir is not None
                dead = [p for p, name in names.items() if services.running_pid(self.run_dir, name) is None]
            if dead:
                self._lose_tree(init_pid, f"{dead[0]} died")
                return

    def _lose_tree(self, init_pid: int, what: str) -> None:
        with self.lock:
            if self.init_pid != init_pid or self.state not in (TreeState.RUNNING, TreeState.CHECKPOINTING):
                return
            self.proxy_lost = what
            LOG.error("job %s node %s: device proxy %s; ending the tree so the job is requeued", self.job_id,
                      self.node, what)
            try:
                os.kill(init_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _reap(self, waiter, init_pid: int) -> None:
        status = waiter()
        with self.lock:
            if self.init_pid != init_pid:
                return
            self.exit_status = status
            if self.state == TreeState.RUNNING:
                self.state = TreeState.EXITED
            elif self.state == TreeState.CHECKPOINTING:
                # The tree ended while being dumped: CRIU's kill after a stop-dump lands here first.
                pass
            self.lock.notify_all()
        LOG.info("job %s node %s: tree ended with status %s", self.job_id, self.node, status)

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
        engine = self._need_engine()
        reason = str(request.get("reason") or "manual")
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
            init_pid = self.init_pid
        try:
            cut_seconds = self._quiesce()
            try:
                summary = engine.checkpoint(self.job_id, self.job_uid, init_pid, reason=reason, stop=stop,
                                            generation=generation,
                                            run=_run_key(request) or self.run_key, common=common)
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

    def op_kill(self, request: dict) -> dict:
        with self.lock:
            if self.init_pid is not None and self.state in (TreeState.RUNNING, TreeState.CHECKPOINTING):
                self.state = TreeState.KILLED
                os.kill(self.init_pid, signal.SIGKILL)
            self.lock.notify_all()
            return {"state": str(self.state)}

    def op_requeue(self, request: dict) -> dict:
        exclude = request.get("exclude") or []
        if not isinstance(exclude, list) or not all(isinstance(n, str) and n.isprintable() and n
                                                    for n in exclude):
            raise RequestError("requeue: exclude must be a list of node names")
        return self._need_engine().requeue(self.job_id, exclude)

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
        engine = self._need_engine()
        engine.use_rank(request.get("rank", 0))
        return {"generations": engine.generations(self.job_id, _run_key(request))}

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
        self.op_kill({})


def _run_key(request: dict, field: str = "run") -> str | None:
    key = request.get(field)
    if key is None:
        return None
    if not isinstance(key, str) or not RUN_KEY.fullmatch(key):
        raise RequestError(f"{field} must be a run key from run_begin, got {key!r}")
    return key


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
        cut_timeout = float(engine.config.proxy.cut_timeout)
        rank_dir = str(rank_socket_dir(engine.config.paths.state_dir))
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


def admin_commands(state: AgentState, config: Config, slurm: SlurmClient) -> CommandServer:
    """The thread that takes root's and operators' requests through Redis (on the batch host only:
    Slurm's record of the job says which node that is)."""
    from singularity_slurm.coordinator.commands import BLOCK_S, CommandServer
    from singularity_slurm.coordinator.registry import connect

    return CommandServer(state, job_id=state.job_id, job_uid=state.job_uid, node=state.node,
                         operators=config.admin.operators,
                         connect=lambda: connect(config.redis, timeout=BLOCK_S + 10),
                         locate=lambda: slurm.job(state.job_id))


if __name__ == "__main__":
    sys.exit(main())
