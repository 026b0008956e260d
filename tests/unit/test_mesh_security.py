"""The proxies' mesh against strangers on its port: real sockets on localhost.

Three proxies `a` < `b` < `c` of one generation build their mesh (lower ids dial higher) while the
test, knowing where `c` listens, sends it garbage, a frame header claiming 4 GiB, a handshake with
the wrong token, a replayed handshake, a slowloris and a flood of idle connections. Every one must be
dropped, and the real peers must still connect and exchange data.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from singularity_slurm.proxy import mesh as meshmod
from singularity_slurm.proxy.mesh import Mesh, MeshError

GENERATION = "3.1"
HANDSHAKE_S = 1.0


class Lost:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.event = threading.Event()

    def __call__(self, peer: str, why: str) -> None:
        self.calls.append((peer, why))
        self.event.set()


@pytest.fixture
def token() -> str:
    return secrets.token_hex(16)


@pytest.fixture
def meshes(token: str) -> Iterator[dict[str, Mesh]]:
    made: dict[str, Mesh] = {}
    for name in ("a", "b", "c"):
        made[name] = Mesh(name, GENERATION, token, "127.0.0.1", on_lost=Lost(), max_payload=1 << 20,
                          handshake_s=HANDSHAKE_S, max_pending=8)
    yield made
    for mesh in made.values():
        mesh.close()


def addresses(meshes: dict[str, Mesh]) -> dict[str, tuple[str, int]]:
    return {name: ("127.0.0.1", mesh.port) for name, mesh in meshes.items()}


class Connecting:
    """Meshes' `connect` running in threads, as the proxies run it; `errors` once joined."""

    def __init__(self, meshes: dict[str, Mesh], names: str,
                 addrs: dict[str, dict[str, tuple[str, int]]] | None = None, timeout: float = 30):
        self.errors: dict[str, BaseException | None] = {}
        self.timeout = timeout
        self.threads = [threading.Thread(target=self.run, args=(meshes[n], (addrs or {}).get(n)
                                                                or addresses(meshes)))
                        for n in names]
        for thread in self.threads:
            thread.start()

    def run(self, mesh: Mesh, addrs: dict[str, tuple[str, int]]) -> None:
        try:
            mesh.connect(addrs, timeout=self.timeout)
            self.errors[mesh.me] = None
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.errors[mesh.me] = exc

    def join(self) -> dict[str, BaseException | None]:
        for thread in self.threads:
            thread.join(self.timeout + 10)
        return self.errors


def connect_all(meshes: dict[str, Mesh], addrs: dict[str, dict[str, tuple[str, int]]] | None = None,
                timeout: float = 30) -> dict[str, BaseException | None]:
    """Every mesh's connect at once; each one's exception or None."""
    return Connecting(meshes, "abc", addrs, timeout).join()


def accepting(mesh: Mesh) -> None:
    """Wait until `mesh`'s connect (started by the caller) accepts: it then expects its dialers."""
    deadline = time.monotonic() + 10
    while not mesh.expected:
        assert time.monotonic() < deadline, "the mesh never started accepting"
        time.sleep(0.01)


def attacked(meshes: dict[str, Mesh], attack) -> dict[str, BaseException | None]:
    """`c` accepts, `attack()` runs against it, then `a` and `b` connect; everyone's errors."""
    c_side = Connecting(meshes, "c")
    accepting(meshes["c"])
    attack()
    errors = Connecting(meshes, "ab").join()
    return {**errors, **c_side.join()}


def exchange(meshes: dict[str, Mesh]) -> None:
    """Data in both directions between every pair, and a control message."""
    for sender in meshes.values():
        for receiver in meshes.values():
            if sender is not receiver:
                sender.send(receiver.me, f"t-{sender.me}", [np.arange(4, dtype=np.float32) + ord(sender.me)])
    for receiver in meshes.values():
        for sender in meshes.values():
            if sender is not receiver:
                data = np.frombuffer(receiver.take(f"t-{sender.me}", sender.me), dtype=np.float32)
                assert data.tolist() == (np.arange(4) + ord(sender.me)).tolist()


