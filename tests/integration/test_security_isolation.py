"""Isolation between jobs and users, attacked by a real second user on the running dev cluster.

`jobuser2` squats every name a victim job's ranks could be served at before the job starts, and
throws garbage, a frame header claiming 4 GiB, a bogus hello, a slowloris and a flood at the job's
proxy mesh ports while it trains. The victim (`jobuser`) must start, finish, and write a training
log byte-identical to an undisturbed run; nothing of root's or of the attacker's may change.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import CTL, run_as
from test_distributed import PYTHON, copy_example, job_script, reference_logs, wait_for_steps

from singularity_slurm.jobenv import job_run_dir
from singularity_slurm.node import services
from singularity_slurm.proxy.ranksock import rank_dir

pytestmark = pytest.mark.integration

ATTACKER = "jobuser2"
WORLD = 2
ARGS = ["--steps", "40", "--hidden", "64"]

SQUATTER = r'''
import json, os, socket, sys, time

job, ranks, folder, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
held, made, refused = [], [], []
for rank in range(ranks):
    # the names the proxies used to bind: abstract, so anyone may take them first
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(f"\0singularity-proxy/{job}/{rank}")
    s.listen(8)
    s.setblocking(False)
    held.append(s)
for path in (f"{folder}/{job}", f"{folder}/{job}/0.sock", f"{folder}/.{job}", folder + "/x"):
    try:
        if path.endswith(".sock"):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(path)
            held.append(s)
        else:
            os.makedirs(path)
        made.append(path)
    except OSError as exc:
        refused.append([path, exc.strerror])
with open(out + ".tmp", "w") as f:
    json.dump({"made": made, "refused": refused}, f)
os.rename(out + ".tmp", out)
accepted = 0
while not os.path.exists(out + ".stop"):
    for s in held:
        try:
            c, _ = s.accept()
            accepted += 1
            c.close()
        except (BlockingIOError, OSError):
            pass
    time.sleep(0.05)
names = [s.getsockname() for s in held]
with open(out + ".done.tmp", "w") as f:
    json.dump({"accepted": accepted, "still_bound": [n.decode(errors="replace") if isinstance(n, bytes)
                                                     else n for n in names]}, f)
os.rename(out + ".done.tmp", out + ".done")
'''

MESH_ATTACK = r'''
import json, os, socket, struct, sys, threading, time

ports = [int(p) for p in sys.argv[1].split(",")]
report = {}

def closed(sock, within):
    sock.settimeout(within)
    end = time.monotonic() + within
    try:
        while time.monotonic() < end:
            if sock.recv(65536) == b"":
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except (TimeoutError, socket.timeout):
        return False
    return False

def refused(sock, data):
    """Send `data`; whether the proxy closed the connection (before or after reading it)."""
    try:
        sock.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        return True
    return closed(sock, 15)

def attack(port):
    got = {}
    def conn():
        return socket.create_connection(("127.0.0.1", port), timeout=10)
    s = conn(); got["garbage"] = refused(s, os.urandom(65536)); s.close()
    s = conn(); got["huge"] = refused(s, struct.pack("!IQ", 0xFFFFFFFF, 1 << 62) + b"{" * 64); s.close()
    hello = json.dumps({"hello": "n1/gpu0", "generation": "0.0", "token": "0" * 32}).encode()
    s = conn(); got["hello"] = refused(s, struct.pack("!IQ", len(hello), 0) + hello); s.close()
    flood = [conn() for _ in range(100)]
    s = conn()
    slow = False
    for _ in range(100):
        try:
            s.sendall(b"\x01")
        except (BrokenPipeError, ConnectionResetError):
            slow = True
            break
        if closed(s, 0.2):
            slow = True
            break
    got["slowloris"] = slow
    s.close()
    got["flood_closed"] = sum(closed(f, 0.5) for f in flood)
    for f in flood:
        f.close()
    report[str(port)] = got

threads = [threading.Thread(target=attack, args=(p,)) for p in ports]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(report))
'''


@pytest.fixture(scope="module")
def attacker() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(ATTACKER)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", ATTACKER], check=True)
        return pwd.getpwnam(ATTACKER)


def attacker_file(attacker: pwd.struct_passwd, name: str, text: str) -> Path:
    folder = Path(attacker.pw_dir) / "attack"
    folder.mkdir(exist_ok=True)
    os.chown(folder, attacker.pw_uid, attacker.pw_gid)
    path = folder / name
    path.write_text(text)
    os.chown(path, attacker.pw_uid, attacker.pw_gid)
    return path


def files_of(uid: int, top: Path) -> list[str]:
    return sorted(str(p) for p in top.rglob("*") if p.lstat().st_uid == uid)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the attacker's process exited: {proc.communicate()}"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.1)


def test_another_user_squatting_a_jobs_rank_socket_names_does_not_stop_it(jobs, config, attacker, tmp_path):
    reference = reference_logs(tmp_path, "train_ddp.py", ARGS, world=WORLD, per_proxy=1)
    copy_example(jobs, "train_ddp.py")
    job_id = jobs.submit(jobs.script("victim.sh", job_script(
        "basic", f"#SBATCH --gres=gpu:{WORLD}", WORLD, f"train_ddp.py {' '.join(ARGS)}")), "--hold")
    state = config.paths.state_dir
    before = files_of(attacker.pw_uid, state)

    squatter = attacker_file(attacker, "squat.py", SQUATTER)
    out = Path(attacker.pw_dir) / "attack" / "squat.json"
    proc = subprocess.Popen(["runuser", "-u", ATTACKER, "--", PYTHON, str(squatter), str(job_id), "8",
                             str(rank_dir(state)), str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_for(out, proc)
        squat = json.loads(out.read_text())
        assert squat["made"] == [], f"{ATTACKER} made {squat['made']} in the rank socket folder"

        subprocess.run(["scontrol", "release", str(job_id)], check=True, timeout=30)
        record = jobs.wait_state(job_id, "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", timeout=300)
        output = (jobs.workdir / "job.out").read_text() if (jobs.workdir / "job.out").exists() else ""
        assert record["JobState"] == "COMPLETED", output
        for rank in range(WORLD):
            assert (jobs.workdir / "logs" / f"{rank}.log").read_text() == reference[rank], f"rank {rank}"

        Path(str(out) + ".stop").touch()
        wait_for(Path(str(out) + ".done"), proc)
        done = json.loads(Path(str(out) + ".done").read_text())
        assert done["accepted"] == 0, "a rank of the victim connected to the attacker's socket"
        assert len(done["still_bound"]) == 8  # the attacker's own sockets were left alone
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert files_of(attacker.pw_uid, state) == before == []


def proxy_ports(run_dir: Path) -> list[int]:
    pids = {services.running_pid(run_dir, p.stem) for p in run_dir.glob("proxy-*.pid")} - {None}
    assert pids, f"no proxy runs in {run_dir}"
    listing = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    ports = []
    for line in listing.splitlines():
        if any(f"pid={pid}," in line for pid in pids):
            ports.append(int(re.search(r":(\d+)\s", line.split()[3] + " ").group(1)))
    return ports


def test_garbage_and_strangers_on_the_proxy_mesh_ports_do_not_disturb_a_job(jobs, config, attacker, tmp_path):
    args = ["--steps", "60", "--hidden", "64"]
    reference = reference_logs(tmp_path, "train_ddp.py", args, world=WORLD, per_proxy=1)
    copy_example(jobs, "train_ddp.py")
    job_id = jobs.submit(jobs.script("victim.sh", job_script(
        "basic", f"#SBATCH --gres=gpu:{WORLD}", WORLD, f"train_ddp.py {' '.join(args)} --sleep 0.3")))
    wait_for_steps(jobs, job_id, WORLD, 5)
    node = jobs.record(job_id)["NodeList"]
    run_dir = job_run_dir(config.paths.state_dir, node, job_id)
    ports = proxy_ports(run_dir)
    assert len(ports) == WORLD, ports  # one mesh listener per proxy

    script = attacker_file(attacker, "mesh.py", MESH_ATTACK)
    proc = run_as(ATTACKER, [PYTHON, str(script), ",".join(map(str, ports))])
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)

    for port in map(str, ports):
        assert report[port]["garbage"] and report[port]["huge"] and report[port]["hello"], report
        assert report[port]["slowloris"] and report[port]["flood_closed"] == 100, report
    for log in run_dir.glob("proxy-*.log"):  # every proxy saw the strangers, and said so
        assert "dropped mesh connection from ('127.0.0.1'" in log.read_text(), log
        # closed as another user's before any handshake slot (proxy/peeruid.py)
        assert f"dialed by uid {attacker.pw_uid} of this host" in log.read_text(), log
    record = jobs.wait_state(job_id, "COMPLETED", "FAILED", "CANCELLED", timeout=300)
    text = (jobs.workdir / "job.out").read_text()
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "0", text
    for rank in range(WORLD):
        assert (jobs.workdir / "logs" / f"{rank}.log").read_text() == reference[rank], f"rank {rank}"


def cgroups_of(pid: int) -> dict[str, str]:
    """A process's cgroup in each v1 hierarchy, by controllers (`freezer`, `devices`, ...)."""
    return {line.split(":", 2)[1]: line.split(":", 2)[2]
            for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()}


