"""criu's page-server protocol, received by the agent: a dump's pages go from criu into the store.

Dumping with a page server (`criu_opts.ps`, here a socket criu inherits), criu writes every image
but the page maps and pages into the image folder, and sends those over the socket instead: for
each process (and each shared memory object) it opens a page map, sends its entries in order,
each followed by its pages where it has any, and ends the session with a close that must be
answered. Received here, each page is hashed once and only pages the store lacks are written; no
pages image is written to the spool and read back. What the store then holds is what criu would
have written into the folder: the same page map entries, and a pages image of the same pages in the
same order (image names as criu gives them; pages ids 1, 2, ... in the order of the opens).

The protocol (criu/page-xfer.c): a command is a `struct page_server_iov`, `u32 cmd` (command in
the low 16 bits, page map flags in the high ones), then `nr_pages`, `u64 vaddr` and `u64 dst_id`.
`nr_pages` is a u32 up to criu 4.1 (24 bytes in all) and a u64 from 4.2 on (32 bytes, with 4 of
padding after `cmd`): `header_layout` picks by the criu's version. `dst_id` names the page map:
its id shifted by 8 over its type (1: a process's, 2: shared memory's). OPEN2 is answered with
one byte (has the dump a parent: never here, the write tracker's holes need none), PARENT with an
int32 (0), CLOSE and FORCE_CLOSE with an int32 status. ADD_F carries flags; ADD means PE_PRESENT
and HOLE PE_PARENT (older criu).

`PageSession` decides (no I/O): what a command means, what is answered, how many pages of data
follow. `receive` does the I/O and hands the data to a `sink`.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from singularity_slurm.errors import CheckpointError

from . import incremental
from .manifest import DIGEST

PAGE_SIZE = incremental.PAGE_SIZE
HEADER_4_1 = struct.Struct("<IIQQ")
"""struct page_server_iov up to criu 4.1: u32 cmd, u32 nr_pages, u64 vaddr, u64 dst_id."""
HEADER_4_2 = struct.Struct("<I4xQQQ")
"""struct page_server_iov from criu 4.2 on (64-bit): u32 cmd, padding, u64 nr_pages, vaddr, dst_id."""


def header_layout(version: tuple[int, ...]) -> struct.Struct:
    """The command layout of the criu of `version` (as `criu --version` gives it: (4, 1, 1))."""
    return HEADER_4_1 if tuple(version[:2]) < (4, 2) else HEADER_4_2

PS_IOV_ADD, PS_IOV_HOLE, PS_IOV_OPEN, PS_IOV_OPEN2, PS_IOV_PARENT, PS_IOV_ADD_F, PS_IOV_GET = range(1, 8)
PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE = 0x1023, 0x1024
PS_TYPE_PID, PS_TYPE_SHMEM = 1, 2
KNOWN_FLAGS = incremental.PE_PARENT | incremental.PE_LAZY | incremental.PE_PRESENT | incremental.PE_COW
MAX_PAGES = 1 << 36
"""Pages one entry may name at most (256 TiB): a count beyond what any address space holds is a
broken stream, not a large process."""
BLOCK_PAGES = 1024
"""Pages gathered before they are handed to the sink at once (4 MiB): criu sends many short runs of
a Python heap's pages, and hashing them a run at a time would cost a call each."""


class PageStreamError(CheckpointError):
    """criu's page stream broke its protocol or ended early: the dump is not stored."""


class PageStreamCut(PageStreamError):
    """criu ended the stream without closing it: criu failed (its own error says why) or died."""


@dataclass(frozen=True)
class Header:
    command: int
    flags: int
    pages: int
    vaddr: int
    dst_id: int

    @property
    def image(self) -> str:
        """The page map image this command is about, named as criu names it in a folder."""
        kind, ident = self.dst_id & 0xFF, self.dst_id >> 8
        if kind == PS_TYPE_PID:
            return f"pagemap-{ident}.img"
        if kind == PS_TYPE_SHMEM:
            return f"pagemap-shmem-{ident}.img"
        raise PageStreamError(f"criu sent pages of an unknown page map type {kind} (dst_id {self.dst_id:#x})")


def parse_header(raw: bytes, layout: struct.Struct = HEADER_4_1) -> Header:
    cmd, pages, vaddr, dst_id = layout.unpack(raw)
    return Header(cmd & 0xFFFF, cmd >> 16, pages, vaddr, dst_id)


@dataclass(frozen=True)
class Step:
    """What one command asks of the receiver: bytes to answer, pages of data that follow it, and
    whether the session is over."""

    reply: bytes = b""
    data_pages: int = 0
    end: bool = False


@dataclass
class Stream:
    """One page map as it arrives: its pages image's id and its entries (vaddr, pages, flags)."""

    image: str
    dst_id: int
    pages_id: int
    entries: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def pagemap(self) -> incremental.Pagemap:
        return incremental.Pagemap(self.pages_id, tuple(self.entries))

    @property
    def pages_image(self) -> str:
        return f"pages-{self.pages_id}.img"


