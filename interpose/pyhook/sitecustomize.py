"""Injected into a job's workers by `singularityctl run --world-size N` (through PYTHONPATH).

Once the script has imported torch, the `singularity` backend is installed (`_singularity_worker`,
beside this file), so the script's own `init_process_group(...)` runs its collectives through the
device proxy. Nothing is imported before that: a worker that never uses torch.distributed pays
nothing. A sitecustomize further down sys.path (the interpreter's own) still runs.

This runs in whatever Python the job uses, so it must at least load in old ones (they are told they
are too old when the script imports torch): no syntax newer than Python 3.6 here.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_TARGET = "torch"


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def run_then_install(module):
            exec_module(module)
            sys.modules[name] = module
            import _singularity_worker

            _singularity_worker.activate()

        spec.loader.exec_module = run_then_install
        return spec


def _chain():
    """Run the next sitecustomize on sys.path, the one this file shadows."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or ".") == here:
            continue
        candidate = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_singularity_next_sitecustomize", candidate)
            if spec and spec.loader:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


if os.environ.get("SINGULARITY_PROXY") == "1":
    sys.meta_path.insert(0, _AfterImport())
_chain()
