"""The GPU reduction kernels compute what the host backend computes, bit for bit.

kernels/reduce.cu compiles for the host too: its loops run here, step by step as the proxy's
`reduction_steps` orders them on the GPU, on the same contributions as `HostBackend.reduce`, and the
results must be the same bytes (NaN, infinities, subnormals, rounding ties, integer wraparound among
them; a NaN is a NaN, whatever its sign and payload). The committed PTX must be what `make kernels`
makes of the source, and must assemble.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from singularity_slurm.proxy import gpu
from singularity_slurm.proxy.hal import (
    BFLOAT16,
    DTYPES,
    REDUCTIONS,
    BackendError,
    HostBackend,
    bfloat16_to_float32,
    float32_to_bfloat16,
)

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "proxy/kernels/reduce.cu"


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory) -> ctypes.CDLL:
    library = tmp_path_factory.mktemp("kernels") / "libreduce_host.so"
    subprocess.run(["g++", "-x", "c++", "-O2", "-ffp-contract=off", "-shared", "-fPIC", "-Wall", "-Werror",
                    str(SOURCE), "-o", str(library)], check=True)
    return ctypes.CDLL(str(library))


def _floats(rng: np.random.Generator, n: int, dtype: str) -> np.ndarray:
    values = rng.standard_normal(n).astype(np.float64) * rng.choice([1e-6, 1e-3, 1.0, 1e3, 6e4], n)
    special = [np.nan, np.inf, -np.inf, 0.0, -0.0, 0.0, -0.0, 1e-40, -1e-40, 65504.0, 65520.0, 3.0e38,
               2.0 ** -25, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 1 + 2.0 ** -8]
    values[:len(special)] = rng.permutation(special)
    if dtype == "bfloat16":
        return float32_to_bfloat16(values.astype(np.float32))
    with np.errstate(over="ignore"):
        return values.astype(dtype)


def _parts(dtype: str, op: str, seed: int, count: int = 3, n: int = 4099) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return [rng.integers(0, 2, n).astype(bool) for _ in range(count)]
    if np.dtype(DTYPES[dtype]).kind in "iu":
        info = np.iinfo(dtype)
        return [rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True) for _ in range(count)]
    return [_floats(rng, n, dtype) for _ in range(count)]


def _run(lib: ctypes.CDLL, dtype: str, op: str, parts: list[np.ndarray]) -> np.ndarray:
    """The proxy's steps, with the host builds of its kernels (host_ for sp_)."""
    n = parts[0].size
    out = np.empty_like(parts[0])
    acc = np.empty(n, dtype=np.float32)

    def ptr(array: np.ndarray) -> ctypes.c_void_p:
        return ctypes.c_void_p(array.ctypes.data)

    for step in gpu.reduction_steps(dtype, op, len(parts)):
        target = acc if step.target == "acc" else out
        if step.kernel == "copy":
            out[:] = parts[step.part]
            continue
        function = getattr(lib, "host_" + step.kernel.removeprefix("sp_"))
        function.restype = None
        if step.divisor is not None:
            scalar = ctypes.c_double(step.divisor) if dtype == "float64" else ctypes.c_float(step.divisor)
            function(ptr(target), scalar, ctypes.c_uint64(n))
        elif step.kernel == "sp_narrow_bfloat16":
            function(ptr(out), ptr(acc), ctypes.c_uint64(n))
        else:
            function(ptr(target), ptr(parts[step.part]), ctypes.c_uint64(n))
    return out


def _nan(values: np.ndarray) -> np.ndarray:
    """Where values are NaN. A NaN's sign and payload are not part of the promise: a GPU writes its
    one canonical NaN where arithmetic makes one, x86 propagates an operand's."""
    if values.dtype == BFLOAT16:
        return np.isnan(bfloat16_to_float32(values))
    if values.dtype.kind == "f":
        return np.isnan(values)
    return np.zeros(values.size, dtype=bool)


CASES = [(dtype, op) for dtype in DTYPES for op in REDUCTIONS
         if not (op == "avg" and np.dtype(DTYPES[dtype]).kind not in "fV")]


@pytest.mark.parametrize("dtype,op", CASES)
def test_the_kernels_give_the_host_backends_bits(host_kernels, dtype, op):
    for seed, count in ((1, 2), (2, 3), (3, 5)):
        parts = _parts(dtype, op, seed, count)
        with np.errstate(all="ignore"):
            expected = HostBackend().reduce(parts, op)
        got = _run(host_kernels, dtype, op, parts)
        assert got.dtype == expected.dtype
        width = got.dtype.itemsize
        unequal = (got.view(np.uint8).reshape(-1, width)
                   != expected.view(np.uint8).reshape(-1, width)).any(axis=1)
        differ = np.flatnonzero(unequal & ~(_nan(got) & _nan(expected)))
        assert differ.size == 0, (
            f"{dtype} {op} over {count} parts: {differ.size} elements differ, first at {differ[0]}: "
            f"parts {[p[differ[0]] for p in parts]}, kernel {got[differ[0]]}, host {expected[differ[0]]}")


