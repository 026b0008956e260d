"""The checkpoint store: content-addressed chunks and atomically committed manifests on a shared filesystem.

Layout under the root, per job::

    jobs/<job_id>/chunks/<2 hex>/<hash>      chunk bytes, named by the xxh3-128 hex digest of their content
    jobs/<job_id>/manifests/<seq:08d>.json   one manifest per committed checkpoint
    jobs/<job_id>/tmp/<writer>/              the in-progress writes of one writer

A checkpoint exists once its manifest is linked into manifests/; until then nothing a writer did is
visible to readers, so a failed dump (a full disk included) never replaces the last good checkpoint.
Chunks are shared by all checkpoints of a job, so a checkpoint stores only the chunks that changed.

Concurrency: one writer per job at a time is the expected use. Two writers cannot take the same sequence
number (it is claimed with an exclusive link). A writer's tmp folder marks it as active: while one is
there, garbage collection and other writers' `abort` leave chunks alone, and `commit` checks that every
chunk it references is still on disk, so a writer racing a prune fails with CheckpointConflict instead of
committing a checkpoint with holes. The window left (a writer that starts, deduplicates against a chunk
and commits while a prune deletes that very chunk) closes if the job's own writer runs `prune` after its
commit.
"""

from __future__ import annotations

import ctypes
import errno
import json
import math
import os
import re
import shutil
import socket
import stat
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import xxhash

from singularity_slurm.errors import (
    CheckpointConflict,
    CheckpointError,
    CorruptCheckpoint,
    InvalidCheckpointRequest,
    NewerCheckpointFormat,
    NoCheckpoint,
    StoreFull,
)

FORMAT_VERSION = 1
DEFAULT_MAX_CHUNK = 16 * 1024
MAX_CHUNK_LENGTH = 1 << 30
"""No chunk is longer (writers cut far smaller ones): a manifest or pack index saying otherwise is corrupt."""
READ_BLOCK = 1 << 20
"""Bytes of a file a writer reads at once; its chunks are slices of them."""
PACK_WRITE_BLOCK = 1 << 20
"""Bytes of new chunks a writer gathers before it writes them to its pack."""
DEFAULT_TMP_GRACE_S = 3600.0
"""Age after which a tmp entry counts as left behind by a dead writer (a live one writes far more often)."""

_JOB_ID = re.compile(r"[0-9]{1,20}")
_HASH = re.compile(r"[0-9a-f]{32}")
_HEX = re.compile(r"[0-9a-f]*")
_MANIFEST_NAME = re.compile(r"([0-9]{8,})\.json")
_FULL = {errno.ENOSPC, errno.EDQUOT}
_MANIFEST_KEYS = {"format", "job_id", "seq", "created_at", "reason", "meta", "files", "logical_bytes",
                  "new_bytes"}
_FILE_KEYS = {"path", "mode", "size", "chunks"}
FENCE = "fence.json"


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


def chunk_spans(size: int, boundaries: Sequence[int] | None = None,
                max_chunk: int = DEFAULT_MAX_CHUNK) -> list[tuple[int, int]]:
    """(offset, length) of every chunk of a `size`-byte file.

    A chunk starts at 0, at every boundary, and every `max_chunk` bytes after each of them. With the
    offsets where memory regions start as boundaries, a region inserted into a pages image changes the
    chunks of that region only, instead of shifting every chunk after it.
    """
    previous = 0
    for offset in boundaries or ():
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= size:
            raise InvalidCheckpointRequest(f"chunk boundary {offset!r} is outside the file (0..{size})")
        if offset < previous:
            raise InvalidCheckpointRequest(f"chunk boundaries must be sorted; {offset} follows {previous}")
        previous = offset
    # Repeats are harmless (an empty memory region starts where the next one does): one cut each.
    cuts = [0, *sorted({offset for offset in boundaries or () if 0 < offset < size}), size]
    spans = []
    for start, end in zip(cuts, cuts[1:], strict=False):
        spans.extend((offset, min(max_chunk, end - offset)) for offset in range(start, end, max_chunk))
    return spans


@dataclass(frozen=True)
class ChunkRef:
    hash: str  # xxh3-128 hex digest of the chunk's bytes
    length: int


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative POSIX path inside the checkpoint
    mode: int  # permission bits of the source (stat.S_IMODE)
    size: int
    chunks: tuple[ChunkRef, ...]


class Skipped(NamedTuple):
    """A manifest or pack index that could not be read and was left alone (`what` names its file)."""

    what: str
    reason: str


class Refusal(NamedTuple):
    """A checkpoint `latest_valid` passed over, and why (CorruptCheckpoint.detail)."""

    seq: int
    reason: str


@dataclass(frozen=True)
class PruneResult:
    manifests_deleted: tuple[int, ...]  # sequence numbers
    chunks_deleted: int
    chunk_bytes_deleted: int
    tmp_entries_deleted: int  # files or whole writer folders left behind by dead writers
    tmp_bytes_deleted: int
    chunk_gc_deferred: bool = False  # a writer was active, so unreferenced chunks wait for the next prune
    skipped: tuple[Skipped, ...] = ()  # unreadable manifests and pack indexes left alone, and why


