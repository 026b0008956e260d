"""criu's `--share-cow` (checkpoint/criu_patches): memory that forked processes still share copy on
write is dumped once, restored intact, and stays shared after the restore.

A real tree of the job user (criutree: a parent holding random memory and two forked children, one
of which wrote a little of it), dumped first with the option off (as stock criu dumps, the tree
left running) and then with it, and restored. No Slurm involved.
"""

from __future__ import annotations

import os
import pwd
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from criutree import ROLES, Tree, running_tree

from singularity_slurm import config as config_mod
from singularity_slurm.checkpoint.criu import Criu, wrapper_path
from singularity_slurm.checkpoint.images import PAGE_SIZE, PE_COW, PE_PRESENT

WRAPPER = wrapper_path(config_mod.load().paths.prefix)
MIB = 48
PAGES = (MIB << 20) // PAGE_SIZE
SLACK = 768  # pages of Python's own a child may have touched, and child1's MiB


def pages_by_process(images: Path) -> dict[int, dict[str, int]]:
    """Per dumped process (its pagemap's pid): pages stored in its own image, and pages it shares."""
    import pycriu

    counts = {}
    for pagemap in images.glob("pagemap-*.img"):
        with open(pagemap, "rb") as handle:
            entries = pycriu.images.load(handle)["entries"]
        own = sum(e["nr_pages"] for e in entries[1:] if e.get("flags", PE_PRESENT) & PE_PRESENT)
        cow = sum(e["nr_pages"] for e in entries[1:] if e.get("flags", 0) & PE_COW)
        counts[int(pagemap.stem.split("-")[1])] = {"own": own, "cow": cow}
    return counts


def _pss_rss_kib(pid: int) -> tuple[int, int]:
    fields = dict(line.split()[:2] for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
    return int(fields["Pss:"]), int(fields["Rss:"])


@pytest.fixture
def tree(job_user: pwd.struct_passwd) -> Iterator[Tree]:
    if not WRAPPER.exists():
        pytest.fail(f"{WRAPPER} is missing: `make test` installs CRIU")
    with running_tree(job_user, MIB) as tree:
        yield tree


def test_shared_pages_are_dumped_once_restored_intact_and_still_shared(tree: Tree, tmp_path: Path):
    ready = tree.reports(3)
    assert Criu(WRAPPER).share_cow, f"{WRAPPER} runs a criu without the share-cow patch"

    stock, shared = tmp_path / "stock", tmp_path / "shared"
    Criu(WRAPPER, share_cow=False).dump(tree.init, stock, leave_running=True)
    Criu(WRAPPER).dump(tree.init, shared)

    before, after = pages_by_process(stock), pages_by_process(shared)
    assert len(before) == len(after) == 3
    parent = min(after)  # the namespace's init: pid 1
    children = sorted(set(after) - {parent})
    assert all(before[c]["cow"] == 0 for c in before), "the option was off, yet pages were left out"
    assert after[parent]["cow"] == 0 and after[parent]["own"] >= PAGES
    # every page a child left as it was is its parent's; only what it wrote (or Python touched) is its own
    for child in children:
        kept = after[child]["own"] + after[child]["cow"]
        assert abs(kept - before[child]["own"]) <= 64, "pages went missing"
        assert after[child]["cow"] >= PAGES - SLACK
        assert after[child]["own"] <= before[child]["own"] - PAGES + SLACK
    stored = sum(p.stat().st_size for p in shared.glob("pages-*.img"))
    assert stored <= sum(p.stat().st_size for p in stock.glob("pages-*.img")) - 2 * (MIB - 3) * (1 << 20)

    root = Criu(WRAPPER).restore(shared)
    try:
        pids = tree.signal_all(root, signal.SIGUSR1)
        assert len(pids) == 3
        restored = tree.reports(6)
        for role in ROLES:
            assert restored[role] == ready[f"{role}-ready"], f"{role}'s memory changed across the restore"
        assert ready["child1-ready"] != ready["child2-ready"]
        for pid in pids:
            pss, rss = _pss_rss_kib(pid)
            assert rss - pss >= (MIB << 10) // 2, \
                f"pid {pid}: its memory is no longer shared ({pss}/{rss} KiB)"
    finally:
        os.kill(root, signal.SIGKILL)
        os.waitpid(root, 0)
