"""Starts a node's ranks inside the job's process tree (what torchrun's agent does, minus the network).

`python -m singularity_slurm.interpose.spawn -- CMD ...` runs CMD once per rank listed in
SINGULARITY_LOCAL_RANKS, each with RANK and LOCAL_RANK set, and exits when they have: with the first
non-zero status, after stopping the others (a failed rank would otherwise leave its peers waiting in
a collective forever). It lives in the tree, so it is checkpointed and restored with the ranks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.stderr.write("usage: python -m singularity_slurm.interpose.spawn -- CMD [ARGS...]\n")
        return 2
    try:
        ranks = [int(r) for r in os.environ["SINGULARITY_LOCAL_RANKS"].split(",") if r]
    except (KeyError, ValueError):
        sys.stderr.write("[singularity] SINGULARITY_LOCAL_RANKS must list this node's ranks (e.g. 0,1)\n")
        return 2
    procs: dict[int, subprocess.Popen] = {}
    for local, rank in enumerate(ranks):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(len(ranks)))
        procs[rank] = subprocess.Popen(argv, env=env)
    status = 0
    while procs:
        for rank, proc in list(procs.items()):
            code = proc.poll()
            if code is None:
                continue
            del procs[rank]
            if code != 0 and status == 0:
                status = 128 - code if code < 0 else code
                sys.stderr.write(f"[singularity] rank {rank} exited with status {status}; stopping the "
                                 f"node's other ranks\n")
                for other in procs.values():
                    other.send_signal(signal.SIGTERM)
        time.sleep(0.1)
    return status


if __name__ == "__main__":
    sys.exit(main())
