"""The `singularityctl run` lines of a job: their identity and outcome, kept across requeues.

Slurm restarts a requeued batch script from its first line, so a script with several `run` lines
runs them all again. Each run is known by its position in the script (the n-th `run` of this start)
and its command; the record says whether it finished (and with which status) or was running when
the job left its nodes. A finished run is not run again; the running one resumes from its own
checkpoints (their manifests carry the run's key); later ones start as usual. If the script's
runs no longer match the records (it was edited, or took another branch), the records from the
first mismatch on are forgotten and those runs start afresh.

The records live in the job's folder of the checkpoint store (root only), next to the checkpoints,
so they survive a requeue onto other nodes and the loss of Redis. `begin` and `finish` are pure;
`load` and `save` do the file I/O (save: temporary file, fsync, rename).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

FILE_NAME = "runs.json"
MAX_RUNS = 1000
MAX_FILE = 1 << 20
MAX_DESCRIPTION = 200


class RunRecordError(Exception):
    """A run request the agent refuses; the message says why."""


def key_of(index: int, command: list[str]) -> str:
    """A run's identity: its position in the batch script and a digest of its command."""
    digest = hashlib.sha256(json.dumps(command).encode()).hexdigest()[:16]
    return f"{index}-{digest}"


def describe(command: list[str]) -> str:
    """The command as a person reads it, bounded: the key, not this, is the run's identity."""
    text = " ".join(command)
    return text if len(text) <= MAX_DESCRIPTION else text[:MAX_DESCRIPTION - 3] + "..."


def begin(records: dict[str, dict[str, Any]], index: int,
          command: list[str]) -> tuple[dict[str, dict[str, Any]], dict[str, Any] | None]:
    """The records once run `index` begins, and what was known of it before (None: a new run)."""
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < MAX_RUNS:
        raise RunRecordError(f"run index {index!r} out of range (a job has at most {MAX_RUNS} runs)")
    if not isinstance(command, list) or not command or not all(isinstance(a, str) for a in command):
        raise RunRecordError("run_begin needs command: a non-empty list of strings")
    key = key_of(index, command)
    known = records.get(str(index))
    if known is not None and known.get("key") == key:
        return records, dict(known)
    # A new run, or the script diverged here: what came after this point no longer applies.
    kept = {i: r for i, r in records.items() if i.isdigit() and int(i) < index}
    kept[str(index)] = {"key": key, "command": describe(command), "state": "running", "exit_status": None}
    return kept, None


def finish(records: dict[str, dict[str, Any]], key: str, exit_status: int) -> dict[str, dict[str, Any]]:
    """The records once the run `key` ended by itself with `exit_status`."""
    if not isinstance(exit_status, int) or isinstance(exit_status, bool) or not 0 <= exit_status <= 255:
        raise RunRecordError(f"exit status {exit_status!r} is not 0..255")
    for index, record in records.items():
        if record.get("key") == key:
            return {**records, index: {**record, "state": "finished", "exit_status": exit_status}}
    raise RunRecordError(f"no run {key!r} was begun in this job")


def load(path: Path) -> dict[str, dict[str, Any]]:
    """The job's run records; none if the file is missing or unusable (the runs then start afresh)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE + 1)
    except FileNotFoundError:
        return {}
    if len(raw) > MAX_FILE:
        return {}
    try:
        doc = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(doc, dict):
        return {}
    return {i: r for i, r in doc.items()
            if isinstance(i, str) and i.isdigit() and isinstance(r, dict) and isinstance(r.get("key"), str)
            and r.get("state") in ("running", "finished")}


def save(path: Path, records: dict[str, dict[str, Any]]) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # A name no other writer (another thread of the agent, another node's agent) can hold.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(8).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            data = memoryview(json.dumps(records, sort_keys=True).encode())
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
