"""Real device proxies and real worker processes, without Slurm: the unit tests' job.

The proxies run in the test's process (as in the integration tests' reference runs), with a job uid
of this process's user. Workers are plain Python processes with a rank's environment: the
sitecustomize on their PYTHONPATH installs the `singularity` backend when they import torch, so their
unmodified `init_process_group("gloo")` goes through the proxies. Rank sockets live under a state
folder of the test's own (`state_folder`), and every job has a random id.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from singularity_slurm.config import ProxyConfig
from singularity_slurm.interpose import HOOK_DIR
from singularity_slurm.interpose.pyhook._singularity_worker import wire
from singularity_slurm.proxy.daemon import Proxy
from singularity_slurm.proxy.hal import HostBackend
from singularity_slurm.proxy.rendezvous import MemoryRendezvous

HOOK = str(HOOK_DIR)


def state_folder() -> Path:
    """A state folder the proxies accept (root's, mode 0755, in sticky /tmp) that a job user of
    another uid can reach, as /run/singularity-slurm is on a node. Remove it with `remove_state`."""
    folder = Path(tempfile.mkdtemp(prefix="singularity-state-", dir="/tmp"))
    folder.chmod(0o755)
    return folder


def remove_state(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


class Job:
    """In-process proxies for a placement, and worker processes for its ranks."""

    def __init__(self, folder: Path, placement: dict[int, str], uid: int | None = None,
                 state_dir: Path | None = None, limits: ProxyConfig | None = None,
                 memory: dict[str, object] | None = None, cuda: dict[str, object] | None = None):
        """`memory`: a stand-in for a proxy's GPU memory (proxy.swap.GpuMemory), by proxy id; `cuda`:
        one for its GPU buffers and reductions (proxy.gpu.CudaDevice)."""
        self.folder = folder
        self.id = int.from_bytes(os.urandom(4), "big") + 10**10
        self.placement = placement
        self.own_state = state_dir is None
        self.state_dir = state_folder() if state_dir is None else state_dir
        self.rank_dir = str(self.state_dir / "ranks")
        rendezvous = MemoryRendezvous()
        uid = os.getuid() if uid is None else uid
        self.proxies = {p: Proxy(self.id, uid, p, HostBackend(), lambda: rendezvous, state_dir=self.state_dir,
                                 bind_host="127.0.0.1", limits=limits, memory=(memory or {}).get(p),
                                 cuda=(cuda or {}).get(p))
                        for p in sorted(set(placement.values()))}
        for proxy in self.proxies.values():
            proxy.configure("1", placement)
        self.workers: dict[int, subprocess.Popen] = {}

    def start(self, source: str, mode: str = "", python: str = sys.executable,
              args: Sequence[str] | None = None) -> None:
        """Run `python worker.py MODE FOLDER` (worker.py holding `source`; or `ARGS...` instead of
        MODE FOLDER) as every rank, with the environment `singularityctl run --world-size N` gives
        ranks: only the hook on PYTHONPATH."""
        script = self.folder / "worker.py"
        script.write_text(source)
        argv = [python, str(script), *([mode, str(self.folder)] if args is None else args)]
        for rank in sorted(self.placement):
            env = dict(os.environ, SINGULARITY_PROXY="1", PYTHONPATH=HOOK, SINGULARITY_JOB_ID=str(self.id),
                       SINGULARITY_RANK_DIR=self.rank_dir,
                       RANK=str(rank), WORLD_SIZE=str(len(self.placement)), LOCAL_RANK="0",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
            with open(self.folder / f"worker-{rank}.log", "wb") as log:
                self.workers[rank] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)

    def log(self, rank: int) -> str:
        return (self.folder / f"worker-{rank}.log").read_text(errors="replace")

    def wait_for(self, what: str, check: Callable[[], bool], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            for rank, proc in self.workers.items():
                if proc.poll() is not None:
                    pytest.fail(f"rank {rank} exited with {proc.returncode} waiting for {what}:\n"
                                f"{self.log(rank)}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} within {timeout:.0f}s; proxies: "
                            f"{[p.status() for p in self.proxies.values()]}")
            time.sleep(0.02)

    def wait_for_files(self, name: str) -> None:
        self.wait_for(f"{name} files",
                      lambda: all((self.folder / f"{name}-{r}").exists() for r in self.workers))

    def touch(self, name: str) -> None:
        (self.folder / name).touch()

    def results(self, timeout: float = 60) -> dict[int, dict]:
        for rank, proc in self.workers.items():
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} did not finish:\n{self.log(rank)}")
            assert code == 0, f"rank {rank} exited with {code}:\n{self.log(rank)}"
        return {r: json.loads((self.folder / f"result-{r}.json").read_text()) for r in self.workers}

    def on_every_proxy(self, action: Callable[[Proxy], dict]) -> dict[str, dict | Exception]:
        """`action` on every proxy at once, as the node agents do: each one's answer or exception."""
        answers: dict[str, dict | Exception] = {}

        def run(proxy: Proxy) -> None:
            try:
                answers[proxy.id] = action(proxy)
            except Exception as exc:
                answers[proxy.id] = exc

        threads = [threading.Thread(target=run, args=(p,)) for p in self.proxies.values()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        return answers

    def close(self) -> None:
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
        for proxy in self.proxies.values():
            proxy.stopping = True  # else a proxy whose peer closes exits the process
        for proxy in self.proxies.values():
            proxy.close()
        if self.own_state:
            remove_state(self.state_dir)

    def address(self, rank: int) -> str:
        return wire.rank_address(self.id, rank, self.rank_dir)


def requirement_closure(names: list[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions of `names` and of what they require at run time (no extras)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        key = re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
        if key in found:
            continue
        found[key] = dist
        for requirement in dist.requires or []:
            if "extra ==" not in requirement:
                todo.append(re.match(r"[A-Za-z0-9._-]+", requirement).group(0))
    return list(found.values())


def make_user_venv(venv: Path) -> Path:
    """A user's venv at `venv`: another interpreter whose site-packages hold torch, numpy and torch's
    run-time requirements (linked from this environment) and nothing of the project's; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    for dist in requirement_closure(["torch", "numpy"]):
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (site / top).exists():
                (site / top).symlink_to(source)
    return python
