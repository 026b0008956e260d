"""Reference pipeline-parallel workload: two stages on two ranks, activations and gradients exchanged
with torch.distributed send/recv, no checkpoint code.

Rank 0 holds the first stage and sends its activations forward; rank 1 holds the second stage,
computes the loss and sends the gradient of the activations back. Each rank writes one line per step
to `RANK.log` in `--log-dir` (step, a value at full precision, and a checksum of its parameters).

    torchrun --nproc-per-node 2 train_pipeline.py --log-dir logs
    singularityctl run --world-size 2 -- python train_pipeline.py --log-dir logs
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist


def checksum(module: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in module.parameters()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--log-dir", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds between steps")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if dist.get_world_size() != 2:
        raise SystemExit("train_pipeline.py runs on exactly 2 ranks (one per stage)")
    torch.manual_seed(rank)
    stage = (torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh()) if rank == 0
             else torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(7)

    args.log_dir.mkdir(parents=True, exist_ok=True)
    with open(args.log_dir / f"{rank}.log", "a") as log:
        for step in range(args.steps):
            x = torch.randn(args.batch, 8, generator=data)
            y = x.sum(dim=1, keepdim=True).sin()
            optimizer.zero_grad()
            if rank == 0:
                activations = stage(x)
                dist.send(activations.detach(), dst=1)
                grad = torch.empty_like(activations)
                dist.recv(grad, src=1)
                activations.backward(grad)
                value = float(activations.detach().double().sum())
            else:
                activations = torch.empty(args.batch, 32)
                dist.recv(activations, src=0)
                activations.requires_grad_()
                loss = torch.nn.functional.mse_loss(stage(activations), y)
                loss.backward()
                dist.send(activations.grad, dst=0)
                value = loss.item()
            optimizer.step()
            log.write(f"{step} {value!r} {checksum(stage)!r}\n")
            log.flush()
            if args.sleep:
                time.sleep(args.sleep)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
