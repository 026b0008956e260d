"""A dump's pages streamed from criu into the store (checkpoint.pagestream): no pages image in the
image folder, each page hashed and stored once, the checkpoint restores complete; a store that fails
mid-stream fails the dump and the tree runs on, even a dump that would have ended it.

A real tree of the job user (criutree: a parent holding random memory, two forked children) is
dumped with real CRIU into a store of the test's own and restored from it. No Slurm involved.
"""

from __future__ import annotations

import pwd
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from criutree import Tree, restore_matches, running_tree

from singularity_slurm import config as config_mod
from singularity_slurm.checkpoint import images, incremental
from singularity_slurm.checkpoint.criu import Criu, wrapper_path
from singularity_slurm.errors import CheckpointError, StoreFull
from singularity_slurm.node.engine import job_store

WRAPPER = wrapper_path(config_mod.load().paths.prefix)
MIB = 48
PAGES = (MIB << 20) // incremental.PAGE_SIZE


@pytest.fixture
def tree(job_user: pwd.struct_passwd) -> Iterator[Tree]:
    if not WRAPPER.exists():
        pytest.fail(f"{WRAPPER} is missing: `make test` installs CRIU")
    with running_tree(job_user, MIB) as tree:
        yield tree


def stored_pages(manifest) -> int:
    return sum(f.size for f in manifest.files if Path(f.path).name.startswith("pages-"))


def test_streamed_dumps_store_each_page_once_leave_no_pages_in_the_folder_and_restore_complete(
        tree: Tree, tmp_path: Path):
    criu = Criu(WRAPPER)
    store = job_store(tmp_path / "store")
    tree.reports(3)

    # a periodic dump, streamed, arming the write trackers
    armed = tmp_path / "armed"
    with store.begin(1, reason="periodic", meta={}) as writer:
        result = criu.dump(tree.init, armed, leave_running=True, arm=criu.tracks_writes,
                           pages=writer.chunk_sink(incremental.PAGE_SIZE))
        assert result.received is not None
        assert not list(armed.glob("pages-*.img")) and not list(armed.glob("pagemap-*.img")), \
            "criu wrote pages into the image folder"
        assert sum(p.stat().st_size for p in armed.iterdir()) < 4 << 20
        images.add_images(writer, armed, None, received=result.received)
        base = writer.commit()
    assert set(result.received.pagemaps) == {"pagemap-1.img", "pagemap-2.img", "pagemap-3.img"}
    # the parent's memory once; the children's shared copy on write with it not again (share-cow)
    assert PAGES * incremental.PAGE_SIZE <= stored_pages(base) < (PAGES + 2048) * incremental.PAGE_SIZE * (
        1 if criu.share_cow else 3)
    assert base.new_bytes < stored_pages(base) + (8 << 20)

    tree.signal_all(tree.init, signal.SIGUSR2)
    written = tree.reports(6)

    # the preemption's dump, streamed too: after an armed one only the written pages come
    later = tmp_path / "later"
    with store.begin(1, reason="preemption", meta={}) as writer:
        result = criu.dump(tree.init, later, incremental=criu.tracks_writes,
                           pages=writer.chunk_sink(incremental.PAGE_SIZE), settle_pages=writer.sync_chunks)
        if criu.tracks_writes:
            assert result.received.pages < PAGES // 4, "unwritten pages were sent again"
        images.add_images(writer, later, base if criu.tracks_writes else None, received=result.received)
        manifest = writer.commit()
    if criu.tracks_writes:
        assert manifest.meta["incremental"]["base"] == base.seq
        assert manifest.new_bytes <= result.received.pages * incremental.PAGE_SIZE + (4 << 20)

    restored = tmp_path / "restored"
    restored.mkdir()
    folder = images.download(store, manifest, restored)
    restore_matches(criu, folder, tree, written)


def test_a_store_that_fails_mid_stream_fails_the_dump_and_the_tree_runs_on(tree: Tree, tmp_path: Path):
    criu = Criu(WRAPPER)
    tree.reports(3)
    calls = []

    def full(data: memoryview) -> bytes:
        calls.append(len(data))
        raise StoreFull("the store's file system is full (test)")

    with pytest.raises(StoreFull, match="full"):
        criu.dump(tree.init, tmp_path / "dump", pages=full)  # a stopping dump: it would end the tree
    assert calls, "no pages reached the sink"
    assert len(tree.signal_all(tree.init, signal.SIGUSR1)) == 3, "the tree did not survive the failed dump"
    tree.reports(6)

    def full_at_the_end() -> None:  # every page taken, and the disk fills as the last ones are written
        raise StoreFull("the store's file system is full at the end (test)")

    with pytest.raises(StoreFull, match="at the end"):
        criu.dump(tree.init, tmp_path / "dump2", pages=lambda data: b"\0" * 16 * (len(data) // 4096),
                  settle_pages=full_at_the_end)
    assert len(tree.signal_all(tree.init, signal.SIGUSR1)) == 3, "the tree did not survive the failed dump"
    tree.reports(9)


def test_criu_failing_before_it_streams_names_criu_not_the_stream(tree: Tree, tmp_path: Path):
    criu = Criu(WRAPPER)
    with pytest.raises(CheckpointError, match="criu dump of pid 999999 failed"):
        criu.dump(999999, tmp_path / "dump", pages=lambda data: b"")
