"""Preemption under pressure: several jobs of each node preempted at once, with the node's dump
slots (`preemption.concurrent_dumps`) at each of the given values, and the waiting trees frozen or
training on (`preemption.freeze_waiting`), side by side in one run.

Per round, the job user submits --jobs-per-node basic jobs to each of --nodes (the reference
workload, examples/train_reference.py, one GPU each, --ballast MiB of memory each) under
`singularityctl run`; once every one has printed step --preempt-at, a premium job that takes
every GPU of those nodes preempts them all at once. Each job's output file is polled every 0.1 s:

  warning -> stopped   its "preemption warning" line -> its "requeued" line (checkpoint, commit
                       and requeue done); a job without that line was killed at the end of
                       GraceTime, its checkpoint missed
  waited               the seconds its checkpoint waited for a dump slot of its node (the
                       launcher's commit line)
  checkpoint s         the commit line's own figure (the dump and its storing, not the wait)
  missed               jobs whose "requeued" line came later than warn_time after their warning,
                       or never

and for the round, from the premium job's submission: the last job stopped, and the premium job
RUNNING. The requeued jobs are cancelled after each round (they are not restored here; see
checkpoint_restore.py for restores). The configuration file's concurrent_dumps and freeze_waiting
are set for each round
(agents read it when a job starts) and put back as it was at the end. Run as root on an
otherwise idle dev cluster; see benchmarks/README.md.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import signal
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_restore import (  # noqa: E402 - the same helpers as the checkpoint benchmark's
    REPO,
    STEP,
    WARNING,
    CannotStart,
    _git_commit,
    _interrupted,
    _say,
)

from singularity_slurm import config as config_mod  # noqa: E402
from singularity_slurm.errors import SingularityError  # noqa: E402
from singularity_slurm.slurmcli import SlurmClient  # noqa: E402

POLL_S = 0.1
REQUEUED = re.compile(r"^\[singularity\] .*: requeued$")
COMMITTED = re.compile(r"^\[singularity\] .*: checkpoint \d+ committed in ([\d.]+)s: .*?"
                       r"(?:; waited ([\d.]+)s for a dump slot of the node)?$")
FAILED = re.compile(r"^\[singularity\] .*: checkpoint failed: (.*)$")
SETTING = r"^{}\s*=.*$"


@dataclass
class JobRun:
    """One preempted job of a round, as its output file tells."""

    job_id: int
    node: str
    output: Path
    last_step: int = 0
    warned_at: float | None = None
    committed_s: float | None = None
    waited_s: float = 0.0
    stopped_at: float | None = None
    failure: str = ""

    def read(self, now: float) -> None:
        try:
            lines = self.output.read_text(errors="replace").split("\n")[:-1]
        except FileNotFoundError:
            return
        for line in lines:
            if m := STEP.match(line):
                self.last_step = max(self.last_step, int(m[1]))
            elif WARNING.match(line) and self.warned_at is None:
                self.warned_at = now
            elif (m := COMMITTED.match(line)) and self.committed_s is None:
                self.committed_s, self.waited_s = float(m[1]), float(m[2] or 0.0)
            elif REQUEUED.match(line) and self.stopped_at is None:
                self.stopped_at = now
            elif m := FAILED.match(line):
                self.failure = m[1]

    def stop_s(self) -> float | None:
        if self.warned_at is None or self.stopped_at is None:
            return None
        return round(self.stopped_at - self.warned_at, 2)


@dataclass
class Round:
    slots: int
    frozen: bool = True  # the trees that wait for a slot are frozen meanwhile
    jobs: list[JobRun] = field(default_factory=list)
    premium_id: int | None = None
    all_stopped_s: float | None = None  # premium submitted -> the last job's "requeued" line
    premium_running_s: float | None = None
    note: str = ""


def missed(job: JobRun, warn_time: int) -> bool:
    """Whether the job's checkpoint and requeue did not end within warn_time of its warning."""
    stop = job.stop_s()
    return stop is None or stop > warn_time


def spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.1f} / {max(values):.1f}" if values else "n/a"


