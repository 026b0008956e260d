"""Admin requests through Redis, signed by munge: what the node agent accepts, from whom, and a real
round trip through the machine's Redis and munged (skipped, with the reason, where they are absent)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis

from singularity_slurm.config import parse
from singularity_slurm.coordinator import keys
from singularity_slurm.coordinator.commands import (
    MAX_AGE_S,
    MAX_ENVELOPE,
    MAX_PAYLOAD,
    MUNGE,
    AgentDidNotAnswer,
    CommandClient,
    CommandServer,
    Credential,
    MungeUnavailable,
    Refused,
    Request,
    agent_request,
    authorize,
    batch_role,
    canonical,
    munge_encode,
    new_request,
    next_delay,
    operator_uids,
    parse_request,
    parse_unmunge,
    pop_bounded,
    verify,
)
from singularity_slurm.coordinator.registry import connect
from singularity_slurm.errors import CommandChannelError, SingularityError
from singularity_slurm.node.agent import AgentState

JOB = 7
JOB_UID = 1001
OPERATOR_UID = 1500
NOW = 1796096072.0
RID = "0123456789abcdef0123456789abcdef"


def payload(**changes) -> bytes:
    fields = {"job_id": JOB, "op": "checkpoint", "args": {}, "request_id": RID, "issued_at": NOW}
    fields.update(changes)
    return canonical({k: v for k, v in fields.items() if v is not ...})


def refusal(call: Callable[[], object]) -> Refused:
    with pytest.raises(Refused) as info:
        call()
    return info.value


# --- the request ----------------------------------------------------------------------------------


def test_a_new_request_is_what_the_agent_parses_back() -> None:
    request = new_request(JOB, "migrate", {"exclude": ["n1", "gpu-07.rack2"]}, clock=lambda: NOW)

    assert parse_request(request.payload(), JOB) == request
    assert len(request.request_id) == 32
    assert new_request(JOB, "checkpoint", {}).request_id != new_request(JOB, "checkpoint", {}).request_id


def test_the_payload_is_canonical_json() -> None:
    request = Request(JOB, "checkpoint", {}, RID, NOW)

    assert request.payload() == (b'{"args":{},"issued_at":1796096072.0,"job_id":7,"op":"checkpoint",'
                                 b'"request_id":"0123456789abcdef0123456789abcdef"}')


def test_a_request_for_another_job_is_refused_without_a_reply() -> None:
    refused = refusal(lambda: parse_request(payload(job_id=8), JOB))

    assert refused.reason == "request is for job 8; this agent serves job 7"
    assert refused.request_id is None


@pytest.mark.parametrize("job_id", ["7", 7.0, True, None])
def test_a_job_id_that_is_not_an_integer_is_another_job(job_id: object) -> None:
    assert refusal(lambda: parse_request(payload(job_id=job_id), JOB)).reason.startswith(
        "request is for job ")


def test_an_oversized_request_is_refused_before_it_is_parsed() -> None:
    huge = b"{" + b" " * MAX_PAYLOAD + b"}"

    assert refusal(lambda: parse_request(huge, JOB)).reason == (
        f"request of {MAX_PAYLOAD + 2} bytes is over the {MAX_PAYLOAD}-byte limit")


@pytest.mark.parametrize(("data", "reason"), [
    (b"not json", "request is not JSON"),
    (b"\xff\xfe", "request is not JSON"),
    (b"[7]", "request must be an object with exactly the fields args, issued_at, job_id, op, request_id"),
    (payload(args=...), "request must be an object with exactly the fields args, issued_at, job_id, op, "
                        "request_id"),
    (payload(extra=1), "request must be an object with exactly the fields args, issued_at, job_id, op, "
                       "request_id"),
    (payload(request_id="../../x"), "request_id must be 32 lowercase hex digits"),
    (payload(request_id=RID.upper()), "request_id must be 32 lowercase hex digits"),
])
def test_a_request_of_the_wrong_shape_is_refused(data: bytes, reason: str) -> None:
    assert refusal(lambda: parse_request(data, JOB)).reason == reason


@pytest.mark.parametrize(("data", "reason"), [
    (payload(op="kill"), "unknown op 'kill'; valid ops: checkpoint, migrate, resize"),
    (payload(op="launcher_checkpoint"),
     "unknown op 'launcher_checkpoint'; valid ops: checkpoint, migrate, resize"),
    (payload(args=[]), "args must be an object, got list"),
    (payload(args={"stop": True}), "checkpoint takes no arguments, got ['stop']"),
    (payload(op="migrate", args={}), "migrate takes exactly {exclude: [node names]}"),
    (payload(op="migrate", args={"exclude": "n1"}), "migrate takes exactly {exclude: [node names]}"),
    (payload(op="migrate", args={"exclude": ["n1", "-rf"]}), "migrate takes exactly {exclude: [node names]}"),
    (payload(issued_at="now"), "issued_at must be a number"),
    (payload(issued_at=True), "issued_at must be a number"),
    (payload().replace(b",", b", "), "request is not in canonical form"),
])
def test_a_bad_request_for_this_job_is_refused_with_a_reply(data: bytes, reason: str) -> None:
    refused = refusal(lambda: parse_request(data, JOB))

    assert (refused.reason, refused.request_id) == (reason, RID)


def test_the_client_refuses_to_send_a_request_the_agent_would_refuse() -> None:
    with pytest.raises(CommandChannelError, match="cannot send kill for job 7: unknown op 'kill'"):
        new_request(JOB, "kill", {})


# --- unmunge's output (golden text from munge 0.5.15) ---------------------------------------------


def unmunge_output(status: str = "Success (0)", uid: str = "root (0)", body: bytes = b"abc",
                   length: int | None = None) -> bytes:
    return (f"STATUS:          {status}\n"
            "ENCODE_HOST:     localhost (127.0.0.1)\n"
            "ENCODE_TIME:     2026-12-01 03:34:32 +0000 (1796096072)\n"
            "DECODE_TIME:     2026-12-01 03:34:32 +0000 (1796096072)\n"
            "TTL:             60\n"
            "CIPHER:          aes128 (4)\n"
            "MAC:             sha256 (5)\n"
            "ZIP:             none (0)\n"
            f"UID:             {uid}\n"
            "GID:             root (0)\n"
            f"LENGTH:          {len(body) if length is None else length}\n"
            "\n").encode() + body


def test_a_good_credential_gives_uid_time_and_the_exact_payload() -> None:
    body = b'{"a":"b\n\nc"}'

    assert parse_unmunge(0, unmunge_output(uid="nobody (65534)", body=body), b"") == Credential(
        ok=True, status="Success (0)", uid=65534, encode_time=1796096072, payload=body)


def test_a_uid_without_a_name_is_read_too() -> None:
    assert parse_unmunge(0, unmunge_output(uid="4242"), b"").uid == 4242


def test_a_replayed_credential_is_not_ok_but_keeps_its_payload_to_answer() -> None:
    credential = parse_unmunge(17, unmunge_output(status="Replayed credential (17)"), b"")

    assert (credential.ok, credential.status, credential.payload) == (
        False, "Replayed credential (17)", b"abc")


def test_success_text_with_a_failing_exit_status_is_not_ok() -> None:
    assert parse_unmunge(1, unmunge_output(), b"").ok is False


def test_a_garbled_credential_is_refused_with_unmunges_words() -> None:
    refused = refusal(lambda: parse_unmunge(8, b"", b"unmunge: Error: Failed to match armor prefix\n"))

    assert refused.reason == ("unmunge could not decode the credential (exit status 8): unmunge: Error: "
                              "Failed to match armor prefix")


def test_a_payload_of_another_length_than_munge_said_is_refused() -> None:
    refused = refusal(lambda: parse_unmunge(0, unmunge_output(length=2), b""))

    assert refused.reason == "unmunge printed no STATUS or a LENGTH (2) that is not the payload's (3)"


# --- verification: who asked, for what, when ------------------------------------------------------


def signed(uid: int, body: bytes | None = None, encode_time: int = int(NOW), ok: bool = True,
           status: str = "Success (0)") -> Callable[[str], Credential]:
    """An unmunge that says `uid` signed `body` (the real one runs in the round-trip tests below)."""
    def unmunge(credential: str) -> Credential:
        assert credential == "MUNGE:cred:"
        return Credential(ok, status, uid, encode_time, payload() if body is None else body)
    return unmunge


ENVELOPE = b'{"credential":"MUNGE:cred:"}'
OPERATORS = frozenset({OPERATOR_UID})


def check(unmunge: Callable[[str], Credential], now: float = NOW, envelope: bytes = ENVELOPE
          ) -> tuple[Request, int]:
    return verify(envelope, job_id=JOB, job_uid=JOB_UID, operators=OPERATORS, now=now, unmunge=unmunge)


@pytest.mark.parametrize("uid", [0, JOB_UID, OPERATOR_UID])
def test_root_the_owner_and_an_operator_are_served(uid: int) -> None:
    request, signer = check(signed(uid))

    assert (request, signer) == (Request(JOB, "checkpoint", {}, RID, NOW), uid)


def test_another_user_is_refused_with_uid_and_job_named() -> None:
    refused = refusal(lambda: check(signed(1002)))

    assert refused.reason == ("uid 1002 may not act on job 7: only root, the job's owner and the operators "
                              "named in [admin] operators may")
    assert (refused.uid, refused.request_id) == (1002, RID)


def test_a_stale_credential_is_refused() -> None:
    refused = refusal(lambda: check(signed(0), now=NOW + MAX_AGE_S + 1))

    assert refused.reason == f"credential is {MAX_AGE_S + 1}s old; the limit is {MAX_AGE_S}s"
    assert (refused.uid, refused.request_id) == (0, RID)


def test_a_credential_from_the_future_or_far_from_the_request_time_is_refused() -> None:
    assert "check the clocks" in refusal(lambda: check(signed(0), now=NOW - 31)).reason
    assert "check the clocks" in refusal(lambda: check(signed(0, payload(issued_at=NOW - 600)))).reason


def test_a_credential_munge_refused_is_answered_when_its_request_can_be_told() -> None:
    refused = refusal(lambda: check(signed(0, ok=False, status="Expired credential (15)")))

    assert refused.reason == "munge refused the credential: Expired credential (15)"
    assert refused.request_id == RID
    assert refusal(lambda: check(signed(0, b"junk", ok=False, status="Replayed credential (17)"))
                   ).request_id is None


def test_the_signers_uid_decides_even_for_a_request_naming_another_job() -> None:
    refused = refusal(lambda: check(signed(0, payload(job_id=8))))

    assert (refused.reason, refused.uid) == ("request is for job 8; this agent serves job 7", 0)


@pytest.mark.parametrize(("envelope", "reason"), [
    (b"x" * (MAX_ENVELOPE + 1), f"request of {MAX_ENVELOPE + 1} bytes is over the {MAX_ENVELOPE}-byte limit"),
    (b"MUNGE:cred:", "request is not JSON"),
    (b'{"credential": 7}', 'request must be {credential: "MUNGE:..."}'),
    (b'{"credential": "forged"}', 'request must be {credential: "MUNGE:..."}'),
    (b'{"credential": "MUNGE:cred:", "uid": 0}', 'request must be {credential: "MUNGE:..."}'),
])
def test_a_malformed_list_entry_never_reaches_unmunge(envelope: bytes, reason: str) -> None:
    def unmunge(credential: str) -> Credential:
        raise AssertionError("unmunge called")

    refused = refusal(lambda: check(unmunge, envelope=envelope))

    assert (refused.reason, refused.uid, refused.request_id) == (reason, None, None)


def test_authorize_names_nobody_but_root_owner_and_operators() -> None:
    authorize(0, JOB, JOB_UID, frozenset())
    authorize(JOB_UID, JOB, JOB_UID, frozenset())
    authorize(OPERATOR_UID, JOB, JOB_UID, OPERATORS)
    with pytest.raises(Refused):
        authorize(OPERATOR_UID, JOB, JOB_UID, frozenset())


def test_operator_names_resolve_to_uids_and_unknown_names_to_nobody(caplog) -> None:
    users = {"ops": 1500, "bob": 1600}

    def lookup(name: str) -> SimpleNamespace:
        return SimpleNamespace(pw_uid=users[name])

    assert operator_uids(["ops", "ghost", "bob"], lookup) == frozenset({1500, 1600})
    assert "[admin] operators names 'ghost', which is no user here: ignored" in caplog.text


# --- what the agent does with an accepted request -------------------------------------------------


def test_a_checkpoint_is_the_socket_ops_manual_checkpoint_or_the_launchers_for_several_nodes() -> None:
    request = Request(JOB, "checkpoint", {}, RID, NOW)

    assert agent_request(request, multi_node=False) == {"op": "checkpoint", "reason": "manual",
                                                         "stop": False}
    assert agent_request(request, multi_node=True) == {"op": "launcher_checkpoint"}


def test_a_migration_is_the_socket_ops_migration() -> None:
    request = Request(JOB, "migrate", {"exclude": ["n1"]}, RID, NOW)

    assert agent_request(request, multi_node=True) == {"op": "migrate", "exclude": ["n1"]}


@pytest.mark.parametrize(("record", "role"), [
    ({"BatchHost": "n1", "NodeList": "n1"}, (True, False)),
    ({"BatchHost": "n1", "NodeList": "n[1-2]"}, (True, True)),
    ({"BatchHost": "n2", "NodeList": "n[1-2]"}, (False, True)),
    ({"BatchHost": "", "NodeList": "n1"}, None),
    (None, None),
])
def test_only_the_batch_host_named_by_slurm_takes_requests(record, role) -> None:
    assert batch_role(record, "n1") == role


def test_backoff_doubles_from_half_a_second_to_ten() -> None:
    delays = [next_delay(0)]
    for _ in range(6):
        delays.append(next_delay(delays[-1]))

    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


class FakeState:
    """Stands in for AgentState: records what it is asked and answers like its ops."""

    def __init__(self, fail: bool = False):
        self.requests: list[dict] = []
        self.fail = fail

    def dispatch(self, request: dict, after_reply: list | None = None) -> dict:
        self.requests.append(request)
        if self.fail:
            raise RuntimeError("disk on fire")
        return {"ok": True, "seq": 3, "seconds": 0.5}


def server(state: FakeState, connect: Callable[[], redis.Redis], **kw) -> CommandServer:
    options = {"job_id": JOB, "job_uid": JOB_UID, "node": "n1", "operators": (), "connect": connect,
               "locate": lambda: {"BatchHost": "n1", "NodeList": "n1"}, "block_s": 0.1}
    options.update(kw)
    return CommandServer(state, **options)


def test_without_redis_the_agent_retries_with_backoff_and_stops_when_asked(caplog) -> None:
    waits: list[float] = []
    attempts = []

    def unreachable() -> redis.Redis:
        attempts.append(1)
        raise SingularityError("cannot reach Redis at 127.0.0.1:6379")

    def wait(delay: float) -> None:
        waits.append(delay)
        if len(waits) == 6:
            commands.stop()

    commands = server(FakeState(), unreachable, wait=wait)
    commands.run()

    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0]
    assert len(attempts) == 6
    assert caplog.text.count("Redis unavailable for admin requests") == 1


def test_a_node_that_is_not_the_batch_host_takes_nothing() -> None:
    def connect_never() -> redis.Redis:
        raise AssertionError("connected")

    server(FakeState(), connect_never, locate=lambda: {"BatchHost": "n2", "NodeList": "n[1-2]"}).run()


def test_the_agent_waits_for_slurm_to_name_the_batch_host() -> None:
    answers = iter([SingularityError("slurmctld down"), None, {"BatchHost": "n2", "NodeList": "n2"}])
    waits: list[float] = []

    def locate() -> dict | None:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    server(FakeState(), lambda: None, locate=locate, wait=waits.append).run()  # type: ignore[arg-type]

    assert waits == [0.5, 1.0]


# --- munge on this host, for the client -----------------------------------------------------------


def test_the_client_says_how_to_install_munge_when_it_is_missing() -> None:
    with pytest.raises(MungeUnavailable) as info:
        munge_encode(b"x", munge=Path("/nonexistent/munge"))

    assert str(info.value) == ("/nonexistent/munge not found: install MUNGE on this host (Debian: `apt "
                               "install munge`); root and operators act on other users' jobs through it")


@pytest.mark.skipif(not MUNGE.exists(), reason=f"{MUNGE} not installed")
def test_the_client_says_to_start_munged_when_it_is_not_running(tmp_path: Path) -> None:
    with pytest.raises(MungeUnavailable, match=r"^munged is not running on this host \(.*\): start it "
                                               r"\(`systemctl start munge`\)$"):
        munge_encode(b"x", socket=tmp_path / "absent.socket")


# --- real round trips through this machine's Redis and munged --------------------------------------


def _munged_running() -> str | None:
    if os.geteuid() != 0:
        return "needs root (credentials are decodable by root only)"
    try:
        proc = subprocess.run([str(MUNGE), "-n"], capture_output=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"munge unusable: {exc}"
    return None if proc.returncode == 0 else f"munged not running: {proc.stderr.decode().strip()}"


def _redis() -> redis.Redis | str:
    try:
        return connect(parse({"redis": {"db": 15}}).redis, timeout=5)
    except SingularityError as exc:
        return f"Redis unavailable: {exc}"


@pytest.fixture(scope="module")
def live_redis() -> redis.Redis:
    """Probed once: a Redis that is down costs redis-py's retries."""
    why = _munged_running()
    if why:
        pytest.skip(why)
    client = _redis()
    if isinstance(client, str):
        pytest.skip(client)
    return client


