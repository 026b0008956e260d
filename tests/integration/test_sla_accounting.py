"""The SLA accounting and the SLA controller on the real cluster: the GPU fractions `singularityctl
sla` reports for a job that was checkpointed and preempted match the fractions of the job's own
timeline, and the controller protects it once the preemption has left it short of its floor.

The job prints the time, from its own clock, every 20 ms it runs: the gaps in what it printed are
exactly when it did not run (frozen for a dump, pending after the preemption, being restored). The
test rebuilds the windows from those lines alone and compares them with the registry's.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

from conftest import CTL, run_as

from singularity_slurm.coordinator import keys

PYTHON = str(Path(CTL).with_name("python"))
CONTROLLER = str(Path(CTL).with_name("singularity-controller"))
WINDOW_S = 30
TICKS = 2400  # about 55 s of running

TICK = """import sys, time
for _ in range(int(sys.argv[1])):
    print(f"tick {time.time():.3f}", flush=True)
    time.sleep(0.02)
print("done", flush=True)
"""

JOB = f"""#!/bin/bash
#SBATCH --singularity-sla=standard
#SBATCH --gres=gpu:4
#SBATCH -o tick.out
{CTL} run -- {PYTHON} tick.py {TICKS}
"""

EVERYTHING = """#!/bin/bash
#SBATCH --singularity-sla=premium
#SBATCH --nodes=2 --gres=gpu:4
#SBATCH -o everything-%j.out
sleep 20
"""


def ticks(text: str) -> list[float]:
    return [float(line.split()[1]) for line in text.splitlines() if line.startswith("tick ")]


def running_spans(times: list[float], gap: float = 0.3, period: float = 0.02) -> list[tuple[float, float]]:
    """When the job ran, from its own ticks: a pause longer than `gap` is a stop."""
    spans: list[tuple[float, float]] = []
    for at in sorted(times):
        if spans and at - spans[-1][1] <= gap:
            spans[-1] = (spans[-1][0], at)
        else:
            spans.append((at, at))
    return [(start, end + period) for start, end in spans]


def fraction(spans: list[tuple[float, float]], start: float, end: float) -> float:
    return sum(max(min(e, end) - max(s, start), 0.0) for s, e in spans) / (end - start)


def _wait_for_ticks(jobs, job_id: int, log: Path, count: int) -> None:
    jobs.wait(job_id, lambda r: len(ticks(log.read_text())) >= count, f"{count} ticks printed", timeout=120)


def controller_once() -> list[dict]:
    """One decision of the controller: a 120 s window in which a standard job (floor 0.70) may lose
    36 s, and a preemption that costs 20."""
    argv = [CONTROLLER, "--once", "--json", "--window", "120", "--preemption-cost", "20"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_a_preempted_standard_jobs_fractions_match_its_own_timeline_and_the_controller_protects_it(
        jobs, job_user, registry):
    """One job's life: started, checkpointed by its user (it stops for the dump only), preempted by
    a premium job that holds every device for 20 s, restored, ended. The fractions `sla` reports
    match those of the job's own timeline; the controller protects the job once the preemption has
    left it short of its floor, not before, and says why."""
    jobs.script("tick.py", TICK)
    job_id = jobs.submit(jobs.script("job.sh", JOB))
    log = jobs.wait_for_file("tick.out")
    _wait_for_ticks(jobs, job_id, log, 100)
    assert not [a for a in controller_once() if a["job_id"] == job_id], "protected before it lost anything"
    _wait_for_ticks(jobs, job_id, log, 400)
    checkpoint = run_as(job_user.pw_name, [CTL, "checkpoint", str(job_id)])
    assert checkpoint.returncode == 0, checkpoint.stderr
    _wait_for_ticks(jobs, job_id, log, 1200)
    everything = jobs.submit(jobs.script("everything.sh", EVERYTHING))
    jobs.wait_state(everything, "COMPLETED", timeout=120)
    jobs.wait(job_id, lambda r: "restored checkpoint" in log.read_text(), "restored", timeout=120)

    decided = [a for a in controller_once() if a["job_id"] == job_id]
    assert [a["action"] for a in decided] == ["protect"], decided
    assert "standard job can lose only" in decided[0]["reason"], decided
    assert str(job_id) in registry.redis.smembers(keys.sla_protected())
    shown = subprocess.run([CTL, "sla", str(job_id), "--actions"], capture_output=True, text=True)
    assert shown.returncode == 0 and f"protect job {job_id}: protected" in shown.stdout, shown.stdout

    jobs.wait(job_id, lambda r: "done" in log.read_text(), "done", timeout=300)
    jobs.wait_state(job_id, "COMPLETED", timeout=60)
    text = log.read_text()

    # root reads the accounting; the job's user cannot (the registry is root's)
    proc = run_as("root", [CTL, "sla", str(job_id), "--window", str(WINDOW_S), "--json"])
    assert proc.returncode == 0, proc.stderr
    accounted = json.loads(proc.stdout)
    assert accounted["tier"] == "standard" and accounted["ended"] and accounted["requested_devices"] == 4
    spans = running_spans(ticks(text))
    # the windows of the job's own timeline: its end in Slurm's accounting is its Epilog's, after
    # its last tick
    compared = [w for w in accounted["windows"] if w["end"] <= spans[-1][1]]
    report = [(round(w["fraction"], 4), round(fraction(spans, w["start"], w["end"]), 4)) for w in compared]
    print(f"windows of {WINDOW_S}s, (sla's fraction, the job's own): {report}; the job ran {spans}")
    assert len(spans) >= 2, spans  # it ran, was preempted, ran again (a dump's pause is shorter)
    assert len(compared) >= 2, accounted["windows"]
    assert all(abs(theirs - ours) <= 0.01 for theirs, ours in report), report
    assert min(ours for _, ours in report) < 0.9, "no window holds the preemption's gap"
    assert any(w["met"] is False for w in accounted["windows"]), "the preemption cost it no window"

    table = run_as("root", [CTL, "sla", "--tier", "standard", "--window", str(WINDOW_S)])
    assert table.returncode == 0 and f"{job_id:>8}  {job_user.pw_name}" in table.stdout, table.stdout
    assert "standard: " in table.stdout
    denied = run_as(job_user.pw_name, [CTL, "sla", str(job_id)])
    assert denied.returncode == 1
    assert "the SLA accounting is kept in the registry" in denied.stderr
    assert "permission denied" in denied.stderr

    # one controller decides at a time: a second one waits for the first's lease; the first serves
    # its metrics
    port = _free_port()
    first = subprocess.Popen([CONTROLLER, "--period", "2", "--metrics-port", str(port)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        metrics = _scrape(port, lambda text: "singularity_controller_leader 1.0" in text
                          and 'singularity_sla_attainment{tier="standard"}' in text)
        assert "singularity_devices_idle " in metrics and "singularity_checkpoints_total" in metrics, metrics
        second = subprocess.run([CONTROLLER, "--once"], capture_output=True, text=True, timeout=60)
        assert second.returncode == 1 and "holds the lease; not deciding" in second.stderr, second.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=60)
    assert registry.redis.get(keys.sla_leader()) is None  # released at its end
    registry.redis.srem(keys.sla_protected(), job_id)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _scrape(port: int, ready, timeout: float = 60) -> str:
    """The controller's metrics, once `ready` holds for them (its first look at the cluster done)."""
    import urllib.request

    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                text = reply.read().decode()
            if ready(text):
                return text
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the controller's metrics never became ready: {text[-3000:]}")
