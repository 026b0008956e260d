"""Bring what the dev cluster needs onto a Debian 12 or 13 machine, idempotently, as root.

CRIU: Debian 12's criu 3.17 fails on current kernels (`vdso: Unexpected rt vDSO area bounds`), and
Debian 13's criu 4.1 needs glibc 2.38. On Debian 12 we therefore unpack Debian 13's criu together
with its own libraries (glibc included) under PREFIX/criu, and point the binary at its own loader
and library folder with patchelf; nothing of the system's is replaced. pycriu (pure Python, not on
PyPI) is unpacked from the python3-pycriu package into the project's virtual environment.
"""

from __future__ import annotations

import os
import platform
import pwd
import re
import shutil
import stat
import subprocess
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path

from singularity_slurm.errors import DevClusterError

from .render import Layout

SYSTEM_PACKAGES = [
    "munge", "slurmctld", "slurmd", "slurm-client", "libslurm-dev", "redis-server",
    "gcc", "libc6-dev", "patchelf", "procps", "util-linux", "lua5.1",
    "prometheus",  # scrapes the SLA controller's metrics in the tests (the dev cluster starts none)
]
CRIU_SUITE = "trixie"
CRIU_PACKAGES = [
    "criu", "libcompel1", "libc6", "libbsd0", "libmd0", "libcap2", "libgnutls30t64", "libp11-kit0",
    "libffi8", "libidn2-0", "libunistring5", "libtasn1-6", "libnettle8t64", "libhogweed6t64",
    "libgmp10", "libnet1", "libnftables1", "libjansson4", "libmnl0", "libnftnl11", "libxtables12",
    "libedit2", "libtinfo6", "libnl-3-200", "libprotobuf-c1", "libuuid1",
]
MIN_CRIU = (4, 0)
POLICY_RC_D = Path("/usr/sbin/policy-rc.d")
UNSTARTED_SERVICES = {"prometheus"}
"""Packages whose own service stays off at boot too (the tests start a Prometheus of their own)."""

Say = Callable[[str], None]


def run(argv: list[str], check: bool = True, **kwargs) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    if check and proc.returncode != 0:
        raise DevClusterError(
            f"`{' '.join(argv)}` failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()}"
        )
    return proc


def os_release(path: Path = Path("/etc/os-release")) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key] = value.strip().strip('"')
    return values


def check_platform() -> str:
    """The Debian major version, or a clear refusal."""
    if os.geteuid() != 0:
        raise DevClusterError("the dev cluster installs packages and starts daemons: run it as root")
    info = os_release()
    if info.get("ID") != "debian" or info.get("VERSION_ID") not in {"12", "13"}:
        raise DevClusterError(
            f"the dev cluster supports Debian 12 and 13; this is {info.get('PRETTY_NAME', 'unknown')}"
        )
    return info["VERSION_ID"]


def missing_packages(names: list[str]) -> list[str]:
    missing = []
    for name in names:
        proc = run(["dpkg-query", "-W", "-f=${Status}", name], check=False)
        if proc.returncode != 0 or "install ok installed" not in proc.stdout:
            missing.append(name)
    return missing


def ensure_packages(names: list[str], say: Say) -> None:
    missing = missing_packages(names)
    if not missing:
        return
    say(f"installing Debian packages: {' '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-qq"], env=env)
    # the dev cluster starts its own daemons: the packages' services (a Prometheus listening on
    # every address, a second Redis) are not started, nor left to start at boot
    guard = POLICY_RC_D if not POLICY_RC_D.exists() else None
    if guard is not None:
        guard.write_text("#!/bin/sh\n# the dev cluster is installing packages: start no service\nexit 101\n")
        guard.chmod(0o755)
    try:
        run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], env=env)
    finally:
        if guard is not None:
            guard.unlink(missing_ok=True)
    if Path("/run/systemd/system").is_dir():
        for unit in (f"{name}.service" for name in missing if name in UNSTARTED_SERVICES):
            run(["systemctl", "disable", unit], check=False)


