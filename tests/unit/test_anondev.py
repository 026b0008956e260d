"""Device numbers a restored tree must not get again (checkpoint.anondev), on this machine's kernel."""

from __future__ import annotations

import os

import pytest

from singularity_slurm.checkpoint import anondev

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creating superblocks needs root")


def fresh_device() -> int:
    """The number a new tmpfs superblock gets, given back at once: the lowest free one, for now."""
    fd, dev = anondev.placeholder()
    os.close(fd)
    return dev


def test_a_placeholder_is_an_anonymous_device_that_is_free_again_once_closed():
    fd, dev = anondev.placeholder()
    assert os.major(dev) == 0 and os.minor(dev) > 0
    os.close(fd)
    # Lowest free first: the number comes back, unless something on the machine took it meanwhile.
    assert any(fresh_device() == dev for _ in range(20))


def test_while_reserved_new_superblocks_never_get_the_reserved_numbers():
    for _ in range(20):
        dev = fresh_device()
        with anondev.reserved([dev]) as held:
            fd, other = anondev.placeholder()
            os.close(fd)
        assert other != dev
        assert held in ({dev}, set())  # empty: something else took it between the two calls
    assert fresh_device() != 0


def test_numbers_above_other_free_ones_are_reserved_too_and_the_others_given_back(tmp_path):
    # Three numbers in a row; reserving the highest must take the two below it, then give them back.
    taken = [anondev.placeholder() for _ in range(3)]
    for fd, _ in taken:
        os.close(fd)
    devices = sorted(dev for _, dev in taken)
    with anondev.reserved([devices[-1]], tmp_path / anondev.LOCK_NAME) as held:
        fds = [anondev.placeholder() for _ in range(2)]
        got = {dev for _, dev in fds}
        for fd, _ in fds:
            os.close(fd)
    assert devices[-1] not in got
    assert held <= {devices[-1]}
    assert (tmp_path / anondev.LOCK_NAME).exists()


def test_nothing_is_held_for_no_or_only_non_anonymous_devices():
    root_dev = os.stat("/").st_dev
    with anondev.reserved([]) as held:
        assert held == set()
    with anondev.reserved([root_dev] if os.major(root_dev) else []) as held:
        assert held == set()


def test_criu_kernel_encoding_converts_to_stat_numbers():
    assert anondev.from_kernel(50) == os.makedev(0, 50)
    assert anondev.from_kernel((8 << 20) | 1) == os.makedev(8, 1)


def test_the_history_keeps_earlier_numbers_then_the_current_ones_newest_last():
    zero = [os.makedev(0, m) for m in range(1, 6)]
    assert anondev.history([zero[0], zero[1]], {zero[3], zero[2]}) == [zero[0], zero[1], zero[2], zero[3]]
    # a number seen again moves to the end (the newest), and is kept once
    assert anondev.history([zero[0], zero[1]], {zero[0]}) == [zero[1], zero[0]]
    # what a damaged manifest might hold is ignored, not an error
    assert anondev.history("junk", {zero[4]}) == [zero[4]]
    assert anondev.history([{"a": 1}, "x", True, -3, os.makedev(8, 1), zero[1]], set()) == [zero[1]]
    long = [os.makedev(0, m) for m in range(1, anondev.HISTORY + 50)]
    assert anondev.history(long, set()) == long[-anondev.HISTORY:]


def test_the_devices_of_a_checkpoint_are_its_namespace_mounts_with_anonymous_numbers(tmp_path):
    from pycriu import images

    def mount(mnt_id: int, root_dev: int, where: str) -> dict:
        return {"fstype": 5, "mnt_id": mnt_id, "root_dev": root_dev, "parent_mnt_id": 1, "flags": 0,
                "root": "/", "mountpoint": where, "source": "tmpfs", "options": ""}

    with open(tmp_path / "mountpoints-11.img", "wb") as handle:
        images.dump({"magic": "MNTS", "entries": [mount(110, 50, "/dev/shm"), mount(78, 21, "/proc"),
                                                  mount(72, (254 << 20) | 1, "/")]}, handle)
    assert anondev.checkpoint_devices(tmp_path) == {os.makedev(0, 50), os.makedev(0, 21)}
    assert anondev.checkpoint_devices(tmp_path / "nothing-here") == set()
    (tmp_path / "mountpoints-12.img").write_bytes(b"\x00not an image")
    assert anondev.checkpoint_devices(tmp_path) == {os.makedev(0, 50), os.makedev(0, 21)}
