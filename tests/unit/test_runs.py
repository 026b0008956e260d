"""The identity and outcome of each `singularityctl run` of a job, across requeues (node.runs)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from singularity_slurm.node import runs
from singularity_slurm.node.agent import AgentState

TRAIN = ["python", "train.py"]
EVAL = ["python", "eval.py"]


def test_a_run_is_known_by_its_position_and_its_command() -> None:
    assert runs.key_of(0, TRAIN) != runs.key_of(1, TRAIN)
    assert runs.key_of(0, TRAIN) != runs.key_of(0, EVAL)
    assert runs.key_of(0, TRAIN) == runs.key_of(0, list(TRAIN))
    assert runs.key_of(12, TRAIN).startswith("12-")


def test_a_new_run_begins_running_with_nothing_known_before() -> None:
    records, before = runs.begin({}, 0, TRAIN)

    assert before is None
    assert records == {"0": {"key": runs.key_of(0, TRAIN), "command": "python train.py", "state": "running",
                             "exit_status": None}}


def test_after_a_requeue_a_finished_run_is_reported_with_its_status() -> None:
    records, _ = runs.begin({}, 0, TRAIN)
    records = runs.finish(records, runs.key_of(0, TRAIN), 3)

    again, before = runs.begin(records, 0, TRAIN)

    assert again == records
    assert before == {"key": runs.key_of(0, TRAIN), "command": "python train.py", "state": "finished",
                      "exit_status": 3}


def test_after_a_requeue_the_interrupted_run_is_reported_running() -> None:
    records = runs.begin(runs.finish(runs.begin({}, 0, TRAIN)[0], runs.key_of(0, TRAIN), 0), 1, EVAL)[0]

    assert runs.begin(records, 0, TRAIN)[1]["state"] == "finished"
    assert runs.begin(records, 1, EVAL)[1]["state"] == "running"
    assert runs.begin(records, 2, TRAIN)[1] is None


def test_a_script_that_diverged_forgets_the_runs_from_the_first_mismatch_on() -> None:
    records = runs.begin(runs.begin({}, 0, TRAIN)[0], 1, EVAL)[0]

    changed, before = runs.begin(records, 0, EVAL)

    assert before is None
    assert list(changed) == ["0"] and changed["0"]["command"] == "python eval.py"


def test_a_long_command_is_recorded_shortened_and_still_known_by_its_whole_text() -> None:
    command = ["python", "train.py", "--tag", "x" * 1000]
    records, _ = runs.begin({}, 0, command)

    assert len(records["0"]["command"]) == runs.MAX_DESCRIPTION
    assert records["0"]["command"].endswith("...")
    assert runs.begin(records, 0, command[:-1] + ["y" * 1000])[1] is None


@pytest.mark.parametrize("index", [-1, runs.MAX_RUNS, True, "0"])
def test_an_index_out_of_range_is_refused(index: object) -> None:
    with pytest.raises(runs.RunRecordError, match="out of range"):
        runs.begin({}, index, TRAIN)  # type: ignore[arg-type]


@pytest.mark.parametrize("command", [[], "python train.py", [1, 2], None])
def test_a_command_that_is_not_a_list_of_strings_is_refused(command: object) -> None:
    with pytest.raises(runs.RunRecordError, match="non-empty list of strings"):
        runs.begin({}, 0, command)  # type: ignore[arg-type]


def test_finishing_a_run_that_never_began_is_refused() -> None:
    with pytest.raises(runs.RunRecordError, match="no run '0-0000000000000000' was begun"):
        runs.finish({}, "0-0000000000000000", 0)


@pytest.mark.parametrize("status", [-1, 256, "0", None, False])
def test_an_exit_status_outside_0_255_is_refused(status: object) -> None:
    records = runs.begin({}, 0, TRAIN)[0]
    with pytest.raises(runs.RunRecordError, match="exit status"):
        runs.finish(records, runs.key_of(0, TRAIN), status)  # type: ignore[arg-type]


def test_records_survive_a_save_and_load_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "job" / runs.FILE_NAME
    records = runs.finish(runs.begin({}, 0, TRAIN)[0], runs.key_of(0, TRAIN), 0)

    runs.save(path, records)

    assert runs.load(path) == records
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert [p.name for p in path.parent.iterdir()] == [runs.FILE_NAME]


@pytest.mark.parametrize("content", [b"", b"not json", b"[1, 2]", b'{"0": "x"}', b'{"x": {"key": "k"}}',
                                     b'{"0": {"key": "k", "state": "exploded"}}'])
def test_unusable_records_are_ignored_and_the_runs_start_afresh(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / runs.FILE_NAME
    path.write_bytes(content)

    assert runs.load(path) == {}


def test_missing_or_oversized_records_read_as_none(tmp_path: Path) -> None:
    assert runs.load(tmp_path / "absent.json") == {}
    big = tmp_path / runs.FILE_NAME
    big.write_bytes(json.dumps({"0": {"key": "k", "state": "running", "pad": "x" * runs.MAX_FILE}}).encode())
    assert runs.load(big) == {}


# --- through the agent -------------------------------------------------------------------------------


class Engine:
    """The engine's run records kept in a folder (the real methods, a temporary store)."""

    def __init__(self, root: Path):
        self.path = root / runs.FILE_NAME

    def run_begin(self, job_id: int, index: int, command: list[str]):
        records, before = runs.begin(runs.load(self.path), index, command)
        runs.save(self.path, records)
        return records[str(index)]["key"], before

    def run_end(self, job_id: int, key: str, exit_status: int) -> None:
        runs.save(self.path, runs.finish(runs.load(self.path), key, exit_status))


