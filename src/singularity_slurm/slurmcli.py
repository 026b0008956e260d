"""The one narrow interface to Slurm: its command-line tools.

Command lines are built and outputs parsed by pure functions (tested from strings); `SlurmClient`
is the thin shell that runs them. Slurm's one-line record format (`scontrol show job -o`) is the
same on every supported release (22.05 to 24.11), while the JSON schemas changed three times in
that range, so records are read from the one-line form.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from singularity_slurm import rootexec
from singularity_slurm.errors import SlurmCommandFailed, SlurmError
from singularity_slurm.jobenv import expand_hostlist  # noqa: F401 (part of this interface)

_KEY = re.compile(r"^[A-Za-z][A-Za-z0-9_:/.]*$")
_DIGITS = re.compile(r"[0-9]{1,9}")
"""A count Slurm prints (`str.isdigit` also takes `²`, which `int` refuses)."""


@dataclass(frozen=True, order=True)
class SlurmVersion:
    major: int
    minor: int
    micro: int = 0

    def __str__(self) -> str:
        return f"{self.major:02d}.{self.minor:02d}.{self.micro}"


def parse_version(text: str) -> SlurmVersion:
    """`slurm 22.05.8` (or `slurm-wlm 24.11.5`) -> SlurmVersion(22, 5, 8)."""
    match = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not match:
        raise SlurmError(f"cannot read a Slurm version from {text.strip()!r}")
    return SlurmVersion(int(match[1]), int(match[2]), int(match[3] or 0))


def parse_record(line: str) -> dict[str, str]:
    """One `scontrol show … -o` line -> {Key: value}.

    Values may hold spaces (Reason, Command) or '=' (TRES=cpu=1,node=1): a token starts a new key
    only when what stands before its first '=' looks like a key.
    """
    record: dict[str, str] = {}
    last: str | None = None
    for token in line.strip().split(" "):
        key, sep, value = token.partition("=")
        if sep and _KEY.match(key):
            record[key] = value
            last = key
        elif last is not None:
            record[last] += " " + token
    return record


def parse_records(text: str) -> list[dict[str, str]]:
    return [parse_record(line) for line in text.splitlines() if line.strip()]


_DRAIN_STATES = {"DRAIN", "DRAINING", "DRAINED"}  # scontrol writes ALLOCATED+DRAIN; sinfo DRAINING


def draining(records: dict[str, dict[str, str]], nodes: Iterable[str]) -> tuple[tuple[str, ...], str]:
    """Which of `nodes` an admin drains (State has the DRAIN flag: DRAINING or DRAINED), and the
    first one's Reason; a node Slurm does not show is not."""
    found = [n for n in nodes if _DRAIN_STATES & set(records.get(n, {}).get("State", "").split("+"))]
    return tuple(found), (records[found[0]].get("Reason", "") if found else "")


def parse_config(text: str) -> dict[str, str]:
    """`scontrol show config` ("Key = value" lines) -> {Key: value}."""
    config: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and " " not in key.strip():
            config[key.strip()] = value.strip()
    return config


