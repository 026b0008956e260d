"""The checkpoint store's data path against this machine's floor, side by side in one run.

A synthetic CRIU pages image (`--mib` MiB of random pages, some repeated, as process memory is) is
stored the way the node agent stores one (`node.engine.job_store`: 4 KiB chunks in packs), then a
second time with `--dirty` of its pages changed (a periodic checkpoint after some training), and the
first checkpoint is restored. The floor is what those bytes cost at least: read them, hash every
page with xxh3-128, append them to one file and fsync it (for the second checkpoint: the same for
the dirty pages only, after reading and hashing all of them; for the restore: read the stored bytes,
hash them, write the file and fsync it). Each figure is the best of `--repeat` runs; the ratios
(store / floor) are what to compare between machines.

    /opt/singularity-slurm/venv/bin/python benchmarks/store_path.py [--mib 256] [--dirty 0.05]
        [--repeat 3] [--dir /var/tmp] [--label TEXT]

Writes benchmarks/results/store_path-<time>.{md,json}. Needs the installed package (`make install`),
no cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import xxhash

from singularity_slurm.checkpoint.store import CheckpointStore

PAGE = 4096
RESULTS = Path(__file__).resolve().parent / "results"


def make_image(path: Path, mib: int, seed: int) -> None:
    """Random pages, one in eight a copy of an earlier page (dedup within a checkpoint)."""
    rng = random.Random(seed)
    pages = mib * 256
    seen: list[bytes] = []
    with open(path, "wb") as out:
        for _ in range(pages):
            if seen and rng.random() < 0.125:
                page = rng.choice(seen)
            else:
                page = rng.randbytes(PAGE)
                if len(seen) < 4096:
                    seen.append(page)
            out.write(page)


def dirty(path: Path, fraction: float, seed: int) -> int:
    """Overwrite `fraction` of the image's pages in place; returns how many."""
    rng = random.Random(seed)
    pages = path.stat().st_size // PAGE
    chosen = rng.sample(range(pages), int(pages * fraction))
    with open(path, "r+b") as out:
        for index in chosen:
            out.seek(index * PAGE)
            out.write(rng.randbytes(PAGE))
    return len(chosen)


def floor_store(source: Path, dest: Path, new_pages: set[int] | None = None) -> float:
    """Read and hash every page; append the new ones (all, or `new_pages`) to one file; fsync."""
    started = time.perf_counter()
    with open(source, "rb") as src, open(dest, "wb") as out:
        index = 0
        while block := src.read(1 << 20):
            view = memoryview(block)
            for offset in range(0, len(view), PAGE):
                page = view[offset:offset + PAGE]
                xxhash.xxh3_128_digest(page)
                if new_pages is None or index in new_pages:
                    out.write(page)
                index += 1
        out.flush()
        os.fsync(out.fileno())
    return time.perf_counter() - started


def floor_restore(source: Path, dest: Path) -> float:
    started = time.perf_counter()
    with open(source, "rb") as src, open(dest, "wb") as out:
        while block := src.read(1 << 20):
            view = memoryview(block)
            for offset in range(0, len(view), PAGE):
                xxhash.xxh3_128_digest(view[offset:offset + PAGE])
            out.write(block)
        out.flush()
        os.fsync(out.fileno())
    return time.perf_counter() - started


def store_once(store: CheckpointStore, image: Path) -> tuple[float, int]:
    started = time.perf_counter()
    with store.begin(1, reason="benchmark", meta={}) as writer:
        writer.add_file("images/pages-1.img", image)
        manifest = writer.commit()
    return time.perf_counter() - started, manifest.new_bytes


def best(times: list[float]) -> float:
    return round(min(times), 4)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="size of the pages image (default 256)")
    parser.add_argument("--dirty", type=float, default=0.05, help="fraction of pages changed (0.05)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"), help="where to work (a real disk)")
    parser.add_argument("--label", default="", help="what is measured (a commit), kept in the results")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="store-path-", dir=args.dir))
    figures: dict[str, list[float]] = {k: [] for k in (
        "floor_first_s", "store_first_s", "floor_dirty_s", "store_dirty_s", "floor_restore_s",
        "store_restore_s", "prune_s")}
    try:
        image = work / "pages-1.img"
        print(f"writing a {args.mib} MiB pages image in {work} ...", flush=True)
        make_image(image, args.mib, seed=1)
        first = work / "first.img"
        shutil.copy(image, first)
        changed = dirty(image, args.dirty, seed=2)
        second = image
        # the pages the second checkpoint stores: those changed
        with open(first, "rb") as a, open(second, "rb") as b:
            new_pages = {i for i in range(args.mib * 256) if a.read(PAGE) != b.read(PAGE)}
        for run in range(args.repeat):
            root = work / f"store-{run}"
            store = CheckpointStore(root, max_chunk=PAGE)
            figures["floor_first_s"].append(floor_store(first, work / "floor.pack"))
            seconds, new_first = store_once(store, first)
            figures["store_first_s"].append(seconds)
            figures["floor_dirty_s"].append(floor_store(second, work / "floor.pack", new_pages))
            seconds, new_second = store_once(store, second)
            figures["store_dirty_s"].append(seconds)
            figures["floor_restore_s"].append(floor_restore(first, work / "floor.out"))
            manifest = store.read(1, 1)
            out = work / f"restore-{run}"
            started = time.perf_counter()
            store.restore(manifest, out)
            figures["store_restore_s"].append(time.perf_counter() - started)
            shutil.rmtree(out)
            # retention once the dirty checkpoint is in: the first one goes, with what only it used
            started = time.perf_counter()
            store.prune(1, keep=1)
            figures["prune_s"].append(time.perf_counter() - started)
            shutil.rmtree(root)
            print(f"run {run + 1}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in figures.items()), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    summary = {k: best(v) for k, v in figures.items()}
    ratios = {stage: round(summary[f"store_{stage}_s"] / summary[f"floor_{stage}_s"], 2)
              for stage in ("first", "dirty", "restore")}
    result = {"label": args.label, "store_module": CheckpointStore.__module__,
              "mib": args.mib, "dirty_fraction": args.dirty, "dirty_pages": changed, "repeat": args.repeat,
              "new_bytes_first": new_first, "new_bytes_dirty": new_second, "best_s": summary,
              "store_over_floor": ratios, "runs": figures}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"store_path-{stamp}.json").write_text(json.dumps(result, indent=2) + "\n")
    mib_s = {stage: round(args.mib / summary[f"store_{stage}_s"]) for stage in ("first", "restore")}
    table = [
        f"# store_path, {args.mib} MiB pages image, {args.dirty:.0%} dirty, best of {args.repeat}"
        + (f": {args.label}" if args.label else ""), "",
        "| stage | floor s | store s | store / floor |", "|---|---|---|---|",
        *(f"| {stage} | {summary[f'floor_{stage}_s']} | {summary[f'store_{stage}_s']} | {ratios[stage]} |"
          for stage in ("first", "dirty", "restore")), "",
        f"first checkpoint {mib_s['first']} MiB/s, restore {mib_s['restore']} MiB/s "
        f"({new_first >> 20} MiB and {new_second >> 20} MiB newly stored)", "",
        f"retention after the dirty checkpoint (the first checkpoint pruned): {summary['prune_s']} s, "
        f"{summary['prune_s'] / summary['store_dirty_s']:.2f}x the dirty checkpoint's store time; the node "
        "agent runs it after the checkpoint's answer, under the node's upload lock", ""]
    (RESULTS / f"store_path-{stamp}.md").write_text("\n".join(table))
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
