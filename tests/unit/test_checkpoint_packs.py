"""Pack mode of the checkpoint store: a writer's new chunks go into one pack file with an index."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest

from singularity_slurm.checkpoint.store import CheckpointStore
from singularity_slurm.errors import CorruptCheckpoint, StoreFull

PAGE = 4096


def pages(count: int, seed: int) -> bytearray:
    return bytearray(random.Random(seed).randbytes(count * PAGE))


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "store", max_chunk=PAGE, pack_chunks=True)


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
    assert list((store.job_dir(7) / "chunks").iterdir()) == []
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


def test_a_full_store_in_pack_mode_keeps_the_previous_checkpoint(tmp_path):
    import os

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    root = tmp_path / "small"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(root)], check=True)
    try:
        store = CheckpointStore(root, max_chunk=PAGE, pack_chunks=True)
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


def spoil_index(text: str, how: str) -> str:
    doc = json.loads(text)
    first = next(iter(doc))
    if how == "a list":
        return json.dumps(list(doc.items()))
    if how == "truncated":
        return text[: len(text) // 2]
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
    return json.dumps(doc)


BAD_INDEXES = {
    "truncated": "is not valid JSON",
    "a list": "holds a JSON list, not an object",
    "bad hash": "has the entry 'not-a-hash'",
    "bad entry": "not 32 hex digits -> [offset, length]",
    "negative offset": "the offset of chunk",
    "huge length": "the length of chunk",
    "beyond the pack": "beyond the end of its pack",
}


@pytest.mark.parametrize("how", BAD_INDEXES)
def test_a_damaged_pack_index_is_skipped_naming_it_by_restore_and_prune(store, tmp_path, how):
    first = commit(store, {"images/pages-1.img": pages(8, 8)})
    second = commit(store, {"images/pages-1.img": pages(8, 9)})
    index = newest_index(store)
    index.write_text(spoil_index(index.read_text(), how))

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
