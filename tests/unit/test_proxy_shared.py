"""The proxies of one host attaching each other's member regions (proxy.shared), with real memfds.

A region is opened again through /proc/PID/fd/FD and mapped only when it is the memfd its proxy
announced: a proxy's region, of that inode and size. Only root may open another process's
descriptors, so a job's user cannot reach the regions a root proxy keeps open (another job's data).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from singularity_slurm.proxy.hal import HostBackend
from singularity_slurm.proxy.shared import PeerRegions, RegionRef, attach, host_identity


@pytest.fixture
def region():
    made = HostBackend().region(1 << 20)
    yield made
    made.close()


def ref_of(region) -> RegionRef:
    return RegionRef(os.getpid(), region.fd, region.ino, region.size)


def test_a_peer_attaches_the_very_memory_of_a_region(region) -> None:
    peer = attach(ref_of(region))
    try:
        np.frombuffer(peer, np.float32, 4)[:] = [1.5, -2.0, 3.25, 0.0]
        assert region.array("float32", 4).tolist() == [1.5, -2.0, 3.25, 0.0]
        region.array("int64", 1)[:] = 7
        assert np.frombuffer(peer, np.int64, 1).tolist() == [7]
    finally:
        peer.close()


def test_a_descriptor_that_is_no_proxy_region_is_refused() -> None:
    with tempfile.TemporaryFile() as plain:
        plain.truncate(1 << 20)
        info = os.fstat(plain.fileno())
        ref = RegionRef(os.getpid(), plain.fileno(), info.st_ino, info.st_size)
        with pytest.raises(ValueError, match="not a proxy's shared region"):
            attach(ref)


@pytest.mark.parametrize("wrong", ["ino", "size"])
def test_a_region_that_is_not_the_one_announced_is_refused(region, wrong: str) -> None:
    ref = ref_of(region)
    ref = RegionRef(ref.pid, ref.fd, ref.ino + (wrong == "ino"), ref.size * (2 if wrong == "size" else 1))

    with pytest.raises(ValueError, match="is not the region the peer announced"):
        attach(ref)


def test_a_closed_descriptor_cannot_be_attached(region) -> None:
    ref = ref_of(region)
    region.close()

    with pytest.raises(OSError):
        attach(ref)


def test_a_members_newer_region_replaces_its_older_one_and_sizes_are_checked() -> None:
    backend, peers = HostBackend(), PeerRegions()
    old, new = backend.region(1 << 20), backend.region(2 << 20)
    try:
        old.array("float32", 1)[:] = 1.0
        new.array("float32", 1)[:] = 2.0
        assert peers.array("p1", 3, ref_of(old), np.dtype(np.float32), 1).tolist() == [1.0]
        assert peers.array("p1", 3, ref_of(new), np.dtype(np.float32), 1).tolist() == [2.0]
        assert [ref for ref, _ in peers.maps.values()] == [ref_of(new)]
        with pytest.raises(ValueError, match="holds 2097152 bytes, not 524289 elements of float32"):
            peers.array("p1", 3, ref_of(new), np.dtype(np.float32), (2 << 20) // 4 + 1)
    finally:
        peers.close()
        old.close()
        new.close()
    assert peers.maps == {}


def test_the_host_identity_names_the_boot_and_the_pid_namespace() -> None:
    boot, pidns = host_identity().split(" ")
    assert len(boot) == 36 and pidns.startswith("pid:[")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a probe as another user")
def test_another_user_cannot_open_the_regions_a_root_proxy_keeps_open(region) -> None:
    probe = (f"import os\ntry:\n    os.open('/proc/{os.getpid()}/fd/{region.fd}', os.O_RDONLY)\n"
             "    print('opened')\nexcept PermissionError:\n    print('refused')\n")
    done = subprocess.run([sys.executable, "-c", probe], user="nobody", capture_output=True, text=True,
                          timeout=60, cwd="/")

    assert (done.returncode, done.stdout.strip()) == (0, "refused"), done.stderr
