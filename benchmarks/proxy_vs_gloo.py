"""Steady-state DDP step time through Singularity's device proxies, side by side with plain gloo.

The same unmodified DDP script (benchmarks/ddp_workload.py: an MLP on synthetic data, one torch thread
per rank, `init_process_group("gloo")`) runs on this machine in two modes:

  gloo    torch's own gloo backend, env:// rendezvous (TCPStore on a free port), loopback TCP
  proxy   the interposed `singularity` backend (PYTHONPATH hook, SINGULARITY_PROXY=1): every
          collective goes through fresh `singularity-proxy` daemons, one per "device", that this
          benchmark starts (file rendezvous, mesh over 127.0.0.1), configures and stops by PID

For each model width (--hidden) and round, both modes run back to back, in alternating order (gloo
first in odd rounds, proxy first in even ones), so slow drift of a shared machine hits both alike.
A run does --warmup steps, then --steps timed steps (each rank times zero_grad + forward + backward +
optimizer step with perf_counter), then --compute-steps steps under DDP's no_sync() (the same
computation without gradient allreduce, between untimed barriers): the compute-only baseline.
The proxies' statistics are read just before and just after the timed steps, while the workers wait
at a sync point, so the profile covers exactly the timed steps.

With `--device cuda` the model trains on GPUs (a rank gets the GPU of its proxy, proxy i on GPU
i mod the GPUs there are, through CUDA_VISIBLE_DEVICES), the script calls
`init_process_group("nccl")`, the baseline mode is NCCL (one GPU per rank: --proxies = --world-size),
and the proxies run the `cuda` backend (ranks of one GPU take turns). `--modes proxy` runs the proxy
mode alone, for placements the baseline cannot run (two ranks time-sliced on one GPU).

Reported: per mode the median step time over rounds (each run's figure is the median over all ranks'
steps), the ratio proxy / gloo (of those medians, and the median of the per-round ratios), the mean
step time (throughput) too, and the proxies' profile per step. Needs root (the proxies' control
socket is root-only). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKLOAD = Path(__file__).resolve().with_name("ddp_workload.py")
GLOO, PROXY = "gloo", "proxy"
BASELINE = {"cpu": "gloo", "cuda": "nccl"}  # the baseline mode's torch backend, by device
TARGET = 1.03  # the design target for proxy / gloo step time
POLL_S = 0.005
STOP_WAIT_S = 10.0
HOOK_VARS = ("SINGULARITY_PROXY", "SINGULARITY_JOB_ID", "SINGULARITY_RANK_DIR", "PYTHONPATH")


def rank_socket_dir() -> str:
    """Where the proxies (run with the configuration's paths.state_dir) put their rank sockets."""
    from singularity_slurm.config import load
    from singularity_slurm.proxy.ranksock import rank_dir

    return str(rank_dir(load().paths.state_dir))


class BenchmarkError(Exception):
    """A run failed or cannot start; the message says why (and where its logs are)."""


# --- settings ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Settings:
    world_size: int
    proxies: int
    sizes: tuple[int, ...]
    layers: int
    batch: int
    steps: int
    warmup: int
    compute_steps: int
    rounds: int
    bucket_mb: float
    run_timeout: float
    python: str
    proxy_cmd: tuple[str, ...]
    device: str = "cpu"
    modes: tuple[str, ...] = (GLOO, PROXY)
    gpus: int = 0  # GPUs this machine has (--device cuda)
    shared_memory: bool = True  # the proxies' proxy.shared_memory
    gpu_swap: str | None = None  # the proxies' proxy.gpu_swap (None: the configuration's)
    device_mb: int = 0  # GPU memory each rank holds besides its model (--device cuda)
    gpu_swap_reserve_mib: int | None = None  # the proxies' proxy.gpu_swap_reserve_mib
    gpu_buffers: bool = True  # the proxies' proxy.gpu_buffers

    @property
    def baseline(self) -> str:
        return BASELINE[self.device]

    def backend_name(self, mode: str) -> str:
        """What dist.get_backend() says in each mode."""
        return self.baseline if mode == GLOO else "singularity"


def placement(world_size: int, proxies: int) -> dict[int, str]:
    """Rank -> proxy id: contiguous blocks of ranks, as a node's local ranks fill its devices."""
    return {r: f"p{r * proxies // world_size}" for r in range(world_size)}


def plan(settings: Settings) -> list[tuple[int, int, str]]:
    """(round, hidden, mode) in run order: per size both modes back to back, alternating which first."""
    runs = []
    for rnd in range(1, settings.rounds + 1):
        order = [m for m in ((GLOO, PROXY) if rnd % 2 else (PROXY, GLOO)) if m in settings.modes]
        for hidden in settings.sizes:
            runs += [(rnd, hidden, mode) for mode in order]
    return runs


def parse_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(dict.fromkeys(int(part) for part in text.split(",") if part.strip()))
    except ValueError as exc:
        raise BenchmarkError(f"--hidden takes widths, comma-separated (e.g. 256,1024), not {text!r}") from exc
    if not sizes or any(s < 1 for s in sizes):
        raise BenchmarkError(f"--hidden needs at least one width >= 1, got {text!r}")
    return sizes


def settings_problems(s: Settings) -> list[str]:
    found = []
    if s.world_size < 1:
        found.append("--world-size must be at least 1")
    if not 1 <= s.proxies <= s.world_size:
        found.append("--proxies must be between 1 and --world-size")
    if not s.modes or set(s.modes) - {GLOO, PROXY}:
        found.append(f"--modes takes {GLOO} (the baseline) and/or {PROXY}")
    if s.device == "cuda" and s.gpus < 1:
        found.append("--device cuda needs a GPU this Python's torch can use (torch.cuda.device_count() is 0)")
    elif s.device == "cuda" and GLOO in s.modes and (s.proxies != s.world_size or s.world_size > s.gpus):
        found.append(f"NCCL, the baseline with --device cuda, runs one rank per GPU: --proxies must equal "
                     f"--world-size and {s.gpus} GPU(s) hold at most {s.gpus} ranks; use --modes {PROXY} "
                     f"to measure ranks that share a GPU")
    if s.steps < 1 or s.rounds < 1:
        found.append("--steps and --rounds must be at least 1")
    if s.warmup < 0 or s.compute_steps < 0:
        found.append("--warmup and --compute-steps must be >= 0")
    if s.device_mb < 0 or (s.device_mb and s.device != "cuda"):
        found.append("--device-mb takes MiB >= 0 of GPU memory, with --device cuda")
    return found


# --- one run -----------------------------------------------------------------------------------

@dataclass
class Run:
    """One run of the workload in one mode: per-rank figures and, in proxy mode, the proxies' stats."""

    round: int
    hidden: int
    mode: str
    position: int  # 1: ran first of its pair, 2: second
    params: int = 0
    grad_bytes: int = 0
    step_ms: float = 0.0  # median over all ranks' timed steps
    mean_step_ms: float = 0.0  # timed loop / steps, averaged over ranks (throughput)
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    optimizer_ms: float = 0.0
    compute_step_ms: float | None = None  # median of the no_sync steps
    compute_backward_ms: float | None = None
    rank_step_ms: list[float] = field(default_factory=list)  # median per rank
    rank0_steps_ms: list[float] = field(default_factory=list)
    loss: float = 0.0
    wall_s: float = 0.0  # the whole run: start of the processes to their exit
    proxy_stats: dict[str, dict] = field(default_factory=dict)  # proxy id -> stats of the timed steps


def _median_ms(values: Sequence[float]) -> float:
    return round(1000 * statistics.median(values), 4)


def summarize_ranks(run: Run, ranks: Sequence[Mapping]) -> Run:
    def pooled(key: str) -> list[float]:
        return [v for r in ranks for v in r[key]]

    run.params, run.grad_bytes = int(ranks[0]["params"]), int(ranks[0]["grad_bytes"])
    run.step_ms = _median_ms(pooled("step_s"))
    run.mean_step_ms = round(1000 * statistics.fmean(r["loop_s"] / len(r["step_s"]) for r in ranks), 4)
    run.forward_ms, run.backward_ms, run.optimizer_ms = (_median_ms(pooled(k)) for k in
                                                         ("forward_s", "backward_s", "optimizer_s"))
    if ranks[0]["compute_step_s"]:
        run.compute_step_ms = _median_ms(pooled("compute_step_s"))
        run.compute_backward_ms = _median_ms(pooled("compute_backward_s"))
    run.rank_step_ms = [_median_ms(r["step_s"]) for r in ranks]
    run.rank0_steps_ms = [round(1000 * v, 4) for v in ranks[0]["step_s"]]
    run.loss = float(ranks[0]["loss"])
    return run


def stats_delta(before: Mapping[str, object], after: Mapping[str, object]) -> dict[str, dict[str, float]]:
    """What a proxy's `stats` counters grew by between two snapshots (op -> counter -> amount)."""
    delta: dict[str, dict[str, float]] = {}
    for op, values in after.items():
        if not isinstance(values, dict):
            continue
        old = before.get(op) or {}
        assert isinstance(old, dict)
        grown = {k: float(v) - float(old.get(k, 0.0)) for k, v in values.items()}
        if any(grown.values()):
            delta[op] = grown
    return delta


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def hook_dir() -> Path:
    import singularity_slurm.interpose

    return Path(singularity_slurm.interpose.__file__).resolve().parent / "pyhook"


class Runner:
    """Starts and watches one run's processes; stops whatever it started, by PID."""

    def __init__(self, settings: Settings, workdir: Path, say: Callable[[str], None]):
        self.s, self.workdir, self.say = settings, workdir, say
        self.live: list[subprocess.Popen] = []

    # --- processes ------------------------------------------------------------------------------

    def spawn(self, argv: list[str], env: Mapping[str, str], log: Path) -> subprocess.Popen:
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, env=dict(env), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.live.append(proc)
        return proc

    def stop(self, procs: Sequence[subprocess.Popen], sig: int = signal.SIGTERM) -> None:
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + STOP_WAIT_S
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(f"pid {proc.pid} did not stop on signal {sig}; killing it")
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        self.live = [p for p in self.live if p not in procs]

    def stop_all(self) -> None:
        if self.live:
            self.stop(list(self.live))

    # --- environment ----------------------------------------------------------------------------

    def base_env(self, rank: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in HOOK_VARS}
        env.update(RANK=str(rank), WORLD_SIZE=str(self.s.world_size), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(self.s.world_size), MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # both modes talk over loopback
        if self.s.device == "cuda":
            proxies = list(dict.fromkeys(placement(self.s.world_size, self.s.proxies).values()))
            mine = proxies.index(placement(self.s.world_size, self.s.proxies)[rank])
            env["CUDA_VISIBLE_DEVICES"] = str(mine % self.s.gpus)  # its proxy's GPU, as Slurm gives it
        return env

    def start_proxies(self, folder: Path, job_id: int) -> dict[str, tuple[subprocess.Popen, Path]]:
        places = placement(self.s.world_size, self.s.proxies)
        proxies: dict[str, tuple[subprocess.Popen, Path]] = {}
        for pid in dict.fromkeys(places.values()):
            sock = folder / f"{pid}.sock"
            argv = [*self.s.proxy_cmd, "--job-id", str(job_id), "--uid", str(os.getuid()), "--id", pid,
                    "--socket", str(sock), "--rendezvous-dir", str(folder / "rendezvous"),
                    "--advertise", "127.0.0.1", "--backend", "cuda" if self.s.device == "cuda" else "host"]
            if self.s.gpu_swap:
                argv += ["--gpu-swap", self.s.gpu_swap]
            env = dict(os.environ)
            settings = ([] if self.s.shared_memory else ["shared_memory = false"]) + (
                [] if self.s.gpu_swap_reserve_mib is None else
                [f"gpu_swap_reserve_mib = {self.s.gpu_swap_reserve_mib}"]) + (
                [] if self.s.gpu_buffers else ["gpu_buffers = false"])
            if settings:  # the proxies read the configuration this names
                config = folder / "proxy-config.toml"
                config.write_text("[proxy]\n" + "".join(f"{line}\n" for line in settings))
                env["SINGULARITY_CONFIG"] = str(config)
            proxies[pid] = (self.spawn(argv, env, folder / f"{pid}.log"), sock)
        deadline = time.monotonic() + 30
        for pid, (proc, sock) in proxies.items():
            while not sock.exists():
                if proc.poll() is not None:
                    raise BenchmarkError(f"proxy {pid} exited with {proc.returncode}: "
                                         f"{tail(folder / f'{pid}.log')}")
                if time.monotonic() > deadline:
                    raise BenchmarkError(f"proxy {pid} did not listen on {sock} within 30s")
                time.sleep(POLL_S)
        from singularity_slurm import rpc

        config = {"op": "configure", "generation": "1", "placement": {str(r): p for r, p in places.items()}}
        for pid, (_proc, sock) in proxies.items():
            try:
                rpc.call(sock, config, timeout=30, service=f"proxy {pid}")
            except rpc.RpcError as exc:
                raise BenchmarkError(f"proxy {pid} refused its configuration: {exc}") from exc
        return proxies

    # --- the run --------------------------------------------------------------------------------

    def run(self, rnd: int, hidden: int, mode: str, position: int) -> Run:
        from singularity_slurm.rpc import call

        folder = self.workdir / f"round{rnd}-h{hidden}-{mode}"
        folder.mkdir(parents=True)
        started = time.monotonic()
        proxies: dict[str, tuple[subprocess.Popen, Path]] = {}
        workers: list[subprocess.Popen] = []
        try:
            envs = [self.base_env(r) for r in range(self.s.world_size)]
            if mode == PROXY:
                job_id = random.randint(10**8, 10**9)  # a fresh rank socket folder per run
                proxies = self.start_proxies(folder, job_id)
                for env in envs:
                    env.update(SINGULARITY_PROXY="1", PYTHONPATH=str(hook_dir()),
                               SINGULARITY_JOB_ID=str(job_id), MASTER_PORT="1",
                               SINGULARITY_RANK_DIR=rank_socket_dir())
            else:
                port = str(free_port())
                for env in envs:
                    env["MASTER_PORT"] = port
            s = self.s
            argv = [s.python, str(WORKLOAD), "--sync-dir", str(folder), "--hidden", str(hidden),
                    "--layers", str(s.layers), "--batch", str(s.batch), "--steps", str(s.steps),
                    "--warmup", str(s.warmup), "--compute-steps", str(s.compute_steps),
                    "--bucket-mb", str(s.bucket_mb), "--device", s.device, "--device-mb", str(s.device_mb)]
            workers = [self.spawn(argv, env, folder / f"rank-{r}.log") for r, env in enumerate(envs)]
            deadline = started + self.s.run_timeout
            snapshots: list[dict[str, dict]] = []
            for point in ("warm", "timed"):
                self.await_file(folder / f"{point}.ready", workers, deadline, folder)
                if proxies:
                    snapshots.append({pid: call(sock, {"op": "stats"}, timeout=30)
                                      for pid, (_proc, sock) in proxies.items()})
                (folder / f"{point}.go").touch()
            for r, proc in enumerate(workers):
                try:
                    code = proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired as exc:
                    raise BenchmarkError(f"rank {r} still running after --run-timeout "
                                         f"{self.s.run_timeout:.0f}s (logs: {folder})") from exc
                if code != 0:
                    raise BenchmarkError(f"rank {r} exited with {code}: {tail(folder / f'rank-{r}.log')}")
        finally:
            self.stop(workers, signal.SIGKILL)  # only the ones still running: a failed run
            self.stop([proc for proc, _sock in proxies.values()])
        wall = time.monotonic() - started
        ranks = [json.loads((folder / f"rank-{r}.json").read_text()) for r in range(self.s.world_size)]
        wrong = {r["backend"] for r in ranks} - {self.s.backend_name(mode)}
        if wrong:
            why = "did not load" if mode == PROXY else "leaked into the baseline run"
            raise BenchmarkError(f"{mode} run used backend {wrong}, not {self.s.backend_name(mode)}: the "
                                 f"proxy hook {why}")
        broken = [r["rank"] for r in ranks if r.get("ballast_intact") is False]
        if broken:
            raise BenchmarkError(f"{mode} run: the GPU memory of rank(s) {broken} (--device-mb) changed "
                                 "while they ran: it did not come back as it went out")
        run = summarize_ranks(Run(rnd, hidden, mode, position, wall_s=round(wall, 2)), ranks)
        if snapshots:
            before, after = snapshots
            run.proxy_stats = {pid: stats_delta(before[pid], after[pid]) for pid in after}
        return run

    @staticmethod
    def await_file(path: Path, workers: Sequence[subprocess.Popen], deadline: float, folder: Path) -> None:
        while not path.exists():
            for r, proc in enumerate(workers):
                if proc.poll() is not None:
                    raise BenchmarkError(f"rank {r} exited with {proc.returncode} before {path.name}: "
                                         f"{tail(folder / f'rank-{r}.log')}")
            if time.monotonic() > deadline:
                raise BenchmarkError(f"no {path.name} within --run-timeout (logs: {folder})")
            time.sleep(POLL_S)


def tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


# --- results -----------------------------------------------------------------------------------

def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


@dataclass(frozen=True)
class Summary:
    """One model width: both modes' medians over rounds, and their ratios."""

    hidden: int
    params: int
    grad_mib: float
    rounds: int
    gloo_ms: float | None
    proxy_ms: float | None
    ratio: float | None  # proxy_ms / gloo_ms
    round_ratio: float | None  # median of the per-round ratios
    round_ratios: list[float]
    gloo_mean_ms: float | None
    proxy_mean_ms: float | None
    mean_ratio: float | None
    compute_ms: float | None  # no_sync step, median over both modes' runs
    gloo_parts_ms: dict[str, float | None]
    proxy_parts_ms: dict[str, float | None]
    gloo_losses: list[float]  # the distinct final losses on rank 0 of this width's runs, per mode:
    proxy_losses: list[float]  # one value each when every run of a mode computed the same thing


PARTS = ("forward_ms", "backward_ms", "optimizer_ms", "compute_backward_ms")


def summarize(runs: Sequence[Run], sizes: Sequence[int]) -> list[Summary]:
    rows = []
    for hidden in sizes:
        mine = [r for r in runs if r.hidden == hidden]
        if not mine:
            continue
        by_mode = {m: [r for r in mine if r.mode == m] for m in (GLOO, PROXY)}
        rounds = sorted({r.round for r in mine})
        pairs = {rnd: {r.mode: r for r in mine if r.round == rnd} for rnd in rounds}
        round_ratios = [round(p[PROXY].step_ms / p[GLOO].step_ms, 4) for p in pairs.values()
                        if GLOO in p and PROXY in p]
        gloo = _median([r.step_ms for r in by_mode[GLOO]])
        proxy = _median([r.step_ms for r in by_mode[PROXY]])
        gloo_mean = _median([r.mean_step_ms for r in by_mode[GLOO]])
        proxy_mean = _median([r.mean_step_ms for r in by_mode[PROXY]])
        rows.append(Summary(
            hidden, mine[0].params, round(mine[0].grad_bytes / 2**20, 2), len(rounds), gloo, proxy,
            _ratio(proxy, gloo), _median(round_ratios), round_ratios, gloo_mean, proxy_mean,
            _ratio(proxy_mean, gloo_mean), _median([r.compute_step_ms for r in mine]),
            {p: _median([getattr(r, p) for r in by_mode[GLOO]]) for p in PARTS},
            {p: _median([getattr(r, p) for r in by_mode[PROXY]]) for p in PARTS},
            sorted({r.loss for r in by_mode[GLOO]}), sorted({r.loss for r in by_mode[PROXY]})))
    return rows


@dataclass(frozen=True)
class OpProfile:
    """One operation on the proxies during the timed steps, per training step (median over runs);
    op "all" sums the operations and gives the mesh traffic."""

    hidden: int
    op: str
    calls_per_rank: float  # calls each rank made per step
    rank_ms: float  # a rank's time inside the proxy per step: its calls, from admission to the answer
    skew_ms: float  # per proxy: first local rank arrived -> last one arrived, summed over the calls
    exchange_ms: float  # per proxy: mesh exchange + reduction (+ copies into numpy) of the calls
    payload_mib: float  # per rank and step: the data of its calls
    mesh_mib: float | None = None  # per proxy and step: bytes sent to other proxies (op "all" only)


def _op_figures(stats: Sequence[Mapping[str, float]], settings: Settings) -> tuple[float, ...]:
    """(calls/rank, rank ms, skew ms/proxy, exchange ms/proxy, payload MiB/rank), per step."""
    def total(key: str) -> float:
        return sum(s.get(key, 0.0) for s in stats)

    steps, world, proxies = settings.steps, settings.world_size, len(stats)
    return (total("count") / world / steps, 1000 * total("seconds") / world / steps,
            1000 * total("skew_seconds") / proxies / steps,
            1000 * total("exchange_seconds") / proxies / steps, total("bytes") / proxies / steps / 2**20)


def profile(runs: Sequence[Run], settings: Settings) -> list[OpProfile]:
    out = []
    for hidden in settings.sizes:
        mine = [r for r in runs if r.hidden == hidden and r.mode == PROXY and r.proxy_stats]
        if not mine:
            continue
        ops = sorted({op for r in mine for stats in r.proxy_stats.values() for op in stats if op != "mesh"})
        per_op: dict[str, list[tuple[float, ...]]] = {op: [] for op in ops}
        totals: list[tuple[float, ...]] = []
        for r in mine:
            figures = {op: _op_figures([s.get(op, {}) for s in r.proxy_stats.values()], settings)
                       for op in ops}
            for op in ops:
                per_op[op].append(figures[op])
            mesh = sum(s.get("mesh", {}).get("bytes_sent", 0.0) for s in r.proxy_stats.values())
            totals.append((*(sum(col) for col in zip(*figures.values(), strict=True)),
                           mesh / len(r.proxy_stats) / settings.steps / 2**20))
        for op in ops:
            out.append(OpProfile(hidden, op, *(round(statistics.median(col), 4)
                                               for col in zip(*per_op[op], strict=True))))
        out.append(OpProfile(hidden, "all", *(round(statistics.median(col), 4)
                                              for col in zip(*totals, strict=True))))
    return out


def loss_check(s: Summary, baseline: str = "gloo") -> str:
    """Each mode should repeat itself exactly; the modes differ only by the order of float sums."""
    def show(losses: Sequence[float]) -> str:
        return "none" if not losses else " / ".join(f"{v:.7g}" for v in losses)

    text = f"hidden {s.hidden}: {baseline} {show(s.gloo_losses)}, proxy {show(s.proxy_losses)}"
    if len(s.gloo_losses) == 1 and len(s.proxy_losses) == 1:
        g, p = s.gloo_losses[0], s.proxy_losses[0]
        text += " (identical)" if g == p else f" (relative difference {abs(p - g) / abs(g or 1):.1e})"
    return text


def _f(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def format_report(meta: Mapping[str, object], summary: Sequence[Summary], prof: Sequence[OpProfile],
                  runs: Sequence[Run], baseline: str = "gloo") -> str:
    b = baseline
    lines = [f"# DDP step time: Singularity proxy vs {b}", "",
             ", ".join(f"{k} {v}" for k, v in meta.items()), "",
             f"| hidden | params | gradients MiB | {b} ms | proxy ms | proxy / {b} | median of round ratios "
             f"| {b} mean ms | proxy mean ms | mean ratio | compute-only ms |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summary:
        lines.append(f"| {s.hidden} | {s.params:,} | {s.grad_mib:.2f} | {_f(s.gloo_ms)} | {_f(s.proxy_ms)} | "
                     f"{_f(s.ratio, 3)} | {_f(s.round_ratio, 3)} | {_f(s.gloo_mean_ms)} | "
                     f"{_f(s.proxy_mean_ms)} | {_f(s.mean_ratio, 3)} | {_f(s.compute_ms)} |")
    verdicts = "; ".join(f"hidden {s.hidden}: {_f(s.ratio, 3)} "
                         f"({'met' if s.ratio is not None and s.ratio <= TARGET else 'not met'})"
                         for s in summary)
    same = "; ".join(loss_check(s, b) for s in summary)
    lines += ["", f"Design target: proxy / {b} <= {TARGET}. {verdicts}.", "",
              f"Final loss on rank 0 (sanity check: same training in both modes): {same}.", "",
        "Where a step goes (medians, ms): backward includes DDP's gradient allreduce; comm wait = backward "
        "- backward of the compute-only (no_sync) steps of the same runs.", "",
        "| hidden | mode | step | forward | backward | optimizer | compute-only backward | comm wait |",
        "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for s in summary:
        for mode, step, parts in ((b, s.gloo_ms, s.gloo_parts_ms), (PROXY, s.proxy_ms, s.proxy_parts_ms)):
            lines.append(f"| {s.hidden} | {mode} | {_f(step)} | {_f(parts['forward_ms'])} | "
                         f"{_f(parts['backward_ms'])} | {_f(parts['optimizer_ms'])} | "
                         f"{_f(parts['compute_backward_ms'])} | "
                         f"{_f(_minus(parts['backward_ms'], parts['compute_backward_ms']))} |")
    if prof:
        lines += ["", "Proxy profile of the timed steps (per training step, median over the proxy runs):", "",
                  "| hidden | op | calls / rank | rank time in proxy ms | skew ms / proxy "
                  "| exchange ms / proxy | payload MiB / rank | mesh MiB sent / proxy |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|"]
        for p in prof:
            mesh = "" if p.mesh_mib is None else f"{p.mesh_mib:.2f}"
            lines.append(f"| {p.hidden} | {p.op} | {p.calls_per_rank:.2f} | {p.rank_ms:.2f} | "
                         f"{p.skew_ms:.2f} | {p.exchange_ms:.2f} | {p.payload_mib:.2f} | {mesh} |")
    lines += ["", "Per run (median step ms; order: which mode ran first in the pair):", "",
              f"| round | hidden | {b} ms | proxy ms | ratio | first | {b} run s | proxy run s |",
              "|---:|---:|---:|---:|---:|---|---:|---:|"]
    for rnd in sorted({r.round for r in runs}):
        for hidden in dict.fromkeys(r.hidden for r in runs):
            pair = {r.mode: r for r in runs if r.round == rnd and r.hidden == hidden}
            if not pair:
                continue
            g, p = pair.get(GLOO), pair.get(PROXY)
            first = next((r.mode for r in pair.values() if r.position == 1), "").replace(GLOO, b)
            lines.append(f"| {rnd} | {hidden} | {_f(g.step_ms if g else None)} | "
                         f"{_f(p.step_ms if p else None)} | "
                         f"{_f(_ratio(p.step_ms, g.step_ms) if g and p else None, 3)} | {first} | "
                         f"{_f(g.wall_s if g else None, 1)} | {_f(p.wall_s if p else None, 1)} |")
    lines += ["", *(f"- {d.format(baseline=b)}" for d in DEFINITIONS), ""]
    return "\n".join(lines)


DEFINITIONS = [
    "step: zero_grad + forward + backward + optimizer step of one rank, perf_counter; a run's figure is "
    "the median over all ranks' timed steps, a mode's the median over rounds; proxy / {baseline} is the "
    "ratio of those; the median of round ratios pairs the two modes' runs of the same round",
    "mean: the timed loop's length / steps, averaged over ranks (throughput; includes slow outliers)",
    "compute-only: the same step under DDP's no_sync() (no gradient allreduce), ranks kept in step by "
    "untimed barriers; median over both modes' runs",
    "rank time in proxy: from the proxy admitting a rank's request to its answer, summed over the calls "
    "of a step (waiting for the other local ranks and the other proxies included); it does not include "
    "the worker's side (copies into and out of shared memory, the unix-socket round trip, Python in the "
    "worker): comm wait - rank time in proxy estimates that",
    "skew: on each proxy, first local rank arrived -> last arrived; exchange: the collective once all "
    "local ranks are there (mesh send/receive, numpy reduction, copies), before results are written back",
    "final loss: {baseline} sums a gradient in its own order (a ring), the proxies in rank order, so the "
    "sums can differ in "
    "the last bits and the steps carry that into the loss; each mode must repeat itself exactly",
    "everything runs on this one machine: the workers, the proxies and {baseline} share its cores, so "
    "the figures show this machine's balance of compute and communication, not a cluster's; compare the "
    "modes of one run, not runs on different machines",
]


# --- the driver --------------------------------------------------------------------------------

def _say(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _git_commit() -> str:
    proc = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=False)
    return proc.stdout.strip() or "unknown"


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as it is written, and every option's default."""


def _env(name: str, default: object) -> str:
    return os.environ.get(f"BENCH_{name.upper()}", str(default))


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=_HelpFormatter,
        epilog="Every option can also be set as BENCH_<OPTION> (e.g. BENCH_ROUNDS=5, BENCH_HIDDEN=512). "
               "The report (Markdown on stdout, or JSON with --json) is also written to "
               "--results-dir/proxy_vs_gloo-DATE-TIME.md and .json; progress goes to stderr. "
               "Exit status: 0 ok, 1 a run failed (the report has the runs before it), 2 bad options, "
               "130 interrupted.")
    parser.add_argument("--world-size", type=int, default=int(_env("world_size", 4)),
                        help="ranks (processes)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=_env("device", "cpu"),
                        help="where the model trains: cpu (baseline gloo) or cuda (baseline NCCL, a GPU per "
                             "proxy, the proxies' cuda backend)")
    parser.add_argument("--shared-memory", choices=("on", "off"), default=_env("shared_memory", "on"),
                        help="the proxies' proxy.shared_memory: on, proxies of this host reduce from each "
                             "other's regions; off, they exchange over the mesh (loopback TCP)")
    parser.add_argument("--gpu-swap", choices=("auto", "always", "never"), default=_env("gpu_swap", None),
                        help="the proxies' proxy.gpu_swap (--device cuda): when a waiting rank's GPU memory "
                             "moves to host memory (default: the configuration's, auto)")
    parser.add_argument("--gpu-swap-reserve-mib", type=int, default=None,
                        help="the proxies' proxy.gpu_swap_reserve_mib: GPU memory auto keeps free beyond "
                             "what the next rank needs (set it near the GPU's size to have auto move memory "
                             "where ranks would fit)")
    parser.add_argument("--gpu-buffers", choices=("on", "off"), default=_env("gpu_buffers", "on"),
                        help="the proxies' proxy.gpu_buffers (--device cuda): on, a rank's allreduce goes "
                             "through a GPU buffer its proxy shares with it (offered where its memory never "
                             "moves: a GPU of its own, or --gpu-swap never); off, through host memory")
    parser.add_argument("--device-mb", type=int, default=int(_env("device_mb", 0)),
                        help="MiB of GPU memory each rank holds besides its model (--device cuda), so that "
                             "ranks sharing a GPU do not fit on it together")
    parser.add_argument("--modes", default=_env("modes", f"{GLOO},{PROXY}"),
                        help=f"modes to run, comma-separated: {GLOO} (the baseline backend, NCCL with "
                             f"--device cuda) and {PROXY}")
    parser.add_argument("--proxies", type=int, default=int(_env("proxies", 2)),
                        help="proxy daemons ('devices'); ranks are placed on them in contiguous blocks")
    parser.add_argument("--hidden", default=_env("hidden", "256,1024"),
                        help="MLP widths to measure, comma-separated (gradients: ~layers*hidden^2*4 bytes)")
    parser.add_argument("--layers", type=int, default=int(_env("layers", 3)), help="hidden Linear layers")
    parser.add_argument("--batch", type=int, default=int(_env("batch", 64)), help="samples per rank and step")
    parser.add_argument("--steps", type=int, default=int(_env("steps", 60)), help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=int(_env("warmup", 10)), help="untimed steps first")
    parser.add_argument("--compute-steps", type=int, default=int(_env("compute_steps", 10)),
                        help="compute-only (no_sync) steps per run, after the timed ones (0: none)")
    parser.add_argument("--rounds", type=int, default=int(_env("rounds", 3)),
                        help="rounds; each runs both modes at each width, alternating which goes first")
    parser.add_argument("--bucket-mb", type=float, default=float(_env("bucket_mb", 25.0)),
                        help="DDP bucket_cap_mb")
    parser.add_argument("--run-timeout", type=float, default=float(_env("run_timeout", 300.0)),
                        help="give up on one run after this many seconds")
    parser.add_argument("--workdir", type=Path, default=os.environ.get("BENCH_WORKDIR"),
                        help="folder for the runs' logs and sockets; by default a new temporary folder, "
                             "removed at the end unless --keep or a run failed")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--results-dir", type=Path,
                        default=Path(_env("results_dir", REPO / "benchmarks" / "results")),
                        help="where the report is written")
    parser.add_argument("--no-save", action="store_true", help="do not write the report files")
    parser.add_argument("--json", dest="as_json", action="store_true",
                        help="print JSON instead of the Markdown report")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    proxy_bin = Path(sys.executable).parent / "singularity-proxy"
    # installed: the venv's entry point; from a checkout (tests/gpu/run.sh): the module
    proxy_cmd = ((str(proxy_bin),) if os.access(proxy_bin, os.X_OK)
                 else (sys.executable, "-m", "singularity_slurm.proxy.daemon"))
    try:
        modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
        settings = Settings(args.world_size, args.proxies, parse_sizes(args.hidden), args.layers, args.batch,
                            args.steps, args.warmup, args.compute_steps, args.rounds, args.bucket_mb,
                            args.run_timeout, sys.executable, proxy_cmd, args.device, modes,
                            _gpus() if args.device == "cuda" else 0, args.shared_memory == "on",
                            args.gpu_swap, args.device_mb, args.gpu_swap_reserve_mib,
                            args.gpu_buffers == "on")
        if problems := settings_problems(settings):
            raise BenchmarkError("; ".join(problems))
        if os.geteuid() != 0:
            raise BenchmarkError("run it as root: the proxies' control socket only takes root")
        try:
            import singularity_slurm.proxy.daemon  # noqa: F401 - what the proxies run
        except ImportError as exc:
            raise BenchmarkError(f"the project is not importable ({exc}): run it with the project's "
                                 "venv python (/opt/singularity-slurm/venv/bin/python) after `make install`"
                                 ) from exc
        if not (hook_dir() / "sitecustomize.py").exists():
            raise BenchmarkError(f"no {hook_dir()}/sitecustomize.py: reinstall the package")
    except BenchmarkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    import torch

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="proxy_vs_gloo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    runs_planned = plan(settings)
    meta = {"date": stamp, "host": socket.gethostname(), "cpus": os.cpu_count(), "commit": _git_commit(),
            "python": platform.python_version(), "torch": torch.__version__,
            "device": settings.device, "world size": settings.world_size, "proxies": settings.proxies,
            "proxies share memory": args.shared_memory, "gpu swap": args.gpu_swap or "configured",
            "gpu buffers": args.gpu_buffers,
            "device MiB per rank": args.device_mb,
            "placement": " ".join(f"{r}:{p}" for r, p in
                                  placement(settings.world_size, settings.proxies).items()),
            "layers": settings.layers, "batch": settings.batch, "steps": settings.steps,
            "warmup": settings.warmup, "compute-only steps": settings.compute_steps,
            "rounds": settings.rounds, "bucket MB": settings.bucket_mb,
            "load average before": " ".join(f"{x:.2f}" for x in os.getloadavg())}
    runner = Runner(settings, workdir, _say)
    signal.signal(signal.SIGTERM, _interrupted)
    runs: list[Run] = []
    failed = False
    started = time.monotonic()
    try:
        previous: tuple[int, int] | None = None
        for i, (rnd, hidden, mode) in enumerate(runs_planned, 1):
            position = 2 if previous == (rnd, hidden) else 1
            previous = (rnd, hidden)
            run = runner.run(rnd, hidden, mode, position)
            runs.append(run)
            _say(f"run {i}/{len(runs_planned)}: round {rnd}, hidden {hidden}, {mode}: "
                 f"step {run.step_ms:.2f} ms "
                 f"(mean {run.mean_step_ms:.2f}, compute-only {_f(run.compute_step_ms)}), {run.wall_s:.1f}s")
    except KeyboardInterrupt:
        _say("interrupted")
        runner.stop_all()
        return 130
    except BenchmarkError as exc:
        _say(f"FAILED: {exc}")
        failed = True
    finally:
        runner.stop_all()
    meta["took"] = f"{time.monotonic() - started:.0f}s"
    if not runs:
        _say(f"nothing measured; logs in {workdir}")
        return 1

    summary = summarize(runs, settings.sizes)
    prof = profile(runs, settings)
    report = format_report(meta, summary, prof, runs, settings.baseline)
    data = {"meta": {k: str(v) for k, v in meta.items()}, "summary": [asdict(s) for s in summary],
            "profile": [asdict(p) for p in prof], "runs": [asdict(r) for r in runs]}
    print(json.dumps(data, indent=2) if args.as_json else report)
    if not args.no_save:
        args.results_dir.mkdir(parents=True, exist_ok=True)
        md_path = args.results_dir / f"proxy_vs_gloo-{stamp}.md"
        md_path.write_text(report)
        md_path.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
        _say(f"report: {md_path} (JSON: {md_path.with_suffix('.json')})")
    if failed or args.keep or args.workdir:
        _say(f"runs' logs: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