def test_a_running_jobs_rank_sockets_are_its_users_and_its_proxies_run_in_its_cgroups(jobs, config):
    """The proxies hold memory for the job's ranks (a hostile rank once had its proxy fault in
    768 MiB of regions outside every limit of the job's): once the job's step starts its trees they
    run in the job's cgroups, beside the trees, out of reach of Slurm's signals and of a tree's
    freeze, and the Epilog removes their cgroup."""
    copy_example(jobs, "train_ddp.py")
    job_id = jobs.submit(jobs.script("plain.sh", job_script(
        "basic", f"#SBATCH --gres=gpu:{WORLD}", WORLD, "train_ddp.py --steps 40 --sleep 0.3")))
    wait_for_steps(jobs, job_id, WORLD, 3)
    folder = rank_dir(config.paths.state_dir) / str(job_id)
    user = pwd.getpwnam(jobs.user)

    st = folder.lstat()
    assert (st.st_uid, oct(st.st_mode & 0o7777)) == (0, "0o755")
    sockets = {p.name: (p.lstat().st_uid, oct(p.lstat().st_mode & 0o777)) for p in folder.iterdir()}
    assert sockets == {f"{r}.sock": (user.pw_uid, "0o600") for r in range(WORLD)}

    node = jobs.record(job_id)["NodeList"]
    run_dir = job_run_dir(config.paths.state_dir, node, job_id)
    proxies = sorted({services.running_pid(run_dir, p.stem) for p in run_dir.glob("proxy-*.pid")} - {None})
    agent = services.running_pid(run_dir, services.AGENT)
    assert len(proxies) == WORLD and agent is not None, proxies
    extern = f"/slurm_{node}/uid_{user.pw_uid}/job_{job_id}/step_extern"
    for proxy in proxies:
        where = cgroups_of(proxy)
        assert (where["freezer"], where["devices"]) == (f"{extern}/singularity-proxies", extern), where
    assert f"job_{job_id}" not in cgroups_of(agent)["freezer"]  # the agent, which dumps, stays out
    jobs.wait_state(job_id, "COMPLETED", timeout=300)
    proxies_cgroup = Path(f"/sys/fs/cgroup/freezer{extern}/singularity-proxies")
    deadline = time.monotonic() + 60
    while (folder.exists() or proxies_cgroup.exists()) and time.monotonic() < deadline:
        time.sleep(0.5)  # the proxies, then the Epilog, remove them
    assert not folder.exists() and not proxies_cgroup.exists()


