"""benchmarks/proxy_vs_gloo.py: its plan, its settings checks and where it puts each rank, on CPUs
and on GPUs (pure logic; the runs need root, proxies and torch workers, and, for --device cuda, a GPU)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import proxy_vs_gloo as bench  # noqa: E402

CPU = bench.Settings(world_size=4, proxies=2, sizes=(256,), layers=3, batch=64, steps=10, warmup=1,
                     compute_steps=1, rounds=2, bucket_mb=25.0, run_timeout=60.0, python=sys.executable,
                     proxy_cmd=("singularity-proxy",))


def test_both_modes_run_back_to_back_alternating_which_goes_first() -> None:
    assert bench.plan(CPU) == [(1, 256, "gloo"), (1, 256, "proxy"), (2, 256, "proxy"), (2, 256, "gloo")]


def test_one_mode_alone_runs_once_a_round() -> None:
    assert bench.plan(replace(CPU, modes=("proxy",))) == [(1, 256, "proxy"), (2, 256, "proxy")]


def test_the_baseline_is_gloo_on_cpus_and_nccl_on_gpus() -> None:
    gpu = replace(CPU, device="cuda", world_size=2, proxies=2, gpus=2)

    assert [CPU.backend_name(m) for m in ("gloo", "proxy")] == ["gloo", "singularity"]
    assert [gpu.backend_name(m) for m in ("gloo", "proxy")] == ["nccl", "singularity"]
    assert bench.settings_problems(gpu) == []


@pytest.mark.parametrize(("changes", "says"), [
    ({"modes": ()}, "--modes takes gloo (the baseline) and/or proxy"),
    ({"modes": ("nccl",)}, "--modes takes gloo (the baseline) and/or proxy"),
    ({"device": "cuda", "gpus": 0}, "--device cuda needs a GPU this Python's torch can use "
                                    "(torch.cuda.device_count() is 0)"),
    ({"device": "cuda", "gpus": 1, "world_size": 2, "proxies": 1},
     "NCCL, the baseline with --device cuda, runs one rank per GPU: --proxies must equal --world-size and "
     "1 GPU(s) hold at most 1 ranks; use --modes proxy to measure ranks that share a GPU"),
    ({"world_size": 0}, "--world-size must be at least 1"),
])
def test_settings_the_benchmark_cannot_run_are_refused_saying_why(changes: dict, says: str) -> None:
    assert says in bench.settings_problems(replace(CPU, **changes))


def test_two_ranks_time_sliced_on_one_gpu_run_in_proxy_mode_alone() -> None:
    sliced = replace(CPU, device="cuda", world_size=2, proxies=1, gpus=1, modes=("proxy",))

    assert bench.settings_problems(sliced) == []


def test_each_rank_sees_the_gpu_of_its_proxy(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpu = replace(CPU, device="cuda", world_size=4, proxies=2, gpus=2, modes=("proxy",))

    assert [bench.Runner(gpu, tmp_path, print).base_env(r)["CUDA_VISIBLE_DEVICES"] for r in range(4)] == [
        "0", "0", "1", "1"]
    assert "CUDA_VISIBLE_DEVICES" not in bench.Runner(CPU, tmp_path, print).base_env(0)