@dataclass(frozen=True)
class Fence:
    """Where the job's latest incarnation began: its restart count, and the newest checkpoint then.

    A checkpoint taken by an older incarnation and committed after that (a node agent that went on
    after the job had been restarted elsewhere) is not the job's: `excludes` says so.
    """

    restart: int
    seq: int

    def excludes(self, manifest: Manifest) -> bool:
        taken = manifest.meta.get("restart")
        return (isinstance(taken, int) and not isinstance(taken, bool) and taken < self.restart
                and manifest.seq > self.seq)


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

    def to_json(self) -> str:
        files = [
            {"path": f.path, "mode": f.mode, "size": f.size, "chunks": [[c.hash, c.length] for c in f.chunks]}
            for f in self.files
        ]
        return json.dumps({
            "format": self.version, "job_id": self.job_id, "seq": self.seq, "created_at": self.created_at,
            "reason": self.reason, "meta": self.meta, "logical_bytes": self.logical_bytes,
            "new_bytes": self.new_bytes, "files": files,
        }) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, job_id: str | None = None, seq: int | None = None,
                  where: str = "") -> Manifest:
        """Parse and check a manifest; `job_id`, `seq` and `where` (its file), when given, say where it was
        found, and it must agree."""

        def refuse(why: str) -> CorruptCheckpoint:
            return CorruptCheckpoint(job_id, seq, f"manifest {where} {why}" if where else f"manifest {why}",
                                     path=where or None)

        try:
            doc = json.loads(text)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both are ValueErrors
            raise refuse(f"is not valid JSON ({exc}); it was truncated or overwritten") from exc
        if not isinstance(doc, dict):
            raise refuse(f"holds a JSON {type(doc).__name__}, not an object")
        if isinstance(doc.get("format"), int) and doc["format"] > FORMAT_VERSION:
            raise NewerCheckpointFormat(
                job_id, seq, f"manifest {where} has format version {doc['format']}, and this "
                f"singularity-slurm reads version {FORMAT_VERSION} only; restore it with the version that "
                "wrote it", path=where or None)
        if doc.get("format") != FORMAT_VERSION:
            raise refuse(f"has format version {doc.get('format')!r}, and this singularity-slurm reads "
                         f"version {FORMAT_VERSION} only; restore it with the version that wrote it")
        try:
            manifest = _manifest_from_doc(doc)
        except (TypeError, ValueError) as exc:
            raise refuse(f"is malformed: {exc}") from exc
        if job_id is not None and manifest.job_id != job_id:
            raise refuse(f"belongs to job {manifest.job_id}, not to job {job_id} whose folder holds it")
        if seq is not None and manifest.seq != seq:
            raise refuse(f"says it is checkpoint {manifest.seq}, but its file name says {seq}")
        return manifest


def _int(value: Any, what: str, low: int = 0, high: int | None = None) -> int:
    too_big = high is not None and isinstance(value, int) and value > high
    if isinstance(value, bool) or not isinstance(value, int) or value < low or too_big:
        raise ValueError(f"{what} is {value!r}, not an integer in {low}..{'' if high is None else high}")
    return value


