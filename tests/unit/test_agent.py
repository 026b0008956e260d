"""The node agent: who is served, what is answered, and a real agent process on a unix socket."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from singularity_slurm import rpc
from singularity_slurm.interpose.pyhook._singularity_worker import wire
from singularity_slurm.node import jobcgroup, services
from singularity_slurm.node.agent import (
    MAX_REQUEST,
    AgentState,
    TreeState,
    authorized,
    main,
    peer_credentials,
    replica_env,
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
        "ok": False, "error": "uid 1002 may not act on job 7", "kind": "forbidden",
    }


def test_other_user_is_refused_before_the_op_is_looked_at() -> None:
    state = AgentState(job_id=7, job_uid=JOB_UID, node="n9")

    assert state.handle({"op": "dump"}, 1002) == {
        "ok": False, "error": "uid 1002 may not act on job 7", "kind": "forbidden",
    }


@pytest.mark.parametrize("named", [8, "7", None])
def test_a_request_naming_another_job_is_refused_before_the_op_runs(named: object) -> None:
    state = AgentState(job_id=7, job_uid=JOB_UID, node="n9")

    assert state.handle({"op": "kill", "job_id": named}, JOB_UID) == {
        "ok": False, "error": f"this agent serves job 7, not job {named!r}: send the request to that "
                              "job's agent", "kind": "forbidden",
    }
    assert state.state == "none"


def test_a_request_naming_its_own_job_is_served() -> None:
    state = AgentState(job_id=7, job_uid=JOB_UID, node="n9")

    assert state.handle({"op": "ping", "job_id": 7}, JOB_UID)["ok"] is True


VALID_OPS = ("checkpoint, command_done, devices, generations, kill, latest, launcher_checkpoint, migrate, "
             "next_command, ping, requeue, resize, restore, run_begin, run_end, settle, start, status, wait")


@pytest.mark.parametrize(("request_", "shown"), [
    ({"op": "dump"}, "'dump'"), ({}, "None"), ({"op": ["ping"]}, "['ping']"),
])
def test_unknown_op_lists_the_valid_ops(request_: dict, shown: str) -> None:
    state = AgentState(job_id=7, job_uid=JOB_UID, node="n9")

    assert state.handle(request_, JOB_UID) == {
        "ok": False, "error": f"unknown op {shown}; valid ops: {VALID_OPS}", "kind": "bad_request",
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


def request(path: Path, payload: dict) -> dict:
    """The agent's reply as it came: `{"ok": true, ...}` or the error reply `rpc.call` raised for."""
    try:
        return rpc.call(path, payload, timeout=10)
    except rpc.RemoteError as exc:
        return rpc.error_reply(exc)


def frame(raw: bytes) -> bytes:
    return struct.pack("!I", len(raw)) + raw


class Conversation:
    """One connection to the agent, raw frames each way."""

    def __init__(self, path: Path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(str(path))
        self.reader = wire.Reader(self.sock)

    def send(self, raw: bytes) -> None:
        self.sock.sendall(raw)

    def reply(self) -> dict:
        return self.reader.recv()[0]

    def close(self) -> None:
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
        "ok": False, "error": f"unknown op 'dump'; valid ops: {VALID_OPS}", "kind": "bad_request",
    }


def test_an_agent_without_engine_refuses_tree_operations(start_agent, socket_dir: Path) -> None:
    start_agent()

    assert request(socket_dir / "agent.sock", {"op": "restore"}) == {
        "ok": False, "error": "this agent has no checkpoint engine", "kind": "unavailable",
    }


@pytest.mark.parametrize(("raw", "error"), [
    (b"not json", "bad request: frame is not JSON: Expecting value: line 1 column 1 (char 0)"),
    (b"[1, 2]", "bad request: frame is not a JSON object"),
    (b"\xff\xfe garbage", "bad request: frame is not JSON: "),
])
def test_a_malformed_frame_gets_a_bad_request_reply_and_is_dropped(
        start_agent, socket_dir: Path, raw: bytes, error: str) -> None:
    start_agent()
    talk = Conversation(socket_dir / "agent.sock")
    try:
        talk.send(frame(raw))
        reply = talk.reply()
        assert reply["error"].startswith(error) and reply["kind"] == "bad_request"
        assert talk.sock.recv(1) == b""  # a peer that speaks garbage is not read further
    finally:
        talk.close()


def test_agent_keeps_serving_after_a_malformed_request(start_agent, socket_dir: Path) -> None:
    proc = start_agent()
    talk = Conversation(socket_dir / "agent.sock")
    talk.send(frame(b"{"))
    assert talk.reply()["ok"] is False
    talk.close()

    assert request(socket_dir / "agent.sock", {"op": "ping"})["pid"] == proc.pid


def test_pipelined_requests_are_answered_in_order(start_agent, socket_dir: Path) -> None:
    start_agent()
    talk = Conversation(socket_dir / "agent.sock")
    try:
        talk.send(frame(b'{"op": "ping"}') + frame(b'{"op": "nope"}') + frame(b'{"op": "ping"}'))

        assert [talk.reply()["ok"] for _ in range(3)] == [True, False, True]
    finally:
        talk.close()


