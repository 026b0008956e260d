"""Prolog entry point: `singularity-prolog`, configured as slurm.conf's Prolog."""

from __future__ import annotations

import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from singularity_slurm.checkpoint import retention
from singularity_slurm.config import Config, load
from singularity_slurm.coordinator.registry import NodeStart, Registry, connect
from singularity_slurm.errors import RegistryError, SingularityError
from singularity_slurm.jobenv import (
    STEP_SPECIAL,
    InvalidJobIdentity,
    JobContext,
    gpus_of_node,
    job_run_dir,
    valid_job_id,
)
from singularity_slurm.node import gpus as node_gpus
from singularity_slurm.node import services
from singularity_slurm.nodelog import node_logger
from singularity_slurm.slurmcli import SlurmClient, parse_time

AGENT = services.AGENT
PROXY = services.PROXY


def agent_spec(job: JobContext, run_dir: Path) -> services.ServiceSpec:
    socket_path = run_dir / "agent.sock"
    argv = [str(Path(sys.executable).with_name("singularity-node-agent")),
            "--job-id", str(job.job_id), "--uid", str(job.uid), "--node", job.node,
            "--socket", str(socket_path), "--restart", str(job.restart_count)]
    gpus = [gpu for gpu in job.gpus if gpu.isdigit()]  # Slurm's numbers; a gres name is no GPU index
    if gpus:
        argv += ["--gpus", ",".join(gpus)]
    return services.ServiceSpec(AGENT, argv, ready_path=socket_path)


def proxy_devices(job: JobContext, config: Config) -> list[str]:
    """The job's devices on this node: its GPUs, or `proxy.cpu_slots` CPU slots without GPUs."""
    if job.gpus:
        return [f"gpu{g}" for g in job.gpus]
    return [f"cpu{i}" for i in range(config.proxy.cpu_slots)]


def proxy_backend(configured: str, device: str, inventory: list[dict] | None) -> str:
    """The device backend of one device's proxy: `host` for a CPU slot; for a GPU, the configured
    one, where `auto` is `cuda` if NVML saw the job's GPUs on this node and `host` if it could not
    (no driver: the dev cluster's stand-in GPUs)."""
    if not device.startswith("gpu"):
        return "host"
    if configured == "auto":
        return "cuda" if inventory else "host"
    return configured


def proxy_spec(job: JobContext, config: Config, run_dir: Path, device: str,
               inventory: list[dict] | None = None) -> services.ServiceSpec:
    socket_path = run_dir / f"{PROXY}{device}.sock"
    argv = [str(Path(sys.executable).with_name("singularity-proxy")), "--job-id", str(job.job_id),
            "--uid", str(job.uid), "--id", f"{job.node}/{device}", "--socket", str(socket_path),
            "--backend", proxy_backend(config.proxy.backend, device, inventory)]
    return services.ServiceSpec(f"{PROXY}{device}", argv, ready_path=socket_path)


def ensure_context(items: dict[str, str], config: Config, slurm: SlurmClient) -> JobContext:
    """The job of a step, from the SPANK items the plugin passes and Slurm's records of job and step."""
    job_id = valid_job_id(items.get("SLURM_JOB_ID", ""))
    record = slurm.job_record(job_id)  # node, partition and restarts from fields no user writes
    if record is None:
        raise InvalidJobIdentity(f"Slurm has no record of job {job_id}")
    step_id = items.get("SLURM_STEP_ID", "")
    srun_step = step_id.isdigit() and int(step_id) < STEP_SPECIAL
    array = (record.get("ArrayJobId", ""), record.get("ArrayTaskId", ""))
    nodes = slurm.step_nodes(job_id, int(step_id), array) if srun_step else None  # squeue's list
    job = JobContext.from_slurm(items, record, nodes, [], config)
    return replace(job, gpus=gpus_of_node(slurm.job_detail(job_id), job.node, job_id))


def claim_store(job: JobContext, config: Config) -> None:
    """Make the job's store folders this job's (restart 0 only: a job id may have been used before)."""
    facts = SlurmClient().job_facts(job.job_id)  # squeue's: a comment cannot hold another submit time
    if facts is None or not facts.get("SubmitTime"):
        raise InvalidJobIdentity(f"Slurm has no submit time of job {job.job_id}")
    log = node_logger("prolog", job.node, job.job_id)
    for moved in retention.claim(config.paths.store_root, job.job_id, job.uid, facts["SubmitTime"]):
        log.warning("job id %s was used before: moved the earlier job's checkpoints aside to %s (the "
                    "next store sweep deletes them)", job.job_id, moved)


