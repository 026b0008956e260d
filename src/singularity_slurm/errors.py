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


class ServiceError(SingularityError):
    """A per-job node service could not be started or stopped."""


class DevClusterError(SingularityError):
    """The local dev cluster could not be installed, configured or started."""
