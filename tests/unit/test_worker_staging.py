"""How the worker's backend hands tensors to its proxy: host memory only, CUDA tensors staged.

The CUDA half (events on the caller's stream, copies to and from the GPU) runs on a GPU machine
(tests/gpu/run.sh); here, what decides it: which tensors are staged, that a stand-in's values go
back to the script's tensor only when the operation succeeded, and that nothing but contiguous host
memory is ever copied by address.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from singularity_slurm.interpose.pyhook._singularity_worker import torch_backend as backend
from singularity_slurm.interpose.pyhook._singularity_worker.proxy_client import ProxyError


def test_a_contiguous_host_tensor_is_handed_over_as_it_is() -> None:
    tensor = torch.arange(6.0)

    with backend._Staged(tensor) as work:
        assert work is tensor
    assert backend._span(tensor) == (tensor.data_ptr(), 24)


def test_a_strided_tensors_stand_in_is_contiguous_and_its_result_goes_back() -> None:
    tensor = torch.arange(12.0).reshape(3, 4).t()

    with backend._Staged(tensor) as work:
        assert work is not tensor and work.is_contiguous() and work.tolist() == tensor.tolist()
        work.mul_(-1)

    assert tensor.tolist() == (-torch.arange(12.0).reshape(3, 4).t()).tolist()


def test_a_pure_outputs_stand_in_is_made_without_reading_it_and_its_result_goes_back() -> None:
    tensor = torch.full((3, 4), 5.0).t()

    with backend._Staged(tensor, copy_in=False) as work:
        assert work is not tensor and work.is_contiguous() and work.shape == tensor.shape
        work.fill_(2.0)  # what the proxy writes: all of it

    assert tensor.tolist() == [[2.0] * 3] * 4
    contiguous = torch.zeros(4)
    with backend._Staged(contiguous, copy_in=False) as work:
        assert work is contiguous  # written in place


def test_a_failed_operation_leaves_the_scripts_tensor_as_it_was() -> None:
    tensor = torch.arange(12.0).reshape(3, 4).t()

    with pytest.raises(ProxyError), backend._Staged(tensor) as work:
        work.fill_(7.0)
        raise ProxyError("refused")

    assert tensor.tolist() == torch.arange(12.0).reshape(3, 4).t().tolist()


def test_only_contiguous_host_memory_is_copied_by_address() -> None:
    with pytest.raises(ProxyError) as info:
        backend._span(torch.arange(12.0).reshape(3, 4).t())
    assert str(info.value) == "internal error: a cpu tensor reached the proxy unstaged"


def test_host_tensors_have_no_device_work_to_wait_for_and_no_cuda_devices() -> None:
    tensors = [torch.ones(2), torch.zeros(3, dtype=torch.int64)]

    assert backend._recorded(tensors) is backend._nothing
    assert backend._cuda(tensors) == []
    assert backend._host(tensors[0]) is tensors[0]


def test_a_tensor_on_another_device_is_refused_naming_the_ones_taken() -> None:
    with pytest.raises(ProxyError) as info:
        backend._dtype(torch.empty(2, device="meta"))
    assert str(info.value) == "the singularity backend takes CPU and CUDA tensors, got one on meta"


def test_the_backend_is_registered_for_cpu_and_cuda_tensors() -> None:
    # torch keeps a registration for the process: look at it in a fresh one
    script = ("import torch.distributed as dist\n"
              "from singularity_slurm.interpose.pyhook._singularity_worker import BACKEND, torch_backend\n"
              "torch_backend.install()\n"
              "print(dist.Backend.backend_capability[BACKEND])\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)

    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["['cpu',", "'cuda']"]
