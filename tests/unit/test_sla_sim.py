"""The fleet simulator: small scenarios worked by hand, and the command line (sla.sim)."""

from __future__ import annotations

import json

import pytest

from singularity_slurm.sla import policy, sim, synth, trace
from singularity_slurm.sla.trace import TraceJob


def params(mode: str, **more) -> sim.SimParams:
    return sim.SimParams(**{"nodes": 1, "gpus_per_node": 8, "mode": mode, "checkpoint_s": 30.0,
                            "restore_s": 60.0, "app_checkpoint_s": 3600.0, **more})


PREEMPTED = [TraceJob("basic", 0.0, 7200.0, 8, "basic", 8),
             TraceJob("premium", 4000.0, 1000.0, 8, "premium", 8)]


def run(jobs, mode: str, **more) -> sim.Simulation:
    simulation = sim.Simulation(jobs, params(mode, **more))
    simulation.outcome = simulation.run()
    # devices are conserved: every one is idle again once every job has ended
    assert (simulation.free, simulation.coming) == (simulation.params.devices, 0)
    return simulation


def test_natively_a_preempted_job_loses_its_work_since_its_own_last_checkpoint() -> None:
    s = run(PREEMPTED, "native")
    basic, premium = s.jobs["basic"], s.jobs["premium"]
    assert premium.finished == 5000.0  # the basic job's devices are free at once
    assert basic.lost == pytest.approx(400.0)  # 4000 s run, its checkpoint at 3600 s
    assert basic.finished == pytest.approx(5000.0 + 60.0 + 3600.0)
    assert s.outcome.lost_device_s == pytest.approx(400.0 * 8) and s.outcome.preemptions == 1


def test_with_singularity_the_preempted_job_checkpoints_and_loses_nothing() -> None:
    s = run(PREEMPTED, "singularity")
    basic, premium = s.jobs["basic"], s.jobs["premium"]
    assert premium.finished == 4030.0 + 1000.0  # it waits for the 30 s checkpoint
    assert basic.lost == 0.0
    assert basic.finished == pytest.approx(5030.0 + 60.0 + 3200.0)
    # the premium job waited 30 s of its 1030: 0.971 of its only window, above its 0.95
    assert s.outcome.attainment["premium"] == 1.0
    assert s.outcome.mean_fraction["premium"] == pytest.approx(1000 / 1030, abs=1e-4)


def test_a_job_s_own_costs_replace_the_simulation_s_and_the_timeline_says_what_happened() -> None:
    jobs = [TraceJob("basic", 0.0, 7200.0, 8, "basic", 8, checkpoint_s=5.0, restore_s=7.0),
            TraceJob("premium", 4000.0, 1000.0, 8, "premium", 8)]
    s = run(jobs, "singularity")
    assert s.jobs["premium"].finished == 4005.0 + 1000.0
    assert s.jobs["basic"].finished == pytest.approx(5005.0 + 7.0 + 3200.0)
    assert s.timeline == [(0.0, "start", "basic", 8), (4000.0, "preempt", "basic", 0),
                          (4005.0, "start", "premium", 8), (5005.0, "end", "premium", 0),
                          (5005.0, "start", "basic", 8), (pytest.approx(8212.0), "end", "basic", 0)]


