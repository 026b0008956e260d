"""`singularityctl admin check`: does this cluster have everything Singularity needs?

`gather` collects facts from the live system (thin shell); `evaluate` turns facts into PASS/FAIL
lines (pure, unit-tested), each FAIL naming the key and the fix.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from singularity_slurm.config import TIERS, Config
from singularity_slurm.coordinator.registry import client as redis_client
from singularity_slurm.coordinator.registry import connect
from singularity_slurm.errors import SingularityError
from singularity_slurm.slurmcli import SlurmClient, SlurmVersion, parse_version

from . import policy

MIN_SLURM = SlurmVersion(22, 5)
MIN_CRIU = (4, 0)


@dataclass(frozen=True)
class Result:
    name: str
    ok: bool
    detail: str
    fix: str = ""

    def line(self) -> str:
        text = f"{'PASS' if self.ok else 'FAIL'}  {self.name}: {self.detail}"
        return text + (f"\n      fix: {self.fix}" if not self.ok and self.fix else "")


@dataclass
class Facts:
    slurm_version: SlurmVersion | None = None
    slurm_error: str = ""
    slurm_config: dict[str, str] = field(default_factory=dict)
    partitions: dict[str, dict[str, str]] = field(default_factory=dict)
    files: dict[str, str | None] = field(default_factory=dict)  # path -> content (None: missing)
    executables: dict[str, bool] = field(default_factory=dict)
    sbatch_help: str = ""
    criu_path: str | None = None
    criu_version: tuple[int, int] | None = None
    criu_check: str = ""
    criu_options: dict[str, bool] = field(default_factory=dict)  # the patches' options it knows
    kernel_tracks_writes: bool = False  # asynchronous write-protecting userfaultfd (Linux 6.7)
    pycriu: bool = False
    node_files: dict[str, bool] = field(default_factory=dict)  # "criu wrapper" -> exists
    redis_error: str | None = "not checked"
    redis_requires_auth: bool | None = None
    redis_eviction: str | None = None  # maxmemory-policy, where CONFIG GET answered


def _has_flag(value: str | None, flag: str) -> bool:
    return flag.lower() in [v.strip().lower() for v in (value or "").replace(";", ",").split(",")]


def _conf_dir(facts: Facts) -> Path:
    return Path(facts.slurm_config.get("SLURM_CONF", "/etc/slurm/slurm.conf")).parent


def evaluate(facts: Facts, config: Config) -> list[Result]:
    results: list[Result] = []
    add = results.append
    source = str(config.source or "built-in defaults")
    add(Result("config", True, f"Singularity configuration valid ({source})"))

    if facts.slurm_version is None:
        add(Result("slurm", False, f"cannot talk to Slurm: {facts.slurm_error}",
                   "start slurmctld (dev cluster: `singularityctl devcluster up`)"))
        return results
    version = facts.slurm_version
    add(Result("slurm version", version >= MIN_SLURM, f"Slurm {version}",
               f"Singularity needs Slurm >= {MIN_SLURM}"))

    conf = facts.slurm_config
    slurm_conf = conf.get("SLURM_CONF", "slurm.conf")

    def key(name: str, ok: bool, shown: str, fix: str) -> None:
        add(Result(f"slurm.conf {name}", ok, shown, f"{fix} in {slurm_conf}, then restart slurmctld"))

    preempt_type = conf.get("PreemptType", "")
    key("PreemptType", preempt_type == "preempt/partition_prio", f"PreemptType={preempt_type}",
        "set PreemptType=preempt/partition_prio")
    mode = conf.get("PreemptMode", "")
    key("PreemptMode", "REQUEUE" in mode.upper(), f"PreemptMode={mode}", "set PreemptMode=REQUEUE")
    requeue = conf.get("JobRequeue", "")
    key("JobRequeue", requeue == "1", f"JobRequeue={requeue}", "set JobRequeue=1")
    if version < SlurmVersion(23, 2):
        value = conf.get("SlurmctldParameters", "")
        key("SlurmctldParameters", _has_flag(value, "preempt_send_user_signal"),
            f"SlurmctldParameters={value or '(unset)'}",
            "add preempt_send_user_signal to SlurmctldParameters (so preemption sends the job's "
            "warning signal to the launcher, which checkpoints the job)")
    else:
        value = conf.get("PreemptParameters", "")
        key("PreemptParameters", _has_flag(value, "send_user_signal"),
            f"PreemptParameters={value or '(unset)'}",
            "add send_user_signal to PreemptParameters (so preemption sends the job's warning "
            "signal to the launcher, which checkpoints the job)")
    bin_dir = config.paths.prefix / "venv" / "bin"
    for name, program in (("Prolog", "singularity-prolog"), ("Epilog", "singularity-epilog")):
        value = conf.get(name, "")
        wanted = str(bin_dir / program)
        ok = value == wanted and facts.executables.get(wanted, False)
        shown = f"{name}={value or '(unset)'}" + ("" if facts.executables.get(value) else
                                                   " (not an executable file)" if value else "")
        key(name, ok, shown, f"set {name}={wanted} (install the project there: `make install`)")
    flags = conf.get("PrologFlags", "")
    key("PrologFlags", _has_flag(flags, "Alloc") and _has_flag(flags, "Contain"),
        f"PrologFlags={flags or '(unset)'}",
        "set PrologFlags=Alloc,Contain (services must run on every node at allocation, and the job's "
        "extern step holds the processes the node agent starts)")
    proctrack = conf.get("ProctrackType", "")
    key("ProctrackType", proctrack == "proctrack/cgroup", f"ProctrackType={proctrack or '(unset)'}",
        "set ProctrackType=proctrack/cgroup (and TaskPlugin=task/cgroup with a cgroup.conf): Slurm then "
        "tracks, limits and ends the job's processes, even if a node agent dies")
    submit = conf.get("JobSubmitPlugins", "")
    key("JobSubmitPlugins", "lua" in submit, f"JobSubmitPlugins={submit or '(unset)'}",
        "set JobSubmitPlugins=lua")
    cli = conf.get("CliFilterPlugins", "")
    key("CliFilterPlugins", "lua" in cli, f"CliFilterPlugins={cli or '(unset)'}",
        "set CliFilterPlugins=lua")

    ranks = []
    for tier in TIERS:
        partition = config.tiers[tier].partition
        part = facts.partitions.get(partition)
        name = f"partition {partition} (tier {tier})"
        if part is None:
            add(Result(name, False, "missing",
                       f"add PartitionName={partition} to {slurm_conf} (see the admin guide)"))
            continue
        ranks.append(int(part.get("PriorityTier", "0") or 0))
        part_mode = part.get("PreemptMode", "")
        grace = int((part.get("GraceTime") or "0").split()[0] or 0)
        ok = "REQUEUE" in part_mode.upper()
        if tier == "premium":
            add(Result(name, True, f"PriorityTier={part.get('PriorityTier')} PreemptMode={part_mode}"))
            continue
        add(Result(f"{name} PreemptMode", ok, f"PreemptMode={part_mode}",
                   f"set PreemptMode=REQUEUE on PartitionName={partition} in {slurm_conf}, "
                   "then `scontrol reconfigure`"))
        add(Result(f"{name} GraceTime", grace >= config.preemption.warn_time,
                   f"GraceTime={grace}s, warning signal {config.preemption.warn_time}s before the kill",
                   f"set GraceTime>={config.preemption.warn_time} on PartitionName={partition} "
                   "(time to checkpoint before Slurm kills the job)"))
    if len(ranks) == len(TIERS):
        add(Result("tier priorities", ranks[0] > ranks[1] > ranks[2],
                   "PriorityTier premium > standard > basic" if ranks[0] > ranks[1] > ranks[2]
                   else f"PriorityTier premium={ranks[0]} standard={ranks[1]} basic={ranks[2]}",
                   "give higher tiers a higher PriorityTier so they preempt lower ones"))

    conf_dir = _conf_dir(facts)
    slurm_user_uid = policy.slurm_user_uid_of_shown(conf.get("SlurmUser", "root(0)")) or 0
    for name, rendered in (("job_submit.lua", policy.render_job_submit(config, slurm_user_uid)),
                           ("cli_filter.lua", policy.render_cli_filter(config))):
        path = str(conf_dir / name)
        content = facts.files.get(path)
        add(Result(name, content == rendered,
                   f"{path} " + ("matches the configuration" if content == rendered else
                                 "missing" if content is None else "differs from the configuration"),
                   "run `singularityctl admin install-policy`"))
    plugstack = conf.get("PlugStackConfig") or str(conf_dir / "plugstack.conf")
    library = str(policy.spank_library_path(config))
    stack_text = "".join(v or "" for k, v in facts.files.items()
                         if k == plugstack or k.startswith(str(Path(plugstack).parent / "plugstack.conf.d")))
    wired = library in stack_text and facts.executables.get(library, False)
    add(Result("SPANK plugin", wired and "--singularity-sla" in facts.sbatch_help,
               f"{library} " + ("loaded, `sbatch --help` lists --singularity-sla" if wired and
                                "--singularity-sla" in facts.sbatch_help else
                                "not wired into " + plugstack if not wired else
                                "wired but `sbatch --help` does not list --singularity-sla"),
               "run `singularityctl admin install-policy`"))

    if facts.criu_path is None:
        add(Result("criu", False, "criu not found",
                   "install CRIU >= 4.0 (dev cluster: `singularityctl devcluster up` bundles it)"))
    else:
        ok = facts.criu_version is not None and facts.criu_version >= MIN_CRIU
        shown = ".".join(map(str, facts.criu_version)) if facts.criu_version else "unknown"
        add(Result("criu version", ok, f"{facts.criu_path}: {shown}",
                   "CRIU >= 4.0 is needed (Debian 12's 3.17 fails on current kernels)"))
        add(Result("criu check", "Looks good" in facts.criu_check,
                   facts.criu_check.strip().splitlines()[-1] if facts.criu_check.strip() else "no output",
                   f"run `{facts.criu_path} check` as root and fix what it reports"))
        lacking = sorted(o for o, known in facts.criu_options.items() if not known)
        add(Result("criu patches", bool(facts.criu_options) and not lacking,
                   "knows --" + ", --".join(sorted(facts.criu_options)) if not lacking else
                   "lacks --" + ", --".join(lacking) + ": forked processes' shared memory is dumped once "
                   "per process, and every dump reads every page",
                   "install the criu the installer builds from Debian's source with "
                   "checkpoint/criu_patches (`singularityctl devcluster up` on a dev cluster)"))
        add(Result("dirty tracking", facts.kernel_tracks_writes,
                   "userfaultfd write-protect (asynchronous) and PAGEMAP_SCAN: a dump after a periodic "
                   "one reads only the pages written since" if facts.kernel_tracks_writes else
                   "this kernel has no asynchronous write-protecting userfaultfd: every dump reads and "
                   "stores every page",
                   "run Linux 6.7 or newer built with CONFIG_USERFAULTFD and CONFIG_PTE_MARKER_UFFD_WP"))
    for name, present in sorted(facts.node_files.items()):
        add(Result(name, present, "present" if present else "missing",
                   "run `singularityctl admin install-node` on the compute nodes"))
    add(Result("pycriu", facts.pycriu, "importable" if facts.pycriu else "not importable",
               "install pycriu (Debian's python3-pycriu) into the project's venv"))
    if facts.redis_error:
        add(Result("redis", False, facts.redis_error,
                   f"start Redis and check {config.redis.password_file}"))
    else:
        add(Result("redis", True, f"{config.redis.address} answers"))
        add(Result("redis auth", bool(facts.redis_requires_auth),
                   "refuses unauthenticated clients" if facts.redis_requires_auth
                   else "accepts clients without a password",
                   "set requirepass in redis.conf and put the password in "
                   f"{config.redis.password_file}"))
        add(eviction_result(facts.redis_eviction))
    return results


def eviction_result(policy: str | None) -> Result:
    """Redis must never evict a key to make room: the registry, the checkpoint index and the
    rendezvous records are not a cache (a full Redis refuses writes instead, which the components
    meet as they meet a Redis outage)."""
    if policy is None:
        return Result("redis eviction", True, "CONFIG GET is not allowed here: make sure redis.conf has "
                      "maxmemory-policy noeviction")
    return Result("redis eviction", policy == "noeviction", f"maxmemory-policy {policy}"
                  + ("" if policy == "noeviction" else ": Redis may drop registry and checkpoint index keys"),
                  "set maxmemory-policy noeviction in redis.conf")


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def find_criu(config: Config) -> str | None:
    bundled = config.paths.prefix / "criu" / "bin" / "criu"
    if bundled.exists():
        return str(bundled)
    return shutil.which("criu") or next(
        (p for p in ("/usr/sbin/criu", "/sbin/criu") if os.path.exists(p)), None)


def gather(config: Config, slurm: SlurmClient) -> Facts:
    facts = Facts()
    try:
        facts.slurm_version = slurm.version()
        facts.slurm_config = slurm.config()
        facts.partitions = slurm.partitions()
    except SingularityError as exc:
        facts.slurm_version = None
        facts.slurm_error = str(exc)
        return facts
    conf_dir = _conf_dir(facts)
    plugstack = Path(facts.slurm_config.get("PlugStackConfig") or conf_dir / "plugstack.conf")
    paths = [conf_dir / "job_submit.lua", conf_dir / "cli_filter.lua", plugstack]
    dropins = plugstack.parent / "plugstack.conf.d"
    if dropins.is_dir():
        paths += sorted(dropins.glob("*.conf"))
    for path in paths:
        facts.files[str(path)] = _read(path)
    for candidate in [facts.slurm_config.get("Prolog", ""), facts.slurm_config.get("Epilog", ""),
                      str(config.paths.prefix / "venv" / "bin" / "singularity-prolog"),
                      str(config.paths.prefix / "venv" / "bin" / "singularity-epilog"),
                      str(policy.spank_library_path(config))]:
        if candidate:
            facts.executables[candidate] = os.path.isfile(candidate) and os.access(candidate, os.X_OK)
    help_proc = subprocess.run(["sbatch", "--help"], capture_output=True, text=True)
    facts.sbatch_help = help_proc.stdout + help_proc.stderr
    facts.criu_path = find_criu(config)
    if facts.criu_path:
        proc = subprocess.run([facts.criu_path, "--version"], capture_output=True, text=True)
        try:
            version = parse_version(proc.stdout)
            facts.criu_version = (version.major, version.minor)
        except SingularityError:
            facts.criu_version = None
        check = subprocess.run([facts.criu_path, "check"], capture_output=True, text=True)
        facts.criu_check = check.stdout + check.stderr
        from singularity_slurm.checkpoint import criu

        facts.criu_options = {option: criu.supports(Path(facts.criu_path), option)
                              for option in criu.PATCHED_OPTIONS}
        facts.kernel_tracks_writes = criu.kernel_tracks_writes()
    facts.pycriu = importlib.util.find_spec("pycriu") is not None
    from singularity_slurm.checkpoint.criu import filelog_shim_path, wrapper_path

    facts.node_files = {
        "criu wrapper": os.access(wrapper_path(config.paths.prefix), os.X_OK),
        "file-log shim": filelog_shim_path(config.paths.prefix).is_file(),
    }
    try:
        connect(config.redis, timeout=3)
        facts.redis_error = None
        import redis

        facts.redis_eviction = _eviction_policy(config)
        try:
            redis_client(config.redis, timeout=3, authenticate=False).ping()
            facts.redis_requires_auth = False
        except redis.AuthenticationError:
            facts.redis_requires_auth = True
        except redis.ResponseError as exc:
            facts.redis_requires_auth = "NOAUTH" in str(exc)
    except SingularityError as exc:
        facts.redis_error = str(exc)
    return facts


def _eviction_policy(config: Config) -> str | None:
    import redis

    try:
        answer = connect(config.redis, timeout=3).config_get("maxmemory-policy")
    except (redis.RedisError, SingularityError):
        return None  # CONFIG renamed or refused to this user
    return answer.get("maxmemory-policy") if isinstance(answer, dict) else None


def results_json(results: list[Result]) -> list[dict[str, Any]]:
    return [{"name": r.name, "ok": r.ok, "detail": r.detail, "fix": r.fix} for r in results]