@pytest.fixture
def live(live_redis: redis.Redis, request: pytest.FixtureRequest) -> Iterator[SimpleNamespace]:
    """Real Redis (db 15, keys of a job id nobody else uses, deleted after) and real munged."""
    client = live_redis
    job = 900_000_000 + (os.getpid() % 100_000) * 100 + (abs(hash(request.node.name)) % 100)
    yield SimpleNamespace(redis=client, job=job)
    for key in client.scan_iter(match=f"{keys.job(job)}:*"):
        client.delete(key)


def as_nobody(payload_bytes: bytes) -> str:
    """A credential signed by uid 65534, as an ordinary user's singularityctl would get it."""
    return munge_encode(payload_bytes, run=lambda argv, **kw: subprocess.run(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *argv], **kw))


@pytest.fixture
def agent(live: SimpleNamespace) -> Iterator[Callable[..., tuple[FakeState, CommandServer]]]:
    started: list[tuple[CommandServer, threading.Thread]] = []

    def start(job_uid: int = JOB_UID, operators: tuple[str, ...] = (), fail: bool = False,
              node_list: str = "n1") -> tuple[FakeState, CommandServer]:
        state = FakeState(fail)
        commands = server(state, lambda: live.redis, job_id=live.job, job_uid=job_uid, operators=operators,
                          locate=lambda: {"BatchHost": "n1", "NodeList": node_list})
        started.append((commands, commands.start()))
        return state, commands

    yield start
    for commands, thread in started:
        commands.stop()
        thread.join(timeout=5)


