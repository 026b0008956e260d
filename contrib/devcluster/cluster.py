"""`singularityctl devcluster up|down|status`: the dev cluster as a whole."""

from __future__ import annotations

import os
import pwd
import secrets
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

from singularity_slurm import config as config_mod
from singularity_slurm.checkpoint.criu import install_wrapper
from singularity_slurm.coordinator import registry
from singularity_slurm.errors import DevClusterError, SingularityError
from singularity_slurm.rootexec import UnsafeProgram, service_env, system_program
from singularity_slurm.slurm_plugin import policy
from singularity_slurm.slurmcli import SlurmClient, parse_version

from . import daemons, install, render
from .render import Layout

Say = Callable[[str], None]


def default_layout() -> Layout:
    return Layout(hostname=socket.gethostname().split(".")[0],
                  job_user=os.environ.get("SINGULARITY_DEVCLUSTER_USER", "jobuser"),
                  other_user=os.environ.get("SINGULARITY_DEVCLUSTER_OTHER_USER", "jobuser2"))


def daemon_table(layout: Layout) -> list[daemons.Daemon]:
    """Every daemon of the dev cluster, in start order."""
    table = [
        daemons.Daemon("munged", "munged", ["runuser", "-u", "munge", "--", "/usr/sbin/munged"],
                       Path("/run/munge/munged.pid"), Path("/var/log/munge/munged.log")),
        daemons.Daemon("redis", "redis-server",
                       ["runuser", "-u", "redis", "--", "redis-server",
                        str(layout.singularity_etc / "redis.conf")],
                       layout.run_dir / "redis" / "redis.pid",
                       layout.lib_dir / "redis" / "redis.log"),
        daemons.Daemon("slurmctld", "slurmctld", ["slurmctld"], layout.slurmctld_pidfile,
                       layout.log_dir / "slurmctld.log"),
    ]
    for node in layout.nodes:
        table.append(daemons.Daemon(f"slurmd {node}", "slurmd", ["slurmd", "-N", node],
                                    layout.slurmd_pidfile(node),
                                    layout.log_dir / f"slurmd-{node}.log"))
    table.append(controller_daemon(layout))
    return table


CONTROLLER_PERIOD_S = 10


def controller_daemon(layout: Layout) -> daemons.Daemon:
    """The SLA controller, advising: it resizes no job (the tests' jobs keep the sizes they ask for)
    and logs what it would do (`singularityctl sla --actions`), keeping its protected set as its own
    bookkeeping. A clean environment, /; start-stop-daemon puts it in the background and writes its
    pid file. `--metrics-port` is left to the site: the tests serve the metrics of a controller of
    their own."""
    pidfile, log = layout.run_dir / "sla-controller.pid", layout.log_dir / "sla-controller.log"
    script = str(layout.venv_bin / "singularity-controller")
    try:
        start_stop = system_program("start-stop-daemon")
    except UnsafeProgram:
        start_stop = "/usr/sbin/start-stop-daemon"  # Debian's dpkg has it; starting says if not
    return daemons.Daemon(
        "sla-controller", "singularity-con",  # a Python script: its command name, cut to 15 characters
        ["/usr/bin/env", "-i", *(f"{k}={v}" for k, v in service_env(os.environ).items()),
         start_stop, "--start", "--background", "--make-pidfile", "--pidfile", str(pidfile),
         "--output", str(log), "--chdir", "/", "--exec", script, "--", "--period", str(CONTROLLER_PERIOD_S)],
        pidfile, log, script=script)


def _slurm_daemons(table: list[daemons.Daemon]) -> list[daemons.Daemon]:
    return [d for d in table if d.program.startswith("slurm")]


@dataclass
class Report:
    changed: list[Path] = field(default_factory=list)
    started: list[str] = field(default_factory=list)
    restarted: list[str] = field(default_factory=list)


def _write_configs(layout: Layout, say: Say) -> tuple[config_mod.Config, list[Path]]:
    changed: list[Path] = []
    etc = layout.singularity_etc
    config_file = etc / "config.toml"
    if render.is_generated_config(config_file) and policy.write_atomic(
            config_file, render.render_singularity_config(layout)):
        changed.append(config_file)  # ours (new, or an earlier version's): a file edited by hand stays
    password_file = etc / "redis.password"
    if not password_file.exists():
        policy.write_atomic(password_file, secrets.token_urlsafe(24) + "\n", mode=0o600)
    config = config_mod.load(config_file)
    if config.paths.prefix != layout.prefix:
        raise DevClusterError(
            f"{config_file} has paths.prefix = {config.paths.prefix}, but the dev cluster is "
            f"installed in {layout.prefix}: fix the file or remove it to get the default"
        )
    password = config.redis.password()
    if not password:
        raise DevClusterError(f"{password_file} is empty: remove it and run `up` again")
    redis_user = pwd.getpwnam("redis")
    for path in (layout.run_dir / "redis", layout.lib_dir / "redis"):
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, redis_user.pw_uid, redis_user.pw_gid)
    redis_conf = etc / "redis.conf"
    if policy.write_atomic(redis_conf, render.render_redis_conf(layout, password), mode=0o640):
        changed.append(redis_conf)
    os.chown(redis_conf, 0, redis_user.pw_gid)
    version = parse_version(install.run(["slurmd", "-V"]).stdout)  # works before slurm.conf
    files = {
        layout.slurm_etc / "slurm.conf": render.render_slurm_conf(layout, config, version),
        layout.slurm_etc / "gres.conf": render.render_gres_conf(layout),
        layout.slurm_etc / "cgroup.conf": render.render_cgroup_conf(),
    }
    for path, text in files.items():
        if policy.write_atomic(path, text):
            changed.append(path)
    changed += policy.install_policy(config, layout.slurm_etc)
    say(f"configuration: {len(changed)} file(s) changed" if changed else "configuration: up to date")
    return config, changed


