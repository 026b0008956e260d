"""Pack indexes: where each chunk of a job lies in its packs, as sorted arrays.

A writer appends its new chunks to one pack file and, at commit, publishes the pack with its index
(`<name>.pack`, `<name>.idx`). An index (format 2) is::

    b"singularity-pack-index 2\\n"
    entries sorted by digest, 28 bytes each: digest (16), offset in the pack (u64 LE), length (u32 LE)

A job's `PackIndex` joins the indexes of all its packs into arrays sorted by digest, so a lookup of
a block of digests is one `searchsorted`. It costs about 60 bytes a chunk: the joined arrays (32),
and each pack's entries as read (28), kept so that a new pack is joined without reading the others
again. Format 1 indexes (a JSON object of hex digest -> [offset, length]) are still read.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from singularity_slurm.checkpoint.manifest import DIGEST, MAX_CHUNK_LENGTH

INDEX_MAGIC = b"singularity-pack-index 2\n"
ENTRY = np.dtype([("digest", DIGEST), ("offset", "<u8"), ("length", "<u4")])
_MAX_OFFSET = 1 << 62
_HASH = re.compile(r"[0-9a-f]{32}")


def encode_index(digests: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> bytes:
    """A pack's index file: its chunks' digests, offsets and lengths, sorted by digest."""
    entries = np.empty(len(digests), ENTRY)
    entries["digest"], entries["offset"], entries["length"] = digests, offsets, lengths
    entries = entries[np.argsort(entries["digest"], kind="stable")]
    return INDEX_MAGIC + entries.tobytes()


def read_pack_index(path: Path, pack_size: int | None) -> np.ndarray:
    """The entries of one pack index (ENTRY records); ValueError says what is wrong with it.

    Every entry must lie inside its pack (`pack_size` bytes, None when the pack is gone), so no
    length read from the store can make a reader allocate more than the pack holds.
    """
    data = path.read_bytes()
    if pack_size is None:
        raise ValueError(f"has no pack {path.with_suffix('.pack').name} beside it")
    if data.startswith(INDEX_MAGIC):
        body = memoryview(data)[len(INDEX_MAGIC):]
        if len(body) % ENTRY.itemsize:
            raise ValueError(f"holds {len(body)} bytes of entries, not a whole number of "
                             f"{ENTRY.itemsize}-byte entries; it was truncated")
        entries = np.frombuffer(body, ENTRY)
    else:
        entries = _json_entries(data)
    if len(entries):
        lengths, offsets = entries["length"].astype(np.uint64), entries["offset"]
        bad = np.flatnonzero((lengths < 1) | (lengths > MAX_CHUNK_LENGTH))
        if bad.size:
            at = entries[bad[0]]
            raise ValueError(f"gives chunk {at['digest'].tobytes().hex()} the length {int(at['length'])}, "
                             f"outside 1..{MAX_CHUNK_LENGTH}")
        bad = np.flatnonzero((offsets > _MAX_OFFSET) | (offsets + lengths > pack_size))
        if bad.size:
            at = entries[bad[0]]
            raise ValueError(f"puts chunk {at['digest'].tobytes().hex()} at bytes {int(at['offset'])}.."
                             f"{int(at['offset']) + int(at['length'])}, beyond the end of its pack "
                             f"({pack_size} bytes)")
    return entries


def _json_entries(data: bytes) -> np.ndarray:
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"is neither a format 2 index nor valid JSON ({exc!s:.200})") from exc
    if not isinstance(doc, dict):
        raise ValueError(f"holds a JSON {type(doc).__name__}, not an object of hash -> [offset, length]")
    entries = np.empty(len(doc), ENTRY)
    for i, (chunk_hash, entry) in enumerate(doc.items()):
        if not _HASH.fullmatch(chunk_hash) or not (isinstance(entry, list) and len(entry) == 2):
            raise ValueError(f"has the entry {chunk_hash!r}: {entry!r}, not 32 hex digits -> "
                             "[offset, length]")
        for value, what, low, high in ((entry[0], "offset", 0, _MAX_OFFSET),
                                       (entry[1], "length", 1, MAX_CHUNK_LENGTH)):
            if type(value) is not int or not low <= value <= high:
                raise ValueError(f"gives chunk {chunk_hash} the {what} {value!r}, not an integer in "
                                 f"{low}..{high}")
        entries[i] = (bytes.fromhex(chunk_hash), entry[0], entry[1])
    return entries


def stat_key(path: Path) -> tuple[int, int, int]:
    """What tells a published index from another file that took its name."""
    info = os.stat(path)
    return info.st_size, info.st_mtime_ns, info.st_ino


class PackIndex:
    """Every packed chunk of one job: digest -> (pack, offset, length), sorted by digest."""

    def __init__(self, sources: Sequence[tuple[Path, tuple[int, ...]]], parts: Sequence[np.ndarray]):
        self.sources = list(sources)  # (index file, its stat_key when read) of each pack number
        self.parts = list(parts)  # the entries of each pack's index, as read
        self.packs = [path.with_suffix(".pack") for path, _ in self.sources]
        sizes = [len(part) for part in parts]
        entries = np.concatenate(parts) if parts else np.empty(0, ENTRY)
        numbers = np.repeat(np.arange(len(parts), dtype=np.uint32), sizes)
        # A chunk in several packs keeps every copy, in pack order: a lookup by length finds the copy
        # whose length matches (a damaged index may give one copy a wrong length), and collection
        # knows which chunks another pack also holds.
        order = np.argsort(entries["digest"], kind="stable")
        self.digests = entries["digest"][order]
        self.pack = numbers[order]
        self.offset = entries["offset"][order]
        self.length = entries["length"][order]

    def __len__(self) -> int:
        return len(self.digests)

    def find(self, digests: np.ndarray, lengths: np.ndarray | None = None) -> np.ndarray:
        """The position in this index (int64) of each digest's first copy, or with `lengths` of its
        first copy of that length; -1 where the job has no such chunk."""
        if not len(self.digests):
            return np.full(len(digests), -1, np.int64)
        at = np.minimum(np.searchsorted(self.digests, digests), len(self.digests) - 1).astype(np.int64)
        hit = self.digests[at] == digests
        if lengths is not None:
            match = hit & (self.length[at] == lengths)
            for i in np.flatnonzero(hit & ~match).tolist():  # another copy may have the right length
                k = int(at[i]) + 1
                while k < len(self.digests) and self.digests[k] == digests[i]:
                    if self.length[k] == lengths[i]:
                        at[i], match[i] = k, True
                        break
                    k += 1
            hit = match
        return np.where(hit, at, -1)

    def get(self, digest: bytes) -> tuple[Path, int, int] | None:
        """Where one chunk is: (pack, offset, length), or None."""
        at = int(self.find(np.frombuffer(digest, DIGEST))[0])
        if at < 0:
            return None
        return self.packs[int(self.pack[at])], int(self.offset[at]), int(self.length[at])


class DigestSet:
    """Digests seen so far, in bounded memory: recent ones in a set, older ones in a few sorted
    arrays (16 bytes each) whose sizes at least double from one to the next, merged in batches, so
    that adding n digests costs O(n log n) and a lookup searches O(log n) arrays."""

    MERGE_AT = 1 << 16

    def __init__(self) -> None:
        self.levels: list[np.ndarray] = []
        self.recent: set[bytes] = set()

    def __len__(self) -> int:
        return sum(map(len, self.levels)) + len(self.recent)

    def contains(self, digests: np.ndarray) -> np.ndarray:
        """Which of `digests` are in the sorted arrays (the recent set is the caller's to ask)."""
        found = np.zeros(len(digests), bool)
        for level in self.levels:
            at = np.minimum(np.searchsorted(level, digests), len(level) - 1)
            found |= level[at] == digests
        return found

    def add(self, digest: bytes) -> None:
        self.recent.add(digest)

    def settle(self) -> None:
        """Move the recent digests into the arrays once there are enough of them."""
        if len(self.recent) < self.MERGE_AT:
            return
        fresh = np.sort(np.frombuffer(b"".join(self.recent), DIGEST))
        self.recent = set()
        while self.levels and len(self.levels[-1]) <= 2 * len(fresh):
            fresh = np.sort(np.concatenate([self.levels.pop(), fresh]), kind="stable")  # two sorted runs
        self.levels.append(fresh)
