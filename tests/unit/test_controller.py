"""The SLA controller's pure parts, and its metrics against the Grafana dashboard that shows them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from singularity_slurm.coordinator.controller import Metrics, gpus_per_node

ROOT = Path(__file__).resolve().parents[2]


def test_the_most_devices_a_node_has_sizes_a_resize() -> None:
    sinfo = "n1 gpu:4 gpu:2(IDX:0-1) mixed\nn2 gpu:a100:8 gpu:a100:0 idle\nn3 (null) (null) idle\n"
    assert gpus_per_node(sinfo) == 8
    assert gpus_per_node("") == 0


def test_every_metric_the_dashboard_queries_is_one_the_controller_exports() -> None:
    from prometheus_client import generate_latest

    metrics = Metrics()
    metrics.fraction.labels("standard").observe(0.9)
    metrics.checkpoints.labels("preempt").inc()
    metrics.jobs.labels("basic", "running").set(1)
    metrics.held.labels("basic").set(1)
    metrics.attainment.labels("basic").set(1)
    metrics.decisions.labels("grow").inc()
    lines = generate_latest(metrics.registry).decode().splitlines()
    exported = {line.split("{")[0].split(" ")[0] for line in lines if line and not line.startswith("#")}
    dashboard = json.loads((ROOT / "contrib" / "grafana" / "singularity-sla.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"singularity_[a-z_]+", target["expr"])}
    assert queried and queried <= exported, queried - exported