def stranger(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def read_challenge(sock: socket.socket) -> bytes:
    data = b""
    while len(data) < len(meshmod.MAGIC) + meshmod.NONCE:
        chunk = sock.recv(64)
        assert chunk, "the mesh closed before its challenge"
        data += chunk
    return meshmod.parse_challenge(data)


def closed_by_peer(sock: socket.socket, within: float) -> bool:
    """Whether the other end closes `sock` within `within` seconds (whatever it sends first)."""
    sock.settimeout(within)
    deadline = time.monotonic() + within
    try:
        while time.monotonic() < deadline:
            if sock.recv(4096) == b"":
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False


def no_peer_lost(meshes: dict[str, Mesh]) -> None:
    assert {n: m.on_lost.calls for n, m in meshes.items()} == {"a": [], "b": [], "c": []}


# --- the handshake as pure functions --------------------------------------------------------------


def test_the_mac_binds_token_role_generation_both_ids_and_both_nonces() -> None:
    base = ("k" * 32, b"dial", "1.0", "b", "a", b"n" * 32, b"m" * 32)
    mac = meshmod.handshake_mac(*base)

    variants = [("x" * 32, *base[1:]), (base[0], b"accept", *base[2:]), (*base[:2], "1.1", *base[3:]),
                (*base[:3], "c", *base[4:]), (*base[:4], "z", *base[5:]), (*base[:5], b"o" * 32, base[6]),
                (*base[:6], b"p" * 32)]
    assert all(meshmod.handshake_mac(*v) != mac for v in variants)
    assert meshmod.handshake_mac(*base) == mac


def test_the_dial_message_carries_no_token() -> None:
    token = secrets.token_hex(16)
    message = meshmod.dial_message(token, "1.0", "b", "a", os.urandom(32), os.urandom(32))

    assert token.encode() not in message and bytes.fromhex(token) not in message
    assert len(message) == 32 + 1 + 1 + 32


def test_a_proxy_id_too_long_for_the_handshake_is_refused() -> None:
    with pytest.raises(meshmod.HandshakeError):
        meshmod.dial_message("k" * 32, "1", "b", "x" * (meshmod.MAX_ID + 1), b"n" * 32, b"m" * 32)


# --- strangers on the port ------------------------------------------------------------------------


def test_real_peers_connect_and_exchange_while_strangers_attack_the_port(meshes, token: str) -> None:
    c = meshes["c"]
    attacks: list[socket.socket] = []
    named: dict[str, socket.socket] = {}

    def attack() -> None:
        # Idle connections first: the flood fills the pending handshakes before the peers dial.
        attacks.extend(stranger(c.port) for _ in range(40))
        named["garbage"] = stranger(c.port)
        named["garbage"].sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + os.urandom(4096))
        named["huge"] = stranger(c.port)
        named["huge"].sendall(struct.pack("!IQ", 0xFFFFFFFF, (1 << 64) - 1) + b"{" * 40)
        named["wrong"] = wrong = stranger(c.port)
        nonce = read_challenge(wrong)
        wrong.sendall(meshmod.dial_message(secrets.token_hex(16), GENERATION, "c", "a", nonce,
                                           os.urandom(32)))
        # A handshake made for one connection, replayed on another.
        first, named["replayed"] = stranger(c.port), stranger(c.port)
        replayed = meshmod.dial_message(token, GENERATION, "c", "a", read_challenge(first), os.urandom(32))
        read_challenge(named["replayed"])
        named["replayed"].sendall(replayed)
        attacks.extend([first, *named.values()])

    errors = attacked(meshes, attack)

    assert errors == {"a": None, "b": None, "c": None}
    exchange(meshes)
    assert all(closed_by_peer(named[k], HANDSHAKE_S + 5) for k in ("wrong", "replayed", "garbage", "huge"))
    assert c.dropped >= 5
    assert set(c.peers) == {"a", "b"}
    no_peer_lost(meshes)
    for sock in attacks:
        sock.close()


