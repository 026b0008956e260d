"""The launcher decides on the agent's error kinds, never on its messages' words."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from singularity_slurm import rpc
from singularity_slurm.config import parse
from singularity_slurm.errors import NoCheckpoint
from singularity_slurm.slurm_plugin import lifecycle
from singularity_slurm.slurm_plugin.launcher import Launcher, LaunchError
from singularity_slurm.slurm_plugin.lifecycle import Requeue, StartFailed

JOB, NODE = 31, "n4"


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Callable[[rpc.Handler, rpc.Limits | None], Launcher]]:
    servers: list[rpc.Server] = []

    def start(handler: rpc.Handler, limits: rpc.Limits | None = None) -> Launcher:
        config = parse({"paths": {"state_dir": str(tmp_path)}})
        run_dir = tmp_path / NODE / str(JOB)
        run_dir.mkdir(parents=True, exist_ok=True)
        servers.append(rpc.Server(run_dir / "agent.sock", handler, name="the node agent",
                                  limits=limits).start())
        said: list[str] = []
        env = {"SLURM_JOB_ID": str(JOB), "SLURMD_NODENAME": NODE, "SLURM_RESTART_COUNT": "1"}
        launcher = Launcher(config, env, say=said.append)
        launcher.said = said  # type: ignore[attr-defined]
        return launcher

    yield start
    for server in servers:
        server.close()


def refuse(exc: Exception) -> rpc.Handler:
    def handler(request: dict, call: rpc.Call) -> dict:
        raise exc
    return handler


def test_a_restore_answered_no_checkpoint_starts_from_the_beginning(agent) -> None:
    def no_checkpoint(request: dict, call: rpc.Call) -> dict:
        try:
            raise NoCheckpoint("nothing committed")
        except NoCheckpoint as exc:  # as the engine does: its own words, the store's error as cause
            raise rpc.RequestError(f"job {JOB} has nothing to restore: {exc}") from exc

    launcher = agent(no_checkpoint)

    assert launcher.restore() is False
    assert launcher.said[-1].endswith("no committed checkpoint: starting from the beginning")


def test_a_restore_refused_otherwise_is_an_error_even_if_its_words_mention_no_checkpoint(agent) -> None:
    launcher = agent(refuse(rpc.Failed("criu failed: no committed checkpoint was harmed")))

    with pytest.raises(LaunchError) as caught:
        launcher.restore()
    assert caught.value.kind == "failed"


def test_a_restore_onto_gpus_that_cannot_take_the_checkpoint_requeues_away_from_the_node(agent) -> None:
    launcher = agent(refuse(rpc.WrongDevices("checkpoint 3 holds GPU state that the GPUs of n4 cannot take")))

    launcher._launch(["python", "train.py"], resume=True)  # never starts the command from the beginning

    event = launcher.events.get_nowait()
    assert event == StartFailed("restore: checkpoint 3 holds GPU state that the GPUs of n4 cannot take",
                                wrong_devices=(NODE,))
    assert lifecycle.step(lifecycle.State(), event)[1][-1] == Requeue((NODE,), keep_excluded=True)


def test_a_missing_agent_is_an_unreachable_launch_error(agent, tmp_path: Path) -> None:
    launcher = agent(refuse(rpc.Failed("x")))
    launcher.socket = tmp_path / "absent.sock"

    with pytest.raises(LaunchError) as caught:
        launcher.agent({"op": "status"})
    assert caught.value.kind == "unreachable"
    assert "is the Prolog configured" in str(caught.value)


def test_a_busy_agent_is_retried_until_a_slot_frees(agent) -> None:
    release, holding = threading.Event(), threading.Event()

    def hold(request: dict, call: rpc.Call) -> dict:
        if request["op"] == "wait":
            holding.set()
            release.wait(10)
        return {"ok": True, "op": request["op"]}

    launcher = agent(hold, rpc.Limits(max_connections=1, root_reserve=0))
    waiter = threading.Thread(target=launcher.agent, args=({"op": "wait"},))
    waiter.start()
    assert holding.wait(10)  # the one slot is taken
    threading.Timer(0.5, release.set).start()

    assert launcher.agent({"op": "status"})["op"] == "status"
    waiter.join(10)


def test_a_resize_is_refused_before_anything_stops_where_the_job_cannot_take_it(agent) -> None:
    from singularity_slurm.slurm_plugin import lifecycle

    launcher = agent(refuse(AssertionError("the agent is not asked")))
    event = launcher.command_event({"op": "resize", "id": "r1", "nodes": [1, 1], "gpus_per_node": None})
    assert event.refused is not None and event.refused.startswith("resize: this job is not distributed")

    launcher.world_size, launcher.devices_per_node = 4, 2
    launcher.placement = {0: "n4/gpu0", 1: "n4/gpu1", 2: "n5/gpu0", 3: "n5/gpu1"}
    assert launcher.command_event({"op": "resize", "id": "r2", "nodes": [1, 1], "gpus_per_node": None}) == (
        lifecycle.Command("resize", (), "r2", resize=lifecycle.Resize((1, 1), None)))
    refused = launcher.command_event({"op": "resize", "id": "r3", "nodes": [1, 1], "gpus_per_node": 1})
    assert refused.refused is None  # 4 ranks on one device: the default bound is 4
    launcher.config = parse({"elastic": {"max_ranks_per_device": 2}})
    refused = launcher.command_event({"op": "resize", "id": "r4", "nodes": None, "gpus_per_node": 1})
    assert refused.refused == (
        "resize to 1 device per node: 4 ranks on 1 device would put 4 ranks on one device, more than "
        "[elastic] max_ranks_per_device = 2: give the job at least 2 devices")


def test_every_line_the_launcher_prints_starts_with_its_mark(agent) -> None:
    launcher = agent(refuse(AssertionError("the agent is not asked")))
    launcher.say("periodic checkpoint failed: criu dump failed\n(00.05) Error (criu/seize.c:882): Zombies\n")

    assert launcher.said == [
        "[singularity] job 31 on n4: periodic checkpoint failed: criu dump failed",
        "[singularity] job 31 on n4:   (00.05) Error (criu/seize.c:882): Zombies"]