def read_pack_index(path: Path, pack_size: int | None) -> dict[str, tuple[int, int]]:
    """hash -> (offset, length) of one pack index; ValueError says what is wrong with it.

    Every entry must lie inside its pack (`pack_size` bytes, None when the pack is gone), so no
    length read from the store can make a reader allocate more than the pack holds.
    """
    try:
        doc = json.loads(path.read_bytes())
    except ValueError as exc:
        raise ValueError(f"is not valid JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise ValueError(f"holds a JSON {type(doc).__name__}, not an object of hash -> [offset, length]")
    if pack_size is None:
        raise ValueError(f"has no pack {path.with_suffix('.pack').name} beside it")
    entries = {}
    for chunk_hash, entry in doc.items():
        if not _HASH.fullmatch(chunk_hash) or not (isinstance(entry, list) and len(entry) == 2):
            raise ValueError(f"has the entry {chunk_hash!r}: {entry!r}, not 32 hex digits -> "
                             "[offset, length]")
        offset = _int(entry[0], f"the offset of chunk {chunk_hash}")
        length = _int(entry[1], f"the length of chunk {chunk_hash}", low=1, high=MAX_CHUNK_LENGTH)
        if offset + length > pack_size:
            raise ValueError(f"puts chunk {chunk_hash} at bytes {offset}..{offset + length}, beyond the "
                             f"end of its pack ({pack_size} bytes)")
        entries[chunk_hash] = (offset, length)
    return entries


def _stale(manifest: Manifest, fence: Fence) -> str:
    return (f"it was committed by a node agent of restart {manifest.meta.get('restart')} after restart "
            f"{fence.restart} of the job had begun (a stale agent's); it is not restored")


def _object(doc: Any, keys: set[str], what: str) -> dict[str, Any]:
    if not isinstance(doc, dict) or set(doc) != keys:
        found = sorted(doc) if isinstance(doc, dict) else f"a {type(doc).__name__}"
        raise ValueError(f"{what} must be an object with exactly the keys {sorted(keys)}, found {found}")
    return doc


def _array(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{what} must be an array, found a {type(value).__name__}")
    return value


def _file_from_doc(raw: Any) -> FileEntry:
    entry = _object(raw, _FILE_KEYS, "each file entry")
    path = check_relpath(entry["path"])
    size = _int(entry["size"], f"the size of {path}")
    chunks = _chunks_from_doc(_array(entry["chunks"], f"the chunks of {path}"), path)
    if sum(c.length for c in chunks) != size:
        raise ValueError(f"the chunks of {path} add up to {sum(c.length for c in chunks)} bytes, "
                         f"not to its size {size}")
    return FileEntry(path, _int(entry["mode"], f"the mode of {path}", high=0o7777), size, chunks)


def _chunks_from_doc(raw: list[Any], path: str) -> tuple[ChunkRef, ...]:
    """A file's [hash, length] pairs, checked all at once (a pages image has one per page); where
    one is wrong, the check again pair by pair names it."""
    if all(type(c) is list and len(c) == 2 for c in raw):
        hashes, lengths = [c[0] for c in raw], [c[1] for c in raw]
        if (all(type(h) is str for h in hashes) and set(map(len, hashes)) <= {32}
                and _HEX.fullmatch("".join(hashes)) and all(type(n) is int for n in lengths)
                and (not lengths or (min(lengths) >= 1 and max(lengths) <= MAX_CHUNK_LENGTH))):
            return tuple(map(ChunkRef, hashes, lengths))
    for chunk in raw:
        if not (isinstance(chunk, list) and len(chunk) == 2 and isinstance(chunk[0], str)
                and _HASH.fullmatch(chunk[0])):
            raise ValueError(f"chunk {chunk!r} of {path} is not [32 hex digits, length]")
        _int(chunk[1], f"the length of chunk {chunk[0]}", low=1, high=MAX_CHUNK_LENGTH)
    raise AssertionError("the chunks passed one check and failed the other")  # pragma: no cover


def _manifest_from_doc(doc: dict[str, Any]) -> Manifest:
    _object(doc, _MANIFEST_KEYS, "the manifest")
    files = [_file_from_doc(raw) for raw in _array(doc["files"], "files")]
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
                    new_bytes=_int(doc["new_bytes"], "new_bytes", high=logical))


@contextmanager
def _store_io(root: Path, doing: str) -> Iterator[None]:
    """Turn OS errors while writing the store into our errors, a full disk into StoreFull."""
    try:
        yield
    except OSError as exc:
        if exc.errno in _FULL:
            raise StoreFull(
                f"the checkpoint store {root} is full ({os.strerror(exc.errno)}) while trying to {doing}; "
                "prune old checkpoints or free space on that filesystem, then checkpoint again"
            ) from exc
        raise CheckpointError(
            f"cannot {doing} in the checkpoint store {root}: {exc}; check that it is mounted and writable"
        ) from exc


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "xb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


def _write(path: Path, data: bytes) -> None:
    # Chunks are made durable together by one syncfs before the manifest is committed: a fsync per
    # chunk would cost one disk flush per 16 KiB.
    with open(path, "xb") as out:
        out.write(data)


_libc = None


def _syncfs(path: Path) -> None:
    """Flush everything written to the filesystem holding `path` (syncfs(2); sync(2) as a fallback)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _libc.syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    # A rename or link is durable only once the folder that holds the new name is synced.
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tree_bytes(path: Path) -> int:
    """Bytes of the files under `path`, which may be a single file."""
    if not path.is_dir():
        return path.lstat().st_size
    return sum((Path(top) / name).lstat().st_size for top, _, names in os.walk(path) for name in names)


def _size(path: Path) -> int | None:
    """The size of a file, None if there is none."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def _chunk_files(chunks_dir: Path) -> dict[str, Path]:
    """hash -> path of every chunk file under a job's chunks/ folder."""
    if not chunks_dir.is_dir():
        return {}
    return {path.name: path for sub in chunks_dir.iterdir() if sub.is_dir() for path in sub.iterdir()}


def _offsets(entry: FileEntry) -> Iterator[tuple[int, int, ChunkRef]]:
    """(index, offset in the file, chunk) for each chunk of a file."""
    offset = 0
    for index, ref in enumerate(entry.chunks):
        yield index, offset, ref
        offset += ref.length


class CheckpointStore:
    """All checkpoints of all jobs under one root folder (a shared filesystem)."""

    def __init__(self, root: str | os.PathLike[str], *, clock: Callable[[], float] = time.time,
                 max_chunk: int = DEFAULT_MAX_CHUNK, pack_chunks: bool = False):
        valid = isinstance(max_chunk, int) and not isinstance(max_chunk, bool)
        if not valid or not 0 < max_chunk <= MAX_CHUNK_LENGTH:
            raise InvalidCheckpointRequest(f"max_chunk {max_chunk!r} must be a number of bytes in "
                                           f"1..{MAX_CHUNK_LENGTH}")
        self.root = Path(root)
        self.clock = clock  # created_at, and the age of tmp entries (so: wall-clock seconds)
        self.max_chunk = max_chunk
        self._open_packs: dict[Path, int] = {}  # fds of packs read by the current verify or restore
        self._damaged: dict[Path, dict[str, str]] = {}  # packs folder -> index name -> why it was skipped
        # index file -> ((its size, mtime, inode, its pack's size), entries): a published pack and its
        # index never change, so an index is parsed again only when another file took its name
        self._parsed: dict[Path, tuple[tuple[int, int, int, int | None], dict[str, tuple[int, int]]]] = {}
        # Pack mode: a writer appends its new chunks to one pack file (with a JSON index) instead of
        # one file per chunk, so page-sized chunks cost no more than big ones. Readers handle both.
        self.pack_chunks = pack_chunks

    # --- layout ------------------------------------------------------------------------------------

    def job_dir(self, job_id: int | str) -> Path:
        return self.root / "jobs" / job_key(job_id)

    def chunk_path(self, job_id: int | str, chunk_hash: str) -> Path:
        return self.job_dir(job_id) / "chunks" / chunk_hash[:2] / chunk_hash

    def packs_dir(self, job_id: int | str) -> Path:
        return self.job_dir(job_id) / "packs"

    def pack_index(self, job_id: int | str) -> dict[str, tuple[Path, int, int]]:
        """hash -> (pack file, offset, length) of every packed chunk of the job.

        A damaged index is skipped (its chunks read as missing, so the checkpoints that need them are
        refused, and the refusal names it); `damaged_indexes` says which and why.
        """
        index: dict[str, tuple[Path, int, int]] = {}
        folder = self.packs_dir(job_id)
        damaged = self._damaged.setdefault(folder, {})
        damaged.clear()
        try:
            names = sorted(os.listdir(folder))
        except FileNotFoundError:
            return index
        present = set()
        for name in names:
            if not name.endswith(".idx"):
                continue
            pack, path = folder / (name[:-4] + ".pack"), folder / name
            present.add(path)
            try:
                info = os.stat(path)
                key = (info.st_size, info.st_mtime_ns, info.st_ino, _size(pack))
                cached = self._parsed.get(path)
                if cached is not None and cached[0] == key:
                    entries = cached[1]
                else:
                    entries = read_pack_index(path, key[3])
                    self._parsed[path] = (key, entries)
            except OSError as exc:
                damaged[name] = f"cannot be read ({exc})"
                continue
            except ValueError as exc:
                damaged[name] = str(exc)
                continue
            for chunk_hash, (offset, length) in entries.items():
                index.setdefault(chunk_hash, (pack, offset, length))
        for gone in [path for path in self._parsed if path.parent == folder and path not in present]:
            del self._parsed[gone]
        return index

    def damaged_indexes(self, job_id: int | str) -> list[Skipped]:
        """The pack indexes the last `pack_index` of the job skipped, and why."""
        folder = self.packs_dir(job_id)
        damaged = sorted(self._damaged.get(folder, {}).items())
        return [Skipped(f"pack index {folder / name}", why) for name, why in damaged]

    def _missing_hint(self, job_id: int | str) -> str:
        damaged = self.damaged_indexes(job_id)
        if not damaged:
            return ""
        return " (" + "; ".join(f"{d.what} was skipped: it {d.reason}" for d in damaged) + ")"

    def locate(self, job_id: int | str, chunk_hash: str) -> tuple[Path, int, int] | None:
        """Where a chunk's bytes are: (file, offset, length), or None when the store lacks it."""
        loose = self.chunk_path(job_id, chunk_hash)
        size = _size(loose)
        if size is not None:
            return loose, 0, size
        return self.pack_index(job_id).get(chunk_hash)

    def manifest_path(self, job_id: int | str, seq: int) -> Path:
        return self.job_dir(job_id) / "manifests" / f"{seq:08d}.json"

    def read_fence(self, job_id: int | str) -> Fence | None:
        """The job's fence (see Fence), or None: none yet, or a damaged one (nothing is fenced out)."""
        try:
            doc = json.loads((self.job_dir(job_id) / FENCE).read_bytes())
            return Fence(_int(doc["restart"], "restart"), _int(doc["seq"], "seq"))
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def raise_fence(self, job_id: int | str, restart: int) -> Fence:
        """Record that incarnation `restart` of the job begins now (never lowers the fence)."""
        current = self.read_fence(job_id)
        if current is not None and current.restart >= restart:
            return current
        seqs = self.seqs(job_id)
        fence = Fence(restart, seqs[-1] if seqs else 0)
        folder = self.job_dir(job_id)
        with _store_io(self.root, f"record the start of restart {restart} of job {folder.name}"):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = folder / f".{FENCE}.{uuid.uuid4().hex[:8]}"
            _write_durably(tmp, json.dumps({"restart": fence.restart, "seq": fence.seq}).encode())
            os.replace(tmp, folder / FENCE)
            _fsync_dir(folder)
        return fence

    def jobs(self) -> list[str]:
        """Job ids with a folder in the store (with or without checkpoints)."""
        try:
            names = os.listdir(self.root / "jobs")
        except FileNotFoundError:
            return []
        return sorted((name for name in names if _JOB_ID.fullmatch(name)), key=int)

    # --- writing -----------------------------------------------------------------------------------

    def begin(self, job_id: int | str, *, reason: str,
              meta: Mapping[str, Any] | None = None) -> CheckpointWriter:
        """Start writing a checkpoint; see CheckpointWriter."""
        return CheckpointWriter(self, job_key(job_id), reason=reason, meta=meta)

    # --- reading -----------------------------------------------------------------------------------

    def seqs(self, job_id: int | str) -> list[int]:
        """Sequence numbers of the committed checkpoints, oldest first (manifests are not read)."""
        try:
            names = os.listdir(self.job_dir(job_id) / "manifests")
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for name in names if (m := _MANIFEST_NAME.fullmatch(name)))

    def read(self, job_id: int | str, seq: int) -> Manifest:
        """The manifest of checkpoint `seq`; CorruptCheckpoint if it is unreadable."""
        job, path = job_key(job_id), self.manifest_path(job_id, seq)
        try:
            text = path.read_bytes()
        except FileNotFoundError:
            raise NoCheckpoint(f"job {job} has no checkpoint {seq} in {self.root}") from None
        except OSError as exc:
            raise CheckpointError(f"cannot read {path}: {exc}; check that the store is mounted") from exc
        return Manifest.from_json(text, job_id=job, seq=seq, where=str(path))

    def list(self, job_id: int | str) -> list[Manifest]:
        """Committed checkpoints whose manifests are readable, oldest first (`checked` names the rest)."""
        return self.checked(job_id)[0]

    def latest(self, job_id: int | str) -> Manifest:
        """The newest committed checkpoint, unverified; `latest_valid` is the one to restore."""
        seqs = self.seqs(job_id)
        if not seqs:
            raise NoCheckpoint(f"job {job_key(job_id)} has no committed checkpoint in {self.root}; "
                               "start it from the beginning")
        return self.read(job_id, seqs[-1])

    def _chunk_data(self, manifest: Manifest, entry: FileEntry, index: int, offset: int,
                    ref: ChunkRef, packs: dict[str, tuple[Path, int, int]] | None = None) -> bytes:
        """The verified bytes of one chunk of a file of a checkpoint (loose, or in a pack)."""
        path = self.chunk_path(manifest.job_id, ref.hash)
        if packs and ref.hash in packs and _size(path) is None:
            return self._packed_chunk(manifest, entry, index, offset, ref, packs[ref.hash])

        def refuse(problem: str) -> CorruptCheckpoint:
            where = f"chunk {index} ({ref.hash}, bytes {offset}..{offset + ref.length}) of {entry.path}"
            return CorruptCheckpoint(manifest.job_id, manifest.seq, f"{where} {problem}", path=entry.path,
                                     chunk=ref.hash)

        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise refuse(f"is missing from {path.parent}{self._missing_hint(manifest.job_id)}") from None
        except OSError as exc:
            # Not CorruptCheckpoint: a transient error (a stale NFS handle) must not make latest_valid
            # fall back to an older checkpoint and throw away the job's progress.
            raise CheckpointError(f"cannot read chunk {path}: {exc}; check the store and retry") from exc
        if len(data) != ref.length:
            raise refuse(f"is corrupt: it has {len(data)} bytes instead of {ref.length}")
        if xxhash.xxh3_128_hexdigest(data) != ref.hash:
            raise refuse("is corrupt: its content no longer matches its hash")
        return data

    def _packed_chunk(self, manifest: Manifest, entry: FileEntry, index: int, offset: int, ref: ChunkRef,
                      where: tuple[Path, int, int]) -> bytes:
        pack, at, length = where
        problem = None
        try:
            data = os.pread(self._pack_fd(pack), length, at)
        except FileNotFoundError:
            data, problem = b"", f"is missing: its pack {pack} is gone"
        except OSError as exc:
            raise CheckpointError(f"cannot read pack {pack}: {exc}; check the store and retry") from exc
        if problem is None and (len(data) != ref.length or length != ref.length):
            problem = f"is corrupt: it has {len(data)} bytes in {pack.name} instead of {ref.length}"
        if problem is None and xxhash.xxh3_128_hexdigest(data) != ref.hash:
            problem = f"is corrupt: its content in {pack.name} no longer matches its hash"
        if problem:
            where_text = f"chunk {index} ({ref.hash}, bytes {offset}..{offset + ref.length}) of {entry.path}"
            raise CorruptCheckpoint(manifest.job_id, manifest.seq, f"{where_text} {problem}",
                                    path=entry.path, chunk=ref.hash)
        return data

    def verify(self, manifest: Manifest) -> None:
        """Read every chunk and check its length and hash; CorruptCheckpoint names the first bad one."""
        checked: set[str] = set()
        packs = self.pack_index(manifest.job_id)
        try:
            for entry in manifest.files:
                for index, offset, ref in _offsets(entry):
                    if ref.hash not in checked:
                        self._chunk_data(manifest, entry, index, offset, ref, packs)
                        checked.add(ref.hash)
        finally:
            self._close_packs()

    def _file_data(self, manifest: Manifest, entry: FileEntry,
                   packs: dict[str, tuple[Path, int, int]]) -> Iterator[bytes]:
        """A file's verified bytes, in pieces. Chunks that lie back to back in one pack (as a
        checkpoint's new pages do) are read with one pread and checked slice by slice."""
        chunks = list(_offsets(entry))
        i = 0
        while i < len(chunks):
            index, offset, ref = chunks[i]
            where = packs.get(ref.hash)
            if where is None:
                yield self._chunk_data(manifest, entry, index, offset, ref, packs)
                i += 1
                continue
            pack, start, _ = where
            j, end = i + 1, start + ref.length
            while j < len(chunks) and packs.get(chunks[j][2].hash, (None, -1, 0))[:2] == (pack, end):
                end += chunks[j][2].length
                j += 1
            try:
                data = os.pread(self._pack_fd(pack), end - start, start)
            except OSError:
                data = b""
            view, at = memoryview(data), 0
            intact = len(data) == end - start
            for k in range(i, j if intact else i):
                length = chunks[k][2].length
                if xxhash.xxh3_128_hexdigest(view[at:at + length]) != chunks[k][2].hash:
                    intact = False
                    break
                at += length
            if not intact:
                # Let the one-chunk path find and name the bad chunk.
                for k in range(i, j):
                    yield self._chunk_data(manifest, entry, *chunks[k], packs)
            else:
                yield data
            i = j

    def _pack_fd(self, pack: Path) -> int:
        """An fd of `pack`, kept open until the current verify or restore ends."""
        fd = self._open_packs.get(pack)
        if fd is None:
            fd = self._open_packs[pack] = os.open(pack, os.O_RDONLY | os.O_CLOEXEC)
        return fd

    def _close_packs(self) -> None:
        for fd in self._open_packs.values():
            os.close(fd)
        self._open_packs.clear()

    def restore(self, manifest: Manifest, dest_dir: str | os.PathLike[str]) -> list[Path]:
        """Write every file of the checkpoint under `dest_dir` (an empty folder), verifying as it goes.

        Each file appears under its name only when complete. On any bad chunk, CorruptCheckpoint, and the
        files this call already wrote are removed again.
        """
        dest = Path(dest_dir)
        written: list[Path] = []
        packs = self.pack_index(manifest.job_id)
        try:
            for entry in manifest.files:
                target = dest / entry.path
                target.parent.mkdir(parents=True, exist_ok=True)
                if not target.parent.resolve().is_relative_to(dest.resolve()):
                    raise CheckpointError(f"{target.parent} leads out of {dest} through a symlink; "
                                          "restore into an empty folder")
                tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.restoring")
                try:
                    with open(tmp, "xb") as out:
                        for data in self._file_data(manifest, entry, packs):
                            out.write(data)
                        # Permission bits only: a checkpoint must not be a way to create setuid files.
                        os.fchmod(out.fileno(), entry.mode & 0o777)
                    os.replace(tmp, target)
                finally:
                    tmp.unlink(missing_ok=True)
                written.append(target)
            self._close_packs()
        except BaseException as exc:
            self._close_packs()
            for path in written:
                path.unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise CheckpointError(f"cannot restore checkpoint {manifest.seq} of job {manifest.job_id} "
                                      f"into {dest}: {exc}") from exc
            raise
        return written

    def latest_valid(self, job_id: int | str,
                     where: Callable[[Manifest], bool] | None = None) -> tuple[Manifest, list[Refusal]]:
        """The newest checkpoint that verifies, and the newer ones refused on the way (newest first).

        `where` skips checkpoints it rejects (those of another run of the job) without refusing them.
        """
        refused: list[Refusal] = []
        fence = self.read_fence(job_id)
        for seq in reversed(self.seqs(job_id)):
            try:
                manifest = self.read(job_id, seq)
                if where is not None and not where(manifest):
                    continue
                if fence is not None and fence.excludes(manifest):
                    refused.append(Refusal(seq, _stale(manifest, fence)))
                    continue
                self.verify(manifest)
            except NoCheckpoint:  # pruned since we listed the folder
                continue
            except CorruptCheckpoint as exc:
                refused.append(Refusal(seq, exc.detail))
                continue
            return manifest, refused
        why = "; ".join(f"checkpoint {r.seq}: {r.reason}" for r in refused) or "none was committed"
        raise NoCheckpoint(f"job {job_key(job_id)} has no checkpoint that verifies in {self.root} ({why}); "
                           "start it from the beginning")

    # --- retention ---------------------------------------------------------------------------------

    def prune(self, job_id: int | str, keep: int, *, tmp_grace_s: float = DEFAULT_TMP_GRACE_S) -> PruneResult:
        """Delete all but the newest `keep` readable checkpoints, then the chunks none of the rest uses.

        An unreadable manifest is skipped (named in the result): it neither counts as kept nor is
        deleted, and its chunks are not protected, since no version can restore it. One written by a
        newer version defers the chunk collection instead, as its chunks are unknown here.
        """
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise InvalidCheckpointRequest(f"keep={keep!r}: prune must keep at least 1 checkpoint; "
                                           "use delete_job to remove them all")
        readable = [m.seq for m in self.list(job_id)]
        return self.drop(job_id, readable[:-keep], tmp_grace_s=tmp_grace_s)

    def drop(self, job_id: int | str, seqs: Sequence[int], *,
             tmp_grace_s: float = DEFAULT_TMP_GRACE_S) -> PruneResult:
        """Delete the checkpoints `seqs`, then the chunks no remaining checkpoint references."""
        doomed = tuple(sorted(set(seqs)))
        with _store_io(self.root, f"prune checkpoints of job {job_key(job_id)}"):
            for seq in doomed:
                self.manifest_path(job_id, seq).unlink(missing_ok=True)
            if doomed:
                _fsync_dir(self.job_dir(job_id) / "manifests")
            return self._collect(job_id, doomed, tmp_grace_s)

    def collect_garbage(self, job_id: int | str, *, tmp_grace_s: float = DEFAULT_TMP_GRACE_S) -> PruneResult:
        """Delete unreferenced chunks and dead writers' tmp entries, keeping every checkpoint."""
        with _store_io(self.root, f"collect garbage of job {job_key(job_id)}"):
            return self._collect(job_id, (), tmp_grace_s)

    def checked(self, job_id: int | str) -> tuple[list[Manifest], list[Skipped], bool]:
        """Readable checkpoints (oldest first), the unreadable manifests skipped, and whether one of
        those is of a newer format (whose chunks are unknown here)."""
        manifests: list[Manifest] = []
        skipped: list[Skipped] = []
        newer = False
        fence = self.read_fence(job_id)
        for seq in self.seqs(job_id):
            try:
                manifest = self.read(job_id, seq)
            except NoCheckpoint:  # pruned since we listed the folder
                continue
            except CorruptCheckpoint as exc:
                skipped.append(Skipped(f"checkpoint {seq} ({self.manifest_path(job_id, seq)})", exc.detail))
                newer = newer or isinstance(exc, NewerCheckpointFormat)
                continue
            if fence is not None and fence.excludes(manifest):
                skipped.append(Skipped(f"checkpoint {seq}", _stale(manifest, fence)))
                continue
            manifests.append(manifest)
        return manifests, skipped, newer

    def _referenced(self, job_id: int | str) -> tuple[set[str], list[Skipped], bool]:
        """Chunks the readable checkpoints use, the manifests skipped, and whether GC must wait."""
        manifests, skipped, newer = self.checked(job_id)
        return {ref.hash for m in manifests for entry in m.files for ref in entry.chunks}, skipped, newer

    def _active_writers(self, job_id: int | str, grace_s: float) -> list[Path]:
        """Writer folders in tmp/ young enough to belong to a live writer."""
        return [entry for entry, age in self._tmp_entries(job_id) if entry.is_dir() and age < grace_s]

    def _tmp_entries(self, job_id: int | str) -> list[tuple[Path, float]]:
        """(entry, age in seconds) for each entry of the job's tmp/ folder."""
        tmp, now, entries = self.job_dir(job_id) / "tmp", self.clock(), []
        for entry in tmp.iterdir() if tmp.is_dir() else []:
            try:
                entries.append((entry, now - entry.lstat().st_mtime))
            except FileNotFoundError:  # a writer finished meanwhile
                continue
        return entries

    def _collect(self, job_id: int | str, doomed: tuple[int, ...], grace_s: float) -> PruneResult:
        tmp_entries = tmp_bytes = 0
        for entry, age in self._tmp_entries(job_id):
            if age >= grace_s:
                tmp_bytes += _tree_bytes(entry)
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                tmp_entries += 1
        # The order matters: chunks listed first, writers checked next, manifests read last. A writer
        # that commits after the check started after it too, so its new chunks are not in our listing.
        on_disk = _chunk_files(self.job_dir(job_id) / "chunks")
        if self._active_writers(job_id, grace_s):
            return PruneResult(doomed, 0, 0, tmp_entries, tmp_bytes, chunk_gc_deferred=True)
        packs = sorted(self.packs_dir(job_id).glob("*.idx"))
        referenced, skipped, newer = self._referenced(job_id)
        if newer:
            return PruneResult(doomed, 0, 0, tmp_entries, tmp_bytes, chunk_gc_deferred=True,
                               skipped=tuple(skipped))
        chunks = chunk_bytes = 0
        for name, path in on_disk.items():
            if name not in referenced:
                try:
                    size = path.stat().st_size
                    path.unlink()
                except FileNotFoundError:
                    continue
                chunks, chunk_bytes = chunks + 1, chunk_bytes + size
        for idx in packs:
            # A pack goes once no kept checkpoint uses any of its chunks (a partly used one stays).
            pack = idx.with_suffix(".pack")
            try:
                hashes = read_pack_index(idx, _size(pack))
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as exc:
                skipped.append(Skipped(f"pack index {idx}", str(exc)))  # left for whoever inspects it
                continue
            if hashes.keys() & referenced:
                continue
            size = _size(pack) or 0
            pack.unlink(missing_ok=True)
            idx.unlink(missing_ok=True)
            chunks, chunk_bytes = chunks + len(hashes), chunk_bytes + size
        return PruneResult(doomed, chunks, chunk_bytes, tmp_entries, tmp_bytes, skipped=tuple(skipped))

    def delete_job(self, job_id: int | str) -> int:
        """Remove every checkpoint of the job; returns the chunk bytes freed."""
        job_dir = self.job_dir(job_id)
        doomed = job_dir.with_name(f".deleting-{job_dir.name}-{uuid.uuid4().hex[:8]}")
        with _store_io(self.root, f"delete the checkpoints of job {job_dir.name}"):
            try:
                # Renamed first, so that a deletion cut short never looks like checkpoints with lost chunks.
                os.rename(job_dir, doomed)
            except FileNotFoundError:
                return 0
            freed = sum(path.stat().st_size for path in _chunk_files(doomed / "chunks").values())
            freed += sum(path.stat().st_size for path in (doomed / "packs").glob("*.pack"))
            shutil.rmtree(doomed)
        return freed

    def job_usage(self, job_id: int | str) -> int:
        """Bytes of the job's chunk and pack files (their sizes, whatever checkpoints reference them)."""
        loose = sum(path.stat().st_size for path in _chunk_files(self.job_dir(job_id) / "chunks").values())
        return loose + sum(path.stat().st_size for path in self.packs_dir(job_id).glob("*.pack"))


