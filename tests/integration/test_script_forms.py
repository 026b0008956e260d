"""Batch scripts as users write them, preempted by premium jobs on the real cluster.

The warning signal must reach the launcher whatever the script looks like: bash or sh, a login
shell, `set -e` with lines before and after `singularityctl run`, `sbatch --wrap`, `srun
singularityctl run`, several `run` lines. None of them uses `exec`, and the README's own example is
run exactly as printed. Each training log must be byte-identical to an undisturbed run's.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import CTL, run_as

BIN = Path(CTL).parent
EXAMPLE = Path(__file__).parents[2] / "examples" / "train_reference.py"
README = Path(__file__).parents[2] / "README.md"

# The user's train.py of the README's example: the reference workload, 30 steps an epoch.
TRAIN_PY = """import runpy, sys
epochs = int(sys.argv[sys.argv.index("--epochs") + 1])
sys.argv = ["train_reference.py", "--steps", str(30 * epochs), "--sleep", "{sleep}"]
runpy.run_path("train_reference.py", run_name="__main__")
"""
HEADER = """#SBATCH --singularity-sla=basic
#SBATCH --gres=gpu:1
#SBATCH -o {name}.out
"""
COMMAND = "singularityctl run -- python train.py --epochs 10"
FORMS = {
    "sh": "#!/bin/sh\n{header}" + COMMAND + "\n",
    # A login shell reads the profile, which resets PATH: the user activates their venv again.
    "login": "#!/bin/bash -l\n{header}source " + str(BIN / "activate") + "\n" + COMMAND + "\n",
    "set-e": "#!/bin/bash\n{header}set -e\necho before\n" + COMMAND + "\necho after\n",
    "srun": "#!/bin/bash\n{header}srun " + COMMAND + "\n",
    "runs": ("#!/bin/bash\n{header}singularityctl run -- python -c 'print(\"run A\")'\n" + COMMAND
             + "\necho all runs done\n"),
}
EXTRA_LINES = {"before", "after", "run A", "all runs done"}
URGENT = """#!/bin/bash
#SBATCH --singularity-sla=premium
#SBATCH --gres=gpu:4
#SBATCH -o urgent-%j.out
sleep 3
"""


def training_log(text: str) -> str:
    """The training's own lines: the launcher's, Slurm's and the scripts' other lines removed."""
    return "".join(line for line in text.splitlines(keepends=True)
                   if not line.startswith(("[singularity]", "slurmstepd", "srun:"))
                   and line.rstrip("\n") not in EXTRA_LINES)


def readme_example() -> str:
    """The batch script of the README's "For users" section, as printed."""
    section = README.read_text().split("## For users", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S)[1]


