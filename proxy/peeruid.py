"""Who owns the other end of a TCP connection, when that end is on this host (sock_diag).

The kernel answers for a socket of this network namespace, looked up by its four addresses
(NETLINK_SOCK_DIAG, an exact `inet_diag_req_v2`): the uid that created the dialing socket. Only
root runs proxies, so a connection to a proxy's mesh port from a socket of another uid on this host
is no peer, whatever it would send, and is closed before it takes a handshake slot. A dialer on
another host (or in another network namespace) is not found here: the handshake judges it.
"""

from __future__ import annotations

import errno
import socket
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
_NLMSG = struct.Struct("=IHHII")  # length, type, flags, sequence, port id
_REQUEST = struct.Struct("=BBBBI")  # family, protocol, extensions, pad, states
_ID = struct.Struct("!HH16s16s")  # source port, destination port, source, destination (network order)
_ID_TAIL = struct.Struct("=III")  # interface, cookie (two words)
_MSG_UID = 4 + _ID.size + _ID_TAIL.size + 12  # after family..retrans, the id, expires, rqueue, wqueue
NO_COOKIE = 0xFFFFFFFF


def request(local: tuple[str, int], remote: tuple[str, int], sequence: int = 1) -> bytes:
    """The sock_diag message that asks for the IPv4 TCP socket bound at `local` and connected to
    `remote` (any state)."""
    def address(host: str) -> bytes:
        return socket.inet_aton(host).ljust(16, b"\0")

    body = (_REQUEST.pack(socket.AF_INET, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF)
            + _ID.pack(local[1], remote[1], address(local[0]), address(remote[0]))
            + _ID_TAIL.pack(0, NO_COOKIE, NO_COOKIE))
    return _NLMSG.pack(_NLMSG.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, sequence, 0) + body


def parse_uid(reply: bytes) -> int | None:
    """The uid in the kernel's answer to `request`; None where it found no such socket."""
    if len(reply) < _NLMSG.size:
        return None
    _, kind, _, _, _ = _NLMSG.unpack_from(reply)
    if kind == NLMSG_ERROR:
        code = struct.unpack_from("=i", reply, _NLMSG.size)[0] if len(reply) >= _NLMSG.size + 4 else 0
        if -code in (errno.ENOENT, 0):
            return None
        raise OSError(-code, f"sock_diag: {errno.errorcode.get(-code, -code)}")
    if kind != SOCK_DIAG_BY_FAMILY or len(reply) < _NLMSG.size + _MSG_UID + 4:
        return None
    return struct.unpack_from("=I", reply, _NLMSG.size + _MSG_UID)[0]


def peer_uid(sock: socket.socket) -> int | None:
    """The uid owning the dialing end of an accepted IPv4 TCP connection, where that end is a
    socket of this host's network namespace; None where it is not (another host), is gone
    already, or the kernel cannot say."""
    try:
        ours, theirs = sock.getsockname(), sock.getpeername()
    except OSError:
        return None
    if sock.family != socket.AF_INET:
        return None
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as diag:
            diag.settimeout(1.0)
            diag.sendto(request(theirs[:2], ours[:2]), (0, 0))
            return parse_uid(diag.recv(8192))
    except OSError:
        return None
