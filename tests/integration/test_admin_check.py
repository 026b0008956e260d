"""`singularityctl admin check` against the live cluster, and after breaking its configuration."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from conftest import CTL

SLURM_CONF = Path("/etc/slurm/slurm.conf")


def _check() -> subprocess.CompletedProcess[str]:
    return subprocess.run([CTL, "admin", "check"], capture_output=True, text=True, timeout=120)


def _reconfigure() -> None:
    subprocess.run(["scontrol", "reconfigure"], check=True, capture_output=True)


@pytest.fixture
def slurm_conf():
    """Yields slurm.conf's text; puts the original back (and reloads Slurm) afterwards."""
    original = SLURM_CONF.read_text()
    yield original
    SLURM_CONF.write_text(original)
    _reconfigure()
    assert _check().returncode == 0


def test_admin_check_passes_on_the_dev_cluster():
    proc = _check()
    assert proc.returncode == 0, proc.stdout
    assert not [ln for ln in proc.stdout.splitlines() if ln.startswith("FAIL")]
    for item in ("slurm version", "slurm.conf PreemptType", "partition basic (tier basic) PreemptMode",
                 "SPANK plugin", "job_submit.lua", "criu check", "pycriu", "redis auth", "redis eviction"):
        assert f"PASS  {item}" in proc.stdout, item
    assert "PASS  redis eviction: maxmemory-policy noeviction" in proc.stdout  # read from the server


def test_basic_partition_without_requeue_fails_naming_the_key_and_fix(slurm_conf):
    broken = re.sub(r"(PartitionName=basic .*?)PreemptMode=REQUEUE", r"\1PreemptMode=OFF",
                    slurm_conf)
    assert broken != slurm_conf
    SLURM_CONF.write_text(broken)
    _reconfigure()
    proc = _check()
    assert proc.returncode == 1
    assert "FAIL  partition basic (tier basic) PreemptMode: PreemptMode=OFF" in proc.stdout
    assert "set PreemptMode=REQUEUE on PartitionName=basic" in proc.stdout
    assert [ln for ln in proc.stdout.splitlines() if ln.startswith("FAIL")] == [
        "FAIL  partition basic (tier basic) PreemptMode: PreemptMode=OFF"]


def test_missing_user_signal_setting_fails_naming_the_key_and_fix(slurm_conf):
    broken = "\n".join(line for line in slurm_conf.splitlines()
                       if "send_user_signal" not in line) + "\n"
    assert broken != slurm_conf
    SLURM_CONF.write_text(broken)
    _reconfigure()
    proc = _check()
    assert proc.returncode == 1
    fails = [line for line in proc.stdout.splitlines() if line.startswith("FAIL")]
    assert len(fails) == 1
    assert re.match(r"FAIL  slurm\.conf (SlurmctldParameters|PreemptParameters)", fails[0])
    assert "send_user_signal" in proc.stdout
