"""What a job can make the registry store is bounded: every event and checkpoint summary is clipped,
a job's lists keep their newest entries, and the controller counts each event once as they move."""

from __future__ import annotations

import json

import pytest

from singularity_slurm.coordinator import keys
from singularity_slurm.coordinator.controller import unseen
from singularity_slurm.coordinator.registry import (
    MAX_CHECKPOINTS,
    MAX_ENTRY_BYTES,
    MAX_EVENTS,
    MAX_STRING,
    Registry,
    bounded,
    entry_json,
)

JOB = 77


def test_strings_lists_and_nesting_are_clipped_and_numbers_kept() -> None:
    value = {"error": "e" * 600_000, "refused": [{"seq": i, "reason": "r" * 5000} for i in range(1000)],
             "deep": {"a": {"b": {"c": {"d": {"e": 1}}}}}, "seq": 3, "seconds": 1.5, "stop": True}

    clipped = bounded(value)

    assert len(clipped["error"]) == MAX_STRING + len("...(clipped)")
    assert len(clipped["refused"]) == 64
    assert all(len(r["reason"]) <= MAX_STRING + 12 for r in clipped["refused"])
    assert clipped["deep"]["a"]["b"]["c"] == "...(nested too deep)"
    assert (clipped["seq"], clipped["seconds"], clipped["stop"]) == (3, 1.5, True)


def test_an_entry_too_large_once_clipped_keeps_its_numbers_and_short_strings() -> None:
    entry = {"event": "restore", "seq": 9, "time": 1.0, "refused": [{"reason": "r" * 1000}] * 64}

    text = entry_json(entry)

    assert len(text) <= MAX_ENTRY_BYTES
    assert json.loads(text) == {"event": "restore", "seq": 9, "time": 1.0, "clipped": True}


def test_a_job_asking_for_checkpoints_without_end_keeps_a_bounded_record(private_redis) -> None:
    registry = Registry(private_redis, clock=lambda: 1000.0)
    before = private_redis.info("memory")["used_memory"]
    for seq in range(MAX_EVENTS + 30):
        registry.record_failure(JOB, "n1", "manual", "x" * 600_000 if seq < 30 else "no space")
    for seq in range(MAX_CHECKPOINTS + 5):
        registry.record_checkpoint(JOB, {"seq": seq, "reason": "manual", "node": "n" * 100_000})

    events = private_redis.lrange(keys.job_events(JOB), 0, -1)
    assert len(events) == MAX_EVENTS
    last = json.loads(events[-1])
    assert (last["event"], last["seq"]) == ("checkpoint", MAX_CHECKPOINTS + 4)
    summaries = registry.checkpoints(JOB)
    assert [s["seq"] for s in summaries] == list(range(5, MAX_CHECKPOINTS + 5))
    assert max(len(e) for e in events) <= MAX_ENTRY_BYTES
    grown = private_redis.info("memory")["used_memory"] - before
    assert grown < MAX_EVENTS * 2048, f"{grown} bytes for {MAX_EVENTS} small events"


def test_the_controller_counts_the_events_after_the_last_it_saw_though_old_ones_were_dropped() -> None:
    events = [{"event": "checkpoint", "seq": i, "time": float(i)} for i in range(10)]

    assert unseen(events, None) == events
    assert unseen(events, events[6]) == events[7:]
    assert unseen(events[4:] + [{"event": "restore", "time": 11.0}], events[6]) == events[7:] + [
        {"event": "restore", "time": 11.0}]
    assert unseen(events, events[9]) == []
    # dropped past the last one seen (more than the list keeps in one look): all are new
    assert unseen(events[8:], events[2]) == events[8:]


def test_a_job_that_floods_its_own_history_looks_better_served_never_starved(private_redis) -> None:
    """The registry keeps a job's last MAX_EVENTS events: a job that checkpoints itself without end
    pushes out the `running` event its accounting starts from. Its record says how many went, and
    the accounting counts the time before the oldest event it still has as full service."""
    from singularity_slurm.coordinator.registry import NodeStart
    from singularity_slurm.sla import report

    now = [1000.0]
    registry = Registry(private_redis, clock=lambda: now[0])
    registry.record_node_start(NodeStart(JOB, "n1", "jobuser", 1001, "standard", "standard", ["0", "1"], 0,
                                         1000.0, requested_devices=2, eligible_at=1000.0))
    registry.record_running(JOB, "n1", "start", 2)
    # preempted at 1100 and pending until 1400: 300 s of a 1000 s window lost
    now[0] = 1100.0
    registry.record_checkpoint(JOB, {"seq": 1, "reason": "preempt", "node": "n1", "seconds": 1.0}, stop=True)
    registry.record_node_start(NodeStart(JOB, "n2", "jobuser", 1001, "standard", "standard", ["0", "1"], 1,
                                         1400.0))
    now[0] = 1400.0
    registry.record_running(JOB, "n2", "restore", 2)
    honest = report.job_sla(registry.job(JOB), now=2000.0, window=1000.0)
    assert registry.job(JOB)["events_dropped"] == 0
    assert honest is not None and honest.windows[0].fraction == pytest.approx(0.7, abs=0.01)

    for seq in range(MAX_EVENTS):  # the job's own checkpoints, each of them a real dump
        now[0] = 1500.0 + seq * 0.04
        registry.record_checkpoint(JOB, {"seq": seq + 2, "reason": "manual", "node": "n2", "seconds": 0.01},
                                   stop=False, dump_seconds=0.01, frozen_seconds=0.0)
    record = registry.job(JOB)
    assert record["events_dropped"] == 5  # every event before its flood
    assert all(e["event"] == "checkpoint" for e in record["events"])
    flooded = report.job_sla(record, now=2000.0, window=1000.0)
    assert flooded is not None and flooded.windows[0].fraction >= 0.95  # not the 0.7 it really had