def send(live: SimpleNamespace, op: str = "checkpoint", args: dict | None = None,
         munge: Callable[[bytes], str] = munge_encode, **kw) -> dict:
    said: list[str] = []
    client = CommandClient(live.redis, munge=munge)
    return client.send(new_request(live.job, op, args or {}), where="n1", say=said.append, block_s=0.2,
                       **kw)


def test_root_checkpoints_another_users_job_through_redis(live, agent, caplog) -> None:
    caplog.set_level(logging.INFO, logger="singularity.agent.commands")
    state, _ = agent()

    assert send(live) == {"ok": True, "seq": 3, "seconds": 0.5}
    assert state.requests == [{"op": "checkpoint", "reason": "manual", "stop": False}]
    assert f"job {live.job} node n1: uid 0 asks for checkpoint {{}}" in caplog.text
    assert live.redis.exists(keys.job_requests(live.job)) == 0


def test_root_migrates_a_multi_node_job_through_its_batch_host(live, agent) -> None:
    state, _ = agent(node_list="n[1-2]")

    assert send(live, "migrate", {"exclude": ["n1", "n2"]})["ok"] is True
    assert state.requests == [{"op": "migrate", "exclude": ["n1", "n2"]}]


def test_a_user_signing_for_someone_elses_job_is_refused_and_nothing_happens(live, agent, caplog) -> None:
    state, _ = agent(job_uid=JOB_UID)

    reply = send(live, munge=as_nobody)

    assert reply == {"ok": False, "error": f"refused: uid 65534 may not act on job {live.job}: only root, "
                                           "the job's owner and the operators named in [admin] operators may",
                     "kind": "forbidden"}
    assert state.requests == []
    assert f"refused an admin request from uid 65534: uid 65534 may not act on job {live.job}" in caplog.text


