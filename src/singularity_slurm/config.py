"""Admin configuration: one TOML file, parsed once into frozen dataclasses.

Every key, its default and its meaning is listed in `KEYS` (and in contrib/config/config.toml, the
documented example). Unknown keys and bad values are refused with the valid choices named, so a typo
never silently falls back to a default.
"""

from __future__ import annotations

import os
import re
import signal
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError

DEFAULT_CONFIG_PATH = Path("/etc/singularity-slurm/config.toml")
CONFIG_ENV = "SINGULARITY_CONFIG"

TIERS = ("premium", "standard", "basic")
"""The SLA tiers, highest first. Their names are part of the user interface (`--singularity-sla`)."""

SLA_TARGETS = {"premium": 0.95, "standard": 0.70, "basic": 0.0}
"""Minimum GPU-time fraction T_ideal/T_real per hour each tier promises (basic: best effort)."""


@dataclass(frozen=True)
class TierConfig:
    name: str
    partition: str
    checkpoint_interval_min: int  # 0 = no periodic checkpoints

    @property
    def sla_target(self) -> float:
        return SLA_TARGETS[self.name]


@dataclass(frozen=True)
class PreemptionConfig:
    signal: str  # name without the SIG prefix, as Slurm's --signal takes it
    warn_time: int  # seconds between the warning signal and the kill
    concurrent_dumps: int = 2  # checkpoints one node dumps and stores at once; 0: no limit
    freeze_waiting: bool = True  # a stopping tree is frozen while it waits for a dump slot
    stream_pages: str = "stopping"  # which dumps send their pages straight into the store

    def streams(self, stop: bool) -> bool:
        """Whether a dump's pages go from criu straight into the store (checkpoint.pagestream)
        rather than through an image folder in the spool: a stopping dump's by default, as its job
        waits for the store anyway; a periodic dump's tree runs again once its images are in the
        spool, and would stay frozen while they are stored."""
        return self.stream_pages == "always" or (self.stream_pages == "stopping" and stop)

    @property
    def sbatch_signal(self) -> str:
        """The `--signal` value the policy adds: to the job's steps, `warn_time` before the end.

        Not `B:` (the batch shell): a shell that is not the launcher dies of it. Without `B:` Slurm
        signals every job step and never the batch script, and the launcher runs as a step.
        """
        return f"{self.signal}@{self.warn_time}"


@dataclass(frozen=True)
class RedisConfig:
    host: str
    port: int
    db: int
    password_file: Path
    # a unix socket of a Redis on this host, reached instead of host:port: its file permissions keep
    # those who may not use Redis from holding connections to it at all
    socket: Path | None = None

    @property
    def address(self) -> str:
        """Where Redis is, as messages name it."""
        return f"unix:{self.socket}" if self.socket else f"{self.host}:{self.port}"

    def password(self) -> str | None:
        """The password, or None when the file does not exist (a Redis without auth)."""
        try:
            return self.password_file.read_text().strip() or None
        except FileNotFoundError:
            return None
        except PermissionError as exc:
            raise ConfigError(
                f"cannot read the Redis password file {self.password_file}: permission denied; "
                "run as root or ask the admin for read access"
            ) from exc


@dataclass(frozen=True)
class PathsConfig:
    state_dir: Path  # node-local state: pid files, sockets (one sub-folder per node and job)
    store_root: Path  # shared checkpoint store
    prefix: Path  # install prefix: venv, criu, SPANK plugin
    # node-local folder of the jobs' file-logs (written by the jobs: on disk, not on the tmpfs /run)
    filelog_dir: Path = Path("/var/lib/singularity-slurm/filelog")
    # node-local folder of the images being dumped or restored (root's; on disk, with room for a
    # job's memory: not the RAM-backed /run)
    spool_dir: Path = Path("/var/spool/singularity-slurm")


