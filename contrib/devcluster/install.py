"""Bring what the dev cluster needs onto a Debian 12 or 13 machine, idempotently, as root.

CRIU: Debian 12's criu 3.17 fails on current kernels (`vdso: Unexpected rt vDSO area bounds`), and
the project needs criu with its own patches (checkpoint/criu_patches) anyway. So the installer
builds criu itself, on this machine and against its own libraries: it downloads the upstream tarball
of Debian 13's criu source package through a private apt (checked against the signed Sources
index), applies the patches, runs `make criu` and installs the binary as PREFIX/criu/bin/criu, with
PREFIX/criu/BUILD recording what it was built from; a later run rebuilds only when that differs.
pycriu (pure Python, not on PyPI) is unpacked from the python3-pycriu package into the project's
virtual environment.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import re
import shutil
import stat
import subprocess
import sysconfig
import tempfile
from collections.abc import Callable, Iterable
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import TextIO

from singularity_slurm.errors import DevClusterError

from .render import Layout

SYSTEM_PACKAGES = [
    "munge", "slurmctld", "slurmd", "slurm-client", "libslurm-dev", "redis-server",
    "gcc", "libc6-dev", "procps", "util-linux", "lua5.1",
    "prometheus",  # scrapes the SLA controller's metrics in the tests (the dev cluster starts none)
]
CRIU_SUITE = "trixie"
CRIU_SOURCE = "criu"
CRIU_VERSION = "4.1.1"
"""The upstream release the patches are written against: a Sources index with another one stops
the build (update this and check that the patches still apply)."""
CRIU_PATCHES = "singularity_slurm.checkpoint.criu_patches"
CRIU_BUILD_PACKAGES = [
    "gcc", "libc6-dev", "make", "pkg-config", "patch", "xz-utils",
    "protobuf-c-compiler", "libprotobuf-c-dev", "libprotobuf-dev",  # images/*.proto (descriptor.proto)
    "libnl-3-dev", "libnet1-dev", "libcap-dev", "uuid-dev",
    # optional in criu's Makefile, built in as in Debian's package: setproctitle, TLS for the page
    # server, nftables network locking
    "libbsd-dev", "libgnutls28-dev", "libnftables-dev",
]
"""What `make criu` needs on Debian 12 and 13 (no Python, no documentation tools)."""
APT_HELPER = "/usr/lib/apt/apt-helper"
BUILD_TAIL_LINES = 40
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


def parse_release(text: str) -> str | None:
    """The release in `criu --version` output ("Version: 4.1.1" gives "4.1.1")."""
    match = re.search(r"^Version:\s*(\d+(?:\.\d+)+)\s*$", text, re.M)
    return match[1] if match else None


def criu_release(binary: str | Path) -> str | None:
    """What `BINARY --version` reports, or None when it does not run."""
    try:
        proc = run([str(binary), "--version"], check=False)
    except OSError:
        return None
    return parse_release(proc.stdout) if proc.returncode == 0 else None


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


def sources_list(mirror: str, suite: str, kinds: Iterable[str] = ("deb",)) -> str:
    """A one-suite sources.list: `deb` for binary packages, `deb-src` for source packages."""
    return "".join(f"{kind} {mirror} {suite} main\n" for kind in kinds)


def parse_source_uris(text: str) -> list[tuple[str, str, str]]:
    """(URI, file name, hash) of each file in `apt-get source --print-uris` output."""
    files = []
    for line in text.splitlines():
        match = re.match(r"^'([^']+)'\s+(\S+)\s+\d+\s+(\S+:\S+)\s*$", line)
        if match:
            files.append((match[1], match[2], match[3]))
    return files


class PrivateApt:
    """apt-get with its own source list and cache: downloads packages or sources, installs nothing."""

    def __init__(self, root: Path, mirror: str, suite: str, kinds: Iterable[str] = ("deb",)):
        self.root = root
        (root / "lists" / "partial").mkdir(parents=True, exist_ok=True)
        (root / "cache" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
        (root / "sources.list").write_text(sources_list(mirror, suite, kinds))
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

    def upstream_tarball(self, package: str, into: Path) -> Path:
        """The upstream tarball (`*.orig.tar.*`) of the source package, alone: apt-helper checks it
        against the hash in the signed Sources index. (The .dsc and the Debian packaging are not
        needed, and some mirrors lack them.)"""
        listing = run(["apt-get", *self.options, "source", "--print-uris", "-qq", package]).stdout
        tarballs = [f for f in parse_source_uris(listing) if ".orig.tar." in f[1]]
        if len(tarballs) != 1:
            raise DevClusterError(
                f"no single upstream tarball in Debian's {package} source: {listing.strip() or 'nothing'}")
        ((uri, name, digest),) = tarballs
        into.mkdir(parents=True, exist_ok=True)
        run([APT_HELPER, *self.options, "download-file", uri, str(into / name), digest])
        return into / name


def bundled_criu(prefix: Path) -> Path:
    return prefix / "criu" / "bin" / "criu"


def stamp_path(prefix: Path) -> Path:
    return prefix / "criu" / "BUILD"


def criu_patches(folder: Traversable | None = None) -> list[tuple[str, bytes]]:
    """(name, contents) of each `*.patch` in FOLDER (the criu_patches package data), in name order."""
    folder = folder if folder is not None else resources.files(CRIU_PATCHES)
    found = [(entry.name, entry.read_bytes()) for entry in folder.iterdir()
             if entry.name.endswith(".patch") and entry.is_file()]
    return sorted(found)


def build_stamp(version: str, patches: list[tuple[str, bytes]]) -> str:
    """PREFIX/criu/BUILD: the upstream release and a digest of the patches' names and contents."""
    digest = hashlib.sha256()
    for name, data in sorted(patches):
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return f"criu {version}\npatches sha256:{digest.hexdigest()}\n"