def test_an_operator_is_served(live, agent) -> None:
    state, _ = agent(operators=("nobody",))

    assert send(live, munge=as_nobody)["ok"] is True
    assert state.requests == [{"op": "checkpoint", "reason": "manual", "stop": False}]


def test_the_jobs_owner_is_served_through_redis_too(live, agent) -> None:
    state, _ = agent(job_uid=65534)

    assert send(live, munge=as_nobody)["ok"] is True


def test_forged_and_tampered_credentials_are_refused_and_the_agent_serves_on(live, agent, caplog) -> None:
    state, _ = agent()
    good = munge_encode(new_request(live.job, "checkpoint", {}).payload())
    tampered = good[:40] + ("A" if good[40] != "A" else "B") + good[41:]
    for credential in ("MUNGE:forged:", tampered):
        live.redis.rpush(keys.job_requests(live.job), json.dumps({"credential": credential}))
    live.redis.rpush(keys.job_requests(live.job), "x" * (MAX_ENVELOPE + 1))
    live.redis.rpush(keys.job_requests(live.job), b"\xff\xfe not text")

    assert send(live)["ok"] is True
    assert state.requests == [{"op": "checkpoint", "reason": "manual", "stop": False}]
    assert caplog.text.count("refused an admin request from uid unknown: ") == 4


