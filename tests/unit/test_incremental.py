"""Incremental dumps: holes of a tracked dump filled from the base checkpoint, nothing read twice."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import xxhash

from singularity_slurm.checkpoint import images, incremental
from singularity_slurm.checkpoint.incremental import (
    PAGE_SIZE,
    PE_COW,
    PE_LAZY,
    PE_PARENT,
    PE_PRESENT,
    IncompleteBase,
    Pagemap,
    base_pages,
    compose,
    process_pages,
)
from singularity_slurm.checkpoint.manifest import DIGEST
from singularity_slurm.checkpoint.store import CheckpointStore
from singularity_slurm.errors import CheckpointError

A = 0x7F0000000000
P = PAGE_SIZE


def page(seed: int) -> bytes:
    return random.Random(seed).randbytes(P)


def digests(*seeds: int) -> np.ndarray:
    return np.frombuffer(b"".join(xxhash.xxh3_128_digest(page(s)) for s in seeds), DIGEST)


def test_a_complete_dumps_pages_are_its_chunks_in_order_and_its_parents_where_shared() -> None:
    parent = process_pages(Pagemap(1, ((A, 2, PE_PRESENT), (A + 8 * P, 1, PE_PRESENT | PE_LAZY))),
                           digests(1, 2, 3), None)
    child = process_pages(Pagemap(2, ((A, 1, PE_COW), (A + P, 1, PE_PRESENT), (A + 8 * P, 1, PE_COW))),
                          digests(9), parent)
    assert child.vaddrs.tolist() == [A, A + P, A + 8 * P]
    assert child.digests.tobytes() == digests(1, 9, 3).tobytes()


def test_shared_pages_of_a_grandchild_resolve_through_its_parent_to_the_root() -> None:
    pagemaps = {10: Pagemap(1, ((A, 1, PE_PRESENT),)), 11: Pagemap(2, ((A, 1, PE_COW),)),
                12: Pagemap(3, ((A, 1, PE_COW),))}
    tables = base_pages(pagemaps, {1: digests(5), 2: digests(), 3: digests()}, {10: 1, 11: 10, 12: 11})
    assert tables[12].digests.tobytes() == digests(5).tobytes()


def test_a_holes_pages_come_from_the_base_and_the_dumps_own_pages_keep_their_order() -> None:
    base = process_pages(Pagemap(1, ((A, 4, PE_PRESENT),)), digests(1, 2, 3, 4), None)
    new = Pagemap(7, ((A, 1, PE_PARENT), (A + P, 1, PE_PRESENT), (A + 2 * P, 2, PE_PARENT),
                      (A + 9 * P, 2, PE_PRESENT), (A + 11 * P, 1, PE_PRESENT), (A + 20 * P, 3, PE_COW)))
    composed = compose(new, base)
    assert composed.pagemap == Pagemap(7, ((A, 1, PE_PRESENT), (A + P, 1, PE_PRESENT),
                                           (A + 2 * P, 2, PE_PRESENT), (A + 9 * P, 2, PE_PRESENT),
                                           (A + 11 * P, 1, PE_PRESENT), (A + 20 * P, 3, PE_COW)))
    first, own, rest, tail = composed.segments
    assert first.tobytes() == digests(1).tobytes() and own == (0, 1)
    assert rest.tobytes() == digests(3, 4).tobytes()
    assert tail == (1, 3), "the dump's adjacent own pages are one segment"
    assert (composed.new_pages, composed.base_pages) == (4, 3)


def test_a_hole_the_base_lacks_refuses_the_dump() -> None:
    base = process_pages(Pagemap(1, ((A, 1, PE_PRESENT),)), digests(1), None)
    with pytest.raises(IncompleteBase, match=hex(A + P)):
        compose(Pagemap(1, ((A, 2, PE_PARENT),)), base)
    with pytest.raises(IncompleteBase, match="not in"):
        compose(Pagemap(1, ((A, 1, PE_PARENT),)), None)


def test_a_base_must_be_complete_and_stored_a_page_a_chunk() -> None:
    with pytest.raises(IncompleteBase, match="PE_PARENT"):
        process_pages(Pagemap(1, ((A, 1, PE_PARENT),)), digests(), None)
    with pytest.raises(IncompleteBase, match="1 page chunks for 2 pages"):
        process_pages(Pagemap(1, ((A, 2, PE_PRESENT),)), digests(1), None)
    with pytest.raises(IncompleteBase, match="parent"):
        process_pages(Pagemap(1, ((A, 1, PE_COW),)), digests(), None)


def test_a_composed_file_references_the_bases_chunks_and_stores_only_the_new_ones(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "store", max_chunk=P)
    with store.begin(1, reason="periodic") as writer:
        writer.add_bytes("images/pages-1.img", b"".join(page(s) for s in (1, 2, 3)))
        base = writer.commit()
    source = tmp_path / "pages-1.img"
    source.write_bytes(page(8) + page(9))
    with store.begin(1, reason="preemption") as writer:
        writer.add_composed("images/pages-1.img", source, [digests(1), (0, 1), digests(3), (1, 1)], chunk=P)
        second = writer.commit()
    assert second.new_bytes == 2 * P
    assert store.file_bytes(second, "images/pages-1.img") == b"".join(page(s) for s in (1, 8, 3, 9))
    assert store.file_bytes(base, "images/pages-1.img") == b"".join(page(s) for s in (1, 2, 3))


def test_a_composed_file_naming_a_chunk_the_store_lacks_commits_nothing(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "store", max_chunk=P)
    source = tmp_path / "pages-1.img"
    source.write_bytes(page(8))
    with pytest.raises(CheckpointError, match="no longer in the store"):
        with store.begin(1, reason="preemption") as writer:
            writer.add_composed("images/pages-1.img", source, [(0, 1), digests(5)], chunk=P)
            writer.commit()
    assert store.seqs(1) == []


def test_a_dump_with_holes_and_no_base_is_refused_with_what_to_do(tmp_path: Path) -> None:
    pytest.importorskip("pycriu")
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "pagemap-1.img").write_bytes(incremental.encode_pagemap(Pagemap(1, ((A, 1, PE_PARENT),))))
    (dump / "pages-1.img").write_bytes(b"")
    store = CheckpointStore(tmp_path / "store", max_chunk=P)
    with pytest.raises(CheckpointError, match="the next dump is a full one"):
        images.upload(store, 1, dump, "preemption", {}, base=None)
    assert store.seqs(1) == []


def test_an_incremental_dump_is_stored_complete_from_its_base(tmp_path: Path) -> None:
    pytest.importorskip("pycriu")
    store = CheckpointStore(tmp_path / "store", max_chunk=P)

    def dump(name: str, pagemaps: dict[int, Pagemap], pages: dict[int, bytes]) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        for pid, pagemap in pagemaps.items():
            (folder / f"pagemap-{pid}.img").write_bytes(incremental.encode_pagemap(pagemap))
        for pages_id, data in pages.items():
            (folder / f"pages-{pages_id}.img").write_bytes(data)
        (folder / "pstree.img").write_bytes(_pstree({1: 0, 2: 1}))
        return folder

    first = dump("first", {1: Pagemap(1, ((A, 3, PE_PRESENT),)), 2: Pagemap(2, ((A, 3, PE_COW),))},
                 {1: page(1) + page(2) + page(3), 2: b""})
    base = images.upload(store, 1, first, "periodic", {})
    # The parent wrote its second page; the child wrote its first, and left the rest to the base,
    # where it shared them with the parent.
    parent = Pagemap(1, ((A, 1, PE_PARENT), (A + P, 1, PE_PRESENT), (A + 2 * P, 1, PE_PARENT)))
    second = dump("second", {1: parent,
                             2: Pagemap(2, ((A, 1, PE_PRESENT), (A + P, 2, PE_PARENT)))},
                  {1: page(7), 2: page(8)})
    manifest = images.upload(store, 1, second, "preemption", {}, base=base)
    assert manifest.new_bytes < 2 * P + 4096, "pages the base holds were stored again"
    assert manifest.meta["incremental"] == {"base": base.seq, "pages_taken": 4, "pages_dumped": 2}
    out = tmp_path / "out"
    out.mkdir()
    folder = images.download(store, manifest, out)
    assert (folder / "pages-1.img").read_bytes() == page(1) + page(7) + page(3)
    assert (folder / "pages-2.img").read_bytes() == page(8) + page(2) + page(3)
    parsed = incremental.parse_pagemap((folder / "pagemap-2.img").read_bytes())
    assert parsed.holes == 0 and parsed.present == 3


def _pstree(ppids: dict[int, int]) -> bytes:
    import io

    import pycriu

    out = io.BytesIO()
    pycriu.images.dump({"magic": "PSTREE", "entries": [
        {"pid": pid, "ppid": ppid, "pgid": 1, "sid": 1, "threads": [pid]}
        for pid, ppid in ppids.items()]}, out)
    return out.getvalue()