def test_a_request_is_answered_when_the_client_half_closes_after_it(
        start_agent, socket_dir: Path) -> None:
    start_agent()
    talk = Conversation(socket_dir / "agent.sock")
    try:
        talk.send(frame(b'{"op": "ping"}'))
        talk.sock.shutdown(socket.SHUT_WR)

        assert talk.reply()["node"] == "n9"
    finally:
        talk.close()


def test_oversized_request_is_refused_from_its_header_and_the_agent_serves_on(
        start_agent, socket_dir: Path) -> None:
    proc = start_agent()
    talk = Conversation(socket_dir / "agent.sock")
    try:
        talk.send(struct.pack("!I", MAX_REQUEST + 1))  # no body follows: the header alone is refused

        assert talk.reply() == {"ok": False, "kind": "too_large",
                                "error": f"request of {MAX_REQUEST + 1} bytes is over the "
                                         f"{MAX_REQUEST}-byte limit"}
    finally:
        talk.close()
    assert request(socket_dir / "agent.sock", {"op": "ping"})["pid"] == proc.pid


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


# --- device proxies -------------------------------------------------------------------------------


def test_devices_lists_the_proxies_by_device_number(tmp_path: Path) -> None:
    for name in ("proxy-gpu10.sock", "proxy-gpu2.sock", "proxy-gpu0.sock", "agent.sock", "proxy-gpu1.pid"):
        (tmp_path / name).touch()
    state = AgentState(job_id=7, job_uid=JOB_UID, node="n9", run_dir=tmp_path)

    assert state.handle({"op": "devices"}, JOB_UID) == {
        "ok": True, "node": "n9", "proxies": ["n9/gpu0", "n9/gpu2", "n9/gpu10"]}


def test_devices_of_a_node_without_proxies_is_empty(tmp_path: Path) -> None:
    assert AgentState(7, JOB_UID, "n9", run_dir=tmp_path).op_devices({}) == {"node": "n9", "proxies": []}
    assert AgentState(7, JOB_UID, "n9").op_devices({}) == {"node": "n9", "proxies": []}


class RecordingEngine:
    """Records what the agent asks of it; its tree is a plain `sleep`."""

    def __init__(self) -> None:
        self.ranks: list[object] = []
        self.requests: list[dict] = []
        self.trees: list[subprocess.Popen] = []

    def for_tree(self, tree: object, **kwargs: object) -> RecordingEngine:
        self.ranks.append(tree)
        return self

    def begin(self, job_id: int) -> None:
        pass

    def tree_spec(self, request: dict, uid: int, job_id: int) -> SimpleNamespace:
        self.requests.append(request)
        return SimpleNamespace(argv=request["argv"])

    def start(self, spec: SimpleNamespace, cgroups: list | None = None) -> tuple[int, Callable[[], int]]:
        tree = subprocess.Popen(["sleep", "60"])
        self.trees.append(tree)
        return tree.pid, tree.wait

    def restore(self, job_id: int, uid: int, generation: str | None = None) -> dict:
        raise AssertionError("restore must not be reached")


START = {"op": "start", "argv": ["python", "train.py"], "cwd": "/tmp", "output": "/tmp/out",
         "env": {"A": "1"}}
NEEDS = "proxy: needs {generation: string, placement: {rank: proxy id}}"
BAD_PLACEMENT = "proxy.placement must map rank numbers to proxy ids"


@pytest.mark.parametrize(("proxy", "error"), [
    ("g1", NEEDS),
    ({"placement": {"0": "n9/gpu0"}}, NEEDS),
    ({"generation": 1, "placement": {"0": "n9/gpu0"}}, NEEDS),
    ({"generation": "g1"}, BAD_PLACEMENT),
    ({"generation": "g1", "placement": [["0", "n9/gpu0"]]}, BAD_PLACEMENT),
    ({"generation": "g1", "placement": {"zero": "n9/gpu0"}}, BAD_PLACEMENT),
    ({"generation": "g1", "placement": {"-1": "n9/gpu0"}}, BAD_PLACEMENT),
    ({"generation": "g1", "placement": {"0": 3}}, BAD_PLACEMENT),
    ({"generation": "g1", "placement": {"0": "n8/gpu0"}},
     "the placement gives no rank to n9's proxies (n9/gpu0, n9/gpu1)"),
])
def test_start_with_a_malformed_proxy_config_is_refused_and_changes_nothing(
        tmp_path: Path, proxy: object, error: str) -> None:
    (tmp_path / "proxy-gpu0.sock").touch()
    (tmp_path / "proxy-gpu1.sock").touch()
    engine = RecordingEngine()
    state = AgentState(7, JOB_UID, "n9", engine=engine, run_dir=tmp_path)

    assert state.handle({**START, "proxy": proxy}, JOB_UID) == {"ok": False, "error": error,
                                                                "kind": "refused"}

    assert engine.requests == [] and engine.trees == []
    assert state.proxies == {}
    assert state.op_status({})["state"] == "none"


def test_start_with_a_placement_on_a_node_without_proxies_says_so(tmp_path: Path) -> None:
    engine = RecordingEngine()
    state = AgentState(7, JOB_UID, "n9", engine=engine, run_dir=tmp_path)

    reply = state.handle({**START, "proxy": {"generation": "g1", "placement": {"0": "n9/gpu0"}}}, JOB_UID)

    assert reply == {"ok": False, "error": "the placement gives no rank to n9's proxies (none)",
                     "kind": "refused"}
    assert engine.trees == []


