"""Which node-local files a job wrote, so that they can follow it when it is restored on another node.

A job's processes run with the `singularity_filelog` shim preloaded (see filelog/singularity_filelog.c).
It appends the absolute path of every file they create or open for writing under a node-local prefix
(/tmp, /var/tmp, /dev/shm by default) to a log; at checkpoint time the node agent reads the log, keeps
the paths that are still regular files, and copies them into the checkpoint.

The log is written by the job's own processes and so is under the job user's control: it is a hint.
`read_log` keeps only well-formed absolute paths and, given the local prefixes, only paths under them;
`existing_files` can keep only files of the job's owner. Whoever copies the files as root must still
open them without following symlinks, as the job's user or after checking ownership.
"""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path

from singularity_slurm.errors import ConfigError, ServiceError

SHIM_SOURCE = "singularity_filelog.c"
SHIM_LIBRARY = "singularity_filelog.so"
DEFAULT_LOCAL_PATHS = ("/tmp", "/var/tmp", "/dev/shm")

ENV_LOG = "SINGULARITY_FILELOG"
ENV_LOCAL_PATHS = "SINGULARITY_LOCAL_PATHS"


def build_shim(output: Path, compiler: str = "cc", source: Path | None = None) -> Path:
    """Compile the shim to `output` (from the package's copy of the source unless `source` is given)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    packaged = resources.files(__package__).joinpath("csrc", SHIM_SOURCE)
    with resources.as_file(packaged if source is None else source) as src:
        tmp = output.with_name(f".{output.name}.build")
        argv = [compiler, "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-o", str(tmp), str(src), "-ldl"]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True)
        except OSError as exc:
            raise ServiceError(
                f"cannot run the C compiler {compiler!r} to build the file-log shim: {exc}; install one "
                "(Debian: apt-get install gcc)"
            ) from exc
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise ServiceError(
                f"building the file-log shim {output} from {src} failed (`{' '.join(argv)}` exited "
                f"{proc.returncode}):\n{proc.stderr.strip()}"
            )
        os.chmod(tmp, 0o755)
        os.rename(tmp, output)
    return output


def _well_formed(path: str) -> bool:
    # The shim writes lexically normalised absolute paths; anything else was not written by it whole.
    if not path.startswith("/") or "\0" in path:
        return False
    if path == "/":
        return True
    parts = path[1:].split("/")
    return all(part not in ("", ".", "..") for part in parts)


def is_under(path: str, prefix: str) -> bool:
    """`path` is `prefix` or lies under it, on a path-component boundary (as the shim decides)."""
    prefix = prefix.rstrip("/") or "/"
    return prefix == "/" or path == prefix or path.startswith(prefix + "/")


def parse_log(data: bytes, local_paths: Iterable[str] | None = None) -> list[str]:
    """Unique well-formed absolute paths of a log's content, in first-seen order.

    Blank, relative and otherwise malformed lines are dropped, and so is a last line without its
    newline (the shim writes each line whole, so it was cut short). With `local_paths`, only paths
    under one of those prefixes are kept. Names that are not UTF-8 come back as `os.fsdecode` gives them.
    """
    prefixes = None if local_paths is None else list(local_paths)
    lines = data.split(b"\n")
    seen: dict[str, None] = {}
    for raw in lines[:-1]:  # the piece after the last newline is empty or incomplete
        path = os.fsdecode(raw)
        if not _well_formed(path) or path in seen:
            continue
        if prefixes is not None and not any(is_under(path, prefix) for prefix in prefixes):
            continue
        seen[path] = None
    return list(seen)


def read_log(path: Path, local_paths: Iterable[str] | None = None) -> list[str]:
    """The paths in the log at `path` (see `parse_log`); none when the job never wrote one."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    return parse_log(data, local_paths)


def existing_files(paths: Iterable[str | os.PathLike[str]], owner: int | None = None) -> list[Path]:
    """Those of `paths` that are regular files now, not following symlinks; with `owner`, only its files."""
    found: list[Path] = []
    for path in paths:
        try:
            st = os.lstat(path)
        except (OSError, ValueError):  # missing, a parent not a directory, a NUL in the name
            continue
        if stat.S_ISREG(st.st_mode) and (owner is None or st.st_uid == owner):
            found.append(Path(path))
    return found


def _env_path(what: str, path: str) -> str:
    if not path.startswith("/") or ":" in path or "\n" in path or " " in path:
        raise ConfigError(
            f"{what} {path!r} cannot go into the environment of the shim: it must be an absolute path "
            "without ':', spaces or newlines"
        )
    return path


def env_for(shim_path: Path, log_path: Path, local_paths: Sequence[str] | None = None,
            ld_preload: str | None = None) -> dict[str, str]:
    """The variables that make a job's processes log their node-local files to `log_path`.

    `local_paths` defaults to DEFAULT_LOCAL_PATHS; an empty sequence means nothing is logged.
    `ld_preload` is the job's own LD_PRELOAD, if it has one: the shim is appended to it (once).
    Relative `shim_path` and `log_path` are made absolute here, because every process of the job
    resolves them against its own working directory.
    """
    shim = _env_path("shim library", os.path.abspath(shim_path))
    log = _env_path("file log", os.path.abspath(log_path))
    if local_paths is None:
        local_paths = DEFAULT_LOCAL_PATHS
    prefixes = [_env_path("node-local path", prefix) for prefix in local_paths]
    preload = [entry for entry in (ld_preload or "").replace(" ", ":").split(":") if entry]
    if shim not in preload:
        preload.append(shim)
    return {
        "LD_PRELOAD": ":".join(preload),
        ENV_LOG: log,
        ENV_LOCAL_PATHS: ":".join(prefixes),
    }
