"""Attacks on the root side of node-local files and of CRIU restore, run as the job user.

The job (jobuser, through sbatch and `singularityctl run`) swaps its file-log, its tracked /tmp files
and their folders for symlinks to root-only files, FIFOs, /dev/zero and jobuser2's files, around a
checkpoint and a restore, and keeps an fd on a file whose path it then points at a root-only file
before the restore. Each test asserts that the agent stays responsive, the job completes or fails
with a clear message, and nothing of root or of jobuser2 changed.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import CTL, run_as

from singularity_slurm.checkpoint.store import CheckpointStore

PYTHON = str(Path(CTL).with_name("python"))

JOB = f"""#!/bin/bash
#SBATCH --singularity-sla=basic
#SBATCH --gres=gpu:4
#SBATCH -o job.out
{CTL} run -- {PYTHON} job.py {{args}}
"""


def _fingerprint(path: Path) -> tuple:
    st = os.lstat(path)
    data = path.read_bytes() if path.is_file() and not path.is_symlink() else None
    return st.st_uid, st.st_gid, st.st_mode, data


@pytest.fixture
def victims(other_user: pwd.struct_passwd) -> Iterator[dict[str, Path]]:
    """A root-only 0600 file and a folder and file of jobuser2, to be aimed at by the job."""
    other = other_user
    tag = uuid.uuid4().hex[:8]
    root_file = Path(f"/tmp/sec-root-{tag}")
    root_file.write_text("ROOT-SECRET\n")
    os.chmod(root_file, 0o600)
    other_dir = Path(f"/tmp/sec-other-{tag}")
    other_dir.mkdir()
    os.chown(other_dir, other.pw_uid, other.pw_gid)
    os.chmod(other_dir, 0o777)  # writable by the job user: only the owner check keeps it out
    other_file = other_dir / "theirs.txt"
    other_file.write_text("jobuser2's\n")
    os.chown(other_file, other.pw_uid, other.pw_gid)
    os.chmod(other_file, 0o666)
    paths = {"root": root_file, "other_dir": other_dir, "other_file": other_file}
    before = {name: _fingerprint(path) for name, path in paths.items()}
    yield paths
    after = {name: _fingerprint(path) for name, path in paths.items()}
    assert sorted(os.listdir(other_dir)) == ["theirs.txt"], "something was written into jobuser2's folder"
    shutil.rmtree(other_dir, ignore_errors=True)
    root_file.unlink(missing_ok=True)
    assert after == before, "a file of root or of jobuser2 changed"


def _wait_text(jobs, job_id: int, log: Path, text: str, timeout: float = 120) -> None:
    jobs.wait(job_id, lambda r: log.exists() and text in log.read_text(), f"printing {text!r}", timeout)


def _agent_answers(job_id: int, user: str) -> None:
    started = time.monotonic()
    proc = run_as(user, [CTL, "status", str(job_id)])
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - started < 30


LOG_SWAP = """
import os, sys, time
kind, target = sys.argv[1], sys.argv[2]
folder = "/tmp/sec-job-" + os.environ["SLURM_JOB_ID"]
os.makedirs(folder, exist_ok=True)
with open(folder + "/data.txt", "w") as f:
    f.write("mine\\n")
log = os.environ["SINGULARITY_FILELOG"]
os.unlink(log)
if kind == "symlink":
    os.symlink(target, log)
elif kind == "fifo":
    os.mkfifo(log)
else:
    os.symlink("/dev/zero", log)
print("swapped", kind, flush=True)
for step in range(60):
    time.sleep(0.25)