def test_the_controller_shrinks_an_elastic_job_instead_and_grows_it_back_when_the_devices_free() -> None:
    jobs = [TraceJob("basic", 0.0, 7200.0, 8, "basic", 2),
            TraceJob("premium", 4000.0, 1000.0, 4, "premium", 4)]
    s = run(jobs, "controller", controller_period_s=60.0)
    basic, premium = s.jobs["basic"], s.jobs["premium"]
    assert basic.preemptions == 0 and basic.resizes == 2  # shrunk to 4, grown back to 8
    assert premium.finished == 4030.0 + 1000.0
    shrink, grow = [a for _, a in s.actions if isinstance(a, policy.Shrink | policy.Grow)]
    assert (shrink, grow) == (policy.Shrink("basic", 4, ""), policy.Grow("basic", 8, ""))
    grown_at = next(t for t, a in s.actions if a == grow)
    assert 5030.0 <= grown_at <= 5030.0 + 60.0  # at the controller's first look after the premium end
    assert [(what, job, devices) for _, what, job, devices in s.timeline] == [
        ("start", "basic", 8), ("shrink", "basic", 4), ("start", "premium", 4), ("end", "premium", 0),
        ("grow", "basic", 8), ("end", "basic", 0)]
    # 4000 s at full size, 30 s checkpoint + 60 s restore at 0, 4 of 8 until the grow, 90 s at 0,
    # then full size for the rest
    half = grown_at - 4090.0
    assert basic.finished == pytest.approx(grown_at + 90.0 + (7200.0 - 4000.0 - half / 2))


def test_a_job_larger_than_the_cluster_is_refused() -> None:
    with pytest.raises(trace.TraceError, match="asks for 16 devices; the cluster has 8"):
        sim.Simulation([TraceJob("big", 0.0, 10.0, 16, "basic", 16)], params("native"))


@pytest.mark.parametrize("mode", sim.MODES)
def test_a_busy_synthetic_fleet_ends_every_job_with_every_device_accounted(mode: str) -> None:
    jobs = synth.generate(400, 32, load=1.3, seed=7)
    s = run(jobs, mode, nodes=4)
    assert all(j.finished is not None for j in s.jobs.values())
    assert 0.5 < s.outcome.utilization <= 1.0 and 0 < s.outcome.goodput <= s.outcome.utilization + 1e-9
    assert s.outcome.preemptions > 0


def test_the_same_trace_side_by_side_keeps_work_that_native_preemption_loses() -> None:
    jobs = synth.generate(400, 32, load=1.3, seed=7)
    native, singularity, controller = sim.compare(jobs, params("native", nodes=4))
    assert native.lost_device_s > 0 and singularity.lost_device_s == controller.lost_device_s == 0
    assert singularity.goodput > native.goodput
    assert controller.resizes > 0
    assert "| native |" in sim.table([native, singularity, controller])


def test_the_command_line_reads_a_trace_and_prints_a_table_or_json(tmp_path, capsys) -> None:
    path = tmp_path / "t.csv"
    path.write_text(trace.write(PREEMPTED))
    assert sim.main([str(path), "--nodes", "1", "--gpus-per-node", "8"]) == 0
    assert "| singularity |" in capsys.readouterr().out
    assert sim.main([str(path), "--nodes", "1", "--mode", "native", "--json"]) == 0
    [outcome] = json.loads(capsys.readouterr().out)
    assert outcome["mode"] == "native" and outcome["lost_device_s"] == pytest.approx(3200.0)


def test_the_command_line_names_the_bad_line_of_a_trace_and_fails(tmp_path, capsys) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("job_id,submit_s,duration_s,gpus,tier\na,0,10,1,basic\nb,5,10,1,gold\n")
    assert sim.main([str(path)]) == 2
    assert f"singularity-sim: {path}:3: unknown tier 'gold'" in capsys.readouterr().err
    assert sim.main([str(tmp_path / "missing.csv")]) == 2
    assert "cannot read the trace" in capsys.readouterr().err