def summary_row(r: Round, warn_time: int) -> dict[str, object]:
    stops = [s for j in r.jobs if (s := j.stop_s()) is not None]
    saves = [j.committed_s for j in r.jobs if j.committed_s is not None]
    return {
        "concurrent_dumps": r.slots or "no limit", "waiting": _waiting(r), "jobs": len(r.jobs),
        "warning -> stopped: median / max s": spread(stops),
        "waited: median / max s": spread([j.waited_s for j in r.jobs]),
        "checkpoint: median / max s": spread(saves),
        "missed warn_time": sum(missed(j, warn_time) for j in r.jobs),
        "premium submitted -> all stopped s": _num(r.all_stopped_s),
        "premium submitted -> running s": _num(r.premium_running_s),
        "note": r.note,
    }


def _waiting(r: Round) -> str:
    return "n/a" if not r.slots else "frozen" if r.frozen else "training"


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def format_report(meta: dict[str, object], rounds: Sequence[Round], warn_time: int) -> str:
    rows = [summary_row(r, warn_time) for r in rounds]
    head = list(rows[0]) if rows else []
    lines = ["# Preemption under pressure", "", ", ".join(f"{k} {v}" for k, v in meta.items()), "",
             "| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    lines += ["| " + " | ".join(str(v).replace("|", "/") for v in row.values()) + " |" for row in rows]
    lines += ["", "Per job (warning -> stopped s, waited s, checkpoint s):", ""]
    for r in rounds:
        per = ", ".join(f"{j.job_id}@{j.node} {_num(j.stop_s())}/{j.waited_s:.1f}/{_num(j.committed_s)}"
                        for j in sorted(r.jobs, key=lambda j: (j.stopped_at or 1e18)))
        lines.append(f"- concurrent_dumps {r.slots or 'no limit'}, waiting {_waiting(r)}: {per}")
    lines += ["", f"- a job misses when its \"requeued\" line comes more than warn_time ({warn_time}s) "
              "after its warning, or never (Slurm killed it at the end of GraceTime)",
              "- times are taken by the benchmark polling every 0.1 s; compare rows of one run", ""]
    return "\n".join(lines)


def training_script(ctl: str, python: str, node: str, steps: int, sleep: float, ballast: int) -> str:
    return (f"#!/bin/bash\n#SBATCH --singularity-sla=basic\n#SBATCH --gres=gpu:1\n#SBATCH -w {node}\n"
            f"#SBATCH -o train-%j.out\n"
            f"exec {ctl} run -- {python} train_reference.py --steps {steps} --sleep {sleep}"
            + (f" --ballast-mb {ballast}" if ballast else "") + "\n")


def premium_script(nodes: Sequence[str], gpus: int) -> str:
    return (f"#!/bin/bash\n#SBATCH --singularity-sla=premium\n#SBATCH -N {len(nodes)}\n"
            f"#SBATCH -w {','.join(nodes)}\n#SBATCH --gres=gpu:{gpus}\n#SBATCH -o premium-%j.out\nsleep 5\n")


def set_preemption(text: str, **settings: int | bool) -> str:
    """The configuration file's text with these keys of [preemption] set."""
    for key, value in settings.items():
        shown = str(value).lower() if isinstance(value, bool) else str(value)
        line, pattern = f"{key} = {shown}", re.compile(SETTING.format(key), re.M)
        if pattern.search(text):
            text = pattern.sub(line, text, count=1)
        elif re.search(r"^\[preemption\]\s*$", text, re.M):
            text = re.sub(r"^\[preemption\]\s*$", f"[preemption]\n{line}", text, count=1, flags=re.M)
        else:
            text = text.rstrip("\n") + f"\n\n[preemption]\n{line}\n"
    return text


def parse_round(text: str) -> tuple[int, bool]:
    """(concurrent_dumps, freeze_waiting) of a round given as N or N/training."""
    number, _, waiting = text.partition("/")
    slots = int(number)
    if not 0 <= slots <= 1024 or waiting not in ("", "training"):
        raise ValueError(text)
    return slots, waiting != "training"


class Bench:
    def __init__(self, slurm: SlurmClient, user: str, folder: Path, say: Callable[[str], None]):
        self.slurm, self.user, self.folder, self.say = slurm, pwd.getpwnam(user), folder, say
        self.active: set[int] = set()

    def submit(self, name: str, text: str) -> int:
        script = self.folder / name
        script.write_text(text)
        os.chown(script, self.user.pw_uid, self.user.pw_gid)
        job = self.slurm.submit(str(script), (), user=self.user.pw_name, cwd=str(self.folder))
        self.active.add(job)
        return job

    def cancel_all(self) -> None:
        if self.active:
            self.slurm.run(["scancel", *map(str, sorted(self.active))], check=False)
        self.active.clear()

    def idle(self, timeout: float) -> None:
        limit = time.monotonic() + timeout
        while any(r.get("JobState") in ("RUNNING", "PENDING", "COMPLETING", "REQUEUED")
                  for r in self.slurm.jobs()):
            if time.monotonic() > limit:
                raise CannotStart("the dev cluster's jobs did not end after the round")
            time.sleep(0.5)

    def round(self, slots: int, frozen: bool, nodes: Sequence[str], per_node: int, gpus: int, steps: int,
              sleep: float, ballast: int, preempt_at: int, timeout: float, ctl: str, python: str) -> Round:
        result = Round(slots, frozen)
        for node in nodes:
            for _ in range(per_node):
                script = training_script(ctl, python, node, steps, sleep, ballast)
                job = self.submit(f"train-{node}.sh", script)
                result.jobs.append(JobRun(job, node, self.folder / f"train-{job}.out"))
        ids = ", ".join(str(j.job_id) for j in result.jobs)
        self.say(f"concurrent_dumps {slots or 'no limit'}, waiting {_waiting(result)}: jobs {ids}")
        limit = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            for job in result.jobs:
                job.read(now)
            if all(j.last_step >= preempt_at for j in result.jobs):
                break
            if now > limit:
                result.note = f"not every job reached step {preempt_at} within {timeout:.0f}s"
                return result
            time.sleep(POLL_S)
        submitted = time.monotonic()
        result.premium_id = self.submit("premium.sh", premium_script(nodes, gpus))
        self.say(f"premium job {result.premium_id} submitted")
        while time.monotonic() < submitted + timeout:
            now = time.monotonic()
            for job in result.jobs:
                job.read(now)
            if result.premium_running_s is None:
                record = self.slurm.job(result.premium_id) or {}
                if record.get("JobState") == "RUNNING":
                    result.premium_running_s = round(now - submitted, 2)
            if result.all_stopped_s is None and all(j.stopped_at for j in result.jobs):
                result.all_stopped_s = round(max(j.stopped_at for j in result.jobs) - submitted, 2)
            if result.premium_running_s is not None and (result.all_stopped_s is not None
                                                         or now - submitted > 3 * timeout / 4):
                break
            time.sleep(POLL_S)
        failures = sorted({j.failure for j in result.jobs if j.failure})
        result.note = "; ".join(failures)
        return result


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--slots", default="0,2/training,2", show_default=True,
              help="The rounds, comma-separated: preemption.concurrent_dumps of each (0: no limit), "
                   "followed by /training where the trees that wait for a slot train on "
                   "(freeze_waiting = false; by default they are frozen).")
