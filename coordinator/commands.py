"""Admin requests to a job's node agent through Redis, authenticated by munge.

The owner of a job reaches its node agent with a job step (Slurm authenticates it); root and the
operators named in `[admin] operators` cannot, because Slurm refuses their steps in other users' jobs.
Their `singularityctl checkpoint|migrate` signs a request with munge instead (the payload is the
request's canonical JSON, decodable by root only) and pushes it onto the job's request list in Redis.
The agent on the job's batch host pops it, has munged verify it, takes the caller's uid from munge and
from nothing else, checks that the request is fresh, well-formed and names its own job, that the uid is
root, the job's owner or an operator, carries it out as the socket op would, and pushes the answer
onto a short-lived reply key. Redis only carries the messages; munge says who asked.

The decisions are pure functions (`parse_unmunge`, `parse_request`, `verify`, `agent_request`); the
munge calls, `CommandClient` and the agent's `CommandServer` thread are thin shells around them.
"""

from __future__ import annotations

import json
import logging
import pwd
import re
import secrets
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from singularity_slurm import rpc
from singularity_slurm.errors import CommandChannelError, SingularityError
from singularity_slurm.slurmcli import expand_hostlist

from . import keys

MUNGE = Path("/usr/bin/munge")
UNMUNGE = Path("/usr/bin/unmunge")
CLEAN_ENV = {"LC_ALL": "C"}
OPS = ("checkpoint", "migrate", "resize")
MAX_SIZE = 4096
"""The most nodes, or devices per node, a resize may name."""
FIELDS = frozenset({"job_id", "op", "args", "request_id", "issued_at"})
MAX_ENVELOPE = 64 * 1024  # bytes of one list entry, checked before anything parses it
MAX_PAYLOAD = 16 * 1024  # bytes of the signed request (a migration's exclude list fits)
MAX_AGE_S = 60  # a credential older than this is refused (munge's TTL is set to the same)
MAX_SKEW_S = 30  # a credential this far in the future is refused (clocks of two hosts)
PICKUP_TIMEOUT_S = 45.0  # < MAX_AGE_S: the client withdraws a request nobody took by then
REPLY_TTL_S = 120
BLOCK_S = 1.0  # the agent looks for requests this often, and notices a stop request within this
MAX_BACKOFF_S = 10.0
_REQUEST_ID = re.compile(r"[0-9a-f]{32}")
_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")

LOG = logging.getLogger("singularity.agent.commands")


class MungeUnavailable(CommandChannelError):
    """munge cannot sign a request on this host: install MUNGE or start munged."""


class AgentDidNotAnswer(CommandChannelError):
    """No answer in time; the message says whether the request may still be carried out."""


class Refused(Exception):
    """The agent does not carry out a request: `reason` goes to its log and, when the request could be
    identified (`request_id`), back to the caller."""

    def __init__(self, reason: str, uid: int | None = None, request_id: str | None = None):
        super().__init__(reason)
        self.reason = reason
        self.uid = uid
        self.request_id = request_id


# --- the request ---------------------------------------------------------------------------------


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


@dataclass(frozen=True)
class Request:
    job_id: int
    op: str
    args: dict[str, Any] = field(hash=False)
    request_id: str
    issued_at: float

    def payload(self) -> bytes:
        return canonical({"job_id": self.job_id, "op": self.op, "args": self.args,
                          "request_id": self.request_id, "issued_at": self.issued_at})


def new_request(job_id: int, op: str, args: dict[str, Any], clock: Callable[[], float] = time.time
                ) -> Request:
    """A request with a random id, checked as the agent will check it."""
    request = Request(job_id, op, args, secrets.token_hex(16), round(clock(), 3))
    try:
        return parse_request(request.payload(), job_id)
    except Refused as exc:
        raise CommandChannelError(f"cannot send {op} for job {job_id}: {exc.reason}") from None


