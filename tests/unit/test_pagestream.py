"""criu's page-server protocol as the agent receives it (checkpoint.pagestream), and what the store
makes of a received dump: the decisions without I/O, the receiver over a socket pair with criu's
side played by the test, and a received dump stored and read back as criu would have written it."""

from __future__ import annotations

import random
import socket
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
import xxhash

from singularity_slurm.checkpoint import images, incremental, pagestream
from singularity_slurm.checkpoint.incremental import PAGE_SIZE, PE_COW, PE_PARENT, PE_PRESENT, Pagemap
from singularity_slurm.checkpoint.manifest import DIGEST
from singularity_slurm.checkpoint.pagestream import (
    HEADER_4_1,
    HEADER_4_2,
    PS_IOV_ADD,
    PS_IOV_ADD_F,
    PS_IOV_CLOSE,
    PS_IOV_FORCE_CLOSE,
    PS_IOV_GET,
    PS_IOV_HOLE,
    PS_IOV_OPEN,
    PS_IOV_OPEN2,
    PS_IOV_PARENT,
    Header,
    PageSession,
    PageStreamError,
    header_layout,
)
from singularity_slurm.checkpoint.store import CheckpointStore
from singularity_slurm.errors import CheckpointError, StoreFull

A = 0x7F0000000000
P = PAGE_SIZE


def pid_map(ident: int) -> int:
    return ident << 8 | pagestream.PS_TYPE_PID


def shmem_map(ident: int) -> int:
    return ident << 8 | pagestream.PS_TYPE_SHMEM


def cmd(command: int, pages: int = 0, vaddr: int = 0, dst: int = 0, flags: int = 0) -> Header:
    return Header(command, flags, pages, vaddr, dst)


def page(seed: int) -> bytes:
    return random.Random(seed).randbytes(P)