@click.option("--nodes", default="n1,n2", show_default=True, help="Nodes whose jobs are preempted.")
@click.option("--jobs-per-node", default=4, show_default=True, help="Basic jobs per node (one GPU each).")
@click.option("--gpus", default=4, show_default=True, help="GPUs per node (the premium job takes them all).")
@click.option("--ballast", default=256, show_default=True, help="MiB of random memory per job.")
@click.option("--steps", default=3000, show_default=True, help="Steps a job would run (it is cancelled).")
@click.option("--sleep", "step_sleep", default=0.1, show_default=True, help="Pause per training step (s).")
@click.option("--preempt-at", default=30, show_default=True, help="Preempt once every job printed this step.")
@click.option("--timeout", default=300.0, show_default=True, help="Seconds a round may take at most.")
@click.option("--user", default="jobuser", show_default=True, help="The job user.")
@click.option("--results-dir", type=click.Path(path_type=Path), default=REPO / "benchmarks" / "results",
              show_default=True, help="Where the report (.md, .json) goes.")
def main(slots: str, nodes: str, jobs_per_node: int, gpus: int, ballast: int, steps: int, step_sleep: float,
         preempt_at: int, timeout: float, user: str, results_dir: Path) -> None:
    """Preempt every job of the dev cluster's nodes at once, for each dump-slot setting, and
    report per job how long its checkpoint waited and whether it made its warn_time."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    slurm = SlurmClient()
    try:
        values = [parse_round(v) for v in slots.split(",")]
    except ValueError as exc:
        raise click.ClickException(f"--slots takes rounds N or N/training (N 0..1024), comma-separated, "
                                   f"not {slots!r}") from exc
    if os.geteuid() != 0:
        raise click.ClickException("run it as root: it edits the configuration and submits as the job user")
    config_file = config_mod.config_path()
    config = config_mod.load()
    prefix = config.paths.prefix
    ctl, python = str(prefix / "venv" / "bin" / "singularityctl"), str(prefix / "venv" / "bin" / "python")
    node_list = [n for n in nodes.split(",") if n]
    try:
        home = Path(pwd.getpwnam(user).pw_dir)
    except KeyError as exc:
        raise click.ClickException(f"no user {user!r}: `singularityctl devcluster up` makes jobuser") from exc
    if any(r.get("JobState") in ("RUNNING", "PENDING") for r in slurm.jobs()):
        raise click.ClickException("the dev cluster has jobs: run this on an idle one")
    original = config_file.read_text()
    meta = {"date": stamp, "host": socket.gethostname(), "cpus": os.cpu_count(), "commit": _git_commit(),
            "nodes": nodes, "jobs per node": jobs_per_node, "ballast": f"{ballast} MiB",
            "warn_time": f"{config.preemption.warn_time}s", "preempt at step": preempt_at}
    signal.signal(signal.SIGTERM, _interrupted)
    owner = pwd.getpwnam(user)
    done: list[Round] = []
    bench: Bench | None = None
    try:
        for index, (value, frozen) in enumerate(values):
            folder = home / f"bench-many-{stamp}" / f"slots-{value}-{index}"
            folder.mkdir(parents=True)
            for path in (folder.parent, folder):
                os.chown(path, owner.pw_uid, owner.pw_gid)
            shutil.copy(REPO / "examples" / "train_reference.py", folder)
            os.chown(folder / "train_reference.py", owner.pw_uid, owner.pw_gid)
            config_file.write_text(set_preemption(original, concurrent_dumps=value, freeze_waiting=frozen))
            bench = Bench(slurm, user, folder, _say)
            try:
                done.append(bench.round(value, frozen, node_list, jobs_per_node, gpus, steps, step_sleep,
                                        ballast, preempt_at, timeout, ctl, python))
            finally:
                bench.cancel_all()
                bench.idle(120)
            _say(json.dumps(summary_row(done[-1], config.preemption.warn_time)))
    except KeyboardInterrupt:
        _say("interrupted")
        sys.exit(130)
    except (SingularityError, CannotStart) as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        config_file.write_text(original)
        if bench is not None:
            bench.cancel_all()
    report = format_report(meta, done, config.preemption.warn_time)
    results_dir.mkdir(parents=True, exist_ok=True)
    md = results_dir / f"preempt_many-{stamp}.md"
    md.write_text(report)
    md.with_suffix(".json").write_text(json.dumps(
        {"meta": {k: str(v) for k, v in meta.items()},
         "rounds": [{**asdict(r), "jobs": [{**asdict(j), "output": str(j.output), "stop_s": j.stop_s()}
                                           for j in r.jobs]} for r in done]}, indent=2) + "\n")
    click.echo(report)
    _say(f"report: {md}")


if __name__ == "__main__":
    main()
