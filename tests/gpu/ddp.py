"""A 2-rank DDP job time-sliced on one device through its proxy, preempted and restored the way the
node agent does it, without Slurm; its ranks' logs compared with an undisturbed 2-rank run's.

    python3 tests/gpu/ddp.py --device cuda|cpu [--gpu-swap auto|always|never] [--device-mb N]

examples/train_ddp.py, unmodified (`init_process_group("nccl")` with --device cuda), runs as two
ranks on one device, each as the init of its own PID and mount namespace (the agent's layout), with
only the worker hook on PYTHONPATH, through one `singularity-proxy` (the `cuda` backend on GPU 0, or
`host` on a CPU slot; the ranks take turns). At step --cut-step the proxy reaches the job's cut
(quiesce: both ranks parked, holding nothing of the proxy's); each rank's CUDA state moves into its
memory (a rank whose proxy moved it out already, proxy.gpu_swap, stays as it is and is recorded), criu
dumps each tree, and the proxy is stopped: the job is preempted. Then a new proxy serves a new
generation, is told the GPU UUID pairs where a rank comes back with its memory out, criu restores
both trees and the driver brings back the state of the ranks that were on the GPU; the ranks
reconnect and finish. `--device cpu` runs the same with CPU tensors (no driver calls), which is how
the dev machine checks this script.

Run as root (criu, the proxy's root-only control socket). Prints a JSON report; exit status 0 when
both ranks' logs are byte-identical to the undisturbed run's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from probe import du, end_training, sh, start_training, wait_for_line, wait_pid

from singularity_slurm import rpc
from singularity_slurm.checkpoint import cuda
from singularity_slurm.checkpoint.criu import dump_externals, external_mounts, restore_externals
from singularity_slurm.config import GpuConfig
from singularity_slurm.node import gpus, jobcgroup
from singularity_slurm.proxy.ranksock import rank_dir

REPO = Path(__file__).resolve().parents[2]
HOOK = REPO / "interpose" / "pyhook"
TRAIN_DDP = REPO / "examples" / "train_ddp.py"
RANKS = (0, 1)


class Setup:
    """One job's fixed parts: its id, state folder (rank sockets), device and training options."""

    def __init__(self, work: Path, device: str, gpu_swap: str | None, device_mb: int, steps: int):
        self.work = work
        self.device = device
        self.gpu_swap = gpu_swap
        self.device_mb = device_mb
        self.steps = steps
        self.job_id = 900_000_000 + os.getpid()
        self.state = Path(tempfile.mkdtemp(prefix="singularity-state-", dir="/tmp"))
        self.state.chmod(0o755)
        self.proxy_id = "n1/gpu0" if device == "cuda" else "n1/cpu0"

    def start_proxy(self, tag: str, generation: str) -> tuple[subprocess.Popen, Path]:
        sock = self.work / f"proxy-{tag}.sock"
        argv = [sys.executable, "-m", "singularity_slurm.proxy.daemon", "--job-id", str(self.job_id),
                "--uid", "0", "--id", self.proxy_id, "--socket", str(sock),
                "--backend", "cuda" if self.device == "cuda" else "host", "--time-slicing", "turns",
                "--rendezvous-dir", str(self.work / "rendezvous"), "--advertise", "127.0.0.1",
                "--state-dir", str(self.state)]
        if self.gpu_swap:
            argv += ["--gpu-swap", self.gpu_swap]
        with open(self.work / f"proxy-{tag}.log", "w") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                log = (self.work / f"proxy-{tag}.log").read_text()
                raise RuntimeError(f"proxy {tag} did not start: {log}")
            time.sleep(0.05)
        rpc.call(sock, {"op": "configure", "generation": generation,
                        "placement": {str(rank): self.proxy_id for rank in RANKS}}, timeout=30)
        return proc, sock

    def start_ranks(self, logs: Path, tag: str) -> dict[int, tuple[subprocess.Popen, int]]:
        base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        trees = {}
        for rank in RANKS:
            env = dict(base, SINGULARITY_PROXY="1", PYTHONPATH=str(HOOK),
                       SINGULARITY_JOB_ID=str(self.job_id), SINGULARITY_RANK_DIR=str(rank_dir(self.state)),
                       RANK=str(rank), WORLD_SIZE=str(len(RANKS)), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(len(RANKS)), MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
            if self.device == "cuda":
                env["CUDA_VISIBLE_DEVICES"] = "0"  # both ranks on one GPU, as Slurm gives a 1-GPU job
            trees[rank] = start_training(self.work / f"{tag}-out-{rank}.txt", "--steps", str(self.steps),
                                         "--sleep", "0.02", "--log-dir", str(logs), "--device", self.device,
                                         "--device-mb", str(self.device_mb), pidns=True, script=TRAIN_DDP,
                                         env=env)
        return trees

    def output(self, tag: str, rank: int) -> str:
        return (self.work / f"{tag}-out-{rank}.txt").read_text(errors="replace")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def undisturbed(setup: Setup) -> dict[int, str]:
    logs = setup.work / "reference"
    proxy, _ = setup.start_proxy("reference", "1")
    trees = setup.start_ranks(logs, "reference")
    try:
        for rank, (proc, _) in trees.items():
            code = proc.wait(600)  # unshare's: its namespace init's exit status
            if code != 0:
                raise RuntimeError(f"reference rank {rank} exited with {code}: "
                                   f"{setup.output('reference', rank)[-800:]}")
    finally:
        for proc, pid in trees.values():
            end_training(proc, pid)
        stop(proxy)
    return {rank: (logs / f"{rank}.log").read_text() for rank in RANKS}


def dump(setup: Setup, driver: cuda.Driver | None, criu: str, rank: int, pid: int) -> dict[str, object]:
    """One parked rank's tree: its CUDA state into its memory (a rank whose memory its proxy moved
    out already stays so), then criu dump (the tree ends)."""
    images = setup.work / f"images-{rank}"
    images.mkdir()
    tree = jobcgroup.tree(pid)
    tasks = cuda.gpu_tasks(tree)
    swapped = (cuda.checkpointed_tasks(driver, cuda.cuda_tasks([p for p in tree if p not in tasks]))
               if driver is not None else [])
    record: dict[str, object] = {"images": str(images), "tasks": sorted(cuda.inner_pids(tasks).values()),
                                 "swapped": sorted(cuda.inner_pids(swapped).values())}
    mounts = external_mounts(Path(f"/proc/{pid}/mountinfo").read_text(), GpuConfig.external_mounts)
    record["mounts"] = mounts
    started = time.perf_counter()
    if driver is not None:
        cuda.suspend(driver, tasks)
    code, text = sh([criu, "dump", "-t", str(pid), "-D", str(images), "-o", "dump.log", "-v4", "--file-locks",
                     *[f"--external={e}" for e in dump_externals(mounts)]], timeout=600)
    if code != 0:
        if driver is not None:
            cuda.resume(driver, tasks)
        raise RuntimeError(f"criu dump of rank {rank} failed: {text[-600:]}")
    wait_pid(pid, 60)
    record["dump_s"] = round(time.perf_counter() - started, 3)
    record["image_bytes"] = du(images)
    return record


def restore(driver: cuda.Driver | None, criu: str, rank: int, record: dict) -> int:
    """criu restores the tree; the driver brings back the CUDA state of its processes that were on
    the GPU at the dump (a rank whose memory was out waits for its proxy). Returns its init's pid."""
    images = Path(record["images"])
    mounts = record["mounts"]
    code, text = sh([criu, "restore", "-D", str(images), "-o", "restore.log", "-v4", "-d", "--file-locks",
                     "--root", "/", "--pidfile", str(images / "restored.pid"),
                     *[f"--external={e}" for e in restore_externals(mounts)]], timeout=600)
    if code != 0:
        raise RuntimeError(f"criu restore of rank {rank} failed: {text[-600:]}")
    restored = int((images / "restored.pid").read_text())
    if driver is not None:
        wanted = set(record["tasks"])
        back = [host for host, inner in cuda.inner_pids(jobcgroup.tree(restored)).items() if inner in wanted]
        cuda.resume(driver, back)
    return restored


def preempted(setup: Setup, criu: str, driver: cuda.Driver | None, cut_step: int) -> dict[str, object]:
    logs = setup.work / "preempted"
    result: dict[str, object] = {}
    proxy, sock = setup.start_proxy("first", "1")
    trees = setup.start_ranks(logs, "first")
    restored: dict[int, int] = {}
    second = None
    try:
        if not wait_for_line(logs / "0.log", f"{cut_step} ", timeout=300):
            raise RuntimeError(f"no step {cut_step}: {setup.output('first', 0)[-800:]}")
        started = time.perf_counter()
        rpc.call(sock, {"op": "quiesce", "timeout": 120}, timeout=150)
        result["cut_s"] = round(time.perf_counter() - started, 3)
        result["first_proxy"] = rpc.call(sock, {"op": "stats"}, timeout=30)
        records = {rank: dump(setup, driver, criu, rank, pid) for rank, (_, pid) in trees.items()}
        result["dumps"] = records
        stop(proxy)  # preempted: the job's proxy goes with its allocation
        started = time.perf_counter()
        second, sock = setup.start_proxy("second", "2")
        if driver is not None and any(r["swapped"] for r in records.values()):
            here = gpus.inventory([0])
            pairs = [[gpu.uuid, gpu.uuid] for gpu in here]  # the driver's remapping path, onto the same GPU
            for rank, record in records.items():
                if record["swapped"]:
                    rpc.call(sock, {"op": "gpu_pairs", "rank": rank, "pairs": pairs}, timeout=30)
            result["gpu_pairs"] = pairs
        for rank, record in records.items():
            restored[rank] = restore(driver, criu, rank, record)
        result["restore_s"] = round(time.perf_counter() - started, 3)
        result["exits"] = {rank: wait_pid(pid, 600) for rank, pid in restored.items()}
        result["second_proxy"] = rpc.call(sock, {"op": "stats"}, timeout=30)
    finally:
        for proc, pid in trees.values():
            end_training(proc, pid)
        for pid in restored.values():
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        stop(proxy)
        if second is not None:
            stop(second)
    result["logs"] = {rank: (logs / f"{rank}.log").read_text() for rank in RANKS}
    result["ballast"] = [line for line in setup.output("first", 0).splitlines() if line.startswith("ballast")]
    return result


def check(work: Path, criu: str, device: str, gpu_swap: str | None = None, device_mb: int = 0,
          steps: int = 60, cut_step: int = 20) -> dict[str, object]:
    """The whole check; the report's `identical` says whether both ranks' logs are the reference's."""
    work.mkdir(parents=True, exist_ok=True)
    setup = Setup(work, device, gpu_swap, device_mb, steps)
    driver = cuda.Driver() if device == "cuda" else None
    try:
        reference = undisturbed(setup)
        result = preempted(setup, criu, driver, cut_step)
    finally:
        subprocess.run(["rm", "-rf", str(setup.state)], check=False)
    logs = result.pop("logs")
    result["identical"] = {rank: logs[rank] == reference[rank] for rank in RANKS}
    result["reference_sha256"] = {rank: hashlib.sha256(reference[rank].encode()).hexdigest()
                                  for rank in RANKS}
    result["gpu_reduce"] = {tag: int(result[tag].get("allreduce", {}).get("gpu_reduce", 0))
                            for tag in ("first_proxy", "second_proxy")}
    result["steps"] = {rank: len(reference[rank].splitlines()) for rank in RANKS}
    result["swapped_at_cut"] = {rank: bool(r["swapped"]) for rank, r in result["dumps"].items()}
    result["ok"] = (all(result["identical"].values()) and all(result["steps"][r] == steps for r in RANKS)
                    and all(code == 0 for code in result["exits"].values())
                    and all("intact" in line for line in result["ballast"]))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--criu", default="/opt/singularity-slurm/bin/singularity-criu")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu-check-ddp"))
    parser.add_argument("--gpu-swap", choices=("auto", "always", "never"), default=None)
    parser.add_argument("--device-mb", type=int, default=0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--cut-step", type=int, default=20)
    args = parser.parse_args()
    subprocess.run(["rm", "-rf", str(args.work)], check=False)
    import ctypes

    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: restored trees come back here
    result = check(args.work, args.criu, args.device, args.gpu_swap, args.device_mb, args.steps,
                   args.cut_step)
    print(json.dumps(result, indent=2, default=str))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