def test_one_contribution_is_itself_and_avg_of_one_divides_by_one(host_kernels):
    part = _parts("float16", "sum", 7, 1)
    assert _run(host_kernels, "float16", "sum", part).tobytes() == part[0].tobytes()
    with np.errstate(all="ignore"):
        expected = HostBackend().reduce(part, "avg").tobytes()
    assert _run(host_kernels, "float16", "avg", part).tobytes() == expected


def test_the_steps_refuse_what_the_host_backend_refuses():
    host = HostBackend()
    for dtype in ("int32", "uint8", "bool"):
        with pytest.raises(BackendError, match="avg needs a floating-point dtype"):
            gpu.reduction_steps(dtype, "avg", 2)
        with pytest.raises(BackendError, match="avg needs a floating-point dtype"):
            host.reduce([np.zeros(2, dtype=dtype)] * 2, "avg")
    with pytest.raises(BackendError, match="dtype 'complex64' not supported"):
        gpu.reduction_steps("complex64", "sum", 2)
    with pytest.raises(BackendError, match="reduction 'xor' not supported"):
        gpu.reduction_steps("float32", "xor", 2)


def test_the_steps_combine_left_to_right_in_the_order_given():
    steps = gpu.reduction_steps("float32", "avg", 4)
    assert [s.part for s in steps if s.part is not None] == [0, 1, 2, 3]
    assert steps[0].kernel == "copy" and steps[-1] == gpu.Step("sp_div_float32", "out", divisor=4.0)
    bf16 = gpu.reduction_steps("bfloat16", "max", 3)
    assert [s.kernel for s in bf16] == ["sp_widen_bfloat16", "sp_max_bfloat16", "sp_max_bfloat16",
                                        "sp_narrow_bfloat16"]
    assert {s.target for s in bf16[:-1]} == {"acc"} and bf16[-1].target == "out"
    # float16's divisor is the count as float16 (numpy converts it so): 2049 is not one
    assert gpu.reduction_steps("float16", "avg", 2049)[-1].divisor == 2048.0


def test_the_committed_ptx_is_made_from_the_source_and_assembles(tmp_path):
    nvcc, ptxas = shutil.which("nvcc"), shutil.which("ptxas")
    assert nvcc and ptxas, "nvcc and ptxas (the CUDA toolkit) are on every machine these tests run on"
    subprocess.run(["make", "-s", "-C", str(REPO), "kernels"], check=True, capture_output=True)
    made = (REPO / "proxy/kernels/reduce.ptx").read_text()
    assert subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "--", "proxy/kernels/reduce.ptx"]
                          ).returncode == 0, "reduce.ptx is not what `make kernels` makes: run it and commit"
    entries = {line.split()[-1].rstrip("(") for line in made.splitlines()
               if line.startswith(".visible .entry")}
    assert set(gpu.kernel_names()) <= entries, set(gpu.kernel_names()) - entries
    assert gpu.PTX.read_text() == made, f"the installed {gpu.PTX} is not the checkout's: reinstall"
    for arch in ("sm_75", "sm_90"):
        subprocess.run([ptxas, f"-arch={arch}", str(REPO / "proxy/kernels/reduce.ptx"), "-o",
                        str(tmp_path / f"reduce-{arch}.cubin")], check=True)


def test_the_buffers_are_offered_only_where_memory_never_moves_under_them():
    assert gpu.offered(ready=True, sliced=False, moves_memory=True)  # holds its GPU alone
    assert gpu.offered(ready=True, sliced=True, moves_memory=False)  # turns, gpu_swap never
    assert not gpu.offered(ready=True, sliced=True, moves_memory=True)
    assert not gpu.offered(ready=False, sliced=False, moves_memory=False)


def test_sizes_grids_and_uuids():
    assert gpu.allocation_size(1, 2 << 20) == 2 << 20
    assert gpu.allocation_size(5 << 20, 2 << 20) == 6 << 20
    assert gpu.allocation_size(0, 0) == 1 << 20
    assert gpu.grid(1) == 1 and gpu.grid(gpu.THREADS + 1) == 2 and gpu.grid(1 << 40) == gpu.MAX_BLOCKS
    assert gpu.format_uuid(bytes(range(16))) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    with pytest.raises(ValueError):
        gpu.format_uuid(b"\0" * 15)
    assert BFLOAT16.itemsize == 2
