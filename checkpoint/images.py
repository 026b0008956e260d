"""From CRIU image folders to the store and back; chunk boundaries from CRIU's page maps."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from singularity_slurm.errors import CheckpointError

from . import incremental, pagestream
from .manifest import DIGEST
from .store import CheckpointStore, CheckpointWriter, Manifest

PAGE_SIZE, PE_PARENT, PE_PRESENT, PE_COW = (incremental.PAGE_SIZE, incremental.PE_PARENT,
                                            incremental.PE_PRESENT, incremental.PE_COW)


def pages_boundaries(images_dir: Path) -> dict[str, list[int]]:
    """Offsets in each pages-N.img where a memory region's pages start.

    Pages images hold the dumped pages of each region back to back, in the order of the page map.
    Cutting chunks where regions start keeps a region that grew, shrank or appeared from shifting the
    chunks of every region after it, so unchanged memory deduplicates across checkpoints.
    """
    import pycriu

    boundaries: dict[str, list[int]] = {}
    for pagemap in sorted(images_dir.glob("pagemap-*.img")):
        with open(pagemap, "rb") as handle:
            entries = pycriu.images.load(handle)["entries"]
        if not entries or "pages_id" not in entries[0]:
            continue
        offsets, offset = [], 0
        for entry in entries[1:]:
            flags = entry.get("flags", PE_PRESENT)
            if not flags & PE_PRESENT or flags & PE_PARENT:
                continue
            if offset:
                offsets.append(offset)
            offset += entry["nr_pages"] * PAGE_SIZE
        boundaries[f"pages-{entries[0]['pages_id']}.img"] = offsets
    return boundaries


def upload(store: CheckpointStore, job_id: int, images_dir: Path, reason: str,
           meta: Mapping[str, Any], extra: Mapping[str, Path] | None = None,
           fault: Callable[[], None] | None = None, base: Manifest | None = None) -> Manifest:
    """Store a CRIU image folder (and `extra` files: checkpoint path -> source) as one checkpoint.

    Nothing is visible until every file is stored and the manifest is committed. `fault` runs once
    the first file is stored (a test's fault point: the write is then half done). An incremental
    dump's holes are filled from `base`, the checkpoint of the dump that armed its write tracker
    (see checkpoint.incremental): what is committed is complete without it.
    """
    with store.begin(job_id, reason=reason, meta=meta) as writer:
        add_images(writer, images_dir, base, fault=fault)
        for rel, path in (extra or {}).items():
            writer.add_file(rel, path)
        return writer.commit()


def add_images(writer: CheckpointWriter, images_dir: Path, base: Manifest | None,
               received: pagestream.Received | None = None, fault: Callable[[], None] | None = None) -> None:
    """Add a dump's images to a checkpoint being written: the folder's files, and where criu sent
    its pages to a page stream (`received`, their chunks stored already), its page maps and pages
    images from that. Holes of an incremental dump are filled from `base`; the checkpoint's meta
    then says how many pages each side gave."""
    if received is not None:
        pagemaps = dict(received.pagemaps)
        pages = {received.pages_of(name): received.digests[received.pages_of(name)] for name in pagemaps}
        composed = compose_received(writer.store, received, base, images_dir)
        for name, (pagemap, digests) in composed.items():
            pagemaps[name] = pagemap
            pages[received.pages_of(name)] = digests
        if composed:
            new = sum(int(received.digests[received.pages_of(n)].size) for n in composed)
            writer.meta["incremental"] = {"base": base.seq if base else None,
                                          "pages_taken": sum(len(d) for _, d in composed.values()) - new,
                                          "pages_dumped": new}
        for name, pagemap in sorted(pagemaps.items()):
            writer.add_bytes(f"images/{name}", incremental.encode_pagemap(pagemap), mode=0o600)
        for name, digests in sorted(pages.items()):
            writer.add_chunked(f"images/{name}", digests, chunk=PAGE_SIZE)
            if fault is not None:
                fault()
                fault = None
        for path in sorted(images_dir.rglob("*")):
            if path.is_file():
                writer.add_file(f"images/{path.relative_to(images_dir).as_posix()}", path)
        return
    boundaries = pages_boundaries(images_dir)
    composed_files = compose_dump(writer.store, images_dir, base)
    if composed_files:
        writer.meta["incremental"] = {"base": base.seq if base else None,
                                      "pages_taken": sum(c.base_pages for c in composed_files.values()),
                                      "pages_dumped": sum(c.new_pages for c in composed_files.values())}
    pages_of = {f"pages-{c.pagemap.pages_id}.img": c for c in composed_files.values()}
    for path in sorted(images_dir.rglob("*")):
        if path.is_file():
            rel = path.relative_to(images_dir).as_posix()
            if path.name in composed_files:
                pagemap = composed_files[path.name].pagemap
                writer.add_bytes(f"images/{rel}", incremental.encode_pagemap(pagemap),
                                 mode=path.stat().st_mode)
            elif path.name in pages_of:
                writer.add_composed(f"images/{rel}", path, pages_of[path.name].segments,
                                    chunk=PAGE_SIZE, mode=path.stat().st_mode)
            else:
                writer.add_file(f"images/{rel}", path, boundaries=boundaries.get(path.name))
            if fault is not None:
                fault()
                fault = None


def compose_received(store: CheckpointStore, received: pagestream.Received, base: Manifest | None,
                     images_dir: Path) -> dict[str, tuple[incremental.Pagemap, np.ndarray]]:
    """For each streamed page map with holes: the page map to store instead and its pages' digests
    in order, the holes' taken from `base`. CheckpointError where `base` cannot fill them."""
    holed = {name: pagemap for name, pagemap in received.pagemaps.items() if pagemap.holes}
    out = {}
    for name, composed in compose_holes(store, holed, base, images_dir).items():
        own = received.digests[received.pages_of(name)]
        parts = [own[s[0]:s[0] + s[1]] if isinstance(s, tuple) else s for s in composed.segments]
        out[name] = (composed.pagemap, np.concatenate(parts) if parts else np.empty(0, DIGEST))
    return out


def compose_dump(store: CheckpointStore, images_dir: Path, base: Manifest | None
                 ) -> dict[str, incremental.Composed]:
    """For each pagemap of the dump that has holes (by file name): the pagemap and pages image to
    store instead, filled from `base`. CheckpointError where `base` cannot fill them."""
    holed = {}
    for path in sorted(images_dir.glob("pagemap-*.img")):
        pagemap = incremental.parse_pagemap(path.read_bytes())
        if pagemap.holes:
            holed[path.name] = pagemap
    return compose_holes(store, holed, base, images_dir)


def compose_holes(store: CheckpointStore, holed: dict[str, incremental.Pagemap], base: Manifest | None,
                  images_dir: Path) -> dict[str, incremental.Composed]:
    """The page maps `holed` (by image name) with their holes filled from `base`; CheckpointError
    where `base` cannot fill them (or a page map that is not a process's has holes)."""
    if not holed:
        return {}
    try:
        if base is None:
            raise incremental.IncompleteBase("no base checkpoint was given")
        tables = base_tables(store, base)
        out = {}
        for name, pagemap in holed.items():
            if not re.fullmatch(r"pagemap-\d+\.img", name):
                raise incremental.IncompleteBase(f"{name} has holes, and only a process's may")
            out[name] = incremental.compose(pagemap, tables.get(_pid(name)))
        return out
    except incremental.IncompleteBase as exc:
        where = f"checkpoint {base.seq}" if base else "an earlier checkpoint"
        raise CheckpointError(f"the dump in {images_dir} leaves unwritten pages to {where}, which cannot "
                              f"supply them: {exc}; checkpoint again (the next dump is a full one)") from exc


def _pid(pagemap_name: str) -> int:
    return int(pagemap_name[len("pagemap-"):-len(".img")])


def base_tables(store: CheckpointStore, base: Manifest) -> dict[int, incremental.Pages]:
    """Where every page of every process of a stored checkpoint is (its pagemaps and chunk lists)."""
    pagemaps, digests = {}, {}
    for entry in base.files:
        name = entry.path.removeprefix("images/")
        if re.fullmatch(r"pagemap-\d+\.img", name):
            pagemaps[_pid(name)] = incremental.parse_pagemap(store.file_bytes(base, entry.path))
        elif match := re.fullmatch(r"pages-(\d+)\.img", name):
            if (entry.length_array() != PAGE_SIZE).any():
                raise incremental.IncompleteBase(f"its {name} is not stored a page a chunk")
            digests[int(match[1])] = entry.digest_array()
    ppids = incremental.parse_ppids(store.file_bytes(base, "images/pstree.img"))
    for pagemap in pagemaps.values():
        digests.setdefault(pagemap.pages_id, np.empty(0, DIGEST))
    return incremental.base_pages(pagemaps, digests, ppids)


def download(store: CheckpointStore, manifest: Manifest, dest: Path) -> Path:
    """Write a checkpoint's images (every chunk verified) into dest; returns the image folder."""
    store.restore(manifest, dest)
    return dest / "images"


def image_files(manifest: Manifest) -> list[str]:
    return [f.path for f in manifest.files if re.match(r"images/", f.path)]
