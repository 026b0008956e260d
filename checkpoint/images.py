"""From CRIU image folders to the store and back; chunk boundaries from CRIU's page maps."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .store import CheckpointStore, Manifest

PAGE_SIZE = 4096
PE_PARENT, PE_PRESENT = 1, 4


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
           fault: Callable[[], None] | None = None) -> Manifest:
    """Store a CRIU image folder (and `extra` files: checkpoint path -> source) as one checkpoint.

    Nothing is visible until every file is stored and the manifest is committed. `fault` runs once
    the first file is stored (a test's fault point: the write is then half done).
    """
    boundaries = pages_boundaries(images_dir)
    with store.begin(job_id, reason=reason, meta=dict(meta)) as writer:
        for path in sorted(images_dir.rglob("*")):
            if path.is_file():
                rel = path.relative_to(images_dir).as_posix()
                writer.add_file(f"images/{rel}", path, boundaries=boundaries.get(path.name))
                if fault is not None:
                    fault()
                    fault = None
        for rel, path in (extra or {}).items():
            writer.add_file(rel, path)
        return writer.commit()


def download(store: CheckpointStore, manifest: Manifest, dest: Path) -> Path:
    """Write a checkpoint's images (every chunk verified) into dest; returns the image folder."""
    store.restore(manifest, dest)
    return dest / "images"


def image_files(manifest: Manifest) -> list[str]:
    return [f.path for f in manifest.files if re.match(r"images/", f.path)]
