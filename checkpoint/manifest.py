"""A committed checkpoint's manifest: which files it holds and the chunks each is made of.

A manifest's chunk lists are kept the way they are stored, as packed arrays: 16 bytes of xxh3-128
digest and 4 bytes of length per chunk. A page-chunked image of a 50 GiB process has 13 million
chunks; as Python objects they cost about 200 bytes each, as arrays 20.

On disk (format 2, `<seq:08d>.mf`)::

    b"singularity-manifest 2\\n"
    u32 little-endian: length of the header
    header: JSON object (job, sequence number, reason, meta, sizes, and each file's path, mode,
            size and chunk count)
    per file, in the header's order: its digests (16 bytes each), then its lengths (u32 LE each)
    xxh3-128 digest of everything before it (a truncated or overwritten manifest is refused)

Format 1 (`<seq:08d>.json`, one JSON document with hex digests) is still read.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from singularity_slurm.errors import CorruptCheckpoint, InvalidCheckpointRequest, NewerCheckpointFormat

FORMAT_VERSION = 2
MAX_CHUNK_LENGTH = 1 << 30
"""No chunk is longer (writers cut far smaller ones): a manifest or pack index saying otherwise is corrupt."""
DIGEST = np.dtype("V16")
"""A chunk's xxh3-128 digest, big-endian as xxhash's digest(); sorts as its bytes do."""
LENGTHS = np.dtype("<u4")

MAGIC = b"singularity-manifest "
_MAGIC_LINE = re.compile(rb"singularity-manifest ([0-9]{1,4})\n")
_JOB_ID = re.compile(r"[0-9]{1,20}")
_HASH = re.compile(r"[0-9a-f]{32}")
_HEX = re.compile(r"[0-9a-f]*")
_MANIFEST_KEYS = {"format", "job_id", "seq", "created_at", "reason", "meta", "files", "logical_bytes",
                  "new_bytes"}
_FILE_KEYS = {"path", "mode", "size", "chunks"}


def job_key(job_id: int | str) -> str:
    """The canonical name of a Slurm job id (it becomes a folder name, so nothing but digits passes)."""
    text = str(job_id) if isinstance(job_id, int | str) and not isinstance(job_id, bool) else ""
    if not _JOB_ID.fullmatch(text) or int(text) == 0:
        raise InvalidCheckpointRequest(
            f"job id {job_id!r} is not a Slurm job id; pass a positive int or a string of digits "
            "such as '4711'"
        )
    return str(int(text))


def check_relpath(relpath: str) -> str:
    """`relpath` if it is a safe relative POSIX path inside a checkpoint; refused otherwise."""
    why = None
    if not isinstance(relpath, str) or not relpath:
        why = "it is not a non-empty string"
    elif relpath.startswith("/"):
        why = "it is absolute"
    elif "\0" in relpath:
        why = "it contains a NUL byte"
    elif any(part in ("", ".", "..") for part in relpath.split("/")):
        why = "it has an empty, '.' or '..' component"
    if why:
        raise InvalidCheckpointRequest(
            f"file path {relpath!r} cannot go into a checkpoint: {why}; use a relative POSIX path such as "
            "'img/pages-1.img'"
        )
    return relpath


@dataclass(frozen=True)
class ChunkRef:
    hash: str  # xxh3-128 hex digest of the chunk's bytes
    length: int


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative POSIX path inside the checkpoint
    mode: int  # permission bits of the source (stat.S_IMODE)
    size: int
    digests: bytes = field(repr=False)  # 16 bytes per chunk, in file order
    lengths: bytes = field(repr=False)  # u32 little-endian per chunk

    @classmethod
    def of_chunks(cls, path: str, mode: int, size: int, chunks: Iterable[ChunkRef]) -> FileEntry:
        chunks = list(chunks)
        return cls(path, mode, size, bytes.fromhex("".join(c.hash for c in chunks)),
                   np.asarray([c.length for c in chunks], dtype=LENGTHS).tobytes())

    @property
    def count(self) -> int:
        return len(self.digests) // DIGEST.itemsize

    def digest_array(self) -> np.ndarray:
        return np.frombuffer(self.digests, DIGEST)

    def length_array(self) -> np.ndarray:
        return np.frombuffer(self.lengths, LENGTHS)

    @property
    def chunks(self) -> tuple[ChunkRef, ...]:
        """The chunks one by one (for reports and tests: a big image's list is large)."""
        hexes = self.digests.hex()
        return tuple(ChunkRef(hexes[32 * i:32 * i + 32], int(n)) for i, n in enumerate(self.length_array()))


@dataclass(frozen=True)
class Manifest:
    """One committed checkpoint: which files it holds and the chunks each is made of."""

    job_id: str
    seq: int
    created_at: float
    reason: str
    meta: dict[str, Any]
    files: tuple[FileEntry, ...]
    logical_bytes: int  # sum of the file sizes
    new_bytes: int  # bytes of the chunks this checkpoint stored that were not in the store before
    version: int = FORMAT_VERSION

    @property
    def dedup_ratio(self) -> float:
        """logical_bytes / new_bytes; inf when nothing new had to be stored (1.0 for an empty one)."""
        if self.new_bytes:
            return self.logical_bytes / self.new_bytes
        return math.inf if self.logical_bytes else 1.0

    def to_bytes(self) -> bytes:
        header = json.dumps({
            "format": FORMAT_VERSION, "job_id": self.job_id, "seq": self.seq, "created_at": self.created_at,
            "reason": self.reason, "meta": self.meta, "logical_bytes": self.logical_bytes,
            "new_bytes": self.new_bytes,
            "files": [{"path": f.path, "mode": f.mode, "size": f.size, "chunks": f.count}
                      for f in self.files],
        }).encode()
        parts = [MAGIC + b"%d\n" % FORMAT_VERSION, struct.pack("<I", len(header)), header]
        for entry in self.files:
            parts += [entry.digests, entry.lengths]
        body = b"".join(parts)
        return body + xxhash.xxh3_128_digest(body)

    @classmethod
    def from_bytes(cls, data: bytes, *, job_id: str | None = None, seq: int | None = None,
                   where: str = "") -> Manifest:
        """Parse and check a manifest of either format; `job_id`, `seq` and `where` (its file), when
        given, say where it was found, and it must agree."""

        def refuse(why: str) -> CorruptCheckpoint:
            return CorruptCheckpoint(job_id, seq, f"manifest {where} {why}" if where else f"manifest {why}",
                                     path=where or None)

        if data.startswith(MAGIC):
            manifest = _from_binary(data, refuse, job_id, seq, where)
        else:
            manifest = _from_json(data, refuse, job_id, seq, where)
        if job_id is not None and manifest.job_id != job_id:
            raise refuse(f"belongs to job {manifest.job_id}, not to job {job_id} whose folder holds it")
        if seq is not None and manifest.seq != seq:
            raise refuse(f"says it is checkpoint {manifest.seq}, but its file name says {seq}")
        return manifest


def _newer(version: int, job_id: str | None, seq: int | None, where: str) -> NewerCheckpointFormat:
    return NewerCheckpointFormat(
        job_id, seq, f"manifest {where} has format version {version}, and this singularity-slurm reads "
        f"versions 1 to {FORMAT_VERSION}; restore it with the version that wrote it", path=where or None)


def _from_binary(data: bytes, refuse, job_id: str | None, seq: int | None, where: str) -> Manifest:
    line = _MAGIC_LINE.match(data[:32])
    if line is None:
        raise refuse("has a damaged first line; it was truncated or overwritten")
    if int(line.group(1)) > FORMAT_VERSION:
        raise _newer(int(line.group(1)), job_id, seq, where)
    if int(line.group(1)) != FORMAT_VERSION:
        raise refuse(f"has format version {int(line.group(1))}, which no singularity-slurm wrote")
    if len(data) < line.end() + 4 + 16 or xxhash.xxh3_128_digest(data[:-16]) != data[-16:]:
        raise refuse("is damaged: its checksum does not match its content (truncated or overwritten)")
    at = line.end()
    (size,) = struct.unpack_from("<I", data, at)
    at += 4
    try:
        doc = json.loads(data[at:at + size])
        _object(doc, _MANIFEST_KEYS, "the manifest")
        if doc["format"] != FORMAT_VERSION:
            raise ValueError(f"its header says format {doc['format']!r} under a format 2 first line")
        at += size
        files = []
        for raw in _array(doc["files"], "files"):
            entry = _object(raw, _FILE_KEYS, "each file entry")
            path = check_relpath(entry["path"])
            count = _int(entry["chunks"], f"the chunk count of {path}")
            digests, at = data[at:at + 16 * count], at + 16 * count
            lengths, at = data[at:at + 4 * count], at + 4 * count
            if len(lengths) != 4 * count:
                raise ValueError(f"the chunk table of {path} is cut short")
            files.append(_file(path, entry["mode"], entry["size"], digests, lengths))
        if at != len(data) - 16:
            raise ValueError(f"{len(data) - 16 - at} bytes follow the last chunk table")
        return _manifest(doc, files)
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:  # JSON errors are ValueErrors
        raise refuse(f"is malformed: {exc!s:.200}") from exc


def _from_json(data: bytes, refuse, job_id: str | None, seq: int | None, where: str) -> Manifest:
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise refuse(f"is not valid JSON ({exc!s:.200}); it was truncated or overwritten") from exc
    if not isinstance(doc, dict):
        raise refuse(f"holds a JSON {type(doc).__name__}, not an object")
    if isinstance(doc.get("format"), int) and doc["format"] > FORMAT_VERSION:
        raise _newer(doc["format"], job_id, seq, where)
    if is_claim(doc):
        raise refuse(f"only claims its number for {doc['manifest']}, which is not there: its commit was "
                     "cut short")
    if doc.get("format") != 1:
        raise refuse(f"is JSON with format version {doc.get('format')!r}; JSON manifests are format 1")
    try:
        _object(doc, _MANIFEST_KEYS, "the manifest")
        files = []
        for raw in _array(doc["files"], "files"):
            entry = _object(raw, _FILE_KEYS, "each file entry")
            path = check_relpath(entry["path"])
            hashes, lengths = _pairs(_array(entry["chunks"], f"the chunks of {path}"), path)
            files.append(_file(path, entry["mode"], entry["size"], bytes.fromhex("".join(hashes)),
                               np.asarray(lengths, dtype=LENGTHS).tobytes()))
        return _manifest(doc, files, version=1)
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise refuse(f"is malformed: {exc!s:.200}") from exc


def is_claim(doc: Any) -> bool:
    """Whether a JSON document is the stub a format 2 commit claims its number with."""
    return isinstance(doc, dict) and set(doc) == {"format", "manifest"} and doc["format"] == FORMAT_VERSION


def _pairs(raw: list[Any], path: str) -> tuple[list[str], list[int]]:
    """A format 1 file's [hash, length] pairs, checked all at once (a pages image has one per page);
    where one is wrong, the check again pair by pair names it."""
    if all(type(c) is list and len(c) == 2 for c in raw):
        hashes, lengths = [c[0] for c in raw], [c[1] for c in raw]
        if (all(type(h) is str for h in hashes) and set(map(len, hashes)) <= {32}
                and _HEX.fullmatch("".join(hashes)) and all(type(n) is int for n in lengths)
                and (not lengths or (min(lengths) >= 1 and max(lengths) <= MAX_CHUNK_LENGTH))):
            return hashes, lengths
    for chunk in raw:
        if not (isinstance(chunk, list) and len(chunk) == 2 and isinstance(chunk[0], str)
                and _HASH.fullmatch(chunk[0])):
            raise ValueError(f"chunk {chunk!r} of {path} is not [32 hex digits, length]")
        _int(chunk[1], f"the length of chunk {chunk[0]}", low=1, high=MAX_CHUNK_LENGTH)
    raise AssertionError("the chunks passed one check and failed the other")  # pragma: no cover


def _file(path: str, mode: Any, size: Any, digests: bytes, lengths: bytes) -> FileEntry:
    size = _int(size, f"the size of {path}")
    sizes = np.frombuffer(lengths, LENGTHS)
    if sizes.size and (int(sizes.min()) < 1 or int(sizes.max()) > MAX_CHUNK_LENGTH):
        raise ValueError(f"a chunk of {path} has a length outside 1..{MAX_CHUNK_LENGTH}")
    total = int(sizes.sum(dtype=np.uint64))
    if total != size:
        raise ValueError(f"the chunks of {path} add up to {total} bytes, not to its size {size}")
    return FileEntry(path, _int(mode, f"the mode of {path}", high=0o7777), size, digests, lengths)


def _manifest(doc: dict[str, Any], files: list[FileEntry], version: int = FORMAT_VERSION) -> Manifest:
    if len({f.path for f in files}) != len(files):
        raise ValueError("a file path is listed twice")
    created_at, reason, meta = doc["created_at"], doc["reason"], doc["meta"]
    if isinstance(created_at, bool) or not isinstance(created_at, int | float):
        raise ValueError(f"created_at is {created_at!r}, not a number")
    if not isinstance(reason, str) or not isinstance(meta, dict) or not isinstance(doc["job_id"], str):
        raise ValueError("reason and job_id must be strings and meta an object")
    logical = _int(doc["logical_bytes"], "logical_bytes")
    if logical != sum(f.size for f in files) or job_key(doc["job_id"]) != doc["job_id"]:
        raise ValueError("logical_bytes is not the sum of the file sizes, or job_id is not canonical")
    return Manifest(job_id=doc["job_id"], seq=_int(doc["seq"], "seq", low=1), created_at=float(created_at),
                    reason=reason, meta=meta, files=tuple(files), logical_bytes=logical,
                    new_bytes=_int(doc["new_bytes"], "new_bytes", high=logical), version=version)


def _int(value: Any, what: str, low: int = 0, high: int | None = None) -> int:
    too_big = high is not None and isinstance(value, int) and value > high
    if isinstance(value, bool) or not isinstance(value, int) or value < low or too_big:
        raise ValueError(f"{what} is {value!r}, not an integer in {low}..{'' if high is None else high}")
    return value


def _object(doc: Any, keys: set[str], what: str) -> dict[str, Any]:
    if not isinstance(doc, dict) or set(doc) != keys:
        found = sorted(doc) if isinstance(doc, dict) else f"a {type(doc).__name__}"
        raise ValueError(f"{what} must be an object with exactly the keys {sorted(keys)}, found {found}")
    return doc


def _array(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{what} must be an array, found a {type(value).__name__}")
    return value
