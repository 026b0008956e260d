"""What the store keeps once no live job needs it: which job incarnation owns a folder, and when it goes.

A job's folder (``jobs/<id>/`` under the store root, and under ``ranks/<r>/`` for the other nodes of a
multi-node job) lives as long as the job: through every requeue, since the next start restores from
it. When the job ends for good (Slurm shows it completed, cancelled, failed, timed out...) the folder
is marked ``ended.json`` and deleted ``store.retention_min`` later; until then an admin can still
``scontrol requeue`` the ended job and it resumes. A folder Slurm no longer knows, with no mark and no
change for ``store.orphan_age_min``, is collected too (its job's end was never seen); one that never
held a committed checkpoint (a job requeued before its first and then cancelled while pending: no
Epilog saw its end) goes once unchanged for EMPTY_ORPHAN_AGE_S, since it holds nothing to resume.

Job ids are reused (a lost ``StateSaveLocation``, ``MaxJobId`` wrapping), so a folder is claimed by the
incarnation that starts it: at its first start (restart 0) the Prolog writes ``owner.json`` with the
job's uid and submit time (Slurm resets the submit time at each requeue, so only restart 0 can tell),
and a folder some other incarnation left is moved aside and deleted, never restored.

Decisions are pure functions (`decide`); `sweep` and `claim` are the thin shells that do the I/O.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from .store import _JOB_ID, _MANIFEST_NAME, job_key

FINAL_STATES = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                          "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"})
"""Slurm job states a job does not leave by itself (every other state is a live job: keep it)."""
ENDED = "ended.json"
OWNER = "owner.json"
LEFTOVER_PREFIXES = (".stale-", ".deleting-")
"""Folders under jobs/ that nothing reads: a claimed-over incarnation's, a deletion cut short."""
EMPTY_ORPHAN_AGE_S = 600.0
"""How long a folder with no committed checkpoint, of a job Slurm no longer knows, stays unchanged
before it goes. Every live job is in Slurm's table; the age only keeps a folder claimed by a job that
started after the sweep asked Slurm (a Prolog's claim is minutes younger than this at most)."""


class Verdict(StrEnum):
    """What a sweep does with one job folder."""

    KEEP = "keep"
    MARK_ENDED = "mark-ended"  # the job ended for good just now: the retention starts
    UNMARK = "unmark"  # an ended job was requeued (by an admin): it is live again
    DELETE = "delete"


@dataclass(frozen=True)
class JobFolder:
    """What a sweep knows of one job folder."""

    root: Path  # the store root (or a rank's) that holds jobs/<job_id>
    job_id: str
    ended_at: float | None  # when a sweep first saw the job ended for good (its mark), or None
    changed_at: float  # the newest change of the folder, its manifests and its run records
    checkpoints: bool = True  # it holds a committed checkpoint (a manifest)

    @property
    def path(self) -> Path:
        return self.root / "jobs" / self.job_id


def decide(folder: JobFolder, state: str | None, now: float, retention_s: float,
           orphan_age_s: float) -> Verdict:
    """The verdict on one folder, given the job's Slurm state (None: Slurm has no record of it)."""
    if state is not None and state not in FINAL_STATES:
        return Verdict.UNMARK if folder.ended_at is not None else Verdict.KEEP
    if folder.ended_at is not None:
        return Verdict.DELETE if now - folder.ended_at >= retention_s else Verdict.KEEP
    if state is not None:  # ended for good, first seen now
        return Verdict.DELETE if retention_s <= 0 else Verdict.MARK_ENDED
    age = orphan_age_s if folder.checkpoints else min(orphan_age_s, EMPTY_ORPHAN_AGE_S)
    return Verdict.DELETE if now - folder.changed_at >= age else Verdict.KEEP


@dataclass(frozen=True)
class SweepAction:
    folder: str  # its path
    job_id: str
    verdict: Verdict
    state: str | None  # the Slurm state it was decided on
    freed_bytes: int = 0
    error: str | None = None  # why the verdict could not be carried out (the next sweep tries again)


def store_roots(root: Path) -> list[Path]:
    """The store root and each node rank's root under it (ranks/<r>)."""
    ranks = root / "ranks"
    found = [root]
    try:
        names = sorted((n for n in os.listdir(ranks) if n.isdigit()), key=int)
        found += [ranks / name for name in names if (ranks / name).is_dir()]
    except FileNotFoundError:
        pass
    return found


def _mtime(path: Path) -> float | None:
    try:
        return path.lstat().st_mtime
    except FileNotFoundError:
        return None


def read_folder(root: Path, job_id: str) -> JobFolder:
    path = root / "jobs" / job_id
    changes = [m for m in (_mtime(path), _mtime(path / "manifests"), _mtime(path / "runs.json"),
                           _mtime(path / "packs"), _mtime(path / OWNER)) if m is not None]
    ended_at = None
    try:
        doc = json.loads((path / ENDED).read_bytes())
        value = doc.get("ended_at") if isinstance(doc, dict) else None
        if isinstance(value, int | float) and not isinstance(value, bool):
            ended_at = float(value)
    except (OSError, ValueError):
        pass  # no mark, or a damaged one: judged as unmarked
    try:
        checkpoints = any(_MANIFEST_NAME.fullmatch(name) for name in os.listdir(path / "manifests"))
    except FileNotFoundError:
        checkpoints = False
    except OSError:
        checkpoints = True  # unreadable: judged as holding one, the longer age
    return JobFolder(root, job_id, ended_at, max(changes, default=0.0), checkpoints)


