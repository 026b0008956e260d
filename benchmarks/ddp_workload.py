"""The DDP workload of benchmarks/proxy_vs_gloo.py: an unmodified torch.distributed script (CPU, gloo).

Every rank trains a replica of an MLP (`--layers` Linear(hidden, hidden) + ReLU, then a Linear to 1
output) with DistributedDataParallel on a fixed synthetic batch, one torch thread per rank. It runs
`--warmup` steps, then waits at a barrier for the benchmark's go-ahead (the file `go` in `--sync-dir`;
rank 0 first writes `warm` there, so the benchmark can take the proxies' statistics between the two),
then times `--steps` steps. A step is zero_grad + forward + backward (DDP's gradient allreduce) +
optimizer step, timed with time.perf_counter(). Each rank writes its step times, and what it ran on,
to `--sync-dir/rank-R.json`.

The script knows nothing of Singularity: under the benchmark's proxy mode the interposed
sitecustomize turns `init_process_group("gloo")` into the proxy backend, and the JSON says which
backend the process group really had (`dist.get_backend()`).

`--no-sync` keeps DDP from communicating gradients at all (`DistributedDataParallel.no_sync()`):
the same computation without its allreduces, the benchmark's compute-only baseline.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

GO_TIMEOUT_S = 300.0


def wait_for(path: Path, timeout: float = GO_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} within {timeout:.0f}s")
        time.sleep(0.002)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sync-dir", type=Path, required=True, help="go-ahead files and results")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=100, help="timed steps")
    parser.add_argument("--hidden", type=int, default=256, help="width of the MLP")
    parser.add_argument("--layers", type=int, default=3, help="hidden Linear layers")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank and step")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    parser.add_argument("--no-sync", action="store_true", help="no gradient allreduce (compute only)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(args.hidden, 1))
    ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
    data = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(args.batch, args.hidden, generator=data)
    y = torch.randn(args.batch, 1, generator=data)

    def step() -> float:
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with ddp.no_sync() if args.no_sync else contextlib.nullcontext():
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            loss.backward()
        optimizer.step()
        return time.perf_counter() - started

    for _ in range(args.warmup):
        step()
    dist.barrier()
    if rank == 0:
        (args.sync_dir / "warm").touch()
    wait_for(args.sync_dir / "go")
    dist.barrier()
    loop_started = time.perf_counter()
    times = [step() for _ in range(args.steps)]
    loop_s = time.perf_counter() - loop_started
    dist.barrier()  # nobody leaves while others still time steps

    params = sum(p.numel() for p in model.parameters())
    result = {"rank": rank, "world_size": world, "backend": str(dist.get_backend()), "pid": os.getpid(),
              "hidden": args.hidden, "layers": args.layers, "batch": args.batch, "no_sync": args.no_sync,
              "params": params, "grad_bytes": params * 4, "warmup": args.warmup, "step_s": times,
              "loop_s": loop_s, "loss": float(loss_value(ddp, x, y))}
    tmp = args.sync_dir / f".rank-{rank}.json"
    tmp.write_text(json.dumps(result))
    tmp.rename(args.sync_dir / f"rank-{rank}.json")
    dist.destroy_process_group()
    return 0


def loss_value(ddp: DistributedDataParallel, x: torch.Tensor, y: torch.Tensor) -> float:
    """The loss at the end (a sanity check that training ran), computed without DDP's hooks."""
    with torch.no_grad():
        return torch.nn.functional.mse_loss(ddp.module(x), y).item()


if __name__ == "__main__":
    raise SystemExit(main())
