"""How root processes run programs: absolute paths from fixed system folders, a clean environment.

Root daemons act for job users, whose environment (PATH, LD_PRELOAD, LD_LIBRARY_PATH, PYTHON*,
locale variables, ...) is hostile input. Root never resolves a program through a PATH it did not
set, and never runs anything with an environment a user wrote: it runs `system_program(name)` with
`clean_env()`. A job's own environment is applied only by a step that already runs as the job's
user (`USER_EXEC`, see node/jobtree.py), which reads it from a descriptor: argv would publish it in
the world-readable /proc/PID/cmdline.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Mapping

from .errors import SingularityError

SYSTEM_DIRS = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
SYSTEM_PATH = ":".join(SYSTEM_DIRS)
PASSED_THROUGH = ("SINGULARITY_CONFIG", "SINGULARITY_LOG_DIR")
"""Root's own settings a root daemon hands on to the daemons it starts (never a user's: the Prolog's
environment comes from slurmd, or from the SPANK plugin's fixed list)."""


class UnsafeProgram(SingularityError):
    """A program root would run is missing from the system folders, or someone but root could
    change it: install it from the distribution's package."""


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The whole environment of a program root starts: a system PATH, the C locale, and `extra`."""
    return {"PATH": SYSTEM_PATH, "LC_ALL": "C", **(extra or {})}


def service_env(parent: Mapping[str, str]) -> dict[str, str]:
    """The environment of a root daemon started by a root daemon: clean, plus root's own settings."""
    return clean_env({k: parent[k] for k in PASSED_THROUGH if parent.get(k)})


def _root_owned_file(path: str) -> bool:
    """A regular executable file that only root can change (resolving symlinks, as exec does)."""
    try:
        info = os.stat(path)
    except OSError:
        return False
    return (stat.S_ISREG(info.st_mode) and info.st_uid == 0 and not info.st_mode & 0o022
            and bool(info.st_mode & 0o111))


def system_program(name: str, dirs: Iterable[str] = SYSTEM_DIRS,
                   trusted: Callable[[str], bool] = _root_owned_file) -> str:
    """The absolute path of `name` in the first system folder that holds a root-owned copy.

    Never looks at PATH. `trusted` decides whether a candidate may run as root (tests pass a fake).
    """
    if not name or "/" in name or name in {".", ".."}:
        raise UnsafeProgram(f"{name!r} is not a program name; root runs programs by name from "
                            f"{SYSTEM_PATH} only")
    for folder in dirs:
        candidate = os.path.join(folder, name)
        if trusted(candidate):
            return candidate
    raise UnsafeProgram(f"{name} not found as a root-owned program that only root can change in "
                        f"{SYSTEM_PATH}; install it (Debian: util-linux provides unshare, setsid, "
                        "setpriv and mount)")


# --- the job's environment, handed to the user's side ----------------------------------------------


class BadEnvironment(SingularityError):
    """A job environment that cannot be passed to execve (a NUL, or a name with '=' or empty)."""


def encode_env(env: Mapping[str, str]) -> bytes:
    """`{"A": "1"}` -> b"A=1\\0": what `USER_EXEC` reads back; refuses what execve cannot carry."""
    parts = []
    for key, value in env.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise BadEnvironment(f"environment entries must be strings, got {key!r}={value!r}")
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise BadEnvironment(f"environment variable {key!r} cannot be passed to a program: names "
                                 "must be non-empty without '=' and neither may hold a NUL byte")
        parts.append(f"{key}={value}".encode("utf-8", "surrogateescape") + b"\0")
    return b"".join(parts)


def decode_env(data: bytes) -> dict[str, str]:
    """The inverse of `encode_env` (the same parsing `USER_EXEC` does)."""
    env = {}
    for item in data.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key:
            env[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
    return env


USER_EXEC = (
    "import os,sys\n"
    "fd=int(sys.argv[1]);data=b''\n"
    "while True:\n"
    " chunk=os.read(fd,1<<16)\n"
    " if not chunk:break\n"
    " data+=chunk\n"
    "os.close(fd)\n"
    "env={}\n"
    "for item in data.split(b'\\0'):\n"
    " key,sep,value=item.partition(b'=')\n"
    " if sep and key:env[key]=value\n"
    "os.execve(sys.argv[2],sys.argv[2:],env)\n"
)
"""Run as `python -I -S -c USER_EXEC FD PROGRAM ARGS...` by the job's user (after setpriv dropped
root): read the job's environment (encode_env's format) from FD, close FD, and become PROGRAM with
exactly that environment. `-I -S`: no PYTHON* variables, no site, nothing of the user's is loaded."""


def env_memfd(env: Mapping[str, str]) -> int:
    """A close-on-exec memory file holding `encode_env(env)`, at offset 0: pass it with pass_fds."""
    data = encode_env(env)
    fd = os.memfd_create("singularity-job-env", os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd
