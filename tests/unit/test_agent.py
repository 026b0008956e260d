"""The node agent: who is served, what is answered, and a real agent process on a unix socket."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from singularity_slurm.node.agent import (
    MAX_REQUEST,
    AgentState,
    authorized,
    main,
    peer_credentials,
    request,
)

JOB_UID = 1001


# --- authorization and dispatch (pure) ------------------------------------------------------------


def test_root_and_the_job_user_are_authorized_nobody_else() -> None:
    assert authorized(0, JOB_UID) is True
    assert authorized(JOB_UID, JOB_UID) is True
    assert authorized(1002, JOB_UID) is False
    assert authorized(65534, JOB_UID) is False


@pytest.mark.parametrize("peer_uid", [0, JOB_UID])
def test_ping_from_an_authorized_peer_names_job_node_and_pid(peer_uid: int) -> None:
    state = AgentState(job_id=7, job_uid=JOB_UID, node="n9")

    assert state.handle({"op": "ping"}, peer_uid) == {
        "ok": True, "job_id": 7, "node": "n9", "pid": os.getpid(),
    }


def test_other_user_is_refused_with_uid_and_job_named() -> None:
    state = AgentState(job_id=7, job_uid=JOB_UID, node="n9")

    assert state.handle({"op": "ping"}, 1002) == {
        "ok": False, "error": "uid 1002 may not act on job 7",
    }


def test_other_user_is_refused_before_the_op_is_looked_at() -> None:
    state = AgentState(job_id=7, job_uid=JOB_UID, node="n9")

    assert state.handle({"op": "dump"}, 1002) == {
        "ok": False, "error": "uid 1002 may not act on job 7",
    }


VALID_OPS = ("checkpoint, command_done, devices, generations, kill, latest, launcher_checkpoint, migrate, "
             "next_command, ping, requeue, restore, start, status, wait")


@pytest.mark.parametrize(("request_", "shown"), [
    ({"op": "dump"}, "'dump'"), ({}, "None"), ({"op": ["ping"]}, "['ping']"),
])
def test_unknown_op_lists_the_valid_ops(request_: dict, shown: str) -> None:
    state = AgentState(job_id=7, job_uid=JOB_UID, node="n9")

    assert state.handle(request_, JOB_UID) == {
        "ok": False, "error": f"unknown op {shown}; valid ops: {VALID_OPS}",
    }


def test_peer_credentials_identify_the_other_end() -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        assert peer_credentials(left) == (os.getpid(), os.getuid(), os.getgid())


def test_command_line_requires_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--job-id", "7", "--uid", "1001", "--node", "n9"])

    assert info.value.code == 2
    assert "--socket" in capsys.readouterr().err


# --- a real agent process -------------------------------------------------------------------------


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    # A unix socket path must fit in 108 bytes; pytest's tmp_path may not.
    with tempfile.TemporaryDirectory(prefix="sa-", dir="/tmp") as path:
        yield Path(path)


def connectable(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            return False
    return True


@pytest.fixture
def start_agent(socket_dir: Path) -> Iterator[Callable[..., subprocess.Popen]]:
    started: list[subprocess.Popen] = []

    def launch(uid: int = os.getuid(), path: Path | None = None) -> subprocess.Popen:
        path = path or socket_dir / "agent.sock"
        proc = subprocess.Popen(
            [sys.executable, "-m", "singularity_slurm.node.agent", "--job-id", "7",
             "--uid", str(uid), "--node", "n9", "--socket", str(path), "--no-engine"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        started.append(proc)
        deadline = time.monotonic() + 20
        while not connectable(path):
            if proc.poll() is not None:
                pytest.fail(f"agent exited with {proc.returncode}: {proc.communicate()[1]}")
            if time.monotonic() > deadline:
                pytest.fail("agent did not listen within 20s")
            time.sleep(0.05)
        return proc

    yield launch
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


class Conversation:
    """One connection to the agent, one JSON line each way."""

    def __init__(self, path: Path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(str(path))
        self.replies = self.sock.makefile("rb")

    def send(self, raw: bytes) -> None:
        self.sock.sendall(raw)

    def reply(self) -> dict:
        return json.loads(self.replies.readline())

    def close(self) -> None:
        self.replies.close()
        self.sock.close()


def test_ping_round_trip(start_agent, socket_dir: Path) -> None:
    proc = start_agent()

    assert request(socket_dir / "agent.sock", {"op": "ping"}) == {
        "ok": True, "job_id": 7, "node": "n9", "pid": proc.pid,
    }


def test_socket_is_open_to_all_and_no_temporary_is_left(start_agent, socket_dir: Path) -> None:
    start_agent()
    mode = os.stat(socket_dir / "agent.sock").st_mode

    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o666
    assert sorted(p.name for p in socket_dir.iterdir()) == ["agent.sock"]


def test_root_is_served_even_when_it_is_not_the_job_user(start_agent, socket_dir: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("needs to run as root")
    start_agent(uid=4242)

    assert request(socket_dir / "agent.sock", {"op": "ping"})["ok"] is True


def test_unknown_op_over_the_socket(start_agent, socket_dir: Path) -> None:
    start_agent()

    assert request(socket_dir / "agent.sock", {"op": "dump"}) == {
        "ok": False, "error": f"unknown op 'dump'; valid ops: {VALID_OPS}",
    }


def test_an_agent_without_engine_refuses_tree_operations(start_agent, socket_dir: Path) -> None:
    start_agent()

    assert request(socket_dir / "agent.sock", {"op": "restore"}) == {
        "ok": False, "error": "this agent has no checkpoint engine",
    }


def test_malformed_lines_get_error_replies_and_the_connection_goes_on(
        start_agent, socket_dir: Path) -> None:
    start_agent()
    talk = Conversation(socket_dir / "agent.sock")
    try:
        talk.send(b"not json\n")
        assert talk.reply() == {
            "ok": False, "error": "bad request: Expecting value: line 1 column 1 (char 0)",
        }
        talk.send(b"[1, 2]\n")
        assert talk.reply() == {"ok": False, "error": "bad request: not an object"}
        talk.send(b"\xff\xfe garbage\n")
        assert talk.reply()["error"].startswith("bad request: ")
        talk.send(b'{"op": "ping"}\n')
        assert talk.reply()["ok"] is True
    finally:
        talk.close()


def test_agent_keeps_serving_after_a_malformed_request(start_agent, socket_dir: Path) -> None:
    proc = start_agent()
    talk = Conversation(socket_dir / "agent.sock")
    talk.send(b"{\n")
    assert talk.reply()["ok"] is False
    talk.close()

    assert request(socket_dir / "agent.sock", {"op": "ping"})["pid"] == proc.pid


def test_pipelined_requests_are_answered_in_order(start_agent, socket_dir: Path) -> None:
    start_agent()
    talk = Conversation(socket_dir / "agent.sock")
    try:
        talk.send(b'{"op": "ping"}\n{"op": "nope"}\n{"op": "ping"}\n')

        assert [talk.reply()["ok"] for _ in range(3)] == [True, False, True]
    finally:
        talk.close()


def test_last_request_without_newline_is_answered_when_the_client_half_closes(
        start_agent, socket_dir: Path) -> None:
    start_agent()
    talk = Conversation(socket_dir / "agent.sock")
    try:
        talk.send(b'{"op": "ping"}')
        talk.sock.shutdown(socket.SHUT_WR)

        assert talk.reply()["node"] == "n9"
    finally:
        talk.close()


def test_oversized_request_is_refused(start_agent, socket_dir: Path) -> None:
    start_agent()
    talk = Conversation(socket_dir / "agent.sock")
    try:
        talk.send(b'{"pad": "' + b"x" * MAX_REQUEST + b'"}\n')

        assert talk.reply() == {"ok": False, "error": "request too large"}
    finally:
        talk.close()


def test_stale_file_at_the_socket_path_is_replaced(start_agent, socket_dir: Path) -> None:
    path = socket_dir / "agent.sock"
    path.write_text("left over from a killed agent")

    proc = start_agent(path=path)

    assert request(path, {"op": "ping"})["pid"] == proc.pid


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_the_agent_cleanly_and_removes_the_socket(
        start_agent, socket_dir: Path, signum: signal.Signals) -> None:
    path = socket_dir / "agent.sock"
    proc = start_agent()

    proc.send_signal(signum)
    stdout, _ = proc.communicate(timeout=10)

    assert proc.returncode == 0
    assert not path.exists()
    assert stdout.splitlines() == [
        f"node agent for job 7 on n9 listening on {path}",
        "node agent for job 7 on n9 stopped",
    ]


def test_idle_client_does_not_keep_the_agent_from_stopping(start_agent, socket_dir: Path) -> None:
    proc = start_agent()
    idle = Conversation(socket_dir / "agent.sock")
    try:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=10)
    finally:
        idle.close()

    assert proc.returncode == 0
    assert not (socket_dir / "agent.sock").exists()
