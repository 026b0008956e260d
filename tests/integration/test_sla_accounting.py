"""The SLA accounting and the SLA controller on the real cluster, in one scripted scenario:

- an elastic basic DDP job B (4 ranks, `--nodes=1-2 --gres=gpu:2`) and a standard job S (2 devices)
  run side by side;
- a premium job P1 takes every device for 15 s: Slurm preempts both (checkpointed, requeued);
- a premium job P2 (one whole node) arrives while P1 runs: when P1 leaves, P2 takes one node and S
  and B share the other, B shrunk to 2 devices (2 ranks to a device);
- the controller (running all along, `--actuate`) protects S once the preemption has left it short
  of its floor, reserving its node: a third premium job P3, which could take that node only by
  preempting S, waits instead (cancelled before it runs); when P2 departs the controller grows B
  back to 4 devices (a resize through its node agent); S's reservation goes with S's end;
- a real Prometheus server (Debian's) scrapes the controller's metrics all along.

S prints the time, from its own clock, every 20 ms it runs: the gaps in what it printed are exactly
when it did not run (frozen for a dump, pending after the preemption, being restored). The test
rebuilds S's windows from those lines alone and compares them with what `singularityctl sla` reports.
B's training log must not depend on the sizes it ran at.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import CTL, run_as
from test_distributed import (
    copy_example,
    job_script,
    logged_steps,
    reference_logs,
    wait_for_steps,
    wait_for_text,
)

from singularity_slurm.coordinator import keys
from singularity_slurm.jobenv import expand_hostlist
from singularity_slurm.sla import accounting, policy, reserve, sim
from singularity_slurm.sla.trace import TraceJob
from singularity_slurm.slurmcli import parse_time

pytestmark = pytest.mark.integration

PYTHON = str(Path(CTL).with_name("python"))
CONTROLLER = str(Path(CTL).with_name("singularity-controller"))
PROMETHEUS = "/usr/bin/prometheus"
WINDOW_S = 30  # the windows the fractions are compared in
CONTROLLER_WINDOW_S = 120  # the controller's: a standard job (floor 0.70) may lose 36 s of it
PREEMPTION_COST_S = 20  # so it protects one with less than 20 s of slack left
TICKS = 2400  # about 55 s of running
DDP_ARGS = ["--steps", "320", "--hidden", "64"]

TICK = """import sys, time
for _ in range(int(sys.argv[1])):
    print(f"tick {time.time():.3f}", flush=True)
    time.sleep(0.02)
print("done", flush=True)
"""

STANDARD = f"""#!/bin/bash
#SBATCH --singularity-sla=standard
#SBATCH --gres=gpu:2
#SBATCH -o tick.out
{CTL} run -- {PYTHON} tick.py {TICKS}
"""

EVERYTHING = """#!/bin/bash
#SBATCH --singularity-sla=premium
#SBATCH --nodes=2 --gres=gpu:4
#SBATCH -o everything-%j.out
sleep 15
"""

ONE_NODE = """#!/bin/bash
#SBATCH --singularity-sla=premium
#SBATCH --nodes=1 --gres=gpu:4
#SBATCH -o one-node-%j.out
sleep 600
"""

ANOTHER_NODE = ONE_NODE.replace("one-node-%j", "another-node-%j")

PROMETHEUS_CONFIG = """global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: singularity-controller
    static_configs:
      - targets: ["127.0.0.1:{port}"]
"""


def ticks(text: str) -> list[float]:
    return [float(line.split()[1]) for line in text.splitlines() if line.startswith("tick ")]


def running_spans(times: list[float], gap: float = 0.3, period: float = 0.02) -> list[tuple[float, float]]:
    """When the job ran, from its own ticks: a pause longer than `gap` is a stop."""
    spans: list[tuple[float, float]] = []
    for at in sorted(times):
        if spans and at - spans[-1][1] <= gap:
            spans[-1] = (spans[-1][0], at)
        else:
            spans.append((at, at))
    return [(start, end + period) for start, end in spans]


def fraction(spans: list[tuple[float, float]], start: float, end: float) -> float:
    return sum(max(min(e, end) - max(s, start), 0.0) for s, e in spans) / (end - start)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def poll(what: str, probe, timeout: float = 60):
    """`probe()`'s first true value within `timeout`, or a failure naming `what`."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except OSError as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(0.5)
    pytest.fail(f"{what} never happened; last seen: {str(last)[-3000:]}")


