"""Step time of one distributed job at several sizes: the same N ranks on M devices, side by side.

A resized job keeps its world size N and runs on however many devices M it gets; ranks that share a
device take turns on it, so the ideal step time on M devices is N/M times the step time on N. This
benchmark measures how close the device proxies come to that. It runs the DDP workload of
proxy_vs_gloo.py (benchmarks/ddp_workload.py, through the interposed `singularity` backend and
fresh `singularity-proxy` daemons, one per device) with N ranks on each device count of --devices,
the counts in rotating order from round to round so a shared machine's drift hits all alike.

On the host backend a "device" is a CPU: every rank placed on device d is pinned to CPU d (taskset),
so ranks sharing a device share one core, as ranks sharing a GPU share its time. Reported per device
count: the median step time over rounds, the slowdown against the run on the most devices measured
(M_max: N itself where the machine has N CPUs), the ideal M_max/M, and the time-slicing overhead =
slowdown / ideal (1.00: no cost beyond sharing the device). Needs
root (the proxies' control socket is root-only) and at least max(--devices) CPUs.

With --device-ms T a device is emulated instead: every forward pass holds its rank's device for T ms
without using the host's CPU (the workload's sleep, standing for kernels), the ranks are not pinned,
and ranks sharing a device take turns (side by side, the sleeps of a device's ranks would overlap,
as no device's work does). The step then costs about (N/M) * T on M devices whatever the machine's
cores, so the overhead of taking turns is measured on device counts beyond them. See
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import proxy_vs_gloo as base  # noqa: E402  (the benchmark this one builds on, beside it)

REPO = base.REPO


CONCURRENT, TURNS, ALONE = "concurrent", "turns", "-"
"""proxy.time_slicing of a run; ALONE where every device has one rank (nothing to slice)."""


class PinnedRunner(base.Runner):
    """proxy_vs_gloo's runner, with every rank pinned to the CPU that stands for its device, and the
    proxies told how ranks sharing a device run (`--time-slicing`)."""

    def __init__(self, settings: base.Settings, folder: Path, say, slicing: str, device_ms: float = 0.0):
        super().__init__(settings, folder, say)
        self.slicing = slicing
        self.device_ms = device_ms

    def spawn(self, argv: list[str], env: Mapping[str, str], log: Path) -> subprocess.Popen:
        if log.name.startswith("rank-") and self.device_ms:
            argv = [*argv, "--device-ms", str(self.device_ms)]
        elif log.name.startswith("rank-"):
            rank = int(log.stem.removeprefix("rank-"))
            device = int(base.placement(self.s.world_size, self.s.proxies)[rank].removeprefix("p"))
            argv = ["taskset", "--cpu-list", str(device), *argv]
        elif tuple(argv[:len(self.s.proxy_cmd)]) == self.s.proxy_cmd and self.slicing != ALONE:
            argv = [*argv, "--time-slicing", self.slicing]
        return super().spawn(argv, env, log)


def plan(devices: Sequence[int], rounds: int, world_size: int = 0,
         slicings: Sequence[str] = (CONCURRENT,)) -> list[tuple[int, int, str]]:
    """(round, device count, slicing) in run order: every count once per round in each slicing mode
    (once where each device has one rank), the order rotated each round, the modes of one count back
    to back and alternating which first."""
    runs = []
    for rnd in range(rounds):
        shift = rnd % len(devices)
        for m in [*devices[shift:], *devices[:shift]]:
            modes = list(slicings) if world_size > m else [ALONE]
            if rnd % 2:
                modes.reverse()
            runs += [(rnd + 1, m, mode) for mode in modes]
    return runs


@dataclass(frozen=True)
class Row:
    devices: int
    slicing: str  # concurrent | turns | - (one rank per device)
    ranks_per_device: float
    step_ms: float | None  # median over rounds
    round_steps_ms: list[float]
    slowdown: float | None  # step_ms / step_ms on the most devices measured (M_max), same slicing there
    ideal: float  # M_max / M
    overhead: float | None  # slowdown / ideal
    vs_concurrent: float | None  # turns: step_ms / the concurrent run's on as many devices
    losses: list[float]  # distinct final losses on rank 0: one value when every size computed the same


def summarize(runs: Sequence[tuple[int, str, base.Run]], world_size: int) -> list[Row]:
    """Per device count and slicing mode. The baseline is the run on the most devices (N itself where
    measured), in the same slicing mode where the most devices still have several ranks each."""
    groups = sorted({(m, mode) for m, mode, _ in runs}, key=lambda g: (-g[0], g[1]))
    medians = {g: statistics.median([r.step_ms for m, mode, r in runs if (m, mode) == g]) for g in groups}
    most = groups[0][0]

    def baseline(mode: str) -> float | None:
        return medians.get((most, mode), medians.get((most, ALONE)))

    rows = []
    for m, mode in groups:
        base_ms, step = baseline(mode), medians[(m, mode)]
        slowdown = step / base_ms if base_ms else None
        ideal = most / m
        concurrent = medians.get((m, CONCURRENT))
        vs = step / concurrent if mode == TURNS and concurrent else None
        rows.append(Row(m, mode, round(world_size / m, 2), round(step, 3),
                        [round(r.step_ms, 3) for n, md, r in runs if (n, md) == (m, mode)],
                        round(slowdown, 3) if slowdown else None, round(ideal, 3),
                        round(slowdown / ideal, 3) if slowdown else None,
                        round(vs, 3) if vs else None,
                        sorted({r.loss for n, md, r in runs if (n, md) == (m, mode)})))
    return rows


def format_report(meta: Mapping[str, object], rows: Sequence[Row]) -> str:
    title = "# Elastic sizes: one job's N ranks on M devices"
    if float(meta.get("device ms", 0) or 0):
        title += f" (emulated: {meta['device ms']} ms of device time per forward pass)"
    lines = [title, ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", "| devices | ranks per device | ranks sharing a device | step (ms) | slowdown vs most "
              "devices | ideal | time-slicing overhead | turns vs concurrent |", "|---" * 8 + "|"]
    for row in rows:
        lines.append(f"| {row.devices} | {row.ranks_per_device:g} | {row.slicing} | {base._f(row.step_ms)} | "
                     f"{base._f(row.slowdown)}x | {row.ideal:.2f}x | {base._f(row.overhead)} | "
                     f"{base._f(row.vs_concurrent) + 'x' if row.vs_concurrent else ''} |")
    losses = sorted({loss for row in rows for loss in row.losses})
    lines += ["", "Final loss on rank 0 at every size: " + (
        f"{losses[0]:.7g} (identical)" if len(losses) == 1 else " / ".join(f"{v:.7g}" for v in losses)),
        "", "Per-round step times (ms): " + "; ".join(
            f"{row.devices} device{'' if row.devices == 1 else 's'}"
            f"{'' if row.slicing == ALONE else ' ' + row.slicing}: "
            f"{', '.join(f'{v:.2f}' for v in row.round_steps_ms)}" for row in rows)]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    env = base._env
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=base._HelpFormatter,
        epilog="Every option can also be set as BENCH_<OPTION> (e.g. BENCH_ROUNDS=5). The report (Markdown "
               "on stdout, or JSON with --json) is also written to --results-dir/elastic_sizes-DATE-TIME.md "
               "and .json; progress goes to stderr. Exit status: 0 ok, 1 a run failed, 2 bad options, "
               "130 interrupted.")
    parser.add_argument("--world-size", type=int, default=int(env("world_size", 4)), help="ranks (N)")
    parser.add_argument("--devices", default=env("devices", "4,2,1"),
                        help="device counts (M) to run the N ranks on, comma-separated; each divides N")
    parser.add_argument("--slicing", default=os.environ.get("BENCH_SLICING"),
                        help="how ranks sharing a device run (proxy.time_slicing), comma-separated: each "
                             f"is measured on every count with several ranks per device (default "
                             f"{CONCURRENT},{TURNS}; {TURNS} with --device-ms)")
    parser.add_argument("--device-ms", type=float, default=float(env("device_ms", 0.0)),
                        help="emulate each device: every forward pass holds it this many ms without "
                             "host CPU, ranks unpinned, taking turns (0: a device is a CPU its ranks are "
                             "pinned to)")
    parser.add_argument("--hidden", type=int, default=int(env("hidden", 256)), help="MLP width")
    parser.add_argument("--layers", type=int, default=int(env("layers", 3)), help="hidden Linear layers")
    parser.add_argument("--batch", type=int, default=int(env("batch", 64)), help="samples per rank and step")
    parser.add_argument("--steps", type=int, default=int(env("steps", 40)), help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=int(env("warmup", 5)), help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=int(env("rounds", 3)), help="rounds over all sizes")
    parser.add_argument("--run-timeout", type=float, default=float(env("run_timeout", 300.0)),
                        help="give up on one run after this many seconds")
    parser.add_argument("--results-dir", type=Path,
                        default=Path(env("results_dir", REPO / "benchmarks" / "results")),
                        help="where the report is written")
    parser.add_argument("--no-save", action="store_true", help="do not write the report files")
    parser.add_argument("--keep", action="store_true", help="keep the runs' work folder")
    parser.add_argument("--json", dest="as_json", action="store_true",
                        help="print JSON instead of the Markdown report")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    proxy_bin = Path(sys.executable).parent / "singularity-proxy"
    try:
        try:
            devices = [int(d) for d in args.devices.split(",") if d.strip()]
        except ValueError:
            raise base.BenchmarkError(f"--devices {args.devices!r}: give device counts, e.g. 4,2,1") from None
        if not devices or any(d < 1 or args.world_size % d for d in devices):
            raise base.BenchmarkError(f"--devices {args.devices}: each count must divide --world-size "
                                      f"{args.world_size}")
        slicing = args.slicing or (TURNS if args.device_ms else f"{CONCURRENT},{TURNS}")
        slicings = list(dict.fromkeys(m.strip() for m in slicing.split(",") if m.strip()))
        if not slicings or any(m not in (CONCURRENT, TURNS) for m in slicings):
            raise base.BenchmarkError(f"--slicing {slicing!r}: give {CONCURRENT}, {TURNS} or both")
        if not 0 <= args.device_ms <= 10_000:
            raise base.BenchmarkError(f"--device-ms {args.device_ms:g}: give 0 (off) up to 10000")
        if args.device_ms and CONCURRENT in slicings:
            raise base.BenchmarkError(f"--slicing {CONCURRENT} with --device-ms: an emulated device's "
                                      "time is a sleep, and side by side the sleeps of its ranks would "
                                      f"overlap, as no device's work does: use --slicing {TURNS}")
        cpus = len(os.sched_getaffinity(0))
        if max(devices) > cpus and not args.device_ms:
            raise base.BenchmarkError(f"{max(devices)} devices need {max(devices)} CPUs to pin their ranks "
                                      f"to; this machine gives {cpus}: use --devices up to {cpus}, or "
                                      "emulate the devices with --device-ms")
        if shutil.which("taskset") is None and not args.device_ms:
            raise base.BenchmarkError("taskset (util-linux) is missing: it pins each device's ranks to a CPU")
        settings = base.Settings(args.world_size, max(devices), (args.hidden,), args.layers, args.batch,
                                 args.steps, args.warmup, 0, args.rounds, 25.0, args.run_timeout,
                                 sys.executable, (str(proxy_bin),))
        if problems := base.settings_problems(settings):
            raise base.BenchmarkError("; ".join(problems))
        if os.geteuid() != 0:
            raise base.BenchmarkError("run it as root: the proxies' control socket only takes root")
        if not os.access(proxy_bin, os.X_OK):
            raise base.BenchmarkError(f"{proxy_bin} is missing: run it with the project's venv python "
                                      "(/opt/singularity-slurm/venv/bin/python) after `make install`")
    except base.BenchmarkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    import torch

    workdir = Path(tempfile.mkdtemp(prefix="elastic_sizes-"))
    meta = {"date": stamp, "host": socket.gethostname(), "cpus": cpus, "commit": base._git_commit(),
            "python": platform.python_version(), "torch": torch.__version__,
            "world size": args.world_size, "devices": ",".join(map(str, devices)),
            "slicing": ",".join(slicings), "device ms": f"{args.device_ms:g}",
            "devices are": f"emulated ({args.device_ms:g} ms per forward pass, ranks unpinned)"
            if args.device_ms else "CPUs (each device's ranks pinned to one)", "hidden": args.hidden,
            "layers": args.layers, "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
            "rounds": args.rounds, "load average before": " ".join(f"{x:.2f}" for x in os.getloadavg())}
    signal.signal(signal.SIGTERM, base._interrupted)
    runs: list[tuple[int, str, base.Run]] = []
    failed = False
    started = time.monotonic()
    runners: list[base.Runner] = []
    try:
        planned = plan(devices, args.rounds, args.world_size, slicings)
        for i, (rnd, count, mode) in enumerate(planned, 1):
            runner = PinnedRunner(dataclasses.replace(settings, proxies=count),
                                  workdir / f"m{count}-{mode.strip('-') or 'alone'}", base._say, mode,
                                  args.device_ms)
            runners.append(runner)
            run = runner.run(rnd, args.hidden, base.PROXY, 1)
            runs.append((count, mode, run))
            base._say(f"run {i}/{len(planned)}: round {rnd}, {args.world_size} ranks on {count} device(s)"
                      f"{'' if mode == ALONE else ', ' + mode}: step {run.step_ms:.2f} ms, {run.wall_s:.1f}s")
    except KeyboardInterrupt:
        base._say("interrupted")
        return 130
    except base.BenchmarkError as exc:
        base._say(f"FAILED: {exc}")
        failed = True
    finally:
        for runner in runners:
            runner.stop_all()
    meta["took"] = f"{time.monotonic() - started:.0f}s"
    if not runs:
        base._say(f"nothing measured; logs in {workdir}")
        return 1
    rows = summarize(runs, args.world_size)
    report = format_report(meta, rows)
    data = {"meta": {k: str(v) for k, v in meta.items()}, "sizes": [asdict(r) for r in rows],
            "runs": [{"devices": m, "slicing": mode, **asdict(r)} for m, mode, r in runs]}
    print(json.dumps(data, indent=2) if args.as_json else report)
    if not args.no_save:
        args.results_dir.mkdir(parents=True, exist_ok=True)
        md_path = args.results_dir / f"elastic_sizes-{stamp}.md"
        md_path.write_text(report)
        md_path.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
        base._say(f"report: {md_path} (JSON: {md_path.with_suffix('.json')})")
    if failed or args.keep:
        base._say(f"runs' logs: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
