"""Incremental dumps: the pages nobody wrote since the last checkpoint, taken from that checkpoint.

With criu's write tracker (criu_patches/0002: `--track-writes` arms it at a periodic dump,
`--track-incremental` reads it at the next one), a page that is present but was not written since
the dump that armed the tracker is not dumped again: its pagemap entry is a PE_PARENT hole, and no
parent images are read. The store is content addressed, so such a page costs nothing to keep: its
chunk is the one the base checkpoint holds at the same address of the same process (or, where the
base recorded it as shared copy on write with the process's parent, the parent's there). `compose`
turns each hole into a present entry whose chunks are the base's, so every committed checkpoint
is complete on its own and restore reads it as it reads any other.

Everything here is pure: pagemaps and chunk digests in, composed pagemaps and a plan of the pages
file out. `images.upload` reads and writes the files.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .manifest import DIGEST

PAGE_SIZE = 4096
PE_PARENT, PE_LAZY, PE_PRESENT = 1, 2, 4
PE_COW = 8
"""Pages the process shares copy on write with its parent process (criu's --share-cow patch): they
are in the parent's image, not in this one's."""


class IncompleteBase(ValueError):
    """The base checkpoint lacks a page the new dump left to it: the dump cannot be committed."""


@dataclass(frozen=True)
class Pagemap:
    """One process's pagemap image: its pages image's id and (vaddr, pages, flags) per entry."""

    pages_id: int
    entries: tuple[tuple[int, int, int], ...]

    @property
    def holes(self) -> int:
        return sum(n for _, n, flags in self.entries if flags & PE_PARENT)

    @property
    def present(self) -> int:
        return sum(n for _, n, flags in self.entries if flags & PE_PRESENT)


def parse_pagemap(data: bytes) -> Pagemap:
    import pycriu

    image = pycriu.images.load(io.BytesIO(data))
    head, *rest = image["entries"]
    entries = tuple((int(e["vaddr"]), int(e["nr_pages"]), int(e.get("flags", PE_PRESENT))) for e in rest)
    return Pagemap(int(head["pages_id"]), entries)


def encode_pagemap(pagemap: Pagemap) -> bytes:
    import pycriu

    out = io.BytesIO()
    pycriu.images.dump({"magic": "PAGEMAP", "entries": [
        {"pages_id": pagemap.pages_id},
        *({"vaddr": vaddr, "nr_pages": pages, "flags": flags} for vaddr, pages, flags in pagemap.entries),
    ]}, out)
    return out.getvalue()


def parse_ppids(pstree: bytes) -> dict[int, int]:
    """pid -> parent pid of every process of a dump (its pstree image; pids as the images name them)."""
    import pycriu

    return {int(e["pid"]): int(e["ppid"]) for e in pycriu.images.load(io.BytesIO(pstree))["entries"]}


@dataclass(frozen=True)
class Pages:
    """Where every page of one process of a complete checkpoint is: sorted addresses, their chunks."""

    vaddrs: np.ndarray  # uint64
    digests: np.ndarray  # DIGEST

    def at(self, vaddrs: np.ndarray) -> np.ndarray:
        """The digests of the pages at `vaddrs`; IncompleteBase names the first one not here."""
        where = np.searchsorted(self.vaddrs, vaddrs)
        inside = where < len(self.vaddrs)
        found = np.zeros(len(vaddrs), bool)
        found[inside] = self.vaddrs[where[inside]] == vaddrs[inside]
        if not found.all():
            missing = int(vaddrs[np.flatnonzero(~found)[0]])
            raise IncompleteBase(f"the base checkpoint has no page at {missing:#x}")
        return self.digests[where]


def _page_addresses(vaddr: int, pages: int) -> np.ndarray:
    return np.uint64(vaddr) + np.arange(pages, dtype=np.uint64) * np.uint64(PAGE_SIZE)


def process_pages(pagemap: Pagemap, digests: np.ndarray, parent: Pages | None) -> Pages:
    """The pages of one process of a complete checkpoint: its present entries' pages are its pages
    image's chunks in order (one page each), its PE_COW entries' pages its parent's."""
    if pagemap.holes:
        raise IncompleteBase("a base checkpoint must be complete: its pagemap has PE_PARENT holes")
    if len(digests) != pagemap.present:
        raise IncompleteBase(f"its pages image has {len(digests)} page chunks for {pagemap.present} pages")
    vaddrs, chunks, used = [], [], 0
    for vaddr, pages, flags in pagemap.entries:
        if flags & PE_PRESENT:
            vaddrs.append(_page_addresses(vaddr, pages))
            chunks.append(digests[used:used + pages])
            used += pages
        elif flags & PE_COW:
            if parent is None:
                raise IncompleteBase(f"pages at {vaddr:#x} are its parent's, and it has none in the dump")
            at = _page_addresses(vaddr, pages)
            vaddrs.append(at)
            chunks.append(parent.at(at))
    if not vaddrs:
        return Pages(np.empty(0, np.uint64), np.empty(0, DIGEST))
    flat = np.concatenate(vaddrs)
    order = np.argsort(flat, kind="stable")
    return Pages(flat[order], np.concatenate(chunks)[order])


def base_pages(pagemaps: Mapping[int, Pagemap], digests: Mapping[int, np.ndarray],
               ppids: Mapping[int, int]) -> dict[int, Pages]:
    """Every process's pages of a complete checkpoint, by pid (parents resolved before children)."""
    done: dict[int, Pages] = {}

    def resolve(pid: int, depth: int = 0) -> Pages:
        if pid not in done:
            if depth > len(pagemaps):
                raise IncompleteBase(f"the process tree of the base checkpoint loops at pid {pid}")
            ppid = ppids.get(pid, 0)
            parent = resolve(ppid, depth + 1) if ppid in pagemaps else None
            done[pid] = process_pages(pagemaps[pid], digests[pagemaps[pid].pages_id], parent)
        return done[pid]

    for pid in pagemaps:
        resolve(pid)
    return done


@dataclass(frozen=True)
class Composed:
    """A process's pagemap with its holes made present, and how to make its pages image: `segments`
    in order, each either (first page, count) of the dump's own pages image or an array of the
    base's chunk digests."""

    pagemap: Pagemap
    segments: tuple[tuple[int, int] | np.ndarray, ...]
    new_pages: int
    base_pages: int


def compose(pagemap: Pagemap, base: Pages | None) -> Composed:
    """Fill the holes of one process's incremental dump from the base checkpoint's pages."""
    entries: list[tuple[int, int, int]] = []
    segments: list[tuple[int, int] | list[np.ndarray]] = []
    new = taken = 0
    for vaddr, pages, flags in pagemap.entries:
        if flags & PE_PARENT:
            if base is None:
                raise IncompleteBase(f"pages at {vaddr:#x} are left to a base checkpoint this process "
                                     "is not in")
            found = base.at(_page_addresses(vaddr, pages))
            if segments and isinstance(segments[-1], list):
                segments[-1].append(found)
            else:
                segments.append([found])
            entries.append((vaddr, pages, PE_PRESENT))
            taken += pages
        else:
            if flags & PE_PRESENT:
                last = segments[-1] if segments else None
                if isinstance(last, tuple) and last[0] + last[1] == new:
                    segments[-1] = (last[0], last[1] + pages)
                else:
                    segments.append((new, pages))
                new += pages
            entries.append((vaddr, pages, flags))
    plan = tuple(np.concatenate(s) if isinstance(s, list) else s for s in segments)
    return Composed(Pagemap(pagemap.pages_id, tuple(entries)), plan, new, taken)