def tarball_version(name: str, package: str = CRIU_SOURCE) -> str | None:
    """The upstream version in an upstream tarball's name (criu_4.1.1.orig.tar.xz gives 4.1.1)."""
    match = re.fullmatch(rf"{re.escape(package)}_(.+)\.orig\.tar\.\w+", name)
    return match[1] if match else None


def build_step(argv: list[str], cwd: Path, log: TextIO, what: str) -> None:
    """Run one step of the criu build, its output appended to LOG; a failure shows its last lines."""
    log.write(f"$ {' '.join(argv)}\n")
    log.flush()
    proc = subprocess.run(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace")
    log.write(proc.stdout)
    log.flush()
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.rstrip().splitlines()[-BUILD_TAIL_LINES:])
        raise DevClusterError(f"building criu: {what}: `{' '.join(argv)}` failed ({proc.returncode}); "
                              f"its last lines (all in {log.name}):\n{tail}")


def write_atomically(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.new")
    tmp.write_bytes(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def ensure_criu(layout: Layout, say: Say, patch_folder: Traversable | None = None) -> Path:
    """PREFIX/criu/bin/criu: criu CRIU_VERSION from Debian's source with checkpoint/criu_patches applied,
    built here; reused while PREFIX/criu/BUILD matches the patches and the binary runs."""
    patches = criu_patches(patch_folder)
    stamp = build_stamp(CRIU_VERSION, patches)
    root, binary, stamp_file = layout.prefix / "criu", bundled_criu(layout.prefix), stamp_path(layout.prefix)
    try:
        built = stamp_file.read_text()
    except OSError:
        built = None
    if built == stamp and criu_release(binary) == CRIU_VERSION:
        return binary
    ensure_packages(CRIU_BUILD_PACKAGES, say)
    names = ", ".join(name for name, _ in patches) or "none"
    say(f"building criu {CRIU_VERSION} from Debian {CRIU_SUITE}'s source into {binary} (patches: {names})")
    apt = PrivateApt(layout.lib_dir / "apt-criu", debian_mirror(), CRIU_SUITE, kinds=("deb-src",))
    apt.update()
    (root / "bin").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="criu-build-") as tmp, open(root / "build.log", "w") as log:
        tarball = apt.upstream_tarball(CRIU_SOURCE, Path(tmp))
        if tarball_version(tarball.name) != CRIU_VERSION:
            raise DevClusterError(
                f"Debian {CRIU_SUITE} now has {tarball.name}, the criu patches are for {CRIU_VERSION}: "
                "update CRIU_VERSION in the installer and check that checkpoint/criu_patches still apply")
        unpacked = Path(tmp) / "src"
        unpacked.mkdir()
        build_step(["tar", "-xf", str(tarball), "-C", str(unpacked)], Path(tmp), log, "unpacking the source")
        folders = [path for path in unpacked.iterdir() if path.is_dir()]
        if len(folders) != 1:
            raise DevClusterError(f"{tarball.name} does not hold one source folder: {folders}")
        source = folders[0]
        for name, data in patches:
            patch_file = Path(tmp) / name
            patch_file.write_bytes(data)
            build_step(["patch", "-p1", "--forward", "--batch", "--fuzz=0", "--no-backup-if-mismatch",
                        "-i", str(patch_file)], source, log, f"applying {name}")
        build_step(["make", f"-j{len(os.sched_getaffinity(0))}", "criu"], source, log, "make")
        release = criu_release(source / "criu" / "criu")
        if release != CRIU_VERSION:
            raise DevClusterError(f"the criu just built reports version {release}, not {CRIU_VERSION}")
        write_atomically(binary, (source / "criu" / "criu").read_bytes(), 0o755)
    write_atomically(stamp_file, stamp.encode(), 0o644)
    # Debian 13's binary, bundled here before criu was built from source, came with its own libraries
    shutil.rmtree(root / "lib", ignore_errors=True)
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
