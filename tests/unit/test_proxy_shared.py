"""The proxies of one host attaching each other's member regions (proxy.shared), with real memfds.

A region is opened again through /proc/PID/fd/FD and mapped only when it is the memfd its proxy
announced: a region of this job's proxies, of that inode and size. Regions are sealed at their size,
so a worker cannot shrink one under the proxies that map it. Only root may open another process's
descriptors, so a job's user cannot reach the regions a root proxy keeps open (another job's data).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from singularity_slurm.proxy.hal import HostBackend
from singularity_slurm.proxy.shared import PeerRegions, RegionRef, attach, host_identity, region_name

NAME = region_name(42)


@pytest.fixture
def region():
    made = HostBackend().region(1 << 20, NAME)
    yield made
    made.close()


def ref_of(region, pid: int | None = None) -> RegionRef:
    return RegionRef(pid or os.getpid(), region.fd, region.ino, region.size)


def test_a_peer_attaches_the_very_memory_of_a_region(region) -> None:
    peer = attach(ref_of(region), NAME)
    try:
        np.frombuffer(peer, np.float32, 4)[:] = [1.5, -2.0, 3.25, 0.0]
        assert region.array("float32", 4).tolist() == [1.5, -2.0, 3.25, 0.0]
        region.array("int64", 1)[:] = 7
        assert np.frombuffer(peer, np.int64, 1).tolist() == [7]
    finally:
        peer.close()


PEER = """
import json, sys
from singularity_slurm.proxy.hal import HostBackend
region = HostBackend().region(1 << 20, sys.argv[1])
region.array("float64", 2)[:] = [2.5, -1.0]
print(json.dumps([region.fd, region.ino, region.size]), flush=True)
sys.stdin.read()  # until the test is done with it
print(region.array("float64", 3).tolist(), flush=True)
"""


def test_a_region_of_another_proxy_process_is_attached_and_written_in_place() -> None:
    peer = subprocess.Popen([sys.executable, "-c", PEER, NAME], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        fd, ino, size = json.loads(peer.stdout.readline())
        regions = PeerRegions()
        array = regions.array("p1", RegionRef(peer.pid, fd, ino, size), NAME, np.dtype(np.float64), 3)
        assert array[:2].tolist() == [2.5, -1.0]
        array[2] = 9.0
        del array
        regions.close()
        out, _ = peer.communicate("", timeout=60)
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
    assert out.strip() == "[2.5, -1.0, 9.0]"


def test_a_descriptor_that_is_no_proxy_region_is_refused() -> None:
    with tempfile.TemporaryFile() as plain:
        plain.truncate(1 << 20)
        info = os.fstat(plain.fileno())
        ref = RegionRef(os.getpid(), plain.fileno(), info.st_ino, info.st_size)
        with pytest.raises(ValueError, match="not a shared region of this job's proxies"):
            attach(ref, NAME)


def test_another_jobs_region_is_refused(region) -> None:
    with pytest.raises(ValueError, match="not a shared region of this job's proxies"):
        attach(ref_of(region), region_name(43))


@pytest.mark.parametrize("wrong", ["ino", "size"])
def test_a_region_that_is_not_the_one_announced_is_refused(region, wrong: str) -> None:
    ref = ref_of(region)
    ref = RegionRef(ref.pid, ref.fd, ref.ino + (wrong == "ino"), ref.size * (2 if wrong == "size" else 1))

    with pytest.raises(ValueError, match="is not the region the peer announced"):
        attach(ref, NAME)


def test_a_closed_descriptor_cannot_be_attached(region) -> None:
    ref = ref_of(region)
    region.close()

    with pytest.raises(OSError):
        attach(ref, NAME)


def test_whoever_holds_a_region_can_neither_shrink_nor_grow_nor_seal_it(region) -> None:
    for size in (0, region.size // 2, region.size * 2):
        with pytest.raises(PermissionError):
            os.ftruncate(region.fd, size)
    assert os.fstat(region.fd).st_size == region.size


def test_each_peers_recent_regions_stay_mapped_and_older_ones_go() -> None:
    backend, peers = HostBackend(), PeerRegions(per_peer=2)
    made = [backend.region(1 << 20, NAME) for _ in range(3)]
    try:
        for i, r in enumerate(made):
            r.array("float32", 1)[:] = float(i)
        for i, r in enumerate(made):
            assert peers.array("p1", ref_of(r), NAME, np.dtype(np.float32), 1).tolist() == [float(i)]
        peers.array("p2", ref_of(made[0]), NAME, np.dtype(np.float32), 1)  # another peer's slots
        assert list(peers.maps["p1"]) == [ref_of(made[1]), ref_of(made[2])]
        assert list(peers.maps["p2"]) == [ref_of(made[0])]
        with pytest.raises(ValueError, match="holds 1048576 bytes, not 262145 elements of float32"):
            peers.array("p1", ref_of(made[2]), NAME, np.dtype(np.float32), (1 << 20) // 4 + 1)
    finally:
        peers.close()
        for r in made:
            r.close()
    assert peers.maps == {}


def test_the_host_identity_names_the_boot_and_the_pid_namespace() -> None:
    boot, pidns = host_identity().split(" ")
    assert len(boot) == 36 and pidns.startswith("pid:[")


SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")


@pytest.mark.skipif(os.geteuid() != 0 or SYSTEM_PYTHON is None,
                    reason="needs root, and a system python3 another user may run")
def test_another_user_cannot_open_the_regions_a_root_proxy_keeps_open(region) -> None:
    probe = (f"import os\ntry:\n    os.open('/proc/{os.getpid()}/fd/{region.fd}', os.O_RDONLY)\n"
             "    print('opened')\nexcept PermissionError:\n    print('refused')\n")
    done = subprocess.run([SYSTEM_PYTHON, "-I", "-c", probe], user="nobody", capture_output=True, text=True,
                          timeout=60, cwd="/")

    assert (done.returncode, done.stdout.strip()) == (0, "refused"), done.stderr
