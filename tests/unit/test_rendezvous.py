"""How a job's proxies find each other: one contract, kept by the in-memory and the folder rendezvous.

(The Redis rendezvous keeps it too; it needs a Redis and is covered by the integration tests.)
"""

from __future__ import annotations

import re
import stat
import threading
import time
from pathlib import Path

import pytest

from singularity_slurm.proxy.rendezvous import FileRendezvous, MemoryRendezvous, RendezvousError


@pytest.fixture(params=["memory", "file"])
def rendezvous(request: pytest.FixtureRequest, tmp_path: Path):
    if request.param == "memory":
        return MemoryRendezvous()
    return FileRendezvous(str(tmp_path / "rendezvous"))


# --- the contract ---------------------------------------------------------------------------------


def test_every_proxy_of_a_generation_gets_the_same_token(rendezvous) -> None:
    tokens = {rendezvous.publish("1", proxy, "10.0.0.1", port)
              for proxy, port in (("n1/gpu0", 4000), ("n1/gpu1", 4001), ("n2/gpu0", 4000))}

    assert len(tokens) == 1
    assert re.fullmatch(r"[0-9a-f]{32}", tokens.pop())


def test_generations_have_different_tokens(rendezvous) -> None:
    first = rendezvous.publish("1", "n1/gpu0", "10.0.0.1", 4000)
    second = rendezvous.publish("2", "n1/gpu0", "10.0.0.1", 4000)

    assert first != second


def test_wait_returns_the_address_of_every_proxy_named(rendezvous) -> None:
    rendezvous.publish("1", "n1/gpu0", "10.0.0.1", 4000)
    rendezvous.publish("1", "n2/gpu0", "10.0.0.2", 4100)

    assert rendezvous.wait("1", ["n1/gpu0", "n2/gpu0"], timeout=5) == {
        "n1/gpu0": ("10.0.0.1", 4000), "n2/gpu0": ("10.0.0.2", 4100)}


def test_wait_returns_only_the_proxies_named(rendezvous) -> None:
    rendezvous.publish("1", "n1/gpu0", "10.0.0.1", 4000)
    rendezvous.publish("1", "n2/gpu0", "10.0.0.2", 4100)

    assert rendezvous.wait("1", ["n2/gpu0"], timeout=5) == {"n2/gpu0": ("10.0.0.2", 4100)}


def test_generations_do_not_see_each_others_proxies(rendezvous) -> None:
    rendezvous.publish("1", "n1/gpu0", "10.0.0.1", 4000)

    with pytest.raises(RendezvousError):
        rendezvous.wait("2", ["n1/gpu0"], timeout=0.2)


def test_wait_blocks_until_the_last_proxy_publishes(rendezvous) -> None:
    rendezvous.publish("1", "n1/gpu0", "10.0.0.1", 4000)
    late = threading.Timer(0.3, rendezvous.publish, args=("1", "n2/gpu0", "10.0.0.2", 4100))
    late.start()
    started = time.monotonic()
    try:
        addresses = rendezvous.wait("1", ["n1/gpu0", "n2/gpu0"], timeout=10)
    finally:
        late.join()

    assert addresses["n2/gpu0"] == ("10.0.0.2", 4100)
    assert 0.25 < time.monotonic() - started < 5


def test_wait_times_out_naming_the_missing_proxies_only(rendezvous) -> None:
    rendezvous.publish("7", "n1/gpu0", "10.0.0.1", 4000)

    with pytest.raises(RendezvousError) as info:
        rendezvous.wait("7", ["n1/gpu0", "n2/gpu1", "n2/gpu0"], timeout=0.2)

    message = str(info.value)
    assert message.startswith("proxies n2/gpu0, n2/gpu1 did not publish generation 7")
    assert "n1/gpu0" not in message


def test_wait_honours_its_timeout(rendezvous) -> None:
    started = time.monotonic()
    with pytest.raises(RendezvousError):
        rendezvous.wait("1", ["n1/gpu0"], timeout=0.3)

    assert 0.3 <= time.monotonic() - started < 3


def test_a_proxy_that_publishes_again_is_found_at_its_new_address(rendezvous) -> None:
    token = rendezvous.publish("1", "n1/gpu0", "10.0.0.1", 4000)

    assert rendezvous.publish("1", "n1/gpu0", "10.0.0.9", 4999) == token
    assert rendezvous.wait("1", ["n1/gpu0"], timeout=5) == {"n1/gpu0": ("10.0.0.9", 4999)}


def test_proxies_publishing_at_once_agree_on_the_token(rendezvous) -> None:
    tokens: list[str] = []
    start = threading.Barrier(8)

    def publish(i: int) -> None:
        start.wait()
        tokens.append(rendezvous.publish("1", f"n{i}/gpu0", "10.0.0.1", 4000 + i))

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)

    assert len(tokens) == 8 and len(set(tokens)) == 1
    assert len(rendezvous.wait("1", [f"n{i}/gpu0" for i in range(8)], timeout=5)) == 8


# --- the folder rendezvous ------------------------------------------------------------------------


def test_folder_rendezvous_keeps_the_token_private(tmp_path: Path) -> None:
    FileRendezvous(str(tmp_path)).publish("1", "n1/gpu0", "10.0.0.1", 4000)

    assert stat.S_IMODE((tmp_path / "1" / "token").stat().st_mode) == 0o600


def test_folder_rendezvous_leaves_no_temporary_file(tmp_path: Path) -> None:
    FileRendezvous(str(tmp_path)).publish("1", "n1/gpu0", "10.0.0.1", 4000)

    assert sorted(p.name for p in (tmp_path / "1").iterdir()) == ["proxy-n1_gpu0.json", "token"]


def test_folder_rendezvous_names_its_folder_on_timeout(tmp_path: Path) -> None:
    with pytest.raises(RendezvousError) as info:
        FileRendezvous(str(tmp_path)).wait("3", ["n1/gpu0"], timeout=0.1)

    assert str(info.value) == f"proxies n1/gpu0 did not publish generation 3 in {tmp_path}"


def test_two_folder_rendezvous_on_one_folder_are_one_rendezvous(tmp_path: Path) -> None:
    # Each proxy process has its own FileRendezvous object on the shared folder.
    first = FileRendezvous(str(tmp_path)).publish("1", "n1/gpu0", "10.0.0.1", 4000)
    second = FileRendezvous(str(tmp_path)).publish("1", "n1/gpu1", "10.0.0.1", 4001)

    assert first == second
    assert FileRendezvous(str(tmp_path)).wait("1", ["n1/gpu0", "n1/gpu1"], timeout=5) == {
        "n1/gpu0": ("10.0.0.1", 4000), "n1/gpu1": ("10.0.0.1", 4001)}
