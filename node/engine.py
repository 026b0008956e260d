"""The root side of checkpointing on a node: start, dump, store, restore and requeue a job's tree."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import pwd
import shutil
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import redis

from singularity_slurm import faults, rootexec, rpc
from singularity_slurm.checkpoint import anondev, cuda, images
from singularity_slurm.checkpoint.criu import (
    Criu,
    RestoreFailed,
    RestoreRefused,
    external_mounts,
    filelog_shim_path,
    frozen_seconds,
    reap,
    user_folder_mounts,
    wrapper_path,
)
from singularity_slurm.checkpoint.generation import newest_first
from singularity_slurm.checkpoint.store import CheckpointStore, Manifest
from singularity_slurm.config import Config, load
from singularity_slurm.coordinator.registry import Registry, connect
from singularity_slurm.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpoint,
    NoCheckpoint,
    ServiceError,
    SingularityError,
)
from singularity_slurm.interpose import filelog
from singularity_slurm.jobenv import expand_hostlist
from singularity_slurm.rpc import RequestError
from singularity_slurm.slurmcli import SlurmClient

from . import dumpgate, gpus, jobcgroup, jobtree, localfiles, release, restorecheck, runs, services, spool
from .userio import UserCreds

LOG = logging.getLogger("singularity.engine")
KEEP_CHECKPOINTS = 3
PAGE_CHUNK = 4096
"""Process images are chunked by page: between two checkpoints a Python process changes single pages
scattered over its heap (reference counts, GC headers), so a 16 KiB chunk would be new for one page."""


def job_store(root: Path) -> CheckpointStore:
    return CheckpointStore(root, max_chunk=PAGE_CHUNK)


def _shell_status(code: int) -> int:
    """An exit code as a shell reports it: 128 + signal for a killed process (Popen gives -signal)."""
    return 128 - code if code < 0 else code


def _exit_status(status: int) -> int:
    """A waitpid status as a shell would report it."""
    return _shell_status(os.waitstatus_to_exitcode(status))


JOB_ID_VARS = ("SINGULARITY_JOB_ID", "SLURM_JOB_ID")


def foreign_job_ids(env: dict[str, str], job_id: int) -> list[str]:
    """The job ids a start request's environment names that are not the agent's job."""
    return [env[var] for var in JOB_ID_VARS if var in env and env[var] != str(job_id)]


def summarize(manifest: Manifest, seconds: float | None = None) -> dict[str, Any]:
    return {
        "seq": manifest.seq,
        "created_at": manifest.created_at,
        "reason": manifest.reason,
        "logical_bytes": manifest.logical_bytes,
        "new_bytes": manifest.new_bytes,
        "dedup_ratio": round(manifest.dedup_ratio, 2) if manifest.new_bytes else None,
        "node": manifest.meta.get("node"),
        **({"placement": manifest.meta["placement"]} if manifest.meta.get("placement") else {}),
        "seconds": round(seconds, 3) if seconds is not None else None,
    }


def _check_taken_for(manifest: Manifest, uid: int) -> None:
    """Refuse a checkpoint of another user's processes: the job id was used before (a lost Slurm
    state, a wrapped MaxJobId) and the folder outlived its first claim."""
    taken_for = manifest.meta.get("uid")
    if taken_for != uid:
        raise RestoreRefused(f"it holds the processes of uid {taken_for!r}, and job {manifest.job_id} runs "
                             f"as uid {uid}: the job id was used by an earlier job")


def of_run(run: str | None) -> Callable[[Manifest], bool]:
    """Which checkpoints belong to a `singularityctl run` of the job (None: any of them)."""
    if run is None:
        return lambda manifest: True
    return lambda manifest: manifest.meta.get("run") == run


NOTICE = "[singularity] "


def store_refusal(seq: int, reason: str) -> Any:
    from singularity_slurm.checkpoint.store import Refusal

    return Refusal(seq, reason)


def check_store_root(path: Path) -> None:
    """Refuse a store folder that anyone but root owns or may write: checkpoints are restored as root."""
    info = os.stat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
        raise ConfigError(
            f"paths.store_root {path} must be a folder owned by root and not writable by group or others "
            f"(it is {'a folder' if stat.S_ISDIR(info.st_mode) else 'not a folder'}, owner uid "
            f"{info.st_uid}, mode {stat.S_IMODE(info.st_mode):o}); fix it with `chown root: {path} && "
            f"chmod 700 {path}`")
    os.chmod(path, 0o700)  # only the agents (root) read checkpoints


class CheckpointEngine:
    def __init__(self, config: Config, node: str, run_dir: Path, store: CheckpointStore,
                 criu: Criu, slurm: SlurmClient, keep: int = KEEP_CHECKPOINTS):
        self.config = config
        self.node = node
        self.run_dir = run_dir
        self.store = store
        self.criu = criu
        self.slurm = slurm
        self.keep = keep
        self.rank = 0
        self.shared = False  # a rank of a distributed job, in the folder the ranks share
        # A node's trees are dumped at once but stored one after another: a rank stored after
        # another dedups against everything the other stored (the replicas' identical pages).
        self.upload_lock = threading.Lock()
        # Retention runs after a checkpoint's answer (off the path to the requeue), under the upload
        # lock, so no tree's writer of this node stores while it collects; shared by the trees.
        self.pruning: list[threading.Thread] = []
        self.pruning_lock = threading.Lock()
        self.restart: int | None = None  # the job's Slurm restart count when the agent started
        # anonymous device numbers the tree's earlier incarnations mounted (see checkpoint.anondev)
        self.devices: list[int] = []
        self.gpus: list[int] = []  # the job's GPUs on this node, as Slurm numbers them (the Prolog's)
        self.gpu: int | None = None  # a rank's tree: the GPU of the proxy serving it (its placement's)
        # The tree's checkpoint whose dump armed criu's write trackers, while they still say what was
        # written since it (see checkpoint.incremental): the next dump leaves the rest to it.
        self.track_base: Manifest | None = None

    def for_tree(self, tree: int, rank: bool = False, gpu: int | None = None) -> CheckpointEngine:
        """This engine for one of the job's process trees: a rank of a `--world-size` job (`rank`,
        on the GPU `gpu` where its proxy serves one), or the node's one tree (its index among the
        job's nodes).

        The ranks of a distributed job share the job's folder at the store's root, and so one dedup
        namespace (their replicas hold the same parameters), each checkpoint naming its rank. A
        node's tree keeps its checkpoints apart: tree 0 (every single-node job) at the store's
        root, tree r > 0 under ranks/r. The copy also keeps the tree's own device history.
        """
        if not isinstance(tree, int) or isinstance(tree, bool) or tree < 0:
            raise RequestError(f"rank must be a non-negative integer, got {tree!r}")
        engine = copy.copy(self)  # shares the upload lock: a node's trees store one after another
        engine.rank, engine.shared, engine.gpu = tree, rank, gpu
        root = self.config.paths.store_root
        engine.store = job_store(root if tree == 0 or rank else root / "ranks" / str(tree))
        engine.devices = []
        engine.track_base = None
        return engine

    def mine(self, run: str | None) -> Callable[[Manifest], bool]:
        """This tree's checkpoints of a run (in a folder the ranks share: those of its rank)."""
        of = of_run(run)
        if not self.shared:
            return of
        return lambda manifest: of(manifest) and manifest.meta.get("rank") == self.rank

    def file_log(self, job_id: int) -> Path:
        return localfiles.log_path(self.config.paths.filelog_dir, job_id, self.rank)

    def begin(self, job_id: int) -> None:
        """A start or restore of this node's part of the job: from now on, a checkpoint an older
        incarnation's agent commits (it went on after the job restarted elsewhere) is fenced out."""
        if self.restart is not None:
            self.store.raise_fence(job_id, self.restart)

    @classmethod
    def from_config(cls, node: str, run_dir: Path) -> CheckpointEngine:
        config = load()
        store_root = config.paths.store_root
        store_root.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_store_root(store_root)
        return cls(config, node, run_dir, job_store(store_root),
                   Criu(wrapper_path(config.paths.prefix)), SlurmClient())

    # --- start ------------------------------------------------------------------------------------

    def tree_spec(self, request: dict, uid: int, job_id: int) -> jobtree.TreeSpec:
        """The tree a start request asks for; `job_id` is the agent's own (from the Prolog), never
        one the request names: the request's environment is the user's."""
        argv, cwd, output, env = (request.get(k) for k in ("argv", "cwd", "output", "env"))
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise RequestError("start needs argv: a non-empty list of strings")
        for name, value in (("cwd", cwd), ("output", output)):
            if not isinstance(value, str) or not value.startswith("/"):
                raise RequestError(f"start needs {name}: an absolute path")
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                for k, v in env.items()):
            raise RequestError("start needs env: an object of strings")
        try:
            rootexec.encode_env(env)
        except rootexec.BadEnvironment as exc:
            raise RequestError(f"start: {exc}") from exc
        named = foreign_job_ids(env, job_id)
        if named:
            raise RequestError(f"start: the request's environment names job {named[0]}, but this agent "
                               f"serves job {job_id}; run `singularityctl run` inside job {named[0]} "
                               "itself")
        gid = pwd.getpwuid(uid).pw_gid
        log = self.file_log(job_id)
        notices = localfiles.prepare_log(log, uid, gid)
        localfiles.tell_job(UserCreds.of_uid(uid), output, notices, NOTICE)
        env = {**env, **filelog.env_for(filelog_shim_path(self.config.paths.prefix), log,
                                        ld_preload=env.get("LD_PRELOAD") or None)}
        return jobtree.TreeSpec(argv, uid, gid, cwd, output, env)

    def start(self, spec: jobtree.TreeSpec,
              cgroups: list[Path] | None = None) -> tuple[int, Callable[[], int]]:
        """Start the tree (in the job's `cgroups` before it runs anything); (init pid, waiter)."""
        proc = jobtree.spawn(spec, cgroup_procs=jobcgroup.procs_files(cgroups or []))
        self.devices = []
        self.track_base = None
        try:
            init_pid = jobtree.namespace_init(proc.pid)  # it waits for the release: it is there
        except BaseException:
            proc.stdin.close()  # it ends unrun
            raise
        try:  # for the Epilog, which ends the tree should the agent be killed first
            services.note_tree(self.run_dir, init_pid, parent=proc.pid)
        except ServiceError:
            pass  # it has ended already: its waiter says how
        except OSError as exc:
            jobtree.kill_tree(init_pid)
            proc.stdin.close()
            raise CheckpointError(f"the job's tree could not be noted in {self.run_dir}: {exc}") from exc
        jobtree.release(proc)
        deadline = time.monotonic() + 10
        while not jobtree.user_init_started(init_pid, spec.uid) and proc.poll() is None:
            if time.monotonic() > deadline:
                jobtree.kill_tree(init_pid)
                raise CheckpointError("the job's namespace init did not start within 10s")
            time.sleep(0.01)
        return init_pid, lambda: _shell_status(proc.wait())

    # --- checkpoint -------------------------------------------------------------------------------

    def checkpoint(self, job_id: int, uid: int, init_pid: int, reason: str, stop: bool,
                   generation: str | None = None, run: str | None = None,
                   common: list[str] | None = None, size: dict[str, int] | None = None,
                   cut_seconds: float | None = None, within_s: float | None = None,
                   pause: Callable[[], contextlib.AbstractContextManager[list[Path]]] | None = None
                   ) -> dict[str, Any]:
        """Dump the tree and commit it, in one of the node's dump slots (see node.dumpgate). For a
        multi-tree checkpoint, `common` lists the generations every tree committed (newest first;
        None: not known, and nothing of this run is pruned); `size`: a distributed job's ranks,
        devices and nodes, which the checkpoint records; `cut_seconds`: how long its ranks took to
        reach the cut just before (the accounting counts the job stopped from the cut's start);
        `within_s`: seconds left until the checkpoint must be done (Slurm's kill), None: no deadline.
        `pause`: what holds the tree still while it waits for a slot (jobcgroup.frozen of its
        cgroups; it yields those it froze). The summary's `waited_s`: the seconds it waited for a
        slot (not in its `seconds`)."""
        # The node's dump slots, shared by the agents of its jobs: a folder, no state of the engine's.
        gate = dumpgate.DumpGate(lambda: spool.slots_folder(self.config.paths.spool_dir, self.node),
                                 self.config.preemption.concurrent_dumps)
        froze: list[Path] = []

        @contextlib.contextmanager
        def hold() -> Iterator[None]:
            assert pause is not None
            with pause() as frozen:
                froze.extend(frozen)
                yield

        with gate.slot(job_id, self.rank, within_s, hold if pause is not None else None) as waited:
            summary = self._checkpoint_now(job_id, uid, init_pid, reason, stop, generation, run, common,
                                           size, cut_seconds, waited, bool(froze))
        self._prune_later(job_id, summary["seq"], generation, run, common)
        return {**summary, "waited_s": round(waited, 3)}

    def _checkpoint_now(self, job_id: int, uid: int, init_pid: int, reason: str, stop: bool,
                        generation: str | None, run: str | None, common: list[str] | None,
                        size: dict[str, int] | None, cut_seconds: float | None,
                        waited: float, waited_frozen: bool = False) -> dict[str, Any]:
        started = time.monotonic()
        work = spool.work_folder(self.config.paths.spool_dir, self.node, job_id,
                                 f"dump-{self.rank}-{int(time.time() * 1000)}")
        stream = self.config.preemption.streams(stop)
        try:
            if self.track_base is None and not stream:  # a full dump: the spool takes every page
                spool.check_room(work, spool.tree_bytes(jobcgroup.tree(init_pid), self.criu.share_cow),
                                 f"a full dump of job {job_id}'s tree")
            return self._checkpoint(job_id, uid, init_pid, reason, stop, generation, run, work, started,
                                    size, cut_seconds, waited, waited_frozen, stream)
        except Exception as exc:
            self.track_base = None  # whatever the trackers say now is relative to no committed dump
            error = str(exc)
            self._index(lambda registry: registry.record_failure(job_id, self.node, reason, error))
            raise
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _prune_later(self, job_id: int, seq: int, generation: str | None, run: str | None,
                     common: list[str] | None) -> None:
        """Retention after the answer: a preempted job's requeue, and a distributed job's ranks waiting
        at the cut, do not wait for older checkpoints to be deleted. An agent ended meanwhile (the
        Epilog after a requeue) leaves at most unreferenced chunks behind, which the next prune or
        the store sweep collects: the newest checkpoints are never among what it deletes. Only
        checkpoints older than the one committed (`seq`) are candidates: a later checkpoint that
        commits before this prune gets the lock is not known to its choice of what to keep."""

        def prune() -> None:
            with self.upload_lock:
                try:
                    self._prune(job_id, generation, run, common, before=seq)
                except SingularityError as exc:  # an old checkpoint left over costs space, not correctness
                    LOG.warning("job %s rank %s: old checkpoints not pruned: %s", job_id, self.rank, exc)
                except Exception:  # noqa: BLE001 - the checkpoint stands; retention is tried again next time
                    LOG.exception("job %s rank %s: old checkpoints not pruned", job_id, self.rank)

        thread = threading.Thread(target=prune, name=f"prune-{job_id}-{self.rank}", daemon=True)
        with self.pruning_lock:
            self.pruning[:] = [t for t in self.pruning if t.is_alive()]
            self.pruning.append(thread)
        thread.start()

    def settle(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for retention started by earlier checkpoints; True when none
        is left running."""
        deadline = time.monotonic() + timeout
        with self.pruning_lock:
            threads = list(self.pruning)
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        return not any(t.is_alive() for t in threads)

    def _prune(self, job_id: int, generation: str | None, run: str | None, common: list[str] | None,
               before: int | None = None) -> None:
        """Keep the newest checkpoints; of a multi-node job, never the last generation every node has.

        Each node prunes its own part, so a node counting only its own checkpoints could drop the one
        generation the others still have (after a checkpoint that failed on some node): it keeps the
        generations the launcher knows every node committed, and the one it just wrote. With
        `before`, nothing from that sequence number on is deleted.
        """
        older = (lambda seq: True) if before is None else (lambda seq: seq < before)
        checked = self.store.checked(job_id)  # read once: the collection uses them too
        if generation is None:
            own = [m.seq for m in checked.manifests if not self.shared or self.mine(run)(m)]
            self.store.drop(job_id, [seq for seq in own[:-self.keep] if older(seq)], checked=checked)
            return
        if common is None:
            return
        keep = {generation, *newest_first(common)[:max(self.keep - 1, 1)]}
        doomed = [m.seq for m in checked.manifests
                  if self.mine(run)(m) and m.meta.get("generation") and m.meta["generation"] not in keep
                  and older(m.seq)]
        if doomed:
            self.store.drop(job_id, doomed, checked=checked)

    def _checkpoint(self, job_id: int, uid: int, init_pid: int, reason: str, stop: bool,
                    generation: str | None, run: str | None, work: Path, started: float,
                    size: dict[str, int] | None = None, cut_seconds: float | None = None,
                    waited: float = 0.0, waited_frozen: bool = False, stream: bool = False) -> dict[str, Any]:
        """Dump the tree into `work` and commit it. `stream`: its pages go from criu straight into
        a checkpoint writer begun before the dump (checkpoint.pagestream), and only its other images
        into `work`; else every image goes into `work`, stored once criu is done."""
        output = localfiles.output_of(init_pid)  # while the tree exists: the file its stdout names
        faults.point(self.config, "dump", self.node)
        external, skipped = self._tree_mounts(init_pid)
        creds = UserCreds.of_uid(uid)
        copies = work.with_name(work.name + "-local")
        with contextlib.ExitStack() as writing:
            writer = None
            if stream:  # the node's trees store one after another: a rank dedups against the others
                writing.enter_context(self.upload_lock)
                writer = writing.enter_context(self.store.begin(job_id, reason=reason, meta={}))
            with self._gpu_state_out(init_pid, stop) as gpu_meta:
                # Devices write to pinned host memory without faulting, which a write tracker cannot
                # see: a tree with CUDA processes is dumped whole every time.
                track = self.criu.tracks_writes and not gpu_meta
                base, self.track_base = (self.track_base if track else None), None
                dump = self.criu.dump(init_pid, work, leave_running=not stop, external=external,
                                      arm=track and not stop, incremental=base is not None,
                                      skip_mounts=skipped,
                                      pages=writer.chunk_sink(PAGE_CHUNK) if writer is not None else None,
                                      settle_pages=writer.sync_chunks if writer is not None else None)
            dumped = time.monotonic()
            frozen = frozen_seconds(work)
            devices = anondev.history(self.devices, anondev.checkpoint_devices(work))
            try:
                local = localfiles.collect(self.file_log(job_id), creds, copies, self.config.local_files)
                meta = {
                    "node": self.node, "uid": uid, "dump_seconds": round(dumped - started, 3),
                    "local_files": sorted(k for k in local.entries if k != localfiles.LOG_ENTRY),
                    "rank": self.rank, "generation": generation, "run": run, "restart": self.restart,
                    "anon_devs": devices, **({"placement": size} if size else {}),
                    **({"external_mounts": external} if external else {}), **gpu_meta,
                    **({"streamed_pages": dump.received.pages} if dump.received is not None else {}),
                }
                if writer is None:
                    with self.upload_lock:
                        manifest = self._upload(job_id, work, reason, meta, local.entries, base)
                else:
                    writer.add_meta(meta)
                    images.add_images(writer, work, base, received=dump.received, fault=self._store_fault)
                    for rel, path in local.entries.items():
                        writer.add_file(rel, path)
                    manifest = writer.commit()
            finally:
                shutil.rmtree(copies, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)  # the images are in the store now: free the space
        if track and not stop:
            self.track_base = manifest
        notices = local.notices + ([f"not carried: the mounts {', '.join(skipped)} (in folders someone but "
                                    "root could change; a restored job sees the folders under them)"]
                                   if skipped else [])
        localfiles.tell_job(creds, output, notices, f"{NOTICE}checkpoint {manifest.seq}: ")
        faults.point(self.config, "commit", self.node)  # committed, not yet answered (nor requeued)
        summary = summarize(manifest, time.monotonic() - started)
        self._index(lambda registry: registry.record_checkpoint(
            job_id, summary, stop=stop, dump_seconds=manifest.meta.get("dump_seconds"),
            frozen_seconds=frozen, cut_seconds=cut_seconds, waited_seconds=round(waited, 3),
            waited_frozen=waited_frozen))
        return {**summary, "notices": notices} if notices else summary

    def _tree_mounts(self, init_pid: int) -> tuple[dict[str, str], list[str]]:
        """The tree's mounts that criu records by key (gpu.external_mounts), and those it leaves out
        (in folders someone but root could change, looked at in the tree's own namespace)."""
        try:
            mountinfo = Path(f"/proc/{init_pid}/mountinfo").read_text()
            host = Path("/proc/self/mountinfo").read_text()  # criu's, whose mounts it binds from
        except OSError as exc:
            raise CheckpointError(f"cannot read the mounts of the job's tree (pid {init_pid}): "
                                  f"{exc.strerror}") from exc
        skipped = user_folder_mounts(mountinfo, lambda path: os.lstat(f"/proc/{init_pid}/root{path}"), host)
        return external_mounts(mountinfo, self.config.gpu.external_mounts), skipped

    @contextlib.contextmanager
    def _gpu_state_out(self, init_pid: int, stop: bool) -> Iterator[dict[str, Any]]:
        """Around the dump: the GPU state of the tree's CUDA processes moved into their memory
        (cuda.suspend), then back onto the GPU where the tree runs on (a periodic checkpoint, or a
        dump that failed). Yields what the manifest records of it.

        A rank whose proxy moved its GPU memory out while it waits (proxy.swap) maps no device: its
        state is in its memory already, and stays there (it is recorded as `swapped`; its proxy
        brings it in at its turn, after this checkpoint or after a restore)."""
        tree = jobcgroup.tree(init_pid)
        tasks = cuda.gpu_tasks(tree)
        maybe = cuda.cuda_tasks([pid for pid in tree if pid not in tasks])
        if not tasks and not maybe:
            yield {}
            return
        if tasks:
            self._need_gpus(len(tasks))
        try:
            driver = cuda.Driver(lock_timeout_ms=self.config.gpu.lock_timeout_s * 1000)
        except cuda.CudaUnavailable:
            if tasks:
                raise
            yield {}  # nothing on a GPU, and no driver that could have moved anything out of one
            return
        swapped = cuda.checkpointed_tasks(driver, maybe)
        if not tasks and not swapped:
            yield {}
            return
        self._need_gpus(len(tasks) + len(swapped))
        held = [gpu.record() for gpu in gpus.inventory(self.gpus)]
        inner = cuda.inner_pids(tasks)
        cuda.suspend(driver, tasks)
        try:
            yield {"cuda": {"tasks": sorted(inner.values()), "gpus": held, "driver": driver.version,
                            "swapped": sorted(cuda.inner_pids(swapped).values()), "gpu": self.gpu}}
        except BaseException:
            self._gpu_back(driver, tasks)  # the dump failed: the job runs on, on its GPUs
            raise
        if not stop:
            self._gpu_back(driver, tasks)

    def _need_gpus(self, processes: int) -> None:
        if not self.gpus:  # what the job's processes hold open is theirs to fake; Slurm's list is not
            raise CheckpointError(f"the job's tree has {processes} CUDA process(es) but the agent was not "
                                  "told the job's GPUs (the Prolog passes Slurm's with --gpus): its GPU "
                                  "state cannot be checkpointed")

    def _gpu_back(self, driver: cuda.Driver, tasks: list[int]) -> None:
        try:
            cuda.resume(driver, tasks)
        except CheckpointError as exc:
            LOG.error("job tree's CUDA processes %s could not resume on their GPUs: %s", tasks, exc)

    def _upload(self, job_id: int, work: Path, reason: str, meta: dict[str, Any],
                extra: dict[str, Path], base: Manifest | None = None) -> Manifest:
        return images.upload(self.store, job_id, work, reason, meta, extra=extra, base=base,
                             fault=self._store_fault)

    def _store_fault(self) -> None:
        faults.point(self.config, "store-write", self.node)

    def _index(self, action: Callable[[Registry], None]) -> None:
        """Update the Redis index; an outage costs `status` detail, never a checkpoint."""
        try:
            action(Registry(connect(self.config.redis, timeout=2)))
        except (SingularityError, OSError, redis.RedisError):
            pass

    # --- restore ----------------------------------------------------------------------------------

    def restore(self, job_id: int, uid: int, generation: str | None = None,
                run: str | None = None, cgroups: list[Path] | None = None,
                gpu_pairs: Callable[[int, list[cuda.GpuPair]], bool] | None = None) -> dict[str, Any]:
        """Restore the newest checkpoint whose restored tree holds nothing its user could not open.

        A checkpoint that fails that check (see restorecheck), or that criu cannot restore, is refused
        like a corrupt one, and the next older one is tried; with `generation` (a multi-node
        checkpoint) there is no other.
        The restored tree joins the job's `cgroups` before any of its tasks runs. `gpu_pairs` is told
        the tree's rank and GPU UUID pairs before the tree runs where a process of it comes back with
        its GPU memory out: it says whether the rank's proxy brings that memory in at the rank's turn
        (else it is brought in here, with the others).
        """
        started = time.monotonic()
        self._check_trusted(job_id)
        self.track_base = None  # a restored tree has no write trackers
        creds = UserCreds.of_uid(uid)
        refused: list[Any] = []
        tried: set[int] = set()
        while True:
            if generation is not None:
                manifest = self._generation(job_id, generation, run)
            else:
                try:
                    # Verified as it is written out (images.download): read once, not twice.
                    manifest, corrupt = self.store.latest_valid(
                        job_id, where=lambda m: self.mine(run)(m) and m.seq not in tried, verify=False)
                except NoCheckpoint as exc:
                    if not refused:
                        raise RequestError(f"no committed checkpoint of job {job_id}: {exc}") from exc
                    why = "; ".join(f"checkpoint {r.seq} refused: {r.reason}" for r in refused)
                    raise RequestError(f"no committed checkpoint of job {job_id} can be restored: "
                                       f"{why}") from exc
                refused.extend(r for r in corrupt if r.seq not in {known.seq for known in refused})
            tried.add(manifest.seq)
            try:
                _check_taken_for(manifest, uid)
                pid, notices = self._restore_one(job_id, manifest, creds, cgroups or [], gpu_pairs)
                break
            except (RestoreRefused, RestoreFailed, faults.InjectedFault, CorruptCheckpoint) as exc:
                why = exc.detail if isinstance(exc, CorruptCheckpoint) else str(exc)
                if generation is not None:
                    raise RequestError(f"checkpoint {manifest.seq} of tree {self.rank} refused: "
                                       f"{why}") from exc
                refused.append(store_refusal(manifest.seq, why))
        summary = summarize(manifest, time.monotonic() - started)
        refusals = [{"seq": r.seq, "reason": r.reason} for r in refused]
        self._index(lambda registry: registry.record_restore(job_id, self.node, manifest.seq,
                                                             summary["seconds"], refusals))
        return {
            **summary,
            "init_pid": pid,
            "refused": refusals,
            "notices": notices,
            "waiter": lambda: _exit_status(os.waitpid(pid, 0)[1]),
        }

    def _restore_one(self, job_id: int, manifest: Manifest, creds: UserCreds, cgroups: list[Path],
                     gpu_pairs: Callable[[int, list[cuda.GpuPair]], bool] | None = None,
                     ) -> tuple[int, list[str]]:
        """Put one checkpoint back and restore its tree; it runs only if what it holds passes the
        check (else RestoreRefused, and criu has killed the tree)."""
        name = f"restore-{self.rank}-{manifest.seq}"
        shutil.rmtree(spool.job_folder(self.config.paths.spool_dir, self.node, job_id) / name,
                      ignore_errors=True)
        work = spool.work_folder(self.config.paths.spool_dir, self.node, job_id, name)
        try:
            spool.check_room(work, manifest.logical_bytes, f"checkpoint {manifest.seq} of job {job_id}")
            image_dir = images.download(self.store, manifest, work)
            risks = restorecheck.check_images(image_dir)
            if risks:
                more = f" (and {len(risks) - 1} more)" if len(risks) > 1 else ""
                raise RestoreRefused(f"it holds {risks[0]}{more}, which criu would create again as root "
                                     "at a path the job's user controls; keep such files and sockets "
                                     "in /dev/shm (private to the job)")
            log = work / localfiles.LOG_ENTRY
            notices = localfiles.prepare_log(self.file_log(job_id),
                                             creds.uid, creds.gid,
                                             log.read_bytes() if log.exists() else None)
            notices += localfiles.put_back(work, creds, self.config.local_files).notices
            # criu's own descriptors (its log, the images folder) are still open in the tasks then
            own = {(st.st_dev, st.st_ino) for st in (os.stat(image_dir), os.stat(work))}

            def check(pid: int) -> str | None:
                log_file = image_dir / "restore.log"
                ignore = own | ({(os.stat(log_file).st_dev, os.stat(log_file).st_ino)}
                                if log_file.exists() else set())
                problems = restorecheck.check_tree(pid, creds.uid, creds.groups, ignore=ignore)
                if not problems:
                    # criu ran in the job's cgroups, and its tasks with it: this finds them there
                    # (and puts a task criu's own cgroups left elsewhere in, before it runs).
                    moved = jobcgroup.join(jobcgroup.tree(pid), cgroups)
                    return (f"the restored processes could not join the job's cgroups: {moved[0]}"
                            if moved else None)
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                return (f"the restored processes would hold what the job's user may not open: "
                        f"{problems[0]}{more}")

            faults.point(self.config, "restore", self.node)
            gpu_plan = self._gpu_plan(manifest)
            proxies_bring_in = False
            if gpu_plan is not None and manifest.meta["cuda"].get("swapped") and gpu_pairs is not None:
                proxies_bring_in = gpu_pairs(self.rank, gpu_plan[1])
            devices = anondev.history(manifest.meta.get("anon_devs"), anondev.checkpoint_devices(image_dir))
            with anondev.reserved(devices, self.config.paths.state_dir / anondev.LOCK_NAME):
                pid = self.criu.restore(image_dir, check=check, external=self._restore_mounts(manifest),
                                        launch=jobtree.joining(jobcgroup.procs_files(cgroups)))
            self.devices = devices
            if gpu_plan is not None:
                self._gpu_state_in(pid, manifest, *gpu_plan, with_swapped=not proxies_bring_in)
            try:  # at once: the tree runs from here on
                services.note_tree(self.run_dir, pid)
            except ServiceError:
                pass  # it has ended already: its waiter says how
            except OSError as exc:
                jobtree.kill_tree(pid)
                reap(pid)
                raise CheckpointError(f"the restored tree could not be noted in {self.run_dir}: "
                                      f"{exc}") from exc
        finally:
            shutil.rmtree(work, ignore_errors=True)
        localfiles.tell_job(creds, localfiles.output_of(pid), notices, f"{NOTICE}restore: ")
        return pid, notices

    def _restore_mounts(self, manifest: Manifest) -> dict[str, str]:
        """The dump's external mounts that this node's configuration still names (the manifest is
        root's; a mount the admin has since removed from gpu.external_mounts is not bound)."""
        recorded = manifest.meta.get("external_mounts") or {}
        allowed = set(self.config.gpu.external_mounts)
        return {key: path for key, path in recorded.items()
                if isinstance(key, str) and key.startswith("ext") and key[3:].isdigit() and path in allowed}

    def _gpu_plan(self, manifest: Manifest) -> tuple[cuda.Driver, list[cuda.GpuPair]] | None:
        """For a checkpoint that holds GPU state: the driver, and the UUID pairs from the GPUs it
        ran on to this job's here (refused, before anything is restored, where they do not fit)."""
        record = manifest.meta.get("cuda")
        if not record:
            return None
        try:
            driver = cuda.Driver(lock_timeout_ms=self.config.gpu.lock_timeout_s * 1000)
            old = [gpus.Gpu.of_record(item) for item in record.get("gpus", [])]
            ran_on = record.get("gpu")
            if self.gpu is not None and isinstance(ran_on, int) and not isinstance(ran_on, bool):
                # A rank: from the GPU its proxy served at the dump onto its proxy's GPU now (its
                # placement may differ: a job restored onto fewer or other GPUs shares them).
                old = [gpu for gpu in old if gpu.index == ran_on]
                if not old:
                    raise CheckpointError(f"it names GPU {ran_on} for its rank but records no such GPU")
                new = gpus.inventory([self.gpu])
            else:
                new = gpus.inventory(self.gpus or [gpu.index for gpu in old])
            return driver, gpus.restore_pairs(old, new)
        except gpus.GpuMismatch as exc:
            if exc.elsewhere and self.config.gpu.on_mismatch == "wait":
                # Not an older checkpoint, nor the beginning: the job waits for GPUs that fit.
                raise rpc.WrongDevices(f"checkpoint {manifest.seq} holds GPU state that the GPUs of "
                                       f"{self.node} cannot take: {exc}") from exc
            raise RestoreFailed(f"checkpoint {manifest.seq} holds GPU state: {exc}") from exc
        except CheckpointError as exc:
            raise RestoreFailed(f"checkpoint {manifest.seq} holds GPU state: {exc}") from exc

    def _gpu_state_in(self, pid: int, manifest: Manifest, driver: cuda.Driver,
                      pairs: list[cuda.GpuPair], with_swapped: bool = True) -> None:
        """The restored CUDA processes' GPU state back onto this job's GPUs, then their CUDA calls
        let run; a failure kills the tree (its processes would wait forever). Processes whose memory
        was out at the dump (`swapped`) are left to their proxies unless `with_swapped`."""
        record = manifest.meta["cuda"]
        wanted = set(record.get("tasks", [])) | (set(record.get("swapped") or []) if with_swapped else set())
        tasks = [host for host, inner in cuda.inner_pids(jobcgroup.tree(pid)).items() if inner in wanted]
        try:
            if len(tasks) != len(wanted):
                raise CheckpointError(f"{len(wanted)} CUDA process(es) were checkpointed, {len(tasks)} "
                                      "came back")
            cuda.resume(driver, tasks, pairs)
        except CheckpointError as exc:
            jobtree.kill_tree(pid)
            reap(pid)
            raise RestoreFailed(f"the restored processes' GPU state could not be put back: {exc}") from exc

    # --- requeue ----------------------------------------------------------------------------------

    def requeue(self, job_id: int, exclude: list[str] | None = None,
                resize: dict[str, Any] | None = None, keep_excluded: bool = False) -> dict[str, Any]:
        """Requeue the job, and lift Slurm's requeue delay from a helper that outlives the epilog.

        With `exclude`, the helper also keeps the job off those nodes (a migration), and off those
        it was kept off already with `keep_excluded` (nodes whose GPUs cannot take its checkpoint);
        with `resize` ({nodes: [MIN, MAX] | None, gpus_per_node: G | None}) it gives the job its new
        size. Slurm changes neither of a running job, only once it is pending again.
        """
        try:
            record = self.slurm.job_record(job_id) or {}  # its restarts from squeue's fields
        except SingularityError:  # the checkpoint is committed: requeue all the same
            record = {}
        if exclude and keep_excluded:
            kept_off = expand_hostlist(str(record.get("ExcNodeList") or ""))
            exclude = list(dict.fromkeys([*kept_off, *exclude]))
        restarts = int(record.get("Restarts") or self.restart or 0)
        if self.restart is not None:
            # Slurm counts a restart as soon as it takes a requeue (`scontrol requeue` of the running
            # job, which this one then follows): the helper waits for the count past this start's.
            restarts = min(restarts, self.restart)
        faults.point(self.config, "requeue", self.node)
        requeued = self.slurm.requeue(job_id)
        argv = [sys.executable, "-I", "-m", "singularity_slurm.node.release", str(job_id), str(restarts)]
        nodes = (resize or {}).get("nodes")
        gpus = (resize or {}).get("gpus_per_node")
        if exclude or resize:
            argv.append(",".join(exclude or []))
        if resize:
            argv += [f"{nodes[0]}-{nodes[1]}" if nodes else "", str(gpus) if gpus else ""]
        log_path = self.run_dir.parent / f"release-{job_id}.log"
        with open(log_path, "ab") as log:
            # The helper removes its log once it lifted the delay: one is left only where it did not.
            env = {**rootexec.service_env(os.environ), release.LOG_VAR: str(log_path)}
            subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd="/",
                             env=env, start_new_session=True, close_fds=True)
        return {"requeued": requeued, "exclude": exclude or [], **({"resize": resize} if resize else {})}

    def _check_trusted(self, job_id: int) -> None:
        """Refuse a job folder in the store that anyone but root could have written.

        Only the agents (root) write checkpoints, into a root-only store; images from anywhere
        else are never restored as the job's user.
        """
        job_dir = self.store.job_dir(job_id)
        for path in (job_dir, job_dir / "manifests", job_dir / "packs"):
            try:
                info = path.stat()
            except FileNotFoundError:
                continue
            if info.st_uid != 0 or info.st_mode & 0o022:
                raise RequestError(f"refusing to restore from {path}: it is not owned by root or is "
                                   f"writable by others (mode {info.st_mode & 0o777:o}); only "
                                   "checkpoints the agents wrote are restored")

    def _generation(self, job_id: int, generation: str, run: str | None = None) -> Manifest:
        """This node's checkpoint of one multi-node checkpoint (verified as it is written out)."""
        for manifest in reversed(self.store.list(job_id)):
            if manifest.meta.get("generation") == generation and self.mine(run)(manifest):
                return manifest
        raise RequestError(f"tree {self.rank} (a rank, or a node of the job) has no checkpoint of "
                           f"generation {generation}")

    def generations(self, job_id: int, run: str | None = None) -> list[str]:
        """Generations this node committed, oldest first (multi-node checkpoints)."""
        return [m.meta["generation"] for m in self.store.list(job_id)
                if m.meta.get("generation") and self.mine(run)(m)]

    def rank_generations(self, job_id: int, ranks: list[int], run: str | None = None) -> dict[str, list[str]]:
        """The generations each of `ranks` of a distributed job committed, oldest first, from one
        reading of the folder the ranks share (however many ranks a request names)."""
        engines = {rank: self.for_tree(rank, rank=True) for rank in ranks}
        manifests = next(iter(engines.values())).store.list(job_id) if engines else []
        return {str(rank): [m.meta["generation"] for m in manifests
                            if m.meta.get("generation") and engine.mine(run)(m)]
                for rank, engine in engines.items()}

    def latest(self, job_id: int, run: str | None = None) -> dict[str, Any] | None:
        manifests = [m for m in self.store.list(job_id) if self.mine(run)(m)]
        return summarize(manifests[-1]) if manifests else None

    # --- the job's runs ---------------------------------------------------------------------------

    def runs_file(self, job_id: int) -> Path:
        """Beside the checkpoints of node rank 0 (the batch host's), whatever this node's rank."""
        return job_store(self.config.paths.store_root).job_dir(job_id) / runs.FILE_NAME

    def run_begin(self, job_id: int, index: int, command: list[str]) -> tuple[str, dict[str, Any] | None]:
        path = self.runs_file(job_id)
        records, before = runs.begin(runs.load(path), index, command)
        runs.save(path, records)
        return records[str(index)]["key"], before

    def run_end(self, job_id: int, key: str, exit_status: int) -> None:
        path = self.runs_file(job_id)
        runs.save(path, runs.finish(runs.load(path), key, exit_status))
