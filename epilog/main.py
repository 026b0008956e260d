"""Epilog entry point: `singularity-epilog`, configured as slurm.conf's Epilog."""

from __future__ import annotations

import os
import shutil
import sys
import time

from singularity_slurm import rpc
from singularity_slurm.config import load
from singularity_slurm.coordinator.registry import Registry, connect
from singularity_slurm.errors import RegistryError, SingularityError
from singularity_slurm.jobenv import JobContext, job_run_dir
from singularity_slurm.node import jobcgroup, localfiles, retire, services, spool
from singularity_slurm.node.agent import SETTLE_S
from singularity_slurm.nodelog import node_logger
from singularity_slurm.proxy import ranksock


def run(env: dict[str, str]) -> int:
    node = env.get("SLURMD_NODENAME", "?")
    log = node_logger("epilog", node, env.get("SLURM_JOB_ID", "?"))
    try:
        config = load()
        job = JobContext.from_env(env, config)
    except SingularityError as exc:
        log.error("cannot clean up the node: %s", exc)
        return 1
    status = 0
    run_dir = job_run_dir(config.paths.state_dir, job.node, job.job_id)
    if run_dir.exists():
        settle(run_dir, log)
        # The agent first: it must not take the proxies' ends for a failure of the running job.
        stopped = services.stop_all(run_dir, first=[services.AGENT])
        # What is left in the cgroups below the job's extern step: the trees live there, out of reach
        # of Slurm's own kill, and the job's user may have made (and frozen) cgroups of their own
        # there, with processes of the trees moved in. First, so that nothing frozen is left for the
        # trees' end below.
        swept = jobcgroup.end_below_extern(jobcgroup.noted_externs(run_dir, job.job_id))
        if swept.ended:
            log.warning("ended processes %s left in the job's cgroups %s", swept.ended,
                        [str(c) for c in swept.cgroups])
        if swept.kept:
            log.warning("could not remove the job's cgroups %s", [str(c) for c in swept.kept])
        trees = services.end_trees(run_dir)  # those an agent that was killed could not end
        if trees.ended:
            log.warning("ended the job's trees %s that outlived its agent", trees.ended)
        left = [p.stem for p in run_dir.glob("*.pid") if services.running_pid(run_dir, p.stem)]
        left += [f"tree {pid}" for pid in trees.left]
        left += [f"process {pid} in the job's cgroups" for pid in swept.left]
        if left:
            log.error("still running after stop: %s; leaving %s", left, run_dir)
            status = 1
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
        log.info("stopped services %s, removed %s", stopped or "none", run_dir)
    shutil.rmtree(localfiles.log_path(config.paths.filelog_dir, job.job_id).parent, ignore_errors=True)
    if status == 0:  # image folders a killed agent left mid-dump or mid-restore (none still at work)
        shutil.rmtree(spool.job_path(config.paths.spool_dir, job.node, job.job_id), ignore_errors=True)
    ranksock.remove_job_folder(config.paths.state_dir, job.job_id)  # what a proxy that died left
    try:
        Registry(connect(config.redis)).record_node_end(job.job_id, job.node, time.time())
    except (RegistryError, OSError) as exc:
        log.warning("registry not updated: %s", exc)
    try:
        if retire.wanted(config, job.job_id, time.time()):
            retire.spawn(job.job_id, job.node)  # the job's folders in the store, once Slurm shows its end
    except OSError as exc:
        log.warning("store sweep not started: %s", exc)
    return status


def settle(run_dir, log) -> None:
    """Let a checkpoint in progress finish before the agent is stopped: at `scontrol requeue` the
    launcher begins one that Slurm may kill it during (after `KillWait`); the agent carries it on."""
    if services.running_pid(run_dir, services.AGENT) is None:
        return
    try:
        reply = rpc.call(run_dir / "agent.sock", {"op": "settle", "timeout": SETTLE_S},
                         timeout=SETTLE_S + 30, service="the node agent")
    except rpc.RpcError as exc:
        log.warning("could not wait for the agent's checkpoint in progress: %s", exc)
        return
    if reply.get("state") == "checkpointing":
        log.warning("the agent's checkpoint was still in progress after %.0fs; stopping it", SETTLE_S)


def main() -> int:
    return run(dict(os.environ))


if __name__ == "__main__":
    sys.exit(main())
