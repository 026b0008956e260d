"""The fleet simulator at scale and the three-way comparison it exists for.

1. Scale: a synthetic trace of `--jobs` jobs (10,000) on `--nodes` x 8 devices (1,000 x 8), each
   mode timed on this core, one after another in one run.
2. Comparison: a contended synthetic trace (`--compare-jobs` on `--compare-nodes` x 8, offered load
   `--load`) under native preemption, Singularity's checkpoints and the SLA controller: the
   Markdown table for benchmarks/README.md, the outcomes as JSON and (with matplotlib) a plot.

    python benchmarks/sim_fleet.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

from singularity_slurm.sla import sim, synth


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=1_000)
    parser.add_argument("--scale-load", type=float, default=3.0,
                        help="offered load of the scale trace (high, so that the queue is long)")
    parser.add_argument("--compare-jobs", type=int, default=4_000)
    parser.add_argument("--compare-nodes", type=int, default=40)
    parser.add_argument("--load", type=float, default=1.2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    scale = synth.generate(args.jobs, args.nodes * 8, args.scale_load, args.seed)
    print(f"scale: {args.jobs} jobs on {args.nodes} x 8 devices (offered load {args.scale_load:g})")
    timings = {}
    for mode in sim.MODES:
        began = time.perf_counter()
        outcome = sim.Simulation(scale, sim.SimParams(nodes=args.nodes, gpus_per_node=8, mode=mode)).run()
        timings[mode] = round(time.perf_counter() - began, 2)
        print(f"  {mode:12s} {timings[mode]:7.2f} s  ({outcome.preemptions} preemptions, "
              f"{outcome.resizes} resizes)")

    jobs = synth.generate(args.compare_jobs, args.compare_nodes * 8, args.load, args.seed)
    params = sim.SimParams(nodes=args.compare_nodes, gpus_per_node=8)
    outcomes = sim.compare(jobs, params)
    title = (f"synthetic trace, {args.compare_jobs} jobs, load {args.load:g}, seed {args.seed}, "
             f"on {args.compare_nodes} x 8 devices")
    print(f"\ncomparison: {title}")
    print(sim.table(outcomes))
    result = {"scale": {"jobs": args.jobs, "nodes": args.nodes, "seconds": timings},
              "comparison": {"title": title, "params": asdict(params),
                             "outcomes": [asdict(o) for o in outcomes]}}
    stem = args.out / f"sim_fleet-{time.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {stem.with_suffix('.json')}")
    try:
        sim.plot(outcomes, stem.with_suffix(".png"), title)
        print(f"wrote {stem.with_suffix('.png')}")
    except sim.SimError as exc:
        print(f"(no plot: {exc})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
