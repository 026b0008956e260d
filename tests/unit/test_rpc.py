"""The one RPC layer: frames checked before they are read, peer identity, connection caps, typed errors."""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from singularity_slurm import rpc
from singularity_slurm.errors import NoCheckpoint, SingularityError
from singularity_slurm.interpose.pyhook._singularity_worker import wire


def echo(request: dict, call: rpc.Call) -> dict:
    if request.get("op") == "fail":
        raise rpc.Conflict("the tree already runs")
    if request.get("op") == "crash":
        raise RuntimeError("boom")
    if request.get("op") == "nocheckpoint":
        try:
            raise NoCheckpoint("job 7 has no committed checkpoint")
        except NoCheckpoint as exc:
            raise rpc.RequestError(f"no committed checkpoint of job 7: {exc}") from exc
    if request.get("op") == "hold":
        time.sleep(float(request["seconds"]))
    return {"ok": True, "peer": [call.peer.pid, call.peer.uid, call.peer.gid], "op": request.get("op")}


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., tuple[rpc.Server, Path]]]:
    servers: list[rpc.Server] = []

    def start(handler: rpc.Handler = echo, **kw) -> tuple[rpc.Server, Path]:
        path = tmp_path / f"s{len(servers)}.sock"
        limits = kw.pop("limits", None)
        server = rpc.Server(path, handler, name="the test server", limits=limits, **kw).start()
        servers.append(server)
        return server, path

    yield start
    for server in servers:
        server.close()


def connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(path))
    return sock


def read_reply(sock: socket.socket) -> dict:
    reply = rpc.read_frame(sock, rpc.MAX_REQUEST, time.monotonic() + 10)
    assert reply is not None
    return reply


# --- round trips and typed errors ------------------------------------------------------------------


def test_a_request_round_trips_and_the_handler_sees_the_callers_credentials(serve) -> None:
    _, path = serve()

    reply = rpc.call(path, {"op": "ping"})

    assert reply == {"ok": True, "peer": [os.getpid(), os.getuid(), os.getgid()], "op": "ping"}


def test_a_handlers_typed_error_comes_back_as_its_class_and_kind(serve) -> None:
    _, path = serve()

    with pytest.raises(rpc.Conflict) as caught:
        rpc.call(path, {"op": "fail"})

    assert caught.value.kind == "conflict"
    assert str(caught.value) == "the tree already runs"
    assert isinstance(caught.value, SingularityError)


def test_the_reply_carries_kind_and_message() -> None:
    assert rpc.error_reply(rpc.Busy("full")) == {"ok": False, "error": "full", "kind": "busy"}
    assert rpc.error_reply(ValueError("x")) == {"ok": False, "error": "x", "kind": "failed"}


def test_a_no_checkpoint_cause_gives_its_kind(serve) -> None:
    _, path = serve()

    with pytest.raises(rpc.NoCheckpointFound, match="no committed checkpoint of job 7"):
        rpc.call(path, {"op": "nocheckpoint"})


def test_an_unexpected_handler_exception_is_a_failed_reply_and_the_server_serves_on(serve) -> None:
    _, path = serve()

    with pytest.raises(rpc.Failed, match="crash failed: boom"):
        rpc.call(path, {"op": "crash"})
    assert rpc.call(path, {"op": "ping"})["ok"] is True


@pytest.mark.parametrize(("reply", "cls", "kind"), [
    ({"ok": False, "error": "x", "kind": "busy"}, rpc.Busy, "busy"),
    ({"ok": False, "error": "x", "kind": "forbidden"}, rpc.Forbidden, "forbidden"),
    ({"ok": False, "error": "x", "kind": "some_new_kind"}, rpc.RemoteError, "some_new_kind"),
    ({"ok": False, "error": "x"}, rpc.RemoteError, "refused"),
    ({"ok": False, "error": 3, "kind": ["x"]}, rpc.RemoteError, "refused"),
    ({"error": "x"}, rpc.BrokenReply, "protocol"),
    ([1, 2], rpc.BrokenReply, "protocol"),
])
def test_replies_map_to_exception_classes(reply, cls, kind) -> None:
    with pytest.raises(cls) as caught:
        rpc.raise_for(reply)
    assert type(caught.value) is cls and caught.value.kind == kind


def test_pipelined_requests_on_one_connection_are_answered_in_order(serve) -> None:
    _, path = serve()
    with connect(path) as sock:
        sock.sendall(wire.encode({"op": "a"}) + wire.encode({"op": "b"}))
        assert read_reply(sock)["op"] == "a"
        assert read_reply(sock)["op"] == "b"


# --- transport failures are typed too -----------------------------------------------------------------


def test_a_missing_socket_is_unreachable(tmp_path: Path) -> None:
    with pytest.raises(rpc.Unreachable, match=r"cannot reach the node agent at .*absent.sock"):
        rpc.call(tmp_path / "absent.sock", {"op": "ping"}, service="the node agent")


def test_a_socket_nobody_listens_on_is_unreachable(tmp_path: Path) -> None:
    path = tmp_path / "dead.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()
    with pytest.raises(rpc.Unreachable):
        rpc.call(path, {"op": "ping"})


