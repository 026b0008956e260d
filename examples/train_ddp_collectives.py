"""Reference distributed workload with more than allreduce: an unmodified torch DDP training script
(CPU, gloo) that also calls all_to_all_single (async, uneven splits), gather, scatter and
all_gather_object every step.

It trains the same small MLP as train_ddp.py, each rank on its own shard of a synthetic regression
set. Before the forward pass every rank starts an all-to-all of a few feature rows (a different,
uneven number for each pair of ranks, changing with the step) and waits for it after the optimizer
step, so the exchange overlaps the training. Rank 0 then gathers the ranks' losses, scatters back to
each rank its loss and their sum, and every rank all-gathers a small record of what it received.
Each rank writes one line per step to `RANK.log` in `--log-dir`: step, loss at full precision, a
checksum of the parameters, and a checksum folded (in rank order, in float64) from what the
collectives returned. Seeds and threads are fixed, so an undisturbed run is reproducible and a
preempted, migrated and restored run must write byte-identical logs.

    torchrun --nproc-per-node 4 train_ddp_collectives.py --log-dir logs
    singularityctl run --world-size 4 -- python train_ddp_collectives.py --log-dir logs

`--sleep` pauses between steps (so tests can preempt mid-run); `--slow-rank R --slow-sleep S` makes
one rank slower than the others.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

FEATURES = 4


def rows(src: int, dst: int, step: int) -> int:
    """Rows `src` sends `dst` at `step`: uneven between pairs, sometimes none."""
    return (src + 2 * dst + step) % 3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--log-dir", type=Path, required=True)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds between steps")
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-sleep", type=float, default=0.0)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, args.hidden), torch.nn.Tanh(),
                                torch.nn.Linear(args.hidden, args.hidden), torch.nn.Tanh(),
                                torch.nn.Linear(args.hidden, 1))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(1000 + rank)
    weights = torch.linspace(-1, 1, 16)

    args.log_dir.mkdir(parents=True, exist_ok=True)
    with open(args.log_dir / f"{rank}.log", "a") as log:
        for step in range(args.steps):
            x = torch.randn(args.batch, 16, generator=data)
            y = (x @ weights).unsqueeze(1) + 0.1 * torch.randn(args.batch, 1, generator=data)

            send = [rows(rank, j, step) for j in range(world)]
            recv = [rows(g, rank, step) for g in range(world)]
            outgoing = torch.cat([x[:n, :FEATURES] + 100 * j for j, n in enumerate(send)])
            incoming = torch.empty(sum(recv), FEATURES)
            exchange = dist.all_to_all_single(incoming, outgoing, recv, send, async_op=True)

            loss = torch.nn.functional.mse_loss(ddp(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            exchange.wait()

            mine = torch.tensor([loss.item(), float(rank)], dtype=torch.float64)
            losses = [torch.empty(2, dtype=torch.float64) for _ in range(world)] if rank == 0 else None
            dist.gather(mine, losses, dst=0)
            back = torch.empty(2, dtype=torch.float64)
            if rank == 0:
                total_loss = torch.zeros((), dtype=torch.float64)
                for part in losses:  # in rank order
                    total_loss += part[0]
                parts = [torch.stack([part[0], total_loss]) for part in losses]
            dist.scatter(back, parts if rank == 0 else None, src=0)
            records: list = [None] * world
            dist.all_gather_object(records, {"rank": rank, "rows": incoming.shape[0],
                                             "sum": incoming.double().sum().item()})

            folded = back[1].item() - back[0].item()  # the other ranks' losses
            for record in records:  # in rank order
                folded += record["rows"] + record["sum"]

            total = torch.zeros(1, dtype=torch.float64)
            for p in model.parameters():
                total += p.detach().double().sum()
            log.write(f"{step} {loss.item()!r} {total.item()!r} {folded!r}\n")
            log.flush()
            if args.sleep:
                time.sleep(args.sleep)
            if rank == args.slow_rank and args.slow_sleep:
                time.sleep(args.slow_sleep)
    if rank == 0:
        print(f"trained {args.steps} steps on {world} ranks (pid {os.getpid()})", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
