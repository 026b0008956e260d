"""Packs of the checkpoint store: a writer's new chunks go into one pack file with an index."""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from singularity_slurm.checkpoint.packs import ENTRY, INDEX_MAGIC
from singularity_slurm.checkpoint.store import CheckpointStore, read_pack_index
from singularity_slurm.errors import CorruptCheckpoint, StoreFull

PAGE = 4096


def pages(count: int, seed: int) -> bytearray:
    return bytearray(random.Random(seed).randbytes(count * PAGE))


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "store", max_chunk=PAGE)


def commit(store: CheckpointStore, files: dict[str, bytes]):
    with store.begin(7, reason="periodic") as writer:
        for name, data in files.items():
            writer.add_bytes(name, bytes(data))
        return writer.commit()


def test_a_checkpoint_is_one_pack_and_one_index_and_restores_byte_identical(store, tmp_path):
    memory = pages(50, 1)
    manifest = commit(store, {"images/pages-1.img": memory, "images/core-1.img": b"core"})

    packs = sorted(p.name.rsplit(".", 1)[1] for p in store.packs_dir(7).iterdir())
    assert packs == ["idx", "pack"]
    assert not (store.job_dir(7) / "chunks").exists()  # no chunk is a file of its own
    assert sorted(p.name for p in (store.job_dir(7) / "manifests").iterdir()) == ["00000001.json",
                                                                                "00000001.mf"]
    # the .json is for an older version during an upgrade: a manifest of a format it does not read
    stub = json.loads((store.job_dir(7) / "manifests/00000001.json").read_text())
    assert stub == {"format": 2, "manifest": "00000001.mf"}
    assert store.manifest_path(7, 1).name == "00000001.mf"
    assert manifest.new_bytes == len(memory) + 4
    store.restore(manifest, tmp_path / "out")
    assert (tmp_path / "out/images/pages-1.img").read_bytes() == bytes(memory)


def test_a_file_of_many_read_and_write_blocks_is_stored_once_per_page_and_restores_exactly(store, tmp_path):
    from singularity_slurm.checkpoint.store import PACK_WRITE_BLOCK, READ_BLOCK

    memory = pages(3 * READ_BLOCK // PAGE + 7, 2)
    memory[5 * PAGE:6 * PAGE] = memory[PAGE:2 * PAGE]  # a page repeated: stored once
    source = tmp_path / "pages-1.img"
    source.write_bytes(memory)
    assert len(memory) > 2 * PACK_WRITE_BLOCK
    with store.begin(7, reason="periodic") as writer:
        # region starts that do not fall on a block boundary
        writer.add_file("images/pages-1.img", source, boundaries=[3 * PAGE, READ_BLOCK + PAGE])
        manifest = writer.commit()

    assert manifest.new_bytes == len(memory) - PAGE
    store.restore(manifest, tmp_path / "out")
    assert (tmp_path / "out/images/pages-1.img").read_bytes() == bytes(memory)


def test_the_next_checkpoint_stores_only_the_pages_that_changed(store, tmp_path):
    memory = pages(50, 1)
    commit(store, {"images/pages-1.img": memory})
    for page in (3, 17, 40):
        memory[page * PAGE] ^= 0xFF
    second = commit(store, {"images/pages-1.img": memory})

    assert second.new_bytes == 3 * PAGE
    assert len(list(store.packs_dir(7).glob("*.pack"))) == 2
    # Its pages come from both packs; the restore reads runs and must interleave them right.
    store.restore(second, tmp_path / "out")
    assert (tmp_path / "out/images/pages-1.img").read_bytes() == bytes(memory)


def test_a_flipped_byte_in_a_pack_is_refused_naming_the_file(store, tmp_path):
    manifest = commit(store, {"images/pages-1.img": pages(8, 2)})
    victim = manifest.files[0].chunks[5].hash
    pack, offset, _ = store.locate(7, victim)
    data = bytearray(pack.read_bytes())
    data[offset + 10] ^= 0x01
    pack.write_bytes(bytes(data))

    with pytest.raises(CorruptCheckpoint, match=r"chunk 5 .* of images/pages-1.img is corrupt"):
        store.verify(manifest)
    with pytest.raises(CorruptCheckpoint):
        store.restore(manifest, tmp_path / "out")
    assert not (tmp_path / "out/images/pages-1.img").exists()


def test_latest_valid_falls_back_when_a_pack_is_gone(store):
    first = commit(store, {"images/pages-1.img": pages(8, 3)})
    second = commit(store, {"images/pages-1.img": pages(8, 4)})
    newest = max(store.packs_dir(7).glob("*.pack"), key=lambda p: p.stat().st_mtime_ns)
    newest.unlink()

    manifest, refused = store.latest_valid(7)

    assert manifest.seq == first.seq
    assert [r.seq for r in refused] == [second.seq]
    assert "is missing" in refused[0].reason


def test_prune_drops_packs_no_kept_checkpoint_uses(store):
    commit(store, {"images/pages-1.img": pages(8, 5)})
    commit(store, {"images/pages-1.img": pages(8, 6)})
    third = commit(store, {"images/pages-1.img": pages(8, 6) + pages(1, 7)})

    result = store.prune(7, keep=1)

    assert store.seqs(7) == [third.seq]
    assert len(list(store.packs_dir(7).glob("*.pack"))) == 2  # the second's pack is still used
    assert result.chunks_deleted == 8
    store.verify(third)


def test_a_full_store_keeps_the_previous_checkpoint(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    root = tmp_path / "small"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(root)], check=True)
    try:
        store = CheckpointStore(root, max_chunk=PAGE)
        first = commit(store, {"images/pages-1.img": pages(16, 8)})
        with pytest.raises(StoreFull, match="is full"):
            commit(store, {"images/pages-1.img": pages(400, 9)})
        assert store.seqs(7) == [first.seq]
        store.verify(first)
        assert list((store.job_dir(7) / "tmp").iterdir()) == []
    finally:
        subprocess.run(["umount", str(root)], check=True)


