"""The store's lifecycle: a job's folders go `retention` after it ends for good, orphans go by age, and
a reused job id never inherits an earlier job's checkpoints. Decisions as a table; sweeps and claims on
a real filesystem."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from singularity_slurm.checkpoint.retention import (
    EMPTY_ORPHAN_AGE_S,
    ENDED,
    OWNER,
    JobFolder,
    Verdict,
    claim,
    decide,
    read_folder,
    store_roots,
    sweep,
)
from singularity_slurm.checkpoint.store import CheckpointStore
from singularity_slurm.node.retire import settled_state

HOUR = 3600.0
NOW = 1_800_000_000.0
RETENTION, ORPHAN_AGE = 24 * HOUR, 7 * 24 * HOUR


def folder(ended_at: float | None = None, changed_at: float = NOW - HOUR) -> JobFolder:
    return JobFolder(Path("/store"), "42", ended_at, changed_at)


@pytest.mark.parametrize(("state", "ended_at", "changed_at", "verdict"), [
    # live jobs are kept whatever their folder looks like
    ("RUNNING", None, NOW - 100 * ORPHAN_AGE, Verdict.KEEP),
    ("PENDING", None, NOW, Verdict.KEEP),
    ("REQUEUED", None, NOW, Verdict.KEEP),
    ("SUSPENDED", None, NOW, Verdict.KEEP),
    ("COMPLETING", None, NOW, Verdict.KEEP),
    ("SOMETHING_NEW", None, NOW - 100 * ORPHAN_AGE, Verdict.KEEP),  # unknown states count as live
    # an ended job that an admin requeued is live again
    ("PENDING", NOW - 2 * RETENTION, NOW, Verdict.UNMARK),
    # ended for good: the retention starts, then the folder goes
    ("COMPLETED", None, NOW, Verdict.MARK_ENDED),
    ("CANCELLED", None, NOW, Verdict.MARK_ENDED),
    ("FAILED", None, NOW, Verdict.MARK_ENDED),
    ("TIMEOUT", None, NOW, Verdict.MARK_ENDED),
    ("COMPLETED", NOW - RETENTION + 1, NOW, Verdict.KEEP),
    ("COMPLETED", NOW - RETENTION, NOW, Verdict.DELETE),
    # Slurm forgot the job (MinJobAge): a mark still counts; without one, the folder's age does
    (None, NOW - RETENTION + 1, NOW, Verdict.KEEP),
    (None, NOW - RETENTION, NOW, Verdict.DELETE),
    (None, None, NOW - ORPHAN_AGE + 1, Verdict.KEEP),
    (None, None, NOW - ORPHAN_AGE, Verdict.DELETE),
])
def test_decide(state: str | None, ended_at: float | None, changed_at: float, verdict: Verdict) -> None:
    assert decide(folder(ended_at, changed_at), state, NOW, RETENTION, ORPHAN_AGE) is verdict


def test_with_no_retention_an_ended_job_goes_at_once() -> None:
    assert decide(folder(), "COMPLETED", NOW, 0, ORPHAN_AGE) is Verdict.DELETE


# --- sweeps on a real store -------------------------------------------------------------------------


def checkpoint(root: Path, job: int, data: bytes = b"x" * 8192) -> None:
    store = CheckpointStore(root, max_chunk=4096)
    with store.begin(job, reason="periodic", meta={"uid": 1000}) as writer:
        writer.add_bytes("images/pages-1.img", data)
        writer.commit()


def age(path: Path, seconds_ago: float, now: float) -> None:
    for top, dirs, names in os.walk(path):
        for name in [*dirs, *names]:
            os.utime(Path(top) / name, (now - seconds_ago, now - seconds_ago), follow_symlinks=False)
    os.utime(path, (now - seconds_ago, now - seconds_ago))


def test_a_sweep_marks_an_ended_job_then_deletes_it_after_the_retention_on_every_rank(tmp_path: Path) -> None:
    root = tmp_path / "store"
    checkpoint(root, 42)
    checkpoint(root / "ranks" / "1", 42)
    checkpoint(root, 43)

    first = sweep(root, {"42": "COMPLETED", "43": "RUNNING"}, NOW, RETENTION, ORPHAN_AGE)

    assert {(a.folder, a.verdict) for a in first} == {
        (str(root / "jobs/42"), Verdict.MARK_ENDED), (str(root / "ranks/1/jobs/42"), Verdict.MARK_ENDED),
        (str(root / "jobs/43"), Verdict.KEEP)}
    assert json.loads((root / "jobs/42" / ENDED).read_text()) == {"ended_at": NOW}

    early = sweep(root, {"43": "RUNNING"}, NOW + RETENTION - 1, RETENTION, ORPHAN_AGE)  # Slurm forgot 42
    assert all(a.verdict is Verdict.KEEP for a in early)
    late = sweep(root, {"43": "RUNNING"}, NOW + RETENTION, RETENTION, ORPHAN_AGE)

    assert {a.folder for a in late if a.verdict is Verdict.DELETE} == {str(root / "jobs/42"),
                                                                       str(root / "ranks/1/jobs/42")}
    assert all(a.freed_bytes > 4096 for a in late if a.verdict is Verdict.DELETE)
    assert sorted(os.listdir(root / "jobs")) == ["43"]
    assert os.listdir(root / "ranks/1/jobs") == []
    CheckpointStore(root).latest_valid(43)  # the live job's checkpoint is whole


def test_a_dry_run_changes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "store"
    checkpoint(root, 42)
    before = sorted(p.relative_to(root) for p in root.rglob("*"))

    actions = sweep(root, {"42": "COMPLETED"}, NOW, 0, ORPHAN_AGE, dry_run=True)

    assert [a.verdict for a in actions] == [Verdict.DELETE]
    assert sorted(p.relative_to(root) for p in root.rglob("*") if p.name != ".sweep.lock") == before


def test_an_orphan_goes_by_the_age_of_its_newest_change(tmp_path: Path) -> None:
    root = tmp_path / "store"
    now = os.path.getmtime(tmp_path) + 10
    checkpoint(root, 7)
    checkpoint(root, 8)
    age(root / "jobs/7", ORPHAN_AGE + 60, now)
    age(root / "jobs/8", ORPHAN_AGE + 60, now)
    os.utime(root / "jobs/8/manifests", (now - 60, now - 60))  # 8 committed a checkpoint a minute ago

    actions = sweep(root, {}, now, RETENTION, ORPHAN_AGE)

    assert {a.job_id: a.verdict for a in actions} == {"7": Verdict.DELETE, "8": Verdict.KEEP}
    assert os.listdir(root / "jobs") == ["8"]


def test_sweeping_one_job_leaves_the_others_alone(tmp_path: Path) -> None:
    root = tmp_path / "store"
    checkpoint(root, 42)
    checkpoint(root, 43)

    actions = sweep(root, {"42": "CANCELLED"}, NOW, 0, ORPHAN_AGE, only="42")

    assert [(a.job_id, a.verdict) for a in actions] == [("42", Verdict.DELETE)]
    assert os.listdir(root / "jobs") == ["43"]


def test_a_damaged_mark_counts_as_none(tmp_path: Path) -> None:
    root = tmp_path / "store"
    checkpoint(root, 42)
    (root / "jobs/42" / ENDED).write_text('{"ended_at": "yesterday"}')
    assert read_folder(root, "42").ended_at is None


def test_store_roots_are_the_root_and_each_rank_in_order(tmp_path: Path) -> None:
    for rank in ("10", "2", "x"):
        (tmp_path / "ranks" / rank).mkdir(parents=True)
    assert store_roots(tmp_path) == [tmp_path, tmp_path / "ranks/2", tmp_path / "ranks/10"]


# --- claims: a reused job id ------------------------------------------------------------------------


def test_a_reused_job_id_moves_the_earlier_jobs_folders_aside_for_a_sweep(tmp_path: Path) -> None:
    root = tmp_path / "store"
    claim(root, 42, 1000, "2026-01-01T00:00:00")  # the earlier job's first start
    checkpoint(root, 42)
    checkpoint(root / "ranks/1", 42)

    moved = claim(root, 42, 1000, "2026-12-01T10:00:00")  # the same user's new job 42

    assert len(moved) == 2 and all(p.name.startswith(".stale-42-") for p in moved)
    assert os.listdir(root / "jobs/42") == [OWNER]
    assert json.loads((root / "jobs/42" / OWNER).read_text()) == {"uid": 1000,
                                                                   "submit_time": "2026-12-01T10:00:00"}
    assert not (root / "ranks/1/jobs/42").exists()
    assert CheckpointStore(root).seqs(42) == []
    swept = sweep(root, {"42": "RUNNING"}, NOW, RETENTION, ORPHAN_AGE)
    assert {a.folder for a in swept if a.verdict is Verdict.DELETE} == {str(p) for p in moved}
    assert sorted(os.listdir(root / "jobs")) == ["42"]


def test_claiming_again_for_the_same_incarnation_keeps_its_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "store"
    claim(root, 42, 1000, "2026-12-01T10:00:00")
    checkpoint(root, 42)
    checkpoint(root / "ranks/1", 42)

    assert claim(root, 42, 1000, "2026-12-01T10:00:00") == []  # another node, or a later step
    assert CheckpointStore(root).seqs(42) == [1]
    assert CheckpointStore(root / "ranks/1").seqs(42) == [1]


def test_a_folder_without_an_owner_is_an_earlier_jobs(tmp_path: Path) -> None:
    root = tmp_path / "store"
    checkpoint(root, 42)
    assert len(claim(root, 42, 1000, "2026-12-01T10:00:00")) == 1
    assert CheckpointStore(root).seqs(42) == []


# --- the helper waits for the job to settle ---------------------------------------------------------


class Slurm:
    def __init__(self, states: list[str | None]):
        self.states = states

    def job_row(self, job_id: int) -> dict | None:  # squeue's row: no field of the user's
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        return None if state is None else {"JobId": str(job_id), "JobState": state}


def test_the_helper_waits_out_completing() -> None:
    slurm = Slurm(["COMPLETING", "COMPLETING", "COMPLETED"])
    assert settled_state(slurm, 42, sleep=lambda s: None) == (True, "COMPLETED")  # type: ignore[arg-type]


def test_a_requeued_job_settles_as_pending() -> None:
    slurm = Slurm(["COMPLETING", "PENDING"])
    assert settled_state(slurm, 42, sleep=lambda s: None) == (True, "PENDING")  # type: ignore[arg-type]


def test_a_job_slurm_forgot_settles_unknown() -> None:
    assert settled_state(Slurm([None]), 42, sleep=lambda s: None) == (True, None)  # type: ignore[arg-type]


def test_a_job_that_never_settles_is_left_to_a_later_sweep() -> None:
    ticks = iter(range(1000))
    slurm = Slurm(["COMPLETING"])
    assert settled_state(slurm, 42, timeout=5, clock=lambda: next(ticks),  # type: ignore[arg-type]
                         sleep=lambda s: None) == (False, None)


def test_the_epilog_starts_a_helper_only_with_work_for_it(tmp_path: Path) -> None:
    from singularity_slurm.config import parse
    from singularity_slurm.node.retire import FULL_SWEEP_S, LAST_SWEEP, wanted

    config = parse({"paths": {"store_root": str(tmp_path / "store")}})
    assert not wanted(config, 42, NOW)  # no store yet: nothing to sweep
    checkpoint(tmp_path / "store" / "ranks" / "1", 42)
    stamp = tmp_path / "store" / LAST_SWEEP
    stamp.touch()
    os.utime(stamp, (NOW, NOW))
    assert wanted(config, 42, NOW)  # a node rank's folder of the job
    assert not wanted(config, 43, NOW + FULL_SWEEP_S - 1)  # a job without folders, a sweep not due
    assert wanted(config, 43, NOW + FULL_SWEEP_S)


def test_an_orphan_that_never_held_a_checkpoint_goes_after_ten_minutes(tmp_path: Path) -> None:
    """A job requeued before its first checkpoint and cancelled while pending: no Epilog saw its end,
    and its folder holds only the Prolog's claim; Slurm forgets it after MinJobAge."""
    root = tmp_path / "store"
    now = os.path.getmtime(tmp_path) + 10
    for job, checkpointed in ((7, False), (8, False), (9, True)):
        if checkpointed:
            checkpoint(root, job)
        else:
            claim(root, job, 1001, "2026-12-06T23:00:00")
        age(root / f"jobs/{job}", EMPTY_ORPHAN_AGE_S + 60, now)
    age(root / "jobs/8", EMPTY_ORPHAN_AGE_S - 60, now)  # claimed nine minutes ago: may be a new job's

    actions = sweep(root, {}, now, RETENTION, ORPHAN_AGE)

    assert {a.job_id: a.verdict for a in actions} == {"7": Verdict.DELETE, "8": Verdict.KEEP,
                                                      "9": Verdict.KEEP}
    assert sorted(os.listdir(root / "jobs")) == ["8", "9"]
    # Slurm still knows it as pending: kept, however old
    claim(root, 10, 1001, "2026-12-06T23:00:00")
    age(root / "jobs/10", ORPHAN_AGE + 60, now)
    assert decide(read_folder(root, "10"), "PENDING", now, RETENTION, ORPHAN_AGE) is Verdict.KEEP
