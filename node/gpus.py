"""A job's GPUs on a node, by UUID, type, memory and health (NVML), and how a restore maps them.

Slurm numbers a job's GPUs on a node by their index (SLURM_JOB_GPUS in the Prolog, from gres.conf);
NVML names the same index's device by UUID. A checkpoint records the GPUs its job held; a restore
onto other GPUs maps them in order, old to new, and refuses where the types differ (a job's memory
layout and kernels are for the GPU type it ran on) or where there are fewer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from singularity_slurm.checkpoint.cuda import GpuPair, uuid_bytes
from singularity_slurm.errors import CheckpointError


class GpuMismatch(CheckpointError):
    """The GPUs a restore would run on cannot hold the checkpoint's GPU state. `elsewhere`: GPUs of
    other nodes may (these are of another type, or unhealthy), unlike too few of them, which every
    node of the job's allocation has alike."""

    def __init__(self, message: str, elsewhere: bool = True):
        super().__init__(message)
        self.elsewhere = elsewhere


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    memory_mib: int
    problems: tuple[str, ...] = field(default=())

    @property
    def healthy(self) -> bool:
        return not self.problems

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "problems": list(self.problems)}

    @classmethod
    def of_record(cls, record: Mapping[str, Any]) -> Gpu:
        """A GPU as a checkpoint's manifest (written by root) or the registry recorded it."""
        try:
            uuid = str(record["uuid"])
            uuid_bytes(uuid)
            return cls(int(record["index"]), uuid, str(record["name"]), int(record["memory_mib"]),
                       tuple(str(p) for p in record.get("problems", ())))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"malformed GPU record {dict(record)!r}: {exc}") from exc


def health_problems(ecc_uncorrected: int | None, remap_pending: bool | None, remap_failed: bool | None,
                    ) -> tuple[str, ...]:
    """What NVML's counters say is wrong with a GPU (None: the counter is not supported there)."""
    problems = []
    if ecc_uncorrected:
        problems.append(f"{ecc_uncorrected} uncorrected ECC errors since the driver loaded")
    if remap_pending:
        problems.append("a row remapping is pending (reset the GPU)")
    if remap_failed:
        problems.append("a row remapping failed (the GPU needs service)")
    return tuple(problems)


def restore_pairs(old: Sequence[Gpu], new: Sequence[Gpu]) -> list[GpuPair]:
    """The UUID pairs a restore passes to the driver: the checkpoint's GPUs, in index order, onto the
    new allocation's, in index order. None where every GPU is the same one."""
    old, new = sorted(old, key=lambda g: g.index), sorted(new, key=lambda g: g.index)
    if len(new) < len(old):
        raise GpuMismatch(f"the checkpoint holds the state of {len(old)} GPU(s) but the job has "
                          f"{len(new)} on this node: request --gpus-per-node={len(old)} or more",
                          elsewhere=False)
    pairs = list(zip(old, new, strict=False))
    wrong = [(a, b) for a, b in pairs if a.name != b.name]
    if wrong:
        a, b = wrong[0]
        raise GpuMismatch(f"the checkpoint ran on {a.name} and this job's GPU {b.index} is {b.name}: a "
                          f"GPU's state restores only onto the same type (constrain the job to "
                          f"{a.name} with --gres or a feature)")
    sick = [b for _, b in pairs if not b.healthy]
    if sick:
        raise GpuMismatch(f"GPU {sick[0].index} ({sick[0].uuid}) is unhealthy: {'; '.join(sick[0].problems)}")
    if all(a.uuid == b.uuid for a, b in pairs):
        return []
    return [GpuPair(a.uuid, b.uuid) for a, b in pairs]


def node_inventory(indices: Iterable[int]) -> tuple[list[Gpu] | None, str | None]:
    """The job's GPUs on this node for the registry, or (None, why) where NVML cannot tell: no
    NVIDIA driver or bindings on the node (a CPU node, or the dev cluster's stand-in devices), or a
    GPU it cannot read. Never raises: the Prolog must not fail for it."""
    try:
        return inventory(indices), None
    except CheckpointError as exc:
        return None, str(exc)


def inventory(indices: Iterable[int]) -> list[Gpu]:
    """The GPUs with these NVML indices, through pynvml (nvidia-ml-py)."""
    try:
        import pynvml
    except ImportError as exc:
        raise CheckpointError("NVML's Python bindings are not installed in the project's venv: install "
                              "the gpu extra (pip install 'singularity-slurm[gpu]')") from exc
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise CheckpointError(f"NVML cannot start on this node: {exc}") from exc
    try:
        return [_one(pynvml, index) for index in indices]
    finally:
        pynvml.nvmlShutdown()


def _one(pynvml, index: int) -> Gpu:
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        uuid, name = pynvml.nvmlDeviceGetUUID(handle), pynvml.nvmlDeviceGetName(handle)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total >> 20
    except pynvml.NVMLError as exc:
        raise CheckpointError(f"NVML cannot read GPU {index}: {exc}") from exc

    def counter(read):
        try:
            return read()
        except pynvml.NVMLError:  # not supported on this GPU
            return None

    ecc = counter(lambda: pynvml.nvmlDeviceGetTotalEccErrors(
        handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC))
    remap = counter(lambda: pynvml.nvmlDeviceGetRemappedRows(handle))  # (corr, unc, pending, failed)
    return Gpu(index, str(uuid), str(name), int(memory),
               health_problems(ecc, bool(remap[2]) if remap else None, bool(remap[3]) if remap else None))
