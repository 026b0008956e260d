"""Lift Slurm's requeue delay once a requeue has completed (run detached by the agent, as root).

A requeued job waits `cred_expire + 1` seconds (121 by default, reason BeginTime) before it may start
again. The delay is set when the requeue completes, after every epilog has run, so an update made
right after `scontrol requeue` is overwritten. This helper outlives the job's epilog: it waits until
the job is pending again, keeps it off the nodes a migration leaves and gives a resized job its new
node count and GPUs per node (Slurm changes these only while the job is pending), and sets its
start time to now, until the job starts or waits for something else. It gives up after `timeout`
seconds.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from singularity_slurm.errors import SingularityError
from singularity_slurm.slurmcli import SlurmClient

LOG_VAR = "SINGULARITY_RELEASE_LOG"
"""The helper's log (set by the agent, root, which starts it): removed once the delay is lifted, so
the node's state folder keeps only the logs of releases that failed."""

# Reasons a requeued job may show while its start is delayed: BeginTime once the scheduler has looked
# at it, None before that (the delay is already set when the requeue completes).
DELAYED = ("BeginTime", "None")


def release_when_pending(slurm: SlurmClient, job_id: int, restarts_before: int,
                         exclude: list[str] | None = None, timeout: float = 90.0,
                         poll: float = 0.5, clock=time.monotonic, sleep=time.sleep,
                         resize: list[list[str]] | None = None) -> bool:
    """True once the requeued job is no longer held back by the delay: it started again, or it waits
    for something else (resources, priority). The start time is set again whenever the job shows
    the delay, so a requeue that completes after an update cannot put the delay back unnoticed."""
    released = False
    deadline = clock() + timeout
    while clock() < deadline:
        try:
            record = slurm.job_record(job_id)  # state, restarts and reason from squeue's fields
        except SingularityError:  # slurmctld busy, or squeue not yet listing what scontrol does
            sleep(poll)
            continue
        if record is None:
            return released
        requeued = int(record.get("Restarts", 0) or 0) > restarts_before
        state = record.get("JobState")
        if requeued and state == "PENDING":
            try:
                if exclude:
                    slurm.run(exclude_argv(job_id, exclude))
                    exclude = None
                while resize:  # one update per field: Slurm refuses the whole update for one bad field
                    slurm.run(resize[0])
                    resize.pop(0)
                if record.get("Reason") not in DELAYED:
                    return True
                slurm.release_start(job_id)
                released = True
            except SingularityError:
                pass
        elif requeued and released:
            return True
        sleep(poll)
    return released


def exclude_argv(job_id: int, nodes: list[str]) -> list[str]:
    return ["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(nodes)}"]


def resize_argvs(job_id: int, nodes: str, gpus_per_node: str) -> list[list[str]]:
    """The updates that give a pending job a new size: its node count range ("1-2"), its GPUs on
    each node (a gres count)."""
    argvs = []
    if nodes:
        argvs.append(["scontrol", "update", f"JobId={job_id}", f"NumNodes={nodes}"])
    if gpus_per_node:
        argvs.append(["scontrol", "update", f"JobId={job_id}", f"Gres=gpu:{gpus_per_node}"])
    return argvs


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    job_id, restarts_before = int(args[0]), int(args[1])
    exclude = args[2].split(",") if len(args) > 2 and args[2] else None
    resize = resize_argvs(job_id, args[3], args[4]) if len(args) > 4 else None
    released = release_when_pending(SlurmClient(), job_id, restarts_before, exclude, resize=resize)
    print(f"job {job_id}: requeue delay {'lifted' if released else 'left to Slurm'}", flush=True)
    if released and os.environ.get(LOG_VAR):
        Path(os.environ[LOG_VAR]).unlink(missing_ok=True)
    return 0 if released else 1


if __name__ == "__main__":
    sys.exit(main())
