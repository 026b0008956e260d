"""The Redis rendezvous at scale, against a real redis-server of the test's own (a private one on a
Unix socket): 256 proxies publish and wait at once, each finds every peer, and the whole rendezvous
costs O(P) commands (each proxy reads the record once), where polling read it P times per round."""

from __future__ import annotations

import threading

import pytest

from singularity_slurm.proxy.rendezvous import RedisRendezvous, RendezvousError

PROXIES = 256


@pytest.fixture
def redis_client(private_redis):
    return private_redis


def calls(client, command: str) -> int:
    return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def test_256_proxies_meet_with_each_reading_the_record_once(redis_client) -> None:
    names = [f"n{i // 8}/gpu{i % 8}" for i in range(PROXIES)]
    found: dict[str, dict] = {}
    tokens: set[str] = set()
    errors: list[BaseException] = []

    def proxy(i: int) -> None:
        try:
            rendezvous = RedisRendezvous(redis_client, 42)
            tokens.add(rendezvous.publish("3.1", names[i], "10.0.0.1", 4000 + i))
            found[names[i]] = rendezvous.wait("3.1", names, timeout=120)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=proxy, args=(i,)) for i in range(PROXIES)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert not errors, errors[:3]
    expected = {name: ("10.0.0.1", 4000 + i) for i, name in enumerate(names)}
    assert len(found) == PROXIES and all(seen == expected for seen in found.values())
    assert len(tokens) == 1  # one token for the generation, whoever published first
    assert calls(redis_client, "hgetall") == PROXIES  # the record read once by each proxy
    # a wait that blocks in slices asks HLEN and BLPOP a few times each, not once per poll interval
    assert calls(redis_client, "hlen") + calls(redis_client, "blpop") < 10 * PROXIES


def test_a_missing_proxy_fails_the_wait_naming_it_after_the_timeout(redis_client) -> None:
    rendezvous = RedisRendezvous(redis_client, 42)
    rendezvous.publish("4.1", "n1/gpu0", "10.0.0.1", 4000)
    with pytest.raises(RendezvousError, match="proxies n2/gpu0 of job 42 did not publish generation 4.1"):
        rendezvous.wait("4.1", ["n1/gpu0", "n2/gpu0"], timeout=1)