def digest(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


# --- decisions ------------------------------------------------------------------------------------


def test_the_layout_follows_criu_s_version() -> None:
    assert header_layout((4, 1, 1)) is HEADER_4_1 and HEADER_4_1.size == 24
    assert header_layout((3, 19)) is HEADER_4_1
    assert header_layout((4, 2)) is HEADER_4_2 and HEADER_4_2.size == 32


def test_a_session_answers_opens_and_closes_and_names_images_as_criu_does() -> None:
    session = PageSession()
    assert session.on_header(cmd(PS_IOV_OPEN2, dst=pid_map(1))).reply == b"\0"  # no parent images
    step = session.on_header(cmd(PS_IOV_ADD_F, 2, A, pid_map(1), PE_PRESENT))
    assert step.data_pages == 2 and step.reply == b""
    assert session.on_header(cmd(PS_IOV_ADD_F, 3, A + 4 * P, pid_map(1), PE_COW)).data_pages == 0
    assert session.on_header(cmd(PS_IOV_ADD_F, 1, A + 9 * P, pid_map(1), PE_PARENT)).data_pages == 0
    assert session.on_header(cmd(PS_IOV_OPEN, dst=shmem_map(77))).reply == b""
    assert session.on_header(cmd(PS_IOV_ADD, 1, 0, shmem_map(77))).data_pages == 1
    assert session.on_header(cmd(PS_IOV_HOLE, 1, P, shmem_map(77))).data_pages == 0
    assert session.on_header(cmd(PS_IOV_PARENT, dst=pid_map(2))).reply == struct.pack("<i", 0)
    end = session.on_header(cmd(PS_IOV_FORCE_CLOSE))
    assert end.end and end.reply == struct.pack("<i", 0)
    assert [(s.image, s.pages_image) for s in session.streams] == [
        ("pagemap-1.img", "pages-1.img"), ("pagemap-shmem-77.img", "pages-2.img")]
    assert session.streams[0].pagemap == Pagemap(1, ((A, 2, PE_PRESENT), (A + 4 * P, 3, PE_COW),
                                                     (A + 9 * P, 1, PE_PARENT)))
    assert session.streams[1].entries == [(0, 1, PE_PRESENT), (P, 1, PE_PARENT)]


def test_a_failed_sink_is_answered_at_the_close_so_criu_fails_the_dump() -> None:
    session = PageSession()
    session.on_header(cmd(PS_IOV_OPEN2, dst=pid_map(1)))
    assert session.on_header(cmd(PS_IOV_CLOSE), failed=True).reply == struct.pack("<i", -1)


@pytest.mark.parametrize(("headers", "problem"), [
    ([cmd(PS_IOV_ADD_F, 1, A, pid_map(1), PE_PRESENT)], "while no page map was open"),
    ([cmd(PS_IOV_OPEN2, dst=pid_map(1)), cmd(PS_IOV_ADD_F, 1, A, pid_map(2), PE_PRESENT)],
     "pages of pagemap-2.img while pagemap-1.img was open"),
    ([cmd(PS_IOV_OPEN2, dst=pid_map(1)), cmd(PS_IOV_OPEN2, dst=pid_map(1))], "opened pagemap-1.img twice"),
    ([cmd(PS_IOV_OPEN2, dst=pid_map(1)), cmd(PS_IOV_ADD_F, 1, A + 1, pid_map(1), PE_PRESENT)],
     "not a run of whole pages"),
    ([cmd(PS_IOV_OPEN2, dst=pid_map(1)), cmd(PS_IOV_ADD_F, 0, A, pid_map(1), PE_PRESENT)],
     "not a run of whole pages"),
    ([cmd(PS_IOV_OPEN2, dst=pid_map(1)), cmd(PS_IOV_ADD_F, 1, A, pid_map(1), 0x40)], "flags 0x40"),
    ([cmd(PS_IOV_OPEN2, dst=9 << 8 | 5)], "unknown page map type 5"),
    ([cmd(PS_IOV_GET, 1, A, pid_map(1))], "a lazy restore's request"),
    ([cmd(0x77)], "unknown page server command 0x77"),
    ([cmd(PS_IOV_CLOSE), cmd(PS_IOV_OPEN2, dst=pid_map(1))], "after closing"),
])
def test_a_stream_that_breaks_the_protocol_is_refused_by_name(headers: list[Header], problem: str) -> None:
    session = PageSession()
    with pytest.raises(PageStreamError, match=problem):
        for header in headers:
            session.on_header(header)


# --- the receiver, criu's side played over a socket pair ---------------------------------------------


class FakeCriu:
    """Sends what criu's page-xfer sends, in the 4.1 layout, and reads its answers."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def send(self, command: int, pages: int = 0, vaddr: int = 0, dst: int = 0, flags: int = 0,
             data: bytes = b"") -> None:
        self.sock.sendall(HEADER_4_1.pack(flags << 16 | command, pages, vaddr, dst) + data)

    def answer(self, size: int) -> bytes:
        got = b""
        while len(got) < size:
            chunk = self.sock.recv(size - len(got))
            assert chunk, "the receiver closed the stream"
            got += chunk
        return got


def run_receiver(sink) -> tuple[FakeCriu, threading.Thread, dict]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["received"] = pagestream.receive(ours, sink)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            outcome["error"] = exc
        finally:
            ours.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return FakeCriu(theirs), thread, outcome


def test_pages_reach_the_sink_in_blocks_and_each_image_gets_its_own_digests(monkeypatch) -> None:
    monkeypatch.setattr(pagestream, "BLOCK_PAGES", 3)
    calls: list[int] = []

    def sink(data: memoryview) -> bytes:
        calls.append(len(data) // P)
        return b"".join(digest(bytes(data[i:i + P])) for i in range(0, len(data), P))

    criu, thread, outcome = run_receiver(sink)
    criu.send(PS_IOV_OPEN2, dst=pid_map(1))
    assert criu.answer(1) == b"\0"
    criu.send(PS_IOV_ADD_F, 2, A, pid_map(1), PE_PRESENT, page(1) + page(2))
    criu.send(PS_IOV_ADD_F, 1, A + 5 * P, pid_map(1), PE_COW)
    criu.send(PS_IOV_ADD_F, 3, A + 8 * P, pid_map(1), PE_PRESENT, page(3) + page(4) + page(5))
    criu.send(PS_IOV_OPEN2, dst=pid_map(2))
    assert criu.answer(1) == b"\0"
    criu.send(PS_IOV_ADD_F, 1, A, pid_map(2), PE_PRESENT, page(6))
    criu.send(PS_IOV_OPEN2, dst=pid_map(3))  # a process with no pages at all
    assert criu.answer(1) == b"\0"
    criu.send(PS_IOV_FORCE_CLOSE)
    assert criu.answer(4) == struct.pack("<i", 0)
    thread.join(10)
    received = outcome["received"]
    assert calls == [3, 2, 1]  # a block of 3 across two entries, the rest at the next open
    assert received.pages == 6
    assert received.pagemaps["pagemap-1.img"].entries == ((A, 2, PE_PRESENT), (A + 5 * P, 1, PE_COW),
                                                         (A + 8 * P, 3, PE_PRESENT))
    assert received.pages_of("pagemap-2.img") == "pages-2.img"
    assert received.digests["pages-1.img"].tobytes() == b"".join(digest(page(s)) for s in (1, 2, 3, 4, 5))
    assert received.digests["pages-2.img"].tobytes() == digest(page(6))
    assert received.digests["pages-3.img"].size == 0


def test_a_sink_failure_reads_the_rest_answers_the_close_with_failure_and_is_raised() -> None:
    def sink(data: memoryview) -> bytes:
        raise StoreFull("the store is full (test)")

    criu, thread, outcome = run_receiver(sink)
    criu.send(PS_IOV_OPEN2, dst=pid_map(1))
    criu.answer(1)
    for n in range(2000):  # more than a block and a socket buffer: criu is never left blocked
        criu.send(PS_IOV_ADD_F, 1, A + n * P, pid_map(1), PE_PRESENT, page(n % 7))
    criu.send(PS_IOV_FORCE_CLOSE)
    assert criu.answer(4) == struct.pack("<i", -1)
    thread.join(10)
    assert isinstance(outcome["error"], StoreFull)


def test_a_stream_cut_before_its_close_is_an_error_not_a_dump() -> None:
    criu, thread, outcome = run_receiver(lambda data: b"\0" * 16 * (len(data) // P))
    criu.send(PS_IOV_OPEN2, dst=pid_map(1))
    criu.answer(1)
    criu.send(PS_IOV_ADD_F, 4, A, pid_map(1), PE_PRESENT, page(1))  # 1 of its 4 pages, then gone
    criu.sock.close()
    thread.join(10)
    assert isinstance(outcome["error"], PageStreamError)
    assert "closed its page stream before the end" in str(outcome["error"])


# --- a received dump in the store -----------------------------------------------------------------------


def received_dump(store: CheckpointStore, writer, pagemaps: dict[str, Pagemap],
                  pages: dict[str, list[bytes]]) -> pagestream.Received:
    """What `receive` gives for these page maps and pages, their chunks put through `writer`."""
    digests = {}
    for name, content in pages.items():
        data = b"".join(content)
        digests[name] = np.frombuffer(writer.put_chunks(data, P) if data else b"", DIGEST)
    return pagestream.Received(pagemaps, digests, sum(len(c) for c in pages.values()))


def test_a_received_dump_is_stored_as_the_folder_criu_would_have_written(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "store", max_chunk=P)
    folder = tmp_path / "images"
    folder.mkdir()
    (folder / "core-1.img").write_bytes(b"core" * 100)
    pagemaps = {"pagemap-1.img": Pagemap(1, ((A, 2, PE_PRESENT), (A + 4 * P, 1, PE_PRESENT))),
                "pagemap-2.img": Pagemap(2, ((A, 3, PE_COW),))}
    with store.begin(1, reason="preemption", meta={"node": "n1"}) as writer:
        received = received_dump(store, writer, pagemaps, {"pages-1.img": [page(1), page(2), page(1)],
                                                           "pages-2.img": []})
        writer.add_meta({"dump_seconds": 1.5})
        images.add_images(writer, folder, None, received=received)
        manifest = writer.commit()
    assert manifest.meta == {"node": "n1", "dump_seconds": 1.5}
    pagemap_bytes = sum(f.size for f in manifest.files if "pagemap-" in f.path)
    assert manifest.new_bytes == 2 * P + 400 + pagemap_bytes  # page 1 once, page 2, the core image
    out = images.download(store, manifest, tmp_path / "restored")
    assert sorted(p.name for p in out.iterdir()) == ["core-1.img", "pagemap-1.img", "pagemap-2.img",
                                                     "pages-1.img", "pages-2.img"]
    assert (out / "pages-1.img").read_bytes() == page(1) + page(2) + page(1)
    assert (out / "pages-2.img").read_bytes() == b""
    assert incremental.parse_pagemap((out / "pagemap-1.img").read_bytes()) == pagemaps["pagemap-1.img"]
    assert (out / "core-1.img").read_bytes() == b"core" * 100


def test_a_received_incremental_dump_takes_its_holes_from_the_base_and_stores_only_the_new(
        tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "store", max_chunk=P)
    folder = tmp_path / "images"
    folder.mkdir()
    (folder / "pstree.img").write_bytes(images_pstree([(1, 0)]))
    with store.begin(1, reason="periodic", meta={}) as writer:
        received = received_dump(store, writer, {"pagemap-1.img": Pagemap(1, ((A, 3, PE_PRESENT),))},
                                 {"pages-1.img": [page(1), page(2), page(3)]})
        images.add_images(writer, folder, None, received=received)
        base = writer.commit()
    with store.begin(1, reason="preemption", meta={}) as writer:
        received = received_dump(store, writer, {"pagemap-1.img": Pagemap(1, (
            (A, 1, PE_PARENT), (A + P, 1, PE_PRESENT), (A + 2 * P, 1, PE_PARENT)))},
            {"pages-1.img": [page(9)]})
        images.add_images(writer, folder, base, received=received)
        later = writer.commit()
    assert later.meta["incremental"] == {"base": base.seq, "pages_taken": 2, "pages_dumped": 1}
    pagemap_bytes = sum(f.size for f in later.files if "pagemap-" in f.path)
    assert later.new_bytes == P + pagemap_bytes  # page 9 and the new page map; pstree is the base's
    out = images.download(store, later, tmp_path / "restored")
    assert (out / "pages-1.img").read_bytes() == page(1) + page(9) + page(3)
    entries = incremental.parse_pagemap((out / "pagemap-1.img").read_bytes()).entries
    assert entries == ((A, 1, PE_PRESENT), (A + P, 1, PE_PRESENT), (A + 2 * P, 1, PE_PRESENT))

    with store.begin(1, reason="preemption", meta={}) as writer:
        received = received_dump(store, writer, {"pagemap-1.img": Pagemap(1, ((A + 50 * P, 1, PE_PARENT),))},
                                 {"pages-1.img": []})
        with pytest.raises(CheckpointError, match="leaves unwritten pages to checkpoint"):
            images.add_images(writer, folder, base, received=received)


def test_a_file_of_chunks_nobody_stored_is_refused(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "store", max_chunk=P)
    with store.begin(1, reason="preemption", meta={}) as writer:
        writer.put_chunks(page(1), P)
        with pytest.raises(CheckpointError, match="neither in the store nor among the chunks"):
            writer.add_chunked("images/pages-1.img", np.frombuffer(digest(page(1)) + digest(page(2)), DIGEST),
                               chunk=P)
        with pytest.raises(CheckpointError, match="not whole chunks"):
            writer.put_chunks(b"x" * (P + 1), P)


def images_pstree(pairs: list[tuple[int, int]]) -> bytes:
    import io

    import pycriu

    out = io.BytesIO()
    pycriu.images.dump({"magic": "PSTREE", "entries": [
        {"pid": pid, "ppid": ppid, "pgid": pid, "sid": pid} for pid, ppid in pairs]}, out)
    return out.getvalue()


def test_what_the_sink_holds_is_settled_before_the_close_is_answered_and_a_failure_there_fails_it() -> None:
    order: list[str] = []
    for fails in (False, True):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        criu, outcome = FakeCriu(theirs), {}

        def settle(fails: bool = fails) -> None:
            order.append("settled")
            if fails:
                raise StoreFull("the store is full at the end (test)")

        def run(ours: socket.socket = ours, settle=settle, outcome: dict = outcome) -> None:
            try:
                outcome["received"] = pagestream.receive(ours, lambda d: digest(bytes(d)), settle=settle)
            except Exception as exc:  # noqa: BLE001 - the test reads it
                outcome["error"] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        criu.send(PS_IOV_OPEN2, dst=pid_map(1))
        criu.answer(1)
        criu.send(PS_IOV_ADD_F, 1, A, pid_map(1), PE_PRESENT, page(1))
        criu.send(PS_IOV_FORCE_CLOSE)
        reply = criu.answer(4)
        order.append("answered")
        thread.join(10)
        assert reply == struct.pack("<i", -1 if fails else 0)
        assert isinstance(outcome.get("error"), StoreFull) if fails else outcome["received"].pages == 1
    assert order == ["settled", "answered"] * 2


def test_a_receiver_that_refuses_the_stream_ends_it_so_criu_is_not_left_waiting() -> None:
    import os

    from singularity_slurm.checkpoint.criu import _PageReceiver

    receiver = _PageReceiver(lambda d: b"", HEADER_4_1, None)
    criu = FakeCriu(socket.socket(fileno=os.dup(receiver.criu_end.fileno())))  # criu's copy
    receiver.start()
    try:
        criu.send(0x77)  # unknown: the receiver gives up, criu would now wait for an answer
        criu.sock.settimeout(10)
        assert criu.sock.recv(1) == b"", "criu would wait for an answer that never comes"
        assert isinstance(receiver.failure(), PageStreamError)
    finally:
        criu.sock.close()
        receiver.close()


def test_sync_chunks_puts_the_buffered_chunks_into_the_pack(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "store", max_chunk=P)
    with store.begin(1, reason="preemption", meta={}) as writer:
        writer.put_chunks(page(1) + page(2), P)
        pack = next((tmp_path / "store").rglob("chunks.pack"))
        assert pack.stat().st_size == 0  # buffered until a block is full
        writer.sync_chunks()
        assert pack.read_bytes() == page(1) + page(2)
