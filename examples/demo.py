"""`make demo`: SLA tiers and preemption on the local dev cluster.

A basic-tier job takes every GPU of the cluster; a premium job arrives and preempts it. The basic job
is warned with the preemption signal, requeued, and starts again once the GPUs are free. The demo
prints both jobs' tiers, states and restart counts at every step.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import time
from pathlib import Path

from singularity_slurm import config as config_mod
from singularity_slurm.slurm_plugin.slurm import SlurmClient

USER = os.environ.get("SINGULARITY_DEVCLUSTER_USER", "jobuser")
CTL = str(config_mod.load().paths.prefix / "venv" / "bin" / "singularityctl")

BASIC = """#!/bin/bash
#SBATCH --singularity-sla=basic
#SBATCH --job-name=train-basic
#SBATCH --nodes=2 --gres=gpu:4
#SBATCH -o basic-%j.out
on_warning() {
  echo "[train] preemption warning (SIG$1): requeueing"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
}
trap 'on_warning USR2' USR2
echo "[train] start: nodes=$SLURM_JOB_NODELIST tier=$SINGULARITY_SLA restart=${SLURM_RESTART_COUNT:-0}"
step=0
while true; do step=$((step + 1)); echo "[train] step $step"; sleep 1; done
"""

PREMIUM = """#!/bin/bash
#SBATCH --singularity-sla=premium
#SBATCH --job-name=urgent-premium
#SBATCH --gres=gpu:4
#SBATCH -o premium-%j.out
echo "[premium] running on $(hostname) with GPUs $CUDA_VISIBLE_DEVICES"
sleep 15
echo "[premium] done"
"""


def say(message: str) -> None:
    print(f"\n=== {message}", flush=True)


def show_status(*job_ids: int) -> None:
    proc = subprocess.run([CTL, "status"], capture_output=True, text=True)
    lines = proc.stdout.splitlines()
    keep = [lines[0]] + [ln for ln in lines[1:] if ln.split()[0] in {str(j) for j in job_ids}]
    print("\n".join("    " + ln for ln in keep), flush=True)


def wait(slurm: SlurmClient, job_id: int, check, what: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        record = slurm.job(job_id) or {}
        if check(record):
            return record
        if time.monotonic() > deadline:
            sys.exit(f"demo: job {job_id} did not become {what} within {timeout:.0f}s: {record}")
        time.sleep(0.5)


def submit(workdir: Path, name: str, text: str) -> int:
    script = workdir / name
    script.write_text(text)
    shutil.chown(script, USER)
    proc = subprocess.run(["runuser", "-u", USER, "--", "env", "-C", str(workdir), "sbatch",
                           "--parsable", str(script)], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"demo: sbatch failed: {proc.stderr.strip()}")
    return int(proc.stdout.strip().split(";")[0])


def main() -> int:
    slurm = SlurmClient()
    user = pwd.getpwnam(USER)
    workdir = Path(user.pw_dir) / "demo"
    workdir.mkdir(exist_ok=True)
    shutil.chown(workdir, USER)

    say(f"1. {USER} submits a basic-tier training job that takes all 8 GPUs (2 nodes x 4)")
    basic = submit(workdir, "train-basic.sh", BASIC)
    log = workdir / f"basic-{basic}.out"
    wait(slurm, basic, lambda r: log.exists() and "[train] step 2" in log.read_text(), "training")
    show_status(basic)

    say(f"2. {USER} submits a premium job that needs 4 GPUs: Slurm preempts the basic job")
    started = time.monotonic()
    premium = submit(workdir, "urgent-premium.sh", PREMIUM)
    record = wait(slurm, basic, lambda r: int(r.get("Restarts", 0)) >= 1, "requeued")
    wait(slurm, premium, lambda r: r.get("JobState") in {"RUNNING", "COMPLETED"}, "RUNNING")
    print(f"    basic job {basic} requeued {time.monotonic() - started:.1f}s after the premium "
          f"job arrived; it now waits: {record.get('JobState')} ({record.get('Reason')})")
    show_status(basic, premium)
    print("\n    basic job output so far:")
    for line in log.read_text().splitlines()[-4:]:
        print(f"      {line}")

    say("3. the premium job finishes; the basic job starts again (restart count 1)")
    slurm.release_start(basic)  # root removes Slurm's 121 s requeue wait
    wait(slurm, premium, lambda r: r.get("JobState") == "COMPLETED", "COMPLETED", 60)
    wait(slurm, basic, lambda r: r.get("JobState") == "RUNNING", "RUNNING again", 60)
    time.sleep(2)
    show_status(basic, premium)
    print("\n    basic job output (one file across the requeue; steps elided):")
    for line in log.read_text().splitlines():
        if "[train] step" not in line:
            print(f"      {line}")

    subprocess.run(["scancel", str(basic)], check=False)
    say(f"done: job {basic} (basic) was preempted by job {premium} (premium), requeued and "
        "restarted. Outputs are in " + str(workdir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
