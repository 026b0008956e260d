"""`make test` runs the unit and the integration tests side by side (pytest-xdist, two workers).

The integration tests share one dev cluster and disturb it (they stop its daemons, fill its nodes,
count its processes), so they all go to one worker and run there one after another, in file order;
the unit tests take the other worker meanwhile.
"""

from __future__ import annotations

from pathlib import Path

import pytest

INTEGRATION = Path(__file__).parent / "integration"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if item.path.is_relative_to(INTEGRATION):
            item.add_marker(pytest.mark.xdist_group("dev-cluster"))
