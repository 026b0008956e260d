"""The checkpoint store on a real filesystem: round trips, deduplication, faults, retention, a full disk."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import stat
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import xxhash

from singularity_slurm.checkpoint.packs import INDEX_MAGIC, read_pack_index
from singularity_slurm.checkpoint.store import (
    DEFAULT_MAX_CHUNK,
    CheckpointStore,
    ChunkRef,
    Fence,
    FileEntry,
    Manifest,
    PruneResult,
    Refusal,
    check_relpath,
    chunk_spans,
    job_key,
)
from singularity_slurm.errors import (
    CheckpointConflict,
    CheckpointError,
    CorruptCheckpoint,
    InvalidCheckpointRequest,
    NewerCheckpointFormat,
    NoCheckpoint,
    StoreFull,
)

KiB = 1024
CHUNK = DEFAULT_MAX_CHUNK
BIG = 256 * KiB  # the region tests are laid out for chunks of this size
JOB = 42


def noise(size: int, seed: int) -> bytes:
    """Incompressible, reproducible bytes: no two seeds share a chunk."""
    return random.Random(seed).randbytes(size)


def commit(store: CheckpointStore, files: dict[str, bytes], job: int = JOB,
           boundaries: dict[str, list[int]] | None = None) -> Manifest:
    with store.begin(job, reason="periodic") as writer:
        for path, data in files.items():
            writer.add_bytes(path, data, boundaries=(boundaries or {}).get(path))
        return writer.commit()


def hashes_of(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def file_of(manifest: Manifest, path: str) -> FileEntry:
    return next(entry for entry in manifest.files if entry.path == path)


def hashes(manifest: Manifest, path: str) -> list[str]:
    return [ref.hash for ref in file_of(manifest, path).chunks]


def chunks_on_disk(store: CheckpointStore, job: int = JOB) -> set[str]:
    """The chunks the job's pack indexes hold."""
    return {digest.tobytes().hex() for digest in store.pack_index(job).digests}


def packs_on_disk(store: CheckpointStore, job: int = JOB) -> list[str]:
    """The names of the files in the job's packs folder."""
    folder = store.packs_dir(job)
    return sorted(os.listdir(folder)) if folder.is_dir() else []


def remove_pack_of(store: CheckpointStore, chunk_hash: str, job: int = JOB) -> Path:
    """Delete the pack holding a chunk and its index, as a concurrent prune could; the pack's path."""
    located = store.locate(job, chunk_hash)
    assert located is not None, f"chunk {chunk_hash} is in no pack"
    pack = located[0]
    pack.unlink()
    pack.with_suffix(".idx").unlink()
    return pack


def tmp_entries(store: CheckpointStore, job: int = JOB) -> list[str]:
    return sorted(os.listdir(store.job_dir(job) / "tmp"))


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def format1_json(manifest: Manifest, **changes: object) -> str:
    """The manifest as the previous version wrote it: one JSON document, format 1, hex digests."""
    doc = {
        "format": 1, "job_id": manifest.job_id, "seq": manifest.seq, "created_at": manifest.created_at,
        "reason": manifest.reason, "meta": manifest.meta, "logical_bytes": manifest.logical_bytes,
        "new_bytes": manifest.new_bytes,
        "files": [{"path": f.path, "mode": f.mode, "size": f.size,
                   "chunks": [[c.hash, c.length] for c in f.chunks]} for f in manifest.files],
    }
    doc.update(changes)
    return json.dumps(doc) + "\n"


def as_format1(store: CheckpointStore, seq: int, text: str | bytes) -> Path:
    """Replace checkpoint `seq`'s manifest with a format 1 one (`<seq>.json`) holding `text`."""
    binary = store.manifest_path(JOB, seq)
    assert binary.name == f"{seq:08d}.mf"
    binary.unlink()
    path = binary.with_suffix(".json")
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    assert store.manifest_path(JOB, seq) == path
    return path


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "store")


# --- round trip -----------------------------------------------------------------------------------


def test_restore_gives_back_every_file_byte_identical_with_its_mode(store: CheckpointStore,
                                                                    tmp_path: Path) -> None:
    sources = tmp_path / "dump"
    (sources / "img").mkdir(parents=True)
    contents = {
        "img/pages-1.img": noise(CHUNK * 3 + 123, 1),
        "img/pagemap-1.img": noise(700, 2),
        "img/empty.img": b"",
        "img/exact.img": noise(CHUNK * 2, 3),
        "run.sh": b"#!/bin/sh\necho resumed\n",
    }
    modes = {"img/pages-1.img": 0o600, "img/pagemap-1.img": 0o640, "img/empty.img": 0o644,
             "img/exact.img": 0o600, "run.sh": 0o755}
    for path, data in contents.items():
        (sources / path).write_bytes(data)
        (sources / path).chmod(modes[path])

    with store.begin(JOB, reason="preemption") as writer:
        for path in contents:
            writer.add_file(path, sources / path)
        writer.add_bytes("meta/step.txt", b"1234\n", mode=0o640)
        manifest = writer.commit()
    restored = store.restore(manifest, tmp_path / "restored")

    assert files_under(tmp_path / "restored") == {**contents, "meta/step.txt": b"1234\n"}
    assert {str(p.relative_to(tmp_path / "restored")): stat.S_IMODE(p.stat().st_mode) for p in restored} == {
        **modes, "meta/step.txt": 0o640,
    }


def test_manifest_records_the_files_their_chunks_and_the_callers_context(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "store", clock=lambda: 1_700_000_000.25)
    data = noise(CHUNK * 2 + 10, 1)

    with store.begin("42", reason="preemption", meta={"step": 120, "nodes": ["n1", "n2"]}) as writer:
        writer.add_bytes("img/pages-1.img", data, mode=0o600)
        writer.add_bytes("img/core-1.img", b"core")
        manifest = writer.commit()

    assert (manifest.job_id, manifest.seq, manifest.version) == ("42", 1, 2)
    assert (manifest.created_at, manifest.reason) == (1_700_000_000.25, "preemption")
    assert manifest.meta == {"step": 120, "nodes": ["n1", "n2"]}
    assert [(f.path, f.mode, f.size) for f in manifest.files] == [
        ("img/pages-1.img", 0o600, CHUNK * 2 + 10), ("img/core-1.img", 0o644, 4),
    ]
    assert [ref.length for ref in file_of(manifest, "img/pages-1.img").chunks] == [CHUNK, CHUNK, 10]
    assert hashes(manifest, "img/core-1.img") == [xxhash.xxh3_128_hexdigest(b"core")]
    assert manifest.logical_bytes == manifest.new_bytes == CHUNK * 2 + 14
    assert manifest.dedup_ratio == 1.0
    assert store.manifest_path(42, 1) == store.job_dir(42) / "manifests" / "00000001.mf"
    assert store.manifest_path(42, 1).is_file()