print("done", flush=True)
"""


# One job per kind of swap, side by side (a device each).
LOG_SWAP_JOB = JOB.replace("--gres=gpu:4", "--gres=gpu:1").replace("-o job.out", "-o {kind}.out")


def test_a_file_log_swapped_for_a_root_file_fifo_or_dev_zero_is_refused(jobs, job_user, victims):
    jobs.script("job.py", LOG_SWAP)
    ids = {kind: jobs.submit(jobs.script(f"{kind}.sh", LOG_SWAP_JOB.format(
        kind=kind, args=f"{kind} {victims['root']}"))) for kind in ("symlink", "fifo", "dev_zero")}
    logs = {kind: jobs.wait_for_file(f"{kind}.out") for kind in ids}
    for kind, job_id in ids.items():
        _wait_text(jobs, job_id, logs[kind], "swapped")

    started = time.monotonic()
    checkpoints = {kind: subprocess.Popen(["runuser", "-u", job_user.pw_name, "--", CTL, "checkpoint",
                                           str(job_id)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True) for kind, job_id in ids.items()}
    for kind, proc in checkpoints.items():
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, (kind, out, err)
    assert time.monotonic() - started < 45, "a checkpoint blocked on the file-log"
    for job_id in ids.values():
        _agent_answers(job_id, job_user.pw_name)
    for kind, job_id in ids.items():
        jobs.wait_state(job_id, "COMPLETED", timeout=120)
        text = logs[kind].read_text()
        assert "done" in text, kind
        assert "[singularity] checkpoint " in text and "files.log is a " in text, (kind, text)
        assert "ROOT-SECRET" not in text, kind
        shutil.rmtree(f"/tmp/sec-job-{job_id}", ignore_errors=True)


TRACKED = """
import os, sys, time
folder = "/tmp/sec-job-" + os.environ["SLURM_JOB_ID"]
os.makedirs(folder + "/sub", exist_ok=True)
for name in ("a.txt", "fifo.txt", "sub/b.txt", "theirs.txt"):
    if not os.path.islink(folder + "/" + name):
        with open(folder + "/" + name, "w") as f:
            f.write("mine " + name + "\\n")
print("wrote", flush=True)
for step in range(80):
    time.sleep(0.25)
    print("step", step, flush=True)
print("done", flush=True)
"""


def _new_checkpoint(config, job_id: int, known: int, timeout: float = 120) -> None:
    store = CheckpointStore(config.paths.store_root)
    deadline = time.monotonic() + timeout
    while len(store.seqs(job_id)) <= known:
        assert time.monotonic() < deadline, "no checkpoint was committed"
        time.sleep(0.05)


def test_tracked_tmp_files_swapped_before_a_restore_are_not_written_through(jobs, job_user, victims, config):
    jobs.script("job.py", TRACKED)
    job_id = jobs.submit(jobs.script("job.sh", JOB.format(args="")))
    log = jobs.wait_for_file("job.out")
    _wait_text(jobs, job_id, log, "step 4\n")
    folder = Path(f"/tmp/sec-job-{job_id}")

    proc = run_as(job_user.pw_name, [CTL, "migrate", str(job_id), "--no-wait"])
    assert proc.returncode == 0, proc.stderr
    _new_checkpoint(config, job_id, 0)
    # Between the dump and the restore, the job's user swaps what the restore will write to.
    swap = (f"cd {folder} && rm -f a.txt fifo.txt theirs.txt && ln -s {victims['root']} a.txt && "
            f"mkfifo fifo.txt && ln -s {victims['other_file']} theirs.txt && rm -rf sub && "
            f"ln -s {victims['other_dir']} sub")
    assert run_as(job_user.pw_name, ["sh", "-c", swap]).returncode == 0
    _wait_text(jobs, job_id, log, "restored checkpoint")
    _agent_answers(job_id, job_user.pw_name)
    jobs.wait_state(job_id, "COMPLETED", timeout=120)

    text = log.read_text()
    assert "done" in text
    for name, why in (("a.txt", "is a symlink"), ("fifo.txt", "is a FIFO or device"),
                      ("theirs.txt", "is a symlink"), ("sub", "is a symlink or not a folder")):
        assert f"not put back: {folder / name} {why}" in text, text
    assert (folder / "fifo.txt").is_fifo() and (folder / "a.txt").is_symlink()
    shutil.rmtree(folder, ignore_errors=True)


CHECKPOINT_SWAP = """
import os, sys, time
root_file, other_dir = sys.argv[1], sys.argv[2]
folder = "/tmp/sec-job-" + os.environ["SLURM_JOB_ID"]
os.makedirs(folder + "/sub", exist_ok=True)
os.chmod(folder, 0o777)  # jobuser2 may put a file of its own in here
for name in ("a.txt", "fifo.txt", "theirs.txt", "sub/b.txt", "shared.txt", "kept.txt"):
    with open(folder + "/" + name, "w") as f:
        f.write("mine " + name + "\\n")
