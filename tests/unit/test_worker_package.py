"""What is injected into workers runs in the job's own Python, or says why it cannot.

The folder on the workers' PYTHONPATH is self-contained (standard library and torch, Python 3.9
syntax; the two files that tell older Pythons so load in older ones still), and a Python or torch the
backend does not support makes `init_process_group` fail with the reason and the fix.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from singularity_slurm.interpose import HOOK_DIR
from singularity_slurm.interpose.pyhook import _singularity_worker
from singularity_slurm.interpose.pyhook._singularity_worker import compat

INJECTED = sorted(HOOK_DIR.rglob("*.py"))
OLDEST_SYNTAX = {HOOK_DIR / "sitecustomize.py": (3, 7),
                 HOOK_DIR / "_singularity_worker" / "__init__.py": (3, 7)}
NEWER_APIS = {"StrEnum", "pairwise", "TaskGroup", "ExceptionGroup", "BaseExceptionGroup", "tomllib", "aiter",
              "anext", "kw_only", "KW_ONLY", "UTC", "batched"}


def name_of(path: Path) -> str:
    return str(path.relative_to(HOOK_DIR))


# --- the injected folder ---------------------------------------------------------------------------


def test_the_injected_folder_holds_the_hook_and_the_worker_package_only() -> None:
    assert sorted(p.name for p in HOOK_DIR.iterdir() if not p.name.startswith("__")) == [
        "_singularity_worker", "sitecustomize.py"]
    assert {name_of(p) for p in INJECTED} >= {
        "sitecustomize.py", "_singularity_worker/__init__.py", "_singularity_worker/compat.py",
        "_singularity_worker/proxy_client.py", "_singularity_worker/torch_backend.py",
        "_singularity_worker/wire.py"}


@pytest.mark.parametrize("path", INJECTED, ids=name_of)
def test_an_injected_file_parses_as_the_oldest_python_it_must_run_on(path: Path) -> None:
    ast.parse(path.read_text(), str(path), feature_version=OLDEST_SYNTAX.get(path, (3, 9)))


@pytest.mark.parametrize("path", INJECTED, ids=name_of)
def test_an_injected_file_uses_no_api_newer_than_python_3_9(path: Path) -> None:
    tree = ast.parse(path.read_text())
    strict = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
              and any(k.arg == "strict" for k in node.keywords)]
    newer = [(node.lineno, name) for node in ast.walk(tree)
             for name in [getattr(node, "attr", None) or getattr(node, "id", None)] if name in NEWER_APIS]

    assert (strict, newer) == ([], [])


@pytest.mark.parametrize("path", INJECTED, ids=name_of)
def test_an_injected_file_imports_the_standard_library_torch_and_its_own_package_only(path: Path) -> None:
    tree = ast.parse(path.read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module}
    foreign = {name for name in imported if name.split(".")[0] not in sys.stdlib_module_names
               and name.split(".")[0] not in ("torch", "_singularity_worker", "__future__")}

    assert foreign == set()


# --- which Python and torch -----------------------------------------------------------------------


@pytest.mark.parametrize(("text", "parsed"), [
    ("2.13.0+cpu", (2, 13, 0)), ("2.1.0a0+git1234", (2, 1, 0)), ("1.13.1", (1, 13, 1)), ("2.4", (2, 4)),
    ("nightly", ()),
])
def test_parse_version(text: str, parsed: tuple[int, ...]) -> None:
    assert compat.parse_version(text) == parsed


@pytest.mark.parametrize("version", ["2.1.0", "2.13.0+cpu", "3.0.0"])
def test_a_torch_from_2_1_with_every_api_is_accepted(version: str) -> None:
    assert compat.torch_problem(version, missing=[]) is None


def test_the_installed_torch_has_every_api_the_backend_uses() -> None:
    assert compat.missing_apis() == []
    assert compat.torch_problem() is None


@pytest.mark.parametrize("version", ["2.0.1", "1.13.1+cu117", "nightly"])
def test_a_torch_older_than_2_1_is_refused_with_the_version_it_needs(version: str) -> None:
    assert compat.torch_problem(version, missing=[], executable="/home/u/venv/bin/python") == (
        f"torch {version} cannot run the singularity backend of `singularityctl run --world-size N` (it is "
        "older than the oldest torch the backend supports): it needs torch 2.1 or newer. Install "
        "torch>=2.1 into the job's Python environment (/home/u/venv/bin/python), or run the job with a "
        "Python that has it.")


def test_a_torch_without_an_api_the_backend_uses_is_refused_naming_it() -> None:
    problem = compat.torch_problem("2.5.0", missing=["Backend.register_backend(devices=...)"],
                                   executable="/opt/conda/bin/python")

    assert problem == (
        "torch 2.5.0 cannot run the singularity backend of `singularityctl run --world-size N` (it lacks "
        "Backend.register_backend(devices=...)): it needs torch 2.1 or newer. Install torch>=2.1 into the "
        "job's Python environment (/opt/conda/bin/python), or run the job with a Python that has it.")


def test_a_python_older_than_3_9_is_refused_and_3_9_is_accepted() -> None:
    assert _singularity_worker.python_problem((3, 9, 0), "/usr/bin/python3.9") is None
    assert _singularity_worker.python_problem((3, 8, 18), "/usr/bin/python3.8") == (
        "Python 3.8.18 (/usr/bin/python3.8) is too old for the singularity backend of `singularityctl run "
        "--world-size N`: it needs Python 3.9 or newer. Run the job's script with a Python 3.9+ "
        "interpreter (venv, conda or container) that has torch.")


# --- a worker that cannot run the backend ----------------------------------------------------------

REFUSED_WORKER = r"""
import sys