def test_manifest_round_trips(store: CheckpointStore) -> None:
    manifest = commit(store, {"a": noise(CHUNK + 1, 1), "b/c": b""})

    assert manifest.to_bytes().startswith(b"singularity-manifest 2\n")
    assert Manifest.from_bytes(manifest.to_bytes()) == manifest
    assert store.read(JOB, 1) == manifest
    # A format 1 (JSON) manifest of the same checkpoint reads as the same one, of version 1.
    old = Manifest.from_bytes(format1_json(manifest).encode())
    assert old == dataclasses.replace(manifest, version=1)
    assert old.files[0].chunks == (ChunkRef(hashes_of(noise(CHUNK + 1, 1)[:CHUNK]), CHUNK),
                                   ChunkRef(hashes_of(noise(CHUNK + 1, 1)[CHUNK:]), 1))


def test_caller_meta_is_copied_when_the_writer_begins(store: CheckpointStore) -> None:
    meta = {"step": 1}
    writer = store.begin(JOB, reason="periodic", meta=meta)
    meta["step"] = 2
    writer.add_bytes("a", b"a")

    assert writer.commit().meta == {"step": 1}


def test_list_and_latest_show_committed_checkpoints_oldest_first(store: CheckpointStore) -> None:
    first = commit(store, {"a": b"one"})
    second = commit(store, {"a": b"two"})

    assert store.list(JOB) == [first, second]
    assert store.seqs(JOB) == [1, 2]
    assert store.latest(JOB) == second
    assert store.jobs() == ["42"]


def test_a_job_without_checkpoints_has_none_to_restore(store: CheckpointStore) -> None:
    assert store.list(JOB) == []
    with pytest.raises(NoCheckpoint, match="job 42 has no committed checkpoint"):
        store.latest(JOB)
    with pytest.raises(NoCheckpoint, match="start it from the beginning"):
        store.latest_valid(JOB)


# --- chunking -------------------------------------------------------------------------------------


def test_chunks_are_cut_every_max_chunk_bytes_without_boundaries() -> None:
    assert chunk_spans(10, None, 4) == [(0, 4), (4, 4), (8, 2)]
    assert chunk_spans(8, [], 4) == [(0, 4), (4, 4)]
    assert chunk_spans(0, None, 4) == []


def test_a_chunk_starts_at_every_boundary() -> None:
    assert chunk_spans(10, [0, 3, 10], 4) == [(0, 3), (3, 4), (7, 3)]
    assert chunk_spans(12, [5], 4) == [(0, 4), (4, 1), (5, 4), (9, 3)]


def test_a_repeated_boundary_cuts_once() -> None:
    assert chunk_spans(10, [0, 0, 3, 3, 10, 10], 4) == chunk_spans(10, [3], 4) == [(0, 3), (3, 4), (7, 3)]


@pytest.mark.parametrize("boundaries", [[5, 3], [3, 0], [11], [-1], [2.5], [True]])
def test_boundaries_must_be_sorted_offsets_inside_the_file(boundaries: list) -> None:
    with pytest.raises(InvalidCheckpointRequest, match="boundar"):
        chunk_spans(10, boundaries, 4)


def test_bad_boundaries_are_refused_naming_the_file(store: CheckpointStore) -> None:
    with store.begin(JOB, reason="periodic") as writer:
        with pytest.raises(InvalidCheckpointRequest, match=r"^img/pages-1\.img: chunk boundaries must be"):
            writer.add_bytes("img/pages-1.img", b"x" * 10, boundaries=[5, 3])


# --- deduplication --------------------------------------------------------------------------------


def test_identical_files_of_one_checkpoint_are_stored_once(store: CheckpointStore) -> None:
    pages = noise(CHUNK * 4, 1)

    manifest = commit(store, {"img/pages-1.img": pages, "img/pages-2.img": pages, "img/core.img": b"c" * 100})

    assert manifest.logical_bytes == CHUNK * 8 + 100
    assert manifest.new_bytes == CHUNK * 4 + 100
    assert manifest.dedup_ratio == (CHUNK * 8 + 100) / (CHUNK * 4 + 100)
    assert hashes(manifest, "img/pages-1.img") == hashes(manifest, "img/pages-2.img")
    assert len(chunks_on_disk(store)) == 5
    assert store.job_usage(JOB) == CHUNK * 4 + 100


def test_second_checkpoint_stores_only_the_changed_chunk(store: CheckpointStore) -> None:
    before = noise(CHUNK * 4, 1)
    after = bytearray(before)
    after[2 * CHUNK + 17] ^= 0xFF

    first = commit(store, {"img/pages-1.img": before})
    second = commit(store, {"img/pages-1.img": bytes(after)})

    assert second.new_bytes == CHUNK
    old, new = hashes(first, "img/pages-1.img"), hashes(second, "img/pages-1.img")
    assert [i for i in range(4) if old[i] != new[i]] == [2]
    assert store.job_usage(JOB) == CHUNK * 5


def test_an_unchanged_checkpoint_stores_nothing_new(store: CheckpointStore) -> None:
    data = noise(CHUNK + 5, 1)
    commit(store, {"a": data})

    again = commit(store, {"a": data})

    assert again.new_bytes == 0
    assert math.isinf(again.dedup_ratio)


def test_a_region_inserted_between_boundaries_changes_only_its_own_chunks(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "store", max_chunk=BIG)
    region_a, region_b, inserted = noise(600 * KiB, 1), noise(300 * KiB, 2), noise(100 * KiB, 3)

    first = commit(store, {"img/pages-1.img": region_a + region_b},
                   boundaries={"img/pages-1.img": [0, 600 * KiB]})
    second = commit(store, {"img/pages-1.img": region_a + inserted + region_b},
                    boundaries={"img/pages-1.img": [0, 600 * KiB, 700 * KiB]})

    old, new = hashes(first, "img/pages-1.img"), hashes(second, "img/pages-1.img")
    assert [ref.length for ref in file_of(first, "img/pages-1.img").chunks] == [BIG, BIG, 88 * KiB,
                                                                                   BIG, 44 * KiB]
    assert new == old[:3] + [xxhash.xxh3_128_hexdigest(inserted)] + old[3:]
    assert second.new_bytes == 100 * KiB