def parse_version_tuple(text: str) -> tuple[int, ...] | None:
    match = re.search(r"Version:\s*(\d+)\.(\d+)", text) or re.search(r"(\d+)\.(\d+)", text)
    return (int(match[1]), int(match[2])) if match else None


def criu_version(binary: str | Path) -> tuple[int, ...] | None:
    try:
        proc = run([str(binary), "--version"], check=False)
    except OSError:
        return None
    return parse_version_tuple(proc.stdout) if proc.returncode == 0 else None


def debian_mirror(sources_dir: Path = Path("/etc/apt")) -> str:
    """The Debian archive this machine already uses (so a site's own mirror is honoured)."""
    texts = []
    for path in [sources_dir / "sources.list", *sorted((sources_dir / "sources.list.d").glob("*"))]:
        if path.is_file() and path.suffix in {".list", ".sources", ""}:
            texts.append(path.read_text(errors="replace"))
    for text in texts:
        for match in re.finditer(r"^\s*URIs:\s*(\S+)", text, re.M):
            if match[1].rstrip("/").endswith("/debian"):
                return match[1].rstrip("/")
        for match in re.finditer(r"^\s*deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+\S+", text, re.M):
            if match[1].rstrip("/").endswith("/debian"):
                return match[1].rstrip("/")
    raise DevClusterError("no Debian archive found in /etc/apt sources; add one and try again")