def test_a_slowloris_is_cut_off_at_the_handshake_deadline(meshes) -> None:
    c = meshes["c"]
    c_side = Connecting(meshes, "c")
    accepting(c)
    slow = stranger(c.port)
    read_challenge(slow)
    started = time.monotonic()
    cut = False
    for _ in range(40):  # one byte every 0.1 s, forever: never a whole handshake
        try:
            slow.sendall(b"\x00")
        except (BrokenPipeError, ConnectionResetError):
            cut = True
            break
        slow.settimeout(0.1)
        try:
            if slow.recv(1) == b"":
                cut = True
                break
        except TimeoutError:
            pass

    assert cut, "the slow connection was still open after 4 s"
    assert time.monotonic() - started < HANDSHAKE_S + 1.5
    slow.close()
    assert {**Connecting(meshes, "ab").join(), **c_side.join()} == {"a": None, "b": None, "c": None}
    exchange(meshes)


def test_a_flood_of_idle_connections_keeps_threads_bounded_and_peers_get_in(meshes) -> None:
    c = meshes["c"]
    baseline = threading.active_count()
    c_side = Connecting(meshes, "c")
    accepting(c)
    flood = [stranger(c.port) for _ in range(200)]
    bound = baseline + 1 + 1 + c.max_pending  # connect, accept, handshakes
    deadline = time.monotonic() + 60  # a loaded machine takes its time; the bounds must hold then
    while (c.dropped < 200 - c.max_pending or threading.active_count() > bound) \
            and time.monotonic() < deadline:
        time.sleep(0.01)

    assert c.dropped >= 200 - c.max_pending  # the oldest idle ones made way for newer ones
    assert threading.active_count() <= bound
    assert {**Connecting(meshes, "ab").join(), **c_side.join()} == {"a": None, "b": None, "c": None}
    exchange(meshes)
    for sock in flood:
        sock.close()


LOCAL_FLOOD = """
import socket, sys, time
held = []
for _ in range(int(sys.argv[2])):
    try:
        held.append(socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5))
    except OSError:
        pass
print(len(held), flush=True)
time.sleep(60)
"""


def test_a_flood_from_another_user_of_the_host_takes_no_handshake_slot(meshes) -> None:
    """Another user on a node opens connection after connection to a proxy's port (faster than a
    handshake round trip, before the proxies dial each other): each is closed at once, none holds
    a slot, and the real peers get in."""
    import subprocess
    import sys

    if os.geteuid() != 0:
        pytest.skip("needs root to connect as another user")
    c = meshes["c"]
    c_side = Connecting(meshes, "c")
    accepting(c)
    flood = subprocess.Popen([sys.executable, "-c", LOCAL_FLOOD, str(c.port), "200"], user=65534,
                             stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        assert flood.stdout.readline().strip() == "200"  # all dialed
        deadline = time.monotonic() + 30
        while c.dropped < 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.dropped == 200 and c.pending == {}  # each closed at once, none took a slot
        assert {**Connecting(meshes, "ab").join(), **c_side.join()} == {"a": None, "b": None, "c": None}
        exchange(meshes)
    finally:
        flood.kill()
        flood.wait()


def test_the_kernel_names_the_uid_of_a_local_dialer_and_none_for_a_socket_it_has_not() -> None:
    from singularity_slurm.proxy import peeruid

    server = socket.create_server(("127.0.0.1", 0))
    dialer = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    try:
        assert peeruid.peer_uid(accepted) == os.geteuid()
        # a socket this host does not have (as a dialer on another host): no uid
        reply_to = peeruid.request(("127.0.0.1", 1), ("127.0.0.1", 2))
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, peeruid.NETLINK_SOCK_DIAG) as diag:
            diag.sendto(reply_to, (0, 0))
            assert peeruid.parse_uid(diag.recv(8192)) is None
    finally:
        for sock in (accepted, dialer, server):
            sock.close()


def test_once_every_peer_is_in_a_stranger_is_dropped_at_once(meshes) -> None:
    assert connect_all(meshes) == {"a": None, "b": None, "c": None}
    late = stranger(meshes["c"].port)

    assert closed_by_peer(late, 2)
    exchange(meshes)


