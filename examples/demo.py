"""`make demo`: an unmodified PyTorch training job survives preemption by a premium job.

1. A basic-tier training job (examples/train_reference.py: no checkpoint code at all) starts under
   `singularityctl run`.
2. A premium job arrives that needs the same node. Slurm warns the basic job; Singularity
   checkpoints it with CRIU into the deduplicated store and requeues it.
3. The basic job resumes on the other node at exactly the step where it stopped, and finishes.
4. Its training log is compared with an undisturbed run of the same script: byte for byte.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from singularity_slurm import config as config_mod
from singularity_slurm.slurmcli import SlurmClient

USER = os.environ.get("SINGULARITY_DEVCLUSTER_USER", "jobuser")
BIN = config_mod.load().paths.prefix / "venv" / "bin"
CTL, PYTHON = str(BIN / "singularityctl"), str(BIN / "python")
STEPS = 300
EXAMPLE = Path(__file__).with_name("train_reference.py")

TRAIN = f"""#!/bin/bash
#SBATCH --singularity-sla=basic
#SBATCH --job-name=train-basic
#SBATCH --gres=gpu:4
#SBATCH -o train-%j.out
singularityctl run -- python train_reference.py --steps {STEPS} --sleep 0.1
"""

PREMIUM = """#!/bin/bash
#SBATCH --singularity-sla=premium
#SBATCH --job-name=urgent-premium
#SBATCH --gres=gpu:4
#SBATCH -o premium-%j.out
echo "[premium] running on $SLURMD_NODENAME with GPUs $CUDA_VISIBLE_DEVICES"
sleep 10
"""


def say(message: str) -> None:
    print(f"\n=== {message}", flush=True)


def show(*argv: str) -> None:
    out = subprocess.run(argv, capture_output=True, text=True).stdout.rstrip()
    print("\n".join("    " + line for line in out.splitlines()), flush=True)


def wait(check, what: str, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            sys.exit(f"demo: gave up after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


def submit(workdir: Path, name: str, text: str, *options: str) -> int:
    script = workdir / name
    script.write_text(text)
    shutil.chown(script, USER)
    # The user's shell has Singularity's venv on PATH (`singularityctl`, and a `python` with torch).
    proc = subprocess.run(["runuser", "-u", USER, "--", "env", "-C", str(workdir),
                           f"PATH={BIN}:/usr/bin:/bin", "sbatch", "--parsable", *options, str(script)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"demo: sbatch failed: {proc.stderr.strip()}")
    return int(proc.stdout.strip().split(";")[0])


def steps(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"^step (\d+) ", text, re.M)]


def training_log(text: str) -> str:
    """The job's own lines: without the launcher's and Slurm's notices of the requeue (slurmstepd's
    "CANCELLED DUE TO JOB REQUEUE", and srun's report on the launcher step it ended)."""
    return "".join(line for line in text.splitlines(keepends=True)
                   if not line.startswith(("[singularity]", "slurmstepd", "srun:")))


def main() -> int:
    slurm = SlurmClient()
    user = pwd.getpwnam(USER)
    workdir = Path(user.pw_dir) / "demo"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir()
    shutil.copy(EXAMPLE, workdir)
    for path in (workdir, workdir / EXAMPLE.name):
        shutil.chown(path, USER)

    say(f"0. reference: {USER} runs train_reference.py undisturbed (no Slurm), for comparison")
    reference = subprocess.run(["runuser", "-u", USER, "--", PYTHON, EXAMPLE.name, "--steps", str(STEPS),
                                "--sleep", "0"], cwd=workdir, capture_output=True, text=True, check=True)
    print(f"    {len(steps(reference.stdout))} steps, last line: {reference.stdout.splitlines()[-2]}")

    say(f"1. {USER} submits the same script as a basic-tier job: singularityctl run -- python "
        "train_reference.py")
    job = submit(workdir, "train.sh", TRAIN)
    log = workdir / f"train-{job}.out"
    wait(lambda: log.exists() and len(steps(log.read_text())) >= 40, "the job to train")
    node = (slurm.job(job) or {}).get("NodeList")
    print(f"    job {job} trains on {node}")
    show(CTL, "status", str(job))

    say(f"2. a premium job arrives that needs {node}: Slurm preempts the basic job")
    premium = submit(workdir, "urgent.sh", PREMIUM, f"--nodelist={node}")
    submitted = time.monotonic()
    wait(lambda: "requeued" in log.read_text(), "the checkpoint and requeue")
    before = steps(log.read_text())
    checkpointed = time.monotonic() - submitted
    wait(lambda: "restored checkpoint" in log.read_text(), "the restore")
    wait(lambda: len(steps(log.read_text())) > len(before), "the first step after the restore")
    resumed = time.monotonic() - submitted
    record = slurm.job(job) or {}
    text = log.read_text()
    for line in text.splitlines():
        if line.startswith("[singularity]"):
            print(f"    {line}")
    after = steps(text)[len(before)]
    print(f"\n    last step before preemption: {before[-1]}; first step after restore: {after} "
          f"(on {record.get('NodeList')}, restart {record.get('Restarts')})")
    print(f"    premium job {premium} arrived -> basic job checkpointed and requeued in {checkpointed:.1f}s "
          f"-> training again in {resumed:.1f}s")

    say("3. the basic job finishes on the other node")
    wait(lambda: (slurm.job(job) or {}).get("JobState") == "COMPLETED", "the job to finish", 300)
    show(CTL, "status", str(job))

    say("4. evidence")
    identical = training_log(log.read_text()) == reference.stdout
    print(f"    training log of job {job} (minus the [singularity] and Slurm lines) is "
          f"{'byte-identical to' if identical else 'DIFFERENT from'} the undisturbed run: "
          f"{len(steps(training_log(log.read_text())))} steps, none lost or repeated")
    print(f"    outputs are in {workdir}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
