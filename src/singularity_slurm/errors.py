"""One base exception for the project, one per subsystem; leaves are named for what the caller does."""


class SingularityError(Exception):
    """Base of every error this project raises on purpose; its message names the problem and the fix."""


class ConfigError(SingularityError):
    """The admin configuration is missing, unreadable or invalid."""


class SlurmError(SingularityError):
    """A Slurm command failed or printed something we could not parse."""


class SlurmCommandFailed(SlurmError):
    """A Slurm command exited non-zero; `stderr` holds what it said."""

    def __init__(self, argv: list[str], returncode: int, stderr: str):
        self.argv = argv
        self.returncode = returncode
        self.stderr = stderr.strip()
        super().__init__(f"`{' '.join(argv)}` failed with exit status {returncode}: {self.stderr}")


class RegistryError(SingularityError):
    """The Redis registry is unreachable, refuses our credentials, or holds a malformed record."""


class CommandChannelError(SingularityError):
    """An admin's request could not reach a job's node agent through Redis, or got no answer."""


class ServiceError(SingularityError):
    """A per-job node service could not be started or stopped."""


class DevClusterError(SingularityError):
    """The local dev cluster could not be installed, configured or started."""


class CheckpointError(SingularityError):
    """The checkpoint store could not write, read or clean up a checkpoint."""


class InvalidCheckpointRequest(CheckpointError, ValueError):
    """The caller passed an unsafe job id or file path, or bad chunk boundaries: fix the call."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint failed verification (bad or missing chunk, unreadable manifest): use an older one.

    `detail` says what is wrong without the job and sequence prefix, for lines such as
    "checkpoint 3 refused: <detail>; using checkpoint 2".
    """

    def __init__(self, job_id: str | None, seq: int | None, detail: str, *, path: str | None = None,
                 chunk: str | None = None):
        self.job_id = job_id
        self.seq = seq
        self.detail = detail
        self.path = path  # the file inside the checkpoint, or the manifest, that is at fault
        self.chunk = chunk  # the chunk's hash, when one chunk is at fault
        which = "checkpoint" + (f" {seq}" if seq is not None else "")
        which += f" of job {job_id}" if job_id is not None else ""
        super().__init__(f"{which} is unusable: {detail}; restore an older checkpoint or start the job "
                         "afresh")


class NewerCheckpointFormat(CorruptCheckpoint):
    """A manifest written by a newer singularity-slurm: restore it with that version; keep its chunks."""


class NoCheckpoint(CheckpointError):
    """The job has no committed checkpoint that verifies: start it from the beginning."""


class StoreFull(CheckpointError):
    """The store's filesystem is out of space or quota: prune old checkpoints or grow the store."""


class CheckpointConflict(CheckpointError):
    """Another process changed the job's store under a writer (pruned or aborted): retry the checkpoint."""
