"""Slurm-side policy files rendered from the admin configuration (pure functions) and installed.

Three files carry the policy into Slurm, all generated from the one TOML configuration:
`job_submit.lua` (slurmctld: tier -> partition, forced requeue, default tier at submit; the same
rules for `scontrol update` by anyone but root and SlurmUser, whose uid comes from slurm.conf),
`cli_filter.lua`
(sbatch: the preemption warning signal, which Slurm's Lua job-submit API cannot set) and the
plugstack.conf line of the SPANK plugin (the tier -> partition map it uses to tell each task its tier).
"""

from __future__ import annotations

import os
import pwd
import re
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

from singularity_slurm.config import TIERS, Config
from singularity_slurm.errors import ConfigError

SPANK_SOURCE = "singularity_sla.c"
SPANK_LIBRARY = "singularity_sla.so"


def _template(name: str) -> str:
    return resources.files(__package__).joinpath("lua", name).read_text()


def _lua_string(value: str) -> str:
    if any(c in value for c in '"\\\n'):
        raise ConfigError(f"partition name {value!r} holds a quote, backslash or newline")
    return value


def slurm_user_name(slurm_conf: str) -> str:
    """SlurmUser from slurm.conf's text (keys are case-insensitive); Slurm's default is root."""
    name = "root"
    for line in slurm_conf.splitlines():
        match = re.search(r"(?:^|\s)slurmuser\s*=\s*(\S+)", line.split("#", 1)[0], re.IGNORECASE)
        if match:
            name = match.group(1)
    return name


def slurm_user_uid_of_shown(value: str) -> int | None:
    """The uid in `scontrol show config`'s "SlurmUser = slurm(64030)", or None."""
    match = re.fullmatch(r"\s*\S*\((\d+)\)\s*", value)
    return int(match.group(1)) if match else None


def read_slurm_user_uid(slurm_etc: Path) -> int:
    """The uid of the SlurmUser that `slurm_etc`/slurm.conf names."""
    slurm_conf = slurm_etc / "slurm.conf"
    try:
        text = slurm_conf.read_text()
    except FileNotFoundError:
        raise ConfigError(
            f"{slurm_conf} not found: the job-submit policy lets SlurmUser update any job and "
            "reads its name there; pass --slurm-etc with the folder of slurm.conf"
        ) from None
    name = slurm_user_name(text)
    if name.isdigit():  # Slurm also takes a uid
        return int(name)
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        raise ConfigError(
            f"SlurmUser={name} in {slurm_conf} is not a user of this host: create the user or "
            "fix SlurmUser"
        ) from None


def render_job_submit(config: Config, slurm_user_uid: int = 0) -> str:
    """job_submit.lua; `slurm_user_uid` and root may change any job with `scontrol update`."""
    pairs = ", ".join(
        f'{tier} = "{_lua_string(config.tiers[tier].partition)}"' for tier in TIERS
    )
    admins = ", ".join(f"[{uid}] = true" for uid in sorted({0, slurm_user_uid}))
    return (
        _template("job_submit.lua.in")
        .replace("@SOURCE@", str(config.source or "the built-in defaults"))
        .replace("@TIER_PARTITIONS@", pairs)
        .replace("@DEFAULT_TIER@", config.default_tier)
        .replace("@ADMIN_UIDS@", admins)
    )


def render_cli_filter(config: Config) -> str:
    return (
        _template("cli_filter.lua.in")
        .replace("@SOURCE@", str(config.source or "the built-in defaults"))
        .replace("@SIGNAL@", config.preemption.sbatch_signal)
    )


def spank_library_path(config: Config) -> Path:
    return config.paths.prefix / "lib" / SPANK_LIBRARY


def render_plugstack_line(config: Config) -> str:
    args = " ".join(f"{tier}={config.tiers[tier].partition}" for tier in TIERS)
    prolog = config.paths.prefix / "venv" / "bin" / "singularity-prolog"
    return f"required {spank_library_path(config)} {args} ensure={prolog}"


PLUGSTACK_DROPIN = "singularity-sla.conf"


def ensure_plugstack_include(existing: str, dropin_dir: Path) -> str:
    """plugstack.conf with an include of the drop-in folder (Debian ships one; other sites may not)."""
    wanted = f"include {dropin_dir}/*.conf"
    for line in existing.splitlines():
        words = line.split()
        if len(words) == 2 and words[0].lower() == "include" and words[1] == f"{dropin_dir}/*.conf":
            return existing
    prefix = existing if not existing or existing.endswith("\n") else existing + "\n"
    return prefix + wanted + "\n"


def write_atomic(path: Path, text: str, mode: int = 0o644) -> bool:
    """Write `text` to `path` via a temp file and rename; False when the content was already there."""
    try:
        if path.read_text() == text:
            if path.stat().st_mode & 0o7777 != mode:
                os.chmod(path, mode)
            return False
    except (FileNotFoundError, UnicodeDecodeError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.rename(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def build_spank_plugin(output: Path, include_dir: Path = Path("/usr/include"),
                       compiler: str = "cc") -> None:
    """Compile the SPANK plugin against the installed Slurm headers (Debian: libslurm-dev)."""
    if not (include_dir / "slurm" / "spank.h").exists():
        raise ConfigError(
            f"{include_dir}/slurm/spank.h not found: install Slurm's headers "
            "(Debian: apt-get install libslurm-dev) to build the SPANK plugin"
        )
    source = resources.files(__package__).joinpath("spank", SPANK_SOURCE)
    output.parent.mkdir(parents=True, exist_ok=True)
    with resources.as_file(source) as src:
        tmp = output.with_name(f".{output.name}.build")
        proc = subprocess.run(
            [compiler, "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror",
             f"-I{include_dir}", "-o", str(tmp), str(src)],
            capture_output=True, text=True,
        )
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise ConfigError(f"building the SPANK plugin failed:\n{proc.stderr.strip()}")
        os.chmod(tmp, 0o755)
        os.rename(tmp, output)


def install_policy(config: Config, slurm_etc: Path) -> list[Path]:
    """Build the SPANK plugin and write the three policy files; returns the files that changed."""
    changed: list[Path] = []
    admin_uid = read_slurm_user_uid(slurm_etc)  # before anything is built: a bad slurm.conf changes nothing
    library = spank_library_path(config)
    build_spank_plugin(library)
    files = {
        slurm_etc / "job_submit.lua": render_job_submit(config, admin_uid),
        slurm_etc / "cli_filter.lua": render_cli_filter(config),
    }
    plugstack = slurm_etc / "plugstack.conf"
    dropins = slurm_etc / "plugstack.conf.d"
    existing = plugstack.read_text() if plugstack.exists() else ""
    files[plugstack] = ensure_plugstack_include(existing, dropins)
    files[dropins / PLUGSTACK_DROPIN] = render_plugstack_line(config) + "\n"
    for path, text in files.items():
        if write_atomic(path, text):
            changed.append(path)
    return changed
