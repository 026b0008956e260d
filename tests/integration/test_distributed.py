"""Distributed jobs (issue: device proxy and transparent collective interception), on the dev cluster.

Unmodified torch.distributed scripts run as `singularityctl run --world-size N` with real Slurm,
CRIU, Redis and PyTorch. Every rank's log must be byte-identical to an undisturbed run: the reference
run goes through the same proxy code (in this process, no Slurm, no checkpoint), since the proxies'
fixed reduction order is what makes the numbers independent of placement and of interruptions.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import CTL

from singularity_slurm import interpose
from singularity_slurm.devcluster.cluster import SPARE_REASON
from singularity_slurm.proxy.daemon import Proxy
from singularity_slurm.proxy.hal import HostBackend
from singularity_slurm.proxy.rendezvous import MemoryRendezvous

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).parents[2] / "examples"
PYTHON = str(Path(CTL).with_name("python"))
HOOK = str(interpose.HOOK_DIR)

URGENT = """#!/bin/bash
#SBATCH --singularity-sla=premium
#SBATCH --gres=gpu:4
#SBATCH -o urgent-%j.out
sleep 2
"""


def reference_logs(tmp: Path, script: str, args: list[str], world: int, per_proxy: int) -> dict[int, str]:
    """Every rank's log of an undisturbed run through in-process proxies."""
    job = random.randint(10**8, 10**9)
    rendezvous = MemoryRendezvous()
    placement = {r: f"ref/{r // per_proxy}" for r in range(world)}
    state = Path(tempfile.mkdtemp(prefix="singularity-state-", dir="/tmp"))
    proxies = [Proxy(job, os.getuid(), proxy, HostBackend(), lambda: rendezvous, state_dir=state)
               for proxy in sorted(set(placement.values()))]
    for proxy in proxies:
        proxy.configure("1", placement)
    log_dir = tmp / "reference"
    procs = []
    for rank in range(world):
        env = dict(os.environ, SINGULARITY_PROXY="1", PYTHONPATH=HOOK, SINGULARITY_JOB_ID=str(job),
                   SINGULARITY_RANK_DIR=str(state / "ranks"),
                   RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT="1")
        procs.append(subprocess.Popen([PYTHON, str(EXAMPLES / script), *args, "--log-dir", str(log_dir)],
                                      env=env))
    try:
        assert [p.wait(timeout=300) for p in procs] == [0] * world
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proxy in proxies:
            proxy.stopping = True
        for proxy in proxies:
            proxy.close()
        shutil.rmtree(state, ignore_errors=True)
    return {rank: (log_dir / f"{rank}.log").read_text() for rank in range(world)}


def copy_example(jobs, name: str) -> None:
    shutil.copy(EXAMPLES / name, jobs.workdir)
    shutil.chown(jobs.workdir / name, jobs.user)


def job_script(sla: str, directives: str, world: int, command: str, options: str = "",
               runner: str | None = None) -> str:
    """`runner`: what starts the ranks instead of `--world-size N -- python` (torchrun, say)."""
    runner = runner or f"--world-size {world} {options} -- {PYTHON}"
    return (f"#!/bin/bash\n#SBATCH --singularity-sla={sla}\n{directives}\n#SBATCH -o job.out\n"
            f"{CTL} run {runner} {command} --log-dir logs\n")


def logged_steps(jobs, world: int) -> int:
    counts = []
    for rank in range(world):
        path = jobs.workdir / "logs" / f"{rank}.log"
        counts.append(len(path.read_text().splitlines()) if path.exists() else 0)
    return min(counts)


def wait_for_steps(jobs, job_id: int, world: int, steps: int, timeout: float = 180) -> None:
    jobs.wait(job_id, lambda r: logged_steps(jobs, world) >= steps, f"{steps} steps on every rank",
              timeout=timeout)


def wait_for_text(jobs, job_id: int, text: str, count: int = 1, timeout: float = 240) -> None:
    out = jobs.workdir / "job.out"
    jobs.wait(job_id, lambda r: out.exists() and out.read_text().count(text) >= count,
              f"{text!r} x{count} in job.out", timeout=timeout)