os.unlink(folder + "/a.txt")
os.symlink(root_file, folder + "/a.txt")
os.unlink(folder + "/fifo.txt")
os.mkfifo(folder + "/fifo.txt")
os.unlink(folder + "/theirs.txt")
os.symlink(other_dir + "/theirs.txt", folder + "/theirs.txt")
os.unlink(folder + "/sub/b.txt")
os.rmdir(folder + "/sub")
os.symlink(other_dir, folder + "/sub")
print("swapped", flush=True)
for step in range(60):
    time.sleep(0.25)
print("done", flush=True)
"""


def test_tracked_tmp_files_swapped_before_a_checkpoint_are_not_carried(jobs, job_user, other_user, victims,
                                                                        config):
    jobs.script("job.py", CHECKPOINT_SWAP)
    job_id = jobs.submit(jobs.script("job.sh", JOB.format(args=f"{victims['root']} {victims['other_dir']}")))
    log = jobs.wait_for_file("job.out")
    _wait_text(jobs, job_id, log, "swapped")
    folder = Path(f"/tmp/sec-job-{job_id}")
    # Another user replaces one of the job's files with a file of its own.
    replace = f"rm -f {folder}/shared.txt && echo jobuser2 > {folder}/shared.txt"
    assert run_as(other_user.pw_name, ["sh", "-c", replace]).returncode == 0

    started = time.monotonic()
    proc = run_as(job_user.pw_name, [CTL, "checkpoint", str(job_id)])
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - started < 45, "the checkpoint blocked on a tracked file"
    _agent_answers(job_id, job_user.pw_name)
    manifest = CheckpointStore(config.paths.store_root).list(job_id)[-1]  # the job's end deletes it
    jobs.wait_state(job_id, "COMPLETED", timeout=120)

    text = log.read_text()
    assert "done" in text and "ROOT-SECRET" not in text
    for notice in (f"not carried: {folder}/a.txt is a symlink",
                   f"not carried: {folder}/fifo.txt is a FIFO, not a regular file",
                   f"not carried: {folder}/theirs.txt is a symlink",
                   f"not carried: {folder}/sub is a symlink or not a folder",
                   f"not carried: {folder}/shared.txt belongs to uid {other_user.pw_uid}"):
        assert notice in text, text
    assert [f for f in manifest.meta["local_files"] if f.startswith(f"files{folder}/")] == [
        f"files{folder}/kept.txt"]
    shutil.rmtree(folder, ignore_errors=True)


PATH_BOUND = """
import os, time
folder = "/tmp/sec-job-" + os.environ["SLURM_JOB_ID"]
os.makedirs(folder, exist_ok=True)
ghost = open(folder + "/ghost", "w")
os.unlink(folder + "/ghost")
for step in range(40):
    print("step", step, flush=True)
    time.sleep(0.25)
print("done", flush=True)
"""


def test_a_deleted_file_open_under_a_user_folder_is_not_restored(jobs, job_user, config):
    """CRIU would create the deleted file again as root, by its path, and then change its owner and
    mode by path: the job's user could aim that at any file."""
    jobs.script("job.py", PATH_BOUND)
    job_id = jobs.submit(jobs.script("job.sh", JOB.format(args="")))
    log = jobs.wait_for_file("job.out")
    _wait_text(jobs, job_id, log, "step 4\n")
    folder = Path(f"/tmp/sec-job-{job_id}")

    proc = run_as(job_user.pw_name, [CTL, "migrate", str(job_id), "--no-wait"])
    assert proc.returncode == 0, proc.stderr
    jobs.wait_state(job_id, "COMPLETED", timeout=180)

    text = log.read_text()
    assert f"refused: it holds a deleted file still open at {folder}/ghost, which criu" in text, text
    assert "no committed checkpoint: starting from the beginning" in text
    assert text.count("step 0\n") == 2 and "done" in text
    shutil.rmtree(folder, ignore_errors=True)