def _write_json(path: Path, doc: dict) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "x") as out:
        json.dump(doc, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def _bytes_under(path: Path) -> int:
    total = 0
    for top, _, names in os.walk(path):
        for name in names:
            try:
                total += (Path(top) / name).lstat().st_size
            except FileNotFoundError:
                continue
    return total


def remove_folder(path: Path) -> int:
    """Delete a job folder (renamed first, so that a deletion cut short is never read as a job's
    folder with lost chunks); returns the bytes freed."""
    doomed = path.with_name(f".deleting-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, doomed)
    except FileNotFoundError:
        return 0
    freed = _bytes_under(doomed)
    shutil.rmtree(doomed, ignore_errors=True)
    return freed


def apply(folder: JobFolder, verdict: Verdict, now: float) -> int:
    """Carry out a verdict; the bytes freed."""
    if verdict is Verdict.MARK_ENDED:
        _write_json(folder.path / ENDED, {"ended_at": now})
    elif verdict is Verdict.UNMARK:
        (folder.path / ENDED).unlink(missing_ok=True)
    elif verdict is Verdict.DELETE:
        return remove_folder(folder.path)
    return 0


def _entries(roots: Iterable[Path]) -> Iterator[tuple[Path, str]]:
    """(store root, name) of everything in each root's jobs/ folder, in name order."""
    for root in roots:
        try:
            names = os.listdir(root / "jobs")
        except FileNotFoundError:
            continue
        yield from ((root, name) for name in sorted(names))


def job_folders(roots: Iterable[Path], only: str | None = None) -> list[JobFolder]:
    return [read_folder(root, name) for root, name in _entries(roots)
            if _JOB_ID.fullmatch(name) and (only is None or name == only) and (root / "jobs" / name).is_dir()]


def leftovers(roots: Iterable[Path]) -> list[Path]:
    """Folders of claimed-over incarnations and deletions cut short."""
    return [root / "jobs" / name for root, name in _entries(roots) if name.startswith(LEFTOVER_PREFIXES)]


def sweep(root: Path, states: Mapping[str, str], now: float, retention_s: float, orphan_age_s: float,
          *, only: str | None = None, dry_run: bool = False) -> list[SweepAction]:
    """Judge every job folder of the store (or only job `only`'s) by the jobs' Slurm states
    (`states`: job id -> state of every job Slurm knows), and carry the verdicts out.

    Sweeps of one store run one at a time (a lock file under the root), so two nodes' epilogs never
    delete under each other.
    """
    actions = []
    with _locked(root):
        roots = store_roots(root)
        for folder in job_folders(roots, only):
            state = states.get(folder.job_id)
            verdict = decide(folder, state, now, retention_s, orphan_age_s)
            freed, error = 0, None
            if not dry_run and verdict is not Verdict.KEEP:
                try:
                    freed = apply(folder, verdict, now)
                except OSError as exc:  # a folder that is a mount point, a read-only store...
                    error = str(exc)
            actions.append(SweepAction(str(folder.path), folder.job_id, verdict, state, freed, error))
        if only is None:
            for path in leftovers(roots):
                freed = 0 if dry_run else _remove_leftover(path)
                actions.append(SweepAction(str(path), "", Verdict.DELETE, None, freed))
    return actions


def _remove_leftover(path: Path) -> int:
    freed = _bytes_under(path)
    shutil.rmtree(path, ignore_errors=True)
    return freed


class _locked:
    def __init__(self, root: Path):
        self.path = root / ".sweep.lock"

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


# --- claiming a folder for a job incarnation --------------------------------------------------------


def owner_of(path: Path) -> dict | None:
    try:
        doc = json.loads((path / OWNER).read_bytes())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def claim(root: Path, job_id: int | str, uid: int, submit_time: str) -> list[Path]:
    """At a job's first start: make its folders (the root's and every rank's) this incarnation's.

    The root's folder decides: once it holds this incarnation's owner record, the job's folders are
    its own (a second call, from another node or a later step, changes nothing). Otherwise every
    folder of the job id was left by an earlier job with the same id: each is moved aside (the next
    sweep deletes it) before the record is written. Returns the folders moved aside.
    """
    job = job_key(job_id)
    mine = {"uid": uid, "submit_time": submit_time}
    primary = root / "jobs" / job
    if owner_of(primary) == mine:
        return []
    moved = []
    for store_root in store_roots(root):
        path = store_root / "jobs" / job
        if not path.is_dir():
            continue
        aside = path.with_name(f".stale-{job}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(path, aside)
            moved.append(aside)
        except FileNotFoundError:
            pass  # another node of the job moved it first
    primary.mkdir(mode=0o700, parents=True, exist_ok=True)
    if owner_of(primary) != mine:
        _write_json(primary / OWNER, mine)
    return moved
