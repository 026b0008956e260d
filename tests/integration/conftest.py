"""Integration fixtures: the running dev cluster (real slurmctld, slurmd, munge, Redis, CRIU).

Jobs are submitted as the non-root job user from a folder of its own, and cancelled at the end of
each test; `other_user` / `other_jobs` do the same for the second unprivileged user, for tests of
what one user can do to another's jobs. `make test` brings the cluster up before pytest runs.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from singularity_slurm import config as config_mod
from singularity_slurm.coordinator.registry import Registry, connect
from singularity_slurm.devcluster.cluster import default_layout
from singularity_slurm.slurmcli import SlurmClient

pytestmark = pytest.mark.integration

CTL = str(Path(config_mod.load().paths.prefix) / "venv" / "bin" / "singularityctl")


def _cluster_up() -> bool:
    proc = subprocess.run(["scontrol", "ping"], capture_output=True, text=True)
    return proc.returncode == 0 and "UP" in proc.stdout


@pytest.fixture(scope="session", autouse=True)
def cluster() -> None:
    """The running dev cluster, with no jobs of the test users left from an interrupted run."""
    if os.geteuid() != 0 or not _cluster_up():
        pytest.fail("the dev cluster is not running: run `make test` (it brings the cluster up)")
    users = [u for u in default_layout().job_users if _exists(u)]
    for user in users:
        subprocess.run(["scancel", "--user", user], capture_output=True)
    _wait_until_no_jobs(users)
    _unmount_small_stores(Path(config_mod.load().paths.store_root))


def _unmount_small_stores(store_root: Path) -> None:
    """Take away the tmpfs mounts over job folders of the store that an interrupted run of
    test_checkpoint_restore's `small_store` left: every job's mount namespace is a copy of the
    host's, so criu would dump such a mount's content into every later checkpoint."""
    listed = subprocess.run(["findmnt", "-rn", "-t", "tmpfs", "-o", "TARGET"], capture_output=True,
                            text=True).stdout.split()
    for target in listed:
        if Path(target).parent == store_root / "jobs":
            subprocess.run(["umount", "-l", target], check=True)


def _wait_until_no_jobs(users: list[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while users and time.monotonic() < deadline:
        left = subprocess.run(["squeue", "--noheader", "--user", ",".join(users)],
                              capture_output=True, text=True).stdout.strip()
        if not left:
            break
        time.sleep(0.5)


@pytest.fixture(scope="session", autouse=True)
def store_holds_only_live_jobs(cluster) -> Iterator[None]:
    """After the whole suite, the store holds nothing of the suite's jobs but the folders of jobs that
    still live: every job that ended has gone (the dev cluster keeps ended jobs' checkpoints for 0
    minutes). Folders from before the suite (an earlier run's, an orphan not yet old enough) are not
    the suite's."""
    config = config_mod.load()
    before = set(_store_folders(config.paths.store_root))
    yield
    _wait_until_no_jobs([u for u in default_layout().job_users if _exists(u)])
    proc = subprocess.run([CTL, "admin", "gc", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    live = {r["JobId"] for r in SlurmClient().jobs()
            if r.get("JobState") not in ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL",
                                         "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY")}
    left = {str(folder): sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            for folder in _store_folders(config.paths.store_root)
            if folder not in before and folder.name not in live}
    assert not left, f"the store still holds folders of jobs that ended (bytes): {left}"


def _store_folders(root: Path) -> list[Path]:
    return [folder for part in (root, *sorted((root / "ranks").glob("*")))
            for folder in (part / "jobs").glob("*")]


def _exists(user: str) -> bool:
    try:
        pwd.getpwnam(user)
    except KeyError:
        return False
    return True


@pytest.fixture(scope="session")
def layout():
    return default_layout()


@pytest.fixture(scope="session")
def config() -> config_mod.Config:
    return config_mod.load()


@pytest.fixture(scope="session")
def slurm() -> SlurmClient:
    return SlurmClient()


@pytest.fixture(scope="session")
def registry(config) -> Registry:
    return Registry(connect(config.redis))


@pytest.fixture
def job_user(layout) -> pwd.struct_passwd:
    return pwd.getpwnam(layout.job_user)


@pytest.fixture
def other_user(layout) -> pwd.struct_passwd:
    """The second unprivileged user (`singularityctl devcluster up` creates it)."""
    try:
        return pwd.getpwnam(layout.other_user)
    except KeyError:
        pytest.fail(f"user {layout.other_user} missing: run `singularityctl devcluster up`")


def _user_workdir(user: pwd.struct_passwd) -> Iterator[Path]:
    path = Path(user.pw_dir) / "tests" / uuid.uuid4().hex[:8]
    path.mkdir(parents=True)
    for p in (path.parent, path):
        os.chown(p, user.pw_uid, user.pw_gid)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def workdir(job_user) -> Iterator[Path]:
    yield from _user_workdir(job_user)


@pytest.fixture
def other_workdir(other_user) -> Iterator[Path]:
    yield from _user_workdir(other_user)


def run_as(user: str, argv: list[str], cwd: Path | None = None,
           check: bool = False) -> subprocess.CompletedProcess[str]:
    full = ["runuser", "-u", user, "--", *argv]
    if cwd:
        full = ["runuser", "-u", user, "--", "env", "-C", str(cwd), *argv]
    return subprocess.run(full, capture_output=True, text=True, check=check, timeout=60)


class Jobs:
    """Submits jobs as one user and cancels them all at the end of the test."""

    def __init__(self, user: str, workdir: Path, slurm: SlurmClient):
        self.user = user
        self.workdir = workdir
        self.slurm = slurm
        self.ids: list[int] = []

    def script(self, name: str, body: str) -> Path:
        path = self.workdir / name
        path.write_text(body)
        os.chmod(path, 0o755)
        shutil.chown(path, self.user)
        return path

    def sbatch(self, script: Path, *options: str) -> subprocess.CompletedProcess[str]:
        proc = run_as(self.user, ["sbatch", "--parsable", *options, str(script)], cwd=self.workdir)
        if proc.returncode == 0:
            self.ids.append(int(proc.stdout.strip().split(";")[0]))
        return proc

    def submit(self, script: Path, *options: str) -> int:
        proc = self.sbatch(script, *options)
        assert proc.returncode == 0, proc.stderr
        return self.ids[-1]

    def record(self, job_id: int) -> dict[str, str]:
        record = self.slurm.job(job_id)
        assert record is not None, f"Slurm does not know job {job_id}"
        return record

    def wait(self, job_id: int, until: Callable[[dict[str, str]], bool], what: str,
             timeout: float = 90) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            record = self.record(job_id)
            if until(record):
                return record
            if record.get("JobState") == "FAILED":  # for good: nothing it waits for comes any more
                pytest.fail(f"job {job_id} failed before it became {what}: {record}")
            if time.monotonic() > deadline:
                pytest.fail(f"job {job_id} never became {what}: {record}")
            time.sleep(0.5)

    def wait_state(self, job_id: int, *states: str, timeout: float = 90) -> dict[str, str]:
        return self.wait(job_id, lambda r: r.get("JobState") in states, "/".join(states), timeout)

    def wait_for_file(self, name: str, timeout: float = 90) -> Path:
        path = self.workdir / name
        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > deadline:
                pytest.fail(f"{path} did not appear within {timeout:.0f}s")
            time.sleep(0.2)
        return path

    def cancel_all(self) -> None:
        if self.ids:
            subprocess.run(["scancel", *map(str, self.ids)], capture_output=True)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                states = [(self.slurm.job(j) or {}).get("JobState") for j in self.ids]
                if all(s in (None, "CANCELLED", "COMPLETED", "FAILED") for s in states):
                    break
                time.sleep(0.5)


@pytest.fixture
def jobs(job_user, workdir, slurm) -> Iterator[Jobs]:
    jobs = Jobs(job_user.pw_name, workdir, slurm)
    yield jobs
    jobs.cancel_all()


@pytest.fixture
def other_jobs(other_user, other_workdir, slurm) -> Iterator[Jobs]:
    """Like `jobs`, as the second unprivileged user, from a folder in its home."""
    jobs = Jobs(other_user.pw_name, other_workdir, slurm)
    yield jobs
    jobs.cancel_all()


def ctl_json(*args: str, user: str | None = None) -> object:
    argv = [CTL, *args, "--json"]
    proc = run_as(user, argv) if user else subprocess.run(argv, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


# --- what a failure report carries ----------------------------------------------------------------

NODE_LOG_DIR = Path("/var/log/singularity-slurm")
TAIL_LINES = 60


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report carries its jobs' output files and the node-log lines about its jobs:
    CI keeps nothing else of the cluster."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    for name in ("jobs", "other_jobs"):
        jobs = item.funcargs.get(name)
        if isinstance(jobs, Jobs):
            for section, text in _failure_context(jobs):
                report.sections.append((section, text))


def _failure_context(jobs: Jobs) -> list[tuple[str, str]]:
    sections = []
    for path in sorted(jobs.workdir.rglob("*")):
        if path.is_file() and path.suffix in (".out", ".log") and path.stat().st_size:
            text = _tail(path.read_text(errors="replace"))
            sections.append((f"job file {path.relative_to(jobs.workdir)}", text))
    marks = tuple(f" job={job_id} " for job_id in jobs.ids)
    for log in sorted(NODE_LOG_DIR.glob("node-*.log")) if marks else ():
        lines = [line for line in log.read_text(errors="replace").splitlines()
                 if any(m in line for m in marks)]
        if lines:
            sections.append((f"node log {log.name} (jobs {jobs.ids})", _tail("\n".join(lines))))
    return sections


def _tail(text: str) -> str:
    lines = text.splitlines()
    return "\n".join(([f"... ({len(lines) - TAIL_LINES} lines before)"] if len(lines) > TAIL_LINES else [])
                     + lines[-TAIL_LINES:])
