"""Every Redis key the project uses, in one place, built only from validated parts.

A key part that came from a request, a job's environment or a peer could otherwise reach into
another job's keys (`7:node:x` as a node name) or make keys without bound. So every part is checked:
job ids are positive integers, node names, proxy ids and rendezvous generations use a small safe
alphabet and a bounded length, request ids are 32 hex digits. A bad part raises `InvalidKeyPart`
naming it; nothing is read or written.
"""

from __future__ import annotations

import re

from singularity_slurm.errors import RegistryError

PREFIX = "singularity"

MAX_JOB_ID = (1 << 63) - 1
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""A node name (Slurm's are letters, digits, `.`, `_` and `-`), a device, a rendezvous generation."""
_PROXY_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}(/[A-Za-z0-9][A-Za-z0-9._-]{0,63})?")
_REQUEST_ID = re.compile(r"[0-9a-f]{32}")
_TOKEN = re.compile(r"[0-9a-f]{32}")


class InvalidKeyPart(RegistryError, ValueError):
    """A job id, node name, proxy id, generation or request id is not safe to build a key from."""


def job_id(value: int | str) -> int:
    """`value` as a job id (a positive integer, or its decimal digits), or InvalidKeyPart."""
    if isinstance(value, bool):
        raise InvalidKeyPart(f"job id must be a positive integer, got {value!r}")
    number = value
    if isinstance(value, str):
        if not value.isascii() or not value.isdigit() or len(value) > 19:
            raise InvalidKeyPart(f"job id must be a positive integer, got {value!r}")
        number = int(value)
    if not isinstance(number, int) or not 0 < number <= MAX_JOB_ID:
        raise InvalidKeyPart(f"job id must be a positive integer, got {value!r}")
    return number


def node_name(value: str) -> str:
    """`value` as a node name: 1-64 of letters, digits, `.`, `_`, `-`, starting with a letter or digit."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise InvalidKeyPart(f"node name must be 1-64 letters, digits, '.', '_' or '-' (starting with a "
                             f"letter or digit), got {value!r}")
    return value


def generation(value: str) -> str:
    """`value` as a rendezvous generation: the same alphabet and length as a node name."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise InvalidKeyPart(f"rendezvous generation must be 1-64 letters, digits, '.', '_' or '-' "
                             f"(starting with a letter or digit), got {value!r}")
    return value


def proxy_id(value: str) -> str:
    """`value` as a proxy id: a name, or NODE/DEVICE, each part like a node name."""
    if not isinstance(value, str) or not _PROXY_ID.fullmatch(value):
        raise InvalidKeyPart(f"proxy id must be NAME or NODE/DEVICE, each 1-64 letters, digits, '.', '_' "
                             f"or '-', got {value!r}")
    return value


def request_id(value: str) -> str:
    if not isinstance(value, str) or not _REQUEST_ID.fullmatch(value):
        raise InvalidKeyPart(f"request id must be 32 lowercase hex digits, got {value!r}")
    return value


def rendezvous_token(value: str) -> str:
    """A generation's mesh token as the rendezvous record holds it: 32 lowercase hex digits."""
    if not isinstance(value, str) or not _TOKEN.fullmatch(value):
        raise InvalidKeyPart("a rendezvous record's token must be 32 lowercase hex digits; this one is "
                             "not (the record was not written by a proxy): end the job's proxies and "
                             "start the job again")
    return value


def job(job_id_: int | str) -> str:
    """Hash: the job record (see `registry.JobRecord`)."""
    return f"{PREFIX}:job:{job_id(job_id_)}"


def job_node(job_id_: int | str, node: str) -> str:
    """Hash: what one node knows of a job (GPUs there, services, prolog time)."""
    return f"{PREFIX}:job:{job_id(job_id_)}:node:{node_name(node)}"


def job_nodes(job_id_: int | str) -> str:
    """Set: the nodes whose prolog ran for the job and whose epilog has not yet."""
    return f"{PREFIX}:job:{job_id(job_id_)}:nodes"


def job_events(job_id_: int | str) -> str:
    """List: the job's history (starts, ends, requeues), oldest first, as JSON lines."""
    return f"{PREFIX}:job:{job_id(job_id_)}:events"


def job_events_total(job_id_: int | str) -> str:
    """Counter: the events ever appended to the job's history (more than it holds: some were dropped)."""
    return f"{PREFIX}:job:{job_id(job_id_)}:events:total"


def jobs() -> str:
    """Sorted set: every job id we know, scored by its last update time."""
    return f"{PREFIX}:jobs"


def job_checkpoints(job_id_: int | str) -> str:
    """List: summaries of the job's committed checkpoints, oldest first, as JSON (an index of the store)."""
    return f"{PREFIX}:job:{job_id(job_id_)}:checkpoints"


def job_rendezvous(job_id_: int | str, generation_: str) -> str:
    """Hash: one rendezvous generation of a job's proxies (`proxy:<id>` -> [host, port], `token`)."""
    return f"{PREFIX}:job:{job_id(job_id_)}:rdzv:{generation(generation_)}"


def job_rendezvous_ready(job_id_: int | str, generation_: str) -> str:
    """List: wake-ups for the proxies blocked on a rendezvous generation, pushed once all published."""
    return f"{job_rendezvous(job_id_, generation_)}:ready"


def job_rendezvous_woken(job_id_: int | str, generation_: str) -> str:
    """String: set by the one proxy that pushes a rendezvous generation's wake-ups."""
    return f"{job_rendezvous(job_id_, generation_)}:woken"


def job_requests(job_id_: int | str) -> str:
    """List: admin requests for the job's node agent on its batch host, each a munge credential
    (see `commands`); short-lived."""
    return f"{PREFIX}:job:{job_id(job_id_)}:requests"


def job_reply(job_id_: int | str, request_id_: str) -> str:
    """List: the node agent's JSON answer to one admin request; short-lived."""
    return f"{PREFIX}:job:{job_id(job_id_)}:reply:{request_id(request_id_)}"


def sla_leader() -> str:
    """The SLA controller's leader lease: the holder's identity, with an expiry."""
    return f"{PREFIX}:sla:leader"


def sla_actions() -> str:
    """The SLA controller's decisions, newest last, bounded."""
    return f"{PREFIX}:sla:actions"


def sla_protected() -> str:
    """The jobs the SLA controller protects (job ids)."""
    return f"{PREFIX}:sla:protected"
