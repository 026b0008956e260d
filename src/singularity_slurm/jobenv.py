"""What a job is, read from the environment Slurm gives Prolog, Epilog and the batch script, or (for
the Prolog's `--ensure` mode, started from a job step) from SPANK items and Slurm's record of the job.

Node names and job ids become paths (state_dir/NODE/JOB): both are validated first.
"""

from __future__ import annotations

import pwd
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .config import Config
from .errors import ConfigError

NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_JOB_ID = 0xFFFFFFF0  # Slurm's job ids are 32-bit; the values above name special steps
STEP_BATCH = 0xFFFFFFFB
"""Slurm's step id of the batch script (SLURM_BATCH_SCRIPT); at or above STEP_SPECIAL, a step that
is no `srun` step (batch, extern, interactive) and spans the job's own nodes."""
STEP_SPECIAL = 0xFFFFFFF0


class InvalidJobIdentity(ConfigError):
    """A job id, node name or uid that must not become a path or an identity: Slurm gave no such value."""


def valid_node_name(name: object) -> str:
    if not isinstance(name, str) or not NODE_NAME.fullmatch(name) or ".." in name:
        raise InvalidJobIdentity(f"node name {name!r} is not a Slurm node name (letters, digits, '.', "
                                 "'_', '-', at most 64, no '..'); refusing to build paths from it")
    return name


def valid_job_id(value: object) -> int:
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if (not isinstance(text, str) or not text.isascii() or not text.isdigit()
            or not 0 < int(text) < MAX_JOB_ID):
        raise InvalidJobIdentity(f"job id {value!r} is not a Slurm job id (a positive integer)")
    return int(text)


def valid_uid(value: object) -> int:
    if not isinstance(value, str) or not value.isascii() or not value.isdigit() or int(value) >= 2**32 - 1:
        raise InvalidJobIdentity(f"uid {value!r} is not a user id")
    return int(value)


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
            job_id=valid_job_id(env["SLURM_JOB_ID"]),
            user=env.get("SLURM_JOB_USER", ""),
            uid=valid_uid(env["SLURM_JOB_UID"]),
            node=valid_node_name(env["SLURMD_NODENAME"]),
            partition=env.get("SLURM_JOB_PARTITION", ""),
            tier=resolve_tier(env, config),
            gpus=gpus,
            restart_count=int(env.get("SLURM_JOB_RESTART_COUNT") or env.get("SLURM_RESTART_COUNT")
                              or 0),
        )

    @classmethod
    def from_slurm(cls, items: Mapping[str, str], record: Mapping[str, str], step_nodes: str | None,
                   gpus: list[str], config: Config,
                   user_name: Callable[[int], str] = lambda uid: pwd.getpwuid(uid).pw_name) -> JobContext:
        """The job as SPANK items (`items`: SLURM_JOB_ID, SLURM_JOB_UID, SLURM_STEP_ID, SLURM_NODEID,
        from spank_get_item) and Slurm's record of the job say: never the step's environment.

        `step_nodes`: an srun step's nodes as squeue lists them (`SlurmClient.step_nodes`; its
        SLURM_NODEID counts them); the batch step runs on the job's BatchHost, other special steps
        on its nodes.
        """
        missing = [v for v in ("SLURM_JOB_ID", "SLURM_JOB_UID", "SLURM_STEP_ID", "SLURM_NODEID")
                   if not items.get(v)]
        if missing:
            raise InvalidJobIdentity(f"the SPANK plugin passed no {', '.join(missing)}: rebuild and "
                                     "reinstall singularity_sla.so (`singularityctl devcluster up`)")
        job_id, uid = valid_job_id(items["SLURM_JOB_ID"]), valid_uid(items["SLURM_JOB_UID"])
        step_id, node_index = int(items["SLURM_STEP_ID"]), int(items["SLURM_NODEID"])
        if valid_job_id(record.get("JobId")) != job_id:
            raise InvalidJobIdentity(f"Slurm's record is of job {record.get('JobId')}, not {job_id}")
        recorded_uid = re.fullmatch(r"[^()]*\((\d+)\)", record.get("UserId", ""))
        if recorded_uid is None or int(recorded_uid[1]) != uid:
            raise InvalidJobIdentity(f"job {job_id} belongs to {record.get('UserId')!r} in Slurm's record, "
                                     f"not to uid {uid}")
        if step_id == STEP_BATCH:
            node = record.get("BatchHost", "")
        else:
            if step_id < STEP_SPECIAL and not step_nodes:
                raise InvalidJobIdentity(f"Slurm lists no step {step_id} of job {job_id}: its nodes are "
                                         "unknown")
            nodes = expand_hostlist(step_nodes if step_id < STEP_SPECIAL else record.get("NodeList", ""))
            if not 0 <= node_index < len(nodes):
                raise InvalidJobIdentity(f"node index {node_index} is outside step {step_id}'s nodes {nodes} "
                                         f"of job {job_id}")
            node = nodes[node_index]
        partition = record.get("Partition", "")
        return cls(job_id=job_id, user=user_name(uid), uid=uid, node=valid_node_name(node),
                   partition=partition, tier=resolve_tier({"SLURM_JOB_PARTITION": partition}, config),
                   gpus=gpus, restart_count=int(record.get("Restarts") or 0))


