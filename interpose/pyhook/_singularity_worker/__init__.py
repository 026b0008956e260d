"""The worker side of the device proxy, run inside the job's own Python environment.

A job trains with its own interpreter (a venv, conda or container Python, 3.9 or newer) and its own
torch, not with the project's venv. So this package is self-contained: standard library and the job's
torch only, Python 3.9 syntax, never installed into the job's environment: `sitecustomize` next to it
finds it through PYTHONPATH. The root side (the proxy daemon, the tests) imports the same modules as
`singularity_slurm.interpose.pyhook._singularity_worker`, so each has one source.

This file must also load in older Pythons (it tells them they are too old): no syntax newer than 3.6.
"""

import sys

MIN_PYTHON = (3, 9)
BACKEND = "singularity"


def python_problem(version_info=None, executable=None):
    """Why this Python cannot run the worker side, or None."""
    version_info = sys.version_info if version_info is None else version_info
    if tuple(version_info[:2]) >= MIN_PYTHON:
        return None
    found = ".".join(str(v) for v in version_info[:3])
    need = ".".join(str(v) for v in MIN_PYTHON)
    return (f"Python {found} ({executable or sys.executable}) is too old for the {BACKEND} backend of "
            f"`singularityctl run --world-size N`: it needs Python {need} or newer. Run the job's script "
            f"with a Python {need}+ interpreter (venv, conda or container) that has torch.")


def refuse(message):
    """Make the script's init_process_group (and new_group) fail with `message`, and say it now.

    The job's ranks would otherwise train on their own, each believing it is alone, or wait forever
    for a gloo rendezvous nobody serves.
    """
    import torch.distributed as dist

    def refused(*args, **kwargs):
        raise RuntimeError("[singularity] " + message)

    refused.__singularity__ = True
    modules = [dist]
    try:
        import torch.distributed.distributed_c10d as c10d

        modules.append(c10d)
    except ImportError:
        pass
    for module in modules:
        module.init_process_group = refused
        module.new_group = refused
    sys.stderr.write("[singularity] " + message + "\n")
    sys.stderr.flush()


def activate():
    """Run once torch has been imported: install the proxy backend, or refuse with the reason."""
    problem = python_problem()
    if problem is None:
        from . import compat

        problem = compat.torch_problem()
    if problem is not None:
        refuse(problem)
        return
    from .torch_backend import install

    install()