def test_without_boundaries_an_insertion_shifts_every_later_chunk(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "store", max_chunk=BIG)
    region_a, region_b, inserted = noise(600 * KiB, 1), noise(300 * KiB, 2), noise(100 * KiB, 3)

    commit(store, {"img/pages-1.img": region_a + region_b})
    second = commit(store, {"img/pages-1.img": region_a + inserted + region_b})

    # Only the two chunks wholly before the insertion point are reused.
    assert second.new_bytes == second.logical_bytes - 2 * BIG


# --- abort ----------------------------------------------------------------------------------------


def assert_only_first_checkpoint(store: CheckpointStore, first: Manifest, chunks_before: set[str],
                                 packs_before: list[str]) -> None:
    assert store.seqs(JOB) == [1]
    assert chunks_on_disk(store) == chunks_before
    assert packs_on_disk(store) == packs_before  # nothing the writer stored was published
    assert tmp_entries(store) == []
    assert store.latest_valid(JOB) == (first, [])


def test_abort_keeps_the_previous_checkpoint_and_commits_nothing(store: CheckpointStore) -> None:
    first = commit(store, {"img/pages-1.img": noise(CHUNK * 2, 1)})
    chunks_before, packs_before = chunks_on_disk(store), packs_on_disk(store)

    writer = store.begin(JOB, reason="preemption")
    writer.add_bytes("img/pages-1.img", noise(CHUNK * 3, 2))
    writer.abort()
    writer.abort()  # idempotent

    assert_only_first_checkpoint(store, first, chunks_before, packs_before)
    with pytest.raises(CheckpointError, match="already aborted; begin a new one"):
        writer.add_bytes("img/other.img", b"x")


def test_an_exception_inside_the_with_block_aborts(store: CheckpointStore) -> None:
    first = commit(store, {"img/pages-1.img": noise(CHUNK * 2, 1)})
    chunks_before, packs_before = chunks_on_disk(store), packs_on_disk(store)

    with pytest.raises(RuntimeError, match="criu dump failed"):
        with store.begin(JOB, reason="preemption") as writer:
            writer.add_bytes("img/pages-1.img", noise(CHUNK * 3, 2))
            raise RuntimeError("criu dump failed")

    assert_only_first_checkpoint(store, first, chunks_before, packs_before)


def test_leaving_the_with_block_without_commit_commits_nothing(store: CheckpointStore) -> None:
    first = commit(store, {"a": b"one"})
    chunks_before, packs_before = chunks_on_disk(store), packs_on_disk(store)

    with store.begin(JOB, reason="periodic") as writer:
        writer.add_bytes("a", b"two")

    assert_only_first_checkpoint(store, first, chunks_before, packs_before)


def test_abort_keeps_new_chunks_that_another_writer_committed_meanwhile(store: CheckpointStore) -> None:
    shared = noise(CHUNK, 1)
    slow = store.begin(JOB, reason="periodic")
    slow.add_bytes("a", shared + noise(10, 2))
    fast = store.begin(JOB, reason="preemption")
    fast.add_bytes("a", shared)  # the slow writer's pack is not published: the fast one stores it too
    committed = fast.commit()

    slow.abort()

    assert store.latest_valid(JOB) == (committed, [])
    assert chunks_on_disk(store) == {hashes_of(shared)}


# --- concurrency ----------------------------------------------------------------------------------


def test_concurrent_writers_get_distinct_sequence_numbers(store: CheckpointStore) -> None:
    writers = 8
    barrier = threading.Barrier(writers)
    manifests: dict[int, Manifest] = {}

    def write(i: int) -> None:
        writer = store.begin(JOB, reason=f"writer {i}")
        writer.add_bytes("data", noise(10 * KiB, i))
        barrier.wait()
        manifests[i] = writer.commit()

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert sorted(m.seq for m in manifests.values()) == list(range(1, writers + 1))
    for i, manifest in manifests.items():
        assert store.read(JOB, manifest.seq) == manifest
        assert manifest.reason == f"writer {i}"
        store.verify(manifest)
    assert tmp_entries(store) == []


def test_commit_refuses_when_a_chunk_vanished_under_the_writer(store: CheckpointStore) -> None:
    commit(store, {"a": noise(CHUNK, 1)})
    writer = store.begin(JOB, reason="periodic")
    writer.add_bytes("a", noise(CHUNK, 1))  # deduplicated against the first checkpoint's pack
    writer.add_bytes("b", noise(CHUNK, 2))  # new: goes to the writer's own pack
    remove_pack_of(store, hashes_of(noise(CHUNK, 1)))  # as a concurrent prune could

    with pytest.raises(CheckpointConflict, match=f"chunk {hashes_of(noise(CHUNK, 1))} of a vanished while "
                                                 "job 42 was checkpointed.*checkpoint again"):
        writer.commit()

    assert store.seqs(JOB) == [1]
    assert packs_on_disk(store) == []  # the writer's pack was not left behind
    assert tmp_entries(store) == []


def test_prune_leaves_chunks_alone_while_a_writer_is_active(store: CheckpointStore) -> None:
    # A pack goes only whole: the chunk the writer relies on and the one that becomes garbage are
    # stored by separate checkpoints, so each has a pack of its own.
    first = commit(store, {"a": noise(CHUNK, 1)})
    commit(store, {"b": noise(CHUNK, 5)})
    commit(store, {"a": noise(CHUNK, 2)})
    writer = store.begin(JOB, reason="periodic")
    writer.add_bytes("a", noise(CHUNK, 1))  # deduplicated against a checkpoint being pruned
    chunks_before = chunks_on_disk(store)

    deferred = store.prune(JOB, keep=1)
    chunks_meanwhile = chunks_on_disk(store)
    fourth = writer.commit()
    collected = store.collect_garbage(JOB)

    assert deferred == PruneResult((1, 2), 0, 0, 0, 0, chunk_gc_deferred=True)
    assert chunks_meanwhile == chunks_before
    assert hashes(fourth, "a") == hashes(first, "a")
    store.verify(fourth)
    assert collected == PruneResult((), chunks_deleted=1, chunk_bytes_deleted=CHUNK, tmp_entries_deleted=0,
                                    tmp_bytes_deleted=0)
    assert chunks_on_disk(store) == {hashes_of(noise(CHUNK, 1)), hashes_of(noise(CHUNK, 2))}