@dataclass(frozen=True)
class ProxyConfig:
    # device backend of a GPU's proxy: auto (cuda where NVML sees the job's GPUs, host otherwise),
    # cuda (staged through host memory, turns on a shared GPU) or host; CPU slots are always host
    backend: str = "auto"
    cpu_slots: int = 1  # proxies on a node where the job has no GPU
    cut_timeout: int = 60  # seconds a checkpoint waits for the distributed cut before giving up
    max_region_mib: int = 4096  # largest shared-memory region one rank may ask its proxy for
    max_rank_connections: int = 4  # connections one rank may hold to its proxy at once
    time_slicing: str = "auto"  # ranks sharing a device: auto (turns on a GPU), turns, concurrent
    turn_lapse_s: int = 10  # a turn held this long without a collective lets the waiters run
    shared_memory: bool = True  # proxies of one host reduce straight from each other's regions
    gpu_swap: str = "auto"  # ranks taking turns on a GPU: waiting ranks' memory to host (auto|always|never)
    gpu_swap_reserve_mib: int = 1024  # GPU memory kept free beyond what the next rank needs (auto)
    gpu_buffers: bool = True  # ranks' allreduces of CUDA tensors through GPU buffers the proxy shares

    @property
    def max_region_bytes(self) -> int:
        return self.max_region_mib << 20

    @property
    def gpu_swap_reserve_bytes(self) -> int:
        return self.gpu_swap_reserve_mib << 20


@dataclass(frozen=True)
class LocalFilesConfig:
    """Bounds on the node-local files (and the file-log) a checkpoint carries."""

    max_files: int = 1000  # files listed in the file-log that are carried; the rest are not
    max_bytes: int = 1 << 30  # their total size; a file that would pass it is not carried
    max_log_bytes: int = 16 << 20  # the file-log itself; only its first max_log_bytes are read


@dataclass(frozen=True)
class StoreConfig:
    """How long the store keeps what no live job needs."""

    retention_min: int = 1440  # after a job ends for good, its checkpoints stay this long (0: deleted then)
    orphan_age_min: int = 10080  # a job folder Slurm no longer knows, unchanged this long, is collected

    @property
    def retention_s(self) -> float:
        return self.retention_min * 60.0

    @property
    def orphan_age_s(self) -> float:
        return self.orphan_age_min * 60.0


@dataclass(frozen=True)
class ElasticConfig:
    """How jobs move between nodes on their own."""

    drain_poll_s: int = 30  # how often a job looks whether an admin drains one of its nodes (0: never)
    max_ranks_per_device: int = 4  # ranks of a distributed job that may share one device
    replica_mmap_threshold: int = 131072  # glibc's mmap threshold in each rank (0: glibc's dynamic one)


@dataclass(frozen=True)
class GpuConfig:
    """Checkpoints of jobs whose processes hold GPU state (the CUDA driver's checkpoint API)."""

    # mounts a tree's namespace inherits that criu cannot dump and that every node has at the same
    # path: recorded by key, bound from the restoring host (the NVIDIA driver's folder in containers)
    external_mounts: tuple[str, ...] = ("/usr/local/nvidia",)
    lock_timeout_s: int = 60  # how long the driver may wait for a process's CUDA calls to finish
    # a checkpoint whose GPU state this node's GPUs cannot take (another type, an unhealthy GPU):
    # wait (requeue the job away from the node, its checkpoints kept) or restart (from the beginning)
    on_mismatch: str = "wait"


@dataclass(frozen=True)
class SlaConfig:
    """How the SLA tiers' guarantees are measured."""

    window_s: int = 3600  # the accounting window: each tier's GPU fraction is met (or not) per window
    protect_nodes: bool = True  # an acting controller reserves a protected running job's nodes (sla.reserve)


TIME_SLICING = ("auto", "turns", "concurrent")
"""The values of `proxy.time_slicing` (`singularity_slurm.proxy.turns.Slicing`)."""

GPU_SWAP = ("auto", "always", "never")
"""The values of `proxy.gpu_swap` (`singularity_slurm.proxy.swap.SwapMode`)."""

PROXY_BACKENDS = ("auto", "cuda", "host")
"""The values of `proxy.backend`: auto is cuda for a GPU NVML sees, host otherwise."""

MAX_MMAP_THRESHOLD = 32 << 20
"""glibc's largest mmap threshold on 64-bit systems (HEAP_MAX_SIZE / 2); it ignores larger values."""


@dataclass(frozen=True)
class TestingConfig:
    faults: bool = False  # fault points of checkpoint and restore may be armed (singularity_slurm.faults)


