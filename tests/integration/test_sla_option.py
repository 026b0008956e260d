"""The `--singularity-sla` option end to end: SPANK plugin, job-submit policy, prolog, status."""

from __future__ import annotations

import json
import subprocess

from conftest import CTL, ctl_json, run_as

ENV_DUMP = """#!/bin/bash
{directives}
echo "SINGULARITY_SLA=$SINGULARITY_SLA"
echo "SLURM_SPANK_SINGULARITY_SLA=$SLURM_SPANK_SINGULARITY_SLA"
"""


def _job_count(slurm) -> int:
    return len(slurm.jobs())


def test_sbatch_help_lists_the_option():
    out = subprocess.run(["sbatch", "--help"], capture_output=True, text=True).stdout
    assert "--singularity-sla=TIER" in out
    assert "premium" in out and "basic" in out


def test_unknown_tier_is_refused_naming_the_valid_tiers_and_nothing_is_submitted(jobs, slurm):
    script = jobs.script("env.sh", ENV_DUMP.format(directives=""))
    before = _job_count(slurm)
    proc = jobs.sbatch(script, "--singularity-sla=gold")
    assert proc.returncode != 0
    assert "gold" in proc.stderr
    assert "valid tiers: premium, standard, basic" in proc.stderr
    assert _job_count(slurm) == before


def test_unknown_tier_in_sbatch_directive_is_refused(jobs, slurm):
    script = jobs.script("env.sh", ENV_DUMP.format(directives="#SBATCH --singularity-sla=Premium"))
    before = _job_count(slurm)
    proc = jobs.sbatch(script)
    assert proc.returncode != 0
    assert "valid tiers: premium, standard, basic" in proc.stderr
    assert _job_count(slurm) == before


def test_premium_directive_lands_in_premium_and_the_prolog_records_the_tier(jobs, registry, job_user):
    script = jobs.script("env.sh", ENV_DUMP.format(
        directives="#SBATCH --singularity-sla=premium\n#SBATCH --gres=gpu:2\n#SBATCH -o out.txt"))
    job_id = jobs.submit(script)
    record = jobs.wait_state(job_id, "COMPLETED")
    assert record["Partition"] == "premium"
    assert record["Requeue"] == "1"
    out = (jobs.workdir / "out.txt").read_text()
    assert "SINGULARITY_SLA=premium\n" in out
    assert "SLURM_SPANK_SINGULARITY_SLA=premium\n" in out

    status = ctl_json("status", str(job_id))
    assert status["job_id"] == job_id
    assert status["tier"] == "premium"
    assert status["user"] == job_user.pw_name
    assert status["state"] == "COMPLETED"
    assert status["registry"]["state"] == "ended"
    stored = registry.job(job_id)
    assert stored["tier"] == "premium"
    assert stored["user"] == job_user.pw_name
    assert stored["uid"] == job_user.pw_uid
    assert stored["restart_count"] == 0
    starts = [e for e in stored["events"] if e["event"] == "node_start"]
    assert len(starts) == 1


def test_job_without_the_option_gets_the_default_tier(jobs, registry, config):
    script = jobs.script("env.sh", ENV_DUMP.format(directives="#SBATCH -o out.txt"))
    job_id = jobs.submit(script)
    record = jobs.wait_state(job_id, "COMPLETED")
    default = config.default_tier
    assert record["Partition"] == config.tiers[default].partition
    assert record["Requeue"] == "1"
    assert f"SINGULARITY_SLA={default}\n" in (jobs.workdir / "out.txt").read_text()
    assert registry.job(job_id)["tier"] == default
    assert ctl_json("status", str(job_id))["tier"] == default


def test_option_conflicting_with_the_partition_is_refused(jobs, slurm):
    script = jobs.script("env.sh", ENV_DUMP.format(directives=""))
    before = _job_count(slurm)
    proc = jobs.sbatch(script, "--singularity-sla=basic", "--partition=premium")
    assert proc.returncode != 0
    assert "--singularity-sla=basic" in proc.stderr and "premium" in proc.stderr
    assert _job_count(slurm) == before


def test_status_as_the_job_user_shows_slurms_view_with_the_tier(jobs, job_user):
    script = jobs.script("env.sh", ENV_DUMP.format(directives="#SBATCH --singularity-sla=standard"))
    job_id = jobs.submit(script)
    jobs.wait_state(job_id, "COMPLETED")
    proc = run_as(job_user.pw_name, [CTL, "status", str(job_id), "--json"])
    assert proc.returncode == 0, proc.stderr
    assert "registry unavailable" in proc.stderr
    assert json.loads(proc.stdout)["tier"] == "standard"