def scraped(port: int, name: str, **labels: str) -> float | None:
    """The value of one series of the controller's metrics endpoint, read as Prometheus reads it."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return None


def prometheus_query(port: int, query: str) -> dict[str, float]:
    """An instant query of the Prometheus server: each series' `action` or `tier` label (or "")
    and its value."""
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=5) as reply:
        answer = json.load(reply)
    assert answer["status"] == "success", answer
    return {r["metric"].get("action") or r["metric"].get("tier") or "": float(r["value"][1])
            for r in answer["data"]["result"]}


def reservations() -> dict[str, reserve.Held]:
    proc = subprocess.run(reserve.LIST_ARGV, capture_output=True, text=True, check=True)
    return reserve.parse(proc.stdout)


def logged(job_id: int) -> list[dict]:
    proc = subprocess.run([CTL, "sla", str(job_id), "--actions", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture
def controller(tmp_path, registry):
    """The SLA controller as a site runs it (acting, serving metrics), and a Prometheus server
    scraping it every second; both ended at the test's end, the controller's log shown on failure.
    The dev cluster's own controller, which only advises, is paused meanwhile (it would hold the
    lease)."""
    from singularity_slurm.devcluster import daemons
    from singularity_slurm.devcluster.cluster import controller_daemon, default_layout

    own = controller_daemon(default_layout())
    assert own.pid() is not None, "the dev cluster runs no SLA controller"
    daemons.stop(own)
    assert registry.redis.get(keys.sla_leader()) is None, "the paused controller kept its lease"
    try:
        yield from _controller(tmp_path)
    finally:
        daemons.start(own)


def _controller(tmp_path):
    metrics_port, prometheus_port = free_port(), free_port()
    log, prom_log = open(tmp_path / "controller.log", "w"), open(tmp_path / "prometheus.log", "w")
    ctl = subprocess.Popen([CONTROLLER, "--period", "2", "--window", str(CONTROLLER_WINDOW_S),
                            "--preemption-cost", str(PREEMPTION_COST_S), "--actuate",
                            "--metrics-port", str(metrics_port)],
                           stdout=log, stderr=subprocess.STDOUT, text=True)
    config = tmp_path / "prometheus.yml"
    config.write_text(PROMETHEUS_CONFIG.format(port=metrics_port))
    data = Path(tempfile.mkdtemp(prefix="prometheus-", dir="/tmp"))
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={data}",
                             f"--web.listen-address=127.0.0.1:{prometheus_port}"],
                            stdout=subprocess.DEVNULL, stderr=prom_log)
    try:
        yield ctl, metrics_port, prometheus_port
    finally:
        for proc in (prom, ctl):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
        for name in reservations():  # a failed test's protections must not close nodes to later tests
            subprocess.run(reserve.argv(reserve.Delete(name), 0), check=False)
        log.close()
        prom_log.close()
        shutil.rmtree(data, ignore_errors=True)
        print("controller log:\n" + (tmp_path / "controller.log").read_text()[-6000:])


def test_controller_protects_the_standard_job_and_grows_the_shrunk_one_and_fractions_match_its_timeline(
        jobs, job_user, registry, config, controller, tmp_path):
    ctl, metrics_port, prometheus_port = controller
    # the undisturbed run B's logs must equal, beside the scenario (it needs no cluster)
    referee = ThreadPoolExecutor(1)
    reference = referee.submit(reference_logs, tmp_path, "train_ddp.py", DDP_ARGS, world=4, per_proxy=1)
    copy_example(jobs, "train_ddp.py")
    jobs.script("tick.py", TICK)

    basic = jobs.submit(jobs.script("basic.sh", job_script(
        "basic", "#SBATCH --nodes=1-2 --gres=gpu:2", 4, f"train_ddp.py {' '.join(DDP_ARGS)} --sleep 0.25")))
    jobs.wait_state(basic, "RUNNING")
    assert jobs.record(basic)["NodeList"] == "n[1-2]"
    standard = jobs.submit(jobs.script("standard.sh", STANDARD))
    tick_log = jobs.wait_for_file("tick.out")
    jobs.wait(standard, lambda r: len(ticks(tick_log.read_text())) >= 600, "600 ticks", timeout=120)
    wait_for_steps(jobs, basic, 4, 20)
    # both at their full size, nothing pending: nothing to decide yet (the controller has looked)
    poll("the controller's look at both jobs", lambda: scraped(
        metrics_port, "singularity_jobs", tier="standard", state="running") == 1)
    assert not logged(standard) and not logged(basic)

    # a premium arrival takes everything; a second one, for a whole node, waits for it
    arrived = time.time()
    everything = jobs.submit(jobs.script("everything.sh", EVERYTHING))
    jobs.wait_state(everything, "RUNNING", timeout=120)
    queued = time.time()
    one_node = jobs.submit(jobs.script("one-node.sh", ONE_NODE))
    jobs.wait_state(everything, "COMPLETED", timeout=120)
    jobs.wait_state(one_node, "RUNNING", timeout=120)

    # the elastic job restarts on the node left, shrunk, at its full world size
    wait_for_text(jobs, basic, "restored distributed checkpoint", 1)
    jobs.wait(standard, lambda r: "restored checkpoint" in tick_log.read_text(), "restored", timeout=120)
    shrunk = [line for line in (jobs.workdir / "job.out").read_text().splitlines()
              if "restored distributed checkpoint" in line]
    assert shrunk[0].endswith("4 ranks on 2 devices of 1 node (2 per device), was 4 ranks on 4 devices of "
                              "2 nodes"), shrunk
    protected = poll("the standard job's protection", lambda: [a for a in logged(standard)
                                                               if a["action"] == "protect"])
    assert protected[0]["time"] > arrived, "protected before it lost anything"
    assert "standard job can lose only" in protected[0]["reason"], protected
    assert str(standard) in registry.redis.smembers(keys.sla_protected())
    assert "its nodes reserved while it runs" in protected[0]["outcome"], protected

    # its node is reserved for root, for a few minutes at a time (a stopped controller's lapse)
    held = poll("the standard job's node reservation", lambda: reservations().get(reserve.name_of(standard)))
    node = jobs.record(standard)["NodeList"]
    assert set(expand_hostlist(held.nodes)) == set(expand_hostlist(node)), (held, node)
    assert time.time() < parse_time(held.end) <= time.time() + 190, held
    # so a premium job that could get that node only by preempting the standard job waits: Slurm
    # tried it at its submission (which is when it preempts) and chose no victim
    chosen = {victim: jobs.record(victim)["PreemptTime"] for victim in (standard, basic)}  # an earlier one
    submitted = time.time()
    another = jobs.submit(jobs.script("another-node.sh", ANOTHER_NODE))
    tried = jobs.wait(another, lambda r: (parse_time(r.get("LastSchedEval")) or 0) >= int(submitted),
                      "looked at by the scheduler")
    assert tried["JobState"] == "PENDING", tried
    for victim, before in chosen.items():
        record = jobs.record(victim)
        assert record["JobState"] == "RUNNING" and record["PreemptTime"] == before, record
    subprocess.run(["scancel", str(another)], check=True)
    jobs.wait_state(another, "CANCELLED", timeout=60)
    assert not [e for e in registry.job(standard)["events"]
                if e["event"] == "checkpoint" and e["time"] > submitted], "preempted while protected"
    assert not logged(basic), "the shrunk job grew while no device was idle"

    # the whole-node premium job departs: the controller grows the elastic job onto its devices
    departed = time.time()
    subprocess.run(["scancel", str(one_node)], check=True)
    wait_for_text(jobs, basic, "restored distributed checkpoint", 2, timeout=180)
    grown = [a for a in logged(basic) if a["action"] == "grow"]
    assert len(grown) == 1 and grown[0]["devices"] == 4 and grown[0]["time"] > departed, grown
    assert grown[0]["outcome"].startswith("resized: checkpoint"), grown
    assert "idle device(s) no pending job can use" in grown[0]["reason"], grown
    restored = [line for line in (jobs.workdir / "job.out").read_text().splitlines()
                if "restored distributed checkpoint" in line]
    assert restored[1].endswith("4 ranks on 4 devices of 1 node, was 4 ranks on 2 devices of 1 node "
                                "(2 per device)"), restored
    shown = subprocess.run([CTL, "sla", "--actions"], capture_output=True, text=True)
    assert f"protect job {standard}: protected" in shown.stdout, shown.stdout
    assert f"grow job {basic} to 4 device(s): resized" in shown.stdout, shown.stdout

    # it trains on at its new size, and what it trained through its sizes is what an undisturbed run
    # trains (its whole run on one size and back is test_distributed's)
    wait_for_steps(jobs, basic, 4, logged_steps(jobs, 4) + 10)
    for rank in range(4):
        text = (jobs.workdir / "logs" / f"{rank}.log").read_text()
        assert reference.result()[rank].startswith(text[:text.rfind("\n") + 1]), f"rank {rank}"
    referee.shutdown()
    jobs.wait(standard, lambda r: "done" in tick_log.read_text(), "done", timeout=300)
    jobs.wait_state(standard, "COMPLETED", timeout=60)
    poll("the ended job's reservation released", lambda: reserve.name_of(standard) not in reservations())

    # the standard job's windows: what `sla` reports against the job's own timeline, within 1%
    proc = run_as("root", [CTL, "sla", str(standard), "--window", str(WINDOW_S), "--json"])
    assert proc.returncode == 0, proc.stderr
    accounted = json.loads(proc.stdout)
    assert accounted["tier"] == "standard" and accounted["ended"] and accounted["requested_devices"] == 2
    spans = running_spans(ticks(tick_log.read_text()))
    # its end in Slurm's accounting is its Epilog's, after its last tick
    compared = [w for w in accounted["windows"] if w["end"] <= spans[-1][1]]
    report = [(round(w["fraction"], 4), round(fraction(spans, w["start"], w["end"]), 4)) for w in compared]
    print(f"windows of {WINDOW_S}s, (sla's fraction, the job's own): {report}; the job ran {spans}")
    assert len(spans) >= 2, spans  # it ran, was preempted, ran again
    assert len(compared) >= 2, accounted["windows"]
    assert all(abs(theirs - ours) <= 0.01 for theirs, ours in report), report
    assert min(ours for _, ours in report) < 0.9, "no window holds the preemption's gap"
    assert any(w["met"] is False for w in accounted["windows"]), "the preemption cost it no window"

    table = run_as("root", [CTL, "sla", "--tier", "standard", "--window", str(WINDOW_S)])
    assert table.returncode == 0 and f"{standard:>8}  {job_user.pw_name}" in table.stdout, table.stdout
    assert "standard: " in table.stdout
    denied = run_as(job_user.pw_name, [CTL, "sla", str(standard)])
    assert denied.returncode == 1
    assert "the SLA accounting is kept in the registry" in denied.stderr
    assert "permission denied" in denied.stderr

    # Prometheus scraped the controller: its decisions and the tiers' attainment are in its store
    decided = poll("Prometheus's series of the controller's decisions", lambda: prometheus_query(
        prometheus_port, "singularity_controller_actions_total"))
    assert decided.get("grow", 0) >= 1 and decided.get("protect", 0) >= 1, decided
    assert prometheus_query(prometheus_port, "max_over_time(singularity_controller_leader[5m])") == {"": 1.0}
    attained = poll("Prometheus's series of the standard tier's attainment", lambda: prometheus_query(
        prometheus_port, "singularity_sla_attainment"))
    assert "standard" in attained and 0 <= attained["standard"] <= 1, attained

    # the simulator, given the scenario's arrivals and the costs the cluster measured, decides the
    # same, in the same order, and delivers the same GPU fractions within 5%: the standard job's
    # over its life until the grow; the elastic job's from its shrunk restart to the grow (before
    # it, the simulator stops a preempted job at once, while on the cluster a multi-node job runs on
    # for the few seconds its launcher's srun takes to reach every node's agent)
    records = {name: registry.job(job_id) for name, job_id in
               (("B", basic), ("S", standard), ("P1", everything), ("P2", one_node))}
    cluster = cluster_timeline(records, logged(standard), logged(basic))
    replay = replay_in_simulator(records, queued, 4 // config.elastic.max_ranks_per_device, grown[0]["time"])
    print(f"the cluster's timeline: {cluster}\nthe simulator's: {replay.timeline}")
    for name, timeline in (("cluster", cluster), ("simulator", replay.timeline)):
        assert in_order(timeline) == [], f"the {name}'s events out of the scenario's order: {timeline}"
    t0, horizon = origin(records), grown[0]["time"]
    for name, requested, start in (("S", 2, first_run(records["S"])), ("B", 4, records["P1"]["ended_at"])):
        theirs = accounting.delivered(accounting.segments_from_events(records[name]["events"], requested),
                                      requested, start, horizon) / (horizon - start)
        ours = accounting.delivered(replay.jobs[name].segments, requested, start - t0, horizon - t0) \
            / (horizon - start)
        print(f"{name}'s GPU fraction from {start - t0:.1f}s until the grow at {horizon - t0:.1f}s: the "
              f"cluster's {theirs:.3f}, the simulator's {ours:.3f}")
        assert abs(theirs - ours) <= 0.05, (name, theirs, ours)

    # one controller decides at a time: a second one waits for the first's lease
    second = subprocess.run([CONTROLLER, "--once"], capture_output=True, text=True, timeout=60)
    assert second.returncode == 1 and "holds the lease; not deciding" in second.stderr, second.stderr
    ctl.send_signal(signal.SIGTERM)
    ctl.wait(timeout=60)
    assert registry.redis.get(keys.sla_leader()) is None  # released at its end
    registry.redis.srem(keys.sla_protected(), standard)


# --- the same scenario in the simulator -----------------------------------------------------------

FIRST = {("start", "B"), ("start", "S")}
"""The two jobs' first starts, before all of the scenario."""