import _singularity_worker
import _singularity_worker.compat as compat

{fake}
import torch.distributed as dist

try:
    dist.init_process_group("gloo")
except RuntimeError as exc:
    print(exc)
else:
    print("initialised")
"""


def refused_worker(tmp_path: Path, fake: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(HOOK_DIR), SINGULARITY_PROXY="1", SINGULARITY_JOB_ID="1",
               RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    return subprocess.run([sys.executable, "-c", REFUSED_WORKER.format(fake=fake)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("fake", "problem"), [
    ("compat.MIN_TORCH = (99, 0)",
     f"torch {torch.__version__} cannot run the singularity backend of `singularityctl run --world-size N` "
     "(it is older than the oldest torch the backend supports): it needs torch 99.0 or newer. Install "
     f"torch>=99.0 into the job's Python environment ({sys.executable}), or run the job with a Python that "
     "has it."),
    ("compat.missing_apis = lambda: ['torch._C._distributed_c10d._create_work_from_future']",
     f"torch {torch.__version__} cannot run the singularity backend of `singularityctl run --world-size N` "
     "(it lacks torch._C._distributed_c10d._create_work_from_future): it needs torch 2.1 or newer. Install "
     f"torch>=2.1 into the job's Python environment ({sys.executable}), or run the job with a Python that "
     "has it."),
    ("_singularity_worker.MIN_PYTHON = (99, 0)",
     f"Python {'.'.join(map(str, sys.version_info[:3]))} ({sys.executable}) is too old for the singularity "
     "backend of `singularityctl run --world-size N`: it needs Python 99.0 or newer. Run the job's script "
     "with a Python 99.0+ interpreter (venv, conda or container) that has torch."),
], ids=["old torch", "torch without an api", "old python"])
def test_a_worker_that_cannot_run_the_backend_is_told_why_at_import_and_at_init_process_group(
        tmp_path: Path, fake: str, problem: str) -> None:
    run = refused_worker(tmp_path, fake)

    assert run.returncode == 0, run.stderr
    assert run.stdout == f"[singularity] {problem}\n"
    assert run.stderr == f"[singularity] {problem}\n"
