"""The proxy wire protocol: length-prefixed JSON frames, descriptors alongside, abstract rank names."""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections.abc import Iterator

import pytest

from singularity_slurm.interpose.pyhook._singularity_worker import wire


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        left.settimeout(10)
        right.settimeout(10)
        yield left, right


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


# --- frames ---------------------------------------------------------------------------------------


def test_a_frame_round_trips(pair) -> None:
    left, right = pair
    message = {"op": "allreduce", "count": 3, "nested": {"ranks": [0, 1]}, "text": "é"}

    wire.send(left, message)

    assert wire.Reader(right).recv() == (message, [])


def test_a_frame_is_a_big_endian_length_and_compact_json() -> None:
    assert wire.encode({"a": [1, 2]}) == b"\x00\x00\x00\x0b" + b'{"a":[1,2]}'


def test_a_descriptor_rides_along_and_reaches_the_same_pipe(pair) -> None:
    left, right = pair
    read_end, write_end = os.pipe()
    try:
        wire.send(left, {"ok": True, "bytes": 4096}, [write_end])
        message, fds = wire.Reader(right).recv()
        assert message == {"ok": True, "bytes": 4096}
        assert len(fds) == 1 and fds[0] != write_end
        os.write(fds[0], b"through the passed descriptor")
        os.close(fds[0])
        assert os.read(read_end, 100) == b"through the passed descriptor"
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_frame_near_the_limit_with_a_descriptor_arrives_whole(pair) -> None:
    left, right = pair
    message = {"pad": "x" * (wire.MAX_FRAME - 20)}
    read_end, write_end = os.pipe()
    received: list[tuple[dict, list[int]]] = []
    reader = threading.Thread(target=lambda: received.append(wire.Reader(right).recv()))
    reader.start()
    try:
        wire.send(left, message, [write_end])
        reader.join(timeout=10)
        [(got, fds)] = received
        assert got == message
        assert len(fds) == 1
        os.close(fds[0])
    finally:
        os.close(read_end)
        os.close(write_end)


def test_two_frames_in_one_read_are_returned_one_by_one(pair) -> None:
    left, right = pair
    left.sendall(wire.encode({"n": 1}) + wire.encode({"n": 2}))
    reader = wire.Reader(right)

    assert reader.recv() == ({"n": 1}, [])
    assert reader.recv() == ({"n": 2}, [])


def test_a_frame_split_over_many_writes_is_reassembled(pair) -> None:
    left, right = pair
    frame = wire.encode({"op": "hello", "rank": 3})

    def dribble() -> None:
        for i in range(len(frame)):
            left.send(frame[i:i + 1])

    writer = threading.Thread(target=dribble)
    writer.start()
    try:
        assert wire.Reader(right).recv() == ({"op": "hello", "rank": 3}, [])
    finally:
        writer.join(timeout=10)


def test_a_clean_end_is_eof(pair) -> None:
    left, right = pair
    left.shutdown(socket.SHUT_WR)

    with pytest.raises(EOFError, match="connection closed"):
        wire.Reader(right).recv()


def test_an_end_inside_a_frame_is_eof_and_its_descriptors_are_closed(pair) -> None:
    left, right = pair
    read_end, write_end = os.pipe()
    try:
        before = open_fds()
        socket.send_fds(left, [wire.encode({"op": "map"})[:6]], [write_end])
        left.shutdown(socket.SHUT_WR)
        with pytest.raises(EOFError):
            wire.Reader(right).recv()
        assert open_fds() == before
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_frame_of_exactly_the_limit_is_accepted(pair) -> None:
    left, right = pair
    body = b'{"p":"' + b"y" * (wire.MAX_FRAME - 8) + b'"}'
    assert len(body) == wire.MAX_FRAME
    writer = threading.Thread(target=left.sendall, args=(struct.pack("!I", len(body)) + body,))
    writer.start()
    try:
        message, _ = wire.Reader(right).recv()
    finally:
        writer.join(timeout=10)

    assert len(message["p"]) == wire.MAX_FRAME - 8


def test_an_oversized_length_is_a_protocol_error(pair) -> None:
    left, right = pair
    left.sendall(struct.pack("!I", wire.MAX_FRAME + 1))

    with pytest.raises(wire.ProtocolError) as info:
        wire.Reader(right).recv()

    assert str(info.value) == f"frame length {wire.MAX_FRAME + 1} exceeds {wire.MAX_FRAME}"


