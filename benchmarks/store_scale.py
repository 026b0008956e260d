"""How the checkpoint store scales with a job's memory: time and writer memory per checkpoint, and
the store's size after many checkpoints, for synthetic pages images of growing logical size.

For each size in `--gib`, a pages image of that many GiB is made as a sparse file whose `--density`
of pages hold data (random pages; the holes read as zero pages, as untouched memory would), and it
is checkpointed `--checkpoints` times the way the node agent stores images (4 KiB chunks, packs),
with `--dirty` of its data pages rewritten between two checkpoints and the job's retention applied
after each (`--keep` newest kept, as the agent does). Every checkpoint runs in a fresh Python
process, so its peak resident memory above the interpreter's (`VmHWM` - the RSS after imports) is
the writer's own.

    /opt/singularity-slurm/venv/bin/python benchmarks/store_scale.py [--gib 1,10] [--density 0.25]
        [--dirty 0.05] [--checkpoints 10] [--keep 2] [--dir /var/tmp]

Reports per size: the first and the mean later checkpoint's seconds, the writer's peak memory and
its bytes per chunk, and the store's size after the last checkpoint against the live data (the
distinct chunks of the newest checkpoint). Writes benchmarks/results/store_scale-<time>.{md,json}.
Needs the installed package (`make install`), no cluster; the largest size needs its data's worth
of free disk twice (image and store).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PAGE = 4096
RESULTS = Path(__file__).resolve().parent / "results"

CHILD = r"""
import json, os, sys, time
from pathlib import Path
import numpy as np
from singularity_slurm.checkpoint.store import CheckpointStore

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

root, image, keep = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
store = CheckpointStore(root, max_chunk=4096)
base = rss("VmRSS:")
started = time.perf_counter()
with store.begin(1, reason="periodic") as writer:
    writer.add_file("images/pages-1.img", image)
    manifest = writer.commit()
seconds = time.perf_counter() - started
peak = rss("VmHWM:") - base
started = time.perf_counter()
store.prune(1, keep=keep)
prune_s = time.perf_counter() - started
digests = np.unique(manifest.files[0].digest_array())
live = len(digests) * 4096
print(json.dumps({"seconds": seconds, "prune_s": prune_s, "peak_bytes": peak,
                  "chunks": manifest.files[0].count, "new_bytes": manifest.new_bytes,
                  "live_bytes": live, "store_bytes": store.job_usage(1)}))
"""


def make_image(path: Path, gib: int, density: float, rng: random.Random) -> list[int]:
    """A sparse image of `gib` GiB; returns the indexes of its data pages."""
    pages = gib * (1 << 30) // PAGE
    data = sorted(rng.sample(range(pages), int(pages * density)))
    with open(path, "wb") as out:
        out.truncate(pages * PAGE)
        write_pages(out, data, rng)
    return data


def write_pages(out, pages: list[int], rng: random.Random) -> None:
    """Random content at each of `pages` (sorted), written in runs."""
    i = 0
    while i < len(pages):
        j = i + 1
        while j < len(pages) and pages[j] == pages[j - 1] + 1 and j - i < 256:
            j += 1
        out.seek(pages[i] * PAGE)
        out.write(rng.randbytes((j - i) * PAGE))
        i = j


def run_size(gib: int, args: argparse.Namespace, work: Path) -> dict:
    rng = random.Random(gib)
    image, root = work / f"pages-{gib}g.img", work / f"store-{gib}g"
    print(f"[{gib} GiB] making the image ({args.density:.0%} data pages)", file=sys.stderr, flush=True)
    data = make_image(image, gib, args.density, rng)
    runs = []
    try:
        for n in range(args.checkpoints):
            if n:
                dirty = sorted(rng.sample(data, int(len(data) * args.dirty)))
                with open(image, "r+b") as out:
                    write_pages(out, dirty, rng)
                os.sync()
            proc = subprocess.run([sys.executable, "-c", CHILD, str(root), str(image), str(args.keep)],
                                  capture_output=True, text=True, check=False)
            if proc.returncode:
                raise SystemExit(f"checkpoint {n + 1} of the {gib} GiB image failed:\n{proc.stderr}")
            run = json.loads(proc.stdout)
            runs.append(run)
            print(f"[{gib} GiB] checkpoint {n + 1}: {run['seconds']:.2f} s, new "
                  f"{run['new_bytes'] / 2**20:.0f} MiB, writer peak {run['peak_bytes'] / 2**20:.0f} MiB, "
                  f"store {run['store_bytes'] / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    finally:
        image.unlink(missing_ok=True)
        shutil.rmtree(root, ignore_errors=True)
    later = runs[1:] or runs
    last = runs[-1]
    return {
        "gib": gib, "chunks": last["chunks"], "live_bytes": last["live_bytes"],
        "first_s": runs[0]["seconds"], "later_s": sum(r["seconds"] for r in later) / len(later),
        "dirty_bytes": sum(r["new_bytes"] for r in later) / len(later),
        "prune_s": max(r["prune_s"] for r in runs),
        "peak_bytes": max(r["peak_bytes"] for r in runs),
        "peak_per_chunk": max(r["peak_bytes"] for r in runs) / last["chunks"],
        "store_bytes": last["store_bytes"], "store_over_live": last["store_bytes"] / last["live_bytes"],
        "runs": runs,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", default="1,10", help="logical sizes in GiB, comma-separated (1,10)")
    parser.add_argument("--density", type=float, default=0.25, help="fraction of pages holding data (0.25)")
    parser.add_argument("--dirty", type=float, default=0.05, help="data pages rewritten between checkpoints")
    parser.add_argument("--checkpoints", type=int, default=10)
    parser.add_argument("--keep", type=int, default=2, help="checkpoints kept after each (the agent's 2)")
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"), help="where to work (a real disk)")
    parser.add_argument("--label", default="", help="what is measured (a commit), kept in the results")
    args = parser.parse_args()
    sizes = [int(s) for s in args.gib.split(",")]
    if not (0 < args.density <= 1 and 0 < args.dirty <= 1 and args.checkpoints >= 1 and args.keep >= 1):
        parser.error("--density and --dirty must be in (0, 1], --checkpoints and --keep at least 1")
    work = Path(tempfile.mkdtemp(prefix="store-scale-", dir=args.dir))
    try:
        rows = [run_size(gib, args, work) for gib in sizes]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = [
        f"# Store scaling ({args.label or 'unlabelled'}): density {args.density}, dirty {args.dirty}, "
        f"{args.checkpoints} checkpoints, keep {args.keep}",
        "",
        "| logical GiB | chunks | live GiB | first s | later s | dirty MiB | prune s | writer peak MiB "
        "| bytes/chunk | store / live |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['gib']} | {r['chunks']:,} | {r['live_bytes'] / 2**30:.2f} | {r['first_s']:.2f} | "
            f"{r['later_s']:.2f} | {r['dirty_bytes'] / 2**20:.0f} | {r['prune_s']:.2f} | "
            f"{r['peak_bytes'] / 2**20:.0f} | {r['peak_per_chunk']:.1f} | {r['store_over_live']:.2f} |")
    report = "\n".join(lines) + "\n"
    print(report)
    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (RESULTS / f"store_scale-{stamp}.md").write_text(report)
    (RESULTS / f"store_scale-{stamp}.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