class CheckpointWriter:
    """One checkpoint being written. Nothing is visible until `commit`; leaving a `with` block without
    committing, or with an exception, aborts it."""

    def __init__(self, store: CheckpointStore, job_id: str, *, reason: str, meta: Mapping[str, Any] | None):
        if not isinstance(reason, str):
            raise InvalidCheckpointRequest(f"reason {reason!r} must be a string such as 'preemption'")
        try:
            # A deep copy through JSON: the manifest holds what the caller meant now, in a form it can store.
            self.meta: dict[str, Any] = json.loads(json.dumps(dict(meta or {})))
        except (TypeError, ValueError) as exc:
            raise InvalidCheckpointRequest(f"meta {meta!r} cannot be stored as JSON: {exc}") from exc
        self.store, self.job_id, self.reason = store, job_id, reason
        self.files: list[FileEntry] = []
        self._dir = store.job_dir(job_id)
        self._paths: set[str] = set()
        self._folders: set[str] = set()  # parents of added paths: a file may not also be a folder
        self._refs: dict[str, int] = {}  # hash -> length of every chunk referenced
        self._new: dict[str, int] = {}  # the chunks this writer stored
        self._synced_dirs: set[Path] = set()
        self._state = "open"  # -> "committed" | "aborted"
        self._tmp = self._dir / "tmp" / f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        with _store_io(store.root, f"start a checkpoint of job {job_id}"):
            for sub in ("chunks", "manifests"):
                (self._dir / sub).mkdir(parents=True, exist_ok=True)
            self._tmp.mkdir(parents=True)
            # Unbuffered: a full disk must fail the write of the chunk, inside _store_io, not a later flush.
            self._pack = open(self._tmp / "chunks.pack", "ab", buffering=0) if store.pack_chunks else None
        self._pack_entries: dict[str, list[int]] = {}
        # Chunks go to the pack a block at a time, each write inside _store_io: a full disk fails
        # the write that hits it, and the writer aborts at once.
        self._pack_buffer = bytearray()
        self._pack_offset = 0
        # Chunks the store already holds, loose or packed: dedup against them without a stat each.
        self._known: set[str] = (set(_chunk_files(self._dir / "chunks")) | set(store.pack_index(job_id))
                                 if store.pack_chunks else set())

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.abort()

    def _check_open(self) -> None:
        if self._state != "open":
            raise CheckpointError(f"this checkpoint of job {self.job_id} is already {self._state}; "
                                  "begin a new one")

    def _check_new_path(self, relpath: str) -> str:
        self._check_open()
        path = check_relpath(relpath)
        parents = ["/".join(path.split("/")[:i]) for i in range(1, path.count("/") + 1)]
        if path in self._paths or path in self._folders or any(p in self._paths for p in parents):
            raise InvalidCheckpointRequest(f"file path {path!r} clashes with a file already in this "
                                           "checkpoint (same name, or one is the other's folder)")
        return path

    def _spans(self, path: str, size: int, boundaries: Sequence[int] | None) -> list[tuple[int, int]]:
        try:
            return chunk_spans(size, boundaries, self.store.max_chunk)
        except InvalidCheckpointRequest as exc:
            raise InvalidCheckpointRequest(f"{path}: {exc}") from None

    def _record(self, path: str, mode: int, size: int, chunks: list[ChunkRef]) -> FileEntry:
        entry = FileEntry(path, mode, size, tuple(chunks))
        self.files.append(entry)
        self._paths.add(path)
        self._folders.update("/".join(path.split("/")[:i]) for i in range(1, path.count("/") + 1))
        return entry

    def add_file(self, relpath: str, source_path: str | os.PathLike[str],
                 boundaries: Sequence[int] | None = None) -> FileEntry:
        """Store a regular file as `relpath`; chunks start at each of `boundaries` (sorted offsets)."""
        path = self._check_new_path(relpath)
        try:
            source = open(source_path, "rb")
        except OSError as exc:
            raise CheckpointError(f"cannot read {source_path} to store it as {path}: {exc}") from exc
        with source:
            info = os.fstat(source.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise InvalidCheckpointRequest(f"{source_path} is not a regular file; only files are stored")
            chunks = []
            buffer, start = b"", 0  # the file's bytes from offset `start`, read a block at a time
            for offset, length in self._spans(path, info.st_size, boundaries):
                if offset + length > start + len(buffer):
                    buffer = buffer[offset - start:] + source.read(max(READ_BLOCK, length))
                    start = offset
                    if offset + length > start + len(buffer):
                        raise CheckpointError(f"{source_path} shrank while it was being stored; checkpoint "
                                              "again once its writer has stopped")
                chunks.append(self._put(memoryview(buffer)[offset - start:offset - start + length]))
        return self._record(path, stat.S_IMODE(info.st_mode), info.st_size, chunks)

    def add_bytes(self, relpath: str, data: bytes, *, mode: int = 0o644,
                  boundaries: Sequence[int] | None = None) -> FileEntry:
        path = self._check_new_path(relpath)
        view = memoryview(data)
        chunks = [self._put(bytes(view[o:o + n])) for o, n in self._spans(path, len(view), boundaries)]
        return self._record(path, mode & 0o7777, len(view), chunks)

    def _put(self, data: bytes | memoryview) -> ChunkRef:
        ref = ChunkRef(xxhash.xxh3_128_hexdigest(data), len(data))
        if ref.hash in self._refs:
            return ref
        if self._pack is not None:
            return self._put_packed(ref, data)
        final = self.store.chunk_path(self.job_id, ref.hash)
        try:
            with _store_io(self.store.root, f"store chunk {ref.hash} of job {self.job_id}"):
                if _size(final) != ref.length:  # absent, or cut short by an earlier crash: (re)write it
                    _write(self._tmp / ref.hash, data)
                    final.parent.mkdir(exist_ok=True)
                    os.replace(self._tmp / ref.hash, final)
                    self._new[ref.hash] = ref.length
                    self._synced_dirs.add(final.parent)
        except StoreFull:
            self.abort()  # at once: the space this writer took is what the next writer needs
            raise
        self._refs[ref.hash] = ref.length
        return ref

    def _put_packed(self, ref: ChunkRef, data: bytes) -> ChunkRef:
        if ref.hash not in self._known:
            try:
                with _store_io(self.store.root, f"store chunk {ref.hash} of job {self.job_id}"):
                    self._pack_entries[ref.hash] = [self._pack_offset, ref.length]
                    self._pack_buffer += data
                    self._pack_offset += ref.length
                    if len(self._pack_buffer) >= PACK_WRITE_BLOCK:
                        self._flush_pack()
            except StoreFull:
                self.abort()
                raise
            self._new[ref.hash] = ref.length
        self._refs[ref.hash] = ref.length
        return ref

    def _flush_pack(self) -> None:
        """Write the buffered chunks to the pack (the caller is inside _store_io)."""
        view = memoryview(self._pack_buffer)
        while view:
            written = self._pack.write(view)
            view = view[written:]
        view.release()
        self._pack_buffer.clear()

    def _publish_pack(self) -> None:
        """Move the pack and its index into packs/ (the index last: a pack without one is ignored)."""
        self._flush_pack()
        self._pack.close()
        if not self._pack_entries:
            return
        packs = self.store.packs_dir(self.job_id)
        packs.mkdir(exist_ok=True)
        name = self._tmp.name
        os.replace(self._tmp / "chunks.pack", packs / f"{name}.pack")
        _write(self._tmp / "chunks.idx", json.dumps(self._pack_entries).encode())
        os.replace(self._tmp / "chunks.idx", packs / f"{name}.idx")
        self._synced_dirs.add(packs)

    def commit(self) -> Manifest:
        """Make the checkpoint visible under the next free sequence number, durably."""
        self._check_open()
        if not self.files:
            raise InvalidCheckpointRequest(f"nothing was added to this checkpoint of job {self.job_id}; "
                                           "add its files before commit")
        try:
            with _store_io(self.store.root, f"commit a checkpoint of job {self.job_id}"):
                if self._pack is not None:
                    self._publish_pack()
                    packed = self.store.pack_index(self.job_id)
                else:
                    packed = {}
                fence, mine = self.store.read_fence(self.job_id), self.meta.get("restart")
                if fence is not None and isinstance(mine, int) and mine < fence.restart:
                    raise CheckpointConflict(
                        f"job {self.job_id} was restarted (restart {fence.restart}) since this checkpoint "
                        f"of restart {mine} began; it is not committed")
                chunks = self._dir / "chunks"
                for chunk_hash, length in self._refs.items():
                    if packed.get(chunk_hash, (None, 0, -1))[2] == length:
                        continue
                    path = chunks / chunk_hash[:2] / chunk_hash
                    if _size(path) != length:
                        raise CheckpointConflict(
                            f"chunk {path} vanished while job {self.job_id} was checkpointed (a prune or "
                            "another writer's abort ran meanwhile); checkpoint again"
                        )
                if self._new:
                    _syncfs(self._dir)  # the new chunks' data and names, in one flush
                for folder in [*self._synced_dirs, self._dir / "chunks", self._dir, self._dir.parent]:
                    _fsync_dir(folder)
                manifest = self._link_manifest()
        finally:
            if self._state == "open":
                self.abort()
        shutil.rmtree(self._tmp, ignore_errors=True)
        return manifest

    def _link_manifest(self) -> Manifest:
        folder, created_at = self._dir / "manifests", self.store.clock()
        seqs = self.store.seqs(self.job_id)
        seq = seqs[-1] + 1 if seqs else 1
        while True:
            manifest = Manifest(
                job_id=self.job_id, seq=seq, created_at=created_at, reason=self.reason, meta=self.meta,
                files=tuple(self.files), logical_bytes=sum(f.size for f in self.files),
                new_bytes=sum(self._new.values()),
            )
            tmp = self._tmp / f"manifest-{seq:08d}.json"
            _write_durably(tmp, manifest.to_json().encode())
            try:
                # link, unlike rename, fails if the name exists: a concurrent writer that took this
                # sequence number keeps its manifest, and we take the next one.
                os.link(tmp, folder / f"{seq:08d}.json")
            except FileExistsError:
                tmp.unlink()
                seq += 1
                continue
            self._state = "committed"
            tmp.unlink()
            _fsync_dir(folder)
            return manifest

    def abort(self) -> None:
        """Drop everything this writer did; idempotent, and a no-op after commit."""
        if self._state != "open":
            return
        self._state = "aborted"
        if self._pack is not None:
            try:
                self._pack.close()
            except OSError:
                pass
        shutil.rmtree(self._tmp, ignore_errors=True)
        if not self._new or self.store._active_writers(self.job_id, DEFAULT_TMP_GRACE_S):
            return  # another writer may have deduplicated against our chunks; GC takes them later
        try:
            referenced, _, newer = self.store._referenced(self.job_id)
        except CheckpointError:
            return  # best effort: GC removes leftovers
        if newer:
            return
        for chunk_hash in self._new.keys() - referenced:
            try:
                self.store.chunk_path(self.job_id, chunk_hash).unlink()
            except OSError:
                continue
