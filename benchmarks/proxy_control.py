"""Control cost of one collective in a device proxy, against the world size.

What a proxy does for every operation besides moving data: find the communicator's group in the
generation's placement, the issuing rank's place in it, the proxy's own members, and the peers it
exchanges with. This benchmark runs that path of the real proxy (`Proxy.group`, `Proxy._channel`,
and `collectives.barrier`, the dissemination barrier a barrier exchanges) for one proxy of a job of
N ranks on N / --ranks-per-proxy proxies, with a fabric that sends nothing and receives empty
messages, so only the control work is timed. Beside it, in the same run, two baselines written out
here: the path before groups were kept per communicator (the group built from the placement at every
operation, the rank found by a list search, the proxies and members by scans of the owners, and an
all-to-all exchange of empty contributions), and the kept groups with that all-to-all exchange.

    /opt/singularity-slurm/venv/bin/python benchmarks/proxy_control.py [--worlds 4,16,64,256,1024]
        [--ranks-per-proxy 1,8] [--ops 200] [--json]

Results go to benchmarks/results/proxy_control-<date>-<time>.{md,json}. No root, no cluster.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from singularity_slurm.proxy import barrier, collectives
from singularity_slurm.proxy.daemon import Proxy, Session
from singularity_slurm.proxy.hal import HostBackend

RESULTS = Path(__file__).resolve().parent / "results"


class NullFabric:
    """Sends go nowhere; every peer's message is empty (a barrier's contributions are)."""

    def __init__(self, me: str):
        self.me = me
        self.sent = 0

    def send(self, peer: str, tag: str, payload) -> None:
        self.sent += 1

    def take(self, tag: str, sender: str) -> bytearray:
        return bytearray()


@dataclass(frozen=True)
class ScannedGroup:
    """The group as it was: its proxies and members found by scanning the owners at every call."""

    name: str
    owners: tuple[str, ...]

    @property
    def proxies(self) -> list[str]:
        seen: list[str] = []
        for proxy in self.owners:
            if proxy not in seen:
                seen.append(proxy)
        return seen

    def members_of(self, proxy: str) -> list[int]:
        return [g for g, owner in enumerate(self.owners) if owner == proxy]


@dataclass
class Before:
    """The control path as it was: nothing kept between operations."""

    placement: dict[int, str]
    comms: dict[str, list[int]] = field(default_factory=dict)

    def op(self, me: str, rank: int, comm: str, fabric: NullFabric) -> None:
        ranks = self.comms[comm]
        group_rank = ranks.index(rank)
        barrier.collective_channel(comm)
        group = ScannedGroup(comm, tuple(self.placement[r] for r in ranks))
        assert len(group.members_of(me)) and group_rank >= 0
        empty = np.empty(0, np.uint8)
        collectives.allgather(fabric, group, "t", {g: empty for g in group.members_of(me)},  # type: ignore[arg-type]
                              np.dtype(np.uint8))


def kept_op(proxy: Proxy, session: Session, message: dict, fabric: NullFabric) -> None:
    """Groups kept per communicator, the barrier an all-to-all of empty contributions."""
    _channel, group_rank = proxy._channel(session, message)
    group = proxy.group(message["comm"])
    assert len(group.members_of(proxy.id)) and group_rank >= 0
    empty = np.empty(0, np.uint8)
    collectives.allgather(fabric, group, "t", {g: empty for g in group.members_of(proxy.id)},
                          np.dtype(np.uint8))


def now_op(proxy: Proxy, session: Session, message: dict, fabric: NullFabric) -> None:
    """The real proxy's control path for one barrier of `session`'s rank."""
    _channel, group_rank = proxy._channel(session, message)
    group = proxy.group(message["comm"])
    assert len(group.members_of(proxy.id)) and group_rank >= 0
    collectives.barrier(fabric, group, "t")


def measure(world: int, per_proxy: int, ops: int, state_dir: Path) -> dict:
    placement = {r: f"n{r // per_proxy // 8}/gpu{(r // per_proxy) % 8}" for r in range(world)}
    me, rank = placement[world - 1], world - 1  # the last rank: the longest search before
    proxy = Proxy(1, 0, me, HostBackend(), None, state_dir=state_dir)
    proxy.placement = placement
    proxy.comms = {"world": list(range(world))}
    session = Session(rank, None, None)  # type: ignore[arg-type]  (no socket: nothing is sent to it)
    proxy._register_comm(session, "world", list(range(world)))
    before = Before(placement, {"world": list(range(world))})
    message = {"op": "barrier", "comm": "world"}
    fabrics = {name: NullFabric(me) for name in ("before", "kept", "now")}
    runs = {"before": lambda f: before.op(me, rank, "world", f),
            "kept": lambda f: kept_op(proxy, session, message, f),
            "now": lambda f: now_op(proxy, session, message, f)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(3):  # rounds, each timing the three back to back
        for name, run in runs.items():
            started = time.perf_counter()
            for _ in range(ops):
                run(fabrics[name])
            times[name].append((time.perf_counter() - started) / ops)
    assert fabrics["before"].sent == fabrics["kept"].sent  # the same messages, to the same peers
    us = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    return {"world": world, "ranks_per_proxy": per_proxy, "proxies": len(set(placement.values())),
            "before_us": round(us["before"], 2), "kept_us": round(us["kept"], 2),
            "now_us": round(us["now"], 2),
            "messages_before": fabrics["before"].sent // (3 * ops),
            "messages_now": fabrics["now"].sent // (3 * ops),
            "before_over_now": round(us["before"] / us["now"], 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="4,16,64,256,1024", help="world sizes (ranks), comma-separated")
    parser.add_argument("--ranks-per-proxy", default="1,8", help="ranks each proxy serves, comma-separated")
    parser.add_argument("--ops", type=int, default=200, help="operations timed per round (3 rounds)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = parser.parse_args(argv)
    try:
        worlds = [int(w) for w in args.worlds.split(",")]
        pers = [int(p) for p in args.ranks_per_proxy.split(",")]
    except ValueError:
        print("error: --worlds and --ranks-per-proxy take comma-separated numbers", file=sys.stderr)
        return 2
    if any(w < 1 for w in worlds) or any(p < 1 for p in pers) or args.ops < 1:
        print("error: world sizes, ranks per proxy and --ops must be positive", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="proxy-control-") as state:
        rows = [measure(w, p, args.ops, Path(state)) for p in pers for w in worlds if p <= w]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    lines = ["# Control cost of one collective in a proxy (barrier path, no data)", "",
             "| ranks | ranks per proxy | proxies | messages sent, all-to-all | messages sent, now "
             "| before (us per op) | groups kept, all-to-all (us) | now (us per op) | before / now |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
             *(f"| {r['world']} | {r['ranks_per_proxy']} | {r['proxies']} | {r['messages_before']} "
               f"| {r['messages_now']} | {r['before_us']} | {r['kept_us']} | {r['now_us']} "
               f"| {r['before_over_now']}x |" for r in rows), ""]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"proxy_control-{stamp}.json").write_text(json.dumps(rows, indent=2) + "\n")
    (RESULTS / f"proxy_control-{stamp}.md").write_text("\n".join(lines))
    print(json.dumps(rows, indent=2) if args.json else "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