@dataclass
class PageSession:
    """The receiving side's state: the page maps opened so far, the one open now."""

    streams: list[Stream] = field(default_factory=list)
    current: Stream | None = None
    ended: bool = False

    def on_header(self, header: Header, failed: bool = False) -> Step:
        """One command: what to answer and how many pages of data follow. `failed`: the sink failed
        earlier, so the session's close is answered with a failure (criu then fails the dump and lets
        the tree run on)."""
        if self.ended:
            raise PageStreamError("criu sent a command after closing its page stream")
        command = header.command
        if command in (PS_IOV_OPEN, PS_IOV_OPEN2):
            self._open(header)
            return Step(reply=b"\0" if command == PS_IOV_OPEN2 else b"")  # no parent images
        if command == PS_IOV_PARENT:
            return Step(reply=struct.pack("<i", 0))
        if command in (PS_IOV_ADD_F, PS_IOV_ADD, PS_IOV_HOLE):
            flags = {PS_IOV_ADD_F: header.flags, PS_IOV_ADD: incremental.PE_PRESENT,
                     PS_IOV_HOLE: incremental.PE_PARENT}[command]
            return Step(data_pages=self._add(header, flags))
        if command in (PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE):
            self.ended, self.current = True, None
            return Step(reply=struct.pack("<i", -1 if failed else 0), end=True)
        if command == PS_IOV_GET:
            raise PageStreamError("criu asked this page stream for pages (a lazy restore's request); it "
                                  "only receives a dump's")
        raise PageStreamError(f"criu sent an unknown page server command {header.command:#x}")

    def _open(self, header: Header) -> None:
        image = header.image
        if any(s.image == image for s in self.streams):
            raise PageStreamError(f"criu opened {image} twice in one dump")
        # pages ids 1, 2, ... in the order of the opens (the agent writes both the page map's head
        # and the pages image, so any distinct ids do)
        self.current = Stream(image, header.dst_id, len(self.streams) + 1)
        self.streams.append(self.current)

    def _add(self, header: Header, flags: int) -> int:
        stream = self.current
        if stream is None or stream.dst_id != header.dst_id:
            raise PageStreamError(f"criu sent pages of {header.image} while "
                                  f"{stream.image if stream else 'no page map'} was open")
        if header.vaddr % PAGE_SIZE or not 0 < header.pages <= MAX_PAGES:
            raise PageStreamError(f"criu sent an entry of {header.pages} pages at {header.vaddr:#x} for "
                                  f"{stream.image}: not a run of whole pages")
        if flags & ~KNOWN_FLAGS:
            raise PageStreamError(f"criu sent page map flags {flags:#x} for {stream.image}, which this "
                                  "agent does not know")
        stream.entries.append((header.vaddr, header.pages, flags))
        return header.pages if flags & incremental.PE_PRESENT else 0


@dataclass(frozen=True)
class Received:
    """A dump's page maps and, by pages image name, the digests of its pages in order."""

    pagemaps: dict[str, incremental.Pagemap]
    digests: dict[str, np.ndarray]
    pages: int  # pages whose data arrived

    def pages_of(self, pagemap_image: str) -> str:
        return f"pages-{self.pagemaps[pagemap_image].pages_id}.img"


Sink = Callable[[memoryview], bytes]
"""Takes whole pages, returns their digests (16 bytes each, in order); the store's writer's."""


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        got = sock.recv_into(view, len(view), socket.MSG_WAITALL)
        if got == 0:
            raise PageStreamCut("criu closed its page stream before the end of the dump")
        view = view[got:]


def receive(sock: socket.socket, sink: Sink, layout: struct.Struct = HEADER_4_1,
            settle: Callable[[], None] | None = None) -> Received:
    """Take one dump's page stream from `sock` until criu closes the session (its commands in
    `layout`, see header_layout). `settle` runs before the close is answered: whatever the sink
    still holds is made durable then, so a store that cannot take it fails the dump while criu can
    still let the tree run on, not after criu has ended it. The sink's (or settle's) first
    failure is answered at the close (criu fails the dump and the tree runs on) and raised then;
    the rest of the data is read and dropped meanwhile, so criu is never left writing into a socket
    nobody reads."""
    session = PageSession()
    buffer = bytearray(BLOCK_PAGES * PAGE_SIZE)
    block = memoryview(buffer)
    raw = bytearray(layout.size)
    digests: dict[str, bytearray] = {}
    held = 0  # pages in the buffer, of session.current
    pages = 0
    failure: BaseException | None = None

    def flush() -> None:
        nonlocal held, failure
        if held and failure is None and session.streams:
            try:
                digests[session.streams[-1].pages_image] += sink(block[:held * PAGE_SIZE])
            except Exception as exc:  # noqa: BLE001 - answered at the close, raised after it
                failure = exc
        held = 0

    while True:
        _recv_exact(sock, memoryview(raw))
        header = parse_header(bytes(raw), layout)
        if header.command in (PS_IOV_OPEN, PS_IOV_OPEN2, PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE):
            flush()  # the pages held are the open page map's: hand them on before it changes
        if header.command in (PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE) and settle is not None and failure is None:
            try:
                settle()
            except Exception as exc:  # noqa: BLE001 - answered at the close, raised after it
                failure = exc
        step = session.on_header(header, failed=failure is not None)
        if header.command in (PS_IOV_OPEN, PS_IOV_OPEN2):
            digests[session.streams[-1].pages_image] = bytearray()
        left = step.data_pages
        pages += left
        while left:
            take = min(left, BLOCK_PAGES - held)
            _recv_exact(sock, block[held * PAGE_SIZE:(held + take) * PAGE_SIZE])
            held += take
            left -= take
            if held == BLOCK_PAGES:
                flush()
        if step.reply:
            sock.sendall(step.reply)
        if step.end:
            break
    if failure is not None:
        raise failure
    return Received({s.image: s.pagemap for s in session.streams},
                    {name: np.frombuffer(bytes(d), DIGEST) for name, d in digests.items()}, pages)
