"""The node agent: one per job per node, started by Prolog as root, stopped by Epilog.

It listens on a unix socket in the job's node-local folder and answers JSON requests, one per line.
Callers are identified by SO_PEERCRED: only root and the job's own user are served. Today it answers
`ping` (liveness and identity); the checkpoint work adds `dump` and `restore` through CRIU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import socketserver
import struct
import sys
import threading
from pathlib import Path

MAX_REQUEST = 1 << 20


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


def authorized(peer_uid: int, job_uid: int) -> bool:
    return peer_uid in (0, job_uid)


class AgentState:
    def __init__(self, job_id: int, job_uid: int, node: str):
        self.job_id = job_id
        self.job_uid = job_uid
        self.node = node

    def handle(self, request: dict, peer_uid: int) -> dict:
        if not authorized(peer_uid, self.job_uid):
            return {"ok": False, "error": f"uid {peer_uid} may not act on job {self.job_id}"}
        op = request.get("op")
        if op == "ping":
            return {"ok": True, "job_id": self.job_id, "node": self.node, "pid": os.getpid()}
        return {"ok": False, "error": f"unknown op {op!r}; valid ops: ping"}


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        _, uid, _ = peer_credentials(self.request)
        for line in self.rfile:
            if len(line) > MAX_REQUEST:
                reply = {"ok": False, "error": "request too large"}
            else:
                try:
                    request = json.loads(line)
                    if not isinstance(request, dict):
                        raise ValueError("not an object")
                    reply = self.server.state.handle(request, uid)  # type: ignore[attr-defined]
                except ValueError as exc:
                    reply = {"ok": False, "error": f"bad request: {exc}"}
            self.wfile.write(json.dumps(reply).encode() + b"\n")


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def request(socket_path: Path, payload: dict, timeout: float = 5.0) -> dict:
    """Send one request to an agent and return its reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(socket_path))
        sock.sendall(json.dumps(payload).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return json.loads(data)


def serve(socket_path: Path, state: AgentState) -> None:
    socket_path.unlink(missing_ok=True)
    tmp = socket_path.with_name(socket_path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    server = _Server(str(tmp), _Handler)
    server.state = state  # type: ignore[attr-defined]
    # Anyone may connect; SO_PEERCRED decides who is served.
    os.chmod(tmp, 0o666)
    os.rename(tmp, socket_path)  # the socket appears only once it is listening

    def shutdown(signum, frame):
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    print(f"node agent for job {state.job_id} on {state.node} listening on {socket_path}",
          flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        socket_path.unlink(missing_ok=True)
        print(f"node agent for job {state.job_id} on {state.node} stopped", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="singularity-node-agent",
                                     description="Per-job node agent (started by the prolog).")
    parser.add_argument("--job-id", type=int, required=True)
    parser.add_argument("--uid", type=int, required=True, help="uid of the job's user")
    parser.add_argument("--node", required=True)
    parser.add_argument("--socket", type=Path, required=True)
    args = parser.parse_args(argv)
    serve(args.socket, AgentState(args.job_id, args.uid, args.node))
    return 0


if __name__ == "__main__":
    sys.exit(main())
