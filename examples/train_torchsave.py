"""The usual alternative to transparent checkpointing: a training script that saves its own state.

Same model, data, seeds and "step N loss X" lines as train_reference.py (it imports nothing from it),
plus what a careful user writes by hand: every --save-every steps it saves the model, the optimizer,
the step, the random number generators and its position in the epoch with torch.save, atomically
(a temporary file, fsync, rename), to --checkpoint in the working directory; when it starts and that
file exists, it resumes from it. The position in the epoch is restored by replaying the epoch's
shuffle from the generator state it started from and skipping the batches already used, so a
resumed run prints the same losses as an undisturbed one; only the steps since the last save are
done again. Its own notes go to stderr and start with "[torchsave]"; stdout is the training log.

    python train_torchsave.py [--steps N] [--workers W] [--sleep SECONDS] [--hidden H]
                              [--save-every K] [--checkpoint PATH] [--ballast-mb N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator, Sized
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset


class ReplayableSampler(RandomSampler):
    """A RandomSampler that remembers the generator state each epoch's shuffle starts from, and can
    start its next epoch from a saved one.

    The state is taken when the epoch's iteration begins (after the DataLoader has drawn its worker
    seed from the same generator), so replaying it reproduces the epoch's order exactly.
    """

    def __init__(self, data_source: Sized, generator: torch.Generator):
        super().__init__(data_source, generator=generator)
        self.epoch_state: torch.Tensor | None = None
        self.replay_state: torch.Tensor | None = None

    def __iter__(self) -> Iterator[int]:
        if self.replay_state is not None:
            self.generator.set_state(self.replay_state)
            self.replay_state = None
        self.epoch_state = self.generator.get_state()
        return super().__iter__()


def make_ballast(mib: int) -> torch.Tensor | None:
    """N MiB of random float32 from a generator of its own; process memory that is not model state,
    so it is not saved (as train_reference.py's)."""
    if mib <= 0:
        return None
    return torch.rand(mib << 18, generator=torch.Generator().manual_seed(2))


def note(message: str) -> None:
    print(f"[torchsave] {message}", file=sys.stderr, flush=True)


def save(path: Path, state: dict[str, Any]) -> tuple[float, int]:
    """Write `state` so that a kill at any moment leaves either the old file or the new one."""
    started = time.monotonic()
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return time.monotonic() - started, path.stat().st_size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    parser.add_argument("--sleep", type=float, default=0.05, help="pause per step (seconds)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--save-every", type=int, default=50, help="steps between saves")
    parser.add_argument("--checkpoint", type=Path, default=Path("torchsave.pt"),
                        help="file to save to and resume from (default: torchsave.pt)")
    parser.add_argument("--ballast-mb", type=int, default=0,
                        help="extra MiB of random, dirty process memory, not saved (default 0: none)")
    args = parser.parse_args()
    if args.save_every < 1:
        parser.error(f"--save-every must be at least 1, got {args.save_every}")
    ballast = make_ballast(args.ballast_mb)

    # The same construction, in the same order, as train_reference.py: same data, same weights.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    inputs = torch.randn(4096, 64)
    targets = (inputs @ torch.randn(64, 1)).tanh() + 0.01 * torch.randn(4096, 1)
    dataset = TensorDataset(inputs, targets)
    shuffle = torch.Generator().manual_seed(1)
    sampler = ReplayableSampler(dataset, generator=shuffle)
    # shuffle=True with generator=G builds RandomSampler(generator=G): this draws the same numbers.
    loader = DataLoader(dataset, batch_size=64, sampler=sampler, num_workers=args.workers,
                        persistent_workers=args.workers > 0, generator=shuffle)
    model = torch.nn.Sequential(torch.nn.Linear(64, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    step, skip = 0, 0
    if args.checkpoint.exists():
        started = time.monotonic()
        state = torch.load(args.checkpoint, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        sampler.replay_state = state["epoch_rng"]
        step, skip = int(state["step"]), int(state["batches_done"])
        note(f"resumed from step {step} ({args.checkpoint}, "
             f"{args.checkpoint.stat().st_size / (1 << 20):.1f} MiB) in {time.monotonic() - started:.2f}s")
    else:
        note(f"no {args.checkpoint}: starting from step 0")

    while step < args.steps:
        batches_done = 0
        for x, y in loader:
            batches_done += 1
            if skip:
                skip -= 1
                continue
            step += 1
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            print(f"step {step} loss {loss.item()!r}", flush=True)
            if ballast is not None:
                ballast[(step * 1024) % ballast.numel()] += 1
            if step % args.save_every == 0:
                seconds, size = save(args.checkpoint, {
                    "step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "torch_rng": torch.get_rng_state(), "epoch_rng": sampler.epoch_state,
                    "batches_done": batches_done,
                })
                note(f"saved step {step} in {seconds:.2f}s: {size / (1 << 20):.1f} MiB")
            if step >= args.steps:
                break
            time.sleep(args.sleep)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