def test_a_start_or_restore_from_outside_the_jobs_steps_is_refused_where_the_job_has_an_extern_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    extern = tmp_path / "freezer" / "slurm_n9" / f"uid_{JOB_UID}" / "job_7" / "step_extern"
    # a login shell's cgroups
    monkeypatch.setattr(jobcgroup, "targets_of", lambda pid, job_id, problems=None, name=None: [])
    monkeypatch.setattr(jobcgroup, "caller_in_a_step", lambda pid, job_id: False)
    monkeypatch.setattr(jobcgroup, "extern_steps", lambda job_id: [extern])
    engine = RecordingEngine()
    state = AgentState(7, JOB_UID, "n9", engine=engine, run_dir=tmp_path)

    for request in (START, {"op": "restore"}):
        reply = state.handle(request, JOB_UID, peer_pid=4242)
        assert reply == {"ok": False, "kind": "forbidden", "error": (
            "job 7: a start or restore must come from a step of the job on n9 (the caller, pid 4242, is "
            "in none): run `singularityctl run` in the batch script or in an srun step")}
    assert engine.requests == [] and engine.trees == [] and engine.ranks == []

    # a caller in a step of the job is served; one from outside still is not
    monkeypatch.setattr(jobcgroup, "targets_of",
                        lambda pid, job_id, problems=None, name=None: [extern] if pid == 1 else [])
    assert state.handle(START, JOB_UID, peer_pid=1)["ok"]
    assert state.cgroups == [extern]
    engine.trees[0].kill()
    assert state.handle({"op": "restore"}, JOB_UID, peer_pid=4242)["kind"] == "forbidden"


def test_the_nodes_proxies_join_the_jobs_cgroups_beside_the_trees_once_a_step_shows_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Prolog starts the proxies outside the job; the first start from a step of the job moves
    them (and their children) into the job's cgroups, so what they hold for its ranks is the job's."""
    extern = tmp_path / "freezer" / "job_7" / "step_extern"
    devices = tmp_path / "devices" / "job_7" / "step_extern"
    proxies, shelter = extern / jobcgroup.PROXIES, extern / jobcgroup.SHELTER
    for folder in (proxies, shelter, devices):
        folder.mkdir(parents=True)
    asked: list[str] = []

    def targets(pid: int, job_id: int, problems: list[str] | None = None, name: str = jobcgroup.SHELTER):
        asked.append(name)
        return [extern / name, devices] if pid == 1 else []

    monkeypatch.setattr(jobcgroup, "targets_of", targets)
    proxy = subprocess.Popen(["sleep", "60"])
    stray = subprocess.Popen(["sleep", "60"])
    try:
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        for name, pid in ((f"{services.PROXY}cpu0", proxy.pid), (services.AGENT, stray.pid)):
            (run_dir / f"{name}.pid").write_text(json.dumps(
                {"pid": pid, "start_time": services.proc_start_time(pid)}))
        (run_dir / f"{services.PROXY}cpu1.pid").write_text(json.dumps({"pid": stray.pid, "start_time": 1}))
        engine = RecordingEngine()
        state = AgentState(7, JOB_UID, "n9", engine=engine, run_dir=run_dir)

        assert state.handle(START, JOB_UID, peer_pid=1)["ok"]
        # only the live proxy named by its pid file, not the agent, nor a pid file whose process is gone
        assert (proxies / "cgroup.procs").read_text() == f"{proxy.pid}\n"
        assert (devices / "cgroup.procs").read_text() == f"{proxy.pid}\n"
        assert not (shelter / "cgroup.procs").exists()  # the trees' own shelter: RecordingEngine's
        assert state.cgroups == [extern / jobcgroup.SHELTER, devices] and state.proxies_charged
        engine.trees[0].kill()
        (proxies / "cgroup.procs").unlink()
        deadline = time.monotonic() + 10
        while state.state == TreeState.RUNNING and time.monotonic() < deadline:  # its watcher saw it end
            time.sleep(0.01)
        assert state.handle(START, JOB_UID, peer_pid=1)["ok"]
        assert not (proxies / "cgroup.procs").exists()  # once
        engine.trees[-1].kill()
        assert asked.count(jobcgroup.PROXIES) == 1
    finally:
        for child in (proxy, stray):
            child.kill()
            child.wait()


def test_proxies_whose_cgroup_a_user_took_first_join_the_extern_step_itself(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Still within the job's limits: taking the name costs the user only its own proxies' shelter
    from Slurm's SIGTERM."""
    extern = tmp_path / "freezer" / "job_7" / "step_extern"
    extern.mkdir(parents=True)

    def targets(pid: int, job_id: int, problems: list[str] | None = None, name: str = jobcgroup.SHELTER):
        if name == jobcgroup.PROXIES and problems is not None:
            problems.append(f"{extern / name} is not root's (uid 1001): someone made it before the agent")
            return [extern]
        return [extern / name]

    monkeypatch.setattr(jobcgroup, "targets_of", targets)
    proxy = subprocess.Popen(["sleep", "60"])
    try:
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        (run_dir / f"{services.PROXY}cpu0.pid").write_text(json.dumps(
            {"pid": proxy.pid, "start_time": services.proc_start_time(proxy.pid)}))
        engine = RecordingEngine()
        state = AgentState(7, JOB_UID, "n9", engine=engine, run_dir=run_dir)

        assert state.handle(START, JOB_UID, peer_pid=1)["ok"]
        assert (extern / "cgroup.procs").read_text() == f"{proxy.pid}\n" and state.proxies_charged
        assert ("someone made it before the agent; the job's proxies run in the extern step itself"
                in caplog.text)
        engine.trees[0].kill()
    finally:
        proxy.kill()
        proxy.wait()


