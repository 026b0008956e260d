"""Rank sockets live in root's per-job folders; a folder another user made or redirected is refused."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from proxyjob import remove_state, state_folder

from singularity_slurm.config import ProxyConfig
from singularity_slurm.interpose.pyhook._singularity_worker import wire
from singularity_slurm.proxy import ranksock
from singularity_slurm.proxy.daemon import Proxy
from singularity_slurm.proxy.hal import HostBackend
from singularity_slurm.proxy.ranksock import RankSocketError, RankSockets
from singularity_slurm.proxy.rendezvous import MemoryRendezvous

USER = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="checks root's ownership of folders")


@pytest.fixture
def state() -> Iterator[Path]:
    folder = state_folder()
    yield folder
    remove_state(folder)


def status(mode: int, uid: int = 0) -> os.stat_result:
    return os.stat_result((mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))


# --- the decision ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "uid", "last", "problem"), [
    (stat.S_IFDIR | 0o755, 0, True, None),
    (stat.S_IFDIR | 0o700, 0, True, None),
    (stat.S_IFDIR | 0o1777, 0, False, None),  # /tmp above the state folder
    (stat.S_IFDIR | 0o1777, 0, True, "is writable by group or others (mode 1777)"),
    (stat.S_IFDIR | 0o777, 0, False, "is writable by group or others and not sticky (mode 0777)"),
    (stat.S_IFDIR | 0o775, 0, True, "is writable by group or others (mode 0775)"),
    (stat.S_IFDIR | 0o755, USER, False, f"is owned by uid {USER}, not root"),
    (stat.S_IFREG | 0o644, 0, True, "is not a directory"),
])
def test_folder_problem(mode: int, uid: int, last: bool, problem: str | None) -> None:
    assert ranksock.folder_problem(status(mode, uid), owner=0, last=last) == problem


# --- the folders ----------------------------------------------------------------------------------


def test_the_jobs_folder_is_made_root_s_mode_0755(state: Path) -> None:
    os.close(ranksock.open_job_folder(state, 42))

    for folder in (state / "ranks", state / "ranks" / "42"):
        st = folder.lstat()
        assert (stat.S_ISDIR(st.st_mode), st.st_uid, stat.S_IMODE(st.st_mode)) == (True, 0, 0o755)


def test_a_state_folder_owned_by_a_user_is_refused(state: Path) -> None:
    os.chown(state, USER, USER)

    with pytest.raises(RankSocketError) as info:
        ranksock.open_job_folder(state, 42)

    assert str(info.value).endswith(f"rank socket folder: {state} is owned by uid {USER}, not root; refusing "
                                    "to serve ranks there: make it root's, mode 0755 (paths.state_dir)")
    assert list(state.iterdir()) == []


def test_a_state_folder_others_may_write_is_refused(state: Path) -> None:
    state.chmod(0o1777)

    with pytest.raises(RankSocketError, match="is writable by group or others"):
        ranksock.open_job_folder(state, 42)
    assert list(state.iterdir()) == []


def test_a_symlinked_state_folder_is_refused(state: Path) -> None:
    link = state.with_name(state.name + "-link")
    link.symlink_to(state)
    try:
        with pytest.raises(RankSocketError) as info:
            ranksock.open_job_folder(link, 42)

        assert f"rank socket folder: {link} is a symlink or not a directory" in str(info.value)
        assert list(state.iterdir()) == []
    finally:
        link.unlink()


@pytest.mark.parametrize("made", ["ranks", "ranks/42"])
def test_a_folder_on_the_way_made_by_a_user_is_refused(state: Path, made: str) -> None:
    (state / made).mkdir(parents=True)
    os.chown(state / made, USER, USER)

    with pytest.raises(RankSocketError) as info:
        ranksock.open_job_folder(state, 42)

    assert str(info.value).endswith(f"{state / made} is owned by uid {USER}, not root: remove it")


@pytest.mark.parametrize("made", ["ranks", "ranks/42"])
def test_a_symlink_on_the_way_is_refused(state: Path, made: str, tmp_path: Path) -> None:
    (state / made).parent.mkdir(parents=True, exist_ok=True)
    (state / made).symlink_to(tmp_path)

    with pytest.raises(RankSocketError, match=f"rank socket folder: {state / made} cannot be opened"):
        ranksock.open_job_folder(state, 42)
    assert list(tmp_path.iterdir()) == []


# --- the sockets ----------------------------------------------------------------------------------


def test_a_rank_socket_is_the_job_users_mode_0600_at_the_workers_path(state: Path) -> None:
    sockets = RankSockets(state, 42, USER)
    listener = sockets.listen(3)
    try:
        path = Path(wire.rank_address(42, 3, str(state / "ranks")))
        st = path.lstat()
        assert (stat.S_ISSOCK(st.st_mode), st.st_uid, stat.S_IMODE(st.st_mode)) == (True, USER, 0o600)
        assert sorted(p.name for p in path.parent.iterdir()) == ["3.sock"]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(path))
    finally:
        listener.close()
        sockets.close()
    assert not (state / "ranks" / "42").exists()


def test_a_stale_socket_is_replaced_and_a_newer_one_is_not_removed(state: Path) -> None:
    old, new = RankSockets(state, 42, 0), RankSockets(state, 42, 0)
    first = old.listen(0)
    second = new.listen(0)  # a fresh proxy takes the path over (the old one died or is leaving)
    path = state / "ranks" / "42" / "0.sock"
    try:
        old.unlink(0)  # the old proxy lets go: it must not remove the new proxy's socket

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(path))
            accepted, _ = second.accept()
            accepted.close()
    finally:
        first.close()
        second.close()
        new.close()
    assert not path.exists()


def test_the_epilog_removes_what_a_dead_proxy_left(state: Path) -> None:
    sockets = RankSockets(state, 42, 0)
    sockets.listen(0).close()

    ranksock.remove_job_folder(state, 42)

    assert list((state / "ranks").iterdir()) == []


# --- the proxy's bounds ---------------------------------------------------------------------------


def raw(address: str) -> tuple[socket.socket, wire.Reader]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(address)
    return sock, wire.Reader(sock)


def ask(conn: tuple[socket.socket, wire.Reader], message: dict) -> dict:
    wire.send(conn[0], message)
    reply, fds = conn[1].recv()
    for fd in fds:
        os.close(fd)
    return reply


@pytest.fixture
def bounded(state: Path) -> Iterator[Proxy]:
    rendezvous = MemoryRendezvous()
    proxy = Proxy(int.from_bytes(os.urandom(4), "big") + 1, 0, "p0", HostBackend(), lambda: rendezvous,
                  state_dir=state, limits=ProxyConfig(max_region_mib=2, max_rank_connections=2),
                  bind_host="127.0.0.1")
    proxy.configure("1", {0: "p0"})
    yield proxy
    proxy.stopping = True
    proxy.close()


def test_a_region_beyond_the_configured_bound_is_refused_naming_the_key(bounded: Proxy) -> None:
    conn = raw(bounded.rank_sockets.address(0))
    try:
        assert ask(conn, {"op": "hello", "rank": 0, "world_size": 1})["ok"]

        assert ask(conn, {"op": "map", "bytes": 2 << 20}) == {"ok": True, "bytes": 2 << 20}
        assert ask(conn, {"op": "map", "bytes": (2 << 20) + 1}) == {"ok": False, "error": (
            f"map: a shared region of {(2 << 20) + 1} bytes is not between 0 and the {2 << 20} bytes the "
            "admin allows (proxy.max_region_mib = 2): move less data per collective call")}
        assert ask(conn, {"op": "map", "bytes": -1})["error"].startswith("map: a shared region of -1 bytes")
    finally:
        conn[0].close()


def test_connections_beyond_the_per_rank_bound_are_closed(bounded: Proxy) -> None:
    address = bounded.rank_sockets.address(0)
    held = [raw(address) for _ in range(2)]
    extra = raw(address)
    try:
        extra[0].settimeout(5)
        assert extra[0].recv(1) == b""  # closed at once, nothing read from it
        assert ask(held[0], {"op": "hello", "rank": 0, "world_size": 1})["ok"]
    finally:
        for sock, _ in [*held, extra]:
            sock.close()


def test_the_mesh_payload_bound_follows_the_region_bound(bounded: Proxy) -> None:
    assert bounded.max_mesh_payload() == (2 << 20) * 1 + 8 + 65536