# --- corruption -----------------------------------------------------------------------------------


def damage(store: CheckpointStore, chunk_hash: str, how: str) -> str:
    """Damage a chunk where it lies in its pack; what a refusal of it says (see PROBLEMS)."""
    located = store.locate(JOB, chunk_hash)
    assert located is not None, f"chunk {chunk_hash} is in no pack"
    pack, offset, length = located
    if how == "flipped":
        with open(pack, "r+b") as out:
            out.seek(offset + length // 2)
            byte = out.read(1)[0]
            out.seek(offset + length // 2)
            out.write(bytes([byte ^ 0x01]))
    elif how == "truncated":  # the chunk is cut one byte short
        os.truncate(pack, offset + length - 1)
    elif how == "missing":  # its pack's index no longer lists it
        index = pack.with_suffix(".idx")
        assert index.read_bytes().startswith(INDEX_MAGIC)
        entries = read_pack_index(index, pack.stat().st_size)
        kept = [entry.tobytes() for entry in entries if entry["digest"].tobytes().hex() != chunk_hash]
        assert len(kept) == len(entries) - 1
        index.write_bytes(INDEX_MAGIC + b"".join(kept))
    else:  # "pack gone": the pack and its index, as a prune removes them
        remove_pack_of(store, chunk_hash)
    return PROBLEMS[how].format(pack=pack.name, packs=store.packs_dir(JOB), index=pack.with_suffix(".idx"),
                                chunk=chunk_hash)


PROBLEMS = {
    "flipped": "is corrupt: its content in {pack} no longer matches its hash",
    # A pack cut short no longer holds what its index says: the index is skipped, naming why.
    "truncated": "is missing from {packs} (pack index {index} was skipped: it puts chunk {chunk} at bytes ",
    "missing": "is missing from {packs}",
    "pack gone": "is missing from {packs}",
}
"""How a damaged chunk is described; the pack's name goes in for {pack}, the packs folder for {packs},
its index for {index}, the chunk's hash for {chunk}."""


# "pack gone" and "truncated" are left out: that pack holds img/core-1.img too, which is then the first
# chunk missing (a pack cut short while a restore reads it: test_checkpoint_packs).
@pytest.mark.parametrize("how", ["flipped", "missing"])
def test_a_damaged_chunk_is_refused_by_verify_and_restore_naming_the_file(store: CheckpointStore,
                                                                          tmp_path: Path, how: str) -> None:
    manifest = commit(store, {"img/core-1.img": b"core", "img/pages-1.img": noise(CHUNK * 3, 1)})
    bad = hashes(manifest, "img/pages-1.img")[1]
    problem = damage(store, bad, how)
    expected = (f"checkpoint 1 of job 42 is unusable: chunk 1 ({bad}, bytes {CHUNK}..{2 * CHUNK}) of "
                f"img/pages-1.img {problem}")

    with pytest.raises(CorruptCheckpoint) as verified:
        store.verify(manifest)
    with pytest.raises(CorruptCheckpoint) as restored:
        store.restore(manifest, tmp_path / "restored")

    for info in (verified, restored):
        assert str(info.value).startswith(expected)
        assert (info.value.job_id, info.value.seq, info.value.path, info.value.chunk) == (
            "42", 1, "img/pages-1.img", bad)
    assert files_under(tmp_path / "restored") == {}  # core-1.img was written, then removed again


@pytest.mark.parametrize("how", PROBLEMS)
def test_latest_valid_falls_back_to_the_previous_checkpoint_and_reports_why(store: CheckpointStore,
                                                                            how: str) -> None:
    pages = noise(CHUNK * 3, 1)
    first = commit(store, {"img/pages-1.img": pages})
    changed = pages[:CHUNK * 2] + noise(CHUNK, 2)
    second = commit(store, {"img/pages-1.img": changed})
    bad = hashes(second, "img/pages-1.img")[2]
    problem = damage(store, bad, how)  # the second checkpoint's pack holds this chunk only

    manifest, refused = store.latest_valid(JOB)

    assert manifest == first
    assert [seq for seq, _ in refused] == [2]
    assert refused[0].reason.startswith(f"chunk 2 ({bad}, bytes {2 * CHUNK}..{3 * CHUNK}) of img/pages-1.img "
                                        f"{problem}")


def test_no_checkpoint_verifies_then_no_checkpoint_lists_every_refusal(store: CheckpointStore) -> None:
    manifest = commit(store, {"a": noise(CHUNK, 1)})
    damage(store, hashes(manifest, "a")[0], "flipped")

    with pytest.raises(NoCheckpoint, match=r"no checkpoint that verifies .*checkpoint 1: chunk 0 .* of a is "
                                           r"corrupt.*start it from the beginning"):
        store.latest_valid(JOB)


# --- manifests ------------------------------------------------------------------------------------


def rewrite(text: str, **changes: object) -> str:
    doc = json.loads(text)
    doc.update(changes)
    return json.dumps(doc)


def unsafe_path(text: str) -> str:
    doc = json.loads(text)
    doc["files"][0]["path"] = "../../etc/cron.d/job"
    return json.dumps(doc)


def chunk_length(text: str, length: int) -> str:
    doc = json.loads(text)
    doc["files"][0]["chunks"][0][1] = length
    return json.dumps(doc)


def chunk_entry(text: str, entry: object) -> str:
    doc = json.loads(text)
    doc["files"][0]["chunks"][0] = entry
    return json.dumps(doc)


def file_size(text: str, size: int) -> str:
    doc = json.loads(text)
    doc["files"][0]["size"] = size
    return json.dumps(doc)


BAD_MANIFESTS = {
    "truncated": (lambda text: text[: len(text) // 2], "is not valid JSON"),
    "garbage": (lambda text: "\x00\xff not json", "is not valid JSON"),
    "a list": (lambda text: "[]", "holds a JSON list, not an object"),
    "newer format": (lambda text: rewrite(text, format=99), "has format version 99"),
    "missing key": (lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "files"}),
                    "is malformed: the manifest must be an object with exactly the keys"),
    "wrong size": (lambda text: rewrite(text, logical_bytes=1), "is malformed: logical_bytes"),
    "another seq": (lambda text: rewrite(text, seq=7), "says it is checkpoint 7, but its file name says 2"),
    "another job": (lambda text: rewrite(text, job_id="43"), "belongs to job 43, not to job 42"),
    "unsafe path": (unsafe_path, "is malformed: file path '../../etc/cron.d/job' cannot go into a"),
    "negative length": (lambda text: chunk_length(text, -5), "is malformed: the length of chunk"),
    "huge length": (lambda text: chunk_length(text, 1 << 62), "is malformed: the length of chunk"),
    "huge size": (lambda text: file_size(text, 1 << 62), "is malformed: the chunks of a add up to"),
    "bool length": (lambda text: chunk_length(text, True), "is malformed: the length of chunk"),
    "upper-case hash": (lambda text: chunk_entry(text, ["A" * 32, 3]), "is malformed: chunk ["),
    "long hash": (lambda text: chunk_entry(text, ["a" * 33, 3]), "is malformed: chunk ["),
    "not a pair": (lambda text: chunk_entry(text, ["a" * 32, 3, 0]), "is malformed: chunk ["),
    "files not a list": (lambda text: rewrite(text, files={"a": 1}), "is malformed: files must be an array"),
}
"""Format 1 (JSON) manifests the store must refuse: how to spoil one, and what the refusal says."""


def assert_refused_clearly(store: CheckpointStore, first: Manifest, path: Path, message: str) -> None:
    """Checkpoint 2, whose manifest is `path`, is refused saying `message`; checkpoint 1 is used."""
    with pytest.raises(CorruptCheckpoint, match="unusable") as info:
        store.read(JOB, 2)
    manifest, refused = store.latest_valid(JOB)

    assert str(info.value).startswith(f"checkpoint 2 of job 42 is unusable: manifest {path} {message}")
    assert (info.value.job_id, info.value.seq, info.value.path) == ("42", 2, str(path))
    assert manifest == first
    assert refused == [Refusal(2, info.value.detail)]
    with pytest.raises(CorruptCheckpoint):
        store.latest(JOB)


@pytest.mark.parametrize("kind", BAD_MANIFESTS)
def test_an_unreadable_manifest_is_refused_clearly(store: CheckpointStore, kind: str) -> None:
    first = commit(store, {"a": b"one"})
    second = commit(store, {"a": b"two"})
    spoil, message = BAD_MANIFESTS[kind]
    path = as_format1(store, 2, spoil(format1_json(second)))

    assert_refused_clearly(store, first, path, message)


def test_a_format_1_manifest_is_still_read(store: CheckpointStore) -> None:
    first = commit(store, {"a": b"one"})
    second = commit(store, {"a": b"two", "b/c": noise(CHUNK + 1, 1)})
    as_format1(store, 2, format1_json(second))

    assert store.read(JOB, 2) == dataclasses.replace(second, version=1)
    assert store.list(JOB) == [first, dataclasses.replace(second, version=1)]
    assert store.latest_valid(JOB) == (dataclasses.replace(second, version=1), [])
    assert commit(store, {"a": b"three"}).seq == 3


def reseal(data: bytes, *, line: bytes | None = None, header: Callable[[dict], object] | None = None,
           tables: Callable[[bytes], bytes] | None = None) -> bytes:
    """A format 2 manifest with its first line, header or chunk tables changed, and a checksum that
    matches again (so what is refused is the change, not the checksum). `header` changes the header
    in place, or returns a new one (bytes: its raw text)."""
    first, rest = data.split(b"\n", 1)
    (size,) = struct.unpack_from("<I", rest)
    doc, body = json.loads(rest[4:4 + size]), rest[4 + size:-16]
    if header is not None:
        changed = header(doc)
        doc = doc if changed is None else changed
    text = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    body = tables(body) if tables is not None else body
    sealed = (line if line is not None else first + b"\n") + struct.pack("<I", len(text)) + text + body
    return sealed + xxhash.xxh3_128_digest(sealed)


def flip(data: bytes, at: int) -> bytes:
    spoiled = bytearray(data)
    spoiled[at] ^= 0x01
    return bytes(spoiled)


def in_file(field: str, value: object) -> Callable[[dict], None]:
    def change(doc: dict) -> None:
        doc["files"][0][field] = value
    return change


CHECKSUM = "is damaged: its checksum does not match its content (truncated or overwritten)"
BAD_BINARY_MANIFESTS: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "truncated": (lambda data: data[: len(data) // 2], CHECKSUM),
    "cut by a byte": (lambda data: data[:-1], CHECKSUM),
    "a byte appended": (lambda data: data + b"\0", CHECKSUM),
    "flipped in the header": (lambda data: flip(data, 40), CHECKSUM),
    "flipped in a chunk table": (lambda data: flip(data, len(data) - 20), CHECKSUM),
    "flipped in the checksum": (lambda data: flip(data, len(data) - 1), CHECKSUM),
    "empty": (lambda data: b"", "is not valid JSON"),
    "garbage": (lambda data: b"\x00\xff not a manifest", "is not valid JSON"),
    "newer format": (lambda data: reseal(data, line=b"singularity-manifest 3\n"),
                     "has format version 3, and this singularity-slurm reads versions 1 to 2"),
    "first line of format 1": (lambda data: reseal(data, line=b"singularity-manifest 1\n"),
                               "has format version 1, which no singularity-slurm wrote"),
    "header of another format": (lambda data: reseal(data, header=lambda doc: doc.update(format=1)),
                                 "is malformed: its header says format 1 under a format 2 first line"),
    "header not JSON": (lambda data: reseal(data, header=lambda doc: b'{"format": 2'),
                        "is malformed: Expecting ',' delimiter"),
    "missing key": (lambda data: reseal(data, header=lambda doc: doc.pop("files") and None),
                    "is malformed: the manifest must be an object with exactly the keys"),
    "wrong size": (lambda data: reseal(data, header=lambda doc: doc.update(logical_bytes=1)),
                   "is malformed: logical_bytes"),
    "another seq": (lambda data: reseal(data, header=lambda doc: doc.update(seq=7)),
                    "says it is checkpoint 7, but its file name says 2"),
    "another job": (lambda data: reseal(data, header=lambda doc: doc.update(job_id="43")),
                    "belongs to job 43, not to job 42"),
    "unsafe path": (lambda data: reseal(data, header=in_file("path", "../../etc/cron.d/job")),
                    "is malformed: file path '../../etc/cron.d/job' cannot go into a"),
    "huge size": (lambda data: reseal(data, header=in_file("size", 1 << 62)),
                  "is malformed: the chunks of a add up to"),
    "negative chunk count": (lambda data: reseal(data, header=in_file("chunks", -1)),
                             "is malformed: the chunk count of a is -1"),
    "chunk table cut short": (lambda data: reseal(data, header=in_file("chunks", 2)),
                              "is malformed: the chunk table of a is cut short"),
    "bytes after the tables": (lambda data: reseal(data, tables=lambda body: body + b"1234"),
                               "is malformed: 4 bytes follow the last chunk table"),
    "zero length": (lambda data: reseal(data, tables=lambda body: body[:-4] + struct.pack("<I", 0)),
                    "is malformed: a chunk of a has a length outside 1.."),
    "huge length": (lambda data: reseal(data, tables=lambda body: body[:-4] + struct.pack("<I", 1 << 31)),
                    "is malformed: a chunk of a has a length outside 1.."),
    "files not a list": (lambda data: reseal(data, header=lambda doc: doc.update(files={"a": 1})),
                         "is malformed: files must be an array"),
}
"""Format 2 (binary) manifests the store must refuse: how to spoil one, and what the refusal says."""


def test_a_resealed_manifest_is_read_as_it_was(store: CheckpointStore) -> None:
    # The spoilers above change only what they say: resealed unchanged, a manifest reads as before.
    manifest = commit(store, {"a": b"two"})
    assert reseal(manifest.to_bytes()) == manifest.to_bytes()


@pytest.mark.parametrize("kind", BAD_BINARY_MANIFESTS)
def test_an_unreadable_binary_manifest_is_refused_clearly(store: CheckpointStore, kind: str) -> None:
    first = commit(store, {"a": b"one"})
    commit(store, {"a": b"two"})
    path = store.manifest_path(JOB, 2)
    assert path.name == "00000002.mf"
    spoil, message = BAD_BINARY_MANIFESTS[kind]
    path.write_bytes(spoil(path.read_bytes()))

    assert_refused_clearly(store, first, path, message)


def test_a_manifest_of_a_newer_format_is_refused_as_such(store: CheckpointStore) -> None:
    commit(store, {"a": b"one"})
    second = commit(store, {"a": b"two"})
    path = store.manifest_path(JOB, 2)
    path.write_bytes(reseal(second.to_bytes(), line=b"singularity-manifest 3\n"))

    with pytest.raises(NewerCheckpointFormat, match="restore it with the version that wrote it"):
        store.read(JOB, 2)
    path = as_format1(store, 2, format1_json(second, format=99))
    with pytest.raises(NewerCheckpointFormat, match="restore it with the version that wrote it"):
        store.read(JOB, 2)


def test_a_checkpoint_the_previous_version_wrote_restores_byte_identical(store: CheckpointStore,
                                                                       tmp_path: Path) -> None:
    # As the previous version left it: a pack with a JSON index, and a JSON manifest (format 1).
    contents = {"img/pages-1.img": noise(CHUNK * 2 + 5, 1), "img/core-1.img": b"core", "img/empty.img": b"",
                "img/again.img": noise(CHUNK * 2 + 5, 1)[:CHUNK]}
    modes = {"img/pages-1.img": 0o600, "img/core-1.img": 0o644, "img/empty.img": 0o640,
             "img/again.img": 0o600}
    pack, index, files = bytearray(), {}, []
    for path, data in contents.items():
        chunks = []
        for offset, length in chunk_spans(len(data)):
            piece = data[offset:offset + length]
            if hashes_of(piece) not in index:
                index[hashes_of(piece)] = [len(pack), length]
                pack += piece
            chunks.append([hashes_of(piece), length])
        files.append({"path": path, "mode": modes[path], "size": len(data), "chunks": chunks})
    packs, manifests = store.packs_dir(JOB), store.job_dir(JOB) / "manifests"
    packs.mkdir(parents=True)
    manifests.mkdir()
    (packs / "oldhost-4711-0123abcd.pack").write_bytes(pack)
    (packs / "oldhost-4711-0123abcd.idx").write_text(json.dumps(index))
    (manifests / "00000001.json").write_text(json.dumps({
        "format": 1, "job_id": "42", "seq": 1, "created_at": 1_700_000_000.5, "reason": "preemption",
        "meta": {"restart": 0}, "logical_bytes": sum(map(len, contents.values())), "new_bytes": len(pack),
        "files": files,
    }) + "\n")

    manifest, refused = store.latest_valid(JOB)
    written = store.restore(manifest, tmp_path / "restored")

    assert refused == []
    assert (manifest.job_id, manifest.seq, manifest.version, manifest.reason) == ("42", 1, 1, "preemption")
    assert manifest.files[0] == FileEntry.of_chunks("img/pages-1.img", 0o600, CHUNK * 2 + 5, [
        ChunkRef(hashes_of(noise(CHUNK * 2 + 5, 1)[:CHUNK]), CHUNK),
        ChunkRef(hashes_of(noise(CHUNK * 2 + 5, 1)[CHUNK:2 * CHUNK]), CHUNK),
        ChunkRef(hashes_of(noise(CHUNK * 2 + 5, 1)[2 * CHUNK:]), 5)])
    assert files_under(tmp_path / "restored") == contents
    assert {str(p.relative_to(tmp_path / "restored")): stat.S_IMODE(p.stat().st_mode)
            for p in written} == modes
    assert chunks_on_disk(store) == set(index)
    # The next checkpoint deduplicates against the old pack, and gets the next sequence number.
    second = commit(store, {"img/pages-1.img": contents["img/pages-1.img"]})
    assert (second.seq, second.new_bytes, store.manifest_path(JOB, 2).name) == (2, 0, "00000002.mf")
    assert store.prune(JOB, keep=1).manifests_deleted == (1,)
    assert packs_on_disk(store) == ["oldhost-4711-0123abcd.idx", "oldhost-4711-0123abcd.pack"]
    store.restore(second, tmp_path / "second")
    assert files_under(tmp_path / "second") == {"img/pages-1.img": contents["img/pages-1.img"]}


# --- refusing bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize("job_id", ["", "abc", "12a", "-1", -1, 0, "0", "../1", "1/2", " 1", "1\n", "١٢",
                                    1.0, True, None, "1" * 21])
def test_anything_but_a_slurm_job_id_is_refused(store: CheckpointStore, job_id: object) -> None:
    refused = r"is not a Slurm job id; pass a positive int"
    with pytest.raises(InvalidCheckpointRequest, match=refused):
        store.begin(job_id, reason="periodic")  # type: ignore[arg-type]
    with pytest.raises(InvalidCheckpointRequest, match=refused):
        store.latest_valid(job_id)  # type: ignore[arg-type]
    with pytest.raises(InvalidCheckpointRequest, match=refused):
        store.delete_job(job_id)  # type: ignore[arg-type]
    assert not (store.root / "jobs").exists()


def test_job_ids_have_one_canonical_name() -> None:
    assert job_key(42) == job_key("42") == job_key("0042") == "42"


@pytest.mark.parametrize("relpath", ["", "/etc/passwd", "../x", "img/../../x", "a//b", "./a", "a/", "a/.",
                                     "a\0b", None])
def test_unsafe_file_paths_are_refused_and_the_writer_stays_usable(store: CheckpointStore,
                                                                  relpath: object) -> None:
    with store.begin(JOB, reason="periodic") as writer:
        with pytest.raises(InvalidCheckpointRequest, match="cannot go into a checkpoint"):
            writer.add_bytes(relpath, b"data")  # type: ignore[arg-type]
        writer.add_bytes("img/ok.img", b"data")
        manifest = writer.commit()

    assert [f.path for f in manifest.files] == ["img/ok.img"]
    with pytest.raises(InvalidCheckpointRequest):
        check_relpath(relpath)  # type: ignore[arg-type]


@pytest.mark.parametrize("first, second", [("img", "img/x"), ("img/x", "img"), ("a/b", "a/b")])
def test_a_path_cannot_be_both_a_file_and_a_folder_or_appear_twice(store: CheckpointStore, first: str,
                                                                   second: str) -> None:
    with store.begin(JOB, reason="periodic") as writer:
        writer.add_bytes(first, b"1")
        with pytest.raises(InvalidCheckpointRequest, match=f"file path '{second}' clashes"):
            writer.add_bytes(second, b"2")


def test_an_empty_checkpoint_is_refused(store: CheckpointStore) -> None:
    with store.begin(JOB, reason="periodic") as writer:
        with pytest.raises(InvalidCheckpointRequest, match="nothing was added"):
            writer.commit()
    assert store.seqs(JOB) == []


def test_meta_must_be_storable_as_json(store: CheckpointStore) -> None:
    with pytest.raises(InvalidCheckpointRequest, match="cannot be stored as JSON"):
        store.begin(JOB, reason="periodic", meta={"when": object()})


def test_only_regular_files_are_stored(store: CheckpointStore, tmp_path: Path) -> None:
    with store.begin(JOB, reason="periodic") as writer:
        with pytest.raises(InvalidCheckpointRequest, match="is not a regular file"):
            writer.add_file("dev", os.devnull)
        with pytest.raises(CheckpointError, match="cannot read .*nope"):
            writer.add_file("nope", tmp_path / "nope")


# --- retention ------------------------------------------------------------------------------------


def test_prune_keeps_the_newest_and_deletes_only_unreferenced_chunks(store: CheckpointStore) -> None:
    kept_everywhere, gone, second_only, third_only = (noise(CHUNK, i) for i in range(1, 5))
    # Each checkpoint's new chunks are one pack, which goes only once none of them is used: the chunk
    # every checkpoint uses comes first, alone, so that the one only the pruned checkpoint used can go.
    commit(store, {"a": kept_everywhere})
    commit(store, {"a": kept_everywhere, "b": gone})
    second = commit(store, {"a": kept_everywhere, "b": second_only})
    third = commit(store, {"a": kept_everywhere, "b": third_only + b"!"})
    usage = store.job_usage(JOB)

    result = store.prune(JOB, keep=2)

    assert result == PruneResult(manifests_deleted=(1, 2), chunks_deleted=1, chunk_bytes_deleted=CHUNK,
                                 tmp_entries_deleted=0, tmp_bytes_deleted=0)
    assert store.list(JOB) == [second, third]
    assert chunks_on_disk(store) == {hashes_of(kept_everywhere), hashes_of(second_only),
                                     hashes_of(third_only), hashes_of(b"!")}
    assert store.job_usage(JOB) == usage - CHUNK
    store.verify(second)
    store.verify(third)
    assert commit(store, {"a": b"next"}).seq == 5


@pytest.mark.parametrize("keep", [0, -1, True, 1.5])
def test_prune_keeps_at_least_one_checkpoint(store: CheckpointStore, keep: object) -> None:
    with pytest.raises(InvalidCheckpointRequest, match="keep at least 1 checkpoint; use delete_job"):
        store.prune(JOB, keep=keep)  # type: ignore[arg-type]


def test_prune_removes_tmp_entries_of_dead_writers_only(store: CheckpointStore) -> None:
    commit(store, {"a": b"one"})
    tmp, old = store.job_dir(JOB) / "tmp", time.time() - 7200
    (tmp / "dead-writer").mkdir()
    (tmp / "dead-writer" / "abc").write_bytes(b"x" * 100)
    (tmp / "stray").write_bytes(b"y" * 10)
    for path in (tmp / "dead-writer" / "abc", tmp / "dead-writer", tmp / "stray"):
        os.utime(path, (old, old))
    (tmp / "live-writer").mkdir()

    result = store.prune(JOB, keep=1, tmp_grace_s=3600)

    assert (result.tmp_entries_deleted, result.tmp_bytes_deleted) == (2, 110)
    assert result.chunk_gc_deferred  # the live writer may still need any chunk
    assert tmp_entries(store) == ["live-writer"]


UNREADABLE = {
    "json": (lambda store: as_format1(store, 3, "{"), "is not valid JSON"),
    "binary": (lambda store: spoil_in_place(store.manifest_path(JOB, 3), lambda data: flip(data, 30)),
               "is damaged: its checksum does not match its content"),
}


def spoil_in_place(path: Path, spoil: Callable[[bytes], bytes]) -> Path:
    path.write_bytes(spoil(path.read_bytes()))
    return path


@pytest.mark.parametrize("kind", UNREADABLE)
def test_prune_skips_an_unreadable_manifest_naming_it_and_keeps_the_newest_readable_ones(
        store: CheckpointStore, kind: str) -> None:
    first, second, _ = (commit(store, {"a": noise(CHUNK, i)}) for i in range(3))
    fourth = commit(store, {"a": noise(CHUNK, 3)})
    spoil, message = UNREADABLE[kind]
    path = spoil(store)

    result = store.prune(JOB, keep=2)

    assert result.manifests_deleted == (first.seq,)
    assert [(s.what, s.reason.split(" (")[0]) for s in result.skipped] == [
        (f"checkpoint 3 ({path})", f"manifest {path} {message}")]
    assert store.seqs(JOB) == [2, 3, 4]  # the unreadable one stays for whoever inspects it
    assert store.list(JOB) == [second, fourth]
    # No version can restore it: its chunks are not kept for it.
    assert chunks_on_disk(store) == {hashes_of(noise(CHUNK, 1)), hashes_of(noise(CHUNK, 3))}
    store.verify(second)
    assert store.latest_valid(JOB)[0] == fourth


NEWER = {
    "json": (lambda store, third: as_format1(store, 3, format1_json(third, format=99)),
             "has format version 99"),
    "binary": (lambda store, third: spoil_in_place(
        store.manifest_path(JOB, 3), lambda data: reseal(data, line=b"singularity-manifest 3\n")),
        "has format version 3"),
}


@pytest.mark.parametrize("kind", NEWER)
def test_a_manifest_of_a_newer_format_defers_chunk_collection(store: CheckpointStore, kind: str) -> None:
    third = [commit(store, {"a": noise(CHUNK, i)}) for i in range(3)][-1]
    spoil, message = NEWER[kind]
    path = spoil(store, third)
    chunks_before, packs_before = chunks_on_disk(store), packs_on_disk(store)

    result = store.prune(JOB, keep=1)

    assert result.manifests_deleted == (1,)
    assert result.chunk_gc_deferred
    assert result.skipped[0].what == f"checkpoint 3 ({path})"
    assert message in result.skipped[0].reason
    assert chunks_on_disk(store) == chunks_before  # the newer version may need any of them
    assert packs_on_disk(store) == packs_before


def test_delete_job_removes_all_its_checkpoints_and_nothing_else(store: CheckpointStore) -> None:
    commit(store, {"a": noise(CHUNK, 1)})
    commit(store, {"a": noise(CHUNK, 2)})
    other = commit(store, {"a": noise(CHUNK, 1)}, job=7)

    assert store.delete_job(JOB) == 2 * CHUNK

    assert store.jobs() == ["7"]
    assert store.seqs(JOB) == []
    assert store.latest_valid(7) == (other, [])
    assert store.delete_job(JOB) == 0
    assert os.listdir(store.root / "jobs") == ["7"]


# --- a full disk ----------------------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mountpoint = tmp_path / "small"
    mountpoint.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mountpoint)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mountpoint
    finally:
        if subprocess.run(["umount", str(mountpoint)]).returncode != 0:
            subprocess.run(["umount", "-l", str(mountpoint)], check=True)