def _raw_server(path: Path, answer: Callable[[socket.socket], None]) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def run() -> None:
        conn, _ = listener.accept()
        with conn:
            answer(conn)

    threading.Thread(target=run, daemon=True).start()
    return listener


@pytest.mark.parametrize(("answer", "cls", "words"), [
    (lambda c: c.sendall(b'{"ok": true}\n'), rpc.BrokenReply, "not a reply"),  # the old line protocol
    (lambda c: c.sendall(struct.pack("!I", 5) + b"nope!"), rpc.BrokenReply, "not JSON"),
    (lambda c: c.sendall(struct.pack("!I", 2) + b"[]"), rpc.BrokenReply, "not a JSON object"),
    (lambda c: c.sendall(struct.pack("!I", 100) + b"{}"), rpc.BrokenReply, "broke the connection"),
    (lambda c: None, rpc.BrokenReply, "without answering"),
    (lambda c: c.sendall(wire.encode({"answer": 1})), rpc.BrokenReply, "not a reply"),
])
def test_a_garbled_or_missing_reply_is_a_broken_reply(tmp_path: Path, answer, cls, words) -> None:
    path = tmp_path / "raw.sock"

    def reply(conn: socket.socket) -> None:
        conn.recv(1 << 16)
        answer(conn)

    with _raw_server(path, reply):
        with pytest.raises(cls, match=words):
            rpc.call(path, {"op": "ping"})


def test_a_server_that_does_not_answer_times_out(tmp_path: Path) -> None:
    path = tmp_path / "mute.sock"
    done = threading.Event()
    with _raw_server(path, lambda conn: done.wait(10)):
        started = time.monotonic()
        with pytest.raises(rpc.TimedOut, match="did not answer ping within 0.3s"):
            rpc.call(path, {"op": "ping"}, timeout=0.3)
        assert time.monotonic() - started < 2
        done.set()


def test_a_request_too_large_to_send_is_refused_before_connecting(tmp_path: Path) -> None:
    with pytest.raises(rpc.TooLarge):
        rpc.call(tmp_path / "absent.sock", {"op": "x", "pad": "x" * rpc.MAX_REQUEST})


# --- bounds -------------------------------------------------------------------------------------------


def test_a_header_claiming_2_gib_is_refused_at_once_without_reading_a_body(serve) -> None:
    server, path = serve()
    with connect(path) as sock:
        started = time.monotonic()
        sock.sendall(struct.pack("!I", (1 << 31)))
        reply = read_reply(sock)
        assert reply == {"ok": False, "kind": "too_large",
                         "error": f"request of {1 << 31} bytes is over the {rpc.MAX_REQUEST}-byte limit"}
        assert sock.recv(1) == b""  # then closed: the stream cannot be resynchronised
        assert time.monotonic() - started < 2
    assert rpc.call(path, {"op": "ping"})["ok"] is True


def test_an_oversized_body_is_refused_and_not_read(serve) -> None:
    """A 64 MiB body after a truthful header: refused from the header; the server reads no more."""
    _, path = serve(limits=rpc.Limits(max_request=1024))
    with connect(path) as sock:
        body = b"x" * (64 << 20)
        try:
            sock.sendall(struct.pack("!I", len(body)) + body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server closed its end after answering
        assert read_reply(sock)["kind"] == "too_large"
    assert rpc.call(path, {"op": "ping"})["ok"] is True


def test_a_request_of_the_limit_is_served_one_byte_more_is_not(serve) -> None:
    _, path = serve(limits=rpc.Limits(max_request=200))
    fits = {"op": "ping", "pad": ""}
    fits["pad"] = "x" * (200 - len(json.dumps(fits, separators=(",", ":"))))
    assert rpc.call(path, fits)["ok"] is True
    fits["pad"] += "x"
    with pytest.raises(rpc.TooLarge):
        rpc.call(path, fits)


def test_garbage_is_a_bad_request_and_the_server_serves_on(serve) -> None:
    _, path = serve()
    with connect(path) as sock:
        sock.sendall(struct.pack("!I", 4) + b"junk")
        assert read_reply(sock)["kind"] == "bad_request"
    assert rpc.call(path, {"op": "ping"})["ok"] is True


def test_an_idle_connection_is_closed_and_its_slot_freed(serve) -> None:
    server, path = serve(limits=rpc.Limits(max_connections=1, root_reserve=0, idle_timeout=0.3))
    with connect(path) as idle:
        started = time.monotonic()
        assert idle.recv(1) == b""  # closed by the server
        assert 0.2 < time.monotonic() - started < 3
    assert rpc.call(path, {"op": "ping"})["ok"] is True


def test_a_slow_sender_is_closed_at_the_deadline_whatever_it_trickles(serve) -> None:
    _, path = serve(limits=rpc.Limits(idle_timeout=0.5))
    with connect(path) as slow:
        frame = wire.encode({"op": "ping", "pad": "x" * 100})
        started = time.monotonic()
        closed = False
        for byte in frame:
            try:
                slow.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.05)
        if not closed:
            assert slow.recv(1) == b""
        assert time.monotonic() - started < 3


