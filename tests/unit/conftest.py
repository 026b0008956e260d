"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from proxyjob import Job

from singularity_slurm.config import ProxyConfig


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    """Make jobs of real proxies (see `proxyjob`); their workers and proxies end with the test."""
    jobs: list[Job] = []

    def make(placement: dict[int, str], uid: int | None = None, limits: ProxyConfig | None = None) -> Job:
        jobs.append(Job(tmp_path, placement, uid, limits=limits))
        return jobs[-1]

    yield make
    for made in jobs:
        made.close()
