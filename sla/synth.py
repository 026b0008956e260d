"""Synthetic job traces shaped like published GPU-cluster traces, for the simulator's scale runs and
tests: most jobs ask for one device and a few for many, run times spread over orders of magnitude
(log-normal), arrivals are a Poisson stream sized to offer the cluster a chosen load, and tiers and
elasticity are drawn per job. The same seed gives the same trace.
"""

from __future__ import annotations

import math
import random

from .trace import TraceJob

GPU_SIZES = ((1, 0.62), (2, 0.12), (4, 0.12), (8, 0.10), (16, 0.025), (32, 0.012), (64, 0.003))
"""Devices asked for, with their share of jobs (single-device jobs dominate, as in Philly and PAI)."""

TIERS = (("premium", 0.2), ("standard", 0.3), ("basic", 0.5))


def generate(jobs: int, devices: int, load: float = 0.9, seed: int = 1, median_s: float = 1800.0,
             sigma: float = 1.4, max_s: float = 7 * 86400.0, elastic_share: float = 0.5) -> list[TraceJob]:
    """`jobs` jobs for a cluster of `devices` devices, offering `load` of its capacity on average.
    Multi-device jobs of the standard and basic tiers are elastic (down to a quarter of their
    request) with probability `elastic_share`."""
    if jobs < 1 or devices < 1 or not load > 0:
        raise ValueError("jobs and devices must be at least 1 and load positive")
    rng = random.Random(seed)
    sizes = [s for s, _ in GPU_SIZES if s <= devices] or [1]
    size_weights = [w for s, w in GPU_SIZES if s <= devices] or [1.0]
    drawn = []
    for i in range(jobs):
        gpus = rng.choices(sizes, size_weights)[0]
        duration = min(max(rng.lognormvariate(math.log(median_s), sigma), 60.0), max_s)
        tier = rng.choices([t for t, _ in TIERS], [w for _, w in TIERS])[0]
        min_gpus = gpus
        if gpus > 1 and tier != "premium" and rng.random() < elastic_share:
            min_gpus = max(1, gpus // 4)
        drawn.append((f"j{i:06d}", round(duration), gpus, tier, min_gpus))
    mean_work = sum(d * g for _, d, g, _, _ in drawn) / jobs
    rate = load * devices / mean_work  # arrivals per second that offer `load` of the capacity
    now, out = 0.0, []
    for job_id, duration, gpus, tier, min_gpus in drawn:
        out.append(TraceJob(job_id, round(now, 1), float(duration), gpus, tier, min_gpus))
        now += rng.expovariate(rate)
    return out
