"""GPU reference workload: a small CUDA PyTorch training run with no checkpoint code at all.

The GPU twin of train_reference.py: a two-layer MLP trained on a synthetic regression set that lives
on the device, printing every step number and its loss at full precision. Seeds are fixed and
PyTorch's deterministic algorithms are on, so two uninterrupted runs on the same GPU type print
byte-identical logs: a run that was checkpointed and restored must print exactly the same.

    python train_cuda.py [--steps N] [--sleep SECONDS] [--hidden H] [--device-mb N]

`--device-mb` holds N MiB of random GPU memory that is not model state (think of a cached dataset on
the device), to measure how a checkpoint scales with a job's GPU memory; the log stays unchanged,
except for one closing line with the ballast's checksum, which proves it survived.

Without a CUDA device it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

CHUNK = 1 << 24  # elements (64 MiB of float32)


def checksum(ballast: torch.Tensor) -> float:
    return sum(chunk.sum(dtype=torch.float64).item() for chunk in ballast.split(CHUNK))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--sleep", type=float, default=0.02, help="pause per step (seconds)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--device-mb", type=int, default=0,
                        help="extra MiB of random GPU memory kept for the whole run (default 0: none)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("train_cuda.py: no CUDA device is visible (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    device = torch.device("cuda")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read at cuBLAS's first handle
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    ballast = None
    if args.device_mb > 0:
        # Filled and summed a chunk at a time, so that no temporary as large as the ballast makes
        # the caching allocator hold more device memory than asked for.
        generator = torch.Generator(device=device).manual_seed(2)
        ballast = torch.empty(args.device_mb << 18, device=device)
        for chunk in ballast.split(CHUNK):
            chunk.uniform_(generator=generator)
        ballast_sum = checksum(ballast)

    torch.manual_seed(0)
    inputs = torch.randn(16384, 256, device=device)
    targets = (inputs @ torch.randn(256, 1, device=device)).tanh() + 0.01 * torch.randn(16384, 1,
                                                                                     device=device)
    model = torch.nn.Sequential(torch.nn.Linear(256, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, 1)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    order = torch.Generator(device=device).manual_seed(1)

    for step in range(1, args.steps + 1):
        batch = torch.randint(0, inputs.shape[0], (512,), generator=order, device=device)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs[batch]), targets[batch])
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item()!r}", flush=True)
        if step < args.steps:
            time.sleep(args.sleep)
    if ballast is not None:
        intact = checksum(ballast) == ballast_sum
        print(f"ballast {args.device_mb} MiB {'intact' if intact else 'CHANGED'} "
              f"(device memory reserved {torch.cuda.memory_reserved() >> 20} MiB)", flush=True)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
