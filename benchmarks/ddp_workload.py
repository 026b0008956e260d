"""The DDP workload of benchmarks/proxy_vs_gloo.py: an unmodified torch.distributed script (CPU with
gloo, or `--device cuda` with NCCL).

Every rank trains a replica of an MLP (`--layers` Linear(hidden, hidden) + ReLU, then a Linear to 1
output) with DistributedDataParallel on a fixed synthetic batch, one torch thread per rank. A step is
zero_grad + forward + backward (which includes DDP's gradient allreduce) + optimizer step; each part
is timed with time.perf_counter().

Phases, each ended by a sync point (a barrier, then rank 0 writes NAME.ready in `--sync-dir` and every
rank waits for the benchmark to write NAME.go, then a barrier; the benchmark reads the proxies'
statistics in between, while no rank communicates):

  `--warmup` steps                              sync point "warm"
  `--steps` timed steps                         sync point "timed"
  `--compute-steps` steps under DDP's no_sync() (the same computation, no gradient allreduce), each
  between two barriers that are not timed: the compute-only baseline.

With `--device cuda` the model and the batch live on the rank's GPU (`cuda:0` of the GPUs it is
given, CUDA_VISIBLE_DEVICES), the process group is NCCL's, and each timestamp is taken once the GPU
has finished the work before it (torch.cuda.synchronize).

`--device-ms` adds that much time to every forward pass without using the host's CPU (a sleep): it
stands for the kernels of a device a rank holds, for benchmarks that model more devices than the
machine has cores (benchmarks/elastic_sizes.py).

Each rank then writes its times, and what it ran on, to `--sync-dir/rank-R.json`. The script knows
nothing of Singularity: under the benchmark's proxy mode the interposed sitecustomize turns
`init_process_group("gloo")` (or "nccl") into the proxy backend, and the JSON says which backend the process
group really had (`dist.get_backend()`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

GO_TIMEOUT_S = 300.0
POLL_S = 0.002


def sync_point(folder: Path, name: str, rank: int, timeout: float = GO_TIMEOUT_S) -> None:
    """Every rank at rest while the benchmark reads the proxies: rank 0 waits for its go, the others
    in the barrier it then joins (waiting outside a collective, they would keep a shared device's
    turn from rank 0)."""
    dist.barrier()
    if rank == 0:
        (folder / f"{name}.ready").touch()
        go = folder / f"{name}.go"
        deadline = time.monotonic() + timeout
        while not go.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {go} within {timeout:.0f}s")
            time.sleep(POLL_S)
    dist.barrier()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sync-dir", type=Path, required=True, help="sync-point files and results")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=100, help="timed steps")
    parser.add_argument("--compute-steps", type=int, default=20,
                        help="timed steps without gradient allreduce (DDP no_sync), after the others")
    parser.add_argument("--hidden", type=int, default=256, help="width of the MLP")
    parser.add_argument("--layers", type=int, default=3, help="hidden Linear layers")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank and step")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the model trains: cpu (gloo) or cuda (NCCL, the first GPU it sees)")
    parser.add_argument("--device-ms", type=float, default=0.0,
                        help="device time added to every forward pass, without host CPU (a sleep)")
    parser.add_argument("--device-mb", type=int, default=0,
                        help="MiB of GPU memory each rank holds besides its model (--device cuda): ranks "
                             "that share a GPU and do not fit on it together")
    args = parser.parse_args()

    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(args.hidden, 1))
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    model = model.to(device)
    ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb, device_ids=[0] if cuda else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
    data = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(args.batch, args.hidden, generator=data).to(device)
    y = torch.randn(args.batch, 1, generator=data).to(device)
    device_s = args.device_ms / 1000
    ballast = (torch.full((args.device_mb << 20,), 7, dtype=torch.uint8, device=device)
               if cuda and args.device_mb else None)

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def step() -> tuple[float, float, float, float]:
        """(step, forward, backward, optimizer) seconds."""
        t0 = now()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        if device_s:
            time.sleep(device_s)
        t1 = now()
        loss.backward()
        t2 = now()
        optimizer.step()
        t3 = now()
        return t3 - t0, t1 - t0, t2 - t1, t3 - t2

    for _ in range(args.warmup):
        step()
    sync_point(args.sync_dir, "warm", rank)
    started = now()
    timed = [step() for _ in range(args.steps)]
    loop_s = now() - started
    sync_point(args.sync_dir, "timed", rank)
    compute = []
    with ddp.no_sync():
        for _ in range(args.compute_steps):
            dist.barrier()
            compute.append(step())
    dist.barrier()

    params = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(model(x), y).item()
    result = {"rank": rank, "world_size": world, "backend": str(dist.get_backend()), "pid": os.getpid(),
              "device": args.device, "hidden": args.hidden, "layers": args.layers, "batch": args.batch,
              "device_ms": args.device_ms, "device_mb": args.device_mb,
              "ballast_intact": None if ballast is None else bool(ballast.eq(7).all().item()),
              "params": params,
              "grad_bytes": params * 4, "warmup": args.warmup, "loop_s": loop_s, "loss": loss,
              "step_s": [t[0] for t in timed], "forward_s": [t[1] for t in timed],
              "backward_s": [t[2] for t in timed], "optimizer_s": [t[3] for t in timed],
              "compute_step_s": [t[0] for t in compute], "compute_backward_s": [t[2] for t in compute]}
    tmp = args.sync_dir / f".rank-{rank}.json"
    tmp.write_text(json.dumps(result))
    tmp.rename(args.sync_dir / f"rank-{rank}.json")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