def worker_pids(pattern: str) -> list[int]:
    proc = subprocess.run(["pgrep", "-u", "jobuser", "-f", pattern], capture_output=True, text=True)
    return [int(p) for p in proc.stdout.split()]


def tcp_inodes() -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            inodes.add(line.split()[9])
    return inodes


def socket_inodes(pid: int) -> set[str]:
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(target[8:-1])
    return found


def preempt(jobs, node: str) -> int:
    return jobs.submit(jobs.script(f"urgent-{node}.sh", URGENT), f"--nodelist={node}")


def resume_spare(slurm, node: str, on: bool) -> None:
    state = ["State=RESUME"] if on else ["State=DRAIN", f"Reason={SPARE_REASON}"]
    subprocess.run(["scontrol", "update", f"NodeName={node}", *state], check=True, timeout=30)


DDP_STEPS = 60
DDP_ARGS = ["--steps", str(DDP_STEPS), "--hidden", "64"]


def test_ddp_on_two_nodes_survives_two_preemptions_and_a_migration_byte_identical(jobs, slurm, tmp_path):
    reference = reference_logs(tmp_path, "train_ddp.py", DDP_ARGS, world=4, per_proxy=2)
    copy_example(jobs, "train_ddp.py")
    job_id = jobs.submit(jobs.script("ddp.sh", job_script(
        "basic", "#SBATCH --nodes=2 --gres=gpu:2", 4,
        f"train_ddp.py {' '.join(DDP_ARGS)} --sleep 0.25")))
    wait_for_steps(jobs, job_id, 4, 8)

    # While training, the ranks hold no TCP socket: only their unix socket to the local proxy.
    pids = worker_pids(f"^{PYTHON} train_ddp.py")
    assert len(pids) == 4
    tcp = tcp_inodes()
    assert all(not (socket_inodes(pid) & tcp) for pid in pids)
    assert all(len(socket_inodes(pid)) <= 1 for pid in pids)

    jobs.wait_state(preempt(jobs, "n1"), "COMPLETED", timeout=240)
    wait_for_text(jobs, job_id, "restored distributed checkpoint", 1)
    wait_for_steps(jobs, job_id, 4, logged_steps(jobs, 4) + 5)

    jobs.wait_state(preempt(jobs, "n2"), "COMPLETED", timeout=240)
    wait_for_text(jobs, job_id, "restored distributed checkpoint", 2)
    wait_for_steps(jobs, job_id, 4, logged_steps(jobs, 4) + 5)

    resume_spare(slurm, "n3", True)
    try:
        proc = subprocess.run(["runuser", "-u", jobs.user, "--", CTL, "migrate", str(job_id),
                               "--exclude", "n1"], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        wait_for_text(jobs, job_id, "restored distributed checkpoint", 3)
        record = jobs.wait_state(job_id, "COMPLETED", timeout=300)
    finally:
        resume_spare(slurm, "n3", False)
    assert "n1" not in record.get("NodeList", "")

    text = (jobs.workdir / "job.out").read_text()
    assert text.count("preemption warning") == 2
    assert "migration requested (away from n1)" in text
    assert "distributed cut in" in text
    for rank in range(4):
        assert (jobs.workdir / "logs" / f"{rank}.log").read_text() == reference[rank], f"rank {rank}"


def resize(user: str, job_id: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", user, "--", CTL, "resize", str(job_id), *args],
                          capture_output=True, text=True, timeout=300)


def test_ddp_resized_to_one_node_then_one_device_and_back_to_two_nodes_is_byte_identical(
        jobs, other_user, tmp_path, registry):
    """The world size stays 4 while the job runs on 2 nodes x 2 devices, 1 x 2, 1 x 1 (4 ranks sharing
    one device) and 2 x 2 again; sizes it cannot take, and other users, are refused first."""
    reference = reference_logs(tmp_path, "train_ddp.py", DDP_ARGS, world=4, per_proxy=1)
    copy_example(jobs, "train_ddp.py")
    job_id = jobs.submit(jobs.script("elastic.sh", job_script(
        "basic", "#SBATCH --nodes=2 --gres=gpu:2", 4, f"train_ddp.py {' '.join(DDP_ARGS)} --sleep 0.25")))
    wait_for_steps(jobs, job_id, 4, 6)

    before = jobs.record(job_id)
    refusals = [
        (jobs.user, ["--nodes", "5"], "world size 4 cannot run on 5 nodes: every node runs at least one "
                                      "rank; ask for at most 4 nodes"),
        (other_user.pw_name, ["--nodes", "1"], f"job {job_id} belongs to {jobs.user}: you can only resize "
                                            "your own jobs"),
        (jobs.user, ["--nodes", "2-1"], "'2-1': counts start at 1, and MIN <= MAX"),
    ]
    for user, args, error in refusals:
        proc = resize(user, job_id, *args)
        assert proc.returncode != 0 and error in proc.stderr, (args, proc.stderr)
    after = jobs.record(job_id)
    assert (after["JobState"], after["Restarts"], after["NodeList"]) == ("RUNNING", before["Restarts"],
                                                                         before["NodeList"])
    assert "resize to" not in (jobs.workdir / "job.out").read_text()

    sizes = [(["--nodes", "1"], "4 ranks on 2 devices of 1 node (2 per device), was 4 ranks on 4 devices "
                                "of 2 nodes"),
             (["--gpus-per-node", "1"], "4 ranks on 1 device of 1 node (4 per device), was 4 ranks on 2 "
                                        "devices of 1 node (2 per device)"),
             (["--nodes", "2", "--gpus-per-node", "2"], "4 ranks on 4 devices of 2 nodes, was 4 ranks on 1 "
                                                        "device of 1 node (4 per device)")]
    for count, (args, size) in enumerate(sizes, start=1):
        proc = resize(jobs.user, job_id, *args)
        assert proc.returncode == 0, proc.stderr
        wait_for_text(jobs, job_id, "restored distributed checkpoint", count)
        restored = [line for line in (jobs.workdir / "job.out").read_text().splitlines()
                    if "restored distributed checkpoint" in line]
        assert restored[-1].endswith(size), restored[-1]
        wait_for_steps(jobs, job_id, 4, logged_steps(jobs, 4) + 3)
    record = jobs.wait_state(job_id, "COMPLETED", timeout=300)

    assert (record["NumNodes"], record["TresPerNode"]) == ("2", "gres:gpu:2")
    text = (jobs.workdir / "job.out").read_text()
    assert text.count("requested: checkpointing") == 3
    status = subprocess.run([CTL, "status", str(job_id)], capture_output=True, text=True, timeout=60)
    assert "started: 4 ranks on 4 devices of 2 nodes" in status.stdout, status.stdout
    for _, size in sizes:
        assert f"restored after resize: {size}" in status.stdout, status.stdout
    for rank in range(4):
        assert (jobs.workdir / "logs" / f"{rank}.log").read_text() == reference[rank], f"rank {rank}"
    # (devices, devices whose ranks took turns) of each node at each start and restore: the dev
    # cluster's CPU slots run a device's ranks side by side (proxy.time_slicing = auto)
    runs = [(e["devices"], e["turns"]) for e in registry.job(job_id)["events"] if e["event"] == "running"]
    assert sorted(runs) == sorted([(2, 0), (2, 0), (2, 0), (1, 0), (2, 0), (2, 0)]), runs


def test_a_job_that_allows_one_to_two_nodes_restarts_on_the_node_left_at_full_world_size(jobs, tmp_path):
    """Preempted on 2 nodes while only one stays free, it does not wait for the second: Slurm starts
    it on the one, and its 4 ranks restore there, 2 per device."""
    reference = reference_logs(tmp_path, "train_ddp.py", DDP_ARGS, world=4, per_proxy=1)
    copy_example(jobs, "train_ddp.py")
    job_id = jobs.submit(jobs.script("range.sh", job_script(
        "basic", "#SBATCH --nodes=1-2 --gres=gpu:2", 4, f"train_ddp.py {' '.join(DDP_ARGS)} --sleep 0.25")))
    jobs.wait_state(job_id, "RUNNING")
    wait_for_steps(jobs, job_id, 4, 6)
    assert jobs.record(job_id)["NodeList"] == "n[1-2]"

    long_urgent = URGENT.replace("sleep 2", "sleep 20")  # n2 stays taken while the job restarts
    urgent = jobs.submit(jobs.script("urgent-long.sh", long_urgent), "--nodelist=n2")
    wait_for_text(jobs, job_id, "restored distributed checkpoint", 1)
    restored = next(line for line in (jobs.workdir / "job.out").read_text().splitlines()
                    if "restored distributed checkpoint" in line)
    assert restored.endswith("4 ranks on 2 devices of 1 node (2 per device), was 4 ranks on 4 devices of "
                             "2 nodes"), restored
    assert jobs.record(job_id)["NodeList"] == "n1"
    jobs.wait_state(urgent, "COMPLETED", timeout=240)
    jobs.wait_state(job_id, "COMPLETED", timeout=300)
    for rank in range(4):
        assert (jobs.workdir / "logs" / f"{rank}.log").read_text() == reference[rank], f"rank {rank}"


def stored_by_rank(job_id: int) -> dict[int, tuple[int, int]]:
    """Rank -> (logical, stored) bytes of the job's first generation, read from the store as root."""
    from singularity_slurm.checkpoint.store import CheckpointStore
    from singularity_slurm.config import load

    manifests = CheckpointStore(load().paths.store_root).list(job_id)
    first = min(m.meta["generation"] for m in manifests if m.meta.get("generation"))
    return {m.meta["rank"]: (m.logical_bytes, m.new_bytes) for m in manifests
            if m.meta.get("generation") == first}


def test_torchrun_with_a_slow_rank_zero_still_reaches_a_consistent_cut(jobs, tmp_path):
    """Also reports what each of the 4 DDP replicas (16 MiB of parameters each, as much momentum)
    stored in the folder the ranks share, against rank 0's."""
    args = ["--steps", "40", "--slow-rank", "0", "--slow-sleep", "0.4", "--hidden", "2048"]
    reference = reference_logs(tmp_path, "train_ddp.py", args, world=4, per_proxy=4)
    copy_example(jobs, "train_ddp.py")
    torchrun = Path(CTL).with_name("torchrun")
    job_id = jobs.submit(jobs.script("slow.sh", job_script(
        "basic", "#SBATCH --gres=gpu:4", 4, f"train_ddp.py {' '.join(args)}",
        runner=f"-- {torchrun} --nproc-per-node=4 --standalone")))
    wait_for_steps(jobs, job_id, 4, 10)
    node = jobs.record(job_id)["NodeList"]
    jobs.wait_state(preempt(jobs, node), "COMPLETED", timeout=240)
    wait_for_text(jobs, job_id, "restored distributed checkpoint")
    stored = stored_by_rank(job_id)  # before the job ends and its store folder goes
    print("stored bytes per rank (logical, new):", stored)
    ratios = [round(stored[r][1] / stored[0][1], 3) for r in (1, 2, 3)]
    print("new bytes of ranks 1-3 against rank 0's:", ratios)
    # Each replica's parameters and momentum (hidden 2048: 4231169 floats each) are stored once:
    # the ranks stored after the first one save at least 90% of them.
    replicated = 2 * 4 * (16 * 2048 + 2048 + 2048 * 2048 + 2048 + 2048 + 1)
    first = max(new for _, new in stored.values())
    saved = sorted(first - new for _, new in stored.values())[1:]
    print(f"bytes saved by the ranks after the first: {saved} ({replicated} replicated)")
    assert all(s >= 0.9 * replicated for s in saved), (saved, replicated)
    jobs.wait_state(job_id, "COMPLETED", timeout=240)
    text = (jobs.workdir / "job.out").read_text()
    assert "distributed cut in" in text
    assert f"torchrun runs as: singularityctl run --world-size 4 -- {PYTHON} train_ddp.py" in text
    for rank in range(4):
        assert (jobs.workdir / "logs" / f"{rank}.log").read_text() == reference[rank], f"rank {rank}"


def test_two_stage_pipeline_under_python_m_torch_distributed_run_survives_checkpoint_and_restore(
        jobs, tmp_path):
    args = ["--steps", "50"]
    reference = reference_logs(tmp_path, "train_pipeline.py", args, world=2, per_proxy=1)
    copy_example(jobs, "train_pipeline.py")
    job_id = jobs.submit(jobs.script("pipe.sh", job_script(
        "basic", "#SBATCH --nodes=2 --gres=gpu:1", 2, f"train_pipeline.py {' '.join(args)} --sleep 0.3",
        runner=f"-- {PYTHON} -m torch.distributed.run --nnodes=2 --nproc-per-node=1")))
    wait_for_steps(jobs, job_id, 2, 8)
    jobs.wait_state(preempt(jobs, "n2"), "COMPLETED", timeout=240)
    wait_for_text(jobs, job_id, "restored distributed checkpoint")
    jobs.wait_state(job_id, "COMPLETED", timeout=240)
    for rank in range(2):
        assert (jobs.workdir / "logs" / f"{rank}.log").read_text() == reference[rank], f"rank {rank}"


COLLECTIVES_JOB = """#!/bin/bash
#SBATCH --singularity-sla=basic
#SBATCH --gres=gpu:{world}
#SBATCH -o job{world}.out
{ctl} run --world-size {world} -- {python} train_ddp_collectives.py {args} --sleep 0.3 --log-dir logs{world}
"""


def test_every_collective_from_the_users_own_venv_with_2_and_4_ranks_survives_preemption(jobs, tmp_path):
    """DDP plus async all_to_all_single, gather, scatter and all_gather_object each step, run by a
    Python that has torch and numpy and nothing of Singularity's (the 4 ranks), and by Singularity's
    venv (the 2 ranks); both jobs are preempted and restored."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
    from proxyjob import make_user_venv

    args = ["--steps", "40"]
    user_python = make_user_venv(jobs.workdir / "venv")
    copy_example(jobs, "train_ddp_collectives.py")
    pythons = {4: user_python, 2: PYTHON}
    references = {}
    for world in (4, 2):
        (tmp_path / str(world)).mkdir()
        references[world] = reference_logs(tmp_path / str(world), "train_ddp_collectives.py", args,
                                           world=world, per_proxy=1)

    def steps(world: int) -> int:
        paths = [jobs.workdir / f"logs{world}" / f"{rank}.log" for rank in range(world)]
        return min(len(p.read_text().splitlines()) if p.exists() else 0 for p in paths)

    ids = {}
    for world in (4, 2):  # one after the other: a job is preempted while the other has not begun
        job_id = ids[world] = jobs.submit(jobs.script(f"collectives{world}.sh", COLLECTIVES_JOB.format(
            world=world, ctl=CTL, python=pythons[world], args=" ".join(args))))
        jobs.wait(job_id, lambda r, w=world: steps(w) >= 5, f"5 steps of {world} ranks", timeout=240)
        jobs.wait_state(preempt(jobs, jobs.record(job_id)["NodeList"]), "COMPLETED", timeout=240)
        out = jobs.workdir / f"job{world}.out"
        jobs.wait(job_id, lambda r, o=out: "restored distributed checkpoint" in o.read_text(), "restored",
                  timeout=240)
    for world in (4, 2):
        jobs.wait_state(ids[world], "COMPLETED", timeout=300)
        text = (jobs.workdir / f"job{world}.out").read_text()
        assert "distributed cut in" in text
        for rank in range(world):
            log = (jobs.workdir / f"logs{world}" / f"{rank}.log").read_text()
            assert log == references[world][rank], f"{world} ranks, rank {rank}"
