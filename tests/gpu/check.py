"""The GPU acceptance checks, through the project's own GPU code, on a machine with an NVIDIA GPU.

Run by tests/gpu/run.sh (which makes the project importable without installing it, and skips where
no GPU is present). As root, with criu where the project installs it. Prints one line per item,
`PASS <item>: ...`, `FAIL <item>: ...` or `SKIP <item>: ...`, then a summary, and writes
DIR/gpu-check.json.

Items:
- driver: checkpoint.cuda.Driver loads (cuda-python's bindings, a driver with the checkpoint API)
- inventory: node.gpus.inventory reads the GPUs (UUID, type, memory, health) through NVML
- single-process: examples/train_cuda.py, unmodified, in the node agent's layout (its own PID and
  mount namespace), checkpointed and restored twice the way the engine does it (cuda.suspend, criu
  dump with the configured external mounts, criu restore, cuda.resume; the second restore passes
  explicit GPU UUID pairs, old -> new): its log byte-identical to an undisturbed run's
- sizes: one such cycle with N MiB of GPU memory, each step timed (the checkpoint/restore benchmark)
- bench-proxy-vs-nccl: benchmarks/proxy_vs_gloo.py --device cuda, one rank per GPU, NCCL and the
  proxies side by side in one run: the step time ratio proxy / NCCL (measured, reported; it passes
  when both modes ran and trained alike)
- time-slicing: the same DDP script with two ranks on one GPU through one proxy (the cuda backend's
  turns; NCCL refuses two ranks on one GPU), its step time against the ideal 2x of one rank alone
- gpu-swap: two ranks on one GPU, 1 GiB each besides the model, their proxy moving the waiting
  rank's memory to host memory as where they would not fit together (proxy.gpu_swap = auto with a
  reserve the size of the GPU): step time against the time-slicing run's, moves per step and their
  time, every rank's memory intact
- gpu-buffers: two ranks time-sliced on one GPU with proxy.gpu_swap = never, so that their proxy gives
  them GPU buffers and reduces on the GPU, against the same with proxy.gpu_buffers = false (staged
  through host memory): the step time ratio, and the same losses both ways
- ddp-2rank: examples/train_ddp.py --device cuda (`init_process_group("nccl")`, unmodified), two
  ranks time-sliced on one GPU through one proxy, preempted at step 15 of 40 and restored the node
  agent's way (tests/gpu/ddp.py: the proxy's cut, the driver's checkpoint, criu per rank tree, a new
  proxy and generation): both ranks' logs byte-identical to an undisturbed 2-rank run's
- ddp-2rank-swapped: the same with proxy.gpu_swap = always and 256 MiB per rank besides the model: at
  the cut a rank's memory is out already (recorded, left so); after the restore its proxy brings it
  in through the restore's GPU UUID pairs
- ddp-2rank-gpu-buffers: ddp-2rank with proxy.gpu_swap = never: the ranks' allreduces go through GPU
  buffers, reduced on the GPU, before the cut and after the restore (the ranks released their buffers
  at the cut); logs byte-identical to its undisturbed run's, which are ddp-2rank's (the GPU reduces
  to the host's bits)

criu runs as its command line here (the node agent drives it through pycriu, which such a machine
may not have); the options are the agent's.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import ddp
from probe import du, end_training, sh, start_training, wait_for_line, wait_pid

from singularity_slurm.checkpoint import cuda
from singularity_slurm.checkpoint.criu import dump_externals, external_mounts, restore_externals
from singularity_slurm.config import GpuConfig
from singularity_slurm.node import gpus, jobcgroup

REPO = Path(__file__).resolve().parents[2]
RESULTS: list[dict[str, object]] = []


def verdict(item: str, status: str, detail: object) -> None:
    RESULTS.append({"item": item, "status": status, "detail": detail})
    text = detail if isinstance(detail, str) else json.dumps(detail, sort_keys=True)
    print(f"{status} {item}: {text}", flush=True)


def cycle(driver: cuda.Driver, criu: str, init_pid: int, images: Path,
          explicit_pairs: bool) -> tuple[int, dict[str, object]]:
    """One checkpoint and restore of the tree whose init is `init_pid`, as the engine does them.
    Returns the restored init's host pid and the timings."""
    times: dict[str, object] = {}
    images.mkdir(parents=True)
    tasks = cuda.gpu_tasks(jobcgroup.tree(init_pid))
    times["cuda_tasks"] = len(tasks)
    held = gpus.inventory(cuda.opened_gpus(tasks))
    inner = set(cuda.inner_pids(tasks).values())
    mounts = external_mounts(Path(f"/proc/{init_pid}/mountinfo").read_text(), GpuConfig.external_mounts)
    times["external_mounts"] = mounts
    start = time.perf_counter()
    cuda.suspend(driver, tasks)
    times["gpu_out_s"] = time.perf_counter() - start
    start = time.perf_counter()
    code, text = sh([criu, "dump", "-t", str(init_pid), "-D", str(images), "-o", "dump.log", "-v4",
                     "--file-locks", *[f"--external={e}" for e in dump_externals(mounts)]], timeout=600)
    times["criu_dump_s"] = time.perf_counter() - start
    if code != 0:
        cuda.resume(driver, tasks)
        raise RuntimeError(f"criu dump failed: {text[-600:]}")
    wait_pid(init_pid, 30)
    times["image_bytes"] = du(images)
    start = time.perf_counter()
    code, text = sh([criu, "restore", "-D", str(images), "-o", "restore.log", "-v4", "-d", "--file-locks",
                     "--root", "/", "--pidfile", str(images / "restored.pid"),
                     *[f"--external={e}" for e in restore_externals(mounts)]], timeout=600)
    times["criu_restore_s"] = time.perf_counter() - start
    if code != 0:
        raise RuntimeError(f"criu restore failed: {text[-600:]}")
    restored = int((images / "restored.pid").read_text())
    new = gpus.inventory([gpu.index for gpu in held])
    pairs = gpus.restore_pairs(held, new)
    if explicit_pairs:  # the driver's remapping path, onto the same GPUs
        pairs = [cuda.GpuPair(old.uuid, now.uuid) for old, now in zip(held, new, strict=True)]
    times["pairs"] = len(pairs)
    back = [host for host, pid in cuda.inner_pids(jobcgroup.tree(restored)).items() if pid in inner]
    start = time.perf_counter()
    resumed = cuda.resume(driver, back, pairs)
    times["gpu_in_s"] = time.perf_counter() - start
    times["resumed"] = resumed
    return restored, times


