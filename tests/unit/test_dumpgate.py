"""The node's dump slots: the earliest deadline dumps first, at most `slots` at once, across the
node's agents (real threads and processes on a real folder), and a dead holder frees its slot."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from singularity_slurm.errors import CheckpointError
from singularity_slurm.node import dumpgate
from singularity_slurm.node.dumpgate import DumpGate, Ticket

WAIT_S = 30.0


def ticket(deadline: int, arrived: int, job: int = 7) -> Ticket:
    return Ticket(deadline, arrived, job, 0, 100, 5)


def until(condition, what: str) -> None:
    """Wait for `condition` (a state another thread or process reaches), failing after WAIT_S."""
    limit = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < limit, f"not within {WAIT_S}s: {what}"
        time.sleep(0.01)


def test_a_ticket_is_its_file_name_and_nothing_else_is_one() -> None:
    t = Ticket(123, 456789, 42, 3, 999, 12345)
    assert Ticket.parse(t.name) == t
    assert t.name.startswith("0000000000123-")  # fixed width: the names sort as the tickets do
    strangers = ("gate.lock", "1-2-3", "a-b-c-d-e-f", "1-2-3-4-5-6-7", "1-2-3-4-5-²", "9" * 21 + "-1-1-1-1-1")
    for stranger in strangers:
        assert Ticket.parse(stranger) is None


@pytest.mark.parametrize(("waiting", "holding", "slots", "expected"), [
    ([ticket(5, 1)], 0, 0, True),  # no limit
    ([ticket(5, 1)], 7, 0, True),
    ([ticket(5, 1)], 0, 1, True),
    ([ticket(5, 1)], 1, 1, False),  # the one slot is taken
    ([ticket(5, 1), ticket(3, 2)], 0, 1, False),  # the other's deadline is earlier
    ([ticket(5, 1), ticket(3, 2)], 0, 2, True),  # two free slots: both go
    ([ticket(5, 1), ticket(3, 2)], 1, 2, False),
    ([ticket(5, 1), ticket(5, 2)], 0, 1, True),  # the same deadline: the first to come
    ([ticket(dumpgate.NO_DEADLINE_MS, 1), ticket(9, 2)], 0, 1, False),  # a periodic one goes last
])
def test_the_earliest_deadline_takes_a_free_slot(waiting: list[Ticket], holding: int, slots: int,
                                                 expected: bool) -> None:
    assert dumpgate.admitted(waiting[0], waiting, holding, slots) is expected


def test_the_deadline_comes_from_slurms_preemption_time() -> None:
    assert dumpgate.time_left(None, stop=False, warn_time=60, now=1000.0) is None  # the job runs on
    assert dumpgate.time_left(990.0, stop=False, warn_time=60, now=1000.0) is None
    assert dumpgate.time_left(990.0, stop=True, warn_time=60, now=1000.0) == 50.0
    assert dumpgate.time_left(900.0, stop=True, warn_time=60, now=1000.0) == 0.0  # late already
    assert dumpgate.time_left(None, stop=True, warn_time=60, now=1000.0) == 60.0  # a requeue, a migration
    assert dumpgate.deadline_ms(10.0, None) == dumpgate.NO_DEADLINE_MS
    assert dumpgate.deadline_ms(10.0, 2.5) == 12500
    assert dumpgate.deadline_ms(10.0, float("inf")) == dumpgate.NO_DEADLINE_MS


def slots_folder(tmp_path: Path):
    folder = tmp_path / "dump-slots"

    def make() -> Path:
        folder.mkdir(mode=0o700, exist_ok=True)
        return folder
    return make


def test_one_slot_goes_to_the_earliest_deadline_then_the_later(tmp_path: Path) -> None:
    gate = DumpGate(slots_folder(tmp_path), 1, liveness_s=5.0)
    order: list[str] = []
    waited: dict[str, float] = {}
    holding, release = threading.Event(), threading.Event()

    def dump(name: str, within: float | None, hold: bool = False) -> None:
        with gate.slot(1, 0, within) as seconds:
            order.append(name)
            waited[name] = seconds
            if hold:
                holding.set()
                release.wait(WAIT_S)

    first = threading.Thread(target=dump, args=("first", None, True))
    first.start()
    assert holding.wait(WAIT_S)
    late = threading.Thread(target=dump, args=("late", 50.0))
    late.start()
    until(lambda: len(os.listdir(tmp_path / "dump-slots" / "waiting")) == 1, "the late one waits")
    early = threading.Thread(target=dump, args=("early", 5.0))
    early.start()
    until(lambda: len(os.listdir(tmp_path / "dump-slots" / "waiting")) == 2, "both wait")
    release.set()  # woken by the holder, not by the 5 s look: the test would take 10 s otherwise
    for thread in (first, late, early):
        thread.join(WAIT_S)
    assert order == ["first", "early", "late"]
    assert waited["first"] < 0.5 and waited["early"] > 0 and waited["late"] >= waited["early"]
    assert os.listdir(tmp_path / "dump-slots" / "waiting") == []
    assert os.listdir(tmp_path / "dump-slots" / "holding") == []


def test_two_slots_are_held_at_once_and_no_more(tmp_path: Path) -> None:
    gate = DumpGate(slots_folder(tmp_path), 2, liveness_s=5.0)
    inside, most = [0], [0]
    lock = threading.Lock()
    go = threading.Barrier(5)

    def dump() -> None:
        go.wait(WAIT_S)
        with gate.slot(1, 0, 10.0):
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(0.05)  # a dump's work, so that the others find both slots taken
            with lock:
                inside[0] -= 1

    threads = [threading.Thread(target=dump) for _ in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert most[0] == 2


HOLDER = """
import sys, time
from pathlib import Path
from singularity_slurm.node.dumpgate import DumpGate
with DumpGate(lambda: Path(sys.argv[1]), 1).slot(9, 0, 1.0):
    print("holding", flush=True)
    time.sleep(3600)
