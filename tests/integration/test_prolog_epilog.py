"""Prolog and Epilog on the real cluster: registry records, node agent lifecycle, cleanup."""

from __future__ import annotations

import json
import sys
import time

from conftest import run_as

from singularity_slurm.jobenv import job_run_dir
from singularity_slurm.node import services

RUNNING = """#!/bin/bash
#SBATCH --singularity-sla=standard
#SBATCH --gres=gpu:3
#SBATCH -o out.txt
touch started
while [ ! -e stop ]; do sleep 0.2; done
"""

PING = """
import json, sys
from singularity_slurm import rpc
try:
    reply = rpc.call(sys.argv[1], {'op': 'ping'})
except rpc.RemoteError as exc:
    reply = rpc.error_reply(exc)
print(json.dumps(reply))
"""


def _ping_as(user: str, socket_path) -> dict:
    proc = run_as(user, [sys.executable, "-c", PING, str(socket_path)])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_prolog_starts_the_agent_and_records_the_node_and_epilog_cleans_up(
        jobs, registry, config, job_user):
    job_id = jobs.submit(jobs.script("run.sh", RUNNING))
    jobs.wait_for_file("started")  # the batch script runs only after every prolog finished
    node = jobs.record(job_id)["NodeList"]
    run_dir = job_run_dir(config.paths.state_dir, node, job_id)
    agent_pid = services.running_pid(run_dir, "agent")
    assert agent_pid is not None

    stored = registry.job(job_id)
    assert stored["state"] == "running"
    assert stored["tier"] == "standard"
    assert list(stored["nodes"]) == [node]
    assert len(stored["nodes"][node]["gpus"]) == 3
    proxies = {f"proxy-gpu{g}": services.running_pid(run_dir, f"proxy-gpu{g}")
               for g in stored["nodes"][node]["gpus"]}
    assert stored["nodes"][node]["services"] == {"agent": agent_pid, **proxies}
    assert all(proxies.values())  # one device proxy per allocated GPU

    reply = _ping_as(job_user.pw_name, run_dir / "agent.sock")
    assert reply == {"ok": True, "job_id": job_id, "node": node, "pid": agent_pid}
    stranger = _ping_as("nobody", run_dir / "agent.sock")
    assert stranger["ok"] is False and stranger["kind"] == "forbidden"
    assert "may not act on job" in stranger["error"]

    (jobs.workdir / "stop").touch()
    jobs.wait_state(job_id, "COMPLETED")
    deadline = time.monotonic() + 30
    while run_dir.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not run_dir.exists()
    assert services.proc_start_time(agent_pid) is None
    assert all(services.proc_start_time(pid) is None for pid in proxies.values())
    ended = registry.job(job_id)
    assert ended["state"] == "ended"
    assert ended["nodes"] == {}
    assert [e["event"] for e in ended["events"]] == ["node_start", "node_end"]
    # what the SLA accounting measures the job against, from Slurm's record at its first start
    assert ended["requested_devices"] == (len(proxies) or 1)
    assert ended["eligible_at"] <= ended["first_started_at"] + 1  # Slurm's times are whole seconds


def test_multi_node_job_runs_an_agent_on_every_node(jobs, registry, config):
    job_id = jobs.submit(jobs.script("run.sh", RUNNING), "--nodes=2")
    jobs.wait_for_file("started")
    stored = registry.job(job_id)
    assert sorted(stored["nodes"]) == ["n1", "n2"]
    for node in ("n1", "n2"):
        assert services.running_pid(job_run_dir(config.paths.state_dir, node, job_id), "agent")
    (jobs.workdir / "stop").touch()
    jobs.wait_state(job_id, "COMPLETED")
    deadline = time.monotonic() + 30
    while registry.job(job_id)["state"] != "ended" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert registry.job(job_id)["state"] == "ended"
