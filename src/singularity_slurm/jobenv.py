"""What a job is, read from the environment Slurm gives Prolog, Epilog and the batch script."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .config import Config
from .errors import ConfigError

TIER_VARS = ("SPANK_SINGULARITY_SLA", "SLURM_SPANK_SINGULARITY_SLA", "SINGULARITY_SLA")


def resolve_tier(env: Mapping[str, str], config: Config) -> str | None:
    """The job's SLA tier: the option's value, else its partition's tier.

    None for a job in a partition that belongs to no tier: the job-submit policy leaves such jobs
    alone (jobs without the option and without a partition were already given the default tier's
    partition at submission).
    """
    for var in TIER_VARS:
        value = env.get(var)
        if value:
            config.tier(value)  # raises with the valid tiers listed
            return value
    partition = env.get("SLURM_JOB_PARTITION")
    if not partition:
        return config.default_tier
    return config.tier_of_partition(partition)


def parse_gpu_list(value: str | None) -> list[str]:
    """`0,1,3` -> ['0', '1', '3']; Slurm writes an empty or `(null)` value for no GPUs."""
    if not value or value in {"(null)", "NoDevFiles"}:
        return []
    return [item.strip() for item in value.split(",") if item.strip()]


@dataclass(frozen=True)
class JobContext:
    job_id: int
    user: str
    uid: int
    node: str
    partition: str
    tier: str | None  # None: not managed by Singularity
    gpus: list[str]
    restart_count: int

    @classmethod
    def from_env(cls, env: Mapping[str, str], config: Config) -> JobContext:
        missing = [v for v in ("SLURM_JOB_ID", "SLURM_JOB_UID", "SLURMD_NODENAME") if not env.get(v)]
        if missing:
            raise ConfigError(
                f"not running under Slurm: {', '.join(missing)} unset (Prolog/Epilog get them from slurmd)"
            )
        gpus = parse_gpu_list(env.get("SLURM_JOB_GPUS") or env.get("CUDA_VISIBLE_DEVICES"))
        return cls(
            job_id=int(env["SLURM_JOB_ID"]),
            user=env.get("SLURM_JOB_USER", ""),
            uid=int(env["SLURM_JOB_UID"]),
            node=env["SLURMD_NODENAME"],
            partition=env.get("SLURM_JOB_PARTITION", ""),
            tier=resolve_tier(env, config),
            gpus=gpus,
            restart_count=int(env.get("SLURM_JOB_RESTART_COUNT") or env.get("SLURM_RESTART_COUNT")
                              or 0),
        )


def job_run_dir(state_dir: Path, node: str, job_id: int) -> Path:
    """Node-local state of one job; per node name, since a dev cluster runs several on one host."""
    return state_dir / node / str(job_id)