def test_a_full_disk_fails_the_writer_and_keeps_the_last_checkpoint(small_fs: Path, tmp_path: Path) -> None:
    store = CheckpointStore(small_fs)
    first = commit(store, {"img/pages-1.img": noise(64 * KiB, 1), "img/core-1.img": b"core"})
    chunks_before, packs_before = chunks_on_disk(store), packs_on_disk(store)
    big = tmp_path / "pages-2.img"
    big.write_bytes(noise(4 * 1024 * KiB, 2))

    with pytest.raises(StoreFull) as info:
        with store.begin(JOB, reason="preemption") as writer:
            writer.add_file("img/pages-1.img", big)

    assert str(info.value).startswith(f"the checkpoint store {small_fs} is full (No space left on device)")
    assert "prune old checkpoints or free space" in str(info.value)
    assert_only_first_checkpoint(store, first, chunks_before, packs_before)
    store.restore(first, tmp_path / "restored")
    assert files_under(tmp_path / "restored") == {"img/pages-1.img": noise(64 * KiB, 1),
                                                  "img/core-1.img": b"core"}
    # The failed writer gave its space back: the next checkpoint fits.
    assert commit(store, {"img/pages-1.img": noise(CHUNK * 4, 3)}).seq == 2


# --- fencing a stale agent out --------------------------------------------------------------------


