"""Attacks on a running job's node agent socket, by real unprivileged users against the real agent.

Another user (the dev cluster's second job user) may connect (the socket is open to all; SO_PEERCRED
decides) but every op is refused with a typed error and the job runs on untouched. The job's own user
cannot make the agent read or allocate an oversized request, nor start or restore a tree from outside
the job's steps (past its cgroups), nor take its threads with held connections: root is still
served, the launcher is served within the connection cap, and the job finishes.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from conftest import CTL, run_as

from singularity_slurm import rpc
from singularity_slurm.jobenv import job_run_dir
from singularity_slurm.node import services
from singularity_slurm.node.agent import MAX_CONNECTIONS

PYTHON = str(Path(CTL).with_name("python"))

LOOP = f"""#!/bin/bash
#SBATCH --singularity-sla=standard
#SBATCH -o out.txt
{CTL} run -- /bin/bash -c 'touch started; i=0; while [ ! -e stop ]; do i=$((i+1)); echo $i > ticks; \
sleep 0.1; done; echo finished'
"""

# Run as another user: each op's outcome, as the exception's kind (or "ok" if it was served).
TRY_OPS = """
import json, sys
from singularity_slurm import rpc
out = {}
for op in json.loads(sys.argv[2]):
    try:
        rpc.call(sys.argv[1], op, timeout=10)
        out[op["op"]] = "ok"
    except rpc.RpcError as exc:
        out[op["op"]] = [type(exc).__name__, exc.kind, str(exc)]
print(json.dumps(out))
"""

# Run as the job's user: COUNT copies of a request whose reason is that many characters long, each
# in turn, and the exception each met (or "ok").
REPEAT = """
import json, sys
from singularity_slurm import rpc
out = []
count, template = int(sys.argv[2]), json.loads(sys.argv[3])
for request in [{**template, "reason": "r" * template["reason"]} for _ in range(count)]:
    try:
        rpc.call(sys.argv[1], request, timeout=30)
        out.append(["ok", "ok", ""])
    except rpc.RpcError as exc:
        out.append([type(exc).__name__, exc.kind, str(exc)])
print(json.dumps(out))
"""

# Run as the job's user: a header claiming 1 GiB (no body), then a truthful header and a 64 MiB body.
OVERSIZED = """
import json, socket, struct, sys, time
from singularity_slurm import rpc
out = {}
for name, size, body in (("header_1g", 1 << 30, 0), ("body_64m", 64 << 20, 64 << 20)):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(sys.argv[1])
    started = time.monotonic()
    try:
        s.sendall(struct.pack("!I", size) + b"x" * body)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the agent answered and closed before the body was all sent
    reply = rpc.read_frame(s, rpc.MAX_REQUEST, time.monotonic() + 20)
    try:
        closed = s.recv(1) == b""
    except ConnectionResetError:  # closed with our unread body in its queue
        closed = True
    out[name] = {"reply": reply, "seconds": time.monotonic() - started, "closed": closed}
    s.close()
print(json.dumps(out))
"""

# Run as the job's user: hold `n` connections open without sending anything; report how each ended.
FLOOD = """
import json, socket, sys, time
from singularity_slurm import rpc
n, hold = int(sys.argv[2]), float(sys.argv[3])
socks, refused_connect = [], 0
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(sys.argv[1])
        socks.append(s)
    except OSError:
        refused_connect += 1
print("held", len(socks), flush=True)
ended = {"busy": 0, "closed": 0, "open": 0}
deadline = time.monotonic() + hold
for s in socks:
    try:
        reply = rpc.read_frame(s, rpc.MAX_REQUEST, deadline)
        key = "closed" if reply is None else str(reply.get("kind"))
    except Exception:  # still open at the deadline
        key = "open"
    ended[key] = ended.get(key, 0) + 1
    s.close()
