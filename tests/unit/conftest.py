"""Fixtures shared by the unit tests."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from proxyjob import Job

from singularity_slurm.config import ProxyConfig


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    """Make jobs of real proxies (see `proxyjob`); their workers and proxies end with the test."""
    jobs: list[Job] = []

    def make(placement: dict[int, str], uid: int | None = None, limits: ProxyConfig | None = None,
             memory: dict[str, object] | None = None, cuda: dict[str, object] | None = None) -> Job:
        jobs.append(Job(tmp_path, placement, uid, limits=limits, memory=memory, cuda=cuda))
        return jobs[-1]

    yield make
    for made in jobs:
        made.close()


REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


@pytest.fixture
def private_redis(tmp_path: Path):
    """A real redis-server of the test's own, on a Unix socket in its folder, and a client of it."""
    import redis

    if not Path(REDIS_SERVER).exists():
        pytest.skip("redis-server is not installed (make test installs it)")
    sock = tmp_path / "redis.sock"
    server = subprocess.Popen([REDIS_SERVER, "--port", "0", "--unixsocket", str(sock), "--save", "",
                               "--appendonly", "no", "--dir", str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        client = redis.Redis(unix_socket_path=str(sock), socket_timeout=5, decode_responses=True,
                             max_connections=512)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except (redis.ConnectionError, FileNotFoundError):
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.05)
        yield client
    finally:
        server.terminate()
        server.wait(timeout=30)