def run(env: dict[str, str], ensure: bool = False) -> int:
    """Prepare the node for the job; with `ensure`, only if its services are not running already.

    `ensure` is how the SPANK plugin calls it at every job step: slurmd skips the Prolog when a
    requeued job comes back to a node within the credential lifetime. The plugin runs in the step,
    whose environment is the user's: it passes SPANK items only, and the rest comes from Slurm.
    """
    node = "?" if ensure else env.get("SLURMD_NODENAME", "?")
    log = node_logger("prolog", node, env.get("SLURM_JOB_ID", "?"))
    try:
        config = load()
        job = ensure_context(env, config, SlurmClient()) if ensure else JobContext.from_env(env, config)
    except SingularityError as exc:
        log.error("cannot prepare the node: %s", exc)
        return 1
    if job.tier is None:
        log.info("partition %s belongs to no SLA tier: job not managed", job.partition)
        return 0
    started_at = time.time()
    run_dir = job_run_dir(config.paths.state_dir, job.node, job.job_id)
    if ensure and services.running_pid(run_dir, AGENT) is not None:
        return 0
    if ensure:
        log.info("services were not running (slurmd skipped the Prolog): starting them")
    if job.restart_count == 0:
        try:
            claim_store(job, config)
        except (OSError, SingularityError) as exc:
            # The job runs all the same (a failed Prolog would drain the node); a restore still
            # refuses checkpoints taken for another uid.
            log.error("cannot claim the job's folder in the checkpoint store: %s", exc)
    inventory = gpu_inventory(job, log)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(run_dir, 0o755)
        specs = [agent_spec(job, run_dir)] + [proxy_spec(job, config, run_dir, device, inventory)
                                              for device in proxy_devices(job, config)]
        with ThreadPoolExecutor(max_workers=len(specs)) as pool:
            started = list(pool.map(lambda spec: services.start(spec, run_dir, ready_timeout=30), specs))
        pids = {spec.name: pid for spec, pid in zip(specs, started, strict=True)}
    except (OSError, SingularityError) as exc:
        log.error("node cannot run the job: %s", exc)
        return 1
    log.info("tier=%s user=%s gpus=%s restart=%d services=%s", job.tier, job.user,
             ",".join(job.gpus) or "-", job.restart_count, pids)
    requested, eligible = (sla_facts(job, SlurmClient(timeout=5), started_at, log) if job.restart_count == 0
                           else (None, None))
    try:
        Registry(connect(config.redis)).record_node_start(NodeStart(
            job_id=job.job_id, node=job.node, user=job.user, uid=job.uid, tier=job.tier,
            partition=job.partition, gpus=job.gpus, restart_count=job.restart_count,
            started_at=started_at, services=pids, requested_devices=requested, eligible_at=eligible,
            gpu_inventory=inventory,
        ))
    except (RegistryError, OSError) as exc:
        log.warning("job not recorded in the registry (the job runs anyway): %s", exc)
    return 0


def gpu_inventory(job: JobContext, log) -> list[dict] | None:
    """The job's GPUs on this node by UUID, type, memory and health (NVML), as the registry keeps
    them; None without GPUs or where NVML cannot tell (logged). An unhealthy GPU is logged as a
    warning: the job runs, and a restore refuses it (node.gpus.restore_pairs)."""
    indices = [int(gpu) for gpu in job.gpus if gpu.isdigit()]
    if not indices:
        return None
    found, why = node_gpus.node_inventory(indices)
    if found is None:
        log.info("GPU inventory not taken: %s", why)
        return None
    for gpu in found:
        if not gpu.healthy:
            log.warning("GPU %d (%s, %s) is unhealthy: %s", gpu.index, gpu.name, gpu.uuid,
                        "; ".join(gpu.problems))
    return [gpu.record() for gpu in found]


SLA_LOOKBACK_S = 30 * 86400.0
"""The oldest first eligibility taken for a starting job: its accounting starts no earlier."""


def sla_facts(job: JobContext, slurm: SlurmClient, started_at: float | None = None,
              log=None) -> tuple[int | None, float | None]:
    """What the SLA accounting measures the job against, at its first start: its devices (this
    node's GPUs, as slurmd gives them, on each of its nodes; one per node without GPUs) and when it
    first became eligible to run, from squeue's fixed columns (never from scontrol's one-line
    record, where the job's own name and comment can imitate any field). The eligible time is kept
    between the submit time and now (and at most 30 days back). (None, None) where Slurm does not
    answer: the accounting then takes the first start's devices and time. Never raises: the Prolog
    must not fail for it."""
    now = time.time() if started_at is None else started_at
    try:
        facts = slurm.job_facts(job.job_id)
        if facts is None:
            return None, None
        nodes = int(facts["NumNodes"]) if re.fullmatch(r"[0-9]{1,6}", facts["NumNodes"]) else 1
        requested = max(len(job.gpus), 1) * max(nodes, 1)
        eligible = parse_time(facts.get("EligibleTime"))
        submitted = parse_time(facts.get("SubmitTime"))
        if eligible is not None:
            eligible = min(max(eligible, submitted or eligible, now - SLA_LOOKBACK_S), now)
        return requested, eligible
    except Exception as exc:  # anything Slurm's output may hold: the job runs all the same
        if log is not None:
            log.warning("SLA accounting facts not read from Slurm: %s", exc)
        return None, None


def main() -> int:
    return run(dict(os.environ), ensure="--ensure" in sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