def expand_hostlist(expr: str) -> list[str]:
    """Slurm hostlist `n[1-3,5],gpu01` -> ['n1', 'n2', 'n3', 'n5', 'gpu01'] (zero padding kept)."""
    if not expr or expr in {"(null)", "None"}:
        return []
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", expr):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not match:
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for lo, hi in _ranges(ranges):
            width = len(lo) if lo.startswith("0") else 0
            hosts.extend(f"{prefix}{n:0{width}d}{suffix}" for n in range(int(lo), int(hi) + 1))
    return hosts


def _ranges(text: str) -> list[tuple[str, str]]:
    """`0-2,5` -> [('0', '2'), ('5', '5')]."""
    out = []
    for item in text.split(","):
        lo, _, hi = item.partition("-")
        out.append((lo, hi or lo))
    return out


def gpus_of_node(detail: str, node: str, job_id: int | None = None) -> list[str]:
    """The GPU indexes a job holds on `node`, from `scontrol show job -d -o`'s per-node entries
    (`Nodes=n[1-2] CPU_IDs=0-3 Mem=0 GRES=gpu:4(IDX:0-3)`); [] when it holds none there.

    With `job_id`, only that job's own record (its line starting `JobId=<id> `: for an array's or a
    heterogeneous job's id, scontrol prints every task's or component's) counts. The line holds text
    the job's user chose (its name, comment, paths), which may imitate an entry; Slurm prints exactly
    one for each node of a record, so a record with two for `node` is refused."""
    if job_id is not None:
        own = [line for line in detail.splitlines() if line.startswith(f"JobId={int(job_id)} ")]
        if len(own) != 1:
            raise InvalidJobIdentity(f"scontrol shows {len(own)} records of job {job_id}, not one: refusing "
                                     "to guess its devices")
        detail = own[0]
    found = [gres for nodes, gres in re.findall(r"\bNodes=(\S+) CPU_IDs=\S+ Mem=\S+ GRES=(\S*)", detail)
             if node in expand_hostlist(nodes)]
    if len(found) > 1:
        raise InvalidJobIdentity(f"Slurm's record of the job names node {node}'s devices {len(found)} times "
                                 "(text of the job's own imitates Slurm's): refusing to guess")
    gpus: list[str] = []
    for ranges in re.findall(r"gpu[^,(]*\(IDX:([0-9,-]+)\)", found[0] if found else ""):
        gpus.extend(str(n) for lo, hi in _ranges(ranges) for n in range(int(lo), int(hi) + 1))
    return gpus


def job_run_dir(state_dir: Path, node: str, job_id: int) -> Path:
    """Node-local state of one job; per node name, since a dev cluster runs several on one host."""
    return state_dir / valid_node_name(node) / str(valid_job_id(job_id))
