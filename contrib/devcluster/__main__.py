"""`singularityctl devcluster up|down|status` (also `python -m singularity_slurm.devcluster`)."""

from __future__ import annotations

import json
import sys

import click

from singularity_slurm.errors import SingularityError

from . import cluster


def _fail(exc: Exception) -> None:
    message = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    click.echo(f"singularityctl: error: {message}", err=True)
    sys.exit(1)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def devcluster() -> None:
    """A two-node Slurm cluster on this machine (Debian 12/13, root), for demos and tests."""


@devcluster.command("up")
def devcluster_up() -> None:
    """Install and start munge, Slurm (slurmctld, slurmd n1 and n2 with 4 fake GPUs each), Redis
    and CRIU, and configure the SLA tiers. Idempotent: running it again, or after a daemon died,
    ends in the same healthy cluster."""
    try:
        cluster.up(say=lambda m: click.echo(f"devcluster: {m}"))
    except (SingularityError, OSError) as exc:
        _fail(exc)


@devcluster.command("down")
def devcluster_down() -> None:
    """Stop exactly the daemons `up` started, found by their pid files."""
    try:
        cluster.down(say=lambda m: click.echo(f"devcluster: {m}"))
    except (SingularityError, OSError) as exc:
        _fail(exc)


@devcluster.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def devcluster_status(as_json: bool) -> None:
    """Show each daemon (pid or stopped), each node's state and each partition."""
    result = cluster.status()
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        for name, info in result["daemons"].items():
            state = f"running (pid {info['pid']})" if info["running"] else "stopped"
            click.echo(f"{name:<14} {state}")
        for name, node in result["nodes"].items():
            click.echo(f"node {name:<7} {node['state']}  {node['gres']}"
                       + (f"  reason: {node['reason']}" if node.get("reason") else ""))
        for name, part in result["partitions"].items():
            click.echo(f"partition {name:<9} PriorityTier={part['priority_tier']} "
                       f"PreemptMode={part['preempt_mode']} GraceTime={part['grace_time']}")
        if "error" in result:
            click.echo(f"error: {result['error']}")
    all_up = all(d["running"] for d in result["daemons"].values())
    sys.exit(0 if all_up else 3)


if __name__ == "__main__":
    devcluster(prog_name="singularityctl devcluster")
