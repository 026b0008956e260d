"""Everything injected into a job's worker processes without changing the user's script.

The torch.distributed backend that routes collectives through the device proxy (`pyhook/`: a
sitecustomize and the self-contained `_singularity_worker` package, put on the workers' PYTHONPATH
so they run in the job's own Python environment), the libc shim that records files written outside
the shared filesystems, and the CUDA driver shim.
"""

from pathlib import Path

HOOK_DIR = Path(__file__).resolve().parent / "pyhook"
"""The folder a distributed job's workers get first on PYTHONPATH."""