def test_a_replayed_credential_is_refused_and_does_not_answer_in_the_requests_place(live, agent,
                                                                                  caplog) -> None:
    state, _ = agent()
    request = new_request(live.job, "checkpoint", {})
    envelope = json.dumps({"credential": munge_encode(request.payload())})
    reply_key = keys.job_reply(live.job, request.request_id)

    for _ in range(2):
        live.redis.rpush(keys.job_requests(live.job), envelope)
    first = live.redis.blpop([reply_key], timeout=5)
    second = live.redis.blpop([reply_key], timeout=0.5)

    assert json.loads(first[1])["ok"] is True
    assert second is None
    assert "refused an admin request from uid 0: munge refused the credential: Replayed credential (17)" \
        in caplog.text
    assert len(state.requests) == 1


def test_a_request_dated_long_before_its_credential_is_answered_with_the_reason(live, agent) -> None:
    state, _ = agent()
    request = new_request(live.job, "checkpoint", {}, clock=lambda: time.time() - 2 * MAX_AGE_S)
    credential = munge_encode(request.payload())

    live.redis.rpush(keys.job_requests(live.job), json.dumps({"credential": credential}))
    reply = live.redis.blpop([keys.job_reply(live.job, request.request_id)], timeout=5)

    answer = json.loads(reply[1])
    assert answer["ok"] is False
    assert answer["error"].startswith("refused: credential time ")
    assert answer["error"].endswith(f"or the request's ({request.issued_at:.0f}): check the clocks")
    assert state.requests == []