@dataclass(frozen=True)
class AdminConfig:
    operators: tuple[str, ...] = ()  # user names that may checkpoint and migrate any job, like root

    def is_admin(self, uid: int, user: str | None) -> bool:
        """Root, or a user named in `operators` (the name of the caller's uid, from the passwd database)."""
        return uid == 0 or (user is not None and user in self.operators)


@dataclass(frozen=True)
class Config:
    default_tier: str
    tiers: dict[str, TierConfig]
    preemption: PreemptionConfig
    redis: RedisConfig
    paths: PathsConfig
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    local_files: LocalFilesConfig = field(default_factory=LocalFilesConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    sla: SlaConfig = field(default_factory=SlaConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    testing: TestingConfig = field(default_factory=TestingConfig)
    source: Path | None = field(default=None, compare=False)

    def tier(self, name: str) -> TierConfig:
        try:
            return self.tiers[name]
        except KeyError:
            raise ConfigError(
                f"unknown SLA tier {name!r}; valid tiers: {', '.join(TIERS)}"
            ) from None

    def tier_of_partition(self, partition: str | None) -> str | None:
        """The tier whose partition is `partition`, or None for a partition we do not manage."""
        for tier in self.tiers.values():
            if tier.partition == partition:
                return tier.name
        return None


# key -> (default, type, help). Sections are the part before the dot; tier keys repeat per tier.
KEYS: dict[str, tuple[Any, type, str]] = {
    "tiers.default": ("basic", str, "tier of jobs submitted without --singularity-sla"),
    "tiers.<tier>.partition": (None, str, "Slurm partition that runs the tier (default: its name)"),
    "tiers.<tier>.checkpoint_interval_min": (
        None, int, "minutes between periodic checkpoints, 0 = off (premium 0, standard 60, basic 30)"),
    "preemption.signal": ("URG", str, "warning signal sent to the job's steps (the launcher) before "
                                      "preemption; one the job's processes ignore by default (URG)"),
    "preemption.warn_time": (60, int, "seconds between the warning signal and the kill; keep <= GraceTime"),
    "preemption.concurrent_dumps": (PreemptionConfig.concurrent_dumps, int,
                                    "checkpoints one node dumps and stores at once (0..1024, 0 = no limit); "
                                    "the others wait, earliest kill first (see node/dumpgate.py)"),
    "preemption.freeze_waiting": (PreemptionConfig.freeze_waiting, bool,
                                  "a stopping checkpoint's tree is frozen (cgroup freezer) while it waits "
                                  "for a dump slot, leaving the node's cores to the dumps due first"),
    "preemption.stream_pages": (PreemptionConfig.stream_pages, str,
                                "which dumps send their pages from criu straight into the store, hashed "
                                "once, with no pages image written to spool_dir and read back: stopping "
                                "(the preemption's, whose job waits for its store anyway), always (periodic "
                                "ones too: their trees stay frozen until their pages are stored) or never"),
    "redis.host": ("127.0.0.1", str, "Redis host of the coordinator"),
    "redis.port": (6379, int, "Redis port"),
    "redis.db": (0, int, "Redis database number"),
    "redis.password_file": ("/etc/singularity-slurm/redis.password", str,
                            "file holding the Redis password (root-readable)"),
    "redis.socket": ("", str, "unix socket of a Redis on the same host, used instead of host:port "
                              "(its permissions keep other users from connecting at all); empty: TCP"),
    "paths.state_dir": ("/run/singularity-slurm", str, "node-local state (pid files, sockets)"),
    "paths.store_root": ("/var/lib/singularity-slurm/store", str, "shared checkpoint store"),
    "paths.prefix": ("/opt/singularity-slurm", str, "install prefix (venv, criu, SPANK plugin)"),
    "paths.filelog_dir": ("/var/lib/singularity-slurm/filelog", str,
                          "node-local folder of the jobs' file-logs (jobs write there: keep it off /run)"),
    "paths.spool_dir": ("/var/spool/singularity-slurm", str,
                        "node-local folder of the checkpoint images being dumped or restored (root's; a "
                        "disk file system with room for a job's memory, not /run)"),
    "proxy.backend": ("auto", str, "device backend of a GPU's proxy: auto (cuda where NVML sees the "
                      "job's GPUs), cuda or host; CPU slots use host"),
    "proxy.cpu_slots": (1, int, "device proxies per node for a job without GPUs"),
    "proxy.cut_timeout": (60, int, "seconds a checkpoint waits for the distributed cut; keep < warn_time"),
    "proxy.max_region_mib": (4096, int, "largest shared-memory region (MiB) a rank may map from its proxy: "
                                        "the most data one collective call moves (1..1048576)"),
    "proxy.max_rank_connections": (4, int, "connections one rank may hold to its proxy at once (1..64); "
                                           "a proxy serves at most this many per rank it serves"),
    "proxy.time_slicing": ("auto", str, "how ranks that share a device run: turns (one at a time, handing "
                                        "the device on at every collective), concurrent (all at once), or "
                                        "auto (turns on a GPU, concurrent on CPU slots)"),
    "proxy.turn_lapse_s": (10, int, "seconds a rank may hold its device's turn without reaching a collective "
                                    "before the ranks waiting for it run beside it (1..3600): a rank that "
                                    "waits for another of its device outside collectives would hang them"),
    "proxy.shared_memory": (True, bool, "proxies of one host reduce straight from each other's shared "
                            "regions instead of sending the data over the mesh (they open them through "
                            "/proc/PID/fd: root in one PID namespace)"),
    "proxy.gpu_swap": ("auto", str, "ranks taking turns on a GPU: a waiting rank's GPU memory moves to "
                                    "host memory (the CUDA driver's checkpoint API) when the next rank "
                                    "would not fit (auto), at every turn (always), or never"),
    "proxy.gpu_swap_reserve_mib": (1024, int, "GPU memory (MiB) gpu_swap = auto keeps free beyond what the "
                                              "next rank needs (0..1048576)"),
    "proxy.gpu_buffers": (True, bool, "a GPU's proxy gives each rank a buffer in the GPU's memory, through "
                                      "which its allreduces of CUDA tensors go (reduced on the GPU where the "
                                      "communicator is on one GPU); false: through host memory"),
    "local_files.max_files": (LocalFilesConfig.max_files, int,
                              "node-local files (from the job's file-log) a checkpoint carries at most"),
    "local_files.max_bytes": (LocalFilesConfig.max_bytes, int,
                              "total bytes of node-local files a checkpoint carries at most"),
    "local_files.max_log_bytes": (LocalFilesConfig.max_log_bytes, int,
                                  "bytes of the job's file-log that are read at a checkpoint"),
    "store.retention_min": (StoreConfig.retention_min, int,
                            "minutes a job's checkpoints are kept after it ended for good (completed, "
                            "cancelled, failed without requeue); 0 = deleted when it ends"),
    "store.orphan_age_min": (StoreConfig.orphan_age_min, int,
                             "minutes after which a job folder in the store that Slurm no longer knows and "
                             "nothing changed is collected"),
    "elastic.drain_poll_s": (ElasticConfig.drain_poll_s, int,
                             "seconds between a running job's looks at its nodes' state: a node an admin "
                             "drains (scontrol update State=DRAIN) has its Singularity jobs checkpointed and "
                             "requeued elsewhere; 0 = never"),
    "elastic.max_ranks_per_device": (ElasticConfig.max_ranks_per_device, int,
                                     "ranks of a --world-size job that may share one device "
                                     "when it runs on fewer devices than ranks; a start, restore or resize "
                                     "that would put more on a device is refused"),
    "elastic.replica_mmap_threshold": (ElasticConfig.replica_mmap_threshold, int,
                                       "bytes from which glibc gives each rank of a --world-size job an "
                                       "allocation a mapping of its own (MALLOC_MMAP_THRESHOLD_, unless "
                                       "the job sets it): every large tensor of the replicas then starts "
                                       "at the same place in its page, and their checkpoints deduplicate "
                                       "page by page; 0 = glibc's dynamic threshold (each rank's "
                                       "allocation history places its tensors)"),
    "sla.window_s": (SlaConfig.window_s, int,
                     "seconds of each SLA accounting window (10..86400): a job's GPU fraction (devices "
                     "held usefully / devices of its allocation) is measured, and its tier's floor met "
                     "or missed, window by window from its first eligibility"),
    "sla.protect_nodes": (SlaConfig.protect_nodes, bool,
                          "while the SLA controller (with --actuate) protects a running job, it keeps a "
                          "reservation of the job's nodes for root (singularity_protect_<job>, ending a few "
                          "of its periods ahead and extended every look), so Slurm's own preemption cannot "
                          "take them for another job; the nodes' other devices stay closed meanwhile. "
                          "false: protection only keeps the controller from shrinking the job"),
    "gpu.external_mounts": (list(GpuConfig.external_mounts), list,
                            "mounts criu records by path, not content, and a restore binds from the node "
                            "(the driver's folder where a container runtime mounts it)"),
    "gpu.lock_timeout_s": (GpuConfig.lock_timeout_s, int,
                           "seconds the CUDA driver may take to stop a process's GPU work at a checkpoint"),
    "gpu.on_mismatch": (GpuConfig.on_mismatch, str,
                        "a checkpoint whose GPU state the node's GPUs cannot take (another type, an "
                        "unhealthy GPU): wait (the job is requeued away from such nodes and keeps its "
                        "checkpoints) or restart (it starts from the beginning)"),
    "testing.faults": (False, bool, "let tests arm fault points of checkpoint and restore (a file in "
                       "<state_dir>/faults/ makes a step fail or kill its process); never on a production "
                       "cluster"),
    "admin.operators": ([], list, "user names that may checkpoint and migrate any user's job, like root "
                        "(they need read access to redis.password_file)"),
}

STREAM_PAGES = ("stopping", "always", "never")
_INTERVAL_DEFAULTS = {"premium": 0, "standard": 60, "basic": 30}
_SECTIONS = {"tiers", "preemption", "redis", "paths", "proxy", "admin", "local_files", "store", "elastic",
             "sla", "gpu", "testing"}
_TIER_KEYS = {"partition", "checkpoint_interval_min"}
_USER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*\$?")
"""A POSIX user name (as useradd accepts it); `root` needs no entry."""


def _valid(keys: set[str] | list[str]) -> str:
    return ", ".join(sorted(keys))


def _take(section: dict[str, Any], name: str, where: str, typ: type, default: Any) -> Any:
    value = section.get(name, default)
    if typ is int and isinstance(value, bool) or not isinstance(value, typ):
        raise ConfigError(
            f"{where}.{name} must be {typ.__name__}, got {value!r} ({type(value).__name__})"
        )
    return value


def _check_keys(section: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = set(section) - allowed
    if unknown:
        raise ConfigError(
            f"unknown key(s) in [{where}]: {_valid(unknown)}; valid keys: {_valid(allowed)}"
        )


def parse(data: dict[str, Any], source: Path | None = None) -> Config:
    """Validate a parsed TOML document and build the frozen configuration."""
    _check_keys(data, _SECTIONS, "top level")
    for name in _SECTIONS:
        if not isinstance(data.get(name, {}), dict):
            raise ConfigError(f"[{name}] must be a table")

    tiers_raw = dict(data.get("tiers", {}))
    _check_keys(tiers_raw, {"default", *TIERS}, "tiers")
    default_tier = _take(tiers_raw, "default", "tiers", str, KEYS["tiers.default"][0])
    if default_tier not in TIERS:
        raise ConfigError(
            f"tiers.default = {default_tier!r} is not a tier; valid tiers: {', '.join(TIERS)}"
        )
    tiers: dict[str, TierConfig] = {}
    for name in TIERS:
        raw = tiers_raw.get(name, {})
        if not isinstance(raw, dict):
            raise ConfigError(f"[tiers.{name}] must be a table")
        _check_keys(raw, _TIER_KEYS, f"tiers.{name}")
        interval = _take(raw, "checkpoint_interval_min", f"tiers.{name}", int,
                         _INTERVAL_DEFAULTS[name])
        if interval < 0:
            raise ConfigError(f"tiers.{name}.checkpoint_interval_min must be >= 0, got {interval}")
        tiers[name] = TierConfig(
            name=name,
            partition=_take(raw, "partition", f"tiers.{name}", str, name),
            checkpoint_interval_min=interval,
        )
    partitions = [t.partition for t in tiers.values()]
    if len(set(partitions)) != len(partitions):
        raise ConfigError(
            f"each tier needs its own partition, got {dict((t.name, t.partition) for t in tiers.values())}"
        )

    pre_raw = data.get("preemption", {})
    _check_keys(pre_raw, {"signal", "warn_time", "concurrent_dumps", "freeze_waiting", "stream_pages"},
                "preemption")
    sig = _take(pre_raw, "signal", "preemption", str, "URG").upper().removeprefix("SIG")
    if f"SIG{sig}" not in signal.Signals.__members__ or sig in {"KILL", "STOP"}:
        raise ConfigError(
            f"preemption.signal = {sig!r} is not a catchable signal name; use URG (the default), USR1, USR2 "
            "or TERM"
        )
    warn_time = _take(pre_raw, "warn_time", "preemption", int, 60)
    if not 1 <= warn_time <= 65535:
        raise ConfigError(f"preemption.warn_time must be 1..65535 seconds, got {warn_time}")
    concurrent_dumps = _take(pre_raw, "concurrent_dumps", "preemption", int,
                             PreemptionConfig.concurrent_dumps)
    if not 0 <= concurrent_dumps <= 1024:
        raise ConfigError(f"preemption.concurrent_dumps must be 0..1024 (0: no limit), "
                          f"got {concurrent_dumps}")
    freeze_waiting = _take(pre_raw, "freeze_waiting", "preemption", bool, PreemptionConfig.freeze_waiting)
    stream_pages = _take(pre_raw, "stream_pages", "preemption", str, PreemptionConfig.stream_pages)
    if stream_pages not in STREAM_PAGES:
        raise ConfigError(f"preemption.stream_pages must be one of {', '.join(STREAM_PAGES)}, "
                          f"got {stream_pages!r}")

    redis_raw = data.get("redis", {})
    _check_keys(redis_raw, {"host", "port", "db", "password_file", "socket"}, "redis")
    redis_socket = _take(redis_raw, "socket", "redis", str, "")
    if redis_socket and not redis_socket.startswith("/"):
        raise ConfigError(f"redis.socket must be an absolute path (or empty for TCP), got {redis_socket!r}")
    port = _take(redis_raw, "port", "redis", int, 6379)
    if not 1 <= port <= 65535:
        raise ConfigError(f"redis.port must be 1..65535, got {port}")

    paths_raw = data.get("paths", {})
    _check_keys(paths_raw, {"state_dir", "store_root", "prefix", "filelog_dir", "spool_dir"}, "paths")

    def path(key: str) -> Path:
        value = Path(_take(paths_raw, key, "paths", str, KEYS[f"paths.{key}"][0]))
        if not value.is_absolute():
            raise ConfigError(f"paths.{key} must be an absolute path, got {str(value)!r}")
        return value

    proxy_raw = data.get("proxy", {})
    _check_keys(proxy_raw, {"backend", "cpu_slots", "cut_timeout", "max_region_mib", "max_rank_connections",
                            "time_slicing", "turn_lapse_s", "shared_memory", "gpu_swap",
                            "gpu_swap_reserve_mib", "gpu_buffers"}, "proxy")
    proxy = ProxyConfig(backend=_take(proxy_raw, "backend", "proxy", str, "auto"),
                        cpu_slots=_take(proxy_raw, "cpu_slots", "proxy", int, 1),
                        cut_timeout=_take(proxy_raw, "cut_timeout", "proxy", int, 60),
                        max_region_mib=_take(proxy_raw, "max_region_mib", "proxy", int,
                                             KEYS["proxy.max_region_mib"][0]),
                        max_rank_connections=_take(proxy_raw, "max_rank_connections", "proxy", int,
                                                   KEYS["proxy.max_rank_connections"][0]),
                        time_slicing=_take(proxy_raw, "time_slicing", "proxy", str, "auto"),
                        turn_lapse_s=_take(proxy_raw, "turn_lapse_s", "proxy", int, 10),
                        shared_memory=_take(proxy_raw, "shared_memory", "proxy", bool, True),
                        gpu_swap=_take(proxy_raw, "gpu_swap", "proxy", str, "auto"),
                        gpu_swap_reserve_mib=_take(proxy_raw, "gpu_swap_reserve_mib", "proxy", int, 1024),
                        gpu_buffers=_take(proxy_raw, "gpu_buffers", "proxy", bool, True))
    if proxy.backend not in PROXY_BACKENDS:
        raise ConfigError(f"proxy.backend = {proxy.backend!r} is not available; valid backends: "
                          f"{', '.join(PROXY_BACKENDS)}")
    if not 1 <= proxy.cpu_slots <= 256:
        raise ConfigError(f"proxy.cpu_slots must be 1..256, got {proxy.cpu_slots}")
    if not 1 <= proxy.cut_timeout <= 3600:
        raise ConfigError(f"proxy.cut_timeout must be 1..3600 seconds, got {proxy.cut_timeout}")
    if not 1 <= proxy.max_region_mib <= 1 << 20:
        raise ConfigError(f"proxy.max_region_mib must be 1..1048576 MiB, got {proxy.max_region_mib}")
    if not 1 <= proxy.max_rank_connections <= 64:
        raise ConfigError(f"proxy.max_rank_connections must be 1..64, got {proxy.max_rank_connections}")
    if not 1 <= proxy.turn_lapse_s <= 3600:
        raise ConfigError(f"proxy.turn_lapse_s must be 1..3600 seconds, got {proxy.turn_lapse_s}")
    if proxy.time_slicing not in TIME_SLICING:
        raise ConfigError(f"proxy.time_slicing = {proxy.time_slicing!r} is not one of "
                          f"{', '.join(TIME_SLICING)}")
    if proxy.gpu_swap not in GPU_SWAP:
        raise ConfigError(f"proxy.gpu_swap = {proxy.gpu_swap!r} is not one of {', '.join(GPU_SWAP)}")
    if not 0 <= proxy.gpu_swap_reserve_mib <= 1 << 20:
        raise ConfigError(f"proxy.gpu_swap_reserve_mib must be 0..1048576 MiB, got "
                          f"{proxy.gpu_swap_reserve_mib}")

    admin_raw = data.get("admin", {})
    _check_keys(admin_raw, {"operators"}, "admin")
    operators = _take(admin_raw, "operators", "admin", list, KEYS["admin.operators"][0])
    for name in operators:
        if not isinstance(name, str) or not _USER_NAME.fullmatch(name):
            raise ConfigError(f"admin.operators must list user names, got {name!r}")

    local_raw = data.get("local_files", {})
    _check_keys(local_raw, {"max_files", "max_bytes", "max_log_bytes"}, "local_files")
    limits = {key: _take(local_raw, key, "local_files", int, KEYS[f"local_files.{key}"][0])
              for key in ("max_files", "max_bytes", "max_log_bytes")}
    for key, value in limits.items():
        if not 0 <= value <= 1 << 50:
            raise ConfigError(f"local_files.{key} must be 0..2**50, got {value}")

    store_raw = data.get("store", {})
    _check_keys(store_raw, {"retention_min", "orphan_age_min"}, "store")
    ages = {key: _take(store_raw, key, "store", int, KEYS[f"store.{key}"][0])
            for key in ("retention_min", "orphan_age_min")}
    for key, value in ages.items():
        if not 0 <= value <= 5_256_000:  # ten years
            raise ConfigError(f"store.{key} must be 0..5256000 minutes, got {value}")
    if ages["orphan_age_min"] < 60:
        raise ConfigError(f"store.orphan_age_min must be at least 60 minutes, got {ages['orphan_age_min']}: "
                          "a job Slurm has not registered yet must not lose its folder")

    elastic_raw = data.get("elastic", {})
    _check_keys(elastic_raw, {"drain_poll_s", "max_ranks_per_device", "replica_mmap_threshold"}, "elastic")
    drain_poll_s = _take(elastic_raw, "drain_poll_s", "elastic", int, ElasticConfig.drain_poll_s)
    if not 0 <= drain_poll_s <= 86400:
        raise ConfigError(f"elastic.drain_poll_s must be 0..86400 seconds, got {drain_poll_s}")
    max_per_device = _take(elastic_raw, "max_ranks_per_device", "elastic", int,
                           ElasticConfig.max_ranks_per_device)
    if not 1 <= max_per_device <= 1024:
        raise ConfigError(f"elastic.max_ranks_per_device must be 1..1024, got {max_per_device}")
    mmap_threshold = _take(elastic_raw, "replica_mmap_threshold", "elastic", int,
                           ElasticConfig.replica_mmap_threshold)
    if not (mmap_threshold == 0 or 4096 <= mmap_threshold <= MAX_MMAP_THRESHOLD):
        raise ConfigError(f"elastic.replica_mmap_threshold must be 0 or 4096..{MAX_MMAP_THRESHOLD} bytes "
                          f"(glibc's bound), got {mmap_threshold}")

    sla_raw = data.get("sla", {})
    _check_keys(sla_raw, {"window_s", "protect_nodes"}, "sla")
    window_s = _take(sla_raw, "window_s", "sla", int, SlaConfig.window_s)
    if not 10 <= window_s <= 86400:
        raise ConfigError(f"sla.window_s must be 10..86400 seconds, got {window_s}")

    gpu_raw = data.get("gpu", {})
    _check_keys(gpu_raw, {"external_mounts", "lock_timeout_s", "on_mismatch"}, "gpu")
    mounts = _take(gpu_raw, "external_mounts", "gpu", list, list(GpuConfig.external_mounts))
    for mount in mounts:
        if not isinstance(mount, str) or not mount.startswith("/") or "\n" in mount or " " in mount:
            raise ConfigError(f"gpu.external_mounts must list absolute mount points, got {mount!r}")
    lock_timeout_s = _take(gpu_raw, "lock_timeout_s", "gpu", int, GpuConfig.lock_timeout_s)
    if not 1 <= lock_timeout_s <= 3600:
        raise ConfigError(f"gpu.lock_timeout_s must be 1..3600 seconds, got {lock_timeout_s}")
    on_mismatch = _take(gpu_raw, "on_mismatch", "gpu", str, GpuConfig.on_mismatch)
    if on_mismatch not in ("wait", "restart"):
        raise ConfigError(f"gpu.on_mismatch must be wait or restart, got {on_mismatch!r}")

    testing_raw = data.get("testing", {})
    _check_keys(testing_raw, {"faults"}, "testing")
    testing = TestingConfig(faults=_take(testing_raw, "faults", "testing", bool, False))

    return Config(
        default_tier=default_tier,
        tiers=tiers,
        preemption=PreemptionConfig(signal=sig, warn_time=warn_time, concurrent_dumps=concurrent_dumps,
                                    freeze_waiting=freeze_waiting, stream_pages=stream_pages),
        redis=RedisConfig(
            host=_take(redis_raw, "host", "redis", str, "127.0.0.1"),
            port=port,
            db=_take(redis_raw, "db", "redis", int, 0),
            socket=Path(redis_socket) if redis_socket else None,
            password_file=Path(_take(redis_raw, "password_file", "redis", str,
                                     KEYS["redis.password_file"][0])),
        ),
        paths=PathsConfig(state_dir=path("state_dir"), store_root=path("store_root"),
                          prefix=path("prefix"), filelog_dir=path("filelog_dir"),
                          spool_dir=path("spool_dir")),
        proxy=proxy,
        admin=AdminConfig(operators=tuple(operators)),
        local_files=LocalFilesConfig(**limits),
        store=StoreConfig(**ages),
        elastic=ElasticConfig(drain_poll_s=drain_poll_s, max_ranks_per_device=max_per_device,
                              replica_mmap_threshold=mmap_threshold),
        sla=SlaConfig(window_s=window_s,
                      protect_nodes=_take(sla_raw, "protect_nodes", "sla", bool, SlaConfig.protect_nodes)),
        gpu=GpuConfig(external_mounts=tuple(mounts), lock_timeout_s=lock_timeout_s, on_mismatch=on_mismatch),
        testing=testing,
        source=source,
    )


def config_path() -> Path:
    return Path(os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH)


def load(path: Path | None = None) -> Config:
    """Load the admin configuration; a missing default file means built-in defaults."""
    explicit = path is not None or bool(os.environ.get(CONFIG_ENV))
    path = path or config_path()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        if explicit:
            raise ConfigError(f"configuration file {path} does not exist") from None
        return parse({}, source=None)
    except OSError as exc:
        raise ConfigError(f"cannot read configuration file {path}: {exc.strerror}") from exc
    try:
        data = tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from exc
    try:
        return parse(data, source=path)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