HOLDER = """
import os, time
path = os.path.join(os.getcwd(), "held.txt")  # under the user's home: not a tracked node-local file
if os.path.islink(path):
    os.unlink(path)
with open(path, "w") as f:
    f.write("my own data\\n")
os.chmod(path, 0o600)  # the size and mode of the root file: CRIU's own checks of both then pass
fd = os.open(path, os.O_RDONLY)
for step in range(80):
    print("step", step, "held:", os.pread(fd, 64, 0), flush=True)
    time.sleep(0.25)
print("done", flush=True)
"""


def test_an_fd_whose_path_was_swapped_for_a_root_file_is_not_restored(jobs, job_user, victims, config):
    jobs.script("job.py", HOLDER)
    job_id = jobs.submit(jobs.script("job.sh", JOB.format(args="")))
    log = jobs.wait_for_file("job.out")
    _wait_text(jobs, job_id, log, "step 4 ")
    held = jobs.workdir / "held.txt"

    proc = run_as(job_user.pw_name, [CTL, "migrate", str(job_id), "--no-wait"])
    assert proc.returncode == 0, proc.stderr
    _new_checkpoint(config, job_id, 0)
    assert run_as(job_user.pw_name, ["ln", "-sfn", str(victims["root"]), str(held)]).returncode == 0
    _wait_text(jobs, job_id, log, "restart 1: restoring")
    _agent_answers(job_id, job_user.pw_name)
    jobs.wait_state(job_id, "COMPLETED", timeout=180)

    text = log.read_text()
    assert "ROOT-SECRET" not in text, "the restored job read the root-only file through its fd"
    assert "no committed checkpoint: starting from the beginning" in text
    assert "the restored processes would hold what the job's user may not open" in text, text
    assert f"on {victims['root']}: the job's user (uid {job_user.pw_uid}) may not read it" in text
    assert "done" in text


WATCHER = """
import ctypes, os, struct, time
libc = ctypes.CDLL(None, use_errno=True)
folder = os.path.join(os.getcwd(), "watched")
if os.path.islink(folder):
    os.unlink(folder)
os.makedirs(folder, exist_ok=True)
fd = libc.inotify_init1(os.O_NONBLOCK)
assert fd >= 0 and libc.inotify_add_watch(fd, folder.encode(), 0x100) >= 0  # IN_CREATE
for step in range(80):
    try:
        data = os.read(fd, 65536)
    except BlockingIOError:
        data = b""
    names = []
    while data:
        _, _, _, size = struct.unpack_from("iIII", data)
        names.append(data[16:16 + size].rstrip(b"\\0").decode())
        data = data[16 + size:]
    print("step", step, "created:", names, flush=True)
    time.sleep(0.25)
print("done", flush=True)
"""


def test_a_watch_whose_folder_was_swapped_for_another_users_private_folder_is_not_restored(
        jobs, job_user, other_user, config):
    """CRIU re-adds an inotify watch by its recorded path, as root: a folder the job watched, made a
    symlink to jobuser2's 0700 folder while the job was checkpointed, would have told the restored
    job the names of the files jobuser2 makes there."""
    private = Path(f"/tmp/sec-private-{uuid.uuid4().hex[:8]}")
    private.mkdir(mode=0o700)
    os.chown(private, other_user.pw_uid, other_user.pw_gid)
    try:
        jobs.script("job.py", WATCHER)
        job_id = jobs.submit(jobs.script("job.sh", JOB.format(args="")))
        log = jobs.wait_for_file("job.out")
        _wait_text(jobs, job_id, log, "step 4 ")
        watched = jobs.workdir / "watched"

        proc = run_as(job_user.pw_name, [CTL, "migrate", str(job_id), "--no-wait"])
        assert proc.returncode == 0, proc.stderr
        _new_checkpoint(config, job_id, 0)
        swap = run_as(job_user.pw_name, ["sh", "-c", f"rm -rf {watched} && ln -s {private} {watched}"])
        assert swap.returncode == 0, swap.stderr
        _wait_text(jobs, job_id, log, "restart 1: restoring")
        secret = run_as(other_user.pw_name, ["touch", str(private / "SECRET-NAME")])
        assert secret.returncode == 0, secret.stderr
        _agent_answers(job_id, job_user.pw_name)
        jobs.wait_state(job_id, "COMPLETED", timeout=180)

        text = log.read_text()
        assert "SECRET-NAME" not in text, "the restored job saw a file made in jobuser2's private folder"
        assert "the restored processes would hold what the job's user may not open" in text, text
        assert f"(a watch) on {private}: the job's user (uid {job_user.pw_uid}) may not read it" in text, text
        assert "no committed checkpoint: starting from the beginning" in text
        assert text.count("step 0 ") == 2 and "done" in text
    finally:
        shutil.rmtree(private, ignore_errors=True)