def run_cycles(driver: cuda.Driver, criu: str, work: Path, name: str, steps: int, cuts: list[int],
               extra: list[str]) -> dict[str, object]:
    log = work / f"{name}.log"
    proc, pid = start_training(log, "--steps", str(steps), *extra, pidns=True)
    result: dict[str, object] = {"cycles": []}
    try:
        for index, cut in enumerate(cuts):
            if not wait_for_line(log, f"step {cut} "):
                raise RuntimeError(f"no step {cut}: {log.read_text()[-600:]}")
            pid, times = cycle(driver, criu, pid, work / f"{name}-{index}", explicit_pairs=index == 1)
            result["cycles"].append(times)
        result["exit"] = wait_pid(pid, 600)
    finally:
        end_training(proc, pid)
    result["log"] = log.read_text()
    return result


def proxy_bench(out: Path, name: str, *options: str) -> dict[str, object]:
    """benchmarks/proxy_vs_gloo.py --device cuda with `options`: its JSON report (stdout)."""
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "proxy_vs_gloo.py"), "--device", "cuda",
                           "--json", "--no-save", "--workdir", str(out / name), *options],
                          capture_output=True, text=True, timeout=420)
    (out / f"{name}.log").write_text(done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"proxy_vs_gloo.py exited with {done.returncode}: {done.stderr[-800:]}")
    report = json.loads(done.stdout)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2))
    return report


