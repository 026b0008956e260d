"""Dev-cluster daemons, started and stopped by pid file.

A pid file is trusted only when the process it names runs the expected program (checked through
/proc/PID/exe or its command name), so a stale file from an earlier boot never makes us signal a stranger.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from singularity_slurm.errors import DevClusterError


@dataclass(frozen=True)
class Daemon:
    name: str  # shown to the user, e.g. "slurmd n1"
    program: str  # what /proc/PID/exe must be called (prefix match: Debian's slurmd-wlm)
    argv: Sequence[str]
    pidfile: Path
    log: Path | None = None
    script: str | None = None  # a root daemon run as a script: the path its interpreter runs

    def pid(self) -> int | None:
        try:
            pid = int(self.pidfile.read_text().split()[0])
        except (FileNotFoundError, ValueError, IndexError):
            return None
        return pid if self.runs_as(pid) else None

    def runs_as(self, pid: int) -> bool:
        """Whether `pid` is this daemon: its program, and for a script, root's process whose
        interpreter runs exactly that script (a command name alone anyone can take)."""
        if not runs_program(pid, self.program):
            return False
        if self.script is None:
            return True
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            owner = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            return False
        return owner == 0 and len(argv) > 1 and argv[1] == self.script.encode()


def runs_program(pid: int, program: str) -> bool:
    """Whether `pid` runs `program`, by executable or by command name (Debian's redis-server is a
    link to redis-check-rdb; its slurmd is slurmd-wlm)."""
    try:
        exe = Path(os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)")).name
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return False
    return exe.startswith(program) or comm.startswith(program)


def start(daemon: Daemon, timeout: float = 20.0) -> int:
    """Start a self-daemonizing program and wait for its pid file to name it."""
    pid = daemon.pid()
    if pid is not None:
        return pid
    daemon.pidfile.unlink(missing_ok=True)
    proc = subprocess.run(list(daemon.argv), capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        hint = f"; see {daemon.log}" if daemon.log else ""
        raise DevClusterError(
            f"{daemon.name} failed to start ({proc.returncode}): "
            f"{(proc.stderr or proc.stdout).strip()}{hint}"
        )
    deadline = time.monotonic() + timeout
    while (pid := daemon.pid()) is None:
        if time.monotonic() > deadline:
            hint = f"; see {daemon.log}" if daemon.log else ""
            raise DevClusterError(f"{daemon.name} did not start within {timeout:.0f}s{hint}")
        time.sleep(0.1)
    return pid


def stop(daemon: Daemon, timeout: float = 20.0) -> bool:
    """SIGTERM the daemon named by its pid file; SIGKILL after `timeout`. False if it was not running."""
    pid = daemon.pid()
    if pid is None:
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while daemon.runs_as(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 5
        time.sleep(0.1)
    return True


def wait_for(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise DevClusterError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.25)
