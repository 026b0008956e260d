"""Sweep the checkpoint store once a job's epilog is over (run detached by the Epilog, as root).

While the Epilog runs the job is COMPLETING, and whether it ended for good or is being requeued shows
only once every node's epilog is done. This helper outlives the Epilog: it waits until Slurm shows the
job settled, judges the job's own folders (an ended job's retention starts; with a retention of 0 they
go now), and at most every FULL_SWEEP_S sweeps the whole store (expired retentions, orphans by age,
folders of reused job ids). See `singularity_slurm.checkpoint.retention`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from singularity_slurm import rootexec
from singularity_slurm.checkpoint import retention
from singularity_slurm.config import Config, load
from singularity_slurm.errors import SingularityError
from singularity_slurm.jobenv import valid_job_id
from singularity_slurm.nodelog import node_logger
from singularity_slurm.slurmcli import SlurmClient

SETTLE_TIMEOUT_S = 600.0
FULL_SWEEP_S = 600.0
"""Least time between two sweeps of the whole store (each asks Slurm for every job's state)."""
LAST_SWEEP = ".last-sweep"


def settled_state(slurm: SlurmClient, job_id: int, timeout: float = SETTLE_TIMEOUT_S, poll: float = 1.0,
                  clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep) -> tuple[bool, str | None]:
    """(settled, state): the job's state once it is no longer completing; state None when Slurm has
    no record of it. (False, None) when Slurm could not say within `timeout`."""
    deadline = clock() + timeout
    while True:
        try:
            # squeue's state: scontrol's line prints the job's comment after its JobState, and a
            # comment holding ` JobState=COMPLETED` would have the job's folder marked ended
            record = slurm.job_row(job_id)
        except SingularityError:
            record = {"JobState": "UNKNOWN"}  # slurmctld away: ask again
        if record is None:
            return True, None
        state = record.get("JobState", "")
        if state not in ("COMPLETING", "UNKNOWN", ""):
            return True, state
        if clock() >= deadline:
            return False, None
        sleep(poll)


def slurm_states(slurm: SlurmClient) -> dict[str, str]:
    """job id -> state of every job Slurm knows (raises if Slurm cannot say: never sweep blind)."""
    return {r["JobId"]: r.get("JobState", "") for r in slurm.job_table()}


def sweep_job(config: Config, job_id: int, state: str | None, now: float) -> list[retention.SweepAction]:
    states: Mapping[str, str] = {str(job_id): state} if state is not None else {}
    return retention.sweep(config.paths.store_root, states, now, config.store.retention_s,
                           config.store.orphan_age_s, only=str(job_id))


def sweep_store(config: Config, slurm: SlurmClient, now: float,
                dry_run: bool = False) -> list[retention.SweepAction]:
    return retention.sweep(config.paths.store_root, slurm_states(slurm), now, config.store.retention_s,
                           config.store.orphan_age_s, dry_run=dry_run)


def full_sweep_due(root: Path, now: float) -> bool:
    """True at most once every FULL_SWEEP_S across all nodes (the stamp lives in the shared store)."""
    stamp = root / LAST_SWEEP
    try:
        if now - stamp.stat().st_mtime < FULL_SWEEP_S:
            return False
    except FileNotFoundError:
        pass
    stamp.touch()
    os.utime(stamp, (now, now))
    return True


def wanted(config: Config, job_id: int, now: float) -> bool:
    """Whether a helper has anything to do: the job has folders in the store, or a sweep of the
    whole store is due (so that jobs Singularity does not manage cost nothing)."""
    root = config.paths.store_root
    if any((part / "jobs" / str(job_id)).is_dir() for part in retention.store_roots(root)):
        return True
    try:
        return now - (root / LAST_SWEEP).stat().st_mtime >= FULL_SWEEP_S
    except FileNotFoundError:
        return root.is_dir()


def spawn(job_id: int, node: str) -> None:
    """Start the helper detached from the Epilog (which slurmd waits for)."""
    argv = [sys.executable, "-I", "-m", "singularity_slurm.node.retire", str(job_id), node]
    subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     cwd="/", env=rootexec.service_env(os.environ), start_new_session=True, close_fds=True)


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    job_id, node = valid_job_id(args[0]), args[1] if len(args) > 1 else "?"
    log = node_logger("retire", node, job_id)
    try:
        config = load()
        slurm = SlurmClient()
        settled, state = settled_state(slurm, job_id)
        if not settled:
            log.warning("Slurm did not show the job settled within %.0fs: its folders are left to a "
                        "later sweep", SETTLE_TIMEOUT_S)
            return 1
        now = time.time()
        actions = sweep_job(config, job_id, state, now)
        if full_sweep_due(config.paths.store_root, now):
            actions += sweep_store(config, slurm, now)
    except (SingularityError, OSError) as exc:
        log.error("store sweep failed: %s", exc)
        return 1
    for action in actions:
        if action.error:
            log.warning("store: could not %s %s: %s", action.verdict, action.folder, action.error)
        elif action.verdict is not retention.Verdict.KEEP:
            log.info("store: %s %s (job state %s, %d bytes freed)", action.verdict, action.folder,
                     action.state or "unknown to Slurm", action.freed_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