def test_the_agent_numbers_the_runs_of_a_start_in_order(tmp_path: Path) -> None:
    agent = AgentState(7, 1000, "n1", engine=Engine(tmp_path))

    first = agent.handle({"op": "run_begin", "command": TRAIN}, 1000)
    second = agent.handle({"op": "run_begin", "command": EVAL}, 1000)

    assert (first["index"], second["index"]) == (0, 1)
    assert first["record"] is None and second["record"] is None
    assert agent.handle({"op": "run_end", "key": first["key"], "exit_status": 0}, 1000) == {"ok": True}

    restarted = AgentState(7, 1000, "n2", engine=Engine(tmp_path))  # after a requeue, on another node
    assert restarted.handle({"op": "run_begin", "command": TRAIN}, 1000)["record"]["state"] == "finished"
    assert restarted.handle({"op": "run_begin", "command": EVAL}, 1000)["record"]["state"] == "running"


@pytest.mark.parametrize("key", [None, "../../etc", 7, "0-xyz"])
def test_run_end_needs_a_run_key(tmp_path: Path, key: object) -> None:
    agent = AgentState(7, 1000, "n1", engine=Engine(tmp_path))

    reply = agent.handle({"op": "run_end", "key": key, "exit_status": 0}, 1000)

    assert reply["ok"] is False
    assert "key" in reply["error"]


def test_a_refused_run_begin_does_not_use_up_a_position(tmp_path: Path) -> None:
    agent = AgentState(7, 1000, "n1", engine=Engine(tmp_path))

    assert agent.handle({"op": "run_begin", "command": []}, 1000)["ok"] is False
    assert agent.handle({"op": "run_begin", "command": TRAIN}, 1000)["index"] == 0


def test_save_writes_through_a_temp_name_of_its_own(tmp_path):
    path = tmp_path / "job" / runs.FILE_NAME
    path.parent.mkdir()
    stale = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # a pid-only name another writer could hold
    stale.write_text("another writer's")
    records, _ = runs.begin({}, 0, ["python", "a.py"])

    runs.save(path, records)

    assert runs.load(path) == records
    assert stale.read_text() == "another writer's"
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, stale.name])