print(json.dumps({"refused_connect": refused_connect, **ended}), flush=True)
"""


def _start(jobs, config) -> tuple[int, Path, int]:
    """A `singularityctl run` job that ticks until the file `stop` appears: (job id, agent socket,
    agent pid)."""
    job_id = jobs.submit(jobs.script("loop.sh", LOOP))
    jobs.wait_for_file("started")
    jobs.wait_for_file("ticks")
    node = jobs.record(job_id)["NodeList"]
    run_dir = job_run_dir(config.paths.state_dir, node, job_id)
    pid = services.running_pid(run_dir, "agent")
    assert pid is not None
    return job_id, run_dir / "agent.sock", pid


def _ticks(jobs) -> int:
    return int((jobs.workdir / "ticks").read_text().strip() or 0)


def _still_ticking(jobs) -> None:
    before = _ticks(jobs)
    deadline = time.monotonic() + 10
    while _ticks(jobs) <= before:
        assert time.monotonic() < deadline, "the job's process stopped ticking"
        time.sleep(0.1)


def _finish(jobs, job_id: int) -> None:
    (jobs.workdir / "stop").touch()
    record = jobs.wait_state(job_id, "COMPLETED", "FAILED", "CANCELLED", timeout=120)
    assert record["JobState"] == "COMPLETED", (jobs.workdir / "out.txt").read_text()
    assert "finished" in (jobs.workdir / "out.txt").read_text()


def _proc_status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_another_user_is_refused_every_op_with_a_typed_error_and_the_job_is_untouched(jobs, config,
                                                                                       other_user):
    job_id, sock, agent_pid = _start(jobs, config)
    status_before = rpc.call(sock, {"op": "status"})
    ops = [{"op": "status"}, {"op": "checkpoint", "reason": "manual", "stop": True}, {"op": "kill"},
           {"op": "start", "argv": ["/bin/sh", "-c", "id > /tmp/owned"], "cwd": "/tmp",
            "output": "/tmp/owned.out", "env": {}},
           {"op": "requeue"}, {"op": "run_begin", "command": ["x"]}]

    proc = run_as(other_user.pw_name, [PYTHON, "-c", TRY_OPS, str(sock), json.dumps(ops)])

    assert proc.returncode == 0, proc.stderr
    outcome = json.loads(proc.stdout)
    uid = other_user.pw_uid
    for op in ops:
        name, kind, message = outcome[op["op"]]
        assert (name, kind) == ("Forbidden", "forbidden"), outcome
        assert f"uid {uid} may not act on job {job_id}" in message
    assert not Path("/tmp/owned").exists() and not Path("/tmp/owned.out").exists()
    status_after = rpc.call(sock, {"op": "status"})
    assert status_after["state"] == "running"
    assert status_after["init_pid"] == status_before["init_pid"]
    assert status_after["last_checkpoint"] == status_before["last_checkpoint"]
    assert services.running_pid(sock.parent, "agent") == agent_pid
    _still_ticking(jobs)
    _finish(jobs, job_id)


def test_oversized_requests_and_starts_from_outside_the_job_are_refused_and_the_agent_serves_on(
        jobs, config, job_user, registry):
    job_id, sock, agent_pid = _start(jobs, config)
    rss_before = _proc_status(agent_pid, "VmRSS")
    events_before = len(registry.job(job_id)["events"])

    proc = run_as(job_user.pw_name, [PYTHON, "-c", OVERSIZED, str(sock)])

    assert proc.returncode == 0, proc.stderr
    outcome = json.loads(proc.stdout)
    for name, size in (("header_1g", 1 << 30), ("body_64m", 64 << 20)):
        result = outcome[name]
        assert result["reply"] == {"ok": False, "kind": "too_large", "error": f"request of {size} bytes "
                                   f"is over the {rpc.MAX_REQUEST}-byte limit"}, name
        assert result["closed"], name
        assert result["seconds"] < 10, name
    # Nothing of the bodies was read into the agent: its memory did not grow by their size.
    assert _proc_status(agent_pid, "VmRSS") - rss_before < 16 * 1024  # KiB
    assert rpc.call(sock, {"op": "ping"})["pid"] == agent_pid
    ping = run_as(job_user.pw_name, [PYTHON, "-c", "import sys; from singularity_slurm import rpc; "
                                     "print(rpc.call(sys.argv[1], {'op': 'ping'})['ok'])", str(sock)])
    assert ping.stdout.strip() == "True", ping.stderr

    # The job's user, from a process in none of the job's steps (a login on the node), may not have
    # the agent start or restore a tree: it would run outside the job's cgroups, past Slurm's limits
    # and cleanup. Refused before anything is looked at.
    ops = [{"op": "start", "argv": ["/bin/sh", "-c", "sleep 600"], "cwd": "/tmp", "env": {}},
           {"op": "restore"}]
    proc = run_as(job_user.pw_name, [PYTHON, "-c", TRY_OPS, str(sock), json.dumps(ops)])
    assert proc.returncode == 0, proc.stderr
    for op, (name, kind, message) in json.loads(proc.stdout).items():
        assert (name, kind) == ("Forbidden", "forbidden"), (op, message)
        assert f"job {job_id}: a start or restore must come from a step of the job" in message, message
    assert rpc.call(sock, {"op": "status"})["state"] == "running"

    # Nor may it fill the shared Redis through the job's record: 30 checkpoint requests with a
    # 600 kB reason each are refused before anything is dumped or recorded.
    template = {"op": "checkpoint", "reason": 600_000}  # made 600 kB long by the user's process
    proc = run_as(job_user.pw_name, [PYTHON, "-c", REPEAT, str(sock), "30", json.dumps(template)])
    assert proc.returncode == 0, proc.stderr
    for name, kind, message in json.loads(proc.stdout):
        assert (name, kind) == ("RemoteError", "refused"), message
        assert message.startswith("checkpoint: reason must be one of periodic, manual, preempt"), message
    job = registry.job(job_id)
    assert len(job["events"]) == events_before and not job["checkpoints"]
    assert rpc.call(sock, {"op": "status"})["last_checkpoint"] is None
    _still_ticking(jobs)
    _finish(jobs, job_id)


def test_200_held_connections_leave_root_served_the_launcher_within_the_cap_and_the_job_finishes(
        jobs, config, job_user):
    job_id, sock, agent_pid = _start(jobs, config)
    threads_before = _proc_status(agent_pid, "Threads")
    flood = subprocess.Popen(["runuser", "-u", job_user.pw_name, "--", PYTHON, "-c", FLOOD, str(sock),
                              "200", "40"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert flood.stdout is not None
        held = flood.stdout.readline()
        assert held.startswith("held "), flood.stderr.read() if flood.stderr else held

        # Root is served at once while the user holds every ordinary slot (root's reserve).
        started = time.monotonic()
        assert rpc.call(sock, {"op": "ping"}, timeout=5)["pid"] == agent_pid
        assert time.monotonic() - started < 5
        # The agent's threads stay within its cap, whatever the user opened.
        assert _proc_status(agent_pid, "Threads") <= threads_before + MAX_CONNECTIONS + rpc.ROOT_RESERVE
        # The job's user (as the launcher calls) is served once idle connections are closed.
        call = run_as(job_user.pw_name, [PYTHON, "-c",
                                         "import sys; from singularity_slurm import rpc; "
                                         "print(rpc.call(sys.argv[1], {'op': 'status'}, timeout=10, "
                                         "busy_retry_s=45)['state'])", str(sock)])
        assert call.stdout.strip() == "running", call.stderr

        out, err = flood.communicate(timeout=60)
    finally:
        if flood.poll() is None:
            flood.kill()
            flood.communicate()
    ended = json.loads(out.strip().splitlines()[-1])
    # Past the cap: answered busy; within it: closed by the agent once idle. None left open.
    assert ended["open"] == 0, ended
    assert ended["busy"] >= 200 - ended["refused_connect"] - MAX_CONNECTIONS, ended
    assert ended["busy"] + ended["closed"] + ended["refused_connect"] == 200, ended
    _still_ticking(jobs)
    _finish(jobs, job_id)
    log = (jobs.workdir / "out.txt").read_text()
    assert "Traceback" not in log, log

