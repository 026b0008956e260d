"""The job's GPUs as NVML sees them at its start: read by UUID, type, memory and health, kept in the
registry by the Prolog, and shown by `singularityctl status`. NVML itself is replaced by a small fake
module here (these machines have no GPU); tests/gpu/ reads the real one."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import pytest

from singularity_slurm.config import parse
from singularity_slurm.coordinator.registry import NodeStart, Registry
from singularity_slurm.jobenv import JobContext
from singularity_slurm.node import gpus
from singularity_slurm.prolog.main import gpu_inventory, proxy_spec
from singularity_slurm.slurm_plugin.status import format_details, merge_job

H200 = "NVIDIA H200"
UUIDS = ["GPU-0b0e5cc6-6e39-5a5e-0d8f-7c1b4f9a2e01", "GPU-1c1f6dd7-7f4a-6b6f-1e90-8d2c5a0b3f12",
         "GPU-2d207ee8-805b-7c70-2fa1-9e3d6b1c4023"]


class NVMLError(Exception):
    pass


def fake_nvml(devices: dict[int, dict], calls: list[str], starts: bool = True) -> types.ModuleType:
    """A stand-in for pynvml: `devices` maps an index to its uuid, name, memory, and counters (None:
    not supported on that GPU)."""
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = NVMLError
    nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC = 1, 0

    def init():
        calls.append("init")
        if not starts:
            raise NVMLError("Driver Not Loaded")

    def counter(index, name):
        value = devices[index].get(name)
        if value is None:
            raise NVMLError("Not Supported")
        return value

    def handle(index):
        if index not in devices:
            raise NVMLError("Invalid Argument")
        return index

    nvml.nvmlInit, nvml.nvmlShutdown = init, lambda: calls.append("shutdown")
    nvml.nvmlDeviceGetHandleByIndex = handle
    nvml.nvmlDeviceGetUUID = lambda i: devices[i]["uuid"]
    nvml.nvmlDeviceGetName = lambda i: devices[i]["name"]
    nvml.nvmlDeviceGetMemoryInfo = lambda i: types.SimpleNamespace(total=devices[i]["mib"] << 20)
    nvml.nvmlDeviceGetTotalEccErrors = lambda i, kind, counter_type: counter(i, "ecc")
    nvml.nvmlDeviceGetRemappedRows = lambda i: counter(i, "remap")
    return nvml


NODE = {
    0: {"uuid": UUIDS[0], "name": H200, "mib": 143771, "ecc": 0, "remap": (0, 0, False, False)},
    1: {"uuid": UUIDS[1], "name": H200, "mib": 143771, "ecc": 3, "remap": (0, 2, True, False)},
    2: {"uuid": UUIDS[2], "name": H200, "mib": 143771, "ecc": None, "remap": None},
}


def job_on(gpu_numbers: list[str]) -> JobContext:
    return JobContext(job_id=7, user="alice", uid=1000, node="n1", partition="basic", tier="basic",
                      gpus=gpu_numbers, restart_count=0)


def test_the_node_inventory_reads_each_gpu_by_uuid_type_memory_and_health(monkeypatch) -> None:
    calls: list[str] = []
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(NODE, calls))

    found, why = gpus.node_inventory([2, 1])

    assert why is None and calls == ["init", "shutdown"]
    assert found == [
        gpus.Gpu(2, UUIDS[2], H200, 143771),  # counters this GPU does not support: nothing known wrong
        gpus.Gpu(1, UUIDS[1], H200, 143771, ("3 uncorrected ECC errors since the driver loaded",
                                              "a row remapping is pending (reset the GPU)")),
    ]


@pytest.mark.parametrize("case", ["no bindings", "no driver", "no such gpu"])
def test_where_nvml_cannot_tell_the_inventory_is_none_with_the_reason(monkeypatch, case: str) -> None:
    calls: list[str] = []
    if case == "no bindings":
        monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    else:
        monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(NODE, calls, starts=case != "no driver"))

    found, why = gpus.node_inventory([5] if case == "no such gpu" else [0])

    assert found is None
    assert why == {
        "no bindings": "NVML's Python bindings are not installed in the project's venv: install the gpu "
                       "extra (pip install 'singularity-slurm[gpu]')",
        "no driver": "NVML cannot start on this node: Driver Not Loaded",
        "no such gpu": "NVML cannot read GPU 5: Invalid Argument",
    }[case]
    assert calls in ([], ["init"], ["init", "shutdown"])


def test_the_prolog_takes_slurms_gpus_and_warns_of_an_unhealthy_one(monkeypatch, caplog) -> None:
    calls: list[str] = []
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(NODE, calls))
    log = logging.getLogger("prolog-test")

    with caplog.at_level(logging.INFO, logger="prolog-test"):
        records = gpu_inventory(job_on(["0", "1", "mps"]), log)  # a gres name is no GPU number

    assert [r["uuid"] for r in records] == UUIDS[:2]
    assert records[0] == {"index": 0, "uuid": UUIDS[0], "name": H200, "memory_mib": 143771, "problems": []}
    assert [r.message for r in caplog.records] == [
        f"GPU 1 ({H200}, {UUIDS[1]}) is unhealthy: 3 uncorrected ECC errors since the driver loaded; a row "
        "remapping is pending (reset the GPU)"]


def test_the_prolog_takes_no_inventory_without_gpus_or_nvml(monkeypatch, caplog) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    log = logging.getLogger("prolog-test")

    with caplog.at_level(logging.INFO, logger="prolog-test"):
        assert gpu_inventory(job_on([]), log) is None
        assert gpu_inventory(job_on(["0"]), log) is None

    assert [r.message for r in caplog.records] == [
        "GPU inventory not taken: NVML's Python bindings are not installed in the project's venv: install "
        "the gpu extra (pip install 'singularity-slurm[gpu]')"]


def backend_of(config_backend: str, device: str, inventory: list[dict] | None) -> str:
    config = parse({"proxy": {"backend": config_backend}})
    argv = proxy_spec(job_on(["0"]), config, Path("/run/x"), device, inventory).argv
    return argv[argv.index("--backend") + 1]


@pytest.mark.parametrize(("configured", "device", "seen", "expected"), [
    ("auto", "gpu0", True, "cuda"),  # NVML saw the job's GPUs: the proxy stages CUDA tensors, turns
    ("auto", "gpu0", False, "host"),  # no driver (the dev cluster's stand-ins)
    ("auto", "cpu0", False, "host"),
    ("cuda", "gpu0", False, "cuda"),  # the admin's word
    ("cuda", "cpu0", False, "host"),  # a CPU slot has no GPU to take turns on
    ("host", "gpu0", True, "host"),
])
def test_a_gpus_proxy_gets_the_cuda_backend_where_nvml_sees_the_gpus_or_the_admin_says_so(
        configured: str, device: str, seen: bool, expected: str) -> None:
    inventory = [{"index": 0, "uuid": UUIDS[0], "name": H200, "memory_mib": 143771, "problems": []}]

    assert backend_of(configured, device, inventory if seen else None) == expected


def node_start(node: str, inventory: list[dict] | None) -> NodeStart:
    return NodeStart(job_id=7, node=node, user="alice", uid=1000, tier="basic", partition="basic",
                     gpus=["0", "1"], restart_count=0, started_at=100.0, gpu_inventory=inventory)


def test_the_registry_keeps_each_nodes_inventory_and_status_shows_it(private_redis) -> None:
    failed = ("a row remapping failed (the GPU needs service)",)
    inventory = [gpus.Gpu(0, UUIDS[0], H200, 143771).record(),
                 gpus.Gpu(1, UUIDS[1], H200, 143771, failed).record()]
    registry = Registry(private_redis)
    registry.record_node_start(node_start("n1", inventory))
    registry.record_node_start(node_start("n2", None))  # NVML could not tell there

    record = registry.job(7)

    assert record["nodes"]["n1"]["gpu_inventory"] == inventory
    assert record["nodes"]["n2"]["gpu_inventory"] is None
    shown = merge_job(None, record, parse({}))
    assert shown["registry"]["gpu_inventory"] == {"n1": inventory}
    assert [gpus.Gpu.of_record(r) for r in shown["registry"]["gpu_inventory"]["n1"]][1].healthy is False
    text = format_details(shown)
    assert (f"GPUs (NVML, at the job's start on each node):\n"
            f"  n1    GPU 0  {H200}  {UUIDS[0]}  143771 MiB  healthy\n"
            f"  n1    GPU 1  {H200}  {UUIDS[1]}  143771 MiB  a row remapping failed (the GPU needs service)"
            ) in text
