"""Transparent checkpoint and restore of an unmodified training job on the real cluster.

The reference workload (examples/train_reference.py: PyTorch, DataLoader worker processes, no
checkpoint code) runs under `singularityctl run`. Its log, with the launcher's own "[singularity]"
lines and Slurm's notices removed, must be byte-identical to an undisturbed run's, however often the
job was preempted, migrated or restored.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import CTL, run_as

from singularity_slurm import nodelog
from singularity_slurm.checkpoint.store import CheckpointStore

EXAMPLE = Path(__file__).parents[2] / "examples" / "train_reference.py"
PYTHON = str(Path(CTL).with_name("python"))
STEPS = 300

TRAIN = f"""#!/bin/bash
#SBATCH --singularity-sla=basic
#SBATCH --gres=gpu:4
#SBATCH -o train.out
{CTL} run {{options}} -- {PYTHON} train_reference.py --steps {STEPS} --sleep {{sleep}}
"""

URGENT = """#!/bin/bash
#SBATCH --singularity-sla=premium
#SBATCH --gres=gpu:4
#SBATCH -o urgent-%j.out
sleep 3
"""


def training_log(text: str) -> str:
    """The job's own output: the launcher's lines and Slurm's notices removed."""
    return "".join(line for line in text.splitlines(keepends=True)
                   if not line.startswith(("[singularity]", "slurmstepd", "srun:")))


@pytest.fixture(scope="module")
def reference_log() -> str:
    return run_reference()


