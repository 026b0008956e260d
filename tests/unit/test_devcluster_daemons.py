"""Which process a dev-cluster pid file names (devcluster.daemons)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from singularity_slurm.devcluster.daemons import Daemon


def test_a_script_daemon_is_its_interpreter_running_exactly_that_script(tmp_path: Path) -> None:
    script = tmp_path / "controller"
    script.write_text("import time\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(script)])
    try:
        pidfile = tmp_path / "controller.pid"
        pidfile.write_text(f"{proc.pid}\n")
        program = Path(os.readlink(f"/proc/{proc.pid}/exe")).name
        assert Daemon("c", program, [], pidfile, script=str(script)).pid() == proc.pid
        # the same command name running another script, or a program by name alone, is not it
        assert Daemon("c", program, [], pidfile, script=str(tmp_path / "other")).pid() is None
        assert Daemon("c", "slurmd", [], pidfile).pid() is None
        if os.geteuid() != 0:  # a user's process never passes for root's daemon
            assert Daemon("c", program, [], pidfile, script=str(script)).pid() is None
    finally:
        proc.kill()
        proc.wait()