HIDER = """#!/bin/bash
#SBATCH --singularity-sla=basic
#SBATCH -o hider-%j.out
# The job's user owns its extern step's folder (Slurm chowns it): take the trees' shelter name first,
# and hide a process, frozen, in a cgroup of one's own there, out of reach of Slurm's end of the job.
batch=$(sed -n 's/^[0-9]*:freezer://p' /proc/self/cgroup)
extern=/sys/fs/cgroup/freezer${{batch%/step_batch}}/step_extern
mkdir "$extern/singularity" "$extern/hide" || exit 3
sleep 1000 &
echo $! > "$extern/hide/cgroup.procs" || exit 4
echo $! > hidden.pid
echo FROZEN > "$extern/hide/freezer.state" || exit 5
echo "$extern" > extern.path
{ctl} run -- /bin/echo trained
"""


def test_a_user_who_squats_the_trees_cgroup_and_hides_a_frozen_process_below_the_extern_step_loses_it(
        jobs):
    """The job runs (its tree in the extern step itself, the squatted name refused), and when it
    ends the Epilog ends the hidden process and removes every cgroup the user made."""
    job_id = jobs.submit(jobs.script("hider.sh", HIDER.format(ctl=CTL)))
    record = jobs.wait_state(job_id, "COMPLETED", "FAILED", timeout=120)
    text = (jobs.workdir / f"hider-{job_id}.out").read_text()
    assert record["JobState"] == "COMPLETED" and "trained" in text, text

    hidden = int((jobs.workdir / "hidden.pid").read_text())
    extern = Path((jobs.workdir / "extern.path").read_text().strip())
    try:
        alive = Path(f"/proc/{hidden}/cmdline").read_bytes() == b"sleep\x001000\x00"
    except FileNotFoundError:
        alive = False
    if alive:
        os.kill(hidden, signal.SIGKILL)
    assert not alive, "the hidden process outlived the job"
    assert not (extern / "hide").exists() and not (extern / "singularity").exists()


REDIS_FLOOD = r'''
import json, socket, sys
path, out = sys.argv[1], {"socket": []}
held = []
for _ in range(64):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        held.append(s)
        out["socket"].append("connected")
    except OSError as exc:
        out["socket"].append(type(exc).__name__)
print(json.dumps(out))
'''


def test_a_user_cannot_hold_connections_to_the_coordinators_redis(config, attacker, registry):
    """Clients that never authenticate once filled Redis's client limit, and every rendezvous,
    registry write and admin command failed: the dev cluster's Redis has no TCP port, and its unix
    socket is the redis user's and group's (0770), so a job user cannot even connect."""
    assert config.redis.socket is not None, "the dev cluster's configuration names Redis's socket"
    proc = run_as(attacker.pw_name, [PYTHON, "-c", REDIS_FLOOD, str(config.redis.socket)])

    assert proc.returncode == 0, proc.stderr
    outcome = json.loads(proc.stdout)
    assert set(outcome["socket"]) == {"PermissionError"}, outcome
    assert registry.redis.config_get("port") == {"port": "0"}  # and no TCP port to fill instead
    assert registry.redis.ping()  # root is served
