"""Attacks on the root side's environment and identity, run as the real job users.

(a) A job whose PATH starts with trojan `unshare`, `setsid`, `sh`, `mount`, `setpriv`, `criu`,
    `scontrol`, `python3` and whose LD_PRELOAD names a library of the user's: it is checkpointed,
    migrated (dump, requeue, restore on another node) and completes, and nothing of the user's ran as
    root.
(b) A job that forges its identity: a start request naming another user's job, job steps whose
    environment names another node, a path-escaping node name, a premium partition and a restart
    count, and a launcher with a forged node name. Nothing is created under paths built from the
    forged values, the other job's file log keeps its owner and content, and the job still runs.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import CTL, Jobs, run_as

from singularity_slurm.coordinator import keys
from singularity_slurm.node import localfiles

PYTHON = str(Path(CTL).with_name("python"))
TROJANS = ("unshare", "setsid", "sh", "mount", "setpriv", "criu", "scontrol", "python3")
TROJAN = """#!/bin/sh
echo "{name} uid=$(/usr/bin/id -u) pid=$$" >> {markers}/trojans
exec {real} "$@"
"""
PRELOAD_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

__attribute__((constructor)) static void mark_root(void)
{
    char line[128];
    int fd, n;

    fd = open(geteuid() == 0 ? "MARKERS/preload-as-root" : "MARKERS/preload-as-user",
          O_WRONLY | O_CREAT | O_APPEND, 0666);
    if (fd < 0)
        return;
    n = snprintf(line, sizeof(line), "pid %d\n", (int) getpid());
    if (write(fd, line, (size_t) n) < 0)
        n = 0;
    close(fd);
}
"""
COUNTER = """import time
for step in range(1, 61):
    print("step", step, flush=True)
    time.sleep(0.25)
print("done", flush=True)
"""
EXPECTED = "".join(f"step {n}\n" for n in range(1, 61)) + "done\n"


def job_lines(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True)
                   if not line.startswith(("[singularity]", "slurmstepd", "srun:")))


def _own(path: Path, user: str) -> None:
    shutil.chown(path, user, user)


def test_trojans_in_path_and_a_hostile_ld_preload_never_run_as_root(jobs, job_user):
    user = job_user.pw_name
    trojan_dir = jobs.workdir / "bin"
    markers = jobs.workdir / "markers"
    for folder in (trojan_dir, markers):
        folder.mkdir()
        _own(folder, user)
    markers.chmod(0o777)  # whoever runs a trojan, as whatever uid, can leave its mark
    for name in TROJANS:
        real = shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin") or "/bin/false"
        path = trojan_dir / name
        path.write_text(TROJAN.format(name=name, markers=markers, real=real))
        path.chmod(0o755)
        _own(path, user)
    source = jobs.workdir / "preload.c"
    source.write_text(PRELOAD_C.replace("MARKERS", str(markers)))
    library = trojan_dir / "libhostile.so"
    built = run_as(user, ["gcc", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror", "-o", str(library),
                          str(source)], cwd=jobs.workdir)
    assert built.returncode == 0, built.stderr
    jobs.script("counter.py", COUNTER)
    job_id = jobs.submit(jobs.script("trojan.sh", f"""#!/bin/bash
#SBATCH --singularity-sla=basic
#SBATCH --gres=gpu:1
#SBATCH -o trojan.out
export PATH={trojan_dir}:$PATH
export LD_PRELOAD={library}
{CTL} run -- {PYTHON} counter.py
"""))
    log = jobs.wait_for_file("trojan.out")
    jobs.wait(job_id, lambda r: "step 8\n" in log.read_text(), "printing step 8", timeout=120)

    checkpoint = run_as(user, [CTL, "checkpoint", str(job_id)])
    assert checkpoint.returncode == 0, checkpoint.stderr + log.read_text()
    first_node = jobs.record(job_id)["NodeList"]
    migrate = run_as(user, [CTL, "migrate", str(job_id), "--no-wait"])
    assert migrate.returncode == 0, migrate.stderr
    jobs.wait(job_id, lambda r: "restored checkpoint" in log.read_text(), "restored", timeout=180)
    jobs.wait_state(job_id, "COMPLETED", timeout=120)

    text = log.read_text()
    assert jobs.record(job_id)["NodeList"] != first_node
    assert job_lines(text).endswith(EXPECTED) and "step 1\n" in text, text
    trojans = (markers / "trojans").read_text() if (markers / "trojans").exists() else ""
    as_root = [line for line in trojans.splitlines() if " uid=0 " in line]
    assert as_root == [], trojans
    assert not (markers / "preload-as-root").exists(), (markers / "preload-as-root").read_text()
    # The attack was live: the job's environment, LD_PRELOAD included, reached the user's processes.
    assert (markers / "preload-as-user").exists()


