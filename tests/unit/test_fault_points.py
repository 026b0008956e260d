"""Fault points fire once, only where the configuration allows them and root armed them."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from singularity_slurm import faults
from singularity_slurm.config import Config, parse


@pytest.fixture
def config(tmp_path: Path):
    return with_faults(parse({"paths": {"state_dir": str(tmp_path / "run")}}), True)


def with_faults(config: Config, on: bool) -> Config:
    return dataclasses.replace(config, testing=dataclasses.replace(config.testing, faults=on))


def test_an_armed_point_fails_once(config) -> None:
    faults.arm(config, "commit", "fail")

    with pytest.raises(faults.InjectedFault, match="a fault was injected at commit"):
        faults.point(config, "commit", "n1")
    faults.point(config, "commit", "n1")  # taken: it does not fire again
    assert os.listdir(faults.folder(config)) == []


def test_a_point_armed_for_one_node_fires_only_there(config) -> None:
    faults.arm(config, "dump", "fail", node="n2")

    faults.point(config, "dump", "n1")
    with pytest.raises(faults.InjectedFault):
        faults.point(config, "dump", "n2")


def test_without_testing_faults_nothing_fires(config) -> None:
    faults.arm(config, "dump", "fail")
    faults.point(with_faults(config, False), "dump")
    assert os.listdir(faults.folder(config)) == ["dump"]


def test_a_file_root_did_not_write_is_ignored(config) -> None:
    path = faults.arm(config, "restore", "fail")
    os.chmod(path, 0o666)
    faults.point(config, "restore")  # not raised
    assert not path.exists()


KILLED = """
import dataclasses, sys
from singularity_slurm import faults, config
c = dataclasses.replace(config.parse({"paths": {"state_dir": sys.argv[1]}}),
                        testing=config.TestingConfig(faults=True))
faults.point(c, "requeue")
print("survived")
"""


def test_kill_ends_the_process_with_sigkill(config) -> None:
    faults.arm(config, "requeue", "kill")
    proc = subprocess.run([sys.executable, "-c", KILLED, str(config.paths.state_dir)], capture_output=True,
                          text=True)
    assert (proc.returncode, proc.stdout) == (-9, ""), proc.stderr


def test_a_stall_waits_there_having_said_it_got_there(config) -> None:
    faults.arm(config, "requeue", "stall 0.2")
    started = time.monotonic()

    faults.point(config, "requeue")

    assert time.monotonic() - started >= 0.2
    assert (faults.folder(config) / "requeue.reached").read_text() == f"{os.getpid()}\n"


def test_unknown_points_and_actions_are_refused(config) -> None:
    with pytest.raises(ValueError, match="points are dump, store-write, commit, requeue, restore, cut"):
        faults.arm(config, "nowhere", "kill")
    with pytest.raises(ValueError, match="actions kill, fail, stall"):
        faults.arm(config, "dump", "explode")
