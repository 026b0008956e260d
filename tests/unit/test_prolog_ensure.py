"""The Prolog's `--ensure` mode (run by the SPANK plugin inside a job step): the job comes from SPANK
items and Slurm's records, never from the step's environment."""

from __future__ import annotations

import pytest

from singularity_slurm.config import parse
from singularity_slurm.jobenv import InvalidJobIdentity
from singularity_slurm.prolog.main import ensure_context

CONFIG = parse({})
RECORD = {"JobId": "42", "UserId": "root(0)", "Partition": "standard", "NodeList": "n[1-2]",
          "BatchHost": "n1", "Restarts": "1"}
DETAIL = "JobId=42 Nodes=n1 CPU_IDs=0 Mem=0 GRES=gpu:1(IDX:3) Nodes=n2 CPU_IDs=0 Mem=0 GRES=gpu:2(IDX:0-1)"


class FakeSlurm:
    def __init__(self, record: dict | None = RECORD, step: dict | None = None) -> None:
        self.record, self.step_record = record, step
        self.steps: list[tuple[int, int]] = []

    def job(self, job_id: int) -> dict | None:
        return self.record

    job_record = job  # squeue's fields over scontrol's: one record here

    def step_nodes(self, job_id: int, step_id: int, array: tuple[str, str] | None = None) -> str | None:
        self.steps.append((job_id, step_id))
        return (self.step_record or {}).get("NodeList")

    def job_detail(self, job_id: int) -> str:
        return DETAIL


def test_an_srun_step_is_placed_by_slurms_step_record_and_gets_its_nodes_gpus() -> None:
    slurm = FakeSlurm(step={"StepId": "42.0", "NodeList": "n2"})
    items = {"SLURM_JOB_ID": "42", "SLURM_JOB_UID": "0", "SLURM_STEP_ID": "0", "SLURM_NODEID": "0",
             "SLURMD_NODENAME": "../../../tmp/evil", "SLURM_JOB_PARTITION": "premium"}

    job = ensure_context(items, CONFIG, slurm)  # type: ignore[arg-type]

    assert (job.node, job.partition, job.tier, job.restart_count, job.gpus) == (
        "n2", "standard", "standard", 1, ["0", "1"])
    assert slurm.steps == [(42, 0)]


def test_the_batch_step_needs_no_step_record() -> None:
    slurm = FakeSlurm()
    items = {"SLURM_JOB_ID": "42", "SLURM_JOB_UID": "0", "SLURM_STEP_ID": "4294967291", "SLURM_NODEID": "0"}

    job = ensure_context(items, CONFIG, slurm)  # type: ignore[arg-type]

    assert (job.node, job.gpus) == ("n1", ["3"])
    assert slurm.steps == []


def test_a_job_slurm_does_not_know_is_refused() -> None:
    items = {"SLURM_JOB_ID": "42", "SLURM_JOB_UID": "0", "SLURM_STEP_ID": "0", "SLURM_NODEID": "0"}

    with pytest.raises(InvalidJobIdentity, match="Slurm has no record of job 42"):
        ensure_context(items, CONFIG, FakeSlurm(record=None))  # type: ignore[arg-type]
