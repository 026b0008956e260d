"""criu's `--track-writes` and `--track-incremental` (checkpoint/criu_patches), through the store: a
dump after an armed one stores the pages written since, takes the rest from the armed dump's
checkpoint, and restores complete.

A real tree of the job user (criutree) is dumped with its trackers armed and left running, writes
into its memory, and is dumped again, incrementally; both dumps go through `images.upload` into a
store of the test's own, and the second is restored from the store with real CRIU. No Slurm
involved.
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
from singularity_slurm.node.engine import job_store

WRAPPER = wrapper_path(config_mod.load().paths.prefix)
MIB = 48
PAGES = (MIB << 20) // incremental.PAGE_SIZE
WRITTEN = 512  # pages each process overwrites at SIGUSR2
SLACK = 1024  # pages Python's own work may touch between the dumps


def holes(images_dir: Path) -> dict[int, int]:
    return {int(p.stem.split("-")[1]): incremental.parse_pagemap(p.read_bytes()).holes
            for p in images_dir.glob("pagemap-*.img")}


def pages_bytes(images_dir: Path) -> int:
    return sum(p.stat().st_size for p in images_dir.glob("pages-*.img"))


@pytest.fixture
def tree(job_user: pwd.struct_passwd) -> Iterator[Tree]:
    if not WRAPPER.exists():
        pytest.fail(f"{WRAPPER} is missing: `make test` installs CRIU")
    with running_tree(job_user, MIB) as tree:
        yield tree


def test_a_dump_after_an_armed_one_stores_only_what_was_written_and_restores_complete(tree: Tree,
                                                                                      tmp_path: Path):
    criu = Criu(WRAPPER)
    assert criu.tracks_writes, f"{WRAPPER} runs a criu without the track-writes patch"
    store = job_store(tmp_path / "store")
    tree.reports(3)

    armed = tmp_path / "armed"
    criu.dump(tree.init, armed, leave_running=True, arm=True)
    assert not any(holes(armed).values()), "a dump with nothing armed before it left pages out"
    base = images.upload(store, 1, armed, "periodic", {})

    tree.signal_all(tree.init, signal.SIGUSR2)
    written = tree.reports(6)
    later = tmp_path / "later"
    criu.dump(tree.init, later, incremental=True)

    left = holes(later)
    assert left[1] >= PAGES - WRITTEN - SLACK, "the parent's unwritten memory was dumped again"
    assert pages_bytes(later) <= (3 * WRITTEN + 3 * SLACK) * incremental.PAGE_SIZE
    assert pages_bytes(armed) >= PAGES * incremental.PAGE_SIZE
    manifest = images.upload(store, 1, later, "preemption", {}, base=base)
    assert manifest.meta["incremental"]["base"] == base.seq
    assert manifest.meta["incremental"]["pages_taken"] == sum(left.values())
    assert manifest.new_bytes <= pages_bytes(later) + (1 << 20), "pages the base holds were stored again"

    restored = tmp_path / "restored"
    restored.mkdir()
    folder = images.download(store, manifest, restored)
    assert not any(holes(folder).values()), "the stored checkpoint is not complete on its own"
    restore_matches(criu, folder, tree, written)


def test_without_an_armed_dump_before_it_an_incremental_dump_leaves_nothing_out(tree: Tree, tmp_path: Path):
    criu = Criu(WRAPPER)
    tree.reports(3)
    first = tmp_path / "first"
    criu.dump(tree.init, first, leave_running=True, incremental=True)
    assert not any(holes(first).values())