def _redis_ok(config: config_mod.Config) -> bool:
    try:
        return bool(registry.client(config.redis, timeout=2).ping())
    except redis.RedisError:
        return False


def _munge_ok() -> bool:
    proc = subprocess.run("munge -n | unmunge", shell=True, capture_output=True)
    return proc.returncode == 0


def _ctld_ok() -> bool:
    proc = subprocess.run(["scontrol", "ping"], capture_output=True, text=True)
    return proc.returncode == 0 and "UP" in proc.stdout


SPARE_REASON = "spare node of the dev cluster (tests resume it)"


def _nodes_ready(slurm: SlurmClient, layout: Layout) -> bool:
    nodes = slurm.nodes()
    ready = True
    for name in layout.nodes:
        state = nodes.get(name, {}).get("State", "UNKNOWN")
        if name in layout.spare_nodes:
            if "DOWN" in state and "DRAIN" not in state:
                slurm.run(["scontrol", "update", f"NodeName={name}", "State=RESUME"], check=False)
                ready = False
            elif "DRAIN" not in state:
                slurm.run(["scontrol", "update", f"NodeName={name}", "State=DRAIN",
                           f"Reason={SPARE_REASON}"], check=False)
                ready = False
            elif any(bad in state for bad in ("FAIL", "NOT_RESPONDING", "UNKNOWN")):
                ready = False
            continue
        if any(bad in state for bad in ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "UNKNOWN")):
            if "DOWN" in state or "DRAIN" in state:
                slurm.run(["scontrol", "update", f"NodeName={name}", "State=RESUME"], check=False)
            ready = False
    return ready


def up(layout: Layout | None = None, say: Say = print) -> Report:
    layout = layout or default_layout()
    report = Report()
    debian = install.check_platform()
    install.ensure_packages(install.SYSTEM_PACKAGES, say)
    criu = install.ensure_criu(layout, say)
    install.ensure_pycriu(layout, debian, say)
    say(f"criu: {criu} (run through {install_wrapper(layout.prefix, criu)})")
    for user in layout.job_users:
        install.ensure_user(user, say)
    install.ensure_munge_key()
    install.ensure_dirs(layout)
    install.ensure_fake_gpus(layout)
    config, report.changed = _write_configs(layout, say)

    table = daemon_table(layout)
    slurm_config_changed = any(p.name in {"slurm.conf", "gres.conf", "cgroup.conf"} for p in report.changed)
    redis_config_changed = any(p.name == "redis.conf" for p in report.changed)
    # the controller reads the project's configuration once, at its start (where Redis is, too)
    config_changed = redis_config_changed or any(p.name == "config.toml" for p in report.changed)
    for daemon in table:
        restart = (slurm_config_changed and daemon.program.startswith("slurm")) or (
            redis_config_changed and daemon.name == "redis") or (
            config_changed and daemon.name == "sla-controller")
        if restart and daemon.pid() is not None:
            daemons.stop(daemon)
            report.restarted.append(daemon.name)
        if daemon.pid() is None:
            daemons.start(daemon)
            if daemon.name not in report.restarted:
                report.started.append(daemon.name)
        if daemon.name == "munged":
            daemons.wait_for(_munge_ok, "munge to issue credentials")
        elif daemon.name == "redis":
            daemons.wait_for(lambda: _redis_ok(config), "Redis to answer")
        elif daemon.name == "slurmctld":
            daemons.wait_for(_ctld_ok, "slurmctld to answer `scontrol ping`")
    slurm = SlurmClient()
    daemons.wait_for(lambda: _nodes_ready(slurm, layout), "nodes to become available", 60)
    check_job_user_python(layout)
    spare = f" (spare, drained: {', '.join(layout.spare_nodes)})" if layout.spare_nodes else ""
    say(f"dev cluster up: nodes {', '.join(layout.nodes)}{spare}; started {report.started or 'nothing'}"
        + (f"; restarted {report.restarted}" if report.restarted else ""))
    return report


def check_job_user_python(layout: Layout) -> None:
    python = layout.venv_bin / "python"
    for user in layout.job_users:
        proc = subprocess.run(["runuser", "-u", user, "--", str(python), "-c",
                               "import singularity_slurm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise DevClusterError(
                f"the job user {user} cannot run {python}: {proc.stderr.strip()}; "
                "install the project with `make install` (it creates a world-readable venv)"
            )


def down(layout: Layout | None = None, say: Say = print) -> list[str]:
    layout = layout or default_layout()
    stopped = []
    for daemon in reversed(daemon_table(layout)):
        if daemons.stop(daemon):
            stopped.append(daemon.name)
    say(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")
    return stopped


def status(layout: Layout | None = None) -> dict:
    layout = layout or default_layout()
    result: dict = {"daemons": {}, "nodes": {}, "partitions": {}}
    for daemon in daemon_table(layout):
        pid = daemon.pid()
        result["daemons"][daemon.name] = {"running": pid is not None, "pid": pid,
                                          "pidfile": str(daemon.pidfile)}
    if result["daemons"]["slurmctld"]["running"]:
        try:
            slurm = SlurmClient(timeout=10)
            for name, node in slurm.nodes().items():
                result["nodes"][name] = {"state": node.get("State"), "gres": node.get("Gres"),
                                         "reason": node.get("Reason")}
            for name, part in slurm.partitions().items():
                result["partitions"][name] = {"priority_tier": part.get("PriorityTier"),
                                              "preempt_mode": part.get("PreemptMode"),
                                              "grace_time": part.get("GraceTime")}
        except SingularityError as exc:
            result["error"] = str(exc)
    return result