def test_the_token_never_crosses_the_wire(meshes, token: str) -> None:
    """`a` reaches `c` through a relay that records every byte both ways."""
    recorded = bytearray()
    relay = socket.create_server(("127.0.0.1", 0))

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                recorded.extend(data)
                dst.sendall(data)
        except OSError:
            pass

    def serve() -> None:
        inner, _ = relay.accept()
        outer = socket.create_connection(("127.0.0.1", meshes["c"].port))
        threading.Thread(target=pump, args=(inner, outer), daemon=True).start()
        threading.Thread(target=pump, args=(outer, inner), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    via_relay = {**addresses(meshes), "c": ("127.0.0.1", relay.getsockname()[1])}

    assert connect_all(meshes, {"a": via_relay}) == {"a": None, "b": None, "c": None}
    exchange(meshes)
    assert len(recorded) > 100
    assert token.encode() not in recorded and bytes.fromhex(token) not in recorded
    relay.close()


def test_a_dialer_does_not_trust_a_listener_without_the_token(token: str) -> None:
    """A stranger's listener at a peer's address answers the challenge it cannot: `a` refuses it."""
    impostor = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        conn, _ = impostor.accept()
        with conn:
            conn.sendall(meshmod.challenge(os.urandom(32)))
            conn.recv(4096)
            conn.sendall(os.urandom(32))
            time.sleep(1)

    threading.Thread(target=answer, daemon=True).start()
    a = Mesh("a", GENERATION, token, "127.0.0.1", handshake_s=HANDSHAKE_S)
    try:
        with pytest.raises(MeshError) as info:
            a.connect({"a": ("127.0.0.1", a.port), "b": ("127.0.0.1", impostor.getsockname()[1])}, timeout=1)
        assert "did not authenticate" in str(info.value) or "cannot reach" in str(info.value)
        assert a.peers == {}
    finally:
        a.close()
        impostor.close()


# --- authenticated peers are bounded too ----------------------------------------------------------


def authenticated(mesh: Mesh, token: str, me: str) -> socket.socket:
    sock = stranger(mesh.port)
    nonce = read_challenge(sock)
    mine = os.urandom(32)
    sock.sendall(meshmod.dial_message(token, GENERATION, mesh.me, me, nonce, mine))
    answer = sock.recv(32)
    assert answer == meshmod.handshake_mac(token, b"accept", GENERATION, mesh.me, me, nonce, mine)
    return sock


@pytest.mark.parametrize(("head", "why"), [
    (struct.pack("!IQ", meshmod.MAX_HEADER + 1, 0), f"frame header of {meshmod.MAX_HEADER + 1} bytes exceeds "
                                                    f"{meshmod.MAX_HEADER}"),
    (struct.pack("!IQ", 2, (1 << 20) + 1), f"frame payload of {(1 << 20) + 1} bytes exceeds {1 << 20}"),
])
def test_an_oversized_frame_from_an_authenticated_peer_is_a_lost_peer(token: str, head: bytes,
                                                                      why: str) -> None:
    lost = Lost()
    b = Mesh("b", GENERATION, token, "127.0.0.1", on_lost=lost, max_payload=1 << 20,
             handshake_s=HANDSHAKE_S)
    threading.Thread(target=b.connect, args=({"a": ("127.0.0.1", 1), "b": ("127.0.0.1", b.port)}, 10),
                     daemon=True).start()
    accepting(b)
    try:
        sock = authenticated(b, token, "a")
        sock.sendall(head)

        assert lost.event.wait(10)
        assert lost.calls == [("a", why)]
        sock.close()
    finally:
        b.close()


def test_connect_without_a_token_is_refused(token: str) -> None:
    mesh = Mesh("a", GENERATION, "", "127.0.0.1")
    try:
        with pytest.raises(MeshError, match="no rendezvous token"):
            mesh.connect({"a": ("127.0.0.1", mesh.port)}, timeout=1)
    finally:
        mesh.close()
