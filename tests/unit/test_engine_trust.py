"""A restore takes images only from a store folder that root alone could have written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from singularity_slurm.node.agent import RequestError
from singularity_slurm.node.engine import CheckpointEngine, job_store

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="making root-owned folders needs root")

JOB = 42
OTHER_UID = 65534


def engine_on(store_root: Path) -> CheckpointEngine:
    engine = CheckpointEngine.__new__(CheckpointEngine)  # only the store is needed for the check
    engine.store = job_store(store_root)
    return engine


def job_folders(store_root: Path) -> dict[str, Path]:
    job_dir = job_store(store_root).job_dir(JOB)
    folders = {"job": job_dir, "manifests": job_dir / "manifests", "chunks": job_dir / "chunks"}
    for path in folders.values():
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, 0o700)
    return folders


def test_a_root_only_job_folder_is_trusted(tmp_path: Path) -> None:
    job_folders(tmp_path)

    engine_on(tmp_path)._check_trusted(JOB)


def test_a_job_without_checkpoints_is_left_to_the_store(tmp_path: Path) -> None:
    engine_on(tmp_path)._check_trusted(JOB)


@pytest.mark.parametrize("which", ["job", "manifests", "chunks"])
def test_a_folder_owned_by_another_user_is_refused(tmp_path: Path, which: str) -> None:
    path = job_folders(tmp_path)[which]
    os.chown(path, OTHER_UID, OTHER_UID)

    with pytest.raises(RequestError) as info:
        engine_on(tmp_path)._check_trusted(JOB)

    assert str(info.value) == (
        f"refusing to restore from {path}: it is not owned by root or is writable by others "
        "(mode 700); only checkpoints the agents wrote are restored"
    )


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777])
def test_a_folder_writable_by_group_or_others_is_refused(tmp_path: Path, mode: int) -> None:
    path = job_folders(tmp_path)["manifests"]
    os.chmod(path, mode)

    with pytest.raises(RequestError) as info:
        engine_on(tmp_path)._check_trusted(JOB)

    assert f"(mode {mode:o})" in str(info.value)
