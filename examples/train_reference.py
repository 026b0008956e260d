"""Reference workload: a small CPU PyTorch training run with no checkpoint code at all.

It trains a two-layer MLP on a synthetic regression set, loaded through a DataLoader with worker
processes, and prints every step number and its loss at full precision. Threads and seeds are fixed,
so two uninterrupted runs print byte-identical logs: a run that was preempted, migrated and
restored must print exactly the same.

    python train_reference.py [--steps N] [--workers W] [--sleep SECONDS] [--hidden H] [--ballast-mb N]

`--ballast-mb` adds N MiB of process memory that is not model state (think of a cached dataset), to
measure how checkpoints scale with a job's size; it leaves the printed log unchanged.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset


def make_ballast(mib: int) -> torch.Tensor | None:
    """N MiB of random float32, from a generator of its own so the training's random streams stay as
    they are. Random, so no page is zero and no chunk deduplicates."""
    if mib <= 0:
        return None
    return torch.rand(mib << 18, generator=torch.Generator().manual_seed(2))


def touch_ballast(ballast: torch.Tensor, step: int) -> None:
    # One element per step, a different page each time: the ballast stays dirty, live memory.
    ballast[(step * 1024) % ballast.numel()] += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    parser.add_argument("--sleep", type=float, default=0.05, help="pause per step (seconds)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ballast-mb", type=int, default=0,
                        help="extra MiB of random, dirty process memory (default 0: none)")
    args = parser.parse_args()
    ballast = make_ballast(args.ballast_mb)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    inputs = torch.randn(4096, 64)
    targets = (inputs @ torch.randn(64, 1)).tanh() + 0.01 * torch.randn(4096, 1)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=64, shuffle=True,
                        num_workers=args.workers, persistent_workers=args.workers > 0,
                        generator=torch.Generator().manual_seed(1))
    model = torch.nn.Sequential(torch.nn.Linear(64, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    step = 0
    while step < args.steps:
        for x, y in loader:
            step += 1
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            print(f"step {step} loss {loss.item()!r}", flush=True)
            if ballast is not None:
                touch_ballast(ballast, step)
            if step >= args.steps:
                break
            time.sleep(args.sleep)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