def test_connections_past_the_cap_are_answered_busy_and_closed(serve) -> None:
    server, path = serve(limits=rpc.Limits(max_connections=3, root_reserve=0))
    held = [connect(path) for _ in range(3)]
    try:
        for sock in held:  # each is being served (a request answered), so each holds a slot
            sock.sendall(wire.encode({"op": "ping"}))
            assert read_reply(sock)["ok"] is True
        with pytest.raises(rpc.Busy, match="serves 3 connections already"):
            rpc.call(path, {"op": "ping"})
        assert server.active == 3
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 5
    while server.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rpc.call(path, {"op": "ping"})["ok"] is True


def test_a_busy_server_is_retried_when_the_caller_asks(serve) -> None:
    server, path = serve(limits=rpc.Limits(max_connections=1, root_reserve=0))
    holder = connect(path)
    holder.sendall(wire.encode({"op": "ping"}))
    read_reply(holder)
    threading.Timer(0.3, holder.close).start()

    assert rpc.call(path, {"op": "ping"}, busy_retry_s=10)["ok"] is True


def test_root_has_slots_past_the_cap() -> None:
    limits = rpc.Limits(max_connections=2, root_reserve=1)
    assert rpc.admit(1000, 1, limits) and not rpc.admit(1000, 2, limits)
    assert rpc.admit(0, 2, limits) and not rpc.admit(0, 3, limits)


def test_the_thread_count_stays_within_the_cap(serve) -> None:
    _, path = serve(limits=rpc.Limits(max_connections=4, root_reserve=0))
    before = threading.active_count()
    socks = [connect(path) for _ in range(40)]
    try:
        for sock in socks:
            try:
                sock.sendall(wire.encode({"op": "hold", "seconds": 0.5}))
            except (BrokenPipeError, ConnectionResetError):
                pass  # answered busy and closed already
        time.sleep(0.2)
        assert threading.active_count() - before <= 4
    finally:
        for sock in socks:
            sock.close()


def test_a_refused_peer_gets_forbidden_before_anything_is_read(serve) -> None:
    seen: list[rpc.Peer] = []

    def allow(peer: rpc.Peer) -> str | None:
        seen.append(peer)
        return "uid not welcome"

    _, path = serve(allow=allow)
    with pytest.raises(rpc.Forbidden, match="uid not welcome"):
        rpc.call(path, {"op": "ping"})
    assert seen == [rpc.Peer(os.getpid(), os.getuid(), os.getgid())]


def test_the_socket_has_the_mode_asked_for(serve) -> None:
    _, path = serve(mode=0o666)
    assert path.stat().st_mode & 0o777 == 0o666


def test_closing_the_server_removes_its_socket(serve) -> None:
    server, path = serve()
    server.close()
    assert not path.exists()
    with pytest.raises(rpc.Unreachable):
        rpc.call(path, {"op": "ping"})


def test_after_reply_callbacks_run_once_the_caller_closed(serve) -> None:
    ran = threading.Event()

    def handler(request: dict, call: rpc.Call) -> dict:
        call.after_reply.append(ran.set)
        return {"ok": True}

    _, path = serve(handler)
    with connect(path) as sock:
        sock.sendall(wire.encode({"op": "x"}))
        read_reply(sock)
        assert not ran.wait(0.2)
    assert ran.wait(5)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user")
def test_peer_credentials_of_another_user_reach_allow() -> None:
    import subprocess
    import sys
    import tempfile

    seen: list[rpc.Peer] = []
    folder = Path(tempfile.mkdtemp(prefix="rpc-test-"))
    os.chmod(folder, 0o755)
    server = rpc.Server(folder / "s.sock", echo, name="the test server", mode=0o666,
                        allow=lambda peer: seen.append(peer) or "no").start()
    path = server.path
    code = ("import sys; from singularity_slurm import rpc\n"
            "try:\n rpc.call(sys.argv[1], {'op': 'ping'})\nexcept rpc.Forbidden as e: print(e.kind)")
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                          "-c", code, str(path)], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    server.close()
    folder.rmdir()
    assert out.stdout.strip() == "forbidden", out.stderr
    assert [(p.uid, p.gid) for p in seen] == [(65534, 65534)]


def test_warnings_about_refused_peers_are_throttled_so_a_connect_loop_cannot_fill_the_log():
    now = [0.0]
    records: list[str] = []

    class Recorder(logging.Logger):
        def warning(self, message, *args, **kwargs):  # type: ignore[override]
            records.append(message % args)

    throttled = rpc.Throttled(Recorder("t"), burst=3, window=60, clock=lambda: now[0])
    for i in range(100):
        throttled.warning("refused %d", i)
    assert records == ["refused 0", "refused 1", "refused 2"]
    now[0] = 61.0
    throttled.warning("refused %d", 100)
    assert records[3:] == ["97 more such warnings in the last 60 s", "refused 100"]
