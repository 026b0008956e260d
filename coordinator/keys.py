"""Every Redis key the project uses, in one place."""

PREFIX = "singularity"


def job(job_id: int | str) -> str:
    """Hash: the job record (see `registry.JobRecord`)."""
    return f"{PREFIX}:job:{job_id}"


def job_node(job_id: int | str, node: str) -> str:
    """Hash: what one node knows of a job (GPUs there, services, prolog time)."""
    return f"{PREFIX}:job:{job_id}:node:{node}"


def job_nodes(job_id: int | str) -> str:
    """Set: the nodes whose prolog ran for the job and whose epilog has not yet."""
    return f"{PREFIX}:job:{job_id}:nodes"


def job_events(job_id: int | str) -> str:
    """List: the job's history (starts, ends, requeues), oldest first, as JSON lines."""
    return f"{PREFIX}:job:{job_id}:events"


def jobs() -> str:
    """Sorted set: every job id we know, scored by its last update time."""
    return f"{PREFIX}:jobs"


def job_checkpoints(job_id: int | str) -> str:
    """List: summaries of the job's committed checkpoints, oldest first, as JSON (an index of the store)."""
    return f"{PREFIX}:job:{job_id}:checkpoints"


def job_rendezvous(job_id: int | str, generation: str) -> str:
    """Hash: one rendezvous generation of a job's proxies (`proxy:<id>` -> [host, port], `token`)."""
    return f"{PREFIX}:job:{job_id}:rdzv:{generation}"


def job_requests(job_id: int | str) -> str:
    """List: admin requests for the job's node agent on its batch host, each a munge credential
    (see `commands`); short-lived."""
    return f"{PREFIX}:job:{job_id}:requests"


def job_reply(job_id: int | str, request_id: str) -> str:
    """List: the node agent's JSON answer to one admin request; short-lived."""
    return f"{PREFIX}:job:{job_id}:reply:{request_id}"
