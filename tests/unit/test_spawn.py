"""The in-tree rank spawner: one process per local rank, and a failed rank stops its node's others."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from singularity_slurm.interpose.spawn import main

RECORD = ("import json, os, sys; "
          "open(os.path.join(sys.argv[1], os.environ['RANK']), 'w').write(json.dumps("
          "{k: os.environ.get(k) for k in ('RANK', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'KEEP')}))")


def test_runs_the_command_once_per_local_rank_with_its_numbers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SINGULARITY_LOCAL_RANKS", "3,5")
    monkeypatch.setenv("KEEP", "the rest of the environment")

    assert main(["--", sys.executable, "-c", RECORD, str(tmp_path)]) == 0

    assert sorted(p.name for p in tmp_path.iterdir()) == ["3", "5"]
    assert json.loads((tmp_path / "3").read_text()) == {
        "RANK": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "KEEP": "the rest of the environment"}
    assert json.loads((tmp_path / "5").read_text()) == {
        "RANK": "5", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "KEEP": "the rest of the environment"}


def test_the_separator_is_optional(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SINGULARITY_LOCAL_RANKS", "0")

    assert main([sys.executable, "-c", RECORD, str(tmp_path)]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["0"]


def test_a_failing_rank_stops_the_others_and_its_status_is_the_exit_status(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SINGULARITY_LOCAL_RANKS", "0,1,2")
    script = ("import os, sys, time\n"
              "rank = os.environ['RANK']\n"
              "open(os.path.join(sys.argv[1], 'started-' + rank), 'w').close()\n"
              "if rank == '1':\n"
              "    time.sleep(0.5)\n"
              "    sys.exit(7)\n"
              "time.sleep(60)\n"
              "open(os.path.join(sys.argv[1], 'finished-' + rank), 'w').close()\n")
    started = time.monotonic()

    status = main(["--", sys.executable, "-c", script, str(tmp_path)])

    assert status == 7
    assert time.monotonic() - started < 30
    assert sorted(p.name for p in tmp_path.iterdir()) == ["started-0", "started-1", "started-2"]
    assert capsys.readouterr().err == (
        "[singularity] rank 1 exited with status 7; stopping the node's other ranks\n")


def test_a_rank_killed_by_a_signal_gives_128_plus_the_signal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SINGULARITY_LOCAL_RANKS", "0,1")
    script = ("import os, signal, time\n"
              "if os.environ['RANK'] == '0':\n"
              "    os.kill(os.getpid(), signal.SIGKILL)\n"
              "time.sleep(60)\n")

    assert main(["--", sys.executable, "-c", script]) == 128 + 9


def test_every_rank_succeeding_is_status_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SINGULARITY_LOCAL_RANKS", "0,1")

    assert main(["--", sys.executable, "-c", "pass"]) == 0


@pytest.mark.parametrize("value", [None, "0,x", "one"])
def test_missing_or_bad_local_ranks_is_status_2_with_a_message(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], value: str | None) -> None:
    if value is None:
        monkeypatch.delenv("SINGULARITY_LOCAL_RANKS", raising=False)
    else:
        monkeypatch.setenv("SINGULARITY_LOCAL_RANKS", value)

    assert main(["--", sys.executable, "-c", "pass"]) == 2
    assert capsys.readouterr().err == (
        "[singularity] SINGULARITY_LOCAL_RANKS must list this node's ranks (e.g. 0,1)\n")


@pytest.mark.parametrize("argv", [[], ["--"]])
def test_no_command_is_status_2_with_the_usage(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("usage: python -m singularity_slurm.interpose.spawn -- CMD")