def gpu_benchmarks(out: Path, gpus: int) -> None:
    """proxy / NCCL with a rank per GPU, then two ranks time-sliced on one GPU against one alone."""
    sizes = ["--hidden", "1024,4096", "--steps", "60", "--warmup", "10", "--compute-steps", "5"]
    try:
        side = proxy_bench(out, "proxy-vs-nccl", "--world-size", str(gpus), "--proxies", str(gpus),
                           "--rounds", "2", *sizes)
        rows = [{k: row[k] for k in ("hidden", "grad_mib", "gloo_ms", "proxy_ms", "ratio", "gloo_losses",
                                      "proxy_losses")} for row in side["summary"]]
        alike = all(len(r["gloo_losses"]) == 1 and len(r["proxy_losses"]) == 1 for r in rows)
        verdict("bench-proxy-vs-nccl", "PASS" if rows and alike else "FAIL",
                {"ranks": gpus, "rows": rows, "note": "gloo_* = the NCCL baseline"})
    except Exception as exc:
        verdict("bench-proxy-vs-nccl", "FAIL", str(exc))
        return
    try:
        alone = {row["hidden"]: row for row in side["summary"]}
        sliced = proxy_bench(out, "time-slicing", "--world-size", "2", "--proxies", "1", "--modes", "proxy",
                             "--rounds", "2", *sizes)
        rows = []
        for row in sliced["summary"]:
            solo = alone[row["hidden"]]["gloo_ms"] if gpus == 1 else None
            rows.append({"hidden": row["hidden"], "two_ranks_one_gpu_ms": row["proxy_ms"],
                         "one_rank_alone_ms": solo,
                         "overhead_vs_ideal_2x": round(row["proxy_ms"] / (2 * solo), 3) if solo else None,
                         "losses": row["proxy_losses"]})
        ok = rows and all(len(r["losses"]) == 1 for r in rows)
        verdict("time-slicing", "PASS" if ok else "FAIL", rows)
    except Exception as exc:
        verdict("time-slicing", "FAIL", str(exc))
        return
    gpu_buffers(out, ["--hidden", "4096", "--steps", "40", "--warmup", "5", "--compute-steps", "0"])
    gpu_swap(out, {row["hidden"]: row["two_ranks_one_gpu_ms"] for row in rows})


def gpu_buffers(out: Path, sizes: list[str]) -> None:
    """Two ranks time-sliced on one GPU (gpu_swap never), their allreduces through GPU buffers reduced
    on the GPU against the same staged through host memory: step time ratio, and the same losses."""
    try:
        runs = {}
        for setting in ("on", "off"):
            report = proxy_bench(out, f"gpu-buffers-{setting}", "--world-size", "2", "--proxies", "1",
                                 "--modes", "proxy", "--rounds", "2", "--gpu-swap", "never",
                                 "--gpu-buffers", setting, *sizes)
            runs[setting] = {row["hidden"]: row for row in report["summary"]}
        rows = []
        for hidden, row in runs["on"].items():
            staged = runs["off"][hidden]
            rows.append({"hidden": hidden, "gpu_buffers_ms": row["proxy_ms"], "staged_ms": staged["proxy_ms"],
                         "ratio": round(row["proxy_ms"] / staged["proxy_ms"], 3),
                         "same_losses": row["proxy_losses"] == staged["proxy_losses"]})
        verdict("gpu-buffers", "PASS" if rows and all(r["same_losses"] for r in rows) else "FAIL", rows)
    except Exception as exc:
        verdict("gpu-buffers", "FAIL", str(exc))


def gpu_swap(out: Path, sliced_ms: dict[int, float]) -> None:
    """Two ranks on one GPU whose memory moves out while they wait, as where they would not fit
    together: proxy.gpu_swap = auto with a reserve the size of the GPU (ranks that truly do not fit
    would need most of an H200 each, and moving that much takes minutes a turn), 1 GiB per rank."""
    total_mib = gpus.inventory([0])[0].memory_mib
    row: dict[str, object] = {}
    try:
        report = proxy_bench(out, "gpu-swap", "--world-size", "2", "--proxies", "1", "--modes", "proxy",
                             "--rounds", "1", "--gpu-swap", "auto", "--gpu-swap-reserve-mib", str(total_mib),
                             "--device-mb", "1024", "--hidden", "1024", "--steps", "6", "--warmup", "2",
                             "--compute-steps", "0")
        (summary,) = report["summary"]
        moves = [p for p in report["profile"] if p["op"] == "swap"]
        sliced = sliced_ms.get(summary["hidden"])
        row = {"mib_per_rank": 1024, "gpu_mib": total_mib, "hidden": summary["hidden"],
               "step_ms": summary["proxy_ms"], "sliced_without_moves_ms": sliced,
               "vs_sliced": round(summary["proxy_ms"] / sliced, 3) if sliced else None,
               "moves_per_rank_step": moves[0]["calls_per_rank"] if moves else 0,
               "move_ms_per_rank_step": moves[0]["rank_ms"] if moves else 0,
               "losses": summary["proxy_losses"]}
        ok = row["moves_per_rank_step"] > 0 and len(row["losses"]) == 1
        verdict("gpu-swap", "PASS" if ok else "FAIL", row)
    except Exception as exc:
        verdict("gpu-swap", "FAIL", {"error": str(exc), **row})


