"""Fault points: named steps of checkpoint and restore that a test can make fail, or kill their process.

Off unless the configuration says `[testing] faults = true`, which no production cluster sets (the
dev cluster does). A test arms a point by writing a file in `<paths.state_dir>/faults/`, a folder
only root may write, named for the point (`dump`), or for the point on one node (`dump@n1`), and
holding the action:

- `kill`: the process SIGKILLs itself there, as a crash or `kill -9` at that moment would;
- `fail`: the step raises InjectedFault, as an I/O error there would;
- `stall N`: the step waits N seconds (at most 600) and goes on, having first written
  `<point>.reached` beside the file: a test does something else at that moment (stops a daemon).

A point fires once: its file is taken (renamed away) before the action, so a restarted process
does not fire it again. Points (`POINTS`) are listed where they are: the agent's dump, store write,
commit, requeue and restore, and a device proxy's distributed cut.
"""

from __future__ import annotations

import os
import signal
import stat
import time
import uuid
from pathlib import Path

from .config import Config
from .errors import SingularityError

POINTS = ("dump", "store-write", "commit", "requeue", "restore", "cut")
ACTIONS = ("kill", "fail", "stall")
MAX_STALL_S = 600.0
FOLDER = "faults"


class InjectedFault(SingularityError):
    """A test armed this fault point (`[testing] faults`): the step fails as a real fault would."""


def folder(config: Config) -> Path:
    return config.paths.state_dir / FOLDER


def arm(config: Config, point: str, action: str, node: str | None = None) -> Path:
    """Arm a point (tests, as root); the file it wrote."""
    if point not in POINTS or action.split()[0] not in ACTIONS:
        raise ValueError(f"fault {point!r}/{action!r}: points are {', '.join(POINTS)}; actions "
                         f"{', '.join(ACTIONS)}")
    where = folder(config)
    where.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = where / (f"{point}@{node}" if node else point)
    path.write_text(action + "\n")
    return path


def _take(path: Path) -> str | None:
    """The action of an armed point, taken so that it fires once; None if it is not armed."""
    taken = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, taken)
    except FileNotFoundError:
        return None
    try:
        info = os.lstat(taken)
        # Only root arms points (the folder is root's); anything else there is ignored.
        if not stat.S_ISREG(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
            return None
        return taken.read_text(errors="replace").strip()
    finally:
        taken.unlink(missing_ok=True)


def point(config: Config | None, name: str, node: str | None = None) -> None:
    """Fire the point `name` if a test armed it (and the configuration allows faults)."""
    if config is None or not config.testing.faults:
        return
    where = folder(config)
    action = (_take(where / f"{name}@{node}") if node else None) or _take(where / name)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "fail":
        raise InjectedFault(f"a fault was injected at {name} (testing.faults is on)")
    if action and action.startswith("stall "):
        try:
            seconds = min(max(float(action.split()[1]), 0.0), MAX_STALL_S)
        except ValueError:
            return
        (where / f"{name}.reached").write_text(f"{os.getpid()}\n")
        time.sleep(seconds)  # the test acts meanwhile: that is the fault