SCENARIO = [{("preempt", "S"), ("preempt", "B")}, {("start", "P1")}, {("end", "P1")},
            {("start", "P2"), ("restart", "S"), ("restart", "B"), ("protect", "S")}, {("end", "P2")},
            {("grow", "B")}]
"""The scenario's events in the order both the cluster and the simulator must see them (those of
one set in any order): the preemption, the premium jobs' runs, both jobs' restarts and the standard
job's protection once it holds devices again (Slurm runs it from its allocation, a moment before
its Prolog records the start), the departure, the grow."""


def first_run(record: dict) -> float:
    """When the job first ran: its tree (a `singularityctl run` job), or its batch script."""
    running = [e["time"] for e in record["events"] if e["event"] == "running"]
    return min(running or [e["time"] for e in record["events"] if e["event"] == "node_start"])


def origin(records: dict[str, dict]) -> float:
    """The scenario's time 0: when the first of the two jobs first ran."""
    return min(first_run(records["B"]), first_run(records["S"]))


def _starts(record: dict) -> dict[int, tuple[float, int]]:
    """Each start of the job (its restart count): when, and on how many devices in all."""
    starts: dict[int, tuple[float, int]] = {}
    for e in record["events"]:
        if e["event"] == "node_start":
            count = e.get("restart_count", 0)
            at, devices = starts.get(count, (e["time"], 0))
            starts[count] = (min(at, e["time"]), devices + (e.get("gpus") or 0))
    return starts


