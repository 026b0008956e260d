"""benchmarks/elastic_sizes.py: its plan, its summary, and the options it refuses (pure logic; the
runs themselves need root, proxies and torch workers, and are the benchmark's own business)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import elastic_sizes as bench  # noqa: E402


def test_every_count_once_per_round_in_each_mode_where_ranks_share_a_device():
    runs = bench.plan([4, 2, 1], rounds=2, world_size=4, slicings=[bench.TURNS])
    assert runs == [(1, 4, bench.ALONE), (1, 2, bench.TURNS), (1, 1, bench.TURNS),
                    (2, 2, bench.TURNS), (2, 1, bench.TURNS), (2, 4, bench.ALONE)]
    both = bench.plan([2, 1], rounds=2, world_size=4, slicings=[bench.CONCURRENT, bench.TURNS])
    assert both == [(1, 2, bench.CONCURRENT), (1, 2, bench.TURNS), (1, 1, bench.CONCURRENT),
                    (1, 1, bench.TURNS), (2, 1, bench.TURNS), (2, 1, bench.CONCURRENT),
                    (2, 2, bench.TURNS), (2, 2, bench.CONCURRENT)]


def _run(step_ms: float, loss: float = 0.5):
    return bench.base.Run(round=1, hidden=256, mode=bench.base.PROXY, position=1, step_ms=step_ms, loss=loss)


def test_slowdown_is_against_the_most_devices_and_overhead_against_the_ideal():
    runs = [(4, bench.ALONE, _run(10.0)), (4, bench.ALONE, _run(12.0)),
            (2, bench.TURNS, _run(22.0)), (1, bench.TURNS, _run(44.0))]
    rows = {row.devices: row for row in bench.summarize(runs, 4)}
    assert rows[4].step_ms == 11.0 and rows[4].slowdown == 1.0 and rows[4].ideal == 1.0
    assert rows[2].slowdown == 2.0 and rows[2].ideal == 2.0 and rows[2].overhead == 1.0
    assert rows[1].slowdown == 4.0 and rows[1].ideal == 4.0 and rows[1].ranks_per_device == 4
    assert all(row.losses == [0.5] for row in rows.values())


@pytest.mark.parametrize(("argv", "says"), [
    (["--device-ms", "20", "--slicing", "concurrent,turns"], "would overlap"),
    (["--device-ms", "-1"], "--device-ms -1"),
    (["--devices", "3"], "each count must divide"),
    (["--slicing", "sideways"], "give concurrent, turns or both"),
])
def test_bad_options_are_refused_before_anything_runs(argv, says, capsys, tmp_path):
    assert bench.main([*argv, "--results-dir", str(tmp_path)]) == 2
    assert says in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_emulated_devices_need_no_cpu_per_device(monkeypatch, capsys, tmp_path):
    """Past the option checks (it stops at the root check here): no CPU count or taskset is asked."""
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda _pid: {0})
    monkeypatch.setattr(bench.os, "geteuid", lambda: 1000)
    assert bench.main(["--device-ms", "5", "--devices", "4,2,1", "--results-dir", str(tmp_path)]) == 2
    assert "run it as root" in capsys.readouterr().err
    assert bench.main(["--devices", "4,2,1", "--results-dir", str(tmp_path)]) == 2
    assert "4 devices need 4 CPUs" in capsys.readouterr().err