SLOT_ATTACK = """
import errno, json, os, socket, sys
folder, holder, waiter = sys.argv[1:4]
ticket = folder + "/waiting/0000000000000-0-1-0-1-1"  # a deadline before every real one
tries = {}
def attempt(name, act):
    try:
        act()
        tries[name] = "done"
    except OSError as exc:
        tries[name] = errno.errorcode.get(exc.errno, str(exc))
dgram = lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
attempt("list", lambda: os.listdir(folder))
attempt("queue", lambda: dgram().bind(ticket))
attempt("lock", lambda: open(folder + "/gate.lock", "rb"))
alias = "/tmp/sec-slots-wake-%d" % os.getpid()  # a socket path is at most 107 bytes: a link to it
os.symlink(waiter, alias)
attempt("wake", lambda: dgram().sendto(b"w", alias))
os.unlink(alias)
attempt("remove", lambda: os.unlink(holder))
attempt("take", lambda: os.rename(waiter, folder + "/holding/" + os.path.basename(waiter)))
print(json.dumps(tries))
"""


def test_the_job_user_can_neither_queue_wake_take_nor_remove_a_dump_slot(job_user, config):
    """The node's dump slots (node.dumpgate), with one checkpoint holding the only slot and another
    waiting for it: the job user tries to queue a ticket with the earliest deadline, to wake the
    waiter, to remove the holder's ticket and to move the waiter into the slot."""
    from singularity_slurm.node import dumpgate, spool

    node = f"sec-slots-{uuid.uuid4().hex[:8]}"  # a node folder of its own in the real spool
    folder = spool.slots_folder(config.paths.spool_dir, node)
    gate = dumpgate.DumpGate(lambda: folder, 1, liveness_s=0.2)
    held, release, admitted = threading.Event(), threading.Event(), threading.Event()

    def hold() -> None:
        with gate.slot(1, 0, 30.0):
            held.set()
            release.wait(60)

    def wait_for_slot() -> None:
        with gate.slot(2, 0, 60.0):
            admitted.set()

    holder, waiter = threading.Thread(target=hold), threading.Thread(target=wait_for_slot)
    holder.start()
    try:
        assert held.wait(10)
        waiter.start()
        deadline = time.monotonic() + 10
        while not os.listdir(folder / "waiting") and time.monotonic() < deadline:
            time.sleep(0.05)
        holding, waiting = os.listdir(folder / "holding"), os.listdir(folder / "waiting")
        assert len(holding) == 1 and len(waiting) == 1, (holding, waiting)
        proc = run_as(job_user.pw_name, [PYTHON, "-c", SLOT_ATTACK, str(folder),
                                          str(folder / "holding" / holding[0]),
                                          str(folder / "waiting" / waiting[0])])
        assert proc.returncode == 0, proc.stderr
        tries = json.loads(proc.stdout)
        assert tries == dict.fromkeys(["list", "queue", "lock", "wake", "remove", "take"], "EACCES"), tries
        # the waiter looks again every 0.2 s: a wake-up or a theft would show within this
        assert not admitted.wait(1.0), "the waiting checkpoint was let in while the slot was held"
        assert (os.listdir(folder / "holding"), os.listdir(folder / "waiting")) == (holding, waiting)
    finally:
        release.set()
        holder.join(30)
        if waiter.ident is not None:
            waiter.join(30)
        shutil.rmtree(spool.node_folder(config.paths.spool_dir, node), ignore_errors=True)
    assert admitted.is_set(), "the waiter never got the slot once it was given back"