def cluster_timeline(records: dict[str, dict], standard_actions: list[dict],
                     basic_actions: list[dict]) -> list[tuple[float, str, str, int]]:
    """The scenario's events on the cluster, from the registry and the controller's log, as the
    simulator's timeline writes them."""
    out = []
    for name, record in records.items():
        for count, (at, devices) in sorted(_starts(record).items()):
            out.append((at, "restart" if count else "start", name, devices))
        out.append((record["ended_at"], "end", name, 0))
        preempted = [e["time"] for e in record["events"] if e["event"] == "checkpoint"
                     and e["reason"] == "preempt"]
        if preempted:
            out.append((min(preempted), "preempt", name, 0))
    for name, logged_actions in (("S", standard_actions), ("B", basic_actions)):
        out += [(a["time"], a["action"], name, a.get("devices", 0)) for a in logged_actions]
    return sorted(out)


def in_order(timeline: list[tuple[float, str, str, int]]) -> list[str]:
    """What in `timeline` breaks SCENARIO's order: an event missing, one of a later set before one of
    an earlier set, or one that is not the scenario's before the grow. The first starts of the two
    jobs come before all; jobs' ends, and the premium jobs' own protection, are not looked at."""
    when: dict[tuple[str, str], float] = {}
    for at, what, name, _ in timeline:
        when.setdefault((what, name), at)
    wrong = [f"{event} never happened" for step in [*SCENARIO, FIRST] for event in step if event not in when]
    for earlier, later in zip([FIRST, *SCENARIO], SCENARIO, strict=False):
        for a in earlier:
            for b in later:
                if a in when and b in when and when[a] > when[b]:
                    wrong.append(f"{b} at {when[b]:.1f} before {a} at {when[a]:.1f}")
    scenario = set().union(FIRST, *SCENARIO)
    grow = when.get(("grow", "B"), float("inf"))
    extra = [(what, name) for at, what, name, _ in timeline if at <= grow and (what, name) not in scenario
             and what not in ("start", "end") and not (what == "protect" and name.startswith("P"))]
    return wrong + [f"{event} is not the scenario's" for event in extra]


