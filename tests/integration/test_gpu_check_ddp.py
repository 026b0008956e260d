"""tests/gpu/ddp.py, the GPU check's 2-rank preempt-and-restore, in its CPU form: two ranks of the
reference DDP script time-sliced through one real proxy, cut, dumped and restored by real criu into a
new proxy's generation, their logs byte-identical to an undisturbed run's. On a GPU machine the same
code adds the driver's checkpoint calls (tests/gpu/run.sh); here it keeps that script from rotting.
It needs no Slurm, but its dumps are heavy: it runs with the integration tests, one at a time, not
beside them with the unit tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CRIU = "/opt/singularity-slurm/bin/singularity-criu"
GPU_CHECKS = Path(__file__).resolve().parents[1] / "gpu"

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.access(CRIU, os.X_OK),
                                reason="needs root and the installed criu (make install)")


def test_two_time_sliced_ranks_preempted_at_their_cut_and_restored_log_what_an_undisturbed_run_logs(
        tmp_path: Path) -> None:
    # its own process: the check makes itself the subreaper of the trees criu restores
    done = subprocess.run([sys.executable, str(GPU_CHECKS / "ddp.py"), "--device", "cpu", "--criu", CRIU,
                           "--work", str(tmp_path / "ddp"), "--steps", "40", "--cut-step", "15"],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(GPU_CHECKS)))
    assert done.returncode in (0, 1), done.stderr
    result = json.loads(done.stdout)

    assert result["identical"] == {"0": True, "1": True}, result
    assert result["steps"] == {"0": 40, "1": 40} and result["exits"] == {"0": 0, "1": 0}
    assert result["first_proxy"]["turn"]["count"] > 0  # the ranks took turns on their device
    assert result["dumps"]["0"]["tasks"] == [] and result["swapped_at_cut"] == {"0": False, "1": False}
    assert result["ok"] and done.returncode == 0
