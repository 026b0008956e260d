"""Node-local files carried in checkpoints: what is collected and where it may be put back."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from singularity_slurm.node import localfiles


@pytest.fixture
def tmp_under_tmp():
    """A folder under /tmp, a node-local prefix (the real one: put_back only writes under those)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="singularity-localfiles-", dir="/tmp") as path:
        yield Path(path)


def test_collect_takes_the_logged_regular_files_and_the_log(tmp_under_tmp):
    kept = tmp_under_tmp / "kept.txt"
    kept.write_text("data")
    (tmp_under_tmp / "dir").mkdir()
    log = tmp_under_tmp / "files.log"
    log.write_text(f"{kept}\n{tmp_under_tmp / 'gone.txt'}\n{tmp_under_tmp / 'dir'}\n{kept}\n")

    entries = localfiles.collect(log, os.getuid())

    assert entries == {localfiles.LOG_ENTRY: log, f"files{kept}": kept}


def test_collect_without_a_log_carries_nothing(tmp_path):
    assert localfiles.collect(tmp_path / "missing.log", os.getuid()) == {}


def test_put_back_restores_content_mode_and_missing_parents(tmp_under_tmp, tmp_path):
    target = tmp_under_tmp / "sub" / "out.bin"
    source = tmp_path / "restored" / "files" / str(target).lstrip("/")
    source.parent.mkdir(parents=True)
    source.write_bytes(b"\x00payload")
    os.chmod(source, 0o640)

    written = localfiles.put_back(tmp_path / "restored", os.getuid(), os.getgid())

    assert written == [target]
    assert target.read_bytes() == b"\x00payload"
    assert target.stat().st_mode & 0o777 == 0o640


def test_put_back_refuses_paths_outside_the_local_prefixes(tmp_path):
    source = tmp_path / "restored" / "files" / "etc" / "evil.conf"
    source.parent.mkdir(parents=True)
    source.write_text("no")

    assert localfiles.put_back(tmp_path / "restored", os.getuid(), os.getgid()) == []
    assert not Path("/etc/evil.conf").exists()


def test_put_back_does_not_follow_a_planted_symlink(tmp_under_tmp, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_under_tmp / "link").symlink_to(outside)
    source = tmp_path / "restored" / "files" / str(tmp_under_tmp / "link" / "x").lstrip("/")
    source.parent.mkdir(parents=True)
    source.write_text("no")

    assert localfiles.put_back(tmp_path / "restored", os.getuid(), os.getgid()) == []
    assert not (outside / "x").exists()


def test_prepare_log_puts_the_content_back(tmp_path):
    log = tmp_path / "filelog" / "7" / localfiles.LOG_NAME
    localfiles.prepare_log(log, os.getuid(), os.getgid(), b"/tmp/a\n")
    assert log.read_bytes() == b"/tmp/a\n"
    assert (log.parent.stat().st_mode & 0o777) == 0o700
    localfiles.prepare_log(log, os.getuid(), os.getgid())
    assert log.read_bytes() == b"/tmp/a\n"  # without content the log is kept as it is