def _check_args(op: str, args: Any) -> dict[str, Any]:
    if not isinstance(args, dict):
        raise Refused(f"args must be an object, got {type(args).__name__}")
    if op == "checkpoint" and args:
        raise Refused(f"checkpoint takes no arguments, got {sorted(args)}")
    if op == "migrate":
        exclude = args.get("exclude")
        if set(args) != {"exclude"} or not isinstance(exclude, list) or not all(
                isinstance(n, str) and _NODE.fullmatch(n) for n in exclude):
            raise Refused("migrate takes exactly {exclude: [node names]}")
    if op == "resize":
        return resize_args(args)
    return args


def resize_args(args: Any) -> dict[str, Any]:
    """{nodes: [MIN, MAX] | null, gpus_per_node: G | null}, at least one given; else Refused."""
    def count(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_SIZE

    usage = (f"resize takes {{nodes: [MIN, MAX] or null, gpus_per_node: G or null}} (1..{MAX_SIZE}, "
             "MIN <= MAX), at least one of them")
    if not isinstance(args, dict) or set(args) != {"nodes", "gpus_per_node"}:
        raise Refused(usage)
    nodes, gpus = args["nodes"], args["gpus_per_node"]
    if nodes is not None and not (isinstance(nodes, list) and len(nodes) == 2 and all(map(count, nodes))
                                  and nodes[0] <= nodes[1]):
        raise Refused(usage)
    if (gpus is not None and not count(gpus)) or (nodes is None and gpus is None):
        raise Refused(usage)
    return {"nodes": nodes, "gpus_per_node": gpus}


def parse_request(payload: bytes, job_id: int) -> Request:
    """The request a verified payload holds, refused unless it is well-formed and for `job_id`."""
    if len(payload) > MAX_PAYLOAD:
        raise Refused(f"request of {len(payload)} bytes is over the {MAX_PAYLOAD}-byte limit")
    try:
        obj = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        raise Refused("request is not JSON") from None
    if not isinstance(obj, dict) or set(obj) != FIELDS:
        raise Refused(f"request must be an object with exactly the fields {', '.join(sorted(FIELDS))}")
    given_job = obj["job_id"]
    if type(given_job) is not int or given_job != job_id:
        raise Refused(f"request is for job {given_job!r}; this agent serves job {job_id}")
    request_id = obj["request_id"]
    if not isinstance(request_id, str) or not _REQUEST_ID.fullmatch(request_id):
        raise Refused("request_id must be 32 lowercase hex digits")
    try:
        op = obj["op"]
        if op not in OPS:
            raise Refused(f"unknown op {op!r}; valid ops: {', '.join(OPS)}")
        issued_at = obj["issued_at"]
        if type(issued_at) not in (int, float):
            raise Refused("issued_at must be a number")
        request = Request(job_id, op, _check_args(op, obj["args"]), request_id, issued_at)
        if request.payload() != payload:
            raise Refused("request is not in canonical form")
    except Refused as exc:
        exc.request_id = request_id
        raise
    return request


# --- munge ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Credential:
    """What unmunge printed: `ok` only when munged accepted the credential."""

    ok: bool
    status: str
    uid: int | None
    encode_time: int | None
    payload: bytes


def _number(value: str | None) -> int | None:
    """`root (0)` -> 0, `2026-12-01 03:34:27 +0000 (1796096067)` -> 1796096067, `7` -> 7."""
    match = re.fullmatch(r"(?:.*\()?(\d+)\)?", value or "")
    return int(match[1]) if match else None


def parse_unmunge(returncode: int, stdout: bytes, stderr: bytes) -> Credential:
    """unmunge's output: `KEY: value` metadata lines, a blank line, then exactly LENGTH payload bytes.

    A replayed or expired credential still prints its metadata and payload, with a non-zero STATUS
    and exit status; the payload then only serves to tell the caller why.
    """
    head, blank, payload = stdout.partition(b"\n\n")
    if not blank:
        why = stderr.decode(errors="replace").strip() or "no output"
        raise Refused(f"unmunge could not decode the credential (exit status {returncode}): {why}")
    fields = {}
    for line in head.decode(errors="replace").splitlines():
        key, colon, value = line.partition(":")
        if colon:
            fields[key.strip()] = value.strip()
    status = _number(fields.get("STATUS"))
    length = _number(fields.get("LENGTH"))
    if status is None or length != len(payload):
        raise Refused(f"unmunge printed no STATUS or a LENGTH ({fields.get('LENGTH')}) that is not the "
                      f"payload's ({len(payload)})")
    return Credential(ok=returncode == 0 and status == 0, status=fields["STATUS"],
                      uid=_number(fields.get("UID")), encode_time=_number(fields.get("ENCODE_TIME")),
                      payload=payload)


def munge_encode(payload: bytes, *, munge: Path = MUNGE, socket: Path | None = None,
                 run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> str:
    """A credential of the calling user carrying `payload`, decodable by root only."""
    argv = [str(munge), "--restrict-uid=0", f"--ttl={MAX_AGE_S}"] + ([f"--socket={socket}"] if socket else [])
    try:
        proc = run(argv, input=payload, capture_output=True, env=CLEAN_ENV, timeout=10)
    except FileNotFoundError:
        raise MungeUnavailable(f"{munge} not found: install MUNGE on this host (Debian: `apt install "
                               "munge`); root and operators act on other users' jobs through it") from None
    except subprocess.TimeoutExpired:
        raise MungeUnavailable(f"{munge} did not answer within 10s: check munged "
                               "(`systemctl status munge`)") from None
    why = proc.stderr.decode(errors="replace").strip()
    if proc.returncode == 6:  # EMUNGE_SOCKET
        raise MungeUnavailable(f"munged is not running on this host ({why}): start it "
                               "(`systemctl start munge`)")
    credential = proc.stdout.decode(errors="replace").strip()
    if proc.returncode != 0 or not credential.startswith("MUNGE:"):
        raise MungeUnavailable(f"{munge} failed with exit status {proc.returncode}: {why or 'no credential'}")
    return credential


def unmunge_decode(credential: str, *, unmunge: Path = UNMUNGE,
                   run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> Credential:
    try:
        proc = run([str(unmunge)], input=credential.encode(), capture_output=True, env=CLEAN_ENV,
                   timeout=10)
    except FileNotFoundError:
        raise Refused(f"{unmunge} not found on this node: install MUNGE") from None
    except subprocess.TimeoutExpired:
        raise Refused(f"{unmunge} did not answer within 10s: check munged on this node") from None
    return parse_unmunge(proc.returncode, proc.stdout, proc.stderr)


# --- the agent's decisions ------------------------------------------------------------------------


def operator_uids(names: Iterable[str], lookup: Callable[[str], Any] = pwd.getpwnam) -> frozenset[int]:
    """The uids of the configured operators; a name the passwd database does not know is nobody."""
    uids = set()
    for name in names:
        try:
            uids.add(lookup(name).pw_uid)
        except KeyError:
            LOG.warning("[admin] operators names %r, which is no user here: ignored", name)
    return frozenset(uids)


def authorize(uid: int, job_id: int, job_uid: int, operators: frozenset[int]) -> None:
    if uid not in (0, job_uid) and uid not in operators:
        raise Refused(f"uid {uid} may not act on job {job_id}: only root, the job's owner and the "
                      "operators named in [admin] operators may")


def _envelope_credential(envelope: bytes) -> str:
    if len(envelope) > MAX_ENVELOPE:
        raise Refused(f"request of {len(envelope)} bytes is over the {MAX_ENVELOPE}-byte limit")
    try:
        obj = json.loads(envelope)
    except (ValueError, UnicodeDecodeError):
        raise Refused("request is not JSON") from None
    if not isinstance(obj, dict) or set(obj) != {"credential"} or not isinstance(obj["credential"], str) \
            or not obj["credential"].startswith("MUNGE:"):
        raise Refused("request must be {credential: \"MUNGE:...\"}")
    return obj["credential"]


def verify(envelope: bytes, *, job_id: int, job_uid: int, operators: frozenset[int], now: float,
           unmunge: Callable[[str], Credential]) -> tuple[Request, int]:
    """The request in a list entry and the uid that signed it, or `Refused` with the reason."""
    credential = unmunge(_envelope_credential(envelope))
    if not credential.ok:
        refusal = Refused(f"munge refused the credential: {credential.status}", credential.uid)
        try:
            refusal.request_id = parse_request(credential.payload, job_id).request_id
        except Refused:
            pass
        raise refusal
    uid, encoded = credential.uid, credential.encode_time
    if uid is None or encoded is None:
        raise Refused("unmunge printed no UID or ENCODE_TIME")
    try:
        request = parse_request(credential.payload, job_id)
        if now - encoded > MAX_AGE_S:
            raise Refused(f"credential is {now - encoded:.0f}s old; the limit is {MAX_AGE_S}s",
                          request_id=request.request_id)
        if encoded - now > MAX_SKEW_S or abs(request.issued_at - encoded) > MAX_SKEW_S:
            raise Refused(f"credential time {encoded} is not this node's ({now:.0f}) or the request's "
                          f"({request.issued_at:.0f}): check the clocks", request_id=request.request_id)
        try:
            authorize(uid, job_id, job_uid, operators)
        except Refused as exc:
            exc.request_id = request.request_id
            raise
    except Refused as exc:
        exc.uid = uid
        raise
    return request, uid


def agent_request(request: Request, multi_node: bool) -> dict[str, Any]:
    """The node agent's op for a request: what `singularityctl checkpoint|migrate` sends its owner's way."""
    if request.op == "checkpoint":
        # Only the launcher of a multi-node job can checkpoint every node at one cut.
        return {"op": "launcher_checkpoint"} if multi_node else {"op": "checkpoint", "reason": "manual",
                                                                "stop": False}
    if request.op == "resize":
        return {"op": "resize", **resize_args(request.args)}
    return {"op": "migrate", "exclude": list(request.args["exclude"])}


def batch_role(record: dict[str, str] | None, node: str) -> tuple[bool, bool] | None:
    """(this node is the job's batch host, the job has several nodes), from Slurm's record; None when
    Slurm does not (yet) say."""
    if not record or not record.get("BatchHost"):
        return None
    return record["BatchHost"] == node, len(expand_hostlist(record.get("NodeList", ""))) > 1


_POP_BOUNDED = """
local entry = redis.call('LPOP', KEYS[1])
if not entry then return false end
if string.len(entry) > tonumber(ARGV[1]) then return string.len(entry) end
return {entry}
"""


def pop_bounded(client: redis.Redis, key: str, limit: int) -> str | int | None:
    """Pop the list's first entry: the entry, or only its size (an int; the entry is dropped) when it
    is over `limit` bytes, or None when the list is empty.

    Redis lets an entry be 512 MiB; BLPOP would send all of it here before any check. A script pops
    and measures it inside Redis instead, so nothing over the limit ever reaches the agent.
    """
    popped = client.eval(_POP_BOUNDED, 1, key, limit)
    if popped is None or isinstance(popped, int):
        return popped
    return popped[0]


def next_delay(delay: float) -> float:
    """Backoff while Redis or Slurm is unreachable: 0.5 s, doubling, at most MAX_BACKOFF_S."""
    return min(max(delay * 2, 0.5), MAX_BACKOFF_S)


# --- the client (root or an operator) --------------------------------------------------------------


class CommandClient:
    def __init__(self, client: redis.Redis, munge: Callable[[bytes], str] = munge_encode,
                 clock: Callable[[], float] = time.monotonic):
        self.redis = client
        self.munge = munge
        self.clock = clock

    def send(self, request: Request, *, where: str, say: Callable[[str], None] = print,
             pickup_timeout: float = PICKUP_TIMEOUT_S, timeout: float = 900.0,
             progress_every: float = 30.0, block_s: float = BLOCK_S) -> dict[str, Any]:
        """Sign and send `request`, then wait for the agent's answer (`{"ok": ..., ...}`)."""
        job = request.job_id
        envelope = json.dumps({"credential": self.munge(request.payload())})
        requests_key = keys.job_requests(job)
        try:
            pipe = self.redis.pipeline()
            pipe.rpush(requests_key, envelope)
            pipe.expire(requests_key, 2 * MAX_AGE_S)
            pipe.execute()
            say(f"sent to job {job}'s node agent on {where} through Redis; waiting for its answer...")
            started = self.clock()
            taken = False
            next_progress = started + progress_every
            while True:
                elapsed = self.clock() - started
                if not taken and elapsed >= pickup_timeout:
                    if self.redis.lrem(requests_key, 1, envelope):
                        raise AgentDidNotAnswer(
                            f"job {job}'s node agent on {where} did not take the request within "
                            f"{pickup_timeout:.0f}s, so nothing was done: check that it runs and reaches "
                            f"Redis (its log: agent.log in the job's state folder on {where})")
                    taken = True
                if elapsed >= timeout:
                    raise AgentDidNotAnswer(
                        f"no answer from job {job}'s node agent on {where} within {timeout:.0f}s; the "
                        f"request may still be carried out: check with `singularityctl status {job}`")
                item = self.redis.blpop([keys.job_reply(job, request.request_id)], timeout=block_s)
                if item is not None:
                    return _reply(item[1], job)
                if self.clock() >= next_progress:
                    say(f"still waiting for job {job}'s node agent on {where} ({elapsed:.0f}s)...")
                    next_progress += progress_every
        except redis.RedisError as exc:
            raise CommandChannelError(f"lost Redis while talking to job {job}'s node agent ({exc}); "
                                      f"the request may still be carried out: check with "
                                      f"`singularityctl status {job}`") from exc


def _reply(raw: str, job: int) -> dict[str, Any]:
    try:
        reply = json.loads(raw)
    except ValueError:
        reply = None
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        raise CommandChannelError(f"job {job}'s node agent answered something that is not a reply: "
                                  f"{raw[:200]!r}")
    return reply


# --- the server (a thread of the node agent on the job's batch host) --------------------------------


class CommandServer:
    """Pops, verifies and carries out admin requests for one job; `state` is the node agent's
    `AgentState` (its `dispatch` carries out an op for an already authorised caller)."""

    def __init__(self, state: Any, *, job_id: int, job_uid: int, node: str, operators: Sequence[str],
                 connect: Callable[[], redis.Redis], locate: Callable[[], dict[str, str] | None],
                 unmunge: Callable[[str], Credential] = unmunge_decode,
                 clock: Callable[[], float] = time.time, lookup_user: Callable[[str], Any] = pwd.getpwnam,
                 block_s: float = BLOCK_S, wait: Callable[[float], Any] | None = None):
        self.state = state
        self.job_id = job_id
        self.job_uid = job_uid
        self.node = node
        self.operators = tuple(operators)
        self.connect = connect
        self.locate = locate
        self.unmunge = unmunge
        self.clock = clock
        self.lookup_user = lookup_user
        self.block_s = block_s
        self.stopping = threading.Event()
        self.wait = wait or self.stopping.wait  # returns early when the agent stops
        self._seen: dict[str, float] = {}  # request ids taken lately: a replay is refused
        self._lock = threading.Lock()

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name="admin-commands", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self.stopping.set()

    def run(self) -> None:
        role = self._retrying("asking Slurm for the job's batch host", lambda: batch_role(
            self.locate(), self.node))
        if role is None:
            return
        batch_host, multi_node = role
        if not batch_host:
            LOG.info("job %s node %s: not the batch host; admin requests are taken there", self.job_id,
                     self.node)
            return
        LOG.info("job %s node %s: taking admin requests from %s", self.job_id, self.node,
                 keys.job_requests(self.job_id))
        client: redis.Redis | None = None
        delay = 0.0
        while not self.stopping.is_set():
            try:
                if client is None:
                    client = self.connect()
                entry = pop_bounded(client, keys.job_requests(self.job_id), MAX_ENVELOPE)
            except (SingularityError, redis.RedisError, OSError) as exc:
                client = None
                if delay == 0:
                    LOG.warning("job %s node %s: Redis unavailable for admin requests (%s); retrying",
                                self.job_id, self.node, exc)
                delay = next_delay(delay)
                self.wait(delay)
                continue
            except ValueError as exc:  # an entry that is not UTF-8: popped, so it is gone
                LOG.warning("job %s node %s: refused an admin request from uid unknown: not text (%s)",
                            self.job_id, self.node, exc)
                continue
            if delay:
                LOG.info("job %s node %s: Redis reachable again", self.job_id, self.node)
                delay = 0.0
            if entry is None:
                self.wait(self.block_s)
            elif isinstance(entry, int):
                LOG.warning("job %s node %s: refused an admin request from uid unknown: request of %s bytes "
                            "is over the %s-byte limit (dropped unread)", self.job_id, self.node, entry,
                            MAX_ENVELOPE)
            else:
                try:
                    self.take(client, entry, multi_node)
                except Exception:  # the agent outlives any one request
                    LOG.exception("job %s node %s: could not take an admin request", self.job_id,
                                  self.node)

    def _retrying(self, what: str, attempt: Callable[[], Any]) -> Any:
        delay = 0.0
        while not self.stopping.is_set():
            try:
                result = attempt()
                if result is not None:
                    return result
                failure = "no answer yet"
            except Exception as exc:  # Slurm's answer, whatever goes wrong: try again later
                failure = str(exc)
            if delay == 0:
                LOG.warning("job %s node %s: %s: %s; retrying", self.job_id, self.node, what, failure)
            delay = next_delay(delay)
            self.wait(delay)
        return None

    def take(self, client: redis.Redis, envelope: str, multi_node: bool) -> None:
        """Verify one list entry; carry it out in its own thread (a migration takes minutes)."""
        try:
            request, uid = verify(envelope.encode(), job_id=self.job_id, job_uid=self.job_uid,
                                  operators=operator_uids(self.operators, self.lookup_user),
                                  now=self.clock(), unmunge=self.unmunge)
            self._first_time(request, uid)
        except Refused as exc:
            LOG.warning("job %s node %s: refused an admin request from uid %s: %s", self.job_id,
                        self.node, "unknown" if exc.uid is None else exc.uid, exc.reason)
            with self._lock:
                # A replay of a request taken before must not answer in its place.
                answer = exc.request_id is not None and exc.request_id not in self._seen
            if answer:
                self._answer(client, exc.request_id, rpc.error_reply(rpc.Forbidden(f"refused: {exc.reason}")))
            return
        except Exception:  # the agent outlives any one request
            LOG.exception("job %s node %s: could not check an admin request", self.job_id, self.node)
            return
        LOG.info("job %s node %s: uid %s asks for %s %s (request %s)", self.job_id, self.node, uid,
                 request.op, request.args, request.request_id)
        threading.Thread(target=self._carry_out, args=(client, request, multi_node), daemon=True).start()

    def _first_time(self, request: Request, uid: int) -> None:
        with self._lock:
            now = self.clock()
            self._seen = {rid: t for rid, t in self._seen.items() if now - t < 2 * (MAX_AGE_S + MAX_SKEW_S)}
            if request.request_id in self._seen:
                raise Refused(f"request {request.request_id} was taken before (a replay)", uid)
            self._seen[request.request_id] = now

    def _carry_out(self, client: redis.Redis, request: Request, multi_node: bool) -> None:
        after_reply: list = []  # e.g. the launcher's requeue waits until the answer is in Redis
        try:
            try:
                reply = self.state.dispatch(agent_request(request, multi_node), after_reply)
            except Exception as exc:  # the caller's error, never the agent's end
                LOG.exception("job %s node %s: %s failed", self.job_id, self.node, request.op)
                reply = rpc.error_reply(rpc.Failed(f"{request.op} failed: {exc}"))
            LOG.info("job %s node %s: request %s answered: %s", self.job_id, self.node, request.request_id,
                     "ok" if reply.get("ok") else reply.get("error"))
            self._answer(client, request.request_id, reply)
        finally:
            for callback in after_reply:
                callback()

    def _answer(self, client: redis.Redis, request_id: str, reply: dict[str, Any]) -> None:
        key = keys.job_reply(self.job_id, request_id)
        for delay in (1.0, 2.0, 0.0):
            try:
                pipe = client.pipeline()
                pipe.rpush(key, json.dumps(reply))
                pipe.expire(key, REPLY_TTL_S)
                pipe.execute()
                return
            except (redis.RedisError, OSError) as exc:
                LOG.error("job %s node %s: cannot answer request %s through Redis: %s", self.job_id,
                          self.node, request_id, exc)
                if delay:
                    self.wait(delay)
