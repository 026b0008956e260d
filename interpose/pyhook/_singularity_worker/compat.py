"""Which torch the backend runs on: decided from the version and the APIs it needs, before using them.

The backend is a Python `ProcessGroup` subclass that a creator registered with
`Backend.register_backend(name, creator, extended_api=True, devices=["cpu"])` returns, and whose
operations return `Work` objects: made by `_create_work_from_future`, or Python subclasses of `Work`.
`devices=` arrived in torch 2.1, the others earlier, so 2.1 is the oldest torch accepted (the backend
is tested on 2.13 only).
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Sequence

MIN_TORCH = (2, 1)


def parse_version(text: str) -> tuple[int, ...]:
    """(2, 13, 0) from "2.13.0+cpu"; (2, 1, 0) from "2.1.0a0+git1234"; () from garbage."""
    match = re.match(r"\s*(\d+(?:\.\d+)*)", text)
    return tuple(int(part) for part in match.group(1).split(".")) if match else ()


def missing_apis() -> list[str]:
    """The torch APIs the backend needs that the imported torch lacks."""
    import torch.distributed as dist

    if not dist.is_available():
        return ["torch.distributed (this torch was built without it)"]
    missing = []
    import torch._C._distributed_c10d as c10d

    for name in ("_create_work_from_future", "Work"):
        if not hasattr(c10d, name):
            missing.append(f"torch._C._distributed_c10d.{name}")
    register = getattr(getattr(dist, "Backend", None), "register_backend", None)
    try:
        parameters = inspect.signature(register).parameters if register else {}
    except (TypeError, ValueError):
        parameters = {}
    for name in ("extended_api", "devices"):
        if name not in parameters:
            missing.append(f"Backend.register_backend({name}=...)")
    if not isinstance(getattr(dist, "ProcessGroup", None), type):
        missing.append("torch.distributed.ProcessGroup")
    return missing


def torch_problem(version: str | None = None, missing: Sequence[str] | None = None,
                  executable: str | None = None) -> str | None:
    """Why the imported torch (or the one described) cannot run the backend, or None."""
    if version is None:
        import torch

        version = str(torch.__version__)
    parsed = parse_version(version)
    if parsed and parsed[:2] >= MIN_TORCH:
        missing = missing_apis() if missing is None else list(missing)
        if not missing:
            return None
        why = f"it lacks {', '.join(missing)}"
    else:
        why = "it is older than the oldest torch the backend supports"
    need = ".".join(str(v) for v in MIN_TORCH)
    return (f"torch {version} cannot run the singularity backend of `singularityctl run --world-size N` "
            f"({why}): it needs torch {need} or newer. Install torch>={need} into the job's Python "
            f"environment ({executable or sys.executable}), or run the job with a Python that has it.")
