"""The checkpoint store: content-addressed chunks in packs and atomically committed manifests on a
shared filesystem.

Layout under the root, per job::

    jobs/<job_id>/packs/<writer>.pack        chunks one writer stored, back to back
    jobs/<job_id>/packs/<writer>.idx         where each of them lies in the pack (see packs.py)
    jobs/<job_id>/manifests/<seq:08d>.mf     one manifest per committed checkpoint (see manifest.py)
    jobs/<job_id>/tmp/<writer>/              the in-progress writes of one writer

A chunk is named by the xxh3-128 digest of its content. A checkpoint exists once its manifest is
linked into manifests/; until then nothing a writer did is visible to readers, so a failed dump (a
full disk included) never replaces the last good checkpoint. Chunks are shared by all checkpoints of
a job, so a checkpoint stores only the chunks that changed.

Concurrency: writers and readers (verify, restore) hold the job's lock (`<job>/lock`, flock) shared,
garbage collection exclusive and only if it is free at once (else it is deferred), so no pack is
removed or compacted while a checkpoint is written from it or restored. Two writers cannot take the
same sequence number (it is claimed with an exclusive link). For collections that take no lock (an
older version's), a writer's tmp folder still marks it as active, and `commit` checks that every chunk
it deduplicated against is still in a pack, so such a race fails with CheckpointConflict instead of
committing a checkpoint with holes. A pack is removed whole once no kept checkpoint uses any of its
chunks; one whose live chunks are under half its bytes is compacted into a new pack.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
import stat
import time
import uuid
from array import array
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Mapping as MappingABC
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import xxhash

from singularity_slurm.checkpoint.manifest import (
    DIGEST,
    FORMAT_VERSION,
    LENGTHS,
    MAX_CHUNK_LENGTH,
    ChunkRef,
    FileEntry,
    Manifest,
    check_relpath,
    is_claim,
    job_key,
)
from singularity_slurm.checkpoint.packs import DigestSet, PackIndex, encode_index, read_pack_index, stat_key
from singularity_slurm.errors import (
    CheckpointConflict,
    CheckpointError,
    CorruptCheckpoint,
    InvalidCheckpointRequest,
    NewerCheckpointFormat,
    NoCheckpoint,
    StoreFull,
)

__all__ = ["FORMAT_VERSION", "MAX_CHUNK_LENGTH", "ChunkRef", "FileEntry", "Manifest", "check_relpath",
           "job_key", "read_pack_index", "CheckpointStore", "CheckpointWriter", "Fence", "PruneResult",
           "Refusal", "Skipped", "chunk_spans"]

DEFAULT_MAX_CHUNK = 16 * 1024
READ_BLOCK = 1 << 20
"""Bytes of a file a writer reads at once; its chunks are slices of them."""
PACK_WRITE_BLOCK = 1 << 20
"""Bytes of new chunks a writer gathers before it writes them to its pack."""
COMPACT_BELOW = 0.5
"""A pack whose live chunks are less than this share of its bytes is compacted by garbage collection:
without it, a pack lives as long as any one of its chunks, and the store of a job that dirties a few
pages between checkpoints grows with every checkpoint."""
COMPACT_MAX_BYTES = 1 << 30
"""Live bytes one collection copies at most when it compacts (it holds the job's lock meanwhile)."""
RESTORE_READ = 8 << 20
"""At most this many bytes of chunks lying back to back in a pack are read at once by a restore."""
DEFAULT_TMP_GRACE_S = 3600.0
"""Age after which a tmp entry counts as left behind by a dead writer (a live one writes far more often)."""

_JOB_ID = re.compile(r"[0-9]{1,20}")
_HASH = re.compile(r"[0-9a-f]{32}")
_MANIFEST_NAME = re.compile(r"([0-9]{8,})\.(mf|json)")
_FULL = {errno.ENOSPC, errno.EDQUOT}
FENCE = "fence.json"
LOCK = "lock"


def chunk_spans(size: int, boundaries: Sequence[int] | None = None,
                max_chunk: int = DEFAULT_MAX_CHUNK) -> list[tuple[int, int]]:
    """(offset, length) of every chunk of a `size`-byte file.

    A chunk starts at 0, at every boundary, and every `max_chunk` bytes after each of them. With the
    offsets where memory regions start as boundaries, a region inserted into a pages image changes the
    chunks of that region only, instead of shifting every chunk after it.
    """
    _check_boundaries(size, boundaries)
    offsets, lengths = span_arrays(size, boundaries, max_chunk)
    return list(zip(offsets.tolist(), lengths.tolist(), strict=True))


def _check_boundaries(size: int, boundaries: Sequence[int] | None) -> None:
    previous = 0
    for offset in boundaries or ():
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= size:
            raise InvalidCheckpointRequest(f"chunk boundary {offset!r} is outside the file (0..{size})")
        if offset < previous:
            raise InvalidCheckpointRequest(f"chunk boundaries must be sorted; {offset} follows {previous}")
        previous = offset


def span_arrays(size: int, boundaries: Sequence[int] | None, max_chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """chunk_spans as two int64 arrays, offsets and lengths (16 bytes a chunk; boundaries unchecked)."""
    # Repeats are harmless (an empty memory region starts where the next one does): one cut each.
    cuts = np.array([0, *sorted({offset for offset in boundaries or () if 0 < offset < size}), size],
                    dtype=np.int64)
    starts, ends = cuts[:-1], cuts[1:]
    counts = -(-(ends - starts) // max_chunk)
    first = np.repeat(starts, counts)
    within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    offsets = first + within * max_chunk
    lengths = np.minimum(max_chunk, np.repeat(ends, counts) - offsets)
    return offsets, lengths


class Skipped(NamedTuple):
    """A manifest or pack index that could not be read and was left alone (`what` names its file)."""

    what: str
    reason: str


class Checked(NamedTuple):
    """A job's manifests as read at one time: the readable checkpoints (oldest first), the manifests
    skipped, whether one of those is of a newer format (whose chunks are unknown here), and every
    sequence number listed then."""

    manifests: list[Manifest]
    skipped: list[Skipped]
    newer: bool
    listed: frozenset[int]


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
    packs_compacted: int = 0  # mostly dead packs whose live chunks were copied into a new pack


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


def _int(value: Any, what: str, low: int = 0, high: int | None = None) -> int:
    too_big = high is not None and isinstance(value, int) and value > high
    if isinstance(value, bool) or not isinstance(value, int) or value < low or too_big:
        raise ValueError(f"{what} is {value!r}, not an integer in {low}..{'' if high is None else high}")
    return value


def _size(path: Path) -> int | None:
    """The size of a file, None if there is none."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def _stale(manifest: Manifest, fence: Fence) -> str:
    return (f"it was committed by a node agent of restart {manifest.meta.get('restart')} after restart "
            f"{fence.restart} of the job had begun (a stale agent's); it is not restored")


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


def _index_key(index: Path) -> tuple[Any, ...]:
    """What tells a published index (and its pack) from another file that took its name, or from
    damage: the index's stat, and its pack's size, against which its entries are checked."""
    return (*stat_key(index), _size(index.with_suffix(".pack")))


def _members(digests: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """Which of `digests` are in `sorted_set` (sorted, unique): one searchsorted, no sort."""
    if not len(sorted_set):
        return np.zeros(len(digests), bool)
    at = np.minimum(np.searchsorted(sorted_set, digests), len(sorted_set) - 1)
    return sorted_set[at] == digests


def _offsets(lengths: np.ndarray) -> np.ndarray:
    """The offset in its file of each chunk."""
    ends = np.cumsum(lengths, dtype=np.int64)
    return ends - lengths


class CheckpointStore:
    """All checkpoints of all jobs under one root folder (a shared filesystem)."""

    def __init__(self, root: str | os.PathLike[str], *, clock: Callable[[], float] = time.time,
                 max_chunk: int = DEFAULT_MAX_CHUNK):
        valid = isinstance(max_chunk, int) and not isinstance(max_chunk, bool)
        if not valid or not 0 < max_chunk <= MAX_CHUNK_LENGTH:
            raise InvalidCheckpointRequest(f"max_chunk {max_chunk!r} must be a number of bytes in "
                                           f"1..{MAX_CHUNK_LENGTH}")
        self.root = Path(root)
        self.clock = clock  # created_at, and the age of tmp entries (so: wall-clock seconds)
        self.max_chunk = max_chunk
        self._open_packs: dict[Path, int] = {}  # fds of packs read by the current verify or restore
        self._damaged: dict[Path, dict[str, str]] = {}  # packs folder -> index name -> why it was skipped
        # packs folder -> its PackIndex: a published pack and its index never change, so the index is
        # built again only when indexes came or went (or another file took an index's name)
        self._indexes: dict[Path, tuple[list[Any], PackIndex, dict[str, str]]] = {}

    # --- layout ------------------------------------------------------------------------------------

    def job_dir(self, job_id: int | str) -> Path:
        return self.root / "jobs" / job_key(job_id)

    def packs_dir(self, job_id: int | str) -> Path:
        return self.job_dir(job_id) / "packs"

    def pack_index(self, job_id: int | str) -> PackIndex:
        """Where every packed chunk of the job lies.

        A damaged index is skipped (its chunks read as missing, so the checkpoints that need them are
        refused, and the refusal names it); `damaged_indexes` says which and why.
        """
        folder = self.packs_dir(job_id)
        damaged = self._damaged.setdefault(folder, {})
        damaged.clear()
        try:
            names = sorted(name for name in os.listdir(folder) if name.endswith(".idx"))
        except FileNotFoundError:
            names = []
        found: list[tuple[Path, tuple[Any, ...]]] = []
        for name in names:
            try:
                found.append((folder / name, _index_key(folder / name)))
            except OSError as exc:
                damaged[name] = f"cannot be read ({exc})"
        cached = self._indexes.get(folder)
        if cached is not None and cached[0] == found:
            damaged.update(cached[2])
            return cached[1]
        previous = {} if cached is None else dict(zip(cached[1].sources, cached[1].parts, strict=True))
        sources, parts = [], []
        for path, key in found:
            part = previous.get((path, key))
            if part is None:
                try:
                    part = read_pack_index(path, _size(path.with_suffix(".pack")))
                except OSError as exc:
                    damaged[path.name] = f"cannot be read ({exc})"
                    continue
                except ValueError as exc:
                    damaged[path.name] = str(exc)
                    continue
            sources.append((path, key))
            parts.append(part)
        index = PackIndex(sources, parts)
        self._indexes[folder] = (found, index, dict(damaged))
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
        """Where a chunk's bytes are: (pack, offset, length), or None when the store lacks it."""
        if not isinstance(chunk_hash, str) or not _HASH.fullmatch(chunk_hash):
            raise InvalidCheckpointRequest(f"{chunk_hash!r} is not a chunk hash (32 hex digits)")
        return self.pack_index(job_id).get(bytes.fromhex(chunk_hash))

    def manifest_path(self, job_id: int | str, seq: int) -> Path:
        """The manifest file of checkpoint `seq` (of format 1 where that is the one there)."""
        path = self.job_dir(job_id) / "manifests" / f"{seq:08d}.mf"
        old = path.with_suffix(".json")
        return old if not path.exists() and old.exists() else path

    def read_fence(self, job_id: int | str) -> Fence | None:
        """The job's fence (see Fence), or None: none yet, or a damaged one (nothing is fenced out)."""
        try:
            doc = json.loads((self.job_dir(job_id) / FENCE).read_bytes())
            return Fence(_int(doc["restart"], "restart"), _int(doc["seq"], "seq"))
        except (OSError, ValueError, TypeError, KeyError, RecursionError):
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

    def lock(self, job_id: int | str, *, exclusive: bool, wait: bool = True) -> int | None:
        """Take the job's store lock (flock on `<job>/lock`): writers and readers hold it shared,
        garbage collection exclusive, so no pack goes while a checkpoint is written from it or
        restored. Returns the fd that holds it (closing it releases it), -1 where the job has no
        folder (nothing to lock), None where it was not free (without wait)."""
        folder = self.job_dir(job_id)
        try:
            fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except FileNotFoundError:
            return -1
        except OSError as exc:
            raise CheckpointError(f"cannot open the lock of job {folder.name} in {self.root}: {exc}; "
                                  "check that the store is mounted and writable") from exc
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError as exc:
            os.close(fd)
            raise CheckpointError(
                f"the checkpoint store {self.root} does not support file locks ({exc}): mount it with "
                "locking across nodes (NFSv4, Lustre with -o flock, GPFS, CephFS)") from exc
        return fd

    @contextmanager
    def job_lock(self, job_id: int | str, *, exclusive: bool, wait: bool = True) -> Iterator[bool]:
        """`lock` for a block: yields whether it was taken."""
        fd = self.lock(job_id, exclusive=exclusive, wait=wait)
        try:
            yield fd is not None
        finally:
            if fd is not None and fd >= 0:
                os.close(fd)

    # --- writing -----------------------------------------------------------------------------------

    def begin(self, job_id: int | str, *, reason: str,
              meta: MappingABC[str, Any] | None = None) -> CheckpointWriter:
        """Start writing a checkpoint; see CheckpointWriter."""
        return CheckpointWriter(self, job_key(job_id), reason=reason, meta=meta)

    # --- reading -----------------------------------------------------------------------------------

    def seqs(self, job_id: int | str) -> list[int]:
        """Sequence numbers of the committed checkpoints, oldest first (manifests are not read)."""
        try:
            names = os.listdir(self.job_dir(job_id) / "manifests")
        except FileNotFoundError:
            return []
        return sorted({int(m.group(1)) for name in names if (m := _MANIFEST_NAME.fullmatch(name))})

    def read(self, job_id: int | str, seq: int) -> Manifest:
        """The manifest of checkpoint `seq`; CorruptCheckpoint if it is unreadable."""
        job, path = job_key(job_id), self.manifest_path(job_id, seq)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise NoCheckpoint(f"job {job} has no checkpoint {seq} in {self.root}") from None
        except OSError as exc:
            raise CheckpointError(f"cannot read {path}: {exc}; check that the store is mounted") from exc
        return Manifest.from_bytes(data, job_id=job, seq=seq, where=str(path))

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

    def _file_data(self, manifest: Manifest, entry: FileEntry, index: PackIndex) -> Iterator[memoryview]:
        """A file's verified bytes, in pieces. Chunks that lie back to back in one pack (as a
        checkpoint's new pages do) are read together and checked slice by slice."""
        digests, lengths = entry.digest_array(), entry.length_array().astype(np.int64)
        if not len(digests):
            return
        at = index.find(digests, lengths)
        offsets = _offsets(lengths)

        def refuse(i: int, problem: str) -> CorruptCheckpoint:
            chunk = digests[i].tobytes().hex()
            where = f"chunk {i} ({chunk}, bytes {offsets[i]}..{offsets[i] + lengths[i]}) of {entry.path}"
            return CorruptCheckpoint(manifest.job_id, manifest.seq, f"{where} {problem}", path=entry.path,
                                     chunk=chunk)

        missing = np.flatnonzero(at < 0)
        if missing.size:
            i = int(missing[0])
            other = int(index.find(digests[i:i + 1])[0])
            if other >= 0:  # a copy of another length only
                raise refuse(i, f"is corrupt: its pack {index.packs[int(index.pack[other])].name} holds "
                                f"{int(index.length[other])} bytes for it instead of {lengths[i]}")
            raise refuse(i, f"is missing from {self.packs_dir(manifest.job_id)}"
                            f"{self._missing_hint(manifest.job_id)}")
        packs, starts = index.pack[at], index.offset[at].astype(np.int64)
        # A run: chunks lying back to back in the same pack; read RESTORE_READ bytes of it at most at once.
        run_ends = np.append(np.flatnonzero((packs[1:] != packs[:-1])
                                            | (starts[1:] != starts[:-1] + lengths[:-1])) + 1, len(at))
        ends, raw, n, i = np.cumsum(lengths), entry.digests, len(at), 0
        while i < n:
            run_end = int(run_ends[np.searchsorted(run_ends, i, side="right")])
            j = int(np.searchsorted(ends, int(ends[i] - lengths[i]) + RESTORE_READ, side="right"))
            j = min(max(j, i + 1), run_end)
            group = lengths[i:j].tolist()
            size = sum(group)
            pack = index.packs[int(packs[i])]
            try:
                data = os.pread(self._pack_fd(pack), size, int(starts[i]))
            except FileNotFoundError:
                raise refuse(i, f"is missing: its pack {pack} is gone") from None
            except OSError as exc:
                # Not CorruptCheckpoint: a transient error (a stale NFS handle) must not make
                # latest_valid fall back to an older checkpoint and throw away the job's progress.
                raise CheckpointError(f"cannot read pack {pack}: {exc}; check the store and retry") from exc
            view, cut = memoryview(data), 0
            for k, length in enumerate(group, start=i):
                if cut + length > len(data):
                    raise refuse(k, f"is corrupt: it has {max(len(data) - cut, 0)} bytes in {pack.name} "
                                    f"instead of {length}")
                if xxhash.xxh3_128_digest(view[cut:cut + length]) != raw[16 * k:16 * k + 16]:
                    raise refuse(k, f"is corrupt: its content in {pack.name} no longer matches its hash")
                cut += length
            yield view
            i = j

    def file_bytes(self, manifest: Manifest, path: str) -> bytes:
        """One (small) file of a checkpoint, every chunk verified."""
        entry = next((f for f in manifest.files if f.path == path), None)
        if entry is None:
            raise CorruptCheckpoint(manifest.job_id, manifest.seq, f"it has no file {path}", path=path)
        with self.job_lock(manifest.job_id, exclusive=False):
            try:
                return b"".join(self._file_data(manifest, entry, self.pack_index(manifest.job_id)))
            finally:
                self._close_packs()

    def verify(self, manifest: Manifest) -> None:
        """Read every chunk and check its length and hash; CorruptCheckpoint names the first bad one."""
        with self.job_lock(manifest.job_id, exclusive=False):
            index = self.pack_index(manifest.job_id)
            try:
                for entry in manifest.files:
                    for _ in self._file_data(manifest, entry, index):
                        pass
            finally:
                self._close_packs()

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
        with self.job_lock(manifest.job_id, exclusive=False):
            return self._restore(manifest, Path(dest_dir))

    def _restore(self, manifest: Manifest, dest: Path) -> list[Path]:
        written: list[Path] = []
        index = self.pack_index(manifest.job_id)
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
                        for data in self._file_data(manifest, entry, index):
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

    def latest_valid(self, job_id: int | str, where: Callable[[Manifest], bool] | None = None, *,
                     verify: bool = True) -> tuple[Manifest, list[Refusal]]:
        """The newest checkpoint that verifies, and the newer ones refused on the way (newest first).

        `where` skips checkpoints it rejects (those of another run of the job) without refusing them.
        With verify=False only its manifest is read and checked: for a caller that restores it next,
        since `restore` verifies every chunk as it writes it (and refuses it as this would).
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
                if verify:
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
        """Delete all but the newest `keep` readable checkpoints, then the packs none of the rest uses.

        An unreadable manifest is skipped (named in the result): it neither counts as kept nor is
        deleted, and its chunks are not protected, since no version can restore it. One written by a
        newer version defers the collection instead, as its chunks are unknown here.
        """
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise InvalidCheckpointRequest(f"keep={keep!r}: prune must keep at least 1 checkpoint; "
                                           "use delete_job to remove them all")
        checked = self.checked(job_id)
        readable = [m.seq for m in checked.manifests]
        return self.drop(job_id, readable[:-keep], tmp_grace_s=tmp_grace_s, checked=checked)

    def drop(self, job_id: int | str, seqs: Sequence[int], *, tmp_grace_s: float = DEFAULT_TMP_GRACE_S,
             checked: Checked | None = None) -> PruneResult:
        """Delete the checkpoints `seqs`, then the packs no remaining checkpoint references.

        `checked`: what `checked(job_id)` returned to the caller that chose `seqs`, so that the
        manifests are not read again (a big job's take seconds); those committed since are.
        """
        doomed = tuple(sorted(set(seqs)))
        folder = self.job_dir(job_id) / "manifests"
        with _store_io(self.root, f"prune checkpoints of job {job_key(job_id)}"):
            for seq in doomed:
                for suffix in ("json", "mf"):  # a stub never outlives its manifest
                    (folder / f"{seq:08d}.{suffix}").unlink(missing_ok=True)
            if doomed:
                _fsync_dir(folder)
            return self._collect(job_id, doomed, tmp_grace_s, checked)

    def collect_garbage(self, job_id: int | str, *, tmp_grace_s: float = DEFAULT_TMP_GRACE_S) -> PruneResult:
        """Delete unreferenced packs and dead writers' tmp entries, keeping every checkpoint."""
        with _store_io(self.root, f"collect garbage of job {job_key(job_id)}"):
            return self._collect(job_id, (), tmp_grace_s)

    def checked(self, job_id: int | str) -> Checked:
        """Readable checkpoints (oldest first), the unreadable manifests skipped, whether one of
        those is of a newer format (whose chunks are unknown here), and the numbers listed."""
        manifests: list[Manifest] = []
        skipped: list[Skipped] = []
        newer = False
        fence = self.read_fence(job_id)
        listed = self.seqs(job_id)
        for seq in listed:
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
        return Checked(manifests, skipped, newer, frozenset(listed))

    @staticmethod
    def _referenced(checked: Checked, doomed: tuple[int, ...]) -> tuple[np.ndarray, list[Skipped], bool]:
        """The digests the readable checkpoints not `doomed` use (sorted, unique), the manifests
        skipped, and whether GC must wait."""
        parts = [entry.digest_array() for m in checked.manifests if m.seq not in doomed for entry in m.files]
        return (np.unique(np.concatenate(parts)) if parts else np.empty(0, DIGEST), list(checked.skipped),
                checked.newer)

    def _drop_cut_claims(self, job_id: int | str, grace_s: float) -> None:
        """Remove the number claims of commits cut short (a stub without its manifest) once they are
        older than the grace time."""
        folder = self.job_dir(job_id) / "manifests"
        try:
            names = set(os.listdir(folder))
        except FileNotFoundError:
            return
        for name in sorted(names):
            if not name.endswith(".json") or name[:-5] + ".mf" in names:
                continue
            path = folder / name
            try:
                if self.clock() - path.stat().st_mtime < grace_s or path.stat().st_size > 256:
                    continue
                if is_claim(json.loads(path.read_bytes())):
                    path.unlink()
            except (OSError, ValueError, RecursionError):
                continue

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

    def _collect(self, job_id: int | str, doomed: tuple[int, ...], grace_s: float,
                 checked: Checked | None = None) -> PruneResult:
        # The manifests are read before the lock is taken (a big job's take seconds; or by the
        # caller, `checked`), and under it only those committed since: writers and restores wait
        # for as short a time as it can be.
        checked = checked or self.checked(job_id)
        read_before = checked.listed
        referenced, skipped, newer = self._referenced(checked, doomed)
        lock = self.lock(job_id, exclusive=True, wait=False)
        if lock is None:  # a checkpoint is being written or restored: its packs and tmp folder stay
            return PruneResult(doomed, 0, 0, 0, 0, chunk_gc_deferred=True)
        try:
            tmp_entries = tmp_bytes = 0
            for entry, age in self._tmp_entries(job_id):
                if age >= grace_s:
                    tmp_bytes += _tree_bytes(entry)
                    if entry.is_dir():
                        shutil.rmtree(entry, ignore_errors=True)
                    else:
                        entry.unlink(missing_ok=True)
                    tmp_entries += 1
            # Where a writer takes no lock (an older version's), the order matters: packs listed first,
            # writers checked next, manifests read last. A writer that commits after the check started
            # after it too, so its pack is not in our listing.
            folder = self.packs_dir(job_id)
            listed = sorted(folder.iterdir()) if folder.is_dir() else []
            if self._active_writers(job_id, grace_s):
                return PruneResult(doomed, 0, 0, tmp_entries, tmp_bytes, chunk_gc_deferred=True)
            self._drop_cut_claims(job_id, grace_s)
            fresh = [seq for seq in self.seqs(job_id) if seq not in read_before]
            for seq in fresh:
                try:
                    manifest = self.read(job_id, seq)
                except NoCheckpoint:
                    continue
                except CorruptCheckpoint as exc:
                    where = self.manifest_path(job_id, seq)
                    skipped.append(Skipped(f"checkpoint {seq} ({where})", exc.detail))
                    newer = newer or isinstance(exc, NewerCheckpointFormat)
                    continue
                referenced = np.union1d(referenced, np.concatenate(
                    [entry.digest_array() for entry in manifest.files] or [np.empty(0, DIGEST)]))
            if newer:
                return PruneResult(doomed, 0, 0, tmp_entries, tmp_bytes, chunk_gc_deferred=True,
                                   skipped=tuple(skipped))
            freed, dropped, compacted = self._collect_packs(job_id, listed, referenced, grace_s, skipped)
            return PruneResult(doomed, dropped, freed, tmp_entries, tmp_bytes, skipped=tuple(skipped),
                               packs_compacted=compacted)
        finally:
            if lock >= 0:
                os.close(lock)

    def _collect_packs(self, job_id: int | str, listed: list[Path], referenced: np.ndarray, grace_s: float,
                       skipped: list[Skipped]) -> tuple[int, int, int]:
        """Remove the packs no kept checkpoint needs, and compact the mostly dead ones; returns
        (bytes freed, chunks dropped, packs compacted). A pack is needed for the referenced chunks
        that no other pack kept holds; a pack whose needed chunks are under COMPACT_BELOW of its
        bytes has them copied into a new pack (at most COMPACT_MAX_BYTES a collection, the sparsest
        packs first; what is left is copied by the next) and goes once all of them are."""
        names = {path.name for path in listed}
        freed = 0
        sources, parts, sizes = [], [], []
        for path in listed:
            if path.suffix == ".pack" and path.with_suffix(".idx").name not in names:
                # A pack whose index was never published (its writer died between the two renames).
                try:
                    if self.clock() - path.stat().st_mtime >= grace_s:
                        freed += path.stat().st_size
                        path.unlink()
                except FileNotFoundError:
                    pass
                continue
            if path.suffix != ".idx":
                continue
            pack = path.with_suffix(".pack")
            if pack.name not in names:
                # An index whose pack is gone (a deletion cut short between the two unlinks).
                try:
                    if self.clock() - path.stat().st_mtime >= grace_s:
                        path.unlink()
                        continue
                except FileNotFoundError:
                    continue
            try:
                entries = read_pack_index(path, _size(pack))
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as exc:
                skipped.append(Skipped(f"pack index {path}", str(exc)))  # left for whoever inspects it
                continue
            sources.append((path, ()))
            parts.append(entries)
            sizes.append(_size(pack) or 0)
        index = PackIndex(sources, parts)
        # needed: the index's entries that are a referenced chunk's only copy; a chunk with several
        # copies is needed from the last of its packs whose fate is decided
        live = _members(index.digests, referenced)
        first = np.searchsorted(index.digests, index.digests, side="left")
        after = np.searchsorted(index.digests, index.digests, side="right")
        needed = live & (after - first == 1)
        shared = live & (after - first > 1)
        by_pack = np.argsort(index.pack, kind="stable")
        bounds = np.searchsorted(index.pack[by_pack], np.arange(len(parts) + 1))
        live_bytes = np.bincount(index.pack[live], weights=index.length[live], minlength=len(parts))
        gone: set[int] = set()
        draining: set[int] = set()  # packs whose chunks are being copied out, in part
        budget, plan = COMPACT_MAX_BYTES, []
        # The sparsest first: a dense pack (a compaction's own) is decided last and keeps the copies.
        for number in sorted(range(len(parts)), key=lambda p: live_bytes[p] / max(sizes[p], 1)):
            mine = by_pack[bounds[number]:bounds[number + 1]]
            for k in mine[shared[mine]].tolist():
                others = {int(p) for p in index.pack[int(first[k]):int(after[k])]} - {number}
                if others <= gone | draining:  # every other copy goes: this one is needed
                    needed[k] = True
            need = mine[needed[mine]]
            need_bytes = int(index.length[need].sum(dtype=np.uint64))
            if not need.size:
                gone.add(number)
            elif need_bytes < COMPACT_BELOW * sizes[number] and need_bytes <= budget:
                plan.append((number, need))
                budget -= need_bytes
                gone.add(number)
            elif need_bytes < COMPACT_BELOW * sizes[number] and budget > 0:
                # Too much for this collection: a part now; once copied, this pack no longer holds
                # the only copy of those chunks, and the next collections copy the rest.
                part = need[np.cumsum(index.length[need], dtype=np.uint64) <= budget]
                if part.size:
                    plan.append((number, part))
                draining.add(number)
                budget = 0
        copied, refused = self._compact(job_id, index, plan) if plan else ({}, [])
        skipped.extend(refused)
        planned = {number for number, _ in plan}
        deleting = sorted(n for n in gone if n not in planned or n in copied)  # a failed copy's pack stays
        for number in deleting:  # every index first: a pack without one is never read
            index.packs[number].with_suffix(".idx").unlink(missing_ok=True)
        if deleting:
            _fsync_dir(self.packs_dir(job_id))
        for number in deleting:
            index.packs[number].unlink(missing_ok=True)
        freed += sum(sizes[n] for n in deleting) - sum(size for size, _ in copied.values())
        dropped = sum(len(parts[n]) for n in deleting) - sum(count for _, count in copied.values())
        return max(freed, 0), max(dropped, 0), len(copied)

    def _compact(self, job_id: int | str, index: PackIndex, plan: list[tuple[int, np.ndarray]],
                 ) -> tuple[dict[int, tuple[int, int]], list[Skipped]]:
        """Copy the chunks `plan` names (pack number, index positions) into one new pack, each
        verified on the way, and publish it. Returns {pack number: (bytes, chunks) copied} for the
        packs whose chunks were all copied, and those left alone."""
        folder, tmp = self.packs_dir(job_id), self.job_dir(job_id) / "tmp" / f"compact-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)  # also marks a writer at work for an older version's collection
        done: dict[int, tuple[int, int]] = {}
        refused: list[Skipped] = []
        digests, offsets, lengths = [], [], []
        try:
            with open(tmp / "chunks.pack", "xb") as out:
                for number, need in plan:
                    need = need[np.argsort(index.offset[need], kind="stable")]
                    start = out.tell()
                    pack = index.packs[number]
                    try:
                        for data in self._live_chunks(pack, index, need):
                            out.write(data)
                    except (OSError, ValueError) as exc:
                        out.seek(start)
                        out.truncate()
                        refused.append(Skipped(f"pack {pack}", f"was not compacted: {exc}"))
                        continue
                    digests.append(index.digests[need])
                    ends = np.cumsum(index.length[need], dtype=np.uint64)
                    offsets.append(ends - index.length[need] + start)
                    lengths.append(index.length[need])
                    done[number] = (out.tell() - start, len(need))
                if not done:
                    return {}, refused
                out.flush()
                os.fsync(out.fileno())
            _write_durably(tmp / "chunks.idx", encode_index(np.concatenate(digests), np.concatenate(offsets),
                                                            np.concatenate(lengths)))
            os.replace(tmp / "chunks.pack", folder / f"{tmp.name}.pack")
            os.replace(tmp / "chunks.idx", folder / f"{tmp.name}.idx")
            _fsync_dir(folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return done, refused

    @staticmethod
    def _live_chunks(pack: Path, index: PackIndex, need: np.ndarray) -> Iterator[bytes]:
        """The bytes of the index's entries `need` (sorted by offset, all in `pack`), each checked
        against its digest."""
        with open(pack, "rb", buffering=0) as source:
            fd = source.fileno()
            for k in need.tolist():
                data = os.pread(fd, int(index.length[k]), int(index.offset[k]))
                if xxhash.xxh3_128_digest(data) != index.digests[k].tobytes():
                    raise ValueError(f"its chunk {index.digests[k].tobytes().hex()} does not match its hash")
                yield data

    def delete_job(self, job_id: int | str) -> int:
        """Remove every checkpoint of the job; returns the pack bytes freed."""
        job_dir = self.job_dir(job_id)
        doomed = job_dir.with_name(f".deleting-{job_dir.name}-{uuid.uuid4().hex[:8]}")
        with _store_io(self.root, f"delete the checkpoints of job {job_dir.name}"):
            try:
                # Renamed first, so that a deletion cut short never looks like checkpoints with lost chunks.
                os.rename(job_dir, doomed)
            except FileNotFoundError:
                return 0
            freed = sum(path.stat().st_size for path in (doomed / "packs").glob("*.pack"))
            shutil.rmtree(doomed)
        return freed

    def job_usage(self, job_id: int | str) -> int:
        """Bytes of the job's pack files (their sizes, whatever checkpoints reference them)."""
        return sum(path.stat().st_size for path in self.packs_dir(job_id).glob("*.pack"))


def _json_copy(meta: MappingABC[str, Any]) -> dict[str, Any]:
    """A deep copy through JSON: the manifest holds what the caller meant now, in a form it can store."""
    try:
        return json.loads(json.dumps(dict(meta)))
    except (TypeError, ValueError) as exc:
        raise InvalidCheckpointRequest(f"meta {meta!r} cannot be stored as JSON: {exc}") from exc


class CheckpointWriter:
    """One checkpoint being written. Nothing is visible until `commit`; leaving a `with` block without
    committing, or with an exception, aborts it.

    New chunks go to one pack of the writer's own; chunks the job's packs already hold (as the store's
    index said when the writer began) are referenced where they are. Memory: 20 bytes a chunk for the
    manifest, about 44 more for each new one, and the job's index (about 60 bytes a stored chunk).
    """

    def __init__(self, store: CheckpointStore, job_id: str, *, reason: str,
                 meta: MappingABC[str, Any] | None):
        if not isinstance(reason, str):
            raise InvalidCheckpointRequest(f"reason {reason!r} must be a string such as 'preemption'")
        self.meta: dict[str, Any] = _json_copy(meta or {})
        self.store, self.job_id, self.reason = store, job_id, reason
        self.files: list[FileEntry] = []
        self._dir = store.job_dir(job_id)
        self._paths: set[str] = set()
        self._folders: set[str] = set()  # parents of added paths: a file may not also be a folder
        self._state = "open"  # -> "committed" | "aborted"
        self._tmp = self._dir / "tmp" / f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._lock: int | None = None
        self._pack = None
        try:
            with _store_io(store.root, f"start a checkpoint of job {job_id}"):
                for sub in ("packs", "manifests"):
                    (self._dir / sub).mkdir(parents=True, exist_ok=True)
                # Held shared until commit or abort: no collection removes a pack this writer relies on.
                self._lock = store.lock(job_id, exclusive=False)
                self._tmp.mkdir(parents=True)
                # Unbuffered: a full disk must fail the write of a block, inside _store_io, not a later flush.
                self._pack = open(self._tmp / "chunks.pack", "ab", buffering=0)
            # Chunks the store already holds: dedup against them, and remember which packs we relied on.
            self._index = store.pack_index(job_id)
        except BaseException:
            if self._pack is not None:
                self._pack.close()
            self._unlock()
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise
        self._used = np.zeros(len(self._index.packs), bool)
        self._seen = DigestSet()  # this writer's new chunks
        self._new_digests = bytearray()
        self._new_offsets = array("Q")
        self._new_lengths = array("I")
        self._new_bytes = 0
        # Chunks go to the pack a block at a time, each write inside _store_io: a full disk fails
        # the write that hits it, and the writer aborts at once.
        self._pack_buffer = bytearray()
        self._pack_offset = 0

    def __enter__(self) -> CheckpointWriter:
        return self

    def add_meta(self, meta: MappingABC[str, Any]) -> None:
        """More of what the manifest records (a dump's figures, known once it is done)."""
        self._check_open()
        self.meta.update(_json_copy(meta))

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

    def _spans(self, path: str, size: int, boundaries: Sequence[int] | None) -> tuple[np.ndarray, np.ndarray]:
        try:
            _check_boundaries(size, boundaries)
        except InvalidCheckpointRequest as exc:
            raise InvalidCheckpointRequest(f"{path}: {exc}") from None
        return span_arrays(size, boundaries, self.store.max_chunk)

    def _record(self, path: str, mode: int, size: int, digests: bytearray, lengths: np.ndarray) -> FileEntry:
        entry = FileEntry(path, mode, size, bytes(digests), lengths.astype(LENGTHS).tobytes())
        self.files.append(entry)
        self._paths.add(path)
        self._folders.update("/".join(path.split("/")[:i]) for i in range(1, path.count("/") + 1))
        return entry

    def add_file(self, relpath: str, source_path: str | os.PathLike[str],
                 boundaries: Sequence[int] | None = None) -> FileEntry:
        """Store a regular file as `relpath`; chunks start at each of `boundaries` (sorted offsets)."""
        path = self._check_new_path(relpath)
        try:
            source = open(source_path, "rb", buffering=0)
        except OSError as exc:
            raise CheckpointError(f"cannot read {source_path} to store it as {path}: {exc}") from exc
        with source:
            info = os.fstat(source.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise InvalidCheckpointRequest(f"{source_path} is not a regular file; only files are stored")
            offsets, lengths = self._spans(path, info.st_size, boundaries)
            ends = offsets + lengths
            digests = bytearray()
            i = 0
            while i < len(offsets):
                # A block from the next chunk on; the chunks that lie wholly in it are stored.
                start = int(offsets[i])
                data = os.pread(source.fileno(), max(READ_BLOCK, int(lengths[i])), start)
                j = int(np.searchsorted(ends, start + len(data), side="right"))
                if j <= i:
                    raise CheckpointError(f"{source_path} shrank while it was being stored; checkpoint "
                                          "again once its writer has stopped")
                self._store(data, start, offsets[i:j], lengths[i:j], digests)
                i = j
        return self._record(path, stat.S_IMODE(info.st_mode), info.st_size, digests, lengths)

    def add_composed(self, relpath: str, source_path: str | os.PathLike[str],
                     segments: Sequence[tuple[int, int] | np.ndarray], *, chunk: int, mode: int = 0o600
                     ) -> FileEntry:
        """Store a file made of `segments` in order: (first, count) takes `count` chunks of `chunk`
        bytes from `source_path` at chunk `first`, an array takes the chunks with those digests
        that the store holds already (a base checkpoint's), none of whose bytes are read."""
        path = self._check_new_path(relpath)
        digests, lengths = bytearray(), []
        try:
            source = open(source_path, "rb", buffering=0)
        except OSError as exc:
            raise CheckpointError(f"cannot read {source_path} to store it as {path}: {exc}") from exc
        with source:
            size = os.fstat(source.fileno()).st_size
            for segment in segments:
                if isinstance(segment, tuple):
                    first, count = segment
                    if (first + count) * chunk > size:
                        raise CheckpointError(f"{source_path} holds {size} bytes, fewer than the "
                                              f"{(first + count) * chunk} its pagemap names")
                    for at in range(first, first + count, READ_BLOCK // chunk):
                        n = min(READ_BLOCK // chunk, first + count - at)
                        data = os.pread(source.fileno(), n * chunk, at * chunk)
                        if len(data) != n * chunk:
                            raise CheckpointError(f"{source_path} shrank while it was being stored")
                        offsets = np.arange(n, dtype=np.int64) * chunk
                        self._store(data, 0, offsets, np.full(n, chunk, np.int64), digests)
                else:
                    self._reference(path, segment, chunk)
                    digests += segment.tobytes()
                lengths.append(segment[1] if isinstance(segment, tuple) else len(segment))
        count = sum(lengths)
        return self._record(path, mode & 0o7777, count * chunk, digests, np.full(count, chunk, np.int64))

    def put_chunks(self, data: bytes | memoryview, chunk: int) -> bytes:
        """Store `data` (a whole number of `chunk`-byte chunks) as chunks of no file yet, and return
        their digests in order: a file streamed in pieces is then recorded with `add_chunked`."""
        self._check_open()
        if len(data) % chunk:
            raise InvalidCheckpointRequest(f"{len(data)} bytes are not whole chunks of {chunk} bytes")
        count = len(data) // chunk
        digests = bytearray()
        self._store(data, 0, np.arange(count, dtype=np.int64) * chunk, np.full(count, chunk, np.int64),
                    digests)
        return bytes(digests)

    def sync_chunks(self) -> None:
        """Make every chunk stored so far durable in the writer's pack (the commit still publishes
        it): a stream's end, so that a full disk is met while the source can still be kept."""
        self._check_open()
        try:
            with _store_io(self.store.root, f"store chunks of job {self.job_id}"):
                self._flush_pack()
                os.fsync(self._pack.fileno())
        except BaseException:
            self.abort()
            raise

    def chunk_sink(self, chunk: int) -> Callable[[bytes | memoryview], bytes]:
        """`put_chunks` of `chunk`-byte chunks, as a stream's receiver calls it."""
        return lambda data: self.put_chunks(data, chunk)

    def add_chunked(self, relpath: str, digests: np.ndarray, *, chunk: int, mode: int = 0o600) -> FileEntry:
        """Record a file made of the chunks `digests` (each `chunk` bytes) in order, every one of them
        stored already: by this writer (`put_chunks`) or by an earlier checkpoint of the job."""
        path = self._check_new_path(relpath)
        found = self._index.find(digests, np.full(len(digests), chunk, np.int64))
        stored = found >= 0
        self._used[self._index.pack[found[stored]]] = True
        mine = digests[~stored]
        if mine.size:
            mine = mine[~self._seen.contains(mine)]
            lost = [d for d in mine if d.tobytes() not in self._seen.recent]
            if lost:
                raise CheckpointError(f"chunk {lost[0].tobytes().hex()} of {path} is neither in the store "
                                      f"nor among the chunks this checkpoint of job {self.job_id} stored")
        return self._record(path, mode & 0o7777, len(digests) * chunk, bytearray(digests.tobytes()),
                            np.full(len(digests), chunk, np.int64))

    def _reference(self, path: str, digests: np.ndarray, chunk: int) -> None:
        """Chunks this checkpoint takes from others: the store must hold every one at its length."""
        found = self._index.find(digests, np.full(len(digests), chunk, np.int64))
        if (found < 0).any():
            missing = digests[np.flatnonzero(found < 0)[0]].tobytes().hex()
            raise CheckpointError(f"chunk {missing} of {path}, which this checkpoint takes from an "
                                  f"earlier one of job {self.job_id}, is no longer in the store; "
                                  "checkpoint again (the next dump is a full one)")
        self._used[self._index.pack[found]] = True

    def add_bytes(self, relpath: str, data: bytes, *, mode: int = 0o644,
                  boundaries: Sequence[int] | None = None) -> FileEntry:
        path = self._check_new_path(relpath)
        offsets, lengths = self._spans(path, len(data), boundaries)
        digests = bytearray()
        for i in range(0, len(offsets), 256):
            self._store(data, 0, offsets[i:i + 256], lengths[i:i + 256], digests)
        return self._record(path, mode & 0o7777, len(data), digests, lengths)

    def _store(self, buffer: bytes, start: int, offsets: np.ndarray, lengths: np.ndarray,
               digests: bytearray) -> None:
        """Hash the chunks at `offsets` of `buffer` (which begins at file offset `start`), append their
        digests to `digests`, and add the ones the store lacks to this writer's pack."""
        if not len(offsets):
            return
        view = memoryview(buffer)
        spans = list(zip((offsets - start).tolist(), lengths.tolist(), strict=True))
        hashed = [xxhash.xxh3_128_digest(view[o:o + n]) for o, n in spans]
        joined = b"".join(hashed)
        digests += joined
        # Stored already only where the index has it at its length (a damaged index could say another).
        found = self._index.find(np.frombuffer(joined, DIGEST), lengths)
        known = found >= 0
        self._used[self._index.pack[found[known]]] = True
        fresh = np.flatnonzero(~known)
        if not fresh.size:
            return
        # New to this writer too: the first of equal chunks in this buffer, not stored by it before.
        # Selected for the whole buffer at once: a dump's pages come a million at a time.
        arrays = np.frombuffer(joined, DIGEST)
        fresh = fresh[np.sort(np.unique(arrays[fresh], return_index=True)[1])]
        fresh = fresh[~self._seen.contains(arrays[fresh])]
        recent = self._seen.recent
        new = [i for i in fresh.tolist() if hashed[i] not in recent]
        if not new:
            return
        recent.update(hashed[i] for i in new)
        sizes = lengths[new]
        total = int(sizes.sum())
        try:
            with _store_io(self.store.root, f"store chunks of job {self.job_id}"):
                self._pack_buffer += b"".join(view[spans[i][0]:spans[i][0] + spans[i][1]] for i in new)
                if len(self._pack_buffer) >= PACK_WRITE_BLOCK:
                    self._flush_pack()
        except BaseException:
            # At once: the space this writer took is what the next writer needs, and its books
            # (the digests it took as stored) no longer match its pack.
            self.abort()
            raise
        self._new_digests += b"".join(hashed[i] for i in new)
        self._new_offsets.extend((self._pack_offset + np.concatenate(([0], np.cumsum(sizes[:-1])))).tolist())
        self._new_lengths.extend(sizes.tolist())
        self._pack_offset += total
        self._new_bytes += total
        self._seen.settle()

    def _flush_pack(self) -> None:
        """Write the buffered chunks to the pack (the caller is inside _store_io)."""
        view = memoryview(self._pack_buffer)
        while view:
            written = self._pack.write(view)
            view = view[written:]
        view.release()
        self._pack_buffer.clear()

    def _publish_pack(self) -> None:
        """Move the pack and its index into packs/, both durable (the index last: a pack without one
        is not read)."""
        self._flush_pack()
        if self._new_lengths:
            os.fsync(self._pack.fileno())
        self._pack.close()
        if not self._new_lengths:
            return
        packs, name = self._dir / "packs", self._tmp.name
        index = encode_index(np.frombuffer(self._new_digests, DIGEST),
                             np.frombuffer(self._new_offsets, np.uint64),
                             np.frombuffer(self._new_lengths, np.uint32))
        _write_durably(self._tmp / "chunks.idx", index)
        os.replace(self._tmp / "chunks.pack", packs / f"{name}.pack")
        os.replace(self._tmp / "chunks.idx", packs / f"{name}.idx")
        _fsync_dir(packs)

    def _check_packs_kept(self) -> None:
        """Every chunk this checkpoint deduplicated against is still in the store: in the pack it
        was in when the writer began, or, where a collection compacted that pack meanwhile, in another."""
        gone = []
        for number in np.flatnonzero(self._used).tolist():
            path, key = self._index.sources[number]
            try:
                if _index_key(path) == key:
                    continue
            except FileNotFoundError:
                pass
            gone.append(number)
        if not gone:
            return
        now = self.store.pack_index(self.job_id)
        for entry in self.files:
            digests = entry.digest_array()
            lengths = entry.length_array()
            at = self._index.find(digests, lengths)
            relying = (at >= 0) & np.isin(self._index.pack[np.maximum(at, 0)], gone)
            relied = digests[relying]
            lost = np.flatnonzero(now.find(relied, lengths[relying]) < 0)
            if lost.size:
                raise CheckpointConflict(
                    f"chunk {relied[lost[0]].tobytes().hex()} of {entry.path} vanished while job "
                    f"{self.job_id} was checkpointed (a prune ran meanwhile); checkpoint again")

    def commit(self) -> Manifest:
        """Make the checkpoint visible under the next free sequence number, durably."""
        self._check_open()
        if not self.files:
            raise InvalidCheckpointRequest(f"nothing was added to this checkpoint of job {self.job_id}; "
                                           "add its files before commit")
        try:
            with _store_io(self.store.root, f"commit a checkpoint of job {self.job_id}"):
                fence, mine = self.store.read_fence(self.job_id), self.meta.get("restart")
                if fence is not None and isinstance(mine, int) and mine < fence.restart:
                    raise CheckpointConflict(
                        f"job {self.job_id} was restarted (restart {fence.restart}) since this checkpoint "
                        f"of restart {mine} began; it is not committed")
                self._check_packs_kept()
                self._publish_pack()
                for folder in (self._dir, self._dir.parent):
                    _fsync_dir(folder)
                manifest = self._link_manifest()
        finally:
            if self._state == "open":
                self.abort()
            else:
                shutil.rmtree(self._tmp, ignore_errors=True)
                self._unlock()
        return manifest

    def _unlock(self) -> None:
        if self._lock is not None and self._lock >= 0:
            os.close(self._lock)
        self._lock = None

    def _link_manifest(self) -> Manifest:
        folder, created_at = self._dir / "manifests", self.store.clock()
        seqs = self.store.seqs(self.job_id)
        seq = seqs[-1] + 1 if seqs else 1
        while True:
            manifest = Manifest(
                job_id=self.job_id, seq=seq, created_at=created_at, reason=self.reason, meta=self.meta,
                files=tuple(self.files), logical_bytes=sum(f.size for f in self.files),
                new_bytes=self._new_bytes,
            )
            # The number is claimed with a JSON stub of format 2, linked first (link, unlike rename,
            # fails where the name exists): a concurrent writer that took it keeps it, and we take the
            # next one. An older version claims numbers the same way and reads the stub as a manifest
            # of a newer format, which it neither restores nor collects under.
            stub = self._tmp / f"manifest-{seq:08d}.json"
            _write_durably(stub, (json.dumps({"format": FORMAT_VERSION, "manifest": f"{seq:08d}.mf"}) + "\n")
                           .encode())
            try:
                os.link(stub, folder / f"{seq:08d}.json")
            except FileExistsError:
                stub.unlink()
                seq += 1
                continue
            stub.unlink()
            tmp = self._tmp / f"manifest-{seq:08d}.mf"
            try:
                _write_durably(tmp, manifest.to_bytes())
                os.link(tmp, folder / f"{seq:08d}.mf")
            except BaseException:
                (folder / f"{seq:08d}.json").unlink(missing_ok=True)  # the claim goes with the commit
                raise
            self._state = "committed"
            tmp.unlink()
            _fsync_dir(folder)
            return manifest

    def abort(self) -> None:
        """Drop everything this writer did; idempotent, and a no-op after commit."""
        if self._state != "open":
            return
        self._state = "aborted"
        try:
            self._pack.close()
        except OSError:
            pass
        shutil.rmtree(self._tmp, ignore_errors=True)
        # A pack published by a commit that then failed is left to garbage collection: a writer that
        # began since may have deduplicated against it.
        self._unlock()
