"""Reference distributed workload: an unmodified torch DDP training script (CPU and gloo, or CUDA and NCCL).

Each rank trains a replica of a small MLP on its own shard of a synthetic regression set and writes
one line per step (step, loss at full precision, and a checksum of the parameters) to its own log,
`RANK.log` in `--log-dir`. Seeds and threads are fixed, so an undisturbed run is reproducible and a
preempted, migrated and restored run must write byte-identical logs.

    torchrun --nproc-per-node 4 train_ddp.py --log-dir logs
    singularityctl run --world-size 4 -- python train_ddp.py --log-dir logs

`--sleep` pauses between steps (so tests can preempt mid-run); `--slow-rank R --slow-sleep S` makes
one rank slower than the others. `--device cuda` trains on the GPU of the rank's LOCAL_RANK (modulo
the GPUs it sees: ranks may share one) with `init_process_group("nccl")` and deterministic kernels;
`--device-mb N` holds N MiB of GPU memory besides the model (ranks sharing a GPU that do not fit on
it together), and rank 0 prints whether it came through intact at the end.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--log-dir", type=Path, required=True)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds between steps")
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-sleep", type=float, default=0.0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--device-mb", type=int, default=0, help="MiB of GPU memory held besides the model")
    args = parser.parse_args()

    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    device = torch.device("cpu")
    if cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read at cuBLAS's first handle
        torch.use_deterministic_algorithms(True)
        torch.backends.cuda.matmul.allow_tf32 = False
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ballast = torch.full((args.device_mb << 20,), 7, dtype=torch.uint8, device=device) if cuda else None
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, args.hidden), torch.nn.Tanh(),
                                torch.nn.Linear(args.hidden, args.hidden), torch.nn.Tanh(),
                                torch.nn.Linear(args.hidden, 1)).to(device)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(1000 + rank)
    weights = torch.linspace(-1, 1, 16)

    args.log_dir.mkdir(parents=True, exist_ok=True)
    with open(args.log_dir / f"{rank}.log", "a") as log:
        for step in range(args.steps):
            x = torch.randn(args.batch, 16, generator=data)
            y = (x @ weights).unsqueeze(1) + 0.1 * torch.randn(args.batch, 1, generator=data)
            x, y = x.to(device), y.to(device)
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total = torch.zeros(1, dtype=torch.float64)
            for p in model.parameters():
                total += p.detach().double().sum().cpu()
            log.write(f"{step} {loss.item()!r} {total.item()!r}\n")
            log.flush()
            if args.sleep:
                time.sleep(args.sleep)
            if rank == args.slow_rank and args.slow_sleep:
                time.sleep(args.slow_sleep)
    if rank == 0:
        print(f"trained {args.steps} steps on {world} ranks (pid {os.getpid()})", flush=True)
        if ballast is not None and args.device_mb:
            intact = bool(ballast.eq(7).all().item())
            print(f"ballast {args.device_mb} MiB {'intact' if intact else 'CHANGED'}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