def newest_index(store: CheckpointStore) -> Path:
    return max(store.packs_dir(7).glob("*.idx"), key=lambda p: p.stat().st_mtime_ns)


def as_json_index(index: Path) -> str:
    """The index as format 1 wrote it: a JSON object of hex digest -> [offset, length]."""
    entries = read_pack_index(index, index.with_suffix(".pack").stat().st_size)
    return json.dumps({e["digest"].tobytes().hex(): [int(e["offset"]), int(e["length"])] for e in entries})


def spoil_index(index: Path, how: str) -> None:
    data = index.read_bytes()
    if how == "cut mid-entry":
        index.write_bytes(data[:-5])
        return
    if how.startswith("binary "):
        entries = np.frombuffer(data[len(INDEX_MAGIC):], ENTRY).copy()
        if how == "binary zero length":
            entries[0]["length"] = 0
        elif how == "binary huge length":
            entries[0]["length"] = (1 << 32) - 1
        elif how == "binary beyond the pack":
            entries[0]["offset"] = 1 << 40
        index.write_bytes(INDEX_MAGIC + entries.tobytes())
        return
    text = as_json_index(index)
    doc = json.loads(text)
    first = next(iter(doc))
    if how == "a list":
        text = json.dumps(list(doc.items()))
    elif how == "truncated":
        text = text[: len(text) // 2]
    else:
        if how == "bad hash":
            doc["not-a-hash"] = doc.pop(first)
        elif how == "bad entry":
            doc[first] = {"offset": 0}
        elif how == "negative offset":
            doc[first] = [-4096, doc[first][1]]
        elif how == "huge length":
            doc[first] = [0, 1 << 62]
        elif how == "beyond the pack":
            doc[first] = [1 << 40, 4096]
        text = json.dumps(doc)
    index.write_text(text)


BAD_INDEXES = {
    "cut mid-entry": "not a whole number of 28-byte entries; it was truncated",
    "binary zero length": "the length 0, outside 1..",
    "binary huge length": "the length 4294967295, outside 1..",
    "binary beyond the pack": "beyond the end of its pack",
    "truncated": "is neither a format 2 index nor valid JSON",
    "a list": "holds a JSON list, not an object",
    "bad hash": "has the entry 'not-a-hash'",
    "bad entry": "not 32 hex digits -> [offset, length]",
    "negative offset": "the offset -4096, not an integer",
    "huge length": "the length 4611686018427387904, not an integer",
    "beyond the pack": "beyond the end of its pack",
}


@pytest.mark.parametrize("how", BAD_INDEXES)
def test_a_damaged_pack_index_is_skipped_naming_it_by_restore_and_prune(store, tmp_path, how):
    first = commit(store, {"images/pages-1.img": pages(8, 8)})
    second = commit(store, {"images/pages-1.img": pages(8, 9)})
    index = newest_index(store)
    spoil_index(index, how)

    manifest, refused = store.latest_valid(7)

    assert manifest == first
    assert [r.seq for r in refused] == [second.seq]
    assert f"pack index {index} was skipped: it " in refused[0].reason
    assert BAD_INDEXES[how] in refused[0].reason.split(" was skipped: it ")[1]
    store.restore(manifest, tmp_path / "out")
    assert (tmp_path / "out/images/pages-1.img").read_bytes() == bytes(pages(8, 8))
    result = store.prune(7, keep=2)  # nothing to delete, and the damaged index fails nothing
    assert [s.what for s in result.skipped] == [f"pack index {index}"]
    assert index.exists() and index.with_suffix(".pack").exists()


def test_a_pack_index_without_its_pack_is_skipped(store):
    first = commit(store, {"images/pages-1.img": pages(8, 10)})
    second = commit(store, {"images/pages-1.img": pages(8, 11)})
    index = newest_index(store)
    index.with_suffix(".pack").unlink()

    manifest, refused = store.latest_valid(7)

    assert (manifest, [r.seq for r in refused]) == (first, [second.seq])
    assert f"has no pack {index.with_suffix('.pack').name} beside it" in refused[0].reason


def test_a_pack_with_a_format_1_json_index_still_restores(store, tmp_path):
    memory = pages(8, 12)
    manifest = commit(store, {"images/pages-1.img": memory})
    index = newest_index(store)
    index.write_text(as_json_index(index))  # as the previous version published it
    store = CheckpointStore(store.root, max_chunk=PAGE)

    store.restore(manifest, tmp_path / "out")

    assert (tmp_path / "out/images/pages-1.img").read_bytes() == bytes(memory)


def test_an_index_is_read_again_only_when_indexes_come_or_go(store, monkeypatch):
    import singularity_slurm.checkpoint.store as store_module

    commit(store, {"images/pages-1.img": pages(8, 13)})
    reads = []
    real = store_module.read_pack_index
    monkeypatch.setattr(store_module, "read_pack_index", lambda *a: reads.append(a[0]) or real(*a))
    first = newest_index(store)
    store.pack_index(7)
    store.pack_index(7)
    assert reads == [first]
    commit(store, {"images/pages-1.img": pages(8, 14)})
    store.pack_index(7)
    assert reads == [first, newest_index(store)]  # the new pack's index only


def test_a_pack_whose_index_was_never_published_goes_after_the_grace_time(tmp_path):
    clock = [1000.0]
    store = CheckpointStore(tmp_path / "store", max_chunk=PAGE, clock=lambda: clock[0])
    kept = commit(store, {"images/pages-1.img": pages(8, 15)})
    orphan = store.packs_dir(7) / "crashed-writer.pack"
    orphan.write_bytes(b"x" * PAGE)

    assert store.collect_garbage(7, tmp_grace_s=60).chunk_bytes_deleted == 0
    assert orphan.exists()
    clock[0] = orphan.stat().st_mtime + 61
    assert store.collect_garbage(7, tmp_grace_s=60).chunk_bytes_deleted == PAGE
    assert not orphan.exists()
    store.verify(kept)


def test_collection_compacts_mostly_dead_packs_and_every_kept_checkpoint_still_restores(store, tmp_path):
    memory = pages(64, 16)
    commit(store, {"images/pages-1.img": memory})
    compacted = 0
    for round_ in range(6):  # each checkpoint rewrites 16 pages: the first pack dies page by page
        for page in range(16 * round_ % 64, 16 * round_ % 64 + 16):
            memory[page * PAGE:(page + 1) * PAGE] = pages(1, 100 + 64 * round_ + page)
        newest = commit(store, {"images/pages-1.img": memory})
        compacted += store.prune(7, keep=2).packs_compacted
    live = {chunk.hash for m in store.list(7) for f in m.files for chunk in f.chunks}

    assert compacted >= 1
    assert store.job_usage(7) == len(live) * PAGE  # only live chunks are left, each once
    for manifest in store.list(7):
        out = tmp_path / f"out-{manifest.seq}"
        store.restore(manifest, out)
    assert (tmp_path / f"out-{newest.seq}/images/pages-1.img").read_bytes() == bytes(memory)


def test_a_corrupt_chunk_keeps_its_pack_out_of_compaction(store):
    memory = pages(8, 17)
    first = commit(store, {"images/pages-1.img": memory})
    memory[: 6 * PAGE] = pages(6, 18)
    commit(store, {"images/pages-1.img": memory})
    victim = first.files[0].chunks[7].hash  # still live in the second checkpoint
    pack, offset, _ = store.locate(7, victim)
    data = bytearray(pack.read_bytes())
    data[offset] ^= 0x01
    pack.write_bytes(bytes(data))

    result = store.prune(7, keep=1)

    assert result.packs_compacted == 0
    assert [s.what for s in result.skipped] == [f"pack {pack}"]
    assert "does not match its hash" in result.skipped[0].reason
    assert pack.exists()


def two_checkpoints_whose_first_pack_is_mostly_dead(store) -> bytearray:
    memory = pages(16, 19)
    commit(store, {"images/pages-1.img": memory})
    memory[: 12 * PAGE] = pages(12, 20)
    commit(store, {"images/pages-1.img": memory})
    return memory


def test_no_collection_runs_while_a_checkpoint_is_written_from_the_packs(store, tmp_path):
    memory = two_checkpoints_whose_first_pack_is_mostly_dead(store)
    packs = sorted(store.packs_dir(7).iterdir())
    with store.begin(7, reason="periodic") as writer:
        writer.add_bytes("images/pages-1.img", bytes(memory))  # its last 4 pages are in the first pack
        writer._tmp.rename(tmp_path / "hidden")  # the job's lock alone keeps the collection off
        result = CheckpointStore(store.root, max_chunk=PAGE).drop(7, [1])
        (tmp_path / "hidden").rename(writer._tmp)
        manifest = writer.commit()

    assert (result.chunk_gc_deferred, result.packs_compacted) == (True, 0)
    assert sorted(store.packs_dir(7).iterdir()) == packs  # nothing new stored, nothing removed
    store.restore(manifest, tmp_path / "out")
    assert (tmp_path / "out/images/pages-1.img").read_bytes() == bytes(memory)
    assert store.prune(7, keep=1).packs_compacted == 1  # once the writer is done


def test_a_writer_whose_pack_an_unlocked_collection_compacted_commits_from_the_new_pack(store, tmp_path):
    import fcntl

    memory = two_checkpoints_whose_first_pack_is_mostly_dead(store)
    with store.begin(7, reason="periodic") as writer:
        writer.add_bytes("images/pages-1.img", bytes(memory))
        # a collection that takes no lock and did not see the writer (an older version's)
        fcntl.flock(writer._lock, fcntl.LOCK_UN)
        writer._tmp.rename(tmp_path / "hidden")
        assert CheckpointStore(store.root, max_chunk=PAGE).drop(7, [1]).packs_compacted == 1
        (tmp_path / "hidden").rename(writer._tmp)
        manifest = writer.commit()

    store.restore(manifest, tmp_path / "out")
    assert (tmp_path / "out/images/pages-1.img").read_bytes() == bytes(memory)


def test_no_collection_runs_while_a_checkpoint_is_restored(store, tmp_path):
    two_checkpoints_whose_first_pack_is_mostly_dead(store)
    packs = sorted(store.packs_dir(7).iterdir())
    with store.job_lock(7, exclusive=False):  # what verify and restore hold while they read
        result = store.drop(7, [1])
        assert sorted(store.packs_dir(7).iterdir()) == packs
    assert (result.manifests_deleted, result.chunk_gc_deferred) == ((1,), True)
    assert store.collect_garbage(7).packs_compacted == 1


def test_the_writers_own_new_digests_are_found_across_merges():
    from singularity_slurm.checkpoint.packs import DIGEST, DigestSet

    seen, every = DigestSet(), []
    seen.MERGE_AT = 3
    rng = random.Random(5)
    for _ in range(200):
        digest = rng.randbytes(16)
        assert not seen.contains(np.frombuffer(digest, DIGEST))[0] and digest not in seen.recent
        seen.add(digest)
        every.append(digest)
        seen.settle()
    assert len(seen) == 200
    sizes = [len(level) for level in seen.levels]
    assert sizes == sorted(sizes, reverse=True) and len(sizes) <= 8  # few arrays, the largest first
    stored = np.frombuffer(b"".join(every), DIGEST)
    assert (seen.contains(stored) | np.array([d in seen.recent for d in every])).all()


def test_a_pack_cut_short_while_a_restore_reads_it_names_the_chunk_it_cut(store, tmp_path, monkeypatch):
    manifest = commit(store, {"images/pages-1.img": pages(8, 23)})
    stale = store.pack_index(7)  # read before the damage, as by a restore already under way
    pack, offset, _ = store.locate(7, manifest.files[0].chunks[5].hash)
    os.truncate(pack, offset + 100)
    monkeypatch.setattr(store, "pack_index", lambda job: stale)

    with pytest.raises(CorruptCheckpoint) as info:
        store.restore(manifest, tmp_path / "out")

    cut = manifest.files[0].chunks[5].hash
    assert (f"chunk 5 ({cut}, bytes {5 * PAGE}..{6 * PAGE}) of images/pages-1.img is corrupt: it has 100 "
            f"bytes in {pack.name} instead of {PAGE}") in str(info.value)


def test_a_chunk_whose_index_gives_a_wrong_length_is_stored_again_and_restores(store, tmp_path):
    memory = pages(4, 24)
    commit(store, {"images/pages-1.img": memory})
    index = newest_index(store)
    entries = read_pack_index(index, index.with_suffix(".pack").stat().st_size).copy()
    entries["length"][0] = PAGE - 1  # damaged, yet inside its pack
    index.write_bytes(INDEX_MAGIC + entries.tobytes())

    second = commit(store, {"images/pages-1.img": memory})

    assert second.new_bytes == PAGE  # that chunk once more, at its length
    for attempt in range(3):  # whichever copy the index meets first
        store = CheckpointStore(store.root, max_chunk=PAGE)
        store.restore(second, tmp_path / f"out-{attempt}")
        assert (tmp_path / f"out-{attempt}/images/pages-1.img").read_bytes() == bytes(memory)


def test_a_number_claimed_by_a_commit_cut_short_is_refused_skipped_and_collected(tmp_path):
    clock = [time.time()]
    store = CheckpointStore(tmp_path / "store", max_chunk=PAGE, clock=lambda: clock[0])
    first = commit(store, {"images/pages-1.img": pages(2, 25)})
    claim = store.job_dir(7) / "manifests/00000002.json"
    claim.write_text(json.dumps({"format": 2, "manifest": "00000002.mf"}))  # its .mf never linked

    manifest, refused = store.latest_valid(7)
    third = commit(store, {"images/pages-1.img": pages(2, 26)})

    assert manifest == first
    assert refused[0].reason.endswith("only claims its number for 00000002.mf, which is not there: its "
                                      "commit was cut short")
    assert (third.seq, store.seqs(7)) == (3, [1, 2, 3])
    store.collect_garbage(7, tmp_grace_s=60)
    assert claim.exists()  # a commit may still be under way
    clock[0] = claim.stat().st_mtime + 61
    store.collect_garbage(7, tmp_grace_s=60)
    assert not claim.exists() and store.seqs(7) == [1, 3]


def test_a_chunk_two_writers_both_stored_survives_compaction_once(store, tmp_path):
    shared = pages(2, 27)
    with store.begin(7, reason="periodic") as a, store.begin(7, reason="periodic") as b:
        a.add_bytes("images/pages-1.img", bytes(shared + pages(14, 28)))
        b.add_bytes("images/pages-1.img", bytes(shared + pages(14, 29)))  # neither saw the other's
        a.commit()
        b.commit()
    newest = commit(store, {"images/pages-1.img": shared + pages(2, 30)})

    result = store.drop(7, [1, 2])

    assert result.packs_compacted == 1  # one copy of the shared pages moved, both old packs gone
    assert store.job_usage(7) == 4 * PAGE
    store.restore(newest, tmp_path / "out")
    assert (tmp_path / "out/images/pages-1.img").read_bytes() == bytes(shared + pages(2, 30))


def test_compaction_copies_at_most_its_budget_per_collection(store, tmp_path, monkeypatch):
    import singularity_slurm.checkpoint.store as store_module

    monkeypatch.setattr(store_module, "COMPACT_MAX_BYTES", 3 * PAGE)
    kept = []
    for seed in range(3):  # three packs of 16 pages, 2 of them still needed in each
        memory = pages(16, 40 + seed)
        commit(store, {"images/pages-1.img": memory})
        kept.append(memory[: 2 * PAGE])
    newest = commit(store, {"images/pages-1.img": b"".join(kept)})
    # 3 pages a collection: one pack's 2 needed pages and 1 of the next's
    assert store.drop(7, [1, 2, 3]).packs_compacted == 2

    counts = [store.collect_garbage(7).packs_compacted for _ in range(2)]

    assert counts == [2, 0]  # the second's last page and the third's 2, then nothing is left to do
    assert store.job_usage(7) == 6 * PAGE
    store.restore(newest, tmp_path / "out")
    assert (tmp_path / "out/images/pages-1.img").read_bytes() == b"".join(kept)


def test_a_writer_that_cannot_begin_leaves_no_lock_and_no_folder_behind(store, monkeypatch):
    import os

    commit(store, {"images/pages-1.img": pages(2, 31)})
    before = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(store, "pack_index", lambda job: (_ for _ in ()).throw(OSError("stale handle")))
    with pytest.raises(OSError):
        store.begin(7, reason="periodic")
    monkeypatch.undo()

    assert len(os.listdir("/proc/self/fd")) == before
    assert list((store.job_dir(7) / "tmp").iterdir()) == []
    assert store.collect_garbage(7).chunk_gc_deferred is False


def test_a_fence_nested_beyond_pythons_depth_fences_nothing(store):
    commit(store, {"images/pages-1.img": pages(2, 32)})
    (store.job_dir(7) / "fence.json").write_text("[" * 200000)

    assert store.read_fence(7) is None
    assert store.latest_valid(7)[0].seq == 1


def test_a_pack_that_needs_more_than_the_budget_is_compacted_over_several_collections(store, tmp_path,
                                                                                       monkeypatch):
    import singularity_slurm.checkpoint.store as store_module

    monkeypatch.setattr(store_module, "COMPACT_MAX_BYTES", 3 * PAGE)
    memory = pages(32, 50)
    commit(store, {"images/pages-1.img": memory})
    memory[8 * PAGE:] = pages(24, 51)
    newest = commit(store, {"images/pages-1.img": memory})  # 8 pages of the first pack still needed
    store.drop(7, [1])  # copies 3 of them

    counts = [store.collect_garbage(7).packs_compacted for _ in range(3)]

    assert counts == [1, 1, 0]  # 3 more, then the last 2 and the first pack goes
    assert store.job_usage(7) == 32 * PAGE  # the 24 new pages and each needed old one once
    store.restore(newest, tmp_path / "out")
    assert (tmp_path / "out/images/pages-1.img").read_bytes() == bytes(memory)