def run_reference() -> str:
    """L0: the same command, run undisturbed by the job user."""
    work = Path("/home/jobuser/tests/reference")
    work.mkdir(parents=True, exist_ok=True)
    shutil.copy(EXAMPLE, work)
    proc = subprocess.run(["runuser", "-u", "jobuser", "--", PYTHON, "train_reference.py", "--steps",
                           str(STEPS), "--sleep", "0"], cwd=work, capture_output=True, text=True,
                          timeout=300)
    shutil.rmtree(work, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == STEPS + 1
    return proc.stdout


def _start_training(jobs, options: str = "", sleep: float = 0.05) -> tuple[int, Path]:
    """Submit the reference job; `sleep` (seconds per step) stretches it without changing its log."""
    shutil.copy(EXAMPLE, jobs.workdir)
    shutil.chown(jobs.workdir / "train_reference.py", jobs.user)
    job_id = jobs.submit(jobs.script("train.sh", TRAIN.format(options=options, sleep=sleep)))
    log = jobs.wait_for_file("train.out")
    _wait_for_text(jobs, job_id, log, "step 20 ")
    return job_id, log


def _wait_for_text(jobs, job_id: int, log: Path, text: str, count: int = 1, timeout: float = 120) -> None:
    jobs.wait(job_id, lambda r: log.read_text().count(text) >= count,
              f"printing {text!r} x{count}", timeout=timeout)


def test_after_a_periodic_checkpoint_a_killed_job_resumes_from_it_even_without_redis(
        jobs, reference_log, registry):
    job_id, log = _start_training(jobs, options="--checkpoint-interval 0.1", sleep=0.1)
    _wait_for_text(jobs, job_id, log, "periodic checkpoint")
    # The store is the truth: the restore must not need Redis's index.
    registry.redis.flushall()
    time.sleep(1)
    # The training process and its DataLoader workers (not the launcher, whose command line names
    # the script too).
    pids = subprocess.run(["pgrep", "-u", "jobuser", "-f", f"^{PYTHON} train_reference.py"],
                          capture_output=True, text=True).stdout.split()
    killed = 0
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
            killed += 1
        except ProcessLookupError:  # a DataLoader worker that ended since pgrep saw it
            pass
    assert killed, pids
    _wait_for_text(jobs, job_id, log, "restored checkpoint")
    jobs.wait_state(job_id, "COMPLETED", timeout=180)

    text = log.read_text()
    assert "were killed (status 137); requeueing to resume from the last checkpoint" in text
    resumed = training_log(text.split("restored checkpoint", 1)[1].split("\n", 1)[1])
    assert resumed, "nothing was printed after the restore"
    assert reference_log.endswith(resumed)
    # No step is skipped: the resumed run starts at a step the killed run printed (the steps since
    # the periodic checkpoint are repeated), or at the one after its last (it was killed right after
    # the checkpoint).
    first = int(re.match(r"step (\d+) ", resumed)[1])
    before = [int(n) for n in re.findall(r"^step (\d+) ", text.split("restored checkpoint", 1)[0], re.M)]
    assert first <= max(before) + 1, (first, max(before))


def test_migrate_of_a_nonexistent_job_fails_clearly(job_user):
    proc = run_as(job_user.pw_name, [CTL, "migrate", "999999"])
    assert proc.returncode == 1
    assert "no job 999999" in proc.stderr


def test_migrate_of_another_users_job_is_refused_and_changes_nothing(jobs, other_user):
    job_id, log = _start_training(jobs)
    before = jobs.record(job_id)
    proc = run_as(other_user, [CTL, "migrate", str(job_id)])
    assert proc.returncode == 1
    assert f"job {job_id} belongs to jobuser: you can only migrate your own jobs" in proc.stderr
    after = jobs.record(job_id)
    assert (after["JobState"], after["Restarts"], after["NodeList"]) == (
        "RUNNING", before["Restarts"], before["NodeList"])
    assert "checkpoint" not in log.read_text()


@pytest.fixture(scope="module")
def other_user() -> str:
    name = "jobuser2"
    if subprocess.run(["id", name], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--create-home", name], check=True)
    return name


LOCAL_FILE_JOB = f"""#!/bin/bash
#SBATCH --singularity-sla=basic
#SBATCH --gres=gpu:4
#SBATCH -o local.out
{CTL} run -- {PYTHON} local_file.py
"""

LOCAL_FILE_SCRIPT = """
import os, time
path = "/tmp/singularity-test-" + os.environ["SLURM_JOB_ID"] + "/scratch.txt"
os.makedirs(os.path.dirname(path), exist_ok=True)
with open(path, "w") as handle:
    handle.write("written before the migration\\n")
print("wrote", path, flush=True)
print("mount in /tmp at the start holds:", sorted(os.listdir(TMP_MOUNT)), flush=True)
for step in range(1, 41):
    print("step", step, flush=True)
    time.sleep(0.25)
print("read back:", open(path).read().strip(), flush=True)
print("host mount holds:", sorted(os.listdir(HOST_MOUNT)), flush=True)
print("mount in /tmp holds:", sorted(os.listdir(TMP_MOUNT)) if os.path.isdir(TMP_MOUNT) else None, flush=True)
"""


def _tmpfs_in(folder: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="singularity-host-mount-", dir=folder))
    path.chmod(0o755)  # the folder under the mount, which a job sees where the mount is left out
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=755", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
        path.rmdir()


@pytest.fixture
def host_tmpfs() -> Iterator[Path]:
    """A tmpfs the host mounts before the job starts, as a site's /run or an admin's scratch, in a
    folder of root's: the job's mount namespace begins with a copy of it."""
    yield from _tmpfs_in("/mnt")


@pytest.fixture
def tmp_tmpfs() -> Iterator[Path]:
    """A tmpfs mounted in /tmp, a folder every user may change: on the restoring node its path may
    be a user's symlink by then, so it must not be bound again by root."""
    yield from _tmpfs_in("/tmp")


@pytest.fixture
def shm_flood() -> Iterator[Path]:
    """Where another user floods the host's /dev/shm; removed at the end."""
    path = Path(f"/dev/shm/singularity-flood-{os.getpid()}")
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def test_a_file_written_in_tmp_travels_with_a_migration_and_the_hosts_mounts_stay_the_hosts(
        jobs, job_user, other_user, host_tmpfs, tmp_tmpfs, shm_flood):
    (host_tmpfs / "before").write_bytes(os.urandom(8 << 20))
    (tmp_tmpfs / "mounted").write_text("on the tmpfs in /tmp\n")
    jobs.script("local_file.py", f"HOST_MOUNT = {str(host_tmpfs)!r}\nTMP_MOUNT = {str(tmp_tmpfs)!r}\n"
                + LOCAL_FILE_SCRIPT)
    job_id = jobs.submit(jobs.script("local.sh", LOCAL_FILE_JOB))
    log = jobs.wait_for_file("local.out")
    _wait_for_text(jobs, job_id, log, "step 4\n")
    # Another user fills the host's /dev/shm (which the job's namespace holds, under its own): a
    # victim's checkpoint must not carry it, nor take the time to archive it.
    filled = run_as(other_user, ["dd", "if=/dev/urandom", f"of={shm_flood}", "bs=1M", "count=32"])
    assert filled.returncode == 0, filled.stderr
    scratch = Path(f"/tmp/singularity-test-{job_id}/scratch.txt")
    assert scratch.read_text() == "written before the migration\n"
    first_node = jobs.record(job_id)["NodeList"]

    proc = run_as(job_user.pw_name, [CTL, "migrate", str(job_id), "--no-wait"])
    assert proc.returncode == 0, proc.stderr
    # The dev cluster's nodes share one /tmp: remove the file, as if the job moved to another host.
    shutil.rmtree(scratch.parent)
    _wait_for_text(jobs, job_id, log, "restored checkpoint")
    # The host's mount is bound into the restored job, not re-created from an archive in its
    # checkpoint (criu made one of every tmpfs the namespace held): the host's change shows.
    (host_tmpfs / "before").unlink()
    (host_tmpfs / "after").write_text("written by the host after the restore\n")
    jobs.wait_state(job_id, "COMPLETED", timeout=120)

    assert jobs.record(job_id)["NodeList"] != first_node
    assert "read back: written before the migration" in log.read_text()
    assert "host mount holds: ['after']" in log.read_text(), log.read_text()[-2000:]
    # The mount in /tmp is left out of the checkpoint: the restored job sees the folder under it.
    assert "mount in /tmp at the start holds: ['mounted']" in log.read_text()
    assert "mount in /tmp holds: []" in log.read_text(), log.read_text()[-2000:]
    assert f"not carried: the mounts {tmp_tmpfs} (in folders someone but root could change" in log.read_text()
    committed = re.search(r"checkpoint \d+ committed in [\d.]+s: ([\d.]+) MiB", log.read_text())
    assert committed and float(committed[1]) < 8, log.read_text()  # the job's own few MiB only
    assert scratch.read_text() == "written before the migration\n"
    assert scratch.stat().st_uid == job_user.pw_uid
    shutil.rmtree(scratch.parent)


def _checkpoint(job_id: int, user: str) -> dict:
    proc = run_as(user, [CTL, "checkpoint", str(job_id), "--json"])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _resumed_part(text: str, marker: str = "restored checkpoint") -> str:
    return training_log(text.split(marker, 1)[1].split("\n", 1)[1])


@pytest.fixture
def small_store(config):
    """Mounts a tmpfs barely larger than a job's checkpoints over its folder in the store.

    The spare room is far below what any later dump adds: one of this job a few seconds later
    stored 6.9 MiB (dedup against the first), which an 8 MiB spare once let through.
    """
    mounted: list[Path] = []

    def shrink(job_id: int, spare_kib: int = 256) -> Path:
        job_dir = CheckpointStore(config.paths.store_root).job_dir(job_id)
        used = int(subprocess.run(["du", "-sk", str(job_dir)], capture_output=True, text=True,
                                  check=True).stdout.split()[0])
        copy = Path(f"/tmp/singularity-store-copy-{job_id}")
        shutil.copytree(job_dir, copy)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={used + spare_kib}k,mode=700", "tmpfs",
                        str(job_dir)], check=True)
        mounted.append(job_dir)
        subprocess.run(["cp", "-a", f"{copy}/.", str(job_dir)], check=True)
        shutil.rmtree(copy)
        return job_dir

    yield shrink
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _corrupt(store: CheckpointStore, job_id: int, seq: int, older: int) -> Path:
    """Flip a byte of a pages chunk that checkpoint `seq` has and `older` has not, and write a newer
    manifest in the previous version's JSON format, of the wrong shape, with lengths no chunk has;
    returns that manifest's path."""
    old = {c.hash for f in store.read(job_id, older).files for c in f.chunks}
    victim = next(c.hash for f in store.read(job_id, seq).files for c in f.chunks
                  if c.hash not in old and f.path.startswith("images/pages-"))
    chunk, offset, length = store.locate(job_id, victim)
    data = bytearray(chunk.read_bytes())
    data[offset + length // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    bogus = store.manifest_path(job_id, seq + 1).with_suffix(".json")
    kept = store.read(job_id, seq)
    doc = {"format": 1, "job_id": kept.job_id, "seq": seq + 1, "created_at": kept.created_at,
           "reason": kept.reason, "meta": kept.meta, "logical_bytes": 0, "new_bytes": 0,
           "files": [{"path": "images/x", "mode": 420, "size": -1, "chunks": [["0" * 32, 1 << 62]]}]}
    bogus.write_text(json.dumps(doc))
    return bogus


def test_checkpoints_stay_small_and_a_full_store_and_a_corrupt_checkpoint_never_cost_the_last_good_one(
        jobs, reference_log, job_user, config, small_store):
    """One job, checkpointed twice while it runs (the second stores at most a quarter of the
    first); then its newest checkpoint is damaged, a bogus newer manifest written, and its store
    folder shrunk below what a dump needs, and it is preempted: the dump fails on the full store,
    the job is requeued all the same, and its restore refuses both damaged checkpoints and resumes
    from the first."""
    job_id, log = _start_training(jobs, sleep=0.15)
    _wait_for_text(jobs, job_id, log, "step 60 ")
    first = _checkpoint(job_id, job_user.pw_name)
    assert jobs.record(job_id)["JobState"] == "RUNNING"
    _wait_for_text(jobs, job_id, log, "step 150 ")
    plain = run_as(job_user.pw_name, [CTL, "checkpoint", str(job_id)])
    assert plain.returncode == 0, plain.stderr
    assert re.search(r"checkpoint \d+ committed in [\d.]+s", plain.stdout), plain.stdout
    assert jobs.record(job_id)["JobState"] == "RUNNING"
    status = json.loads(subprocess.run([CTL, "status", str(job_id), "--json"], capture_output=True,
                                       text=True, check=True).stdout)
    second = status["checkpoints"][-1]
    assert second["seq"] == first["seq"] + 1
    assert second["logical_bytes"] > 100 << 20  # a whole PyTorch process tree, not a stub
    assert second["new_bytes"] <= 0.25 * first["new_bytes"], (first, second)

    store = CheckpointStore(config.paths.store_root)
    bogus = _corrupt(store, job_id, second["seq"], first["seq"])
    small_store(job_id)
    node = jobs.record(job_id)["NodeList"]
    urgent = jobs.submit(jobs.script("urgent.sh", URGENT), f"--nodelist={node}")
    _wait_for_text(jobs, job_id, log, "restored checkpoint", timeout=180)
    # while the job lives (its end deletes its folder): the failed dump added and removed nothing
    assert store.seqs(job_id) == [first["seq"], second["seq"], second["seq"] + 1]
    store.verify(store.read(job_id, first["seq"]))
    jobs.wait_state(urgent, "COMPLETED")
    jobs.wait_state(job_id, "COMPLETED", timeout=180)

    text = log.read_text()
    notes = [line for line in text.splitlines() if line.startswith("[singularity]")]
    assert any("checkpoint failed: " in n and "is full (No space left on device)" in n for n in notes), notes
    assert f"checkpoint {second['seq'] + 1} refused: manifest {bogus} is malformed: " in text
    assert f"checkpoint {second['seq']} refused: " in text
    assert f"restored checkpoint {first['seq']} " in text
    assert reference_log.endswith(_resumed_part(text))
    status = json.loads(subprocess.run([CTL, "status", str(job_id), "--json"], capture_output=True,
                                       text=True).stdout)
    assert "is full" in status["failures"][-1]["error"]
    assert status["restores"][-1]["seq"] == first["seq"]
    assert [r["seq"] for r in status["restores"][-1]["refused"]] == [second["seq"] + 1, second["seq"]]


def test_a_cancelled_job_is_not_checkpointed_or_requeued(jobs, job_user, config):
    job_id, log = _start_training(jobs)
    proc = run_as(job_user.pw_name, ["scancel", str(job_id)])
    assert proc.returncode == 0, proc.stderr
    jobs.wait_state(job_id, "CANCELLED")
    # (The launcher's "not checkpointing" may not reach the output: with proctrack/cgroup Slurm ends
    # the batch step's srun, which relays the launcher's lines, together with the launcher.)
    assert "committed" not in log.read_text()
    assert jobs.record(job_id)["Restarts"] == "0"
    assert CheckpointStore(config.paths.store_root).seqs(job_id) == []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and subprocess.run(
            ["pgrep", "-u", "jobuser", "-f", f"^{PYTHON} train_reference.py"]).returncode == 0:
        time.sleep(0.2)
    assert subprocess.run(["pgrep", "-u", "jobuser", "-f", f"^{PYTHON} train_reference.py"]).returncode == 1


MULTI_NODE = f"""#!/bin/bash
#SBATCH --singularity-sla=basic
#SBATCH --nodes=2 --gres=gpu:4
#SBATCH -o multi.out
{CTL} run -- sh -c 'exec {PYTHON} train_reference.py --steps {STEPS} --sleep 0.1 > rank-$RANK.log'
"""


def test_a_two_node_job_is_checkpointed_and_restored_on_every_node(jobs, reference_log):
    shutil.copy(EXAMPLE, jobs.workdir)
    shutil.chown(jobs.workdir / "train_reference.py", jobs.user)
    job_id = jobs.submit(jobs.script("multi.sh", MULTI_NODE))
    log = jobs.wait_for_file("multi.out")
    ranks = [jobs.workdir / "rank-0.log", jobs.workdir / "rank-1.log"]
    jobs.wait(job_id, lambda r: all(p.exists() and "step 40 " in p.read_text() for p in ranks),
              "training on both nodes")

    urgent = jobs.submit(jobs.script("urgent.sh", URGENT), "--nodelist=n1")
    _wait_for_text(jobs, job_id, log, "restored multi-node checkpoint")
    jobs.wait_state(urgent, "COMPLETED")
    jobs.wait_state(job_id, "COMPLETED", timeout=180)

    text = log.read_text()
    assert "on 2 nodes (n1,n2)" in text
    assert "preemption warning (SIGURG): checkpointing" in text
    for rank_log in ranks:
        assert rank_log.read_text() == reference_log


def test_a_reused_job_id_starts_afresh_and_an_ended_job_leaves_nothing_in_the_store(
        jobs, reference_log, job_user, other_user, config):
    shutil.copy(EXAMPLE, jobs.workdir)
    shutil.chown(jobs.workdir / "train_reference.py", jobs.user)
    job_id = jobs.submit(jobs.script("train.sh", TRAIN.format(options="", sleep=0.02)), "--hold")
    # An earlier job 42 of another user left its checkpoints (a lost StateSaveLocation restarts ids).
    root = config.paths.store_root
    planted = []
    for part in (root, root / "ranks" / "1"):
        store = CheckpointStore(part, max_chunk=4096)
        with store.begin(job_id, reason="periodic", meta={"uid": pwd.getpwnam(other_user).pw_uid}) as writer:
            writer.add_bytes("images/core-1.img", b"the earlier job's process")
            planted.append(writer.commit())
    subprocess.run(["scontrol", "release", str(job_id)], check=True)

    log = jobs.wait_for_file("train.out")
    _wait_for_text(jobs, job_id, log, "step 20 ")
    # What the Prolog moved aside, from its log (a sweep of the whole store may delete it any time).
    node_log = Path(nodelog.LOG_DIR) / f"node-{jobs.record(job_id)['BatchHost']}.log"
    said = f"job id {job_id} was used before: moved the earlier job's checkpoints aside to "
    stale = [Path(line.split(said)[1].split(" (the next")[0])
             for line in node_log.read_text().splitlines() if said in line]
    assert sorted(p.parent for p in stale) == [root / "jobs", root / "ranks/1/jobs"], stale
    owner = json.loads((CheckpointStore(root).job_dir(job_id) / "owner.json").read_text())
    assert owner["uid"] == job_user.pw_uid
    jobs.wait_state(job_id, "COMPLETED", timeout=180)

    assert training_log(log.read_text()) == reference_log
    # The job ended for good: with the dev cluster's retention of 0 its folder goes once Slurm says so.
    deadline = time.monotonic() + 60
    while CheckpointStore(root).job_dir(job_id).exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not CheckpointStore(root).job_dir(job_id).exists()

    # What an earlier job left goes at the next sweep of the whole store (one may have run already).
    proc = subprocess.run([CTL, "admin", "gc", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert not any(p.exists() for p in stale)


def test_admin_gc_collects_an_orphan_by_age_and_says_so_first_in_a_dry_run(config):
    root = config.paths.store_root / "jobs"
    old, young = root / "3999999998", root / "3999999999"  # ids Slurm does not know
    for folder in (old, young):
        (folder / "manifests").mkdir(parents=True, exist_ok=True)
        (folder / "runs.json").write_text("{}")
    week_ago = time.time() - config.store.orphan_age_s - 60
    for path in (old / "runs.json", old / "manifests", old):
        os.utime(path, (week_ago, week_ago))
    try:
        dry = subprocess.run([CTL, "admin", "gc", "--dry-run"], capture_output=True, text=True)
        assert dry.returncode == 0, dry.stderr
        assert f"would delete       {old}  (job state: unknown to Slurm)" in dry.stdout
        assert str(young) not in dry.stdout
        assert dry.stdout.rstrip().endswith("(dry run: nothing changed)")
        assert old.exists()

        real = subprocess.run([CTL, "admin", "gc", "--json"], capture_output=True, text=True)
        assert real.returncode == 0, real.stderr
        actions = {a["folder"]: a for a in json.loads(real.stdout)["actions"]}
        assert actions[str(old)]["verdict"] == "delete" and actions[str(old)]["freed_bytes"] == 2
        assert str(young) not in actions
        assert not old.exists() and young.exists()
    finally:
        shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(young, ignore_errors=True)


def test_admin_gc_is_for_root(job_user):
    proc = run_as(job_user.pw_name, [CTL, "admin", "gc"])
    assert proc.returncode == 1
    assert proc.stderr.startswith("singularityctl: error: admin gc must run as root")