def test_a_failing_op_becomes_an_error_reply_and_the_agent_serves_on(live, agent, caplog) -> None:
    state, _ = agent(fail=True)

    assert send(live) == {"ok": False, "error": "checkpoint failed: disk on fire", "kind": "failed"}
    assert send(live) == {"ok": False, "error": "checkpoint failed: disk on fire", "kind": "failed"}
    assert len(state.requests) == 2


def test_a_request_nobody_takes_is_withdrawn_and_said_to_have_done_nothing(live) -> None:
    with pytest.raises(AgentDidNotAnswer) as info:
        send(live, pickup_timeout=0.3)

    assert str(info.value).startswith(f"job {live.job}'s node agent on n1 did not take the request within "
                                      "0s, so nothing was done: check that it runs and reaches Redis")
    assert live.redis.llen(keys.job_requests(live.job)) == 0


def test_a_request_taken_but_unanswered_may_still_be_carried_out(live) -> None:
    taker = threading.Thread(target=live.redis.blpop, args=([keys.job_requests(live.job)],), kwargs={
        "timeout": 5}, daemon=True)
    taker.start()

    with pytest.raises(AgentDidNotAnswer) as info:
        send(live, pickup_timeout=0.3, timeout=0.8)

    assert str(info.value) == (f"no answer from job {live.job}'s node agent on n1 within 1s; the request "
                               f"may still be carried out: check with `singularityctl status {live.job}`")
    taker.join(timeout=5)