"""


def test_the_slot_of_an_agent_killed_while_it_dumps_is_taken_by_the_next(tmp_path: Path) -> None:
    make = slots_folder(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(make())], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert holder.stdout.readline().strip() == "holding"
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(WAIT_S)
        assert len(os.listdir(tmp_path / "dump-slots" / "holding")) == 1  # it left its ticket behind
        with DumpGate(make, 1, liveness_s=0.1).slot(1, 0, 5.0) as waited:
            assert waited < WAIT_S
        assert os.listdir(tmp_path / "dump-slots" / "holding") == []
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_a_folder_others_may_write_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "dump-slots"
    folder.mkdir(mode=0o700)
    folder.chmod(0o777)
    with pytest.raises(CheckpointError, match="not root's alone"):
        with DumpGate(lambda: folder, 1).slot(1, 0, None):
            pass


def test_without_a_limit_no_folder_is_used(tmp_path: Path) -> None:
    with DumpGate(lambda: tmp_path / "nowhere", 0).slot(1, 0, 1.0) as waited:
        assert waited == 0.0
    assert not (tmp_path / "nowhere").exists()



def test_a_checkpoint_that_must_wait_is_paused_until_its_slot_and_one_that_need_not_is_never(
        tmp_path: Path) -> None:
    gate = DumpGate(slots_folder(tmp_path), 1, liveness_s=5.0)
    events: list[str] = []
    holding, release = threading.Event(), threading.Event()

    @contextlib.contextmanager
    def pause(name: str) -> Iterator[list[Path]]:
        events.append(f"{name} paused")
        yield []
        events.append(f"{name} resumed")

    def dump(name: str, hold: bool = False) -> None:
        with gate.slot(1, 0, 10.0, lambda: pause(name)):
            events.append(f"{name} dumps")
            if hold:
                holding.set()
                release.wait(WAIT_S)

    first = threading.Thread(target=dump, args=("first", True))
    first.start()
    assert holding.wait(WAIT_S)
    second = threading.Thread(target=dump, args=("second",))
    second.start()
    until(lambda: "second paused" in events, "the second one is paused")
    release.set()
    for thread in (first, second):
        thread.join(WAIT_S)
    assert events == ["first dumps", "second paused", "second resumed", "second dumps"]


def test_a_pause_that_cannot_end_fails_the_checkpoint_and_gives_the_slot_back(tmp_path: Path) -> None:
    gate = DumpGate(slots_folder(tmp_path), 1, liveness_s=5.0)
    holding, release = threading.Event(), threading.Event()

    @contextlib.contextmanager
    def stuck() -> Iterator[list[Path]]:
        yield []
        raise CheckpointError("cannot be thawed")

    def hold() -> None:
        with gate.slot(1, 0, 10.0):
            holding.set()
            release.wait(WAIT_S)

    first = threading.Thread(target=hold)
    first.start()
    assert holding.wait(WAIT_S)
    failed: list[Exception] = []

    def second() -> None:
        try:
            with gate.slot(2, 0, 10.0, stuck):
                raise AssertionError("a tree that could not be thawed was dumped")
        except CheckpointError as exc:
            failed.append(exc)

    waiter = threading.Thread(target=second)
    waiter.start()
    until(lambda: len(os.listdir(tmp_path / "dump-slots" / "waiting")) == 1, "the second one waits")
    release.set()
    for thread in (first, waiter):
        thread.join(WAIT_S)
    assert [str(e) for e in failed] == ["cannot be thawed"]
    assert os.listdir(tmp_path / "dump-slots" / "holding") == []
    assert os.listdir(tmp_path / "dump-slots" / "waiting") == []