def test_a_step_of_the_job_on_a_node_without_its_extern_step_is_served_uncontained(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slurm skips the Prolog, and with it the extern step, on a node a requeued job comes back to
    soon; another node of the job (the same host in the dev cluster) may still show one."""
    monkeypatch.setattr(jobcgroup, "targets_of", lambda pid, job_id, problems=None, name=None: [])
    monkeypatch.setattr(jobcgroup, "caller_in_a_step", lambda pid, job_id: True)
    monkeypatch.setattr(jobcgroup, "extern_steps", lambda job_id: [tmp_path / "job_7" / "step_extern"])
    engine = RecordingEngine()
    state = AgentState(7, JOB_UID, "n9", engine=engine, run_dir=tmp_path)

    assert state.handle(START, JOB_UID, peer_pid=4242)["ok"]
    assert state.cgroups == []
    engine.trees[0].kill()


@pytest.fixture
def node_proxies(socket_dir: Path) -> Iterator[Callable[[list[str]], dict]]:
    """Real proxies of job 7 behind their control sockets in `socket_dir`, as the Prolog leaves them."""
    from singularity_slurm.node import services
    from singularity_slurm.proxy.daemon import Proxy, serve_control
    from singularity_slurm.proxy.hal import HostBackend
    from singularity_slurm.proxy.rendezvous import MemoryRendezvous

    if os.getuid() != 0:
        pytest.skip("a proxy's control socket serves root only")
    rendezvous = MemoryRendezvous()
    started: dict = {}
    servers: list[socket.socket] = []
    job_id = int.from_bytes(os.urandom(4), "big")

    def start(devices: list[str]) -> dict:
        for device in devices:
            proxy = Proxy(job_id, os.getuid(), f"n9/{device}", HostBackend(), lambda: rendezvous,
                          state_dir=socket_dir, bind_host="127.0.0.1")
            servers.append(serve_control(proxy, socket_dir / f"proxy-{device}.sock"))
            pidfile = services.pidfile_path(socket_dir, f"proxy-{device}")
            pidfile.write_text(json.dumps({"pid": os.getpid(),
                                           "start_time": services.proc_start_time(os.getpid())}))
            started[device] = proxy
        return started

    yield start
    for server in servers:
        server.close()
    for proxy in started.values():
        proxy.stopping = True
    for proxy in started.values():
        proxy.close()


def test_start_configures_every_proxy_and_starts_one_tree_per_rank_of_this_node(
        socket_dir: Path, node_proxies) -> None:
    proxies = node_proxies(["gpu0", "gpu1", "gpu2"])
    engine = RecordingEngine()
    state = AgentState(7, JOB_UID, "n9", engine=engine, run_dir=socket_dir)
    placement = {"0": "n9/gpu0", "1": "n9/gpu1", "2": "n9/gpu0", "3": "n8/gpu0"}
    try:
        reply = state.handle({**START, "rank": 1, "proxy": {"generation": "g1", "placement": placement}},
                             JOB_UID)

        pids = [tree.pid for tree in engine.trees]
        assert reply == {"ok": True, "init_pid": pids[0], "trees": {"0": pids[0], "1": pids[1], "2": pids[2]}}
        assert engine.ranks == [0, 1, 2]  # a rank is a tree: the node's index does not matter
        assert [r["env"] for r in engine.requests] == [
            {"A": "1", "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "3"}
            for rank in range(3)]
        assert state.op_status({})["trees"] == {"0": pids[0], "1": pids[1], "2": pids[2]}
        assert state.proxies == {"n9/gpu0": socket_dir / "proxy-gpu0.sock",
                                 "n9/gpu1": socket_dir / "proxy-gpu1.sock"}
        assert {device: (p.generation, p.local_ranks) for device, p in proxies.items()} == {
            "gpu0": ("g1", [0, 2]), "gpu1": ("g1", [1]), "gpu2": ("g1", [])}
    finally:
        state.op_kill({})


def test_every_rank_gets_glibcs_fixed_mmap_threshold_unless_the_job_sets_its_own(
        socket_dir: Path, node_proxies) -> None:
    from singularity_slurm.config import parse

    node_proxies(["gpu0"])
    placement = {"0": "n9/gpu0", "1": "n9/gpu0"}
    for env, expected in (({"A": "1"}, "131072"), ({"MALLOC_MMAP_THRESHOLD_": "65536"}, "65536"),
                          ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=8192"}, None)):
        engine = RecordingEngine()
        engine.config = parse({})  # type: ignore[attr-defined]
        state = AgentState(7, JOB_UID, "n9", engine=engine, run_dir=socket_dir)
        try:
            request = {**START, "env": env, "proxy": {"generation": "g1", "placement": placement}}
            state.handle(request, JOB_UID)
            assert [r["env"].get("MALLOC_MMAP_THRESHOLD_") for r in engine.requests] == [expected] * 2
        finally:
            state.op_kill({})


def test_a_distributed_start_whose_environment_is_not_an_object_is_refused(
        socket_dir: Path, node_proxies) -> None:
    node_proxies(["gpu0"])
    engine = RecordingEngine()
    state = AgentState(7, JOB_UID, "n9", engine=engine, run_dir=socket_dir)
    request = {**START, "env": ["A=1"], "proxy": {"generation": "g1", "placement": {"0": "n9/gpu0"}}}

    assert state.handle(request, JOB_UID) == {"ok": False, "kind": "refused",
                                              "error": "start needs env: an object of strings"}
    assert engine.trees == []


def test_replica_env_is_nothing_when_the_site_turns_it_off() -> None:
    assert replica_env({}, 0) == {}
    assert replica_env({}, 4096) == {"MALLOC_MMAP_THRESHOLD_": "4096"}
    # what is not an environment is refused later, where the request is checked
    assert replica_env(["A=1"], 4096) == {}  # type: ignore[arg-type]
    assert replica_env({"GLIBC_TUNABLES": 7}, 4096) == {"MALLOC_MMAP_THRESHOLD_": "4096"}  # type: ignore[dict-item]


class RankEngine(RecordingEngine):
    """Each rank's tree runs `sh -c` with the command its env's RANK picks (default: sleep)."""

    def __init__(self, commands: dict[str, str]) -> None:
        super().__init__()
        self.commands = commands
        self.dumped: list[tuple[int, str | None]] = []

    def tree_spec(self, request: dict, uid: int, job_id: int) -> SimpleNamespace:
        self.requests.append(request)
        return SimpleNamespace(argv=request["argv"], rank=request["env"]["RANK"])

    def start(self, spec: SimpleNamespace, cgroups: list | None = None) -> tuple[int, Callable[[], int]]:
        tree = subprocess.Popen(["sh", "-c", self.commands.get(spec.rank, "exec sleep 60")])
        self.trees.append(tree)
        return tree.pid, lambda: _status(tree.wait())

    def checkpoint(self, job_id: int, uid: int, init_pid: int, **kwargs: object) -> dict:
        self.dumped.append((init_pid, kwargs.get("generation")))  # type: ignore[arg-type]
        return {"seq": 1, "logical_bytes": 10, "new_bytes": 4, "seconds": 0.5, "reason": kwargs["reason"]}


def _status(code: int) -> int:
    return 128 - code if code < 0 else code


def test_a_rank_that_fails_ends_the_nodes_other_ranks_and_its_status_is_the_nodes(
        socket_dir: Path, node_proxies) -> None:
    node_proxies(["gpu0", "gpu1"])
    engine = RankEngine({"1": "sleep 0.3; exit 3"})
    state = AgentState(7, JOB_UID, "n9", engine=engine, run_dir=socket_dir)
    placement = {"0": "n9/gpu0", "1": "n9/gpu1", "2": "n9/gpu0"}

    assert state.handle({**START, "proxy": {"generation": "g1", "placement": placement}}, JOB_UID)["ok"]
    reply = state.handle({"op": "wait"}, JOB_UID)

    assert reply == {"ok": True, "state": "exited", "exit_status": 3, "proxy_lost": None}
    assert [tree.poll() for tree in engine.trees] == [-9, 3, -9]  # the others were ended, not waited for


def test_the_ranks_of_a_node_are_checkpointed_together_as_one_generation(
        socket_dir: Path, node_proxies) -> None:
    node_proxies(["gpu0"])
    engine = RankEngine({})
    state = AgentState(7, JOB_UID, "n9", engine=engine, run_dir=socket_dir)
    placement = {"0": "n9/gpu0", "1": "n9/gpu0"}
    try:
        assert state.handle({**START, "proxy": {"generation": "g1", "placement": placement}}, JOB_UID)["ok"]
        state.proxies = {}  # no ranks connected to quiesce here: the dump alone is under test

        # a node's own checkpoint request (singularityctl checkpoint) goes through the launcher,
        # which names the generation every rank commits
        refused = state.handle({"op": "checkpoint", "reason": "manual"}, JOB_UID)
        assert refused == {"ok": False, "kind": "unavailable", "error": (
            "job 7 has no launcher waiting for requests on n9 (not a `singularityctl run` job, or it is "
            "starting or ending); try again once it runs")}
        assert state.op_status({})["state"] == "running" and engine.dumped == []

        reply = state.handle({"op": "checkpoint", "reason": "manual", "generation": "0.5"}, JOB_UID)
        assert reply["ok"] and reply["trees"] == [0, 1]
        assert (reply["logical_bytes"], reply["new_bytes"], reply["seconds"]) == (20, 8, 0.5)
        assert sorted(engine.dumped) == sorted((t.pid, "0.5") for t in engine.trees)
        assert state.op_status({})["state"] == "running"
    finally:
        state.op_kill({})


def test_a_stopping_checkpoints_deadline_comes_from_slurm_not_from_the_users_request(
        socket_dir: Path, node_proxies) -> None:
    from singularity_slurm.config import parse

    node_proxies(["gpu0"])
    engine = RankEngine({})
    preempted_at = time.time() - 10
    engine.slurm = SimpleNamespace(preempt_time=lambda job_id: preempted_at)
    engine.config = parse({"preemption": {"warn_time": 60}})
    seen: list[object] = []
    dump = engine.checkpoint
    engine.checkpoint = lambda *args, **kwargs: seen.append(kwargs["within_s"]) or dump(*args, **kwargs)
    state = AgentState(7, JOB_UID, "n9", engine=engine, run_dir=socket_dir)
    try:
        start = {**START, "proxy": {"generation": "g1", "placement": {"0": "n9/gpu0"}}}
        assert state.handle(start, JOB_UID)["ok"]
        state.proxies = {}
        # the job's user asks for its dump to go first on the node: the fields are not read
        reply = state.handle({"op": "checkpoint", "reason": "preempt", "stop": True, "generation": "0.5",
                              "within_s": 0, "deadline": 0}, JOB_UID)
        assert reply["ok"]
        assert len(seen) == 1 and 48 < seen[0] <= 50  # warn_time after Slurm's PreemptTime
    finally:
        state.op_kill({})


def test_a_stopping_checkpoint_of_the_nodes_one_tree_is_frozen_while_it_waits_and_no_other_is(
        socket_dir: Path, tmp_path: Path, node_proxies) -> None:
    from singularity_slurm.config import parse
    from singularity_slurm.node import jobcgroup

    node_proxies(["gpu0"])
    engine = RankEngine({})
    engine.slurm = SimpleNamespace(preempt_time=lambda job_id: None)
    engine.config = parse({})
    pauses: list[object] = []
    dump = engine.checkpoint
    engine.checkpoint = lambda *args, **kwargs: pauses.append(kwargs["pause"]) or dump(*args, **kwargs)
    extern = tmp_path / "freezer" / "job_7" / "step_extern"
    shelter = extern / jobcgroup.SHELTER
    shelter.mkdir(parents=True)
    (shelter / "freezer.state").write_text("THAWED")
    state = AgentState(7, JOB_UID, "n9", engine=engine, run_dir=socket_dir)
    try:
        start = {**START, "proxy": {"generation": "g1", "placement": {"0": "n9/gpu0"}}}
        assert state.handle(start, JOB_UID)["ok"]
        state.proxies = {}
        state.cgroups = [shelter, tmp_path / "memory" / "job_7" / "step_extern"]
        assert state.handle({"op": "checkpoint", "reason": "periodic", "generation": "0.4"}, JOB_UID)["ok"]
        assert state.handle({"op": "checkpoint", "reason": "preempt", "stop": True, "generation": "0.5"},
                            JOB_UID)["ok"]
        keeps_running, stops = pauses
        assert keeps_running is None  # a periodic checkpoint's tree trains on while it waits
        with stops() as froze:  # what the dump slot enters while this tree waits
            assert froze == [shelter]  # the shelter alone: never the extern step Slurm's process is in
            assert (shelter / "freezer.state").read_text() == "FROZEN"
        assert (shelter / "freezer.state").read_text() == "THAWED"
    finally:
        state.op_kill({})


def test_generations_of_named_ranks_come_from_each_ranks_store(tmp_path: Path) -> None:
    class Stores(RecordingEngine):
        def rank_generations(self, job_id: int, ranks: list[int], run: str | None) -> dict:
            self.ranks.extend(ranks)
            return {str(rank): [f"g-{rank}"] for rank in ranks}

    engine = Stores()
    state = AgentState(7, JOB_UID, "n9", engine=engine, run_dir=tmp_path)

    assert state.handle({"op": "generations", "ranks": [0, 3]}, JOB_UID) == {
        "ok": True, "ranks": {"0": ["g-0"], "3": ["g-3"]}}
    assert state.handle({"op": "generations", "ranks": "0-3"}, JOB_UID) == {
        "ok": False, "kind": "refused", "error": "generations: ranks must be a list of 1 to 4096 ranks"}


def test_start_refused_by_a_proxy_names_it_and_starts_nothing(socket_dir: Path, node_proxies) -> None:
    node_proxies(["gpu0"])
    engine = RecordingEngine()
    state = AgentState(7, JOB_UID, "n9", engine=engine, run_dir=socket_dir)

    reply = state.handle({**START, "proxy": {"generation": "g1", "placement": {"1": "n9/gpu0"}}}, JOB_UID)

    assert reply == {"ok": False, "error": "proxy n9/gpu0: placement must name ranks 0..N-1, got [1]",
                     "kind": "refused"}
    assert engine.trees == []
    assert state.proxies == {}


# --- requests only a multi-node job's launcher carries out ----------------------------------------


def test_next_command_without_a_request_answers_none_after_its_timeout() -> None:
    state = AgentState(7, JOB_UID, "n9")
    started = time.monotonic()

    assert state.handle({"op": "next_command", "timeout": 0.2}, JOB_UID) == {"ok": True, "command": None}
    assert 0.2 <= time.monotonic() - started < 2


def test_next_command_timeout_has_a_floor() -> None:
    state = AgentState(7, JOB_UID, "n9")
    started = time.monotonic()

    assert state.handle({"op": "next_command", "timeout": 0.001}, JOB_UID) == {"ok": True, "command": None}
    assert 0.1 <= time.monotonic() - started < 2


def test_next_command_with_a_timeout_that_is_not_a_number_is_refused() -> None:
    assert AgentState(7, JOB_UID, "n9").handle({"op": "next_command", "timeout": "soon"}, JOB_UID) == {
        "ok": False, "error": "next_command failed: could not convert string to float: 'soon'",
        "kind": "failed"}


def test_command_done_needs_a_result_object() -> None:
    assert AgentState(7, JOB_UID, "n9").handle({"op": "command_done", "result": "ok"}, JOB_UID) == {
        "ok": False, "error": "command_done needs result: an object", "kind": "refused"}


class Launcher:
    """A launcher polling the agent: takes one command, answers it with `result`."""

    def __init__(self, state: AgentState, result: dict):
        self.state = state
        self.result = result
        self.received: list[dict] = []
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        reply = self.state.handle({"op": "next_command", "timeout": 10}, JOB_UID)
        if reply.get("command"):
            command = dict(reply["command"])
            self.state.handle({"op": "command_done", "id": command.pop("id"), "result": self.result},
                              JOB_UID)
            reply = {**reply, "command": command}
        self.received.append(reply)

    def __enter__(self) -> Launcher:
        self.thread.start()
        deadline = time.monotonic() + 5
        while self.state.launcher_polls_until <= time.monotonic():
            assert time.monotonic() < deadline, "the launcher did not poll"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.thread.join(timeout=15)


def test_migrate_while_a_launcher_polls_is_handed_to_it_and_answers_its_summary() -> None:
    state = AgentState(7, JOB_UID, "n9")

    with Launcher(state, {"ok": True, "summary": {"seq": 4, "generation": "g2"}}) as launcher:
        reply = state.handle({"op": "migrate", "exclude": ["n3"]}, JOB_UID)

    assert launcher.received == [{"ok": True, "command": {"op": "migrate", "exclude": ["n3"]}}]
    assert reply == {"ok": True, "seq": 4, "generation": "g2", "exclude": ["n3"]}


def test_migrate_the_launcher_could_not_carry_out_is_an_error_with_its_reason() -> None:
    state = AgentState(7, JOB_UID, "n9")

    with Launcher(state, {"ok": False, "error": "n2: no consistent cut"}):
        reply = state.handle({"op": "migrate"}, JOB_UID)

    assert reply == {"ok": False, "error": "migrate failed: n2: no consistent cut", "kind": "failed"}


def test_a_checkpoint_reason_outside_the_closed_set_is_refused_and_nothing_is_dumped(
        socket_dir: Path, node_proxies) -> None:
    node_proxies(["gpu0"])
    engine = RankEngine({})
    state = AgentState(7, JOB_UID, "n9", engine=engine, run_dir=socket_dir)
    try:
        start = {**START, "proxy": {"generation": "g1", "placement": {"0": "n9/gpu0"}}}
        assert state.handle(start, JOB_UID)["ok"]
        state.proxies = {}
        for reason in ("x" * 600_000, ["manual"], "drain\n"):
            reply = state.handle({"op": "checkpoint", "reason": reason, "generation": "0.5"}, JOB_UID)
            assert reply["ok"] is False and reply["kind"] == "refused"
            assert reply["error"].startswith("checkpoint: reason must be one of periodic, manual, preempt, "
                                             "requeue, migrate, resize, got ")
            assert len(reply["error"]) < 200  # the answer does not echo what was sent
        assert engine.dumped == [] and state.op_status({})["state"] == "running"
        assert state.handle({"op": "checkpoint", "generation": "0.5"}, JOB_UID)["reason"] == "manual"
    finally:
        state.op_kill({})


def test_launcher_checkpoint_is_handed_to_the_polling_launcher() -> None:
    state = AgentState(7, JOB_UID, "n9")

    with Launcher(state, {"ok": True, "summary": {"seq": 5}}) as launcher:
        reply = state.handle({"op": "launcher_checkpoint"}, JOB_UID)

    assert launcher.received == [{"ok": True, "command": {"op": "checkpoint"}}]
    assert reply == {"ok": True, "seq": 5}


NO_LAUNCHER = ("job 7 has no launcher waiting for requests on n9 (not a `singularityctl run` job, or it "
               "is starting or ending); try again once it runs")


@pytest.mark.parametrize("op", ["launcher_checkpoint", "migrate"])
def test_a_request_for_the_launcher_without_a_polling_launcher_is_refused(op: str) -> None:
    state = AgentState(7, JOB_UID, "n9")

    assert state.handle({"op": op}, JOB_UID) == {"ok": False, "error": NO_LAUNCHER, "kind": "unavailable"}
    assert state.commands.empty()


@pytest.mark.parametrize("exclude", ["n3", [""], [3]])
def test_migrate_with_a_bad_exclude_is_refused_before_the_launcher_sees_it(exclude: object) -> None:
    state = AgentState(7, JOB_UID, "n9")
    state.launcher_polls_until = time.monotonic() + 60

    assert state.handle({"op": "migrate", "exclude": exclude}, JOB_UID) == {
        "ok": False, "error": "migrate: exclude must be a list of node names", "kind": "refused"}
    assert state.commands.empty()


def test_the_agent_takes_admin_requests_with_the_configured_operators_and_slurms_record() -> None:
    from singularity_slurm.config import parse
    from singularity_slurm.node.agent import admin_commands

    asked = []
    # squeue's fixed fields, not scontrol's one-line record (where the job's comment can imitate them)
    slurm = SimpleNamespace(job_row=lambda job_id: asked.append(job_id) or {"BatchHost": "n9"})
    state = AgentState(job_id=7, job_uid=JOB_UID, node="n9")

    commands = admin_commands(state, parse({"admin": {"operators": ["ops"]}}), slurm)

    assert (commands.state, commands.job_id, commands.job_uid, commands.node, commands.operators) == (
        state, 7, JOB_UID, "n9", ("ops",))
    assert commands.locate() == {"BatchHost": "n9"} and asked == [7]


def test_an_answer_to_no_request_is_refused_and_reaches_no_later_request() -> None:
    state = AgentState(7, JOB_UID, "n9")

    forged = state.handle({"op": "command_done", "id": "x", "result": {"ok": True, "summary": {"seq": 9}}},
                          JOB_UID)

    assert forged == {"ok": False, "error": "command_done: no request 'x' is being carried out",
                      "kind": "conflict"}
    with Launcher(state, {"ok": True, "summary": {"seq": 4}}):
        assert state.handle({"op": "launcher_checkpoint"}, JOB_UID) == {"ok": True, "seq": 4}


def test_an_answer_naming_another_request_is_refused() -> None:
    state = AgentState(7, JOB_UID, "n9")
    state.launcher_polls_until = time.monotonic() + 60
    replies: list[dict] = []
    caller = threading.Thread(target=lambda: replies.append(state.handle({"op": "launcher_checkpoint"},
                                                                         JOB_UID)))
    caller.start()
    command = state.handle({"op": "next_command", "timeout": 5}, JOB_UID)["command"]

    wrong = state.handle({"op": "command_done", "id": "0" * 16, "result": {"ok": True}}, JOB_UID)
    right = state.handle({"op": "command_done", "id": command["id"], "result": {"ok": False,
                                                                                 "error": "no cut"}}, JOB_UID)
    caller.join(timeout=15)

    assert wrong["ok"] is False and "no request" in wrong["error"]
    assert right == {"ok": True}
    assert replies == [{"ok": False, "error": "checkpoint failed: no cut", "kind": "failed"}]


def test_a_second_request_while_the_launcher_carries_one_out_is_refused() -> None:
    state = AgentState(7, JOB_UID, "n9")
    state.launcher_polls_until = time.monotonic() + 60
    caller = threading.Thread(target=lambda: state.handle({"op": "launcher_checkpoint"}, JOB_UID))
    caller.start()
    command = state.handle({"op": "next_command", "timeout": 5}, JOB_UID)["command"]

    second = state.handle({"op": "migrate", "exclude": ["n1"]}, JOB_UID)
    state.handle({"op": "command_done", "id": command["id"], "result": {"ok": True}}, JOB_UID)
    caller.join(timeout=15)

    assert second == {"ok": False, "error": "the job's launcher is carrying out another request "
                                            "(checkpoint); try again when it is done", "kind": "conflict"}


@pytest.mark.parametrize("timeout", ["nan", "inf", "-inf"])
def test_a_poll_with_a_timeout_that_is_not_finite_is_refused(timeout: str) -> None:
    state = AgentState(7, JOB_UID, "n9")

    reply = state.handle({"op": "next_command", "timeout": float(timeout)}, JOB_UID)

    assert reply == {"ok": False, "error": "next_command: timeout must be a number of seconds",
                     "kind": "refused"}
    assert state.launcher_polls_until == 0.0


def test_a_placement_with_more_ranks_on_a_device_than_the_site_allows_starts_nothing(
        socket_dir: Path, node_proxies) -> None:
    from singularity_slurm.config import parse

    node_proxies(["gpu0", "gpu1"])
    engine = RankEngine({})
    engine.config = parse({"elastic": {"max_ranks_per_device": 1}})  # type: ignore[attr-defined]
    state = AgentState(7, JOB_UID, "n9", engine=engine, run_dir=socket_dir)
    placement = {"0": "n9/gpu0", "1": "n9/gpu1", "2": "n9/gpu0"}

    assert state.handle({**START, "proxy": {"generation": "g1", "placement": placement}}, JOB_UID) == {
        "ok": False, "kind": "refused", "error": (
            "the placement puts 2 ranks on one of n9's devices, more than [elastic] "
            "max_ranks_per_device = 1")}
    assert engine.trees == [] and state.op_status({})["state"] == "none"
    huge = {str(r): "n9/gpu0" for r in range(4097)}
    assert state.handle({**START, "proxy": {"generation": "g1", "placement": huge}}, JOB_UID)["error"] == (
        "proxy.placement names 4097 ranks, more than 4096")


def test_settle_waits_for_the_checkpoint_in_progress_and_no_longer() -> None:
    """The Epilog's wait before it stops the agent: until the dump the launcher began has ended."""
    state = AgentState(job_id=7, job_uid=JOB_UID, node="n9")
    assert state.handle({"op": "settle", "timeout": 5}, 0) == {"ok": True, "state": "none"}

    state.state = TreeState.CHECKPOINTING

    def commit() -> None:
        with state.lock:
            state.state = TreeState.DUMPED
            state.lock.notify_all()

    threading.Timer(0.2, commit).start()
    assert state.handle({"op": "settle", "timeout": 30}, 0) == {"ok": True, "state": "dumped"}

    state.state = TreeState.CHECKPOINTING
    assert state.handle({"op": "settle", "timeout": 0.1}, 0)["state"] == "checkpointing"
    assert state.handle({"op": "settle", "timeout": "forever"}, 0)["kind"] == "refused"
