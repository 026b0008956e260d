"""Tier preemption on the real cluster: premium takes the GPUs, basic is signalled and requeued."""

from __future__ import annotations

from conftest import ctl_json

# Takes every GPU of both nodes and runs a job step, as the launcher does; the batch shell and the
# step each record the signal they are warned with, then requeue the job the way the launcher does
# after a checkpoint.
VICTIM = """#!/bin/bash
#SBATCH --singularity-sla=basic
#SBATCH --nodes=2 --gres=gpu:4
#SBATCH -o victim-%j.out
on_signal() { echo "$1 signal $2"; scontrol requeue "$SLURM_JOB_ID"; exit 0; }
for s in URG USR1 USR2 TERM; do trap "on_signal batch $s" $s; done
echo "start restart=${SLURM_RESTART_COUNT:-0}"
srun --overlap --nodes=1 --ntasks=1 bash -c '
on_signal() { echo "$1 signal $2"; scontrol requeue "$SLURM_JOB_ID"; exit 0; }
for s in URG USR1 USR2 TERM; do trap "on_signal step $s" $s; done
echo "step started"
for i in $(seq 1 600); do sleep 1; done' &
wait
"""

PREMIUM = """#!/bin/bash
#SBATCH --singularity-sla=premium
#SBATCH --gres=gpu:4
#SBATCH -o premium-%j.out
echo premium; sleep 20
"""


def _preempt(jobs, *victim_options: str) -> tuple[int, int, str]:
    victim = jobs.submit(jobs.script("victim.sh", VICTIM), *victim_options)
    log = jobs.wait_for_file(f"victim-{victim}.out")
    jobs.wait(victim, lambda r: "step started" in log.read_text(), "started (traps set)")
    premium = jobs.submit(jobs.script("premium.sh", PREMIUM))
    jobs.wait_state(premium, "RUNNING", timeout=60)
    record = jobs.wait(victim, lambda r: int(r.get("Restarts", 0)) >= 1, "requeued", timeout=60)
    # requeued, not ended (COMPLETING: the requeue's Epilog still runs on one of its nodes)
    assert record["JobState"] in {"COMPLETING", "PENDING", "REQUEUED", "CONFIGURING", "RUNNING"}
    jobs.wait(victim, lambda r: "signal" in log.read_text(), "told of the preemption", 30)
    return victim, premium, log.read_text()


def test_premium_job_preempts_basic_job_which_gets_the_default_signal_and_is_requeued(jobs):
    victim, premium, output = _preempt(jobs)
    assert "start restart=0" in output
    # The warning goes to the job's steps (the launcher is one), never to the batch shell. (The
    # batch shell's SIGTERM from the requeue may be written before srun relays the step's line.)
    assert "step signal URG" in output
    assert "batch signal URG" not in output
    status = {j["job_id"]: j for j in ctl_json("status")}
    assert status[victim]["tier"] == "basic"
    assert status[victim]["restart_count"] >= 1
    assert status[premium]["tier"] == "premium"
    assert status[premium]["state"] == "RUNNING"


def test_a_job_that_sets_its_own_signal_keeps_it(jobs):
    _, _, output = _preempt(jobs, "--signal=B:USR1@15")
    assert "batch signal USR1" in output
    assert "step signal USR1" not in output
    assert "signal URG" not in output