def parse_sbatch_parsable(text: str) -> int:
    """`sbatch --parsable` prints `JOBID` or `JOBID;CLUSTER`."""
    first = text.strip().splitlines()[-1] if text.strip() else ""
    job_id = first.split(";")[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch printed {text.strip()!r}, not a job id")
    return int(job_id)


def parse_gpu_count(record: dict[str, str]) -> int:
    """GPUs per node a job asked for, from TresPerNode (`gres:gpu:2`, `gres/gpu=2`, `gpu:a100:2`)."""
    tres = record.get("TresPerNode") or record.get("Gres") or ""
    total = 0
    for item in tres.split(","):
        parts = re.split(r"[:/=]", item)
        if "gpu" in parts:
            tail = parts[-1]
            total += int(tail) if tail.isdigit() else 1
    return total


def allocated_devices(record: dict[str, str]) -> int:
    """The devices a job holds (running) or asks for (pending): TRES's gres/gpu (`gres/gpu=4`,
    `gres/gpu:a100=4`), else GPUs per node times nodes, else per job; 0 for a job without GPUs."""
    for item in (record.get("TRES") or record.get("ReqTRES") or "").split(","):
        key, _, value = item.partition("=")
        if key.split(":")[0] == "gres/gpu" and _DIGITS.fullmatch(value):
            return int(value)
    per_node = parse_gpu_count(record)
    nodes = (record.get("NumNodes") or "1").split("-")[0]
    if per_node:
        return per_node * (int(nodes) if _DIGITS.fullmatch(nodes) else 1)
    return parse_gpu_count({"TresPerNode": record.get("TresPerJob", "")})


JOB_TABLE = (("JobId", "%A"), ("JobState", "%T"), ("Partition", "%P"), ("BatchHost", "%B"),
             ("NodeList", "%N"), ("NumNodes", "%D"))
"""What `SlurmClient.job_table` reads of every job: fields Slurm and the admin write, never the job's
user. (`scontrol show job -o` puts the job's name, comment, command and paths, which its user
chooses, on the same line as the fields Slurm sets: a name holding ` JobId=7` makes that line name
another job. squeue's `%b`, the GPUs per node, holds a GRES type the user wrote: it is read apart,
by `parse_gpus_per_node`.)"""


def job_table_argv(states: str = "all", job_id: int | None = None) -> list[str]:
    return ["squeue", "-h", *(["-j", str(int(job_id))] if job_id is not None else []), "-t", states,
            "-o", "|".join(code for _, code in JOB_TABLE)]


def preempt_time_argv(job_id: int) -> list[str]:
    return ["squeue", "-h", "-j", str(int(job_id)), "-O", "PreemptTime:40"]


def preempting_argv() -> list[str]:
    return ["squeue", "-h", "-t", "running", "-O", "JobID:20,StartTime:25,PreemptTime:25"]


def parse_preempting(text: str) -> set[int]:
    """The running jobs Slurm is preempting, from `preempting_argv`'s fixed-width columns (no field
    of which a user writes): those whose PreemptTime is at or after the StartTime of their current
    run (a requeued job's PreemptTime may be its earlier run's)."""
    found: set[int] = set()
    for line in text.splitlines():
        fields = line.split()
        if len(fields) != 3 or not fields[0].isascii() or not fields[0].isdigit():
            continue
        started, preempted = parse_time(fields[1]), parse_time(fields[2])
        if started is not None and preempted is not None and preempted >= started:
            found.add(int(fields[0]))
    return found


def gpus_per_node_argv(states: str = "all") -> list[str]:
    return ["squeue", "-h", "-t", states, "-o", "%A|%b"]


_TABLE_FIELDS = {
    "JobId": re.compile(r"[0-9]{1,19}"),
    "JobState": re.compile(r"[A-Z_?]{1,40}"),
    "Partition": re.compile(r"[A-Za-z0-9_.,-]{0,1024}"),
    "NodeList": re.compile(r"[A-Za-z0-9._,\[\]-]{0,65536}"),
    "NumNodes": re.compile(r"[0-9]{1,9}"),
}
"""What each field of the job table may hold (a batch host is checked apart: for a job not started by
sbatch squeue prints the host it was submitted from)."""
_NODE_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_GPUS_PER_NODE = re.compile(r"[A-Za-z0-9_:/=,.()-]{0,1024}")


def parse_job_table(text: str) -> list[dict[str, str]]:
    """`squeue` lines of `job_table_argv` -> records with scontrol's key names (`n/a` and `N/A` empty).
    A line of another shape, or a job id twice, fails the whole table (SlurmError): nothing in it is
    the users', so something is wrong. A batch host that is not one of the job's nodes (a job started
    by salloc or srun: its submit host) is empty."""
    records, seen = [], set()
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        values = [v.strip() for v in line.strip().split("|")]
        if len(values) != len(JOB_TABLE):
            raise SlurmError(f"squeue line {number} has {len(values)} fields, not {len(JOB_TABLE)}: "
                             f"{line!r}")
        record = {key: ("" if value.lower() == "n/a" else value)
                  for (key, _), value in zip(JOB_TABLE, values, strict=True)}
        bad = [key for key, pattern in _TABLE_FIELDS.items() if not pattern.fullmatch(record[key])]
        if bad or not record["JobId"]:
            what = ", ".join(bad) or "JobId"
            raise SlurmError(f"squeue line {number} does not look like Slurm's ({what}): {line!r}")
        if record["JobId"] in seen:
            raise SlurmError(f"squeue lists job {record['JobId']} twice (line {number})")
        seen.add(record["JobId"])
        host = record["BatchHost"]
        if not _NODE_NAME.fullmatch(host) or host not in expand_hostlist(record["NodeList"]):
            record["BatchHost"] = ""
        records.append(record)
    return records


def parse_gpus_per_node(text: str, jobs: Iterable[str]) -> dict[str, str]:
    """job id -> its GPUs per node (`%b`, e.g. `gres:gpu:4`), from `gpus_per_node_argv`'s lines, for
    the ids of `jobs` only. The field holds a GRES type its user wrote, which may carry `|` or a line
    break and so imitate a line of another job: an id whose lines are not exactly one, or whose value
    is not of GRES's shape, is left out (its size is unknown)."""
    wanted = set(jobs)
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        job, sep, value = line.strip().partition("|")
        if sep and job in wanted:
            found.setdefault(job, []).append(value.strip())
    return {job: ("" if values[0].lower() == "n/a" else values[0]) for job, values in found.items()
            if len(values) == 1 and _GPUS_PER_NODE.fullmatch(values[0])}


def parse_time(text: str | None) -> float | None:
    """A Slurm timestamp (`2026-12-03T06:00:00`, in the controller's local time) as a Unix time;
    None for `Unknown`, `None` or anything else."""
    import datetime

    try:
        return datetime.datetime.strptime((text or "").strip(), "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def parse_user(field: str) -> tuple[str, int | None]:
    """`UserId=alice(1001)` value -> ('alice', 1001)."""
    match = re.fullmatch(r"([^()]*)\((\d+)\)", field or "")
    if match:
        return match[1], int(match[2])
    return field, None


def sbatch_argv(script: str, options: Sequence[str] = (), parsable: bool = True) -> list[str]:
    argv = ["sbatch"]
    if parsable:
        argv.append("--parsable")
    return [*argv, *options, script]


def scontrol_show_job_argv(job_id: int | None = None) -> list[str]:
    argv = ["scontrol", "show", "job", "-o"]
    return argv + [str(job_id)] if job_id is not None else argv


def requeue_argv(job_id: int, hold: bool = False) -> list[str]:
    return ["scontrol", "requeuehold" if hold else "requeue", str(job_id)]


def release_start_argv(job_id: int) -> list[str]:
    """Remove Slurm's requeue wait (BeginTime = cred_expire + 1 s): needs root or SlurmUser."""
    return ["scontrol", "update", f"JobId={job_id}", "StartTime=now"]


def is_already_requeued(stderr: str) -> bool:
    """Newer Slurm requeues a preempted job itself; a second requeue then fails harmlessly."""
    text = stderr.lower()
    return "already" in text and "requeue" in text or "job is pending execution" in text


def is_invalid_job(stderr: str) -> bool:
    return "invalid job id" in stderr.lower()


class SlurmClient:
    """Runs Slurm's CLI; every method is a thin shell around the pure functions above."""

    def __init__(self, timeout: float = 30.0, runner=subprocess.run, as_root: bool | None = None):
        self.timeout = timeout
        self._run = runner
        # As root (the agent, its release helper, admin tools) Slurm's tools run by absolute path with
        # a clean environment; as a user (the CLI, the launcher) they run as the user's own commands.
        # A runner given by a test sees the argv as written unless as_root says otherwise.
        self.as_root = (os.geteuid() == 0 and runner is subprocess.run) if as_root is None else as_root

    def run(self, argv: list[str], check: bool = True, user: str | None = None,
            input: str | None = None, timeout: float | None = None) -> subprocess.CompletedProcess[str]:
        """`argv` run (as `user`), within `timeout` seconds (default: the client's)."""
        timeout = self.timeout if timeout is None else timeout
        full = ["runuser", "-u", user, "--", *argv] if user else argv
        extra = {}
        if self.as_root:  # root never finds Slurm's tools through, or runs them with, a caller's env
            full = [rootexec.system_program(full[0]), *full[1:]]
            extra = {"env": rootexec.clean_env()}
        try:
            # errors="replace": a job's name or paths may hold bytes that are not UTF-8
            proc = self._run(full, capture_output=True, text=True, timeout=timeout,
                             input=input, errors="replace", **extra)
        except FileNotFoundError as exc:
            raise SlurmError(
                f"{argv[0]} not found: install Slurm's client tools (Debian: slurm-client)"
            ) from exc
        except subprocess.TimeoutExpired as exc:
            raise SlurmError(
                f"`{shlex.join(argv)}` did not answer within {timeout:.0f}s: is slurmctld up?"
            ) from exc
        if check and proc.returncode != 0:
            raise SlurmCommandFailed(argv, proc.returncode, proc.stderr or proc.stdout)
        return proc

    def version(self) -> SlurmVersion:
        return parse_version(self.run(["scontrol", "--version"]).stdout)

    def config(self) -> dict[str, str]:
        return parse_config(self.run(["scontrol", "show", "config"]).stdout)

    def jobs(self, job_id: int | None = None) -> list[dict[str, str]]:
        proc = self.run(scontrol_show_job_argv(job_id), check=False)
        if proc.returncode != 0:
            if is_invalid_job(proc.stderr):
                return []
            raise SlurmCommandFailed(scontrol_show_job_argv(job_id), proc.returncode, proc.stderr)
        if proc.stdout.strip() == "No jobs in the system":
            return []
        return parse_records(proc.stdout)

    def job_table(self, states: str = "all", gpus: bool = False) -> list[dict[str, str]]:
        """Every job Slurm knows in `states` (squeue's list), with the fields of `JOB_TABLE` only: what
        root reads when it judges many jobs at once. With `gpus`, each job's `TresPerNode` too where
        it can be read (see `parse_gpus_per_node`; a job without one has an unknown size)."""
        table = parse_job_table(self.run(job_table_argv(states)).stdout)
        if gpus:
            per_node = parse_gpus_per_node(self.run(gpus_per_node_argv(states)).stdout,
                                           (r["JobId"] for r in table))
            for record in table:
                if record["JobId"] in per_node:
                    record["TresPerNode"] = per_node[record["JobId"]]
        return table

    def job_row(self, job_id: int) -> dict[str, str] | None:
        """One job's `JOB_TABLE` fields (squeue's, which no user writes); None when Slurm does not
        list it (or lists something that is not Slurm's shape); SlurmCommandFailed when squeue
        fails for another reason (slurmctld away: ask again)."""
        argv = job_table_argv("all", job_id)
        proc = self.run(argv, check=False)
        if proc.returncode != 0 and not is_invalid_job(proc.stderr):
            raise SlurmCommandFailed(argv, proc.returncode, proc.stderr)
        try:
            rows = parse_job_table(proc.stdout)
        except SlurmError:
            return None
        return next((r for r in rows if r["JobId"] == str(int(job_id))), None)

    def job_facts(self, job_id: int) -> dict[str, str] | None:
        """One job's node count, restart count, eligible and submit time, array job and task (the
        job's own id and N/A for a job of no array), and the reason it is pending, from fixed-width
        squeue columns that no user writes (scontrol's one-line record holds
        the job's name, comment and paths, which its user chooses, and a ` Key=value` there reads as
        Slurm's field); None for a job Slurm does not list."""
        widths = (("JobId", "JobID", 20), ("NumNodes", "NumNodes", 10), ("Restarts", "RestartCnt", 10),
                  ("EligibleTime", "EligibleTime", 25), ("SubmitTime", "SubmitTime", 25),
                  ("ArrayJobId", "ArrayJobID", 20), ("ArrayTaskId", "ArrayTaskID", 20),
                  ("Reason", "Reason", 200))  # last: Slurm's reasons may hold spaces
        spec = ",".join(f"{name}:{width}" for _, name, width in widths)
        out = self.run(["squeue", "-h", "-t", "all", "-j", str(int(job_id)), "-O", spec], check=False)
        for line in out.stdout.splitlines():
            fields = line.split(None, len(widths) - 1)
            if len(fields) == len(widths) - 1:
                fields.append("")
            if len(fields) == len(widths) and fields[0] == str(int(job_id)) and _DIGITS.fullmatch(fields[2]):
                return {key: value.strip() for (key, _, _), value in zip(widths, fields, strict=True)}
        return None

    def job_record(self, job_id: int) -> dict[str, str] | None:
        """scontrol's record of one job, with every field root acts on replaced by squeue's, which no
        user writes: `job_row`'s state, partition, batch host and nodes, `job_facts`' node count,
        restarts, eligible and submit time and pending reason. (`parse_record` lets a later
        ` Key=value` win, and the job's comment, command and paths come after Slurm's fields: a
        comment holding ` BatchHost=n2` would otherwise read as the job's batch host.) None when
        Slurm does not know the job; SlurmError when squeue does not list what scontrol did."""
        record = self.job(job_id)
        if record is None:
            return None
        row, facts = self.job_row(job_id), self.job_facts(job_id)
        if row is None or facts is None:
            raise SlurmError(f"squeue does not list job {job_id}, which scontrol shows: cannot read its "
                             "state, nodes and restarts from fields no user writes")
        return {**record, **row, **facts}

    def job_detail(self, job_id: int) -> str:
        """`scontrol show job -d -o`: the record with its per-node resources (GRES indexes)."""
        return self.run(["scontrol", "show", "job", "-d", "-o", str(job_id)]).stdout

    def step_nodes(self, job_id: int, step_id: int, array: tuple[str, str] | None = None) -> str | None:
        """The nodes of one step of a job (a hostlist), from squeue's step list: `scontrol show step`
        prints the step's name, which its user chooses, after its NodeList, and a name holding
        ` NodeList=n1` would read as Slurm's. squeue names a step of an array's task
        ARRAYJOB_TASK.STEP: `array` is the job's (ArrayJobId, ArrayTaskId) of `job_facts`. None when
        Slurm lists no such step, or lists it more than once."""
        argv = ["squeue", "-h", "-s", "-j", str(int(job_id)), "-o", "%i|%N"]
        proc = self.run(argv, check=False)
        wanted = {f"{int(job_id)}.{int(step_id)}"}
        if array is not None and _DIGITS.fullmatch(array[0]) and _DIGITS.fullmatch(array[1]):
            wanted.add(f"{array[0]}_{array[1]}.{int(step_id)}")
        found = []
        for line in proc.stdout.splitlines() if proc.returncode == 0 else []:
            step, sep, nodes = line.strip().partition("|")
            if sep and step in wanted and _TABLE_FIELDS["NodeList"].fullmatch(nodes):
                found.append(nodes)
        return found[0] if len(found) == 1 else None

    def step(self, job_id: int, step_id: int) -> dict[str, str] | None:
        proc = self.run(["scontrol", "show", "step", "-o", f"{job_id}.{step_id}"], check=False)
        records = parse_records(proc.stdout) if proc.returncode == 0 else []
        return records[0] if records else None

    def job(self, job_id: int) -> dict[str, str] | None:
        jobs = self.jobs(job_id)
        return jobs[0] if jobs else None

    def preempting(self) -> set[int]:
        """The running jobs Slurm is preempting now (`parse_preempting`)."""
        return parse_preempting(self.run(preempting_argv()).stdout)

    def preempt_time(self, job_id: int, timeout: float = 5.0) -> float | None:
        """When Slurm began preempting the job (Unix time), None when it is not being preempted.
        Read alone (squeue's PreemptTime): a line of scontrol's would carry the job's name and
        comment, which its user writes, and which could hold a ` PreemptTime=` of their own. Within
        `timeout`: a checkpoint asks just before its dump."""
        proc = self.run(preempt_time_argv(job_id), check=False, timeout=timeout)
        if proc.returncode != 0:
            if is_invalid_job(proc.stderr):
                return None
            raise SlurmCommandFailed(preempt_time_argv(job_id), proc.returncode, proc.stderr)
        return parse_time(proc.stdout.strip())

    def partitions(self) -> dict[str, dict[str, str]]:
        records = parse_records(self.run(["scontrol", "show", "partition", "-o"]).stdout)
        return {r["PartitionName"]: r for r in records if "PartitionName" in r}

    def nodes(self, names: Iterable[str] = ()) -> dict[str, dict[str, str]]:
        """Every node's record, or those of `names`."""
        wanted = ",".join(names)
        argv = ["scontrol", "show", "node", "-o", *([wanted] if wanted else [])]
        records = parse_records(self.run(argv).stdout)
        return {r["NodeName"]: r for r in records if "NodeName" in r}

    def submit(self, script: str, options: Iterable[str] = (), user: str | None = None,
               cwd: str | None = None) -> int:
        argv = sbatch_argv(script, list(options))
        if cwd:
            argv = ["env", "-C", cwd, *argv]
        return parse_sbatch_parsable(self.run(argv, user=user).stdout)

    def requeue(self, job_id: int) -> bool:
        """Requeue; False when Slurm already did it (newer releases requeue preempted jobs)."""
        proc = self.run(requeue_argv(job_id), check=False)
        if proc.returncode == 0:
            return True
        if is_already_requeued(proc.stderr):
            return False
        raise SlurmCommandFailed(requeue_argv(job_id), proc.returncode, proc.stderr)

    def release_start(self, job_id: int) -> None:
        self.run(release_start_argv(job_id))