def test_the_client_reports_progress_while_it_waits(live) -> None:
    said: list[str] = []
    ticks = iter(time.monotonic() + t for t in (0, 0, 0, 31, 31, 900))

    with pytest.raises(AgentDidNotAnswer):
        CommandClient(live.redis, clock=lambda: next(ticks)).send(
            new_request(live.job, "checkpoint", {}), where="n1", say=said.append, block_s=0.05,
            pickup_timeout=1000)

    assert said == [f"sent to job {live.job}'s node agent on n1 through Redis; waiting for its answer...",
                    f"still waiting for job {live.job}'s node agent on n1 (31s)..."]


def test_the_real_agent_state_carries_out_the_request_as_its_socket_op_would(live) -> None:
    state = AgentState(job_id=live.job, job_uid=JOB_UID, node="n1")  # no engine: ops say so
    commands = server(state, lambda: live.redis, job_id=live.job)  # type: ignore[arg-type]
    thread = commands.start()
    try:
        assert send(live) == state.handle({"op": "checkpoint", "reason": "manual", "stop": False}, 0) == {
            "ok": False, "error": "this agent has no checkpoint engine", "kind": "unavailable"}
    finally:
        commands.stop()
        thread.join(timeout=5)


def test_an_oversized_list_entry_is_dropped_inside_redis_unread_and_the_agent_serves_on(live, agent,
                                                                                        caplog) -> None:
    caplog.set_level(logging.INFO, logger="singularity.agent.commands")
    state, _ = agent()
    live.redis.rpush(keys.job_requests(live.job), "x" * (8 << 20))

    assert send(live)["ok"] is True
    assert len(state.requests) == 1
    assert (f"request of {8 << 20} bytes is over the {MAX_ENVELOPE}-byte limit (dropped unread)"
            in caplog.text)


def test_pop_bounded_returns_the_entry_its_size_or_none(live) -> None:
    key = keys.job_requests(live.job)
    live.redis.rpush(key, "small", "y" * 100)

    assert pop_bounded(live.redis, key, 50) == "small"
    assert pop_bounded(live.redis, key, 50) == 100
    assert pop_bounded(live.redis, key, 50) is None
    assert live.redis.llen(key) == 0


@pytest.mark.parametrize("args", [
    {"nodes": [1, 2], "gpus_per_node": None}, {"nodes": None, "gpus_per_node": 1},
    {"nodes": [2, 2], "gpus_per_node": 4096}])
def test_a_resize_request_names_a_node_range_or_gpus_per_node(args: dict) -> None:
    from singularity_slurm.coordinator.commands import resize_args

    assert resize_args(args) == args


@pytest.mark.parametrize("args", [
    {}, {"nodes": None, "gpus_per_node": None}, {"nodes": [2, 1], "gpus_per_node": None},
    {"nodes": [0, 1], "gpus_per_node": None}, {"nodes": [1], "gpus_per_node": None},
    {"nodes": ["1", "2"], "gpus_per_node": None}, {"nodes": [True, 2], "gpus_per_node": None},
    {"nodes": None, "gpus_per_node": 4097}, {"nodes": None, "gpus_per_node": 1, "exclude": []},
    [1, 2]])
def test_a_malformed_resize_request_is_refused(args: object) -> None:
    from singularity_slurm.coordinator.commands import Refused, resize_args

    with pytest.raises(Refused) as info:
        resize_args(args)
    assert info.value.reason == ("resize takes {nodes: [MIN, MAX] or null, gpus_per_node: G or null} "
                                 "(1..4096, MIN <= MAX), at least one of them")
