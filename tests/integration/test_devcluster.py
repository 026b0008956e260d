"""`singularityctl devcluster`: idempotent `up`, recovery after a daemon died, `status`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from conftest import CTL

from singularity_slurm.devcluster.cluster import daemon_table


def _up() -> subprocess.CompletedProcess[str]:
    return subprocess.run([CTL, "devcluster", "up"], capture_output=True, text=True, timeout=600)


def _status(expect_rc: int = 0) -> dict:
    """`devcluster status --json`; it exits 3 while any daemon is stopped."""
    proc = subprocess.run([CTL, "devcluster", "status", "--json"], capture_output=True, text=True)
    assert proc.returncode == expect_rc, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def _healthy(status: dict) -> bool:
    return (all(d["running"] for d in status["daemons"].values())
            and sorted(status["nodes"]) == ["n1", "n2", "n3"]
            and all(n["state"] in {"IDLE", "MIXED", "ALLOCATED"}
                    for name, n in status["nodes"].items() if name != "n3")
            and "DRAIN" in status["nodes"]["n3"]["state"])


def test_up_twice_changes_nothing_and_keeps_the_cluster_healthy():
    before = _status()
    proc = _up()
    assert proc.returncode == 0, proc.stderr
    assert "configuration: up to date" in proc.stdout
    assert "started nothing" in proc.stdout
    after = _status()
    assert _healthy(after)
    assert {k: v["pid"] for k, v in after["daemons"].items()} == {
        k: v["pid"] for k, v in before["daemons"].items()}


def test_up_after_a_daemon_died_restarts_only_that_daemon(layout):
    slurmd_n2 = next(d for d in daemon_table(layout) if d.name == "slurmd n2")
    pid = slurmd_n2.pid()
    assert pid is not None
    others = {d.name: d.pid() for d in daemon_table(layout) if d.name != "slurmd n2"}
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while slurmd_n2.pid() is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _status(expect_rc=3)["daemons"]["slurmd n2"]["running"] is False

    proc = _up()
    assert proc.returncode == 0, proc.stderr
    assert "started ['slurmd n2']" in proc.stdout
    status = _status()
    assert _healthy(status)
    assert {d.name: d.pid() for d in daemon_table(layout) if d.name != "slurmd n2"} == others


def test_status_lists_every_daemon_node_and_tier_partition():
    status = _status()
    assert set(status["daemons"]) == {"munged", "redis", "slurmctld", "slurmd n1", "slurmd n2", "slurmd n3",
                                      "sla-controller"}
    assert set(status["partitions"]) == {"premium", "standard", "basic"}
    for part in status["partitions"].values():
        assert part["preempt_mode"] == "REQUEUE"
    assert all("gpu:4" in n["gres"] for n in status["nodes"].values())
