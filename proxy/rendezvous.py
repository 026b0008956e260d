"""How a job's proxies find each other: a record per rendezvous generation in the coordinator.

Every start or restore of a distributed job is a new generation; its proxies publish their address
under it and wait for the others named by the placement. A fresh generation after every restore means
a proxy of an earlier allocation can never be mistaken for a peer. The record also carries a random
token only the proxies (root, with the Redis password) can read: a peer must present it.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from singularity_slurm.coordinator import keys

RECORD_TTL_S = 7 * 24 * 3600


class RendezvousError(Exception):
    """The peers of a generation did not all publish in time, or published something malformed."""


class Rendezvous(Protocol):
    def publish(self, generation: str, proxy: str, host: str, port: int) -> str:
        """Publish this proxy's address; returns the generation's token."""

    def wait(self, generation: str, proxies: Iterable[str], timeout: float) -> dict[str, tuple[str, int]]:
        """Addresses of every proxy named, once all have published."""


@contextmanager
def _reachable(job_id: int | str, generation: str) -> Iterator[None]:
    """A Redis outage fails the rendezvous (the node agent then ends the tree and the job is
    requeued) instead of killing the thread that waits for it, which would leave the ranks waiting."""
    try:
        yield
    except Exception as exc:
        import redis  # only a RedisRendezvous gets here, and it needs redis

        if not isinstance(exc, redis.RedisError):
            raise
        raise RendezvousError(f"the coordinator's Redis is unreachable during the rendezvous of generation "
                              f"{generation} of job {job_id}: {exc}") from exc


class RedisRendezvous:
    """The rendezvous in the coordinator's Redis, without polling every record: a proxy waiting for
    its peers asks only how many have published (HLEN, O(1)) and otherwise blocks on the
    generation's wake-up list (BLPOP, in slices shorter than the client's socket timeout). The first
    proxy to find everyone published pushes one wake-up per proxy (once: a SET NX decides who), and
    every proxy reads the whole record once. A rendezvous of P proxies thus costs O(P) commands, not
    O(P) per proxy per poll; a wake-up lost to a crash costs a slice, not the rendezvous."""

    BLOCK_S = 2.0  # below registry.connect's 5 s socket timeout

    def __init__(self, client, job_id: int | str, poll_s: float = 0.05):
        self.client = client
        self.job_id = job_id
        self.poll_s = poll_s  # kept for callers that give it; the wait blocks instead of polling

    def publish(self, generation: str, proxy: str, host: str, port: int) -> str:
        with _reachable(self.job_id, generation):
            return self._publish(generation, proxy, host, port)

    def _publish(self, generation: str, proxy: str, host: str, port: int) -> str:
        key = keys.job_rendezvous(self.job_id, generation)
        keys.proxy_id(proxy)
        pipe = self.client.pipeline()
        pipe.hsetnx(key, "token", secrets.token_hex(16))
        pipe.hset(key, f"proxy:{proxy}", json.dumps([host, port]))
        pipe.expire(key, RECORD_TTL_S)
        pipe.hget(key, "token")
        token = pipe.execute()[-1]
        return keys.rendezvous_token(token.decode() if isinstance(token, bytes) else token)

    def wait(self, generation: str, proxies: Iterable[str], timeout: float) -> dict[str, tuple[str, int]]:
        key = keys.job_rendezvous(self.job_id, generation)
        ready = keys.job_rendezvous_ready(self.job_id, generation)
        wanted = {keys.proxy_id(p) for p in proxies}
        deadline = time.monotonic() + timeout
        while True:
            with _reachable(self.job_id, generation):
                # the token and every wanted proxy: only then is the record worth reading
                found = self._found(key, wanted) if self.client.hlen(key) > len(wanted) else {}
                if len(found) == len(wanted):
                    self._wake(generation, len(wanted))
                    return found
            left = deadline - time.monotonic()
            if left <= 0:
                with _reachable(self.job_id, generation):
                    found = self._found(key, wanted)
                if len(found) == len(wanted):
                    return found
                missing = ", ".join(sorted(wanted - set(found)))
                raise RendezvousError(f"proxies {missing} of job {self.job_id} did not publish generation "
                                      f"{generation} within {timeout:.0f}s")
            with _reachable(self.job_id, generation):
                self.client.blpop([ready], timeout=max(min(left, self.BLOCK_S), 0.01))

    def _found(self, key: str, wanted: set[str]) -> dict[str, tuple[str, int]]:
        fetched = self.client.hgetall(key)
        record = {(k.decode() if isinstance(k, bytes) else k): v for k, v in fetched.items()}
        return {p: tuple(json.loads(record[f"proxy:{p}"])) for p in wanted  # type: ignore[misc]
                if f"proxy:{p}" in record}

    def _wake(self, generation: str, count: int) -> None:
        """Wake every proxy blocked on the generation: the first to see it complete pushes a wake-up
        for each (more than are blocked; the rest expire with the record)."""
        ready = keys.job_rendezvous_ready(self.job_id, generation)
        if self.client.set(keys.job_rendezvous_woken(self.job_id, generation), "1", nx=True,
                           ex=RECORD_TTL_S):
            pipe = self.client.pipeline()
            pipe.rpush(ready, *(["1"] * count))
            pipe.expire(ready, RECORD_TTL_S)
            pipe.execute()


class MemoryRendezvous:
    """The same contract in one process (unit tests, benchmarks without a coordinator)."""

    def __init__(self):
        self.records: dict[str, dict[str, object]] = {}
        self.cond = threading.Condition()

    def publish(self, generation: str, proxy: str, host: str, port: int) -> str:
        with self.cond:
            record = self.records.setdefault(generation, {"token": secrets.token_hex(16)})
            record[f"proxy:{proxy}"] = (host, port)
            self.cond.notify_all()
            return str(record["token"])

    def wait(self, generation: str, proxies: Iterable[str], timeout: float) -> dict[str, tuple[str, int]]:
        wanted = set(proxies)
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                record = self.records.get(generation, {})
                found = {p: record[f"proxy:{p}"] for p in wanted if f"proxy:{p}" in record}
                if len(found) == len(wanted):
                    return found  # type: ignore[return-value]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RendezvousError(f"proxies {', '.join(sorted(wanted - set(found)))} did not "
                                          f"publish generation {generation}")
                self.cond.wait(left)


class FileRendezvous:
    """The same contract through a folder (one machine, no coordinator): benchmarks and tests."""

    def __init__(self, folder: str, poll_s: float = 0.02):
        self.folder = Path(folder)
        self.poll_s = poll_s

    def publish(self, generation: str, proxy: str, host: str, port: int) -> str:
        gen_dir = self.folder / generation
        gen_dir.mkdir(parents=True, exist_ok=True)
        token_path = gen_dir / "token"
        try:
            fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, secrets.token_hex(16).encode())
            os.close(fd)
        except FileExistsError:
            pass
        tmp = gen_dir / f".{proxy.replace('/', '_')}.tmp"
        tmp.write_text(json.dumps([proxy, host, port]))
        tmp.rename(gen_dir / f"proxy-{proxy.replace('/', '_')}.json")
        while not token_path.read_text():
            time.sleep(self.poll_s)
        return token_path.read_text()

    def wait(self, generation: str, proxies: Iterable[str], timeout: float) -> dict[str, tuple[str, int]]:
        wanted = set(proxies)
        deadline = time.monotonic() + timeout
        while True:
            found = {}
            for path in (self.folder / generation).glob("proxy-*.json"):
                proxy, host, port = json.loads(path.read_text())
                if proxy in wanted:
                    found[proxy] = (host, int(port))
            if len(found) == len(wanted):
                return found
            if time.monotonic() > deadline:
                raise RendezvousError(f"proxies {', '.join(sorted(wanted - set(found)))} did not publish "
                                      f"generation {generation} in {self.folder}")
            time.sleep(self.poll_s)
