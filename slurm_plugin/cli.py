"""`singularityctl`: the command line of Singularity for Slurm."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import click

from singularity_slurm import config as config_mod
from singularity_slurm.coordinator.registry import Registry, connect
from singularity_slurm.errors import SingularityError
from singularity_slurm.slurmcli import SlurmClient

from . import admin_check, lifecycle, policy
from . import status as status_mod

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def one_line(exc: BaseException) -> str:
    """An error's message on one line: its lines joined, blank ones dropped."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return "; ".join(lines) or type(exc).__name__


def _fail(exc: Exception) -> None:
    click.echo(f"singularityctl: error: {one_line(exc)}", err=True)
    sys.exit(1)


class _Commands(click.Group):
    """The command group; a project error that no command caught is printed as one line, exit 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except SingularityError as exc:
            _fail(exc)


def _load(path: Path | None) -> config_mod.Config:
    try:
        return config_mod.load(path)
    except SingularityError as exc:
        _fail(exc)
        raise  # unreachable


@click.group(cls=_Commands, context_settings=CONTEXT)
@click.option("--config", "config_path", type=click.Path(path_type=Path), envvar="SINGULARITY_CONFIG",
              help="Singularity configuration file [default: /etc/singularity-slurm/config.toml].")
@click.version_option(package_name="singularity-slurm")
@click.pass_context
def main(ctx: click.Context, config_path: Path | None) -> None:
    """Transparent preemption, migration and elasticity for deep-learning jobs on Slurm.

    Users pick an SLA tier at submission (`sbatch --singularity-sla=premium|standard|basic`);
    this command shows what Singularity knows of jobs, and lets admins check and run a cluster.
    """
    ctx.obj = config_path


@main.command()
@click.argument("job_id", type=int, required=False)
@click.option("--tier", type=click.Choice(["premium", "standard", "basic"]), help="Only jobs of this tier.")
@click.option("--window", "window_s", type=click.IntRange(10, 86400), metavar="SECONDS",
              help="Accounting window [default: the configuration's sla.window_s, 3600].")
@click.option("--actions", "show_actions", is_flag=True,
              help="Show the SLA controller's decisions (of JOB_ID, or all), with reason and outcome.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (one object per job) for scripts.")
@click.pass_obj
def sla(config_path: Path | None, job_id: int | None, tier: str | None, window_s: int | None,
        show_actions: bool, as_json: bool) -> None:
    """Show the SLA accounting: each job's GPU fraction, window by window, against its tier's floor.

    A job's fraction in a window is the devices it held usefully over the devices of its allocation,
    averaged over the window: time pending after a preemption, checkpointing or restoring counts 0,
    and k ranks sharing one device count 1/k each. Windows follow each other from the job's first
    eligibility to its end. A tier's floor (premium 0.95, standard 0.70; basic is best effort) is met
    or VIOLATED per closed window; a running job's last window is open. The summary gives, per
    tier, the share of closed job time in windows that met the floor.

    With JOB_ID: that job's windows. With --actions: what the SLA controller (singularity-controller)
    decided, and why. The timelines are in the registry (Redis), which root and the operators of
    `[admin] operators` (with read access to its password file) can read.
    """
    from singularity_slurm.sla import report

    config = _load(config_path)
    try:
        registry = Registry(connect(config.redis, timeout=3))
    except SingularityError as exc:
        _fail(SingularityError(f"the SLA accounting is kept in the registry: {one_line(exc)}"))
    if show_actions:
        from singularity_slurm.coordinator.controller import actions

        logged = [a for a in actions(registry.redis) if job_id is None or a.get("job_id") == job_id]
        if as_json:
            click.echo(json.dumps(logged, indent=2))
        for entry in [] if as_json else logged:
            devices = f" to {entry['devices']} device(s)" if "devices" in entry else ""
            click.echo(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(entry.get('time', 0)))}  "
                       f"{entry.get('action')} job {entry.get('job_id')}{devices}: {entry.get('outcome')} "
                       f"({entry.get('reason')})")
        if not logged and not as_json:
            click.echo("no decisions logged" + (f" for job {job_id}" if job_id is not None else ""))
        return
    window = float(window_s or config.sla.window_s)
    found = []
    for jid in [job_id] if job_id is not None else registry.job_ids():
        record = registry.job(jid)
        if record is None:
            if job_id is not None:
                _fail(SingularityError(f"no job {jid} in the registry (it never started under "
                                       f"Singularity, or its record expired)"))
            continue
        accounted = report.job_sla(record, window=window)
        if accounted is None:
            if job_id is not None:
                _fail(SingularityError(f"job {jid} has no SLA tier ({record.get('tier')!r})"))
            continue
        if tier is None or accounted.tier == tier:
            found.append(accounted)
    if as_json:
        out = [report.to_json(j) for j in found]
        click.echo(json.dumps(out[0] if job_id is not None else out, indent=2))
    elif job_id is not None:
        click.echo(report.format_windows(found[0]))
    elif found:
        click.echo(report.format_table(found))
    else:
        click.echo("no jobs" + (f" of tier {tier}" if tier else ""))


@main.command()
@click.argument("job_id", type=int, required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (one object per job) for scripts.")
@click.pass_obj
def status(config_path: Path | None, job_id: int | None, as_json: bool) -> None:
    """Show jobs with their SLA tier, state, restart count, GPUs and nodes.

    Joins Slurm's view (`scontrol show job`) with the registry the prolog writes in Redis. Without
    access to Redis (its password file is readable by root only) the Slurm view is shown alone.
    With JOB_ID, shows that job, also after Slurm has forgotten it.
    """
    config = _load(config_path)
    try:
        jobs = SlurmClient().jobs(job_id)
    except SingularityError as exc:
        _fail(exc)
    registry = None
    warning = None
    try:
        registry = Registry(connect(config.redis, timeout=3))
    except SingularityError as exc:
        warning = f"registry unavailable, showing Slurm's view only: {exc}"
    by_id = {int(j["JobId"]): j for j in jobs if "JobId" in j}
    ids = sorted(by_id)
    if job_id is not None and job_id not in by_id:
        ids = [job_id]
    merged = []
    for jid in ids:
        record = registry.job(jid) if registry else None
        if jid not in by_id and record is None:
            _fail(SingularityError(f"no job {jid}: neither Slurm nor the registry knows it"))
        merged.append(status_mod.merge_job(by_id.get(jid), record, config))
    if warning:
        click.echo(f"singularityctl: warning: {warning}", err=True)
    if as_json:
        click.echo(json.dumps(merged if job_id is None else merged[0], indent=2))
    elif merged and job_id is not None:
        click.echo(status_mod.format_details(merged[0]))
    elif merged:
        click.echo(status_mod.format_table(merged))
    else:
        click.echo("no jobs")


@main.command(context_settings={"ignore_unknown_options": True})
@click.option("--checkpoint-interval", type=float, envvar="SINGULARITY_CHECKPOINT_INTERVAL",
              help="Minutes between periodic checkpoints [default: the tier's setting].")
@click.option("--world-size", type=click.IntRange(min=1), envvar="SINGULARITY_WORLD_SIZE",
              help="Run COMMAND as N torch.distributed ranks over the job's devices (one per device "
                   "by default), with collectives through the device proxies.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_obj
def run(config_path: Path | None, checkpoint_interval: float | None, world_size: int | None,
        command: tuple[str, ...]) -> None:
    """Run COMMAND as a preemptible, migratable job step (use it in the batch script).

    \b
        #SBATCH --singularity-sla=basic
        singularityctl run -- python train.py --epochs 10
    \b
        #SBATCH --nodes=2 --gres=gpu:2
        singularityctl run --world-size 4 -- python train_ddp.py

    On the first start COMMAND is started; after a requeue the last checkpoint is restored and
    COMMAND continues where it stopped. The preemption warning signal (SIGURG; SIGTERM as a
    fallback) checkpoints and requeues the job. Written in a batch script, `run` starts itself as a
    job step (srun --overlap), which Slurm's warning reaches: no `exec` or trap is needed, and the
    lines after it run once COMMAND has ended. The exit status is COMMAND's.

    A script may hold several `run` lines: after a requeue, runs that had finished return their
    recorded exit status without running again, and the interrupted one resumes.

    Without --world-size, COMMAND runs once per node of the job (RANK is the node's index). With
    --world-size N it runs as N ranks with the environment torchrun gives (RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT): the script's own init_process_group("gloo" or "nccl")
    is routed through the job's device proxies, so the ranks hold no network connections and
    every checkpoint is taken at a consistent cut of all of them. N stays the same for the job's
    whole life, whatever devices it is restored on.

    A torchrun (or `python -m torch.distributed.run`) COMMAND runs as its ranks' program with
    --world-size nproc-per-node x nnodes; `srun` and `mpirun` are refused with what to write instead.
    """
    from .commandline import devices_per_node, interpret
    from .launcher import WARNING_SIGNALS, Launcher, LaunchError, front_environment, in_job_step, run_as_step

    in_step = in_job_step(os.environ)
    early: list[int] = []
    if in_step:  # the warning may come before the launcher exists: keep it for the launcher
        for sig in WARNING_SIGNALS:
            signal.signal(sig, lambda signum, frame: early.append(signum))
    env = front_environment(os.environ) if in_step else dict(os.environ)
    try:
        run_command = interpret(command, world_size, devices_per_node=devices_per_node(env),
                                python_exec=env.get("PYTHON_EXEC"))
    except SingularityError as exc:
        _fail(exc)
    config = _load(config_path)
    try:
        if not in_step:
            # In the batch script: run as a job step, which Slurm's warning signal reaches. The step
            # interprets the command again and prints the notes.
            sys.exit(run_as_step(config, os.environ, sys.argv[1:]))
        if os.environ.get("SLURM_PROCID", "0") != "0":
            sys.exit(0)  # `srun singularityctl run` with several tasks: task 0 launches for all
        for note in run_command.notes:
            click.echo(f"[singularity] {note}", err=True)
        launcher = Launcher(config, os.environ, checkpoint_interval_s=(
            checkpoint_interval * 60 if checkpoint_interval else None), world_size=run_command.world_size)
        sys.exit(launcher.run(list(run_command.argv), early))
    except (LaunchError, SingularityError) as exc:
        _fail(exc)


@main.command()
@click.argument("job_id", type=int)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_obj
def checkpoint(config_path: Path | None, job_id: int, as_json: bool) -> None:
    """Checkpoint a running job now; it keeps running.

    The checkpoint is committed to the store like a periodic one: after a failure the job resumes
    from it. Only the job's owner, root and the operators named in the configuration's
    `[admin] operators` may checkpoint it (root and operators: through Redis, signed by munge).
    """
    from .jobctl import JobControl

    control = JobControl(_load(config_path), SlurmClient(), os.getuid(),
                         say=(lambda m: None) if as_json else click.echo)
    try:
        reply = control.checkpoint(job_id)
    except SingularityError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(reply, indent=2))
    else:
        click.echo(f"checkpoint {reply['seq']} committed in {reply['seconds']:.1f}s: "
                   f"{reply['logical_bytes'] / 2**20:.1f} MiB, {reply['new_bytes'] / 2**20:.1f} MiB stored"
                   + lifecycle.waited(reply))


@main.command()
@click.argument("job_id", type=int)
@click.option("--exclude", help="Nodes to move away from, comma-separated [default: the job's nodes].")
@click.option("--no-wait", is_flag=True, help="Return once the job is requeued.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_obj
def migrate(config_path: Path | None, job_id: int, exclude: str | None, no_wait: bool,
            as_json: bool) -> None:
    """Move a running job to other nodes: checkpoint, requeue away from the excluded nodes, restore.

    The job resumes exactly where it stopped. Only the job's owner, root and the operators named in
    the configuration's `[admin] operators` may migrate it (root and operators: through Redis, signed
    by munge).
    """
    from .jobctl import JobControl

    control = JobControl(_load(config_path), SlurmClient(), os.getuid(),
                         say=(lambda m: None) if as_json else click.echo)
    nodes = [n for n in (exclude or "").split(",") if n]
    try:
        reply = control.migrate(job_id, nodes or None, wait=0 if no_wait else 180)
    except SingularityError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(reply, indent=2))


def _node_range(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    low, _, high = text.partition("-")
    try:
        nodes = (int(low), int(high or low))
    except ValueError:
        raise click.BadParameter(f"{text!r}: give a node count (2) or a range (1-2)",
                                 param_hint="--nodes") from None
    if not 1 <= nodes[0] <= nodes[1]:
        raise click.BadParameter(f"{text!r}: counts start at 1, and MIN <= MAX", param_hint="--nodes")
    return nodes


@main.command()
@click.argument("job_id", type=int)
@click.option("--nodes", "nodes", metavar="N|MIN-MAX",
              help="Nodes for the job from now on: a count, or a range Slurm may pick from when the job "
                   "starts again [default: as now].")
@click.option("--gpus-per-node", type=click.IntRange(min=1), metavar="G",
              help="GPUs (device proxies) on each node from now on [default: as now].")
@click.option("--no-wait", is_flag=True, help="Return once the job is requeued.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_obj
def resize(config_path: Path | None, job_id: int, nodes: str | None, gpus_per_node: int | None,
           no_wait: bool, as_json: bool) -> None:
    """Change the number of nodes and GPUs a distributed job runs on; its world size stays.

    The job (a `singularityctl run --world-size N` job) is checkpointed at its distributed cut,
    requeued with the new size (Slurm's own node count and gres request of the pending job), and
    restored there: its N ranks are spread over the devices it gets, several ranks per device taking
    turns when there are fewer devices than ranks (at most `[elastic] max_ranks_per_device`). Its
    numbers do not change with its size. A size that cannot hold the world size (more nodes than
    ranks, too many ranks per device), and a job that is not distributed, are refused before anything
    stops. Only the job's owner, root and the operators named in `[admin] operators` may resize it.

    \b
    Examples:
      singularityctl resize 42 --nodes 1               # all ranks onto one node
      singularityctl resize 42 --nodes 1 --gpus-per-node 1
      singularityctl resize 42 --nodes 1-2             # whatever Slurm can give, up to 2 nodes
    """
    from .jobctl import JobControl

    size = _node_range(nodes)
    if size is None and gpus_per_node is None:
        raise click.UsageError("give --nodes, --gpus-per-node or both")
    control = JobControl(_load(config_path), SlurmClient(), os.getuid(),
                         say=(lambda m: None) if as_json else click.echo)
    try:
        reply = control.resize(job_id, size, gpus_per_node, wait=0 if no_wait else 180)
    except SingularityError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(reply, indent=2))


@main.command("agent-call", hidden=True)
@click.argument("op")
@click.argument("args", default="{}")
@click.pass_obj
def agent_call(config_path: Path | None, op: str, args: str) -> None:
    """Send one request to this job's node agent (runs as a step inside the job)."""
    from singularity_slurm import rpc
    from singularity_slurm.jobenv import job_run_dir

    config = _load(config_path)
    for sig in (signal.SIGURG, signal.SIGUSR1, signal.SIGUSR2):
        # A job step like any other, it gets the preemption warning too; the launcher acts on it.
        signal.signal(sig, signal.SIG_IGN)
    try:
        payload = {**json.loads(args), "op": op}
        if op in ("start", "restore", "generations") and "rank" not in payload:
            # One task per node (multi-node jobs): the node's index in the job is its rank.
            rank = int(os.environ.get("SLURM_NODEID") or 0)
            payload["rank"] = rank
            if op == "start":
                payload["env"] = {**payload.get("env", {}), "RANK": str(rank), "GROUP_RANK": str(rank)}
        sock = job_run_dir(config.paths.state_dir, os.environ["SLURMD_NODENAME"],
                           int(os.environ["SLURM_JOB_ID"])) / "agent.sock"
    except (KeyError, ValueError, TypeError) as exc:
        reply = rpc.error_reply(rpc.BadRequest(f"agent-call {op}: cannot make the request: {exc!r}"))
    else:
        try:
            reply = rpc.call(sock, payload, timeout=None, service="the node agent", busy_retry_s=120)
        except rpc.RpcError as exc:
            reply = rpc.error_reply(exc)
    click.echo(json.dumps(reply))  # for the caller to read: the launcher's fan-out, `jobctl`


@main.group()
def admin() -> None:
    """Cluster administration: verify and install Singularity's Slurm wiring."""


@admin.command("check")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_obj
def admin_check_cmd(config_path: Path | None, as_json: bool) -> None:
    """Verify this cluster: Slurm version and preemption keys, tier partitions, Prolog/Epilog,
    SPANK plugin and job-submit wiring, CRIU >= 4.0 and `criu check`, pycriu, Redis with auth.

    Prints one line per item, PASS or FAIL with the fix; exits 1 when any item fails. Run it as root:
    `criu check` and the Redis password need it.
    """
    config = _load(config_path)
    results = admin_check.evaluate(admin_check.gather(config, SlurmClient()), config)
    if as_json:
        click.echo(json.dumps(admin_check.results_json(results), indent=2))
    else:
        for result in results:
            click.echo(result.line())
        failed = sum(not r.ok for r in results)
        click.echo(f"{len(results) - failed} of {len(results)} checks passed"
                   + (f", {failed} FAILED" if failed else ""))
    sys.exit(1 if any(not r.ok for r in results) else 0)


@admin.command("gc")
@click.option("--dry-run", is_flag=True, help="Say what would be deleted; delete nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_obj
def admin_gc_cmd(config_path: Path | None, dry_run: bool, as_json: bool) -> None:
    """Sweep the checkpoint store: delete what no live job needs.

    Judges every job folder in the store (and in each node rank's part of it) by the job's state in
    Slurm. A job that ended for good (completed, cancelled, failed, timed out) is marked, and its
    checkpoints are deleted `store.retention_min` minutes later; until then `scontrol requeue JOBID`
    resumes it. A folder of a job Slurm no longer knows, unchanged for `store.orphan_age_min`
    minutes (10 minutes when it never held a committed checkpoint), is deleted; so are folders left
    by earlier jobs with a reused job id. Live jobs (pending, running, requeued, suspended) are never
    touched.

    Every job's Epilog starts such a sweep by itself (its own job at once, the whole store at most
    every 10 minutes); run this as root to sweep now, or from cron. Exits 1 when Slurm cannot be
    asked (nothing is deleted then).
    """
    import time

    from singularity_slurm.node.retire import sweep_store

    if os.geteuid() != 0:
        _fail(SingularityError("admin gc must run as root: only root reads and writes the checkpoint "
                               "store (run `sudo singularityctl admin gc`)"))
    config = _load(config_path)
    try:
        actions = sweep_store(config, SlurmClient(), time.time(), dry_run=dry_run)
    except (SingularityError, OSError) as exc:
        _fail(exc)
    changed = [a for a in actions if a.verdict != "keep"]
    if as_json:
        click.echo(json.dumps({"dry_run": dry_run, "folders": len(actions), "actions": [
            {"folder": a.folder, "job_id": a.job_id or None, "verdict": str(a.verdict), "state": a.state,
             "freed_bytes": a.freed_bytes, "error": a.error} for a in changed]}, indent=2))
        return
    for a in changed:
        what = "would " + str(a.verdict) if dry_run else str(a.verdict)
        click.echo(f"{what:<18} {a.folder}  (job state: {a.state or 'unknown to Slurm'}"
                   + (f", {a.freed_bytes / 2**20:.1f} MiB freed)" if a.freed_bytes else ")")
                   + (f"  FAILED: {a.error}" if a.error else ""))
    freed = sum(a.freed_bytes for a in changed)
    click.echo(f"{len(actions)} folders judged, {len(changed)} changed, {freed / 2**20:.1f} MiB freed"
               + (" (dry run: nothing changed)" if dry_run else ""))


@admin.command("install-policy")
@click.option("--slurm-etc", type=click.Path(path_type=Path), default=Path("/etc/slurm"),
              show_default=True, envvar="SINGULARITY_SLURM_ETC",
              help="Folder of slurm.conf, where the policy files go.")
@click.pass_obj
def install_policy_cmd(config_path: Path | None, slurm_etc: Path) -> None:
    """Build the SPANK plugin and write job_submit.lua, cli_filter.lua and the plugstack entry.

    Everything is generated from the Singularity configuration; run it again after changing it.
    slurm.conf must also name the plugins (JobSubmitPlugins=lua, CliFilterPlugins=lua): see
    `singularityctl admin check`.
    """
    config = _load(config_path)
    try:
        changed = policy.install_policy(config, slurm_etc)
    except (SingularityError, OSError) as exc:
        _fail(exc)
    click.echo(f"SPANK plugin: {policy.spank_library_path(config)}")
    for path in changed:
        click.echo(f"wrote {path}")
    if not changed:
        click.echo("policy files already up to date")


@admin.command("install-node")
@click.option("--criu", "criu_path", type=click.Path(path_type=Path, exists=True, dir_okay=False),
              help="criu >= 4.0 to use [default: criu on PATH].")
@click.pass_obj
def install_node_cmd(config_path: Path | None, criu_path: Path | None) -> None:
    """Prepare a compute node: build the file-log shim and the criu wrapper under the prefix.

    Run it as root on every compute node (or once, with a shared prefix) after installing CRIU.
    """
    import shutil

    from singularity_slurm.checkpoint.criu import install_wrapper

    config = _load(config_path)
    criu = criu_path or (Path(found) if (found := shutil.which("criu")) else None)
    if criu is None:
        _fail(SingularityError("criu not found: install CRIU >= 4.0 or give its path with --criu"))
    try:
        wrapper = install_wrapper(config.paths.prefix, criu)
    except (SingularityError, OSError) as exc:
        _fail(exc)
    click.echo(f"criu wrapper: {wrapper} (runs {criu})")


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def devcluster(args: tuple[str, ...]) -> None:
    """A two-node Slurm cluster on this machine (Debian 12/13, root), for demos and tests:
    `devcluster up|down|status` (`devcluster --help` says more)."""
    # The dev cluster builds on the command line's pieces (policy installation), not the reverse: it
    # is its own program, which this command runs in its place.
    os.execv(sys.executable, [sys.executable, "-m", "singularity_slurm.devcluster", *args])
