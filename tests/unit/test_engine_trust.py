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
    folders = {"job": job_dir, "manifests": job_dir / "manifests", "packs": job_dir / "packs"}
    for path in folders.values():
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, 0o700)
    return folders


def test_a_root_only_job_folder_is_trusted(tmp_path: Path) -> None:
    job_folders(tmp_path)

    engine_on(tmp_path)._check_trusted(JOB)


def test_a_job_without_checkpoints_is_left_to_the_store(tmp_path: Path) -> None:
    engine_on(tmp_path)._check_trusted(JOB)


@pytest.mark.parametrize("which", ["job", "manifests", "packs"])
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


def test_a_store_root_owned_by_another_user_or_writable_by_others_is_refused(tmp_path: Path) -> None:
    from singularity_slurm.errors import ConfigError
    from singularity_slurm.node.engine import check_store_root

    store = tmp_path / "store"
    store.mkdir(mode=0o755)
    check_store_root(store)
    assert store.stat().st_mode & 0o777 == 0o700  # only the agents read checkpoints

    os.chmod(store, 0o777)
    with pytest.raises(ConfigError, match=r"must be a folder owned by root and not writable by group or "
                                          r"others \(it is a folder, owner uid 0, mode 777\)"):
        check_store_root(store)
    os.chmod(store, 0o700)
    os.chown(store, OTHER_UID, 0)
    with pytest.raises(ConfigError, match=f"owner uid {OTHER_UID}, mode 700"):
        check_store_root(store)
    assert store.stat().st_mode & 0o777 == 0o700 and store.stat().st_uid == OTHER_UID  # left as it was