@pytest.fixture
def other_jobs(cluster) -> Iterator[Jobs]:
    """Jobs of the second job user, from a folder of its own."""
    name = "jobuser2"
    if subprocess.run(["id", name], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", name], check=True)
    entry = pwd.getpwnam(name)
    workdir = Path(entry.pw_dir) / "tests" / uuid.uuid4().hex[:8]
    workdir.mkdir(parents=True)
    for path in (workdir.parent, workdir):
        os.chown(path, entry.pw_uid, entry.pw_gid)
    from singularity_slurm.slurmcli import SlurmClient

    jobs = Jobs(name, workdir, SlurmClient())
    yield jobs
    jobs.cancel_all()
    shutil.rmtree(workdir, ignore_errors=True)


FORGE = """import json, sys
sock_path, other = sys.argv[1], sys.argv[2]

def ask(request):
    from singularity_slurm import rpc
    try:
        return rpc.call(sock_path, request, timeout=30)
    except rpc.RpcError as exc:
        return rpc.error_reply(exc)

env = {"PATH": "/usr/bin:/bin", "SINGULARITY_JOB_ID": other, "SLURM_JOB_ID": other}
print("forged start:", json.dumps(ask({"op": "start", "argv": ["/bin/true"], "cwd": "/tmp",
                                       "output": "/dev/null", "env": env})), flush=True)
print("forged status:", json.dumps(ask({"op": "status", "job_id": int(other)})), flush=True)
"""


def test_forged_identity_in_requests_and_step_environments_changes_nothing(jobs, other_jobs, config,
                                                                            registry):
    state_dir = config.paths.state_dir
    victim = other_jobs.submit(other_jobs.script("victim.sh", f"""#!/bin/bash
#SBATCH --singularity-sla=basic
#SBATCH --gres=gpu:1
#SBATCH -o victim.out
{CTL} run -- sleep 300
"""))
    victim_log = localfiles.log_path(config.paths.filelog_dir, victim)
    other_jobs.wait(victim, lambda r: victim_log.exists(), "starting its tree", timeout=120)
    before = victim_log.parent.stat(), victim_log.stat(), victim_log.read_bytes()

    tag = uuid.uuid4().hex[:8]
    evil = f"../../../tmp/evil-{tag}"
    escaped = Path(f"/tmp/evil-{tag}")
    jobs.script("forge.py", FORGE)
    job_id = jobs.submit(jobs.script("forged.sh", f"""#!/bin/bash
#SBATCH --singularity-sla=basic
#SBATCH --gres=gpu:1
#SBATCH --nodelist=n1
#SBATCH -o forged.out
{PYTHON} forge.py {state_dir}/$SLURMD_NODENAME/$SLURM_JOB_ID/agent.sock {victim}
SLURMD_NODENAME={evil} SLURM_JOB_PARTITION=premium SLURM_RESTART_COUNT=7 SINGULARITY_JOB_ID={victim} \\
    srun --overlap -n1 true; echo "step with an escaping node name: $?"
SLURMD_NODENAME=n2 SLURM_JOB_PARTITION=premium SLURM_RESTART_COUNT=7 srun --overlap -n1 true
echo "step with another node's name: $?"
SLURMD_NODENAME={evil} {CTL} run -- echo never; echo "launcher with an escaping node name: $?"
SINGULARITY_JOB_ID={victim} {CTL} run -- {PYTHON} -c 'print("the job ran")'
"""))
    log = jobs.wait_for_file("forged.out")
    jobs.wait_state(job_id, "COMPLETED", "FAILED", timeout=120)

    text = log.read_text()
    assert (f'forged start: {{"ok": false, "error": "start: the request\'s environment names job {victim}, '
            f"but this agent serves job {job_id}") in text, text
    assert (f'forged status: {{"ok": false, "error": "this agent serves job {job_id}, not job {victim}'
            in text), text
    assert "step with an escaping node name: 0" in text, text
    assert "step with another node's name: 0" in text, text
    assert "\nnever\n" not in text, text
    assert "launcher with an escaping node name: 0" not in text, text
    assert "the job ran\n" in text, text
    # Nothing was built from the forged values.
    assert not escaped.exists()
    assert not (state_dir / "n2" / str(job_id)).exists()
    assert registry.redis.smembers(keys.job_nodes(job_id)) in (set(), {"n1"}), \
        registry.redis.smembers(keys.job_nodes(job_id))
    record = registry.redis.hgetall(keys.job(job_id))
    assert record.get("restart_count", "0") == "0" and record.get("partition", "basic") == "basic", record
    # The other user's job and its file log are untouched.
    after = victim_log.parent.stat(), victim_log.stat(), victim_log.read_bytes()
    assert [(s.st_uid, s.st_gid, s.st_mode) for s in after[:2]] == [
        (s.st_uid, s.st_gid, s.st_mode) for s in before[:2]]
    assert after[0].st_uid == pwd.getpwnam("jobuser2").pw_uid
    assert after[2] == before[2]
    assert other_jobs.record(victim)["JobState"] == "RUNNING"


def test_ensure_mode_reads_node_gpus_partition_and_restarts_from_slurm(jobs, config, job_user):
    """What the SPANK plugin's items and Slurm's records give the Prolog's --ensure mode, for the batch
    step and an srun step of a real job, is what slurmd gave the job itself: not what the job's own
    comment imitates (scontrol's one-line record prints it after Slurm's fields)."""
    from singularity_slurm.prolog.main import ensure_context
    from singularity_slurm.slurmcli import SlurmClient

    job_id = jobs.submit(jobs.script("steps.sh", """#!/bin/bash
#SBATCH --singularity-sla=basic
#SBATCH --gres=gpu:2
#SBATCH --nodelist=n2
#SBATCH -o steps.out
echo "gpus=$SLURM_JOB_GPUS node=$SLURMD_NODENAME"
srun --overlap -n1 -J "sleeper NodeList=n1" sleep 60
"""), "--comment=mine BatchHost=n1 NodeList=n1 Partition=premium Restarts=5")
    log = jobs.wait_for_file("steps.out")
    jobs.wait(job_id, lambda r: "gpus=" in log.read_text(), "printing its GPUs")
    slurm = SlurmClient()
    jobs.wait(job_id, lambda r: slurm.step(job_id, 0) is not None, "running step 0")
    line = next(x for x in log.read_text().splitlines() if x.startswith("gpus="))
    gpus = line.split()[0].removeprefix("gpus=").split(",")
    assert slurm.job(job_id)["BatchHost"] == "n1"  # what the comment makes scontrol's line read as
    assert slurm.step(job_id, 0)["NodeList"] == "n1"  # and the step's name its step line
    items = {"SLURM_JOB_ID": str(job_id), "SLURM_JOB_UID": str(job_user.pw_uid), "SLURM_NODEID": "0"}

    for step in ("4294967291", "0"):
        job = ensure_context({**items, "SLURM_STEP_ID": step}, config, slurm)
        assert (job.node, job.gpus, job.partition, job.tier, job.restart_count, job.user) == (
            "n2", gpus, "basic", "basic", 0, job_user.pw_name), (step, line)