def replay_in_simulator(records: dict[str, dict], queued: float, min_basic: int,
                        decided_at: float) -> sim.Simulation:
    """The scenario as a trace, with the cluster's measured costs: the first premium job arrives when
    Slurm's preemption reached the first of its victims (their first checkpoint began), the second
    when the test submitted it, and both hold their devices as long as they did on the cluster from
    when the devices they waited for were free (the first: its victims' release; the second: the
    first's end), Slurm's delay in starting them included; the two jobs start
    when they first ran, the standard one runs as long as it did, the elastic one longer than the
    scenario; each checkpoints in the time from that arrival to its devices' release, and restores
    in the time from the first premium job's end to its running again. The same controller: a 2 s
    period, deciding in step with the cluster's (one of its decisions was at `decided_at`: a
    decision up to a period later would move the grow, and with it the fractions, by as much), a
    120 s window, a 20 s preemption cost."""
    t0 = origin(records)
    end_p1 = records["P1"]["ended_at"]
    arrived = min(e["time"] - e["seconds"] for name in ("S", "B") for e in records[name]["events"]
                  if e["event"] == "checkpoint" and e["reason"] == "preempt")

    def costs(record: dict) -> dict[str, float]:
        released = max(e["time"] for e in record["events"] if e["event"] == "node_end"
                       and arrived < e["time"] < end_p1)
        resumed = min(e["time"] for e in record["events"] if e["event"] == "running" and e["time"] > end_p1)
        return {"checkpoint_s": released - arrived, "restore_s": resumed - end_p1}

    released = max(e["time"] for name in ("S", "B") for e in records[name]["events"]
                   if e["event"] == "node_end" and arrived < e["time"] < end_p1)
    standard_work = sum(s.end - s.start for s in accounting.segments_from_events(records["S"]["events"], 2))
    standard_at, basic_at = first_run(records["S"]) - t0, first_run(records["B"]) - t0
    trace = [TraceJob("B", basic_at, 10_000.0, 4, "basic", min_basic, **costs(records["B"])),
             TraceJob("S", standard_at, standard_work, 2, "standard", 2, **costs(records["S"])),
             TraceJob("P1", arrived - t0, end_p1 - released, 8, "premium", 8),
             TraceJob("P2", queued - t0, records["P2"]["ended_at"] - end_p1, 4, "premium", 4)]
    replay = sim.Simulation(trace, sim.SimParams(nodes=2, gpus_per_node=4, mode="controller",
                                                 window_s=CONTROLLER_WINDOW_S, controller_period_s=2.0,
                                                 controller_start_s=(decided_at - t0) % 2.0),
                            policy.Params(preemption_cost_s=PREEMPTION_COST_S))
    replay.run()
    replay.timeline = [(t + t0, what, name, devices) for t, what, name, devices in replay.timeline]
    seen: set[str] = set()
    for i, (t, what, name, devices) in enumerate(replay.timeline):
        if what == "start":
            replay.timeline[i] = (t, "restart" if name in seen else "start", name, devices)
            seen.add(name)
    return replay
