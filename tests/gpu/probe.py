"""What a GPU machine can do for Singularity: CRIU, the CUDA driver's checkpoint API, NCCL, NVML.

Run as root on a GPU machine, with criu installed where the project installs it:

    python3 tests/gpu/probe.py --criu /opt/singularity-slurm/bin/singularity-criu --out DIR

It prints one `PROBE <item>: <result>` line per finding and writes DIR/probe.json. Items:

- facts: kernel, driver, GPU, torch/CUDA/NCCL versions, cuda-bindings and NVML versions
- criu-check: `criu check` and `criu check --all`
- inventory: the GPUs through NVML (UUID, name, memory, health)
- plain-dump: CRIU on a running CUDA process without the driver's checkpoint (expected to fail; the
  error is what a site sees without GPU support)
- cycle: examples/train_cuda.py checkpointed and restored twice (driver lock + checkpoint, criu dump,
  criu restore, driver restore + unlock), its log compared with an undisturbed run's
- cycle-pidns: one such cycle of the script as a PID namespace's init (the pid changes at restore)
- nccl-shared-gpu: two NCCL ranks on one GPU (does NCCL refuse duplicate GPUs?)
- sizes: one such cycle with N MiB of GPU ballast, each step timed

No part of the project is imported: the machine has its own Python and PyTorch.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN = HERE.parent.parent / "examples" / "train_cuda.py"
RESULTS: dict[str, object] = {}


def report(item: str, result: object) -> None:
    RESULTS[item] = result
    text = result if isinstance(result, str) else json.dumps(result, sort_keys=True)
    print(f"PROBE {item}: {text}", flush=True)


def sh(argv: list[str], timeout: float = 60) -> tuple[int, str]:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return -1, str(exc)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


class Driver:
    """The CUDA driver's process checkpoint API through ctypes (the cuda-bindings names are checked
    separately): each call takes the target's pid and optional arguments (NULL here)."""

    STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self._check(self.lib.cuInit(0), "cuInit")
        version = ctypes.c_int()
        self._check(self.lib.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
        self.version = version.value
        self.has_api = all(hasattr(self.lib, name) for name in (
            "cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
            "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock", "cuCheckpointProcessGetState"))

    def _check(self, code: int, what: str) -> None:
        if code:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(code, ctypes.byref(name))
            raise RuntimeError(f"{what}: {name.value.decode() if name.value else code}")

    def act(self, action: str, pid: int) -> float:
        start = time.perf_counter()
        self._check(getattr(self.lib, f"cuCheckpointProcess{action}")(ctypes.c_int(pid), None),
                    f"cuCheckpointProcess{action}({pid})")
        return time.perf_counter() - start

    def state(self, pid: int) -> str:
        state = ctypes.c_int()
        self._check(self.lib.cuCheckpointProcessGetState(ctypes.c_int(pid), ctypes.byref(state)),
                    f"cuCheckpointProcessGetState({pid})")
        return self.STATES.get(state.value, str(state.value))


def facts() -> None:
    found: dict[str, object] = {"kernel": platform.release(), "python": platform.python_version()}
    code, text = sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,uuid",
                     "--format=csv,noheader"])
    found["nvidia-smi"] = text if code == 0 else f"failed: {text}"
    try:
        import torch

        found["torch"] = torch.__version__
        found["torch_cuda"] = torch.version.cuda
        found["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
        found["nccl_available"] = torch.distributed.is_nccl_available()
    except Exception as exc:  # a probe reports, it does not stop
        found["torch"] = f"not importable: {exc}"
    for package in ("cuda-bindings", "cuda-python", "nvidia-ml-py", "pynvml"):
        try:
            from importlib.metadata import version

            found[package] = version(package)
        except Exception:
            found[package] = None
    try:
        from cuda.bindings import driver

        found["cuda_bindings_checkpoint_api"] = [name for name in dir(driver)
                                                 if name.startswith("cuCheckpointProcess")]
    except Exception as exc:
        found["cuda_bindings_checkpoint_api"] = f"not importable: {exc}"
    with open("/proc/self/status") as status:
        found["caps"] = [line.split()[1] for line in status if line.startswith("CapEff")]
    found["devices"] = sorted(p.name for p in Path("/dev").glob("nvidia*"))
    found["ptrace_scope"] = Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip() \
        if Path("/proc/sys/kernel/yama/ptrace_scope").exists() else None
    report("facts", found)


def criu_check(criu: str) -> None:
    code, text = sh([criu, "--version"])
    version = text.splitlines()[0] if text else ""
    code1, text1 = sh([criu, "check"])
    code2, text2 = sh([criu, "check", "--all"])
    report("criu-check", {"version": version, "check_rc": code1, "check": text1[-1500:],
                          "check_all_rc": code2, "check_all": text2[-2500:]})


def inventory() -> None:
    try:
        import pynvml

        pynvml.nvmlInit()
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            gpu: dict[str, object] = {
                "index": index,
                "uuid": pynvml.nvmlDeviceGetUUID(handle),
                "name": pynvml.nvmlDeviceGetName(handle),
                "memory_mib": pynvml.nvmlDeviceGetMemoryInfo(handle).total >> 20,
                "pci": pynvml.nvmlDeviceGetPciInfo(handle).busId,
            }
            for key, call in (
                ("ecc_uncorrected_volatile", lambda h: pynvml.nvmlDeviceGetTotalEccErrors(
                    h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)),
                ("remapped_rows", pynvml.nvmlDeviceGetRemappedRows),
                ("throttle_reasons", pynvml.nvmlDeviceGetCurrentClocksEventReasons),
                ("persistence", pynvml.nvmlDeviceGetPersistenceMode),
                ("compute_mode", pynvml.nvmlDeviceGetComputeMode),
                ("mig", pynvml.nvmlDeviceGetMigMode),
            ):
                try:
                    value = call(handle)
                    gpu[key] = list(value) if isinstance(value, tuple) else value
                except Exception as exc:
                    gpu[key] = f"error: {exc}"
            gpus.append(gpu)
        report("inventory", {"driver": pynvml.nvmlSystemGetDriverVersion(), "gpus": gpus})
    except Exception as exc:
        report("inventory", f"failed: {exc}")


def start_training(log: Path, *args: str, pidns: bool = False, script: Path = TRAIN,
                   env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    """The training script (`script`, default train_cuda.py) in a session of its own; with `pidns`,
    as the init of a new PID namespace (the project's layout: the node agent acts on a tree in its own
    namespace by its host pid). `env`: its environment (default this one's). Returns the child and
    the pid to act on (the namespace's init, under `unshare`)."""
    argv = [sys.executable, str(script), *args]
    if pidns:
        # The project's layout (node/jobtree.py): a PID and mount namespace with its own /proc and
        # /dev/shm, whose init leads its own session and opens the log itself, so that unshare's
        # own complaints (it reports its child's SIGKILL at a dump) stay out of it.
        argv = ["unshare", "--pid", "--fork", "--mount", "--mount-proc", "--propagation", "private",
                "setsid", "sh", "-c",
                'mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm && '
                'exec "$0" "$@" </dev/null >"$LOG" 2>&1',
                *argv]
        log.write_text("")
    with open(log if not pidns else os.devnull, "w") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env=dict(env or os.environ, LOG=str(log)))
    if not pidns:
        return proc, proc.pid
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = children.read_text().split() if children.exists() else []
        if found:
            return proc, int(found[0])
        time.sleep(0.01)
    raise RuntimeError("unshare started no namespace init")


def end_training(proc: subprocess.Popen, pid: int) -> None:
    """Kill the training run's process groups: the one it was started in and its (restored) init's."""
    for target in (pid, proc.pid):
        try:
            os.killpg(target, 9)
        except (ProcessLookupError, PermissionError):
            pass
    proc.poll()


def wait_for_line(log: Path, prefix: str, timeout: float = 120) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and any(line.startswith(prefix) for line in log.read_text().splitlines()):
            return True
        time.sleep(0.05)
    return False


def wait_pid(pid: int, timeout: float = 300) -> int | None:
    """Exit status of a child (or of an orphan of a criu restore: this process is a subreaper); for
    a process that is neither, None once it is gone."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            if not Path(f"/proc/{pid}").exists():
                return None
        else:
            if done:
                return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    return None


def criu_errors(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    errors = [line for line in lines if "Error" in line or "rror (" in line]
    return "\n".join((errors or lines)[-15:])


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def external_mounts() -> list[tuple[str, str]]:
    """Mounts criu cannot dump inside a mount namespace that it should bind back from the host at
    restore instead: on GPU machines the driver's folder is often a read-only mount of a file system
    criu does not know (here /usr/local/nvidia: "FS mnt ... unsupported"). (mount point, fstype)."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        point, fstype = fields[4], fields[fields.index("-") + 1]
        if point.startswith("/usr/local/nvidia"):
            found.append((point, fstype))
    return found


def cycle(driver: Driver, criu: str, pid: int, images: Path, pidns: bool = False) -> dict[str, object]:
    """Driver lock + checkpoint, criu dump (the tree ends), criu restore, driver restore + unlock.
    The restored tree's pid (another one where it is a PID namespace's init) is in `pid`."""
    times: dict[str, object] = {}
    images.mkdir(parents=True)
    times["lock_s"] = driver.act("Lock", pid)
    times["checkpoint_s"] = driver.act("Checkpoint", pid)
    times["state_after_checkpoint"] = driver.state(pid)
    times["fds_after_checkpoint"] = sorted({os.readlink(f"/proc/{pid}/fd/{fd}")
                                            for fd in os.listdir(f"/proc/{pid}/fd")
                                            if "nvidia" in os.readlink(f"/proc/{pid}/fd/{fd}")})
    times["nvidia_maps_after_checkpoint"] = sum("nvidia" in line
                                                for line in open(f"/proc/{pid}/maps"))
    dump_ext: list[str] = []
    restore_ext: list[str] = []
    if pidns:
        mounts = external_mounts()
        times["external_mounts"] = mounts
        for index, (point, _) in enumerate(mounts):
            dump_ext += ["--external", f"mnt[{point}]:ext{index}"]
            restore_ext += ["--external", f"mnt[ext{index}]:{point}"]
    start = time.perf_counter()
    code, text = sh([criu, "dump", "-t", str(pid), "-D", str(images), "-o", "dump.log", "-v4",
                     "--file-locks", *dump_ext], timeout=600)
    times["criu_dump_s"] = time.perf_counter() - start
    if code != 0:
        times["criu_dump_error"] = criu_errors(images / "dump.log") or text
        return times
    times["exit_after_dump"] = wait_pid(pid, 30)
    times["image_bytes"] = du(images)
    start = time.perf_counter()
    code, text = sh([criu, "restore", "-D", str(images), "-o", "restore.log", "-v4", "-d",
                     "--file-locks", "--root", "/", "--pidfile", str(images / "restored.pid"),
                     *restore_ext],
                    timeout=600)
    times["criu_restore_s"] = time.perf_counter() - start
    if code != 0:
        times["criu_restore_error"] = criu_errors(images / "restore.log") or text
        return times
    pid = int((images / "restored.pid").read_text())
    times["pid"] = pid
    times["state_after_criu_restore"] = driver.state(pid)
    times["driver_restore_s"] = driver.act("Restore", pid)
    times["unlock_s"] = driver.act("Unlock", pid)
    times["state_after_unlock"] = driver.state(pid)
    return times


def plain_dump(criu: str, work: Path) -> None:
    log = work / "plain.log"
    proc, _ = start_training(log, "--steps", "100000", "--sleep", "0.01")
    try:
        if not wait_for_line(log, "step 3 "):
            report("plain-dump", f"training did not start: {log.read_text()[-500:]}")
            return
        images = work / "plain"
        images.mkdir()
        code, text = sh([criu, "dump", "-t", str(proc.pid), "-D", str(images), "-o", "dump.log",
                         "-v4", "--leave-running"], timeout=120)
        report("plain-dump", {"rc": code, "errors": criu_errors(images / "dump.log")})
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def cycles(driver: Driver, criu: str, work: Path, steps: int, cut_steps: list[int],
           extra: list[str], name: str, pidns: bool = False) -> dict[str, object]:
    log = work / f"{name}.log"
    proc, pid = start_training(log, "--steps", str(steps), *extra, pidns=pidns)
    result: dict[str, object] = {"cycles": []}
    try:
        for index, cut in enumerate(cut_steps):
            if not wait_for_line(log, f"step {cut} "):
                result["error"] = f"no step {cut}: {log.read_text()[-800:]}"
                return result
            try:
                times = cycle(driver, criu, pid, work / f"{name}-{index}", pidns)
            except Exception as exc:
                result["cycles"].append(f"failed: {exc}")
                return result
            result["cycles"].append(times)
            if "criu_dump_error" in times or "criu_restore_error" in times:
                return result
            pid = int(times["pid"])
            proc.poll()
        result["exit"] = wait_pid(pid, 600)
    finally:
        end_training(proc, pid)
    result["log_lines"] = len(log.read_text().splitlines())
    return result


def nccl_shared_gpu(work: Path) -> None:
    script = work / "nccl2.py"
    script.write_text(
        "import os, sys, torch, torch.distributed as dist\n"
        "rank = int(sys.argv[1])\n"
        "torch.cuda.set_device(0)\n"
        "dist.init_process_group('nccl', init_method='tcp://127.0.0.1:29531', rank=rank, world_size=2)\n"
        "t = torch.full((4,), float(rank + 1), device='cuda')\n"
        "try:\n"
        "    dist.all_reduce(t); torch.cuda.synchronize(); print('allreduce', t.tolist(), flush=True)\n"
        "except Exception as exc:\n"
        "    print('error', type(exc).__name__, str(exc)[:400], flush=True)\n"
        "dist.destroy_process_group()\n")
    env = dict(os.environ, NCCL_DEBUG="WARN")
    procs = [subprocess.Popen([sys.executable, str(script), str(rank)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for rank in range(2)]
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            out = "TIMEOUT " + out
        outputs.append(out[-800:])
    report("nccl-shared-gpu", {"rc": [p.returncode for p in procs], "output": outputs})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--criu", default="/opt/singularity-slurm/bin/singularity-criu")
    parser.add_argument("--out", type=Path, default=Path("/tmp/gpu-probe"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu-probe-work"))
    parser.add_argument("--sizes", default="1024,8192", help="GPU ballast MiB for the sizes item")
    parser.add_argument("--items", default="all",
                        help="comma-separated items after facts and driver (default all): "
                             "criu-check,inventory,plain-dump,cycle,cycle-pidns,nccl-shared-gpu,sizes")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: restored trees come back here
    try:
        wanted = set(args.items.split(",")) if args.items != "all" else None

        def want(item: str) -> bool:
            return wanted is None or item in wanted

        facts()
        if want("criu-check"):
            criu_check(args.criu)
        if want("inventory"):
            inventory()
        try:
            driver = Driver()
        except Exception as exc:
            report("driver", f"no CUDA driver: {exc}")
            return 0
        report("driver", {"version": driver.version, "checkpoint_api": driver.has_api})
        if not driver.has_api:
            return 0
        started = time.perf_counter()
        ref = args.work / "reference.log"
        proc, _ = start_training(ref)
        code = proc.wait(300)
        report("reference", {"rc": code, "lines": len(ref.read_text().splitlines()),
                             "seconds": round(time.perf_counter() - started, 2),
                             "tail": ref.read_text().splitlines()[-2:]})
        if want("plain-dump"):
            plain_dump(args.criu, args.work)
        if want("cycle"):
            result = cycles(driver, args.criu, args.work, 400, [100, 250], [], "twice")
            result["identical"] = (args.work / "twice.log").read_bytes() == ref.read_bytes()
            report("cycle", result)
        if want("cycle-pidns"):
            result = cycles(driver, args.criu, args.work, 400, [100, 250], [], "pidns", pidns=True)
            result["identical"] = (args.work / "pidns.log").read_bytes() == ref.read_bytes()
            report("cycle-pidns", result)
        if want("nccl-shared-gpu"):
            nccl_shared_gpu(args.work)
        for mib in [int(x) for x in args.sizes.split(",") if x and want("sizes")]:
            sized = cycles(driver, args.criu, args.work, 60, [20], ["--device-mb", str(mib)],
                           f"ballast{mib}")
            lines = (args.work / f"ballast{mib}.log").read_text().splitlines()
            sized["ballast_line"] = [line for line in lines if line.startswith("ballast")]
            sized["steps_identical"] = [line for line in lines if line.startswith("step")] == \
                ref.read_text().splitlines()[:60]
            report(f"sizes-{mib}", sized)
    finally:
        (args.out / "probe.json").write_text(json.dumps(RESULTS, indent=2, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