def test_the_command_line_simulates_writes_and_draws_a_synthetic_trace(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    out, figure = tmp_path / "trace.csv", tmp_path / "plot.png"
    argv = ["--synthetic", "50", "--nodes", "2", "--write-trace", str(out), "--plot", str(figure)]
    assert sim.main(argv) == 0
    assert len(trace.parse(out.read_text())) == 50
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "synthetic trace (50 jobs" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--synthetic", "0"], "--synthetic needs at least 1 job"),
    (["--synthetic", "5", "--window-s", "0"], "--window-s must be a positive number"),
    (["--synthetic", "5", "--tier-shares", "gold=1"], "unknown tier 'gold'"),
    (["--synthetic", "5", "--load", "-1"], "--load must be a positive number"),
])
def test_bad_options_are_refused_saying_which(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        sim.main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def run_nodes(jobs, mode: str, **more) -> sim.Simulation:
    s = run(jobs, mode, placement="nodes", **more)
    assert s.node_free == [s.params.gpus_per_node] * s.params.nodes and s.node_coming == [0] * s.params.nodes
    return s


@pytest.mark.parametrize("mode", ["native", "singularity"])
def test_on_one_node_placement_by_node_changes_nothing(mode: str) -> None:
    pooled, by_node = run(PREEMPTED, mode).outcome, run_nodes(PREEMPTED, mode).outcome
    assert {**vars(pooled), "sim_seconds": 0} == {**vars(by_node), "sim_seconds": 0}


# two nodes of 4: a and b packed on n0, c and d on n1; b and c end, leaving 2 idle on each node
FRAGMENTED = [TraceJob("a", 0.0, 10000.0, 2, "basic", 2), TraceJob("b", 0.0, 1000.0, 2, "basic", 2),
              TraceJob("c", 0.0, 1000.0, 2, "basic", 2), TraceJob("d", 0.0, 10000.0, 2, "basic", 2),
              TraceJob("e", 2000.0, 1000.0, 4, "basic", 4)]


def test_a_job_that_fits_by_count_but_not_by_node_waits_and_the_controller_migrates_room_for_it() -> None:
    waits = run_nodes(FRAGMENTED, "singularity", nodes=2, gpus_per_node=4)
    assert [e for e in waits.timeline if e[2] == "e"][0] == (10000.0, "start", "e", 4)
    moved = run_nodes(FRAGMENTED, "controller", nodes=2, gpus_per_node=4)
    # the first look after e's arrival (every 60 s) moves a off n0; a's checkpoint takes 30 s
    assert (2040.0, "migrate", "a", 0) in moved.timeline
    assert moved.jobs["e"].started_at == 2070.0 and moved.jobs["e"].finished == 3070.0
    assert moved.jobs["a"].where == {} and 0 in moved.jobs["a"].excluded
    assert moved.outcome.migrations == 1 and moved.outcome.preemptions == 0
    migrate = [a for _, a in moved.actions if isinstance(a, policy.Migrate)]
    assert migrate == [policy.Migrate("a", "n0", "")]
    # a restarts on n1 beside d, its restore paid: it ends 30 + 60 s later than undisturbed
    assert moved.jobs["a"].finished == pytest.approx(10000.0 + 90.0)
    assert waits.outcome.completion_s["basic"]["mean"] > moved.outcome.completion_s["basic"]["mean"]


def test_preemption_by_node_takes_the_jobs_that_free_a_node_with_the_fewest_devices() -> None:
    jobs = [TraceJob("x", 0.0, 9000.0, 4, "basic", 4), TraceJob("y", 0.0, 9000.0, 2, "basic", 2),
            TraceJob("p", 100.0, 1000.0, 4, "premium", 4)]
    s = run_nodes(jobs, "singularity", nodes=2, gpus_per_node=4)
    assert [e for e in s.timeline if e[1] == "preempt"] == [(100.0, "preempt", "y", 0)]
    assert s.jobs["p"].started_at == 130.0  # y's checkpoint freed n1's other two devices
    pooled = run(jobs, "singularity", nodes=2, gpus_per_node=4)
    assert [e for e in pooled.timeline if e[1] == "preempt"] == [(100.0, "preempt", "x", 0)]


def test_a_large_job_spreads_evenly_over_as_few_nodes_as_hold_it() -> None:
    s = sim.Simulation([TraceJob("w", 0.0, 10.0, 12, "basic", 12)], params("singularity", nodes=3,
                                                                            placement="nodes"))
    assert s._shares(12) == [6, 6] and s._shares(17) == [6, 6, 5] and s._shares(3) == [3]
    s.run()
    assert s.timeline[0] == (0.0, "start", "w", 12)
    with pytest.raises(ValueError, match="unknown placement"):
        sim.Simulation([], params("singularity", placement="racks"))