class PrivateApt:
    """apt-get with its own source list and cache: downloads packages, installs nothing."""

    def __init__(self, root: Path, mirror: str, suite: str):
        self.root = root
        (root / "lists" / "partial").mkdir(parents=True, exist_ok=True)
        (root / "cache" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
        (root / "sources.list").write_text(f"deb {mirror} {suite} main\n")
        self.options = [
            "-o", f"Dir::Etc::SourceList={root / 'sources.list'}",
            "-o", "Dir::Etc::SourceParts=/nonexistent",
            "-o", f"Dir::State::Lists={root / 'lists'}",
            "-o", f"Dir::Cache={root / 'cache'}",
            "-o", "Debug::NoLocking=1",
            "-o", "APT::Sandbox::User=root",
        ]

    def update(self) -> None:
        run(["apt-get", *self.options, "update", "-qq"])

    def download(self, packages: list[str], into: Path) -> list[Path]:
        into.mkdir(parents=True, exist_ok=True)
        run(["apt-get", *self.options, "download", *packages], cwd=into)
        return sorted(into.glob("*.deb"))


def multiarch() -> tuple[str, str]:
    """(multiarch folder, dynamic loader name) of this machine."""
    machine = platform.machine()
    if machine == "x86_64":
        return "x86_64-linux-gnu", "ld-linux-x86-64.so.2"
    if machine == "aarch64":
        return "aarch64-linux-gnu", "ld-linux-aarch64.so.1"
    raise DevClusterError(f"no bundled CRIU for {machine}; install criu >= 4.0 yourself")


def bundled_criu(prefix: Path) -> Path:
    return prefix / "criu" / "bin" / "criu"


def ensure_criu(layout: Layout, say: Say) -> Path:
    """A working criu >= 4.0: the system's if it is recent enough, else Debian 13's, bundled."""
    for candidate in (shutil.which("criu"), bundled_criu(layout.prefix)):
        version = criu_version(candidate) if candidate else None
        if version and version >= MIN_CRIU:
            return Path(candidate)
    say(f"bundling CRIU from Debian {CRIU_SUITE} under {layout.prefix / 'criu'} "
        "(Debian 12's criu 3.17 does not work on current kernels)")
    triple, loader = multiarch()
    root = layout.prefix / "criu"
    apt = PrivateApt(layout.lib_dir / "apt-criu", debian_mirror(), CRIU_SUITE)
    apt.update()
    with tempfile.TemporaryDirectory() as tmp:
        debs = apt.download(CRIU_PACKAGES, Path(tmp) / "debs")
        staging = Path(tmp) / "root"
        for deb in debs:
            run(["dpkg-deb", "-x", str(deb), str(staging)])
        libdir = root / "lib"
        if root.exists():
            shutil.rmtree(root)
        (root / "bin").mkdir(parents=True)
        shutil.copytree(staging / "usr" / "lib" / triple, libdir, symlinks=True)
        for extra in (staging / "lib" / triple, staging / "lib64"):
            if extra.is_dir():
                shutil.copytree(extra, libdir, symlinks=True, dirs_exist_ok=True)
        binary = root / "bin" / "criu"
        shutil.copy2(staging / "usr" / "sbin" / "criu", binary)
        run(["patchelf", "--set-interpreter", str(libdir / loader), "--force-rpath",
             "--set-rpath", str(libdir), str(binary)])
    version = criu_version(binary)
    if not version or version < MIN_CRIU:
        raise DevClusterError(f"bundled criu at {binary} does not run (version {version})")
    return binary


def ensure_pycriu(layout: Layout, debian: str, say: Say) -> None:
    """Unpack pycriu from python3-pycriu into this interpreter's site-packages."""
    purelib = Path(sysconfig.get_paths()["purelib"])
    if (purelib / "pycriu" / "__init__.py").exists():
        return
    say(f"installing pycriu into {purelib}")
    suite = CRIU_SUITE if debian == "12" else os_release().get("VERSION_CODENAME", CRIU_SUITE)
    apt = PrivateApt(layout.lib_dir / "apt-pycriu", debian_mirror(), suite)
    apt.update()
    with tempfile.TemporaryDirectory() as tmp:
        (deb,) = apt.download(["python3-pycriu"], Path(tmp) / "debs")
        run(["dpkg-deb", "-x", str(deb), str(Path(tmp) / "root")])
        source = Path(tmp) / "root" / "usr" / "lib" / "python3" / "dist-packages" / "pycriu"
        shutil.copytree(source, purelib / "pycriu", dirs_exist_ok=True)


def ensure_user(name: str, say: Say) -> pwd.struct_passwd:
    """An unprivileged job user with a home and a login shell; an existing one is left as it is."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        say(f"creating the job user {name}")
        run(["useradd", "--create-home", "--shell", "/bin/bash", name])
        return pwd.getpwnam(name)


def ensure_munge_key(path: Path = Path("/etc/munge/munge.key")) -> None:
    if not path.exists():
        run(["mungekey", "--create", f"--keyfile={path}"])
    munge = pwd.getpwnam("munge")
    os.chown(path, munge.pw_uid, munge.pw_gid)
    os.chmod(path, 0o400)


def ensure_fake_gpus(layout: Layout) -> None:
    for index, node in enumerate(layout.nodes):
        (layout.gpu_dev_dir / node).mkdir(parents=True, exist_ok=True)
        for path, minor in layout.gpu_devices(index):
            wanted = os.makedev(195, minor)
            try:
                st = path.stat()
                if stat.S_ISCHR(st.st_mode) and st.st_rdev == wanted:
                    continue
                path.unlink()
            except FileNotFoundError:
                pass
            os.mknod(path, 0o666 | stat.S_IFCHR, wanted)


def ensure_dirs(layout: Layout) -> None:
    slurm = pwd.getpwnam("slurm")
    munge = pwd.getpwnam("munge")
    owned = {
        layout.slurm_pid_dir: slurm, layout.lib_dir / "slurmctld": slurm, layout.log_dir: slurm,
        Path("/run/munge"): munge, Path("/var/log/munge"): munge, Path("/var/lib/munge"): munge,
    }
    for path, owner in owned.items():
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, owner.pw_uid, owner.pw_gid)
        os.chmod(path, 0o755)
    for node in layout.nodes:
        (layout.lib_dir / f"slurmd-{node}").mkdir(parents=True, exist_ok=True)
    for path in (layout.run_dir, layout.lib_dir / "redis", layout.singularity_etc):
        path.mkdir(parents=True, exist_ok=True)
    os.chmod(layout.lib_dir / "redis", 0o700)