def test_an_oversized_message_is_refused_before_sending() -> None:
    with pytest.raises(wire.ProtocolError, match=f"exceeds {wire.MAX_FRAME}$"):
        wire.encode({"pad": "x" * wire.MAX_FRAME})


@pytest.mark.parametrize("body", [b"not json", b"{", b"\xff\xfe"])
def test_a_frame_that_is_not_json_is_a_protocol_error(pair, body: bytes) -> None:
    left, right = pair
    left.sendall(struct.pack("!I", len(body)) + body)

    with pytest.raises(wire.ProtocolError, match="^frame is not JSON: "):
        wire.Reader(right).recv()


@pytest.mark.parametrize("body", [b"[1, 2]", b"42", b'"op"', b"null"])
def test_a_frame_that_is_not_an_object_is_a_protocol_error(pair, body: bytes) -> None:
    left, right = pair
    left.sendall(struct.pack("!I", len(body)) + body)

    with pytest.raises(wire.ProtocolError) as info:
        wire.Reader(right).recv()

    assert str(info.value) == "frame is not a JSON object"


# --- names and peers ------------------------------------------------------------------------------


def test_rank_address_is_a_path_in_the_jobs_folder_under_the_rank_dir() -> None:
    assert wire.rank_address(7, 3, "/run/singularity-slurm/ranks") == "/run/singularity-slurm/ranks/7/3.sock"


def test_rank_addresses_differ_per_job_and_rank() -> None:
    addresses = {wire.rank_address(job, rank, "/r") for job in (7, 8, 70) for rank in (0, 1, 10)}

    assert len(addresses) == 9


def test_rank_address_is_the_same_for_a_job_id_given_as_text() -> None:
    # Workers read the job id from the environment, the proxy gets it as a number.
    assert wire.rank_address("7", 3, "/r/") == wire.rank_address(7, 3, "/r")


@pytest.mark.parametrize(("job", "rank", "folder", "message"), [
    ("../7", 0, "/r", "job id must be a positive integer, got '../7'"),
    (0, 0, "/r", "job id must be a positive integer, got 0"),
    (True, 0, "/r", "job id must be a positive integer, got True"),
    (7, -1, "/r", "rank must be a non-negative integer, got -1"),
    (7, "1", "/r", "rank must be a non-negative integer, got '1'"),
    (7, 0, "r", "the rank socket folder must be an absolute path, got 'r'"),
    (7, 0, "/" + "x" * 100, f"rank socket path /{'x' * 100}/7/0.sock is longer than the 107 bytes a unix "
                            "socket name may have: choose a shorter paths.state_dir"),
])
def test_a_rank_address_from_bad_parts_is_refused(job, rank, folder: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        wire.rank_address(job, rank, folder)

    assert str(info.value) == message


def test_peer_uid_is_the_other_ends_user(pair) -> None:
    left, right = pair

    assert wire.peer_uid(left) == os.getuid()
    assert wire.peer_uid(right) == os.getuid()


# --- bounds on what a peer can make the reader hold -----------------------------------------------


def test_the_reader_never_buffers_past_the_frame_it_assembles(pair) -> None:
    left, right = pair
    first = wire.encode({"n": 1})
    left.sendall(first + b"\xff" * 200_000)  # a frame, then garbage that claims 4 GiB
    reader = wire.Reader(right)

    assert reader.recv() == ({"n": 1}, [])
    assert reader.buffer == b""
    with pytest.raises(wire.ProtocolError) as info:
        reader.recv()
    assert str(info.value) == f"frame length {0xFFFFFFFF} exceeds {wire.MAX_FRAME}"
    assert len(reader.buffer) == 4  # the length alone was read, not what follows


def test_descriptors_beyond_max_fds_for_one_frame_are_closed_and_refused(pair) -> None:
    left, right = pair
    frame = wire.encode({"n": 1})
    before = open_fds()
    for byte in frame[:3]:  # one byte at a time, each with MAX_FDS descriptors
        files = [os.open("/dev/null", os.O_RDONLY) for _ in range(wire.MAX_FDS)]
        socket.send_fds(left, [bytes([byte])], files)
        for fd in files:
            os.close(fd)
    reader = wire.Reader(right)

    with pytest.raises(wire.ProtocolError) as info:
        reader.recv()

    assert str(info.value) == f"more than {wire.MAX_FDS} descriptors came with one frame"
    assert open_fds() == before