def commit_as(store: CheckpointStore, restart: int, data: bytes) -> Manifest:
    with store.begin(JOB, reason="periodic", meta={"restart": restart}) as writer:
        writer.add_bytes("a", data)
        return writer.commit()


def test_a_checkpoint_an_older_incarnation_commits_after_the_restart_is_fenced_out(
        store: CheckpointStore) -> None:
    commit_as(store, 0, b"one")
    store.raise_fence(JOB, 1)  # the job restarted elsewhere (restart 1) and restores checkpoint 1
    with store.begin(JOB, reason="periodic", meta={"restart": 0}) as stale:  # its old agent went on
        stale.add_bytes("a", b"stale")
        newer = commit_as(store, 1, b"two")  # the new incarnation's own checkpoint
        with pytest.raises(CheckpointConflict, match="was restarted .restart 1. since this checkpoint of "
                                                     "restart 0 began"):
            stale.commit()
    assert store.seqs(JOB) == [1, 2]
    assert store.latest_valid(JOB)[0] == newer


def test_a_stale_commit_that_slips_past_the_check_is_never_restored(store: CheckpointStore) -> None:
    first = commit_as(store, 0, b"one")
    with store.begin(JOB, reason="periodic", meta={"restart": 0}) as stale:
        stale.add_bytes("a", b"stale")
        store.raise_fence(JOB, 1)
        store.raise_fence(JOB, 0)  # never lowered
        # checked before the fence went up, linked after it: the readers still tell it apart
        stale.store.read_fence = lambda job_id: None  # type: ignore[method-assign]
        late = stale.commit()
    del store.read_fence

    manifest, refused = store.latest_valid(JOB)
    assert manifest == first
    assert refused == [Refusal(late.seq, "it was committed by a node agent of restart 0 after restart 1 "
                                         "of the job had begun (a stale agent's); it is not restored")]
    assert store.list(JOB) == [first]
    assert store.read_fence(JOB) == Fence(1, 1)


def test_checkpoints_of_this_incarnation_and_unmarked_ones_are_not_fenced(store: CheckpointStore) -> None:
    store.raise_fence(JOB, 2)
    mine, unmarked = commit_as(store, 2, b"mine"), commit(store, {"a": b"old format"})
    assert store.list(JOB) == [mine, unmarked]
    (store.job_dir(JOB) / "fence.json").write_text("[]")  # damaged: nothing is fenced out
    assert store.read_fence(JOB) is None