@pytest.fixture(scope="module")
def reference_log() -> str:
    work = Path("/home/jobuser/tests/reference-forms")
    work.mkdir(parents=True, exist_ok=True)
    shutil.copy(EXAMPLE, work)
    proc = run_as("jobuser", [str(BIN / "python"), "train_reference.py", "--steps", "300", "--sleep", "0"],
                  cwd=work)
    shutil.rmtree(work, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _prepare(jobs, sleep: float = 0.1) -> None:
    """The user's train.py; `sleep` (seconds per step) stretches the training, not its log."""
    shutil.copy(EXAMPLE, jobs.workdir)
    (jobs.workdir / "train.py").write_text(TRAIN_PY.format(sleep=sleep))
    for name in ("train.py", "train_reference.py"):
        shutil.chown(jobs.workdir / name, jobs.user)


def _sbatch(jobs, *args: str) -> int:
    """sbatch as the job user whose PATH has singularityctl and a python with torch (a venv)."""
    proc = run_as(jobs.user, ["env", f"PATH={BIN}:/usr/bin:/bin", "sbatch", "--parsable", *args],
                  cwd=jobs.workdir)
    assert proc.returncode == 0, proc.stderr
    jobs.ids.append(int(proc.stdout.strip().split(";")[0]))
    return jobs.ids[-1]


def _wait_for(jobs, job_id: int, log: Path, text: str, count: int = 1, timeout: float = 180) -> None:
    jobs.wait(job_id, lambda r: log.exists() and log.read_text().count(text) >= count,
              f"printing {text!r} x{count}", timeout=timeout)


def _preempt_node(jobs, node: str, victims: dict[int, Path], restores_before: int = 0) -> None:
    urgent = jobs.submit(jobs.script(f"urgent-{node}.sh", URGENT), f"--nodelist={node}")
    for job_id, log in victims.items():
        _wait_for(jobs, job_id, log, "restored checkpoint", restores_before + 1)
    jobs.wait_state(urgent, "COMPLETED")


def test_the_readme_example_as_printed_survives_preemptions_a_drain_a_migration_and_scontrol_requeue(
        jobs, reference_log):
    _prepare(jobs, sleep=0.15)  # still running when the drain is seen, and after the migration
    script = readme_example()
    assert script.rstrip().endswith("singularityctl run -- python train.py --epochs 10")
    job_id = _sbatch(jobs, str(jobs.script("train.sh", script)))
    record = jobs.wait_state(job_id, "RUNNING")
    log = jobs.workdir / f"train-{job_id}.out"
    _wait_for(jobs, job_id, log, "step 20 ")

    _preempt_node(jobs, record["NodeList"], {job_id: log})
    _wait_for(jobs, job_id, log, "step ", count=120)
    _preempt_node(jobs, jobs.record(job_id)["NodeList"], {job_id: log}, restores_before=1)
    _wait_for(jobs, job_id, log, "step ", count=180)

    # An admin drains the node it runs on, as for maintenance: the job moves off it by itself.
    drained = jobs.record(job_id)["NodeList"]
    subprocess.run(["scontrol", "update", f"NodeName={drained}", "State=DRAIN", "Reason=disk swap"],
                   check=True, timeout=30)
    try:
        _wait_for(jobs, job_id, log, "restored checkpoint", count=3, timeout=120)
    finally:
        subprocess.run(["scontrol", "update", f"NodeName={drained}", "State=RESUME"], check=True, timeout=30)
    _wait_for(jobs, job_id, log, "step ", count=200)

    # An admin moves it: root's request reaches the job's agent through Redis, signed with munge.
    before = jobs.record(job_id)["NodeList"]
    assert before != drained
    proc = subprocess.run([CTL, "migrate", str(job_id)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"runs again on {drained}" in proc.stdout

    # An admin requeues it the Slurm way: every process of the job gets SIGTERM at once, and the
    # launcher checkpoints the training (out of that signal's reach) before Slurm's KillWait is over.
    _wait_for(jobs, job_id, log, "step ", count=230)
    subprocess.run(["scontrol", "requeue", str(job_id)], check=True, timeout=30)
    _wait_for(jobs, job_id, log, "restored checkpoint", count=5, timeout=120)
    record = jobs.wait_state(job_id, "COMPLETED", timeout=240)

    text = log.read_text()
    assert training_log(text) == reference_log  # no step lost, none done twice
    assert text.count("preemption warning (SIGURG): checkpointing") == 2
    assert text.count("migration requested") == 1
    assert text.count(f"{drained} draining (disk swap [root@") == 1
    assert text.count("Slurm is requeueing the job (scontrol requeue): checkpointing") == 1
    assert "(requeue, taken on" in text.rsplit("restored checkpoint", 1)[1]
    assert text.count("restored checkpoint") == 5
    assert record["ExitCode"] == "0:0"
    assert int(record["Restarts"]) == 5


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The most of these (start, end) intervals that overlap at any moment."""
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    most = now = 0
    for _, step in edges:  # an end sorts before a start at the same moment
        now += step
        most = max(most, now)
    return most


def test_every_script_form_is_checkpointed_requeued_and_completes_identically(jobs, reference_log, registry,
                                                                              config):
    _prepare(jobs, sleep=0.3)  # the second node's jobs must still run once the first node's restored
    ids: dict[str, int] = {}
    for name, form in FORMS.items():
        script = jobs.script(f"{name}.sh", form.format(header=HEADER.format(name=name)))
        ids[name] = _sbatch(jobs, str(script))
    ids["wrap"] = _sbatch(jobs, "--singularity-sla=basic", "--gres=gpu:1", "-o", "wrap.out", "--wrap",
                          COMMAND)
    failing = _sbatch(jobs, str(jobs.script("status.sh", "#!/bin/bash\n" + HEADER.format(name="status")
                                            + "singularityctl run -- sh -c 'exit 3'\n")))
    logs = {name: jobs.workdir / f"{name}.out" for name in ids}
    for name, job_id in ids.items():
        _wait_for(jobs, job_id, logs[name], "step 20 ")

    by_node: dict[str, dict[int, Path]] = {}
    for name, job_id in ids.items():
        by_node.setdefault(jobs.record(job_id)["NodeList"], {})[job_id] = logs[name]
    for node in sorted(by_node):  # one node at a time: its jobs are dumped side by side
        still_there = {j: log for j, log in by_node[node].items() if jobs.record(j)["NodeList"] == node}
        _preempt_node(jobs, node, still_there, restores_before=0)

    for name, job_id in ids.items():
        record = jobs.wait_state(job_id, "COMPLETED", timeout=240)
        text = logs[name].read_text()
        assert training_log(text) == reference_log, name
        assert "preemption warning (SIGURG): checkpointing" in text, name
        assert record["ExitCode"] == "0:0", name
        assert int(record["Restarts"]) >= 1, name
    assert jobs.wait_state(failing, "FAILED")["ExitCode"] == "3:0"

    # A node's jobs, preempted at once, were dumped and stored in its dump slots: never more at once
    # than preemption.concurrent_dumps (the registry's spans of each committed checkpoint lie within
    # the slot it held; see node.dumpgate). A checkpoint that waited says so in the job's output.
    spans: dict[str, list[tuple[float, float]]] = {}
    for job_id in ids.values():
        for event in registry.job(job_id)["events"]:
            if event["event"] == "checkpoint" and event.get("stop"):
                spans.setdefault(event["node"], []).append((event["time"] - event["seconds"], event["time"]))
    slots = config.preemption.concurrent_dumps
    assert slots and spans
    for node, held in spans.items():
        assert most_at_once(held) <= slots, (node, held)
    for name, job_id in ids.items():
        waits = [e for e in registry.job(job_id)["events"] if (e.get("waited_seconds") or 0) >= 0.05]
        assert logs[name].read_text().count("for a dump slot of the node") == len(waits), name

    set_e = logs["set-e"].read_text()
    assert set_e.count("after") == 1 and set_e.rstrip().endswith("after")
    runs = logs["runs"].read_text()
    assert runs.count("run A\n") == 1
    assert "run 0 (python -c print(\"run A\")) finished before the requeue with status 0" in runs
    assert runs.count("all runs done") == 1 and runs.rstrip().endswith("all runs done")


def test_a_premium_job_arriving_at_any_moment_of_the_start_requeues_the_job_which_completes_identically(
        jobs, reference_log):
    """Premium jobs 1, 3 and 10 s after the basic job starts (Prolog, launcher start, training), then
    one while it restores: it is requeued each time and never ends FAILED."""
    _prepare(jobs, sleep=0.3)  # long enough to be running still after four requeues
    script = "#!/bin/bash\n" + HEADER.format(name="anytime").replace("gpu:1", "gpu:4") + COMMAND + "\n"
    job_id = _sbatch(jobs, str(jobs.script("anytime.sh", script)))
    log = jobs.workdir / "anytime.out"

    def running_again(restarts: int) -> dict[str, str]:
        return jobs.wait(job_id, lambda r: r["JobState"] == "RUNNING" and int(r["Restarts"]) == restarts,
                         f"running (restart {restarts})", timeout=240)

    for restarts, delay in enumerate((1.0, 3.0, 10.0)):
        node = running_again(restarts)["NodeList"]
        time.sleep(delay)  # the moment of the job's life the premium job arrives at is the test
        urgent = jobs.submit(jobs.script(f"urgent-{restarts}.sh", URGENT), f"--nodelist={node}")
        jobs.wait(job_id, lambda r, n=restarts: int(r["Restarts"]) > n, "requeued", timeout=120)
        jobs.wait_state(urgent, "COMPLETED")

    node = running_again(3)["NodeList"]
    _wait_for(jobs, job_id, log, "restart 3: restoring the last checkpoint")
    urgent = jobs.submit(jobs.script("urgent-restore.sh", URGENT), f"--nodelist={node}")
    jobs.wait(job_id, lambda r: int(r["Restarts"]) > 3, "requeued during its restore", timeout=120)
    jobs.wait_state(urgent, "COMPLETED")
    record = jobs.wait_state(job_id, "COMPLETED", timeout=300)

    assert training_log(log.read_text()) == reference_log
    assert record["ExitCode"] == "0:0"