def ddp_checks(work: Path, criu: str) -> None:
    """The 2-rank DDP job preempted and restored: staged through host memory (gpu_swap auto: the
    proxy may move memory, so it offers no GPU buffers), with a rank's memory out at the cut, and
    through GPU buffers reduced on the GPU (gpu_swap never), whose numbers must be the staged run's."""
    swapped = {"gpu_swap": "always", "device_mb": 256, "steps": 8, "cut_step": 4}  # moves take seconds
    references: dict[str, object] = {}
    short = {"steps": 40, "cut_step": 15}  # both alike: their undisturbed runs' logs are compared
    for item, options in (("ddp-2rank", short), ("ddp-2rank-swapped", swapped),
                          ("ddp-2rank-gpu-buffers", {**short, "gpu_swap": "never"})):
        try:
            result = ddp.check(work / item, criu, "cuda", **options)
            references[item] = result["reference_sha256"]
            ok = result["ok"]
            if item == "ddp-2rank-swapped":
                ok = ok and any(result["swapped_at_cut"].values())
            if item == "ddp-2rank-gpu-buffers":  # on the GPU before the cut and after the restore
                staged = references.get("ddp-2rank")
                result["same_numbers_as_staged"] = staged == result["reference_sha256"]
                ok = ok and all(result["gpu_reduce"].values()) and result["same_numbers_as_staged"]
            verdict(item, "PASS" if ok else "FAIL", {k: v for k, v in result.items()
                                                     if k not in ("first_proxy", "second_proxy")})
        except Exception as exc:
            verdict(item, "FAIL", str(exc))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--criu", default="/opt/singularity-slurm/bin/singularity-criu")
    parser.add_argument("--out", type=Path, default=Path("/tmp/gpu-check"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu-check-work"))
    parser.add_argument("--sizes", default="1024,4096", help="GPU memory MiB of the sizes items")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: restored trees come back here
    try:
        try:
            driver = cuda.Driver()
            verdict("driver", "PASS", {"cuda_driver_version": driver.version})
        except cuda.CudaUnavailable as exc:
            verdict("driver", "FAIL", str(exc))
            return 1
        try:
            found = gpus.inventory([0])
            verdict("inventory", "PASS" if found and found[0].uuid.startswith("GPU-") else "FAIL",
                    [gpu.record() for gpu in found])
        except Exception as exc:
            verdict("inventory", "FAIL", str(exc))
        ref = args.work / "reference.log"
        proc, _ = start_training(ref)
        proc.wait(300)
        try:
            result = run_cycles(driver, args.criu, args.work, "single", 400, [100, 250], [])
            same = result.pop("log") == ref.read_text()
            verdict("single-process", "PASS" if same and result["exit"] == 0 else "FAIL",
                    {**result, "log_identical": same})
        except Exception as exc:
            verdict("single-process", "FAIL", str(exc))
        reference_steps = ref.read_text().splitlines()[:60]
        for mib in [int(x) for x in args.sizes.split(",") if x]:
            try:
                result = run_cycles(driver, args.criu, args.work, f"mem{mib}", 60, [20],
                                    ["--device-mb", str(mib)])
                lines = result.pop("log").splitlines()
                intact = [line for line in lines if line.startswith("ballast")]
                steps_same = [line for line in lines if line.startswith("step")] == reference_steps
                ok = steps_same and intact and "intact" in intact[0] and result["exit"] == 0
                verdict(f"sizes-{mib}", "PASS" if ok else "FAIL", {**result, "ballast": intact})
            except Exception as exc:
                verdict(f"sizes-{mib}", "FAIL", str(exc))
        code, listed = sh(["nvidia-smi", "-L"])
        ddp_checks(args.work, args.criu)
        gpu_benchmarks(args.out, max(1, sum(line.startswith("GPU ") for line in listed.splitlines())))
    finally:
        (args.out / "gpu-check.json").write_text(json.dumps(RESULTS, indent=2, default=str))
        passed = sum(r["status"] == "PASS" for r in RESULTS)
        print(f"SUMMARY: {passed} passed, {len(RESULTS) - passed} failed of {len(RESULTS)}", flush=True)
    return 0 if all(r["status"] == "PASS" for r in RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
